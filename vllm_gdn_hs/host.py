"""The host a server runs on, for ``doctor``: its memory (under a batch job's cgroup too) and
the hidden-states folder's room and write speed. No GPU and no vLLM needed."""

from __future__ import annotations

import contextlib
import os
import shutil
import time

PROBE_BYTES = 1 << 30  # written, fsync-ed and removed to measure the storage


def write_speed(folder: str, nbytes: int = PROBE_BYTES) -> float:
    """Bytes/s of one sequential write of ``nbytes`` into ``folder``, fsync included."""
    block = os.urandom(1 << 20) * 64  # incompressible, 64 MiB
    blocks = max(nbytes // len(block), 1)
    path = os.path.join(folder, f".vllm-gdn-hs-probe-{os.getpid()}")
    t0 = time.perf_counter()
    try:
        with open(path, "wb") as f:
            for _ in range(blocks):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        return blocks * len(block) / (time.perf_counter() - t0)
    finally:
        if os.path.exists(path):
            os.remove(path)


def storage_checks(path: str, hidden_size: int | None) -> list[tuple[str, str, str | None]]:
    """The hidden-states folder: writable, free space, write speed, and what those mean in
    tokens at speculators' default of 4 layers when the model's hidden size is known."""
    from vllm_gdn_hs.files import check_storage_path

    try:
        if why := check_storage_path(path):
            raise ValueError(
                f"{path} is not writable ({why}): pass a writable folder with "
                "--hidden-states-path DIR"
            )
        free = shutil.disk_usage(path).free
        speed = write_speed(path, min(PROBE_BYTES, max(free // 4, 1 << 26)))
    except (ValueError, OSError) as e:
        return [("hidden-states path", path, str(e))]
    rows: list[tuple[str, str, str | None]] = [
        ("hidden-states path", path, None),
        ("  free space", f"{free / 1e9:,.1f} GB", None),
        ("  write speed (one stream, fsync)", f"{speed / 1e9:.2f} GB/s", None),
    ]
    if hidden_size:
        per_token = 4 * hidden_size * 2  # 4 layers of bf16 rows
        rows.append(
            (
                "  at 4 layers (speculators' default)",
                f"{per_token / 1e3:.1f} KB/token: room for {free / per_token / 1e6:,.1f}M "
                f"tokens; one stream keeps up with {speed / per_token:,.0f} tokens/s",
                None,
            )
        )
    return rows


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):  # absent, or "max" (no limit)
        return None


def memory_limit(proc: str = "/proc", cgroup_fs: str = "/sys/fs/cgroup") -> int | None:
    """Bytes this process's memory cgroup may still take (limit less usage), where a limit
    is set: cgroup v2 (``memory.max``) or v1 (``memory.limit_in_bytes``), as batch
    schedulers such as Slurm set them per job; None without one."""
    try:
        with open(os.path.join(proc, "self", "cgroup")) as f:
            lines = [line.strip().split(":", 2) for line in f if line.count(":") >= 2]
    except OSError:
        return None
    for _, controllers, rel in lines:
        if controllers == "":
            files, root = ("memory.max", "memory.current"), cgroup_fs
        elif "memory" in controllers.split(","):
            files, root = ("memory.limit_in_bytes", "memory.usage_in_bytes"), cgroup_fs + "/memory"
        else:
            continue
        # the cgroup's own folder, or the mount's root where the container shows only its own
        for folder in (root + rel, root):
            limit, used = (_read_int(os.path.join(folder, name)) for name in files)
            if limit is not None and used is not None and limit < 1 << 60:
                return max(limit - used, 0)
    return None


def host_memory_checks(
    proc: str = "/proc", cgroup_fs: str = "/sys/fs/cgroup"
) -> list[tuple[str, str, str | None]]:
    """Host memory against the writer's default write_backlog_gb (finished requests' rows
    waiting for their files). A FAIL only where a memory cgroup caps the job below it (the
    kernel would kill the server when the backlog fills); free memory moves, so it is only
    reported."""
    from vllm_gdn_hs.config import HiddenStatesConfig

    backlog_gb = HiddenStatesConfig.model_fields["write_backlog_gb"].default
    avail = None
    errors = (OSError, StopIteration, ValueError, IndexError)
    with contextlib.suppress(*errors), open(os.path.join(proc, "meminfo")) as f:
        avail = next(int(x.split()[1]) * 1024 for x in f if x.startswith("MemAvailable:"))
    limit = memory_limit(proc, cgroup_fs)
    known = [x for x in (avail, limit) if x is not None]
    if not known:
        return [("host memory", "unknown (no /proc/meminfo)", None)]
    free = min(known)
    value = f"{free / 1e9:,.1f} GB available" + (
        f" (the job's memory cgroup allows {limit / 1e9:,.1f} GB more)" if limit is not None else ""
    )
    problem = None
    if limit is not None and limit < backlog_gb * 1e9:
        problem = (
            f"the writer may hold write_backlog_gb={backlog_gb:g} GB of finished requests "
            f"waiting for their files, more than the {limit / 1e9:.1f} GB the job's memory "
            "cgroup allows: pass --kv-transfer-config.kv_connector_extra_config."
            f"write_backlog_gb={max(int(limit / 2e9), 1)} to vLLM, or ask for more memory"
        )
    return [("host memory", value, problem)]
