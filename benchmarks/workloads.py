"""Model shapes, model folders and workloads (prompt lengths, prompt ids); CPU only."""

from __future__ import annotations

import json
import os
import random
import re
import statistics
from dataclasses import dataclass

from vllm_gdn_hs.cli.model_info import packaged_config_path

HERE = os.path.dirname(os.path.abspath(__file__))
REFERENCE_CONFIG = packaged_config_path("Qwen/Qwen3.6-27B")

# Text-model shapes. "27b" is the published Qwen3.6-27B config; "4b" halves hidden size, layers
# and every head count (head dims unchanged): about 3.0B non-embedding + 1.3B embedding params,
# not a released checkpoint. "27b-8" is the 27B shape cut to 8 layers (two of them attention):
# the same widths, so the same per-token memory of aux states and activations, in a minute.
# "35b-a3b" is the published Qwen3.5-35B-A3B text_config (ARCHITECTURES: the MoE class).
# "tiny" is a smoke test. Full attention is every 4th layer. A key set to None is dropped.
SHAPES = {
    "27b": {},
    "27b-8": dict(num_hidden_layers=8),
    "4b": dict(
        hidden_size=2560,
        num_hidden_layers=32,
        intermediate_size=8704,
        num_attention_heads=12,
        num_key_value_heads=2,
        linear_num_key_heads=8,
        linear_num_value_heads=24,
    ),
    # https://huggingface.co/Qwen/Qwen3.5-35B-A3B, config.json's text_config: the keys that differ
    # from Qwen3.6-27B's; the rest (head and GDN head dims, conv kernel, attention every 4th
    # layer, attn_output_gate, rope, vocabulary, fp32 GDN state) are the same. No dense MLP:
    # every layer's MLP is 256 experts, 8 routed a token, plus a shared expert. Qwen3.6-35B-A3B
    # has the same shape.
    "35b-a3b": dict(
        model_type="qwen3_5_moe_text",
        hidden_size=2048,
        num_hidden_layers=40,
        intermediate_size=None,
        num_attention_heads=16,
        num_key_value_heads=2,
        linear_num_value_heads=32,
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        router_aux_loss_coef=0.001,
    ),
    "tiny": dict(
        hidden_size=256,
        num_hidden_layers=8,
        intermediate_size=512,
        num_attention_heads=2,
        num_key_value_heads=1,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
    ),
}
# The top-level keys of a shape whose model class is not the reference's.
ARCHITECTURES = {
    "35b-a3b": dict(architectures=["Qwen3_5MoeForConditionalGeneration"], model_type="qwen3_5_moe")
}

# Layer ids to extract (k = residual stream after k decoder layers): speculators' EAGLE-3 style
# spread for 64 layers, [1, 16, 31, 46, 61, 64], and for n layers the same positions scaled to n
# and rounded up, the fifth kept below the last (spread_layer_ids).
EAGLE3_SPREAD_64 = (1, 16, 31, 46, 61)


def spread_layer_ids(n: int) -> list[int]:
    """EAGLE3_SPREAD_64 scaled to n layers (rounded up; the last kept below n), then n."""
    ids = [-(-k * n // 64) for k in EAGLE3_SPREAD_64]
    ids[-1] = min(ids[-1], n - 1)
    return [*ids, n]


DEFAULT_LAYERS = {n: spread_layer_ids(n) for n in (64, 40, 32, 8)}

# The mixed workload: prompt lengths ~ lognormal(mu, sigma) tokens, clipped, fixed seed.
MIXED_N, MIXED_MU, MIXED_SIGMA, MIXED_CLIP = 256, 6.93, 1.0, (16, 8192)  # median e^6.93 ~ 1024
# The chat workload: an SFT chat set's lengths as speculators' data generation sends them
# (prefill only): lognormal with median e^5.99 ~ 400 tokens, sigma 1.1, clipped to [16, 8192];
# about 80% of the prompts under 1,000 tokens and a tail to 8,192 (seed 0: 512 prompts,
# 364,415 tokens, mean 711.7, median 414, range 16-8192).
CHAT_N, CHAT_MU, CHAT_SIGMA, CHAT_CLIP = 512, 5.99, 1.1, (16, 8192)
WARMUP_PROMPTS = 8
TOKEN_RANGE = (1000, 150000)  # random prompt ids, clear of special and image/video token ids


def model_config(shape: str) -> dict:
    with open(REFERENCE_CONFIG) as f:
        cfg = json.load(f)
    cfg.pop("_comment", None)
    cfg.update(ARCHITECTURES.get(shape, {}))
    text = cfg["text_config"]
    text.update(SHAPES[shape])
    for key in [k for k, v in text.items() if v is None]:
        del text[key]
    n = text["num_hidden_layers"]
    text["layer_types"] = [
        "full_attention" if (i + 1) % text["full_attention_interval"] == 0 else "linear_attention"
        for i in range(n)
    ]
    cfg["vision_config"]["out_hidden_size"] = text["hidden_size"]
    return cfg


def write_model_dir(root: str, shape: str) -> str:
    """A model folder with config.json only: enough for load_format="dummy"."""
    path = os.path.join(root, f"qwen3.6-{shape}-dummy")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(model_config(shape), f, indent=1)
    return path


def model_summary(shape: str) -> dict:
    """The text-model numbers report.py needs for the FLOPs/roofline formula."""
    t = model_config(shape)["text_config"]
    out = {k: v for k, v in t.items() if not isinstance(v, (list, dict, str))}
    out["num_full_attention_layers"] = t["layer_types"].count("full_attention")
    out["num_linear_attention_layers"] = t["layer_types"].count("linear_attention")
    return out


@dataclass
class Workload:
    name: str
    lengths: list[int]
    output_tokens: int = 0  # 0: prefill only (max_tokens=1); K: K tokens, include_output_tokens

    @property
    def max_tokens(self) -> int:
        return max(self.output_tokens, 1)

    def stats(self) -> dict:
        # Tokens that go through a forward pass: the prompt, plus all generated tokens but
        # the last. attn_ctx_mean: keys an average such token attends to (report.py's FLOPs).
        seen = [n + max(self.output_tokens - 1, 0) for n in self.lengths]
        return dict(
            workload=self.name,
            num_requests=len(self.lengths),
            prompt_tokens=sum(self.lengths),
            output_tokens_requested=self.output_tokens,
            processed_tokens=sum(seen),
            mean_len=round(statistics.mean(self.lengths), 1),
            median_len=statistics.median(self.lengths),
            min_len=min(self.lengths),
            max_len=max(self.lengths),
            attn_ctx_mean=round(sum(t * (t + 1) / 2 for t in seen) / sum(seen), 1),
        )


def lognormal_lengths(key: str, n: int, mu: float, sigma: float, clip) -> list[int]:
    """n lengths round(lognormal(mu, sigma)) clipped to clip, from random.Random(key)."""
    rng, (lo, hi) = random.Random(key), clip
    return [min(hi, max(lo, round(rng.lognormvariate(mu, sigma)))) for _ in range(n)]


def make_workload(name: str, seed: int) -> Workload:
    m = re.fullmatch(r"(\d+)x(\d+)(?:-out(\d+))?", name)
    if m:
        return Workload(name, [int(m[2])] * int(m[1]), int(m[3] or 0))
    m = re.fullmatch(r"mixed(?:-out(\d+))?", name)
    if m:
        lengths = lognormal_lengths(f"mixed:{seed}", MIXED_N, MIXED_MU, MIXED_SIGMA, MIXED_CLIP)
        return Workload(name, lengths, int(m[1] or 0))
    m = re.fullmatch(r"chat(?:-out(\d+))?", name)
    if m:
        lengths = lognormal_lengths(f"chat:{seed}", CHAT_N, CHAT_MU, CHAT_SIGMA, CHAT_CLIP)
        return Workload(name, lengths, int(m[1] or 0))
    raise ValueError(
        f"unknown workload {name!r}: use NxL (e.g. 128x1024), NxL-outK, mixed, mixed-outK, "
        "chat or chat-outK"
    )


def prompt_ids(w: Workload, seed: int) -> list[list[int]]:
    base = w.name.split("-out")[0]  # mixed-out256 gets the prompts of mixed
    rng = random.Random(f"tokens:{base}:{seed}")
    return [[rng.randrange(*TOKEN_RANGE) for _ in range(n)] for n in w.lengths]


def bytes_needed(w: Workload, spec: dict) -> int:
    """Hidden-state bytes one run of w writes: processed tokens x (layers x hidden x 2 B + 8 B)."""
    hidden = model_config(spec["shape"])["text_config"]["hidden_size"]
    return w.stats()["processed_tokens"] * (len(spec["layers"]) * hidden * 2 + 8)
