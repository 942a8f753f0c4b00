"""The roofline of a record: FLOPs per processed token of the model, against the GPU's peak.

FLOPs per processed token =
    2 x (matmul weights of all decoder layers, a MoE layer's routed experts only; embeddings
         and lm_head left out)
  + 4 x n_heads x head_dim x ctx        per full-attention layer (QK^T and PV)
  + 6 x h_v x d_k x d_v                 per GDN layer (state update, read-out; intra-chunk left out)
where ctx is the mean number of keys a token attends to (the records' attn_ctx_mean). The limit
in tokens/s is PEAK_TFLOPS / FLOPs per token; "% roofline" is processed tokens/s over that
limit (processed = prompt tokens, plus generated tokens for the mixed-outK workloads).
"""

from __future__ import annotations

PEAK_TFLOPS = 790  # bf16 dense matmul, measured on the H200 (see benchmarks/README.md)


def mlp_params(m: dict, active: bool) -> int:
    """One layer's MLP matmul weights: SwiGLU, or (Qwen3.5-MoE) the router, the experts (those
    a token is routed to, if ``active``) and the shared expert with its gate."""
    h = m["hidden_size"]
    if "num_experts" not in m:
        return 3 * h * m["intermediate_size"]
    experts = m["num_experts_per_tok"] if active else m["num_experts"]
    swiglu = 3 * h * (experts * m["moe_intermediate_size"] + m["shared_expert_intermediate_size"])
    return swiglu + h * m["num_experts"] + h


def linear_params(m: dict, active: bool = True) -> int:
    """Matmul weights of the decoder layers (Qwen3.5/3.6: gated attention, GDN, SwiGLU MLP or
    mixture of experts); ``active``: those one token goes through."""
    h, hd = m["hidden_size"], m["head_dim"]
    heads, kv = m["num_attention_heads"], m["num_key_value_heads"]
    q_out = heads * hd * (2 if m.get("attn_output_gate") else 1)  # the gate rides on q_proj
    attn = h * q_out + 2 * h * kv * hd + heads * hd * h
    kd = m["linear_num_key_heads"] * m["linear_key_head_dim"]
    vd = m["linear_num_value_heads"] * m["linear_value_head_dim"]
    gdn = h * (2 * kd + vd) + h * vd + 2 * h * m["linear_num_value_heads"] + vd * h  # qkv z ba out
    gdn += (2 * kd + vd) * m["linear_conv_kernel_dim"]
    mlp = mlp_params(m, active)
    n_full, n_lin = m["num_full_attention_layers"], m["num_linear_attention_layers"]
    return n_full * attn + n_lin * gdn + (n_full + n_lin) * mlp


def flops_per_token(m: dict, ctx: float) -> float:
    attn = 4 * m["num_attention_heads"] * m["head_dim"] * ctx * m["num_full_attention_layers"]
    gdn = (
        6
        * m["linear_num_value_heads"]
        * m["linear_key_head_dim"]
        * m["linear_value_head_dim"]
        * m["num_linear_attention_layers"]
    )
    return 2 * linear_params(m) + attn + gdn


def total_params(m: dict) -> int:
    # every expert; untied embeddings and lm_head
    return linear_params(m, active=False) + m["vocab_size"] * m["hidden_size"] * 2


def roofline_tok_s(r: dict) -> float:
    return PEAK_TFLOPS * 1e12 / flops_per_token(r["model"], r["attn_ctx_mean"])


def roofline_frac(r: dict) -> float:
    return r["processed_tokens"] / r["gen_s"] / roofline_tok_s(r)
