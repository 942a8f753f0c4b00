"""``vllm-gdn-hs doctor``: what is installed and whether it will work here, a row as each is
known (this host's rows: :mod:`.host`). No GPU needed."""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from importlib import metadata
from itertools import groupby

from vllm_gdn_hs import version
from vllm_gdn_hs.cli.backends import mooncake_checks
from vllm_gdn_hs.cli.host import Row, gpu_checks, host_memory_checks, storage_checks
from vllm_gdn_hs.cli.model_info import ModelConfigError, ModelInfo, read_model_info
from vllm_gdn_hs.layer_ids import target_layer_ids, validate_layer_ids
from vllm_gdn_hs.model_support import aux_outputs_problem, has_aux_outputs
from vllm_gdn_hs.names import CONNECTOR_NAME
from vllm_gdn_hs.patch import apply_patches

SKIPPED = "skipped (needs "


def _compress(ids: list[int]) -> str:
    """[0, 1, 2, 4] -> '0-2,4'"""
    runs = [[x for _, x in run] for _, run in groupby(enumerate(ids), lambda p: p[1] - p[0])]
    return ",".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs) or "-"


def overlapping_files(path: list[str] | None = None) -> dict[tuple[str, ...], list[str]]:
    """Files that two or more installed distributions' ``RECORD``s claim, by claimants (e.g.
    cuda-python < 12.8's copies of cuda.bindings break torch's cuda-bindings 13 if they win)."""
    owners: dict[str, set[str]] = {}
    dists = metadata.distributions(path=path) if path else metadata.distributions()
    for dist in dists:
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
    """No two distributions own the same file (``.ci/run`` runs this row too)."""
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
    """vLLM, torch, transformers and the plugin's entry point, from package metadata alone."""
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
    """With ``load``: the plugin through vLLM's own loader, its patches and the runner; else,
    or when ``needs`` (a prerequisite) failed, ``skipped``."""
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


def iter_checks(
    model: str | None = None,
    hidden_states_path: str | None = None,
    mooncake_master: str | None = None,
    layer_ids: list[int] | None = None,
    load: bool = False,
) -> Iterator[list[Row]]:
    """Groups of rows as each is known, the quick first (the model, metadata, /proc, RECORDs),
    then the folder, the master and, with ``load``, vLLM's loader (a minute)."""
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
        ids, hidden = None, None
        if info is not None:
            hidden = info.hidden_size
            with contextlib.suppress(ValueError):  # sized only for ids the launcher takes
                n = info.num_hidden_layers
                ids = validate_layer_ids(target_layer_ids(layer_ids, n), n)
        yield from storage_checks(hidden_states_path, hidden, ids)
    if mooncake_master:
        yield mooncake_checks(mooncake_master)
    failed = {item for item, _, problem in packages if problem}
    needs = "a supported vllm" if "vllm" in failed else "the installed packages" if failed else None
    yield load_checks(load, needs)


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
