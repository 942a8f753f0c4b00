"""Bytes a token and KV cache capacity of a model no lent GPU holds, from vLLM's own classes.

No GPU and no weights: the model's published config.json goes into a temporary folder, vLLM
builds its VllmConfig three times through tests/cpu_engine.py (plain vLLM; ours,
HybridHiddenStatesConnector; upstream, ExampleHiddenStatesConnector with HMA on), builds the
model's layers on the meta device, and plans the KV cache with get_kv_cache_configs. From that
come: the parameters vLLM holds, the attention KV bytes a token, the GDN state bytes a request,
upstream's hidden-state bytes a token as its own KV cache group allocates them, the KV cache
memory one request at max_model_len takes, and vLLM's "KV cache size" in tokens for a given KV
memory. Layer ids: the launcher's defaults (vllm_gdn_hs/layer_ids.py) unless --layers.

    PYTHONPATH=tests python benchmarks/scale_on_paper.py \
        --results benchmarks/results/scale_on_paper.json
    python benchmarks/scale_on_paper.py --table benchmarks/results/scale_on_paper.json

(from the repository root: tests/ on PYTHONPATH for tests/cpu_engine.py, the CPU tests'
engine; --table only renders docs/scale.md's tables from the record, without vLLM).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile

# Qwen/Qwen3-Next-80B-A3B-Instruct's config.json as published on the Hugging Face hub
# (https://huggingface.co/Qwen/Qwen3-Next-80B-A3B-Instruct/blob/main/config.json, 2025-09),
# every key. layer_types is not in it: transformers derives it from full_attention_interval.
QWEN3_NEXT_80B_A3B = {
    "architectures": ["Qwen3NextForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "full_attention_interval": 4,
    "head_dim": 256,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 5120,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_value_head_dim": 128,
    "max_position_embeddings": 262144,
    "mlp_only_layers": [],
    "model_type": "qwen3_next",
    "moe_intermediate_size": 512,
    "norm_topk_prob": True,
    "num_attention_heads": 16,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "num_hidden_layers": 48,
    "num_key_value_heads": 2,
    "output_router_logits": False,
    "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 10000000,
    "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 512,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.57.0.dev0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
SOURCES = {
    "Qwen/Qwen3-Next-80B-A3B-Instruct": "https://huggingface.co/Qwen/Qwen3-Next-80B-A3B-Instruct",
    "Qwen/Qwen3.6-27B": "the package's config (vllm_gdn_hs/cli/configs/qwen3.6-27b.json)",
}
VARIANTS = ("plain", "ours", "upstream")
TOKEN_ID_BYTES = 8  # int64 token ids in every file
FP8_SCALE_BYTES = 4  # fp8 files: one fp32 scale a token
AMPLE = 1 << 40  # KV memory that holds one request of any length here: for its block counts


def model_config(model: str) -> dict:
    if model == "Qwen/Qwen3-Next-80B-A3B-Instruct":
        return dict(QWEN3_NEXT_80B_A3B)
    from vllm_gdn_hs.cli.model_info import packaged_config_path

    with open(packaged_config_path(model)) as f:
        cfg = json.load(f)
    cfg.pop("_comment", None)
    return cfg


def engine_config(cpu_engine, folder: str, variant: str, layers: list[int], max_model_len: int):
    kw = dict(enable_prefix_caching=False, max_model_len=max_model_len)
    if variant == "plain":
        kw.update(connector=None, layer_ids=None)
    elif variant == "ours":
        kw.update(connector=cpu_engine.OURS, layer_ids=layers)
    else:  # upstream starts on hybrids with HMA on (vLLM >= 0.26.0)
        kw.update(
            connector=cpu_engine.STOCK, layer_ids=layers, disable_hybrid_kv_cache_manager=False
        )
    return cpu_engine.engine_config(folder, **kw)


def spec_kind(spec) -> str:
    """'state' (GDN or Mamba2), 'hidden_states' (upstream's cache-only layer) or 'attention'."""
    from vllm.v1.kv_cache_interface import MambaSpec

    try:
        from vllm.v1.kv_cache_interface import HiddenStateCacheSpec
    except ImportError:  # releases before it kept hidden states in a plain attention spec
        HiddenStateCacheSpec = ()
    if isinstance(spec, MambaSpec):
        return "state"
    return "hidden_states" if isinstance(spec, HiddenStateCacheSpec) else "attention"


def sizing(cpu_engine, cfg, memory: int) -> dict:
    """vLLM's KV cache plan of one engine config for ``memory`` bytes of KV cache."""
    from vllm.utils.math_utils import cdiv
    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

    specs = cpu_engine.kv_cache_specs(cfg)
    try:
        kcc, fits = cpu_engine.kv_cache_config(cfg, specs, memory), True
    except ValueError:  # vLLM refuses: one request at max_model_len needs more than memory
        kcc, fits = cpu_engine.kv_cache_config(cfg, specs, AMPLE), False
    # Every group's block ids come from one pool: a block id costs its page in every layer
    # slot of the shared tensors, whatever group owns it.
    block_bytes = max(t.size for t in kcc.kv_cache_tensors) // kcc.num_blocks
    kinds: dict[str, dict] = {}
    for spec in specs.values():
        k = kinds.setdefault(spec_kind(spec), dict(layers=0, real_bytes=0, page_bytes=0))
        k["layers"] += 1
        k["real_bytes"] += spec.real_page_size_bytes  # one page: a block of tokens, or a state
        k["page_bytes"] += spec.page_size_bytes
        k["block_size"] = spec.block_size
    groups = []
    for g in kcc.kv_cache_groups:  # vLLM's own blocks a request at max_model_len takes
        s = g.kv_cache_spec
        blocks = cdiv(s.max_memory_usage_bytes(cfg), s.page_size_bytes)
        groups.append(dict(kind=spec_kind(s), block_size=s.block_size, blocks=blocks))
    conc = get_max_concurrency_for_kv_cache_config(cfg, kcc) if fits else 0.0
    return dict(
        kinds=kinds,
        block_bytes=block_bytes,
        groups=groups,
        request_bytes=block_bytes * sum(g["blocks"] for g in groups),
        tokens=int(conc * cfg.model_config.max_model_len),
    )


def compute(model: str, layers: list[int] | None, lens: list[int], memory_gib: float) -> dict:
    import cpu_engine  # first: it installs vLLM's CPU platform
    import vllm
    import vllm.plugins

    from vllm_gdn_hs.cli.model_info import read_model_info
    from vllm_gdn_hs.layer_ids import target_layer_ids

    vllm.plugins.load_general_plugins()
    memory = int(memory_gib * 2**30)
    with tempfile.TemporaryDirectory() as folder:
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(model_config(model), f)
        info = read_model_info(folder)
        n, hidden = info.num_hidden_layers, info.hidden_size
        layers = target_layer_ids(layers, n)
        rec = dict(
            date=datetime.date.today().isoformat(),
            vllm=vllm.__version__,
            model=model,
            source=SOURCES[model],
            num_hidden_layers=n,
            hidden_size=hidden,
            layers=layers,
            params=cpu_engine.model_parameters(
                engine_config(cpu_engine, folder, "plain", [], 8448)
            ),
            hidden_states_bytes=dict(
                bf16=len(layers) * hidden * 2, fp8=len(layers) * hidden + FP8_SCALE_BYTES
            ),
            token_id_bytes=TOKEN_ID_BYTES,
            kv_memory_gib=memory_gib,
            capacity=[],
        )
        for mml in lens:
            row = dict(max_model_len=mml)
            for v in VARIANTS:
                row[v] = sizing(
                    cpu_engine, engine_config(cpu_engine, folder, v, layers, mml), memory
                )
            rec["capacity"].append(row)
    return rec


def _gb(b: float) -> str:
    return f"{b / 1e9:,.1f} GB" if b < 1e12 else f"{b / 1e12:,.1f} TB"


def markdown(rec: dict) -> str:
    """docs/scale.md's two tables for one record (no date: the doc states it)."""
    hs, tok = rec["hidden_states_bytes"], rec["token_id_bytes"]
    first = rec["capacity"][0]
    plain, up = first["plain"], first["upstream"]
    att, st = plain["kinds"]["attention"], plain["kinds"]["state"]
    up_hs = up["kinds"]["hidden_states"]
    up_group = next(g for g in up["groups"] if g["kind"] == "hidden_states")
    up_state_blocks = max(g["blocks"] for g in up["groups"] if g["kind"] == "state")
    state_groups = sum(g["kind"] == "state" for g in plain["groups"])
    n_layers, hidden = len(rec["layers"]), rec["hidden_size"]
    lines = [
        "| figure | value | |",
        "|---|---|---|",
        f"| parameters vLLM builds, bf16 weights | {rec['params'] / 1e9:.1f}B: "
        f"{rec['params'] * 2 / 1e9:,.0f} GB ({rec['params'] * 2 / 2**30:,.0f} GiB) | V |",
        f"| hidden states a token ({n_layers} x {hidden}), bf16 / fp8 | {hs['bf16']:,} B / "
        f"{hs['fp8']:,} B (+ {tok} B token id) | D |",
        f"| hidden states per 1M tokens on disk, bf16 / fp8 | {_gb(1e6 * (hs['bf16'] + tok))} / "
        f"{_gb(1e6 * (hs['fp8'] + tok))} | D |",
        f"| 800K samples x 2,048 tokens (1.64 G tokens), bf16 / fp8 | "
        f"{_gb(1.6384e9 * (hs['bf16'] + tok))} / {_gb(1.6384e9 * (hs['fp8'] + tok))} | D |",
        f"| attention KV a token ({att['layers']} layers) | "
        f"{att['real_bytes'] // att['block_size']:,} B | V |",
        f"| GDN state a request ({st['layers']} layers) | {st['real_bytes']:,} B; as allocated "
        f"{plain['block_bytes'] * state_groups:,} B ({state_groups} blocks) | V |",
        f"| upstream: hidden states a token in the KV cache | "
        f"{up_hs['real_bytes'] // up_hs['block_size']:,} B; as allocated "
        f"{up['block_bytes'] // up_group['block_size']:,} B (blocks of "
        f"{up_group['block_size']} tokens) | V |",
        f"| upstream: GDN state a request | {up_state_blocks} blocks a group, as allocated "
        f"{up['block_bytes'] * up_state_blocks * state_groups:,} B | V |",
    ]
    gib = rec["kv_memory_gib"]
    cap = [
        "",
        f"| max_model_len | KV memory a request: plain = ours | upstream | KV cache tokens per "
        f"{gib:g} GiB: plain | ours | upstream | upstream / plain |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rec["capacity"]:
        p, o, u = row["plain"], row["ours"], row["upstream"]
        mine = f"{p['request_bytes'] / 1e9:.2f} GB"
        if o["request_bytes"] != p["request_bytes"]:
            mine += f" / ours {o['request_bytes'] / 1e9:.2f} GB"
        if u["tokens"]:
            theirs, ratio = f"{u['tokens']:,}", f"{u['tokens'] / p['tokens']:.1%}"
        else:
            theirs, ratio = "none: one request does not fit", "-"
        cap.append(
            f"| {row['max_model_len']:,} | {mine} | {u['request_bytes'] / 1e9:.2f} GB "
            f"| {p['tokens']:,} | {o['tokens']:,} | {theirs} | {ratio} |"
        )
    return "\n".join(lines + cap)


def load(path: str) -> list[dict]:
    with open(path) as f:
        return json.load(f)["records"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="Qwen/Qwen3-Next-80B-A3B-Instruct", choices=sorted(SOURCES))
    p.add_argument("--layers", help="comma list of layer ids (default: the launcher's)")
    p.add_argument("--max-model-len", default="8448,32768,262144")
    p.add_argument("--kv-memory-gib", type=float, default=10.0, help="KV cache memory (GiB)")
    p.add_argument("--results", help="write the record here (replacing this model's)")
    p.add_argument("--table", metavar="JSON", help="print the tables of a results file; no vLLM")
    args = p.parse_args()
    if args.table:
        for rec in load(args.table):
            print(f"{rec['model']} (vLLM {rec['vllm']}, {rec['date']}):\n\n{markdown(rec)}\n")
        return 0
    layers = [int(x) for x in args.layers.split(",")] if args.layers else None
    lens = [int(x) for x in args.max_model_len.split(",")]
    rec = compute(args.model, layers, lens, args.kv_memory_gib)
    print(json.dumps(rec))
    print(markdown(rec))
    if args.results:
        old = load(args.results) if os.path.exists(args.results) else []
        keep = [r for r in old if r["model"] != rec["model"]]
        with open(args.results, "w") as f:
            json.dump({"records": [*keep, rec]}, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
