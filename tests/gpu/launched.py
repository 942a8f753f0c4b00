"""`vllm-gdn-hs launch` as the GPU tests start it: a real `vllm serve` on 127.0.0.1.

The server runs in a session of its own and `stop` signals that whole group, so a test that
ends early, or a job cut by its time limit, leaves no engine holding the GPU for the next one.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

TRITON_GDN = json.dumps({"gdn_prefill_backend": "triton"})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(model, storage, layers, log, *serve_args: str, max_model_len: int = 2048, **popen):
    """Start the launcher for ``model`` writing under ``storage``; (process, base url).
    ``serve_args`` go to `vllm serve` after the tests' common ones (eager, 0.3 of the GPU)."""
    port = free_port()
    cmd = [sys.executable, "-m", "vllm_gdn_hs.cli", "launch", str(model)]
    cmd += ["--hidden-states-path", str(storage), "--target-layer-ids", *map(str, layers), "--"]
    cmd += ["--port", str(port), "--host", "127.0.0.1", "--gpu-memory-utilization", "0.3"]
    cmd += ["--max-model-len", str(max_model_len), "--enforce-eager"]
    cmd += ["--additional-config", TRITON_GDN, *serve_args]
    out = dict(stdout=log, stderr=subprocess.STDOUT)
    proc = subprocess.Popen(cmd, start_new_session=True, **out, **popen)
    return proc, f"http://127.0.0.1:{port}"


def health(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return r.status
    except OSError:
        return None


def wait_healthy(proc, url: str, log_path, timeout: float = 300) -> None:
    """Return once /health answers 200; raise with the log's tail if the server exits or
    takes longer than ``timeout`` (then it is killed)."""
    deadline = time.monotonic() + timeout
    while health(url) != 200:
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc, grace=0)
            with open(log_path, errors="replace") as f:
                tail = f.read()[-4000:]
            why = f"exited {proc.returncode}" if proc.returncode else f"not healthy in {timeout} s"
            raise RuntimeError(f"server {why}:\n{tail}")
        time.sleep(1)


def stop(proc, grace: float = 200) -> None:
    """SIGTERM to the server's group, SIGKILL after ``grace`` s. The connector may take
    shutdown_drain_s (120 s) to write answered files and vLLM its teardown after that (the
    launcher's VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS, 150 s)."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)  # the session start() made
            proc.wait(wait)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue
