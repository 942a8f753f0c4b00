"""The writer's figures (:class:`WriterStats`) for the progress and shutdown lines, vLLM's
``KV Transfer metrics`` line (:class:`HiddenStatesKVConnectorStats`) and ``/metrics``.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1 import metrics
from vllm.v1.metrics.utils import create_metric_per_engine

from vllm_gdn_hs.names import init_logger

logger = init_logger(__name__)


@dataclass
class WriterStats:
    """Totals since the worker side started; the last three are gauges (now)."""

    files: int = 0  # written, complete, lock released
    bytes: int = 0  # of hidden states in those files
    failed: int = 0  # requests that got no file (logged each with its id)
    aborted: int = 0  # aborted by the client or the engine: no file, no lock
    lost_at_shutdown: int = 0  # finished, not written within shutdown_drain_s: lock removed
    unfinished: int = 0  # still running at shutdown: lock removed
    steps: int = 0  # forward passes whose rows were saved
    engine_save_s: float = 0.0  # of the engine thread in save(), waits included
    engine_waited_s: float = 0.0  # of those, waiting for a free host buffer
    drain_s: float = 0.0  # of the drain thread filing rows
    backlog_waited_s: float = 0.0  # of the drain thread waiting on write_backlog_gb
    writing: int = 0  # files queued or being written
    backlog_bytes: int = 0  # their rows in host memory
    in_flight: int = 0  # requests whose rows are being filed

    GAUGES = ("writing", "backlog_bytes", "in_flight")

    def timing_summary(self) -> str:
        steps = max(self.steps, 1)
        backlog = self.backlog_waited_s
        return (
            f"{self.steps} steps; per step {1e3 * self.engine_save_s / steps:.2f} ms of the "
            f"engine thread in save() ({self.engine_waited_s:.1f} s waiting for host buffers in "
            f"all) and {1e3 * self.drain_s / steps:.2f} ms of drain work"
            + (f"; {backlog:.1f} s of drain waiting on write_backlog_gb" if backlog else "")
        )

    def progress_line(self, unit: str = "files", rate: tuple | None = None) -> str:
        """``rate``: (seconds, files, bytes) since the last line, for its rate."""
        since = ""
        if rate and rate[0] > 0:
            s, n, size = rate
            since = f"; {size / s / 1e9:.2f} GB/s, {n / s:.1f} {unit}/s over the last {s:.0f} s"
        return (
            f"{self._totals(unit)}, {self.writing} writing ({self.backlog_bytes / 1e9:.2f} GB), "
            f"{self.in_flight} requests in flight{since}; {self.timing_summary()}"
        )

    def shutdown_line(self, unfinished_ids: Sequence[str] = (), unit: str = "files") -> str:
        lost = f", {self.lost_at_shutdown} lost at shutdown" if self.lost_at_shutdown else ""
        ids = f" ({', '.join(unfinished_ids[:5])})" if unfinished_ids else ""
        return (
            f"shut down; {self._totals(unit)}, {self.unfinished} unfinished{ids}{lost}; "
            f"{self.timing_summary()}"
        )

    def _totals(self, unit: str) -> str:
        written = f"{self.files} {unit} ({self.bytes / 1e9:.2f} GB) written"
        return f"{written}, {self.failed} failed, {self.aborted} aborted"

    def counters(self) -> dict[str, float]:
        fields = dataclasses.fields(self)
        return {f.name: getattr(self, f.name) for f in fields if f.name not in self.GAUGES}


class StatsBook:
    """One :class:`WriterStats` for every thread, behind one lock; :meth:`interval` gives the
    change since its last call."""

    def __init__(self):
        self.lock = threading.Lock()
        self._stats = WriterStats()
        self._reported = WriterStats().counters()

    def add(self, **deltas: float) -> None:
        with self.lock:
            for name, d in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + d)

    def snapshot(self) -> WriterStats:
        with self.lock:
            return dataclasses.replace(self._stats)

    def interval(self, gauges: Mapping[str, float]) -> dict[str, float]:
        """The counters' change since the last call, and the ``gauges`` that changed."""
        with self.lock:
            now = self._stats.counters()
            delta = {k: v - self._reported[k] for k, v in now.items() if v != self._reported[k]}
            delta |= {k: v for k, v in gauges.items() if v != self._reported.get(k, 0)}
            self._reported = now | gauges
        return delta


def failed(book: StatsBook, req_id: str, why: str, counter: str = "failed") -> None:
    logger.error("request %r: no hidden-states file: %s", req_id, why)
    book.add(**{counter: 1})


@dataclass
class HiddenStatesKVConnectorStats(metrics.KVConnectorStats):
    """The figures of one interval (a counter's change, a gauge's new value)."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: metrics.KVConnectorStats) -> metrics.KVConnectorStats:
        for k, v in (other.data or {}).items():
            self.data[k] = v if k in WriterStats.GAUGES else self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        """The log line's counters, not the gauges (vLLM sums several engines' into one)."""
        return {
            k: round(v, 3) if isinstance(v, float) else v
            for k, v in sorted(self.data.items())
            if k not in WriterStats.GAUGES
        }

    def is_empty(self) -> bool:  # a gauge back at 0 is news
        return not any(v or k in WriterStats.GAUGES for k, v in self.data.items())


# WriterStats field -> its series vllm:hidden_states_<name> and help; not the shutdown figures.
PROM_SERIES = {
    "files": ("saved_total", "Requests whose hidden states were saved whole."),
    "bytes": ("saved_bytes_total", "Bytes of hidden states saved."),
    "failed": ("failed_total", "Requests that got no hidden states (each logged with its id)."),
    "aborted": ("aborted_total", "Requests aborted by the client or the engine."),
    "steps": ("steps_total", "Forward passes whose rows were saved."),
    "engine_save_s": ("engine_save_seconds_total", "Time of the engine thread in save()."),
    "engine_waited_s": (
        "engine_wait_seconds_total",
        "Time the engine waited for a free host buffer (growing: the storage is too slow).",
    ),
    "drain_s": ("drain_seconds_total", "Time of the drain thread filing rows."),
    "backlog_waited_s": (
        "backlog_wait_seconds_total",
        "Time the drain thread waited for the write backlog (write_backlog_gb) to shrink.",
    ),
    "writing": ("writing", "Finished requests whose file or object is being written."),
    "backlog_bytes": ("backlog_bytes", "Host memory held by their rows (write_backlog_gb)."),
    "in_flight": ("in_flight", "Requests whose rows are being collected."),
}


class HiddenStatesPromMetrics(metrics.KVConnectorPromMetrics):
    """The writer's figures on ``/metrics``, one child per engine (vLLM's labels)."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.per_engine: dict[str, dict[int, Any]] = {}
        for key, (series, doc) in PROM_SERIES.items():
            kw = dict(name=f"vllm:hidden_states_{series}", documentation=doc, labelnames=labelnames)
            if key in WriterStats.GAUGES:
                metric = self._gauge_cls(**kw, multiprocess_mode="mostrecent")
            else:
                metric = self._counter_cls(**kw)
            self.per_engine[key] = create_metric_per_engine(metric, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            if (child := self.per_engine.get(key, {}).get(engine_idx)) is None:
                continue  # a figure not exported (see PROM_SERIES)
            if key in WriterStats.GAUGES:
                child.set(value)
            elif value > 0:
                child.inc(value)
