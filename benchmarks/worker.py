"""The child process of one variant (``bench.py --worker SPEC.json``): builds the engine (vLLM,
or HF transformers in hf_worker.py), runs each workload and writes a record per workload (per
batch size for hf) to the spec's result_file as it goes, so the parent keeps what was done
before a timeout."""

from __future__ import annotations

import json
import os
import shutil
import time
import traceback

from host import GpuMemPoller
from logparse import generating_mark, ready_mark
from outputs import check_space, dir_bytes, record_error, reset_dir
from records import FAILED, OK
from workloads import WARMUP_PROMPTS, make_workload, prompt_ids

from vllm_gdn_hs.locks import take_finished

CONNECTORS = {
    "ours": "HybridHiddenStatesConnector",
    "ours-layers": "HybridHiddenStatesConnector",  # with layer_by_layer: true (VARIANT_CONFIG)
    "ours-v2": "HybridHiddenStatesConnector",  # on Model Runner V2 (plan.variant_env)
    "ours-prev": "HybridHiddenStatesConnector",  # the defaults before graph_aux_buffers
    "fp8": "HybridHiddenStatesConnector",  # with fp8: true (VARIANT_CONFIG)
    "mooncake": "HybridHiddenStatesConnector",  # objects in a local Mooncake store (run_vllm)
    "mooncake-fp8": "HybridHiddenStatesConnector",  # those objects in fp8
    "upstream": "ExampleHiddenStatesConnector",
}
# merged under --connector-config
VARIANT_CONFIG = {
    "fp8": {"fp8": True},
    "mooncake-fp8": {"fp8": True},
    "ours-layers": {"layer_by_layer": True},
    # the defaults until 2026-12-07: no graph_aux_buffers (docs/memory.md), 2 host buffers
    "ours-prev": {"graph_aux_buffers": False, "host_buffers": 2},
}


def wait_files_ready(out_dir: str, outputs, expected: int, timeout: float) -> float:
    """Seconds until every expected hidden-state file exists and is unlocked."""
    paths = [(o.kv_transfer_params or {}).get("hidden_states_path") for o in outputs]
    paths = [p if os.path.isabs(p) else os.path.join(out_dir, p) for p in paths if p]
    t0, done = time.perf_counter(), set()
    while True:
        if len(paths) < expected:  # the connector returned no paths: count what is there
            paths = [
                os.path.join(root, n)
                for root, _, names in os.walk(out_dir)
                for n in names
                if n.endswith(".safetensors")
            ]
        done.update(p for p in paths if p not in done and take_finished(p))
        if len(done) >= expected:
            return time.perf_counter() - t0
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError(
                f"{len(done)} of {expected} hidden-state files finished after {timeout:.0f} s "
                f"in {out_dir}: raise --drain-timeout or check the connector's log"
            )
        time.sleep(0.005)


def engine_kwargs(spec: dict) -> dict:
    kw = dict(
        model=spec["model_dir"],
        load_format="dummy",
        language_model_only=True,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        enforce_eager=spec["eager"],
        enable_prefix_caching=False,
        max_model_len=spec["max_model_len"],
        seed=0,
    )
    backend = spec.get("gdn_backend", "triton")  # specs before --gdn-backends forced triton
    if backend != "default":  # "default": vLLM chooses (on Hopper flashinfer's kernel)
        kw["additional_config"] = {"gdn_prefill_backend": backend}
    if spec["gpu_memory_utilization"]:  # 0: vLLM's default (0.34.0: the extensible KV cache)
        kw["gpu_memory_utilization"] = spec["gpu_memory_utilization"]
    for name in ("max_num_batched_tokens", "max_num_seqs"):  # 0 or absent: vLLM's default
        if spec.get(name):
            kw[name] = spec[name]
    connector = CONNECTORS.get(spec["variant"])
    if connector:
        from vllm_gdn_hs.config import extraction_config

        kw.update(
            extraction_config(
                spec["layers"],
                spec["out_dir"],
                connector,
                **{**VARIANT_CONFIG.get(spec["variant"], {}), **spec.get("connector_config", {})},
            )
        )
    kw.update(spec["extra_engine_kwargs"])
    return kw


def _has_v1_runner() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm.v1.worker.gpu_model_runner") is not None


def engine_config(llm) -> dict | str:
    """What vLLM chose, for reading the figures (0.20.1 attribute names)."""
    try:
        c = llm.llm_engine.vllm_config
        return dict(
            async_scheduling=c.scheduler_config.async_scheduling,
            hybrid_kv_cache_manager=not c.scheduler_config.disable_hybrid_kv_cache_manager,
            max_num_seqs=c.scheduler_config.max_num_seqs,
            max_num_batched_tokens=c.scheduler_config.max_num_batched_tokens,
            block_size=c.cache_config.block_size,
            prefix_caching=c.cache_config.enable_prefix_caching,
            # from 0.22.0 vLLM may choose Model Runner V2; 0.34.0 has no other runner
            model_runner="v2" if getattr(c, "use_v2_model_runner", not _has_v1_runner()) else "v1",
            extensible_kv_cache=getattr(c.cache_config, "enable_extensible_kv_cache", False),
            gpu_memory_utilization=c.cache_config.gpu_memory_utilization,
            num_gpu_blocks=c.cache_config.num_gpu_blocks,
            additional_config=c.additional_config,
        )
    except Exception as e:
        return repr(e)


def run_vllm(spec: dict, emit, poller: GpuMemPoller) -> None:
    from vllm import LLM, SamplingParams

    store = None
    if spec["variant"].startswith("mooncake"):  # its master, and the trainer's reads
        from mooncake_side import LocalStore

        log, fp8 = spec["result_file"] + ".master.log", spec["variant"] == "mooncake-fp8"
        store = LocalStore(log, spec["mooncake_segment_gib"], fp8=fp8)
        cfg = {**spec.get("connector_config", {}), "mooncake": store.options()}
        spec = {**spec, "connector_config": cfg}
    try:
        _run_vllm(spec, emit, poller, LLM, SamplingParams, store)
    finally:
        if store is not None:
            store.close()


def _run_vllm(spec: dict, emit, poller: GpuMemPoller, LLM, SamplingParams, store) -> None:
    kwargs = engine_kwargs(spec)
    recorded_kwargs = json.loads(json.dumps(kwargs))  # vLLM fills config objects into nested dicts
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    startup = dict(startup_s=round(time.perf_counter() - t0, 1), startup_peak_gpu_mib=poller.take())
    print(ready_mark(spec["variant"], time.time()), flush=True)
    startup["engine_config"] = engine_config(llm)
    connector = spec["variant"] in CONNECTORS
    out_dir = spec["out_dir"]
    for name in spec["workloads"]:
        w = make_workload(name, spec["seed"])
        rec = dict(w.stats(), **startup, engine_kwargs=recorded_kwargs)
        try:
            reset_dir(out_dir)
            if connector and store is None:
                check_space(out_dir, w, spec)
            prompts = [{"prompt_token_ids": ids} for ids in prompt_ids(w, spec["seed"])]
            extra = None
            if w.output_tokens and connector:
                extra = {"kv_transfer_params": {"include_output_tokens": True}}
            sp = SamplingParams(max_tokens=w.max_tokens, ignore_eos=True, extra_args=extra)
            warm = SamplingParams(
                max_tokens=min(w.max_tokens, 8), ignore_eos=True, extra_args=extra
            )
            rec["sampling"] = dict(max_tokens=w.max_tokens, ignore_eos=True, extra_args=extra)
            outs = llm.generate(prompts[:WARMUP_PROMPTS], warm, use_tqdm=False)
            if store is not None:
                store.take_all(outs, spec["drain_timeout"])
            elif connector:
                wait_files_ready(out_dir, outs, len(outs), spec["drain_timeout"])
            reset_dir(out_dir)
            poller.take()
            print(generating_mark(spec["variant"], name, time.time()), flush=True)
            t0 = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            gen_s = time.perf_counter() - t0
            ready_s = 0.0
            read = {}
            if store is not None:  # objects, not files: counted as the files are; one trainer
                ready_s, nbytes, nfiles, read_s = store.take_all(  # reads them all
                    outs, spec["drain_timeout"], read=True
                )
                read = dict(trainer_read_s=round(read_s, 3))
                read["trainer_read_gb_s"] = round(nbytes / read_s / 1e9, 3)
            else:
                if connector:
                    ready_s = wait_files_ready(out_dir, outs, len(outs), spec["drain_timeout"])
                nbytes, nfiles = dir_bytes(out_dir)
            rec.update(
                status=OK,
                gen_s=round(gen_s, 3),
                files_ready_s=round(ready_s, 3),
                output_tokens=sum(len(o.outputs[0].token_ids) for o in outs),
                files=nfiles,
                bytes_written=nbytes,
                peak_gpu_mib=poller.take(),
                **read,
            )
        except Exception as e:
            record_error(rec, e)
        emit(rec)
        reset_dir(out_dir)
    shutil.rmtree(out_dir, ignore_errors=True)
    try:  # as tests/test_gpu_extract.py; the parent kills whatever is left
        llm.llm_engine.engine_core.shutdown()
    except Exception as e:
        print(f"[bench] engine shutdown: {e!r}", flush=True)


def main(spec_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    records: list[dict] = []

    def emit(rec: dict) -> None:
        records.append(rec)
        tmp = spec["result_file"] + ".tmp"
        with open(tmp, "w") as f:
            json.dump(records, f, indent=1, default=repr)  # a stray object never loses a record
        os.replace(tmp, spec["result_file"])  # the parent keeps what was done before a timeout
        if rec["status"] == OK:
            msg = (
                f"{rec['prompt_tokens'] / rec['gen_s']:,.0f} prompt tok/s, "
                f"files ready {rec['files_ready_s']} s"
            )
        else:
            msg = (rec["error"].strip().splitlines() or [rec["status"]])[-1]
        print(
            f"[bench] {spec['variant']} {rec['workload']} bs={rec.get('batch_size', '-')}: {msg}",
            flush=True,
        )

    poller = GpuMemPoller()
    poller.start()
    try:
        if spec["variant"] == "hf":
            from hf_worker import run_hf

            run_hf(spec, emit, poller)
        else:
            run_vllm(spec, emit, poller)
    except Exception:  # startup failed: one error record per workload not yet measured
        err = traceback.format_exc(limit=-3)
        done = {r["workload"] for r in records}
        for name in spec["workloads"]:
            if name not in done:
                emit(dict(make_workload(name, spec["seed"]).stats(), status=FAILED, error=err))
        return 1
    finally:
        poller.stopped = True
    return 0
