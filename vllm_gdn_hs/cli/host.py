"""What ``doctor`` reads off this host without CUDA, torch or vLLM: the folder, host memory (a
job's cgroup too) and the GPUs NVIDIA's driver lists."""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections import Counter
from collections.abc import Iterator

from vllm_gdn_hs.config import HiddenStatesConfig
from vllm_gdn_hs.probes import check_storage_path

Row = tuple[str, str, str | None]  # (item, value, problem or None)

GIB = 1 << 30
PROBE_BYTES = GIB  # written, fsync-ed and removed to measure the storage


def probe_path(folder: str) -> str:
    return os.path.join(folder, f".vllm-gdn-hs-probe-{os.getpid()}")


def write_speed(folder: str, nbytes: int = PROBE_BYTES) -> float:
    """Bytes/s of one sequential write of ``nbytes`` into ``folder``, fsync included."""
    block = os.urandom(1 << 20) * 64  # incompressible, 64 MiB
    blocks = max(nbytes // len(block), 1)
    path = probe_path(folder)
    t0 = time.perf_counter()
    try:
        with open(path, "wb") as f:
            f.writelines([block] * blocks)
            f.flush()
            os.fsync(f.fileno())
        return blocks * len(block) / (time.perf_counter() - t0)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def storage_checks(
    path: str, hidden_size: int | None = None, layer_ids: list[int] | None = None
) -> Iterator[list[Row]]:
    """The folder: could the launcher make it, free space, write speed (the probe said before it
    writes); with ``hidden_size`` and ``layer_ids``, bytes per token."""
    if why := check_storage_path(path, make=False):
        fix = "pass a writable folder with --hidden-states-path DIR"
        yield [("hidden-states path", path, f"{path} is not writable ({why}): {fix}")]
        return
    where = path
    while not os.path.isdir(where):  # the launcher makes it: the probe goes where it would
        where = os.path.dirname(where)
    try:
        free = shutil.disk_usage(where).free
    except OSError as e:
        yield [("hidden-states path", path, str(e))]
        return
    nbytes = min(PROBE_BYTES, max(free // 4, 1 << 26))
    made = "" if where == path else f" (missing: the launcher makes it; probed in {where})"
    yield [
        ("hidden-states path", path + made, None),
        ("  free space", f"{free / 1e9:,.1f} GB", None),
        ("  write probe", f"writes {nbytes / GIB:.2f} GiB to {probe_path(where)}, then "
         "removes it", None),
    ]  # fmt: skip
    try:
        speed = write_speed(where, nbytes)
    except OSError as e:
        yield [("  write speed (one stream, fsync)", "-", str(e))]
        return
    rows: list[Row] = [("  write speed (one stream, fsync)", f"{speed / 1e9:.2f} GB/s", None)]
    if hidden_size and layer_ids:
        per_token = len(layer_ids) * hidden_size * 2  # bf16 rows
        room = (
            f"{per_token / 1e3:.1f} KB/token: room for {free / per_token / 1e6:,.1f}M tokens; "
            f"one stream keeps up with {speed / per_token:,.0f} tokens/s"
        )
        rows.append((f"  at layers {','.join(map(str, layer_ids))}", room, None))
    yield rows


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):  # absent, or "max" (no limit)
        return None


def memory_limit(proc: str = "/proc", cgroup_fs: str = "/sys/fs/cgroup") -> int | None:
    """Bytes this process's memory cgroup (v2 or v1, as Slurm sets) may still take, or None."""
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


def host_memory_checks(proc: str = "/proc", cgroup_fs: str = "/sys/fs/cgroup") -> list[Row]:
    """Host memory against the default write_backlog_gb: FAIL where a cgroup caps it lower."""
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


def gpu_checks(driver: str = "/proc/driver/nvidia/gpus") -> list[Row]:
    """The GPUs NVIDIA's driver lists (no CUDA initialized, no torch imported)."""
    names = []
    with contextlib.suppress(OSError):
        for bus in sorted(os.listdir(driver)):
            with contextlib.suppress(OSError), open(os.path.join(driver, bus, "information")) as f:
                names += [line.split(":", 1)[1].strip() for line in f if line.startswith("Model:")]
    value = ", ".join(f"{n} x {name}" for name, n in Counter(names).items()) or "none"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return [("GPU", value + (f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible else ""), None)]
