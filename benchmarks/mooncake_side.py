"""The ``mooncake`` variant's store: a ``mooncake_master`` on 127.0.0.1 for one engine, and the
trainer's side of each workload (wait until every request's object is in the store, count its
bytes, remove it, as a trainer deletes what it read).

The objects live in the engine's own segment (``segment_gib``: it must hold one workload's
objects, since ``LLM.generate`` returns the handles only at the end); the reader lends none.
Stopped by its process id. Needs the ``mooncake`` package of the machine's CUDA build
(``mooncake-transfer-engine-cuda13`` for vLLM's CUDA 13 builds) and libibverbs.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time

HOST = "127.0.0.1"
ERROR_SUFFIX = ":error"  # hs-connectors' error object (vllm_gdn_hs.connector.mooncake_store)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def master_binary() -> str | None:
    """The ``mooncake_master`` next to the ``mooncake`` package, or on PATH; None without it."""
    try:
        import mooncake
    except ImportError:
        return None
    here = os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master")
    return here if os.access(here, os.X_OK) else shutil.which("mooncake_master")


def start_master(path: str, port: int, log_path: str, timeout: float = 30.0) -> subprocess.Popen:
    """Start ``mooncake_master`` on 127.0.0.1:``port``, logging to ``log_path``, and wait until
    it takes connections; RuntimeError with the log's tail (the process killed) if it does
    not within ``timeout`` s."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            master_command(path, port, free_port()), stdout=log, stderr=subprocess.STDOUT
        )
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((HOST, port), timeout=1).close()
            return proc
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                if proc.poll() is None:
                    os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
                with open(log_path) as f:
                    log = f.read()[-2000:]
                raise RuntimeError(f"mooncake_master did not start: {log}") from None
            time.sleep(0.05)


def _required_master_binary() -> str:
    path = master_binary()
    if path is None:
        raise RuntimeError(
            "mooncake_master not found: pip install mooncake-transfer-engine-cuda13 (vLLM's "
            "CUDA 13 builds) or mooncake-transfer-engine (CUDA 12)"
        )
    return path


def master_command(path: str, port: int, metrics_port: int) -> list[str]:
    """``mooncake_master`` on 127.0.0.1:``port``. The wheels differ: the ``-cuda13`` 0.3.11
    master has no ``-metrics_host`` and stops on a flag it does not know, so the flags it lists
    in ``--helpfull`` decide."""
    listed = subprocess.run([path, "--helpfull"], capture_output=True, text=True, timeout=30)
    cmd = [path, f"-rpc_address={HOST}", f"-rpc_port={port}", f"-metrics_port={metrics_port}"]
    if "-metrics_host " in listed.stdout + listed.stderr:
        cmd.append(f"-metrics_host={HOST}")
    return cmd


def reader(address: str, segment: int = 0):
    """hs-connectors' own ``MooncakeTransfer`` (speculators' trainer reads with it) on the master
    at ``address``; by default it lends no memory, so every object lies in the server's
    segment and each read crosses TCP."""
    from hs_connectors.mooncake_store import MooncakeHiddenStatesStore, MooncakeStoreConfig
    from hs_connectors.transfer import MooncakeTransfer

    cfg = MooncakeStoreConfig(
        local_hostname=HOST,
        master_server_address=address,
        global_segment_size=segment,
        local_buffer_size=64 << 20,
    )
    transfer = MooncakeTransfer(MooncakeHiddenStatesStore(cfg))
    transfer.setup()
    return transfer


class LocalStore:
    def __init__(self, log_path: str, segment_gib: float, timeout: float = 30.0, fp8=False):
        os.environ["MC_TCP_BIND_ADDRESS"] = HOST  # the engine's client advertises loopback
        self.port = free_port()
        self.address = f"{HOST}:{self.port}"
        self.segment = int(segment_gib * 2**30)
        self.log_path = log_path
        self.proc = start_master(_required_master_binary(), self.port, log_path, timeout)
        self.client = None
        self.fp8 = (
            fp8  # read with vllm_gdn_hs.cli.train's reader: bf16 back, as the trainer sees it
        )

    def options(self) -> dict:
        """``kv_connector_extra_config["mooncake"]`` for the engine."""
        return dict(
            local_hostname=HOST,
            master_server_address=self.address,
            global_segment_size=self.segment,
            local_buffer_size=2**30,
            protocol="tcp",
        )

    def _reader(self):
        if self.client is None:
            self.client = reader(self.address)
            if self.fp8:
                from vllm_gdn_hs.cli.train import MooncakeFP8Transfer

                self.client = MooncakeFP8Transfer(self.client.store)
        return self.client

    def take_all(self, outputs, timeout: float, read=False) -> tuple[float, int, int, float]:
        """Seconds until every output's object is in the store, their bytes, their count, and
        with ``read`` the seconds one trainer process took to read them all (hs-connectors'
        ``MooncakeTransfer``, what speculators' trainer reads with, one object at a time);
        then removes them. RuntimeError for a request with an error object or no handle."""
        params = [o.kv_transfer_params or {} for o in outputs]
        handles = [p.get("handle") for p in params]
        if not all(handles):
            raise RuntimeError(f"{handles.count(None)} outputs have no mooncake handle")
        transfer, t0, pending = self._reader(), time.perf_counter(), list(handles)
        client = transfer.store._store  # the reader's own mooncake client
        while pending:
            found = client.batch_is_exist(pending)
            pending = [h for h, e in zip(pending, found, strict=True) if e != 1]
            failed = [h for h in pending if client.is_exist(h + ERROR_SUFFIX) == 1]
            if failed:
                raise RuntimeError(f"{len(failed)} requests got an error object, e.g. {failed[0]}")
            if pending and time.perf_counter() - t0 > timeout:
                raise TimeoutError(
                    f"{len(handles) - len(pending)} of {len(handles)} objects in the store "
                    f"after {timeout:.0f} s: raise --drain-timeout or check the connector's log"
                )
            time.sleep(0.005 if pending else 0)
        ready_s = time.perf_counter() - t0
        nbytes = sum(p["metadata"]["total_aligned_bytes"] for p in params)
        read_s = 0.0
        if read:
            t1 = time.perf_counter()
            for p in params:
                sample = transfer.get_generated(p)
                if sample is None or "hidden_states" not in sample:
                    raise RuntimeError(f"the trainer's reader got nothing for {p['handle']}")
                del sample
            read_s = time.perf_counter() - t1
        for h in handles:
            client.remove(h, True)
        return ready_s, nbytes, len(handles), read_s

    def close(self) -> None:
        if self.client is not None:  # hs-connectors' reader has no close of its own
            self.client.store._store.close()
            self.client = None
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
