"""Nothing answered is lost at shutdown: the worker side's drain, a process stopped by a signal,
and the launcher's shutdown settings.

Run: python -m pytest tests/test_shutdown.py -q (CPU, no network; starts child processes).
The worker side with real files (the disk is slowed or held at the edge); a child process that
shuts down as vLLM 0.33.0's engine core does (tests/shutdown_child.py), stopped with SIGINT or
SIGTERM and then a second SIGTERM (vLLM's API server terminating it) while it drains, judged
by ``vllm-gdn-hs check``'s scan; the launcher's environment and flags read against the
installed vLLM's own shutdown code. The GPU twin through ``vllm serve`` is
tests/gpu/test_gpu_shutdown.py.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import hybrid_config_dict, write_config

from vllm_gdn_hs import files, locks
from vllm_gdn_hs.cli import launch, serve_args
from vllm_gdn_hs.config import HiddenStatesConfig
from vllm_gdn_hs.connector import worker as worker_mod
from vllm_gdn_hs.connector.metadata import (
    FinishedRequest,
    HybridHiddenStatesConnectorMetadata,
    NewRequest,
)
from vllm_gdn_hs.connector.worker import HybridHiddenStatesConnectorWorker
from vllm_gdn_hs.verify import check

L, H = 2, 8
CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shutdown_child.py")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_worker(folder, **cfg) -> HybridHiddenStatesConnectorWorker:
    return HybridHiddenStatesConnectorWorker(
        HiddenStatesConfig(shared_storage_path=str(folder), **cfg),
        max_tokens=64,
        num_layers=L,
        hidden=H,
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
    )


def serve(worker, folder, names: list[str], answer: bool = True) -> dict[str, str]:
    """Each request: new, one step of 4 rows, finished (answered) or left running."""
    paths = {r: files.request_path(str(folder), r) for r in names}
    meta = [NewRequest(r, p, 4) for r, p in paths.items()]
    worker.on_metadata(HybridHiddenStatesConnectorMetadata(new_requests=meta))
    qsl = torch.arange(0, 4 * len(names) + 1, 4)
    rows = torch.randn(4 * len(names), L, H).bfloat16() + 1
    worker.save(rows, names, qsl, torch.arange(4).repeat(len(names)))
    if answer:
        done = [FinishedRequest(r, [1, 2, 3, 4]) for r in names]
        worker.on_metadata(HybridHiddenStatesConnectorMetadata(finished_requests=done))
    return paths


def lock_of(path: str) -> str:
    return path + locks.LOCK_SUFFIX


def test_close_writes_every_answered_request_queued_before_it(tmp_path, monkeypatch):
    """Writes still held back when close() begins are all written: close() drains them."""
    gate, real_write = threading.Event(), files.write_file

    def held_write(*args, **kwargs):  # the disk edge: nothing lands before close() begins
        assert gate.wait(30)
        return real_write(*args, **kwargs)

    monkeypatch.setattr(files, "write_file", held_write)
    w = make_worker(tmp_path, write_workers=2)
    paths = serve(w, tmp_path, [f"r{i}" for i in range(12)])
    real_close = w.writer.close

    def close(deadline):
        gate.set()
        return real_close(deadline)

    w.writer.close = close
    w.close()
    for path in paths.values():
        assert load_file(path)["token_ids"].tolist() == [1, 2, 3, 4]
        assert not locks.lock_held(lock_of(path))
    assert (w.stats.files, w.stats.lost_at_shutdown) == (12, 0)


def test_writes_past_the_drain_lose_their_lock_and_are_counted(tmp_path, monkeypatch, caplog):
    """A disk that does not answer within shutdown_drain_s: every answered request still
    queued or being written loses its lock (its reader fails at once instead of waiting), and
    the count is logged; a request never finished loses its lock too."""
    caplog.set_level(logging.INFO, logger=worker_mod.logger.name)
    gate, real_write, started = threading.Event(), files.write_file, threading.Event()

    def stuck_write(*args, **kwargs):
        started.set()
        gate.wait(30)
        return real_write(*args, **kwargs)

    monkeypatch.setattr(files, "write_file", stuck_write)
    w = make_worker(tmp_path, write_workers=1, shutdown_drain_s=0.2)
    answered = serve(w, tmp_path, ["a", "b", "c"])
    running = serve(w, tmp_path, ["never"], answer=False)
    assert started.wait(30)  # "a" is being written, "b" and "c" wait in the queue
    w.close()
    for path in [*answered.values(), *running.values()]:
        assert not os.path.exists(lock_of(path)), path
        assert not os.path.exists(path), path
    assert (w.stats.lost_at_shutdown, w.stats.unfinished, w.stats.files) == (3, 1, 0)
    (line,) = [r.getMessage() for r in caplog.records if "shut down;" in r.getMessage()]
    assert "3 lost at shutdown" in line and "1 unfinished (never)" in line, line
    lost = [r.getMessage() for r in caplog.records if "not written within" in r.getMessage()]
    assert len(lost) == 3 and all("shutdown_drain_s" in m for m in lost), lost
    gate.set()  # the write that was running ends: its file is complete, or absent
    w.writer.threads[0].join(30)
    assert check.scan(str(tmp_path))["problems"] == {}
    if os.path.exists(answered["a"]):
        assert load_file(answered["a"])["token_ids"].tolist() == [1, 2, 3, 4]


# -- a process stopped by a signal ------------------------------------------------------------


def run_child(
    folder, sig: int, drain_s: float, delay_s: float, workers: int, answers: int, at="draining"
):
    """Start the child, let it answer ``answers`` requests, send ``sig``, and a SIGTERM
    again once it prints ``at`` (teardown, before the drain; or draining); returns (its
    answered paths, its exit code, its log)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, CHILD, str(folder), str(drain_s), str(delay_s), str(workers)]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO
    )
    answered, signalled, log = [], False, []  # vLLM's logger writes to stdout
    try:
        for line in proc.stdout:
            log.append(line)
            if line.startswith("answered "):
                answered.append(line.split(" ", 1)[1].strip())
                if len(answered) == answers and not signalled:
                    proc.send_signal(sig)
                    signalled = True
            elif line.strip() == at:
                proc.send_signal(signal.SIGTERM)  # the API server's terminate(), mid-drain
        rc = proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return answered, rc, "".join(log) + proc.stderr.read()


@pytest.mark.parametrize("at", ["teardown", "draining"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signalled_process_writes_every_answered_file(tmp_path, sig, at):
    """A second signal before the drain begins or during it is logged, never fatal."""
    folder = tmp_path / "hs"
    answered, rc, log = run_child(folder, sig, 60, 0.05, workers=2, answers=40, at=at)
    assert rc == 0, log[-3000:]
    assert "SIGTERM during shutdown" in log, log[-3000:]  # the second signal was only logged
    out = check.scan(str(folder))
    assert out["problems"] == {}, dict(out["problems"])
    assert set(answered) <= set(out["complete_paths"]), set(answered) - set(out["complete_paths"])
    assert not any(locks.lock_held(lock_of(p)) for p in answered)
    shut = re.search(r"shut down; (\d+) files .* (\d+) aborted", log)
    assert shut and int(shut[1]) >= len(answered) and "lost at shutdown" not in log, log[-3000:]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_drain_too_short_leaves_complete_files_or_no_lock(tmp_path, sig):
    """Writes of 1 s each through one writer, 1 s to drain: most answered files cannot be
    written; each is complete or has no lock, and the loss is counted in the log."""
    folder = tmp_path / "hs"
    answered, rc, log = run_child(folder, sig, drain_s=1, delay_s=1, workers=1, answers=6)
    assert rc == 0, log[-3000:]
    out = check.scan(str(folder))
    assert out["problems"] == {}, dict(out["problems"])  # no lock without its file
    complete = set(out["complete_paths"])
    missing = [p for p in answered if p not in complete]
    for path in missing:
        assert not os.path.exists(lock_of(path)) and not os.path.exists(path), path
    lost = re.search(r"shut down; .* (\d+) lost at shutdown", log)
    assert missing and lost and int(lost[1]) >= len(missing), log[-3000:]


def test_a_killed_process_leaves_check_exactly_the_lost_files(tmp_path):
    """SIGKILL (a lost node, a scheduler past its KillWait) leaves no time to drain: ``check``
    names exactly the answered requests whose files are not complete, as lost (to send again),
    and nothing else; every other answered file is complete and readable."""
    folder = tmp_path / "hs"
    answered, rc, log = run_child(folder, signal.SIGKILL, drain_s=60, delay_s=0.3, workers=1,
                                  answers=8)  # fmt: skip
    assert rc == -signal.SIGKILL, log[-3000:]
    out = check.scan(str(folder))
    complete = set(out["complete_paths"])
    lost = {path for path, _ in out["problems"].get(check.LOST, [])}
    assert set(out["problems"]) <= {check.LOST, check.TEMP}, dict(out["problems"])
    expected = {lock_of(p) for p in set(answered) - complete}
    # the request after the last answered one may hold its lock when the kill lands, unanswered:
    # named too (to send again, harmlessly), and no other
    next_lock = lock_of(files.request_path(str(folder), f"req-{len(answered)}"))
    assert expected and expected <= lost <= expected | {next_lock}, (lost, expected)
    for path in complete:
        assert load_file(path)["hidden_states"].shape[0] > 0


# -- the launcher ------------------------------------------------------------------------------


def test_the_version_gate_agrees_with_the_installed_vllm():
    """engine_wait_from_env is a version gate (0.33.0 on); the installed vLLM's own process
    manager says the same: it reads VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS."""
    import inspect

    import vllm.v1.engine.utils as utils

    reads = hasattr(utils, "get_engine_process_shutdown_timeout") and (
        serve_args.SHUTDOWN_ENV in inspect.getsource(utils.get_engine_process_shutdown_timeout)
    )
    assert serve_args.engine_wait_from_env() == reads


def test_vllm_waits_the_window_the_launcher_sets(monkeypatch):
    """With the launcher's environment and vLLM's default --shutdown-timeout 0, vLLM's own
    process manager gives the engine core twice shutdown_drain_s plus the teardown."""
    import vllm.v1.engine.utils as utils

    if not hasattr(utils, "get_engine_process_shutdown_timeout"):
        pytest.skip("this vLLM waits max(--shutdown-timeout, 5) s: the launcher passes the flag")
    env = serve_args.shutdown_env(120.0, environ={})
    assert env == {serve_args.SHUTDOWN_ENV: "270"}
    monkeypatch.setenv(serve_args.SHUTDOWN_ENV, env[serve_args.SHUTDOWN_ENV])
    assert utils.get_engine_process_shutdown_timeout(0, 0) == 270
    assert serve_args.shutdown_args([], 120.0) == []


def test_shutdown_timeout_where_vllm_ignores_the_variable(monkeypatch, capsys):
    monkeypatch.setattr(serve_args, "engine_wait_from_env", lambda: False)
    assert serve_args.shutdown_args([], 7.5) == ["--shutdown-timeout", "46"]
    assert serve_args.shutdown_args(["--shutdown-timeout", "600"], 7.5) == []
    assert capsys.readouterr().err == ""
    assert serve_args.shutdown_args(["--shutdown-timeout=10"], 120) == []
    assert "--shutdown-timeout 10 may stop" in capsys.readouterr().err
    assert serve_args.shutdown_env(120, environ={serve_args.SHUTDOWN_ENV: "5"}) == {}
    assert f"{serve_args.SHUTDOWN_ENV}=5 may stop" in capsys.readouterr().err


def test_launch_exports_the_window(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(serve_args.SHUTDOWN_ENV, "")  # records the original, for the undo
    monkeypatch.delenv(serve_args.SHUTDOWN_ENV)
    model = write_config(str(tmp_path / "hybrid"), hybrid_config_dict(8))
    extra = '{"kv_connector_extra_config": {"shutdown_drain_s": 300}}'
    argv = [model, "--dry-run", "--", "--kv-transfer-config", extra]
    assert launch.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == ["Would run:", f"export {serve_args.SHUTDOWN_ENV}=630"]
    calls = []
    monkeypatch.setattr(launch.os, "execvp", lambda file, args: calls.append(args))
    monkeypatch.setattr(launch, "gpu_visible", lambda: True)  # no GPU here
    assert launch.main(argv[:1] + argv[2:]) == 0
    assert calls and os.environ[serve_args.SHUTDOWN_ENV] == "630"
