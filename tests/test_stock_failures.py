"""The two stock vLLM 0.20.1 startup failures on a GDN hybrid model, and our fix; CPU only.

Run: python -m pytest tests/test_stock_failures.py -q (no GPU, no network;
the stock half runs in one fresh interpreter without our plugin, ~10 s).
Covers: stock vLLM + ExampleHiddenStatesConnector on the tiny hybrid Qwen3.5 fails with
default flags ("Hybrid KV cache manager is disabled ...") and with HMA forced on ("The page
size of the layer is not divisible ..."), exact class and message. The same two
configurations with our plugin and HybridHiddenStatesConnector build a KV cache config with
HMA on, GDN/attention groups only, no drafter layer, and as many blocks as the same model
without any speculative or connector config (hidden states take no KV cache capacity).
On vLLM 0.26.0, where stock starts on hybrid models, stock's cost shows instead: its hidden
states take KV cache blocks (fewer blocks than the same model without extraction).
"""

from __future__ import annotations

import json

import harness
import pytest
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

# vLLM 0.26.0 decides HMA per connector and keeps hidden states in a KV cache group of
# their own: stock starts on hybrid models there.
STOCK_STARTS = hasattr(KVConnectorFactory, "supports_hma_config")

CONFIGS = {"default flags": {}, "HMA forced on": {"disable_hybrid_kv_cache_manager": False}}

# One interpreter for both stock checks: vLLM's import is the slow part.
_STOCK = """
import json, sys
import harness
import vllm_gdn_hs.plugin
from vllm.config import VllmConfig
results = {}
for name, kw in json.loads(sys.argv[1]).items():
    try:
        cfg = harness.engine_config(sys.argv[2], connector=harness.STOCK, storage=sys.argv[3], **kw)
        results[name] = {"hma_off": cfg.scheduler_config.disable_hybrid_kv_cache_manager}
        results[name]["tokens"] = harness.kv_capacity(cfg, 1 << 30)[0]
        results[name]["error"] = None
    except Exception as e:
        results[name]["error"] = [type(e).__module__, type(e).__qualname__, str(e)]
results["plugin loaded"] = vllm_gdn_hs.plugin._registered
results["patched"] = hasattr(VllmConfig, "_vllm_gdn_hs_patched")
print("RESULT " + json.dumps(results))
"""


@pytest.fixture(scope="module")
def stock(run_python, hybrid_model, tmp_path_factory):
    import shlex

    args = [json.dumps(CONFIGS), hybrid_model, str(tmp_path_factory.mktemp("stock"))]
    code = f"import sys; sys.argv[1:] = {args!r}\n" + _STOCK
    proc = run_python(code, plugins=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (shlex.join(args), proc.stderr[-3000:])
    return json.loads(lines[-1][len("RESULT ") :])


def test_stock_process_has_no_plugin(stock):
    assert stock["plugin loaded"] is False
    assert stock["patched"] is False


@pytest.mark.skipif(STOCK_STARTS, reason="stock vLLM starts on hybrid models from 0.26.0")
def test_stock_default_flags_fails(stock):
    got = stock["default flags"]
    assert got["hma_off"] is True
    assert got["error"] == [
        "builtins",
        "ValueError",
        "Hybrid KV cache manager is disabled but failed to convert the KV cache specs to "
        "one unified type.",
    ]


@pytest.mark.skipif(STOCK_STARTS, reason="stock vLLM starts on hybrid models from 0.26.0")
def test_stock_hma_forced_on_fails(stock):
    got = stock["HMA forced on"]
    assert got["hma_off"] is False
    module, cls, msg = got["error"]
    assert (module, cls) == ("builtins", "NotImplementedError")
    assert msg.startswith("The page size of the layer is not divisible by the maximum page size.")


@pytest.fixture(scope="module")
def baseline(hybrid_model):
    """The same model without speculative decoding or a connector."""
    cfg = harness.engine_config(
        hybrid_model, connector=None, layer_ids=None, enable_prefix_caching=False
    )
    assert cfg.speculative_config is None and cfg.kv_transfer_config is None
    specs = harness.kv_cache_specs(cfg)
    return specs, harness.kv_cache_config(cfg, specs)


@pytest.mark.skipif(not STOCK_STARTS, reason="stock vLLM fails to start before 0.26.0")
@pytest.mark.parametrize("name", list(CONFIGS))
def test_stock_pays_kv_cache_for_hidden_states(name, stock, hybrid_model, tmp_path):
    got = stock[name]
    assert got["error"] is None and got["hma_off"] is False
    # Plain with prefix caching off, as ours runs (from 0.33.0 vLLM turns it on for hybrids,
    # and its mamba "align" mode then sizes the cache otherwise).
    plain = harness.engine_config(
        hybrid_model, connector=None, layer_ids=None, enable_prefix_caching=False
    )
    ours = harness.engine_config(hybrid_model, connector=harness.OURS, storage=str(tmp_path))
    plain_tokens = harness.kv_capacity(plain, 1 << 30)[0]
    ours_tokens = harness.kv_capacity(ours, 1 << 30)[0]
    # vLLM's "GPU KV cache size" for the same KV memory: stock gives up a share to hidden
    # states; ours none (its GPU memory is a step's hand-over, in the profiled peak).
    assert 0 < got["tokens"] < 0.5 * plain_tokens < ours_tokens == plain_tokens


@pytest.mark.parametrize("name", list(CONFIGS))
def test_ours_builds_with_hma_on(name, hybrid_model, baseline, tmp_path):
    base_specs, base_kcc = baseline
    cfg = harness.engine_config(
        hybrid_model, connector=harness.OURS, storage=str(tmp_path), **CONFIGS[name]
    )
    assert cfg.scheduler_config.disable_hybrid_kv_cache_manager is False
    specs = harness.kv_cache_specs(cfg)
    # No layer of the drafter has a spec: exactly the target model's layers.
    assert set(specs) == set(base_specs)
    kcc = harness.kv_cache_config(cfg, specs)
    kinds = [type(g.kv_cache_spec) for g in kcc.kv_cache_groups]
    assert set(kinds) == {MambaSpec, FullAttentionSpec}
    assert sorted(k.__name__ for k in kinds) == sorted(
        type(g.kv_cache_spec).__name__ for g in base_kcc.kv_cache_groups
    )
    grouped = sorted(n for g in kcc.kv_cache_groups for n in g.layer_names)
    assert grouped == sorted(base_specs)
    # Hidden states take no KV cache capacity.
    assert kcc.num_blocks == base_kcc.num_blocks > 0
    # And vLLM's scheduler starts on it, with our connector.
    sched = harness.scheduler(cfg, kcc)
    assert type(sched.connector).__name__ == harness.OURS
