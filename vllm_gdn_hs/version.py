"""Which vLLM is installed, and whether this plugin supports it.

The supported releases are those with runtime patches (``vllm_gdn_hs.patch.PATCHES``);
the ``vllm`` requirement in ``pyproject.toml`` admits exactly them among published releases
(``tests/test_register.py`` checks both), and this module reads it back from the package
metadata.
"""

from __future__ import annotations

import functools
from importlib import metadata

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

DIST_NAME = "vllm-gdn-hs"


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
    """The vLLM releases the plugin has runtime patches for (each within the requirement)."""
    from vllm_gdn_hs.patch import PATCHES

    return sorted(PATCHES, key=Version)


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
