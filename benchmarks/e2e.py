"""End-to-end rate through an OpenAI server, as speculators' data generation drives it: one
``vllm-gdn-hs launch MODEL ... -- <serve flags>`` per backend (file, fp8, mooncake), and plain
``vllm serve MODEL <the same serve flags>`` as the baseline; the workload's prompts go as token
ids (POST /v1/completions, ``prompt`` a list of ints, ``max_tokens`` 1, ``return_token_ids``
true) from ``--concurrency`` threads. Each backend's record (samples/s, prompt tokens/s, every
answered file checked) is appended to ``--results`` as soon as its server has stopped.

    python benchmarks/e2e.py --shape 27b --backends plain,file,fp8,mooncake --workload chat \\
        --out-dir /dev/shm/e2e --results /tmp/e2e.json --run run48 -- --max-num-seqs 256

Flags after ``--`` go to ``vllm serve`` for every backend alike. Stdlib only (urllib, threads).
The server runs in a session of its own and is stopped with SIGTERM to that group (SIGKILL
after ``--stop-grace`` s), so the connector writes what it answered before it exits.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from datetime import datetime, timezone

from host import git_commit, nvidia_smi, versions
from logparse import (
    compress_log,
    gdn_backend_info,
    kv_cache_info,
    memory_info,
    read_log,
    warmup_info,
)
from records import merge_results
from workloads import (
    DEFAULT_LAYERS,
    WARMUP_PROMPTS,
    make_workload,
    model_config,
    prompt_ids,
    write_model_dir,
)

BACKENDS = ("plain", "file", "fp8", "mooncake")
HOST = "127.0.0.1"
CHUNKED_RE = r"Chunked prefill is enabled with max_num_batched_tokens=(\d+)"


def request_body(model: str, ids: list[int]) -> dict:
    """One request as speculators' data generation sends it."""
    return {"model": model, "prompt": ids, "max_tokens": 1, "return_token_ids": True}


def post(url: str, body: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


def send_all(url: str, model: str, prompts: list[list[int]], concurrency: int) -> list:
    """Every prompt, ``concurrency`` requests in flight; the answers (or the exception) in
    prompt order."""
    answers: list = [None] * len(prompts)
    nxt, lock = iter(range(len(prompts))), threading.Lock()

    def work() -> None:
        while True:
            with lock:
                i = next(nxt, None)
            if i is None:
                return
            try:
                answers[i] = post(url, request_body(model, prompts[i]))
            except Exception as e:  # recorded, counted as failed
                answers[i] = e

    threads = [threading.Thread(target=work, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return answers


def answer_problem(answer, ids: list[int], backend: str) -> str | None:
    """Why an answer is not what the backend must give (None: it is)."""
    if isinstance(answer, Exception):
        return f"{type(answer).__name__}: {answer}"
    if answer["choices"][0].get("prompt_token_ids") not in (None, ids):
        return "prompt_token_ids differ from the prompt"
    if backend == "plain":
        return None
    params = answer.get("kv_transfer_params") or {}
    if params.get("hidden_states_error"):
        return f"hidden_states_error: {params['hidden_states_error']}"
    if backend == "mooncake":
        return None if params else "no kv_transfer_params (no mooncake manifest)"
    return None if params.get("hidden_states_path") else "no hidden_states_path"


def files_ready(paths: list[str], timeout: float) -> tuple[float, list[str]]:
    """Seconds until every answered path is a finished file (exists, its ``.lock`` gone), and
    the paths that were not within ``timeout``."""
    t0, left = time.perf_counter(), set(paths)
    while left and time.perf_counter() - t0 < timeout:
        left = {p for p in left if not os.path.exists(p) or os.path.exists(p + ".lock")}
        if left:
            time.sleep(0.01)
    return time.perf_counter() - t0, sorted(left)


def serve_command(args, backend: str, port: int) -> list[str]:
    """The server for one backend: the launcher for ours, plain ``vllm serve`` for the
    baseline; the same serve flags after it either way (the flags the launcher adds for a
    hybrid model are given to both explicitly)."""
    serve = ["--host", HOST, "--port", str(port), *args.serve_common, *args.serve_args]
    if backend == "plain":
        # as the launcher starts it: no console script needed on PATH (the device's isn't)
        return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", args.model, *serve]
    cmd = [sys.executable, "-m", "vllm_gdn_hs.cli", "launch", args.model]
    cmd += ["--hidden-states-backend", backend, "--hidden-states-path", args.backend_dir(backend)]
    cmd += ["--target-layer-ids", *map(str, args.layers), "--no-include-last-layer"]
    if backend == "mooncake":
        cmd += ["--mooncake-master", f"{HOST}:{args.mooncake_port}"]
        cmd += ["--mooncake-metadata-server", "P2PHANDSHAKE", "--mooncake-protocol", "tcp"]
        cmd += ["--mooncake-global-segment-gib", str(args.mooncake_segment_gib)]
    return [*cmd, "--", *serve]


def common_serve_flags(args) -> list[str]:
    """Flags every backend's server gets before the user's: dummy weights where the model is a
    shape, no tokenizer (token ids in and out), prefix caching off, the language model only,
    and the GDN prefill backend unless it is vLLM's default."""
    flags = ["--skip-tokenizer-init", "--no-enable-prefix-caching", "--language-model-only"]
    flags += ["--max-model-len", str(args.max_model_len)]
    if args.shape:
        flags += ["--load-format", "dummy"]
    if args.gdn_backend != "default":
        flags += ["--additional-config", json.dumps({"gdn_prefill_backend": args.gdn_backend})]
    return flags


def server_env(backend: str) -> dict:
    env = dict(os.environ, VLLM_USE_FLASHINFER_SAMPLER="0", PYTHONUNBUFFERED="1", NO_COLOR="1")
    if backend == "plain" and "VLLM_PLUGINS" not in env:
        env["VLLM_PLUGINS"] = ""  # vLLM as shipped, as bench.py's plain
    return env


def health(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def stop(proc: subprocess.Popen, grace: float) -> float:
    """SIGTERM to the server's session, SIGKILL after ``grace`` s; the seconds it took."""
    t0 = time.perf_counter()
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(wait)
            break
        except ProcessLookupError:
            break
        except subprocess.TimeoutExpired:
            continue
    return time.perf_counter() - t0


def setting(flags: list[str], name: str):
    """The last value of ``--name`` in serve flags (``--name=V`` too), or None."""
    value = None
    for i, f in enumerate(flags):
        if f == name and i + 1 < len(flags):
            value = flags[i + 1]
        elif f.startswith(name + "="):
            value = f.split("=", 1)[1]
    return value


def record_fields(args, backend: str, log: str) -> dict:
    """What every record names: date, commit, GPU, versions, runner, mode, the GDN prefill
    backend used (the server's log line, else the requested one), step and batch sizes,
    prefix caching and KV sizing, as the serve flags and the server's log say."""
    import re

    flags = [*args.serve_common, *args.serve_args]
    gdn = gdn_backend_info(log)
    chunked = re.findall(CHUNKED_RE, log)
    mnbt = setting(flags, "--max-num-batched-tokens")
    seqs = setting(flags, "--max-num-seqs")
    gmu = setting(flags, "--gpu-memory-utilization")
    vllm = versions()["vllm"]
    return dict(
        date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        commit=git_commit(),
        run=args.run,
        gpu=nvidia_smi("name") or "none",
        versions=versions(),
        variant=f"e2e-{backend}",
        backend=backend,
        runner="v2" if vllm and tuple(map(int, vllm.split(".")[:2])) >= (0, 34) else None,
        mode="eager" if "--enforce-eager" in flags else "cudagraph",
        gdn_backend_requested=args.gdn_backend,
        gdn_prefill_backend=gdn.get("gdn_prefill_backend") or f"{args.gdn_backend} (requested)",
        gdn_prefill_backend_source="vllm log" if gdn else "requested",
        max_num_batched_tokens=int(chunked[-1]) if chunked else (mnbt and int(mnbt)),
        max_num_seqs=int(seqs) if seqs else None,
        prefix_caching=False,
        kv_sizing=f"gpu_memory_utilization {gmu}" if gmu else "extensible KV cache",
        shape=args.shape,
        model=args.model,
        layers=args.layers,
        concurrency=args.concurrency,
        serve_flags=flags,
        **kv_cache_info(log),
        **warmup_info(log),
        **memory_info(log),
    )


def measure(args, backend: str, url: str) -> dict:
    """Warm-up, then the timed workload against a healthy server; the figures."""
    w = make_workload(args.workload, args.seed)
    prompts = prompt_ids(w, args.seed)
    send_all(url, args.served_model, prompts[:WARMUP_PROMPTS], args.concurrency)
    t0 = time.perf_counter()
    answers = send_all(url, args.served_model, prompts, args.concurrency)
    wall = time.perf_counter() - t0
    pairs = zip(answers, prompts, strict=True)
    problems = [p for a, ids in pairs if (p := answer_problem(a, ids, backend))]
    rec = dict(w.stats(), wall_s=round(wall, 3), answered=len(answers) - len(problems))
    rec["samples_s"] = round(rec["answered"] / wall, 2)
    rec["prompt_tokens_s"] = round(w.stats()["prompt_tokens"] / wall, 1)
    if problems:
        rec["failed_requests"] = len(problems)
        rec["first_problem"] = problems[0][:500]
    if backend in ("file", "fp8"):
        paths = [
            a["kv_transfer_params"]["hidden_states_path"]
            for a in answers
            if isinstance(a, dict) and (a.get("kv_transfer_params") or {}).get("hidden_states_path")
        ]
        ready_s, missing = files_ready(paths, args.files_timeout)
        rec.update(files_checked=len(paths), files_missing=len(missing))
        rec["files_ready_s"] = round(ready_s, 3)
        if missing:
            rec["first_missing"] = missing[0]
    rec["status"] = "ok" if not problems and not rec.get("files_missing") else "failed"
    return rec


def run_backend(args, backend: str) -> dict:
    """One server from start to stop, and its record (never raises: a failure is recorded)."""
    from mooncake_side import free_port

    rec: dict = {}
    log_path = os.path.join(args.log_dir, f"e2e-{backend}-{args.gdn_backend}.log")
    master = None
    if backend == "mooncake":
        problem = mooncake_problem()
        if problem:
            return dict(record_fields(args, backend, ""), status="skipped", error=problem)
        from mooncake_side import master_binary, start_master

        args.mooncake_port = free_port()
        master = start_master(master_binary(), args.mooncake_port, log_path + ".master")
    port = free_port()
    url = f"http://{HOST}:{port}"
    cmd = serve_command(args, backend, port)
    shutil.rmtree(args.backend_dir(backend), ignore_errors=True)
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=server_env(backend),
            start_new_session=True,
        )  # fmt: skip
    try:
        while not health(url):
            if proc.poll() is not None or time.perf_counter() - t0 > args.start_timeout:
                raise RuntimeError(
                    f"server exited {proc.returncode}"
                    if proc.poll() is not None
                    else f"server not healthy after {args.start_timeout:.0f} s"
                )
            time.sleep(1)
        rec["startup_s"] = round(time.perf_counter() - t0, 1)
        rec.update(measure(args, backend, url))
    except Exception as e:
        rec.update(status="failed", error=f"{type(e).__name__}: {e}")
    finally:
        rec["stop_s"] = round(stop(proc, args.stop_grace), 1)
        rec["server_exit"] = proc.returncode
        if master is not None:
            os.kill(master.pid, signal.SIGTERM)
            master.wait(30)
        shutil.rmtree(args.backend_dir(backend), ignore_errors=True)
    log = read_log(log_path)
    log_path = compress_log(log_path)  # read: kept as log.gz
    if rec.get("status") != "ok":
        rec["log_tail"] = "\n".join(log.splitlines()[-25:])
    return dict(record_fields(args, backend, log), command=cmd, log=log_path, **rec)


def mooncake_problem() -> str | None:
    from mooncake_side import master_binary

    try:
        import mooncake.store  # noqa: F401
    except ImportError:
        return "skipped: no mooncake wheel"
    if master_binary() is None:
        return "skipped: no mooncake_master binary"
    return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    serve_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shape", default="27b", help="a dummy-weight model shape (workloads.py)")
    p.add_argument("--model", help="a model folder or name instead of --shape (real weights)")
    p.add_argument("--layers", help="comma list of layer ids (default: bench.py's)")
    p.add_argument("--backends", default="plain,file,fp8,mooncake")
    p.add_argument("--workload", default="chat")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--gdn-backend", default="default", help="default (vLLM's choice) or triton")
    p.add_argument("--max-model-len", type=int, default=8448)
    p.add_argument("--out-dir", default="/dev/shm/e2e")
    p.add_argument("--results", required=True, help="results JSON; records are appended")
    p.add_argument("--log-dir", default="/tmp/vllm_gdn_hs_bench/e2e-logs")
    p.add_argument("--model-root", default="/tmp/vllm_gdn_hs_bench/models")
    p.add_argument("--run", help="a label shared with bench.py's records of the same session")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--stop-grace", type=float, default=200)
    p.add_argument("--files-timeout", type=float, default=120)
    p.add_argument("--mooncake-segment-gib", type=float, default=40)
    args = p.parse_args(argv)
    args.serve_args = serve_args
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if bad := [b for b in args.backends if b not in BACKENDS]:
        p.error(f"unknown backends {bad}: choose from {','.join(BACKENDS)}")
    if args.model:
        args.shape = None
    make_workload(args.workload, args.seed)
    if args.layers:
        args.layers = [int(x) for x in args.layers.split(",")]
    else:
        n = model_config(args.shape or "27b")["text_config"]["num_hidden_layers"]
        args.layers = DEFAULT_LAYERS[n]
    args.mooncake_port = None
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.shape:
        args.model = write_model_dir(args.model_root, args.shape)
    args.served_model = args.model  # vllm serve names the model by its path
    args.serve_common = common_serve_flags(args)
    args.backend_dir = lambda b: os.path.join(os.path.abspath(args.out_dir), b)
    os.makedirs(args.log_dir, exist_ok=True)
    for backend in args.backends:
        print(f"[e2e] {backend}: starting {time.strftime('%H:%M:%S')}", flush=True)
        rec = run_backend(args, backend)
        merge_results(args.results, [rec])  # kept even if a later backend is cut off
        figures = (
            f"{rec.get('samples_s')} samples/s, {rec.get('prompt_tokens_s')} prompt tok/s"
            if rec.get("status") == "ok"
            else rec.get("error") or rec.get("first_problem") or rec.get("first_missing")
        )
        print(f"[e2e] {backend}: {rec.get('status')}: {figures} -> {args.results}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
