"""tools/device/session.sh: a job started in the background is stopped by its own process group,
children included, and nothing else; CPU only.

Run: python -m pytest tests/test_device_session.py -q
"""

from __future__ import annotations

import os
import subprocess
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SESSION_SH = os.path.join(ROOT, "tools", "device", "session.sh")


def alive(pid: int) -> bool:
    """Running: a zombie (killed, not yet reaped where no init reaps) counts as gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_stop_ends_the_started_job_and_its_children_only(tmp_path):
    job = tmp_path / "job.sh"
    pids = tmp_path / "pids"
    job.write_text(f"sleep 300 & echo $! >>{pids}\nsleep 300 & echo $! >>{pids}\nwait\n")
    bystander = subprocess.Popen(["sleep", "300"])  # same user, same command line
    env = dict(os.environ, SESSION=str(tmp_path / "session"))
    try:
        subprocess.run(["bash", SESSION_SH, "start", str(job)], env=env, check=True)
        for _ in range(50):
            if pids.exists() and len(pids.read_text().split()) == 2:
                break
            time.sleep(0.1)
        children = [int(p) for p in pids.read_text().split()]
        assert all(alive(p) for p in children)
        out = subprocess.run(
            ["bash", SESSION_SH, "stop"], env=env, check=True, capture_output=True, text=True
        ).stdout
        assert "stopped the job" in out
        time.sleep(0.5)
        assert not any(alive(p) for p in children)
        assert bystander.poll() is None  # a process outside the job is left alone
    finally:
        bystander.kill()


def test_stop_without_a_started_job_says_so(tmp_path):
    env = dict(os.environ, SESSION=str(tmp_path / "none"))
    r = subprocess.run(["bash", SESSION_SH, "stop"], env=env, capture_output=True, text=True)
    assert r.returncode == 2 and "no job started" in r.stdout
