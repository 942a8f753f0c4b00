"""A py-spy profile of an engine core in a few lines: samples per thread, the share under the
engine's main stages, and the busiest leaf frames.

    py-spy record --pid $(pgrep -f EngineCore) --duration 40 --rate 50 --threads \\
        --format raw -o ours.raw
    python benchmarks/pyspy_summary.py ours.raw
"""

from __future__ import annotations

import argparse
from collections import Counter

# vLLM's engine-core stages (V1 and V2 runners), and this package's hooks
STAGES = (
    "step_with_batch_queue", "schedule", "execute_model", "forward", "sample_tokens",
    "update_from_output", "save", "save_step", "copy_out", "_drain_loop", "_on_rows", "_write",
)  # fmt: skip


def frame_name(frame: str) -> str:
    """'Module.fn (path/file.py:12)' -> 'fn'."""
    return frame.split(" (", 1)[0].rsplit(".", 1)[-1]


def summarize(lines) -> dict:
    total, threads, stages, leaves = 0, Counter(), Counter(), Counter()
    for line in lines:
        stack, _, n = line.rstrip("\n").rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = stack.split(";")
        total += int(n)
        threads[frames[0]] += int(n)
        names = {frame_name(f) for f in frames[1:]}
        for s in STAGES:
            stages[s] += int(n) if s in names else 0
        leaves[frames[-1].split(" (", 1)[0]] += int(n)
    return dict(total=total, threads=threads, stages=stages, leaves=leaves)


def render(s: dict, top: int = 15) -> str:
    total = max(s["total"], 1)
    out = [f"{s['total']} samples"]
    out += [f"  {n:6d} {n / total:6.1%}  {t}" for t, n in s["threads"].most_common(5)]
    out.append("under (any depth):")
    out += [f"  {n:6d} {n / total:6.1%}  {k}" for k, n in s["stages"].most_common() if n]
    out.append(f"top {top} leaf frames:")
    out += [f"  {n:6d} {n / total:6.1%}  {k}" for k, n in s["leaves"].most_common(top)]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("raw", help="py-spy record --format raw output")
    p.add_argument("--top", type=int, default=15)
    args = p.parse_args(argv)
    with open(args.raw) as f:
        print(render(summarize(f), args.top))


if __name__ == "__main__":
    main()
