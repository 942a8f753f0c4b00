"""vllm_gdn_hs.patch.patch_worker_gpu_model_runner_v2: Model Runner V2 streams aux hidden
states; CPU only.

Run: python -m pytest tests/test_patch_worker_gpu_model_runner_v2.py -q   (no GPU, no network)
Covers (on releases where extraction runs on V2, version.MODEL_RUNNER_V2_FROM): the patch
replaces V2's methods; ``load_model`` gives the connector's layers to the model and refuses a
model without aux hidden states; ``profile_run``'s allocated peak covers the largest stacked
step's hand-over through the real connector; an eager step's rows leave layer by layer (the
layer sink): its peak is plain's plus one layer's rows, and the files hold the same rows; the
patched ``execute_model``, between the steps of vLLM's own V2 ``ActiveKVConnector``
(``pre_forward`` ... ``post_forward``, the order ``sample_tokens`` keeps), hands the real
worker-side connector each forward pass's rows from vLLM's own V2 ``InputBatch`` (scheduled
tokens only, configured layer order) and the files hold exactly those rows; dummy runs and
steps without a forward pass and the kernel warm-up (connector disabled) hand over nothing;
other connectors are untouched.
Edges replaced: the runner's construction (a CUDA device) and the forward pass on the GPU,
which here leaves the aux states in ``execute_model_state`` as V2's does.
"""

from __future__ import annotations

import os
from unittest import mock

import harness
import pytest
import torch
from safetensors.torch import load_file
from vllm.config import set_current_vllm_config
from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.model_executor.models.interfaces import SupportsEagle3

from vllm_gdn_hs.version import runs_model_runner_v2

pytestmark = pytest.mark.skipif(
    not runs_model_runner_v2(), reason="Model Runner V2 is patched from vLLM 0.33.0"
)
if runs_model_runner_v2():
    from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    from vllm_gdn_hs.connector import HybridHiddenStatesConnector
    from vllm_gdn_hs.connector.metadata import (
        FinishedRequest,
        HybridHiddenStatesConnectorMetadata,
        NewRequest,
    )
    from vllm_gdn_hs.patch import patch_worker_gpu_model_runner_v2 as patch_mod
    from vllm_gdn_hs.patch.extraction import (
        RUNNER_ATTR,
        Extraction,
        extraction,
        init_and_profile_run,
        layer_order,
        set_up_extraction,
    )


def _ours(layer_ids) -> Extraction:
    """What the patched ``__init__`` keeps on the runner for our connector."""
    return Extraction(list(layer_ids), layer_order(layer_ids), HybridHiddenStatesConnector)


def _kept(runner) -> Extraction:
    """What the patches keep on the runner: there, for our connector."""
    ours = extraction(runner)
    assert ours is not None
    return ours


def _sink(runner):
    return _kept(runner).sink


def test_patch_replaces_runner_methods():
    for name, fn in patch_mod.PATCH.attrs.items():
        assert getattr(GPUModelRunner, name) is fn


class _Model(SupportsEagle3):
    """The model at the edge (vLLM's models subclass SupportsEagle3 the same way): records
    the aux layers it is asked for."""

    def set_aux_hidden_state_layers(self, layers):
        self.aux_layers = layers


def test_load_model_gives_the_connectors_layers_to_the_model():
    runner = object.__new__(GPUModelRunner)

    def load(self, *args, **kwargs):  # the edge: loading weights onto the GPU
        self.model = model

    with mock.patch.object(patch_mod, "_orig_load_model", load):
        model = _Model()
        setattr(runner, RUNNER_ATTR, _ours([8, 1, 4]))
        GPUModelRunner.load_model(runner)
        assert model.aux_layers == (8, 1, 4)
        model = _Model()
        setattr(runner, RUNNER_ATTR, None)  # another connector, or none: vLLM's own way
        GPUModelRunner.load_model(runner)
        assert not hasattr(model, "aux_layers")
        model = object()
        setattr(runner, RUNNER_ATTR, _ours([1]))
        with pytest.raises(ValueError, match="SupportsEagle3"):
            GPUModelRunner.load_model(runner)


class _AuxModel(torch.nn.Module, SupportsEagle3):
    """The model at the edge, collecting its aux states through vLLM's own
    ``EagleModelMixin._maybe_add_hidden_state`` as vLLM's Qwen3.5 does: each layer's residual
    stream is given rows (``states[k]``, exact: residual zero), and each layer allocates an
    activation temporary of 4 x hidden per token, its peak."""

    def __init__(self):
        from vllm.model_executor.models.interfaces import EagleModelMixin

        super().__init__()
        self.inner = type("Inner", (torch.nn.Module, EagleModelMixin), {})()

    def set_aux_hidden_state_layers(self, layers):
        self.inner._set_aux_hidden_state_layers(layers)

    def forward(self, states: list[torch.Tensor]):
        aux, zero = [], torch.zeros_like(states[0])
        for k, h in enumerate(states):
            activation = torch.empty((h.shape[0], 4 * h.shape[1]), dtype=h.dtype)
            del activation
            self.inner._maybe_add_hidden_state(aux, k, h.clone(), zero)
        return states[-1].clone(), aux


def _runner(cfg, model):
    """A V2 runner as the patched ``__init__`` and ``load_model`` leave it (CPU device)."""
    runner = object.__new__(GPUModelRunner)
    runner.vllm_config, runner.model_config = cfg, cfg.model_config
    runner.device = torch.device("cpu")
    runner.max_num_tokens = cfg.scheduler_config.max_num_batched_tokens
    set_up_extraction(runner, cfg)
    load = lambda self: setattr(self, "model", model)  # noqa: E731
    with mock.patch.object(patch_mod, "_orig_load_model", load):
        GPUModelRunner.load_model(runner)
    return runner


def _eager_step(runner, so, states, batch):
    """One real step through the patched ``execute_model``, the forward pass on the edge."""

    def forward(self, scheduler_output, *args, **kwargs):
        hidden, aux = self.model(states)
        self.execute_model_state = harness.v2_forward_state(batch, aux)

    with mock.patch.object(patch_mod, "_orig_execute_model", forward):
        GPUModelRunner.execute_model(runner, so)
    runner.execute_model_state = None  # sample_tokens drops it


def _connector(cfg):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    harness._init_dist(cfg)
    return HybridHiddenStatesConnector(cfg, KVConnectorRole.WORKER)


@pytest.mark.parametrize("sink", [False, True])
def test_profile_run_peak_covers_a_real_steps_hand_over(hybrid_model, tmp_path, sink):
    """vLLM sizes the KV cache from profile_run's allocated peak: that peak must cover what the
    hand-over of the largest step that takes the stacked path allocates, measured the same way,
    with the connector's real save path (with the sink, the largest CUDA-graph step)."""
    from live_bytes import LiveBytes

    cfg = harness.engine_config(hybrid_model, layer_ids=(8, 1, 4), storage=str(tmp_path))
    cfg.kv_transfer_config.kv_connector_extra_config["layer_by_layer"] = True
    from vllm.config import CUDAGraphMode

    cfg.model_config.enforce_eager = False  # CUDA graphs of up to 16 tokens, as on a GPU
    cfg.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    cfg.compilation_config.max_cudagraph_capture_size = 16
    runner = _runner(cfg, _AuxModel())
    if not sink:
        _kept(runner).sink = None
    stacked = 16 if sink else runner.max_num_tokens
    hidden = cfg.model_config.get_hidden_size()
    # The patch's profile_run around vLLM's own, here the edge: no forward pass on a GPU.
    vllm_runner = type("GPUModelRunner", (), {"profile_run": lambda self, **kw: None})
    profile_run = init_and_profile_run(vllm_runner)["profile_run"]
    assert profile_run.__code__ is GPUModelRunner.profile_run.__code__  # what the patch installs
    with LiveBytes() as profiled:
        profile_run(runner)
    conn = _connector(cfg)
    saved, kv_transfer_state._KV_CONNECTOR_AGENT = kv_transfer_state._KV_CONNECTOR_AGENT, conn
    batch = harness.v2_input_batch([("a", 0, stacked)], torch.arange(stacked))
    try:
        with LiveBytes() as step:  # the model's outputs, alive during the hand-over, and it
            outputs = [torch.ones(stacked, hidden, dtype=torch.bfloat16) for _ in range(4)]
            patch_mod.save_step(runner, harness.v2_forward_state(batch, outputs[1:]))
            del outputs
        conn.shutdown()
    finally:
        kv_transfer_state._KV_CONNECTOR_AGENT = saved
    assert step.peak > 0 and profiled.peak >= step.peak


def test_eager_steps_stream_each_layer_as_the_model_makes_it(hybrid_model, tmp_path):
    """A step larger than any CUDA graph: each aux state leaves for the pinned slot as the
    model makes it, so the step's allocated peak (what vLLM's warm-up measures) is plain
    vLLM's plus at most one layer's rows and the norms; a dummy run drops them the same way;
    the file holds exactly the rows, layers in the configured order."""
    from live_bytes import LiveBytes

    layer_ids = (8, 1, 4)
    cfg = harness.engine_config(hybrid_model, layer_ids=layer_ids, storage=str(tmp_path))
    extra = cfg.kv_transfer_config.kv_connector_extra_config
    extra["layer_by_layer"] = False
    assert _sink(_runner(cfg, _AuxModel())) is None
    extra.pop("layer_by_layer")  # on by default
    hidden, n = cfg.model_config.get_hidden_size(), 40
    g = torch.Generator().manual_seed(0)
    states = [torch.randn(n + 2, hidden, generator=g).bfloat16() for _ in range(9)]  # +2 pad
    batch = harness.v2_input_batch([("a", 0, n)], harness.schedule_positions([("a", 0, n)], 2), 2)
    path = os.path.join(tmp_path, "a.safetensors")
    conn = _connector(cfg)
    saved, kv_transfer_state._KV_CONNECTOR_AGENT = kv_transfer_state._KV_CONNECTOR_AGENT, conn
    try:
        plain = _runner(cfg, _AuxModel())
        setattr(plain, RUNNER_ATTR, None)  # no extraction: vLLM's own step
        ours = _runner(cfg, _AuxModel())
        assert _sink(ours) is not None
        meta = HybridHiddenStatesConnectorMetadata(new_requests=[NewRequest("a", path, n)])
        conn.bind_connector_metadata(meta)
        peaks = {}
        for name, runner in (("plain", plain), ("ours", ours)):
            with LiveBytes() as m:
                _eager_step(runner, harness.scheduler_output(None, {"a": n}), states, batch)
            peaks[name] = m.peak
        with LiveBytes() as m:  # a dummy run of profile_run: no slot, the same memory
            forward = lambda self, *a, **kw: self.model(states)  # noqa: E731
            with mock.patch.object(patch_mod, "_orig_execute_model", forward):
                GPUModelRunner.execute_model(
                    ours, harness.scheduler_output(None, {"a": n}), dummy_run=True
                )
        peaks["dummy"] = m.peak
        fin = [FinishedRequest("a", [0] * n)]
        done = HybridHiddenStatesConnectorMetadata(finished_requests=fin)
        conn.bind_connector_metadata(done)
        conn.shutdown()
    finally:
        kv_transfer_state._KV_CONNECTOR_AGENT = saved
    one_layer = (n + 2) * hidden * 2
    assert peaks["ours"] <= peaks["plain"] + one_layer + n * len(layer_ids) * 4
    assert peaks["dummy"] <= peaks["plain"] + one_layer
    got = load_file(path)["hidden_states"]
    assert torch.equal(got, torch.stack([states[k][:n] for k in layer_ids], dim=1))


def test_a_model_vllm_compiles_keeps_its_own_aux_states(hybrid_model, tmp_path):
    """A model whose forward vLLM runs through torch.compile (its compiled submodule, the one
    thing faked here) is not wrapped: dynamo would trace the sink's copies. Its eager steps
    stack their rows, and profile_run covers the largest step."""
    cfg = harness.engine_config(hybrid_model, layer_ids=(8, 1, 4), storage=str(tmp_path))
    with mock.patch(
        "vllm.v1.worker.gpu.cudagraph_utils.has_compiled_submodule", lambda model: True
    ):
        runner = _runner(cfg, _AuxModel())
    assert _sink(runner) is None
    assert "_maybe_add_hidden_state" not in vars(runner.model.inner)
    assert "_maybe_add_hidden_state" in vars(_runner(cfg, _AuxModel()).model.inner)
    from vllm.config import CompilationMode

    cfg.compilation_config.mode = CompilationMode.STOCK_TORCH_COMPILE  # the whole model
    assert _sink(_runner(cfg, _AuxModel())) is None


@pytest.mark.smoke  # the releases with V2: its own InputBatch and KVConnector interface
def test_execute_model_streams_rows_to_the_connector(hybrid_model, tmp_path):
    layer_ids = (8, 1, 4)  # configured order; the model hands aux states in ascending order
    cfg = harness.engine_config(hybrid_model, layer_ids=layer_ids, storage=str(tmp_path))
    harness._init_dist(cfg)
    hidden = cfg.model_config.get_hidden_size()
    prompts = {"a": [1, 2, 3], "b": [4, 5, 6, 7, 8, 9]}
    path = {r: os.path.join(tmp_path, f"{r}.safetensors") for r in prompts}
    g = torch.Generator().manual_seed(0)
    full = {r: torch.randn(len(t), 3, hidden, generator=g).bfloat16() for r, t in prompts.items()}
    forwards = []

    def forward(self, scheduler_output, intermediate_tensors=None, dummy_run=False, **kw):
        """The edge: V2's forward pass on the GPU, which leaves its state for sample_tokens
        (or, without scheduled tokens, returns the no-forward output)."""
        forwards.append(dummy_run)
        if not scheduler_output.total_num_scheduled_tokens and not dummy_run:
            return "no forward"
        self.execute_model_state = harness.v2_forward_state(self.next_batch, self.next_aux)
        return None

    with set_current_vllm_config(cfg), mock.patch.object(patch_mod, "_orig_execute_model", forward):
        conn = HybridHiddenStatesConnector(cfg, KVConnectorRole.WORKER)
        saved, kv_transfer_state._KV_CONNECTOR_AGENT = kv_transfer_state._KV_CONNECTOR_AGENT, conn
        try:
            v2_connector = ActiveKVConnector(cfg, {})  # vLLM's own, around the runner
            runner = object.__new__(GPUModelRunner)
            set_up_extraction(runner, cfg)  # what the patched __init__ adds
            assert _kept(runner).layer_ids == list(layer_ids)

            def step(meta, sched, pad=3, dummy_run=False):
                rows = torch.cat(
                    [full[r][s : s + n] for r, s, n in sched]
                    + [torch.full((pad, 3, hidden), float("nan")).bfloat16()]
                )
                pos = torch.cat([torch.arange(s, s + n) for _, s, n in sched] + [torch.zeros(pad)])
                runner.next_batch = harness.v2_input_batch(sched, pos.long(), pad)
                runner.next_aux = [rows[:, k] for k in range(3)]
                so = harness.scheduler_output(meta, {r: n for r, _, n in sched})
                if dummy_run:  # vLLM disables the connector around dummy runs
                    assert GPUModelRunner.execute_model(runner, so, dummy_run=True) is None
                    return
                v2_connector.pre_forward(so, runner.next_batch)
                assert GPUModelRunner.execute_model(runner, so, None) is None
                v2_connector.finish_forward()
                v2_connector.post_forward(so.finished_req_ids)  # in sample_tokens

            new = [NewRequest(r, path[r], len(t)) for r, t in prompts.items()]
            step(HybridHiddenStatesConnectorMetadata(new_requests=new), [("a", 0, 3), ("b", 0, 4)])
            with mock.patch.object(conn, "save_hidden_states", side_effect=AssertionError):
                # A dummy run (profiling, capture, an idle DP rank) hands over nothing...
                step(HybridHiddenStatesConnectorMetadata(), [("b", 4, 2)], dummy_run=True)
                # ...nor does a step without scheduled tokens (V2's no_forward path).
                empty = harness.scheduler_output(HybridHiddenStatesConnectorMetadata())
                assert GPUModelRunner.execute_model(runner, empty) == "no forward"
                # ...nor the kernel warm-up's made-up requests (vLLM disables the connector).
                v2_connector.set_disabled(True)
                warmup = harness.scheduler_output(None, {"warmup": 2})
                runner.next_batch = harness.v2_input_batch([("warmup", 0, 2)], torch.arange(2), 0)
                assert GPUModelRunner.execute_model(runner, warmup) is None
                v2_connector.set_disabled(False)
            step(HybridHiddenStatesConnectorMetadata(), [("b", 4, 2)], pad=0)
            done = HybridHiddenStatesConnectorMetadata(finished_requests=fin(prompts))
            v2_connector.no_forward(harness.scheduler_output(done, finished_req_ids=prompts))
            conn.shutdown()
        finally:
            kv_transfer_state._KV_CONNECTOR_AGENT = saved
    assert forwards == [False, True, False, False, False]

    for r, tokens in prompts.items():
        got = load_file(path[r])
        # File layers in the configured order [8, 1, 4] = ascending indices [2, 0, 1];
        # the NaN padding rows never reach a file.
        assert torch.equal(got["hidden_states"], full[r][:, [2, 0, 1]])
        assert got["token_ids"].tolist() == tokens


def fin(prompts):
    return [FinishedRequest(r, t) for r, t in prompts.items()]


def test_other_connectors_are_untouched():
    runner = object.__new__(GPUModelRunner)
    setattr(runner, RUNNER_ATTR, None)
    calls = []

    def forward(self, scheduler_output, *args, **kwargs):
        calls.append(kwargs)
        return None

    with mock.patch.object(patch_mod, "_orig_execute_model", forward):
        so = harness.scheduler_output(None, {"a": 3})
        assert GPUModelRunner.execute_model(runner, so, None) is None
    assert calls == [{}] and extraction(runner) is None


def test_graph_aux_buffers_give_vllms_graph_manager_one_tensor_of_aux_buffers_first(
    hybrid_model, tmp_path
):
    """vLLM's CUDA-graph manager allocates its persistent aux buffers lazily, inside capture,
    where they pin a cached segment of a kernel's workspace (0.78 GiB on an H100, measured by
    benchmarks/graph_memory.py). The patched capture_model fills vLLM's own manager's list
    before the original runs: a [largest capture size, hidden] view per layer id, all of one
    tensor, which vLLM then keeps (it allocates only into an empty list). Option
    graph_aux_buffers, on by default; off, vLLM's own way."""
    from vllm.config import CUDAGraphMode
    from vllm.v1.worker.gpu.cudagraph_utils import ModelCudaGraphManager

    cfg = harness.engine_config(hybrid_model, layer_ids=(8, 1, 4), storage=str(tmp_path))
    cfg.compilation_config.max_cudagraph_capture_size = 16
    runner = _runner(cfg, _AuxModel())
    harness._init_dist(cfg)
    extra = cfg.kv_transfer_config.kv_connector_extra_config
    with set_current_vllm_config(cfg):
        manager = ModelCudaGraphManager(cfg, runner.device, CUDAGraphMode.NONE, {1: 16})
    assert manager.aux_hidden_states == []  # vLLM's own start: filled at the first capture
    runner.cudagraph_manager = manager
    seen = []
    capture = lambda self, *a, **kw: seen.append(list(self.cudagraph_manager.aux_hidden_states))  # noqa: E731
    with mock.patch.object(patch_mod, "_orig_capture_model", capture):
        extra["graph_aux_buffers"] = False
        GPUModelRunner.capture_model(runner)  # off: vLLM's way
        assert manager.aux_hidden_states == [] and seen.pop() == []
        del extra["graph_aux_buffers"]  # the default
        GPUModelRunner.capture_model(runner)
        buffers = manager.aux_hidden_states
        GPUModelRunner.capture_model(runner)  # the next capture keeps them
    hidden = cfg.model_config.get_hidden_size()
    assert [tuple(b.shape) for b in buffers] == [(16, hidden)] * 3
    assert {b.untyped_storage().data_ptr() for b in buffers} == {buffers[0].data_ptr()}
    assert all(b.dtype == cfg.model_config.dtype for b in buffers)
    assert seen[0] == buffers and all(x is y for x, y in zip(seen[1], buffers, strict=True))

    setattr(runner, RUNNER_ATTR, None)  # another connector, or none: vLLM's own way
    manager.aux_hidden_states = []
    with mock.patch.object(patch_mod, "_orig_capture_model", capture):
        GPUModelRunner.capture_model(runner)
    assert manager.aux_hidden_states == []
