"""Run: python -m pytest tests/test_patches.py -q (CPU, no network, patch(1)).

The source patch series in patches/<release>/ (patches/upstream/ is the pull request,
tests/test_upstream_patch.py): each folder's VLLM_VERSIONS lists the releases its series
applies to, and every supported release is listed in exactly one folder. The installed
release's series applies, in series order and with no fuzz, to a copy of the installed vLLM's
files, and the patched files compile; each series lists every patch once, one per runtime patch
module in the order they apply; each patch has its DEP-3 header, names its runtime patch in
Origin and adds no line of this plugin. Skipped (with the reason) where `patch` is missing.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import py_compile
import re
import shutil
import subprocess

import pytest
from packaging.version import Version

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATCHES = os.path.join(REPO, "patches")


def _folders() -> list[str]:
    """The series folders: every patches/<release>/ (a VLLM_VERSIONS file in it)."""
    return sorted(
        d for d in os.listdir(PATCHES) if os.path.isfile(os.path.join(PATCHES, d, "VLLM_VERSIONS"))
    )


def _covers(folder: str) -> list[str]:
    with open(os.path.join(PATCHES, folder, "VLLM_VERSIONS")) as f:
        return [ln.strip() for ln in f if ln.strip()]


FOLDERS = _folders()


def _series(release: str) -> list[str]:
    with open(os.path.join(PATCHES, release, "series")) as f:
        return [ln.strip() for ln in f if ln.strip() and not ln.startswith("#")]


def _targets(release: str, name: str) -> list[str]:
    """Paths (vllm/...) a patch changes, from its `+++ b/...` lines."""
    with open(os.path.join(PATCHES, release, name)) as f:
        return [ln[len("+++ b/") :].split("\t")[0].strip() for ln in f if ln.startswith("+++ b/")]


ALL_PATCHES = [(r, name) for r in FOLDERS for name in _series(r)]


def test_one_series_per_supported_release():
    from vllm_gdn_hs.version import RELEASES, requirement

    covered = [release for folder in FOLDERS for release in _covers(folder)]
    assert sorted(covered, key=Version) == list(RELEASES)  # each once, none else
    for folder in FOLDERS:
        assert folder == _covers(folder)[0], "a folder is named after its first release"
    assert all(release in requirement("vllm") for release in covered)  # the pyproject pin
    folders = {d for d in os.listdir(PATCHES) if os.path.isdir(os.path.join(PATCHES, d))}
    assert folders == {*FOLDERS, "upstream"}, "a folder without VLLM_VERSIONS"


@pytest.mark.parametrize("release", FOLDERS)
def test_series_lists_every_patch_once_in_order(release):
    files = sorted(f for f in os.listdir(os.path.join(PATCHES, release)) if f.endswith(".patch"))
    assert _series(release) == files
    assert all(re.match(r"\d{4}-[a-z0-9-]+\.patch$", f) for f in files), files


@pytest.mark.parametrize("release", FOLDERS)
def test_series_is_one_twin_per_runtime_patch_in_order(release):
    # patch_worker_gpu_model_runner -> a patch naming worker, gpu, model and runner,
    # whose Origin names vllm_gdn_hs/patch/patch_worker_gpu_model_runner.py.
    from vllm_gdn_hs.patch import patches_for

    series, modules = _series(release), patches_for(release)
    assert len(series) == len(modules), (series, modules)
    for index, (name, module) in enumerate(zip(series, modules, strict=True), start=1):
        assert name.startswith(f"{index:04d}-"), name
        words = module.removeprefix("patch_").split("_")
        assert all(w in name for w in words), (name, module)
        with open(os.path.join(PATCHES, release, name)) as f:
            header = f.read().split("\n---\n", 1)[0]
        origin = re.search(r"^Origin: (.*)$", header, re.M)
        assert origin and f"vllm_gdn_hs/patch/{module}.py" in origin.group(1), name


@pytest.mark.parametrize("release, name", ALL_PATCHES)
def test_patch_has_dep3_header_and_no_plugin_code(release, name):
    with open(os.path.join(PATCHES, release, name)) as f:
        text = f.read()
    header = text.split("\n---\n", 1)[0]
    for field in ("Description", "Author", "Origin", "Forwarded", "Applied-Upstream"):
        assert re.search(rf"^{field}: \S", header, re.M), f"{name}: no {field}"
    assert re.search(r"^Last-Update: \d{4}-\d{2}-\d{2}$", header, re.M), name
    targets = _targets(release, name)
    assert targets and all(t.startswith("vllm/") for t in targets)
    added = [ln for ln in text.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
    assert not [ln for ln in added if "vllm_gdn_hs" in ln], f"{name} imports the plugin"


INSTALLED = importlib.metadata.version("vllm").split("+")[0]
FOLDER = next((f for f in FOLDERS if INSTALLED in _covers(f)), None)


@pytest.fixture(scope="module")
def vllm_src() -> str:
    if shutil.which("patch") is None:
        pytest.skip("the `patch` binary is missing (Debian: apt-get install patch)")
    assert FOLDER is not None, f"installed vllm {INSTALLED} is in no patches/*/VLLM_VERSIONS"
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None
    return os.path.dirname(os.path.dirname(spec.origin))  # site-packages


SERIES = _series(FOLDER) if FOLDER else ["(no series)"]
SERIES_DIR = os.path.join(PATCHES, FOLDER or "")


@pytest.mark.smoke
@pytest.mark.parametrize("index", range(len(SERIES)), ids=SERIES)
def test_series_applies_in_order_and_compiles(index, vllm_src, tmp_path):
    """The installed release's series, on a copy of the installed vLLM's files."""
    applied = SERIES[: index + 1]
    for name in applied:
        for target in _targets(FOLDER, name):
            dst = tmp_path / target
            if not dst.exists():
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(os.path.join(vllm_src, target), dst)
    for name in applied:
        proc = subprocess.run(
            ["patch", "-p1", "--batch", "--forward", "--fuzz=0", "--no-backup-if-mismatch"]
            + ["-i", os.path.join(SERIES_DIR, name)],
            cwd=tmp_path,
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, f"{name} does not apply:\n{proc.stdout}{proc.stderr}"
    for target in _targets(FOLDER, SERIES[index]):
        patched = tmp_path / target
        with open(os.path.join(vllm_src, target)) as f:
            assert patched.read_text() != f.read(), f"{target} unchanged"
        py_compile.compile(str(patched), cfile=str(patched) + "c", doraise=True)
