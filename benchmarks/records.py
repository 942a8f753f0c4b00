"""Results JSON files (read, append), and what a bench.py record says: its status, its
figures (fields renamed since are read under both names) and its place in a table.

A record's ``status`` is one of STATUSES; one that is not "ok" has ``error`` (the full text),
``error_summary`` and ``note`` (one line: what the table shows). Records written before the
field existed carry the status in their error text: :func:`status` reads it from there.
"""

from __future__ import annotations

import json
import os
import time

# GPU memory in use by others when an engine starts, above which its KV cache figure is not
# comparable (bench.py warns and records it; report.py names it in the row).
BUSY_GPU_MIB = 4096

OK = "ok"
SKIPPED = "skipped"  # not run: plugin missing, too little space or --budget left
CUT = "cut"  # stopped by the --budget: time ran out, not a fault
TIMED_OUT = "timed_out"  # stopped by --timeout: a hang, a fault
FAILED = "failed"
STATUSES = (OK, SKIPPED, CUT, TIMED_OUT, FAILED)
FAULTS = (TIMED_OUT, FAILED)
VARIANT_ORDER = {
    v: i
    for i, v in enumerate(
        (
            "plain",
            "plain-v1",
            "ours",
            "ours-v2",
            "fp8",
            "mooncake",
            "mooncake-fp8",
            "upstream",
            "hf",
        )
    )
}
# plain vLLM, as shipped; plain-v1 on the V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0, from
# 0.22.0, where vLLM may choose Model Runner V2), which ours runs on: the two tell the
# runner's share from ours
BASELINES = ("plain", "plain-v1")
# the variants that run this package's connector: fp8 is ours with ``fp8: true``, mooncake
# ours with the mooncake backend (a local mooncake_master: mooncake_side.py), mooncake-fp8
# both, ours-v2 ours on Model Runner V2 (VLLM_USE_V2_MODEL_RUNNER=1, vLLM 0.33.0), ours-prev
# ours with the defaults before 2026-12-07 (worker.VARIANT_CONFIG)
OURS = ("ours", "ours-prev", "ours-v2", "fp8", "mooncake", "mooncake-fp8")


def status_note(r: dict) -> str:
    """The one line that explains a record's status ("" for an ok record)."""
    if r.get("note"):
        return r["note"]
    if not r.get("error"):
        return ""
    return r.get("error_summary") or (r["error"].strip().splitlines() or ["error"])[-1]


def status(r: dict) -> str:
    """The record's status: its field, or for an older record the one its error text says."""
    if r.get("status"):
        return r["status"]
    if not r.get("error"):
        return OK
    text = status_note(r)
    if text.startswith("skipped"):
        return SKIPPED
    # "timed out after 210 s (--timeout/--budget)": run 18, before the two were told apart
    if text.startswith("cut off by --budget") or text.endswith("/--budget)"):
        return CUT
    if text.startswith("timed out"):
        return TIMED_OUT
    return FAILED


def files_ready_s(r: dict) -> float | None:
    """Seconds from generate() returning until every file was complete (wall time in bench);
    older records call it drain_s."""
    return r.get("files_ready_s", r.get("drain_s"))


def ok(r: dict) -> bool:
    """Measured: status ok, with a generate() time."""
    return status(r) == OK and bool(r.get("gen_s"))


def tok_s(r: dict) -> float:
    return r["prompt_tokens"] / r["gen_s"]


def workload_order(name: str, rows: list[dict]) -> tuple:
    """Prefill-only workloads first, then by size: 128x1024, 32x8192, mixed, mixed-out256."""
    r = next(r for r in rows if r["workload"] == name)
    return (r["output_tokens_requested"], r["prompt_tokens"], name)


def load_records(path: str) -> list[dict]:
    """The records already in a results JSON ([] if there is none); raises if it is unreadable."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        data = json.load(f)
    records = data["records"] if isinstance(data, dict) else data
    if not isinstance(records, list):
        raise ValueError(f"{path}: no list of records")
    return records


def merge_results(path: str, new: list[dict]) -> None:
    """Append new records to path, atomically; never overwrite a file it cannot read."""
    try:
        records = load_records(path)
    except (OSError, ValueError, KeyError) as e:
        path = path + f".{int(time.time())}.json"  # keep both: the old file is left as it is
        print(f"[bench] warning: cannot read the results file ({e}): writing {path}", flush=True)
        records = []
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"records": records + new}, f, indent=1)
    os.replace(tmp, path)


def settings(spec: dict) -> dict:
    """The engine settings of a worker spec that two records must share for one to be divided
    by the other (report.py): GDN prefill backend, step and batch sizes, context, KV sizing,
    mode, extra engine arguments, seed. Specs written before a setting existed read as what
    ran then (the GDN backend was forced to triton; None: vLLM's default)."""
    return dict(
        gdn_backend=spec.get("gdn_backend", "triton"),
        max_num_batched_tokens=spec.get("max_num_batched_tokens") or None,
        max_num_seqs=spec.get("max_num_seqs") or None,
        max_model_len=spec.get("max_model_len"),
        gpu_memory_utilization=spec.get("gpu_memory_utilization"),
        extra_engine_kwargs=spec.get("extra_engine_kwargs") or {},
        eager=spec.get("eager"),
        seed=spec.get("seed"),
    )


def record_settings(r: dict) -> dict:
    """A record's engine settings: its own field, else read from the spec in its flags."""
    return r.get("settings") or settings(r.get("flags", {}).get("spec", {}))
