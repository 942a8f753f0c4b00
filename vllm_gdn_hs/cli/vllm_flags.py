"""The long options of the installed vLLM's ``vllm serve``, read from its sources without
importing it (building vLLM's parser takes 40-50 s and needs a GPU), so that the launcher
refuses a misspelled vLLM flag at once, ``--dry-run`` included, instead of passing it on."""

from __future__ import annotations

import ast
import difflib
import functools
import importlib.util
import re
from pathlib import Path

# where vLLM declares serve's options: the engine's, and the frontend's (moved between releases)
SOURCES = ("engine/arg_utils.py", "entrypoints/cli_args.py", "entrypoints/*/cli_args.py")
LONG = re.compile(r"--[a-z0-9][a-z0-9-]*")


@functools.cache
def serve_flags() -> frozenset[str]:
    """Every ``--flag`` string in those sources, and the frontend dataclasses' fields."""
    spec = importlib.util.find_spec("vllm")
    root = Path(next(iter(spec.submodule_search_locations or []))) if spec else None
    flags: set[str] = set()
    for path in [p for pattern in SOURCES for p in root.glob(pattern)] if root else []:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                flags.update([node.value] if LONG.fullmatch(node.value) else [])
            elif isinstance(node, ast.ClassDef) and node.name.endswith("FrontendArgs"):
                flags.update(
                    f"--{st.target.id.replace('_', '-')}"
                    for st in node.body
                    if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)
                )
    return frozenset(flags)


def _spellings(flag: str) -> set[str]:
    """The declared names a flag may come from: vLLM adds ``--no-x`` for a boolean ``--x``, and
    ``--enable-x`` and ``--disable-x`` for each other."""
    base = re.sub(r"^--(no-|enable-|disable-)", "--", flag)
    return {flag, base, base.replace("--", "--enable-", 1), base.replace("--", "--disable-", 1)}


def misspelled(flags: list[str]) -> str | None:
    """A message for the first long flag the installed vLLM's serve does not know, or None
    (also when its sources cannot be read: then ``vllm serve`` is the judge)."""
    known = serve_flags()
    if len(known) < 100:
        return None
    for flag in flags:
        if not LONG.fullmatch(flag) or _spellings(flag) & known:
            continue
        if sum(k.startswith(flag) for k in known) == 1:  # argparse takes a unique prefix
            continue
        close = difflib.get_close_matches(flag, known, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        return (
            f"{flag}: the installed vLLM's `vllm serve` has no such option{hint}; fix it "
            "after `--` (`vllm serve --help=all` lists them)"
        )
    return None
