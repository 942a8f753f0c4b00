"""``vllm-gdn-hs doctor``: what is installed, and whether it will work. No GPU needed."""

from __future__ import annotations

from collections.abc import Iterator
from importlib import metadata

from vllm_gdn_hs.host import host_memory_checks, storage_checks
from vllm_gdn_hs.version import installed

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
    parts, start = [], None
    for i, x in enumerate(ids):
        if start is None:
            start = x
        if i + 1 == len(ids) or ids[i + 1] != x + 1:
            parts.append(str(start) if start == x else f"{start}-{x}")
            start = None
    return ",".join(parts) or "-"


def mooncake_checks(master: str) -> list[Row]:
    """A Mooncake wheel that loads, and the master at ``master`` (host:port) answering."""
    from vllm_gdn_hs.storage.mooncake_options import MooncakeOptions, check_master

    wheels = [f"{d} {v}" for d in MOONCAKE_WHEELS if (v := installed(d))]
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


def model_runner() -> str:
    """Which of vLLM's GPU model runners extraction runs on, on the installed release."""
    from vllm.config import VllmConfig

    from vllm_gdn_hs.version import runner_in_use, runs_model_runner_v2

    if not runs_model_runner_v2() and hasattr(
        VllmConfig, "_get_v2_model_runner_unsupported_features"
    ):
        return "V1 (vLLM would choose V2 for some models; the plugin keeps V1 and vLLM logs why)"
    return runner_in_use()


def overlapping_files(path: list[str] | None = None) -> dict[tuple[str, ...], list[str]]:
    """Files inside packages that two or more installed distributions claim (their
    ``RECORD``s), by the claiming distributions. Which wheel's copy won depends on the
    unpacking order: cuda-python < 12.8 carries cuda.bindings' own files, which break torch's
    cuda-bindings 13 when they win."""
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
    rows = [
        (
            "installed files",
            f"{len(paths)} owned by {' and '.join(names)} (e.g. {min(paths)})",
            "one wheel overwrote the other's files: uv pip install "
            + (
                "'cuda-python>=12.8' --reinstall-package cuda-bindings"
                if "cuda-python" in names
                else " ".join(f"--reinstall-package {n}" for n in names)
            ),
        )
        for names, paths in overlapping_files().items()
    ]
    return rows or [("installed files", "one owner each", None)]


def model_checks(model: str) -> tuple[list[Row], int | None]:
    """The model's rows and its hidden size (None where its config cannot be read)."""
    from vllm_gdn_hs.model_info import ModelConfigError, read_model_info

    try:
        info = read_model_info(model)
    except ModelConfigError as e:
        return [("model", model, str(e))], None
    return [
        ("model", f"{model} ({', '.join(info.architectures) or info.model_type})", None),
        ("hybrid", "yes" if info.is_hybrid else "no (dense)", None),
        ("layers", str(info.num_hidden_layers), None),
        ("  linear attention (GDN/Mamba)", _compress(info.linear_layers), None),
        ("  full attention", _compress(info.full_attention_layers), None),
        *([("  sliding window", _compress(info.sliding_layers), None)] * bool(info.sliding_layers)),
        ("hidden size", str(info.hidden_size), None),
        ("multimodal (pass --language-model-only)", "yes" if info.multimodal else "no", None),
    ], info.hidden_size


def vllm_checks() -> list[Row]:
    """vLLM, the plugin's loading through vLLM's own loader, its patches and runner; a check
    whose prerequisite failed says ``skipped (needs ...)``."""
    from vllm_gdn_hs.version import (
        ALLOW_UNTESTED,
        UnsupportedVllmError,
        check_vllm,
        describe_releases,
        installed_vllm,
        is_untested,
    )

    vllm_v = installed_vllm()
    try:
        check_vllm()
        problem = None
    except UnsupportedVllmError as e:
        problem = str(e)
    untested = f" (untested, run with {ALLOW_UNTESTED}=1)" if vllm_v and is_untested() else ""
    rows: list[Row] = [
        ("vllm", f"{vllm_v}{untested}" if vllm_v else "not installed", problem),
        ("supported vllm", describe_releases(), None),
    ]
    for dist in ("torch", "transformers"):
        v = installed(dist)
        rows.append((dist, v or "not installed", None if v else f"pip install {dist}"))
    plugin, later = "plugin via vllm.general_plugins", ("runtime patches", "model runner")
    if problem is not None:
        return rows + [(item, SKIPPED + "a supported vllm)", None) for item in (plugin, *later)]
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.plugins import load_general_plugins

        from vllm_gdn_hs.names import CONNECTOR_NAME
        from vllm_gdn_hs.patch import apply_patches

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
    return [*rows, ("model runner", model_runner(), None)]


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
    """Groups of rows, the fast ones first: the model's (a hub id that cannot be reached fails
    in seconds), then the install and vLLM (which imports vLLM), the GPU, host memory, the
    folder and the Mooncake master."""
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
    """Every row of :func:`iter_checks`."""
    return [row for rows in iter_checks(*args) for row in rows]


def run_doctor(
    model: str | None = None,
    hidden_states_path: str | None = None,
    mooncake_master: str | None = None,
) -> int:
    """Print each group of rows as soon as it is known; exit 1 if any row failed."""
    problems = []
    for rows in iter_checks(model, hidden_states_path, mooncake_master):
        for item, value, problem in rows:
            mark = "FAIL" if problem else "skip" if value.startswith(SKIPPED) else "ok"
            print(f"{mark:4}  {item:<40}  {value}", flush=True)
            if problem:
                print(f"fix {item.strip()}: {problem}", flush=True)
                problems.append(item.strip())
    if problems:
        print(f"\n{len(problems)} problem(s): {', '.join(problems)}")
    return 1 if problems else 0
