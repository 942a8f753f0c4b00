"""Runtime patches for the installed vLLM, chosen in this one place: one ``patch_<vllm
module>.py`` per patched module, each with its Why/How/Remove-when and its twin source patch in
``patches/<vllm version>/``."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from dataclasses import dataclass

from vllm_gdn_hs import version
from vllm_gdn_hs.names import init_logger

# In the order they apply, then the patch of each runner that carries extraction (version.py).
PATCHES = ("patch_config_vllm", "patch_config_kv_transfer", "patch_engine_arg_utils")
V1_RUNNER_PATCH = "patch_worker_gpu_model_runner"
MODEL_RUNNER_V2_PATCH = "patch_worker_gpu_model_runner_v2"


def patches_for(vllm: str | None = None) -> tuple[str, ...]:
    """The patches a vLLM release needs (an untested newer one: the newest release's)."""
    vllm = version.release(vllm)
    if version.is_untested(vllm):
        vllm = version.RELEASES[-1]
    if vllm not in version.RELEASES:
        return ()
    v1 = (V1_RUNNER_PATCH,) if version.has_v1_runner(vllm) else ()
    v2 = (MODEL_RUNNER_V2_PATCH,) if version.runs_model_runner_v2(vllm) else ()
    return PATCHES + v1 + v2


@dataclass
class Patch:
    """Replace or add attributes of one vLLM class; refuse to apply twice."""

    target: type
    attrs: dict

    def apply(self) -> None:
        logger = init_logger(__name__)
        if getattr(self.target, "_vllm_gdn_hs_patched", False):  # by this Patch or another
            raise RuntimeError(f"{self.target.__qualname__} is already patched")
        for name, value in self.attrs.items():
            verb = "replaced" if hasattr(self.target, name) else "added"
            setattr(self.target, name, value)
            logger.debug("%s %s.%s", verb, self.target.__qualname__, name)
        self.target._vllm_gdn_hs_patched = True  # type: ignore[attr-defined]


def require(what, *names: str) -> None:
    """AttributeError naming the first of ``names`` that ``what`` (a function's parameters, a
    dataclass's fields, a class) lacks: what a patch reads of vLLM, checked at its import."""
    if inspect.isfunction(what):
        have = set(inspect.signature(what).parameters)
    elif dataclasses.is_dataclass(what):
        have = {f.name for f in dataclasses.fields(what)}
    else:  # a class, NamedTuples' fields included
        have = set(dir(what))
    if missing := [name for name in names if name not in have]:
        raise AttributeError(f"{what.__qualname__} has no {missing[0]!r}")


_applied: list[str] = []


def runtime_patches() -> dict[str, Patch]:
    """The installed vLLM's patches by module name, imported, not applied (an untested vLLM:
    UnsupportedVllmError names what is gone)."""
    return {name: _module(name).PATCH for name in patches_for()}


def _module(name: str):
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except (AttributeError, ImportError) as e:
        if not version.is_untested():
            raise
        raise version.UnsupportedVllmError(
            f"vllm {version.installed_vllm()} lacks what the runtime patch {name} needs "
            f"({type(e).__name__}: {e}). Install the newest tested release: "
            f"{version.install_command(version.RELEASES[-1])}"
        ) from e


def apply_patches() -> list[str]:
    """Apply the patches the installed vLLM needs (once per process)."""
    if _applied:
        return list(_applied)
    patches = runtime_patches()
    shutdown = _module("shutdown").PATCHES  # the drain at shutdown (no source twin)
    for name, patch in patches.items():
        patch.apply()
        _applied.append(name)
    for patch in shutdown:
        patch.apply()
    return list(_applied)
