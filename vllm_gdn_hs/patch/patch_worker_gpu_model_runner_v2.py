"""Hand the aux hidden states to the connector after every forward pass: Model Runner V2.

Why: Model Runner V2 (vLLM's default from 0.33.0, its only runner from 0.34.0) returns aux
hidden states only to a drafter, and the config patch drops the speculative config.

How, only when the connector is configured:
- ``__init__``: ``use_aux_hidden_state_outputs`` on (the CUDA-graph manager then keeps output
  buffers for them);
- ``load_model``: the original runs with the flag off (it reads it as "a drafter's layers"),
  then the model returns the connector's layers (``SupportsEagle3``) and the layer sink is
  installed (:func:`~vllm_gdn_hs.patch.extraction.install_sink`);
- ``profile_run``: the largest step's hand-over is allocated once, so the KV cache is sized
  with it (0.34.0's extensible KV cache keeps that peak free as headroom);
- ``capture_model``, with ``graph_aux_buffers`` (on by default): the CUDA-graph manager's aux
  buffers are allocated first, in a segment of their own, not lazily inside a cached segment
  they would pin (:func:`~vllm_gdn_hs.patch.extraction.graph_aux_buffers`; docs/memory.md);
- ``execute_model``: after a real forward pass with the connector on, the scheduled tokens'
  aux states go to the connector before ``sample_tokens`` calls ``wait_for_save``. (V2 keeps
  prefill chunks out of FULL decode CUDA graphs itself: no dispatch guard as in V1.)

Upstream: no equivalent; ``patches/upstream/`` proposes the same hand-over through V2's
``KVConnector`` interface. Twin: ``patches/*/*-gpu-model-runner-v2-*.patch``.
"""

from __future__ import annotations

import inspect

import torch
from vllm.distributed.kv_transfer import has_kv_transfer_group
from vllm.model_executor.models.interfaces import supports_eagle3
from vllm.v1.worker.gpu.input_batch import InputBatch
from vllm.v1.worker.gpu.model_runner import ExecuteModelState, GPUModelRunner

from vllm_gdn_hs.config import config_from
from vllm_gdn_hs.patch import Patch, require
from vllm_gdn_hs.patch.extraction import (
    extraction,
    graph_aux_buffers,
    hand_over,
    init_and_profile_run,
    install_sink,
    sink_open,
)

_orig_load_model = GPUModelRunner.load_model
_orig_execute_model = GPUModelRunner.execute_model
_orig_capture_model = GPUModelRunner.capture_model
_EXECUTE_MODEL_ARGS = inspect.signature(_orig_execute_model)
require(_orig_execute_model, "scheduler_output", "dummy_run")
require(ExecuteModelState, "input_batch", "aux_hidden_states")
require(InputBatch, "req_ids", "num_reqs", "query_start_loc_np", "positions")


def load_model(self, *args, **kwargs) -> None:
    ours = extraction(self)
    if ours is None:
        return _orig_load_model(self, *args, **kwargs)
    self.use_aux_hidden_state_outputs = False  # vLLM's reads it as "a drafter's aux layers"
    try:
        _orig_load_model(self, *args, **kwargs)
    finally:
        self.use_aux_hidden_state_outputs = True
    if not supports_eagle3(self.model):
        raise ValueError(
            f"{type(self.model).__name__} cannot return aux hidden states (it does not "
            "implement vLLM's SupportsEagle3), so its hidden states cannot be extracted"
        )
    self.model.set_aux_hidden_state_layers(tuple(ours.layer_ids))
    install_sink(self)


def capture_model(self, *args, **kwargs):
    manager = getattr(self, "cudagraph_manager", None)
    if (
        extraction(self) is not None
        and manager is not None
        and not getattr(manager, "aux_hidden_states", True)  # vLLM fills it at first capture
        and config_from(self.vllm_config).graph_aux_buffers
    ):
        manager.aux_hidden_states = graph_aux_buffers(self)
    return _orig_capture_model(self, *args, **kwargs)


def execute_model(self, scheduler_output, *args, **kwargs):
    call = _EXECUTE_MODEL_ARGS.bind(self, scheduler_output, *args, **kwargs).arguments
    dummy_run = call.get("dummy_run", False)
    with sink_open(self, scheduler_output.total_num_scheduled_tokens, dummy_run):
        output = _orig_execute_model(self, scheduler_output, *args, **kwargs)
    if (
        extraction(self) is not None
        and output is None  # a forward pass ran; its state waits for sample_tokens
        and scheduler_output.total_num_scheduled_tokens > 0
        and has_kv_transfer_group()  # off in kernel warm-up (KVConnector.set_disabled)
        and not dummy_run
    ):
        save_step(self, self.execute_model_state)
    return output


def save_step(self, state) -> None:
    """Hand one forward pass's rows (scheduled tokens only, no padding) to the connector."""
    batch, num_reqs = state.input_batch, state.input_batch.num_reqs
    with torch.inference_mode():
        hand_over(
            self,
            state.aux_hidden_states,
            req_ids=list(batch.req_ids[:num_reqs]),
            query_start_loc_cpu=torch.from_numpy(batch.query_start_loc_np[: num_reqs + 1].copy()),
            positions=batch.positions,
        )


PATCH = Patch(
    GPUModelRunner,
    {
        **init_and_profile_run(GPUModelRunner),
        "load_model": load_model,
        "execute_model": execute_model,
        "capture_model": capture_model,
    },
)
