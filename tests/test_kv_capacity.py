"""KV cache capacity with extraction vs plain vLLM, at the Qwen3.6-27B shape, from vLLM's own
sizing code (real layer specs on the meta device, get_kv_cache_configs); CPU only.

Run: python -m pytest tests/test_kv_capacity.py -q   (no GPU, no network)
The bar: the same capacity as plain at every context length. Extraction adds no KV cache
spec and holds no GPU memory between steps (a step's hand-over is in the peak vLLM profiles,
which bench.py measures on the GPU). (When extraction ran as speculative decoding, the extra
GDN state block per request cost 19% at 8k context.)
"""

from __future__ import annotations

import json
import os

import harness
import pytest

from vllm_gdn_hs.cli.model_info import packaged_config_path

HERE = os.path.dirname(os.path.abspath(__file__))
LAYERS = [1, 16, 31, 46, 61, 64]
KV_MEMORY = int(71.72 * 2**30)  # plain vLLM 0.20.1, 27B, H200 at 0.9 (benchmarks/results)
STEP_TOKENS = 16384  # vLLM's max_num_batched_tokens for LLM(...) on an H200


@pytest.fixture(scope="module")
def model_27b(tmp_path_factory) -> str:
    with open(packaged_config_path("Qwen/Qwen3.6-27B")) as f:
        cfg = json.load(f)
    cfg.pop("_comment", None)
    path = tmp_path_factory.mktemp("qwen3.6-27b")
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


def _tokens(model: str, max_model_len: int, extract: bool) -> int:
    kw = dict(
        enable_prefix_caching=False, max_model_len=max_model_len, max_num_batched_tokens=STEP_TOKENS
    )
    if extract:
        kw.update(connector=harness.OURS, layer_ids=LAYERS)
    else:
        kw.update(connector=None, layer_ids=None)
    return harness.kv_capacity(harness.engine_config(model, **kw), KV_MEMORY)[0]


@pytest.mark.parametrize(
    "max_model_len", [pytest.param(8448, marks=pytest.mark.smoke), 32768, 262144]
)
def test_capacity_is_plains(model_27b, max_model_len):
    plain = _tokens(model_27b, max_model_len, extract=False)
    ours = _tokens(model_27b, max_model_len, extract=True)
    assert ours == plain, f"{ours:,} vs {plain:,} tokens ({ours / plain:.1%})"
