"""Hidden-state extraction speed and memory: plain vLLM, ours, upstream vLLM, HF transformers.

Each variant runs in a fresh child process (``bench.py --worker SPEC.json``, worker.py) so
engines never share GPU memory; the parent (this file: options, --budget, children) tees the
child's output (and the vLLM engine core's, which inherits it) to a log, reads vLLM's KV cache
lines from it (logparse.py), and merges the child's records into one results JSON
(records.py). A child that fails or times out leaves a record with its status, not a crash.

    python benchmarks/bench.py --shape 27b --variants plain,ours --workloads 128x1024 --eager \\
        --out-dir /dev/shm/hs --results benchmarks/results/h200.json
    python benchmarks/report.py benchmarks/results/h200.json --md benchmarks/results/README-table.md

Variants:   plain (no extraction), ours (HybridHiddenStatesConnector), fp8 (ours, fp8 files),
            mooncake (ours, objects in a mooncake_master started on 127.0.0.1), mooncake-fp8
            (those objects in fp8, read in bf16 by vllm_gdn_hs.cli.train's reader), upstream
            (vLLM's ExampleHiddenStatesConnector), hf (transformers + forward hooks, best batch
            size).
Workloads:  NxL (N random-token prompts of L tokens, max_tokens=1), mixed (lognormal lengths,
            max_tokens=1), mixed-outK / NxL-outK (the same prompts, K generated tokens with
            include_output_tokens). See benchmarks/README.md.
Smoke test: --smoke (tiny shape, 16x512 and 16x512-out8, eager), about a minute per engine.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

import worker
from host import gpu_mem_used_mib, wait_gpu_released
from logparse import (
    compress_log,
    cut_detail,
    error_summary,
    gdn_backend_info,
    kv_cache_info,
    memory_info,
    read_log,
    warmup_info,
    writer_info,
)
from plan import Plan, announce, common_fields, make_plan, print_workloads
from records import (
    BUSY_GPU_MIB,
    CUT,
    FAILED,
    OK,
    OURS,
    SKIPPED,
    TIMED_OUT,
    load_records,
    merge_results,
    settings,
)
from workloads import DEFAULT_LAYERS, SHAPES, make_workload, model_config, write_model_dir

HERE = os.path.dirname(os.path.abspath(__file__))
VARIANTS = (
    "plain", "plain-v1", "ours", "ours-layers", "ours-prev", "ours-v2", "fp8", "mooncake",
    "mooncake-fp8", "upstream", "hf",
)  # fmt: skip


def can_start(left_s: float, slowest_s: float) -> bool:
    """Whether a variant is worth starting with left_s of the --budget: 20 s go to stopping
    and writing results, and a variant needs about as long as the slowest one so far took
    from start to its last record (27B with CUDA graphs on 0.26.0: 270 s)."""
    return left_s - 20 >= max(30.0, slowest_s)


@dataclass
class Budget:
    """--budget (0: none): its deadline, and the longest a variant has taken so far."""

    seconds: float
    deadline: float
    slowest_s: float = 0.0

    def timeout(self, limit: float, now: float) -> float:
        """A variant's limit: --timeout, or what is left less 20 s to kill, wait and write."""
        return min(limit, self.deadline - now - 20) if self.seconds else limit

    def allows(self, now: float) -> bool:
        return not self.seconds or can_start(self.deadline - now, self.slowest_s)


def run_child(cmd: list[str], log_path: str, timeout: float, env: dict) -> tuple[int | None, str]:
    """Run cmd in its own process group, tee its output to log_path; kill the group on timeout.

    A process group, not a new session: if this parent is killed, whoever ends the caller's
    session (the device machine's call, a shell) still ends the child and its engine core."""
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        preexec_fn=os.setpgrp,
        text=True,
        errors="replace",
    )

    def tee() -> None:
        with open(log_path, "w", buffering=1) as log:
            for line in proc.stdout:
                log.write(line)
                sys.stdout.write(line)

    reader = threading.Thread(target=tee, daemon=True)
    reader.start()
    rc = None
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    finally:  # the child and whatever it left behind (the engine core), by our group id
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    reader.join(timeout=30)
    return rc, read_log(log_path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shape", choices=sorted(SHAPES), default="27b")
    p.add_argument("--variants", default="plain,ours", help=f"comma list of {','.join(VARIANTS)}")
    p.add_argument(
        "--workloads",
        default="128x1024",
        help="comma list: NxL (e.g. 128x1024,32x8192), mixed, mixed-out256",
    )
    p.add_argument(
        "--layers",
        help="comma list of layer ids (default: by layer count: "
        + "; ".join(f"{n} layers {v}" for n, v in DEFAULT_LAYERS.items())
        + ")",
    )
    p.add_argument("--eager", action="store_true", help="enforce_eager=True (default: cudagraph)")
    p.add_argument(
        "--out-dir",
        default="/dev/shm/hs",
        help="where hidden states are written, one sub-folder per variant "
        "(emptied between workloads): /dev/shm for the pipeline, a disk folder for "
        "what a user gets",
    )
    p.add_argument(
        "--results",
        default=os.path.join(HERE, "results", "h200.json"),
        help="results JSON; new records are appended",
    )
    p.add_argument("--log-dir", default="/tmp/vllm_gdn_hs_bench/logs")
    p.add_argument("--model-root", default="/tmp/vllm_gdn_hs_bench/models")
    p.add_argument("--max-model-len", type=int, default=8448, help="8192 prompt + 256 output")
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="0: leave it to vLLM (0.34.0: the extensible KV cache, sized after warm-up)",
    )
    p.add_argument(
        "--gdn-backends",
        default="default",
        help="comma list of GDN prefill backends, each variant runs with each: default (vLLM's "
        "choice: on Hopper flashinfer's kernel), triton, flashinfer, cutedsl",
    )
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=0, help="tokens per step (0: vLLM's default)"
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=0,
        help="requests at once (0: vLLM's default; 27B with CUDA graphs on one H100 needs 256)",
    )
    p.add_argument("--hf-batch-sizes", default="1,4,8,16")
    p.add_argument(
        "--extra-engine-kwargs",
        default="{}",
        help="JSON object merged into LLM(...) for the vLLM variants, "
        """e.g. '{"max_num_seqs": 512}'""",
    )
    p.add_argument(
        "--connector-config",
        default="{}",
        help="JSON object merged into kv_connector_extra_config for ours/upstream, "
        """e.g. '{"validate_rows": false}'""",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="smoke test: --shape tiny --workloads 16x512,16x512-out8 --eager",
    )
    p.add_argument(
        "--run",
        help="a label shared by the plain and the extraction groups measured together (two "
        "commands at once on two GPUs, say): report.py divides by the plain record of the same run",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=540, help="hard limit per variant, seconds")
    p.add_argument(
        "--budget",
        type=float,
        default=0,
        help="seconds for the whole command (e.g. 570 inside a 10-minute call): a variant gets "
        "at most what is left, and is not started with less left than the slowest variant so "
        "far took, so the group ends with error records instead of being killed",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=120,
        help="seconds to wait, after generate() returns, for every file to be ready",
    )
    p.add_argument(
        "--mooncake-segment-gib",
        type=float,
        default=40,
        help="mooncake variant: host memory the engine lends its local store; it must hold one "
        "workload's objects (32x8192 at 27B, 6 layers: 15 GiB)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="write the model folder, print workloads and child commands, run nothing",
    )
    p.add_argument("--worker", metavar="SPEC_JSON", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return args
    if args.smoke:
        args.shape, args.workloads, args.eager = "tiny", "16x512,16x512-out8", True
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad or not args.variants:
        p.error(f"unknown variants {bad}: choose from {','.join(VARIANTS)}")
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for w in args.workloads:
        try:
            make_workload(w, args.seed)
        except ValueError as e:
            p.error(str(e))
    n = model_config(args.shape)["text_config"]["num_hidden_layers"]
    if args.layers:
        args.layers = [int(x) for x in args.layers.split(",")]
    elif n in DEFAULT_LAYERS:
        args.layers = DEFAULT_LAYERS[n]
    else:
        p.error(f"no default layer ids for {n} layers: pass --layers")
    if not all(0 <= k <= n for k in args.layers):
        p.error(f"--layers must lie in 0..{n} for the {args.shape} shape ({n} layers)")
    args.gdn_backends = [b.strip() for b in args.gdn_backends.split(",") if b.strip()]
    if not args.gdn_backends:
        p.error("--gdn-backends: give at least one (default, triton, ...)")
    args.hf_batch_sizes = [int(x) for x in args.hf_batch_sizes.split(",")]
    for name in ("extra_engine_kwargs", "connector_config"):
        try:
            setattr(args, name, dict(json.loads(getattr(args, name))))
        except (ValueError, TypeError) as e:
            p.error(f"--{name.replace('_', '-')} must be a JSON object: {e}")
    try:
        load_records(args.results)  # an unreadable results file stops us before any GPU work
    except (OSError, ValueError, KeyError) as e:
        p.error(f"--results {args.results} exists but cannot be read ({e}): fix or move it")
    return args


def why_missing(args, problem, out_of_budget, rc, timeout, left_s, slowest_s) -> tuple[str, str]:
    """(status, error) of the workloads a variant left without a record."""
    if problem:
        return SKIPPED, problem
    if out_of_budget:
        why = f"skipped: not started, {left_s:.0f} s left of --budget {args.budget:.0f}"
        if slowest_s:
            why += f" and a variant took {slowest_s:.0f} s; run it in its own call"
        return SKIPPED, why
    if rc is None and timeout < args.timeout:
        return CUT, f"cut off by --budget after {timeout:.0f} s (not a fault: time ran out)"
    if rc is None:
        return TIMED_OUT, f"timed out after {timeout:.0f} s (--timeout)"
    return FAILED, f"worker exited with status {rc}"


def run_variant(args, plan: Plan, budget: Budget, common: dict) -> list[dict]:
    """Run one variant's worker (unless it cannot run or start) and return its records, one
    per workload (per batch size for hf): the worker's, and error records for the rest."""
    variant, spec = plan.variant, plan.spec
    backend = spec.get("gdn_backend", "default")
    log_path = os.path.join(args.log_dir, f"{args.shape}-{variant}-{backend}-{plan.mode}.log")
    t0 = time.time()
    timeout = budget.timeout(args.timeout, t0)
    out_of_budget = not budget.allows(t0)
    rc, log, skip = None, "", bool(plan.problem or out_of_budget)
    busy = gpu_mem_used_mib()  # another process's memory shrinks this engine's KV cache
    if busy is not None and busy > BUSY_GPU_MIB:
        print(
            f"[bench] warning: {busy} MiB of the GPU in use before {variant} starts (another "
            "process: its KV cache figure is not comparable; nvidia-smi says which)",
            flush=True,
        )
    if not skip:
        rc, log = run_child(plan.cmd, log_path, timeout, plan.env)
        log_path = compress_log(log_path)  # read: kept as log.gz
        wait_gpu_released()
        shutil.rmtree(spec["out_dir"], ignore_errors=True)  # a killed worker leaves files
    records = []
    if os.path.exists(spec["result_file"]):
        with open(spec["result_file"]) as f:
            records = json.load(f)
    done = {r["workload"] for r in records}
    status, why = why_missing(
        args, plan.problem, out_of_budget, rc, timeout, budget.deadline - t0, budget.slowest_s
    )
    stopped = min(time.time(), t0 + timeout)  # killed then, before the clean-up
    for n in args.workloads:
        if n in done:
            continue
        stats = make_workload(n, args.seed).stats()
        rec = dict(stats, status=status, error=why)
        if rc is None and not skip and variant != "hf":  # cut: say how far it got
            detail = cut_detail(log, t0, stopped, n, stats["prompt_tokens"])
            rec["error"] = f"{why}; {detail}"
        records.append(rec)
    tail = "\n".join(log.splitlines()[-25:])
    for r in records:
        r.update(
            common,
            variant=variant,
            mode=plan.mode,
            log=log_path,
            wall_s=round(time.time() - t0, 1),
            gpu_used_before_mib=busy,
            flags=dict(
                argv=shlex.join([sys.executable] + sys.argv),
                spec=spec,
                VLLM_USE_FLASHINFER_SAMPLER="0",
                VLLM_PLUGINS=plan.env.get("VLLM_PLUGINS"),
            ),
            **(kv_cache_info(log) if variant != "hf" else {}),
            **(warmup_info(log) | memory_info(log) if variant != "hf" else {}),
            **(writer_info(log) if variant in OURS else {}),
        )
        if variant != "hf":
            r.update(engine_fields(r, spec, log))
        if r["status"] != OK:
            summary = error_summary(r["error"], log)
            r.update(error_summary=summary, note=summary, log_tail=tail)
    if variant != "hf" and rc == 0:
        budget.slowest_s = max(budget.slowest_s, time.time() - t0)
    return records


def engine_fields(r: dict, spec: dict, log: str) -> dict:
    """What every vLLM record names at its top level: the GDN prefill backend vLLM used (from
    its log; else the one requested), and the step, batch, cache and sizing settings (as vLLM's
    config says where the worker read it, else as requested; None: vLLM's default)."""
    engine = r.get("engine_config") if isinstance(r.get("engine_config"), dict) else {}
    requested = spec.get("gdn_backend", "default")
    gdn = gdn_backend_info(log)
    gmu = engine.get("gpu_memory_utilization", spec["gpu_memory_utilization"] or None)
    return dict(
        gdn_backend_requested=requested,
        gdn_prefill_backend=gdn.get("gdn_prefill_backend") or f"{requested} (requested)",
        gdn_prefill_backend_source="vllm log" if gdn else "requested",
        max_num_batched_tokens=engine.get(
            "max_num_batched_tokens", spec.get("max_num_batched_tokens") or None
        ),
        max_num_seqs=engine.get("max_num_seqs", spec.get("max_num_seqs") or None),
        prefix_caching=engine.get("prefix_caching", False),
        kv_sizing=(
            "extensible KV cache"
            if engine.get("extensible_kv_cache")
            else f"gpu_memory_utilization {gmu}"
        ),
        runner=engine.get("model_runner"),
        settings=settings(spec),
    )


def print_summary(records: list[dict], results: str) -> None:
    print(f"[bench] summary; table: python benchmarks/report.py {results}")
    for r in records:
        if r["status"] != OK:
            res = r["error_summary"][:240]
        else:
            res = (
                f"{r['prompt_tokens'] / r['gen_s']:9,.0f} tok/s  "
                f"files ready {r['files_ready_s']:6.2f} s  files {r['files']}  "
                f"KV {r.get('kv_cache_tokens')} ({r.get('kv_cache_blocks')} blocks, warm-up "
                f"peak {r.get('warmup_allocated_peak_gib')} GiB)  peak {r['peak_gpu_mib']} MiB"
            )
        bs = r.get("batch_size", "-")
        print(f"  {r['variant']:9s} {r['workload']:13s} bs={bs!s:3s} {res}")


def main(argv: list[str] | None = None) -> int:
    started = time.time()
    args = parse_args(argv)
    if args.worker:
        rc = worker.main(args.worker)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)  # no interpreter teardown to hang in; the parent reaps the process group
    model_dir = write_model_dir(args.model_root, args.shape)
    os.makedirs(args.log_dir, exist_ok=True)
    common = common_fields(args)
    print(f"[bench] {common['gpu']}, {common['versions']}, model folder {model_dir}")
    print_workloads(args)
    tmpdir = tempfile.mkdtemp(prefix="vllm_gdn_hs_bench_")
    budget, summary = Budget(args.budget, started + args.budget), []
    for backend in args.gdn_backends:  # one engine start per variant and backend
        for variant in args.variants:
            if variant == "hf" and backend != args.gdn_backends[0]:
                continue  # transformers has no GDN backend choice: once is enough
            plan = make_plan(args, variant, model_dir, tmpdir, __file__, backend)
            announce(plan, args)
            if args.dry_run:
                continue
            records = run_variant(args, plan, budget, common)
            merge_results(args.results, records)
            summary += records
            print(
                f"[bench] {variant} (GDN {backend}): {len(records)} records -> {args.results}",
                flush=True,
            )
    if args.dry_run:
        print(f"[bench] dry run: worker specs kept in {tmpdir}")
        return 0
    shutil.rmtree(tmpdir, ignore_errors=True)
    print_summary(summary, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
