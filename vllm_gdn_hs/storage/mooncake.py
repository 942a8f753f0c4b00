"""The mooncake backend: each request's rows as one object in a Mooncake store, read by
hs-connectors' ``MooncakeTransfer`` (no lock: the reader waits for the object or its error
object). Puts go through this server's client (:mod:`.mooncake_client`)."""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING

from vllm_gdn_hs.files import MAX_STEM
from vllm_gdn_hs.names import init_logger
from vllm_gdn_hs.storage.base import HiddenStatesStorage, RowShape, StorageConfig, StoredRequest
from vllm_gdn_hs.storage.mooncake_client import MooncakeStore, manifest
from vllm_gdn_hs.storage.mooncake_options import MooncakeOptions

if TYPE_CHECKING:
    import torch

logger = init_logger(__name__)


class MooncakeStorage(HiddenStatesStorage):
    unit = "objects"
    options_field = "mooncake"

    def __init__(self, cfg: StorageConfig):
        super().__init__(cfg)
        self.options: MooncakeOptions = getattr(cfg, self.options_field)
        self.tag, self.count = secrets.token_hex(6), 0  # in place_for's keys
        self.shape = RowShape([])
        self.store: MooncakeStore | None = None

    def open_scheduler_side(self, shape: RowShape) -> None:
        self.shape = shape
        logger.info(
            "layers %s -> Mooncake store at %s%s",
            shape.layer_ids,
            self.options.master_server_address,
            " (fp8)" if self.cfg.fp8 else "",
        )

    def place_for(self, req_id: str, custom: str | None) -> str:
        """The key: ``sanitize_key(req_id)`` (cut to ``MAX_STEM``), ``-`` and a tag unique across
        engines and restarts (random, then a counter), as ``sanitize_key`` maps many ids to one."""
        # hs-connectors' own function; its module imports vLLM, so only here, on use.
        from hs_connectors.mooncake_hidden_states_connector import sanitize_key

        if custom is not None:
            logger.warning("request %r: hidden_states_path ignored (the mooncake backend)", req_id)
        self.count += 1
        return f"{sanitize_key(req_id)[:MAX_STEM]}-{self.tag}{self.count:x}"

    def response(self, place: str, num_tokens: int, include_output_tokens: bool) -> dict:
        """hs-connectors' v1 manifest; ``place`` is the key."""
        s = self.shape
        return manifest(
            place, num_tokens, len(s.layer_ids), s.hidden, s.dtype, include_output_tokens,
            fp8=self.cfg.fp8,
        )  # fmt: skip

    def open_worker_side(self) -> None:
        self.store = MooncakeStore(self.options)

    def _client(self) -> MooncakeStore:
        if self.store is None:
            raise RuntimeError("the Mooncake storage's worker side is not open")
        return self.store

    def write(
        self,
        request: StoredRequest,
        hidden_states: torch.Tensor,
        token_ids: torch.Tensor,
        scales: torch.Tensor | None,
    ) -> None:
        request.begin_write()
        try:
            self._client().write(request.path, hidden_states, token_ids, scales)
        except BaseException as e:
            self._client().write_error(request.path, str(e))
            raise
        finally:
            with request.mutex:
                request.state = "done" if request.state == "writing" else request.state

    def abandon(self, request: StoredRequest, why: str = "") -> None:
        with request.mutex:
            was, request.state = request.state, "abandoned"
        # A put under way ends either way: its object, or its error object.
        if was == "open" and why:
            self._client().write_error(request.path, why)

    def begin_close(self) -> None:
        self._client().begin_close()

    def close(self, deadline: float | None = None) -> None:
        self._client().close(readers_until=deadline)
