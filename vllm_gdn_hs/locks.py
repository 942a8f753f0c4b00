"""The ``.lock`` protocol of speculators' files: the writer ``flock``s ``<file>.lock`` before the
response leaves and releases it once the file is complete; the reader takes it, deletes it, and
reads the file."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import time

LOCK_SUFFIX = ".lock"
_LOGGER = "vllm.vllm_gdn_hs.files"  # inside vLLM's logger tree, as init_logger names ours


def take_lock(path: str) -> int:
    """``flock`` a new ``<path>.lock`` (exclusive; BlockingIOError if held), making a missing
    folder again; its descriptor."""
    lock = path + LOCK_SUFFIX
    flags = os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW
    try:
        fd = os.open(lock, flags, 0o666)
    except FileNotFoundError:
        make_folder_again(os.path.dirname(lock))
        fd = os.open(lock, flags, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException as e:
        os.close(fd)
        if isinstance(e, BlockingIOError):
            raise BlockingIOError(errno.EWOULDBLOCK, "another process holds it", lock) from None
        raise
    return fd


def make_folder_again(folder: str) -> None:
    """Make a folder that vanished during a run (logged each time it is made)."""
    try:
        os.makedirs(folder)
    except FileExistsError:  # another thread made it first
        return
    logging.getLogger(_LOGGER).warning(
        "hidden-states folder %s was removed during the run; made it again", folder
    )


def release_lock(fd: int | None, path: str, remove: bool) -> None:
    """Let go of ``<path>.lock``; ``remove``: delete it first (no file will come)."""
    if fd is None:  # use_synchronization_lock off: no lock file was made
        return
    try:
        if remove:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path + LOCK_SUFFIX)
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def lock_held(lock_path: str) -> bool | None:
    """Whether a writer holds ``lock_path`` (None: this user may not open it); probed with a
    shared lock, released at once."""
    try:
        fd = os.open(lock_path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except FileNotFoundError:
        return False
    except PermissionError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def take_finished(path: str) -> bool:
    """One step of speculators' reader: False while the lock is held; else take and delete it
    and require the file."""
    try:
        fd = os.open(path + LOCK_SUFFIX, os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError:
        pass  # no lock (any more): the writer is done
    else:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        release_lock(fd, path, remove=True)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no hidden-states file at {path} (write failed or aborted?)")
    return True


def wait_for_file(path: str, timeout: float = 10.0) -> None:
    """Poll :func:`take_finished` for up to ``timeout`` s, as speculators' reader does."""
    deadline = time.monotonic() + timeout
    while not take_finished(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path}{LOCK_SUFFIX} still held after {timeout} s")
        time.sleep(0.01)
