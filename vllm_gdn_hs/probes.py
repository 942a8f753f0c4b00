"""Can a folder hold hidden-states files? Probed as the connector makes it, or, for a dry run and
``doctor``, where nothing is left behind."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile


def check_storage_path(path: str, make: bool = True) -> str | None:
    """Why ``path`` cannot hold files, or None: a file is made and removed in it (the folder
    made if missing; ``make=False``: its missing part under a temporary name, then removed)."""
    if make:
        return _probe(path, make=True)
    parent = path
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"{os.strerror(errno.ENOTDIR)}: {parent!r}"
    if parent == path:
        return _probe(path, make=False)
    try:
        scratch = tempfile.mkdtemp(prefix=".vllm-gdn-hs-probe-", dir=parent)
    except OSError as e:
        return f"no folder can be made in {parent}: {e.strerror}"
    try:  # the same depth and names below the first missing folder, as the launch makes them
        below = os.path.relpath(path, parent).split(os.sep)[1:]
        return _probe(os.path.join(scratch, *below), make=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _probe(folder: str, make: bool) -> str | None:
    probe = os.path.join(folder, f".write-probe-{os.getpid()}")
    try:
        if make:
            os.makedirs(folder, exist_ok=True)
        os.close(os.open(probe, os.O_CREAT | os.O_WRONLY, 0o600))
        os.remove(probe)
    except OSError as e:
        return str(e)
    return None
