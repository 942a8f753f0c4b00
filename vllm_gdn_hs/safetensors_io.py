"""safetensors files written from each tensor's memory (safetensors' ``save_file`` first copies
each into a bytes object, holding the GIL the engine thread shares)."""

from __future__ import annotations

import json
import struct
from typing import BinaryIO

_SAFETENSORS_DTYPES = {
    "torch.bfloat16": "BF16",
    "torch.float16": "F16",
    "torch.float32": "F32",
    "torch.float8_e4m3fn": "F8_E4M3",
    "torch.int64": "I64",
    "torch.int32": "I32",
}


def safetensors_header(tensors: dict) -> tuple[bytes, list]:
    """The header bytes of a safetensors file holding ``tensors``, and the tensors in the order
    safetensors puts their data (by alignment, then name)."""
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    meta, offset = {}, 0
    for name in order:
        t = tensors[name]
        size = t.numel() * t.element_size()
        dtype = _SAFETENSORS_DTYPES[str(t.dtype)]
        meta[name] = dict(dtype=dtype, shape=list(t.shape), data_offsets=[offset, offset + size])
        offset += size
    text = json.dumps(meta, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, [tensors[k] for k in order]


def raw_bytes(t) -> memoryview:
    """A CPU tensor's bytes, without a copy where it is contiguous."""
    import torch

    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def write(f: BinaryIO, tensors: dict) -> None:
    """``tensors`` (CPU torch tensors) as a safetensors file into ``f``."""
    header, order = safetensors_header(tensors)
    f.write(header)
    for t in order:
        f.write(raw_bytes(t))
