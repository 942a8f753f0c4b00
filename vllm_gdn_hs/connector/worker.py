"""The connector's worker side (tensor-parallel rank 0): each step's rows into a pinned host
slot (:mod:`.staging`), filed by request (:mod:`.drain`), written when finished (:mod:`.writer`).
A failure costs only that request its hidden states (logged with its id, counted).
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import threading
import time

import torch

from vllm_gdn_hs.config import HiddenStatesConfig
from vllm_gdn_hs.connector.drain import Drain, StepRows
from vllm_gdn_hs.connector.metadata import HybridHiddenStatesConnectorMetadata
from vllm_gdn_hs.connector.staging import HostRing, HostSlot
from vllm_gdn_hs.connector.stats import StatsBook, WriterStats
from vllm_gdn_hs.connector.writer import Writer
from vllm_gdn_hs.names import init_logger
from vllm_gdn_hs.storage.registry import storage_for

logger = init_logger(__name__)


class HybridHiddenStatesConnectorWorker:
    def __init__(
        self,
        cfg: HiddenStatesConfig,
        max_tokens: int,
        num_layers: int,
        hidden: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.ring = HostRing(
            cfg.host_buffers, max_tokens, num_layers, hidden, dtype, device, fp8=cfg.fp8
        )
        self.cfg = cfg
        self.book = StatsBook()
        # Slow-storage warnings once per writer (vLLM's warning_once keys on the figures too).
        self.warned: set[str] = set()
        self.storage = storage_for(cfg)
        self.storage.open_worker_side()
        self.writer = Writer(cfg, self.storage, self.book, num_layers, self._warn_once)
        stored = self.ring.hidden_states.dtype  # fp8: float8_e4m3fn
        self.drain = Drain(
            self.writer, self.storage, self.book, num_layers, hidden, stored, cfg.fp8
        )
        self.logged = (time.monotonic(), 0, 0)  # (when, files, bytes) at the last progress line
        self.log_lock = threading.Lock()
        self.closed = False
        self._taken = (0.0, 0.0)  # (seconds waited, seconds in take()) of take()'s last slot

    # -- engine thread ----------------------------------------------------------------
    def on_metadata(self, meta: HybridHiddenStatesConnectorMetadata) -> None:
        for req in meta.new_requests:
            self.drain.start_request(req)
        for fin in meta.finished_requests:
            self.drain.tasks.put(fin)

    def save(
        self,
        hidden_states: torch.Tensor,
        req_ids: list[str],
        query_start_loc_cpu: torch.Tensor,
        positions: torch.Tensor,
    ) -> None:
        t0 = time.perf_counter()
        slot, waited = self.ring.copy_out(hidden_states, positions)
        self._queue(slot, req_ids, query_start_loc_cpu, waited, t0)

    def take(self, num_tokens: int) -> HostSlot:
        t0 = time.perf_counter()
        slot, waited = self.ring.take(num_tokens)
        self._taken = (waited, time.perf_counter() - t0)
        return slot

    def save_taken(
        self,
        slot: HostSlot,
        req_ids: list[str],
        query_start_loc_cpu: torch.Tensor,
        norms: torch.Tensor,
        positions: torch.Tensor,
    ) -> None:
        t0 = time.perf_counter()
        slot.finish(norms, positions)
        waited, taking = self._taken  # the forward pass between take and here is not save()'s
        self._queue(slot, req_ids, query_start_loc_cpu, waited, t0, taking)

    def _queue(self, slot, req_ids, query_start_loc_cpu, waited, t0, taking=0.0) -> None:
        if waited > 0.5:
            self._warn_once(
                "host_buffers",
                "the engine waited %.1f s for host buffers, with %d files being written "
                "(%.2f GB): writing hidden states is slower than the GPU (with files being "
                "written: write to faster storage, or raise write_workers; with none: raise "
                "host_buffers)",
                waited,
                (gauges := self.writer.gauges())["writing"],
                gauges["backlog_bytes"] / 1e9,
            )
        self.drain.tasks.put(StepRows(slot, req_ids, query_start_loc_cpu.tolist()))
        spent = time.perf_counter() - t0 + taking
        self.book.add(steps=1, engine_waited_s=waited, engine_save_s=spent)
        self.log_progress()

    @property
    def stats(self) -> WriterStats:
        return dataclasses.replace(self.book.snapshot(), **self.gauges())

    def gauges(self) -> dict[str, int]:
        return {**self.writer.gauges(), "in_flight": len(self.drain.requests)}

    def interval_stats(self) -> dict[str, float]:
        return self.book.interval(self.gauges())

    def log_progress(self, every: float = 30.0) -> None:
        """The progress line, at most every ``every`` s (after steps: a long decode speaks too)."""
        with self.log_lock:
            now, (then, files, size) = time.monotonic(), self.logged
            if now - then < every:
                return
            stats = self.stats
            self.logged = (now, stats.files, stats.bytes)
        rate = (now - then, stats.files - files, stats.bytes - size)
        logger.info("%s", stats.progress_line(self.storage.unit, rate))

    def _warn_once(self, key: str, msg: str, *args) -> None:
        if key not in self.warned:
            self.warned.add(key)
            logger.warning(msg, *args)

    # -- shutdown ---------------------------------------------------------------------
    def close(self, timeout: float | None = None) -> None:
        """Write every finished request within ``timeout`` s (default ``shutdown_drain_s``);
        the rest, and requests never finished, lose their lock (counted and logged)."""
        if self.closed:
            return
        self.closed = True
        timeout = self.cfg.shutdown_drain_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        self.storage.begin_close()  # e.g. writes waiting for a full Mooncake store give up soon
        with signals_logged(timeout):
            if not self.drain.stop(deadline - time.monotonic()):
                logger.error("the drain thread did not end within %gs", timeout)
            self.writer.close(deadline)
            unfinished = self.drain.abandon_unfinished()
            self.storage.close(deadline)  # a store's readers may read until then
        self.book.add(unfinished=len(unfinished))
        logger.info("%s", self.stats.shutdown_line(unfinished, self.storage.unit))


@contextlib.contextmanager
def signals_logged(timeout: float):
    """SIGINT and SIGTERM are logged, not acted on, while the writes drain: vLLM's engine core
    puts the default handlers back before its teardown (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def log(signum, frame):
        logger.warning(
            "%s during shutdown: finishing the hidden-state writes first (at most %gs, "
            "shutdown_drain_s)",
            signal.Signals(signum).name,
            timeout,
        )

    previous = {s: signal.signal(s, log) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
