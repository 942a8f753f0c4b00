"""Device-to-host staging: a ring of pinned host rows, one slot per step, filled on a side
stream that only copies; the GPU work (norms, fp8) runs on the compute stream in small chunks
(:func:`rows_and_norms`). A slot filled a layer at a time takes one strided DMA per layer.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

from vllm_gdn_hs.rows import CHUNK_TOKENS, row_norms


def rows_and_norms(hidden_states: torch.Tensor, fp8: bool, chunk: int = CHUNK_TOKENS):
    """The rows [T, L, H] to copy (``fp8``: quantized per token, as hs-connectors does) and [T, L]
    float32 norms of the unquantized rows (``fp8``: each row's scale last), by token chunks."""
    num_tokens, num_layers = hidden_states.shape[:2]
    norms = hidden_states.new_empty((num_tokens, num_layers + fp8), dtype=torch.float32)
    rows = hidden_states
    if fp8:
        from hs_connectors.fp8_utils import quantize_tensor_to_fp8

        rows = torch.empty_like(hidden_states, dtype=torch.float8_e4m3fn)
    for s in range(0, num_tokens, chunk):
        h = hidden_states[s : s + chunk]
        norms[s : s + chunk, :num_layers] = row_norms(h)
        if fp8:
            q, scales = quantize_tensor_to_fp8(h)
            rows[s : s + chunk] = q
            norms[s : s + chunk, num_layers] = scales.view(-1)
    return rows, norms


@dataclass(eq=False)
class HostSlot:
    """One step's rows in the ring: views of exactly its rows, in pinned host memory."""

    ring: HostRing
    start: int  # first row in the ring
    hidden_states: torch.Tensor  # [tokens, L, H]
    norms: torch.Tensor  # [tokens, L] float32; with fp8 [tokens, L + 1]: + each row's scale
    positions: torch.Tensor  # [tokens] int64
    copied: torch.cuda.Event | None  # None on CPU
    released: bool = False

    @property
    def end(self) -> int:
        return self.start + self.positions.shape[0]

    def release(self) -> None:
        """Give the rows back to the ring, which frees them once every older slot is back."""
        self.ring.release(self)

    def fill_layer(self, column: int, rows: torch.Tensor) -> None:
        """Start copying a layer's rows [tokens, H] into their column (the caller may drop them)."""
        _side_copy(self.ring.stream, [(self.hidden_states[:, column], rows)])

    def finish(self, norms: torch.Tensor, positions: torch.Tensor) -> None:
        """After its layers: the norms and positions; ``copied`` then marks all copies done."""
        pairs = [(self.norms, norms), (self.positions, positions)]
        _side_copy(self.ring.stream, pairs, self.copied)


def _side_copy(stream, pairs, done=None, keep=()) -> None:
    """Copy each (host, GPU) pair on the side ``stream`` after the compute stream's work, the
    sources and ``keep`` kept alive; ``done`` marks the end. On CPU, plain copies."""
    if stream is None or not pairs[0][1].is_cuda:
        for dst, src in pairs:
            dst.copy_(src)
        return
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for dst, src in pairs:
            if dst.is_contiguous():
                dst.copy_(src, non_blocking=True)
            else:
                _copy_rows_2d(dst, src.contiguous(), stream)
        if done is not None:
            done.record(stream)
    for t in (*(src for _, src in pairs), *keep):
        if t.is_cuda:
            t.record_stream(stream)


def _copy_rows_2d(dst: torch.Tensor, src: torch.Tensor, stream) -> None:
    """One DMA of GPU rows [T, H] into a slot's column (torch would stage it through pageable
    memory and wait)."""
    from cuda.bindings import runtime

    assert dst.dim() == 2 and dst.stride(1) == 1 and dst.shape == src.shape, (dst, src)
    item = src.element_size()
    (err,) = runtime.cudaMemcpy2DAsync(
        dst.data_ptr(),
        dst.stride(0) * item,
        src.data_ptr(),
        src.shape[1] * item,
        src.shape[1] * item,
        src.shape[0],
        runtime.cudaMemcpyKind.cudaMemcpyDeviceToHost,
        stream.cuda_stream,
    )
    if err != runtime.cudaError_t.cudaSuccess:
        raise RuntimeError(f"cudaMemcpy2DAsync of {tuple(src.shape)} rows: {err.name}")


def strided_copy_works(device: torch.device) -> bool:
    """Whether :func:`_copy_rows_2d` works on ``device``: checked at startup, on a few rows."""
    try:
        host = torch.zeros((3, 2, 4), dtype=torch.bfloat16, pin_memory=True)
        rows = torch.arange(12, dtype=torch.bfloat16, device=device).view(3, 4)
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        _copy_rows_2d(host[:, 1], rows, stream)
        stream.synchronize()
        return bool(torch.equal(host[:, 1], rows.cpu()) and not host[:, 0].any())
    except Exception:
        return False


class HostRing:
    """Pinned host rows for ``num_slots`` of the largest steps, handed out in order, each step
    taking only its rows; with ``fp8``, quantized rows and each row's scale after its norms."""

    def __init__(self, num_slots, max_tokens, num_layers, hidden, dtype, device, fp8=False):
        cuda = device.type == "cuda"
        self.fp8 = fp8
        self.stream = torch.cuda.Stream(device=device) if cuda else None
        self.capacity = n = num_slots * max_tokens
        dtype = torch.float8_e4m3fn if fp8 else dtype
        self.hidden_states = torch.empty((n, num_layers, hidden), dtype=dtype, pin_memory=cuda)
        self.norms = torch.empty((n, num_layers + fp8), dtype=torch.float32, pin_memory=cuda)
        self.positions = torch.empty(n, dtype=torch.int64, pin_memory=cuda)
        self.live: deque[HostSlot] = deque()  # handed out, oldest first
        self.room = threading.Condition()

    def _fit(self, num_tokens: int) -> int | None:
        """The first row of ``num_tokens`` free rows after the newest slot, or None."""
        if not self.live:
            return 0
        head, tail = self.live[-1].end, self.live[0].start
        if tail < head:  # in use: [tail, head); free: [head, capacity) and [0, tail)
            if self.capacity - head >= num_tokens:
                return head
            return 0 if tail >= num_tokens else None
        return head if tail - head >= num_tokens else None  # wrapped: free is [head, tail)

    def take(self, num_tokens: int) -> tuple[HostSlot, float]:
        """Rows for one step, and the seconds waited (the drain is behind)."""
        if not 0 < num_tokens <= self.capacity:
            raise ValueError(f"a step of {num_tokens} rows in a ring of {self.capacity}")
        with self.room:
            began, waited = time.monotonic(), 0.0
            while (start := self._fit(num_tokens)) is None:
                self.room.wait()
                waited = time.monotonic() - began
            span = slice(start, start + num_tokens)
            done = torch.cuda.Event() if self.stream is not None else None
            slot = HostSlot(
                self, start, self.hidden_states[span], self.norms[span], self.positions[span], done
            )
            self.live.append(slot)
        return slot, waited

    def release(self, slot: HostSlot) -> None:
        with self.room:
            slot.released = True
            while self.live and self.live[0].released:
                self.live.popleft()
            self.room.notify_all()

    def copy_out(self, rows: torch.Tensor, positions: torch.Tensor) -> tuple[HostSlot, float]:
        """Start copying one step's rows, norms and positions into the ring (as :meth:`take`)."""
        slot, waited = self.take(rows.shape[0])
        stored, norms = rows_and_norms(rows, self.fp8)  # fp8: quantized
        pairs = [(slot.hidden_states, stored), (slot.norms, norms), (slot.positions, positions)]
        _side_copy(self.stream, pairs, slot.copied, keep=(rows,))
        return slot, waited
