"""What both child processes (worker.py for vLLM, hf_worker.py for HF) share: the output
folder's upkeep and a workload's failure in its record."""

from __future__ import annotations

import os
import shutil
import traceback

from records import FAILED, SKIPPED
from workloads import Workload, bytes_needed


class Skip(Exception):
    """A workload not run, for a reason given in one line (no traceback in the record)."""


def record_error(rec: dict, e: Exception) -> None:
    """A workload's failure in its record: a Skip as its one line, else the traceback."""
    if isinstance(e, Skip):
        rec.update(status=SKIPPED, error=str(e))
    else:
        rec.update(status=FAILED, error=traceback.format_exc(limit=-3))


def reset_dir(path: str) -> None:
    """Empty path but keep the folder itself: a connector may have created it only once."""
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(path):
        p = os.path.join(path, name)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p, ignore_errors=True)
        else:
            os.remove(p)


def dir_bytes(path: str) -> tuple[int, int]:
    """(bytes, number of .safetensors files) under path."""
    total = files = 0
    for root, _, names in os.walk(path):
        for name in names:
            total += os.path.getsize(os.path.join(root, name))
            files += name.endswith(".safetensors")
    return total, files


def check_space(out_dir: str, w: Workload, spec: dict) -> None:
    """Refuse a workload whose files would not fit (tmpfs is RAM: a full one stalls the run)."""
    need, free = bytes_needed(w, spec), shutil.disk_usage(out_dir).free
    if need * 1.1 > free:
        raise Skip(
            f"skipped: {w.name} writes about {need / 1e9:.1f} GB, only {free / 1e9:.1f} GB free "
            f"in {out_dir}"
        )
