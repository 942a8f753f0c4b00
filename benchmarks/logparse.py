"""What an engine log says: KV cache size, the writer's summary line, the root cause of a
failed engine core, and the worker's progress marks (engine ready, generating). A finished run
log is kept gzip-compressed (:func:`compress_log`) and read back either way (:func:`read_log`).

    python benchmarks/logparse.py compress LOG...   # each LOG replaced by LOG.gz
"""

from __future__ import annotations

import gzip
import os
import re
import shutil
import sys

KV_SIZE_RE = re.compile(r"KV cache size: ([\d,]+) tokens")
KV_CONC_RE = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")
# vLLM 0.34.0's extensible KV cache, after its warm-up (vllm/v1/worker/extensible_kv_cache.py):
# "Memory after warmup: F GiB free, C GiB committed to the KV cache, T GiB kept for transient
# activations (P GiB allocated at peak, R GiB of torch reservation growth); N KV cache blocks"
WARMUP_RE = re.compile(
    r"Memory after warmup: ([-\d.,]+) GiB free, ([-\d.,]+) GiB committed to the KV cache, "
    r"([-\d.,]+) GiB kept for transient activations \(([-\d.,]+) GiB allocated at peak, "
    r"([-\d.,]+) GiB of torch reservation growth\); (\d+) KV cache blocks"
)
# The worker's memory accounting (vllm/v1/worker/gpu_worker.py, gpu/model_runner.py): "Actual
# usage is W GiB for consumed memory (weights + non-torch), P GiB for peak activation, and G GiB
# for CUDAGraph memory" and "Graph capturing finished in S secs, took G GiB".
USAGE_RE = re.compile(r"([\d.]+) GiB for peak activation, and ([\d.]+) GiB for CUDAGraph memory")
CAPTURE_RE = re.compile(r"Graph capturing finished in (\d+) secs, took ([-\d.]+) GiB")
# "Extended KV cache to N blocks (X GiB)." (vllm/v1/worker/extensible_kv_cache.py)
EXTENDED_RE = re.compile(r"Extended KV cache to (\d+) blocks \(([\d.]+) GiB\)")
# "Using FlashInfer GDN prefill kernel (requested=auto, head_k_dim=128)." (qwen_gdn_linear_attn)
GDN_RE = re.compile(r"Using (.+?) GDN prefill kernel \((?:requested=([^,)]+))?")
GDN_NAMES = {"FlashInfer": "flashinfer", "CuteDSL": "cutedsl", "Triton/FLA": "triton"}
# The writer's last progress or shutdown line: files, bytes, its host cost per engine step
# (WriterStats.progress_line / shutdown_line in vllm_gdn_hs/connector/stats.py; in-process
# benchmarks read the WriterStats object itself, through the worker's stats).
WRITER_RE = re.compile(
    r"HybridHiddenStatesConnector: ((?:shut down; |\d+ (?:files|objects) ).*per step.*)$", re.M
)
# The worker's progress marks (epoch seconds), read back when the --budget or --timeout cuts it
READY_RE = re.compile(r"\[bench\] \S+: engine ready at ([\d.]+)$", re.M)
GENERATING_RE = re.compile(r"\[bench\] \S+ (\S+): generating from ([\d.]+)$", re.M)
# "ValueError: ..." alone or after the engine core's "(EngineCore_DP0 pid=123) " prefix
ERROR_LINE_RE = re.compile(r"(?:^|\) )([\w.]*(?:Error|Exception): .*)")
ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")


def strip_ansi(text: str) -> str:
    return ANSI_RE.sub("", text)


def compress_log(path: str) -> str:
    """Replace the finished log ``path`` by ``path.gz`` (no name or time in the gzip header: the
    same log gives the same bytes); the path it is at now (``path`` itself if there is none)."""
    if not os.path.exists(path):
        return path
    with (
        open(path, "rb") as src,
        open(path + ".gz", "wb") as raw,
        gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as dst,
    ):
        shutil.copyfileobj(src, dst)
    os.remove(path)
    return path + ".gz"


def read_log(path: str) -> str:
    """A run log's text, ANSI codes stripped: ``path``, or where only its compressed form is
    left (as records name the log they were read from), ``path.gz``."""
    if not os.path.exists(path) and os.path.exists(path + ".gz"):
        path += ".gz"
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", errors="replace") as f:
        return strip_ansi(f.read())


def kv_cache_info(log: str) -> dict:
    size, conc = KV_SIZE_RE.findall(log), KV_CONC_RE.findall(log)
    return dict(
        kv_cache_tokens=int(size[-1].replace(",", "")) if size else None,
        max_concurrency=float(conc[-1][1]) if conc else None,
    )


def warmup_info(log: str) -> dict:
    """The extensible KV cache's figures after vLLM's warm-up (the last such line), in GiB:
    the transient activations' peak ("allocated at peak") is what extraction may add to."""
    found = WARMUP_RE.findall(log)
    if not found:
        return {}
    free, kv, kept, peak, growth, blocks = found[-1]
    gib = [float(x.replace(",", "")) for x in (free, kv, kept, peak, growth)]
    return dict(
        warmup_free_gib=gib[0],
        warmup_kv_cache_gib=gib[1],
        warmup_transient_kept_gib=gib[2],
        warmup_allocated_peak_gib=gib[3],
        warmup_torch_growth_gib=gib[4],
        kv_cache_blocks=int(blocks),
    )


def memory_info(log: str) -> dict:
    """vLLM's own memory lines (the last of each), in GiB: the peak activation its profiling
    measured, what CUDA-graph capture took, and one KV cache block's size."""
    out: dict = {}
    if usage := USAGE_RE.findall(log):
        out["peak_activation_gib"], out["cudagraph_gib"] = map(float, usage[-1])
    if capture := CAPTURE_RE.findall(log):
        out["capture_s"], out["capture_gib"] = int(capture[-1][0]), float(capture[-1][1])
    if extended := EXTENDED_RE.findall(log):
        blocks, gib = int(extended[-1][0]), float(extended[-1][1])
        out["kv_block_gib"] = round(gib / blocks, 5) if blocks else None
    return out


def gdn_backend_info(log: str) -> dict:
    """The GDN prefill kernel vLLM chose, from its log line (None when the log has none)."""
    found = GDN_RE.findall(log)
    if not found:
        return {}
    name, requested = found[-1]
    return dict(
        gdn_prefill_backend=GDN_NAMES.get(name, name.lower()),
        gdn_prefill_backend_requested_vllm=requested or None,
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


if __name__ == "__main__":
    if sys.argv[1:2] != ["compress"] or len(sys.argv) < 3:
        sys.exit("usage: python benchmarks/logparse.py compress LOG...")
    for log in sys.argv[2:]:
        print(compress_log(log))
