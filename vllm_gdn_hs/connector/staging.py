"""Device-to-host staging: a ring of pinned host slots, filled from each step's rows on a side
stream.

The GPU work (norms, and fp8 quantization) runs on the compute stream in chunks of
:data:`CHUNK_TOKENS` (:func:`rows_and_norms`), so its temporaries are small and come out of
the memory vLLM profiled (the runner patch runs it once on the largest step inside
``profile_run``). The side stream only copies; ``record_stream`` keeps the step's GPU tensors
alive until it has, so the runner holds no buffer between steps. A slot is free again once
the drain thread has filed its rows. On CPU (tests) the same path runs with plain copies.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

from vllm_gdn_hs.files import row_norms

CHUNK_TOKENS = 1024  # float32 temporaries of 1,024 x 6 x 5,120: 0.13 GB each at 27B size


def rows_and_norms(hidden_states: torch.Tensor, fp8: bool, chunk: int = CHUNK_TOKENS):
    """What goes to the host for rows [T, L, H]: the rows (with ``fp8``, quantized with
    hs-connectors' per-token float8_e4m3fn scaling) and [T, L] float32 norms of the
    unquantized rows (with ``fp8``, [T, L + 1]: each row's scale as a last column). In chunks
    of ``chunk`` tokens; both are per token, so the chunks change no value."""
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


@dataclass
class HostSlot:
    hidden_states: torch.Tensor  # pinned [max_tokens, L, H]
    norms: torch.Tensor  # pinned [max_tokens, L] float32; with fp8 [max_tokens, L + 1]: + scale
    positions: torch.Tensor  # pinned [max_tokens] int64
    copied: torch.cuda.Event | None  # None on CPU
    free: threading.Event


class HostRing:
    """``num_slots`` pinned slots of ``max_tokens`` rows each, used in turn. With ``fp8`` the
    rows are quantized on the GPU before the copy (hs-connectors' per-token float8_e4m3fn
    scaling), so the copy and the ring are half the size; each row's scale travels as one
    more column after its layer norms, which are taken before quantization."""

    def __init__(self, num_slots, max_tokens, num_layers, hidden, dtype, device, fp8=False):
        cuda = device.type == "cuda"
        self.fp8 = fp8
        self.stream = torch.cuda.Stream(device=device) if cuda else None
        dtype = torch.float8_e4m3fn if fp8 else dtype
        self.slots = [
            HostSlot(
                torch.empty((max_tokens, num_layers, hidden), dtype=dtype, pin_memory=cuda),
                torch.empty((max_tokens, num_layers + fp8), dtype=torch.float32, pin_memory=cuda),
                torch.empty(max_tokens, dtype=torch.int64, pin_memory=cuda),
                torch.cuda.Event() if cuda else None,
                threading.Event(),
            )
            for _ in range(num_slots)
        ]
        for s in self.slots:
            s.free.set()
        self.next = 0

    def copy_out(
        self, hidden_states: torch.Tensor, positions: torch.Tensor
    ) -> tuple[HostSlot, float]:
        """Start copying one step's rows, their norms and positions into the next slot; returns
        the slot and the seconds waited for it (host back-pressure: the drain is behind)."""
        num_tokens = hidden_states.shape[0]
        slot = self.slots[self.next]
        self.next = (self.next + 1) % len(self.slots)
        waited = 0.0
        if not slot.free.is_set():
            start = time.monotonic()
            slot.free.wait()
            waited = time.monotonic() - start
        slot.free.clear()
        rows, norms = rows_and_norms(hidden_states, self.fp8)
        if self.stream is None:
            slot.hidden_states[:num_tokens].copy_(rows)
            slot.norms[:num_tokens].copy_(norms)
            slot.positions[:num_tokens].copy_(positions)
        else:
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                slot.hidden_states[:num_tokens].copy_(rows, non_blocking=True)
                slot.norms[:num_tokens].copy_(norms, non_blocking=True)
                slot.positions[:num_tokens].copy_(positions, non_blocking=True)
                slot.copied.record(self.stream)
            # Made on the compute stream, read on this one: not reused before the copies end.
            for t in (hidden_states, rows, norms, positions):
                t.record_stream(self.stream)
        return slot, waited
