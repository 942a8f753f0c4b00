"""vllm_gdn_hs.patch.patch_config_vllm: HMA on, no speculative decoding for our connector; CPU.

Run: python -m pytest tests/test_patch_config_vllm.py -q (no GPU, no network).
Covers, on real VllmConfigs of the tiny hybrid model built through EngineArgs: HMA stays on
for HybridHiddenStatesConnector when the user said nothing; an explicit choice is kept;
connectors without SupportsHMA still get vLLM's own rule (HMA off); an extract_hidden_states
speculative config becomes the connector's layer ids (no speculation runs); and the patch
wraps the original __post_init__ rather than replacing it.
"""

from __future__ import annotations

import harness
import pytest
from vllm.config import KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

from vllm_gdn_hs.patch import patch_config_vllm


def test_patch_wraps_post_init():
    assert VllmConfig.__post_init__ is patch_config_vllm.__post_init__
    assert patch_config_vllm._orig_post_init is not patch_config_vllm.__post_init__
    assert patch_config_vllm._orig_post_init.__qualname__ == "VllmConfig.__post_init__"


def test_hma_kept_on_for_our_connector(hybrid_model):
    cfg = harness.engine_config(hybrid_model, connector=harness.OURS)
    assert cfg.scheduler_config.disable_hybrid_kv_cache_manager is False
    kcc = harness.kv_cache_config(cfg)
    # Several KV cache groups: the hybrid manager is really in use.
    kinds = sorted(type(g.kv_cache_spec).__name__ for g in kcc.kv_cache_groups)
    assert kinds == ["FullAttentionSpec", "MambaSpec", "MambaSpec", "MambaSpec"]


def test_hma_kept_on_for_our_connector_dense(dense_model):
    cfg = harness.engine_config(dense_model, connector=harness.OURS)
    assert cfg.scheduler_config.disable_hybrid_kv_cache_manager is False
    (group,) = harness.kv_cache_config(cfg).kv_cache_groups
    assert isinstance(group.kv_cache_spec, FullAttentionSpec)
    assert not isinstance(group.kv_cache_spec, MambaSpec)


def test_explicit_disable_is_respected(hybrid_model):
    cfg = harness.engine_config(
        hybrid_model, connector=harness.OURS, disable_hybrid_kv_cache_manager=True
    )
    assert cfg.scheduler_config.disable_hybrid_kv_cache_manager is True
    # ...and vLLM then refuses the hybrid model, in its own words (0.33.0 reworded them).
    refusal = "Hybrid KV cache manager is disabled|Failed to promote local KV cache specs"
    with pytest.raises(ValueError, match=refusal):
        harness.kv_cache_config(cfg)


def _supports_hma(connector: str) -> bool:
    cls = KVConnectorFactory.get_connector_class(
        KVTransferConfig(kv_connector=connector, kv_role="kv_both")
    )
    return supports_hma(cls)


# vLLM's ExampleHiddenStatesConnector subclasses SupportsHMA from 0.26.0 on.
@pytest.mark.parametrize(
    "connector", [c for c in ("ExampleConnector", harness.STOCK) if not _supports_hma(c)]
)
def test_connector_without_supports_hma_gets_hma_off(hybrid_model, connector):
    cfg = harness.engine_config(hybrid_model, connector=connector)
    assert cfg.scheduler_config.disable_hybrid_kv_cache_manager is True


def test_without_connector_vllm_decides(hybrid_model):
    cfg = harness.engine_config(hybrid_model, connector=None, layer_ids=None)
    assert cfg.kv_transfer_config is None
    assert cfg.scheduler_config.disable_hybrid_kv_cache_manager is False


def test_unknown_connector_is_left_to_vllm():
    cfg = VllmConfig.__new__(VllmConfig)
    cfg.kv_transfer_config = KVTransferConfig(kv_connector="NoSuchConnector", kv_role="kv_both")
    assert patch_config_vllm._connector_supports_hma(cfg) is False


def test_speculative_config_becomes_layer_ids(hybrid_model):
    """speculators' extract_hidden_states flags carry only the layer ids: no speculation runs."""
    cfg = harness.engine_config(hybrid_model, connector=harness.OURS, layer_ids=(8, 1, 4))
    assert cfg.speculative_config is None
    assert cfg.kv_transfer_config.kv_connector_extra_config["layer_ids"] == [8, 1, 4]
    # So the scheduler plans no draft tokens, as for plain vLLM.
    assert (
        cfg.scheduler_config.max_num_batched_tokens
        == harness.engine_config(
            hybrid_model, connector=None, layer_ids=None
        ).scheduler_config.max_num_batched_tokens
    )


def test_same_layer_ids_given_twice_are_fine(hybrid_model):
    args = harness.engine_args(hybrid_model, connector=harness.OURS, layer_ids=(1, 8))
    args.kv_transfer_config["kv_connector_extra_config"]["layer_ids"] = [1, 8]
    assert args.create_engine_config().kv_transfer_config.kv_connector_extra_config[
        "layer_ids"
    ] == [1, 8]


def test_stock_connector_keeps_its_speculative_config(hybrid_model):
    cfg = harness.engine_config(hybrid_model, connector=harness.STOCK, layer_ids=(1, 8))
    assert cfg.speculative_config is not None
    assert cfg.speculative_config.method == "extract_hidden_states"
    assert "layer_ids" not in cfg.kv_transfer_config.kv_connector_extra_config


def test_data_parallel_config_keeps_extraction(hybrid_model):
    # `--data-parallel-size N` (the README's 8-GPU example): every engine gets the same
    # connector config, HMA on and the layer ids, and no speculative decoding.
    cfg = harness.engine_config(hybrid_model, connector=harness.OURS, data_parallel_size=2)
    assert cfg.parallel_config.data_parallel_size == 2
    assert cfg.scheduler_config.disable_hybrid_kv_cache_manager is False
    assert cfg.kv_transfer_config.kv_connector_extra_config["layer_ids"] == [1, 4, 8]
    assert cfg.speculative_config is None
