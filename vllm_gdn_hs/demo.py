"""``vllm-gdn-hs demo``: extract hidden states from a tiny hybrid model and check them.

Builds a tiny random Qwen3.5 hybrid model (GDN + full attention), runs vLLM
with HybridHiddenStatesConnector through ``LLM(...)``, and compares every file
with HF transformers on the same weights. Without a GPU it says so and runs
``doctor``.
"""

from __future__ import annotations

import os
import random

LAYERS = [1, 4, 6, 8]
PROMPT_LENS = [1, 17, 100, 700, 1500]
BAR = 0.03


def run_demo(workdir: str) -> int:
    import torch

    if not torch.cuda.is_available():
        print("vllm-gdn-hs demo needs a CUDA GPU; none is visible. Running doctor instead.\n")
        from vllm_gdn_hs.doctor import run_doctor

        run_doctor()
        return 1
    from vllm import LLM, SamplingParams

    from vllm_gdn_hs.config import extraction_config
    from vllm_gdn_hs.files import load_hidden_states
    from vllm_gdn_hs.reference import (
        file_problems,
        hf_hidden_states,
        load_hf_model,
        relative_errors,
    )
    from vllm_gdn_hs.testing import build_tiny_hybrid

    model = build_tiny_hybrid(os.path.join(workdir, "tiny-qwen3.5-hybrid"))
    storage = os.path.join(workdir, "hidden_states")
    rng = random.Random(0)
    prompts = [[rng.randrange(0, 1000) for _ in range(n)] for n in PROMPT_LENS]
    llm = LLM(
        model=model,
        language_model_only=True,
        skip_tokenizer_init=True,
        max_model_len=2048,
        gpu_memory_utilization=0.3,
        additional_config={"gdn_prefill_backend": "triton"},
        **extraction_config(LAYERS, storage),
    )
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=1), use_tqdm=False
    )
    hf = load_hf_model(model)
    hidden = hf.config.get_text_config().hidden_size
    print(f"\nmodel: {model}\nlayers: {LAYERS}\n")
    print(f"{'tokens':>7}  " + "  ".join(f"L{i:<6}" for i in LAYERS) + "  file")
    ok = True
    for out, prompt in zip(outputs, prompts, strict=True):
        path = out.kv_transfer_params["hidden_states_path"]
        data = load_hidden_states(path, timeout=30)
        problems = file_problems(data, prompt, len(LAYERS), hidden)
        errs = relative_errors(data["hidden_states"], hf_hidden_states(hf, [prompt], LAYERS)[0])
        ok &= not problems and max(errs) <= BAR
        print(
            f"{len(prompt):>7}  "
            + "  ".join(f"{e:<7.4f}" for e in errs)
            + f"  {path}"
            + (f"  PROBLEMS: {problems}" if problems else "")
        )
    print(
        f"\nrelative error vs HF transformers (bar {BAR}): {'PASS' if ok else 'FAIL'}; "
        f"{len(outputs)} files in {storage}"
    )
    return 0 if ok else 1
