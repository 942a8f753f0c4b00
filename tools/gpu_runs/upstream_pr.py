"""The upstream pull request (patches/upstream/) on the GPU, on a patched copy of vLLM 0.34.0.

Run by tools/gpu_runs/upstream_pr.sh, which applies the patch to a copy of the installed vLLM and
puts it first on PYTHONPATH (this checkout, tests/ and benchmarks/ after it, for the test models
and the workloads); vLLM plugins are off (VLLM_PLUGINS=), so what runs is stock vLLM
plus the patch, with the PR's own AuxHiddenStatesConnector.

    python tools/gpu_runs/upstream_pr.py accuracy OUT.json   # tiny hybrid + dense, eager + graphs
    python tools/gpu_runs/upstream_pr.py bench OUT.json      # 27B shape: plain, example, aux
    python tools/gpu_runs/upstream_pr.py tp OUT.json         # two GPUs: TP=2 against TP=1

accuracy: per model (tiny Qwen3.5 hybrid, tiny Qwen3 dense; tests/tiny_models.py), the PR's
connector and ExampleHiddenStatesConnector, each in eager and in CUDA-graph mode, each asked as
speculators asks (`extract_hidden_states`), for the same prompts, prompt-only and with
include_output_tokens. Each run is judged against HF transformers fp32 on the same weights
(vllm_gdn_hs.verify.reference: per layer, pooled over the run's files, within 1.1 x HF bf16's own
error), and the PR's files against Example's of the same mode, row by row over the tokens both
hold.

tp: the PR's connector on the tiny hybrid with CUDA graphs, at tensor parallel size 1 and 2 (two
GPUs), the accuracy requests. Each run is judged against HF fp32 as above; every request gets
one complete file and the folder holds nothing else (only rank 0 writes: a second writer would
fail on rank 0's locks, which upstream_pr.sh finds in the log); TP=2's files carry TP=1's
token ids over the prompt and lie within 2.2 x HF bf16's error of TP=1's (each run is within
1.1 x of fp32, and TP=2 splits every matmul and adds an all-reduce, so the two round
differently).

bench: Qwen3.6-27B shape, dummy weights, CUDA graphs, vLLM 0.34.0's defaults (the extensible
KV cache sized after warm-up): KV cache tokens, the sizing lines, prompt tokens/s. One fresh
process per variant (bench-one).
"""

from __future__ import annotations

import gc
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time

AUX, EXAMPLE = "AuxHiddenStatesConnector", "ExampleHiddenStatesConnector"
# Ascending: the order in which the model returns aux states and both connectors store them.
LAYERS = {"hybrid": [1, 3, 4, 6, 8], "dense": [1, 2, 4, 8]}
# More decode steps than the PR's COMPACT_AFTER_VIEWS (32): those requests' rows get compacted.
OUTPUT_TOKENS = 40


def _prompts(seed: int, lens: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 1000) for _ in range(n)] for n in lens]


# One-token, short, chunk-crossing and long prompts, then 40 of 5-60 tokens in one batch.
PROMPTS = _prompts(0, [1, 17, 100, 700]) + _prompts(
    1, [random.Random(2).randrange(5, 60) for _ in range(40)]
)
WITH_OUTPUTS = PROMPTS[1:9]


def _save(path: str, results: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1)
    os.replace(tmp, path)


def engine_kwargs(
    model: str, kind: str, connector: str | None, storage: str, eager: bool, tp: int = 1
):
    from vllm_gdn_hs.config import extraction_config

    kw = dict(
        model=model,
        tensor_parallel_size=tp,
        skip_tokenizer_init=True,
        max_model_len=2048,
        max_num_batched_tokens=512,  # the 700-token prompt is chunked
        seed=0,
        gpu_memory_utilization=0.3,
        enforce_eager=eager,
        enable_prefix_caching=False,  # the PR's connector refuses prefix caching
        additional_config={"gdn_prefill_backend": "triton"},
    )
    if kind == "hybrid":
        kw["language_model_only"] = True
    if connector:
        kw.update(extraction_config(LAYERS[kind], storage, connector))
    return kw


def _generate(llm, prompts, outputs: bool):
    from vllm import SamplingParams

    if outputs:
        params = SamplingParams(
            temperature=0.0,
            max_tokens=OUTPUT_TOKENS,
            ignore_eos=True,
            extra_args={"kv_transfer_params": {"include_output_tokens": True}},
        )
    else:
        params = SamplingParams(temperature=0.0, max_tokens=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.kv_transfer_params or {}).get("hidden_states_path") for o in outs]


def run_engine(model, kind, connector, storage, eager, tp: int = 1) -> dict:
    """Both request sets through one engine; the file paths (None: no path answered)."""
    import torch
    from vllm import LLM

    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs(model, kind, connector, storage, eager, tp))
    started = time.perf_counter() - t0
    try:
        config = llm.llm_engine.vllm_config
        info = {
            "startup_s": round(started, 1),
            "speculative_config": config.speculative_config is not None,
            "kv_cache_tokens": config.cache_config.kv_cache_size_tokens,
        }
        paths = {
            "prompt": _generate(llm, PROMPTS, outputs=False),
            "outputs": _generate(llm, WITH_OUTPUTS, outputs=True),
        }
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    return {"info": info, "paths": paths}


def _layer_errors(got, ref) -> list[float]:
    from vllm_gdn_hs.verify.reference import relative_errors

    return [round(e, 5) for e in relative_errors(got, ref)]


def judge_vs_hf(reference, paths: list, prompts: list, outputs: bool) -> tuple[dict, list[str]]:
    """The run's files against HF fp32 (the bar), as tests/gpu/test_gpu_extract.py does: each
    holds its prompt, and with ``outputs`` also all generated tokens but the last."""
    from vllm_gdn_hs.files import load_hidden_states
    from vllm_gdn_hs.verify.reference import worst_by_layer

    reference.reset()
    checks, problems = [], []
    for path, prompt in zip(paths, prompts, strict=True):
        if not path:
            problems.append("no hidden_states_path answered")
            continue
        data = load_hidden_states(path, timeout=60)
        seq = list(prompt)
        if outputs:  # the generated tokens, as the file has them; their count checked here
            seq = data["token_ids"].tolist()
            if seq[: len(prompt)] != list(prompt) or len(seq) != len(prompt) + OUTPUT_TOKENS - 1:
                problems.append(f"{path}: token_ids are not the prompt + {OUTPUT_TOKENS - 1}")
                continue
        result = reference.check(data, seq)
        checks.append(result)
        problems += [f"{path} ({len(seq)} tokens): {p}" for p in result["problems"]]
    pooled = reference.pooled()
    problems += pooled["problems"]
    figures = {
        "files": pooled["files"],
        "pooled_ours_vs_fp32": [round(x, 5) for x in pooled["ours"]],
        "pooled_hf_bf16_vs_fp32": [round(x, 5) for x in pooled["hf_bf16"]],
        "pooled_ratio": [round(x, 3) for x in pooled["ratio"]],
        **worst_by_layer(checks),
    }
    return figures, problems


def compare_files(
    ours: list, theirs: list, prompts: list, tolerance: list[float]
) -> tuple[dict, list[str]]:
    """One run's files against another's for the same prompts (the PR's against Example's, or
    TP=2's against TP=1's), over the tokens both hold (at least the prompt; generated tokens
    may part after a near-tie): per layer the pooled relative difference, which must stay
    within ``tolerance`` (HF bf16's own error against fp32, or a multiple of it)."""
    from vllm_gdn_hs.files import hidden_states_of, load_hidden_states

    num = den = None
    rows = equal_rows = 0
    problems = []
    for a, b, prompt in zip(ours, theirs, prompts, strict=True):
        if not (a and b):
            problems.append(f"missing path: {a}, the other run's {b}")
            continue
        da, db = load_hidden_states(a, timeout=60), load_hidden_states(b, timeout=60)
        ta, tb = da["token_ids"].tolist(), db["token_ids"].tolist()
        n = min(len(ta), len(tb))
        n = next((i for i in range(n) if ta[i] != tb[i]), n)
        if n < len(prompt):
            problems.append(f"{a}: token_ids part from the other run's at {n}, in the prompt")
            continue
        ha, hb = hidden_states_of(da)[:n].float(), hidden_states_of(db)[:n].float()
        if ha.shape != hb.shape:
            problems.append(f"{a}: shape {tuple(ha.shape)} vs the other run's {tuple(hb.shape)}")
            continue
        d = (ha - hb).double().pow(2).sum(dim=(0, 2))
        r = hb.double().pow(2).sum(dim=(0, 2))
        num, den = (d, r) if num is None else (num + d, den + r)
        rows += n
        equal_rows += int((ha == hb).all(dim=(1, 2)).sum())
    if num is None:
        return {"rows": 0}, problems or ["nothing compared"]
    diff = (num / den.clamp(min=1e-30)).sqrt().tolist()
    problems += [
        f"layer {i}: pooled difference {x:.5f} from the other run's files over {t:.5f}"
        for i, x, t in zip(range(len(diff)), diff, tolerance, strict=True)
        if not x <= max(t, 1e-3)
    ]
    figures = {
        "rows": rows,
        "bitwise_equal_rows": equal_rows,
        "pooled_rel_diff_by_layer": [round(x, 5) for x in diff],
    }
    return figures, problems


def _verdict(out_path: str, results: dict, failed: list, what: str) -> int:
    results["failed"] = failed
    results["passed"] = not failed
    _save(out_path, results)
    print(f"[upstream-pr] {what}: {'PASSED' if not failed else 'FAILED: ' + str(failed)}")
    return 0 if not failed else 1


def run_and_judge(results, failed, reference, key, model, kind, connector, storage, eager, tp=1):
    """One engine's runs (run_engine) judged against HF fp32 into results[key]; the run, or
    None if the engine failed (the other runs still tell something)."""
    try:
        run = run_engine(model, kind, connector, storage, eager, tp)
    except Exception as e:
        results[key] = {"error": f"{type(e).__name__}: {e}"}
        failed.append(key)
        return None
    results[key] = dict(run["info"])
    for requests, prompts in (("prompt", PROMPTS), ("outputs", WITH_OUTPUTS)):
        paths = run["paths"][requests]
        figures, problems = judge_vs_hf(reference, paths, prompts, requests == "outputs")
        results[key][f"{requests}_vs_hf"] = figures
        if problems:
            results[key][f"{requests}_problems"] = problems[:10]
            failed.append(f"{key} {requests} vs HF")
    return run


def accuracy(out_path: str) -> int:
    from tiny_models import build_tiny_dense, build_tiny_hybrid

    from vllm_gdn_hs.verify.reference import HFReference

    # UPSTREAM_PR_MODES and UPSTREAM_PR_MODELS pick the modes and the tiny models (all by
    # default), so that a short device session can run what an earlier one did not reach.
    modes = os.environ.get("UPSTREAM_PR_MODES", "eager,cudagraph").split(",")
    kinds = os.environ.get("UPSTREAM_PR_MODELS", ",".join(LAYERS)).split(",")
    if not set(modes) <= {"eager", "cudagraph"} or not set(kinds) <= set(LAYERS):
        print(
            f"[upstream-pr] accuracy: UPSTREAM_PR_MODES={modes} (eager and/or cudagraph), "
            f"UPSTREAM_PR_MODELS={kinds} (hybrid and/or dense)"
        )
        return 2
    results: dict = {
        "layers": LAYERS,
        "prompts": len(PROMPTS),
        "with_outputs": len(WITH_OUTPUTS),
        "modes": modes,
        "models": kinds,
    }
    failed = []
    root = tempfile.mkdtemp(prefix="upstream-pr-")
    builders = {"hybrid": build_tiny_hybrid, "dense": build_tiny_dense}
    for kind in kinds:
        model = builders[kind](os.path.join(root, kind))
        reference = HFReference(model, LAYERS[kind], batch_tokens=32768)
        reference.precompute(PROMPTS)
        runs = {}
        for name, connector, eager in (
            ("aux_eager", AUX, True),
            ("example_eager", EXAMPLE, True),
            ("aux_cudagraph", AUX, False),
            ("example_cudagraph", EXAMPLE, False),
        ):
            if ("eager" if eager else "cudagraph") not in modes:
                continue
            key = f"{kind}_{name}"
            storage = os.path.join(root, key)
            run = run_and_judge(
                results, failed, reference, key, model, kind, connector, storage, eager
            )
            if run is not None:
                runs[name] = run
                if connector == AUX and results[key]["speculative_config"]:
                    failed.append(f"{key}: the speculative config was kept")
                print(f"[upstream-pr] {key}: {json.dumps(results[key])[:600]}", flush=True)
            _save(out_path, results)
        # Like with like: eager and compiled kernels round differently, and each mode's files
        # may differ from the other mode's by about HF bf16's error (run 41: dense, 1.04 x).
        for mode in ("eager", "cudagraph"):
            name, example = f"aux_{mode}", f"example_{mode}"
            if name in runs and example in runs:
                key = f"{kind}_{name}_vs_example"
                results[key] = {}
                for requests in ("prompt", "outputs"):
                    tolerance = results[f"{kind}_{name}"][f"{requests}_vs_hf"].get(
                        "pooled_hf_bf16_vs_fp32", []
                    )
                    figures, problems = compare_files(
                        runs[name]["paths"][requests],
                        runs[example]["paths"][requests],
                        PROMPTS if requests == "prompt" else WITH_OUTPUTS,
                        tolerance,
                    )
                    results[key][requests] = figures
                    if problems:
                        results[key][f"{requests}_problems"] = problems[:10]
                        failed.append(f"{key} {requests}")
                print(f"[upstream-pr] {key}: {json.dumps(results[key])}", flush=True)
                _save(out_path, results)
        reference.close()
    return _verdict(out_path, results, failed, "accuracy")


def tensor_parallel(out_path: str) -> int:
    """TP=2 against TP=1 with the PR's connector (the module's docstring says what is judged)."""
    import torch
    from tiny_models import build_tiny_hybrid

    from vllm_gdn_hs.verify.reference import HFReference

    if torch.cuda.device_count() < 2:
        print(f"[upstream-pr] tp: needs two GPUs, {torch.cuda.device_count()} visible")
        return 2
    results: dict = {"layers": LAYERS["hybrid"], "prompts": len(PROMPTS)}
    failed = []
    root = tempfile.mkdtemp(prefix="upstream-pr-tp-")
    model = build_tiny_hybrid(os.path.join(root, "hybrid"))
    reference = HFReference(model, LAYERS["hybrid"], batch_tokens=32768)
    reference.precompute(PROMPTS)
    runs = {}
    for tp in (1, 2):
        key, storage = f"tp{tp}", os.path.join(root, f"tp{tp}")
        run = run_and_judge(
            results, failed, reference, key, model, "hybrid", AUX, storage, False, tp
        )
        if run is not None:
            runs[tp] = run
            # Read, so each lock was taken and removed: what is left is the answered files.
            answered = {os.path.basename(p) for ps in run["paths"].values() for p in ps if p}
            others = sorted(set(os.listdir(storage)) - answered)
            results[key]["files"] = len(answered)
            if others or len(answered) != len(PROMPTS) + len(WITH_OUTPUTS):
                results[key]["other_entries"] = others[:10]
                failed.append(f"{key}: {len(answered)} files answered, {len(others)} other entries")
            print(f"[upstream-pr] tp {key}: {json.dumps(results[key])[:600]}", flush=True)
        _save(out_path, results)
    if len(runs) == 2:
        results["tp2_vs_tp1"] = {}
        for requests, prompts in (("prompt", PROMPTS), ("outputs", WITH_OUTPUTS)):
            bf16 = results["tp1"][f"{requests}_vs_hf"].get("pooled_hf_bf16_vs_fp32", [])
            tolerance = [2.2 * x for x in bf16]
            figures, problems = compare_files(
                runs[2]["paths"][requests], runs[1]["paths"][requests], prompts, tolerance
            )
            results["tp2_vs_tp1"][requests] = figures
            if problems:
                results["tp2_vs_tp1"][f"{requests}_problems"] = problems[:10]
                failed.append(f"tp2_vs_tp1 {requests}")
        print(f"[upstream-pr] tp2_vs_tp1: {json.dumps(results['tp2_vs_tp1'])}", flush=True)
    reference.close()
    return _verdict(out_path, results, failed, "tp")


# ---- 27B shape: KV cache capacity and throughput ------------------------------------------

BENCH_VARIANTS = {"plain": None, "example": EXAMPLE, "aux": AUX}
SIZING_RE = re.compile(r"(Memory after warmup: .*|Extended KV cache to .*|Available KV cache .*)")


def bench_one(variant: str, spec_path: str) -> int:
    """One variant in this process: engine start, warm-up, each workload; a JSON record."""
    from vllm import LLM, SamplingParams
    from workloads import DEFAULT_LAYERS, make_workload, prompt_ids

    from vllm_gdn_hs.config import extraction_config
    from vllm_gdn_hs.locks import take_finished

    with open(spec_path) as f:
        spec = json.load(f)
    storage = os.path.join(spec["storage"], variant)
    kw = dict(
        model=spec["model_dir"],
        load_format="dummy",
        language_model_only=True,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        enforce_eager=False,
        additional_config={"gdn_prefill_backend": "triton"},
        enable_prefix_caching=False,
        max_model_len=spec["max_model_len"],
        max_num_seqs=spec["max_num_seqs"],
        seed=0,
    )
    if BENCH_VARIANTS[variant]:
        kw.update(extraction_config(DEFAULT_LAYERS[64], storage, BENCH_VARIANTS[variant]))
    t0 = time.perf_counter()
    llm = LLM(**kw)
    config = llm.llm_engine.vllm_config
    record = {
        "variant": variant,
        "startup_s": round(time.perf_counter() - t0, 1),
        "kv_cache_tokens": config.cache_config.kv_cache_size_tokens,
        "num_gpu_blocks": config.cache_config.num_gpu_blocks,
        "extensible_kv_cache": getattr(config.cache_config, "enable_extensible_kv_cache", None),
        "gpu_memory_utilization": config.cache_config.gpu_memory_utilization,
        "speculative_config": config.speculative_config is not None,
        "workloads": {},
    }
    for name in spec["workloads"]:
        w = make_workload(name, 0)
        prompts = [{"prompt_token_ids": ids} for ids in prompt_ids(w, 0)]
        extra = None
        if w.output_tokens and BENCH_VARIANTS[variant]:
            extra = {"kv_transfer_params": {"include_output_tokens": True}}
        sp = SamplingParams(max_tokens=w.max_tokens, ignore_eos=True, extra_args=extra)
        llm.generate(prompts[:8], sp, use_tqdm=False)  # warm-up
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        gen_s = time.perf_counter() - t0
        paths = [(o.kv_transfer_params or {}).get("hidden_states_path") for o in outs]
        ready_s = None
        if BENCH_VARIANTS[variant]:
            done, deadline = set(), time.perf_counter() + 300
            while len(done) < len(paths) and time.perf_counter() < deadline:
                done |= {p for p in paths if p and p not in done and take_finished(p)}
                time.sleep(0.01)
            ready_s = round(time.perf_counter() - t0 - gen_s, 2)
            record["workloads"][name + "_files"] = len(done)
        stats = w.stats()
        record["workloads"][name] = {
            "gen_s": round(gen_s, 3),
            "prompt_tok_s": round(stats["prompt_tokens"] / gen_s, 1),
            "files_ready_s": ready_s,
            **stats,
        }
        print(f"[upstream-pr] bench {variant} {name}: {record['workloads'][name]}", flush=True)
        subprocess.run(["rm", "-rf", storage], check=False)
    with open(spec["result_file"], "w") as f:
        json.dump(record, f, indent=1)
    llm.llm_engine.engine_core.shutdown()
    return 0


def bench(out_path: str) -> int:
    from workloads import DEFAULT_LAYERS, write_model_dir

    root = tempfile.mkdtemp(prefix="upstream-pr-bench-")
    storage = "/dev/shm/upstream-pr-hs" if os.path.isdir("/dev/shm") else root
    workloads = os.environ.get("UPSTREAM_PR_WORKLOADS", "128x1024").split(",")
    variants = os.environ.get("UPSTREAM_PR_VARIANTS", "plain,aux,example").split(",")
    timeout = int(os.environ.get("UPSTREAM_PR_VARIANT_TIMEOUT", "180"))
    # The workloads send at most 128 requests; vLLM's default of 1024 sequences needs more
    # Mamba cache blocks for CUDA-graph capture than one H100 holds at this shape.
    max_num_seqs = int(os.environ.get("UPSTREAM_PR_MAX_NUM_SEQS", "256"))
    results: dict = {
        "shape": "27b",
        "layers": DEFAULT_LAYERS[64],
        "max_model_len": 8448,
        "max_num_seqs": max_num_seqs,
        "workloads": workloads,
        "variants": {},
    }
    for variant in variants:
        spec = {
            "model_dir": write_model_dir(root, "27b"),
            "storage": storage,
            "max_model_len": 8448,
            "max_num_seqs": max_num_seqs,
            "workloads": workloads,
            "result_file": os.path.join(root, f"{variant}.json"),
        }
        spec_path = os.path.join(root, f"{variant}.spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        log_path = out_path.replace(".json", f"-{variant}.log")
        with open(log_path, "w") as log:
            # Its own process group: a timeout also ends the engine core it started.
            proc = subprocess.Popen(
                [sys.executable, __file__, "bench-one", variant, spec_path],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = f"timeout after {timeout} s"
        with open(log_path) as f:
            text = f.read()
        record = {"rc": rc}
        if os.path.exists(spec["result_file"]):
            with open(spec["result_file"]) as f:
                record.update(json.load(f))
        record["sizing_log"] = SIZING_RE.findall(text)[-4:]
        kv = re.findall(r"KV cache size: ([\d,]+) tokens", text)
        record["kv_cache_tokens_log"] = int(kv[-1].replace(",", "")) if kv else None
        results["variants"][variant] = record
        _save(out_path, results)
        print(f"[upstream-pr] bench {variant}: rc={rc} kv={record.get('kv_cache_tokens')}")
    plain = results["variants"].get("plain", {})
    for record in results["variants"].values():
        if plain.get("kv_cache_tokens") and record.get("kv_cache_tokens"):
            record["kv_x_plain"] = round(record["kv_cache_tokens"] / plain["kv_cache_tokens"], 4)
        for name, w in record.get("workloads", {}).items():
            base = plain.get("workloads", {}).get(name)
            if isinstance(w, dict) and isinstance(base, dict):
                w["x_plain"] = round(w["prompt_tok_s"] / base["prompt_tok_s"], 4)
    _save(out_path, results)
    return 0 if all(r["rc"] == 0 for r in results["variants"].values()) else 1


def main(argv: list[str]) -> int:
    if argv[:1] == ["accuracy"] and len(argv) == 2:
        return accuracy(argv[1])
    if argv[:1] == ["bench"] and len(argv) == 2:
        return bench(argv[1])
    if argv[:1] == ["tp"] and len(argv) == 2:
        return tensor_parallel(argv[1])
    if argv[:1] == ["bench-one"] and len(argv) == 3:
        return bench_one(argv[1], argv[2])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
