"""Tiny random-weight models for tests, the demo and the GPU suite.

Built locally with transformers (nothing is downloaded). The hybrid model has
the Qwen3.5/3.6 architecture (``Qwen3_5ForConditionalGeneration``: Gated
DeltaNet layers with a full-attention layer every 4th, and a tiny vision tower
that vLLM skips with ``language_model_only=True``); the dense one is Qwen3.
"""

from __future__ import annotations

import json
import os

# Image/video ids must lie inside the vocabulary for vLLM to load the model.
_VOCAB = 1024
_MM_IDS = dict(
    image_token_id=1000, video_token_id=1001, vision_start_token_id=1002, vision_end_token_id=1003
)


def hybrid_config_dict(
    num_hidden_layers: int = 8,
    hidden_size: int = 256,
    linear_num_key_heads: int = 2,
    linear_num_value_heads: int = 4,
) -> dict:
    """Qwen3.5 config; GDN key and value heads of 64 dims (value heads a multiple of key heads)."""
    layer_types = [
        "full_attention" if (i + 1) % 4 == 0 else "linear_attention"
        for i in range(num_hidden_layers)
    ]
    text = dict(
        model_type="qwen3_5_text",
        vocab_size=_VOCAB,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=linear_num_key_heads,
        linear_num_value_heads=linear_num_value_heads,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        full_attention_interval=4,
        layer_types=layer_types,
        attn_output_gate=True,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        tie_word_embeddings=False,
        rope_parameters=dict(
            rope_type="default",
            rope_theta=10000000.0,
            partial_rotary_factor=0.25,
            mrope_interleaved=True,
            mrope_section=[4, 2, 2],
        ),
        dtype="bfloat16",
    )
    vision = dict(
        model_type="qwen3_5_vision",
        depth=1,
        hidden_size=64,
        intermediate_size=128,
        num_heads=2,
        in_channels=3,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=hidden_size,
        num_position_embeddings=64,
    )
    return dict(
        architectures=["Qwen3_5ForConditionalGeneration"],
        model_type="qwen3_5",
        text_config=text,
        vision_config=vision,
        tie_word_embeddings=False,
        dtype="bfloat16",
        **_MM_IDS,
    )


def dense_config_dict(num_hidden_layers: int = 8, hidden_size: int = 256) -> dict:
    return dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        vocab_size=_VOCAB,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        tie_word_embeddings=False,
        rope_theta=1000000.0,
        dtype="bfloat16",
    )


def write_config(path: str, config: dict) -> str:
    """A model folder with config.json only: enough for configs and dummy weights."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return path


def _text_model(config: dict):
    """The HF causal LM of a config: its language model alone for multimodal configs."""
    from transformers import AutoConfig, AutoModelForCausalLM

    text = dict(config.get("text_config") or config)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(text.pop("model_type"), **text))


# Multimodal Qwen3.5 checkpoints keep the language model under this prefix.
_MM_PREFIX = ("model.", "model.language_model.")


def build_model(path: str, config: dict, seed: int = 0) -> str:
    """Save a model with random bf16 weights, built with transformers.

    A multimodal (Qwen3.5) model gets its language model's weights only, under
    the checkpoint's ``model.language_model.`` names: vLLM runs it with
    ``language_model_only=True``, which builds no vision tower.
    """
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    model = _text_model(config).to(torch.bfloat16)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if "vision_config" in config:
        old, new = _MM_PREFIX
        state = {(new + k[len(old) :] if k.startswith(old) else k): v for k, v in state.items()}
    write_config(path, config)
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path


def _checkpoint_files(path: str) -> list[str]:
    """The safetensors files of a model folder: the index's shards, or the one file."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, s) for s in shards]
    single = os.path.join(path, "model.safetensors")
    if not os.path.exists(single):
        raise FileNotFoundError(
            f"{path}: no model.safetensors or model.safetensors.index.json; pass the folder "
            "of a HF checkpoint in safetensors"
        )
    return [single]


# Weights of a multimodal checkpoint that its language model does not use.
_NOT_LANGUAGE_MODEL = ("model.visual.", "mtp.")


def load_text_model(path: str, device: str = "cuda", dtype=None):
    """The HF causal LM of a model folder (the language model of a multimodal one, whose
    vision tower and MTP weights are skipped), in ``dtype`` (default bf16, as saved; fp32
    upcasts the same bf16 weights). One or several safetensors shards."""
    import torch
    from safetensors.torch import load_file

    dtype = dtype or torch.bfloat16

    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    model = _text_model(config).to(dtype)  # built in fp32: 4 bytes per parameter at peak
    new, old = _MM_PREFIX
    # A weight is missing if none of its names was loaded (tied embeddings: one name saved).
    names = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        names.setdefault(id(tensor), set()).add(name)
    loaded = set()
    for shard in _checkpoint_files(path):
        state = {
            (new + k[len(old) :] if "vision_config" in config and k.startswith(old) else k): v
            for k, v in load_file(shard).items()
            if not k.startswith(_NOT_LANGUAGE_MODEL)
        }
        unexpected = model.load_state_dict(state, strict=False).unexpected_keys
        if unexpected:
            raise ValueError(f"{shard}: weights the model does not have: {unexpected[:5]}")
        loaded |= set(state)
    missing = [sorted(group)[0] for group in names.values() if not group & loaded]
    if missing:
        raise ValueError(f"{path}: weights missing from the checkpoint: {sorted(missing)[:5]}")
    return model.to(device).eval()


def build_tiny_hybrid(path: str, **kw) -> str:
    return build_model(path, hybrid_config_dict(**kw))


# Deeper, wider and with GDN value heads = 3 x key heads, as in Qwen3.6-27B: bf16 error
# grows with depth, so this is where a bar of fixed size fails first.
DEEP_HYBRID = dict(
    num_hidden_layers=12, hidden_size=384, linear_num_key_heads=2, linear_num_value_heads=6
)


def build_deep_hybrid(path: str) -> str:
    return build_model(path, hybrid_config_dict(**DEEP_HYBRID))


def build_tiny_dense(path: str, **kw) -> str:
    return build_model(path, dense_config_dict(**kw))
