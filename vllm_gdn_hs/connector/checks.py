"""The connector's startup checks: its options and the engine config it can run with. Each error
names the fix."""

from __future__ import annotations

from typing import TYPE_CHECKING

import vllm.envs as envs

from vllm_gdn_hs.config import HiddenStatesConfig, config_from
from vllm_gdn_hs.layer_ids import validate_layer_ids
from vllm_gdn_hs.model_support import aux_outputs_problem
from vllm_gdn_hs.names import CONNECTOR_NAME
from vllm_gdn_hs.version import requirement, runs_model_runner_v2

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def validate_vllm_config(
    vllm_config: VllmConfig, cfg: HiddenStatesConfig | None = None
) -> list[int]:
    """The layer ids, once the checks pass; ``cfg``: the options, if parsed."""
    spec = vllm_config.speculative_config
    if spec is not None:
        raise ValueError(
            f"{CONNECTOR_NAME} extracts hidden states without speculative decoding; "
            f"--speculative-config method {spec.method!r} cannot run with it: drop it, or use "
            '{"method": "extract_hidden_states", ...} only to pass the layer ids'
        )
    if why := aux_outputs_problem(vllm_config.model_config.architectures):
        raise ValueError(f"{CONNECTOR_NAME}: {why}")
    cfg = cfg or config_from(vllm_config)
    layer_ids = list(cfg.layer_ids)
    if cfg.fp8:
        try:  # fp8 quantizes with hs-connectors' own code (a dependency of this package)
            import hs_connectors.fp8_utils  # noqa: F401
        except ImportError as e:
            raise ValueError(
                f"{CONNECTOR_NAME}: fp8 needs hs-connectors ({e}): pip install "
                f"'hs-connectors{requirement('hs-connectors')}' into the server's environment"
            ) from None
    if not layer_ids:
        raise ValueError(
            f"{CONNECTOR_NAME} needs the layer ids to extract: pass --speculative-config "
            '\'{"method": "extract_hidden_states", "num_speculative_tokens": 1, '
            '"draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [...]}}}\' '
            'or "layer_ids": [...] in kv_connector_extra_config'
        )
    n = vllm_config.model_config.get_num_layers(vllm_config.parallel_config)
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        raise ValueError(
            f"{CONNECTOR_NAME} does not support pipeline parallelism: use tensor or data "
            "parallelism (--tensor-parallel-size / --data-parallel-size) instead of "
            "--pipeline-parallel-size"
        )
    if getattr(vllm_config.parallel_config, "prefill_context_parallel_size", 1) > 1:
        raise ValueError(
            f"{CONNECTOR_NAME} does not support prefill context parallelism (each rank would "
            "hold part of a prompt's hidden states): leave --prefill-context-parallel-size at 1"
        )
    try:
        validate_layer_ids(layer_ids, n)
    except ValueError as e:
        raise ValueError(f"{CONNECTOR_NAME}: layer ids: {e}") from None
    # Before 0.33.0 only V1 is patched (vLLM picks the runner in VllmConfig from 0.26.0).
    v2 = getattr(vllm_config, "use_v2_model_runner", None)
    if v2 is None:
        v2 = getattr(envs, "VLLM_USE_V2_MODEL_RUNNER", False)
    if not runs_model_runner_v2() and v2:
        raise ValueError(
            f"{CONNECTOR_NAME} works with vLLM's V1 GPU model runner on this vLLM: unset "
            "VLLM_USE_V2_MODEL_RUNNER (or set it to 0), or install vLLM 0.34.0, where "
            "extraction runs on Model Runner V2"
        )
    if vllm_config.cache_config.enable_prefix_caching:
        raise ValueError(
            f"{CONNECTOR_NAME} does not support prefix caching (cached prefixes have no hidden "
            "states): pass --no-enable-prefix-caching (LLM(..., enable_prefix_caching=False))"
        )
    return layer_ids
