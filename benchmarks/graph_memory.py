"""Who owns the CUDA-graph memory: one engine's capture under torch's memory history, plain or
ours, grouped by the code that allocated.

    python benchmarks/graph_memory.py --variant plain --out /tmp/gm-plain.json
    python benchmarks/graph_memory.py --variant ours --out /tmp/gm-ours.json
    python benchmarks/graph_memory.py --compare /tmp/gm-plain.json /tmp/gm-ours.json

The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), recording every
allocation's Python stack from before the model loads. Each ``capture_model`` call (vLLM's
profiling capture, then the real one) is a window, marked in torch's trace by an allocation of
its own; for each window the record has the free device memory and torch's reserved bytes
before and after (what neither explains is the driver's: graph objects, kernel modules), the
segments torch allocated in it (cudaMalloc), and the allocations still alive at its end, each
grouped by the first frames of vLLM's and this plugin's code on its stack. Once LLM(...) is
up, the graph pools' live and free blocks are summed the same way. --compare prints each
group's bytes in both and the difference, the largest first. The model is the 27B shape cut to
8 layers by default (--shape, benchmarks/workloads.py), dummy weights; the engine settings are
bench.py's, the KV cache vLLM's extensible one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import defaultdict
from collections.abc import Iterable

from workloads import DEFAULT_LAYERS, SHAPES, model_config, write_model_dir

OURS_CODE = ("vllm/", "vllm_gdn_hs/")


def stack_key(frames: list[dict], depth: int = 3) -> str:
    """The first ``depth`` frames of vLLM's or the plugin's code on an allocation's stack."""
    picked = []
    for f in frames:
        name = f.get("filename", "")
        cut = max((name.rfind(c) for c in OURS_CODE), default=-1)
        if cut >= 0:
            picked.append(f"{name[cut:]}:{f.get('line')} {f.get('name')}")
        if len(picked) == depth:
            break
    return " < ".join(picked) or "(no vLLM frame)"


def graph_pool_summary(snapshot: dict) -> dict:
    """Bytes of the graph pools' segments, their live blocks by stack key, and their free bytes."""
    pools: dict[str, int] = defaultdict(int)
    live: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    free = 0
    for seg in snapshot.get("segments", []):
        pool = tuple(seg.get("segment_pool_id") or (0, 0))
        if pool == (0, 0):
            continue
        pools[str(pool)] += seg["total_size"]
        for block in seg.get("blocks", []):
            if block.get("state") == "active_allocated":
                entry = live[stack_key(block.get("frames", []))]
                entry[0] += block["size"]
                entry[1] += 1
            else:
                free += block["size"]
    groups = sorted(live.items(), key=lambda kv: -kv[1][0])
    return dict(
        graph_pool_bytes=sum(pools.values()),
        pools=dict(pools),
        free_in_pools_bytes=free,
        live=[dict(key=k, bytes=b, blocks=n) for k, (b, n) in groups],
    )


MARK_BYTES = 7 * 2**20 + 3 * 4096  # a size nothing else asks for: a window's edge in the trace


def _grouped(acc: dict[str, list[int]]) -> list[dict]:
    rows = sorted(acc.items(), key=lambda kv: -kv[1][0])
    return [dict(key=k, bytes=b, blocks=n) for k, (b, n) in rows if b]


def is_mark(event: dict) -> bool:
    return (
        event.get("action") == "alloc"
        and event.get("size") == MARK_BYTES
        and any(f.get("name") == "_mark" for f in event.get("frames", []))
    )


def window_summary(trace: Iterable[dict]) -> list[dict]:
    """For each window between two marks in one device's trace (oldest first): the segments
    allocated and freed in it and the allocations alive at its end, grouped by stack key."""
    windows: list[dict] = []
    current = None
    for e in trace:
        if is_mark(e):
            if current is None:
                current = dict(segments=defaultdict(lambda: [0, 0]), freed=0, live={})
            else:
                live: dict[str, list[int]] = defaultdict(lambda: [0, 0])
                for size, key in current["live"].values():
                    live[key][0] += size
                    live[key][1] += 1
                windows.append(
                    dict(
                        segments_allocated=_grouped(current["segments"]),
                        segments_allocated_bytes=sum(b for b, _ in current["segments"].values()),
                        segments_freed_bytes=current["freed"],
                        alive_at_end=_grouped(live),
                        alive_at_end_bytes=sum(b for b, _ in live.values()),
                    )
                )
                current = None
            continue
        if current is None:
            continue
        action = e.get("action")
        if action == "segment_alloc":
            entry = current["segments"][stack_key(e.get("frames", []))]
            entry[0] += e["size"]
            entry[1] += 1
        elif action == "segment_free":
            current["freed"] += e["size"]
        elif action == "alloc":
            current["live"][e["addr"]] = (e["size"], stack_key(e.get("frames", [])))
        elif action in ("free_requested", "free_completed"):
            current["live"].pop(e.get("addr"), None)
    return windows


def compare(a: dict, b: dict, part: str = "live") -> list[tuple[str, int, int]]:
    """(key, bytes in a, bytes in b) for every key of one grouped list, the largest
    difference first."""
    bytes_a = {g["key"]: g["bytes"] for g in a[part]}
    bytes_b = {g["key"]: g["bytes"] for g in b[part]}
    keys = set(bytes_a) | set(bytes_b)
    rows = [(k, bytes_a.get(k, 0), bytes_b.get(k, 0)) for k in keys]
    return sorted(rows, key=lambda r: -abs(r[2] - r[1]))


def _mark(torch) -> None:
    torch.empty(MARK_BYTES, dtype=torch.uint8, device="cuda")


def watch_capture(torch, windows: list[dict]) -> None:
    """Mark each ``capture_model`` call in torch's trace, with its memory before and after."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    original = GPUModelRunner.capture_model

    def reading() -> tuple[int, int]:
        # capture_model empties the allocator's cache first and last: read as it does, or the
        # warm-up's cached blocks count as memory the capture gave back
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved()

    def capture_model(self, *a, **kw):
        free0, reserved0 = reading()
        _mark(torch)
        try:
            return original(self, *a, **kw)
        finally:
            _mark(torch)
            free1, reserved1 = reading()
            used, grown = free0 - free1, reserved1 - reserved0
            windows.append(
                dict(
                    profile_only=bool(kw.get("profile_only")),
                    device_memory_used_bytes=used,
                    torch_reserved_growth_bytes=grown,
                    not_torch_bytes=used - grown,
                )
            )

    GPUModelRunner.capture_model = capture_model


def run(args: argparse.Namespace) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # as bench.py: no JIT build
    import torch

    torch.cuda.memory._record_memory_history(stacks="python", max_entries=4_000_000)
    import worker
    from vllm import LLM

    windows: list[dict] = []
    watch_capture(torch, windows)
    root = tempfile.mkdtemp(prefix="graph-memory-")
    layers = (
        args.layers or DEFAULT_LAYERS[model_config(args.shape)["text_config"]["num_hidden_layers"]]
    )
    spec = dict(
        variant=args.variant, model_dir=write_model_dir(root, args.shape), eager=False,
        max_model_len=8448, gdn_backend=args.gdn_backend, gpu_memory_utilization=0,
        max_num_seqs=256, layers=layers, out_dir=os.path.join(root, "hs"),
        extra_engine_kwargs={},
    )  # fmt: skip
    llm = LLM(**worker.engine_kwargs(spec))
    snapshot = torch.cuda.memory._snapshot()
    summary = graph_pool_summary(snapshot)
    traced = window_summary(snapshot["device_traces"][torch.cuda.current_device()])
    # the trace may have lost its oldest window: pair them from the newest
    for window, trace in zip(windows[::-1], traced[::-1], strict=False):
        window.update(trace)
    summary |= dict(
        variant=args.variant,
        shape=args.shape,
        layers=layers,
        gpu=torch.cuda.get_device_name(),
        captures=windows,
        trace_windows_found=len(traced),
    )
    del llm
    return summary


FIGURES = (
    "device_memory_used_bytes",
    "torch_reserved_growth_bytes",
    "not_torch_bytes",
    "segments_allocated_bytes",
    "segments_freed_bytes",
    "alive_at_end_bytes",
)


def line(key: str, x: int, y: int) -> str:
    return f"{(y - x) / 2**20:+10.1f} MiB  {x / 2**20:10.1f} -> {y / 2**20:10.1f}  {key}"


def print_compare(a: dict, b: dict) -> None:
    gib = 2**30
    print(f"graph pools: {a['graph_pool_bytes'] / gib:.2f} GiB -> {b['graph_pool_bytes'] / gib:.2f}"
          f" GiB; free in them {a['free_in_pools_bytes'] / gib:.2f} -> "
          f"{b['free_in_pools_bytes'] / gib:.2f} GiB")  # fmt: skip
    for i, (x, y) in enumerate(zip(a.get("captures", []), b.get("captures", []), strict=False)):
        print(f"capture {i} (profile_only={x['profile_only']}):")
        for k in FIGURES:
            if k in x and k in y:
                print(f"  {k:30s} {x[k] / gib:7.3f} -> {y[k] / gib:7.3f} GiB")
        for part in ("segments_allocated", "alive_at_end"):
            if part in x and part in y:
                print(f"  {part}, by the code that asked:")
                for key, p, q in compare(x, y, part)[:12]:
                    print(f"  {line(key, p, q)}")
    print("graph pools' live blocks at the end, by the code that made them:")
    for key, x, y in compare(a, b)[:15]:
        print(line(key, x, y))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--variant", choices=("plain", "ours"), default="ours")
    p.add_argument("--shape", choices=sorted(SHAPES), default="27b-8")
    p.add_argument(
        "--layers",
        type=lambda t: [int(x) for x in t.split(",")],
        help="layer ids for ours, comma-separated (default: workloads.DEFAULT_LAYERS')",
    )
    p.add_argument("--gdn-backend", default="default", help="default (vLLM's choice) or triton")
    p.add_argument("--out", help="write the summary JSON here")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), help="two summaries: B against A")
    args = p.parse_args(argv)
    if args.compare:
        a, b = (json.load(open(path)) for path in args.compare)
        print_compare(a, b)
        return 0
    summary = run(args)
    text = json.dumps(summary, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text[:4000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
