"""KV cache capacity with and without hidden-state extraction, from vLLM's own sizing code.

No GPU needed: builds the real per-layer KV cache specs of the model (meta device, through
tests/cpu_engine.py) and runs vLLM 0.20.1's get_kv_cache_configs and
get_max_concurrency_for_kv_cache_config, the numbers behind its "GPU KV cache size: N tokens"
line. Variants: plain (no extraction); ours (HybridHiddenStatesConnector: the same KV cache
specs, and no GPU memory held between steps; a step's hand-over is in the peak vLLM profiles,
which bench.py measures on the GPU); stock
(ExampleHiddenStatesConnector with HMA forced on; on 0.20.1 it fails to start, and the error is
recorded).

    PYTHONPATH=tests python benchmarks/kv_capacity.py --shape 27b \
        --max-model-len 8448,32768,262144 --results benchmarks/results/kv_capacity.json

(from the repository root: tests/ on PYTHONPATH for tests/cpu_engine.py, the CPU tests' engine).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile

# tests/cpu_engine.py: vLLM's CpuPlatform, the CPU tests' engine (test code, not in the
# package), through PYTHONPATH (the usage line above). First: it installs the platform.
try:
    import cpu_engine
except ModuleNotFoundError as e:
    sys.exit(f"{e}: run with PYTHONPATH=tests from the repository root")
from records import merge_results  # noqa: E402
from workloads import DEFAULT_LAYERS, model_config, write_model_dir  # noqa: E402


def capacity(
    model: str, variant: str, layers: list[int], max_model_len: int, memory: int, step_tokens: int
):
    import vllm.plugins

    vllm.plugins.load_general_plugins()
    kw = dict(
        enable_prefix_caching=False, max_model_len=max_model_len, max_num_batched_tokens=step_tokens
    )
    if variant == "plain":
        kw.update(connector=None, layer_ids=None)
    elif variant == "ours":
        kw.update(connector=cpu_engine.OURS, layer_ids=layers)
    else:
        kw.update(
            connector=cpu_engine.STOCK, layer_ids=layers, disable_hybrid_kv_cache_manager=False
        )
    try:
        cfg = cpu_engine.engine_config(model, **kw)
        tokens, kcc = cpu_engine.kv_capacity(cfg, memory)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return {
        "tokens": tokens,
        "max_concurrency": round(tokens / max_model_len, 2),
        "num_blocks": kcc.num_blocks,
        "block_size": cfg.cache_config.block_size,
        "groups": [type(g.kv_cache_spec).__name__ for g in kcc.kv_cache_groups],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="27b")
    p.add_argument("--max-model-len", default="8448,32768,262144")
    p.add_argument(
        "--kv-memory-gib",
        type=float,
        default=71.72,
        help="KV cache memory of plain vLLM (27B on an H200 at 0.9: 71.72 GiB, measured)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=16384,
        help="tokens per step, which sizes the hidden-state buffers (LLM(...) on an H200: 16384)",
    )
    p.add_argument("--variants", default="plain,ours,stock")
    p.add_argument("--results", help="append the records to this JSON file")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as root:
        model = write_model_dir(root, args.shape)
        n = model_config(args.shape)["text_config"]["num_hidden_layers"]
        layers = DEFAULT_LAYERS[n]
        records = []
        for mml in map(int, args.max_model_len.split(",")):
            rec = {
                "date": datetime.date.today().isoformat(),
                "shape": args.shape,
                "layers": layers,
                "max_model_len": mml,
                "kv_memory_gib": args.kv_memory_gib,
                "max_num_batched_tokens": args.max_num_batched_tokens,
                "vllm": __import__("vllm").__version__,
            }
            for v in args.variants.split(","):
                rec[v] = capacity(
                    model,
                    v,
                    layers,
                    mml,
                    int(args.kv_memory_gib * 2**30),
                    args.max_num_batched_tokens,
                )
            if "tokens" in rec.get("plain", {}) and "tokens" in rec.get("ours", {}):
                rec["ours_over_plain"] = round(rec["ours"]["tokens"] / rec["plain"]["tokens"], 4)
            records.append(rec)
            print(json.dumps(rec))
    if args.results:
        merge_results(args.results, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
