"""The package holds the product only, in modules small enough to read, with no import circle:
no module imports the tests' helpers, none is over 350 lines, the modules' imports (those
inside functions too) form no cycle, the package's face only hands names on, and the
connector's scheduler side and writer know no storage backend by name. Beside the package:
tests/, benchmarks/ and tools/ import their helpers by name (pytest's pythonpath option in
pyproject.toml, PYTHONPATH for scripts), never by editing Python's import path, and tests/
holds tests and their helpers only: the device tooling lives in tools/."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = REPO / "vllm_gdn_hs"
TEST_HELPERS = {
    "tests", "harness", "cpu_engine", "tiny_models", "conftest", "mooncake_master", "live_bytes",
    "launched",
}  # fmt: skip
MAX_LINES = 350


def modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imported(path: pathlib.Path, name: str, top_level_only: bool) -> set[str]:
    """Absolute names of the modules ``path`` imports (relative imports resolved)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    return names


@pytest.mark.parametrize("name", sorted(modules()))
def test_no_test_helpers_and_not_too_long(name):
    path = modules()[name]
    helpers = {n for n in imported(path, name, False) if n.split(".")[0] in TEST_HELPERS}
    assert not helpers, f"{path.name} imports test code: {sorted(helpers)}"
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.name}: {lines} lines; split it by job"


def test_no_import_circle():
    mods = modules()
    graph = {
        name: {m for m in imported(path, name, False) if m in mods and m != name}
        for name, path in mods.items()
    }
    for name in graph:  # a package imports its own submodules; that is not a circle
        graph[name] = {m for m in graph[name] if not m.startswith(name + ".")}
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = trail[trail.index(nxt) :] + [nxt] if nxt in trail else [node, nxt]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, [*trail, nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_package_face_only_hands_names_on():
    """``vllm_gdn_hs/__init__.py`` imports nothing of the package, and no module imports the
    package itself for a name: shared names live in ``names.py``, ``register`` in
    ``plugin.py``."""
    mods = modules()
    face = {n for n in imported(mods["vllm_gdn_hs"], "vllm_gdn_hs", False) if n in mods}
    assert not face, f"vllm_gdn_hs/__init__.py imports {sorted(face)}"
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "vllm_gdn_hs":
                names = {a.name for a in node.names}
                assert names <= set(mods_below(mods)), f"{name} imports {names} from the face"


def mods_below(mods: dict[str, pathlib.Path]) -> set[str]:
    """The package's own modules, as ``from vllm_gdn_hs import <module>`` names them."""
    return {n.split(".")[1] for n in mods if n.count(".") >= 1}


@pytest.mark.parametrize("module", ["connector/scheduler.py", "connector/writer.py"])
def test_no_backend_named_outside_its_module(module):
    text = (PACKAGE / module).read_text()
    assert "mooncake" not in text.lower() and "self.keys" not in text


# An edit of the import path: insert/append/extend/remove, an item or slice, += or =.
PATH_EDIT = re.compile(r"\bsys\.path\s*(\.\s*(insert|append|extend|remove)\b|\[|\+=|=(?!=))")
# tests/gpu: the GPU tests and the two pytest helpers they load; tests/: one shell script, the
# release matrix (CPU). The drivers run on the GPU machine live in tools/gpu_runs, the kit
# for that machine in tools/device.
GPU_TEST_HELPERS = {"gpu_report.py", "launched.py"}
TESTS_SHELL_SCRIPTS = {"matrix.sh"}


def test_no_import_path_edits_in_tests_benchmarks_or_tools():
    found = []
    for folder in ("tests", "benchmarks", "tools"):
        for path in sorted((REPO / folder).rglob("*.py")):
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if PATH_EDIT.search(line):
                    found.append(f"{path.relative_to(REPO)}:{i}: {line.strip()}")
    assert not found, (
        "import path edited (name the folder in pyproject.toml's pythonpath for pytest, or in "
        "PYTHONPATH where a script is run):\n" + "\n".join(found)
    )


def test_no_device_tooling_in_tests():
    tests = REPO / "tests"
    device = sorted(str(p.relative_to(REPO)) for p in tests.rglob("device_*") if p.is_file())
    assert not device, f"device tooling belongs in tools/device: {device}"
    drivers = sorted(
        p.name
        for p in (tests / "gpu").iterdir()
        if p.is_file()
        and p.suffix in (".py", ".sh")
        and not p.name.startswith("test_")
        and p.name not in GPU_TEST_HELPERS
    )
    assert not drivers, f"GPU drivers that are not pytest files belong in tools/gpu_runs: {drivers}"
    scripts = sorted(str(p.relative_to(REPO)) for p in tests.rglob("*.sh"))
    assert set(scripts) <= {f"tests/{n}" for n in TESTS_SHELL_SCRIPTS}, (
        f"shell scripts in tests/ other than {sorted(TESTS_SHELL_SCRIPTS)}: {scripts}"
    )


# -- rooms by audience -------------------------------------------------------------------------
AUDIENCES = ("vllm_gdn_hs.cli", "vllm_gdn_hs.verify")  # the command line, verification
# The package root: its face and the basics every room shares, each with its one job.
ROOT = {
    "__init__": "the package face",
    "plugin": "vLLM's entry point (vllm.general_plugins)",
    "unsupported": "what the entry point registers on a vLLM it does not support",
    "names": "the connector's name and module, the logger",
    "version": "which vLLM is installed, and whether it is supported",
    "config": "the connector's options, parsed once (config_from)",
    "layer_ids": "speculators' layer-id rules, the launcher's and the connector's",
    "model_support": "which of vLLM's model classes give aux hidden states",
    "files": "the hidden-states file format: names, paths, the write, the header",
    "locks": "the files' .lock protocol, the writer's and the reader's",
    "probes": "whether a folder can hold the files",
    "rows": "the checks of a file's rows",
    "hook": "the seam between the runner patches and the connector",
}


def test_runtime_imports_neither_the_command_line_nor_verification():
    """vLLM loads the runtime (connector, storage, patch and the basics) in every engine
    process; the command line and the verification tools import it, never the reverse."""
    mods = modules()
    for name, path in mods.items():
        if name.startswith(AUDIENCES):
            continue
        reached = {m for m in imported(path, name, False) if m.startswith(AUDIENCES)}
        assert not reached, f"{name} (runtime) imports {sorted(reached)}"
    verify = {n: p for n, p in mods.items() if n.startswith("vllm_gdn_hs.verify")}
    for name, path in verify.items():
        reached = {m for m in imported(path, name, False) if m.startswith("vllm_gdn_hs.cli")}
        assert not reached, f"{name} (verification) imports the command line: {sorted(reached)}"


def test_package_root_holds_the_face_and_shared_basics():
    root = {p.stem for p in PACKAGE.glob("*.py")}
    assert root <= set(ROOT), f"modules at the root with no shared job: {sorted(root - set(ROOT))}"
    rooms = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert rooms == {"cli", "verify", "connector", "storage", "patch"}, rooms


def code_reads(tree: ast.AST, key: str) -> list[int]:
    """Lines where code reads ``key``: an attribute, a subscript or a ``.get``/``getattr``."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == key:
            lines.append(node.lineno)
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            lines += [node.lineno] * (node.slice.value == key)
        elif isinstance(node, ast.Call) and any(
            isinstance(a, ast.Constant) and a.value == key for a in node.args
        ):
            lines.append(node.lineno)
    return lines


def test_connector_options_are_read_through_config_only():
    """``kv_connector_extra_config`` is parsed once, in config.py (config_from); every other
    module takes the typed options, or config.py's helpers for what is not ours."""
    found = []
    for name, path in modules().items():
        if name != "vllm_gdn_hs.config":
            lines = code_reads(ast.parse(path.read_text()), "kv_connector_extra_config")
            found += [f"{path.relative_to(REPO)}:{n}" for n in lines]
    assert not found, f"read kv_connector_extra_config through vllm_gdn_hs.config: {found}"


def own_private_names() -> set[str]:
    """Every private name the package defines outside patch/ (whose wrappers bear the names of
    the vLLM methods they wrap): functions, classes, module names, attributes."""
    names = set()
    for path in modules().values():
        if path.parent.name == "patch":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


@pytest.mark.parametrize("room", ["patch", "storage"])
def test_no_reach_into_private_names_across_modules(room):
    """A seam is a public method or a Protocol: ``patch/`` and ``storage/`` take no private name
    of another module of ours (an attribute, a getattr string, an import). vLLM's own private
    methods, which the patches wrap, are not ours."""
    ours, found = own_private_names(), []
    for path in sorted((PACKAGE / room).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            reach = None
            if isinstance(node, ast.Attribute) and node.attr in ours:
                base = ast.unparse(node.value)
                reach = None if base in ("self", "cls") else f"{base}.{node.attr}"
            elif isinstance(node, ast.Call) and ast.unparse(node.func) in (
                "getattr", "setattr", "hasattr"
            ):  # fmt: skip
                key = node.args[1] if len(node.args) > 1 else None
                if isinstance(key, ast.Constant) and key.value in ours:
                    base = ast.unparse(node.args[0])
                    reach = None if base in ("self", "cls") else f"{base}.{key.value}"
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vllm_gdn_hs"):
                private = [a.name for a in node.names if a.name in ours]
                reach = f"from {node.module} import {', '.join(private)}" if private else None
            if reach:
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {reach}")
    assert not found, "reaches into private names of another module:\n" + "\n".join(found)


def test_ci_releases_live_beside_ci_and_are_supported():
    """.ci/run's releases are CI's business: a list beside it, not a name in the runtime; each
    is a supported release, and the newest supported one is among them."""
    from vllm_gdn_hs.version import RELEASES

    lines = (REPO / ".ci" / "releases").read_text().splitlines()
    listed = " ".join(line for line in lines if not line.startswith("#")).split()
    assert listed and set(listed) <= set(RELEASES) and listed[-1] == RELEASES[-1], listed
    assert listed == sorted(listed, key=RELEASES.index), "oldest first: .ci/run starts the last"
    assert "CI_RELEASES" not in (PACKAGE / "version.py").read_text()
