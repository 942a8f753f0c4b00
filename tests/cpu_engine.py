"""Real vLLM configs, KV cache specs and schedulers on a machine without a GPU (0.20.1-0.33.0).

vLLM's CUDA wheel sees no GPU here, so its platform is "unspecified" and
``EngineArgs.create_engine_config()`` fails. We install vLLM's own
``CpuPlatform`` as the current platform (it supports the hybrid KV cache
manager), build the target model's layers on the meta device (no weights, no
kernels), and ask each real layer for its KV cache spec, then run vLLM's
``get_kv_cache_configs`` and ``Scheduler``. Block sizes are aligned with the
generic ``Platform.update_block_size_for_backend``, the step the GPU
executors run after building the model (CpuPlatform skips it).

Import this module before anything else from vLLM (``tests/conftest.py`` does, through
``tests/harness.py``), and never in a process that runs vLLM on a GPU: it switches the
process's platform. Test code, not part of the package: used by the CPU tests and by
``benchmarks/kv_capacity.py`` (run with tests/ on PYTHONPATH).
"""

from __future__ import annotations

import tempfile
from unittest import mock

import vllm.platforms
from vllm.platforms.cpu import CpuPlatform


class _CpuPlatform(CpuPlatform):
    """vLLM's CpuPlatform, minus one check: from 0.34.0 it refuses an x86 CPU without
    triton-cpu, which only its CPU model runner needs; these tests never run a CPU model."""

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        import vllm.triton_utils as triton_utils

        saved, triton_utils.HAS_TRITON = triton_utils.HAS_TRITON, True
        try:
            super().check_and_update_config(vllm_config)
        finally:
            triton_utils.HAS_TRITON = saved


vllm.platforms.current_platform = _CpuPlatform()

import torch  # noqa: E402


def _stub_missing_custom_ops() -> None:
    """vLLM 0.26.0's wheel ships its kernels only for CUDA (they need libcuda to load), so
    on a machine without a GPU driver ``torch.ops._C.<op>`` does not resolve and layers
    that look an op up in ``__init__`` cannot even be built (on the meta device, as this
    harness builds models). Resolve those names to a stub that raises if it is ever
    called: building a layer needs the name only, never the kernel."""
    import torch._ops as ops

    names = {"silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul", "mul_and_silu", "gelu_new"}
    names |= {"gelu_fast", "gelu_quick", "rms_norm", "fused_add_rms_norm", "rotary_embedding"}
    original = ops._OpNamespace.__getattr__

    def getattr_(self, name):
        try:
            return original(self, name)
        except AttributeError:
            if self.name != "_C" or name not in names:
                raise

            def stub(*args, **kwargs):
                raise RuntimeError(f"torch.ops._C.{name} has no CPU kernel (test harness)")

            return stub

    ops._OpNamespace.__getattr__ = getattr_


try:
    torch.ops._C.silu_and_mul  # noqa: B018  (present on vLLM 0.20.1's wheel)
except AttributeError:
    _stub_missing_custom_ops()
from vllm.config import VllmConfig, get_layers_from_vllm_config, set_current_vllm_config  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402

from vllm_gdn_hs.cli.model_info import read_model_info  # noqa: E402
from vllm_gdn_hs.config import extraction_config  # noqa: E402

STOCK = "ExampleHiddenStatesConnector"
OURS = "HybridHiddenStatesConnector"


def engine_args(
    model: str,
    layer_ids=(1, 4, 8),
    connector: str | None = OURS,
    storage: str = "/tmp/hidden_states_test",
    **kw,
) -> EngineArgs:
    extra = extraction_config(layer_ids or [], storage, connector)
    if layer_ids is None:
        del extra["speculative_config"]
    if connector is None:
        del extra["kv_transfer_config"]
    kw.setdefault("max_model_len", 2048)
    if read_model_info(model).multimodal:
        kw.setdefault("language_model_only", True)
    return EngineArgs(model=model, skip_tokenizer_init=True, **extra, **kw)


def engine_config(model: str, **kw) -> VllmConfig:
    return engine_args(model, **kw).create_engine_config()


_dist_ready = False


def _init_dist(vllm_config: VllmConfig) -> None:
    global _dist_ready
    if _dist_ready:
        return
    from vllm.config import ModelConfig
    from vllm.distributed.parallel_state import (
        ensure_model_parallel_initialized,
        init_distributed_environment,
    )

    # One parallel state a process, whatever model comes first: with an expert-parallel group
    # (of one rank), which vLLM makes only when the first model is a mixture of experts.
    with (
        set_current_vllm_config(vllm_config),
        mock.patch.object(ModelConfig, "is_moe", property(lambda self: True)),
    ):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            backend="gloo",
            distributed_init_method=f"file://{tempfile.mktemp()}",
        )
        ensure_model_parallel_initialized(1, 1)
    _dist_ready = True


def _load_drafter(vllm_config: VllmConfig) -> None:
    """Build the extract_hidden_states drafter with vLLM's own loader: up to 0.33.0 the V1
    runner's ``ExtractHiddenStatesProposer.load_model``, from 0.34.0 Model Runner V2's
    ``ExtractHiddenStatesSpeculator.load_draft_model``.

    Only their edges are replaced: weights (``get_model`` builds the draft model on the meta
    device) and the worker-side connector object.
    """
    from unittest import mock

    import vllm.distributed.kv_transfer as kv_transfer
    from vllm.model_executor.model_loader.utils import initialize_model

    def get_model(*, vllm_config, model_config, **kw):
        return initialize_model(vllm_config=vllm_config, model_config=model_config)

    try:
        import vllm.v1.spec_decode.extract_hidden_states as ehs
    except ImportError:  # vLLM 0.34.0: Model Runner V2's speculator
        import vllm.v1.worker.gpu.spec_decode.extract_hidden_states as ehs

        speculator = object.__new__(ehs.ExtractHiddenStatesSpeculator)
        speculator.vllm_config = vllm_config
        speculator.draft_model_config = vllm_config.speculative_config.draft_model_config
        with mock.patch.object(ehs, "get_model", get_model):
            speculator.model = speculator.load_draft_model(None, set())
        return speculator
    proposer = object.__new__(ehs.ExtractHiddenStatesProposer)
    proposer.vllm_config, proposer.device = vllm_config, torch.device("cpu")
    with (
        mock.patch.object(ehs, "get_model", get_model),
        mock.patch.object(kv_transfer, "has_kv_transfer_group", lambda: True),
        mock.patch.object(kv_transfer, "get_kv_transfer_group", lambda: object()),
    ):
        proposer.load_model(None)
    return proposer


def kv_cache_specs(vllm_config: VllmConfig) -> dict:
    """Each attention-like layer's real KV cache spec, as the GPU runner collects
    them: target model first, then the extract_hidden_states drafter."""
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.platforms.interface import Platform

    with set_current_vllm_config(vllm_config):
        _init_dist(vllm_config)
        with torch.device("meta"):
            initialize_model(vllm_config=vllm_config)
            spec = vllm_config.speculative_config
            if spec is not None and spec.method == "extract_hidden_states":
                _load_drafter(vllm_config)
        Platform.update_block_size_for_backend.__func__(
            type(vllm.platforms.current_platform), vllm_config
        )
        layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase)
        specs = {name: layer.get_kv_cache_spec(vllm_config) for name, layer in layers.items()}
        _resolve_kv_cache_layout(vllm_config, specs)
        return specs


def model_parameters(vllm_config: VllmConfig) -> int:
    """The target model's parameter count as vLLM builds it (meta device: no memory, no
    weights). Give it a config of its own: vLLM refuses to build a layer name twice."""
    from vllm.model_executor.model_loader.utils import initialize_model

    with set_current_vllm_config(vllm_config):
        _init_dist(vllm_config)
        with torch.device("meta"):
            model = initialize_model(vllm_config=vllm_config)
    return sum(p.numel() for p in model.parameters())


def _resolve_kv_cache_layout(vllm_config: VllmConfig, specs: dict) -> None:
    """vLLM 0.33.0: the engine core resolves one KV cache layout from what every worker's
    attention backends support, before it plans the KV cache; do the same for one worker."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
        from vllm.v1.attention.backends.utils import (
            get_supported_kv_cache_layouts,
            resolve_kv_cache_layout,
        )
    except ImportError:
        return  # earlier releases choose the layout per backend
    if vllm_config.cache_config.kv_cache_layout is None:
        supported = get_supported_kv_cache_layouts(get_current_attn_backends(vllm_config))
        # records the layout on cache_config, as in the engine core
        resolve_kv_cache_layout(vllm_config, [[x.name for x in supported]], specs.values())


def kv_cache_config(vllm_config: VllmConfig, specs: dict | None = None, memory: int = 1 << 30):
    """vLLM's KV cache config for one worker, as EngineCore plans it."""
    specs = kv_cache_specs(vllm_config) if specs is None else specs
    try:  # vLLM 0.33.0: the groups are planned first, over every worker's specs
        from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    except ImportError:
        from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

        return get_kv_cache_configs(vllm_config, [specs], [memory])[0]
    groups = get_global_kv_cache_groups(vllm_config, [specs])
    return get_kv_cache_configs(vllm_config, [specs], [memory], groups)[0]


def kv_capacity(vllm_config: VllmConfig, memory: int):
    """(vLLM's "GPU KV cache size" in tokens, the KV cache config) for ``memory`` bytes of KV
    memory. Extraction holds no GPU memory between steps (a step's hand-over is in the peak
    vLLM profiles, which only a GPU measures), so what differs here is the KV cache specs."""
    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

    kcc = kv_cache_config(vllm_config, memory=memory)
    conc = get_max_concurrency_for_kv_cache_config(vllm_config, kcc)
    return int(conc * vllm_config.model_config.max_model_len), kcc


def scheduler(vllm_config: VllmConfig, kv_cache_config_=None):
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    kcc = kv_cache_config_ or kv_cache_config(vllm_config)
    vllm_config.cache_config.num_gpu_blocks = kcc.num_blocks
    try:  # vLLM 0.26.0: the scheduler's block size follows the groups, as EngineCore does it
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

        block_size, hash_block_size = resolve_kv_cache_block_sizes(kcc, vllm_config)
        sizes = dict(block_size=block_size, hash_block_size=hash_block_size)
    except ImportError:
        sizes = dict(block_size=vllm_config.cache_config.block_size)
    with set_current_vllm_config(vllm_config):
        return Scheduler(
            vllm_config=vllm_config,
            kv_cache_config=kcc,
            structured_output_manager=StructuredOutputManager(vllm_config),
            log_stats=False,
            **sizes,
        )
