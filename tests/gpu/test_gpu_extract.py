"""GPU suite: HybridHiddenStatesConnector on vLLM against HF transformers.

Run on a CUDA machine with the plugin installed (vLLM finds it by entry point):
    pytest -m gpu tests/gpu/test_gpu_extract.py -v -s
Set VLLM_GDN_HS_RESULTS=/path/results.json to keep the measured figures.
Covers: hybrid Qwen3.5 and dense Qwen3 tiny models (built here, random weights) and a
deeper hybrid (12 layers, hidden 384, GDN value heads = 3 x key heads, as Qwen3.6-27B),
>= 4 layer ids in unsorted order incl. 1 and N, prompts of 1/17/100/700 tokens,
chunked prefill, 80 requests in one batch, eager and CUDA-graph mode (with one-token
prompts in steps of one token per request: alone and among decodes), vLLM's
default scheduling, include_output_tokens, preemption, an abort, and the KV
cache capacity against the same engine without extraction.
Judged against HF run in fp32 on the same bf16 weights (vllm_gdn_hs.verify.reference): each
file complete and sane, per layer within GROSS_FACTOR x HF bf16's own error; each run
(one _check batch) per layer within BAR_FACTOR x HF bf16's error, both pooled over the
run's files. RESULTS keeps, per run and layer, the pooled errors of ours and of HF bf16.
"""

from __future__ import annotations

import gc
import json
import os
import random
import re
import time
from contextlib import contextmanager

import pytest
import torch
from tiny_models import build_deep_hybrid, build_tiny_dense, build_tiny_hybrid

from vllm_gdn_hs.config import extraction_config
from vllm_gdn_hs.files import hidden_states_of, load_hidden_states, read_header
from vllm_gdn_hs.locks import lock_held
from vllm_gdn_hs.verify.reference import (
    BAR_FACTOR,
    GROSS_FACTOR,
    HFReference,
    describe_pooled,
    file_problems,
    relative_errors,
    worst_by_layer,
)

pytestmark = pytest.mark.gpu

# Configured order kept.
LAYERS = {"hybrid": [1, 6, 3, 8, 4], "dense": [8, 1, 4, 2], "deep": [1, 3, 6, 9, 11, 12]}
BAR = (
    f"per run and layer, pooled over the run's files: rel err vs HF fp32 <= {BAR_FACTOR} x "
    f"HF bf16's; per file and layer: <= {GROSS_FACTOR} x HF bf16's"
)
BASE_LENS = [1, 17, 100, 700]
BATCH_TOKENS = 32768  # HF reference tokens a pass (tiny models)
RESULTS: dict = {}


def describe(worst: dict) -> str:
    """One line for a :func:`~vllm_gdn_hs.verify.reference.worst_by_layer` result, for the log."""
    if not worst:
        return "no file to compare"
    return (
        f"max rel err vs HF fp32 {worst['max_rel_err_vs_fp32']:.4f} "
        f"(HF bf16 {worst['max_hf_bf16_err_vs_fp32']:.4f}), worst ratio to HF bf16's in one "
        f"file {worst['worst_ratio']:.3f} (per-file bound {GROSS_FACTOR}); by layer "
        f"{worst['rel_err_vs_fp32_by_layer']} (HF bf16 {worst['hf_bf16_err_vs_fp32_by_layer']})"
    )


def _prompts(seed: int, lens: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 1000) for _ in range(n)] for n in lens]


BASE = _prompts(0, BASE_LENS)
MANY = _prompts(1, [random.Random(2).randrange(5, 60) for _ in range(80)])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {
        "hybrid": build_tiny_hybrid(str(root / "hybrid")),
        "dense": build_tiny_dense(str(root / "dense"), num_hidden_layers=8),
        "deep": build_deep_hybrid(str(root / "deep")),
    }


@pytest.fixture(scope="module")
def reference(models):
    """reference[kind]: HF fp32 and bf16 of that model (HFReference: loaded on first use,
    cached per prompt); reference[kind](prompt) -> (fp32, bf16) [T, L, H]. Prompts of one
    length share HF's passes (a run's twelve 1,799-token sequences: one pass, not twelve)."""
    refs = {
        kind: HFReference(path, LAYERS[kind], batch_tokens=BATCH_TOKENS)
        for kind, path in models.items()
    }
    yield refs
    for ref in refs.values():
        ref.close()


def model_implementations() -> dict[str, str]:
    """The module of the class vLLM's registry resolves each tiny model's architecture to on
    this platform (0.34.0 on CUDA: Qwen3.5/3.6 in vllm.models.qwen3_5.nvidia)."""
    from vllm.model_executor.models.registry import ModelRegistry

    found = {}
    for arch in ("Qwen3_5ForConditionalGeneration", "Qwen3ForCausalLM"):
        cls = ModelRegistry._try_load_model_cls(arch)
        found[arch] = f"{cls.__module__}.{cls.__qualname__}" if cls is not None else "none"
    return found


@pytest.fixture(scope="module", autouse=True)
def save_results():
    import datetime
    import subprocess

    import vllm

    from vllm_gdn_hs.version import runner_in_use

    commit = (
        os.environ.get("VLLM_GDN_HS_COMMIT")
        or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
    )
    RESULTS["environment"] = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        commit=commit or "unknown",
        vllm=vllm.__version__,
        torch=torch.__version__,
        gpu=torch.cuda.get_device_name(0),
        runner=runner_in_use(),
        gdn_prefill_backend="triton (the tiny models' GDN head dim 64; vLLM's default needs 128)",
        model_implementations=model_implementations(),
    )
    yield


@pytest.fixture(autouse=True)
def write_results():
    """The results file after every test, so that a run cut short keeps what finished."""
    yield
    path = os.environ.get("VLLM_GDN_HS_RESULTS")
    if path:
        with open(path, "w") as f:  # "_" keys hold tensors passed between tests
            json.dump({k: v for k, v in RESULTS.items() if not k.startswith("_")}, f, indent=1)


@contextmanager
def engine(model: str, kind: str, storage: str, extract: bool | str = True, options=None, **kw):
    from vllm import LLM

    args = dict(
        model=model,
        skip_tokenizer_init=True,
        max_model_len=2048,
        seed=0,
        gpu_memory_utilization=0.3,
        enforce_eager=True,
        additional_config={"gdn_prefill_backend": "triton"},
    )
    if kind != "dense":
        args["language_model_only"] = True
    if extract == "layer_ids":  # the connector's own option, no speculative config
        kv = extraction_config([], storage)["kv_transfer_config"]
        kv["kv_connector_extra_config"]["layer_ids"] = LAYERS[kind]
        args["kv_transfer_config"] = kv
    elif extract:  # as speculators asks for it
        args.update(extraction_config(LAYERS[kind], storage, **(options or {})))
    args.update(kw)
    llm = LLM(**args)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def _generate(llm, prompts, **sp):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, **{"max_tokens": 1, **sp})
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def pooled_figures(pooled: dict) -> dict:
    """An HFReference.pooled result as RESULTS keeps it: per layer the pooled errors
    against HF fp32 of ours and of HF bf16, and their ratio (the bar: <= BAR_FACTOR)."""
    return {
        "files": pooled["files"],
        **{k: [round(x, 4) for x in pooled[k]] for k in ("ours", "hf_bf16", "ratio")},
    }


def assert_pooled(name: str, pooled: dict) -> None:
    """The run's errors, pooled over its files, within the bar for every layer."""
    assert not pooled["problems"], (
        f"{name}: over the bar, pooled over {pooled['files']} files:\n"
        + "\n".join(pooled["problems"])
    )


def _check(kind, outputs, prompts, reference, name, include_outputs=False, pool=True) -> list[dict]:
    """One run, judged against HF fp32 (BAR): every file complete, sane and within the
    per-file bound, then (``pool``: for runs of several files) the run's errors pooled over
    its files within the bar. Returns
    each file's HFReference.check result, in order. RESULTS keeps the pooled errors per
    layer of ours and of HF bf16, the worst in one file, and both for one file of each
    length."""
    reference[kind].reset()  # each run pooled on its own
    seqs = [
        list(prompt) + (list(out.outputs[0].token_ids)[:-1] if include_outputs else [])
        for out, prompt in zip(outputs, prompts, strict=True)
    ]
    reference[kind].precompute(seqs)
    checks, table, failed = [], {}, []
    for out, prompt, seq in zip(outputs, prompts, seqs, strict=True):
        assert list(out.prompt_token_ids) == list(prompt)
        path = (out.kv_transfer_params or {}).get("hidden_states_path")
        assert path, f"{name}: no hidden_states_path in kv_transfer_params"
        data = load_hidden_states(path, timeout=30)
        result = reference[kind].check(data, seq)
        checks.append(result)
        table.setdefault(
            len(seq), {k: [round(e, 4) for e in result[k]] for k in ("ours", "hf_bf16")}
        )
        if result["problems"]:
            failed.append(f"{path} ({len(seq)} tokens): {result['problems']}")
    worst, pooled = worst_by_layer(checks), reference[kind].pooled()
    RESULTS[name] = {
        "layers": LAYERS[kind],
        "files": len(outputs),
        "bar": BAR,
        "pooled_vs_fp32": pooled_figures(pooled),
        **worst,
        "rel_err_vs_fp32_by_len": table,
    }
    print(f"\n{name}: {describe_pooled(pooled)}\n  one file at worst: {describe(worst)}")
    assert not failed, f"{name}: {len(failed)} of {len(outputs)} files fail:\n" + "\n".join(
        failed[:10]
    )
    if pool:
        assert_pooled(name, pooled)
    return checks


def _abort_files(folder) -> list[str]:
    return sorted(f for f in os.listdir(folder) if f.startswith("abort-"))


def test_hybrid_eager_chunked(models, reference, tmp_path):
    with engine(models["hybrid"], "hybrid", str(tmp_path), max_num_batched_tokens=256) as llm:
        sched = llm.llm_engine.vllm_config.scheduler_config
        RESULTS["hybrid_eager_chunked_config"] = {
            "hma": not sched.disable_hybrid_kv_cache_manager,
            "async_scheduling": bool(sched.async_scheduling),
            "prefix_caching": bool(llm.llm_engine.vllm_config.cache_config.enable_prefix_caching),
        }
        assert sched.disable_hybrid_kv_cache_manager is False
        checks = _check("hybrid", _generate(llm, BASE), BASE, reference, "hybrid_eager_chunked")
        RESULTS["_chunked_700"] = checks[3]
        _check("hybrid", _generate(llm, MANY), MANY, reference, "hybrid_eager_80_requests")

        # Aborts: each request leaves either nothing (aborted in prefill) or a
        # complete, correct file (it finished first); never a lock or a temp file.
        from vllm import SamplingParams

        engine_ = llm.llm_engine
        long = _prompts(4, [2000] * 8)  # ~8 steps each at 256 tokens a step
        ids = [
            engine_.add_request(f"abort-{i}", {"prompt_token_ids": p}, SamplingParams(max_tokens=1))
            for i, p in enumerate(long)
        ]
        engine_.step()
        engine_.abort_request([f"abort-{i}" for i in range(len(long))])
        # Drain here: LLM.generate would also collect (and fail to sort) the outputs
        # of any abort-* request that finished before its abort landed.
        deadline = time.monotonic() + 60
        while engine_.has_unfinished_requests() and time.monotonic() < deadline:
            engine_.step()
        _generate(llm, BASE[:2])  # the engine steps on past the aborts
        # A finished file keeps its released .lock until a reader takes it (speculators'
        # protocol); an aborted request must leave neither lock nor temp file.
        deadline = time.monotonic() + 10
        while any(
            lock_held(os.path.join(tmp_path, f))
            for f in _abort_files(tmp_path)
            if f.endswith(".lock")
        ):
            assert time.monotonic() < deadline, f"locks still held: {_abort_files(tmp_path)}"
            time.sleep(0.05)
        left = _abort_files(tmp_path)
        done = {f for f in left if f.endswith(".safetensors")}
        strays = [f for f in left if f not in done and f.removesuffix(".lock") not in done]
        assert not strays, f"left behind by aborted requests: {strays}"
        finished = [(i, p) for i, p in zip(ids, long, strict=True) if f"{i}.safetensors" in done]
        assert len(finished) == len(done), (ids, sorted(done))
        for req_id, prompt in finished:
            data = load_hidden_states(os.path.join(tmp_path, f"{req_id}.safetensors"))
            assert not file_problems(
                data, prompt, len(LAYERS["hybrid"]), data["hidden_states"].shape[-1]
            )
        RESULTS["aborts"] = {
            "aborted_in_prefill": len(long) - len(finished),
            "finished_first": len(finished),
        }
        print(f"\naborts: {RESULTS['aborts']}")
        assert len(finished) < len(long), "no request was aborted during prefill"


def test_hybrid_eager_unchunked_and_outputs(models, reference, tmp_path):
    with engine(models["hybrid"], "hybrid", str(tmp_path), max_num_batched_tokens=4096) as llm:
        checks = _check("hybrid", _generate(llm, BASE), BASE, reference, "hybrid_eager_unchunked")
        chunked = RESULTS.pop("_chunked_700", None)
        if chunked is not None:  # each judged against HF fp32 by _check
            _chunked_vs_unchunked("chunked_vs_unchunked_700", chunked, checks[3])
        prompts = BASE[1:3]
        outs = _generate(
            llm,
            prompts,
            max_tokens=16,
            ignore_eos=True,
            extra_args={"kv_transfer_params": {"include_output_tokens": True}},
        )
        _check(
            "hybrid", outs, prompts, reference, "hybrid_include_output_tokens", include_outputs=True
        )
        # The longest prompt vLLM accepts, batched with a short one.
        full = _prompts(5, [2047, 40])  # vLLM refuses prompt_len == max_model_len
        _check("hybrid", _generate(llm, full), full, reference, "hybrid_max_model_len_prompt")


def _chunked_vs_unchunked(name: str, chunked: dict, unchunked: dict) -> None:
    """Record one prompt's errors against HF fp32, chunked and unchunked."""
    RESULTS[name] = {
        "chunked_vs_fp32": [round(e, 5) for e in chunked["ours"]],
        "unchunked_vs_fp32": [round(e, 5) for e in unchunked["ours"]],
        "hf_bf16_vs_fp32": [round(e, 5) for e in unchunked["hf_bf16"]],
    }
    print(f"\n{name}, rel err vs HF fp32 by layer: {RESULTS[name]}")


def test_deep_hybrid_chunked_and_unchunked(models, reference, tmp_path):
    """The deeper hybrid, where bf16 error is largest: chunked prefill (256-token steps,
    80 requests too) and unchunked (with a max_model_len prompt), each against HF fp32."""
    full = _prompts(5, [2047, 40])
    checks = {}
    for mode, step in (("chunked", 256), ("unchunked", 4096)):
        storage = str(tmp_path / mode)
        with engine(models["deep"], "deep", storage, max_num_batched_tokens=step) as llm:
            name = f"deep_eager_{mode}"
            checks[mode] = _check("deep", _generate(llm, BASE), BASE, reference, name)
            if mode == "chunked":
                _check("deep", _generate(llm, MANY), MANY, reference, "deep_eager_80_requests")
            else:
                _check("deep", _generate(llm, full), full, reference, "deep_max_model_len_prompt")
    _chunked_vs_unchunked(
        "deep_chunked_vs_unchunked_700", checks["chunked"][3], checks["unchunked"][3]
    )


def _one_token_prompt_among_decodes(llm, prompt):
    """Add a one-token prompt while two requests decode: a step of one token per request
    that starts a prompt (vLLM's V1 runner once replayed it as a FULL decode CUDA graph)."""
    from vllm import SamplingParams

    engine_ = llm.llm_engine
    for i, p in enumerate(_prompts(6, [30, 40])):
        params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
        engine_.add_request(f"decode-{i}", {"prompt_token_ids": p}, params)
    for _ in range(4):  # both prompts prefilled in the first step, then decoding
        engine_.step()
    engine_.add_request("one-token", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=1))
    finished, deadline = [], time.monotonic() + 60
    while engine_.has_unfinished_requests() and time.monotonic() < deadline:
        finished += [o for o in engine_.step() if o.finished]
    (out,) = [o for o in finished if list(o.prompt_token_ids) == list(prompt)]
    return out


def test_hybrid_cudagraph(models, reference, tmp_path):
    with engine(models["hybrid"], "hybrid", str(tmp_path), enforce_eager=False) as llm:
        _check("hybrid", _generate(llm, BASE), BASE, reference, "hybrid_cudagraph")
        _check("hybrid", _generate(llm, MANY), MANY, reference, "hybrid_cudagraph_80_requests")
        # One-token prompts in steps of one token per request: alone, and among decodes.
        one = _prompts(7, [1])
        outs = _generate(llm, one) + [_one_token_prompt_among_decodes(llm, one[0])]
        _check("hybrid", outs, one * 2, reference, "hybrid_cudagraph_one_token", pool=False)


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "cudagraph"])
def test_hybrid_layer_by_layer(models, reference, tmp_path, enforce_eager):
    """The layer sink (``layer_by_layer``): each layer's rows leave the GPU as the model makes
    them in eager steps (every step eager; with CUDA graphs, the steps larger than any graph),
    held to HF like the stacked hand-over."""
    name = f"hybrid_layer_by_layer_{'eager' if enforce_eager else 'cudagraph'}"
    with engine(
        models["hybrid"], "hybrid", str(tmp_path), enforce_eager=enforce_eager,
        options={"layer_by_layer": True}, max_num_batched_tokens=256,
    ) as llm:  # fmt: skip
        _check("hybrid", _generate(llm, BASE), BASE, reference, name)
        _check("hybrid", _generate(llm, MANY), MANY, reference, name + "_80_requests")


def test_dense(models, reference, tmp_path):
    with engine(models["dense"], "dense", str(tmp_path), extract="layer_ids") as llm:
        _check("dense", _generate(llm, BASE), BASE, reference, "dense_eager")
        _check("dense", _generate(llm, MANY), MANY, reference, "dense_eager_80_requests")


def test_kv_cache_capacity(models, tmp_path, capfd):
    """Extraction keeps >= 99% of the KV cache capacity of plain vLLM.

    vLLM reports capacity as max concurrency x max_model_len. Measured at a short
    context, where per-request GDN state weighs most. Both with prefix caching off, as
    extraction runs: on 0.33.0 plain's default (on, GDN state cached in "align" mode)
    reports 10% fewer tokens at this shape and would flatter extraction.
    """
    caps, mem = {}, {}
    for extract in (False, True):
        with engine(
            models["hybrid"], "hybrid", str(tmp_path), extract=extract, enable_prefix_caching=False
        ):
            pass
        log = capfd.readouterr()
        text = log.out + log.err
        found = re.findall(r"GPU KV cache size: ([\d,]+) tokens", text)
        caps[extract] = int(found[-1].replace(",", "")) if found else None
        found = re.findall(r"Available KV cache memory: ([\d.]+) GiB", text)
        mem[extract] = float(found[-1]) if found else None
    RESULTS["kv_cache_tokens"] = {
        "plain": caps[False],
        "extract": caps[True],
        "plain_GiB": mem[False],
        "extract_GiB": mem[True],
        "max_model_len": 2048,
        "prefix_caching": False,
    }
    print(f"\nKV cache tokens: {caps}, memory GiB: {mem}")
    assert caps[False] and caps[True]
    assert caps[True] >= 0.99 * caps[False]


def test_preemption(models, reference, tmp_path):
    """A KV cache too small for the batch forces preemption and recompute. Each request
    decodes past its first KV block (0.34.0 makes this model's blocks 1,024 tokens long; a
    request that fits in the block it starts with never needs another, and never preempts)."""
    prompts = _prompts(3, [600] * 12)
    with engine(
        models["hybrid"],
        "hybrid",
        str(tmp_path),
        max_model_len=2048,
        num_gpu_blocks_override=48,
        max_num_batched_tokens=1024,
        disable_log_stats=False,
    ) as llm:
        outs = _generate(
            llm,
            prompts,
            max_tokens=1200,
            ignore_eos=True,
            extra_args={"kv_transfer_params": {"include_output_tokens": True}},
        )
        preempted = [m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions"]
        RESULTS["preemptions"] = preempted
        print(f"\npreemptions: {preempted}")
        _check("hybrid", outs, prompts, reference, "hybrid_preemption", include_outputs=True)
        assert preempted and preempted[0] > 0, "the test did not preempt; shrink the cache"


def _payload(path: str) -> int:
    return sum(e - b for b, e in (t["data_offsets"] for t in read_header(path).values()))


def test_hybrid_fp8(models, reference, tmp_path):
    """speculators' fp8 backend, quantized on the GPU: every file judged against HF fp32, with
    HF bf16 put through the same fp8 quantization as the yardstick; the dequantized error
    against our own bf16 files of the same prompts and the bytes per token are recorded."""
    prompts = BASE + MANY[:20]
    paths = {}
    for fmt, options in (("bf16", None), ("fp8", {"fp8": True})):
        storage = str(tmp_path / fmt)
        with engine(models["hybrid"], "hybrid", storage, options=options) as llm:
            outs = _generate(llm, prompts)
            if fmt == "fp8":
                _check("hybrid", outs, prompts, reference, "hybrid_fp8")
            paths[fmt] = [o.kv_transfer_params["hidden_states_path"] for o in outs]
    worst, ratios = [0.0] * len(LAYERS["hybrid"]), []
    for p8, p16 in zip(paths["fp8"], paths["bf16"], strict=True):
        d8, d16 = load_hidden_states(p8, timeout=30), load_hidden_states(p16, timeout=30)
        assert d8["hidden_states"].dtype == torch.float8_e4m3fn
        assert torch.equal(d8["token_ids"], d16["token_ids"])
        errs = relative_errors(hidden_states_of(d8), d16["hidden_states"])
        worst = [max(w, e) for w, e in zip(worst, errs, strict=True)]
        ratios.append(_payload(p8) / _payload(p16))
    RESULTS["hybrid_fp8"]["vs_our_bf16_files_by_layer"] = [round(e, 4) for e in worst]
    RESULTS["hybrid_fp8"]["bytes_per_token_vs_bf16"] = round(max(ratios), 4)
    print(f"\nfp8 vs our bf16 files, worst by layer {worst}; bytes per token x {max(ratios):.4f}")
    assert max(ratios) <= 0.52
