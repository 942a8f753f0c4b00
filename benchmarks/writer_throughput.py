"""Host-side throughput of the connector's worker half, without a GPU.

Feeds HybridHiddenStatesConnectorWorker (the same code the GPU path runs after the device-to-host
copy) one scheduling step at a time, at the Qwen3.6-27B row size, and times rows
in -> files complete: the scatter into per-request buffers, the row checks and the
safetensors writes. If this is well above the GPU's prefill rate, the host side is
not the bottleneck.

    python benchmarks/writer_throughput.py --out-dir /dev/shm/hs-bench --requests 64 --tokens 1024
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time

import torch
from records import merge_results

from vllm_gdn_hs.config import HiddenStatesConfig
from vllm_gdn_hs.connector import staging
from vllm_gdn_hs.connector.metadata import (
    FinishedRequest,
    HybridHiddenStatesConnectorMetadata,
    NewRequest,
)
from vllm_gdn_hs.connector.worker import HybridHiddenStatesConnectorWorker
from vllm_gdn_hs.locks import wait_for_file

_row_norms = staging.row_norms  # the real one; run() stands a precomputed copy in for it


@torch.inference_mode()
def run(
    out_dir: str,
    requests: int,
    tokens: int,
    layers: int,
    hidden: int,
    step_tokens: int,
    workers: int,
    validate: bool,
) -> dict:
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    cfg = HiddenStatesConfig(
        shared_storage_path=out_dir, write_workers=workers, validate_rows=validate
    )
    writer = HybridHiddenStatesConnectorWorker(
        cfg,
        max_tokens=step_tokens,
        num_layers=layers,
        hidden=hidden,
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
    )
    reqs = [
        NewRequest(f"r{i}", os.path.join(out_dir, f"r{i}.safetensors"), tokens)
        for i in range(requests)
    ]
    rows = torch.randn(step_tokens, layers, hidden).to(torch.bfloat16)
    norms = _row_norms(rows)  # on the GPU in production
    staging.row_norms = lambda h: norms[: h.shape[0]]
    start = time.perf_counter()
    writer.on_metadata(HybridHiddenStatesConnectorMetadata(new_requests=reqs))
    per_step = max(1, step_tokens // tokens)  # whole prompts per step, as unchunked prefill
    for first in range(0, requests, per_step):
        batch = reqs[first : first + per_step]
        qsl = torch.arange(0, (len(batch) + 1) * tokens, tokens)
        writer.save(
            rows[: len(batch) * tokens],
            [r.req_id for r in batch],
            qsl,
            torch.arange(tokens).repeat(len(batch)),  # each request's positions 0..tokens-1
        )
        writer.on_metadata(
            HybridHiddenStatesConnectorMetadata(
                finished_requests=[FinishedRequest(r.req_id, list(range(tokens))) for r in batch]
            )
        )
    for r in reqs:
        wait_for_file(r.path, timeout=600)
    elapsed = time.perf_counter() - start
    writer.close()
    total = requests * tokens
    nbytes = sum(os.path.getsize(r.path) for r in reqs)
    return {
        "requests": requests,
        "tokens_per_request": tokens,
        "layers": layers,
        "hidden": hidden,
        "write_workers": workers,
        "validate_rows": validate,
        "out_dir": out_dir,
        "seconds": round(elapsed, 3),
        "tokens_per_s": round(total / elapsed),
        "GB_per_s": round(nbytes / elapsed / 1e9, 3),
        "cpu_cores": os.cpu_count(),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out-dir", default="/dev/shm/vllm-gdn-hs-writer-bench")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=5120)
    p.add_argument("--step-tokens", type=int, default=8192)
    p.add_argument("--workers", default="1,4")
    p.add_argument("--results", help="append records to this JSON file")
    args = p.parse_args()
    records = []
    for workers in map(int, args.workers.split(",")):
        for validate in (True, False):
            rec = run(
                args.out_dir,
                args.requests,
                args.tokens,
                args.layers,
                args.hidden,
                args.step_tokens,
                workers,
                validate,
            )
            print(json.dumps(rec), flush=True)
            records.append(rec)
    shutil.rmtree(args.out_dir, ignore_errors=True)
    if args.results:
        merge_results(args.results, records)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
