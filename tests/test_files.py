"""The file contract (vllm_gdn_hs.files): names, containment, locks, writes, headers.

Run: python -m pytest tests/test_files.py -q (CPU, no network).
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import pytest
import torch

from vllm_gdn_hs import files, locks


@pytest.mark.parametrize(
    "request_id, name",
    [
        ("cmpl-3f2a-0-1b2c3d4e", "cmpl-3f2a-0-1b2c3d4e"),
        ("../../x", "%2E.%2F..%2Fx"),
        ("/abs/x", "%2Fabs%2Fx"),
        (".", "%2E"),
        ("..", "%2E."),
        ("", "%"),
        ("a b%", "a%20b%25"),
        ("nul\x00", "nul%00"),
        ("ü", "%C3%BC"),
    ],
)
def test_file_name_encoding(request_id, name):
    assert files.file_name(request_id) == name + files.SUFFIX


def test_long_ids_are_shortened_with_a_hash():
    a, b = files.file_name("x" * 10_000), files.file_name("x" * 10_001)
    assert a != b and len(a) == len(b) == files.MAX_STEM + len(files.SUFFIX)
    assert a.startswith("x" * 100) and "~" in a
    # The shortened form cannot collide with an id that encodes to the same characters.
    assert files.file_name(a[: -len(files.SUFFIX)]) != a


def test_inside(tmp_path):
    root = str(tmp_path / "hs")
    assert files.inside(f"{root}/a.safetensors", root)
    assert not files.inside(root, root)
    assert not files.inside(f"{root}/../a.safetensors", root)
    assert not files.inside(f"{root}-sibling/a.safetensors", root)
    assert not files.inside(f"{root}/a\x00.safetensors", root)
    os.makedirs(root)
    os.symlink(tmp_path, f"{root}/link")
    assert not files.inside(f"{root}/link/a.safetensors", root)


def test_request_path_refuses_a_planted_link(tmp_path):
    root = tmp_path / "hs"
    root.mkdir()
    (root / files.file_name("r")).symlink_to(tmp_path / "elsewhere.safetensors")
    with pytest.raises(ValueError, match="resolves outside"):
        files.request_path(str(root), "r")
    assert files.request_path(str(root), "s") == str(root / "s.safetensors")


def test_is_temp():
    assert files.is_temp("a.safetensors.tmp-123-456") == 123
    assert files.is_temp(".tmpAb12Cd") == 0  # safetensors' own
    for name in ("a.safetensors", "a.safetensors.lock", ".tmp", ".tmpAb12Cde", "tmpAb12Cd"):
        assert files.is_temp(name) is None, name


_WRITE = """
import os, sys, torch
from vllm_gdn_hs import files, locks
os.umask(int(sys.argv[2], 8))
path = os.path.join(sys.argv[1], "f.safetensors")
fd = locks.take_lock(path)
files.write_file(path, torch.zeros(2, 1, 4, dtype=torch.bfloat16) + 1, torch.arange(2))
locks.release_lock(fd, path, remove=False)
print(oct(os.stat(path).st_mode & 0o777), oct(os.stat(path + ".lock").st_mode & 0o777))
"""


@pytest.mark.parametrize("umask, mode", [("022", "0o644"), ("002", "0o664"), ("077", "0o600")])
def test_files_and_locks_get_the_umasks_mode(tmp_path, umask, mode):
    """safetensors makes its temp file 0600; the file and its lock get what the umask gives,
    so a trainer running as another user can read them."""
    out = subprocess.run(
        [sys.executable, "-c", _WRITE, str(tmp_path), umask],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert out == [mode, mode]


def test_take_lock_never_waits(tmp_path):
    path = str(tmp_path / "a.safetensors")
    fd = locks.take_lock(path)
    with pytest.raises(BlockingIOError, match="another process holds it"):
        locks.take_lock(path)
    assert locks.lock_held(path + ".lock") is True
    assert locks.take_finished(path) is False  # the reader waits while it is held
    locks.release_lock(fd, path, remove=True)
    assert locks.lock_held(path + ".lock") is False
    with pytest.raises(FileNotFoundError):  # no lock and no file: the write failed
        locks.take_finished(path)


def _safetensors(path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)


def test_read_header_checks_offsets_against_shapes_and_size(tmp_path):
    good = str(tmp_path / "good.safetensors")
    files.write_file(good, torch.ones(3, 2, 4, dtype=torch.bfloat16), torch.arange(3))
    assert files.layout(files.read_header(good)) == (3, 2, 4, "BF16")
    hs = {"dtype": "BF16", "shape": [3, 2, 4], "data_offsets": [0, 48]}
    ids = {"dtype": "I64", "shape": [3], "data_offsets": [48, 72]}
    cases = {
        "short span": ({"hidden_states": {**hs, "data_offsets": [0, 40]}, "token_ids": ids}, 72),
        "overlap": ({"hidden_states": hs, "token_ids": {**ids, "data_offsets": [40, 64]}}, 64),
        "gap": ({"hidden_states": hs, "token_ids": {**ids, "data_offsets": [56, 80]}}, 80),
        "truncated": ({"hidden_states": hs, "token_ids": ids}, 70),
        "no dtype": ({"hidden_states": {**hs, "dtype": "??"}, "token_ids": ids}, 72),
    }
    for name, (header, size) in cases.items():
        path = str(tmp_path / f"{name}.safetensors")
        _safetensors(path, header, b"\0" * size)
        with pytest.raises(ValueError):
            files.read_header(path)


def test_read_header_opens_regular_files_only(tmp_path):
    fifo = str(tmp_path / "f.safetensors")
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):
        files.read_header(fifo)  # returns at once: never blocks on the FIFO


@pytest.mark.parametrize("fp8", [False, True])
def test_written_files_are_the_bytes_safetensors_writes(tmp_path, fp8):
    """``write_file`` writes each tensor from its memory (no bytes copy under the GIL), yet the
    file is byte for byte what safetensors' own ``save_file`` writes, and its reader (as
    speculators reads) gets the tensors back; a non-contiguous tensor is written as its values."""
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(0)
    hs = torch.randn(7, 4, 3, generator=g).to(torch.bfloat16).transpose(0, 1).contiguous()
    hs = hs.transpose(0, 1)  # [7, 4, 3], not contiguous
    scales = torch.rand(7, 1, 1, generator=g) if fp8 else None
    if fp8:
        hs = hs.to(torch.float8_e4m3fn)
    ids = torch.arange(7, dtype=torch.int64)
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    files.write_file(str(ours), hs, ids, scales)
    expected = {"hidden_states": hs.contiguous(), "token_ids": ids}
    if fp8:
        expected[files.SCALES] = scales
    save_file(expected, str(theirs))
    assert ours.read_bytes() == theirs.read_bytes()
    got = load_file(str(ours))
    assert got.keys() == expected.keys()
    for k, v in expected.items():
        assert torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)), k
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


def test_the_format_names_what_hs_connectors_names():
    """files.py declares the fp8 scales' tensor name without importing hs-connectors (whose
    fp8_utils imports torch: check and doctor run without it); the two must stay one name."""
    from hs_connectors.fp8_utils import SCALES_KEY

    assert files.SCALES == SCALES_KEY
