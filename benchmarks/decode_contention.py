"""How much the connector's host side slows the engine thread in decode, without a GPU.

In decode, every step hands the writer one row per running request (256 at vLLM's default
max_num_seqs), and the writer's drain thread files each row into its request's buffer. That
thread shares the GIL with the engine thread, which in eager mode spends the step issuing
about a thousand small operator calls (kernel launches). This script stands a loop of small
torch operator calls in for the engine's step, feeds the real worker side one decode
step per engine step, and reports the engine's step time against the same loop without the
writer (in the same process, in alternating blocks of 10 steps; the writer is idle when
a block without it starts).

    python benchmarks/decode_contention.py --requests 256 --steps 200 --ops-per-step 1000

`--skip-filing` times the same run with one stage left out: the decode rows are gathered
from the step's host buffer as usual but never filed into their requests' buffers (the
files then lack those rows and are refused; only the timing counts).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time

import torch
from records import merge_results

from vllm_gdn_hs.config import HiddenStatesConfig
from vllm_gdn_hs.connector import request_rows, staging
from vllm_gdn_hs.connector.metadata import (
    FinishedRequest,
    HybridHiddenStatesConnectorMetadata,
    NewRequest,
)
from vllm_gdn_hs.connector.worker import HybridHiddenStatesConnectorWorker


def engine_step(x: torch.Tensor, ops: int) -> None:
    """Stand-in for one eager forward pass: `ops` small operator calls."""
    for _ in range(ops):
        x.add_(1.0)


@torch.inference_mode()
def run(args: argparse.Namespace) -> dict:
    shutil.rmtree(args.out_dir, ignore_errors=True)
    os.makedirs(args.out_dir)
    if args.skip_filing:
        request_rows.RequestRows.defer = lambda self, *a: None
    torch.set_num_threads(1)
    cfg = HiddenStatesConfig(shared_storage_path=args.out_dir)
    writer = HybridHiddenStatesConnectorWorker(
        cfg,
        max_tokens=args.requests,
        num_layers=args.layers,
        hidden=args.hidden,
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
    )
    reqs = [
        NewRequest(f"r{i}", os.path.join(args.out_dir, f"r{i}.safetensors"), args.prompt)
        for i in range(args.requests)
    ]
    writer.on_metadata(HybridHiddenStatesConnectorMetadata(new_requests=reqs))
    ids = [r.req_id for r in reqs]
    rows = torch.randn(args.requests, args.layers, args.hidden).to(torch.bfloat16)
    norms = staging.row_norms(rows)  # computed on the GPU in production
    staging.row_norms = lambda h: norms[: h.shape[0]]
    qsl = torch.arange(args.requests + 1)
    x = torch.zeros(16)
    # Prefill: each request's prompt rows, so decode rows extend filled buffers.
    for r in reqs:
        writer.save(
            torch.randn(args.prompt, args.layers, args.hidden).to(torch.bfloat16),
            [r.req_id],
            torch.tensor([0, args.prompt]),
            torch.arange(args.prompt),
        )
    plain, ours = [], []
    step = 0
    while step < args.steps:  # blocks of 10 steps each way; plain blocks start drained
        while not (writer.drain.tasks.empty() and writer.ring.idle()):
            time.sleep(0.001)
        for _ in range(10):
            t = time.perf_counter()
            engine_step(x, args.ops_per_step)
            plain.append(time.perf_counter() - t)
        for _ in range(10):
            # The engine's own work is timed, plus any wait for a free host buffer: on a
            # GPU, save() is otherwise a few asynchronous launches (here, a CPU copy). The
            # drain thread files the rows while the next engine step runs.
            waited = writer.stats.engine_waited_s
            writer.save(rows, ids, qsl, torch.full((args.requests,), args.prompt + step))
            waited = writer.stats.engine_waited_s - waited  # back-pressure: counted
            t = time.perf_counter()
            engine_step(x, args.ops_per_step)
            ours.append(time.perf_counter() - t + waited)
            step += 1
    n = args.prompt + args.steps
    writer.on_metadata(
        HybridHiddenStatesConnectorMetadata(
            finished_requests=[FinishedRequest(r, list(range(n))) for r in ids]
        )
    )
    writer.close()
    shutil.rmtree(args.out_dir, ignore_errors=True)
    p, o = statistics.mean(plain), statistics.mean(ours)  # means: bursts count
    return {
        "requests": args.requests,
        "ops_per_step": args.ops_per_step,
        "layers": args.layers,
        "hidden": args.hidden,
        "engine_step_ms": round(p * 1e3, 3),
        "engine_step_with_writer_ms": round(o * 1e3, 3),
        "ratio": round(o / p, 3),
        "files": writer.stats.files,
        "engine_waited_s": round(writer.stats.engine_waited_s, 3),
        "writer": writer.stats.timing_summary(),
        "cpu_cores": os.cpu_count(),
        "skip_filing": args.skip_filing,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out-dir", default="/dev/shm/vllm-gdn-hs-decode-bench")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--ops-per-step", type=int, default=1000)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=5120)
    p.add_argument(
        "--skip-filing", action="store_true", help="leave out filing decode rows (a stage timing)"
    )
    p.add_argument("--label", help="stored in the record, e.g. the commit measured")
    p.add_argument("--results", help="append the record to this JSON file")
    args = p.parse_args()
    rec = dict(run(args), label=args.label)
    print(json.dumps(rec), flush=True)
    if args.results:
        merge_results(args.results, [rec])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
