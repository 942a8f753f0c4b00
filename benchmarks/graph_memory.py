"""Who owns the CUDA-graph memory: one engine's capture under torch's memory history, plain or
ours, and the live allocations of the graph pools grouped by the code that made them.

    python benchmarks/graph_memory.py --variant plain --out /tmp/gm-plain.json
    python benchmarks/graph_memory.py --variant ours --out /tmp/gm-ours.json
    python benchmarks/graph_memory.py --compare /tmp/gm-plain.json /tmp/gm-ours.json

The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), recording every
allocation's Python stack from before the model loads. Once LLM(...) has captured its graphs,
torch.cuda.memory._snapshot() gives each segment and block; the graph pools are the segments
with a private pool id. Each live block is keyed by the first frames of vLLM's and this
plugin's code on its stack. --compare prints each key's bytes in both and the difference, the
largest first. The model is the 27B shape with dummy weights (--shape, benchmarks/workloads.py);
the engine settings are bench.py's, the KV cache vLLM's extensible one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import defaultdict

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


def compare(a: dict, b: dict) -> list[tuple[str, int, int]]:
    """(key, bytes in a, bytes in b) for every key, the largest difference first."""
    bytes_a = {g["key"]: g["bytes"] for g in a["live"]}
    bytes_b = {g["key"]: g["bytes"] for g in b["live"]}
    keys = set(bytes_a) | set(bytes_b)
    rows = [(k, bytes_a.get(k, 0), bytes_b.get(k, 0)) for k in keys]
    return sorted(rows, key=lambda r: -abs(r[2] - r[1]))


def run(args: argparse.Namespace) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
    import torch

    torch.cuda.memory._record_memory_history(max_entries=2_000_000)
    import worker
    from vllm import LLM

    root = tempfile.mkdtemp(prefix="graph-memory-")
    layers = DEFAULT_LAYERS[model_config(args.shape)["text_config"]["num_hidden_layers"]]
    spec = dict(
        variant=args.variant, model_dir=write_model_dir(root, args.shape), eager=False,
        max_model_len=8448, gdn_backend=args.gdn_backend, gpu_memory_utilization=0,
        max_num_seqs=256, layers=layers, out_dir=os.path.join(root, "hs"),
        extra_engine_kwargs={},
    )  # fmt: skip
    llm = LLM(**worker.engine_kwargs(spec))
    summary = graph_pool_summary(torch.cuda.memory._snapshot())
    summary |= dict(variant=args.variant, shape=args.shape, layers=layers)
    del llm
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--variant", choices=("plain", "ours"), default="ours")
    p.add_argument("--shape", choices=sorted(SHAPES), default="27b")
    p.add_argument("--gdn-backend", default="default", help="default (vLLM's choice) or triton")
    p.add_argument("--out", help="write the summary JSON here")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), help="two summaries: B against A")
    args = p.parse_args(argv)
    if args.compare:
        a, b = (json.load(open(path)) for path in args.compare)
        print(f"graph pools: {a['graph_pool_bytes'] / 2**30:.2f} GiB -> "
              f"{b['graph_pool_bytes'] / 2**30:.2f} GiB")  # fmt: skip
        for key, x, y in compare(a, b)[:25]:
            print(f"{(y - x) / 2**20:+10.1f} MiB  {x / 2**20:10.1f} -> {y / 2**20:10.1f}  {key}")
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
