"""Rates across simulated hosts (network namespaces on one machine; tests/netns.py), for
docs/scale.md: how fast one trainer process reads over a veth link, and how fast the producers
put under a bandwidth cap. Not a test: it writes a JSON record and prints it.

    sudo PYTHONPATH=tests python benchmarks/netns_rates.py [--objects 16] [--tokens 256] \
        [--cap-mbit 400]

(from the repository root: tests/ on PYTHONPATH for tests/netns.py, the simulated hosts).

Hosts: ``store`` (``mooncake_master`` and a client lending the store its memory), ``prod1``
and ``prod2`` (the connector's own client, ``MooncakeStore.write``, putting objects of
``tokens`` x 6 layers x 5120 bf16, Qwen3.6-27B's rows; they lend no memory, so every put
crosses the producer's link), ``train`` (hs-connectors' ``MooncakeTransfer``, what speculators'
trainer reads with, one object at a time, then deleting it). Phase 1: both producers put
uncapped, then the trainer reads everything. Phase 2: ``tbf`` caps each producer's link at
``cap-mbit`` and both put again. Each host's traffic stays inside the namespaces.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

WRITER = r"""
import json, os, sys, time, torch
from vllm_gdn_hs.storage.mooncake_client import MooncakeStore
from vllm_gdn_hs.storage.mooncake_options import MooncakeOptions
a = json.loads(sys.argv[1])
store = MooncakeStore(MooncakeOptions(local_hostname=a["ip"], master_server_address=a["master"],
                      global_segment_size=0, local_buffer_size=16 << 20))
rows = torch.randn(a["tokens"], 6, 5120).bfloat16()
ids = torch.arange(a["tokens"])
t0 = time.perf_counter()
for i in range(a["objects"]):
    store.write(f"{a['tag']}-{i}", rows, ids)
secs = time.perf_counter() - t0
print(json.dumps({"bytes": store.stats["bytes"], "seconds": secs}), flush=True)
end = time.monotonic() + 300
while not os.path.exists(a["release"]) and time.monotonic() < end:
    time.sleep(0.1)
store.close()
"""

READER = r"""
import json, sys, time, torch
from hs_connectors.mooncake_store import MooncakeHiddenStatesStore, MooncakeStoreConfig
from hs_connectors.transfer import MooncakeTransfer
from vllm_gdn_hs.storage.mooncake_client import manifest
from vllm_gdn_hs.storage.mooncake_options import advertise_address
a = json.loads(sys.argv[1])
advertise_address(a["ip"])
t = MooncakeTransfer(MooncakeHiddenStatesStore(MooncakeStoreConfig(
    local_hostname=a["ip"], master_server_address=a["master"], global_segment_size=0,
    local_buffer_size=64 << 20)))
t.setup()
nbytes, t0 = 0, time.perf_counter()
for key in a["keys"]:
    params = manifest(key, a["tokens"], 6, 5120, torch.bfloat16)
    t.get_generated(params)
    t.delete(key)
    nbytes += params["metadata"]["total_aligned_bytes"]
print(json.dumps({"bytes": nbytes, "seconds": time.perf_counter() - t0}), flush=True)
"""


def commit() -> str:
    run = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True)
    return run.stdout.decode().strip() or "unknown"


def last_json(path: str) -> dict:
    with open(path) as f:
        lines = [x for x in f.read().splitlines() if x.startswith('{"bytes"')]
    return json.loads(lines[-1])


def main() -> None:
    from mooncake_side import master_binary

    try:
        from netns import Hosts, netns_problem
    except ModuleNotFoundError as e:
        sys.exit(f"{e}: run with PYTHONPATH=tests from the repository root")

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--objects", type=int, default=16, help="objects per producer per phase")
    p.add_argument("--tokens", type=int, default=256, help="tokens per object")
    p.add_argument("--cap-mbit", type=int, default=400, help="phase 2's cap on each producer")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    args = p.parse_args()
    if problem := netns_problem():
        sys.exit(f"cannot run: {problem}")
    binary = master_binary()
    if binary is None:
        sys.exit("mooncake_master not installed (pip install mooncake-transfer-engine-non-cuda)")
    tmp = tempfile.mkdtemp(prefix="netns-rates-")
    hosts = Hosts(["store", "prod1", "prod2", "train"])
    record: dict = {
        "what": "netns_rates",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit(),
        "settings": {
            **vars(args), "layers": 6, "hidden": 5120, "dtype": "bfloat16",
            "link": "veth pair through a bridge namespace", "protocol": "tcp",
            "cpus": os.cpu_count(),
        },
    }  # fmt: skip
    try:
        ip = hosts.ip("store")
        master = f"{ip}:50051"
        hosts.popen("store", [binary, f"-rpc_address={ip}", "-rpc_port=50051",
                              f"-metrics_host={ip}", "-metrics_port=9003"],
                    os.path.join(tmp, "master.log"))  # fmt: skip
        hosts.wait_port("store", master)
        seg = 2 * args.objects * args.tokens * 6 * 5120 * 2 + (64 << 20)
        ready = os.path.join(tmp, "ready")
        seg_args = {"ip": ip, "master": master, "segment": seg, "ready": ready}
        hosts.python("store", ["segment", json.dumps(seg_args)], os.path.join(tmp, "seg.log"))
        end = time.monotonic() + 60
        while not os.path.exists(ready) and time.monotonic() < end:
            time.sleep(0.1)
        for phase in ("uncapped", "capped"):
            if phase == "capped":
                for h in ("prod1", "prod2"):
                    hosts.shape(h, "tbf", "rate", f"{args.cap_mbit}mbit", "burst", "256kbit",
                                "latency", "400ms")  # fmt: skip
            release = os.path.join(tmp, f"release-{phase}")
            writers = {}
            for h in ("prod1", "prod2"):
                a = {"ip": hosts.ip(h), "master": master, "tokens": args.tokens,
                     "objects": args.objects, "tag": f"{phase}-{h}",
                     "release": release}  # fmt: skip
                log = os.path.join(tmp, f"{phase}-{h}.log")
                argv = [sys.executable, "-c", WRITER, json.dumps(a)]
                writers[h] = (log, hosts.popen(h, argv, log))
            end = time.monotonic() + 600
            while any(
                not os.path.exists(log) or '{"bytes"' not in open(log).read()
                for log, _ in writers.values()
            ):
                assert time.monotonic() < end, "writers did not finish"
                assert all(w.poll() in (None, 0) for _, w in writers.values()), "a writer failed"
                time.sleep(0.2)
            record[f"producers_{phase}"] = {h: last_json(log) for h, (log, _) in writers.items()}
            if phase == "uncapped":
                keys = [f"{phase}-{h}-{i}" for h in ("prod1", "prod2") for i in range(args.objects)]
                a = {"ip": hosts.ip("train"), "master": master, "tokens": args.tokens,
                     "keys": keys}  # fmt: skip
                log = os.path.join(tmp, "reader.log")
                r = hosts.popen("train", [sys.executable, "-c", READER, json.dumps(a)], log)
                r.wait(600)
                record["trainer_read"] = last_json(log)
            open(release, "w").close()
            for _, w in writers.values():
                w.wait(120)
    finally:
        hosts.close()
    for name, rec in list(record.items()):
        if isinstance(rec, dict) and "bytes" in rec:
            rec["GB_per_s"] = round(rec["bytes"] / rec["seconds"] / 1e9, 3)
        elif name.startswith("producers_"):
            for r in rec.values():
                r["GB_per_s"] = round(r["bytes"] / r["seconds"] / 1e9, 3)
    os.makedirs(args.out, exist_ok=True)
    stamp = record["date"][:19].replace(":", "").replace("-", "")
    path = os.path.join(args.out, f"netns_rates-{stamp}.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    print(json.dumps(record, indent=1))
    print(f"written {path}")


if __name__ == "__main__":
    main()
