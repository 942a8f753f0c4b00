"""How long ``vllm-gdn-hs doctor`` (no arguments: the README's install line) takes, and when its
first row appears, as a user starts it: a fresh process each run, its output read line by line.

    python benchmarks/doctor_time.py [--runs 5] [--out benchmarks/results/doctor_time.json]

One record per call, appended to ``--out``: the machine (CPU model, cores, memory, load at the
start), the commit, the versions, how many distributions and RECORD entries the scan read, and
each run's wall and first-row seconds; the bar is 10 s and 2 s (issue 55). ``--load`` times
``doctor --load`` instead (it imports vLLM and torch).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from importlib import metadata

from host import git_commit, versions
from records import merge_results

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "results", "doctor_time.json")
BAR_WALL_S, BAR_FIRST_ROW_S = 10.0, 2.0
ROW = ("ok  ", "FAIL", "skip")
GPUS = "/proc/driver/nvidia/gpus"


def machine() -> dict:
    """The machine in words a reader can compare: CPU model, cores, memory, load, kernel."""
    cpu = platform.processor() or None
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu
            )
        with open("/proc/meminfo") as f:
            mem_kb = int(next(ln.split()[1] for ln in f if ln.startswith("MemTotal:")))
    except (OSError, StopIteration, ValueError):
        mem_kb = 0
    return dict(
        host=platform.node(),
        cpu=cpu,
        cores=len(os.sched_getaffinity(0)),
        memory_gb=round(mem_kb / 1e6, 1),
        load_1min=round(os.getloadavg()[0], 2),
        kernel=platform.release(),
        gpus=len(os.listdir(GPUS)) if os.path.isdir(GPUS) else 0,
    )


def one_run(load: bool) -> dict:
    """One ``doctor`` in a fresh process: wall seconds, seconds to its first row, exit code."""
    cmd = [sys.executable, "-m", "vllm_gdn_hs.cli", "doctor", *(["--load"] * load)]
    t0 = time.perf_counter()
    first = None
    rows = 0
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line[:4] in ROW:
                rows += 1
                first = first if first is not None else time.perf_counter() - t0
    wall = time.perf_counter() - t0
    return dict(wall_s=round(wall, 3), first_row_s=first and round(first, 3), rows=rows,
                returncode=proc.returncode)  # fmt: skip


def record(runs: int, load: bool) -> dict:
    start = machine()
    dists = list(metadata.distributions())
    results = [one_run(load) for _ in range(runs)]
    wall = statistics.median(r["wall_s"] for r in results)
    first = statistics.median(r["first_row_s"] or wall for r in results)
    return dict(
        benchmark="doctor_time",
        date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        commit=git_commit(),
        command="vllm-gdn-hs doctor" + (" --load" if load else ""),
        machine=start,
        versions=versions(),
        distributions=len(dists),
        record_entries=sum(len(d.files or ()) for d in dists),
        runs=results,
        median_wall_s=wall,
        median_first_row_s=first,
        bar=dict(wall_s=BAR_WALL_S, first_row_s=BAR_FIRST_ROW_S),
        meets_bar=all(
            r["wall_s"] <= BAR_WALL_S and (r["first_row_s"] or 1e9) <= BAR_FIRST_ROW_S
            for r in results
        ),
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5, help="fresh processes timed")
    p.add_argument("--load", action="store_true", help="time doctor --load instead")
    p.add_argument("--out", default=OUT, help="the results JSON the record is appended to")
    args = p.parse_args(argv)
    rec = record(args.runs, args.load)
    merge_results(args.out, [rec])
    m = rec["machine"]
    print(
        f"{rec['command']}: median {rec['median_wall_s']:.2f} s, first row "
        f"{rec['median_first_row_s']:.2f} s over {args.runs} runs on {m['cores']} cores "
        f"({m['cpu']}, load {m['load_1min']}); {rec['distributions']} distributions, "
        f"{rec['record_entries']:,} RECORD entries; bar met: {rec['meets_bar']} -> {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
