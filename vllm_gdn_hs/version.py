"""Which vLLM is installed, and whether this plugin supports it.

:data:`RELEASES` is the one list of supported vLLM releases. The ``vllm`` requirement in
``pyproject.toml`` admits exactly them among published releases, ``patches/<release>/`` holds a
source series for each, and ``.ci/run`` tests each (``tests/test_register.py`` and
``tests/test_patches.py`` check that they agree).
"""

from __future__ import annotations

import functools
from importlib import metadata

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

DIST_NAME = "vllm-gdn-hs"
RELEASES = ("0.20.1", "0.26.0")


class UnsupportedVllmError(RuntimeError):
    pass


@functools.cache
def supported_vllm() -> SpecifierSet:
    """The vLLM versions this plugin supports, from its own package metadata."""
    for line in metadata.requires(DIST_NAME) or []:
        req = Requirement(line)
        if req.name == "vllm" and not req.marker:
            return req.specifier
    raise RuntimeError(f"{DIST_NAME} metadata has no vllm requirement; reinstall {DIST_NAME}")


def installed_vllm() -> Version | None:
    try:
        return Version(metadata.version("vllm"))
    except metadata.PackageNotFoundError:
        return None


def supported_releases() -> list[str]:
    return list(RELEASES)


def check_vllm(version: Version | None = None) -> Version:
    """Return the installed vLLM version, or raise naming the supported ones."""
    version = version if version is not None else installed_vllm()
    releases = supported_releases()
    names = " or ".join(releases)
    if version is None:
        raise UnsupportedVllmError(f"vLLM is not installed; {DIST_NAME} needs vllm {names}")
    # Compare the release only: local builds (0.20.1+cu130) are the same release.
    if (
        version.base_version not in releases
        or Version(version.base_version) not in supported_vllm()
    ):
        raise UnsupportedVllmError(
            f"{DIST_NAME} supports vllm {names}, found vllm {version}. "
            f"Install a supported release: pip install 'vllm=={releases[-1]}'"
        )
    return version
