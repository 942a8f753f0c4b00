"""The connector's scheduler side: which file each request gets, and when it is finished.

Request ids and ``kv_transfer_params`` come from the network: the params are checked with
:func:`vllm_gdn_hs.config.request_params` and the path made with :mod:`vllm_gdn_hs.files`
before anything is opened. A request refused here is served as usual; its response's
``kv_transfer_params`` carry ``hidden_states_error`` (the reason) instead of a path. Nothing
here raises into vLLM's ``schedule()``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from vllm_gdn_hs import files
from vllm_gdn_hs.config import HiddenStatesConfig, request_params
from vllm_gdn_hs.connector.metadata import (
    FinishedRequest,
    HybridHiddenStatesConnectorMetadata,
    NewRequest,
)
from vllm_gdn_hs.names import CONNECTOR_NAME, init_logger

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)


class HybridHiddenStatesConnectorScheduler:
    def __init__(
        self,
        cfg: HiddenStatesConfig,
        layer_ids: list[int],
        max_model_len: int,
        hidden: int = 0,
        dtype=None,
    ):
        self.cfg = cfg
        self.storage_path = os.path.abspath(cfg.shared_storage_path)
        self.custom_root = os.path.abspath(cfg.custom_save_root or self.storage_path)
        self.max_model_len = max_model_len
        # request id -> (file, rows to reserve, include_output_tokens)
        self._paths: dict[str, tuple[str, int, bool]] = {}
        self._refused: dict[str, str] = {}  # request id -> why it gets no file
        self._finished: list[FinishedRequest] = []
        # -- storage seam: the mooncake backend names objects, not files --
        self.keys = None
        if cfg.mooncake is not None:
            from vllm_gdn_hs.connector.mooncake_store import KeyMaker

            self.keys, self.sample = KeyMaker(), (len(layer_ids), hidden, dtype)
            self.fp8 = cfg.fp8
            logger.info(
                "%s: layers %s -> Mooncake store at %s%s",
                CONNECTOR_NAME,
                layer_ids,
                cfg.mooncake.master_server_address,
                " (fp8)" if cfg.fp8 else "",
            )
            return
        if why := files.check_storage_path(self.storage_path):
            raise ValueError(
                f"{CONNECTOR_NAME}: shared_storage_path {self.storage_path!r} is not "
                f"writable ({why}); pass a writable folder: --hidden-states-path DIR to the "
                'launcher, or "shared_storage_path" in --kv-transfer-config\'s '
                "kv_connector_extra_config"
            )
        logger.info("%s: layers %s -> %s", CONNECTOR_NAME, layer_ids, self.storage_path)
        if cfg.allow_custom_save_path:
            logger.warning(
                "%s: allow_custom_save_path is on: any client may choose where its file is "
                "written, anywhere under %s (custom_save_root)",
                CONNECTOR_NAME,
                self.custom_root,
            )

    def on_new_request(self, request: Request) -> None:
        """A request arrived (vLLM 0.33.0 says so, then reads its params as a dict itself):
        params that are not an object are refused now and dropped, so that vLLM's own reading
        cannot fail on them."""
        params = request.kv_transfer_params
        if params is not None and not isinstance(params, dict):
            try:
                request_params(params)
            except Exception as e:
                self._refuse(request.request_id, str(e))
            request.kv_transfer_params = None

    def on_allocated(self, request: Request) -> None:
        """A request got KV cache blocks (first allocation: its file is decided)."""
        if request.request_id in self._paths or request.request_id in self._refused:
            return  # not its first allocation
        try:
            params = request_params(request.kv_transfer_params)
            path = self._path_for(request.request_id, params.hidden_states_path)
        except Exception as e:  # the client's input: refused for this request alone
            self._refuse(request.request_id, str(e))
            return
        outputs = request.max_tokens if params.include_output_tokens else 0
        rows = min(request.num_prompt_tokens + outputs, self.max_model_len)
        self._paths[request.request_id] = (path, rows, params.include_output_tokens)

    def _refuse(self, req_id: str, why: str) -> None:
        self._refused[req_id] = why
        logger.warning("%s: request %r: no hidden states: %s", CONNECTOR_NAME, req_id, why)

    def _path_for(self, req_id: str, custom: str | None) -> str:
        if self.keys is not None:  # the mooncake backend: the object's key, never taken
            if custom is not None:
                logger.warning(
                    "%s: request %r: hidden_states_path ignored (the mooncake backend)",
                    CONNECTOR_NAME,
                    req_id,
                )
            return self.keys.key(req_id)
        if custom is not None and self.cfg.allow_custom_save_path:
            path = files.custom_path(custom, self.custom_root)
        else:
            if custom is not None:  # the response names the file's real path
                logger.warning(
                    "%s: request %r: hidden_states_path ignored (allow_custom_save_path is off)",
                    CONNECTOR_NAME,
                    req_id,
                )
            path = files.request_path(self.storage_path, req_id)
        if os.path.lexists(path) or os.path.lexists(path + files.LOCK_SUFFIX):
            # An earlier request with the same id whose file nobody has read yet: writing
            # again would cost that request its file.
            raise ValueError(
                f"{path} already exists and has not been read; send a new request id, or move "
                "the earlier file away"
            )
        return path

    def build_meta(self, scheduler_output: SchedulerOutput) -> HybridHiddenStatesConnectorMetadata:
        meta = HybridHiddenStatesConnectorMetadata(finished_requests=self._finished)
        self._finished = []
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id not in self._paths:
                continue
            path, rows, _ = self._paths[new.req_id]
            meta.new_requests.append(
                NewRequest(new.req_id, path, len(new.prompt_token_ids or ()), rows)
            )
        return meta

    def on_finished(self, request: Request) -> dict[str, Any] | None:
        """The response's ``kv_transfer_params``; the worker is told next step."""
        from vllm.v1.request import RequestStatus

        if (why := self._refused.pop(request.request_id, None)) is not None:
            return {"hidden_states_error": why}
        path, _, include_output_tokens = self._paths.pop(request.request_id, (None, 0, False))
        if path is None:
            return None
        if request.status == RequestStatus.FINISHED_ABORTED:
            self._finished.append(FinishedRequest(request.request_id, None))
            return None
        if include_output_tokens:
            token_ids = list(request.all_token_ids[:-1])  # the last one was never run
        else:
            token_ids = list(request.prompt_token_ids or ())
        self._finished.append(FinishedRequest(request.request_id, token_ids))
        if self.keys is not None:  # hs-connectors' v1 manifest; path is the key
            from vllm_gdn_hs.connector.mooncake_store import manifest

            return manifest(path, len(token_ids), *self.sample, include_output_tokens, fp8=self.fp8)
        return {"hidden_states_path": path}
