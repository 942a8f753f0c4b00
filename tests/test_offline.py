"""The first commands with a hub id and no network: they fail at once, saying how to go on.

Run: python -m pytest tests/test_offline.py -q (no GPU, no network: the "hub" is a closed
port, or a local server that answers 503 and counts requests).

Each command runs in a fresh interpreter with HF_HUB_OFFLINE unset, an empty HF_HOME and
HF_ENDPOINT pointed at that hub, as a new user's machine without network would be. Hub
downloads retry for about 20 s before they fail; here one request is made, and the message
names the fix (the model's folder, or its config.json downloaded). A config in the local
cache is used without asking the hub.
"""

from __future__ import annotations

import http.server
import json
import os
import shlex
import subprocess
import sys
import threading

import pytest

from vllm_gdn_hs.cli.model_info import packaged_config_path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN36_CONFIG = packaged_config_path("Qwen/Qwen3.6-27B")
MODEL = "Qwen/Qwen3.6-27B"
CLOSED = "http://127.0.0.1:9"  # the discard port: nothing listens, the connection is refused
FIX = (
    f"pass the model's folder instead, or download its config.json first (`hf download {MODEL} "
    "config.json --local-dir DIR`, then pass DIR; enough for --dry-run and doctor); offline, "
    f"`vllm-gdn-hs config {MODEL} DIR` writes the packaged one"
)


def run(args: list[str], hf_home, endpoint: str = CLOSED, **env) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    full.update(HF_HOME=str(hf_home), HF_ENDPOINT=endpoint, **env)
    full["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "vllm_gdn_hs.cli", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=full,
        timeout=300,
    )


@pytest.fixture
def hub503():
    """A hub that answers every request with 503 (retried by hub downloads); yields its URL
    and the list of requests it got."""
    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self):
            seen.append(f"{self.command} {self.path}")
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_GET = do_HEAD = _answer

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", seen
    server.shutdown()
    server.server_close()


def launch_args(tmp_path, *extra) -> list[str]:
    return ["launch", MODEL, "--dry-run", "--hidden-states-path", str(tmp_path / "hs"), *extra]


def test_launch_dry_run_without_network(tmp_path):
    p = run(launch_args(tmp_path, "--target-layer-ids", "1", "16", "31"), tmp_path / "hf")
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr == (
        f"error: {MODEL!r} is no local folder and not in the local HF cache, and cannot reach "
        f"the HF hub at {CLOSED} (ConnectError): {FIX}\n"
    )


def test_one_request_to_a_failing_hub(tmp_path, hub503):
    url, seen = hub503
    p = run(launch_args(tmp_path), tmp_path / "hf", endpoint=url)
    assert p.returncode == 2 and "Retrying" not in p.stderr
    assert p.stderr.startswith(f"error: {MODEL!r} is no local folder and not in the local HF ")
    assert "the hub answered" in p.stderr and "503" in p.stderr and FIX in p.stderr
    # One request for the file (huggingface_hub may also ask /api/agent-harnesses, once).
    assert [r for r in seen if "/resolve/" in r] == [f"HEAD /{MODEL}/resolve/main/config.json"]


def test_hf_hub_offline_is_named(tmp_path, hub503):
    url, seen = hub503
    p = run(launch_args(tmp_path), tmp_path / "hf", endpoint=url, HF_HUB_OFFLINE="1")
    assert p.returncode == 2 and seen == []  # offline: not even huggingface_hub's own
    assert "not in the local HF cache, and HF_HUB_OFFLINE is set: " + FIX in p.stderr


def cache_config(hf_home, config_path: str = QWEN36_CONFIG) -> None:
    """The hub id's config.json in the local HF cache, as `hf download` leaves it."""
    repo = hf_home / "hub" / f"models--{MODEL.replace('/', '--')}"
    commit = "0" * 40
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "config.json").write_text(open(config_path).read())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)


def test_cached_config_needs_no_network(tmp_path, hub503):
    url, seen = hub503
    cache_config(tmp_path / "hf")
    p = run(launch_args(tmp_path, "--target-layer-ids", "1,16,31"), tmp_path / "hf", endpoint=url)
    assert p.returncode == 0, p.stderr
    cmd = shlex.split(p.stdout.strip().splitlines()[-1])
    assert cmd[3:5] == ["serve", MODEL] and not [r for r in seen if "/resolve/" in r]
    spec = json.loads(cmd[cmd.index("--speculative_config") + 1])
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [
        1,
        16,
        31,
        64,
    ]


def test_doctor_without_network(tmp_path):
    p = run(["doctor", "--model", MODEL], tmp_path / "hf")
    assert p.returncode == 1
    assert (
        f"fix model: {MODEL!r} is no local folder and not in the local HF cache, and cannot "
        f"reach the HF hub at {CLOSED} (ConnectError): {FIX}"
    ) in p.stdout
