"""Keep the hybrid KV cache manager (HMA) on for connectors that support it.

Why: vLLM 0.20.1 turns HMA off whenever ``--kv-transfer-config`` is set and
the user expressed no preference (``VllmConfig.__post_init__``), even for a
connector that subclasses ``SupportsHMA``. A GDN hybrid model (Qwen3.5/3.6)
cannot start without HMA: "Hybrid KV cache manager is disabled but failed to
convert the KV cache specs to one unified type".

How: before the original ``__post_init__`` runs, if the user left
``disable_hybrid_kv_cache_manager`` unset, the configured connector class
subclasses ``SupportsHMA`` and the platform supports HMA, set it to False.
Every other case goes through vLLM's own rules unchanged.

Upstream: later vLLM releases decide HMA per connector the same way
(``supports_hma(connector_cls)``). Remove this patch when the supported vLLM
releases all do. Source twin: ``patches/0.20.1/0001-*.patch``.
"""

from __future__ import annotations

from vllm.config import VllmConfig

from vllm_gdn_hs.patch import Patch

_orig_post_init = VllmConfig.__post_init__


def _connector_supports_hma(vllm_config: VllmConfig) -> bool:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma

    try:
        cls = KVConnectorFactory.get_connector_class(vllm_config.kv_transfer_config)
    except Exception:  # unknown connector: vLLM reports it later, in its own words
        return False
    return supports_hma(cls)


def __post_init__(self: VllmConfig) -> None:
    from vllm.platforms import current_platform

    if (
        self.kv_transfer_config is not None
        and self.kv_transfer_config.kv_connector is not None
        and self.scheduler_config.disable_hybrid_kv_cache_manager is None
        and current_platform.support_hybrid_kv_cache()
        and (self.model_config is None or self.model_config.attention_chunk_size is None)
        and _connector_supports_hma(self)
    ):
        self.scheduler_config.disable_hybrid_kv_cache_manager = False
    _orig_post_init(self)


PATCH = Patch(VllmConfig, {"__post_init__": __post_init__})
