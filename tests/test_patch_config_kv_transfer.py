"""vllm_gdn_hs.patch.patch_config_kv_transfer: the compile cache key covers the layer ids; CPU.

Run: python -m pytest tests/test_patch_config_kv_transfer.py -q   (no GPU, no network)
vLLM keys its torch.compile cache on VllmConfig.compute_hash() (0.34.0: on the hash of
VllmConfig.compile_factors()); the aux hidden-state outputs
change the graph, so extraction runs must not share a key with plain runs or with each other.
"""

from __future__ import annotations

import harness
from vllm.config import KVTransferConfig

from vllm_gdn_hs.patch import patch_config_kv_transfer as patch_mod


def test_patch_wraps_what_vllm_keys_on():
    # vLLM 0.34.0 builds the key from compile_factors(); earlier releases from compute_hash().
    if patch_mod._FACTORS:
        assert KVTransferConfig.compile_factors is patch_mod.compile_factors
    else:
        assert KVTransferConfig.compute_hash is patch_mod.compute_hash


def compile_cache_key(cfg) -> str:
    """The key vLLM's compile cache uses for a config (0.34.0: the hash of its factors)."""
    if hasattr(cfg, "compute_hash"):
        return cfg.compute_hash()
    from vllm.compilation.caching import compute_env_and_config_hashes

    return compute_env_and_config_hashes(cfg)[1]


def test_vllm_hash_differs_by_layer_ids_and_from_plain(hybrid_model):
    def key(**kw):
        return compile_cache_key(harness.engine_config(hybrid_model, **kw))

    plain = key(connector=None, layer_ids=None)
    a = key(connector=harness.OURS, layer_ids=(1, 4, 8))
    b = key(connector=harness.OURS, layer_ids=(1, 4, 7))
    assert len({plain, a, b}) == 3
    assert a == key(connector=harness.OURS, layer_ids=(1, 4, 8))  # stable


def test_other_connectors_hash_as_in_vllm():
    cfg = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both")
    wrapped = patch_mod.compile_factors if patch_mod._FACTORS else patch_mod.compute_hash
    assert wrapped(cfg) == patch_mod._orig(cfg)
