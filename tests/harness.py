"""The CPU tests' harness: tests/cpu_engine.py (vLLM's configs, KV cache specs and Scheduler
on a machine without a GPU).

cpu_engine makes vLLM's CpuPlatform the process's platform, which would break the GPU
engines of tests run in the same process; so where torch sees a CUDA GPU, importing this
module skips the test module that imports it (a module-level skip, reported with the reason)
and switches nothing. Run those tests on a CPU machine, or with ``CUDA_VISIBLE_DEVICES=``.
"""

import contextlib

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip(
        "runs on vLLM's CpuPlatform (tests/harness.py), which would replace the GPU's platform "
        "in this process; run it with CUDA_VISIBLE_DEVICES= or on a CPU machine",
        allow_module_level=True,
    )

from cpu_engine import *  # noqa: E402, F403
from cpu_engine import _init_dist  # noqa: E402, F401


def serve_parser():
    """vLLM's own ``vllm serve`` argument parser (its module moved in 0.33.0)."""
    try:
        from vllm.entrypoints.common.cli_args import make_arg_parser  # 0.33.0
    except ImportError:
        from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))


def runner_step(connector, scheduler_output, vllm_config, forward=None):
    """One step of the worker side, driven as vLLM's model runner drives a KV connector: the
    runner's own connector hooks bind the step's metadata and run around ``forward()`` (the
    model's forward pass, where our runner patch hands over the rows) in the release's own
    order. Up to 0.33.0 that is the V1 runner's ``KVConnectorModelRunnerMixin`` (from 0.29.0
    ``start_load_kv`` comes only after the forward); from 0.34.0, which has no V1 runner,
    Model Runner V2's ``ActiveKVConnector``. A step without scheduled tokens takes vLLM's
    no-forward path, as the runner does. ``connector`` is the process's KV transfer group for
    the step."""
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.forward_context import set_forward_context

    saved, kv_transfer_state._KV_CONNECTOR_AGENT = kv_transfer_state._KV_CONNECTOR_AGENT, connector
    try:
        try:
            from vllm.v1.worker.kv_connector_model_runner_mixin import (
                KVConnectorModelRunnerMixin as M,
            )
        except ImportError:  # vLLM 0.34.0: Model Runner V2 only
            return _v2_connector_step(scheduler_output, vllm_config, forward)
        if not scheduler_output.total_num_scheduled_tokens:
            return M.kv_connector_no_forward(scheduler_output, vllm_config)
        with (
            set_forward_context(None, vllm_config),
            M.maybe_get_kv_connector_output(scheduler_output),
        ):
            return forward()
    finally:
        kv_transfer_state._KV_CONNECTOR_AGENT = saved


def _v2_connector_step(scheduler_output, vllm_config, forward):
    """Model Runner V2's connector hooks around one step, in ``execute_model`` and
    ``sample_tokens``' order (the active KV transfer group is the connector)."""
    from vllm.forward_context import set_forward_context
    from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector

    kv = ActiveKVConnector(vllm_config, {})
    if not scheduler_output.total_num_scheduled_tokens:
        return kv.no_forward(scheduler_output)
    kv.pre_forward(scheduler_output)
    with set_forward_context(None, vllm_config):
        result = forward()
    kv.finish_forward()
    kv.post_forward(scheduler_output.finished_req_ids)
    return result


def model_runner_output(req_ids, sampled_token_ids):
    """vLLM's own ModelRunnerOutput for a step (0.34.0 dropped ``req_id_to_index``)."""
    import dataclasses

    from vllm.v1.outputs import ModelRunnerOutput

    kw = dict(req_ids=list(req_ids), sampled_token_ids=sampled_token_ids)
    if "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}:
        kw["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
    return ModelRunnerOutput(**kw)


def scheduler_output(metadata, num_scheduled_tokens=(), finished_req_ids=()):
    """vLLM's own (empty) SchedulerOutput carrying a connector's metadata, for a worker-side
    step without a Scheduler."""
    from vllm.v1.core.sched.output import SchedulerOutput

    so = SchedulerOutput.make_empty()
    so.kv_connector_metadata = metadata
    so.num_scheduled_tokens = dict(num_scheduled_tokens)
    so.total_num_scheduled_tokens = sum(so.num_scheduled_tokens.values())
    so.finished_req_ids = set(finished_req_ids)
    return so


def v2_input_batch(sched, positions, pad=0):
    """vLLM's own Model Runner V2 ``InputBatch`` for a schedule ``[(req_id, start, count)]`` in
    batch order, with ``pad`` padding tokens after the scheduled ones (as CUDA graphs pad)."""
    import dataclasses

    import numpy as np
    from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers

    num_tokens = sum(n for _, _, n in sched)
    buffers = InputBuffers(
        max_num_reqs=max(8, len(sched)),
        max_num_tokens=max(64, num_tokens + pad),
        device=torch.device("cpu"),
    )
    batch = InputBatch.make_dummy(len(sched), num_tokens + pad, buffers)
    batch.positions[:] = positions
    qsl = np.array([0, *np.cumsum([n for _, _, n in sched])], dtype=np.int32)
    return dataclasses.replace(
        batch, req_ids=[r for r, _, _ in sched], num_tokens=num_tokens, query_start_loc_np=qsl
    )


def v2_forward_state(batch, aux):
    """What V2's forward pass leaves for ``sample_tokens`` (``execute_model_state``): the batch
    and the model's aux hidden states, one tensor per layer (ascending); nothing else."""
    from vllm.v1.worker.gpu.model_runner import ExecuteModelState

    state = dict.fromkeys(ExecuteModelState._fields)
    state.update(input_batch=batch, hidden_states=aux[-1], aux_hidden_states=aux)
    state.update(finished_req_ids=set(), num_spec_tokens_to_schedule=0)
    return ExecuteModelState(**state)


def schedule_positions(sched, pad=0):
    """The token positions of a schedule ``[(req_id, start, count)]`` in batch order, then
    ``pad`` zeros (padding tokens, as CUDA graphs pad)."""
    return torch.cat(
        [torch.arange(s, s + n) for _, s, n in sched] + [torch.zeros(pad, dtype=torch.long)]
    )


class V1Runner:
    """vLLM's own V1 ``GPUModelRunner`` with the plugin's patch: its patched ``_model_forward``
    runs inside vLLM's own ``KVConnectorModelRunnerMixin`` hooks (:func:`runner_step`), and
    hands the rows to the process's KV transfer group through the hook, as on the GPU. The
    one fake is the GPU's model, which returns the step's aux hidden states (one tensor per
    layer, ascending), padding rows included. ``connector`` is the worker-side connector."""

    def __init__(self, connector, vllm_config):
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        from vllm_gdn_hs.patch.extraction import set_up_extraction  # the patched __init__'s

        self.connector, self.vllm_config = connector, vllm_config
        self.runner = object.__new__(GPUModelRunner)
        set_up_extraction(self.runner, vllm_config)

    def step(self, scheduler_output, sched, aux, pad=0):
        """One step: ``sched`` as for :func:`v2_input_batch`; ``aux`` the model's aux hidden
        states, one tensor per layer (ascending), a row per scheduled token plus ``pad``."""
        from types import SimpleNamespace

        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        def model(input_ids, positions, intermediate_tensors, inputs_embeds):  # the GPU's
            return aux[-1], aux

        counts = torch.tensor([0, *(n for _, _, n in sched)], dtype=torch.int32)
        self.runner.model = model
        self.runner.input_batch = SimpleNamespace(
            req_ids=[r for r, _, _ in sched], num_reqs=len(sched)
        )
        self.runner.query_start_loc = SimpleNamespace(cpu=counts.cumsum(0).to(torch.int32))
        positions = schedule_positions(sched, pad)
        return runner_step(
            self.connector,
            scheduler_output,
            self.vllm_config,
            lambda: GPUModelRunner._model_forward(self.runner, input_ids=None, positions=positions),
        )


class V2Runner:
    """vLLM's own Model Runner V2 ``GPUModelRunner`` with the plugin's patch, stepped between
    the hooks of vLLM's own V2 ``ActiveKVConnector`` in the order ``execute_model`` and
    ``sample_tokens`` keep. The one fake is the GPU's forward pass, which leaves the step's
    aux hidden states in ``execute_model_state`` as V2's does. ``connector`` is the worker-side
    connector, the process's KV transfer group during each step."""

    def __init__(self, connector, vllm_config):
        from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner

        from vllm_gdn_hs.patch import patch_worker_gpu_model_runner_v2
        from vllm_gdn_hs.patch.extraction import set_up_extraction  # the patched __init__'s

        self.patch = patch_worker_gpu_model_runner_v2
        self.connector = connector
        with self.agent():
            self.kv = ActiveKVConnector(vllm_config, {})
        self.runner = object.__new__(GPUModelRunner)
        set_up_extraction(self.runner, vllm_config)

    @contextlib.contextmanager
    def agent(self):
        from vllm.distributed.kv_transfer import kv_transfer_state

        saved, kv_transfer_state._KV_CONNECTOR_AGENT = (
            kv_transfer_state._KV_CONNECTOR_AGENT,
            self.connector,
        )
        try:
            yield
        finally:
            kv_transfer_state._KV_CONNECTOR_AGENT = saved

    def step(self, scheduler_output, sched, aux, pad=0):
        """One step: ``sched`` as for ``v2_input_batch``; ``aux`` the model's aux hidden
        states, one tensor per layer (ascending), a row per scheduled token plus ``pad``."""
        from unittest import mock

        from vllm.v1.worker.gpu.model_runner import GPUModelRunner

        with self.agent():
            if not scheduler_output.total_num_scheduled_tokens:
                return self.kv.no_forward(scheduler_output)
            batch = v2_input_batch(sched, schedule_positions(sched, pad), pad)

            def forward(runner, *args, **kwargs):  # the edge: V2's forward pass on the GPU
                runner.execute_model_state = v2_forward_state(batch, aux)

            with mock.patch.object(self.patch, "_orig_execute_model", forward):
                self.kv.pre_forward(scheduler_output, batch)
                GPUModelRunner.execute_model(self.runner, scheduler_output, None)
                self.kv.finish_forward()
                return self.kv.post_forward(scheduler_output.finished_req_ids)
