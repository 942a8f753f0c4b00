"""GPU, two GPUs: tensor parallelism writes the same files as one GPU (rank 0 writes).

Run on the two-GPU machine with the plugin installed:
    pytest -m gpu tests/test_gpu_tp.py -v -s
Skipped with fewer than two visible GPUs.
"""

from __future__ import annotations

import os

import pytest
import torch
from test_gpu_extract import BASE, LAYERS, MANY, RESULTS, _generate, engine, save_results  # noqa: F401

from vllm_gdn_hs.reader import load_hidden_states
from vllm_gdn_hs.reference import relative_errors
from vllm_gdn_hs.testing import build_tiny_hybrid

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
]


def _files(outputs):
    return [
        load_hidden_states(o.kv_transfer_params["hidden_states_path"], timeout=30) for o in outputs
    ]


def test_tp2_matches_tp1(tmp_path):
    model = build_tiny_hybrid(str(tmp_path / "model"))
    prompts = BASE + MANY[:16]
    files = {}
    for tp in (1, 2):
        storage = tmp_path / f"tp{tp}"
        with engine(model, "hybrid", str(storage), tensor_parallel_size=tp) as llm:
            files[tp] = _files(_generate(llm, prompts))
        # Only rank 0 writes: exactly one file (and no stray temp file) per request.
        names = sorted(os.listdir(storage))
        assert len([n for n in names if n.endswith(".safetensors")]) == len(prompts), names
        assert not [n for n in names if ".tmp-" in n], names
    worst = 0.0
    for a, b in zip(files[1], files[2], strict=True):
        assert torch.equal(a["token_ids"], b["token_ids"])
        worst = max(worst, *relative_errors(b["hidden_states"], a["hidden_states"]))
    RESULTS["tp2_vs_tp1"] = {"files": len(prompts), "max_rel_diff": round(worst, 5)}
    print(f"\nTP=2 vs TP=1: {len(prompts)} files, max relative difference {worst:.5f}")
    assert worst <= 0.01
