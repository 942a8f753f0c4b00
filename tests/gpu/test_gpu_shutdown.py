"""GPU: nothing answered is lost when `vllm serve` is stopped at once, by SIGINT or SIGTERM.

Run on a CUDA machine with the plugin installed:
    pytest -m gpu tests/gpu/test_gpu_shutdown.py -v -s
`vllm-gdn-hs launch` starts a real `vllm serve` (a tiny Qwen3.5 hybrid, one writer thread and
long prompts so that writes are still queued when the signal comes). A burst of requests is
sent; the signal goes out as soon as the last answer arrives (well within 100 ms), or halfway
through the burst with requests still running. Then `vllm-gdn-hs check` must find no problem,
every answered path must be a complete file with its prompt's token ids, and the connector's
shutdown line must be in the server log with nothing lost. Cases: SIGINT to the process group
(Ctrl-C), SIGTERM to the process group (Slurm), SIGTERM to the API server alone.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import launched
import pytest
from safetensors.torch import load_file
from tiny_models import build_tiny_hybrid

from vllm_gdn_hs import files

pytestmark = pytest.mark.gpu

LAYERS = [1, 3, 6]  # the launcher appends N = 8
BURST, PROMPT = 48, 1500


def _start(root, model: str):
    storage, log_path = root / "hs", root / "server.log"
    extra = {"kv_connector_extra_config": {"write_workers": 1}}  # writes lag the engine
    serve = ["--skip-tokenizer-init", "--kv-transfer-config", json.dumps(extra)]
    log = open(log_path, "w")
    proc, url = launched.start(model, storage, LAYERS, log, *serve)
    launched.wait_healthy(proc, url, log_path)
    return proc, url, storage, log_path, log


def _complete(url: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    body |= {"return_token_ids": True, "ignore_eos": True}
    body["kv_transfer_params"] = {"include_output_tokens": max_tokens > 1}
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            out = json.load(r)
    except OSError as e:  # refused or cut by the shutdown: never answered
        return {"error": str(e)}
    choice = out["choices"][0]
    return {"kv": out.get("kv_transfer_params") or {}, "outputs": choice.get("token_ids")}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build_tiny_hybrid(str(tmp_path_factory.mktemp("model") / "tiny-qwen3.5-hybrid"))


@pytest.mark.parametrize(
    "sig, group, after",
    [
        (signal.SIGINT, True, BURST),
        (signal.SIGTERM, True, BURST),
        (signal.SIGTERM, False, BURST),
        (signal.SIGTERM, True, BURST // 2),
    ],
    ids=["SIGINT-group", "SIGTERM-group", "SIGTERM-api-server", "SIGTERM-group-mid-burst"],
)
def test_stopped_at_once_loses_no_answered_file(tmp_path, tiny_model, sig, group, after):
    proc, url, storage, log_path, log = _start(tmp_path, tiny_model)
    model = json.load(urllib.request.urlopen(url + "/v1/models"))["data"][0]["id"]
    rng = random.Random(0)
    plan = []
    for i in range(BURST):
        include = i % 4 == 0  # some with their outputs' rows too
        plan.append((rng.choices(range(3, 1000), k=PROMPT - 40 * include), 32 if include else 1))
    answers, lock, signalled = {}, threading.Lock(), {}

    def one(i):
        prompt, max_tokens = plan[i]
        rec = _complete(url, model, prompt, max_tokens)
        rec["t"] = time.monotonic()
        with lock:
            answers[i] = rec
            if sum("kv" in a for a in answers.values()) == after and not signalled:
                signalled["t"] = time.monotonic()
                (os.killpg if group else os.kill)(proc.pid, sig)
        return rec

    try:
        with ThreadPoolExecutor(BURST) as pool:
            list(pool.map(one, range(BURST)))
        assert signalled, f"{sum('kv' in a for a in answers.values())} answers, no signal sent"
        rc = proc.wait(300)  # shutdown_drain_s (120 s) plus vLLM's teardown
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    text = log_path.read_text(errors="replace")
    answered = {i: a for i, a in answers.items() if "hidden_states_path" in a.get("kv", {})}
    assert len(answered) >= after, (len(answered), text[-4000:])
    last = max(a["t"] for a in answered.values())
    print(f"signal {signalled['t'] - last:+.3f} s after the last answer; server rc {rc}")

    check = subprocess.run(
        [sys.executable, "-m", "vllm_gdn_hs.cli", "check", str(storage)],
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    for i, a in answered.items():
        path = a["kv"]["hidden_states_path"]
        prompt, max_tokens = plan[i]
        seq = prompt + (a["outputs"][:-1] if max_tokens > 1 else [])
        assert os.path.exists(path), f"answered file missing: {path}\n{text[-4000:]}"
        assert not files.lock_held(path + files.LOCK_SUFFIX)
        assert load_file(path)["token_ids"].tolist() == seq, path
    shut = re.findall(r"HybridHiddenStatesConnector: (shut down; .*)", text)
    assert shut and "lost at shutdown" not in shut[-1], text[-4000:]
    assert int(re.match(r"shut down; (\d+) files", shut[-1])[1]) >= len(answered), shut[-1]
