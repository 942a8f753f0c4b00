"""The drain at SIGINT/SIGTERM in vLLM's engine core and API server (patch/shutdown.py); CPU.

Run: python -m pytest tests/test_shutdown_drain.py -q (no GPU, no network).
vLLM's real VllmConfig, Scheduler and EngineCoreProc methods (``_handle_shutdown``,
``_send_abort_outputs``, ``_reject_add_in_shutdown``) on an engine core built without its
``__init__`` (which would start a GPU executor): the window the plugin gives vLLM's drain
mode, running requests finishing within it, what still runs at its end aborted with
``hidden_states_error`` in the output's ``kv_transfer_params``, a new request refused the
same way (and with HTTP 503 by the API server's AsyncLLM where the release can), a second
signal logged while the drain goes on.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import time

import harness
import pytest
from test_connector_scheduler import make_request, make_scheduler, prompt, step
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.core import EngineCoreProc, EngineShutdownState
from vllm.v1.request import RequestStatus

from vllm_gdn_hs import config
from vllm_gdn_hs.patch import shutdown


def engine_core(sched) -> EngineCoreProc:
    """vLLM's EngineCoreProc with its scheduler, without the executor its __init__ starts."""
    engine = object.__new__(EngineCoreProc)
    engine.scheduler, engine.vllm_config = sched, sched.vllm_config
    engine.output_queue, engine.batch_queue = queue.Queue(), None
    engine.engines_running, engine.shutdown_state = False, EngineShutdownState.RUNNING
    return engine


def sent(engine) -> dict[str, tuple[str, dict | None]]:
    """What the engine core sent its clients: request id -> (finish reason, kv params)."""
    out = {}
    while not engine.output_queue.empty():
        _, eco = engine.output_queue.get_nowait()
        for o in eco.outputs:
            out[o.request_id] = (str(o.finish_reason), o.kv_transfer_params)
    return out


def test_the_plugin_gives_vllm_drain_mode_its_window(hybrid_model, tmp_path):
    """vLLM's default --shutdown-timeout 0 (abort at once) becomes the drain's window."""
    args = harness.engine_args(hybrid_model, storage=str(tmp_path))
    args.kv_transfer_config["kv_connector_extra_config"]["shutdown_drain_s"] = 45
    assert args.create_engine_config().shutdown_timeout == config.shutdown_window(45) == 120
    args.shutdown_timeout = 60  # the user's, kept (with a warning)
    assert args.create_engine_config().shutdown_timeout == 60
    other = harness.engine_args(hybrid_model, connector=None, layer_ids=None)
    assert other.create_engine_config().shutdown_timeout == 0  # vLLM's own default


def test_an_aborted_request_says_why_in_its_kv_transfer_params(hybrid_model, tmp_path):
    """vLLM's abort mode (finish_requests, then _send_abort_outputs): each output carries
    hidden_states_error, never a bare answer without a path."""
    sched = make_scheduler(hybrid_model, str(tmp_path))
    engine = engine_core(sched)
    sched.add_request(make_request("running", prompt(10), max_tokens=8))
    step(sched)
    sched.add_request(make_request("waiting", prompt(10, 7), max_tokens=8))
    aborted = sched.finish_requests(None, RequestStatus.FINISHED_ABORTED)
    engine._send_abort_outputs(aborted)
    out = sent(engine)
    assert set(out) == {"running", "waiting"}
    for reason, params in out.values():
        assert reason == "abort" and "aborted" in params["hidden_states_error"], out


def test_running_requests_finish_then_the_rest_are_aborted_with_the_reason(
    hybrid_model, tmp_path, caplog
):
    caplog.set_level(logging.INFO, logger=shutdown.logger.name)
    sched = make_scheduler(hybrid_model, str(tmp_path), shutdown_drain_s=0.3)
    engine = engine_core(sched)
    sched.add_request(make_request("short", prompt(10), max_tokens=2))
    sched.add_request(make_request("long", prompt(10, 5), max_tokens=1000))
    step(sched)
    engine.shutdown_state = EngineShutdownState.REQUESTED  # vLLM's signal handler
    assert engine._handle_shutdown()  # drain: keep stepping
    assert "draining: 2 requests running may finish within 0.3 s" in caplog.text
    _, finished = step(sched)  # "short" finishes within the drain, with its file
    assert finished["short"].kv_transfer_params["hidden_states_path"]
    engine.shutdown_state = EngineShutdownState.REQUESTED  # a second signal
    assert engine._handle_shutdown()
    assert "another signal during the drain: the drain goes on" in caplog.text
    time.sleep(0.35)
    assert engine._handle_shutdown()  # "long" aborted at the deadline
    ((reason, params),) = sent(engine).values()
    assert reason == "abort" and "did not finish within 0.3 s" in params["hidden_states_error"]
    sched.schedule()  # the busy loop's next step
    assert not engine._handle_shutdown()  # nothing left: teardown


def test_a_request_arriving_during_the_drain_is_refused_with_the_reason(hybrid_model, tmp_path):
    engine = engine_core(make_scheduler(hybrid_model, str(tmp_path)))
    engine.shutdown_state = EngineShutdownState.SHUTTING_DOWN
    assert engine._reject_add_in_shutdown(make_request("late", prompt(10)))
    assert sent(engine) == {"late": ("abort", {"hidden_states_error": shutdown.REFUSED})}


def test_the_api_server_refuses_new_requests_with_503_once_it_stops(hybrid_model, tmp_path):
    if shutdown.GracefulHTTPError is None:
        pytest.skip("this vLLM has no GracefulHTTPError: the engine core refuses instead")
    llm = object.__new__(AsyncLLM)
    llm.vllm_config = make_scheduler(hybrid_model, str(tmp_path)).vllm_config
    llm.shutdown(timeout=0)  # the API server's first step at SIGINT/SIGTERM
    with pytest.raises(shutdown.GracefulHTTPError) as err:
        asyncio.run(llm.add_request("late", "a prompt", None))
    assert err.value.http_status == 503 and shutdown.REFUSED in err.value.message
