"""Default prefix caching to off when HybridHiddenStatesConnector is used.

Why: a prefix-cache hit skips the forward pass of the cached tokens, so the file would miss
their rows. The connector refuses ``enable_prefix_caching=True``; turning the default off
makes swapping the connector name the whole migration.

How: after ``EngineArgs._set_default_chunked_prefill_and_prefix_caching_args``, an unset
``enable_prefix_caching`` becomes False when the KV transfer config names the connector.

Upstream: none; vLLM's own hidden-states connector has the same limitation. Remove when the
connector handles cached prefixes. Twin: ``patches/*/0003-*.patch``.
"""

from __future__ import annotations

from vllm.engine.arg_utils import EngineArgs

from vllm_gdn_hs.config import is_ours
from vllm_gdn_hs.names import init_logger
from vllm_gdn_hs.patch import Patch

logger = init_logger(__name__)

_orig = EngineArgs._set_default_chunked_prefill_and_prefix_caching_args


def _set_default_chunked_prefill_and_prefix_caching_args(self: EngineArgs, *args, **kwargs):
    unset = self.enable_prefix_caching is None
    result = _orig(self, *args, **kwargs)
    if unset and is_ours(self.kv_transfer_config):
        if self.enable_prefix_caching:
            logger.info("prefix caching off (cached prefixes have no hidden states)")
        self.enable_prefix_caching = False
    return result


_NAME = "_set_default_chunked_prefill_and_prefix_caching_args"
PATCH = Patch(EngineArgs, {_NAME: _set_default_chunked_prefill_and_prefix_caching_args})
