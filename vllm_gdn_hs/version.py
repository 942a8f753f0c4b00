"""Which vLLM is installed, and whether this plugin supports it: :data:`RELEASES` is the one
list of supported releases (``pyproject.toml``'s pin and ``patches/*/VLLM_VERSIONS`` agree, as
tests check); :data:`REFUSED`, releases between them refused, with the reason.
"""

from __future__ import annotations

import functools
import os
from importlib import metadata

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

DIST_NAME = "vllm-gdn-hs"
RELEASES = (
    "0.20.1", "0.20.2", "0.21.0", "0.22.0", "0.22.1", "0.23.0", "0.24.0", "0.25.0", "0.25.1",
    "0.26.0", "0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0",
    "0.34.0",
)  # fmt: skip
REFUSED: dict[str, str] = {}
NEEDS_OVERRIDES = ("0.34.0",)
# The runner extraction runs on: V1 up to 0.33.0 (0.34.0 deleted it), Model Runner V2 from
# 0.33.0 (there only with VLLM_USE_V2_MODEL_RUNNER=1).
MODEL_RUNNER_V2_FROM = "0.33.0"
V1_RUNNER_UNTIL = "0.33.0"
# From here vLLM's API server waits VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS for its engine cores.
ENGINE_WAIT_FROM_ENV_FROM = "0.33.0"
# Set to 1, a vLLM newer than RELEASES[-1] runs (patch/ probes every vLLM method it wraps).
ALLOW_UNTESTED = "VLLM_GDN_HS_ALLOW_UNTESTED_VLLM"


class UnsupportedVllmError(RuntimeError): ...


@functools.cache
def requirement(name: str) -> SpecifierSet:
    """The versions of ``name`` this package requires, from its metadata (pyproject.toml)."""
    for line in metadata.requires(DIST_NAME) or []:
        req = Requirement(line)
        if req.name == name and not req.marker:
            return req.specifier
    raise RuntimeError(f"{DIST_NAME} metadata has no {name} requirement; reinstall {DIST_NAME}")


def installed(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def installed_vllm() -> Version | None:
    v = installed("vllm")
    return None if v is None else Version(v)


def release(version: str | None = None) -> str:
    """A release without its local part (0.20.1+cu130 is 0.20.1); default: the installed, or "0"."""
    v = installed_vllm() if version is None else Version(version)
    return v.base_version if v is not None else "0"


def runs_model_runner_v2(version: str | None = None) -> bool:
    return Version(release(version)) >= Version(MODEL_RUNNER_V2_FROM)


def has_v1_runner(version: str | None = None) -> bool:
    return Version(release(version)) <= Version(V1_RUNNER_UNTIL)


def engine_wait_from_env(version: str | None = None) -> bool:
    return Version(release(version)) >= Version(ENGINE_WAIT_FROM_ENV_FROM)


def model_runner_v2_asked_for() -> bool:
    """Whether extraction runs on Model Runner V2: the only runner, or (beside V1) as
    ``VLLM_USE_V2_MODEL_RUNNER`` says."""
    if not runs_model_runner_v2():
        return False
    if not has_v1_runner():
        return True
    import vllm.envs as envs

    return bool(getattr(envs, "VLLM_USE_V2_MODEL_RUNNER", False))


def runner_in_use() -> str:
    """The runner extraction runs on with the installed vLLM, in a few words."""
    if not has_v1_runner():
        return "Model Runner V2 (the only runner of this vLLM)"
    if model_runner_v2_asked_for():
        return "Model Runner V2 (VLLM_USE_V2_MODEL_RUNNER=1; the plugin's default here is V1)"
    if runs_model_runner_v2():
        return "V1 (the plugin's default here; VLLM_USE_V2_MODEL_RUNNER=1 runs Model Runner V2)"
    from vllm.config import VllmConfig

    if hasattr(VllmConfig, "_get_v2_model_runner_unsupported_features"):  # 0.22.0 to 0.32.0
        return "V1 (vLLM would choose V2 for some models; the plugin keeps V1 and vLLM logs why)"
    return "V1 (the only runner the plugin supports on this vLLM)"


def describe_releases() -> str:
    """``<first> to <last>`` (``, except ...``)."""
    span = f"{RELEASES[0]} to {RELEASES[-1]}" if len(RELEASES) > 2 else " or ".join(RELEASES)
    return span + (f", except {', '.join(sorted(REFUSED))}" if REFUSED else "")


def nearest_release(version: Version) -> str:
    """The newest release for a newer vLLM, else the last patch of the nearest minor one."""
    if version >= Version(RELEASES[-1]):
        return RELEASES[-1]

    def distance(release: str) -> tuple[int, int, int]:
        r = Version(release)
        return abs(r.major - version.major), abs(r.minor - version.minor), -r.micro

    return min(RELEASES, key=distance)


def install_command(release: str) -> str:
    if release in NEEDS_OVERRIDES:
        return (
            f"uv pip install 'vllm=={release}' --override overrides.txt (the file is in "
            f"{DIST_NAME}'s repository: vLLM {release} pins a flashinfer-python the index lacks)"
        )
    return f"pip install 'vllm=={release}'"


def is_untested(version: str | Version | None = None) -> bool:
    return Version(release(None if version is None else str(version))) > Version(RELEASES[-1])


def untested_note(version: Version) -> str:
    """What a run on an untested release says, once per process."""
    return (
        f"vllm {version} is newer than {RELEASES[-1]}, the newest release {DIST_NAME} is "
        f"tested on; {ALLOW_UNTESTED}=1 runs it with {RELEASES[-1]}'s runtime patches, whose "
        f"vLLM methods are all there. Hold the first files to HF transformers before a long "
        f"run: vllm-gdn-hs check DIR --reference MODEL --layer-ids ..."
    )


def check_vllm(version: Version | None = None) -> Version:
    """The installed vLLM version, or UnsupportedVllmError naming the supported ones and the
    nearest (a newer one passes with ``ALLOW_UNTESTED=1``)."""
    version = version if version is not None else installed_vllm()
    if version is None:
        raise UnsupportedVllmError(
            f"vLLM is not installed; {DIST_NAME} needs vllm {describe_releases()}: "
            f"{install_command(RELEASES[-1])}"
        )
    release = version.base_version
    install = install_command(nearest_release(version))
    if release in REFUSED:
        raise UnsupportedVllmError(
            f"{DIST_NAME} refuses vllm {version}: {REFUSED[release]}. "
            f"Install the nearest supported release: {install}"
        )
    if is_untested(release) and os.environ.get(ALLOW_UNTESTED, "").strip() == "1":
        return version
    if release not in RELEASES or Version(release) not in requirement("vllm"):
        allow = f", or set {ALLOW_UNTESTED}=1 to run vllm {version} untested"
        untested = allow if is_untested(release) else ""
        raise UnsupportedVllmError(
            f"{DIST_NAME} supports vllm {describe_releases()}, found vllm {version}. "
            f"Install the nearest supported release: {install}{untested}"
        )
    return version
