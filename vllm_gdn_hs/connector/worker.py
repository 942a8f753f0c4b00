"""The connector's worker side: a request's rows from the GPU to its file.

After each forward pass the patched runner hands the step's rows to :meth:`save`
(``HybridHiddenStatesConnector.save_hidden_states``), which starts their copy into a pinned
host slot (:mod:`.staging`). The drain thread files them into each request's
:class:`~.request_rows.RequestRows` by token position (a position written again keeps the
later row: chunked prefill and preemption come out right). When the scheduler side says a
request finished, a write thread checks its rows and writes its file
(:func:`vllm_gdn_hs.files.write_file`), then releases its ``.lock``. A failure costs only that
request its file: logged once with its id, counted, no file and no lock.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from vllm_gdn_hs import CONNECTOR_NAME, files, init_logger
from vllm_gdn_hs.config import HiddenStatesConfig
from vllm_gdn_hs.connector.metadata import FinishedRequest, HybridHiddenStatesConnectorMetadata
from vllm_gdn_hs.connector.request_rows import _PENDING_ROWS, _SHORT_RUN, RequestRows, host_view
from vllm_gdn_hs.connector.staging import HostRing, HostSlot
from vllm_gdn_hs.files import check_norms, release_lock

logger = init_logger(__name__)


class HybridHiddenStatesConnectorWorker:
    """The worker side (tensor-parallel rank 0): copies out of the GPU, the drain thread that
    files rows by request, and the threads that write finished requests' files."""

    def __init__(
        self,
        cfg: HiddenStatesConfig,
        max_tokens: int,
        num_layers: int,
        hidden: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        # -- storage seam: the mooncake backend puts objects instead of writing files --
        self.store = None  # with cfg.mooncake: .connector.mooncake_store.MooncakeStore
        if cfg.mooncake is not None:  # connects first: a wrong master fails the startup
            from vllm_gdn_hs.connector.mooncake_store import MooncakeStore

            self.store = MooncakeStore(cfg.mooncake)
        self.ring = HostRing(
            cfg.host_buffers, max_tokens, num_layers, hidden, dtype, device, fp8=cfg.fp8
        )
        self.cfg, self.num_layers, self.hidden = cfg, num_layers, hidden
        self.dtype = self.ring.slots[0].hidden_states.dtype  # as stored: fp8 with cfg.fp8
        self.requests: dict[str, RequestRows] = {}
        self.created = 0  # request buffers made, to stagger their flushes
        self.deferring: set[RequestRows] = set()  # buffers holding rows of step blocks
        self.tasks: queue.Queue = queue.Queue()
        self.pool = ThreadPoolExecutor(cfg.write_workers, thread_name_prefix="hs-write")
        self.pending_writes = 0
        self.stats = dict(files=0, bytes=0, failed=0, aborted=0)
        # Host cost, for the logs: steps saved, seconds of the engine thread in save()
        # (waits for a free host buffer included, and counted apart), of drain work.
        # backlog_waited_s: the drain thread's waits on write_backlog_gb (below).
        self.timing = dict(
            steps=0, engine_save_s=0.0, engine_waited_s=0.0, drain_s=0.0, backlog_waited_s=0.0
        )
        # Slow-storage warnings come once per writer, whatever their figures (vLLM's
        # warning_once keys on the arguments: a new figure would log again, at every step);
        # the totals are in the progress and shutdown lines.
        self.warned: set[str] = set()
        # Rows of finished requests not yet written, bounded by write_backlog_gb: past it
        # the drain thread waits for the writers, the ring fills and the engine slows to
        # the speed of the writes instead of the host running out of memory.
        self.backlog_bytes = 0
        # One lock (with its condition) for the stats and the backlog: writers, the drain
        # thread and the progress line share both.
        self.stats_lock = threading.Condition()
        self.last_log = time.monotonic()
        self.drain = threading.Thread(target=self._drain_loop, name="hs-drain", daemon=True)
        self.drain.start()

    # -- engine thread ----------------------------------------------------
    def on_metadata(self, meta: HybridHiddenStatesConnectorMetadata) -> None:
        for req in meta.new_requests:
            if req.req_id in self.requests:
                continue
            try:
                self.requests[req.req_id] = RequestRows(
                    req,
                    self.num_layers,
                    self.hidden,
                    self.dtype,
                    flush_rows=_PENDING_ROWS + self.created % _PENDING_ROWS,
                    lock=self.cfg.use_synchronization_lock and self.store is None,
                    norms_width=self.num_layers + self.cfg.fp8,
                )
                self.created += 1
            except Exception as e:  # never stop the engine for one request's file
                self._failed(req.req_id, f"cannot start its rows or lock for {req.path}: {e}")
                self._store_error(req.path, f"cannot start its rows: {e}")
        for fin in meta.finished_requests:
            self.tasks.put(("finish", fin))

    def save(
        self,
        hidden_states: torch.Tensor,
        req_ids: list[str],
        query_start_loc_cpu: torch.Tensor,
        positions: torch.Tensor,
    ) -> None:
        """One step's rows [tokens, L, H] in batch order, with each row's token position."""
        t0 = time.perf_counter()
        slot, waited = self.ring.copy_out(hidden_states, positions)
        self.timing["engine_waited_s"] += waited
        if waited > 0.5:
            # Which side is behind: with files being written, the storage; with none, the
            # drain thread filing rows (on the GPU: fresh request buffers during prefill).
            self._warn_once(
                "host_buffers",
                "%s: the engine waited %.1f s for host buffers, with %d files being written "
                "(%.2f GB): writing hidden states is slower than the GPU (with files being "
                "written: write to faster storage, or raise write_workers; with none: raise "
                "host_buffers)",
                CONNECTOR_NAME,
                waited,
                self.pending_writes,
                self.backlog_bytes / 1e9,
            )
        self.tasks.put(("rows", slot, req_ids, query_start_loc_cpu.tolist()))
        self.timing["steps"] += 1
        self.timing["engine_save_s"] += time.perf_counter() - t0

    def timing_summary(self) -> str:
        t = self.timing
        steps = max(t["steps"], 1)
        backlog = t["backlog_waited_s"]
        return (
            f"{t['steps']} steps; per step {1e3 * t['engine_save_s'] / steps:.2f} ms of the "
            f"engine thread in save() ({t['engine_waited_s']:.1f} s waiting for host buffers in "
            f"all) and {1e3 * t['drain_s'] / steps:.2f} ms of drain work"
            + (f"; {backlog:.1f} s of drain waiting on write_backlog_gb" if backlog else "")
        )

    def _warn_once(self, key: str, msg: str, *args) -> None:
        if key not in self.warned:
            self.warned.add(key)
            logger.warning(msg, *args)

    def drained(self, timeout: float) -> bool:
        """Wait until the drain thread has done every task queued before this call."""
        done = threading.Event()
        self.tasks.put(("flush", done))
        return done.wait(timeout)

    def close(self, timeout: float = 600.0) -> None:
        if self.store is not None:  # writers waiting for a full store give up soon
            self.store.begin_close()
        if not self.drained(timeout):
            logger.error("%s: hidden-state writer did not drain in %.0f s", CONNECTOR_NAME, timeout)
        self.pool.shutdown(wait=True)
        unfinished = list(self.requests)
        for buf in self.requests.values():  # never finished: leave no lock behind
            release_lock(buf.lock_fd, buf.req.path, remove=True)
        self.requests.clear()
        if self.store is not None:
            self.store.close()
        logger.info(
            "%s: shut down; %d files (%.2f GB) written, %d failed, %d aborted, %d unfinished%s; %s",
            CONNECTOR_NAME,
            self.stats["files"],
            self.stats["bytes"] / 1e9,
            self.stats["failed"],
            self.stats["aborted"],
            len(unfinished),
            f" ({', '.join(unfinished[:5])})" if unfinished else "",
            self.timing_summary(),
        )

    # -- drain thread -----------------------------------------------------
    @torch.inference_mode()  # host buffers are made on the engine thread, in inference mode
    def _drain_loop(self) -> None:
        while True:
            task = self.tasks.get()
            try:
                kind, *args = task
                {"rows": self._on_rows, "finish": self._on_finish, "flush": self._on_flush}[kind](
                    *args
                )
            except Exception:
                logger.exception("%s: hidden-state drain task %s failed", CONNECTOR_NAME, task[0])

    def _on_rows(self, slot: HostSlot, req_ids: list[str], qsl: list[int]) -> None:
        if slot.copied is not None:
            slot.copied.synchronize()
        t0 = time.perf_counter()
        try:
            positions = slot.positions[: qsl[-1]].tolist()
            short: list[tuple[RequestRows, int]] = []  # (buffer, row in the slot)
            for i, req_id in enumerate(req_ids):
                buf = self.requests.get(req_id)
                if buf is None:
                    continue  # aborted, or finished before this step's rows
                s, e = qsl[i], qsl[i + 1]
                if e - s > _SHORT_RUN:
                    try:
                        buf.put(positions[s:e], slot.hidden_states[s:e], slot.norms[s:e])
                    except Exception as err:  # this request alone loses its file
                        self._drop(buf, f"cannot keep its rows: {err}")
                else:
                    short += ((buf, r) for r in range(s, e))
            touched = set()
            if short:  # decode: one gather for the whole step, then references
                index = [r for _, r in short]  # numpy copies whole rows; torch, elements
                block = host_view(slot.hidden_states)[index]
                block_norms = host_view(slot.norms)[index]
                for j, (buf, r) in enumerate(short):
                    if buf.req.req_id not in self.requests:
                        continue  # dropped above
                    try:
                        buf.defer(block, block_norms, j, positions[r])
                    except Exception as err:
                        self._drop(buf, f"cannot keep its rows: {err}")
                        continue
                    touched.add(buf)
            # A request that got no short rows this step (preempted, or prefilling again)
            # files what it holds, so that it keeps no step block alive while it waits.
            for buf in self.deferring - touched:
                try:
                    buf.flush()
                except Exception as err:
                    self._drop(buf, f"cannot keep its rows: {err}")
            self.deferring = {buf for buf in touched if buf.pending}
        finally:
            self.timing["drain_s"] += time.perf_counter() - t0
            slot.free.set()
        self._log_progress()

    def _drop(self, buf: RequestRows, why: str) -> None:
        """Give up on one request: no file and no lock (so its reader fails at once), counted
        and logged once with its id; every other request goes on."""
        self.requests.pop(buf.req.req_id, None)
        self.deferring.discard(buf)
        try:
            release_lock(buf.lock_fd, buf.req.path, remove=True)
        except Exception as e:
            why += f" (and its lock: {e})"
        self._failed(buf.req.req_id, why)
        self._store_error(buf.req.path, why)

    def _failed(self, req_id: str, why: str) -> None:
        logger.error("%s: request %r: no hidden-states file: %s", CONNECTOR_NAME, req_id, why)
        with self.stats_lock:
            self.stats["failed"] += 1

    def _store_error(self, key: str, why: str) -> None:
        """The mooncake backend: its reader gets the error object at once, not a timeout."""
        if self.store is not None:
            self.store.write_error(key, why)

    def _on_finish(self, fin: FinishedRequest) -> None:
        buf = self.requests.pop(fin.req_id, None)
        if buf is None:
            return
        self.deferring.discard(buf)  # from here on only its writer touches it
        if fin.token_ids is None:  # aborted: no file, no lock
            release_lock(buf.lock_fd, buf.req.path, remove=True)
            with self.stats_lock:
                self.stats["aborted"] += 1
            return
        nbytes = len(fin.token_ids) * self.num_layers * self.hidden * self.dtype.itemsize
        limit = self.cfg.write_backlog_gb * 1e9
        with self.stats_lock:
            if self.backlog_bytes and self.backlog_bytes + nbytes > limit:
                self._warn_once(
                    "write_backlog_gb",
                    "%s: %.1f GB of finished requests wait for their files to be written "
                    "(write_backlog_gb=%g): extraction now runs at the speed of the writes "
                    "(write to faster storage, or raise write_workers)",
                    CONNECTOR_NAME,
                    self.backlog_bytes / 1e9,
                    self.cfg.write_backlog_gb,
                )
                t0 = time.perf_counter()
                self.stats_lock.wait_for(
                    lambda: not self.backlog_bytes or self.backlog_bytes + nbytes <= limit
                )
                self.timing["backlog_waited_s"] += time.perf_counter() - t0
            self.backlog_bytes += nbytes
            self.pending_writes += 1
        self.pool.submit(self._write, buf, fin.token_ids, nbytes)

    def _on_flush(self, done: threading.Event) -> None:
        done.set()

    # -- writer threads -----------------------------------------------------
    @torch.inference_mode()
    def _write(self, buf: RequestRows, token_ids: list[int], nbytes: int) -> None:
        path, n = buf.req.path, len(token_ids)
        ok = False
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
            ids = torch.tensor(token_ids, dtype=torch.int64)
            if self.store is None:
                files.write_file(path, hidden_states, ids, scales)
            else:  # the mooncake backend: path is the object's key (no fp8 there)
                self.store.write(path, hidden_states, ids)
            ok = True
        except Exception as e:
            self._failed(buf.req.req_id, f"not written to {path}: {e}")
            self._store_error(path, str(e))
        finally:
            # On failure the lock goes too, so a reader fails at once, not after 10 s.
            release_lock(buf.lock_fd, path, remove=not ok)
            with self.stats_lock:
                self.pending_writes -= 1
                self.backlog_bytes -= nbytes
                self.stats_lock.notify_all()
                if ok:
                    self.stats["files"] += 1
                    self.stats["bytes"] += nbytes
            self._log_progress()

    def _log_progress(self, every: float = 30.0) -> None:
        """The progress line, at most every ``every`` s; from the drain thread after each step
        and from the writers after each file, so a long decode phase is not silent."""
        with self.stats_lock:
            now = time.monotonic()
            if now - self.last_log < every:
                return
            self.last_log = now
            logger.info(
                "%s: %d files (%.2f GB) written, %d failed, %d aborted, "
                "%d writing (%.2f GB), %d requests in flight; %s",
                CONNECTOR_NAME,
                self.stats["files"],
                self.stats["bytes"] / 1e9,
                self.stats["failed"],
                self.stats["aborted"],
                self.pending_writes,
                self.backlog_bytes / 1e9,
                len(self.requests),
                self.timing_summary(),
            )
