"""vllm_gdn_hs.patch.extraction: what both runner patches share; CPU only, every release.

Run: python -m pytest tests/test_extraction.py -q   (no GPU, no network)
Covers: layer_order keeps the configured layer order; the connector's layer ids reach the
runner through vLLM's own config (no speculative config left, no drafter); runner setup.
"""

from __future__ import annotations

import harness
import pytest

from vllm_gdn_hs.patch.extraction import extraction_layer_ids, layer_order


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
    assert extraction_layer_ids(cfg) == [8, 1, 4]
    assert cfg.speculative_config is None  # no drafter, no draft tokens
    stock = harness.engine_config(hybrid_model, connector=harness.STOCK)
    assert extraction_layer_ids(stock) is None
    assert stock.speculative_config is not None
