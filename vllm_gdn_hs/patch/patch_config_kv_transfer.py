"""Make the compile cache key see the hidden-states connector's layer ids.

Why: returning the chosen layers' aux hidden states changes the compiled graph, and vLLM's
torch.compile cache key covers them only through the speculative config, which the config
patch drops: a plain run's cache could be loaded for an extraction run (or the reverse).

How: for this connector, ``KVTransferConfig.compute_hash`` (up to 0.33.0) or
``compile_factors()`` (0.34.0) also covers the connector name and its layer ids.

Upstream: not needed where the speculative config carries the layers. Remove with the config
patch. Twin: ``patches/*/0002-*.patch``.
"""

from __future__ import annotations

import hashlib

from vllm.config import KVTransferConfig

from vllm_gdn_hs.config import configured_layer_ids, is_ours
from vllm_gdn_hs.names import CONNECTOR_NAME
from vllm_gdn_hs.patch import Patch

# vLLM 0.34.0 keys the cache on each config's compile_factors(); earlier releases on a hash.
_FACTORS = hasattr(KVTransferConfig, "compile_factors")
_orig = KVTransferConfig.compile_factors if _FACTORS else KVTransferConfig.compute_hash


def compute_hash(self: KVTransferConfig) -> str:
    base = _orig(self)
    if not is_ours(self):
        return base
    factors = f"{base}|{CONNECTOR_NAME}|aux_hidden_states={configured_layer_ids(self)}"
    return hashlib.sha256(factors.encode()).hexdigest()


def compile_factors(self: KVTransferConfig) -> dict[str, object]:
    factors = _orig(self)
    if not is_ours(self):
        return factors
    ours = {"kv_connector": CONNECTOR_NAME, "aux_hidden_states": configured_layer_ids(self)}
    return {**factors, **ours}


PATCH = Patch(
    KVTransferConfig,
    {"compile_factors": compile_factors} if _FACTORS else {"compute_hash": compute_hash},
)
