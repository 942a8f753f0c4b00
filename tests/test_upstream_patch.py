"""patches/upstream/: the pull request against vLLM is well formed, applies and its tests pass.

Run: python -m pytest tests/test_upstream_patch.py -q (CPU, no network; needs `git`).
The format checks always run. On vLLM 0.34.0 (the PR's base; CI installs it) the files the
patch touches are copied from the installed vLLM, checked against the sha256 sums of its wheel's
RECORD (so they are the release's own, not edited in place), the patch is applied to the copy
with `git apply` (no fuzz), the patched files are compiled, and the unit tests the patch adds
run in a fresh interpreter in which the patched modules shadow the installed ones.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import importlib.util
import os
import py_compile
import re
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UPSTREAM = os.path.join(REPO, "patches", "upstream")
BASE = "0.34.0"
PATCHES = sorted(f for f in os.listdir(UPSTREAM) if f.endswith(".patch"))
INSTALLED = importlib.metadata.version("vllm").split("+")[0]


def _read(name: str) -> str:
    with open(os.path.join(UPSTREAM, name)) as f:
        return f.read()


def _files(text: str) -> list[dict]:
    """One entry per `diff --git` section: paths, whether new, its ---/+++ lines, added lines."""
    files: list[dict] = []
    for line in text.splitlines():
        if line.startswith("diff --git "):
            a, b = line[len("diff --git ") :].split(" ")
            files.append({"a": a, "b": b, "new": False, "minus": None, "plus": None, "added": []})
        elif not files:
            continue
        elif line.startswith("new file mode "):
            files[-1]["new"] = line == "new file mode 100644"
        elif line.startswith("--- ") and files[-1]["minus"] is None:
            files[-1]["minus"] = line[4:]
        elif line.startswith("+++ ") and files[-1]["plus"] is None:
            files[-1]["plus"] = line[4:]
        elif line.startswith("+"):
            files[-1]["added"].append(line[1:])
    return files


def _targets(name: str) -> list[str]:
    return [f["b"][len("b/") :] for f in _files(_read(name))]


def test_folder_has_patches_and_pr_description():
    assert PATCHES and all(re.match(r"\d{4}-[a-z0-9-]+\.patch$", p) for p in PATCHES), PATCHES
    if len(PATCHES) > 1:
        with open(os.path.join(UPSTREAM, "series")) as f:
            assert [ln.strip() for ln in f if ln.strip()] == PATCHES
    with open(os.path.join(UPSTREAM, "PR.md")) as f:
        pr = f.read()
    for needle in ("#56774", "#56822", "61,440", "Test plan", "Not in this PR", f"v{BASE}"):
        assert needle in pr, needle
    assert "TO BE FILLED" not in pr, "PR.md still has placeholders: fill them from a GPU run"


@pytest.mark.parametrize("name", PATCHES)
def test_patch_is_well_formed(name):
    text = _read(name)
    header, sep, _ = text.partition("\n---\n")
    assert sep and re.search(r"^Subject: \S", header, re.M), f"{name}: no commit message"
    assert f"Base: vLLM v{BASE}" in header
    files = _files(text)
    assert files, f"{name}: no diff"
    for f in files:
        a, b = f["a"], f["b"]
        assert a.startswith("a/") and b.startswith("b/") and a[2:] == b[2:], (a, b)
        path = b[2:]
        assert path.startswith(("vllm/", "tests/")) and ".." not in path.split("/"), path
        assert f["plus"] == b, (path, f["plus"])
        if f["new"]:
            assert f["minus"] == "/dev/null", path
            if path.endswith(".py"):  # vLLM's SPDX header
                assert f["added"][:2] == [
                    "# SPDX-License-Identifier: Apache-2.0",
                    "# SPDX-FileCopyrightText: Copyright contributors to the vLLM project",
                ], path
        else:
            assert f["minus"] == a, (path, f["minus"])
        assert not [ln for ln in f["added"] if "vllm_gdn_hs" in ln], f"{path} names the plugin"
        if path.endswith(".py"):  # vLLM's line length
            assert all(len(ln) <= 88 or "noqa: E501" in ln for ln in f["added"]), path
    assert any(f["b"].startswith("b/tests/") and f["new"] for f in files), "no tests added"


# --- on the PR's base release --------------------------------------------------------------

# Makes the patched modules under ROOT shadow the installed vllm ones, then runs pytest.
_OVERLAY = """
import importlib.abc, importlib.util, os, sys
ROOT = sys.argv[1]
class _Patched(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.startswith("vllm."):
            f = os.path.join(ROOT, *name.split(".")) + ".py"
            if os.path.isfile(f):
                return importlib.util.spec_from_file_location(name, f)
        return None
sys.meta_path.insert(0, _Patched())
import pytest
sys.exit(pytest.main(sys.argv[2:]))
"""


def _release_file(dist: importlib.metadata.Distribution, path: str) -> str:
    """The installed file at ``path`` (e.g. ``vllm/config/vllm.py``), checked against the
    sha256 its wheel's RECORD lists: the release's own file, not one edited in place."""
    (record,) = [f for f in dist.files or () if str(f) == path] or [None]
    assert record is not None and record.hash is not None, f"{path}: not in vLLM's RECORD"
    local = str(dist.locate_file(record))
    with open(local, "rb") as f:
        digest = hashlib.new(record.hash.mode, f.read()).digest()
    value = base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
    assert value == record.hash.value, (
        f"{local} differs from vLLM {BASE}'s wheel (RECORD): reinstall vLLM {BASE}"
    )
    return local


@pytest.fixture(scope="module")
def patched_tree(tmp_path_factory) -> str:
    if INSTALLED != BASE:
        pytest.skip(
            f"needs vLLM {BASE}'s sources (the PR's base), taken from an installed vLLM "
            f"{BASE}; installed is {INSTALLED}"
        )
    if shutil.which("git") is None:
        pytest.skip("`git` is missing")
    dist = importlib.metadata.distribution("vllm")
    root = str(tmp_path_factory.mktemp("vllm-pr"))
    for name in PATCHES:
        for f in _files(_read(name)):
            if not f["new"]:
                dst = os.path.join(root, f["a"][2:])
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                shutil.copyfile(_release_file(dist, f["a"][2:]), dst)
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    for name in PATCHES:
        for args in (["--check"], []):
            proc = subprocess.run(
                ["git", "apply", *args, os.path.join(UPSTREAM, name)],
                cwd=root,
                capture_output=True,
                text=True,
            )
            assert proc.returncode == 0, f"{name} does not apply {args}:\n{proc.stderr}"
    return root


def test_patch_applies_and_compiles(patched_tree):
    for name in PATCHES:
        for target in _targets(name):
            if target.endswith(".py"):
                path = os.path.join(patched_tree, target)
                py_compile.compile(path, cfile=path + "c", doraise=True)


def test_tests_added_by_the_patch_pass_on_cpu(patched_tree):
    tests = [t for name in PATCHES for t in _targets(name) if re.match(r"tests/.*test_\w+\.py$", t)]
    with open(os.path.join(patched_tree, "pytest.ini"), "w") as f:
        f.write("[pytest]\n")  # not this project's pytest settings
    env = dict(os.environ, VLLM_PLUGINS="")  # stock vLLM plus the patch, no plugin
    proc = subprocess.run(
        [sys.executable, "-c", _OVERLAY, patched_tree, *tests, "-q", "-p", "no:cacheprovider"],
        cwd=patched_tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert re.search(r"\d+ passed", proc.stdout) and " skipped" not in proc.stdout, proc.stdout
