"""The ``vllm serve`` arguments that pass through the launcher: read as vLLM reads them
(``--a_b.c=x`` is ``--a-b`` with key ``c``; the last use wins), refused where they contradict
hidden-state extraction, and completed with the flags extraction needs."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import sys
from typing import Any

from vllm_gdn_hs.cli import vllm_flags
from vllm_gdn_hs.cli.model_info import ModelInfo
from vllm_gdn_hs.config import TEARDOWN_S, shutdown_window
from vllm_gdn_hs.names import CONNECTOR_NAME
from vllm_gdn_hs.version import engine_wait_from_env


class LaunchError(ValueError):
    """Bad launcher input; the message tells the user what to change."""


def _flag(arg: str) -> tuple[str, str | None] | None:
    """``--kv_transfer_config.kv_role=x`` -> ``("--kv-transfer-config", "x")``, as vLLM reads it."""
    if not arg.startswith("-") or arg == "--":
        return None
    key, eq, value = arg.partition("=")
    if key.startswith("--"):
        key = "--" + key[2:].split(".", 1)[0].replace("_", "-")
    return key, (value if eq else None)


def _last_value(args: list[str], names: set[str]) -> tuple[str, str | None] | None:
    """The last use of a flag in ``names`` and its value (after ``=`` or the next argument)."""
    found = None
    for arg, following in zip(args, [*args[1:], None], strict=False):
        if (parsed := _flag(arg)) and parsed[0] in names:
            found = (parsed[0], following if parsed[1] is None else parsed[1])
    return found


def _bool_flag(args: list[str], name: str) -> bool | None:
    """What ``--name`` / ``--no-name`` leave set (the last one wins); None if not given."""
    state = None
    for flag, value in filter(None, map(_flag, args)):
        if flag == f"--{name}":
            state = value is None or value.lower() not in {"false", "0", "no", "off"}
        elif flag == f"--no-{name}":
            state = False
    return state


def take_kv_transfer_config(vllm_args: list[str]) -> tuple[list[str], dict]:
    """The vLLM arguments without ``--kv-transfer-config``, and its settings (JSON objects and
    vLLM's dotted keys, merged in order)."""
    rest: list[str] = []
    user: dict[str, Any] = {}
    args = iter(vllm_args)
    for arg in args:
        parsed = _flag(arg)
        if not parsed or parsed[0] != "--kv-transfer-config":
            rest.append(arg)
            continue
        value = parsed[1] if parsed[1] is not None else next(args, None)
        if value is None:
            raise LaunchError("--kv-transfer-config needs a value")
        keys = arg.partition("=")[0].split(".")[1:]
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            if not keys:
                raise LaunchError(
                    f"--kv-transfer-config {value!r} is not JSON: pass an object such as "
                    '\'{"kv_connector_extra_config": {"write_workers": 8}}\''
                ) from None
        if keys:
            node = user
            for key in keys[:-1]:
                if not isinstance(node.get(key), dict):
                    node[key] = {}
                node = node[key]
            node[keys[-1]] = value
        elif isinstance(value, dict):
            for key, v in value.items():
                both = isinstance(v, dict) and isinstance(user.get(key), dict)
                user[key] = {**user[key], **v} if both else v
        else:
            raise LaunchError(f"--kv-transfer-config {value!r}: pass a JSON object")
    return rest, user


def check_vllm_args(vllm_args: list[str], info: ModelInfo) -> None:
    if typo := vllm_flags.misspelled([parsed[0] for parsed in filter(None, map(_flag, vllm_args))]):
        raise LaunchError(typo)
    if used := _last_value(vllm_args, {"--speculative-config", "-sc"}):
        raise LaunchError(
            f"{used[0]} is set by the launcher for hidden-state extraction; drop it from "
            "the vLLM arguments and use --target-layer-ids/--include-last-layer instead"
        )
    if _bool_flag(vllm_args, "enable-prefix-caching"):
        raise LaunchError(
            f"--enable-prefix-caching: {CONNECTOR_NAME} needs prefix caching off (a cached "
            "prefix is not run through the model, so its hidden states would be missing); "
            "drop the flag, the launcher passes --no-enable-prefix-caching"
        )
    if info.is_hybrid and _bool_flag(vllm_args, "disable-hybrid-kv-cache-manager"):
        raise LaunchError(
            f"--disable-hybrid-kv-cache-manager: {info.path} is a hybrid (GDN) model and "
            f"{CONNECTOR_NAME} works with vLLM's hybrid KV cache manager on; drop the flag"
        )
    pp = _last_value(vllm_args, {"--pipeline-parallel-size", "-pp"})
    if pp and pp[1] is not None and pp[1].isdigit() and int(pp[1]) > 1:
        raise LaunchError(
            f"{pp[0]} {pp[1]}: pipeline parallelism is not supported for hidden-state "
            "extraction (each stage holds only some layers); use --tensor-parallel-size "
            "or --data-parallel-size instead"
        )


def extra_vllm_args(vllm_args: list[str], info: ModelInfo) -> list[str]:
    """The flags we add, each only when the user did not pass it (either way)."""
    extra = []
    if _bool_flag(vllm_args, "enable-prefix-caching") is None:
        extra.append("--no-enable-prefix-caching")
    if info.multimodal and _bool_flag(vllm_args, "language-model-only") is None:
        extra.append("--language-model-only")
    if info.is_hybrid and not _has_flashinfer():
        # vLLM's default GDN prefill kernel on Hopper comes from flashinfer.
        user = _last_value(vllm_args, {"--additional-config"})
        if not user:
            extra += ["--additional-config", json.dumps({"gdn_prefill_backend": "triton"})]
        elif "gdn_prefill_backend" not in (user[1] or ""):  # the user's JSON wins, as is
            warn(
                f"flashinfer is not installed and {user[0]} {user[1]} does not set "
                'gdn_prefill_backend: add "gdn_prefill_backend": "triton" to it, or vLLM '
                "may pick the flashinfer GDN prefill kernel and fail at startup."
            )
    return extra


def _has_flashinfer() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


# vLLM's API server SIGKILLs its engine cores soon after SIGTERM (0.33.0 on: at once) unless
# told to wait: the launcher says shutdown_window() here too (patch/shutdown.py).
SHUTDOWN_ENV = "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS"


def shutdown_env(drain_s: float, environ=None) -> dict[str, str]:
    """``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS``, unless set (then a warning if too short)."""
    window = shutdown_window(drain_s)
    environ = os.environ if environ is None else environ  # now, not at import
    if SHUTDOWN_ENV not in environ:
        return {SHUTDOWN_ENV: str(window)}
    _warn_if_short(f"{SHUTDOWN_ENV}={environ[SHUTDOWN_ENV]}", environ[SHUTDOWN_ENV], window)
    return {}


def shutdown_args(vllm_args: list[str], drain_s: float) -> list[str]:
    """``--shutdown-timeout`` where vLLM ignores the variable (0.20.1), unless passed (then a
    warning if too short)."""
    window = shutdown_window(drain_s)
    user = _last_value(vllm_args, {"--shutdown-timeout"})
    if user is not None:
        if user[1] != "0":
            _warn_if_short(f"{user[0]} {user[1]}", user[1], window)
        return []
    return [] if engine_wait_from_env() else ["--shutdown-timeout", str(window)]


def _warn_if_short(what: str, value: str | None, window: int) -> None:
    with contextlib.suppress(TypeError, ValueError):
        if value is not None and float(value) >= window:  # seconds
            return
    warn(
        f"{what} may stop vLLM's engine core before the hidden-state files of answered "
        f"requests are written: it needs {window} s (shutdown_drain_s plus {TEARDOWN_S} s of "
        "teardown); files not written lose their lock."
    )


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)
