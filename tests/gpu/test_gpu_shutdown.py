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
Then 64 requests in flight, SIGTERM (and a SIGINT 1 s later) while they run, through the
launcher and through plain `vllm serve`: see the section below; it writes tests/results/.
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
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import launched
import pytest
from safetensors.torch import load_file
from tiny_models import build_tiny_hybrid

from vllm_gdn_hs import locks

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
        assert not locks.lock_held(path + locks.LOCK_SUFFIX)
        assert load_file(path)["token_ids"].tolist() == seq, path
    shut = re.findall(r"HybridHiddenStatesConnector: (shut down; .*)", text)
    assert shut and "lost at shutdown" not in shut[-1], text[-4000:]
    assert int(re.match(r"shut down; (\d+) files", shut[-1])[1]) >= len(answered), shut[-1]


# -- SIGTERM with requests running: every one answered with its file or with the reason -------
# A burst of 64 in flight (long decodes), SIGTERM to the server's process group while they run,
# optionally a SIGINT 1 s later; through the launcher and through plain `vllm serve` naming the
# connector. Each request must end with a complete exact file or hidden_states_error (or HTTP
# 503 for one sent after the signal): no hung client, no answer without either. The server
# must exit within the drain window + 10 s and `vllm-gdn-hs check` find nothing wrong. The
# figures go to tests/results/.

DRAIN_S = 20  # shutdown_drain_s: window W = 2 x 20 + 30 = 70 s (config.shutdown_window)
IN_FLIGHT = 64  # request i decodes 16 + 64 * (i % 8) tokens: most still run at the signal


def _plain_serve(model: str, storage, log):
    extra = {"shared_storage_path": str(storage), "layer_ids": [*LAYERS, 8]}
    extra |= {"shutdown_drain_s": DRAIN_S, "write_workers": 1}
    kv = {"kv_connector": "HybridHiddenStatesConnector", "kv_role": "kv_producer"}
    port = launched.free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model, "--port", str(port)]
    cmd += ["--host", "127.0.0.1"]
    cmd += ["--gpu-memory-utilization", "0.3", "--max-model-len", "2048", "--enforce-eager"]
    # What the launcher adds for a multimodal model: without it, vLLM's multimodal processor
    # needs the tokenizer --skip-tokenizer-init leaves out, and the server does not start.
    cmd += ["--additional-config", launched.TRITON_GDN, "--skip-tokenizer-init"]
    cmd += ["--language-model-only"]
    cmd += ["--kv-transfer-config", json.dumps(kv | {"kv_connector_extra_config": extra})]
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=log, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


def _ask(url: str, model: str, prompt: list[int], decode: int, timeout: float) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": decode, "temperature": 0}
    body |= {"return_token_ids": True, "ignore_eos": True}
    body["kv_transfer_params"] = {"include_output_tokens": True}
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            out = json.load(r)
    except urllib.error.HTTPError as e:
        return {"status": e.code, "t": time.monotonic()}
    except OSError as e:  # refused once the server has stopped listening, or hung: timeout
        return {"error": str(e), "t": time.monotonic()}
    choice = out["choices"][0]
    kv = out.get("kv_transfer_params") or {}
    return {"status": 200, "kv": kv, "outputs": choice.get("token_ids"), "t": time.monotonic()}


def _save(name: str, record: dict) -> None:
    import vllm

    from vllm_gdn_hs.version import runner_in_use

    gpu = subprocess.run(
        ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True
    ).stdout.strip()
    commit = (
        os.environ.get("VLLM_GDN_HS_COMMIT")
        or subprocess.run(  # the GPU machine's git
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=launched_root(),
        ).stdout.strip()
    )  # can be a stale copy, so the session names the commit
    commit = commit or "unknown"
    record = dict(
        date=time.strftime("%Y-%m-%d"), commit=commit, vllm=vllm.__version__,
        runner=runner_in_use(), gpu=gpu, gdn_kernels="triton prefill (gdn_prefill_backend)",
        settings=dict(shutdown_drain_s=DRAIN_S, in_flight=IN_FLIGHT, decode="16 + 64 * (i % 8)",
                      prompt=PROMPT, write_workers=1, enforce_eager=True),
    ) | record  # fmt: skip
    folder = os.environ.get("VLLM_GDN_HS_RESULTS_DIR") or os.path.join(
        launched_root(), "tests", "results"
    )
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{record['date']}-vllm{vllm.__version__}-shutdown-{name}.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=1)


def launched_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("second", [False, True], ids=["SIGTERM", "SIGTERM-then-SIGINT"])
@pytest.mark.parametrize("how", ["launcher", "plain-vllm-serve"])
def test_sigterm_with_requests_running_answers_each_with_file_or_reason(
    tmp_path, tiny_model, how, second
):
    from vllm_gdn_hs.cli.serve_args import shutdown_window

    window = shutdown_window(DRAIN_S)
    storage, log_path = tmp_path / "hs", tmp_path / "server.log"
    log = open(log_path, "w")
    if how == "launcher":
        extra = {"kv_connector_extra_config": {"write_workers": 1, "shutdown_drain_s": DRAIN_S}}
        serve = ["--skip-tokenizer-init", "--kv-transfer-config", json.dumps(extra)]
        proc, url = launched.start(tiny_model, storage, LAYERS, log, *serve)
    else:
        proc, url = _plain_serve(tiny_model, storage, log)
    launched.wait_healthy(proc, url, log_path)
    model = json.load(urllib.request.urlopen(url + "/v1/models"))["data"][0]["id"]
    rng = random.Random(1)
    prompts = [rng.choices(range(3, 1000), k=PROMPT) for _ in range(IN_FLIGHT + 8)]
    answers, lock, signalled = {}, threading.Lock(), {}

    def one(i):
        if i >= IN_FLIGHT:  # sent after the signal
            while "t" not in signalled:
                time.sleep(0.05)
            time.sleep(0.5 + 0.1 * (i - IN_FLIGHT))
        answers[i] = _ask(url, model, prompts[i], 16 + 64 * (i % 8), timeout=window + 30)

    def signaller():
        while sum(1 for a in list(answers.values()) if a.get("status") == 200) < 1:
            time.sleep(0.01)  # some answered, the rest mid-decode
        with lock:
            signalled["t"] = time.monotonic()
            os.killpg(proc.pid, signal.SIGTERM)
        if second:
            time.sleep(1)
            os.killpg(proc.pid, signal.SIGINT)

    try:
        sig_thread = threading.Thread(target=signaller, daemon=True)
        sig_thread.start()
        with ThreadPoolExecutor(IN_FLIGHT + 8) as pool:
            list(pool.map(one, range(IN_FLIGHT + 8)))
        try:
            rc = proc.wait(window + 10 + 30)
        except subprocess.TimeoutExpired:
            rc = None  # still running: killed below, and the case fails on its exit time
        exited = time.monotonic()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    text = log_path.read_text(errors="replace")
    exit_s = exited - signalled["t"]
    kinds = {"file": 0, "hidden_states_error": 0, "503": 0, "refused_after_exit": 0}
    problems = []  # each one a reason this case fails; the record keeps them and the log's tail
    for i, a in sorted(answers.items()):
        if a.get("status") == 200:
            kv = a["kv"]
            if ("hidden_states_path" in kv) == ("hidden_states_error" in kv):
                problems.append(f"request {i}: kv_transfer_params {kv}")
            elif "hidden_states_path" in kv:
                path = kv["hidden_states_path"]
                seq = prompts[i] + a["outputs"][:-1]
                try:
                    if load_file(path)["token_ids"].tolist() != seq:
                        problems.append(f"request {i}: {path} holds other token ids")
                except Exception as e:
                    problems.append(f"request {i}: {path}: {e}")
                if locks.lock_held(path + locks.LOCK_SUFFIX):
                    problems.append(f"request {i}: {path} still locked")
                kinds["file"] += 1
            else:
                kinds["hidden_states_error"] += 1
        elif a.get("status") == 503 and i >= IN_FLIGHT:
            kinds["503"] += 1
        elif i >= IN_FLIGHT and "timed out" not in a.get("error", ""):
            kinds["refused_after_exit"] += 1  # a late one, after the server left
        else:  # in flight at the signal and never answered, or a client left hanging
            problems.append(f"request {i} ({'in flight' if i < IN_FLIGHT else 'late'}): {a}")
    check = subprocess.run(
        [sys.executable, "-m", "vllm_gdn_hs.cli", "check", str(storage)],
        capture_output=True,
        text=True,
    )
    if rc is None or exit_s > window + 10:
        problems.append(f"still running {exit_s:.1f} s after the signal, window {window} s")
    if check.returncode != 0:
        problems.append(f"check exit {check.returncode}: {(check.stdout + check.stderr)[-1500:]}")
    if kinds["file"] < 1:
        problems.append("no answered file")
    if "draining:" not in text:
        problems.append("no 'draining:' line in the server log")
    name = f"{how}-{'sigterm-sigint' if second else 'sigterm'}"
    _save(name, dict(case=name, rc=rc, exit_s=round(exit_s, 1), window_s=window, answers=kinds,
                     check_rc=check.returncode, problems=problems[:20],
                     log_tail=text[-6000:] if problems else None, shut_down=re.findall(
                         r"HybridHiddenStatesConnector: (shut down; .*)", text)))  # fmt: skip
    assert not problems, "\n".join(problems[:20]) + "\n" + text[-4000:]
