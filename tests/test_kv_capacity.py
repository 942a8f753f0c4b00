"""KV cache capacity with extraction vs plain vLLM, at the Qwen3.6-27B shape, from vLLM's own
sizing code (real layer specs on the meta device, get_kv_cache_configs); CPU only.

Run: python -m pytest tests/test_kv_capacity.py -q   (no GPU, no network)
The bar: >= 95% of plain at every context length. Extraction's KV memory is the same budget
less the runner's one-step hidden-state buffers, which the runner patch counts into vLLM's
memory budget. (When extraction ran as speculative decoding, the extra GDN state block per
request cost 19% at 8k context.)
"""

from __future__ import annotations

import json
import os

import harness
import pytest

from vllm_gdn_hs.patch.patch_worker_gpu_model_runner import buffer_bytes

HERE = os.path.dirname(os.path.abspath(__file__))
LAYERS = [1, 16, 31, 46, 61, 64]
KV_MEMORY = int(71.72 * 2**30)  # plain vLLM 0.20.1, 27B, H200 at 0.9 (benchmarks/results)
STEP_TOKENS = 16384  # vLLM's max_num_batched_tokens for LLM(...) on an H200


@pytest.fixture(scope="module")
def model_27b(tmp_path_factory) -> str:
    with open(os.path.join(HERE, "..", "benchmarks", "qwen3.6-27b-config.json")) as f:
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
    tokens, _, held = harness.kv_capacity(harness.engine_config(model, **kw), KV_MEMORY)
    assert (held > 0) == extract
    return tokens


@pytest.mark.parametrize(
    "max_model_len", [pytest.param(8448, marks=pytest.mark.smoke), 32768, 262144]
)
def test_capacity_at_least_95_percent_of_plain(model_27b, max_model_len):
    plain = _tokens(model_27b, max_model_len, extract=False)
    ours = _tokens(model_27b, max_model_len, extract=True)
    assert ours >= 0.95 * plain, f"{ours:,} vs {plain:,} tokens ({ours / plain:.1%})"


def test_buffers_are_one_step_of_rows(model_27b):
    cfg = harness.engine_config(
        model_27b, connector=harness.OURS, layer_ids=LAYERS, max_num_batched_tokens=STEP_TOKENS
    )
    # 16,384 tokens x 6 layers x 5,120 x 2 B + 16,384 int64 positions: 0.94 GiB.
    assert buffer_bytes(cfg) == 16384 * 6 * 5120 * 2 + 16384 * 8
