"""Read a hidden-states file the way speculators does, honouring ``<file>.lock``."""

from __future__ import annotations

import fcntl
import os
import time


def wait_for_file(path: str, timeout: float = 10.0) -> None:
    """Wait until ``path`` is complete: take and delete its lock, as speculators' reader.

    Raises FileNotFoundError if neither the lock nor the file exists (the
    write failed or the request was aborted), TimeoutError if the lock is
    still held after ``timeout`` seconds.
    """
    lock = path + ".lock"
    deadline = time.monotonic() + timeout
    while os.path.exists(lock):
        try:
            fd = os.open(lock, os.O_RDWR)
        except FileNotFoundError:
            break
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{lock} still held after {timeout} s") from None
            time.sleep(0.01)
            continue
        try:
            os.remove(lock)
        except FileNotFoundError:
            pass
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
        break
    if not os.path.exists(path):
        raise FileNotFoundError(f"no hidden-states file at {path} (write failed or aborted?)")


def load_hidden_states(path: str, timeout: float = 10.0) -> dict:
    """``{"hidden_states": [T, L, H], "token_ids": [T]}`` once the file is complete."""
    from safetensors.torch import load_file

    wait_for_file(path, timeout)
    return load_file(path)
