"""Run: python -m pytest tests/test_readme.py -q   (CPU; about 30 s, the CLI runs in subprocesses)

The README's shell commands, run against a tiny model, so that they keep matching the CLI.

The fenced (and indented) shell blocks of README.md are split into commands. The README's model
(``Qwen/Qwen3.6-27B``) and the folder (``qwen3.6-config``) that its ``vllm-gdn-hs config``
command writes, offline, become that folder, which holds only Qwen3.6-27B's config.json
(vllm_gdn_hs/cli/configs/qwen3.6-27b.json: its published dimensions); the
hidden-states folder (``/data/hidden_states``) becomes a temp folder. Then every command that
needs no GPU runs: each ``vllm-gdn-hs launch`` with ``--dry-run`` (it must print a pastable
``vllm serve`` command that vLLM's own parser takes, and the output shown in the README),
``vllm-gdn-hs doctor`` (it writes up to 1 GiB as its speed probe), ``vllm-gdn-hs check`` on a
folder holding one file, and the Python block that reads a file. The commands that need a GPU,
a server or the network (``demo``, ``curl``, ``git``, ``pip``/``uv``, ``hf``, the test suites)
are checked offline for what can be checked. The install must pin a supported vLLM; the README
names the supported range, not every release. The option tables must name every option of the
launcher and of the connector, with the code's defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
from importlib import metadata

import pytest
from tiny_models import build_tiny_hybrid

from vllm_gdn_hs.cli.launch import make_parser, parse_args
from vllm_gdn_hs.cli.model_info import packaged_config_path
from vllm_gdn_hs.config import HiddenStatesConfig, RequestParams
from vllm_gdn_hs.names import CONNECTOR_NAME
from vllm_gdn_hs.version import RELEASES, engine_wait_from_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, "README.md")
OPTIONS = os.path.join(REPO, "docs", "options.md")  # the option tables the README links to
MAX_LINES, MAX_WIDTH = 160, 100  # a feature that needs room moves something to docs/
CI_COMMAND = 'python -m pytest tests -m "not gpu"'  # the CPU suite, as .ci/run runs it
MODEL = "Qwen/Qwen3.6-27B"  # the README's model, replaced by a folder with its config.json
CONFIG_DIR = "qwen3.6-config"  # where the README writes its config.json, replaced alike
QWEN36_CONFIG = packaged_config_path("Qwen/Qwen3.6-27B")
DEFAULT_FOLDER = "/tmp/hidden_states"  # the launcher's default, replaced by the temp folder
FOLDER = "/data/hidden_states"  # the README's hidden-states folder, replaced by a temp one
LAYERS = 64  # Qwen3.6-27B's
SHELL = {"bash", "sh", "shell", "console"}
with open(os.path.join(REPO, "pyproject.toml")) as _f:  # tomllib: Python 3.11+ only
    MARKERS = set(re.findall(r'"(\w+):', _f.read().split("markers = [", 1)[1].split("]", 1)[0]))
# Commands shown but not run here (they need a GPU, a server, the network or change the
# environment); each is checked in its own test below.
NOT_RUN = {"git", "cd", "pip", "uv", "source", "hf", "curl", "bash", "python", "speculators"}
SUBCOMMANDS = {"config", "launch", "doctor", "check", "demo"}
# What the launcher adds where flashinfer is not installed (the README's shown output has not).
NO_FLASHINFER = ["--additional-config", '{"gdn_prefill_backend": "triton"}']


def readme(path: str = README) -> str:
    with open(path) as f:
        return f.read()


def blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every code block in order: fenced ones with their info string's
    first word, indented ones (after a blank line, not inside a list) with language ''."""
    out, lines, i, prose = [], text.splitlines(), 0, ""
    while i < len(lines):
        line = lines[i]
        fence = re.match(r"^(`{3,}|~{3,})\s*([\w+-]*)", line)
        if fence:
            j = i + 1
            while j < len(lines) and not lines[j].startswith(fence.group(1)):
                j += 1
            out.append((fence.group(2).lower(), "\n".join(lines[i + 1 : j])))
            i, prose = j + 1, ""
            continue
        in_list = re.match(r"^(\s*[-*+]|\s*\d+[.)])\s|^\s{2,}\S", prose)
        if line.startswith("    ") and i > 0 and not lines[i - 1].strip() and not in_list:
            j = i
            while j < len(lines) and (lines[j].startswith("    ") or not lines[j].strip()):
                j += 1
            out.append(("", "\n".join(x[4:] for x in lines[i:j]).strip("\n")))
            i = j
            continue
        if line.strip():
            prose = line if not line.startswith("  ") or not prose else prose
        i += 1
    return out


def split_commands(body: str, strict: bool) -> list[list[str]]:
    """The commands of a shell block: continuation lines joined, comments dropped, ``&&``
    chains split. ``strict`` (fenced shell blocks): every line is a command; otherwise (indented
    blocks, which may hold output) only lines that start with a program named here."""
    cmds = []
    for line in body.replace("\\\n", " ").splitlines():
        line = line.strip().removeprefix("$ ")
        if not line or line.startswith("#"):
            continue
        if not strict and line.split()[0] not in NOT_RUN | {"vllm-gdn-hs"}:
            continue
        words, cmd = shlex.split(line, comments=True), []
        for word in [*words, "&&"]:
            if word == "&&":
                if cmd:
                    cmds.append(cmd)
                cmd = []
            else:
                cmd.append(word)
    return cmds


def commands(text: str | None = None) -> list[list[str]]:
    text = readme() if text is None else text
    out = []
    for lang, body in blocks(text):
        if lang in SHELL or lang == "":
            out += split_commands(body, strict=lang in SHELL)
    return out


def ours(sub: str) -> list[list[str]]:
    """The README's ``vllm-gdn-hs <sub> ...`` commands, each once, in order."""
    found = []
    for cmd in commands():
        if cmd[0] == "vllm-gdn-hs" and cmd[1:2] == [sub] and cmd not in found:
            found.append(cmd)
    return found


def _cli(*args, cwd=None, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "vllm_gdn_hs.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )


@pytest.fixture(scope="module")
def places(tmp_path_factory) -> dict:
    """The folder the README's own ``vllm-gdn-hs config`` command writes (Qwen3.6-27B's
    config.json alone, offline), and the hidden-states folder, that stand in for the README's."""
    root = tmp_path_factory.mktemp("readme")
    for cmd in ours("config"):
        r = _cli(*cmd[1:], cwd=root)
        assert r.returncode == 0, f"{shlex.join(cmd)}\n{r.stdout}{r.stderr}"
    model = root / CONFIG_DIR
    assert os.listdir(model) == ["config.json"], "the README's config command writes the folder"
    with open(model / "config.json") as f, open(QWEN36_CONFIG) as g:
        assert json.load(f) == json.load(g)
    folder = root / "hidden_states"
    folder.mkdir()
    return {"root": root, "model": str(model), "folder": str(folder)}


def substitute(words: list[str], places: dict) -> list[str]:
    out = [w.replace(MODEL, places["model"]).replace(FOLDER, places["folder"]) for w in words]
    return [places["model"] if w == CONFIG_DIR else w for w in out]


# -- the README as a whole -----------------------------------------------------------------


def test_readme_is_short_and_narrow():
    """At most MAX_LINES lines, and prose of at most MAX_WIDTH characters (commands and their
    output, in code blocks, may be longer)."""
    lines = readme().splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines: move details to docs/"
    fenced, wide = False, []
    for n, line in enumerate(lines, 1):
        fenced ^= line.startswith("```")
        if not fenced and not line.startswith("```") and len(line) > MAX_WIDTH:
            wide.append(n)
    assert not wide, f"README.md lines over {MAX_WIDTH} characters outside code blocks: {wide}"


def test_readme_keeps_the_ci_command_verbatim():
    text = readme()
    assert CI_COMMAND in text, "CI runs this command (.ci/run): keep it exactly"
    shell = [body for lang, body in blocks(text) if lang in SHELL or lang == ""]
    assert any(CI_COMMAND in body.splitlines() for body in shell), "keep it as a shell command"


def test_block_parser_reads_fenced_and_indented_commands():
    text = (
        "Intro.\n\n    vllm-gdn-hs check /x \\\n        --expect 2\n\n- a list item\n\n"
        "    continued item text\n\n```bash\npip install -e . && vllm-gdn-hs demo  # GPU\n```\n"
    )
    assert commands(text) == [
        ["vllm-gdn-hs", "check", "/x", "--expect", "2"],
        ["pip", "install", "-e", "."],
        ["vllm-gdn-hs", "demo"],
    ]


def test_every_readme_command_is_one_this_test_knows():
    """A new kind of command in the README needs a check here, so none goes unchecked."""
    cmds = commands()
    assert cmds, "no shell commands found in README.md"
    for cmd in cmds:
        assert cmd[0] in NOT_RUN | {"vllm-gdn-hs"}, f"README command not covered: {cmd}"
        if cmd[0] == "vllm-gdn-hs":
            assert cmd[1:2] and cmd[1] in SUBCOMMANDS, f"unknown subcommand: {cmd}"
    text = " ".join(" ".join(c) for c in cmds)
    assert MODEL in text and FOLDER in text, "the placeholders this test replaces changed"
    for sub in ("launch", "doctor", "check"):
        assert ours(sub), f"README has no `vllm-gdn-hs {sub}` command"


def test_script_and_python_commands_exist():
    for cmd in commands():
        if cmd[0] == "bash":
            assert os.path.isfile(os.path.join(REPO, cmd[1])), cmd
        elif cmd[0] == "source":
            venvs = [c[3] for c in commands() if c[:3] == ["python", "-m", "venv"]]
            assert cmd[1:] in ([f"{v}/bin/activate"] for v in venvs), (cmd, venvs)
        elif cmd[0] == "python":
            # speculators' own launcher (the "before" of the migration), the CPU tests, a
            # virtualenv, or one of our scripts.
            ok = cmd[1].startswith("speculators/") or cmd[1:4] == ["-m", "pytest", "tests"]
            if cmd[1:4] == ["-m", "pytest", "tests"] and "-m" in cmd[4:]:
                marks = set(re.findall(r"\w+", cmd[cmd.index("-m", 4) + 1])) - {"not", "and", "or"}
                assert marks <= MARKERS, f"{cmd}: {marks - MARKERS} is no marker of pyproject.toml"
            ok = ok or (cmd[1:3] == ["-m", "venv"] and len(cmd) == 4)
            ours = cmd[1].startswith("tests/") and os.path.isfile(os.path.join(REPO, cmd[1]))
            assert ok or ours, f"README python command not covered: {cmd}"


def installs() -> list[list[str]]:
    """The README's ``pip install`` and ``uv pip install`` commands, as ``pip ...``."""
    cmds = [c[1:] if c[:2] == ["uv", "pip"] else c for c in commands()]
    return [c for c in cmds if c[:2] == ["pip", "install"]]


def test_install_commands_pin_supported_vllm_releases():
    """The install pins the newest supported vLLM (the README says so) and names the supported
    range by its ends, not release by release; the override file it names exists."""
    text = readme()
    pins = [w.split("==", 1)[1] for c in installs() for w in c if w.startswith("vllm==")]
    assert pins, "the README's install must say how to choose the vLLM release (vllm==X)"
    assert set(pins) == {RELEASES[-1]}, f"README pins {pins}; the newest supported: {RELEASES[-1]}"
    assert f"{RELEASES[0]} to {RELEASES[-1]}" in text, "README: name the supported range"
    for cmd in installs():
        if "--override" in cmd:
            with open(os.path.join(REPO, cmd[cmd.index("--override") + 1])) as f:
                assert any(line.startswith("flashinfer-python==") for line in f), cmd
    extras = set(metadata.metadata("vllm-gdn-hs").get_all("Provides-Extra") or [])
    for cmd in installs():
        for word in cmd:
            if m := re.fullmatch(r"\.\[(.+)\]", word):
                assert set(m.group(1).split(",")) <= extras, (word, extras)
    other = [c for c in commands() if c[0] == "uv" and c[:3] != ["uv", "pip", "install"]]
    assert not other, other


def test_git_clone_and_package_address():
    """One clone address, used everywhere; the package is said not to be on PyPI."""
    clones = [c for c in commands() if c[:2] == ["git", "clone"]]
    assert len(clones) == 1 and clones[0][2].startswith("https://github.com/"), clones
    assert "not on pypi" in readme().lower()
    assert not [c for c in installs() if "vllm-gdn-hs" in c], "pip install vllm-gdn-hs fails"


def test_config_command_feeds_the_dry_run():
    """``vllm-gdn-hs config MODEL DIR``, then a dry run on DIR: the path a new user takes on a
    CPU machine without network (``places`` runs it; the dry run runs in the launch tests)."""
    assert ours("config") == [["vllm-gdn-hs", "config", MODEL, CONFIG_DIR]]
    assert any(c[2] == CONFIG_DIR and "--dry-run" in c for c in ours("launch"))


def test_speculators_commands_are_taken_by_speculators():
    """speculators' pipeline as the README shows it: each command parsed by speculators
    0.9.0's own CLI; the trainer gets the launcher's layer ids and a backend we write."""
    import typer
    from speculators.cli import app
    from speculators.train.config import TrainConfig

    cmds = [c for c in commands() if c[0] == "speculators"]
    subs = {c[1] for c in cmds}
    assert {"prepare-data", "generate-offline-data", "train"} <= subs, subs
    launched = {tuple(parse_args(c[2:]).target_layer_ids or ()) for c in ours("launch")}
    launched = {tuple(map(str, ids)) for ids in launched}
    for cmd in cmds:
        argv = ["0" if w.startswith("$") else w for w in cmd[2:]]  # a shell variable: a rank
        if cmd[1] == "train":
            f = TrainConfig.resolve(argv).flatten()
            assert f["hidden_states_backend"] in ("file", "fp8"), cmd
            assert tuple(map(str, f["target_layer_ids"])) in launched, cmd
            assert f["verifier_name_or_path"] == MODEL, cmd
        else:
            command = typer.main.get_command(app).commands[cmd[1]]
            params = command.make_context(cmd[1], argv).params
            assert params["model"] == MODEL, cmd


def test_demo_command_exists():
    for cmd in ours("demo"):
        r = _cli(*cmd[1:], "--help")
        assert r.returncode == 0, r.stdout + r.stderr


# -- vllm-gdn-hs launch ----------------------------------------------------------------------


def with_dry_run(argv: list[str]) -> list[str]:
    """``launch MODEL ...`` with --dry-run right after MODEL (never after ``--``, where it
    would go to vLLM and the launcher would start it)."""
    assert argv[0] == "launch" and len(argv) > 1, argv
    own = argv[: argv.index("--")] if "--" in argv else argv
    return argv if "--dry-run" in own else [*argv[:2], "--dry-run", *argv[2:]]


def dry_run(cmd: list[str], places: dict) -> list[str]:
    """Run a README launch command with --dry-run; the printed command, split back. Without a
    --hidden-states-path the temp folder is given, so that the launcher's check of the folder
    makes none on this machine."""
    argv = with_dry_run(substitute(cmd[1:], places))
    own = argv[: argv.index("--")] if "--" in argv else argv
    if "--hidden-states-path" not in own:
        argv = [*argv[:2], "--hidden-states-path", places["folder"], *argv[2:]]
    r = _cli(*argv, timeout=60)
    assert r.returncode == 0, f"{shlex.join(cmd)}\n{r.stdout}{r.stderr}"
    lines = r.stdout.strip().splitlines()
    assert lines[0] == "Would run:", r.stdout
    return shlex.split(lines[-1])


def dry_run_output(cmd: list[str], places: dict) -> list[str]:
    """Every line a README launch command prints with --dry-run."""
    r = _cli(*with_dry_run(substitute(cmd[1:], places)), timeout=60)
    assert r.returncode == 0, f"{shlex.join(cmd)}\n{r.stdout}{r.stderr}"
    return r.stdout.strip().splitlines()


@pytest.fixture(scope="module")
def dry_runs(places) -> list[tuple[list[str], list[str]]]:
    cmds = ours("launch")
    assert cmds
    return [(cmd, dry_run(cmd, places)) for cmd in cmds]


def test_launch_commands_print_a_vllm_serve_command(dry_runs, places):
    for cmd, serve in dry_runs:
        args = parse_args(cmd[2:])
        assert serve[:5] == [
            sys.executable,
            "-m",
            "vllm.entrypoints.cli.main",
            "serve",
            places["model"],
        ], serve
        opts = {serve[i]: serve[i + 1] for i in range(5, len(serve) - 1) if serve[i][:2] == "--"}
        spec = json.loads(opts["--speculative_config"])
        ids = spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"]
        want = [*args.target_layer_ids, LAYERS] if args.target_layer_ids else [2, 32, 61, 64]
        assert ids == want, (cmd, ids)
        kv = json.loads(opts["--kv_transfer_config"])
        assert kv["kv_connector"] == CONNECTOR_NAME
        assert args.hidden_states_path in (FOLDER, DEFAULT_FOLDER), args.hidden_states_path
        assert kv["kv_connector_extra_config"]["shared_storage_path"] == places["folder"]
        after = cmd[cmd.index("--") + 1 :] if "--" in cmd else []
        for i, word in enumerate(after):  # the user's connector options are merged in
            if word == "--kv-transfer-config":
                extra = json.loads(after[i + 1])["kv_connector_extra_config"]
                assert extra.items() <= kv["kv_connector_extra_config"].items(), (extra, kv)
        assert "--no-enable-prefix-caching" in serve and "--language-model-only" in serve
        for word in after:  # everything after -- reaches vllm serve
            if word != "--kv-transfer-config" and not word.startswith("{"):
                assert word in serve, (word, serve)


def test_printed_commands_are_taken_by_vllm_serve(dry_runs, places):
    """Pastable: what the launcher prints parses with vLLM's own `vllm serve` parser."""
    import harness

    parser = harness.serve_parser()
    for cmd, serve in dry_runs:
        try:
            args = parser.parse_args(serve[4:])
        except SystemExit:
            pytest.fail(f"vllm serve refuses the command printed for {shlex.join(cmd)}")
        assert places["model"] in (getattr(args, "model_tag", None), getattr(args, "model", None))


def test_readme_shows_the_launchers_real_output(places):
    """The ``Would run:`` block is all that the launch command before it prints, line by line
    (with ``python3`` for the interpreter, and flashinfer installed): whole on the release the
    README installs; on older ones, whose shutdown settings differ, the command line."""
    found = blocks(readme())
    shown = [i for i, (lang, body) in enumerate(found) if body.startswith("Would run:")]
    assert shown, "README shows no launcher output"
    for i in shown:
        before = [
            c for c in split_commands(found[i - 1][1], True) if c[:2] == ["vllm-gdn-hs", "launch"]
        ]
        assert len(before) == 1, "the shown output must follow its one launch command"
        lines = dry_run_output(before[0], places)
        want_lines = found[i][1].splitlines()
        if metadata.version("vllm").startswith(RELEASES[-1]):
            assert lines[:-1] == want_lines[:-1], (lines, want_lines)
        real = shlex.split(lines[-1])
        if "--shutdown-timeout" in real and not engine_wait_from_env():
            # vLLM before VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS: the flag instead of the
            # export line the README shows (its release's)
            at = real.index("--shutdown-timeout")
            del real[at : at + 2]
        want = substitute(shlex.split(found[i][1].splitlines()[-1]), places)
        assert want[0] == "python3"
        assert [w for w in real[1:] if w not in NO_FLASHINFER] == want[1:], (real, want)


# -- vllm-gdn-hs doctor and check ----------------------------------------------------------


def test_doctor_commands(places, tmp_path):
    """The install block's doctor works offline and writes nothing; the one given a folder says
    where its speed probe writes, and how much, before the speed it measured."""
    cmds = ours("doctor")
    assert any("--hidden-states-path" in c for c in cmds), "README: doctor --hidden-states-path"
    install = [c for lang, body in blocks(readme()) for c in split_commands(body, True)
               if "git clone" in body and c[:2] == ["vllm-gdn-hs", "doctor"]]  # fmt: skip
    assert install == [["vllm-gdn-hs", "doctor"]], install
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    r = subprocess.run(
        [sys.executable, "-m", "vllm_gdn_hs.cli", "doctor"], capture_output=True, text=True,
        cwd=tmp_path, env=env, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0 and not os.listdir(tmp_path), r.stdout + r.stderr
    for cmd in cmds:
        r = _cli(*substitute(cmd[1:], places), cwd=places["root"])
        assert r.returncode == 0, f"{shlex.join(cmd)}\n{r.stdout}{r.stderr}"
        rows = [line for line in r.stdout.splitlines() if line[:4] in ("ok  ", "FAIL")]
        assert rows and all(row.startswith("ok") for row in rows), r.stdout
        if "--hidden-states-path" in cmd:
            probe = r.stdout.index(f"GiB to {places['folder']}/.vllm-gdn-hs-probe-")
            assert probe < r.stdout.index("write speed"), r.stdout
        if "--model" in cmd:
            assert re.search(r"layers\s+64\b", r.stdout), r.stdout


def test_check_commands_on_a_folder_with_one_file(places, tmp_path):
    import torch

    from vllm_gdn_hs.files import request_path, write_file

    folder = str(tmp_path / "hidden_states")
    os.makedirs(folder)
    write_file(
        request_path(folder, "cmpl-0123456789abcdef-0-89abcdef"),
        torch.ones(5, 6, 256, dtype=torch.bfloat16),  # rows no model gives
        torch.arange(5, dtype=torch.int64),
    )
    here = {**places, "folder": folder}
    cmds = ours("check")
    assert cmds
    for cmd in cmds:
        argv = substitute(cmd[1:], here)
        reference = "--reference" in argv
        if reference:  # the tiny hybrid with weights, as many layers as Qwen3.6-27B
            weights = build_tiny_hybrid(str(tmp_path / "weights"), num_hidden_layers=LAYERS)
            argv[argv.index("--reference") + 1] = weights
        r = _cli(*argv, cwd=tmp_path, timeout=300)
        expect = int(argv[argv.index("--expect") + 1]) if "--expect" in argv else None
        fails = reference or (expect and expect > 1)
        assert r.returncode == (1 if fails else 0), r.stdout + r.stderr
        if reference:
            assert "FAILED: 1 of 1 files over the per-file bound" in r.stdout, r.stdout
        assert r.stdout.startswith(f"{folder}: 1 complete files, 5 tokens"), r.stdout
        if expect and expect > 1:
            assert f"{expect - 1:,} missing" in r.stdout, r.stdout
        if "--list" in argv:
            assert (tmp_path / argv[argv.index("--list") + 1]).is_file()


# -- the request and the file --------------------------------------------------------------


def test_curl_request_is_speculators_request():
    curls = [c for c in commands() if c[0] == "curl"]
    assert curls, "README shows no request"
    for cmd in curls:
        url = next(w for w in cmd[1:] if not w.startswith("-") and "/v1/" in w)
        assert url.endswith("/v1/completions"), url
        body = json.loads(cmd[cmd.index("-d") + 1])
        assert body["model"] == MODEL
        assert body["prompt"] and all(isinstance(t, int) for t in body["prompt"])
        assert body["max_tokens"] == 1 and body["return_token_ids"] is True


def test_shown_response_names_the_file():
    shown = [json.loads(body) for lang, body in blocks(readme()) if lang == "json"]
    # or inline: `"kv_transfer_params": {...}`
    shown += [
        json.loads("{" + m + "}")
        for m in re.findall(r'`("kv_transfer_params": \{.*?\})`', readme())
    ]
    paths = [
        r["kv_transfer_params"]["hidden_states_path"] for r in shown if "kv_transfer_params" in r
    ]
    assert paths and all(p.startswith(FOLDER + "/") and p.endswith(".safetensors") for p in paths)
    assert RequestParams.model_fields.keys() >= {"hidden_states_path", "include_output_tokens"}


def test_python_block_reads_a_file(tmp_path):
    import torch

    from vllm_gdn_hs.files import request_path, write_file

    path = request_path(str(tmp_path), "cmpl-0123456789abcdef-0-89abcdef")
    write_file(path, torch.ones(7, 4, 256, dtype=torch.bfloat16), torch.arange(7))
    codes = [body for lang, body in blocks(readme()) if lang == "python"]
    assert codes, "README shows no Python"
    for code in codes:
        code, n = re.subn(r"([\"'])" + re.escape(FOLDER) + r"/[^\"']*\1", repr(path), code)
        assert n, "the Python block reads no file under the README's folder"
        assert "[T, L, H] bf16" in code and "[T] int64" in code
        namespace: dict = {}
        exec(compile(code, "README.md", "exec"), namespace)
        d = namespace["d"]
        assert d["hidden_states"].shape == (7, 4, 256)
        assert d["hidden_states"].dtype == torch.bfloat16 and d["token_ids"].dtype == torch.int64


# -- the option tables ---------------------------------------------------------------------


def table(text: str, first_header: str) -> dict[str, list[str]]:
    """The rows of the Markdown table whose first header cell is ``first_header``: first cell
    (backticks kept) -> the other cells."""
    rows, inside = {}, False
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if "|" in line else None
        if cells and cells[0] == first_header:
            inside = True
        elif inside and cells and not set(cells[0]) <= set("-: "):
            rows[cells[0]] = cells[1:]
        elif inside and not cells:
            break
    assert rows, f"README has no table headed {first_header!r}"
    return rows


def _shown(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def test_connector_options_table_matches_the_code():
    rows = table(readme(OPTIONS), "`kv_connector_extra_config`")
    names = {cell.strip("`") for cell in rows}
    assert names == set(HiddenStatesConfig.model_fields), names ^ set(
        HiddenStatesConfig.model_fields
    )
    for name, field in HiddenStatesConfig.model_fields.items():
        if field.default is not None and not callable(field.default_factory):
            shown = rows[f"`{name}`"][0].split()[0].strip("`")
            assert shown == _shown(field.default), (name, shown, field.default)


def test_request_params_table_matches_the_code():
    rows = table(readme(OPTIONS), "per-request `kv_transfer_params`")
    assert {c.strip("`") for c in rows} == set(RequestParams.model_fields)
    assert rows["`include_output_tokens`"][0] == _shown(
        RequestParams.model_fields["include_output_tokens"].default
    )


def test_launcher_options_table_matches_the_parser():
    rows = table(readme(OPTIONS), "launcher option")
    listed = {w for cell in rows for w in re.findall(r"`(--[\w-]+)", cell)}
    parser = make_parser()
    options = {s for a in parser._actions for s in a.option_strings if s not in ("-h", "--help")}
    assert listed == options, listed ^ options
    for action in parser._actions:
        if action.default not in (None, False, True, argparse.SUPPRESS) and action.option_strings:
            cell = next(v for k, v in rows.items() if action.option_strings[0] in k)
            assert _shown(action.default) in cell[0], (action.option_strings, cell)
