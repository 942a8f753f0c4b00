"""Tiny random-weight model folders for the tests and the GPU suite (test code, not in the
package). Built locally with transformers: nothing is downloaded.

The hybrid is the demo's model (:func:`vllm_gdn_hs.demo.tiny_hybrid_config`: Qwen3.5's
architecture, GDN layers with a full-attention layer every 4th, and a tiny vision tower that
vLLM skips with ``language_model_only=True``); the dense one is Qwen3. Weights are saved in
the checkpoint layout :mod:`vllm_gdn_hs.checkpoint` loads.
"""

from __future__ import annotations

from vllm_gdn_hs.checkpoint import save_random_checkpoint, write_config
from vllm_gdn_hs.demo import tiny_hybrid_config as hybrid_config_dict

__all__ = [
    "DEEP_HYBRID",
    "build_deep_hybrid",
    "build_model",
    "build_tiny_dense",
    "build_tiny_hybrid",
    "dense_config_dict",
    "hybrid_config_dict",
    "write_config",
]


def dense_config_dict(num_hidden_layers: int = 8, hidden_size: int = 256) -> dict:
    return dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        vocab_size=hybrid_config_dict()["text_config"]["vocab_size"],
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


def build_model(path: str, config: dict, seed: int = 0) -> str:
    """A model folder with ``config`` and random bf16 weights."""
    return save_random_checkpoint(path, config, seed)


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
