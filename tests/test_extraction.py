"""vllm_gdn_hs.patch.extraction: what both runner patches share; CPU only, every release.

Run: python -m pytest tests/test_extraction.py -q   (no GPU, no network)
Covers: layer_order keeps the configured layer order; the connector's layer ids reach the
runner through vLLM's own config (no speculative config left, no drafter); runner setup keeps
what is ours under one prefixed attribute (vLLM's own ``use_aux_hidden_state_outputs`` aside).
"""

from __future__ import annotations

import harness
import pytest

from vllm_gdn_hs.config import configured_layer_ids, is_ours
from vllm_gdn_hs.patch.extraction import RUNNER_ATTR, extraction, layer_order, set_up_extraction


@pytest.mark.parametrize(
    "ids, order",
    [
        ([16, 1, 64], [1, 0, 2]),
        ([1, 16, 64], [0, 1, 2]),
        ([64, 16, 1], [2, 1, 0]),
        ([8, 2, 5, 4], [3, 0, 2, 1]),
    ],
)
def test_layer_order(ids, order):
    got = layer_order(ids)
    assert got == order
    assert [sorted(ids)[i] for i in got] == ids


def test_layer_ids_reach_the_runner_through_the_config(hybrid_model):
    cfg = harness.engine_config(hybrid_model, connector=harness.OURS, layer_ids=(8, 1, 4))
    assert configured_layer_ids(cfg.kv_transfer_config) == [8, 1, 4]
    assert cfg.speculative_config is None  # no drafter, no draft tokens
    stock = harness.engine_config(hybrid_model, connector=harness.STOCK)
    assert not is_ours(stock.kv_transfer_config)
    assert stock.speculative_config is not None


def test_the_runner_keeps_one_attribute_of_ours(hybrid_model):
    import vllm_gdn_hs.plugin
    from vllm_gdn_hs.connector import HybridHiddenStatesConnector

    vllm_gdn_hs.plugin.register()  # what vLLM's plugin loader does in every process
    cfg = harness.engine_config(hybrid_model, connector=harness.OURS, layer_ids=(8, 1, 4))
    runner = type("Runner", (), {})()
    set_up_extraction(runner, cfg)
    assert set(vars(runner)) == {RUNNER_ATTR, "use_aux_hidden_state_outputs"}
    ours = extraction(runner)
    assert ours is not None and (ours.layer_ids, ours.order) == ([8, 1, 4], [2, 0, 1])
    assert ours.connector_class is HybridHiddenStatesConnector
    assert ours.sink is None and ours.connector is None
    stock = type("Runner", (), {})()
    set_up_extraction(stock, harness.engine_config(hybrid_model, connector=harness.STOCK))
    assert extraction(stock) is None and set(vars(stock)) == {RUNNER_ATTR}
