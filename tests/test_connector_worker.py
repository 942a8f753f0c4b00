"""The connector's worker side on CPU (HybridHiddenStatesConnectorWorker), locks, files.

Run: python -m pytest tests/test_connector_worker.py -q (no GPU, no network).
Covers the worker side end to end with device=cpu (the same drain thread and write pool
as on a GPU; only the device-to-host copy is a plain copy): the lock is created and
flock-held from the moment a request is known until its file is complete; rows of several
requests per step, chunked prefill and overwritten positions; exact [T, L, H] bf16 files
with int64 token ids; aborts, missing rows, NaN and all-zero rows, full disk and vanished
folders leave no file, no temp file and no lock, are logged with the request id and do not
stop other requests; close() drains everything; the engine thread in inference mode, as in
vLLM's worker. Also check_rows and write_file directly.
The only fakes are at the disk edge (os.replace / safetensors raising ENOSPC).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import queue
import shutil
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from vllm_gdn_hs import files, locks
from vllm_gdn_hs.config import HiddenStatesConfig
from vllm_gdn_hs.connector import request_rows, staging, worker
from vllm_gdn_hs.connector.metadata import (
    FinishedRequest,
    HybridHiddenStatesConnectorMetadata,
    NewRequest,
)
from vllm_gdn_hs.connector.worker import HybridHiddenStatesConnectorWorker
from vllm_gdn_hs.files import write_file
from vllm_gdn_hs.rows import check_rows

L, H = 3, 16
LOGGER = worker.logger.name


@pytest.fixture
def storage(tmp_path):
    path = tmp_path / "hs"
    path.mkdir()
    return path


def make_writer(storage, **cfg) -> HybridHiddenStatesConnectorWorker:
    return HybridHiddenStatesConnectorWorker(
        HiddenStatesConfig(shared_storage_path=str(storage), **cfg),
        max_tokens=128,
        num_layers=L,
        hidden=H,
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
    )


@pytest.fixture
def writer(storage):
    w = make_writer(storage)
    yield w
    w.close(timeout=30)


_gen = torch.Generator().manual_seed(0)


def rows(n: int) -> torch.Tensor:
    return torch.randn(n, L, H, generator=_gen).bfloat16()


def path_of(storage, req_id: str) -> str:
    return os.path.join(storage, f"{req_id}.safetensors")


def new(writer, storage, **reqs: int) -> None:
    writer.on_metadata(
        HybridHiddenStatesConnectorMetadata(
            new_requests=[NewRequest(r, path_of(storage, r), n) for r, n in reqs.items()]
        )
    )


def finish(writer, **reqs: list[int] | None) -> None:
    writer.on_metadata(
        HybridHiddenStatesConnectorMetadata(
            finished_requests=[FinishedRequest(r, t) for r, t in reqs.items()]
        )
    )


def save(writer, *chunks: tuple[str, int, torch.Tensor]) -> None:
    """One step: (req_id, first position, rows) per request, in batch order."""
    qsl = [0]
    for _, _, r in chunks:
        qsl.append(qsl[-1] + r.shape[0])
    writer.save(
        torch.cat([r for _, _, r in chunks]),
        [c[0] for c in chunks],
        torch.tensor(qsl, dtype=torch.int32),
        torch.cat([torch.arange(p, p + r.shape[0]) for _, p, r in chunks]),
    )


def lock_state(path: str) -> str:
    """'held', 'free' or 'absent': what speculators' reader would find at <path>.lock."""
    if not os.path.exists(path + ".lock"):
        return "absent"
    return "held" if locks.lock_held(path + ".lock") else "free"


def leftovers(storage) -> list[str]:
    return sorted(f for f in os.listdir(storage) if files.is_temp(f) is not None)


def test_new_request_creates_and_holds_lock(writer, storage):
    path = path_of(storage, "a")
    new(writer, storage, a=4)
    assert lock_state(path) == "held"
    fd = os.open(path + ".lock", os.O_RDWR)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
    assert not os.path.exists(path)


def test_two_requests_chunked_and_overwritten(writer, storage):
    a, b = rows(5), rows(7)
    b_redo = rows(2)  # positions 3 and 4 computed again (preemption / recompute)
    new(writer, storage, a=5, b=7)
    save(writer, ("a", 0, a), ("b", 0, b[:5]))  # b's first chunk
    save(writer, ("b", 3, torch.cat([b_redo, b[5:]])))  # b's last chunk re-covers 3..4
    finish(writer, a=[1, 2, 3, 4, 5], b=list(range(10, 17)))
    writer.close()

    expect_b = b.clone()
    expect_b[3:5] = b_redo
    for req, expect, tokens in (("a", a, [1, 2, 3, 4, 5]), ("b", expect_b, list(range(10, 17)))):
        got = load_file(path_of(storage, req))
        assert set(got) == {"hidden_states", "token_ids"}
        assert got["hidden_states"].dtype == torch.bfloat16
        assert got["hidden_states"].shape == (len(tokens), L, H)
        assert torch.equal(got["hidden_states"], expect)
        assert got["token_ids"].dtype == torch.int64
        assert got["token_ids"].tolist() == tokens
        assert lock_state(path_of(storage, req)) == "free"  # the reader deletes it
    assert writer.stats.files == 2 and writer.stats.failed == 0
    assert leftovers(storage) == []


def test_output_tokens_grow_the_buffer(writer, storage):
    # include_output_tokens: rows past the prompt (decode steps) are kept too.
    prompt, d1, d2 = rows(3), rows(1), rows(1)
    new(writer, storage, g=3)
    save(writer, ("g", 0, prompt))
    save(writer, ("g", 3, d1))
    save(writer, ("g", 4, d2))
    finish(writer, g=[7, 8, 9, 100, 101])
    writer.close()
    got = load_file(path_of(storage, "g"))
    assert torch.equal(got["hidden_states"], torch.cat([prompt, d1, d2]))
    assert got["token_ids"].tolist() == [7, 8, 9, 100, 101]


def test_reserved_output_rows_and_a_long_run(writer, storage):
    # A buffer reserved for prompt + outputs (include_output_tokens), a prefill run long
    # enough to take the numpy copy, then decode rows one at a time.
    prompt, outs = rows(100), [rows(1) for _ in range(5)]
    writer.on_metadata(
        HybridHiddenStatesConnectorMetadata(
            new_requests=[NewRequest("g", path_of(storage, "g"), 100, 106)]
        )
    )
    save(writer, ("g", 0, prompt[:70]))
    save(writer, ("g", 70, prompt[70:]))
    for i, o in enumerate(outs):
        save(writer, ("g", 100 + i, o))
    finish(writer, g=list(range(105)))
    writer.close()
    assert torch.equal(
        load_file(path_of(storage, "g"))["hidden_states"], torch.cat([prompt, *outs])
    )
    assert writer.stats.steps == 7 and writer.stats.drain_s > 0
    assert writer.stats.timing_summary().startswith("7 steps; per step ")


def test_reservation_refused_falls_back_to_growing(writer, storage, monkeypatch):
    # Under strict overcommit a reservation of prompt + max_tokens rows can be refused;
    # the buffer then holds the prompt and grows for the outputs.
    real = request_rows._grow

    def grow(t, cap):
        if cap > 1000:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory")
        return real(t, cap)

    monkeypatch.setattr(request_rows, "_grow", grow)
    data = rows(5)
    writer.on_metadata(
        HybridHiddenStatesConnectorMetadata(
            new_requests=[NewRequest("g", path_of(storage, "g"), 3, 10**6)]
        )
    )
    save(writer, ("g", 0, data[:3]))
    save(writer, ("g", 3, data[3:4]))
    save(writer, ("g", 4, data[4:]))
    finish(writer, g=list(range(5)))
    writer.close()
    assert torch.equal(load_file(path_of(storage, "g"))["hidden_states"], data)


def test_positions_out_of_order_and_rewritten(writer, storage):
    # Rows arrive by position, not batch order; a position written again keeps the later
    # row (a preempted request recomputes its prompt).
    data, again = rows(6), rows(2)
    new(writer, storage, p=6)
    qsl = torch.tensor([0, 4], dtype=torch.int32)
    writer.save(data[[3, 0, 2, 1]], ["p"], qsl, torch.tensor([3, 0, 2, 1]))
    writer.save(again, ["p"], torch.tensor([0, 2], dtype=torch.int32), torch.tensor([1, 3]))
    save(writer, ("p", 4, data[4:]))
    finish(writer, p=list(range(6)))
    writer.close()
    want = data.clone()
    want[[1, 3]] = again
    got = load_file(path_of(storage, "p"))["hidden_states"]
    assert torch.equal(got, want)


def test_decode_rows_are_filed_once_a_request_skips_a_step(writer, storage):
    # "a" decodes two steps and then is not scheduled (preempted); its rows leave the step
    # blocks at once, while "b", still decoding, keeps batching them.
    new(writer, storage, a=2, b=2)
    save(writer, ("a", 0, rows(2)), ("b", 0, rows(2)))
    save(writer, ("a", 2, rows(1)), ("b", 2, rows(1)))
    save(writer, ("a", 3, rows(1)), ("b", 3, rows(1)))
    save(writer, ("b", 4, rows(1)))
    assert writer.drain.flushed(10)
    a, b = writer.drain.requests["a"].rows, writer.drain.requests["b"].rows
    assert a.pending == [] and bytes(a.seen[:4]) == b"\x01" * 4
    assert len(b.pending) == 5 and writer.drain.deferring == {b}


def test_reader_gets_the_lock_only_once_the_file_is_complete(writer, storage):
    path = path_of(storage, "r")
    data = rows(6)
    new(writer, storage, r=6)
    seen = {}

    def reader():  # speculators' protocol
        locks.wait_for_file(path, timeout=30)
        seen["file"] = load_file(path)

    t = threading.Thread(target=reader)
    t.start()
    save(writer, ("r", 0, data[:2]))
    save(writer, ("r", 2, data[2:]))
    finish(writer, r=list(range(6)))
    writer.close()
    t.join(timeout=30)
    assert not t.is_alive()
    assert seen["file"] is not None and torch.equal(seen["file"]["hidden_states"], data)
    assert lock_state(path) == "absent"


def test_aborted_request_leaves_nothing(writer, storage):
    new(writer, storage, x=4, y=2)
    y = rows(2)
    save(writer, ("x", 0, rows(2)), ("y", 0, y))
    finish(writer, x=None, y=[1, 2])
    writer.close()
    assert not os.path.exists(path_of(storage, "x"))
    assert lock_state(path_of(storage, "x")) == "absent"
    assert torch.equal(load_file(path_of(storage, "y"))["hidden_states"], y)
    assert writer.stats.aborted == 1 and writer.stats.files == 1
    # Rows for a request the writer no longer knows are ignored.
    assert "x" not in writer.drain.requests


def test_missing_rows_refused(writer, storage, caplog):
    caplog.set_level(logging.ERROR, logger=LOGGER)
    new(writer, storage, m=5)
    save(writer, ("m", 0, rows(3)))
    finish(writer, m=[1, 2, 3, 4, 5])
    writer.close()
    path = path_of(storage, "m")
    assert not os.path.exists(path) and lock_state(path) == "absent"
    msgs = [(r.name, r.getMessage()) for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(msgs) == 1, msgs
    ((_, msg),) = msgs
    assert "request 'm':" in msg and path in msg
    assert "hidden states missing for token positions [3, 4]" in msg
    assert writer.stats.failed == 1


def test_token_ids_past_the_rows_refused(writer, storage, caplog):
    new(writer, storage, p=2)
    save(writer, ("p", 0, rows(2)))
    finish(writer, p=[1, 2, 3, 4, 5])
    writer.close()
    assert not os.path.exists(path_of(storage, "p"))
    assert any("beyond the rows computed" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "value, why",
    [
        (float("nan"), "non-finite values at token positions [1]"),
        (float("inf"), "non-finite values at token positions [1]"),
        (0.0, "all-zero rows at token positions [1]"),
    ],
)
def test_bad_rows_refused(writer, storage, caplog, value, why):
    bad = rows(3)
    bad[1] = value
    new(writer, storage, n=3, ok=2)
    ok = rows(2)
    save(writer, ("n", 0, bad), ("ok", 0, ok))
    finish(writer, n=[1, 2, 3], ok=[4, 5])
    writer.close()
    assert not os.path.exists(path_of(storage, "n"))
    assert lock_state(path_of(storage, "n")) == "absent"
    assert torch.equal(load_file(path_of(storage, "ok"))["hidden_states"], ok)
    msgs = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(msgs) == 1 and "request 'n':" in msgs[0] and why in msgs[0]


def test_zero_rows_written_when_validation_is_off(storage):
    w = make_writer(storage, validate_rows=False)
    new(w, storage, z=2)
    save(w, ("z", 0, torch.zeros(2, L, H, dtype=torch.bfloat16)))
    finish(w, z=[1, 2])
    w.close()
    assert load_file(path_of(storage, "z"))["hidden_states"].abs().sum() == 0


def test_full_disk_logged_and_others_written(writer, storage, caplog, monkeypatch):
    real_replace = os.replace
    full = path_of(storage, "full")

    def replace(src, dst):
        if dst == full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    good = rows(3)
    new(writer, storage, full=3, good=3)
    save(writer, ("full", 0, rows(3)), ("good", 0, good))
    finish(writer, full=[1, 2, 3], good=[4, 5, 6])
    writer.close()
    assert not os.path.exists(full) and lock_state(full) == "absent"
    assert torch.equal(load_file(path_of(storage, "good"))["hidden_states"], good)
    assert leftovers(storage) == []
    msgs = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(msgs) == 1
    assert "request 'full':" in msgs[0] and "No space left on device" in msgs[0]
    assert writer.stats.failed == 1 and writer.stats.files == 1


def backlog_waits(w) -> queue.Queue:
    """The backlog (bytes) each time the drain thread starts waiting on write_backlog_gb: the
    writer's condition is waited on there and nowhere else."""
    entered, real_wait = queue.Queue(), w.writer.cond.wait

    def wait(timeout=None):
        entered.put(w.writer.backlog_bytes)  # under the condition's lock: a steady figure
        return real_wait(timeout)

    w.writer.cond.wait = wait
    return entered


def test_write_backlog_bounded_and_nothing_lost(storage, caplog, monkeypatch):
    """Writes slower than the GPU: past write_backlog_gb the drain thread waits for the
    writers (and so, through the ring, the engine) instead of holding ever more finished
    requests in host memory; every file is still written once the writes catch up."""
    gate, real_replace = threading.Event(), os.replace

    def slow_replace(src, dst):
        gate.wait(30)
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", slow_replace)
    per_request = 8 * L * H * 2  # 8 rows of bf16
    w = make_writer(storage, write_workers=1, write_backlog_gb=3 * per_request / 1e9)
    waits = backlog_waits(w)
    data = {f"r{i}": rows(8) for i in range(6)}
    new(w, storage, **{r: 8 for r in data})
    save(w, *((r, 0, x) for r, x in data.items()))
    finish(w, **{r: list(range(8)) for r in data})
    # The drain thread waits with 3 writes queued (none can end while the gate is shut);
    # unbounded, it would queue all 6 and never wait.
    assert waits.get(timeout=30) == 3 * per_request
    assert (w.stats.writing, w.stats.backlog_bytes) == (3, 3 * per_request)
    msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("write_backlog_gb" in m and "faster storage" in m for m in msgs), msgs
    gate.set()
    w.close(timeout=30)
    assert (w.stats.writing, w.stats.backlog_bytes, w.stats.files) == (0, 0, 6)
    for r, x in data.items():
        assert torch.equal(load_file(path_of(storage, r))["hidden_states"], x)
    assert leftovers(storage) == []


def test_write_backlog_warned_once_and_its_wait_timed(storage, caplog, monkeypatch):
    """Writes slower than the GPU hit write_backlog_gb again and again, each time with
    another backlog figure: one warning in all (vLLM's warning_once would log each new
    figure; on the GPU that was 23 lines in a second), and the drain thread's time waiting
    on the backlog in the shutdown line."""
    gate, real_replace = threading.Semaphore(0), os.replace

    def slow_replace(src, dst):
        gate.acquire(timeout=30)
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", slow_replace)
    caplog.set_level(logging.INFO, logger=LOGGER)
    per_row = L * H * 2
    # 8 + 7 + 6 rows fill the backlog; 5 waits (backlog 21 rows), then 4 (backlog 18 rows)
    lengths = {f"r{n}": n for n in (8, 7, 6, 5, 4, 3)}
    w = make_writer(storage, write_workers=1, write_backlog_gb=21.5 * per_row / 1e9)
    waits = backlog_waits(w)
    data = {r: rows(n) for r, n in lengths.items()}
    new(w, storage, **lengths)
    save(w, *((r, 0, x) for r, x in data.items()))
    finish(w, **{r: list(range(n)) for r, n in lengths.items()})
    for expect in (21, 18):  # one write at a time; the drain waits again with a new figure
        assert waits.get(timeout=30) == expect * per_row
        gate.release()
    for _ in lengths:
        gate.release()
    w.close(timeout=30)
    assert w.stats.files == len(lengths)
    assert waits.empty()  # it waited twice, no more
    warned = [r for r in caplog.records if "write_backlog_gb=" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in warned]
    assert w.stats.backlog_waited_s > 0
    (shut,) = [r.getMessage() for r in caplog.records if "shut down" in r.getMessage()]
    assert "s of drain waiting on write_backlog_gb" in shut, shut


class _Clock:
    """time.monotonic for the host ring: each reading 0.6 s after the last, so every wait for a
    host buffer measures 0.6 s, past the 0.5 s warning threshold, however fast it was."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self) -> float:
        self.now += 0.6
        return self.now


def test_engine_wait_for_host_buffers_warned_once_with_the_side_behind(
    storage, caplog, monkeypatch
):
    """A drain slower than the steps (a ring of one largest step, steps of that size, filing
    rows held up): the engine thread waits in save() for room; one warning, which says no
    file was being written (so the advice is host_buffers, not faster storage), and the wait
    is counted."""
    monkeypatch.setattr(staging, "time", _Clock())
    engine_waiting = threading.Semaphore(0)
    real_put = request_rows.RequestRows.put

    def held_put(self, *args):  # a and b are filed only once the engine waits for the buffer
        if self.req.req_id != "c":
            assert engine_waiting.acquire(timeout=30)
        return real_put(self, *args)

    monkeypatch.setattr(request_rows.RequestRows, "put", held_put)
    caplog.set_level(logging.INFO, logger=LOGGER)
    w = make_writer(storage, host_buffers=1)
    real_wait = w.ring.room.wait

    def wait(timeout=None):  # the engine thread, holding the ring's lock, waits for room
        engine_waiting.release()
        return real_wait(timeout)

    w.ring.room.wait = wait
    n = w.ring.capacity  # 128 rows
    data = {r: rows(n) for r in ("a", "b", "c")}
    new(w, storage, **dict.fromkeys(data, n))
    for r, x in data.items():  # one step each: the 2nd and 3rd wait for the whole ring
        save(w, (r, 0, x))
    finish(w, **{r: list(range(n)) for r in data})
    w.close(timeout=30)
    assert w.stats.files == 3 and w.stats.engine_waited_s == pytest.approx(1.2)
    warned = [r.getMessage() for r in caplog.records if "waited" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "with 0 files being written" in warned[0] and "host_buffers" in warned[0]


def test_progress_line_without_finished_files(writer, storage, caplog):
    """A long decode phase finishes no file for minutes; the progress line still comes,
    from the drain thread, through vLLM's logger at INFO."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    new(writer, storage, a=4)
    writer.logged = (0.0, 0, 0)  # the last line is long past
    save(writer, ("a", 0, rows(4)))
    assert writer.drain.flushed(10)
    lines = [r.getMessage() for r in caplog.records if "requests in flight" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "0 files (0.00 GB) written" in lines[0] and "1 requests in flight" in lines[0]
    assert "1 steps; per step" in lines[0]
    save(writer, ("a", 4, rows(1)))  # within 30 s of that line: no other
    assert writer.drain.flushed(10)
    assert len([r for r in caplog.records if "requests in flight" in r.getMessage()]) == 1


def test_progress_line_gives_the_rate_since_the_last_line(writer, storage, caplog):
    """Each progress line says how fast files went out since the line before (what storage
    must sustain now), not since the start."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    names = "abcdefgh"
    new(writer, storage, **dict.fromkeys(names, 4))
    save(writer, *((r, 0, rows(4)) for r in names))
    finish(writer, **{r: [1, 2, 3, 4] for r in names})
    deadline = time.monotonic() + 10
    while writer.stats.files < len(names) and time.monotonic() < deadline:
        time.sleep(0.01)
    size = writer.stats.bytes
    assert writer.stats.files == 8 and size > 0
    writer.logged = (time.monotonic() - 40, 4, size // 2)  # a line 40 s ago, at half of it
    new(writer, storage, i=4)
    save(writer, ("i", 0, rows(1)))
    (line,) = [r.getMessage() for r in caplog.records if "requests in flight" in r.getMessage()]
    assert f"; {size / 2 / 40 / 1e9:.2f} GB/s, 0.1 files/s over the last 40 s; " in line, line
    when, files, done = writer.logged  # the next line counts from this one: no file since
    writer.logged = (when - 40, files, done)
    save(writer, ("i", 1, rows(1)))
    lines = [r.getMessage() for r in caplog.records if "requests in flight" in r.getMessage()]
    assert len(lines) == 2 and "; 0.00 GB/s, 0.0 files/s over the last 40 s; " in lines[1], lines


def test_without_synchronization_lock(storage):
    """use_synchronization_lock off (vLLM's upstream option, for offline runs): the file is
    written as always, and no .lock file is made or left."""
    w = make_writer(storage, use_synchronization_lock=False)
    x = rows(3)
    new(w, storage, a=3, b=3)
    assert lock_state(path_of(storage, "a")) == "absent"
    save(w, ("a", 0, x), ("b", 0, rows(3)))
    finish(w, a=[1, 2, 3], b=None)
    w.close(timeout=30)
    assert torch.equal(load_file(path_of(storage, "a"))["hidden_states"], x)
    assert sorted(os.listdir(storage)) == ["a.safetensors"]


def test_upstream_option_names_accepted():
    cfg = HiddenStatesConfig(num_writer_threads=8, use_synchronization_lock=True)
    assert cfg.write_workers == 8


def test_vanished_folder_made_again_and_every_file_written(writer, storage, caplog):
    """A cleanup job removes the folder while requests are in flight, and again before new
    ones arrive: the folder is made again (logged each time it is made), no request is lost."""
    sub = storage / "sub"
    sub.mkdir()
    before, after = str(sub / "before.safetensors"), str(sub / "after.safetensors")
    writer.on_metadata(
        HybridHiddenStatesConnectorMetadata(new_requests=[NewRequest("before", before, 2)])
    )
    shutil.rmtree(sub)  # the folder disappears under the server, lock and all
    data = rows(2)
    save(writer, ("before", 0, data))
    finish(writer, before=[1, 2])
    deadline = time.monotonic() + 30  # its lock went with the folder: wait for the file
    while not os.path.exists(before) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert torch.equal(load_file(before)["hidden_states"], data)
    shutil.rmtree(sub)  # and again, before the next request
    writer.on_metadata(
        HybridHiddenStatesConnectorMetadata(new_requests=[NewRequest("after", after, 2)])
    )
    assert lock_state(after) == "held"
    save(writer, ("after", 0, data))
    finish(writer, after=[3, 4])
    writer.close()
    assert torch.equal(files.load_hidden_states(after)["hidden_states"], data)
    made = [r.getMessage() for r in caplog.records if "made it again" in r.getMessage()]
    assert len(made) == 2, made
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert writer.stats.files == 2 and writer.stats.failed == 0
    assert leftovers(sub) == []


def test_unwritable_request_path_does_not_stop_others(writer, storage, caplog):
    blocker = storage / "a-file"
    blocker.write_text("")
    bad = str(blocker / "bad.safetensors")  # its folder is a file: no lock can be made
    writer.on_metadata(
        HybridHiddenStatesConnectorMetadata(
            new_requests=[NewRequest("bad", bad, 2), NewRequest("ok", path_of(storage, "ok"), 2)]
        )
    )
    ok = rows(2)
    save(writer, ("bad", 0, rows(2)), ("ok", 0, ok))
    finish(writer, bad=[1, 2], ok=[3, 4])
    writer.close()
    assert torch.equal(load_file(path_of(storage, "ok"))["hidden_states"], ok)
    assert any("request 'bad'" in r.getMessage() for r in caplog.records)


def test_close_drains_everything(storage):
    w = make_writer(storage, host_buffers=1, write_workers=2)
    data = {f"q{i}": rows(1 + i % 5) for i in range(24)}
    new(w, storage, **{r: d.shape[0] for r, d in data.items()})
    items = list(data.items())
    for i in range(0, len(items), 4):  # 4 requests per step, through a single host buffer
        save(w, *[(r, 0, d) for r, d in items[i : i + 4]])
    new(w, storage, never=3)  # never finished: close() must not leave its lock
    finish(w, **{r: list(range(d.shape[0])) for r, d in data.items()})
    w.close()
    for r, d in data.items():
        assert torch.equal(load_file(path_of(storage, r))["hidden_states"], d)
        assert lock_state(path_of(storage, r)) == "free"
    assert lock_state(path_of(storage, "never")) == "absent"
    assert w.stats.files == len(data) and w.stats.writing == 0 and w.drain.requests == {}


def test_duplicate_new_request_keeps_rows(writer, storage):
    # A resumed request may be listed as new again; its rows so far are kept.
    first = rows(2)
    new(writer, storage, d=4)
    save(writer, ("d", 0, first))
    new(writer, storage, d=4)
    rest = rows(2)
    save(writer, ("d", 2, rest))
    finish(writer, d=[1, 2, 3, 4])
    writer.close()
    assert torch.equal(load_file(path_of(storage, "d"))["hidden_states"], torch.cat([first, rest]))


# -- check_rows ------------------------------------------------------------------------


def test_check_rows_accepts_finite_nonzero():
    assert check_rows(rows(4)) is None
    r = rows(2)
    r[0, 0, 0] = 0.0  # a zero value is fine; a zero row is not
    assert check_rows(r) is None


def test_check_rows_names_positions():
    r = rows(8)
    r[2, 1, 3] = float("nan")
    r[5, 0, 0] = float("-inf")
    assert check_rows(r) == "non-finite values at token positions [2, 5]"
    r = rows(8)
    r[0] = 0
    r[7] = 0
    assert check_rows(r) == "all-zero rows at token positions [0, 7]"
    assert check_rows(torch.zeros(3, L, H)) == "all-zero rows at token positions [0, 1, 2]"


# -- write_file ------------------------------------------------------------------------


def test_write_file_roundtrip(tmp_path):
    path = str(tmp_path / "f.safetensors")
    hs, ids = rows(4), torch.arange(4, dtype=torch.int64)
    write_file(path, hs, ids)
    got = load_file(path)
    assert torch.equal(got["hidden_states"], hs) and torch.equal(got["token_ids"], ids)
    assert os.listdir(tmp_path) == ["f.safetensors"]


def test_write_file_failure_keeps_old_file_and_no_temp(tmp_path, monkeypatch):
    path = str(tmp_path / "f.safetensors")
    old = rows(2)
    write_file(path, old, torch.arange(2))
    real_raw_bytes = files.raw_bytes

    def disk_full_after_the_header(t):  # the header went out; then the disk is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(files, "raw_bytes", disk_full_after_the_header)
    with pytest.raises(OSError) as e:
        write_file(path, rows(3), torch.arange(3))
    assert e.value.errno == errno.ENOSPC
    assert os.listdir(tmp_path) == ["f.safetensors"]
    assert torch.equal(load_file(path)["hidden_states"], old)

    monkeypatch.setattr(files, "raw_bytes", real_raw_bytes)
    monkeypatch.setattr(
        files.os, "replace", lambda *a: (_ for _ in ()).throw(OSError(errno.EIO, "I/O"))
    )
    with pytest.raises(OSError):
        write_file(path, rows(3), torch.arange(3))
    assert os.listdir(tmp_path) == ["f.safetensors"]
    assert torch.equal(load_file(path)["hidden_states"], old)


def test_engine_thread_in_inference_mode(storage):
    # vLLM's worker runs the connector under torch.inference_mode(): buffers made there
    # are inference tensors, and the drain and write threads must still fill and read them.
    with torch.inference_mode():
        w = make_writer(storage)
        data = rows(4)
        new(w, storage, i=2)
        save(w, ("i", 0, data[:2]))
        save(w, ("i", 2, data[2:]))  # past the prompt: the buffer grows
        finish(w, i=[1, 2, 3, 4])
    w.close()
    assert torch.equal(load_file(path_of(storage, "i"))["hidden_states"], data)
    assert w.stats.files == 1


def test_stats_reach_vllms_kv_connector_logging(storage):
    """The connector's get_kv_connector_stats gives the writer's counters per interval, and
    vLLM's own KVConnectorLogging rebuilds them through build_kv_connector_stats, sums the
    intervals and logs them ("KV Transfer metrics: ...")."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging

    import vllm_gdn_hs.names
    import vllm_gdn_hs.plugin
    from vllm_gdn_hs.connector import HybridHiddenStatesConnector

    vllm_gdn_hs.plugin.register()
    connector = object.__new__(HybridHiddenStatesConnector)  # its worker side alone
    connector._worker = w = make_writer(storage)
    kv = KVTransferConfig(kv_connector=vllm_gdn_hs.names.CONNECTOR_NAME, kv_role="kv_producer")
    vllm_log = KVConnectorLogging(kv)
    assert connector.get_kv_connector_stats() is None  # nothing yet
    written, real_add = threading.Semaphore(0), w.book.add

    def add(**deltas):  # a file counted: the writer is done with it
        real_add(**deltas)
        for _ in range(deltas.get("files", 0)):
            written.release()

    w.book.add = add
    for names in (["a", "b"], ["c"]):
        new(w, storage, **dict.fromkeys(names, 2))
        save(w, *((r, 0, rows(2)) for r in names))
        finish(w, **{r: [1, 2] for r in names})
        assert all(written.acquire(timeout=30) for _ in names)
        stats = connector.get_kv_connector_stats()
        assert stats.data["files"] == len(names) and stats.data["steps"] == 1
        vllm_log.observe(stats.data)  # what the scheduler gets from the workers, as a dict
    logged = []
    vllm_log.log(lambda fmt, text: logged.append(fmt % text))
    (line,) = logged
    assert line.startswith("KV Transfer metrics: ") and "files=3" in line and "steps=2" in line
    assert f"bytes={3 * 2 * L * H * 2}" in line and "failed" not in line  # zeros left out
    w.close()
    # Gauges are values, not changes: aggregated, the newest is kept, even when it is 0; the
    # log line leaves them out (with several engines logged together it would show one's).
    stats = connector.build_kv_connector_stats({"files": 1, "writing": 2})
    stats = stats.aggregate(connector.build_kv_connector_stats({"files": 2, "writing": 0}))
    assert stats.data == {"files": 3, "writing": 0} and not stats.is_empty()
    assert connector.build_kv_connector_stats({"writing": 0}).is_empty() is False
    vllm_log.observe({"files": 1, "writing": 2})
    vllm_log.observe({"files": 2, "writing": 0})
    vllm_log.log(lambda fmt, text: logged.append(fmt % text))
    assert "files=3" in logged[-1] and "writing" not in logged[-1], logged[-1]


def scrape() -> dict[tuple[str, str], float]:
    """The ``vllm:hidden_states_*`` samples of vLLM's /metrics text, by (name, engine)."""
    from prometheus_client import REGISTRY, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    text = generate_latest(REGISTRY).decode()
    return {
        (s.name, s.labels["engine"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("vllm:hidden_states_") and not s.name.endswith("_created")
    }


def test_stats_reach_vllms_prometheus_metrics(storage, monkeypatch, hybrid_model):
    """vLLM's own PrometheusStatLogger, built from a real config that names the connector,
    shows the writer's figures on /metrics for the engine that reports them: counters summed
    over intervals, and the gauges of writes held up by slow storage, back at 0 once written."""
    import harness
    from vllm.v1.metrics.loggers import PrometheusStatLogger
    from vllm.v1.metrics.stats import SchedulerStats

    import vllm_gdn_hs.names
    import vllm_gdn_hs.plugin
    from vllm_gdn_hs.connector import HybridHiddenStatesConnector

    vllm_gdn_hs.plugin.register()
    prom = PrometheusStatLogger(
        harness.engine_config(hybrid_model, connector=harness.OURS), engine_indexes=[0, 1]
    )
    connector = object.__new__(HybridHiddenStatesConnector)  # its worker side alone
    connector._worker = w = make_writer(storage, write_workers=1)

    def report(engine: int) -> dict:
        """One step's stats, as the scheduler hands them to the stats loggers."""
        if stats := connector.get_kv_connector_stats():
            sched = SchedulerStats(kv_connector_stats=stats.data)  # the payload sent
            prom.record(scheduler_stats=sched, iteration_stats=None, engine_idx=engine)
        got = scrape()
        return {name[len("vllm:hidden_states_") :]: v for (name, e), v in got.items() if e == "1"}

    def wait_for(what, timeout=30.0):
        end = time.monotonic() + timeout
        while not what():
            assert time.monotonic() < end
            time.sleep(0.01)

    gate, real_replace = threading.Event(), os.replace
    monkeypatch.setattr(os, "replace", lambda src, dst: (gate.wait(30), real_replace(src, dst)))
    per_request = 2 * L * H * 2  # 2 rows of bf16
    new(w, storage, a=2, b=2)
    save(w, ("a", 0, rows(2)), ("b", 0, rows(2)))
    finish(w, a=[1, 2], b=[3, 4])
    wait_for(lambda: w.stats.writing == 2)
    held = report(1)
    assert (held["writing"], held["backlog_bytes"], held["in_flight"]) == (2, 2 * per_request, 0)
    assert held["saved_total"] == 0 and held["steps_total"] == 1
    assert all(v == 0 for (_, e), v in scrape().items() if e == "0")  # the other engine's

    gate.set()
    wait_for(lambda: w.stats.files == 2)
    new(w, storage, c=2)
    save(w, ("c", 0, rows(2)))
    finish(w, c=[5, 6])
    wait_for(lambda: w.stats.files == 3 and w.stats.writing == 0)
    done = report(1)
    assert (done["saved_total"], done["saved_bytes_total"]) == (3, 3 * per_request)
    assert (done["writing"], done["backlog_bytes"], done["failed_total"]) == (0, 0, 0)
    assert done["steps_total"] == 2 and done["engine_save_seconds_total"] > 0
    w.close()


def test_a_slot_filled_during_the_forward_pass_counts_only_take_and_hand_over(writer, storage):
    """The layer sink takes its slot before the forward pass and hands it over after: the
    forward pass between is the model's time, not the engine thread's time in save()."""
    new(writer, storage, a=4)
    slot = writer.take(4)
    r = rows(4)
    for column in range(L):
        slot.fill_layer(column, r[:, column])
    time.sleep(0.3)  # the forward pass
    norms = torch.linalg.vector_norm(r.float(), dim=-1)
    writer.save_taken(slot, ["a"], torch.tensor([0, 4], dtype=torch.int32), norms, torch.arange(4))
    finish(writer, a=[1, 2, 3, 4])
    writer.close(timeout=30)
    assert writer.stats.steps == 1 and writer.stats.engine_save_s < 0.1
    assert torch.equal(load_file(path_of(storage, "a"))["hidden_states"], r)
