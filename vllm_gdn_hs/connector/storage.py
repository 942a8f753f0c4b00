"""Where a request's hidden states go: a small interface and its two backends.

A request's lifecycle on the worker side, through its backend:

- :meth:`HiddenStatesStorage.start` when the request is first scheduled, before its path can
  reach a client: reserve its place (the file backend takes ``<file>.lock``);
- :meth:`~HiddenStatesStorage.write` once it finished, from a write thread: store its rows
  and token ids and release the place (the reader may take it from then on);
- :meth:`~HiddenStatesStorage.abandon` when it gets nothing (aborted, failed, or not written
  within ``shutdown_drain_s``): release the place so that its reader fails at once instead of
  waiting. It may be called while a write of the same request runs (shutdown), and more than
  once;
- :meth:`~HiddenStatesStorage.begin_close` when shutdown starts, and
  :meth:`~HiddenStatesStorage.close` once every request was written or abandoned.

Two backends: :class:`FileStorage` (one safetensors file per request) and, with
``cfg.mooncake``, :class:`MooncakeStorage` (one object per request in a Mooncake store). The
response's ``kv_transfer_params`` are made on the
scheduler side (``scheduler.py``), from the same request path or key.
"""

from __future__ import annotations

import contextlib
import os
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from vllm_gdn_hs import files
from vllm_gdn_hs.config import HiddenStatesConfig
from vllm_gdn_hs.connector.metadata import NewRequest


@dataclass
class StoredRequest:
    """One request's place in a backend."""

    req_id: str
    path: str  # the file (file backend), or the key a backend derives from it
    handle: Any = None  # the backend's own: the file backend's lock descriptor
    state: str = "open"  # open -> writing -> done; abandoned at any point
    mutex: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def begin_write(self) -> None:
        """open -> writing; RuntimeError if the place was given up meanwhile."""
        with self.mutex:
            if self.state != "open":
                raise RuntimeError(f"its place was given up ({self.state})")
            self.state = "writing"


class HiddenStatesStorage(ABC):
    unit = "files"  # what one request's hidden states are called in the log lines

    def __init__(self, cfg: HiddenStatesConfig):
        self.cfg = cfg

    @abstractmethod
    def start(self, req: NewRequest) -> StoredRequest:
        """Reserve the request's place; raises if it cannot have one (the request alone then
        gets no hidden states)."""

    @abstractmethod
    def write(self, request: StoredRequest, hidden_states, token_ids, scales) -> None:
        """Store [T, L, H] rows, [T] int64 token ids and, for fp8, [T, 1, 1] scales (the
        response already named where: the scheduler side's ``kv_transfer_params``)."""

    @abstractmethod
    def abandon(self, request: StoredRequest, why: str = "") -> None:
        """Give the request's place up: its reader finds nothing and fails at once (``why``, for
        a backend that tells the reader; empty for an aborted request, which nobody reads)."""

    def begin_close(self) -> None:  # noqa: B027 - optional
        """Shutdown has started: writes that wait on the backend should give up soon."""

    def close(self, deadline: float | None = None) -> None:  # noqa: B027 - optional
        """At shutdown, once every request was written or abandoned; done by ``deadline``
        (monotonic: the end of ``shutdown_drain_s``)."""


def make_storage(cfg: HiddenStatesConfig) -> HiddenStatesStorage:
    """The backend ``cfg`` names: a Mooncake store with ``cfg.mooncake`` (it connects here,
    so a wrong master fails the startup), else files."""
    if cfg.mooncake is not None:
        return MooncakeStorage(cfg)
    return FileStorage(cfg)


class FileStorage(HiddenStatesStorage):
    """One safetensors file per request (:mod:`vllm_gdn_hs.files`): ``<file>.lock`` is held from
    :meth:`start` until the file is complete (``use_synchronization_lock``)."""

    def start(self, req: NewRequest) -> StoredRequest:
        fd = files.take_lock(req.path) if self.cfg.use_synchronization_lock else None
        return StoredRequest(req.req_id, req.path, fd)

    def write(self, request: StoredRequest, hidden_states, token_ids, scales) -> None:
        request.begin_write()
        try:
            files.write_file(request.path, hidden_states, token_ids, scales)
        except BaseException:
            self._release(request, remove=True)
            raise
        self._release(request, remove=False)

    def abandon(self, request: StoredRequest, why: str = "") -> None:
        with request.mutex:
            if request.state == "open":
                self._release_locked(request, remove=True)
            elif request.state == "writing":
                # The write thread closes the descriptor when it ends; the lock file goes now,
                # so a reader stops waiting (the file may still appear, complete).
                with contextlib.suppress(FileNotFoundError):
                    os.remove(request.path + files.LOCK_SUFFIX)
                request.state = "abandoned"

    def _release(self, request: StoredRequest, remove: bool) -> None:
        with request.mutex:
            self._release_locked(request, remove and request.state != "abandoned")

    @staticmethod
    def _release_locked(request: StoredRequest, remove: bool) -> None:
        fd, request.handle = request.handle, None
        request.state = "done" if request.state != "abandoned" else "abandoned"
        files.release_lock(fd, request.path, remove=remove)


class MooncakeStorage(HiddenStatesStorage):
    """The connector's storage backend for ``cfg.mooncake``: ``request.path`` is the object's
    key (the scheduler side made it, :class:`KeyMaker`); no lock (the reader waits for the
    object or its error object); fp8 objects carry their scales (read by
    :mod:`vllm_gdn_hs.train`'s ``mooncake-fp8`` backend)."""

    unit = "objects"

    def __init__(self, cfg: HiddenStatesConfig):
        super().__init__(cfg)
        from vllm_gdn_hs.connector.mooncake_store import MooncakeStore

        self.store = MooncakeStore(cfg.mooncake)

    def start(self, req: NewRequest) -> StoredRequest:
        return StoredRequest(req.req_id, req.path)

    def write(self, request: StoredRequest, hidden_states, token_ids, scales) -> None:
        request.begin_write()
        try:
            self.store.write(request.path, hidden_states, token_ids, scales)
        except BaseException as e:
            self.store.write_error(request.path, str(e))
            raise
        finally:
            with request.mutex:
                request.state = "done" if request.state == "writing" else request.state

    def abandon(self, request: StoredRequest, why: str = "") -> None:
        with request.mutex:
            was, request.state = request.state, "abandoned"
        # A put under way ends either way: its object, or its error object.
        if was == "open" and why:
            self.store.write_error(request.path, why)

    def begin_close(self) -> None:
        self.store.begin_close()

    def close(self, deadline: float | None = None) -> None:
        self.store.close(readers_until=deadline)
