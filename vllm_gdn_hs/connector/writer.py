"""The write pool: ``write_workers`` threads (not daemons: they finish the queue) check each
finished request's rows and store them. Past ``write_backlog_gb`` of rows waiting,
:meth:`Writer.submit` waits: the engine slows to the writes' speed instead of running out of
host memory.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm_gdn_hs.config import HiddenStatesConfig
from vllm_gdn_hs.connector.request_rows import RequestRows
from vllm_gdn_hs.connector.stats import StatsBook, failed
from vllm_gdn_hs.names import init_logger
from vllm_gdn_hs.rows import check_norms
from vllm_gdn_hs.storage.base import HiddenStatesStorage, StoredRequest

logger = init_logger(__name__)
POLL_S = 0.5  # how often an idle drain or write thread looks whether the process ends


def next_task(tasks: queue.Queue, done: Callable[[], bool] = lambda: True):
    """The next item of ``tasks``, waited for; None also once the process ends without
    close() (its main thread gone) and ``done()`` says that nothing more will be queued."""
    while True:
        try:
            return tasks.get(timeout=POLL_S)
        except queue.Empty:
            if not threading.main_thread().is_alive() and done():
                return None


@dataclass(eq=False)  # by identity: the set of running writes holds them
class WriteJob:
    stored: StoredRequest
    rows: RequestRows
    token_ids: list[int]
    nbytes: int


class Writer:
    def __init__(
        self,
        cfg: HiddenStatesConfig,
        storage: HiddenStatesStorage,
        book: StatsBook,
        num_layers: int,
        warn_once: Callable[..., None],
    ):
        self.cfg, self.storage, self.book, self.num_layers = cfg, storage, book, num_layers
        self.warn_once = warn_once
        self.producer_done = threading.Event()  # set when the drain thread, which submits, ends
        self.jobs: queue.Queue[WriteJob | None] = queue.Queue()
        self.running: set[WriteJob] = set()
        # The backlog and the writes in flight, shared by the drain thread and the writers.
        self.cond = threading.Condition()
        self.backlog_bytes = self.writing = 0
        self.deadline: float | None = None  # set by close()
        self.threads = [
            threading.Thread(target=self._loop, name=f"hs-write-{i}", daemon=False)
            for i in range(cfg.write_workers)
        ]
        for t in self.threads:
            t.start()

    # -- the drain thread -------------------------------------------------------------
    def submit(self, job: WriteJob) -> None:
        """Queue one finished request's write; waits while the backlog is full (until the
        shutdown deadline, past which the request is abandoned)."""
        limit = self.cfg.write_backlog_gb * 1e9
        with self.cond:
            if self.backlog_bytes and self.backlog_bytes + job.nbytes > limit:
                self.warn_once(
                    "write_backlog_gb",
                    "%.1f GB of finished requests wait for their files to be written "
                    "(write_backlog_gb=%g): extraction now runs at the speed of the writes "
                    "(write to faster storage, or raise write_workers)",
                    self.backlog_bytes / 1e9,
                    self.cfg.write_backlog_gb,
                )
                t0 = time.perf_counter()
                while self.backlog_bytes and self.backlog_bytes + job.nbytes > limit:
                    left = None if self.deadline is None else self.deadline - time.monotonic()
                    if left is not None and left <= 0:
                        break
                    self.cond.wait(left)
                self.book.add(backlog_waited_s=time.perf_counter() - t0)
            late = self._late()
            if not late:
                self.backlog_bytes += job.nbytes
                self.writing += 1
        if late:
            self._lost(job, "not written within shutdown_drain_s")
        else:
            self.jobs.put(job)

    def _late(self) -> bool:
        """Past close()'s deadline: no write starts any more."""
        return self.deadline is not None and time.monotonic() >= self.deadline

    def gauges(self) -> dict[str, int]:
        with self.cond:
            return {"writing": self.writing, "backlog_bytes": self.backlog_bytes}

    # -- write threads ----------------------------------------------------------------
    def _loop(self) -> None:
        while (job := next_task(self.jobs, self.producer_done.is_set)) is not None:
            with self.cond:
                late = self._late()
                if not late:
                    self.running.add(job)
            try:
                if late:  # close() gave up on the queue while this thread was busy
                    self._lost(job, "not written within shutdown_drain_s")
                else:
                    self._write(job)
            finally:
                with self.cond:
                    self.running.discard(job)
                    self.backlog_bytes -= job.nbytes
                    self.writing -= 1
                    self.cond.notify_all()

    @torch.inference_mode()
    def _write(self, job: WriteJob) -> None:
        buf, n = job.rows, len(job.token_ids)
        try:
            buf.flush()
            missing = buf.missing(n)
            if missing is None or missing:
                where = "beyond the rows computed" if missing is None else missing
                raise RuntimeError(f"hidden states missing for token positions {where}")
            hidden_states, norms = buf.rows[:n], buf.norms[:n]
            if self.cfg.validate_rows and (why := check_norms(norms[:, : self.num_layers])):
                raise RuntimeError(why)
            scales = (
                norms[:, self.num_layers :].reshape(n, 1, 1).contiguous() if self.cfg.fp8 else None
            )
            ids = torch.tensor(job.token_ids, dtype=torch.int64)
            self.storage.write(job.stored, hidden_states, ids, scales)
        except Exception as e:
            # On failure the lock goes too, so a reader fails at once, not after 10 s.
            self._lost(job, f"not written to {job.stored.path}: {e}", counter="failed")
            return
        self.book.add(files=1, bytes=job.nbytes)

    # -- shutdown ---------------------------------------------------------------------
    def close(self, deadline: float) -> None:
        """Wait for every queued write until ``deadline`` (monotonic); abandon what is left
        (its lock removed, the file may still appear complete)."""
        with self.cond:
            self.deadline = deadline
            self.cond.notify_all()
        for _ in self.threads:
            self.jobs.put(None)
        for t in self.threads:
            t.join(max(deadline - time.monotonic(), 0))
        queued: list[WriteJob | None] = []
        with contextlib.suppress(queue.Empty):
            while True:
                queued.append(self.jobs.get_nowait())
        left = [job for job in queued if job is not None]
        for _ in self.threads:  # for the threads still busy, which then end
            self.jobs.put(None)
        with self.cond:
            running = list(self.running)
            for job in left:  # never to be written: out of the backlog
                self.backlog_bytes -= job.nbytes
                self.writing -= 1
        for job in left + running:
            self._lost(job, "not written within shutdown_drain_s")
        if running:
            logger.error(
                "%d files were still being written after shutdown_drain_s=%gs: their locks "
                "are removed (each file may still appear, complete)",
                len(running),
                self.cfg.shutdown_drain_s,
            )

    def _lost(self, job: WriteJob, why: str, counter: str = "lost_at_shutdown") -> None:
        self.storage.abandon(job.stored, why)
        failed(self.book, job.stored.req_id, why, counter)
