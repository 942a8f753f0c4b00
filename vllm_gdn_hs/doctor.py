"""``vllm-gdn-hs doctor``: what is installed, and whether it will work. No GPU needed."""

from __future__ import annotations

import os
import shutil
import time
from importlib import metadata

PROBE_BYTES = 1 << 30  # written, fsync-ed and removed to measure the storage


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _compress(ids: list[int]) -> str:
    """[0, 1, 2, 4] -> '0-2,4'"""
    parts, start = [], None
    for i, x in enumerate(ids):
        if start is None:
            start = x
        if i + 1 == len(ids) or ids[i + 1] != x + 1:
            parts.append(str(start) if start == x else f"{start}-{x}")
            start = None
    return ",".join(parts) or "-"


def write_speed(folder: str, nbytes: int = PROBE_BYTES) -> float:
    """Bytes/s of one sequential write of ``nbytes`` into ``folder``, fsync included, as a
    file writer does (the probe file is removed)."""
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
    rows = [
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
    """Host memory against the writer's default write_backlog_gb: finished requests' rows
    wait there for their files, on top of the rows of requests in flight. A FAIL only where
    a memory cgroup caps the job below it (the kernel would kill the server when the
    backlog fills); free memory on a shared machine moves, so it is only reported."""
    from vllm_gdn_hs.config import HiddenStatesConfig

    backlog_gb = HiddenStatesConfig.model_fields["write_backlog_gb"].default
    avail = None
    try:
        with open(os.path.join(proc, "meminfo")) as f:
            avail = next(int(x.split()[1]) * 1024 for x in f if x.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        pass
    limit = memory_limit(proc, cgroup_fs)
    known = [x for x in (avail, limit) if x is not None]
    free = min(known) if known else None
    if free is None:
        return [("host memory", "unknown (no /proc/meminfo)", None)]
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


# hs-connectors' Mooncake wheels: each installs the package "mooncake"
MOONCAKE_WHEELS = (
    "mooncake-transfer-engine-non-cuda",
    "mooncake-transfer-engine-cuda13",
    "mooncake-transfer-engine",
)


def mooncake_checks(master: str) -> list[tuple[str, str, str | None]]:
    """The mooncake backends' needs on this host: a Mooncake wheel that loads, and the master
    at ``master`` (host:port) answering. For the servers and the trainers alike."""
    from vllm_gdn_hs.storage.mooncake_options import MooncakeOptions, check_master

    wheels = [f"{d} {v}" for d in MOONCAKE_WHEELS if (v := _version(d))]
    problem = None
    if not wheels:
        problem = (
            "pip install mooncake-transfer-engine-non-cuda (CPU hosts; GPU hosts: the "
            "-cuda13 wheel for vLLM's CUDA 13 builds, docs/mooncake.md)"
        )
    else:
        try:
            import mooncake.store  # noqa: F401
        except ImportError as e:
            problem = f"{e}: apt-get install -y libibverbs1 (Debian/Ubuntu)"
    rows = [("mooncake", ", ".join(wheels) or "not installed", problem)]
    try:
        options = MooncakeOptions(master_server_address=master)
        check_master(options)
        rows.append(("mooncake master", f"{master} answers", None))
    except ValueError as e:  # a malformed address, or none listening
        msg = e.errors()[0]["msg"] if hasattr(e, "errors") else str(e)
        rows.append(("mooncake master", master, msg))
    return rows


def model_runner() -> str:
    """Which of vLLM's GPU model runners extraction runs on, on the installed release."""
    from vllm.config import VllmConfig

    from vllm_gdn_hs.version import runner_in_use, runs_model_runner_v2

    if not runs_model_runner_v2() and hasattr(
        VllmConfig, "_get_v2_model_runner_unsupported_features"
    ):
        return "V1 (vLLM would choose V2 for some models; the plugin keeps V1 and vLLM logs why)"
    return runner_in_use()


def checks(
    model: str | None = None,
    hidden_states_path: str | None = None,
    mooncake_master: str | None = None,
) -> list[tuple[str, str, str | None]]:
    """(item, value, problem-or-None) rows."""
    from vllm_gdn_hs.version import (
        ALLOW_UNTESTED,
        UnsupportedVllmError,
        check_vllm,
        describe_releases,
        installed_vllm,
        is_untested,
    )

    rows = []
    vllm_v = installed_vllm()
    try:
        check_vllm()
        problem = None
    except UnsupportedVllmError as e:
        problem = str(e)
    untested = f" (untested, run with {ALLOW_UNTESTED}=1)" if vllm_v and is_untested() else ""
    rows.append(("vllm", f"{vllm_v}{untested}" if vllm_v else "not installed", problem))
    rows.append(("supported vllm", describe_releases(), None))
    for dist in ("torch", "transformers"):
        v = _version(dist)
        rows.append((dist, v or "not installed", None if v else f"pip install {dist}"))

    plugin_problem, patches, runner = None, "-", "-"
    if problem is None:
        try:
            from vllm.plugins import load_general_plugins

            load_general_plugins()
            from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

            from vllm_gdn_hs.names import CONNECTOR_NAME
            from vllm_gdn_hs.patch import apply_patches

            if CONNECTOR_NAME not in KVConnectorFactory._registry:
                plugin_problem = (
                    "vLLM's plugin loader did not find vllm_gdn_hs: install the "
                    "package into this environment (uv pip install -e . in its repository, "
                    "as the README's Install), PYTHONPATH is not enough"
                )
            patches = ", ".join(apply_patches()) or "none needed"
            runner = model_runner()
        except Exception as e:  # report, don't crash: this is the diagnostic tool
            plugin_problem = f"{type(e).__name__}: {e}"
    rows.append(
        ("plugin via vllm.general_plugins", "found" if not plugin_problem else "no", plugin_problem)
    )
    rows.append(("runtime patches", patches, None))
    rows.append(("model runner", runner, None))
    try:
        import torch

        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none visible"
    except Exception:
        gpu = "none visible"
    rows.append(("GPU", gpu, None))
    rows += host_memory_checks()

    info = None
    if model:
        from vllm_gdn_hs.model_info import ModelConfigError, read_model_info

        try:
            info = read_model_info(model)
        except ModelConfigError as e:
            rows.append(("model", model, str(e)))
    if info:
        rows.append(
            ("model", f"{model} ({', '.join(info.architectures) or info.model_type})", None)
        )
        rows.append(("hybrid", "yes" if info.is_hybrid else "no (dense)", None))
        rows.append(("layers", str(info.num_hidden_layers), None))
        rows.append(("  linear attention (GDN/Mamba)", _compress(info.linear_layers), None))
        rows.append(("  full attention", _compress(info.full_attention_layers), None))
        if info.sliding_layers:
            rows.append(("  sliding window", _compress(info.sliding_layers), None))
        rows.append(("hidden size", str(info.hidden_size), None))
        rows.append(
            ("multimodal (pass --language-model-only)", "yes" if info.multimodal else "no", None)
        )
    if hidden_states_path:
        rows += storage_checks(hidden_states_path, info.hidden_size if info else None)
    if mooncake_master:
        rows += mooncake_checks(mooncake_master)
    return rows


def run_doctor(
    model: str | None = None,
    hidden_states_path: str | None = None,
    mooncake_master: str | None = None,
) -> int:
    rows = checks(model, hidden_states_path, mooncake_master)
    width = max(len(r[0]) for r in rows)
    for item, value, problem in rows:
        mark = "FAIL" if problem else "ok"
        print(f"{mark:4}  {item:<{width}}  {value}")
    problems = [(item, p) for item, _, p in rows if p]
    for item, p in problems:
        print(f"\nfix {item}: {p}")
    return 1 if problems else 0
