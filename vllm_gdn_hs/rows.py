"""The check every row passes before it is shipped: no NaN/Inf, no all-zero row. The
connector checks the norms it computes on the GPU; ``check`` and the reference, whole rows."""

from __future__ import annotations

import torch

# Tokens per chunk where norms (and fp8 scales) are taken on the GPU, so that their float32
# temporaries stay small: 1,024 x 6 x 5,120 (a step's rows) is 0.13 GB at 27B size.
CHUNK_TOKENS = 1024


def row_norms(hidden_states):
    """[T, L, H] -> [T, L] float32 norms: NaN/Inf if a value is, 0 for an all-zero row;
    computed next to the copy out of the GPU, so the host checks T x L numbers, not T x L x H."""
    return torch.linalg.vector_norm(hidden_states, dim=-1, dtype=torch.float32)


def check_norms(norms) -> str | None:
    """Why rows with these norms must not be shipped, or None."""
    bad = ~torch.isfinite(norms).all(1)
    if bad.any():
        return f"non-finite values at token positions {bad.nonzero().flatten()[:5].tolist()}"
    zero = (norms == 0).any(1)
    if zero.any():
        return f"all-zero rows at token positions {zero.nonzero().flatten()[:5].tolist()}"
    return None


def check_rows(hidden_states) -> str | None:
    return check_norms(row_norms(hidden_states))
