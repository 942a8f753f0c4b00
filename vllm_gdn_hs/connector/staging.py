"""Device-to-host staging: a ring of pinned host slots, filled from the runner's one-step GPU
buffer on a side stream.

The runner allocates its GPU step buffer before vLLM profiles memory (so it is counted in the
budget), before any connector exists; this ring decides when that buffer may be reused:
:meth:`HostRing.wait_free` makes the compute stream wait, on the GPU, for the last copy out
of it. A slot is free again once the drain thread has filed its rows. On CPU (tests) the same
path runs with plain copies.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

from vllm_gdn_hs.files import row_norms


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
        self.last_copy: torch.cuda.Event | None = None

    def wait_free(self) -> None:
        """Make the current stream wait (on the GPU) for the last copy out of the runner's
        step buffer before it is overwritten."""
        if self.last_copy is not None:
            torch.cuda.current_stream().wait_event(self.last_copy)

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
        if self.stream is None:
            rows, norms = self._rows_and_norms(hidden_states)
            slot.hidden_states[:num_tokens].copy_(rows)
            slot.norms[:num_tokens].copy_(norms)
            slot.positions[:num_tokens].copy_(positions)
        else:
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                rows, norms = self._rows_and_norms(hidden_states)
                slot.hidden_states[:num_tokens].copy_(rows, non_blocking=True)
                slot.norms[:num_tokens].copy_(norms, non_blocking=True)
                slot.positions[:num_tokens].copy_(positions, non_blocking=True)
                slot.copied.record(self.stream)
            self.last_copy = slot.copied
        return slot, waited

    def _rows_and_norms(self, hidden_states: torch.Tensor):
        """What goes to the host: the rows (quantized with fp8) and their norms (of the
        unquantized rows; with fp8 the scale as a last column)."""
        norms = row_norms(hidden_states)
        if not self.fp8:
            return hidden_states, norms
        from hs_connectors.fp8_utils import quantize_tensor_to_fp8

        rows, scales = quantize_tensor_to_fp8(hidden_states)
        return rows, torch.cat([norms, scales.view(-1, 1)], dim=1)
