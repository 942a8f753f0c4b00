"""The speculators hidden-states file (no torch at import): ``<name>.safetensors`` holding
``hidden_states`` [T, L, H] and ``token_ids`` [T] int64, complete once its ``.lock`` is released
(:mod:`vllm_gdn_hs.locks`): its name (never leaving the folder), its write, its header.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import stat
import struct
import threading

from vllm_gdn_hs.locks import make_folder_again, wait_for_file

SUFFIX = ".safetensors"
SCALES = "hidden_states_scales"  # fp8: hs-connectors' fp8_utils.SCALES_KEY (which imports torch)
MAX_STEM = 160  # with .safetensors.lock or our temp suffix, within a name's 255 bytes
_SAFE = re.compile(rb"[A-Za-z0-9._-]")
_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header
# Temp files: ours "<file>.tmp-<pid>-<thread id>", safetensors' (0.5+) ".tmp" + 6 characters.
_OUR_TEMP = re.compile(re.escape(SUFFIX) + r"\.tmp-(\d+)-\d+$")
_SAFETENSORS_TEMP = re.compile(r"^\.tmp[A-Za-z0-9]{6}$")


# -- names and paths ---------------------------------------------------------------------
def file_name(request_id: str) -> str:
    """The file name for a request id, injective and safe: each UTF-8 byte outside
    ``[A-Za-z0-9._-]``, and a leading ``.``, becomes ``%XX`` (the empty id: ``%``); a stem over
    :data:`MAX_STEM` is cut, then ``~`` and 32 hex digits of its SHA-256. Ordinary ids stay."""
    raw = request_id.encode("utf-8", "surrogatepass")
    stem = "".join(
        chr(b) if _SAFE.match(bytes([b])) and not (i == 0 and b == 0x2E) else f"%{b:02X}"
        for i, b in enumerate(raw)
    )
    stem = stem or "%"
    if len(stem) > MAX_STEM:
        stem = stem[: MAX_STEM - 33] + "~" + hashlib.sha256(raw).hexdigest()[:32]
    return stem + SUFFIX


def inside(path: str, folder: str) -> bool:
    """Whether ``path`` (after resolving links and ``..``) lies inside ``folder``."""
    if "\x00" in path or "\x00" in folder:
        return False
    root = os.path.realpath(folder)
    return os.path.commonpath([root, os.path.realpath(path)]) == root != os.path.realpath(path)


def request_path(folder: str, request_id: str) -> str:
    """The absolute path of a request's file, checked to lie inside ``folder``."""
    path = os.path.join(os.path.abspath(folder), file_name(request_id))
    if not inside(path, folder):  # only a link planted in the folder could do this
        raise ValueError(f"{path} resolves outside {folder}")
    return path


def custom_path(path: str, root: str) -> str:
    """A client's own ``hidden_states_path``, absolute; ValueError unless it lies in ``root``."""
    full = os.path.abspath(os.path.join(root, path)) if path and "\x00" not in path else ""
    if not full or not inside(full, root) or not full.endswith(SUFFIX):
        raise ValueError(
            f"hidden_states_path {path[:200]!r} is not a {SUFFIX} file inside {root}: only "
            "paths under the server's custom_save_root are allowed"
        )
    return full


def is_temp(name: str) -> int | None:
    """A temp file's writer pid (0: safetensors', no pid); None for any other name."""
    if m := _OUR_TEMP.search(name):
        return int(m.group(1))
    return 0 if _SAFETENSORS_TEMP.match(name) else None


def load_hidden_states(path: str, timeout: float = 10.0) -> dict:
    """``{"hidden_states": [T, L, H], "token_ids": [T]}`` once the file is complete."""
    from safetensors.torch import load_file

    wait_for_file(path, timeout)
    return load_file(path)


# -- the write ---------------------------------------------------------------------------
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


def write_file(path, hidden_states, token_ids, scales=None) -> None:
    """Write atomically (temp file, rename) with the umask's mode, making a missing folder
    again; ``scales`` [T, 1, 1]: an fp8 file. Each tensor is written from its own memory
    (safetensors' ``save_file`` first copies each into a bytes object, holding the GIL the
    engine thread shares)."""
    tensors = {"hidden_states": hidden_states, "token_ids": token_ids}
    if scales is not None:
        tensors[SCALES] = scales
    header, order = safetensors_header(tensors)
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
    try:
        if not os.path.isdir(os.path.dirname(path)):
            make_folder_again(os.path.dirname(path))
        with open(tmp, "wb") as f:
            f.write(header)
            for t in order:
                f.write(raw_bytes(t))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


# -- the header --------------------------------------------------------------------------
_DTYPE_BYTES = {
    **dict.fromkeys(["BOOL", "U8", "I8", "F8_E4M3", "F8_E5M2"], 1),
    **dict.fromkeys(["I16", "U16", "F16", "BF16"], 2),
    **dict.fromkeys(["I32", "U32", "F32"], 4),
    **dict.fromkeys(["I64", "U64", "F64"], 8),
}


def read_header(path: str) -> dict:
    """A safetensors file's tensors, their offsets checked against shapes, each other and the
    file's size; ValueError naming what is wrong. Opens regular files only."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file")
        size = st.st_size
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"truncated: {size} bytes, no safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER or 8 + n > size:
            raise ValueError(f"truncated or not safetensors: header of {n} bytes in {size}")
        try:
            meta = json.loads(f.read(n))
        except ValueError:
            raise ValueError("not safetensors: header is not JSON") from None
    if not isinstance(meta, dict):
        raise ValueError("not safetensors: header is not a JSON object")
    tensors = {k: v for k, v in meta.items() if k != "__metadata__"}
    spans = []
    for name, t in tensors.items():
        try:
            begin, end = (int(x) for x in t["data_offsets"])
            want = math.prod(int(d) for d in t["shape"]) * _DTYPE_BYTES[t["dtype"]]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"not safetensors: tensor {name!r} has no valid dtype, shape and "
                             "data_offsets") from None  # fmt: skip
        if end - begin != want:
            raise ValueError(f"tensor {name!r}: data_offsets span {end - begin} bytes, its shape "
                             f"{t['shape']} {t['dtype']} needs {want}")  # fmt: skip
        spans.append((begin, end))
    at = 0
    for begin, end in sorted(spans):
        if begin != at:
            raise ValueError(f"data_offsets leave a gap or overlap at byte {at}")
        at = end
    if 8 + n + at != size:
        raise ValueError(f"truncated: {size} bytes, the header says {8 + n + at}")
    return tensors


def layout(tensors: dict) -> tuple[int, int, int, str]:
    """(tokens, layers, hidden, dtype) of a speculators file; ValueError if it is not one."""
    hs, ids = tensors.get("hidden_states"), tensors.get("token_ids")
    if hs is None or ids is None:
        raise ValueError(f"not a hidden-states file: tensors {sorted(tensors)}")
    if len(hs["shape"]) != 3 or hs["shape"][0] == 0:
        raise ValueError(f"hidden_states shape {hs['shape']}, not [tokens, layers, hidden]")
    t, layers, hidden = hs["shape"]
    if ids["dtype"] != "I64" or ids["shape"] != [t]:
        raise ValueError(f"token_ids {ids['dtype']} {ids['shape']} for {t} rows (want I64 [{t}])")
    scales = tensors.get(SCALES)
    if (hs["dtype"] == "F8_E4M3") != (scales is not None):
        raise ValueError(f"hidden_states {hs['dtype']} with {'no ' * (scales is None)}{SCALES}")
    if scales is not None and (scales["dtype"] != "F32" or scales["shape"] != [t, 1, 1]):
        raise ValueError(f"{SCALES} {scales['dtype']} {scales['shape']} (want F32 [{t}, 1, 1])")
    return t, layers, hidden, hs["dtype"]


def hidden_states_of(data: dict):
    """A file's ``hidden_states``, fp8 ones dequantized as hs-connectors' ``FP8Transfer`` does."""
    if SCALES not in data:
        return data["hidden_states"]
    from hs_connectors.fp8_utils import dequantize_fp8_tensor

    return dequantize_fp8_tensor(data["hidden_states"], data[SCALES])
