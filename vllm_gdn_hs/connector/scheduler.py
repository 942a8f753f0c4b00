"""The connector's scheduler side: where each request's hidden states go, and when it ended.
``kv_transfer_params`` come from the network: a request they fail is served as usual, with
``hidden_states_error`` (the reason) in its response; nothing raises into ``schedule()``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

from vllm.v1.request import Request, RequestStatus

from vllm_gdn_hs.config import HiddenStatesConfig, request_params
from vllm_gdn_hs.connector.metadata import (
    FinishedRequest,
    HybridHiddenStatesConnectorMetadata,
    NewRequest,
)
from vllm_gdn_hs.names import init_logger
from vllm_gdn_hs.storage.base import RowShape
from vllm_gdn_hs.storage.registry import storage_for

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

logger = init_logger(__name__)

ABORTED = "the request was aborted before it finished (client gone, or the server stopping)"


class Placed(NamedTuple):
    """Where a request's hidden states go, decided at its first KV cache allocation."""

    path: str  # the storage's place for it
    rows: int  # rows to reserve: prompt, and outputs if included, at most max_model_len
    include_output_tokens: bool


class HybridHiddenStatesConnectorScheduler:
    def __init__(
        self,
        cfg: HiddenStatesConfig,
        layer_ids: list[int],
        max_model_len: int,
        hidden: int = 0,
        dtype: Any = None,
    ):
        self.cfg = cfg
        self.max_model_len = max_model_len
        self._placed: dict[str, Placed] = {}  # request id -> where its hidden states go
        self._refused: dict[str, str] = {}  # request id -> why it gets no hidden states
        self._finished: list[FinishedRequest] = []
        self.abort_reason = ABORTED
        # request id -> the params of vLLM's abort output (none of its own), until the next step
        self.aborted: dict[str, dict[str, Any]] = {}
        self.storage = storage_for(cfg)
        self.storage.open_scheduler_side(RowShape(layer_ids, hidden, dtype))

    @property
    def drain_s(self) -> float:
        return self.cfg.shutdown_drain_s

    def refuse(self, reason: str) -> None:
        self.abort_reason = reason

    def abort_params(self, request_id: str) -> dict[str, Any] | None:
        """An aborted request's response params, once (vLLM's abort output has none)."""
        return self.aborted.pop(request_id, None)

    def on_new_request(self, request: Request) -> None:
        """vLLM 0.33.0 reads the params as a dict itself: others are refused and dropped now."""
        if not isinstance(request.kv_transfer_params, dict | None):
            try:
                request_params(request.kv_transfer_params)
            except Exception as e:
                self._refuse(request.request_id, str(e))
            request.kv_transfer_params = None

    def on_allocated(self, request: Request) -> None:
        """A request got KV cache blocks (first allocation: its file is decided)."""
        if request.request_id in self._placed or request.request_id in self._refused:
            return  # not its first allocation
        try:
            params = request_params(request.kv_transfer_params)
            path = self.storage.place_for(request.request_id, params.hidden_states_path)
        except Exception as e:  # the client's input: refused for this request alone
            self._refuse(request.request_id, str(e))
            return
        outputs = request.max_tokens if params.include_output_tokens else 0
        rows = min(request.num_prompt_tokens + outputs, self.max_model_len)
        self._placed[request.request_id] = Placed(path, rows, params.include_output_tokens)

    def _refuse(self, req_id: str, why: str) -> None:
        self._refused[req_id] = why
        logger.warning("request %r: no hidden states: %s", req_id, why)

    def build_meta(self, scheduler_output: SchedulerOutput) -> HybridHiddenStatesConnectorMetadata:
        meta = HybridHiddenStatesConnectorMetadata(finished_requests=self._finished)
        self._finished = []
        self.aborted.clear()  # vLLM sends abort outputs right after finish_requests
        for new in scheduler_output.scheduled_new_reqs:
            if (placed := self._placed.get(new.req_id)) is not None:
                prompt = len(new.prompt_token_ids or ())
                meta.new_requests.append(NewRequest(new.req_id, placed.path, prompt, placed.rows))
        return meta

    def on_finished(self, request: Request) -> dict[str, Any] | None:
        """The response's ``kv_transfer_params``; the worker is told next step."""
        req_id = request.request_id
        placed = self._placed.pop(req_id, None)
        why = self._refused.pop(req_id, None)
        if request.status == RequestStatus.FINISHED_ABORTED:  # never a bare answer
            if placed is not None:
                self._finished.append(FinishedRequest(req_id, None))
            why = why or f"no hidden states: {self.abort_reason}"
            self.aborted[req_id] = {"hidden_states_error": why}
            return self.aborted[req_id]
        if why is not None:
            return {"hidden_states_error": why}
        if placed is None:
            return None
        # With the outputs, all but the last token: it was never run.
        outputs = placed.include_output_tokens
        ran = request.all_token_ids[:-1] if outputs else request.prompt_token_ids
        token_ids = list(ran or ())
        self._finished.append(FinishedRequest(req_id, token_ids))
        return self.storage.response(placed.path, len(token_ids), outputs)
