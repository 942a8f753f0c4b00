"""What bench.py runs for each variant: the worker's spec and command, its environment, the
fields every record shares, and whether the variant can run here at all."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import metadata

import worker
from host import fs_type, git_commit, nvidia_smi, versions
from records import BASELINES, OURS
from workloads import bytes_needed, make_workload, model_summary


@dataclass
class Plan:
    variant: str
    mode: str  # eager or cudagraph (hf: eager)
    spec: dict  # what the worker reads; kept in the records' flags
    cmd: list[str]
    env: dict
    problem: str | None  # why it cannot run here ("skipped: ..."), or None


def plugin_problem() -> str | None:
    """Why the ours variant cannot run here (checked before any engine starts), or None."""
    eps = metadata.entry_points(group="vllm.general_plugins")
    if not any(ep.name == "vllm_gdn_hs" for ep in eps):
        return (
            "skipped: vllm-gdn-hs is not installed (no vllm.general_plugins entry point); "
            "install it: python3 -m pip install --no-deps --no-build-isolation --no-index "
            "--target /tmp/site ."
        )
    from vllm_gdn_hs.version import UnsupportedVllmError, check_vllm

    try:
        check_vllm()
    except UnsupportedVllmError as e:
        return f"skipped: {e}"
    return None


def common_fields(args: argparse.Namespace) -> dict:
    """What every record of one command shares: date, GPU, versions, shape, target, commit."""
    return dict(
        date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        gpu=nvidia_smi("name") or "none",
        versions=versions(),
        shape=args.shape,
        model=model_summary(args.shape),
        layers=args.layers,
        write_target="tmpfs" if fs_type(args.out_dir) == "tmpfs" else "disk",
        out_dir=args.out_dir,
        out_fs=fs_type(args.out_dir),
        commit=git_commit(),
        run=args.run,
    )


def print_workloads(args: argparse.Namespace) -> None:
    for name in args.workloads:
        s = make_workload(name, args.seed).stats()
        print(
            f"[bench] workload {name}: {s['num_requests']} requests, {s['prompt_tokens']:,} "
            f"prompt tokens, mean {s['mean_len']}, median {s['median_len']}, "
            f"min {s['min_len']}, max {s['max_len']}, "
            f"{s['output_tokens_requested']} output tokens"
        )


def variant_env(variant: str) -> dict:
    env = dict(os.environ, VLLM_USE_FLASHINFER_SAMPLER="0", PYTHONUNBUFFERED="1", NO_COLOR="1")
    if variant.endswith(("-v1", "-v2")):  # vLLM's own switch; before V2 it is ignored, and
        # 0.34.0 (V2 only) stops at startup on any value but 1
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1" if variant.endswith("-v2") else "0"
    if variant not in OURS and "VLLM_PLUGINS" not in env:
        # plain and upstream run without vLLM plugins: vLLM as shipped, and our plugin
        # refuses to load on a vLLM it does not support (0.26.0), which would stop the engine
        env["VLLM_PLUGINS"] = ""
    return env


def make_plan(
    args: argparse.Namespace,
    variant: str,
    model_dir: str,
    tmpdir: str,
    bench_py: str,
    gdn_backend: str = "default",
) -> Plan:
    """One variant's plan with one GDN prefill backend ("default": vLLM's choice); its spec is
    written to tmpdir for the worker command."""
    name = variant if gdn_backend == "default" else f"{variant}-{gdn_backend}"
    spec = dict(
        variant=variant,
        gdn_backend=gdn_backend,
        max_num_batched_tokens=getattr(args, "max_num_batched_tokens", 0),
        max_num_seqs=getattr(args, "max_num_seqs", 0),
        shape=args.shape,
        model_dir=model_dir,
        layers=args.layers,
        workloads=args.workloads,
        eager=args.eager,
        out_dir=os.path.join(os.path.abspath(args.out_dir), variant),
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        hf_batch_sizes=args.hf_batch_sizes,
        extra_engine_kwargs=args.extra_engine_kwargs,
        connector_config=args.connector_config,
        seed=args.seed,
        drain_timeout=args.drain_timeout,
        mooncake_segment_gib=args.mooncake_segment_gib,
        result_file=os.path.join(tmpdir, f"{name}.json"),
    )
    spec_path = os.path.join(tmpdir, f"{name}-spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f, indent=1)
    return Plan(
        variant=variant,
        mode="eager" if variant == "hf" or args.eager else "cudagraph",  # transformers: eager
        spec=spec,
        cmd=[sys.executable, os.path.abspath(bench_py), "--worker", spec_path],
        env=variant_env(variant),
        problem=plugin_problem() if variant in OURS else None,
    )


def announce(plan: Plan, args: argparse.Namespace) -> None:
    """The child command, the engine's arguments, and for extraction the space it needs."""
    variant, spec = plan.variant, plan.spec
    print(f"[bench] {variant}: {shlex.join(plan.cmd)}", flush=True)
    if variant != "hf":
        print(f"[bench] {variant}: LLM(**{worker.engine_kwargs(spec)})", flush=True)
    if plan.problem:
        print(f"[bench] {variant}: {plan.problem}", flush=True)
    if variant not in BASELINES:
        parent = os.path.dirname(spec["out_dir"])
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        worst = max(bytes_needed(make_workload(n, args.seed), spec) for n in args.workloads)
        print(
            f"[bench] {variant}: largest workload writes {worst / 1e9:.1f} GB; "
            f"{shutil.disk_usage(parent).free / 1e9:.1f} GB free in {parent}",
            flush=True,
        )
