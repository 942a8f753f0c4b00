"""Hidden states without speculative decoding, and HMA on, for the hidden-states connector.

Why: vLLM 0.20.1 turns the hybrid KV cache manager (HMA) off for any ``--kv-transfer-config`` the
user set no preference for, even a ``SupportsHMA`` connector's, and a GDN hybrid model cannot start
without HMA. speculators asks for hidden states through the ``extract_hidden_states`` speculative
method, which costs a draft layer in the KV cache, one extra GDN state block per request (a fifth of
the KV cache at 27B, 8k context) and a wasted draft token each decode step.

How: before the original ``VllmConfig.__post_init__``, for our connector, an
``extract_hidden_states`` speculative config is dropped, its layer ids kept in
``kv_connector_extra_config["layer_ids"]``. For any ``SupportsHMA`` connector, an unset
``disable_hybrid_kv_cache_manager`` becomes False where the platform supports HMA (not from 0.26.0,
where vLLM decides per connector). After the original, the connector's startup checks run, so a bad
configuration fails before any model loads. Where vLLM may pick Model Runner V2 (0.22.0 to 0.33.0)
the connector is listed in ``_get_v2_model_runner_unsupported_features``, so vLLM keeps V1 and says
why, unless ``VLLM_USE_V2_MODEL_RUNNER=1`` asks for V2 where it is patched
(``version.MODEL_RUNNER_V2_FROM``). 0.34.0 has neither the method nor a choice.

Upstream: no "extract hidden states without speculation" mode yet. Remove when there is one. Source
twins: ``patches/<vllm version>/0001-*.patch``.
"""

from __future__ import annotations

from vllm.config import VllmConfig

from vllm_gdn_hs.config import extra_config, is_ours
from vllm_gdn_hs.names import CONNECTOR_NAME, init_logger
from vllm_gdn_hs.patch import Patch
from vllm_gdn_hs.version import model_runner_v2_asked_for

logger = init_logger(__name__)

_orig_post_init = VllmConfig.__post_init__
_orig_v2_unsupported = getattr(VllmConfig, "_get_v2_model_runner_unsupported_features", None)


def _connector_supports_hma(vllm_config: VllmConfig) -> bool:
    """Where vLLM does not decide it per connector itself (before 0.26.0)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma

    if hasattr(KVConnectorFactory, "supports_hma_config"):
        return False  # vLLM decides
    try:
        cls = KVConnectorFactory.get_connector_class(vllm_config.kv_transfer_config)
    except Exception:  # unknown connector: vLLM reports it later, in its own words
        return False
    return supports_hma(cls)


def take_layer_ids_from_speculative_config(vllm_config: VllmConfig) -> None:
    """extract_hidden_states speculative config -> kv_connector_extra_config["layer_ids"]."""
    spec = vllm_config.speculative_config
    if spec is None or spec.method != "extract_hidden_states":
        return  # no speculation, or another method: the connector says what is wrong
    hf_config = spec.draft_model_config.hf_config
    ids = list(getattr(hf_config, "eagle_aux_hidden_state_layer_ids", None) or [])
    extra = extra_config(vllm_config.kv_transfer_config)  # filled in here: the dict itself
    if "layer_ids" in extra and list(extra["layer_ids"]) != ids:
        raise ValueError(
            f"{CONNECTOR_NAME}: layer ids given twice and different: {ids} in "
            f"--speculative-config, {list(extra['layer_ids'])} in kv_connector_extra_config; "
            "give them once"
        )
    extra["layer_ids"] = ids
    vllm_config.speculative_config = None
    logger.info(
        "extracting layers %s from the target model, without speculative "
        "decoding (no draft tokens, no drafter KV cache)",
        ids,
    )


def __post_init__(self: VllmConfig) -> None:
    from vllm.platforms import current_platform

    kv = self.kv_transfer_config
    if is_ours(kv):
        take_layer_ids_from_speculative_config(self)
    if (
        kv is not None
        and kv.kv_connector is not None
        and self.scheduler_config.disable_hybrid_kv_cache_manager is None
        and current_platform.support_hybrid_kv_cache()
        and (self.model_config is None or self.model_config.attention_chunk_size is None)
        and _connector_supports_hma(self)
    ):
        self.scheduler_config.disable_hybrid_kv_cache_manager = False
    _orig_post_init(self)
    if is_ours(kv):
        from vllm_gdn_hs.patch.shutdown import set_window

        set_window(self)  # the engine core's time to drain at SIGINT/SIGTERM
        if self.model_config is not None:
            from vllm_gdn_hs.connector.checks import validate_vllm_config  # the connector: lazily

            validate_vllm_config(self)  # fail now, not after the model is loaded


def _get_v2_model_runner_unsupported_features(self: VllmConfig) -> list[str]:
    unsupported = _orig_v2_unsupported(self)  # type: ignore[misc]  # patched only where set
    if is_ours(self.kv_transfer_config) and not model_runner_v2_asked_for():
        unsupported.append(CONNECTOR_NAME)
    return unsupported


_ATTRS: dict[str, object] = {"__post_init__": __post_init__}
if _orig_v2_unsupported is not None:
    _ATTRS["_get_v2_model_runner_unsupported_features"] = _get_v2_model_runner_unsupported_features
PATCH = Patch(VllmConfig, _ATTRS)
