"""``vllm-gdn-hs doctor``: what is installed, and whether it will work on this host (its memory,
under a batch job's cgroup too, and the hidden-states folder's room and write speed). No GPU
needed."""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Iterator
from importlib import metadata
from itertools import groupby

from vllm_gdn_hs import version
from vllm_gdn_hs.config import HiddenStatesConfig
from vllm_gdn_hs.files import check_storage_path
from vllm_gdn_hs.model_info import ModelConfigError, read_model_info
from vllm_gdn_hs.model_support import aux_outputs_problem, has_aux_outputs
from vllm_gdn_hs.names import CONNECTOR_NAME
from vllm_gdn_hs.patch import apply_patches
from vllm_gdn_hs.storage.mooncake_options import MooncakeOptions, check_master

Row = tuple[str, str, str | None]  # (item, value, problem or None)
SKIPPED = "skipped (needs "
# hs-connectors' Mooncake wheels: each installs the package "mooncake"
MOONCAKE_WHEELS = (
    "mooncake-transfer-engine-non-cuda",
    "mooncake-transfer-engine-cuda13",
    "mooncake-transfer-engine",
)


def _compress(ids: list[int]) -> str:
    """[0, 1, 2, 4] -> '0-2,4'"""
    runs = [[x for _, x in run] for _, run in groupby(enumerate(ids), lambda p: p[1] - p[0])]
    return ",".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs) or "-"


def mooncake_checks(master: str) -> list[Row]:
    """A Mooncake wheel that loads, and the master at ``master`` (host:port) answering."""
    wheels = [f"{d} {v}" for d in MOONCAKE_WHEELS if (v := version.installed(d))]
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
        check_master(MooncakeOptions(master_server_address=master))
        rows.append(("mooncake master", f"{master} answers", None))
    except ValueError as e:  # a malformed address, or none listening
        msg = e.errors()[0]["msg"] if hasattr(e, "errors") else str(e)
        rows.append(("mooncake master", master, msg))
    return rows


def overlapping_files(path: list[str] | None = None) -> dict[tuple[str, ...], list[str]]:
    """Files inside packages that two or more installed distributions claim (their ``RECORD``s), by
    the claiming distributions. Which wheel's copy won depends on the unpacking order: cuda-python <
    12.8 carries cuda.bindings' own files, which break torch's cuda-bindings 13 when they win."""
    owners: dict[str, set[str]] = {}
    for dist in metadata.distributions(**({"path": path} if path else {})):
        for f in dist.files or ():
            file = str(f)
            # top-level loose modules (build tools' build_backend.py) are no package's files
            if "/" in file and ".dist-info/" not in file and not file.startswith(".."):
                owners.setdefault(file, set()).add(dist.metadata["Name"])
    clashes: dict[tuple[str, ...], list[str]] = {}
    for file, names in owners.items():
        if len(names) > 1 and not file.endswith(".pyc"):
            clashes.setdefault(tuple(sorted(names)), []).append(file)
    return clashes


def install_checks() -> list[Row]:
    """No two distributions own the same file: the row ``.ci/run`` and a user's doctor share."""
    rows: list[Row] = []
    for names, paths in overlapping_files().items():
        fix = " ".join(f"--reinstall-package {n}" for n in names)
        if "cuda-python" in names:
            fix = "'cuda-python>=12.8' --reinstall-package cuda-bindings"
        owners = f"{len(paths)} owned by {' and '.join(names)} (e.g. {min(paths)})"
        why = f"one wheel overwrote the other's files: uv pip install {fix}"
        rows.append(("installed files", owners, why))
    return rows or [("installed files", "one owner each", None)]


def model_checks(model: str) -> tuple[list[Row], int | None]:
    """The model's rows and its hidden size (None where its config cannot be read)."""
    try:
        info = read_model_info(model)
    except ModelConfigError as e:
        return [("model", model, str(e))], None
    why = aux_outputs_problem(info.architectures)
    known = info.architectures and all(has_aux_outputs(a) for a in info.architectures)
    aux = "no" if why else "yes" if known else "not in vLLM's registry: checked at model load"
    return [
        ("model", f"{model} ({', '.join(info.architectures) or info.model_type})", None),
        ("aux hidden states in vLLM", aux, why),
        ("hybrid", "yes" if info.is_hybrid else "no (dense)", None),
        ("layers", str(info.num_hidden_layers), None),
        ("  linear attention (GDN/Mamba)", _compress(info.linear_layers), None),
        ("  full attention", _compress(info.full_attention_layers), None),
        *([("  sliding window", _compress(info.sliding_layers), None)] * bool(info.sliding_layers)),
        *([("  MLP or MoE only", _compress(info.mlp_layers), None)] * bool(info.mlp_layers)),
        ("hidden size", str(info.hidden_size), None),
        ("multimodal (pass --language-model-only)", "yes" if info.multimodal else "no", None),
    ], info.hidden_size


def vllm_checks() -> list[Row]:
    """vLLM, the plugin's loading through vLLM's own loader, its patches and runner; a check
    whose prerequisite failed says ``skipped (needs ...)``."""
    vllm_v = version.installed_vllm()
    try:
        version.check_vllm()
        problem = None
    except version.UnsupportedVllmError as e:
        problem = str(e)
    untested = f" (untested, run with {version.ALLOW_UNTESTED}=1)" if version.is_untested() else ""
    rows: list[Row] = [
        ("vllm", f"{vllm_v}{untested}" if vllm_v else "not installed", problem),
        ("supported vllm", version.describe_releases(), None),
    ]
    for dist in ("torch", "transformers"):
        v = version.installed(dist)
        rows.append((dist, v or "not installed", None if v else f"pip install {dist}"))
    plugin, later = "plugin via vllm.general_plugins", ("runtime patches", "model runner")
    if problem is not None:
        return rows + [(item, SKIPPED + "a supported vllm)", None) for item in (plugin, *later)]
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.plugins import load_general_plugins

        load_general_plugins()
        if CONNECTOR_NAME not in KVConnectorFactory._registry:
            raise RuntimeError(
                "vLLM's plugin loader did not find vllm_gdn_hs: install the package into this "
                "environment (uv pip install -e . in its repository, as the README's Install), "
                "PYTHONPATH is not enough"
            )
        rows.append((plugin, "found", None))
        rows.append(("runtime patches", ", ".join(apply_patches()) or "none needed", None))
    except Exception as e:  # report, don't crash: this is the diagnostic tool
        rows.append((plugin, "no", f"{type(e).__name__}: {e}"))
        return rows + [(item, SKIPPED + "the plugin)", None) for item in later]
    return [*rows, ("model runner", version.runner_in_use(), None)]


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
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def storage_checks(path: str, hidden_size: int | None) -> list[Row]:
    """The hidden-states folder: writable, free space and write speed, also in tokens."""
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
    rows: list[Row] = [
        ("hidden-states path", path, None),
        ("  free space", f"{free / 1e9:,.1f} GB", None),
        ("  write speed (one stream, fsync)", f"{speed / 1e9:.2f} GB/s", None),
    ]
    if hidden_size:
        per_token = 4 * hidden_size * 2  # 4 layers of bf16 rows
        room = (
            f"{per_token / 1e3:.1f} KB/token: room for {free / per_token / 1e6:,.1f}M tokens; "
            f"one stream keeps up with {speed / per_token:,.0f} tokens/s"
        )
        rows.append(("  at 4 layers (speculators' default)", room, None))
    return rows


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):  # absent, or "max" (no limit)
        return None


def memory_limit(proc: str = "/proc", cgroup_fs: str = "/sys/fs/cgroup") -> int | None:
    """Bytes this process's memory cgroup may still take, where a limit is set (cgroup v2 or
    v1, as batch schedulers such as Slurm set per job); None without one."""
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
    """Host memory against the writer's default write_backlog_gb. A FAIL only where a memory
    cgroup caps the job below it (the kernel would kill the server when the backlog fills)."""
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


def gpu_checks() -> list[Row]:
    try:
        import torch

        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none visible"
    except Exception:
        gpu = "none visible"
    return [("GPU", gpu, None)]


def iter_checks(
    model: str | None = None,
    hidden_states_path: str | None = None,
    mooncake_master: str | None = None,
) -> Iterator[list[Row]]:
    """Groups of rows, the fast ones first (an unreachable hub fails in seconds)."""
    hidden_size = None
    if model:
        rows, hidden_size = model_checks(model)
        yield rows
    yield install_checks()
    yield vllm_checks()
    yield gpu_checks()
    yield host_memory_checks()
    if hidden_states_path:
        yield storage_checks(hidden_states_path, hidden_size)
    if mooncake_master:
        yield mooncake_checks(mooncake_master)


def checks(*args: str | None) -> list[Row]:
    return [row for rows in iter_checks(*args) for row in rows]


def run_doctor(*args: str | None) -> int:
    """Print each group of :func:`iter_checks`' rows as soon as it is known; 1 if any failed."""
    problems = []
    for rows in iter_checks(*args):
        for item, value, problem in rows:
            mark = "FAIL" if problem else "skip" if value.startswith(SKIPPED) else "ok"
            print(f"{mark:4}  {item:<40}  {value}", flush=True)
            if problem:
                print(f"fix {item.strip()}: {problem}", flush=True)
                problems.append(item.strip())
    if problems:
        print(f"\n{len(problems)} problem(s): {', '.join(problems)}")
    return 1 if problems else 0
