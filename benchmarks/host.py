"""What the benchmark reads off the machine: GPU memory (nvidia-smi), versions, commit, mounts."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from importlib import metadata


def gpu_index() -> str:
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    return first if first.isdigit() else "0"


def nvidia_smi(field: str) -> str | None:
    try:
        out = subprocess.run(
            [
                "nvidia-smi",
                f"--query-gpu={field}",
                "--format=csv,noheader,nounits",
                "-i",
                gpu_index(),
            ],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout.strip()
        return out or None
    except (OSError, subprocess.SubprocessError):
        return None


def gpu_mem_used_mib() -> int | None:
    out = nvidia_smi("memory.used")
    return int(out) if out and out.isdigit() else None


class GpuMemPoller(threading.Thread):
    """Max of nvidia-smi memory.used (whole GPU, all processes) between take() calls."""

    def __init__(self, interval: float = 0.2):
        super().__init__(daemon=True)
        self.interval, self.peak, self.stopped = interval, None, False

    def run(self) -> None:
        while not self.stopped:
            used = gpu_mem_used_mib()
            if used is None:
                return  # no nvidia-smi: peaks stay None
            self.peak = used if self.peak is None else max(self.peak, used)
            time.sleep(self.interval)

    def take(self) -> int | None:
        peak, self.peak = self.peak, None
        return peak


def wait_gpu_released(limit_mib: int = 4096, timeout: float = 30) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        used = gpu_mem_used_mib()
        if used is None or used < limit_mib:
            return
        time.sleep(1)
    print(f"[bench] warning: {gpu_mem_used_mib()} MiB still in use on the GPU", flush=True)


def dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return None


def git_commit() -> str | None:
    """The checkout's short commit, "-dirty" when tracked files differ from it; None without git.
    VLLM_GDN_HS_COMMIT names it where the checkout's git is a stale copy (the GPU machine)."""
    if os.environ.get("VLLM_GDN_HS_COMMIT"):
        return os.environ["VLLM_GDN_HS_COMMIT"]
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short=7", "HEAD"], cwd=here, capture_output=True, text=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=here,
            capture_output=True,
            text=True,
        )
    except OSError:
        return None
    if head.returncode:
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def versions() -> dict:
    return dict(
        vllm=dist_version("vllm"),
        torch=dist_version("torch"),
        transformers=dist_version("transformers"),
        fla=dist_version("flash-linear-attention", "fla-core"),
        vllm_gdn_hs=dist_version("vllm-gdn-hs"),
        safetensors=dist_version("safetensors"),
        python=sys.version.split()[0],
    )


def fs_type(path: str) -> str | None:
    """Filesystem type of the mount holding path (tmpfs for /dev/shm), from /proc/mounts."""
    path, best, fstype = os.path.realpath(path), "", None
    try:
        with open("/proc/mounts") as f:
            for line in f:
                mnt, typ = line.split()[1:3]
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                    best, fstype = mnt, typ
    except OSError:
        pass
    return fstype
