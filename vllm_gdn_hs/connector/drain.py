"""The drain thread: each step's rows from the host ring into each request's rows (by token
position: a position written again keeps the later row), and each finished request to the
writer, in the order the engine thread queued them.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass

import torch

from vllm_gdn_hs.connector.metadata import FinishedRequest, NewRequest
from vllm_gdn_hs.connector.request_rows import PENDING_ROWS, SHORT_RUN, RequestRows, host_view
from vllm_gdn_hs.connector.staging import HostSlot
from vllm_gdn_hs.connector.stats import StatsBook, failed
from vllm_gdn_hs.connector.writer import WriteJob, Writer, next_task
from vllm_gdn_hs.names import init_logger
from vllm_gdn_hs.storage.base import HiddenStatesStorage, StoredRequest

logger = init_logger(__name__)


@dataclass(frozen=True)
class StepRows:
    """One step's rows in a host slot: the requests in batch order, their query start locations."""

    slot: HostSlot
    req_ids: list[str]
    qsl: list[int]


# A finished request; an event set once every task queued before it has run; None: the last.
Task = StepRows | FinishedRequest | threading.Event | None


@dataclass(eq=False)
class ActiveRequest:
    rows: RequestRows
    stored: StoredRequest


class Drain:
    def __init__(
        self,
        writer: Writer,
        storage: HiddenStatesStorage,
        book: StatsBook,
        num_layers: int,
        hidden: int,
        dtype: torch.dtype,
        fp8: bool,
    ):
        """Rows of ``num_layers`` x ``hidden`` values in ``dtype`` (as stored: float8_e4m3fn
        with ``fp8``), each request started in ``storage`` and handed to ``writer`` finished."""
        self.writer, self.storage, self.book = writer, storage, book
        self.num_layers, self.hidden, self.dtype = num_layers, hidden, dtype
        self.norms_width = num_layers + fp8  # fp8: each row's scale too
        self.requests: dict[str, ActiveRequest] = {}
        self.created = 0  # request buffers made, to stagger their flushes
        self.deferring: set[RequestRows] = set()  # buffers holding rows of step blocks
        self.tasks: queue.Queue[Task] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="hs-drain", daemon=False)
        self.thread.start()

    # -- engine thread ----------------------------------------------------------------
    def start_request(self, req: NewRequest) -> None:
        if req.req_id in self.requests:
            return  # listed as new again (resumed): its rows so far are kept
        flush_rows = PENDING_ROWS + self.created % PENDING_ROWS
        try:  # the rows first: they hold nothing a reader waits for
            rows = RequestRows(
                req, self.num_layers, self.hidden, self.dtype, flush_rows, self.norms_width
            )
            stored = self.storage.start(req.req_id, req.path)
        except Exception as e:  # never stop the engine for one request's file
            failed(self.book, req.req_id, f"cannot start its rows or lock for {req.path}: {e}")
            return
        self.created += 1
        self.requests[req.req_id] = ActiveRequest(rows, stored)

    def flushed(self, timeout: float) -> bool:
        """Wait until the drain thread has done every task queued before this call."""
        done = threading.Event()
        self.tasks.put(done)
        return done.wait(timeout)

    def stop(self, timeout: float) -> bool:
        """Run every queued task, then end the thread; False if still busy after ``timeout`` s."""
        self.tasks.put(None)
        self.thread.join(max(timeout, 0))
        return not self.thread.is_alive()

    # -- drain thread -----------------------------------------------------------------
    @torch.inference_mode()  # host buffers are made on the engine thread, in inference mode
    def _run(self) -> None:
        try:
            while (task := next_task(self.tasks)) is not None:
                try:
                    match task:
                        case StepRows():
                            self._on_rows(task)
                        case FinishedRequest():
                            self._on_finish(task)
                        case threading.Event():
                            task.set()
                except Exception:
                    logger.exception("hidden-state drain task %s failed", type(task).__name__)
        finally:
            self.writer.producer_done.set()  # the writer's last producer is gone

    def _on_rows(self, task: StepRows) -> None:
        slot, qsl = task.slot, task.qsl
        if slot.copied is not None:
            slot.copied.synchronize()
        t0 = time.perf_counter()
        try:
            positions = slot.positions[: qsl[-1]].tolist()
            short: list[tuple[ActiveRequest, int]] = []  # (request, row in the slot)
            for i, req_id in enumerate(task.req_ids):
                if (active := self.requests.get(req_id)) is None:
                    continue  # aborted, or finished before this step's rows
                s, e = qsl[i], qsl[i + 1]
                if e - s > SHORT_RUN:
                    try:
                        active.rows.put(positions[s:e], slot.hidden_states[s:e], slot.norms[s:e])
                    except Exception as err:  # this request alone loses its file
                        self._drop(active, f"cannot keep its rows: {err}")
                else:
                    short += ((active, r) for r in range(s, e))
            touched = set()
            if short:  # decode: one gather for the whole step, then references
                index = [r for _, r in short]  # numpy copies whole rows; torch, elements
                block = host_view(slot.hidden_states)[index]
                block_norms = host_view(slot.norms)[index]
                for j, (active, r) in enumerate(short):
                    if active.stored.req_id not in self.requests:
                        continue  # dropped above
                    try:
                        active.rows.defer(block, block_norms, j, positions[r])
                    except Exception as err:
                        self._drop(active, f"cannot keep its rows: {err}")
                        continue
                    touched.add(active.rows)
            # A request that got no short rows this step (preempted, or prefilling again)
            # files what it holds, so that it keeps no step block alive while it waits.
            for buf in self.deferring - touched:
                try:
                    buf.flush()
                except Exception as err:
                    if (active := self.requests.get(buf.req.req_id)) is not None:
                        self._drop(active, f"cannot keep its rows: {err}")
            self.deferring = {buf for buf in touched if buf.pending}
        finally:
            self.book.add(drain_s=time.perf_counter() - t0)
            slot.release()

    def _drop(self, active: ActiveRequest, why: str) -> None:
        """Give up on one request: no file and no lock (so its reader fails at once), counted
        and logged once with its id; every other request goes on."""
        self.requests.pop(active.stored.req_id, None)
        self.deferring.discard(active.rows)
        try:
            self.storage.abandon(active.stored, why)
        except Exception as e:
            why += f" (and its lock: {e})"
        failed(self.book, active.stored.req_id, why)

    def _on_finish(self, fin: FinishedRequest) -> None:
        if (active := self.requests.pop(fin.req_id, None)) is None:
            return
        self.deferring.discard(active.rows)  # from here on only its writer touches it
        if fin.token_ids is None:  # aborted: no file, no lock
            self.storage.abandon(active.stored)  # no reason: nobody waits for it
            self.book.add(aborted=1)
            return
        nbytes = len(fin.token_ids) * self.num_layers * self.hidden * self.dtype.itemsize
        self.writer.submit(WriteJob(active.stored, active.rows, fin.token_ids, nbytes))

    # -- shutdown ---------------------------------------------------------------------
    def abandon_unfinished(self) -> list[str]:
        """At shutdown, after :meth:`stop`: requests never finished lose their place."""
        unfinished = list(self.requests)
        for active in self.requests.values():
            self.storage.abandon(active.stored, "the server stopped before the request finished")
        self.requests.clear()
        self.deferring.clear()
        return unfinished
