"""``vllm-gdn-hs doctor``: what is installed, and whether it will work on this host (memory, under
a batch job's cgroup too, and the hidden-states folder's room and write speed). No GPU needed."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import time
from collections import Counter
from collections.abc import Iterator
from importlib import metadata
from itertools import groupby

from vllm_gdn_hs import version
from vllm_gdn_hs.backends import Row, mooncake_checks
from vllm_gdn_hs.config import HiddenStatesConfig
from vllm_gdn_hs.files import check_storage_path
from vllm_gdn_hs.model_info import (
    ModelConfigError,
    ModelInfo,
    read_model_info,
    target_layer_ids,
    validate_layer_ids,
)
from vllm_gdn_hs.model_support import aux_outputs_problem, has_aux_outputs
from vllm_gdn_hs.names import CONNECTOR_NAME
from vllm_gdn_hs.patch import apply_patches

SKIPPED = "skipped (needs "


def _compress(ids: list[int]) -> str:
    """[0, 1, 2, 4] -> '0-2,4'"""
    runs = [[x for _, x in run] for _, run in groupby(enumerate(ids), lambda p: p[1] - p[0])]
    return ",".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs) or "-"


def overlapping_files(path: list[str] | None = None) -> dict[tuple[str, ...], list[str]]:
    """Files inside packages that two or more installed distributions claim (their ``RECORD``s), by
    the claiming distributions. Which wheel's copy won depends on the unpacking order: cuda-python <
    12.8 carries cuda.bindings' own files, which break torch's cuda-bindings 13 when they win."""
    owners: dict[str, set[str]] = {}
    for dist in metadata.distributions(**({"path": path} if path else {})):
        name = dist.metadata["Name"]  # each read parses METADATA again: once per distribution
        for f in dist.files or ():
            file = str(f)
            # top-level loose modules (build tools' build_backend.py) are no package's files
            if "/" in file and ".dist-info/" not in file and not file.startswith(".."):
                owners.setdefault(file, set()).add(name)
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


def model_checks(model: str) -> tuple[list[Row], ModelInfo | None]:
    """The model's rows and what its config says (None where it cannot be read)."""
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
    ], info


PLUGIN = "plugin via vllm.general_plugins"
INSTALL_FIX = (
    "install the package into this environment (uv pip install -e . in its repository, as "
    "the README's Install): PYTHONPATH is not enough"
)
LOAD = "--load: it imports vLLM and torch, about a minute on 2 cores)"


def package_checks() -> list[Row]:
    """vLLM, torch and transformers as installed, and the plugin's entry point: package
    metadata alone, nothing imported."""
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
    return [*rows, entry_point_check()]


def load_checks(load: bool, needs: str | None = None) -> list[Row]:
    """With ``load``: the plugin loaded by vLLM's own loader, its patches and the runner. A
    check whose prerequisite failed (``needs``) or was not asked for says ``skipped``."""
    later = ("runtime patches", "model runner")
    if needs:
        return [(item, f"{SKIPPED}{needs})", None) for item in (PLUGIN, *later)]
    if not load:
        return [(PLUGIN, SKIPPED + LOAD, None)]
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.plugins import load_general_plugins

        load_general_plugins()
        if CONNECTOR_NAME not in KVConnectorFactory._registry:
            raise RuntimeError(f"vLLM's plugin loader did not find vllm_gdn_hs: {INSTALL_FIX}")
        patches = ", ".join(apply_patches()) or "none needed"
    except Exception as e:  # report, don't crash: this is the diagnostic tool
        rows: list[Row] = [(PLUGIN, "no", f"{type(e).__name__}: {e}")]
        return rows + [(item, SKIPPED + "the plugin)", None) for item in later]
    return [
        (PLUGIN, "found", None),
        ("runtime patches", patches, None),
        ("model runner", version.runner_in_use(), None),
    ]


def entry_point_check() -> Row:
    """The entry point vLLM's plugin loader reads, and its module found where it points."""
    item = "plugin entry point"
    eps = metadata.entry_points(group="vllm.general_plugins")
    ours = [ep for ep in eps if ep.value.split(":")[0].startswith("vllm_gdn_hs.")]
    if not ours:
        return (item, "none", INSTALL_FIX)
    if importlib.util.find_spec(ours[0].module) is None:
        return (item, ours[0].value, f"{ours[0].module} is not importable: install again")
    return (item, f"{ours[0].name} = {ours[0].value}", None)


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
            for _ in range(blocks):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        return blocks * len(block) / (time.perf_counter() - t0)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def storage_checks(
    path: str, hidden_size: int | None = None, layer_ids: list[int] | None = None
) -> Iterator[list[Row]]:
    """The hidden-states folder: could the launcher make it and write there (probed where it
    leaves nothing), its free space, and write speed: the probe's size and place are said in a
    row before it writes. With the model's ``hidden_size``, bytes per token at ``layer_ids``."""
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


def iter_checks(
    model: str | None = None,
    hidden_states_path: str | None = None,
    mooncake_master: str | None = None,
    layer_ids: list[int] | None = None,
    load: bool = False,
) -> Iterator[list[Row]]:
    """Groups of rows, each as soon as it is known: the model first (an unreachable hub fails
    in seconds), then what package metadata and /proc tell, the RECORD scan (a second or
    two), the folder, the master and, with ``load``, vLLM's loader (a minute)."""
    info = None
    if model:
        rows, info = model_checks(model)
        yield rows
    packages = package_checks()
    yield packages
    yield gpu_checks()
    yield host_memory_checks()
    yield install_checks()
    if hidden_states_path:
        ids = None
        if info is not None:
            with contextlib.suppress(ValueError):  # sized only for ids the launcher takes
                n = info.num_hidden_layers
                ids = validate_layer_ids(target_layer_ids(layer_ids, n), n)
        yield from storage_checks(hidden_states_path, info and info.hidden_size, ids)
    if mooncake_master:
        yield mooncake_checks(mooncake_master)
    failed = {item for item, _, problem in packages if problem}
    needs = None
    if failed:
        needs = "a supported vllm" if "vllm" in failed else "the installed packages"
    yield load_checks(load, needs)


def checks(*args, **kwargs) -> list[Row]:
    return [row for rows in iter_checks(*args, **kwargs) for row in rows]


def run_doctor(*args, **kwargs) -> int:
    """Print each row of :func:`iter_checks` as soon as it is known; 1 if any failed."""
    problems = []
    for rows in iter_checks(*args, **kwargs):
        for item, value, problem in rows:
            mark = "FAIL" if problem else "skip" if value.startswith(SKIPPED) else "ok"
            print(f"{mark:4}  {item:<40}  {value}", flush=True)
            if problem:
                print(f"fix {item.strip()}: {problem}", flush=True)
                problems.append(item.strip())
    if problems:
        print(f"\n{len(problems)} problem(s): {', '.join(problems)}")
    return 1 if problems else 0
