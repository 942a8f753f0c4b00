"""Tiny random-weight model folders for the tests and the GPU suite (test code, not in the
package). Built locally with transformers: nothing is downloaded.

The hybrid is the demo's model (:func:`vllm_gdn_hs.cli.demo.tiny_hybrid_config`: Qwen3.5's
architecture, GDN layers with a full-attention layer every 4th, and a tiny vision tower that
vLLM skips with ``language_model_only=True``); the dense one is Qwen3. Weights are saved in
the checkpoint layout :mod:`vllm_gdn_hs.verify.checkpoint` loads.

:data:`FAMILIES`: one tiny model per hybrid family users train drafters for (issue 56), each
built by HF transformers' own class: Qwen3.5 dense (the demo's), Qwen3.5-MoE (multimodal and
text-only), Qwen3-Next (GDN, MoE, text-only) and Nemotron-H (Mamba2, attention, MLP and MoE
blocks). The new ones have GDN heads of 128 dims, which vLLM's default GDN prefill kernel on
Hopper takes (the demo's 64 need ``gdn_prefill_backend: triton``).
"""

from __future__ import annotations

from vllm_gdn_hs.cli.demo import tiny_hybrid_config as hybrid_config_dict
from vllm_gdn_hs.verify.checkpoint import save_random_checkpoint, write_config

__all__ = [
    "CPU_FAMILIES",
    "DEEP_HYBRID",
    "FAMILIES",
    "build_deep_hybrid",
    "build_model",
    "build_tiny_dense",
    "build_tiny_hybrid",
    "dense_config_dict",
    "family_config_dict",
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


_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128)


def _qwen3_5_moe(text_only: bool = False) -> dict:
    """Qwen3.5-MoE (Qwen3.5/3.6-35B-A3B's architecture): the demo's layout, every MLP a
    mixture of 8 experts (2 routed a token) plus a shared expert, GDN heads of 128."""
    cfg = hybrid_config_dict()
    text = dict(
        cfg["text_config"], model_type="qwen3_5_moe_text", linear_key_head_dim=128,
        linear_value_head_dim=128, shared_expert_intermediate_size=128, **_MOE,
    )  # fmt: skip
    del text["intermediate_size"]
    if text_only:
        return dict(text, architectures=["Qwen3_5MoeForCausalLM"])
    vision = dict(cfg["vision_config"], model_type="qwen3_5_moe_vision")
    return dict(
        cfg, architectures=["Qwen3_5MoeForConditionalGeneration"], model_type="qwen3_5_moe",
        text_config=text, vision_config=vision,
    )  # fmt: skip


def _qwen3_next() -> dict:
    """Qwen3-Next (80B-A3B's architecture): GDN with full attention every 4th layer, text-only,
    every layer's MLP a mixture of experts with a shared expert."""
    text = _qwen3_5_moe(text_only=True)
    return dict(
        {k: v for k, v in text.items() if k not in ("layer_types", "rope_parameters")},
        architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", decoder_sparse_step=1,
        norm_topk_prob=True, partial_rotary_factor=0.25, rope_theta=10000000.0,
        layer_types=text["layer_types"],
    )  # fmt: skip


def _nemotron_h(pattern: str = "M-M*-M*-") -> dict:
    """Nemotron-H: blocks of one kind each, Mamba2 (M), attention (*), MLP (-) or MoE (E),
    written as real checkpoints write them; MLP blocks as Nemotron-H 8B/47B, MoE blocks as the
    Nemotron Nano 3 models (``nemotron_h_moe``: vLLM builds its relu2 experts only on a GPU)."""
    return dict(
        architectures=["NemotronHForCausalLM"], model_type="nemotron_h", vocab_size=1024,
        hidden_size=256, hybrid_override_pattern=pattern, num_hidden_layers=len(pattern),
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=512,
        mlp_hidden_act="relu2", ssm_state_size=64, mamba_num_heads=8, mamba_head_dim=64,
        n_groups=1, conv_kernel=4, expand=2, chunk_size=128, n_routed_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=128,
        moe_shared_expert_intermediate_size=128, n_shared_experts=1,
        max_position_embeddings=32768, rms_norm_eps=1e-5, tie_word_embeddings=False,
        dtype="bfloat16",
    )  # fmt: skip


# family -> its tiny config; all have 8 layers (ids 0..8). CPU_FAMILIES: those vLLM builds on
# the CPU (Nemotron-H's relu2 experts have no CPU kernel, even on the meta device).
FAMILIES = {
    "qwen3_5": hybrid_config_dict,
    "qwen3_5_moe": _qwen3_5_moe,
    "qwen3_5_moe_text": lambda: _qwen3_5_moe(text_only=True),
    "qwen3_next": _qwen3_next,
    "nemotron_h": _nemotron_h,
    "nemotron_h_moe": lambda: _nemotron_h("M-M*EM*E"),
}
CPU_FAMILIES = [f for f in FAMILIES if f != "nemotron_h_moe"]


def family_config_dict(family: str) -> dict:
    return FAMILIES[family]()
