"""SIGINT/SIGTERM drain what is in flight, in a bounded window, and no answer is silent.

Why: with vLLM's default ``--shutdown-timeout 0`` the engine core aborts every running request
at the first signal (their responses carry no ``kv_transfer_params``) and vLLM's process
manager gives it 0 s (0.33.0 on) or 5 s (before) to write the files already queued.

How, only for our connector, through vLLM's own drain mode (``shutdown_timeout`` > 0: the
engine core steps until nothing runs, refuses new requests, and is killed
``shutdown_timeout`` s after the signal; in every supported release):

- :func:`set_window` (from ``VllmConfig.__post_init__``, in the API server): a
  ``shutdown_timeout`` of 0 becomes :func:`vllm_gdn_hs.config.shutdown_window`.
- ``EngineCoreProc._handle_shutdown``: running requests get ``shutdown_drain_s`` (less if
  ``shutdown_timeout`` is short) to finish, then are aborted as vLLM's abort mode does; the
  files get ``shutdown_drain_s``; a second signal is logged and the drain goes on.
- ``EngineCoreProc._send_abort_outputs_to_client``: an aborted or refused request's output
  carries ``hidden_states_error`` (vLLM's carries no ``kv_transfer_params``).
- ``EngineCoreProc.shutdown``: SIGINT/SIGTERM are logged, not acted on, during the teardown
  (vLLM puts the default handlers back before it, so a signal would kill the writes).
- ``AsyncLLM.add_request``: once the API server stops, new requests get HTTP 503 (vLLM's
  ``GracefulHTTPError``, where the release has it; before, the engine core refuses them).

Not a twin of a source patch in ``patches/``: extraction runs without it.
"""

from __future__ import annotations

import time
from http import HTTPStatus

from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.core import EngineCoreProc, EngineShutdownState
from vllm.v1.request import RequestStatus

from vllm_gdn_hs.config import TEARDOWN_S, config_from, is_ours, shutdown_window
from vllm_gdn_hs.hook import DrainsAtShutdown, HasShutdownDrain
from vllm_gdn_hs.names import CONNECTOR_NAME, init_logger
from vllm_gdn_hs.patch import Patch, require

try:  # vLLM 0.33.0 on: an error the API server answers with its own HTTP status
    from vllm.exceptions import GracefulHTTPError
except ImportError:
    GracefulHTTPError = None

logger = init_logger(__name__)
require(EngineCoreProc, "_handle_shutdown", "_send_abort_outputs", "_send_abort_outputs_to_client")
require(EngineCoreOutput, "kv_transfer_params")

_orig_handle_shutdown = EngineCoreProc._handle_shutdown
_orig_send_abort = EngineCoreProc._send_abort_outputs_to_client
_orig_engine_shutdown = EngineCoreProc.shutdown
_orig_add_request = AsyncLLM.add_request
_orig_llm_shutdown = AsyncLLM.shutdown

REFUSED = "the server is shutting down; send the request to another server"


def set_window(vllm_config) -> None:
    """Give the engine core the time the drain needs (``--shutdown-timeout``)."""
    drain_s = config_from(vllm_config).shutdown_drain_s
    window = shutdown_window(drain_s)
    if vllm_config.shutdown_timeout == 0:
        vllm_config.shutdown_timeout = window
    elif vllm_config.shutdown_timeout < window:
        logger.warning(
            "--shutdown-timeout %d is shorter than the %d s the drain needs "
            "(2 x shutdown_drain_s %g + %d s of teardown): running requests are aborted "
            "sooner, and files not written by then lose their lock. Pass --shutdown-timeout %d",
            vllm_config.shutdown_timeout,
            window,
            drain_s,
            TEARDOWN_S,
            window,
        )


def _ours(engine) -> DrainsAtShutdown | None:
    """The connector's scheduler side in this engine core, or None."""
    if not is_ours(engine.vllm_config.kv_transfer_config):
        return None
    connector = getattr(engine.scheduler, "connector", None)
    return connector.shutdown_drain() if isinstance(connector, HasShutdownDrain) else None


def _handle_shutdown(self) -> bool:
    side = _ours(self)
    if side is None or self.shutdown_state == EngineShutdownState.RUNNING:
        return _orig_handle_shutdown(self)
    if self.shutdown_state == EngineShutdownState.REQUESTED:
        _on_signal(self, side)
    deadline = getattr(self, "_vllm_gdn_hs_deadline", 0.0)
    if time.monotonic() >= deadline and self.scheduler.has_unfinished_requests():
        reason = (
            f"the server is shutting down and the request did not finish within "
            f"{side.drain_s:g} s (shutdown_drain_s)"
        )
        side.refuse(reason)
        aborted = self.scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)
        logger.warning("%d aborted: %s", len(aborted), reason)
        self._send_abort_outputs(aborted)
    return _orig_handle_shutdown(self)


def _on_signal(self, side: DrainsAtShutdown) -> None:
    now, timeout = time.monotonic(), self.vllm_config.shutdown_timeout
    if getattr(self, "_vllm_gdn_hs_start", None) is not None:
        logger.warning(
            "another signal during the drain: the drain goes on (%.0f s left at most); "
            "SIGKILL stops it, then `vllm-gdn-hs check` lists the incomplete files",
            self._vllm_gdn_hs_start + timeout - now,
        )
        return
    drain_s = side.drain_s
    requests_s = min(drain_s, max(timeout - drain_s - TEARDOWN_S, 0))
    self._vllm_gdn_hs_start, self._vllm_gdn_hs_deadline = now, now + requests_s
    side.refuse("the server is shutting down")
    logger.info(
        "draining: %d requests running may finish within %g s, then their files are "
        "written within %g s (shutdown_drain_s); the engine exits within %d s "
        "(--shutdown-timeout); new requests are refused",
        self.scheduler.get_num_unfinished_requests(),
        requests_s,
        drain_s,
        timeout,
    )


def _send_abort_outputs_to_client(self, req_ids: list[str], client_index: int) -> None:
    if (side := _ours(self)) is None:
        return _orig_send_abort(self, req_ids, client_index)
    outputs = [  # vLLM's abort output, with the response's kv_transfer_params
        EngineCoreOutput(
            r,
            [],
            finish_reason=FinishReason.ABORT,
            kv_transfer_params=side.abort_params(r) or {"hidden_states_error": REFUSED},
        )
        for r in req_ids
    ]
    self.output_queue.put_nowait(
        (client_index, EngineCoreOutputs(finished_requests=set(req_ids), outputs=outputs))
    )


def _engine_shutdown(self) -> None:
    from vllm_gdn_hs.connector.worker import signals_logged

    if _ours(self) is None:
        return _orig_engine_shutdown(self)
    with signals_logged(self.vllm_config.shutdown_timeout):
        return _orig_engine_shutdown(self)


async def add_request(self, request_id, *args, **kwargs):
    if getattr(self, "_vllm_gdn_hs_stopping", False) and GracefulHTTPError is not None:
        raise GracefulHTTPError(f"{CONNECTOR_NAME}: {REFUSED}", HTTPStatus.SERVICE_UNAVAILABLE)
    return await _orig_add_request(self, request_id, *args, **kwargs)


def llm_shutdown(self, *args, **kwargs):
    if is_ours(self.vllm_config.kv_transfer_config):
        self._vllm_gdn_hs_stopping = True  # before the engine core is told to drain
    return _orig_llm_shutdown(self, *args, **kwargs)


PATCHES = (
    Patch(
        EngineCoreProc,
        {
            "_handle_shutdown": _handle_shutdown,
            "_send_abort_outputs_to_client": _send_abort_outputs_to_client,
            "shutdown": _engine_shutdown,
        },
    ),
    Patch(AsyncLLM, {"add_request": add_request, "shutdown": llm_shutdown}),
)
