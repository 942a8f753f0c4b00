"""The host rows of one request, filed by token position until its file is written."""

from __future__ import annotations

import numpy as np
import torch

from vllm_gdn_hs.connector.metadata import NewRequest

# Runs of up to SHORT_RUN rows (decode) are filed 32 to 63 at a time (staggered by request).
SHORT_RUN, PENDING_ROWS = 4, 32


class RequestRows:
    """Host rows of one request by token position. Decode's rows are (block, row) references,
    stacked a few dozen at a time: per-row work stays out of Python (the GIL is shared)."""

    def __init__(
        self,
        req: NewRequest,
        num_layers: int,
        hidden: int,
        dtype: torch.dtype,
        flush_rows: int = PENDING_ROWS,
        norms_width: int | None = None,
    ):
        self.req = req
        self.flush_rows = flush_rows
        self.rows = torch.empty((0, num_layers, hidden), dtype=dtype)
        # Per row: each layer's norm, and with fp8 one more column, the row's scale.
        self.norms = torch.empty((0, norms_width or num_layers), dtype=torch.float32)
        self.seen = bytearray()  # 1 where a position's row has arrived
        self.pending: list[tuple[np.ndarray, np.ndarray, int, int]] = []  # block, norms, i, pos
        try:
            self._resize(max(req.num_prompt_tokens, req.num_rows))
        except RuntimeError:  # no address space for the reservation (strict overcommit)
            self._resize(req.num_prompt_tokens)  # outputs' rows then grow the buffer

    def _resize(self, cap: int) -> None:
        self.rows, self.norms = (_grow(t, cap) for t in (self.rows, self.norms))
        self.seen.extend(bytes(cap - len(self.seen)))
        self._rows, self._norms = host_view(self.rows), host_view(self.norms)

    def defer(self, rows: np.ndarray, norms: np.ndarray, i: int, position: int) -> None:
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
        """Rows and their norms at these token positions (one written again: the later row)."""
        self.flush()  # earlier rows first, so that later ones win
        n = len(positions)
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
        return [] if first < 0 else [q for q in range(first, n) if not self.seen[q]][:5]


def _is_run(positions: list[int]) -> bool:  # consecutive and increasing
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
