"""The check every row passes before it is shipped: no NaN/Inf, no all-zero row."""

from __future__ import annotations

import torch

CHUNK_TOKENS = 1024  # tokens per chunk of GPU norms: small float32 temporaries


def row_norms(hidden_states):
    """[T, L, H] -> [T, L] float32 norms: NaN/Inf if a value is, 0 for an all-zero row."""
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
