"""Whether vLLM's class for a model implements ``SupportsEagle3`` (returns aux hidden states),
decided before anything loads: the class vLLM's model registry names, and its bases, are read
with ``ast`` from vLLM's sources, never imported (seconds a module). An architecture not in the
registry is let through; the runner patch checks the loaded model again.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import os

AUX_INTERFACE = "SupportsEagle3"
_REGISTRY_TABLES = ("_TEXT_GENERATION_MODELS", "_MULTIMODAL_MODELS")
_MODELS_PACKAGE = "vllm.model_executor.models"


@functools.lru_cache(maxsize=64)
def _source(module: str) -> str | None:
    """The file of one of vLLM's modules; None if it is not vLLM's or not there."""
    spec = importlib.util.find_spec("vllm")  # the top package only: nothing of vLLM runs
    if spec is None or spec.origin is None or not module.startswith("vllm."):
        return None
    base = os.path.join(os.path.dirname(spec.origin), *module.split(".")[1:])
    paths = (base + ".py", os.path.join(base, "__init__.py"))
    return next((path for path in paths if os.path.isfile(path)), None)


@functools.lru_cache(maxsize=64)
def _parse(module: str) -> ast.Module | None:
    if (path := _source(module)) is None:
        return None
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read(), path)


def _resolve(module: str, relative: str | None, level: int) -> str:
    """The absolute module of ``from <level dots><relative> import ...`` inside ``module``."""
    if not level:
        return relative or ""
    is_package = (_source(module) or "").endswith("__init__.py")  # a module's dot: its package
    package = module if is_package else module.rpartition(".")[0]
    return importlib.util.resolve_name("." * level + (relative or ""), package)


@functools.lru_cache(maxsize=1)
def registered_classes() -> dict[str, tuple[str, str]]:
    """Architecture -> (module, class) of vLLM's text-generation and multimodal models."""
    tree = _parse(f"{_MODELS_PACKAGE}.registry")
    found: dict[str, tuple[str, str]] = {}
    for node in tree.body if tree else ():
        if not (isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(node.value, ast.Dict)):
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        if not any(isinstance(t, ast.Name) and t.id in _REGISTRY_TABLES for t in targets):
            continue
        for key, value in zip(node.value.keys, node.value.values, strict=True):
            try:  # a ``**other`` entry has no key
                arch, (module, cls) = ast.literal_eval(key or ""), ast.literal_eval(value)
            except (ValueError, TypeError, SyntaxError):
                continue
            if not module.startswith("vllm."):
                module = f"{_MODELS_PACKAGE}.{module}"
            found[arch] = (module, cls)
    return found


def _bindings(nodes):
    """Statements, those inside ``if``/``try`` blocks included, in order."""
    for node in nodes:
        if isinstance(node, ast.If | ast.Try | ast.ExceptHandler):
            yield from _bindings(
                [*node.body, *getattr(node, "handlers", ()), *getattr(node, "orelse", ())]
            )
        else:
            yield node


def _base_name(expr: ast.expr) -> str | None:
    if isinstance(expr, ast.Subscript):  # Generic[...] and the like
        expr = expr.value
    if isinstance(expr, ast.Name):
        return expr.id
    if isinstance(expr, ast.Attribute):
        return expr.attr
    return None


def _has_interface(module: str, name: str, seen: set[tuple[str, str]]) -> bool | None:
    """Whether ``name`` in ``module`` derives from SupportsEagle3 (None: a module is unread)."""
    if name == AUX_INTERFACE:
        return True
    if (module, name) in seen:
        return False
    seen.add((module, name))
    if not module.startswith("vllm."):
        return False  # torch's, typing's: SupportsEagle3 is vLLM's
    tree = _parse(module)
    if tree is None:
        return None
    for node in _bindings(tree.body):  # the first binding wins (the CUDA branch in vllm.models.*)
        if isinstance(node, ast.ClassDef) and node.name == name:
            answers = [
                _has_interface(module, base, seen)
                for base in filter(None, map(_base_name, node.bases))
            ]
            return True if True in answers else (None if None in answers else False)
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    source = _resolve(module, node.module, node.level)
                    return _has_interface(source, alias.name, seen)
    return False  # a name bound some other way (object, nn.Module, a Protocol of typing)


def has_aux_outputs(architecture: str) -> bool | None:
    """True or False for an architecture in vLLM's registry; None where that cannot be decided."""
    entry = registered_classes().get(architecture)
    return None if entry is None else _has_interface(*entry, set())


def aux_outputs_problem(architectures) -> str | None:
    """Why an architecture's vLLM class gives no aux hidden states, naming the fix; or None."""
    for arch in architectures or ():
        if has_aux_outputs(arch) is False:
            module, cls = registered_classes()[arch]
            return (
                f"{arch} cannot be extracted from: vLLM's {cls} ({module}) returns no auxiliary "
                f"hidden states (it does not implement {AUX_INTERFACE}), so no layer can be "
                "taken out of it. Extract from a model vLLM serves with them (Qwen3.5/3.6, "
                "Qwen3.5-MoE, Qwen3-Next, Nemotron-H, most dense models; docs/options.md, "
                "'Supported models'), or add EagleModelMixin to that class in vLLM"
            )
    return None
