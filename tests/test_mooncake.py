"""The mooncake backend against a real ``mooncake_master`` on 127.0.0.1; CPU only.

Run: python -m pytest tests/test_mooncake.py -q (needs mooncake-transfer-engine-non-cuda, the
dev extra, and libibverbs1 from apt; skipped, saying so, without them). Each test starts its
own master on a free loopback port and kills it by process id (tests/mooncake_master.py).
Requests run through vLLM's real Scheduler and our worker side (test_hostile's Engine; the GPU
is the only fake: each step's rows are seeded random numbers); the objects are read back with
hs-connectors' own ``MooncakeTransfer``. Covers: bf16 objects bit for bit equal to the file
backend's files for the same rows, fp8 objects (``mooncake-fp8``) holding the fp8 files'
tensors and read in bf16 through speculators' training config, keys that ``sanitize_key`` alone
would mix up, the manifest in ``kv_transfer_params``; a failed request's error object (the
reader fails at once, with the reason); the startup check naming the master's address; the
master killed and restarted mid-run; a full store with a slow reader (back-pressure, nothing
evicted, host memory within write_backlog_gb); a reader that never comes (a clear log line,
bounded memory) and shutdown removing what no reader took.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time

import harness
import pytest
import torch
from mooncake_master import HOST, Master, free_port, reader, require_mooncake
from safetensors.torch import load_file
from test_connector_scheduler import make_request, prompt
from test_hostile import Engine

from vllm_gdn_hs.storage import mooncake_client
from vllm_gdn_hs.storage.mooncake_options import MooncakeOptions

MB = 1 << 20


@pytest.fixture(scope="module")
def master_bin():
    return require_mooncake()


@pytest.fixture
def master(master_bin, tmp_path):
    m = Master(master_bin, str(tmp_path))
    m.start()
    try:
        yield m
    finally:
        m.kill()


def options(address: str, segment: int = 64 * MB, **more) -> dict:
    return more | {
        "local_hostname": HOST,
        "master_server_address": address,
        "global_segment_size": segment,
        "local_buffer_size": 16 * MB,
    }


class RowsEngine(Engine):
    """test_hostile's Engine (real Scheduler, our worker side) with seeded random rows, the
    same for two engines given the same requests; ``sent[req][pos]`` keeps each row handed
    over (the last one per position, as the connector keeps it); ``zero`` makes a
    request's rows all-zero."""

    def __init__(self, model, storage, **extra):
        super().__init__(model, storage, **extra)
        self.gen = torch.Generator().manual_seed(0)
        self.sent: dict[str, dict[int, torch.Tensor]] = {}
        self.zero: set[str] = set()
        save = self.worker.save_hidden_states

        def random_rows(hidden_states, req_ids, query_start_loc_cpu, positions):
            # the hook's own names: the runner patches call it with keywords
            rows, ids, qsl, pos = hidden_states, req_ids, query_start_loc_cpu, positions
            rows = torch.randn(rows.shape, generator=self.gen).bfloat16()
            for i, rid in enumerate(ids):
                s, e = int(qsl[i]), int(qsl[i + 1])
                if rid in self.zero:
                    rows[s:e] = 0
                for j in range(s, e):
                    self.sent.setdefault(rid, {})[int(pos[j])] = rows[j].clone()
            save(rows, ids, qsl, pos)

        self.worker.save_hidden_states = random_rows

    def store(self) -> mooncake_client.MooncakeStore:
        return self.worker._worker.storage.store

    def until_finished(self, *rids: str, limit: int = 50) -> None:
        for _ in range(limit):
            if all(r in self.outputs for r in rids):
                break
            self.step()
        self.step()  # the worker hears of the last finish in the next step
        assert self.worker._worker.drain.flushed(60)

    def expected(self, rid: str, n: int) -> torch.Tensor:
        return torch.stack([self.sent[rid][p] for p in range(n)])


def mooncake_engine(model, tmp_path, address, segment=64 * MB, mooncake=None, **extra):
    extra.setdefault("shutdown_drain_s", 3)  # shutdown waits this long for unread objects
    mc = options(address, segment, **(mooncake or {}))
    return RowsEngine(model, str(tmp_path / "hs"), mooncake=mc, **extra)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16))


def assert_sample(eng: RowsEngine, rid: str, got: dict) -> None:
    ids = got["token_ids"]
    assert got["hidden_states"].shape == (len(ids), eng.L, eng.hidden)
    assert same_bits(got["hidden_states"], eng.expected(rid, len(ids)))


IDS = ["a.b", "a_b", "7x"]  # sanitize_key: "a_b", "a_b", "k7x"


def test_objects_equal_the_file_backend_bit_for_bit(hybrid_model, master, tmp_path):
    from hs_connectors.mooncake_hidden_states_connector import sanitize_key

    file_eng = RowsEngine(hybrid_model, str(tmp_path / "files"))
    mc_eng = mooncake_engine(hybrid_model, tmp_path, master.address)
    transfer = reader(master.address)
    lengths = {"a.b": 5, "a_b": 300, "7x": 64}  # 300: chunked prefill (256 tokens a step)
    for eng in (file_eng, mc_eng):
        for rid, n in lengths.items():
            out = {"include_output_tokens": True} if rid == "7x" else None
            eng.add(make_request(rid, prompt(n), max_tokens=3, params=out))
        eng.until_finished(*IDS)
    file_eng.worker.shutdown()
    handles = set()
    for rid in IDS:
        params = mc_eng.params(rid)
        assert set(params) == {"handle", "version", "tensors", "metadata"}
        assert params["handle"].startswith(sanitize_key(rid) + "-")
        handles.add(params["handle"])
        got = transfer.get_generated(params)
        want = load_file(file_eng.params(rid)["hidden_states_path"])
        assert same_bits(got["hidden_states"], want["hidden_states"])
        assert torch.equal(got["token_ids"], want["token_ids"])
        assert got["token_ids"].tolist() == mc_eng.tokens[rid] + [7] * ("x" in rid) * 2
        assert_sample(mc_eng, rid, got)
        transfer.delete(params["handle"])
        assert transfer.store._store.is_exist(params["handle"]) == 0
    assert len(handles) == 3  # one key each, though sanitize_key maps two ids to one
    mc_eng.worker.shutdown()


def test_fp8_objects_hold_the_fp8_files_tensors(hybrid_model, master, tmp_path):
    """mooncake-fp8: each object holds the fp8 file's three tensors bit for bit (hs-connectors'
    stock reader returns them as stored); vllm_gdn_hs.cli.train's reader returns what hs-connectors'
    FP8Transfer reads from the file: bf16, no scales."""
    from hs_connectors.transfer import FP8Transfer

    from vllm_gdn_hs.cli.train import MooncakeFP8Transfer

    file_eng = RowsEngine(hybrid_model, str(tmp_path / "files"), fp8=True)
    mc_eng = mooncake_engine(hybrid_model, tmp_path, master.address, fp8=True)
    stock = reader(master.address)
    fp8_reader, file_reader = MooncakeFP8Transfer(stock.store), FP8Transfer(tmp_path / "files")
    lengths = {"a.b": 5, "a_b": 300, "7x": 64}
    for eng in (file_eng, mc_eng):
        for rid, n in lengths.items():
            eng.add(make_request(rid, prompt(n), max_tokens=3))
        eng.until_finished(*IDS)
    file_eng.worker.shutdown()
    for rid in IDS:
        params, path = mc_eng.params(rid), file_eng.params(rid)["hidden_states_path"]
        stored, file = stock.get_generated(params), load_file(path)
        assert set(stored) == set(file) == {"hidden_states", "hidden_states_scales", "token_ids"}
        for name, want in file.items():
            assert stored[name].dtype == want.dtype and stored[name].shape == want.shape
            assert torch.equal(stored[name].view(torch.uint8), want.view(torch.uint8)), name
        got, want = (
            fp8_reader.get_generated(params),
            file_reader.get_generated({"hidden_states_path": path}),
        )
        assert set(got) == {"hidden_states", "token_ids"} and got["hidden_states"].dtype == (
            torch.bfloat16
        )
        assert same_bits(got["hidden_states"], want["hidden_states"])
        assert torch.equal(got["token_ids"], want["token_ids"])
        err = (got["hidden_states"].float() - mc_eng.expected(rid, lengths[rid]).float()).abs()
        assert err.max() <= 0.07 * mc_eng.expected(rid, lengths[rid]).float().abs().max()
        fp8_reader.delete(params["handle"])
    mc_eng.worker.shutdown()


TRAINER = """
import argparse, json, sys
import vllm_gdn_hs.cli.train as ours
ours.register()  # what python -m vllm_gdn_hs.cli.train does before speculators' config loads
from hs_connectors.transfer import HiddenStatesBackend
from speculators.train.config import TrainConfig
import torch
argv, params, out = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
args = argparse.Namespace(**TrainConfig.resolve(argv).flatten())  # as speculators' main
transfer = HiddenStatesBackend.registry[args.hidden_states_backend].from_train_args(
    args, args.data_path
)
transfer.setup()
sample = transfer.get_generated(params)
torch.save({"type": type(transfer).__name__, "vllm": "vllm" in sys.modules, **sample}, out)
"""


def test_speculators_trainer_reads_fp8_objects(hybrid_model, master, tmp_path):
    """speculators' own training config, in a fresh interpreter with vllm_gdn_hs.cli.train's backend
    registered first: ``--hidden-states-backend mooncake-fp8`` and the --mooncake-* options give
    the reader speculators' main builds, and it returns the sample in bf16."""
    import json
    import subprocess

    mc_eng = mooncake_engine(hybrid_model, tmp_path, master.address, fp8=True)
    mc_eng.add(make_request("r", prompt(40), max_tokens=2))
    mc_eng.until_finished("r")
    argv = [
        "--verifier-name-or-path", "/m", "--data-path", str(tmp_path), "--speculator-type",
        "eagle3", "--hidden-states-backend", "mooncake-fp8", "--mooncake-master",
        master.address, "--mooncake-global-segment-gib", "0", "--mooncake-local-buffer-gib",
        "0.0625",
    ]  # fmt: skip
    out = tmp_path / "sample.pt"
    env = {**os.environ, "MOONCAKE_LOCAL_HOSTNAME": "127.0.0.1"}
    run = subprocess.run(
        [sys.executable, "-c", TRAINER, json.dumps(argv), json.dumps(mc_eng.params("r")), out],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got = torch.load(out)
    assert got["type"] == "MooncakeFP8Transfer" and got["hidden_states"].dtype == torch.bfloat16
    assert not got["vllm"]  # a trainer host needs no vLLM
    assert got["token_ids"].tolist() == mc_eng.tokens["r"]
    want = mc_eng.expected("r", 40).float()
    assert (got["hidden_states"].float() - want).abs().max() <= 0.07 * want.abs().max()
    mc_eng.worker.shutdown()


def test_a_failed_request_gets_an_error_object(hybrid_model, master, tmp_path):
    eng = mooncake_engine(hybrid_model, tmp_path, master.address)
    transfer = reader(master.address)
    eng.zero.add("bad")
    for rid in ("bad", "good"):
        eng.add(make_request(rid, prompt(40)))
    eng.until_finished("bad", "good")
    from hs_connectors.mooncake_store import MooncakeIntegrityError

    with pytest.raises(MooncakeIntegrityError, match="all-zero rows"):
        transfer.get_generated(eng.params("bad"))
    assert_sample(eng, "good", transfer.get_generated(eng.params("good")))
    eng.worker.shutdown()


def test_startup_names_the_master_it_cannot_reach(hybrid_model, master_bin, tmp_path):
    address = f"{HOST}:{free_port()}"  # nothing listens there
    with pytest.raises(ValueError, match=f"cannot reach the Mooncake master at {address}"):
        mooncake_engine(hybrid_model, tmp_path, address)


@pytest.mark.parametrize("copies", [True, False], ids=["copies", "no-copies"])
def test_master_killed_and_restarted(hybrid_model, master, tmp_path, caplog, copies):
    """A restarted master has lost every object. "read" was read before: gone for good.
    "unread" was not: put again from the server's copy (without copies, lost and named in the
    log). "during" is put while the master is down: its put waits for the master. Each
    object left is read once, bit-equal."""
    mc = {} if copies else {"unread_copy_size": 0}
    eng = mooncake_engine(hybrid_model, tmp_path, master.address, mooncake=mc)
    transfer = reader(master.address)
    for rid in ("read", "unread"):
        eng.add(make_request(rid, prompt(30)))
    eng.until_finished("read", "unread")
    assert_sample(eng, "read", transfer.get_generated(eng.params("read")))
    transfer.delete(eng.params("read")["handle"])  # as the trainer does, once it has read it
    deadline, unread = time.monotonic() + 30, eng.params("unread")
    while (left := eng.store().unread_objects.unread()) != [unread["handle"]]:  # "read" forgotten
        assert time.monotonic() < deadline, f"still unread: {left}"
        time.sleep(0.05)

    master.kill()
    with caplog.at_level(logging.WARNING):
        eng.add(make_request("during", prompt(30)))
        eng.until_finished("during")  # the engine goes on; the put waits for the master
        time.sleep(2)
        master.start()  # same port; every object it held is gone
        deadline = time.monotonic() + 60
        while "lost its objects" not in caplog.text:
            assert time.monotonic() < deadline, "the restart was not noticed"
            time.sleep(0.05)
        assert_sample(eng, "during", read_back(transfer, eng.params("during")))
    line = next(r.getMessage() for r in caplog.records if "lost its objects" in r.getMessage())
    if copies:
        assert ": 1 put again from this server's copies, 0 lost" in line
        assert_sample(eng, "unread", read_back(transfer, unread))
    else:
        assert (
            "0 put again from this server's copies, 1 lost (no copy within unread_copy_size, or "
            f"not put again): "
            f"{unread['handle']}" in line
        )
        from hs_connectors.mooncake_store import MooncakeIntegrityError

        with pytest.raises(MooncakeIntegrityError, match="restarted and lost this sample"):
            read_back(transfer, unread)  # the trainer fails on it at once, with the reason
    assert "does not answer: puts wait for it" in caplog.text
    assert eng.worker._worker.stats.failed == 0
    eng.add(make_request("after", prompt(30)))
    eng.until_finished("after")
    assert_sample(eng, "after", transfer.get_generated(eng.params("after")))
    assert eng.store().stats["put_again"] == int(copies) and eng.store().stats["lost"] == 1 - copies
    eng.worker.shutdown()


def read_back(transfer, params, timeout: float = 60.0) -> dict:
    """The sample of ``params``, read as the trainer reads it, retried while the reader's own
    client cannot reach the restarted master yet (is_exist -900: a RuntimeError); the
    producer's error object raises MooncakeIntegrityError."""
    from hs_connectors.mooncake_store import MooncakeIntegrityError

    deadline = time.monotonic() + timeout
    while True:
        try:
            return transfer.get_generated(params)
        except MooncakeIntegrityError:
            raise
        except RuntimeError:
            assert time.monotonic() < deadline, "the reader did not get back to the master"
            time.sleep(0.2)


class SlowReader(threading.Thread):
    """speculators' reader, one sample at a time, each after ``delay`` s; starts reading once
    ``start_when()`` is true."""

    def __init__(self, transfer, start_when, delay=0.05):
        super().__init__(daemon=True)
        self.transfer, self.start_when, self.delay = transfer, start_when, delay
        self.todo: queue.Queue = queue.Queue()
        self.got: dict[str, dict] = {}
        self.failed: dict[str, Exception] = {}

    def run(self):
        while not self.start_when():
            time.sleep(0.01)
        while (item := self.todo.get()) is not None:
            rid, params = item
            time.sleep(self.delay)
            try:
                self.got[rid] = self.transfer.get_generated(params)
                self.transfer.delete(params["handle"])
            except Exception as e:
                self.failed[rid] = e


TOKENS, BACKLOG = 1500, 4e-3  # objects of 3 MB (4 layers x 256 x bf16), 4 MB of backlog


def sample_bytes(eng: RowsEngine) -> int:
    return TOKENS * eng.L * eng.hidden * 2


def run_full_store(eng: RowsEngine, rids: list[str], slow: SlowReader) -> int:
    """Step the engine until every request is finished and written, handing each finished
    request's manifest to ``slow`` at once; returns the most backlog bytes seen."""
    worker, most = eng.worker._worker, [0]
    done = threading.Event()

    def watch():
        while not done.is_set():
            most[0] = max(most[0], worker.writer.backlog_bytes)
            time.sleep(0.001)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    handed = set()
    for _ in range(200):
        eng.step()
        for rid in set(eng.outputs) - handed:
            handed.add(rid)
            slow.todo.put((rid, eng.params(rid)))
        if handed == set(rids):
            break
    eng.step()
    assert worker.drain.flushed(120)
    done.set()
    watcher.join()
    return most[0]


def test_full_store_slows_the_engine_and_evicts_nothing(hybrid_model, master, tmp_path):
    # 16 MiB of store (Mooncake's least) for 12 objects of 3 MB; 4 MB of backlog.
    eng = mooncake_engine(hybrid_model, tmp_path, master.address, 16 * MB, write_backlog_gb=BACKLOG)
    store = eng.store()
    slow = SlowReader(reader(master.address), lambda: store.stats["full_waits"] > 0)
    slow.start()
    rids = [f"r{i}" for i in range(12)]
    for rid in rids:
        eng.add(make_request(rid, prompt(TOKENS)))
    most = run_full_store(eng, rids, slow)
    slow.todo.put(None)
    slow.join(120)
    assert not slow.failed
    assert sorted(slow.got) == sorted(rids)  # none evicted: every sample read
    for rid in rids:
        assert_sample(eng, rid, slow.got[rid])
    assert store.stats["full_waits"] > 0  # the store was full, and the writers waited
    assert most <= BACKLOG * 1e9 + sample_bytes(eng)
    eng.worker.shutdown()


def test_a_reader_that_never_comes(hybrid_model, master, tmp_path, caplog):
    eng = mooncake_engine(hybrid_model, tmp_path, master.address, 16 * MB, write_backlog_gb=BACKLOG)
    store, worker = eng.store(), eng.worker._worker
    rids = [f"r{i}" for i in range(12)]
    for rid in rids:
        eng.add(make_request(rid, prompt(TOKENS)))
    late = SlowReader(reader(master.address), lambda: False, delay=0)
    result = {}
    engine = threading.Thread(
        target=lambda: result.update(most=run_full_store(eng, rids, late)), daemon=True
    )
    with caplog.at_level(logging.WARNING):
        engine.start()
        deadline = time.monotonic() + 60
        while not (store.waiting_full and "the Mooncake store is full" in caplog.text):
            assert time.monotonic() < deadline, "the store never filled"
            time.sleep(0.01)
    line = next(r.getMessage() for r in caplog.records if "store is full" in r.getMessage())
    assert "check that a trainer reads from " + master.address in line
    assert engine.is_alive()  # held back by the full store
    unread = store.unread_objects.unread()
    assert 0 < len(unread) < len(rids)  # the store holds what fits, nothing was evicted
    assert worker.writer.backlog_bytes <= BACKLOG * 1e9 + sample_bytes(eng)

    late.start_when = lambda: True  # the reader comes after all: every sample is there
    late.start()
    engine.join(120)
    late.todo.put(None)
    late.join(120)
    assert not late.failed and sorted(late.got) == sorted(rids)
    assert result["most"] <= BACKLOG * 1e9 + sample_bytes(eng)
    eng.worker.shutdown()


def two_objects_put(eng, master):
    """Requests x and y finished and their objects in the store; their handles, and a client."""
    for rid in ("x", "y"):
        eng.add(make_request(rid, prompt(20)))
    eng.until_finished("x", "y")
    handles = [eng.params(r)["handle"] for r in ("x", "y")]
    other = reader(master.address).store._store
    deadline = time.monotonic() + 30  # drained: the drain thread is done; the puts may run on
    while [other.is_exist(h) for h in handles] != [1, 1]:
        assert time.monotonic() < deadline, "the objects were never put"
        time.sleep(0.01)
    return handles, other


def test_shutdown_removes_what_no_reader_took(hybrid_model, master, tmp_path, caplog):
    eng = mooncake_engine(hybrid_model, tmp_path, master.address, shutdown_drain_s=1)
    handles, other = two_objects_put(eng, master)
    t0 = time.monotonic()
    with caplog.at_level(logging.INFO):
        eng.worker.shutdown()
    assert time.monotonic() - t0 >= 1  # it waited shutdown_drain_s for a reader
    assert [other.is_exist(h) for h in handles] == [0, 0]
    assert "2 objects not read by a trainer by the end of shutdown_drain_s" in caplog.text
    assert "and 2 objects in all were removed at shutdown" in caplog.text
    shut = [r.getMessage() for r in caplog.records if "shut down; " in r.getMessage()]
    assert shut and "shut down; 2 objects (" in shut[-1], shut  # objects, not files


def test_shutdown_waits_for_a_trainer_still_reading(hybrid_model, master, tmp_path, caplog):
    """The objects live in the server's segment and go with it: a stop (SIGTERM at the end of
    a Slurm job) waits, within shutdown_drain_s, for the trainer to read what it was told of."""
    eng = mooncake_engine(hybrid_model, tmp_path, master.address, shutdown_drain_s=60)
    handles, _ = two_objects_put(eng, master)
    transfer, got = reader(master.address), {}

    def trainer():  # reads once shutdown has begun
        time.sleep(1.0)
        for rid in ("x", "y"):
            got[rid] = transfer.get_generated(eng.params(rid))
            transfer.delete(eng.params(rid)["handle"])

    t = threading.Thread(target=trainer)
    t.start()
    t0 = time.monotonic()
    with caplog.at_level(logging.INFO):
        eng.worker.shutdown()
    t.join(30)
    assert sorted(got) == ["x", "y"]
    for rid in ("x", "y"):
        assert_sample(eng, rid, got[rid])
    assert time.monotonic() - t0 < 30  # done once read, not at the end of the 60 s
    assert "waiting up to" in caplog.text and "0 objects not read" in caplog.text


def test_request_ids_and_params_from_the_network(hybrid_model, master, tmp_path):
    """Hostile ids get keys of their own; a custom hidden_states_path is ignored."""
    eng = mooncake_engine(hybrid_model, tmp_path, master.address)
    transfer = reader(master.address)
    rids = ["../../x", "a\x00b", "ü" * 300, "", "a:error"]
    for rid in rids:
        eng.add(make_request(rid, prompt(8), params={"hidden_states_path": "/etc/x"}))
    eng.until_finished(*rids)
    keys = {eng.params(r)["handle"] for r in rids}
    assert len(keys) == len(rids)
    for rid in rids:
        assert_sample(eng, rid, transfer.get_generated(eng.params(rid)))
    eng.worker.shutdown()


_ = harness  # the CPU engine (imported for its side effect through test_hostile)


def test_odd_row_sizes_round_trip(master):
    """Rows whose bytes are no multiple of 8 put the scales and token ids at odd offsets of the
    object's tail; hs-connectors' reader still gets every tensor back bit for bit."""
    from hs_connectors.fp8_utils import quantize_tensor_to_fp8

    store = mooncake_client.MooncakeStore(MooncakeOptions(**options(master.address)))
    transfer = reader(master.address)
    try:
        for i, (shape, fp8) in enumerate(
            (((3, 1, 10), False), ((5, 3, 7), True), ((1, 1, 1), True))
        ):
            rows, scales = torch.randn(shape).bfloat16(), None
            if fp8:
                rows, scales = quantize_tensor_to_fp8(rows)
            ids = torch.arange(100, 100 + shape[0])
            store.write(f"odd{i}", rows, ids, scales)
            got = transfer.get_generated(
                mooncake_client.manifest(f"odd{i}", *shape, rows.dtype, fp8=fp8)
            )
            want = {"hidden_states": rows, "token_ids": ids}
            if fp8:
                want["hidden_states_scales"] = scales
            assert set(got) == set(want)
            for name, t in want.items():
                assert torch.equal(got[name].view(torch.uint8), t.view(torch.uint8)), (shape, name)
    finally:
        store.close()


@pytest.mark.parametrize("fp8", [False, True], ids=["mooncake", "mooncake-fp8"])
def test_the_benchmarks_store_takes_every_object(tmp_path, fp8):
    """benchmarks/mooncake_side.py (the bench's mooncake variants): its own master, the
    connector's store writing into it, and the trainer's side counting, reading (fp8: in bf16,
    with vllm_gdn_hs.cli.train's reader) and removing."""
    import types

    from hs_connectors.fp8_utils import quantize_tensor_to_fp8

    require_mooncake()
    from mooncake_side import LocalStore

    local = LocalStore(str(tmp_path / "master.log"), segment_gib=1 / 16, fp8=fp8)
    store = mooncake_client.MooncakeStore(MooncakeOptions(**local.options()))
    try:
        outs, total = [], 0
        for i, n in enumerate((5, 40, 1)):
            key = f"r{i}-bench"
            rows, scales = torch.randn(n, 2, 8).bfloat16(), None
            if fp8:
                rows, scales = quantize_tensor_to_fp8(rows)
            store.write(key, rows, torch.arange(n), scales)
            params = mooncake_client.manifest(key, n, 2, 8, torch.bfloat16, fp8=fp8)
            total += params["metadata"]["total_aligned_bytes"]
            outs.append(types.SimpleNamespace(kv_transfer_params=params))
        ready_s, nbytes, count, read_s = local.take_all(outs, timeout=10, read=True)
        assert (nbytes, count) == (total, 3) and ready_s < 10 and read_s > 0
        assert type(local._reader()).__name__ == (
            "MooncakeFP8Transfer" if fp8 else "MooncakeTransfer"
        )
        assert store.client.batch_is_exist([f"r{i}-bench" for i in range(3)]) == [0, 0, 0]
        store.write_error("bad-bench", "boom")  # its reader fails at once, so does the bench
        bad = mooncake_client.manifest("bad-bench", 3, 2, 8, torch.bfloat16)
        with pytest.raises(RuntimeError, match="error object"):
            local.take_all([types.SimpleNamespace(kv_transfer_params=bad)], timeout=10)
        never = mooncake_client.manifest("never-put", 3, 2, 8, torch.bfloat16)
        with pytest.raises(TimeoutError, match="0 of 1 objects"):
            local.take_all([types.SimpleNamespace(kv_transfer_params=never)], timeout=0.5)
    finally:
        store.close()
        local.close()
    assert local.proc.poll() is not None  # stopped by its process id
