"""HybridHiddenStatesConnector: hidden states streamed out of the GPU every step.

Mirrors vLLM's ``ExampleHiddenStatesConnector`` (same request, file and
``kv_transfer_params`` contract, the one speculators reads) but never keeps
hidden states in the paged KV cache, and subclasses ``SupportsHMA`` so GDN
hybrid models (Qwen3.5/3.6) run with the hybrid KV cache manager on.

Data path, per step:
- configuration: the ``extract_hidden_states`` speculative config that
  speculators passes only carries the layer ids; the plugin turns it into
  ``kv_connector_extra_config["layer_ids"]`` and runs no speculative decoding
  (``patch/patch_config_vllm.py``);
- scheduler side: tells the worker which requests are new (file path,
  prompt length) and which finished (token ids to write, or aborted);
- worker side: after each forward pass the runner (``patch/patch_worker_gpu_model_runner.py``)
  copies the target model's aux hidden states into a one-step GPU buffer and
  calls :meth:`HybridHiddenStatesConnector.save_hidden_states`, which copies
  them and their token positions to a pinned host buffer on a side stream. A
  drain thread scatters rows into per-request host tensors by position (a
  position written again keeps the later row: chunked prefill and preemption
  come out right), and a thread pool writes finished requests atomically.

Files: ``{shared_storage_path}/{req_id}.safetensors`` with ``hidden_states``
[T, L, H] (model dtype, layers in the configured order) and ``token_ids``
[T] int64. ``<file>.lock`` is created and ``flock``-ed by the writer before
the response leaves; it is released once the file is complete (the reader
deletes it), as speculators' reader expects.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from vllm_gdn_hs import CONNECTOR_NAME, files, init_logger
from vllm_gdn_hs.config import HiddenStatesConfig, request_params
from vllm_gdn_hs.files import check_norms, release_lock, row_norms, take_lock

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger(__name__)


def config_from(vllm_config: VllmConfig) -> HiddenStatesConfig:
    extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    try:
        return HiddenStatesConfig(**extra)
    except Exception as e:
        raise ValueError(f"{CONNECTOR_NAME}: bad kv_connector_extra_config: {e}") from None


def validate_vllm_config(vllm_config: VllmConfig) -> list[int]:
    """Startup checks; each error names the fix. Returns the layer ids."""
    spec = vllm_config.speculative_config
    if spec is not None:
        raise ValueError(
            f"{CONNECTOR_NAME} extracts hidden states without speculative decoding; "
            f"--speculative-config method {spec.method!r} cannot run with it: drop it, or use "
            '{"method": "extract_hidden_states", ...} only to pass the layer ids'
        )
    layer_ids = list(config_from(vllm_config).layer_ids)
    if not layer_ids:
        raise ValueError(
            f"{CONNECTOR_NAME} needs the layer ids to extract: pass --speculative-config "
            '\'{"method": "extract_hidden_states", "num_speculative_tokens": 1, '
            '"draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [...]}}}\' '
            'or "layer_ids": [...] in kv_connector_extra_config'
        )
    n = vllm_config.model_config.get_num_layers(vllm_config.parallel_config)
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        raise ValueError(
            f"{CONNECTOR_NAME} does not support pipeline parallelism: use tensor or data "
            "parallelism (--tensor-parallel-size / --data-parallel-size) instead of "
            "--pipeline-parallel-size"
        )
    from vllm_gdn_hs.model_info import validate_layer_ids

    try:
        validate_layer_ids(layer_ids, n)
    except ValueError as e:
        raise ValueError(f"{CONNECTOR_NAME}: layer ids: {e}") from None
    import vllm.envs as envs

    # vLLM 0.26.0 decides the runner in VllmConfig (the runner patch keeps it on V1);
    # vLLM 0.20.1 only by the environment variable.
    if getattr(vllm_config, "use_v2_model_runner", envs.VLLM_USE_V2_MODEL_RUNNER):
        raise ValueError(
            f"{CONNECTOR_NAME} works with vLLM's V1 GPU model runner: unset "
            "VLLM_USE_V2_MODEL_RUNNER (or set it to 0)"
        )
    if vllm_config.cache_config.enable_prefix_caching:
        raise ValueError(
            f"{CONNECTOR_NAME} does not support prefix caching (cached prefixes have no hidden "
            "states): pass --no-enable-prefix-caching (LLM(..., enable_prefix_caching=False))"
        )
    return layer_ids


# ---------------------------------------------------------------------------
# Metadata: scheduler side -> worker side, once per step
# ---------------------------------------------------------------------------


@dataclass
class NewRequest:
    req_id: str
    path: str
    num_prompt_tokens: int
    # Rows to reserve: the prompt, plus the outputs with include_output_tokens (the host
    # buffer is reserved, not touched, so an unused reservation costs no memory).
    num_rows: int = 0


@dataclass
class FinishedRequest:
    req_id: str
    token_ids: list[int] | None  # None: aborted, drop everything


@dataclass
class HybridHiddenStatesConnectorMetadata(KVConnectorMetadata):
    new_requests: list[NewRequest] = field(default_factory=list)
    finished_requests: list[FinishedRequest] = field(default_factory=list)


# ---------------------------------------------------------------------------
# Worker side: host buffers, drain thread, writers
# ---------------------------------------------------------------------------


# Runs of up to this many rows (decode steps) are gathered per step and filed in batches
# of 32 to 63 rows per request (staggered, so that requests decoding in lockstep do not
# all file in the same step); longer runs (prefill chunks) are copied at once. So up to
# 63 steps' blocks of decode rows stay alive: at 27B with 256 requests decoding, 1 GB.
_SHORT_RUN, _PENDING_ROWS = 4, 32


class _RequestBuffer:
    """Host rows of one request, indexed by token position.

    The drain thread shares the GIL with the engine thread, which in eager mode spends a
    decode step issuing kernels. So the per-row work of decode stays out of Python: a
    step's short runs are gathered into one block by one numpy call (which lets go of
    the GIL while it copies), each request keeps (block, row) references, and files them
    a few dozen at a time, stacking numpy views (bf16 as int16, the same bytes; a tenth of
    the cost of a torch call) straight into place. A block lives until every request
    holding rows of it has filed them. Long runs (prefill) are copied by torch, in parallel.
    """

    def __init__(
        self,
        req: NewRequest,
        num_layers: int,
        hidden: int,
        dtype: torch.dtype,
        flush_rows: int = _PENDING_ROWS,
        lock: bool = True,
    ):
        self.req = req
        self.flush_rows = flush_rows
        self.rows = torch.empty((0, num_layers, hidden), dtype=dtype)
        self.norms = torch.empty((0, num_layers), dtype=torch.float32)
        self.seen = bytearray()  # 1 where a position's row has arrived
        self.pending: list[tuple[np.ndarray, np.ndarray, int, int]] = []  # block, norms, i, pos
        try:
            self._resize(max(req.num_prompt_tokens, req.num_rows))
        except RuntimeError:  # no address space for the reservation (strict overcommit)
            self._resize(req.num_prompt_tokens)  # outputs' rows then grow the buffer
        self.lock_fd = take_lock(req.path) if lock else None

    def _resize(self, cap: int) -> None:
        self.rows, self.norms = (_grow(t, cap) for t in (self.rows, self.norms))
        self.seen.extend(bytes(cap - len(self.seen)))
        self._rows, self._norms = host_view(self.rows), host_view(self.norms)

    def defer(self, rows: np.ndarray, norms: np.ndarray, i: int, position: int) -> None:
        """Row i of a step's block of short-run rows, for this position."""
        self.pending.append((rows, norms, i, position))
        if len(self.pending) >= self.flush_rows:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        pending, self.pending = self.pending, []
        positions = [q for *_, q in pending]
        rows = [b[i] for b, _, i, _ in pending]
        norms = [n[i] for _, n, i, _ in pending]
        start, end = positions[0], positions[-1] + 1
        if _is_run(positions) and end <= len(self.seen):  # decode
            np.stack(rows, out=self._rows[start:end])
            np.stack(norms, out=self._norms[start:end])
            self.seen[start:end] = b"\x01" * len(positions)
        else:
            self.put(
                positions,
                torch.from_numpy(np.stack(rows)).view(self.rows.dtype),
                torch.from_numpy(np.stack(norms)).view(torch.float32),
            )

    def put(self, positions: list[int], rows: torch.Tensor, norms: torch.Tensor) -> None:
        """Rows and their norms at these token positions; a position written again keeps
        the later row."""
        self.flush()  # earlier rows first, so that later ones win
        n = len(positions)
        if n == 0:
            return
        start, end = positions[0], positions[-1] + 1
        contiguous = _is_run(positions)
        needed = end if contiguous else max(positions) + 1
        if needed > len(self.seen):  # generated tokens
            self._resize(max(needed, 2 * len(self.seen)))
        if contiguous:  # the usual case: one run of positions
            self.rows[start:end] = rows
            self.norms[start:end] = norms
            self.seen[start:end] = b"\x01" * n
        else:
            last = {q: k for k, q in enumerate(positions)}  # a repeated position: the later row
            src, dst = torch.tensor(list(last.values())), torch.tensor(list(last))
            self.rows[dst] = rows[src]
            self.norms[dst] = norms[src]
            for q in last:
                self.seen[q] = 1

    def missing(self, n: int) -> list[int] | None:
        """Up to 5 of the first n positions without a row; None if n is beyond the buffer."""
        if n > len(self.seen):
            return None
        first = self.seen.find(0, 0, n)
        if first < 0:
            return []
        return [q for q in range(first, n) if not self.seen[q]][:5]


def _is_run(positions: list[int]) -> bool:
    """Whether the positions are consecutive and increasing (a prefill chunk, decode rows)."""
    start, n = positions[0], len(positions)
    return positions[-1] - start == n - 1 and (n <= 2 or positions == list(range(start, start + n)))


def host_view(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor, as integers of the same width (numpy has no bf16)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.view(ints[t.element_size()]).numpy()


def _grow(t: torch.Tensor, cap: int) -> torch.Tensor:
    grown = torch.empty((cap, *t.shape[1:]), dtype=t.dtype)  # pages are touched on write
    grown[: t.shape[0]] = t
    return grown


@dataclass
class _Slot:
    hidden_states: torch.Tensor  # pinned [max_tokens, L, H]
    norms: torch.Tensor  # pinned [max_tokens, L] float32
    positions: torch.Tensor  # pinned [max_tokens] int64
    copied: torch.cuda.Event | None  # None on CPU
    free: threading.Event


class HiddenStatesWriter:
    """Device-to-host copies, the drain thread and the file writers of one worker."""

    def __init__(
        self,
        cfg: HiddenStatesConfig,
        max_tokens: int,
        num_layers: int,
        hidden: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.cfg, self.num_layers, self.hidden, self.dtype = cfg, num_layers, hidden, dtype
        # On CUDA: pinned host buffers filled by a side stream. On CPU (tests)
        # the same path runs with plain copies.
        cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device=device) if cuda else None
        self.slots = [
            _Slot(
                torch.empty((max_tokens, num_layers, hidden), dtype=dtype, pin_memory=cuda),
                torch.empty((max_tokens, num_layers), dtype=torch.float32, pin_memory=cuda),
                torch.empty(max_tokens, dtype=torch.int64, pin_memory=cuda),
                torch.cuda.Event() if cuda else None,
                threading.Event(),
            )
            for _ in range(cfg.host_buffers)
        ]
        for s in self.slots:
            s.free.set()
        self.next_slot = 0
        self.last_copy: torch.cuda.Event | None = None
        self.requests: dict[str, _RequestBuffer] = {}
        self.created = 0  # request buffers made, to stagger their flushes
        self.deferring: set[_RequestBuffer] = set()  # buffers holding rows of step blocks
        self.tasks: queue.Queue = queue.Queue()
        self.pool = ThreadPoolExecutor(cfg.write_workers, thread_name_prefix="hs-write")
        self.pending_writes = 0
        self.stats = dict(files=0, bytes=0, failed=0, aborted=0)
        # Host cost, for the logs: steps saved, seconds of the engine thread in save()
        # (waits for a free host buffer included, and counted apart), of drain work.
        self.timing = dict(steps=0, engine_save_s=0.0, engine_waited_s=0.0, drain_s=0.0)
        self.stats_lock = threading.Lock()
        # Rows of finished requests not yet written, bounded by write_backlog_gb: past it
        # the drain thread waits for the writers, the ring fills and the engine slows to
        # the speed of the writes instead of the host running out of memory.
        self.backlog_bytes = 0
        self.backlog = threading.Condition(self.stats_lock)
        self.last_log = time.monotonic()
        self.drain = threading.Thread(target=self._drain_loop, name="hs-drain", daemon=True)
        self.drain.start()

    # -- engine thread ----------------------------------------------------
    def wait_staging_free(self) -> None:
        """Make the current stream wait (on the GPU) for the last copy out of
        the one-step staging buffer before it is overwritten."""
        if self.last_copy is not None:
            torch.cuda.current_stream().wait_event(self.last_copy)

    def on_metadata(self, meta: HybridHiddenStatesConnectorMetadata) -> None:
        for req in meta.new_requests:
            if req.req_id in self.requests:
                continue
            try:
                self.requests[req.req_id] = _RequestBuffer(
                    req,
                    self.num_layers,
                    self.hidden,
                    self.dtype,
                    flush_rows=_PENDING_ROWS + self.created % _PENDING_ROWS,
                    lock=self.cfg.use_synchronization_lock,
                )
                self.created += 1
            except Exception as e:  # never stop the engine for one request's file
                self._failed(req.req_id, f"cannot lock {req.path}.lock: {e}")
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
        num_tokens = hidden_states.shape[0]
        slot = self.slots[self.next_slot]
        self.next_slot = (self.next_slot + 1) % len(self.slots)
        if not slot.free.is_set():  # host back-pressure: the drain thread is behind
            start = time.monotonic()
            slot.free.wait()
            waited = time.monotonic() - start
            self.timing["engine_waited_s"] += waited
            if waited > 0.5:
                logger.warning_once(
                    "%s: the engine waited %.1f s for host buffers: writing hidden states "
                    "is slower than the GPU (write to faster storage, or raise host_buffers "
                    "/ write_workers)",
                    CONNECTOR_NAME,
                    waited,
                )
        slot.free.clear()
        if self.stream is None:
            slot.hidden_states[:num_tokens].copy_(hidden_states)
            slot.norms[:num_tokens].copy_(row_norms(hidden_states))
            slot.positions[:num_tokens].copy_(positions)
        else:
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                slot.hidden_states[:num_tokens].copy_(hidden_states, non_blocking=True)
                slot.norms[:num_tokens].copy_(row_norms(hidden_states), non_blocking=True)
                slot.positions[:num_tokens].copy_(positions, non_blocking=True)
                slot.copied.record(self.stream)
            self.last_copy = slot.copied
        self.tasks.put(("rows", slot, req_ids, query_start_loc_cpu.tolist()))
        self.timing["steps"] += 1
        self.timing["engine_save_s"] += time.perf_counter() - t0

    def timing_summary(self) -> str:
        t = self.timing
        steps = max(t["steps"], 1)
        return (
            f"{t['steps']} steps; per step {1e3 * t['engine_save_s'] / steps:.2f} ms of the "
            f"engine thread in save() ({t['engine_waited_s']:.1f} s waiting for host buffers in "
            f"all) and {1e3 * t['drain_s'] / steps:.2f} ms of drain work"
        )

    def drained(self, timeout: float) -> bool:
        """Wait until the drain thread has done every task queued before this call."""
        done = threading.Event()
        self.tasks.put(("flush", done))
        return done.wait(timeout)

    def close(self, timeout: float = 600.0) -> None:
        if not self.drained(timeout):
            logger.error("%s: hidden-state writer did not drain in %.0f s", CONNECTOR_NAME, timeout)
        self.pool.shutdown(wait=True)
        unfinished = list(self.requests)
        for buf in self.requests.values():  # never finished: leave no lock behind
            release_lock(buf.lock_fd, buf.req.path, remove=True)
        self.requests.clear()
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
                getattr(self, "_on_" + task[0])(*task[1:])
            except Exception:
                logger.exception("%s: hidden-state drain task %s failed", CONNECTOR_NAME, task[0])

    def _on_rows(self, slot: _Slot, req_ids: list[str], qsl: list[int]) -> None:
        if slot.copied is not None:
            slot.copied.synchronize()
        t0 = time.perf_counter()
        try:
            positions = slot.positions[: qsl[-1]].tolist()
            short: list[tuple[_RequestBuffer, int]] = []  # (buffer, row in the slot)
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

    def _drop(self, buf: _RequestBuffer, why: str) -> None:
        """Give up on one request: no file and no lock (so its reader fails at once), counted
        and logged once with its id; every other request goes on."""
        self.requests.pop(buf.req.req_id, None)
        self.deferring.discard(buf)
        try:
            release_lock(buf.lock_fd, buf.req.path, remove=True)
        except Exception as e:
            why += f" (and its lock: {e})"
        self._failed(buf.req.req_id, why)

    def _failed(self, req_id: str, why: str) -> None:
        logger.error("%s: request %r: no hidden-states file: %s", CONNECTOR_NAME, req_id, why)
        with self.stats_lock:
            self.stats["failed"] += 1

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
        with self.backlog:
            if self.backlog_bytes and self.backlog_bytes + nbytes > limit:
                logger.warning_once(
                    "%s: %.1f GB of finished requests wait for their files to be written "
                    "(write_backlog_gb=%g): extraction now runs at the speed of the writes "
                    "(write to faster storage, or raise write_workers)",
                    CONNECTOR_NAME,
                    self.backlog_bytes / 1e9,
                    self.cfg.write_backlog_gb,
                )
                self.backlog.wait_for(
                    lambda: not self.backlog_bytes or self.backlog_bytes + nbytes <= limit
                )
            self.backlog_bytes += nbytes
            self.pending_writes += 1
        self.pool.submit(self._write, buf, fin.token_ids, nbytes)

    def _on_flush(self, done: threading.Event) -> None:
        done.set()

    # -- writer threads -----------------------------------------------------
    @torch.inference_mode()
    def _write(self, buf: _RequestBuffer, token_ids: list[int], nbytes: int) -> None:
        path, n = buf.req.path, len(token_ids)
        ok = False
        try:
            buf.flush()
            missing = buf.missing(n)
            if missing is None or missing:
                where = "beyond the rows computed" if missing is None else missing
                raise RuntimeError(f"hidden states missing for token positions {where}")
            hidden_states = buf.rows[:n]
            if self.cfg.validate_rows and (why := check_norms(buf.norms[:n])):
                raise RuntimeError(why)
            files.write_file(path, hidden_states, torch.tensor(token_ids, dtype=torch.int64))
            ok = True
        except Exception as e:
            logger.error(
                "%s: request %r: no hidden-states file written to %s: %s",
                CONNECTOR_NAME,
                buf.req.req_id,
                path,
                e,
            )
        finally:
            # On failure the lock goes too, so a reader fails at once, not after 10 s.
            release_lock(buf.lock_fd, path, remove=not ok)
            with self.backlog:
                self.pending_writes -= 1
                self.backlog_bytes -= nbytes
                self.backlog.notify_all()
                self.stats["files" if ok else "failed"] += 1
                if ok:
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


# ---------------------------------------------------------------------------
# The connector
# ---------------------------------------------------------------------------


class HybridHiddenStatesConnector(KVConnectorBase_V1, SupportsHMA):
    """Writes each request's hidden states to one safetensors file."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.cfg = config_from(vllm_config)
        self.layer_ids = validate_vllm_config(vllm_config)
        self.storage_path = os.path.abspath(self.cfg.shared_storage_path)
        self.custom_root = os.path.abspath(self.cfg.custom_save_root or self.storage_path)
        # Scheduler side
        # request id -> (file, rows to reserve, include_output_tokens)
        self._paths: dict[str, tuple[str, int, bool]] = {}
        self._refused: dict[str, str] = {}  # request id -> why it gets no file
        self._finished: list[FinishedRequest] = []
        self._max_model_len = vllm_config.model_config.max_model_len
        # Worker side
        self._writer: HiddenStatesWriter | None = None
        if role == KVConnectorRole.SCHEDULER:
            if why := files.check_storage_path(self.storage_path):
                raise ValueError(
                    f"{CONNECTOR_NAME}: shared_storage_path {self.storage_path!r} is not "
                    f"writable ({why}); pass a writable folder: --hidden-states-path DIR to the "
                    'launcher, or "shared_storage_path" in --kv-transfer-config\'s '
                    "kv_connector_extra_config"
                )
            logger.info("%s: layers %s -> %s", CONNECTOR_NAME, self.layer_ids, self.storage_path)
            if self.cfg.allow_custom_save_path:
                logger.warning(
                    "%s: allow_custom_save_path is on: any client may choose where its file is "
                    "written, anywhere under %s (custom_save_root)",
                    CONNECTOR_NAME,
                    self.custom_root,
                )
        elif self._is_writer_rank():
            self._writer = self._make_writer(vllm_config)

    @staticmethod
    def _is_writer_rank() -> bool:
        from vllm.distributed.parallel_state import get_tp_group

        return get_tp_group().rank_in_group == 0

    def _make_writer(self, vllm_config: VllmConfig) -> HiddenStatesWriter:
        sched = vllm_config.scheduler_config
        return HiddenStatesWriter(
            self.cfg,
            max_tokens=sched.max_num_batched_tokens,
            num_layers=len(self.layer_ids),
            hidden=vllm_config.model_config.get_hidden_size(),
            dtype=vllm_config.model_config.dtype,
            device=torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu"),
        )

    # ==============================
    # Worker side
    # ==============================
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self._writer is not None and self.has_connector_metadata():
            meta = self._get_connector_metadata()
            assert isinstance(meta, HybridHiddenStatesConnectorMetadata)
            self._writer.on_metadata(meta)

    def wait_staging_free(self) -> None:
        if self._writer is not None:
            self._writer.wait_staging_free()

    def save_hidden_states(
        self,
        hidden_states: torch.Tensor,
        req_ids: list[str],
        query_start_loc_cpu: torch.Tensor,
        positions: torch.Tensor,
    ) -> None:
        """Called by the patched runner after each forward pass with the step's rows."""
        if self._writer is not None:
            self._writer.save(hidden_states, req_ids, query_start_loc_cpu, positions)

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        pass  # nothing lives in the KV cache

    def wait_for_save(self) -> None:
        pass

    def shutdown(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    # ==============================
    # Scheduler side
    # ==============================
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if request.request_id in self._paths or request.request_id in self._refused:
            return  # not its first allocation
        try:
            params = request_params(request.kv_transfer_params)
            path = self._path_for(request.request_id, params.hidden_states_path)
        except Exception as e:  # the client's input: refused for this request alone
            self._refuse(request.request_id, str(e))
            return
        outputs = request.max_tokens if params.include_output_tokens else 0
        rows = min(request.num_prompt_tokens + outputs, self._max_model_len)
        self._paths[request.request_id] = (path, rows, params.include_output_tokens)

    def _refuse(self, req_id: str, why: str) -> None:
        """No file for this request: the reason goes into its response's kv_transfer_params
        (``hidden_states_error``) and the log; the request itself is served as usual."""
        self._refused[req_id] = why
        logger.warning("%s: request %r: no hidden states: %s", CONNECTOR_NAME, req_id, why)

    def _path_for(self, req_id: str, custom: str | None) -> str:
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

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
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

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        if (why := self._refused.pop(request.request_id, None)) is not None:
            return False, {"hidden_states_error": why}
        path, _, include_output_tokens = self._paths.pop(request.request_id, (None, 0, False))
        if path is None:
            return False, None
        if request.status == RequestStatus.FINISHED_ABORTED:
            self._finished.append(FinishedRequest(request.request_id, None))
            return False, None
        if include_output_tokens:
            token_ids = list(request.all_token_ids[:-1])  # the last one was never run
        else:
            token_ids = list(request.prompt_token_ids or ())
        self._finished.append(FinishedRequest(request.request_id, token_ids))
        return False, {"hidden_states_path": path}

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))
