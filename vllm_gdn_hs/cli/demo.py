"""``vllm-gdn-hs demo``: hidden states of a tiny random Qwen3.5 hybrid model extracted through
``LLM(...)``, each file held to HF transformers as ``check --reference`` does (a GPU needed)."""

from __future__ import annotations

import os
import random
import sys


def tiny_hybrid_config(
    num_hidden_layers: int = 8,
    hidden_size: int = 256,
    linear_num_key_heads: int = 2,
    linear_num_value_heads: int = 4,
) -> dict:
    """A tiny Qwen3.5 config: full attention every 4th layer, GDN heads of 64 dims (value heads
    a multiple of key heads), a tiny vision tower."""
    layer_types = [
        "full_attention" if (i + 1) % 4 == 0 else "linear_attention"
        for i in range(num_hidden_layers)
    ]
    text = dict(
        model_type="qwen3_5_text", vocab_size=1024, hidden_size=hidden_size,
        intermediate_size=2 * hidden_size, num_hidden_layers=num_hidden_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        linear_num_key_heads=linear_num_key_heads,
        linear_num_value_heads=linear_num_value_heads, linear_key_head_dim=64,
        linear_value_head_dim=64, linear_conv_kernel_dim=4, full_attention_interval=4,
        layer_types=layer_types, attn_output_gate=True, max_position_embeddings=32768,
        rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=False,
        rope_parameters=dict(
            rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25,
            mrope_interleaved=True, mrope_section=[4, 2, 2],
        ),
        dtype="bfloat16",
    )  # fmt: skip
    vision = dict(
        model_type="qwen3_5_vision", depth=1, hidden_size=64, intermediate_size=128,
        num_heads=2, in_channels=3, patch_size=16, spatial_merge_size=2,
        temporal_patch_size=2, out_hidden_size=hidden_size, num_position_embeddings=64,
    )  # fmt: skip
    return dict(
        architectures=["Qwen3_5ForConditionalGeneration"],
        model_type="qwen3_5",
        text_config=text,
        vision_config=vision,
        tie_word_embeddings=False,
        dtype="bfloat16",
        # Image/video ids must lie inside the vocabulary (1024) for vLLM to load the model.
        image_token_id=1000,
        video_token_id=1001,
        vision_start_token_id=1002,
        vision_end_token_id=1003,
    )


LAYERS = [1, 4, 6, 8]
PROMPT_LENS = [1, 17, 100, 700, 1500]


def run_demo(workdir: str) -> int:
    import torch

    if not torch.cuda.is_available():
        print(
            "error: vllm-gdn-hs demo needs a CUDA GPU and none is visible here; run it on a GPU "
            "machine (vllm-gdn-hs doctor checks this one's install)",
            file=sys.stderr,
        )
        return 2
    from vllm import LLM, SamplingParams

    from vllm_gdn_hs.config import extraction_config
    from vllm_gdn_hs.files import load_hidden_states
    from vllm_gdn_hs.verify.check import run_spot_check
    from vllm_gdn_hs.verify.checkpoint import save_random_checkpoint

    model = os.path.join(workdir, "tiny-qwen3.5-hybrid")
    save_random_checkpoint(model, tiny_hybrid_config())  # random bf16 weights, seed 0
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
    paths = [out.kv_transfer_params["hidden_states_path"] for out in outputs]
    for path, prompt in zip(paths, prompts, strict=True):  # each read once its .lock is let go
        if load_hidden_states(path, timeout=30)["token_ids"].tolist() != prompt:
            print(f"error: {path} holds other token ids than its prompt's", file=sys.stderr)
            return 1
    # `vllm-gdn-hs check DIR --reference MODEL --layer-ids ...` on every file, every token
    return run_spot_check(storage, paths, model, LAYERS, len(paths), max(PROMPT_LENS), "cuda")
