"""Run: python -m pytest tests/test_docs.py -q   (CPU, no network; about a minute: subprocesses)

Every ``vllm-gdn-hs`` and ``python`` command line in docs/, run from the repository root as a
reader pastes it: in code blocks and in inline code. A launch runs with ``--dry-run`` (the
docs' model becomes a folder with its config.json, ``MASTER_IP`` the loopback address); any
other command, or one cut short by ``...`` or a shell operator, with ``--help``. A script or
module named must exist. tests/test_readme.py does the same, and more, for the README.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import shlex
import subprocess
import sys

import pytest
from test_readme import MODEL, blocks, split_commands

from vllm_gdn_hs.cli.model_info import write_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))
OURS = {"vllm-gdn-hs", "python"}
CUT = {"...", "&", "&&", "|", ";", "||"}  # the rest of the line is the shell's, or elided
PLACES = {"MASTER_IP": "127.0.0.1", "THIS_HOST_IP": "127.0.0.1", "TRAINER_IP": "127.0.0.1"}


def doc_commands(path: str) -> list[list[str]]:
    """The ``vllm-gdn-hs``/``python`` commands of one page: code blocks, then inline code."""
    with open(path) as f:
        text = f.read()
    found = []
    for lang, body in blocks(text):
        if lang in {"bash", "sh", "shell", "console", ""}:
            found += split_commands(body, strict=lang != "")
    for span in re.findall(r"`((?:vllm-gdn-hs|python) [^`]+)`", text):
        found.append(shlex.split(span))
    return [cmd for cmd in found if cmd[0] in OURS]


CASES = [
    pytest.param(cmd, id=f"{os.path.basename(page)}:{shlex.join(cmd)[:60]}")
    for page in DOCS
    for cmd in doc_commands(page)
]


def test_docs_have_commands():
    assert len(CASES) >= 6, [c.values for c in CASES]


def is_launch(words: list[str]) -> bool:
    return words[1:2] == ["launch"] or words[1:2] == ["launch/launch_vllm.py"]


def runnable(cmd: list[str], model: str) -> tuple[list[str], bool]:
    """The command as run here (argv after the program) and whether it is a dry run."""
    words = []
    for word in cmd:
        if word in CUT or "..." in word:
            break
        words.append(word)
    whole = len(words) == len(cmd)
    for name, value in PLACES.items():
        words = [w.replace(name, value) for w in words]
    words = [model if w == MODEL else w for w in words]
    own = words[: words.index("--")] if "--" in words else words
    if is_launch(words) and whole and "--help" not in own:
        return [*words[1:3], "--dry-run", *words[3:]], True
    return [*own[1:], "--help"], False


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("docs") / "model")
    write_config(MODEL, folder)
    return folder


@pytest.mark.parametrize("cmd", CASES)
def test_doc_command_runs_from_the_repository_root(cmd, model):
    if cmd[0] == "python":
        if cmd[1] == "-m":
            assert importlib.util.find_spec(cmd[2]) is not None, f"no module {cmd[2]}: {cmd}"
        else:
            assert os.path.isfile(os.path.join(REPO, cmd[1])), f"{cmd}: no such file at the root"
    argv, dry = runnable(cmd, model)
    program = [sys.executable] if cmd[0] == "python" else [sys.executable, "-m", "vllm_gdn_hs.cli"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    r = subprocess.run(
        [*program, *argv], capture_output=True, text=True, cwd=REPO, timeout=300, env=env
    )
    assert r.returncode == 0, f"{shlex.join(cmd)}\n{r.stdout[-2000:]}{r.stderr[-2000:]}"
    assert r.stdout.startswith("Would run:") if dry else "usage:" in r.stdout, r.stdout[:500]
