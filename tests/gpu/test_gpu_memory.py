"""GPU: extraction costs plain vLLM no KV cache: CUDA-graph memory and the warm-up's peak
activation, as vLLM itself reports them, within one KV cache block of plain's.

Run on a CUDA machine with the plugin installed (about 3 minutes on one H100):
    pytest -m gpu tests/gpu/test_gpu_memory.py -v -s
The 27B shape cut to 8 layers (benchmarks/workloads.py "27b-8": the 27B widths, so the same
per-token bytes of aux states and activations), dummy weights, vLLM's default GDN kernels, CUDA
graphs, the extensible KV cache, max_num_seqs 256, prefix caching off: plain vLLM, then ours
with its defaults, each in its own process through benchmarks/bench.py, which reads vLLM's
own lines ("... GiB for peak activation, and ... GiB for CUDAGraph memory", "Extended KV cache
to N blocks (X GiB)"). Records: VLLM_GDN_HS_RESULTS_DIR (default tests/results).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_graph_memory_and_peak_within_one_block_of_plain(tmp_path):
    results = tmp_path / "memory.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench.py"), "--shape", "27b-8"]
    cmd += ["--variants", "plain,ours", "--workloads", "16x512", "--gpu-memory-utilization", "0"]
    cmd += ["--max-num-seqs", "256", "--results", str(results), "--timeout", "400"]
    cmd += ["--out-dir", str(tmp_path / "hs"), "--log-dir", str(tmp_path / "logs")]
    cmd += ["--model-root", str(tmp_path / "models"), "--run", "gpu-memory-test"]
    subprocess.run(cmd, check=True, timeout=900)
    records = {r["variant"]: r for r in json.loads(results.read_text())["records"]}
    plain, ours = records["plain"], records["ours"]
    keys = ("cudagraph_gib", "peak_activation_gib", "kv_block_gib", "kv_cache_blocks")
    figures = {v: {k: r.get(k) for k in keys} for v, r in records.items()}
    folder = os.environ.get("VLLM_GDN_HS_RESULTS_DIR") or os.path.join(ROOT, "tests", "results")
    os.makedirs(folder, exist_ok=True)
    record = {k: plain.get(k) for k in ("date", "commit", "versions", "gpu")}
    record["gdn_prefill_backend"] = ours.get("gdn_prefill_backend")
    record["settings"] = "27b-8, CUDA graphs, extensible KV cache, max_num_seqs 256"
    record["figures"] = figures
    name = f"{time.strftime('%Y-%m-%d')}-gpu-memory.json"
    with open(os.path.join(folder, name), "w") as f:
        json.dump(record, f, indent=1)
    print(json.dumps(figures))
    block = plain["kv_block_gib"]
    assert block, figures
    assert ours["cudagraph_gib"] <= plain["cudagraph_gib"] + block, figures
    assert ours["peak_activation_gib"] <= plain["peak_activation_gib"] + block, figures
