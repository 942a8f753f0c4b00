"""A process that shuts down as vLLM's engine core does, with the connector's worker side inside.

Run by tests/test_shutdown.py: ``python tests/shutdown_child.py FOLDER DRAIN_S WRITE_DELAY_S
WRITE_WORKERS``. It serves requests one step at a time (each: new, its rows, finished) and
prints ``answered PATH`` once a request's path would be in its response. On SIGINT or SIGTERM
it does what vLLM 0.33.0's ``EngineCoreProc.run_engine_core`` does: the handler only records
the request, the running request is aborted, the busy loop ends, the default handlers are put
back (so a second signal would end the process) and the teardown calls the connector's
shutdown (here the worker side's ``close()``). It prints ``draining`` once the writes drain
(inside ``close()``, where the connector logs a second signal instead of dying of it) and
``closed`` after; ``teardown`` before the drain, inside the guard the plugin puts around
vLLM's engine core teardown (patch/shutdown.py). The only fake is the disk: each file write
first sleeps WRITE_DELAY_S.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

import torch

from vllm_gdn_hs import files
from vllm_gdn_hs.config import HiddenStatesConfig
from vllm_gdn_hs.connector.metadata import (
    FinishedRequest,
    HybridHiddenStatesConnectorMetadata,
    NewRequest,
)
from vllm_gdn_hs.connector.worker import HybridHiddenStatesConnectorWorker, signals_logged

L, H, T = 2, 64, 16


def main(folder: str, drain_s: float, delay_s: float, workers: int) -> int:
    real_write = files.write_file

    def slow_write(*args, **kwargs):  # the disk edge: slower than the engine
        time.sleep(delay_s)
        return real_write(*args, **kwargs)

    files.write_file = slow_write
    os.makedirs(folder, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the connector's lines
    stop = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))
    signal.signal(signal.SIGINT, lambda signum, frame: stop.append(signum))
    cfg = HiddenStatesConfig(
        shared_storage_path=folder, write_workers=workers, shutdown_drain_s=drain_s
    )
    worker = HybridHiddenStatesConnectorWorker(
        cfg, T, L, H, torch.bfloat16, device=torch.device("cpu")
    )
    qsl = torch.tensor([0, T])
    i = 0
    try:
        while not stop:
            req_id = f"req-{i}"
            path = files.request_path(folder, req_id)
            worker.on_metadata(
                HybridHiddenStatesConnectorMetadata(new_requests=[NewRequest(req_id, path, T)])
            )
            worker.save(torch.randn(T, L, H).bfloat16() + 1, [req_id], qsl, torch.arange(T))
            if stop:  # the engine aborts what is running when the signal comes
                finished = FinishedRequest(req_id, None)
            else:
                finished = FinishedRequest(req_id, list(range(T)))
            worker.on_metadata(HybridHiddenStatesConnectorMetadata(finished_requests=[finished]))
            if finished.token_ids is not None:
                print(f"answered {path}", flush=True)
            i += 1
            time.sleep(0.001)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as vLLM's engine core, before teardown
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        real_close = worker.writer.close

        def close(deadline):
            print("draining", flush=True)
            return real_close(deadline)

        worker.writer.close = close
        with signals_logged(drain_s):  # as the plugin's EngineCoreProc.shutdown wrap
            print("teardown", flush=True)  # before the connector's close(): vLLM's teardown
            time.sleep(0.5)  # the executor's teardown: the second signal lands here
            worker.close()
        print("closed", flush=True)
    return 0


if __name__ == "__main__":
    folder, drain_s, delay_s, workers = sys.argv[1:5]
    sys.exit(main(folder, float(drain_s), float(delay_s), int(workers)))
