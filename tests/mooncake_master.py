"""A real ``mooncake_master`` on 127.0.0.1 for the mooncake tests: started on a free port,
stopped by its process id; the tests skip, saying why, where the binary is missing (in CI: fail).

The binary and ``mooncake.store`` come from ``mooncake-transfer-engine-non-cuda`` (the dev
extra) and need ``libibverbs1`` (apt). Only loopback: the master binds 127.0.0.1, and
``MC_TCP_BIND_ADDRESS`` makes the clients advertise 127.0.0.1 (their listening ports bind every
interface whatever it says; the tests send nothing elsewhere).
"""

from __future__ import annotations

import os
import signal
import subprocess

import pytest
from mooncake_side import (  # noqa: F401  (benchmarks/mooncake_side.py, shared: pytest's pythonpath)
    HOST,
    free_port,
    master_binary,
    reader,
    start_master,
)


def require_mooncake() -> str:
    """The master binary, after checking that ``mooncake.store`` loads; else skip, or fail
    where CI is set (.ci/run installs both, so a missing one is a broken install there)."""
    missing = pytest.fail if os.environ.get("CI", "").lower() in ("1", "true") else pytest.skip
    path = master_binary()
    if path is None:
        missing(
            "mooncake_master not installed: pip install mooncake-transfer-engine-non-cuda "
            "(in the dev extra)"
        )
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:
        missing(f"mooncake.store does not load ({e}): apt-get install -y libibverbs1")
    os.environ["MC_TCP_BIND_ADDRESS"] = HOST
    return path


class Master:
    """One ``mooncake_master`` bound to 127.0.0.1; ``kill`` and ``start`` again on the same
    port (a restarted master has lost every object)."""

    def __init__(self, path: str, log_dir: str):
        self.path, self.log_dir = path, log_dir
        self.port = free_port()
        self.address = f"{HOST}:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self, timeout: float = 30.0) -> None:
        self.starts += 1
        log_path = os.path.join(self.log_dir, f"master-{self.starts}.log")
        try:
            self.proc = start_master(self.path, self.port, log_path, timeout)
        except RuntimeError as e:
            pytest.fail(str(e))

    def kill(self) -> None:
        """SIGKILL by process id, and wait for it."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def log(self) -> str:
        with open(os.path.join(self.log_dir, f"master-{self.starts}.log")) as f:
            return f.read()
