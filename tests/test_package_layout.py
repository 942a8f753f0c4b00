"""The package holds the product only, in modules small enough to read, with no import circle:
no module imports the tests' helpers, none is over 400 lines (the size of one cohesive contract
such as ``files.py``), and the modules' top-level imports form no cycle."""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "vllm_gdn_hs"
TEST_HELPERS = {"tests", "harness", "cpu_engine", "tiny_models", "conftest", "mooncake_master"}
MAX_LINES = 400


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
        name: {m for m in imported(path, name, True) if m in mods and m != name}
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
