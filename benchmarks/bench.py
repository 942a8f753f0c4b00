"""Hidden-state extraction speed and memory: plain vLLM, ours, upstream vLLM, HF transformers.

Each variant runs in a fresh child process (``bench.py --worker SPEC.json``) so engines never
share GPU memory; the parent tees the child's output (and the vLLM engine core's, which
inherits it) to a log, reads vLLM's KV cache lines from it, and merges the child's records
into one results JSON. A child that fails or times out leaves an error record, not a crash.

    python benchmarks/bench.py --shape 27b --variants plain,ours --workloads 128x1024 --eager \\
        --out-dir /dev/shm/hs --results benchmarks/results/h200.json
    python benchmarks/report.py benchmarks/results/h200.json --md benchmarks/results/README-table.md

Variants:   plain (no extraction), ours (HybridHiddenStatesConnector), upstream (vLLM's
            ExampleHiddenStatesConnector), hf (transformers + forward hooks, best batch size).
Workloads:  NxL (N random-token prompts of L tokens, max_tokens=1), mixed (lognormal lengths,
            max_tokens=1), mixed-outK / NxL-outK (the same prompts, K generated tokens with
            include_output_tokens). See benchmarks/README.md.
Smoke test: --smoke (tiny shape, 16x512 and 16x512-out8, eager), about a minute per engine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import metadata

from vllm_gdn_hs.files import take_finished

HERE = os.path.dirname(os.path.abspath(__file__))
REFERENCE_CONFIG = os.path.join(HERE, "qwen3.6-27b-config.json")

# Text-model shapes. "27b" is the published Qwen3.6-27B config; "4b" halves hidden size, layers
# and every head count (head dims unchanged): about 3.0B non-embedding + 1.3B embedding params,
# not a released checkpoint. "tiny" is a smoke test. Full attention is every 4th layer.
SHAPES = {
    "27b": {},
    "4b": dict(
        hidden_size=2560,
        num_hidden_layers=32,
        intermediate_size=8704,
        num_attention_heads=12,
        num_key_value_heads=2,
        linear_num_key_heads=8,
        linear_num_value_heads=24,
    ),
    "tiny": dict(
        hidden_size=256,
        num_hidden_layers=8,
        intermediate_size=512,
        num_attention_heads=2,
        num_key_value_heads=1,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
    ),
}
# Layer ids to extract (k = residual stream after k decoder layers). 64 layers: speculators'
# EAGLE-3 style spread; 32 layers: the same positions halved.
DEFAULT_LAYERS = {64: [1, 16, 31, 46, 61, 64], 32: [1, 8, 16, 23, 31, 32], 8: [1, 2, 4, 6, 7, 8]}

VARIANTS = ("plain", "ours", "upstream", "hf")
CONNECTORS = {"ours": "HybridHiddenStatesConnector", "upstream": "ExampleHiddenStatesConnector"}

# The mixed workload: prompt lengths ~ lognormal(mu, sigma) tokens, clipped, fixed seed.
MIXED_N, MIXED_MU, MIXED_SIGMA, MIXED_CLIP = 256, 6.93, 1.0, (16, 8192)  # median e^6.93 ~ 1024
WARMUP_PROMPTS = 8
TOKEN_RANGE = (1000, 150000)  # random prompt ids, clear of special and image/video token ids
KV_SIZE_RE = re.compile(r"KV cache size: ([\d,]+) tokens")
KV_CONC_RE = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")
# The writer's last progress or shutdown line: files, bytes, its host cost per engine step.
WRITER_RE = re.compile(
    r"HybridHiddenStatesConnector: ((?:shut down; |\d+ files ).*per step.*)$", re.M
)
# The worker's progress marks (epoch seconds), read back when the --budget or --timeout cuts it
READY_RE = re.compile(r"\[bench\] \S+: engine ready at ([\d.]+)$", re.M)
GENERATING_RE = re.compile(r"\[bench\] \S+ (\S+): generating from ([\d.]+)$", re.M)
# "ValueError: ..." alone or after the engine core's "(EngineCore_DP0 pid=123) " prefix
ERROR_LINE_RE = re.compile(r"(?:^|\) )([\w.]*(?:Error|Exception): .*)")
ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")


# ---------------------------------------------------------------------------------------------
# Model folders and workloads (CPU only)


def model_config(shape: str) -> dict:
    with open(REFERENCE_CONFIG) as f:
        cfg = json.load(f)
    cfg.pop("_comment", None)
    text = cfg["text_config"]
    text.update(SHAPES[shape])
    n = text["num_hidden_layers"]
    text["layer_types"] = [
        "full_attention" if (i + 1) % text["full_attention_interval"] == 0 else "linear_attention"
        for i in range(n)
    ]
    cfg["vision_config"]["out_hidden_size"] = text["hidden_size"]
    return cfg


def write_model_dir(root: str, shape: str) -> str:
    """A model folder with config.json only: enough for load_format="dummy"."""
    path = os.path.join(root, f"qwen3.6-{shape}-dummy")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(model_config(shape), f, indent=1)
    return path


def model_summary(shape: str) -> dict:
    """The text-model numbers report.py needs for the FLOPs/roofline formula."""
    t = model_config(shape)["text_config"]
    out = {k: v for k, v in t.items() if not isinstance(v, (list, dict, str))}
    out["num_full_attention_layers"] = t["layer_types"].count("full_attention")
    out["num_linear_attention_layers"] = t["layer_types"].count("linear_attention")
    return out


@dataclass
class Workload:
    name: str
    lengths: list[int]
    output_tokens: int = 0  # 0: prefill only (max_tokens=1); K: K tokens, include_output_tokens

    @property
    def max_tokens(self) -> int:
        return max(self.output_tokens, 1)

    def stats(self) -> dict:
        # Tokens that go through a forward pass: the prompt, plus all generated tokens but
        # the last. attn_ctx_mean: keys an average such token attends to (report.py's FLOPs).
        seen = [n + max(self.output_tokens - 1, 0) for n in self.lengths]
        return dict(
            workload=self.name,
            num_requests=len(self.lengths),
            prompt_tokens=sum(self.lengths),
            output_tokens_requested=self.output_tokens,
            processed_tokens=sum(seen),
            mean_len=round(statistics.mean(self.lengths), 1),
            median_len=statistics.median(self.lengths),
            min_len=min(self.lengths),
            max_len=max(self.lengths),
            attn_ctx_mean=round(sum(t * (t + 1) / 2 for t in seen) / sum(seen), 1),
        )


def make_workload(name: str, seed: int) -> Workload:
    m = re.fullmatch(r"(\d+)x(\d+)(?:-out(\d+))?", name)
    if m:
        return Workload(name, [int(m[2])] * int(m[1]), int(m[3] or 0))
    m = re.fullmatch(r"mixed(?:-out(\d+))?", name)
    if m:
        rng = random.Random(f"mixed:{seed}")
        lo, hi = MIXED_CLIP
        lengths = [
            min(hi, max(lo, round(rng.lognormvariate(MIXED_MU, MIXED_SIGMA))))
            for _ in range(MIXED_N)
        ]
        return Workload(name, lengths, int(m[1] or 0))
    raise ValueError(
        f"unknown workload {name!r}: use NxL (e.g. 128x1024), NxL-outK, mixed or mixed-outK"
    )


def prompt_ids(w: Workload, seed: int) -> list[list[int]]:
    base = w.name.split("-out")[0]  # mixed-out256 gets the prompts of mixed
    rng = random.Random(f"tokens:{base}:{seed}")
    return [[rng.randrange(*TOKEN_RANGE) for _ in range(n)] for n in w.lengths]


# ---------------------------------------------------------------------------------------------
# Helpers shared by the parent and the workers


def gpu_index() -> str:
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    return first if first.isdigit() else "0"


def nvidia_smi(field: str) -> str | None:
    try:
        out = subprocess.run(
            [
                "nvidia-smi",
                f"--query-gpu={field}",
                "--format=csv,noheader,nounits",
                "-i",
                gpu_index(),
            ],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout.strip()
        return out or None
    except (OSError, subprocess.SubprocessError):
        return None


def gpu_mem_used_mib() -> int | None:
    out = nvidia_smi("memory.used")
    return int(out) if out and out.isdigit() else None


class GpuMemPoller(threading.Thread):
    """Max of nvidia-smi memory.used (whole GPU, all processes) between take() calls."""

    def __init__(self, interval: float = 0.2):
        super().__init__(daemon=True)
        self.interval, self.peak, self.stopped = interval, None, False

    def run(self) -> None:
        while not self.stopped:
            used = gpu_mem_used_mib()
            if used is None:
                return  # no nvidia-smi: peaks stay None
            self.peak = used if self.peak is None else max(self.peak, used)
            time.sleep(self.interval)

    def take(self) -> int | None:
        peak, self.peak = self.peak, None
        return peak


def dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return None


def git_commit() -> str | None:
    """The checkout's short commit, "-dirty" when tracked files differ from it; None without git."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short=7", "HEAD"], cwd=here, capture_output=True, text=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=here,
            capture_output=True,
            text=True,
        )
    except OSError:
        return None
    if head.returncode:
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def versions() -> dict:
    return dict(
        vllm=dist_version("vllm"),
        torch=dist_version("torch"),
        transformers=dist_version("transformers"),
        fla=dist_version("flash-linear-attention", "fla-core"),
        vllm_gdn_hs=dist_version("vllm-gdn-hs"),
        safetensors=dist_version("safetensors"),
        python=sys.version.split()[0],
    )


def fs_type(path: str) -> str | None:
    """Filesystem type of the mount holding path (tmpfs for /dev/shm), from /proc/mounts."""
    path, best, fstype = os.path.realpath(path), "", None
    try:
        with open("/proc/mounts") as f:
            for line in f:
                mnt, typ = line.split()[1:3]
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                    best, fstype = mnt, typ
    except OSError:
        pass
    return fstype


def reset_dir(path: str) -> None:
    """Empty path but keep the folder itself: a connector may have created it only once."""
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(path):
        p = os.path.join(path, name)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p, ignore_errors=True)
        else:
            os.remove(p)


def dir_bytes(path: str) -> tuple[int, int]:
    """(bytes, number of .safetensors files) under path."""
    total = files = 0
    for root, _, names in os.walk(path):
        for name in names:
            total += os.path.getsize(os.path.join(root, name))
            files += name.endswith(".safetensors")
    return total, files


def bytes_needed(w: Workload, spec: dict) -> int:
    """Hidden-state bytes one run of w writes: processed tokens x (layers x hidden x 2 B + 8 B)."""
    hidden = model_config(spec["shape"])["text_config"]["hidden_size"]
    return w.stats()["processed_tokens"] * (len(spec["layers"]) * hidden * 2 + 8)


class Skip(Exception):
    """A workload not run, for a reason given in one line (no traceback in the record)."""


def error_text(e: Exception) -> str:
    return str(e) if isinstance(e, Skip) else traceback.format_exc(limit=-3)


def can_start(left_s: float, slowest_s: float) -> bool:
    """Whether a variant is worth starting with left_s of the --budget: 20 s go to stopping
    and writing results, and a variant needs about as long as the slowest one so far took
    from start to its last record (27B with CUDA graphs on 0.26.0: 270 s)."""
    return left_s - 20 >= max(30.0, slowest_s)


def check_space(out_dir: str, w: Workload, spec: dict) -> None:
    """Refuse a workload whose files would not fit (tmpfs is RAM: a full one stalls the run)."""
    need, free = bytes_needed(w, spec), shutil.disk_usage(out_dir).free
    if need * 1.1 > free:
        raise Skip(
            f"skipped: {w.name} writes about {need / 1e9:.1f} GB, only {free / 1e9:.1f} GB free "
            f"in {out_dir}"
        )


def drain(out_dir: str, outputs, expected: int, timeout: float) -> float:
    """Seconds until every expected hidden-state file exists and is unlocked."""
    paths = [(o.kv_transfer_params or {}).get("hidden_states_path") for o in outputs]
    paths = [p if os.path.isabs(p) else os.path.join(out_dir, p) for p in paths if p]
    t0, done = time.perf_counter(), set()
    while True:
        if len(paths) < expected:  # the connector returned no paths: count what is there
            paths = [
                os.path.join(root, n)
                for root, _, names in os.walk(out_dir)
                for n in names
                if n.endswith(".safetensors")
            ]
        done.update(p for p in paths if p not in done and take_finished(p))
        if len(done) >= expected:
            return time.perf_counter() - t0
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError(
                f"{len(done)} of {expected} hidden-state files finished after {timeout:.0f} s "
                f"in {out_dir}: raise --drain-timeout or check the connector's log"
            )
        time.sleep(0.005)


# ---------------------------------------------------------------------------------------------
# Workers (one process per variant)


def engine_kwargs(spec: dict) -> dict:
    kw = dict(
        model=spec["model_dir"],
        load_format="dummy",
        language_model_only=True,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        enforce_eager=spec["eager"],
        additional_config={"gdn_prefill_backend": "triton"},
        enable_prefix_caching=False,
        max_model_len=spec["max_model_len"],
        gpu_memory_utilization=spec["gpu_memory_utilization"],
        seed=0,
    )
    connector = CONNECTORS.get(spec["variant"])
    if connector:
        from vllm_gdn_hs.config import extraction_config

        kw.update(
            extraction_config(
                spec["layers"], spec["out_dir"], connector, **spec.get("connector_config", {})
            )
        )
    kw.update(spec["extra_engine_kwargs"])
    return kw


def run_vllm(spec: dict, emit, poller: GpuMemPoller) -> None:
    from vllm import LLM, SamplingParams

    kwargs = engine_kwargs(spec)
    recorded_kwargs = json.loads(json.dumps(kwargs))  # vLLM fills config objects into nested dicts
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    startup = dict(startup_s=round(time.perf_counter() - t0, 1), startup_peak_gpu_mib=poller.take())
    print(ready_mark(spec["variant"], time.time()), flush=True)
    try:  # what vLLM chose, for reading the figures (0.20.1 attribute names)
        c = llm.llm_engine.vllm_config
        startup["engine_config"] = dict(
            async_scheduling=c.scheduler_config.async_scheduling,
            hybrid_kv_cache_manager=not c.scheduler_config.disable_hybrid_kv_cache_manager,
            max_num_seqs=c.scheduler_config.max_num_seqs,
            max_num_batched_tokens=c.scheduler_config.max_num_batched_tokens,
            block_size=c.cache_config.block_size,
            prefix_caching=c.cache_config.enable_prefix_caching,
        )
    except Exception as e:
        startup["engine_config"] = repr(e)
    connector = spec["variant"] in CONNECTORS
    out_dir = spec["out_dir"]
    for name in spec["workloads"]:
        w = make_workload(name, spec["seed"])
        rec = dict(w.stats(), **startup, engine_kwargs=recorded_kwargs)
        try:
            reset_dir(out_dir)
            if connector:
                check_space(out_dir, w, spec)
            prompts = [{"prompt_token_ids": ids} for ids in prompt_ids(w, spec["seed"])]
            extra = None
            if w.output_tokens and connector:
                extra = {"kv_transfer_params": {"include_output_tokens": True}}
            sp = SamplingParams(max_tokens=w.max_tokens, ignore_eos=True, extra_args=extra)
            warm = SamplingParams(
                max_tokens=min(w.max_tokens, 8), ignore_eos=True, extra_args=extra
            )
            rec["sampling"] = dict(max_tokens=w.max_tokens, ignore_eos=True, extra_args=extra)
            outs = llm.generate(prompts[:WARMUP_PROMPTS], warm, use_tqdm=False)
            if connector:
                drain(out_dir, outs, len(outs), spec["drain_timeout"])
            reset_dir(out_dir)
            poller.take()
            print(generating_mark(spec["variant"], name, time.time()), flush=True)
            t0 = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            gen_s = time.perf_counter() - t0
            drain_s = drain(out_dir, outs, len(outs), spec["drain_timeout"]) if connector else 0.0
            nbytes, nfiles = dir_bytes(out_dir)
            rec.update(
                gen_s=round(gen_s, 3),
                drain_s=round(drain_s, 3),
                output_tokens=sum(len(o.outputs[0].token_ids) for o in outs),
                files=nfiles,
                bytes_written=nbytes,
                peak_gpu_mib=poller.take(),
            )
        except Exception as e:
            rec["error"] = error_text(e)
        emit(rec)
        reset_dir(out_dir)
    shutil.rmtree(out_dir, ignore_errors=True)
    try:  # as tests/test_gpu_extract.py; the parent kills whatever is left
        llm.llm_engine.engine_core.shutdown()
    except Exception as e:
        print(f"[bench] engine shutdown: {e!r}", flush=True)


def run_hf(spec: dict, emit, poller: GpuMemPoller) -> None:
    """transformers forward with hooks on the chosen layers; saves upstream's file format.

    Builds the language model alone (Qwen3_5ForCausalLM from text_config, random weights, on
    the GPU), as vllm_gdn_hs.testing does: transformers 5.17 cannot build this config's vision
    tower, and vLLM's language_model_only skips it too."""
    from concurrent.futures import ThreadPoolExecutor

    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        import fla  # noqa: F401  (transformers picks up fla's GDN kernels when importable)

        fla_ok = True
    except Exception:
        fla_ok = False
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    text = dict(model_config(spec["shape"])["text_config"])
    cfg = AutoConfig.for_model(text.pop("model_type"), **text)
    torch.manual_seed(0)
    with torch.device(dev):  # weights made and initialised on the GPU, no CPU copy
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    if dev == "cuda":
        torch.cuda.synchronize()
    startup = dict(
        startup_s=round(time.perf_counter() - t0, 1),
        startup_peak_gpu_mib=poller.take(),
        fla_available=fla_ok,
        device=dev,
        hf_model=type(model).__name__,
        attn_implementation=getattr(model.config, "_attn_implementation", None),
    )

    captured: dict[int, torch.Tensor] = {}

    def hook(k):
        def fn(module, inputs, output):
            captured[k] = output[0] if isinstance(output, tuple) else output

        return fn

    body = model.model  # the decoder stack under the LM head
    for k in spec["layers"]:  # id 0 is the embeddings, id k the output of decoder layer k-1
        (body.embed_tokens if k == 0 else body.layers[k - 1]).register_forward_hook(hook(k))

    pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="hf-hs-save")
    out_dir = spec["out_dir"]

    def run_batch(ids: list[list[int]], names: list[str] | None) -> list:
        # Right padding needs no attention mask: causal attention and the GDN recurrence never
        # let a real token see the padding after it.
        x = torch.zeros(len(ids), max(map(len, ids)), dtype=torch.long)
        for j, seq in enumerate(ids):
            x[j, : len(seq)] = torch.tensor(seq)
        with torch.inference_mode():  # logits of the last position only, as vLLM's prefill
            model(input_ids=x.to(dev), use_cache=False, logits_to_keep=1)
            hs = torch.stack([captured[k] for k in spec["layers"]], dim=2).cpu()  # B,T,layers,H
        captured.clear()
        if names is None:
            return []
        return [
            pool.submit(
                save_file,
                {"hidden_states": hs[j, : len(seq)], "token_ids": torch.tensor(seq)},
                os.path.join(out_dir, n),
            )
            for j, (seq, n) in enumerate(zip(ids, names, strict=True))
        ]

    for name in spec["workloads"]:
        w = make_workload(name, spec["seed"])
        all_ids = prompt_ids(w, spec["seed"])
        order = sorted(range(len(all_ids)), key=lambda i: -len(all_ids[i]))  # least padding
        for bs in spec["hf_batch_sizes"]:
            rec = dict(w.stats(), **startup, batch_size=bs)
            if w.output_tokens:
                rec["error"] = "skipped: the hf variant measures prefill-only workloads"
                emit(rec)
                break
            try:
                batches = [order[i : i + bs] for i in range(0, len(order), bs)]
                reset_dir(out_dir)
                check_space(out_dir, w, spec)
                for n in (1024, 1023):  # warm-up; Triton specialises lengths on n % 16 == 0
                    run_batch([all_ids[i][:n] for i in batches[0]], None)
                if dev == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                poller.take()
                t0 = time.perf_counter()
                futures = []
                for b in batches:
                    names = [f"req-{i}.safetensors" for i in b]
                    futures += run_batch([all_ids[i] for i in b], names)
                gen_s = time.perf_counter() - t0
                for f in futures:
                    f.result()
                drain_s = time.perf_counter() - t0 - gen_s
                nbytes, nfiles = dir_bytes(out_dir)
                rec.update(
                    gen_s=round(gen_s, 3),
                    drain_s=round(drain_s, 3),
                    output_tokens=0,
                    padded_tokens=sum(len(b) * len(all_ids[b[0]]) for b in batches),
                    files=nfiles,
                    bytes_written=nbytes,
                    peak_gpu_mib=poller.take(),
                    torch_peak_mib=torch.cuda.max_memory_allocated() // 2**20
                    if dev == "cuda"
                    else None,
                )
            except Exception as e:
                rec["error"] = error_text(e)
            captured.clear()
            if dev == "cuda":
                torch.cuda.empty_cache()
            emit(rec)
            reset_dir(out_dir)
    pool.shutdown()
    shutil.rmtree(out_dir, ignore_errors=True)


def worker_main(spec_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    records: list[dict] = []

    def emit(rec: dict) -> None:
        records.append(rec)
        tmp = spec["result_file"] + ".tmp"
        with open(tmp, "w") as f:
            json.dump(records, f, indent=1, default=repr)  # a stray object never loses a record
        os.replace(tmp, spec["result_file"])  # the parent keeps what was done before a timeout
        msg = rec.get("error", "").strip().splitlines()[-1:] or [
            f"{rec['prompt_tokens'] / rec['gen_s']:,.0f} prompt tok/s, drain {rec['drain_s']} s"
        ]
        print(
            f"[bench] {spec['variant']} {rec['workload']} bs={rec.get('batch_size', '-')}: "
            f"{msg[0]}",
            flush=True,
        )

    poller = GpuMemPoller()
    poller.start()
    try:
        (run_hf if spec["variant"] == "hf" else run_vllm)(spec, emit, poller)
    except Exception:  # startup failed: one error record per workload not yet measured
        err = traceback.format_exc(limit=-3)
        done = {r["workload"] for r in records}
        for name in spec["workloads"]:
            if name not in done:
                emit(dict(make_workload(name, spec["seed"]).stats(), error=err))
        return 1
    finally:
        poller.stopped = True
    return 0


# ---------------------------------------------------------------------------------------------
# Parent


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
    with open(log_path, errors="replace") as f:
        return rc, ANSI_RE.sub("", f.read())


def wait_gpu_released(limit_mib: int = 4096, timeout: float = 30) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        used = gpu_mem_used_mib()
        if used is None or used < limit_mib:
            return
        time.sleep(1)
    print(f"[bench] warning: {gpu_mem_used_mib()} MiB still in use on the GPU", flush=True)


def kv_cache_info(log: str) -> dict:
    size, conc = KV_SIZE_RE.findall(log), KV_CONC_RE.findall(log)
    return dict(
        kv_cache_tokens=int(size[-1].replace(",", "")) if size else None,
        max_concurrency=float(conc[-1][1]) if conc else None,
    )


def writer_info(log: str) -> dict:
    """The writer's last summary line in an engine log (cumulative over the engine's workloads:
    exact for a group of one workload)."""
    lines = WRITER_RE.findall(log)
    return dict(writer_log=lines[-1].strip()) if lines else {}


def error_summary(error: str, log: str) -> str:
    """One line: the error, or for a failed vLLM engine core the root cause from its log."""
    last = (error.strip().splitlines() or ["error"])[-1]
    if "Engine core initialization failed" not in last:
        return last
    causes = [m[1] for m in map(ERROR_LINE_RE.search, log.splitlines()) if m]
    causes = [c for c in causes if "Engine core" not in c]
    return causes[-1].strip() if causes else last


def ready_mark(variant: str, at: float) -> str:
    return f"[bench] {variant}: engine ready at {at:.1f}"


def generating_mark(variant: str, workload: str, at: float) -> str:
    return f"[bench] {variant} {workload}: generating from {at:.1f}"


def cut_detail(log: str, started: float, stopped: float, workload: str, tokens: int) -> str:
    """How far a variant stopped at `stopped` had got with `workload`, from its progress
    marks: a lower bound on the time it needed, and so an upper bound on its tokens/s (prompt
    tokens, as the records' tokens/s)."""
    ready = READY_RE.findall(log)
    if not ready:
        return f"its engine was not ready after {stopped - started:.0f} s"
    gen = dict(GENERATING_RE.findall(log)).get(workload)
    if gen is None:
        return f"engine ready after {float(ready[-1]) - started:.0f} s; {workload} not begun"
    took = max(stopped - float(gen), 0.1)
    return (
        f"engine ready after {float(ready[-1]) - started:.0f} s; {workload} not done after "
        f"{took:.0f} s of generating: under {tokens / took:,.0f} tok/s"
    )


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
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
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
    p.add_argument("--drain-timeout", type=float, default=120)
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


def main(argv: list[str] | None = None) -> int:
    started = time.time()
    args = parse_args(argv)
    if args.worker:
        rc = worker_main(args.worker)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)  # no interpreter teardown to hang in; the parent reaps the process group
    model_dir = write_model_dir(args.model_root, args.shape)
    os.makedirs(args.log_dir, exist_ok=True)
    mode = "eager" if args.eager else "cudagraph"
    common = dict(
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
    print(f"[bench] {common['gpu']}, {common['versions']}, model folder {model_dir}")
    for name in args.workloads:
        s = make_workload(name, args.seed).stats()
        print(
            f"[bench] workload {name}: {s['num_requests']} requests, {s['prompt_tokens']:,} "
            f"prompt tokens, mean {s['mean_len']}, median {s['median_len']}, "
            f"min {s['min_len']}, max {s['max_len']}, "
            f"{s['output_tokens_requested']} output tokens"
        )
    base_env = dict(os.environ, VLLM_USE_FLASHINFER_SAMPLER="0", PYTHONUNBUFFERED="1", NO_COLOR="1")
    tmpdir = tempfile.mkdtemp(prefix="vllm_gdn_hs_bench_")
    deadline, summary = started + args.budget, []
    slowest_s = 0.0  # the longest variant so far: one with less time left is not begun
    for variant in args.variants:
        env = dict(base_env)
        if variant != "ours" and "VLLM_PLUGINS" not in env:
            # plain and upstream run without vLLM plugins: vLLM as shipped, and our plugin
            # refuses to load on a vLLM it does not support (0.26.0), which would stop the engine
            env["VLLM_PLUGINS"] = ""
        problem = plugin_problem() if variant == "ours" else None
        spec = dict(
            variant=variant,
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
            result_file=os.path.join(tmpdir, f"{variant}.json"),
        )
        spec_path = os.path.join(tmpdir, f"{variant}-spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f, indent=1)
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", spec_path]
        print(f"[bench] {variant}: {shlex.join(cmd)}", flush=True)
        if variant != "hf":
            print(f"[bench] {variant}: LLM(**{engine_kwargs(spec)})", flush=True)
        if problem:
            print(f"[bench] {variant}: {problem}", flush=True)
        if variant != "plain":
            parent = os.path.dirname(spec["out_dir"])
            while not os.path.exists(parent):
                parent = os.path.dirname(parent)
            worst = max(bytes_needed(make_workload(n, args.seed), spec) for n in args.workloads)
            print(
                f"[bench] {variant}: largest workload writes {worst / 1e9:.1f} GB; "
                f"{shutil.disk_usage(parent).free / 1e9:.1f} GB free in {parent}",
                flush=True,
            )
        if args.dry_run:
            continue
        vmode = "eager" if variant == "hf" else mode  # transformers runs eagerly
        log_path = os.path.join(args.log_dir, f"{args.shape}-{variant}-{vmode}.log")
        t0 = time.time()
        timeout = args.timeout
        if args.budget:
            timeout = min(timeout, deadline - t0 - 20)  # 20 s to kill, wait and write results
        out_of_budget = args.budget and not can_start(deadline - t0, slowest_s)
        rc, log, skip = None, "", bool(problem or out_of_budget)
        if not skip:
            rc, log = run_child(cmd, log_path, timeout, env)
            wait_gpu_released()
            shutil.rmtree(spec["out_dir"], ignore_errors=True)  # a killed worker leaves files
        records = []
        if os.path.exists(spec["result_file"]):
            with open(spec["result_file"]) as f:
                records = json.load(f)
        done = {r["workload"] for r in records}
        if problem:
            why = problem
        elif skip:
            why = f"skipped: not started, {deadline - t0:.0f} s left of --budget {args.budget:.0f}"
            if slowest_s:
                why += f" and a variant took {slowest_s:.0f} s; run it in its own call"
        elif rc is None and timeout < args.timeout:
            why = f"cut off by --budget after {timeout:.0f} s (not a fault: time ran out)"
        elif rc is None:
            why = f"timed out after {timeout:.0f} s (--timeout)"
        else:
            why = f"worker exited with status {rc}"
        stopped = min(time.time(), t0 + timeout)  # killed then, before the clean-up
        for n in args.workloads:
            if n in done:
                continue
            stats = make_workload(n, args.seed).stats()
            rec = dict(stats, error=why)
            if rc is None and not skip and variant != "hf":  # cut: say how far it got
                detail = cut_detail(log, t0, stopped, n, stats["prompt_tokens"])
                rec["error"] = f"{why}; {detail}"
            records.append(rec)
        tail = "\n".join(log.splitlines()[-25:])
        for r in records:
            r.update(
                common,
                variant=variant,
                mode=vmode,
                log=log_path,
                wall_s=round(time.time() - t0, 1),
                flags=dict(
                    argv=shlex.join([sys.executable] + sys.argv),
                    spec=spec,
                    VLLM_USE_FLASHINFER_SAMPLER="0",
                    VLLM_PLUGINS=env.get("VLLM_PLUGINS"),
                ),
                **(kv_cache_info(log) if variant != "hf" else {}),
                **(writer_info(log) if variant == "ours" else {}),
            )
            if r.get("error"):
                r.update(error_summary=error_summary(r["error"], log), log_tail=tail)
        if variant != "hf" and rc == 0:
            slowest_s = max(slowest_s, time.time() - t0)
        merge_results(args.results, records)
        summary += records
        print(f"[bench] {variant}: {len(records)} records -> {args.results}", flush=True)
    if args.dry_run:
        print(f"[bench] dry run: worker specs kept in {tmpdir}")
        return 0
    shutil.rmtree(tmpdir, ignore_errors=True)
    print(f"[bench] summary; table: python benchmarks/report.py {args.results}")
    for r in summary:
        if r.get("error"):
            res = r["error_summary"][:240]
        else:
            res = (
                f"{r['prompt_tokens'] / r['gen_s']:9,.0f} tok/s  drain {r['drain_s']:6.2f} s  "
                f"files {r['files']}  KV {r.get('kv_cache_tokens')}  peak {r['peak_gpu_mib']} MiB"
            )
        bs = r.get("batch_size", "-")
        print(f"  {r['variant']:9s} {r['workload']:13s} bs={bs!s:3s} {res}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
