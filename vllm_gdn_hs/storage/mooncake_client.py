"""The mooncake backend's client: this server's puts into a Mooncake store.

On the wire as hs-connectors' ``MooncakeHiddenStatesConnector`` (0.9.0), so that its reader
``MooncakeTransfer`` reads our objects: the tensors' bytes at its ``packed_layout``'s offsets,
the v1 manifest (:func:`manifest`) in the response, a failure as ``{"error": why}`` under
``key + ":error"``. Puts are hard-pinned: a full store refuses them and the writer waits, so it
slows the engine as slow storage does (docs/mooncake.md).
"""

from __future__ import annotations

import contextlib
import json
import queue
import threading
import time

import torch
from hs_connectors.fp8_utils import SCALES_KEY
from hs_connectors.mooncake_store import VERSION, packed_layout

from vllm_gdn_hs.names import CONNECTOR_NAME, init_logger
from vllm_gdn_hs.storage.mooncake_options import MooncakeOptions, advertise_address, check_master
from vllm_gdn_hs.storage.mooncake_unread import WATCH_S, UnreadObjects

logger = init_logger(__name__)

ERROR_SUFFIX = ":error"  # hs-connectors' error object: key + ":error"
NO_AVAILABLE_HANDLE = -200  # no room in any segment: store full (or not yet mounted again)
OBJECT_ALREADY_EXISTS = -705  # Mooncake ErrorCode (types.h): a put of a key the store holds
RPC_FAIL = -900  # the master does not answer
MASTER_WAIT_S = 120.0  # how long a put waits for a master that does not answer


def manifest(
    key, num_tokens, num_layers, hidden, dtype, include_output_tokens=False, fp8=False
) -> dict:
    """hs-connectors' v1 transfer manifest for one request's object; ``fp8``: the fp8 file's
    tensors (float8_e4m3fn rows, [T, 1, 1] fp32 scales; ``dtype`` ignored)."""
    rows_dtype = torch.float8_e4m3fn if fp8 else dtype
    layout = {"hidden_states": ([num_tokens, num_layers, hidden], rows_dtype)}
    if fp8:
        layout[SCALES_KEY] = ([num_tokens, 1, 1], torch.float32)
    tensors, total = packed_layout({**layout, "token_ids": ([num_tokens], torch.int64)})
    return {
        "handle": key,
        "version": VERSION,
        "tensors": tensors,
        "metadata": {
            "num_tokens": num_tokens,
            "total_aligned_bytes": total,
            "extract_mode": "all" if include_output_tokens else "prompt_only",
        },
    }


class MooncakeError(RuntimeError):
    """A Mooncake call failed; the message names the call, the key and the status."""


class MooncakeStore:
    """This server's Mooncake client; ``write`` runs on the connector's write threads."""

    def __init__(self, options: MooncakeOptions, *, error_retry_s=300.0, close_grace_s=30.0):
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig

        self.options = options
        self.error_retry_s, self.close_grace_s = error_retry_s, close_grace_s
        check_master(options)
        advertise_address(options.local_hostname)  # this host's address, not the first NIC's
        self.client = MooncakeDistributedStore()
        o = options
        rc = self.client.setup(
            o.local_hostname, o.metadata_server, o.global_segment_size, o.local_buffer_size,
            o.protocol, o.device_name, o.master_server_address,
        )  # fmt: skip
        if rc != 0:
            raise ValueError(
                f"{CONNECTOR_NAME}: Mooncake client setup failed (status {rc}) with the master "
                f"at {options.master_server_address}, local_hostname "
                f"{options.local_hostname!r}, metadata server {options.metadata_server!r}, "
                f"protocol {options.protocol}: check that other hosts reach this one at "
                "local_hostname (MOONCAKE_LOCAL_HOSTNAME) and that global_segment_size "
                "(--mooncake-global-segment-gib) is 16 MiB or more and fits in host memory"
            )
        self.pin = ReplicateConfig()
        self.pin.with_hard_pin = True  # refused when full, never evicted
        self.lock = threading.Condition()
        self.stats = dict(objects=0, bytes=0, errors=0, full_waits=0, full_waited_s=0.0,
                          put_again=0, lost=0)  # fmt: skip
        self.waiting_full = 0  # writers waiting for room now
        self.last_full_log = 0.0
        self.closing_at: float | None = None
        self.errors: queue.Queue = queue.Queue()
        self.error_thread = threading.Thread(
            target=self._error_loop, name="hs-mooncake-errors", daemon=True
        )
        self.error_thread.start()
        self.unread_objects = UnreadObjects(self)
        logger.info(
            "Mooncake store at %s (%s, this client %s lends %.2f GiB); puts hard-pinned",
            options.master_server_address,
            options.protocol,
            options.local_hostname,
            options.global_segment_size / 2**30,
        )

    def write(
        self,
        key: str,
        hidden_states: torch.Tensor,
        token_ids: torch.Tensor,
        scales: torch.Tensor | None = None,
    ) -> None:
        """Put one request's object, waiting while the store is full; MooncakeError else."""
        hidden_states = hidden_states.contiguous()
        n, num_layers, hidden = hidden_states.shape
        fp8 = scales is not None
        spec = manifest(key, n, num_layers, hidden, hidden_states.dtype, fp8=fp8)
        total = spec["metadata"]["total_aligned_bytes"]
        head = spec["tensors"]["hidden_states"]["nbytes"]
        # The rows as they lie in the host buffer; the rest, padded, as a second small part.
        tail = torch.zeros(total - head, dtype=torch.uint8)
        small = {"token_ids": token_ids, **({SCALES_KEY: scales} if fp8 else {})}
        for name, tensor in small.items():
            at, size = spec["tensors"][name]["offset"] - head, spec["tensors"][name]["nbytes"]
            tail[at : at + size].copy_(tensor.contiguous().view(-1).view(torch.uint8))
        parts = [(hidden_states.data_ptr(), head), (tail.data_ptr(), tail.numel())]
        self.unread_objects.keep(key, [hidden_states.view(-1).view(torch.uint8), tail])
        self.put_parts(key, parts)
        self.unread_objects.done(key)
        with self.lock:
            self.stats["objects"] += 1
            self.stats["bytes"] += total

    def put_parts(self, key: str, parts: list[tuple[int, int]]) -> None:
        registered = []
        try:
            for ptr, size in parts:  # RDMA sends only from registered memory
                self.check("register_buffer", key, self.client.register_buffer(ptr, size))
                registered.append(ptr)
            self._put(key, [p for p, _ in parts], [s for _, s in parts])
        except BaseException:
            self.unread_objects.forget([key])
            raise
        finally:
            for ptr in registered:
                self.client.unregister_buffer(ptr)

    def _put(self, key: str, ptrs: list[int], sizes: list[int]) -> None:
        since, delay = None, 0.005
        try:
            while True:
                rc = self.client.batch_put_from_multi_buffers([key], [ptrs], [sizes], self.pin)[0]
                if rc not in (NO_AVAILABLE_HANDLE, RPC_FAIL):
                    return self.check("put", key, 0 if rc == OBJECT_ALREADY_EXISTS else rc)
                now = time.monotonic()
                if since is None:
                    since = now
                    with self.lock:
                        self.stats["full_waits"] += rc == NO_AVAILABLE_HANDLE
                        self.waiting_full += 1
                closing = self.closing_at is not None and now - self.closing_at > self.close_grace_s
                if rc == RPC_FAIL and (closing or now - since > MASTER_WAIT_S):
                    return self.check("put", key, rc)
                if closing:
                    raise MooncakeError(f"the Mooncake store stayed full; {key} not put")
                if rc == NO_AVAILABLE_HANDLE:
                    self._log_full(now - since)
                elif since == now:
                    logger.warning("the Mooncake master at %s does not answer: puts wait "
                                   "for it up to %.0f s",
                                   self.options.master_server_address, MASTER_WAIT_S)  # fmt: skip
                time.sleep(delay)
                delay = min(2 * delay, 0.2)
        finally:
            if since is not None:
                with self.lock:
                    self.waiting_full -= 1
                    self.stats["full_waited_s"] += time.monotonic() - since

    def _log_full(self, waited: float, every: float = 60.0) -> None:
        now = time.monotonic()
        with self.lock:
            if now - self.last_full_log < every:
                return
            self.last_full_log = now
            waiting = self.waiting_full
            mean = self.stats["bytes"] / max(self.stats["objects"], 1)
        unread = len(self.unread_objects.unread())
        logger.warning(
            "the Mooncake store is full: %d writes waiting (the longest %.0f s), %d objects "
            "(%.2f GB) put by this server not read yet. Objects are hard-pinned and stay until "
            "a trainer reads them, so extraction now runs at the trainers' pace; if this "
            "lasts, check that a trainer reads from %s, or lend the store more memory "
            "(--mooncake-global-segment-gib, here or on the trainers)",
            waiting,
            waited,
            unread,
            unread * mean / 1e9,
            self.options.master_server_address,
        )

    def write_error(self, key: str, why: str) -> None:
        """Put ``key:error`` (``{"error": why}``), so its reader fails at once: queued, and
        retried for ``error_retry_s`` (through a master restart)."""
        self.errors.put((key + ERROR_SUFFIX, why, time.monotonic() + self.error_retry_s))

    def _error_loop(self) -> None:
        while (item := self.errors.get()) is not None:
            key, why, deadline = item
            data = json.dumps({"error": why[:4096]}).encode()
            copy = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            while True:
                self.unread_objects.keep(key, [copy])
                try:
                    rc = self.client.put(key, data, self.pin)
                except Exception as e:  # never let this thread die
                    rc = repr(e)
                if rc in (0, OBJECT_ALREADY_EXISTS):
                    self.unread_objects.done(key)
                    with self.lock:
                        self.stats["errors"] += 1
                    break
                self.unread_objects.forget([key])
                now = time.monotonic()
                closing = self.closing_at is not None and now - self.closing_at > 1.0
                if now > deadline or closing:
                    logger.error(
                        "could not put the error object %s (status %s): its reader "
                        "waits until its own timeout",
                        key,
                        rc,
                    )
                    break
                time.sleep(0.5)

    def begin_close(self) -> None:
        """Writers still waiting for room give up ``close_grace_s`` from now."""
        if self.closing_at is None:
            self.closing_at = time.monotonic()

    def close(self, readers_until: float | None = None) -> None:
        """Put the queued error objects, wait until ``readers_until`` (monotonic) for trainers
        to read what is left, then remove what no reader took (hard-pinned: never expires)."""
        self.begin_close()
        self.errors.put(None)
        self.error_thread.join(timeout=self.close_grace_s)
        unread = self._wait_for_readers(readers_until)
        removed = 0
        for key in self.unread_objects.unread():
            with contextlib.suppress(Exception):
                removed += self.client.remove(key, True) == 0
        with contextlib.suppress(Exception):
            self.client.remove(self.unread_objects.marker, True)
        self._close_client()
        (logger.error if unread else logger.info)(
            "Mooncake: %d objects (%.2f GB) and %d error objects put; %d objects not read "
            "by a trainer by the end of shutdown_drain_s (their readers fail) and %d objects "
            "in all were removed at shutdown",
            self.stats["objects"],
            self.stats["bytes"] / 1e9,
            self.stats["errors"],
            unread,
            removed,
        )

    def _close_client(self) -> None:
        """Close the client once no thread of ours calls it (left to the interpreter's exit,
        its C++ teardown may abort the process)."""
        self.unread_objects.thread.join(timeout=2 * WATCH_S + 5)
        busy = [t.name for t in (self.error_thread, self.unread_objects.thread) if t.is_alive()]
        if busy:
            logger.warning(
                "Mooncake client left open at shutdown: %s still running", ", ".join(busy)
            )
            return
        with contextlib.suppress(Exception):
            self.client.close()

    def _wait_for_readers(self, until: float | None) -> int:
        """How many objects (error objects aside) no reader took by ``until``."""

        def objects() -> list[str]:
            return [k for k in self.unread_objects.unread() if not k.endswith(ERROR_SUFFIX)]

        waiting = objects()
        if waiting and until is not None and until > time.monotonic():
            logger.info(
                "waiting up to %.0f s for trainers to read the %d objects still in the "
                "Mooncake store",
                until - time.monotonic(),
                len(waiting),
            )
            while waiting and time.monotonic() < until:
                time.sleep(min(0.2, max(until - time.monotonic(), 0)))
                waiting = objects()
        return len(waiting)

    @staticmethod
    def check(call: str, key: str, rc) -> None:
        if rc != 0:
            hint = " (the master does not answer)" if rc == RPC_FAIL else ""
            raise MooncakeError(f"Mooncake {call} of {key} returned {rc}{hint}")
