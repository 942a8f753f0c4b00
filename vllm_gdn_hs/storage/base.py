"""A storage backend: the scheduler side names each request's place and answers with it; the
worker side reserves it, then stores the rows there or gives it up (``abandon``, at any time)."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from pydantic import BaseModel

if TYPE_CHECKING:
    import torch


class StorageConfig(Protocol):
    """What a backend reads of the connector's options (``config.HiddenStatesConfig``)."""

    shared_storage_path: str
    custom_save_root: str | None
    allow_custom_save_path: bool
    use_synchronization_lock: bool
    fp8: bool


class StorageOptions(BaseModel):
    """The base of a backend's own options (a field of the connector's config)."""

    def check_config(self, cfg: Any) -> None:
        """Check or settle the connector's other options (``cfg``) as this backend needs them."""


@dataclass
class StoredRequest:
    """One request's place in a backend."""

    req_id: str
    path: str  # the file (file backend), or the object's key
    handle: Any = None  # the backend's own: the file backend's lock descriptor
    state: str = "open"  # open -> writing -> done; abandoned at any point
    mutex: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def begin_write(self) -> None:
        with self.mutex:
            if self.state != "open":
                raise RuntimeError(f"its place was given up ({self.state})")
            self.state = "writing"


@dataclass(frozen=True)
class RowShape:  # what the scheduler side knows of every request's rows
    layer_ids: list[int]
    hidden: int = 0
    dtype: Any = None  # torch.dtype; None where no backend needs it


class HiddenStatesStorage(ABC):
    unit: ClassVar[str] = "files"  # what one request's hidden states are called in log lines
    # The config field whose options pick this backend (``storage.registry``); None: the default.
    options_field: ClassVar[str | None] = None

    def __init__(self, cfg: StorageConfig):
        self.cfg = cfg

    # -- scheduler side ---------------------------------------------------------------
    def open_scheduler_side(self, shape: RowShape) -> None:  # noqa: B027 - optional
        """Check the storage before the first request (raise to refuse the startup)."""

    @abstractmethod
    def place_for(self, req_id: str, custom: str | None) -> str:
        """The request's place (``custom``: the client's ``hidden_states_path``); ValueError
        refuses this request alone."""

    @abstractmethod
    def response(self, place: str, num_tokens: int, include_output_tokens: bool) -> dict:
        """The finished request's ``kv_transfer_params``: where its reader finds it."""

    # -- worker side ------------------------------------------------------------------
    def open_worker_side(self) -> None:  # noqa: B027 - optional
        """Connect before the first request (raise to refuse the startup)."""

    def start(self, req_id: str, place: str) -> StoredRequest:
        """Reserve the request's place; raises if it cannot (that request alone loses out)."""
        return StoredRequest(req_id, place)

    @abstractmethod
    def write(
        self,
        request: StoredRequest,
        hidden_states: torch.Tensor,
        token_ids: torch.Tensor,
        scales: torch.Tensor | None,
    ) -> None:
        """Store [T, L, H] rows, [T] int64 token ids and, for fp8, [T, 1, 1] scales."""

    @abstractmethod
    def abandon(self, request: StoredRequest, why: str = "") -> None:
        """Give the place up, so its reader fails at once (``why``: told to it; empty: aborted)."""

    def begin_close(self) -> None:  # noqa: B027 - optional
        """Shutdown has started: writes that wait on the backend should give up soon."""

    def close(self, deadline: float | None = None) -> None:  # noqa: B027 - optional
        """Once every request was written or abandoned; done by ``deadline`` (monotonic)."""
