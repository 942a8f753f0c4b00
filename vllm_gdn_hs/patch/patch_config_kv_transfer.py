"""Make the compile cache key see the hidden-states connector's layer ids.

Why: with ``HybridHiddenStatesConnector`` the target model returns aux hidden
states of the chosen layers, which changes the compiled graph. vLLM keys its
torch.compile cache on ``VllmConfig.compute_hash()``; with a speculative config
that key includes the aux layers, but the config patch drops the speculative
config, and ``KVTransferConfig.compute_hash`` has no factors. Without this, a
cache written by a plain run of the same model could be loaded for an
extraction run (or the reverse).

How: wraps ``KVTransferConfig.compute_hash``; for this connector the hash also
covers the connector name and its layer ids.

Upstream: not needed where the speculative config carries the layers. Remove
with the config patch. Source twin: ``patches/<vllm version>/0002-*.patch``.
"""

from __future__ import annotations

import hashlib

from vllm.config import KVTransferConfig

from vllm_gdn_hs import CONNECTOR_NAME
from vllm_gdn_hs.config import is_ours
from vllm_gdn_hs.patch import Patch

_orig_compute_hash = KVTransferConfig.compute_hash


def compute_hash(self: KVTransferConfig) -> str:
    base = _orig_compute_hash(self)
    if not is_ours(self):
        return base
    layers = list((self.kv_connector_extra_config or {}).get("layer_ids") or [])
    factors = f"{base}|{CONNECTOR_NAME}|aux_hidden_states={layers}"
    return hashlib.sha256(factors.encode()).hexdigest()


PATCH = Patch(KVTransferConfig, {"compute_hash": compute_hash})
