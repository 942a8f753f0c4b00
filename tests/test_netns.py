"""The mooncake pipeline across simulated hosts (network namespaces), with network faults.

Run (as root): python -m pytest tests/test_netns.py -q -m netns. Skipped, saying why, without
root, ``ip netns`` or Mooncake (in CI: failed). The hosts (tests/netns.py): ``store``
(``mooncake_master`` and a client lending the store its memory), two producers, ``prod1`` and
``prod2`` (each vLLM's real Scheduler and this package's worker side, as two data-parallel
engines would run, with the same request ids), and ``train`` (hs-connectors'
``MooncakeTransfer``, or this package's ``mooncake-fp8`` reader); each a child process
(tests/netns_child.py) in its own namespace, every Mooncake address its own namespace address.

Each test checks that nothing is lost: every request answered with a key is read exactly once,
bit for bit equal to the file backend's rows for the same prompt, and deleted; any other
request carries ``hidden_states_error`` or its key's error object; and the test's log says
which fault it made, one line each (``FAULT ...``).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

import pytest
from mooncake_master import require_mooncake
from netns import Hosts, require_netns

pytestmark = pytest.mark.netns

HOSTS = ["store", "prod1", "prod2", "train"]
PRODUCERS = ["prod1", "prod2"]
MB = 1 << 20


class Net:
    """The four hosts, the master and the store's memory on ``store``."""

    def __init__(self, tmp, master_bin: str, segment: int = 256 * MB):
        self.tmp, self.bin, self.segment = str(tmp), master_bin, segment
        self.faults: list[str] = []
        self.hosts = Hosts(HOSTS, log=self._fault)
        self.master_address = f"{self.hosts.ip('store')}:50051"
        self.master = self.seg = None
        self.starts = 0

    def _fault(self, line: str) -> None:
        self.faults.append(line)
        print(line, file=sys.stderr)

    def start_store(self) -> None:
        ip = self.hosts.ip("store")
        self.starts += 1
        argv = [self.bin, f"-rpc_address={ip}", "-rpc_port=50051", f"-metrics_host={ip}",
                "-metrics_port=9003"]  # fmt: skip
        self.master = self.hosts.popen("store", argv, self.log(f"master-{self.starts}"))
        self.hosts.wait_port("store", self.master_address)
        ready = os.path.join(self.tmp, f"segment-ready-{self.starts}")
        args = {"ip": ip, "master": self.master_address, "segment": self.segment, "ready": ready}
        self.seg = self.child("store", "segment", args, f"segment-{self.starts}")
        end = time.monotonic() + 60
        while not os.path.exists(ready):
            assert self.seg.poll() is None, self.read(f"segment-{self.starts}")
            assert time.monotonic() < end, "the store's segment never mounted"
            time.sleep(0.1)

    def log(self, name: str) -> str:
        return os.path.join(self.tmp, f"{name}.log")

    def read(self, name: str) -> str:
        with open(self.log(name)) as f:
            return f.read()

    def child(self, host: str, role: str, args: dict, log: str):
        return self.hosts.python(host, [role, json.dumps(args)], self.log(log))

    def producer(self, host: str, model: str, seed: int, **kw):
        args = {
            "name": host, "ip": self.hosts.ip(host), "master": self.master_address,
            "model": model, "out": os.path.join(self.tmp, host), "seed": seed,
            "requests": 6, "tokens": 300, **kw,
        }  # fmt: skip
        return self.child(host, "producer", args, host)

    def trainer(self, log: str = "train", **kw):
        out = os.path.join(self.tmp, log)
        os.makedirs(out, exist_ok=True)
        args = {
            "ip": self.hosts.ip("train"), "master": self.master_address, "out": out,
            "hosts": PRODUCERS, "done_file": os.path.join(self.tmp, "trainer-done"),
            "answers": [os.path.join(self.tmp, p, "answers.jsonl") for p in PRODUCERS], **kw,
        }  # fmt: skip
        return self.child("train", "trainer", args, log)

    def wait(self, proc, name: str, timeout: float = 240) -> None:
        try:
            proc.wait(timeout)
        except Exception:
            pytest.fail(f"{name} still running after {timeout} s:\n{self.read(name)[-4000:]}")
        assert proc.returncode == 0, f"{name} failed:\n{self.read(name)[-4000:]}"

    def result(self, name: str) -> dict:
        with open(os.path.join(self.tmp, name, "result.json")) as f:
            return json.load(f)

    def answers(self, host: str) -> list[dict]:
        with open(os.path.join(self.tmp, host, "answers.jsonl")) as f:
            return [x for x in map(json.loads, f) if "params" in x]

    def close(self) -> None:
        self.hosts.close()


@pytest.fixture(scope="module")
def master_bin():
    path = require_mooncake()
    require_netns()
    return path


@pytest.fixture
def net(master_bin, tmp_path):
    n = Net(tmp_path, master_bin)
    try:
        n.start_store()
        yield n
    finally:
        n.close()


def check_nothing_lost(net: Net, trainers=("train",), results: dict | None = None) -> dict:
    """Every answered request's key read exactly once, bit-equal, and gone from the store;
    every other request with ``hidden_states_error`` or an error object. The per-key
    results (``results``: already gathered, e.g. from a journal)."""
    if results is None:
        results = {}
        for t in trainers:
            got = net.result(t)["results"]
            for k in got:
                assert k not in results, f"{k} read twice"
            results.update(got)
    answered = {h: net.answers(h) for h in PRODUCERS}
    handles = [x["params"].get("handle") for xs in answered.values() for x in xs]
    keyed = [h for h in handles if h]
    assert len(set(keyed)) == len(keyed), "two requests got one key"
    for host, xs in answered.items():
        for x in xs:
            handle = x["params"].get("handle")
            if handle is None:
                assert "hidden_states_error" in x["params"], x
                continue
            r = results.get(handle)
            assert r is not None, f"{host}/{x['rid']} ({handle}) never read"
            assert r["host"] == host and r["rid"] == x["rid"]
            if not r["ok"]:
                assert r.get("error"), r  # its error object, read as the trainer reads it
            else:
                assert r["exists_after"] == 0  # deleted once read
    return results


def run_pipeline(
    net: Net, model: str, during=None, trainer_kw=None, train_after=False, **kw
) -> dict:
    """The producers, and the trainer (``train_after``: once ``during`` has returned)."""
    procs = {h: net.producer(h, model, seed=i + 1, **kw) for i, h in enumerate(PRODUCERS)}
    trainer = None if train_after else net.trainer(**(trainer_kw or {}))
    if during:
        during(procs, trainer)
    trainer = trainer or net.trainer(**(trainer_kw or {}))
    for h, p in procs.items():
        net.wait(p, h)
    net.wait(trainer, "train")
    return check_nothing_lost(net)


def wait_for_answers(net: Net, timeout: float = 180) -> None:
    """Until both producers have answered a request (they are up and writing)."""
    end = time.monotonic() + timeout
    for h in PRODUCERS:
        while not os.path.exists(os.path.join(net.tmp, h, "answers.jsonl")):
            assert time.monotonic() < end, f"{h} answered nothing in {timeout} s"
            time.sleep(0.05)


def test_two_producers_one_trainer(net, hybrid_model):
    """The 3-host pipeline without faults: each host reaches the master at its address; equal
    request ids on both producers get distinct keys; the trainer reads both hosts' samples."""
    for host in HOSTS:
        run = net.hosts.run(
            host, [sys.executable, "-m", "vllm_gdn_hs.cli", "doctor", "--mooncake-master",
                   net.master_address],
        )  # fmt: skip
        assert run.returncode == 0, run.stdout + run.stderr
        assert f"{net.master_address} answers" in run.stdout
    results = run_pipeline(net, hybrid_model)
    assert len(results) == 12 and all(r["ok"] for r in results.values())
    assert {r["host"] for r in results.values()} == set(PRODUCERS)
    rids = {h: sorted(x["rid"] for x in net.answers(h)) for h in PRODUCERS}
    assert rids["prod1"] == rids["prod2"]  # the same ids, different keys
    for h in PRODUCERS:
        r = net.result(h)
        assert r["flushed"] and r["failed"] == 0 and r["store"]["objects"] == 6


def test_fp8_two_producers(net, hybrid_model):
    """mooncake-fp8 across hosts, read with vllm_gdn_hs.cli.train's reader in bf16."""
    results = run_pipeline(net, hybrid_model, fp8=True, trainer_kw={"fp8": True}, requests=4)
    assert len(results) == 8 and all(r["ok"] for r in results.values())


def test_producer_link_down_then_up(net, hybrid_model):
    """prod1's link goes down for 10 s while it writes, then up: nothing lost."""

    def during(procs, trainer):
        wait_for_answers(net)
        net.hosts.link("prod1", up=False)
        time.sleep(10)
        net.hosts.link("prod1", up=True)

    results = run_pipeline(net, hybrid_model, during=during, requests=8, pace_s=1.0)
    assert len(results) == 16
    bad = {k: r for k, r in results.items() if not r["ok"]}
    log = net.read("prod1")
    for r in bad.values():  # a request not stored: its error says why, and so does the log
        assert r["host"] == "prod1"
    assert len(bad) == net.result("prod1")["failed"]
    assert [f for f in net.faults if "down" in f] and [f for f in net.faults if " up" in f]
    if bad:
        assert "Mooncake" in log


def test_master_killed_and_restarted(net, hybrid_model):
    """The master (and the store's memory with it) goes away mid-run and comes back, having
    lost every object it held. The producers' puts wait for it meanwhile, and each producer
    puts the objects no trainer has read again from its host copies (``unread_copy_size``):
    the trainer, started after the restart so that nothing was read before it, reads every
    sample, bit-equal."""

    def during(procs, trainer):
        wait_for_answers(net)
        net.hosts.fault("master on store killed (SIGKILL), with the store's segment client")
        net.hosts.stop(net.master, 9)
        net.hosts.stop(net.seg, 9)
        time.sleep(3)
        net.start_store()
        net.hosts.fault("master on store restarted")

    results = run_pipeline(
        net, hybrid_model, during=during, requests=8, pace_s=1.0, train_after=True
    )  # fmt: skip
    assert len(results) == 16 and all(r["ok"] for r in results.values())
    logs = "\n".join(net.read(h) for h in PRODUCERS)
    again = [int(n) for n in re.findall(r"lost its objects \(restarted\): (\d+) put again", logs)]
    assert sum(again) > 0 and " lost (no copy" not in logs
    for h in PRODUCERS:  # no put failed: those during the outage waited for the master
        r = net.result(h)
        assert r["failed"] == 0 and r["store"]["errors"] == 0, r
    waited = logs.count("does not answer: puts wait for it")
    print(f"master restart: {sum(again)} objects put again from the producers' copies; "
          f"{waited} puts waited for the master")  # fmt: skip


def master_evictions(net: Net) -> list[str]:
    """The master's periodic metrics lines that count an eviction (none, where nothing was
    evicted)."""
    lines = [x for n in range(1, net.starts + 1) for x in net.read(f"master-{n}").splitlines()]
    metrics = [x for x in lines if "Eviction: Success/Attempts=" in x]
    assert metrics, "the master logged no metrics"
    return [x for x in metrics if "Eviction: Success/Attempts=0/0," not in x]


CAP_MBIT = 16  # the store's link: 2 MB/s both ways, well below what the producers put


def test_store_link_capped_below_the_write_rate(net, hybrid_model):
    """tbf caps the store's link at 16 Mbit/s each way, below the producers' write rate: the
    puts slow down, the writers' backlog reaches write_backlog_gb (1 MB, about one object),
    the drain thread waits on it, the host buffers stay taken and the engine waits for one
    (logged: "waited ... for host buffers"); its steps stay bounded, nothing is evicted or
    fails, and every sample is read, bit-equal."""
    net.hosts.shape("store", "tbf", "rate", f"{CAP_MBIT}mbit", "burst", "32kbit", "latency", "1s")
    results = run_pipeline(net, hybrid_model, requests=8, tokens=600, backlog_gb=0.001)
    assert len(results) == 16 and all(r["ok"] for r in results.values())
    cap = CAP_MBIT * 1e6 / 8
    for h in PRODUCERS:
        r, log = net.result(h), net.read(h)
        assert r["flushed"] and r["failed"] == 0 and r["store"]["errors"] == 0
        assert r["store"]["objects"] == 8 and r["store"]["full_waits"] == 0
        assert r["store"]["bytes"] / r["write_s"] <= cap  # the cap, not the engine, set the pace
        assert r["backlog_waited_s"] > 0 and r["engine_waited_s"] > 0  # back-pressure
        assert "waiting on write_backlog_gb" in log and "for host buffers" in log
        object_bytes = r["store"]["bytes"] / r["store"]["objects"]
        assert r["most_backlog"] <= 0.001 * 1e9 + object_bytes  # host memory bounded
        assert r["max_step_s"] < 30  # a step waits for one object's put, not for the queue
        print(
            f"{h}: {r['store']['bytes'] / r['write_s'] / 1e6:.2f} MB/s put under the "
            f"{cap / 1e6:.0f} MB/s cap; engine waited {r['engine_waited_s']:.1f} s for host "
            f"buffers, drain {r['backlog_waited_s']:.1f} s on the backlog; longest step "
            f"{r['max_step_s']:.2f} s"
        )
    assert master_evictions(net) == []


def test_trainer_host_restarted_mid_epoch(net, hybrid_model):
    """The trainer is killed (SIGKILL) after 4 of 12 samples, between two samples, and a new
    one starts on the same host from its journal (a sample's journal line is written after it
    is read and deleted): across the two, every sample is read exactly once, none twice, none
    missing, each bit-equal."""
    procs = {h: net.producer(h, hybrid_model, seed=i + 1) for i, h in enumerate(PRODUCERS)}
    first = net.trainer(stop_after=4)
    stopped = os.path.join(net.tmp, "train", "stopped")
    end = time.monotonic() + 240
    while not os.path.exists(stopped):
        assert first.poll() is None, net.read("train")[-4000:]
        assert time.monotonic() < end, "the trainer never read 4 samples"
        time.sleep(0.1)
    net.hosts.fault("trainer on train killed (SIGKILL) after 4 samples, mid-epoch")
    net.hosts.stop(first, 9)
    journal = os.path.join(net.tmp, "train", "journal.jsonl")
    with open(journal) as f:
        before = [json.loads(x)["handle"] for x in f]
    assert len(before) == 4
    second = net.trainer(log="train-2", out=os.path.join(net.tmp, "train"))
    net.hosts.fault("trainer on train restarted from its journal (4 samples in it)")
    for h, p in procs.items():
        net.wait(p, h)
    net.wait(second, "train-2")
    after = net.result("train")["results"]  # the second trainer's, in the same folder
    assert not set(before) & set(after), "read again after the restart"
    with open(journal) as f:
        lines = [json.loads(x) for x in f]
    handles = [x["handle"] for x in lines]
    assert len(handles) == len(set(handles)) == 12, "a sample journaled twice, or missing"
    results = check_nothing_lost(net, results={x["handle"]: x for x in lines})
    assert len(results) == 12 and all(r["ok"] for r in results.values())
    print(f"trainer restart: {len(before)} read before the kill, {len(after)} after")


def test_loss_on_the_store_link(net, hybrid_model):
    """2% of the packets the store host receives on its link are dropped at random (iptables'
    statistic match; this kernel has no sch_netem): the producers' puts and the master's RPCs
    come in through it, and the trainer's acknowledgements. TCP resends what is lost: every
    sample is stored and read, bit-equal. No delay is added: this kernel has neither netem
    nor fq, nor modules to load."""
    net.hosts.drop("store", 0.02)
    results = run_pipeline(net, hybrid_model, tokens=600)
    dropped, resent = net.hosts.dropped("store"), net.hosts.retransmits()
    print(f"loss: {dropped} packets dropped on the store's link, {resent} TCP segments resent")
    assert dropped > 0 and resent > 0  # the rule did drop, and TCP sent again
    assert len(results) == 12 and all(r["ok"] for r in results.values())
    for h in PRODUCERS:
        r = net.result(h)
        assert r["flushed"] and r["failed"] == 0 and r["store"]["errors"] == 0
    assert master_evictions(net) == []
