"""vllm_gdn_hs.patch.patch_worker_gpu_model_runner: the runner streams aux hidden states; CPU only.

Run: python -m pytest tests/test_patch_worker_gpu_model_runner.py -q   (no GPU, no network)
Skipped from vLLM 0.34.0, which has no V1 runner (tests/test_extraction.py covers what both
runners share). Covers: profile_run allocates the largest step's hand-over inside vLLM's
memory profiling (the connector's own GPU work on rows of that shape);
the patched GPUModelRunner._model_forward, inside the steps that vLLM's own
KVConnectorModelRunnerMixin runs around it (each release's hook order), hands the real
worker-side connector each step's rows (scheduled tokens only, configured layer order, M-RoPE
positions) and the files hold exactly those rows; a one-token step that starts a prompt is
not dispatched as a FULL decode CUDA graph; other connectors are untouched.
Edges replaced: the GPU runner's construction (a CUDA device), vLLM's dummy forward pass on
the GPU, the model itself, and the CUDA graph dispatcher.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from unittest import mock

import harness
import pytest
import torch
from safetensors.torch import load_file
from vllm.config import set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from vllm_gdn_hs.version import has_v1_runner

if not has_v1_runner():
    pytest.skip("vLLM 0.34.0 and later have no V1 GPU model runner", allow_module_level=True)

from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # noqa: E402

from vllm_gdn_hs.connector import HybridHiddenStatesConnector  # noqa: E402
from vllm_gdn_hs.connector.metadata import (  # noqa: E402
    FinishedRequest,
    HybridHiddenStatesConnectorMetadata,
    NewRequest,
)
from vllm_gdn_hs.patch import patch_worker_gpu_model_runner as patch_mod  # noqa: E402
from vllm_gdn_hs.patch.extraction import (  # noqa: E402
    RUNNER_ATTR,
    Extraction,
    init_and_profile_run,
    layer_order,
)


def _ours(layer_ids) -> Extraction:
    """What the patched ``__init__`` keeps on the runner for our connector."""
    return Extraction(list(layer_ids), layer_order(layer_ids), HybridHiddenStatesConnector)


def test_patch_replaces_runner_methods():
    for name, fn in patch_mod.PATCH.attrs.items():
        assert getattr(GPUModelRunner, name) is fn


def test_other_connectors_keep_vllms_aux_layers():
    runner = object.__new__(GPUModelRunner)
    setattr(runner, RUNNER_ATTR, None)
    runner.speculative_config = None
    assert GPUModelRunner._get_eagle3_aux_layers_from_config(runner) is None
    setattr(runner, RUNNER_ATTR, _ours([8, 1, 4]))
    assert GPUModelRunner._get_eagle3_aux_layers_from_config(runner) == (8, 1, 4)


def test_profile_run_allocates_the_largest_steps_hand_over(hybrid_model):
    cfg = harness.engine_config(hybrid_model, connector=harness.OURS, layer_ids=(8, 1, 4))
    tokens = cfg.scheduler_config.max_num_batched_tokens
    hidden = cfg.model_config.get_hidden_size()
    runner = object.__new__(GPUModelRunner)
    runner.vllm_config, runner.model_config = cfg, cfg.model_config
    runner.max_num_tokens, runner.device = tokens, torch.device("cpu")
    forwards, handed = [], []

    def dummy_forward(self, *args, **kwargs):  # the edge: vLLM's dummy forward on a GPU
        forwards.append(kwargs)

    real = HybridHiddenStatesConnector.profile_save_hidden_states

    def spy(vllm_config, hidden_states):
        handed.append(tuple(hidden_states.shape))
        real(vllm_config, hidden_states)  # the connector's own GPU work, here on CPU

    # The patch's profile_run around vLLM's own, here the edge's dummy forward.
    vllm_runner = type("GPUModelRunner", (), {"profile_run": dummy_forward})
    profile_run = init_and_profile_run(vllm_runner)["profile_run"]
    assert profile_run.__code__ is GPUModelRunner.profile_run.__code__  # what the patch installs
    with mock.patch.object(HybridHiddenStatesConnector, "profile_save_hidden_states", spy):
        setattr(runner, RUNNER_ATTR, _ours([8, 1, 4]))
        profile_run(runner, randomize_inputs=False)  # 0.33.0's keyword
        setattr(runner, RUNNER_ATTR, None)  # another connector, or none
        profile_run(runner)
    assert forwards == [{"randomize_inputs": False}, {}]
    assert handed == [(tokens, 3, hidden)]  # the largest step, once, after the forward


class _Model:
    """The GPU model at the edge: returns (hidden, aux in ascending layer order)."""

    def __init__(self, rows_for):
        self.rows_for = rows_for

    def __call__(self, input_ids, positions, intermediate_tensors, inputs_embeds):
        aux = self.rows_for(positions)
        return aux[-1], aux


def _runner(layer_ids):
    runner = object.__new__(GPUModelRunner)
    setattr(runner, RUNNER_ATTR, _ours(layer_ids))
    return runner


@pytest.mark.smoke  # every release: its own runner mixin's hook order around the forward pass
def test_model_forward_streams_rows_to_the_connector(hybrid_model, tmp_path):
    layer_ids = (8, 1, 4)  # configured order; the model hands aux states in ascending order
    cfg = harness.engine_config(
        hybrid_model, connector=harness.OURS, layer_ids=layer_ids, storage=str(tmp_path)
    )
    harness._init_dist(cfg)
    hidden = cfg.model_config.get_hidden_size()
    prompts = {"a": [1, 2, 3], "b": [4, 5, 6, 7, 8, 9]}
    path = {r: os.path.join(tmp_path, f"{r}.safetensors") for r in prompts}
    g = torch.Generator().manual_seed(0)
    # full[r][t, k] = the residual stream after layer sorted(layer_ids)[k] at token t of r.
    full = {r: torch.randn(len(t), 3, hidden, generator=g).bfloat16() for r, t in prompts.items()}

    with set_current_vllm_config(cfg):
        conn = HybridHiddenStatesConnector(cfg, KVConnectorRole.WORKER)
        runner = _runner(layer_ids)

        def step(meta, sched, pad=3, mrope=False):  # sched: (req_id, start, count), batch order
            pos = torch.cat([torch.arange(s, s + n) for _, s, n in sched] + [torch.zeros(pad)])
            rows = torch.cat(
                [full[r][s : s + n] for r, s, n in sched]
                + [torch.full((pad, 3, hidden), float("nan")).bfloat16()]
            )
            runner.model = _Model(lambda positions: [rows[:, k] for k in range(3)])
            qsl = torch.tensor([0, *torch.tensor([n for _, _, n in sched]).cumsum(0).tolist()])
            runner.input_batch = SimpleNamespace(
                req_ids=[r for r, _, _ in sched], num_reqs=len(sched)
            )
            runner.query_start_loc = SimpleNamespace(cpu=qsl)
            positions = torch.stack([pos, pos, pos]).long() if mrope else pos.long()
            so = harness.scheduler_output(meta, {r: n for r, _, n in sched})
            out = harness.runner_step(
                conn,
                so,
                cfg,
                lambda: GPUModelRunner._model_forward(runner, input_ids=None, positions=positions),
            )
            assert out[1][0].shape[0] == rows.shape[0]  # the runner gets the model's output

        new = [NewRequest(r, path[r], len(t)) for r, t in prompts.items()]
        fin = [FinishedRequest(r, t) for r, t in prompts.items()]
        step(HybridHiddenStatesConnectorMetadata(new_requests=new), [("a", 0, 3), ("b", 0, 4)])
        step(HybridHiddenStatesConnectorMetadata(), [("b", 4, 2)], mrope=True)
        done = HybridHiddenStatesConnectorMetadata(finished_requests=fin)
        harness.runner_step(conn, harness.scheduler_output(done, finished_req_ids=prompts), cfg)
        conn.shutdown()

    for r, tokens in prompts.items():
        got = load_file(path[r])
        # File layers in the configured order [8, 1, 4] = ascending indices [2, 0, 1];
        # the NaN padding rows never reach a file.
        assert torch.equal(got["hidden_states"], full[r][:, [2, 0, 1]])
        assert got["token_ids"].tolist() == tokens


class _Dispatcher:
    """vLLM's CUDA graph dispatcher at the edge (no graphs on a CPU): FULL for a uniform
    decode batch, PIECEWISE otherwise, as FULL_AND_PIECEWISE dispatches."""

    def __init__(self):
        self.uniform = []

    def dispatch(self, num_tokens, uniform_decode=False, **kwargs):
        from vllm.config import CUDAGraphMode
        from vllm.forward_context import BatchDescriptor

        self.uniform.append(uniform_decode)
        mode = CUDAGraphMode.FULL if uniform_decode else CUDAGraphMode.PIECEWISE
        return mode, BatchDescriptor(num_tokens=num_tokens)


@pytest.mark.smoke  # every release: its own _determine_batch_execution_and_padding
@pytest.mark.parametrize(
    "computed, ours, full",
    [
        ([5, 9, 0], True, False),  # a one-token prompt among decodes: piecewise
        ([0], True, False),  # a one-token prompt alone: piecewise
        ([5, 9, 3], True, True),  # decodes only: FULL, as vLLM decides
        ([5, 9, 0], False, True),  # extraction off: vLLM's own decision
    ],
)
def test_a_step_that_starts_a_prompt_is_not_a_full_decode_graph(
    hybrid_model, tmp_path, computed, ours, full
):
    """A one-token step that starts a prompt is a prefill to the GDN backend, which FULL decode
    graphs do not run (on the H200, vLLM 0.33.0: the prompt's hidden states came out wrong)."""
    import numpy as np
    from vllm.config import CUDAGraphMode

    cfg = harness.engine_config(hybrid_model, connector=harness.OURS, storage=str(tmp_path))
    runner = _runner((1, 4, 8)) if ours else object.__new__(GPUModelRunner)
    runner.vllm_config, runner.model_config = cfg, cfg.model_config
    runner.parallel_config = cfg.parallel_config
    runner.compilation_config = cfg.compilation_config
    runner.uniform_decode_query_len = 1
    runner.cudagraph_dispatcher = dispatcher = _Dispatcher()
    runner.input_batch = SimpleNamespace(
        num_computed_tokens_cpu=np.array(computed + [7, 7]),  # rows past num_reqs: stale
        lora_id_to_lora_request={},
    )
    n = len(computed)
    mode = GPUModelRunner._determine_batch_execution_and_padding(
        runner,
        num_tokens=n,
        num_reqs=n,
        num_scheduled_tokens_np=np.ones(n, dtype=np.int32),
        max_num_scheduled_tokens=1,
        use_cascade_attn=False,  # required before 0.32.0
    )[0]
    assert mode == (CUDAGraphMode.FULL if full else CUDAGraphMode.PIECEWISE)
    assert dispatcher.uniform == [full]
    # CUDA graph capture says what it captures: untouched.
    dispatcher.uniform.clear()
    GPUModelRunner._determine_batch_execution_and_padding(
        runner,
        num_tokens=n,
        num_reqs=n,
        num_scheduled_tokens_np=np.ones(n, dtype=np.int32),
        max_num_scheduled_tokens=1,
        use_cascade_attn=False,
        force_uniform_decode=True,
    )
    assert dispatcher.uniform == [True]
