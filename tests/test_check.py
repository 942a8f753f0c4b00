"""``vllm-gdn-hs check``: files written by the connector's own writer functions and lock
protocol, then damaged the ways a long run can damage them. CPU only.

Run: python -m pytest tests/test_check.py -q
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import torch

from vllm_gdn_hs.cli import main
from vllm_gdn_hs.files import write_file
from vllm_gdn_hs.locks import release_lock, take_lock
from vllm_gdn_hs.verify import check
from vllm_gdn_hs.verify.check import scan

L, H = 4, 64


def _write(folder, name, tokens=5, layers=L, rows=None, lock=True):
    """A file as the writer leaves it: lock taken, file written atomically, lock released
    and left for the reader."""
    path = os.path.join(folder, f"{name}.safetensors")
    fd = take_lock(path) if lock else None
    hs = rows if rows is not None else torch.randn(tokens, layers, H).to(torch.bfloat16)
    write_file(path, hs, torch.arange(hs.shape[0], dtype=torch.int64))
    release_lock(fd, path, remove=False)
    return path


def test_a_sound_folder(tmp_path, capsys):
    _write(tmp_path, "a")
    _write(tmp_path, "b", tokens=7)
    os.remove(_write(tmp_path, "c", tokens=3) + ".lock")  # read by speculators: lock gone
    os.makedirs(tmp_path / "sub")
    _write(tmp_path / "sub", "d")
    assert main(["check", str(tmp_path), "--rows"]) == 0
    out = capsys.readouterr().out
    assert "4 complete files, 20 tokens" in out and f"4 x [T, {L}, {H}] BF16" in out, out
    assert "3 of them still have their .lock (not yet read)" in out, out
    assert main(["check", str(tmp_path), "--expect", "5"]) == 1
    assert "expected 5 files: 1 missing" in capsys.readouterr().out


def test_damage_is_found_and_listed(tmp_path, capsys):
    good = _write(tmp_path, "good")
    trunc = _write(tmp_path, "truncated")
    with open(trunc, "r+b") as f:  # a full disk or a killed copy: the tail is missing
        f.truncate(os.path.getsize(trunc) - 10)
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    nan_rows = torch.randn(5, L, H).to(torch.bfloat16)
    nan_rows[2, 1, 7] = float("nan")
    nan = _write(tmp_path, "nan", rows=nan_rows)
    zero_rows = torch.randn(5, L, H).to(torch.bfloat16)
    zero_rows[4, 3] = 0
    zero = _write(tmp_path, "zero", rows=zero_rows)
    odd = _write(tmp_path, "odd", layers=L - 1)
    _write(tmp_path, "more")
    # The writer died after taking its lock: a lock nobody holds and no file.
    lost = str(tmp_path / "lost.safetensors")
    os.close(os.open(lost + ".lock", os.O_CREAT | os.O_RDWR))
    # A live writer holds its lock and has no file yet: not a problem.
    live = str(tmp_path / "live.safetensors")
    live_fd = take_lock(live)
    # Temp files: one of a process that is gone, one of this (live) process.
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    dead_tmp = tmp_path / f"x.safetensors.tmp-{gone}-1"
    dead_tmp.write_bytes(b"half")
    old = os.path.getmtime(dead_tmp) - check.TEMP_AGE_S - 60
    os.utime(dead_tmp, (old, old))  # a writer renames within seconds; this one is long gone
    (tmp_path / f"z.safetensors.tmp-{gone}-1").write_bytes(b"fresh")  # maybe another host's
    y = tmp_path / f"y.safetensors.tmp-{os.getpid()}-1"
    y.write_bytes(b"in progress")
    os.utime(y, (old, old))  # old, but its process is alive
    try:
        listing = tmp_path / "bad.txt"
        assert main(["check", str(tmp_path), "--list", str(listing)]) == 1
        out = capsys.readouterr().out
        assert "1 being written" in out, out
        listed = dict(line.split("\t") for line in listing.read_text().splitlines())
        assert "1 lost (a lock nobody holds and no file" in out, out
        assert set(listed) == {
            trunc,
            str(tmp_path / "junk.safetensors"),
            odd,
            lost + ".lock",
            str(dead_tmp),
        }, listed
        assert listed[trunc].startswith(f"{check.BROKEN}: truncated")
        want = f"{L - 1} layers x {H} BF16, the folder's others {L} x {H} BF16"
        assert listed[odd] == f"{check.LAYOUT}: {want}"
        assert listed[lost + ".lock"] == f"{check.LOST}: no file"
        assert good not in listed and nan not in listed  # header-only by default
        # --rows loads the rows: the connector's own check finds NaN and zero rows.
        problems = scan(str(tmp_path), rows=True)["problems"]
        flat = {p: (kind, why) for kind, found in problems.items() for p, why in found}
        assert flat[nan] == (check.ROWS, "non-finite values at token positions [2]")
        assert flat[zero] == (check.ROWS, "all-zero rows at token positions [4]")
        assert good not in flat
    finally:
        release_lock(live_fd, live, remove=True)


def test_not_a_folder(tmp_path, capsys):
    assert main(["check", str(tmp_path / "nope")]) == 2
    assert "is not a folder" in capsys.readouterr().err


def test_empty_folder(tmp_path, capsys):
    assert main(["check", str(tmp_path)]) == 0
    assert "0 complete files" in capsys.readouterr().out


def test_a_live_run_moving_on_is_not_reported(tmp_path, monkeypatch):
    """The folder is listed, then checked: a writer that finishes, or a reader that takes a
    file away, in between is neither lost nor broken."""
    done = str(tmp_path / "done.safetensors")
    fd = take_lock(done)  # listed as a lock without its file
    moved = _write(tmp_path, "moved")
    probe, header = check.lock_held, check.read_header

    def writer_finishes_first(lock):
        if lock == done + ".lock" and not os.path.exists(done):
            write_file(done, torch.randn(3, L, H).to(torch.bfloat16), torch.arange(3))
            release_lock(fd, done, remove=False)
        return probe(lock)

    def reader_moves_it_first(path):
        if path == moved:
            os.remove(path)
        return header(path)

    monkeypatch.setattr(check, "lock_held", writer_finishes_first)
    monkeypatch.setattr(check, "read_header", reader_moves_it_first)
    out = scan(str(tmp_path))
    assert not out["problems"], dict(out["problems"])
    assert (out["complete"], out["gone"]) == (1, 1)


def test_any_damaged_header_is_reported_not_raised(tmp_path):
    import json
    import struct

    for name, header in [("list", []), ("nulls", {"hidden_states": {"data_offsets": None}})]:
        raw = json.dumps(header).encode()
        (tmp_path / f"{name}.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    problems = scan(str(tmp_path))["problems"]
    assert sorted(os.path.basename(p) for p, _ in problems[check.BROKEN]) == [
        "list.safetensors",
        "nulls.safetensors",
    ]


def test_what_a_killed_writer_or_a_stray_entry_leaves(tmp_path, capsys):
    """A writer killed mid-write leaves safetensors' own temp file (``.tmpXXXXXX``, no pid in
    its name); a FIFO under a file's name must not hang the check; a file whose
    ``data_offsets`` disagree with its shapes is broken; a link to a file is not a second
    file."""
    good = _write(tmp_path, "good")
    killed = tmp_path / ".tmpAb12Cd"
    killed.write_bytes(b"\0" * 1000)
    old = os.path.getmtime(killed) - check.TEMP_AGE_S - 60
    os.utime(killed, (old, old))
    (tmp_path / ".tmpXy34Zw").write_bytes(b"\0")  # fresh: a writer may be at it now
    fifo = str(tmp_path / "fifo.safetensors")
    os.mkfifo(fifo)
    shifted = _write(tmp_path, "shifted")
    header_len = struct.unpack("<Q", open(shifted, "rb").read(8))[0]
    with open(shifted, "r+b") as f:  # same sizes, token_ids' span moved one byte
        head = f.read(8 + header_len)
        meta = json.loads(head[8:])
        begin, end = meta["token_ids"]["data_offsets"]
        meta["token_ids"]["data_offsets"] = [begin + 1, end]
        raw = json.dumps(meta, separators=(",", ":")).encode().ljust(header_len)
        assert len(raw) == header_len
        f.seek(8)
        f.write(raw)
    os.symlink(good, tmp_path / "link.safetensors")
    listing = tmp_path / "bad.txt"
    assert main(["check", str(tmp_path), "--list", str(listing)]) == 1
    out = capsys.readouterr().out
    listed = dict(line.split("\t") for line in listing.read_text().splitlines())
    assert set(listed) == {str(killed), fifo, shifted}, listed
    assert listed[str(killed)].startswith(f"{check.TEMP}: ")
    assert "safetensors temp file" in listed[str(killed)]
    assert listed[fifo] == f"{check.ODD}: not a regular file"
    assert listed[shifted].startswith(f"{check.BROKEN}: tensor 'token_ids': data_offsets")
    assert f"{tmp_path}: 1 complete files" in out, out
    assert "1 symbolic links not followed" in out
