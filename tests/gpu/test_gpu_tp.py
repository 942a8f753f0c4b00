"""GPU, two GPUs: tensor parallelism writes the same files as one GPU (rank 0 writes), and
data parallelism behind `vllm-gdn-hs launch` writes every request's file from either engine.

Asserted: one complete file per request and no temp file (only rank 0 writes), the
same token ids as TP=1, and TP=1 and TP=2 each against HF fp32 (vllm_gdn_hs.verify.reference:
every file within the per-file bound, each run's errors pooled over its files within the
bar), not against each other. Recorded: both runs' pooled errors per layer, of ours and
of HF bf16, and the TP=2 vs TP=1 difference
per layer. On the H200 it was 0.018 at worst (2026-11-30), of the size of each run's
own bf16 error against HF bf16 (0.018-0.019): TP=2 splits every matmul and adds an
all-reduce, so the two runs round differently. A wrong or shifted row would differ by ~1.

Run on the two-GPU machine with the plugin installed:
    pytest -m gpu tests/gpu/test_gpu_tp.py -v -s
The data-parallel test also keeps its figures in VLLM_GDN_HS_LAUNCH_RESULTS.
Skipped with fewer than two visible GPUs.
"""

from __future__ import annotations

import os
import random
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from test_gpu_extract import (  # noqa: F401
    BASE,
    LAYERS,
    MANY,
    RESULTS,
    _generate,
    assert_pooled,
    describe,
    engine,
    models,
    pooled_figures,
    reference,
    save_results,
)
from test_gpu_launch import RESULTS as LAUNCH_RESULTS
from test_gpu_launch import (  # noqa: F401
    _check,
    _post,
    _run_figures,
    _save_results,
    _serve,
    hf,
    tiny_model,
)

from vllm_gdn_hs.files import load_hidden_states
from vllm_gdn_hs.verify.reference import describe_pooled, relative_errors, worst_by_layer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
]


def _files(outputs):
    return [
        load_hidden_states(o.kv_transfer_params["hidden_states_path"], timeout=30) for o in outputs
    ]


def test_tp2_matches_tp1(models, reference, tmp_path):  # noqa: F811 (fixtures)
    prompts = BASE + MANY[:16]
    files = {}
    for tp in (1, 2):
        storage = tmp_path / f"tp{tp}"
        with engine(models["hybrid"], "hybrid", str(storage), tensor_parallel_size=tp) as llm:
            files[tp] = _files(_generate(llm, prompts))
        # Only rank 0 writes: exactly one file (and no stray temp file) per request.
        names = sorted(os.listdir(storage))
        assert len([n for n in names if n.endswith(".safetensors")]) == len(prompts), names
        assert not [n for n in names if ".tmp-" in n], names
    for a, b in zip(files[1], files[2], strict=True):
        assert torch.equal(a["token_ids"], b["token_ids"])
    ref, checks, pooled = reference["hybrid"], {}, {}
    for tp in (1, 2):  # two runs, each judged against HF fp32 on its own
        ref.reset()
        checks[tp] = [ref.check(f, p) for f, p in zip(files[tp], prompts, strict=True)]
        pooled[tp] = ref.pooled()
    diffs = [
        relative_errors(b["hidden_states"], a["hidden_states"])
        for a, b in zip(files[1], files[2], strict=True)
    ]
    diff = torch.tensor(diffs).amax(0).tolist()  # max per layer over the prompts
    vs_hf = {
        f"tp{tp}": {"pooled_vs_fp32": pooled_figures(pooled[tp]), **worst_by_layer(c)}
        for tp, c in checks.items()
    }
    RESULTS["tp2_vs_tp1"] = {
        "files": len(prompts),
        "layers": LAYERS["hybrid"],
        "max_rel_diff_by_layer": [round(x, 5) for x in diff],
        "vs_hf_fp32": vs_hf,
    }
    print(
        f"\nTP=2 vs TP=1: {len(prompts)} files, max relative difference by layer "
        f"{RESULTS['tp2_vs_tp1']['max_rel_diff_by_layer']} (issue bar 0.01: "
        f"{'met' if max(diff) <= 0.01 else 'missed'}; recorded, not asserted)"
        + "".join(
            f"\nTP={tp}: {describe_pooled(pooled[tp])}\n  one file at worst: "
            f"{describe(worst_by_layer(checks[tp]))}"
            for tp in (1, 2)
        )
    )
    problems = {
        tp: [(len(p), c["problems"]) for p, c in zip(prompts, cs, strict=True) if c["problems"]]
        for tp, cs in checks.items()
    }
    assert not problems[1] and not problems[2], problems
    for tp in (1, 2):
        assert_pooled(f"TP={tp}", pooled[tp])


def test_data_parallel(tmp_path, tiny_model, hf):  # noqa: F811 (fixtures)
    """`--data-parallel-size 2`: two engines, one per GPU, each with its own connector and
    writer, behind one API server. Concurrent requests reach both; every file is complete,
    in the one folder, and matches HF."""
    rng = random.Random(2)
    prompts = [[rng.randrange(0, 1000) for _ in range(rng.randrange(1, 800))] for _ in range(24)]
    hf.reset()  # this test's files are one run
    with _serve(tmp_path, tiny_model, "--data-parallel-size", "2") as srv:

        def ask(prompt):
            body = {"model": tiny_model, "prompt": prompt, "max_tokens": 1}
            return _post(srv["url"] + "/v1/completions", body)["kv_transfer_params"]

        with ThreadPoolExecutor(len(prompts)) as pool:
            paths = [p["hidden_states_path"] for p in pool.map(ask, prompts)]
        assert len(set(paths)) == len(prompts), "two requests got the same file"
        checks = [
            _check(hf, p, path, f"dp request {i}")
            for i, (p, path) in enumerate(zip(prompts, paths, strict=True))
        ]
        names = os.listdir(srv["storage"])
        assert sorted(n for n in names if n.endswith(".safetensors")) == sorted(
            os.path.basename(p) for p in paths
        ), names
        assert not [n for n in names if ".tmp-" in n], names
    # Each engine writes its own share: its writer's shutdown line says how many files.
    log = srv["log"].read_text()
    written = [
        int(n) for n in re.findall(r"HybridHiddenStatesConnector: shut down; (\d+) files", log)
    ]
    LAUNCH_RESULTS["data_parallel"] = {
        **_run_figures(hf, checks, "data parallel 2"),
        "files_per_engine": written,
    }
    _save_results()  # kept even if the checks below fail
    print(f"\ndata parallel 2: files per engine {written}")
    assert_pooled("data parallel 2", hf.pooled())
    assert len(written) == 2 and min(written) > 0 and sum(written) == len(prompts), (
        f"files per engine {written}: both engines should write, {len(prompts)} in all\n"
        + log[-3000:]
    )
