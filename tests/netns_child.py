"""One simulated host's process for tests/test_netns.py and benchmarks/netns_rates.py, run
inside its namespace (``ip netns exec NS python tests/netns_child.py ROLE --json ARGS``).

- ``segment``: the store host's memory, a Mooncake client lending ``segment`` bytes to the
  store (the producers and the trainer lend none, so every object crosses the network twice:
  put, then read); runs until SIGTERM.
- ``producer``: vLLM's real Scheduler and this package's worker side (tests/test_mooncake.py's
  RowsEngine: seeded random rows, the GPU the only fake), once with the file backend and once
  with mooncake, fed the same requests in the same steps, so each request's file holds the rows
  its object must hold. Each answered request is appended to ``out/answers.jsonl`` as it
  finishes (what a client hands the trainer): the manifest, or ``hidden_states_error``, and the
  file. At the end it waits for ``out/../trainer-done`` (bounded), shuts down, and writes
  ``out/result.json``.
- ``trainer``: reads every producer's answers with hs-connectors' ``MooncakeTransfer`` (bf16)
  or this package's ``MooncakeFP8Transfer`` (fp8), compares each sample with the file
  backend's file bit for bit, deletes it, and journals it (a restarted trainer skips what its
  journal holds); writes ``result.json``.

Every loop is bounded in count and time.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

MB = 1 << 20


def _append(path: str, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _lines(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f.read().splitlines() if line.endswith("}")]


def segment(a: dict) -> None:
    from mooncake.store import MooncakeDistributedStore

    os.environ.setdefault("MC_TCP_BIND_ADDRESS", a["ip"])
    store = MooncakeDistributedStore()
    rc = store.setup(
        a["ip"], "P2PHANDSHAKE", a["segment"], 16 * MB, "tcp", "", a["master"]
    )  # fmt: skip
    if rc != 0:
        sys.exit(f"segment setup failed: {rc}")
    open(a["ready"], "w").close()
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    end = time.monotonic() + a.get("limit_s", 900)
    while not stop and time.monotonic() < end:
        time.sleep(0.1)
    store.close()


def producer(a: dict) -> None:
    import torch
    from test_connector_scheduler import make_request, prompt
    from test_mooncake import RowsEngine

    out, fp8 = a["out"], a.get("fp8", False)
    os.makedirs(out, exist_ok=True)
    opts = {
        "local_hostname": a["ip"],
        "master_server_address": a["master"],
        "global_segment_size": a.get("segment", 0),
        "local_buffer_size": 16 * MB,
    }
    extra = {"shutdown_drain_s": a.get("drain_s", 5), "fp8": fp8}
    if "backlog_gb" in a:
        extra["write_backlog_gb"] = a["backlog_gb"]
    files = RowsEngine(a["model"], os.path.join(out, "files"), fp8=fp8)
    mc = RowsEngine(a["model"], os.path.join(out, "hs"), mooncake=opts, **extra)
    for eng in (files, mc):  # each host its own rows; the same for both of its engines
        eng.gen.manual_seed(a["seed"])
    worker = mc.worker._worker
    answers = os.path.join(out, "answers.jsonl")
    steps, most_backlog, t0 = [], 0, time.monotonic()
    n, per_round, tokens = a["requests"], a.get("per_round", 2), a["tokens"]
    for start in range(0, n, per_round):
        rids = [f"r{i}" for i in range(start, min(start + per_round, n))]
        for rid in rids:
            for eng in (files, mc):
                eng.add(make_request(rid, prompt(tokens, start=int(rid[1:])), max_tokens=2))
        for _ in range(200):
            for eng in (files, mc):
                s = time.monotonic()
                eng.step()
                if eng is mc:
                    steps.append(time.monotonic() - s)
                    most_backlog = max(most_backlog, worker.writer.backlog_bytes)
            if all(r in mc.outputs and r in files.outputs for r in rids):
                break
        for rid in rids:
            _append(answers, {
                "host": a["name"], "rid": rid, "t": time.monotonic() - t0,
                "params": mc.params(rid),
                "file": files.params(rid).get("hidden_states_path"),
            })  # fmt: skip
        time.sleep(a.get("pace_s", 0))
    for eng in (files, mc):
        eng.step()  # the worker hears of the last finish
    files.worker.shutdown()
    flushed = worker.drain.flushed(a.get("flush_s", 120))
    write_s = time.monotonic() - t0
    store = mc.store()
    _append(answers, {"host": a["name"], "done": True})
    done = os.path.join(os.path.dirname(out), "trainer-done")
    end = time.monotonic() + a.get("wait_trainer_s", 120)
    while not os.path.exists(done) and time.monotonic() < end:
        time.sleep(0.1)
    mc.worker.shutdown()
    result = {
        "flushed": flushed,
        "write_s": write_s,
        "steps": len(steps),
        "max_step_s": max(steps),
        "sum_step_s": sum(steps),
        "most_backlog": most_backlog,
        "failed": (stats := worker.stats).failed,
        "engine_waited_s": stats.engine_waited_s,  # for a free host buffer: back-pressure
        "backlog_waited_s": stats.backlog_waited_s,  # the drain, on write_backlog_gb
        "store": dict(store.stats),
        "row_bytes": torch.finfo(torch.bfloat16).bits // 8 * mc.L * mc.hidden,
    }
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump(result, f)


def trainer(a: dict) -> None:
    import torch
    from hs_connectors.mooncake_store import (
        MooncakeHiddenStatesStore,
        MooncakeIntegrityError,
        MooncakeStoreConfig,
    )
    from hs_connectors.transfer import FP8Transfer, MooncakeTransfer
    from safetensors.torch import load_file

    from vllm_gdn_hs.cli.train import MooncakeFP8Transfer
    from vllm_gdn_hs.storage.mooncake_options import advertise_address

    advertise_address(a["ip"])
    cfg = MooncakeStoreConfig(
        local_hostname=a["ip"], master_server_address=a["master"], global_segment_size=0,
        local_buffer_size=64 * MB,
    )  # fmt: skip
    fp8 = a.get("fp8", False)
    transfer = (MooncakeFP8Transfer if fp8 else MooncakeTransfer)(MooncakeHiddenStatesStore(cfg))
    setup_end = time.monotonic() + 60
    while True:  # the master may be away for a moment (restarted)
        try:
            transfer.setup()
            break
        except Exception:
            if time.monotonic() > setup_end:
                raise
            time.sleep(1)
    if "read_timeout_s" in a:  # hs-connectors waits 120 s for a key that never comes
        import functools

        store = transfer.store
        store.get_sample = functools.partial(store.get_sample, timeout=a["read_timeout_s"])
    journal = os.path.join(a["out"], "journal.jsonl")
    done = {r["handle"] for r in _lines(journal)}
    stop_after = a.get("stop_after")  # read this many, then hang (to be killed mid-epoch)
    results: dict[str, dict] = {}
    nbytes, read_s, end = 0, 0.0, time.monotonic() + a.get("limit_s", 300)
    seen: set[tuple[str, str]] = set()
    while time.monotonic() < end:
        answers = [x for p in a["answers"] for x in _lines(p)]
        todo = [x for x in answers if "params" in x]
        finished = {x["host"] for x in answers if x.get("done")}
        for x in todo:
            if (x["host"], x["rid"]) in seen:
                continue
            seen.add((x["host"], x["rid"]))
            params = x["params"]
            handle = params.get("handle")
            if handle is None:
                results[f"{x['host']}/{x['rid']}"] = {**x, "ok": False, "error": params}
                continue
            if handle in done:
                continue
            res = {"host": x["host"], "rid": x["rid"], "ok": False}
            t = time.perf_counter()
            for _attempt in range(120):  # the reader's own client may be cut off for a while
                try:
                    got = transfer.get_generated(params)
                    break
                except (MooncakeIntegrityError, TimeoutError) as e:  # error object, or none
                    got, res["error"] = None, f"{type(e).__name__}: {e}"
                    break
                except Exception as e:  # -900 / -800 / timeout: retry, bounded
                    got, res["error"] = None, f"{type(e).__name__}: {e}"
                    time.sleep(0.5)
            if got is not None:
                read_s += time.perf_counter() - t
                nbytes += params["metadata"]["total_aligned_bytes"]
                wait_end = time.monotonic() + 60  # the file backend writes after the answer
                while not os.path.exists(x["file"]) and time.monotonic() < wait_end:
                    time.sleep(0.05)
                if fp8:
                    want = FP8Transfer(os.path.dirname(x["file"])).get_generated(
                        {"hidden_states_path": x["file"]}
                    )
                else:
                    want = load_file(x["file"])
                hs, w = got["hidden_states"], want["hidden_states"]
                res["ok"] = (
                    hs.dtype == w.dtype
                    and hs.shape == w.shape
                    and torch.equal(hs.view(torch.int16), w.view(torch.int16))
                    and torch.equal(got["token_ids"], want["token_ids"])
                )
                res.pop("error", None)
                transfer.delete(handle)
                res["exists_after"] = transfer.store._store.is_exist(handle)
            results[handle] = res
            done.add(handle)
            _append(journal, {"handle": handle, **res})
            if stop_after is not None and len(done) >= stop_after:
                open(os.path.join(a["out"], "stopped"), "w").close()
                time.sleep(3600)  # killed here, mid-epoch
        if finished >= set(a["hosts"]) and len(seen) >= len(todo):
            break
        time.sleep(0.05)
    with open(os.path.join(a["out"], "result.json"), "w") as f:
        json.dump({"results": results, "bytes": nbytes, "read_s": read_s}, f)
    if a.get("done_file"):
        open(a["done_file"], "w").close()


if __name__ == "__main__":
    role, args = sys.argv[1], json.loads(sys.argv[2])
    {"segment": segment, "producer": producer, "trainer": trainer}[role](args)
