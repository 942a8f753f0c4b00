"""docs/scale.md's on-paper figures are benchmarks/scale_on_paper.py's, and those are vLLM's own;
CPU only.

Run: python -m pytest tests/test_scale_on_paper.py -q   (no GPU, no network; about two minutes:
the recomputation builds Qwen3-Next-80B-A3B's and Qwen3.6-27B's layers on the meta device)
Covers: docs/scale.md holds the tables the script renders from its record
(benchmarks/results/scale_on_paper.json) and the 27B cross-check's figures; the record agrees
with the published config's arithmetic (attention KV and hidden-state bytes a token, ours'
KV cache is plain's); recomputed with the installed vLLM, the record comes out the same (on the
release it names).
"""

from __future__ import annotations

import os

import harness  # noqa: F401  (first: vLLM's CPU platform, or a module-level skip on a GPU)
import pytest
import scale_on_paper  # benchmarks/ (pytest's pythonpath, pyproject.toml)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results", "scale_on_paper.json")
NEXT = "Qwen/Qwen3-Next-80B-A3B-Instruct"
RECORDS = {r["model"]: r for r in scale_on_paper.load(RESULTS)}


def test_doc_holds_the_records_figures():
    with open(os.path.join(REPO, "docs", "scale.md")) as f:
        doc = f.read()
    assert scale_on_paper.markdown(RECORDS[NEXT]) in doc
    row = RECORDS["Qwen/Qwen3.6-27B"]["capacity"][0]
    plain, upstream = row["plain"]["tokens"], row["upstream"]["tokens"]
    assert f"{plain:,} and {upstream:,} ({upstream / plain:.1%})" in doc


def test_the_record_is_the_published_configs_arithmetic():
    cfg, rec = scale_on_paper.model_config(NEXT), RECORDS[NEXT]
    assert rec["layers"] == [2, 24, 45, 48]  # the launcher's defaults for 48 layers
    n_attention = cfg["num_hidden_layers"] // cfg["full_attention_interval"]
    attention = n_attention * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 2  # K, V; bf16
    for row in rec["capacity"]:
        kinds = row["plain"]["kinds"]
        assert kinds["attention"]["real_bytes"] // kinds["attention"]["block_size"] == attention
        assert kinds["state"]["layers"] == cfg["num_hidden_layers"] - n_attention
        hs = row["upstream"]["kinds"]["hidden_states"]
        assert hs["real_bytes"] // hs["block_size"] == rec["hidden_states_bytes"]["bf16"]
        assert rec["hidden_states_bytes"]["bf16"] == 4 * cfg["hidden_size"] * 2
        # ours adds no KV cache spec: vLLM plans plain's KV cache
        assert row["ours"] == row["plain"]


@pytest.mark.parametrize("model", sorted(RECORDS))
def test_recomputed_with_vllm_the_record_is_the_same(model):
    import vllm

    rec = RECORDS[model]
    if vllm.__version__ != rec["vllm"]:
        pytest.skip(f"the record is vLLM {rec['vllm']}'s; this is {vllm.__version__}")
    lens = [row["max_model_len"] for row in rec["capacity"]]
    again = scale_on_paper.compute(model, rec["layers"], lens, rec["kv_memory_gib"])
    assert {**again, "date": rec["date"]} == rec
