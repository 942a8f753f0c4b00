"""The objects this server put that no trainer has read yet, kept through a master restart
(which loses every object): host copies within ``unread_copy_size``, and a marker object no
reader deletes; once it is gone, :meth:`UnreadObjects.watch` puts the copies again, and gives
an object without one an error object (logged by name).
"""

from __future__ import annotations

import secrets
import threading
import time
from typing import Any, Protocol

import torch

from vllm_gdn_hs.names import init_logger
from vllm_gdn_hs.storage.mooncake_options import MooncakeOptions

logger = init_logger(__name__)

WATCH_S = 1.0  # how often the marker and the unread objects are looked up


class UnreadStore(Protocol):
    """What :class:`UnreadObjects` needs of its store (:class:`MooncakeStore`)."""

    options: MooncakeOptions
    client: Any  # Mooncake's MooncakeDistributedStore: is_exist, batch_is_exist, put
    pin: Any  # Mooncake's ReplicateConfig for every put
    lock: threading.Condition  # guards stats
    stats: dict[str, Any]
    closing_at: float | None

    def check(self, call: str, key: str, rc: Any) -> None: ...
    def put_parts(self, key: str, parts: list[tuple[int, int]]) -> None: ...
    def write_error(self, key: str, why: str) -> None: ...


class UnreadObjects:
    def __init__(self, store: UnreadStore):
        self.store = store
        self.lock = threading.Lock()
        self.sweep = threading.RLock()  # unread() and watch(): one at a time
        # key -> a copy of its bytes (None: none), from before its put until a reader took it
        self.owned: dict[str, torch.Tensor | None] = {}
        self.put_done: set[str] = set()  # the keys in owned whose put returned
        self.copied = 0  # bytes of the copies in owned
        self.marker = f"vllm-gdn-hs-alive-{secrets.token_hex(8)}"
        self._put_marker()
        self.thread = threading.Thread(target=self._loop, name="hs-mooncake-watch", daemon=True)
        self.thread.start()

    def _put_marker(self) -> None:
        s = self.store
        s.check("put", self.marker, s.client.put(self.marker, b"1", s.pin))

    def keep(self, key: str, parts: list[torch.Tensor]) -> None:
        """Own ``key`` from before its put, with a copy where ``unread_copy_size`` has room."""
        size = sum(p.numel() for p in parts)
        with self.lock:
            room = size <= self.store.options.unread_copy_size - self.copied
            self.copied += size if room else 0
        copy = torch.cat(parts) if room else None
        with self.lock:
            self.owned[key] = copy

    def done(self, key: str) -> None:
        with self.lock:
            self.put_done.add(key)

    def forget(self, keys) -> None:
        with self.lock:
            for k in keys:
                copy = self.owned.pop(k, None)
                self.copied -= 0 if copy is None else copy.numel()
                self.put_done.discard(k)

    def _put_and_found(self) -> tuple[list[tuple[str, torch.Tensor | None]], list[int]]:
        """The keys whose put returned (those in flight reach a restarted master themselves),
        with their copies, and whether the store has each (1) or not (0)."""
        with self.lock:
            owned = [(k, c) for k, c in self.owned.items() if k in self.put_done]
        return owned, self.store.client.batch_is_exist([k for k, _ in owned]) if owned else []

    def unread(self) -> list[str]:
        """The keys put and still in the store, where the marker shows the master kept them;
        what a reader took is forgotten."""
        with self.sweep:  # not while watch() puts objects again
            owned, found = self._put_and_found()
            keys = [k for k, _ in owned]
            if self.store.client.is_exist(self.marker) != 1:  # lost, not read: put again
                return keys
            self.forget(k for k, e in zip(keys, found, strict=True) if e == 0)
            return [k for k, e in zip(keys, found, strict=True) if e != 0]

    def _loop(self) -> None:
        while self.store.closing_at is None:
            time.sleep(WATCH_S)
            try:
                self.watch()
            except Exception as e:  # never let this thread die
                logger.warning("Mooncake watch: %r", e)

    def watch(self) -> None:
        """Forget what readers took; where the marker is gone, put it and every copy again, and
        give the objects without one an error object."""
        store, address = self.store, self.store.options.master_server_address
        with self.sweep:
            if store.client.is_exist(self.marker) != 0:  # there, or no master to ask: nothing
                self.unread()
                return
            owned, found = self._put_and_found()
            again = [(k, c) for (k, c), e in zip(owned, found, strict=True) if e == 0]
            lost = [k for k, c in again if c is None]
            # The marker first: until the restarted master takes it (its segments mounted
            # again), nothing changes here, and the next round looks again.
            self._put_marker()
            for key, copy in again:
                if copy is not None:
                    try:
                        store.put_parts(key, [(copy.data_ptr(), copy.numel())])
                    except Exception as e:
                        logger.error("%s not put again: %s", key, e)
                        lost.append(key)
            self.forget(lost)
            why = (f"the Mooncake master at {address} restarted and lost this sample, and its "
                   "server kept no copy (unread_copy_size)")  # fmt: skip
            for key in lost:  # its reader fails at once, with the reason, instead of waiting
                store.write_error(key, why)
        with store.lock:
            store.stats["put_again"] += len(again) - len(lost)
            store.stats["lost"] += len(lost)
        (logger.error if lost else logger.warning)(
            "the Mooncake master at %s lost its objects (restarted): %d put again from "
            "this server's copies, %d lost%s", address, len(again) - len(lost),
            len(lost), f" (no copy within unread_copy_size, or not put again): {', '.join(lost)}"
            if lost else "",
        )  # fmt: skip
