"""The writer's figures as data: :class:`WriterStats` feeds the progress and shutdown lines, the
benchmarks (``benchmarks/writer_throughput.py``, ``decode_contention.py``) and, where the
release has it, vLLM's ``KVConnectorStats`` (:class:`HiddenStatesKVConnectorStats`: vLLM's
``KV Transfer metrics`` log line and its stats loggers).

The log lines keep their wording: ``benchmarks/logparse.py`` finds the last one in an engine
log of a run it did not start in-process.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from typing import Any

try:  # vLLM's stats container for KV connectors (every supported release has it; probed)
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
except ImportError:  # pragma: no cover - a release without it: the log lines only
    KVConnectorStats = None


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
            f"{self.files} {unit} ({self.bytes / 1e9:.2f} GB) written, {self.failed} failed, "
            f"{self.aborted} aborted, {self.writing} writing ({self.backlog_bytes / 1e9:.2f} GB), "
            f"{self.in_flight} requests in flight{since}; {self.timing_summary()}"
        )

    def shutdown_line(self, unfinished_ids: list[str] = (), unit: str = "files") -> str:
        lost = f", {self.lost_at_shutdown} lost at shutdown" if self.lost_at_shutdown else ""
        ids = f" ({', '.join(unfinished_ids[:5])})" if unfinished_ids else ""
        return (
            f"shut down; {self.files} {unit} ({self.bytes / 1e9:.2f} GB) written, {self.failed} "
            f"failed, {self.aborted} aborted, {self.unfinished} unfinished{ids}{lost}; "
            f"{self.timing_summary()}"
        )

    def counters(self) -> dict[str, float]:
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in self.GAUGES
        }


class StatsBook:
    """One :class:`WriterStats` shared by the engine thread, the drain thread and the writers,
    behind one lock; :meth:`interval` gives the change since its last call (vLLM's connectors
    report per interval)."""

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

    def interval(self) -> dict[str, float]:
        """The counters' change since the last call; empty if none changed."""
        with self.lock:
            now = self._stats.counters()
            delta = {k: v - self._reported[k] for k, v in now.items() if v != self._reported[k]}
            self._reported = now
        return delta


if KVConnectorStats is not None:

    @dataclass
    class HiddenStatesKVConnectorStats(KVConnectorStats):
        """The writer's counters over one interval (``data``: name -> change), as vLLM's stats
        loggers collect them from the worker and sum them."""

        def reset(self) -> None:
            self.data = {}

        def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
            for k, v in (other.data or {}).items():
                self.data[k] = self.data.get(k, 0) + v
            return self

        def reduce(self) -> dict[str, int | float]:
            return {
                k: round(v, 3) if isinstance(v, float) else v for k, v in sorted(self.data.items())
            }

        def is_empty(self) -> bool:
            return not any(self.data.values())

    def kv_connector_stats(
        data: dict[str, Any] | None, empty: bool = False
    ) -> HiddenStatesKVConnectorStats | None:
        """vLLM's stats object for ``data``; None for no data unless ``empty``."""
        return HiddenStatesKVConnectorStats(data=dict(data or {})) if data or empty else None

else:  # pragma: no cover
    HiddenStatesKVConnectorStats = None

    def kv_connector_stats(data: dict[str, Any] | None, empty: bool = False) -> None:
        return None
