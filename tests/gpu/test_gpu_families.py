"""GPU suite: every hybrid family (Qwen3.5, Qwen3.5-MoE, Qwen3-Next, Nemotron-H with MLP and with
MoE blocks) served through ``LLM(...)`` with the connector, held to HF transformers.

Run on a CUDA machine with the plugin installed (vLLM finds it by entry point), from the repo root:
    pytest -m gpu tests/gpu/test_gpu_families.py -v -s  (record: VLLM_GDN_HS_RESULTS)
Each family's tiny model is built here (random weights, HF transformers' own class, nothing
downloaded) and served twice: eager with chunked prefill (128-token steps) and with CUDA graphs;
HMA on, layer ids 0 and N in an unsorted order, prompts of 1 to 300 tokens, include_output_tokens
on two of them. Every file is held to HF fp32 on the same weights with the project's bar
(vllm_gdn_hs.verify.reference: per file within GROSS_FACTOR x HF bf16's error, pooled per run within
BAR_FACTOR x). GDN prefill: vLLM's default kernel (the new families' GDN heads are 128 wide) unless
VLLM_GDN_HS_GDN_PREFILL names one (e.g. triton); Qwen3.5 dense's 64-wide heads take triton.
The JSON record (VLLM_GDN_HS_RESULTS, default tests/results/gpu-families.json) is rewritten after
every test: date, commit, vLLM, runner, GPU, kernels, and per family and mode the per-layer errors
of ours and of HF bf16 against HF fp32.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import random
import subprocess

import pytest
import torch
from tiny_models import FAMILIES, build_model

from vllm_gdn_hs.config import extraction_config
from vllm_gdn_hs.files import load_hidden_states
from vllm_gdn_hs.verify.reference import BAR_FACTOR, GROSS_FACTOR, HFReference, worst_by_layer

pytestmark = pytest.mark.gpu

LAYERS = [8, 0, 5, 3]  # ids 0 (embeddings) and N (8), unsorted
_rng = random.Random(56)
PROMPTS = [[_rng.randrange(0, 1000) for _ in range(n)] for n in (1, 17, 100, 300, 33, 64)]
RESULTS_PATH = os.environ.get("VLLM_GDN_HS_RESULTS", "tests/results/gpu-families.json")
RECORD: dict = {"bar": f"per file <= {GROSS_FACTOR} x HF bf16's error vs HF fp32; pooled "
                f"per run <= {BAR_FACTOR} x", "runs": {}}  # fmt: skip
# family -> GDN prefill backend: vLLM's default where the GDN heads are 128 wide
GDN_PREFILL = {"qwen3_5": "triton"}


def _write_record() -> None:
    os.makedirs(os.path.dirname(RESULTS_PATH) or ".", exist_ok=True)
    with open(RESULTS_PATH, "w") as f:
        json.dump(RECORD, f, indent=1)


@pytest.fixture(scope="module", autouse=True)
def environment():
    import vllm

    from vllm_gdn_hs.version import runner_in_use

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    RECORD["environment"] = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        commit=os.environ.get("VLLM_GDN_HS_COMMIT") or commit or "unknown",
        vllm=vllm.__version__,
        torch=torch.__version__,
        gpu=torch.cuda.get_device_name(0),
        runner=runner_in_use(),
        gdn_prefill_backend={
            f: os.environ.get("VLLM_GDN_HS_GDN_PREFILL") or GDN_PREFILL.get(f, "vLLM's default")
            for f in FAMILIES
            if not f.startswith("nemotron")
        },
        mamba_kernels="vLLM's Mamba2 (Triton) kernels, as NemotronH selects them",
    )
    _write_record()
    yield


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {f: build_model(str(root / f), FAMILIES[f]()) for f in FAMILIES}


def _serve(model: str, family: str, storage: str, eager: bool):
    from vllm import LLM

    kw = dict(
        model=model, skip_tokenizer_init=True, max_model_len=1024, seed=0,
        gpu_memory_utilization=0.3, enforce_eager=eager, enable_prefix_caching=False,
        max_num_batched_tokens=128 if eager else 2048, max_num_seqs=8,
        **extraction_config(LAYERS, storage),
    )  # fmt: skip
    if not eager:  # few graphs to capture: seconds, not a minute, per engine
        kw["compilation_config"] = {"cudagraph_capture_sizes": [1, 2, 4, 8]}
    backend = os.environ.get("VLLM_GDN_HS_GDN_PREFILL") or GDN_PREFILL.get(family)
    if backend:
        kw["additional_config"] = {"gdn_prefill_backend": backend}
    if "vision_config" in FAMILIES[family]():
        kw["language_model_only"] = True
    return LLM(**kw)


# CUDA graphs for the four families of issue 56 (the text-only Qwen3.5-MoE class and Nemotron-H's
# MoE variant run eager only: same graphs as their siblings). VLLM_GDN_HS_FAMILIES=a,b: only those.
# Every family eager first, then CUDA graphs: a lease cut short has still held each family to HF.
_ONLY = [f for f in os.environ.get("VLLM_GDN_HS_FAMILIES", "").split(",") if f]
RUNS = [
    (f, mode)
    for mode in ("eager_chunked", "cudagraph")
    for f in FAMILIES
    if (not _ONLY or f in _ONLY)
    and (mode == "eager_chunked" or f in ("qwen3_5", "qwen3_5_moe", "qwen3_next", "nemotron_h"))
]


@pytest.mark.parametrize(("family", "mode"), RUNS)
def test_family_against_hf(models, tmp_path, family, mode):
    from vllm import SamplingParams

    llm = _serve(models[family], family, str(tmp_path), eager=mode == "eager_chunked")
    try:
        sched = llm.llm_engine.vllm_config.scheduler_config
        assert sched.disable_hybrid_kv_cache_manager is False  # HMA on
        plain = SamplingParams(temperature=0.0, max_tokens=1)
        with_out = SamplingParams(
            temperature=0.0, max_tokens=12, ignore_eos=True,
            extra_args={"kv_transfer_params": {"include_output_tokens": True}},
        )  # fmt: skip
        params = [plain] * 4 + [with_out] * 2
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    seqs = [
        list(p) + (list(o.outputs[0].token_ids)[:-1] if sp is with_out else [])
        for o, p, sp in zip(outs, PROMPTS, params, strict=True)
    ]
    ref = HFReference(models[family], LAYERS)
    try:
        ref.precompute(seqs)
        checks = []
        for out, seq in zip(outs, seqs, strict=True):
            data = load_hidden_states(out.kv_transfer_params["hidden_states_path"], timeout=30)
            checks.append(ref.check(data, seq))
        pooled = ref.pooled()
    finally:
        ref.close()
    RECORD["runs"][f"{family}/{mode}"] = {
        "architecture": FAMILIES[family]()["architectures"][0],
        "layers": LAYERS,
        "files": len(checks),
        "pooled_vs_fp32": {
            k: [round(x, 5) for x in pooled[k]] for k in ("ours", "hf_bf16", "ratio")
        },
        **worst_by_layer(checks),
        "problems": [p for c in checks for p in c["problems"]] + pooled["problems"],
    }
    _write_record()
    print(f"\n{family}/{mode}: {json.dumps(RECORD['runs'][f'{family}/{mode}'])}")
    assert not RECORD["runs"][f"{family}/{mode}"]["problems"]
