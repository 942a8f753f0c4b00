"""Turn bench.py's results JSON into a Markdown table (for the README) and a PNG plot.

    python benchmarks/report.py benchmarks/results/h200.json \\
        --md benchmarks/results/README-table.md --png benchmarks/results/throughput.png

Rows: the latest record per (GPU, shape, layers, workload, variant, vLLM version, mode, write
target, batch size); for hf, the best batch size. "x plain" divides by plain vLLM's tok/s on the
same GPU, shape, workload, vLLM version and mode, measured in the same run where the records
carry one (bench.py --run; hf: plain eager on the newest vLLM in the file). The plot needs
matplotlib; without it only the Markdown is written.

Roofline. FLOPs per processed token =
    2 x (matmul weights of all decoder layers; embeddings and lm_head left out)
  + 4 x n_heads x head_dim x ctx        per full-attention layer (QK^T and PV)
  + 6 x h_v x d_k x d_v                 per GDN layer (state update, read-out; intra-chunk left out)
where ctx is the mean number of keys a token attends to (bench.py's attn_ctx_mean). The limit in
tokens/s is PEAK_TFLOPS / FLOPs per token; "% roofline" is processed tokens/s over that limit
(processed = prompt tokens, plus generated tokens for the mixed-outK workloads).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

PEAK_TFLOPS = 790  # bf16 dense matmul, measured on the H200 (see benchmarks/README.md)
VARIANT_ORDER = {"plain": 0, "ours": 1, "upstream": 2, "hf": 3}


def linear_params(m: dict) -> int:
    """Matmul weights of the decoder layers (Qwen3.5/3.6: gated attention, GDN, SwiGLU MLP)."""
    h, hd = m["hidden_size"], m["head_dim"]
    heads, kv = m["num_attention_heads"], m["num_key_value_heads"]
    q_out = heads * hd * (2 if m.get("attn_output_gate") else 1)  # the gate rides on q_proj
    attn = h * q_out + 2 * h * kv * hd + heads * hd * h
    kd = m["linear_num_key_heads"] * m["linear_key_head_dim"]
    vd = m["linear_num_value_heads"] * m["linear_value_head_dim"]
    gdn = h * (2 * kd + vd) + h * vd + 2 * h * m["linear_num_value_heads"] + vd * h  # qkv z ba out
    gdn += (2 * kd + vd) * m["linear_conv_kernel_dim"]
    mlp = 3 * h * m["intermediate_size"]
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
    return linear_params(m) + m["vocab_size"] * m["hidden_size"] * 2  # untied embed + lm_head


def tok_s(r: dict) -> float:
    return r["prompt_tokens"] / r["gen_s"]


def roofline_tok_s(r: dict) -> float:
    return PEAK_TFLOPS * 1e12 / flops_per_token(r["model"], r["attn_ctx_mean"])


def roofline_frac(r: dict) -> float:
    return r["processed_tokens"] / r["gen_s"] / roofline_tok_s(r)


def ok(r: dict) -> bool:
    return not r.get("error") and bool(r.get("gen_s"))


def vkey(version: str | None) -> tuple:
    parts = (version or "0").split("+")[0].split(".")
    return tuple(int(p) if p.isdigit() else 0 for p in parts)


def load(paths: list[str]) -> list[dict]:
    records = []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        records += data["records"] if isinstance(data, dict) else data
    return records


def select(records: list[dict]) -> list[dict]:
    """Latest record per key, then the best hf batch size per group."""
    latest = {}
    for r in records:  # records are appended in time order
        key = (
            r["gpu"],
            r["shape"],
            tuple(r["layers"]),
            r["workload"],
            r["variant"],
            r["versions"]["vllm"],
            r["mode"],
            "none" if r["variant"] == "plain" else r["write_target"],  # plain writes nothing
            r.get("batch_size"),
        )
        latest[key] = r
    rows, hf = [], defaultdict(list)
    for key, r in latest.items():
        (hf[key[:-1]] if r["variant"] == "hf" else rows).append(r)
    for group in hf.values():
        good = [r for r in group if ok(r)]
        best = dict(max(good, key=tok_s) if good else group[-1])
        if good:
            sizes = sorted(r["batch_size"] for r in group if r.get("batch_size"))
            best["hf_batch_note"] = f"batch {best['batch_size']} (best of {sizes})"
        rows.append(best)
    return rows


def plain_for(r: dict, records: list[dict]) -> dict | None:
    """The plain record to divide by: same GPU, shape, workload, mode and vLLM version (hf: plain
    eager on the newest vLLM); of those, the one measured in the same run (bench.py --run) when
    there is one, else the newest."""
    cands = [
        p
        for p in records
        if p["variant"] == "plain"
        and ok(p)
        and p["gpu"] == r["gpu"]
        and p["shape"] == r["shape"]
        and p["workload"] == r["workload"]
        and (p["mode"] == "eager" if r["variant"] == "hf" else p["mode"] == r["mode"])
        and (r["variant"] == "hf" or p["versions"]["vllm"] == r["versions"]["vllm"])
    ]
    same_run = [p for p in cands if r.get("run") and p.get("run") == r["run"]]
    return max(
        same_run or cands, key=lambda p: (vkey(p["versions"]["vllm"]), p["date"]), default=None
    )


def workload_order(name: str, rows: list[dict]) -> tuple:
    """Prefill-only workloads first, then by size: 128x1024, 32x8192, mixed, mixed-out256."""
    r = next(r for r in rows if r["workload"] == name)
    return (r["output_tokens_requested"], r["prompt_tokens"], name)


def series_order(label: str) -> int:
    return VARIANT_ORDER.get(label.split()[0], 9)


def fmt(x, spec: str = ",.0f", none: str = "n/a") -> str:
    return none if x is None else format(x, spec)


def note(r: dict) -> str:
    parts = [r["hf_batch_note"]] if r.get("hf_batch_note") else []
    if r.get("commit"):
        parts.append(f"commit {r['commit']}")
    if r.get("run"):
        parts.append(f"run {r['run']}")
    if r.get("error"):
        err = r.get("error_summary") or (r["error"].strip().splitlines() or ["error"])[-1]
        # skipped, or cut off by --budget, is time, not a fault: say so without "failed" (the
        # "--timeout/--budget" wording is the records of run 18, before the two were told apart)
        cut = err.startswith(("skipped", "cut off by --budget")) or err.endswith("/--budget)")
        parts.append(err[:240] if cut else "failed: " + err[:240])
    elif r["variant"] == "hf" and not r.get("fla_available"):
        parts.append("no fla: reference GDN kernels")
    return "; ".join(parts).replace("|", "/")


def conditions(records: list[dict]) -> str:
    """One paragraph: everything the records hold in common or in range (dates, versions, flags)."""

    def uniq(get) -> str:
        vals = sorted({json.dumps(v) if isinstance(v, dict) else str(v) for v in map(get, records)})
        return ", ".join(v for v in vals if v != "None") or "n/a"

    def ver(name: str) -> str:
        return uniq(lambda r: r["versions"].get(name))

    def flag(name: str) -> str:
        return uniq(lambda r: r.get("flags", {}).get("spec", {}).get(name))

    dates = sorted(r["date"][:10] for r in records)
    return (
        f"GPU {uniq(lambda r: r['gpu'])}; runs {dates[0]} to {dates[-1]}; vLLM {ver('vllm')}; "
        f"torch {ver('torch')}; transformers {ver('transformers')}; fla {ver('fla')}; "
        f'vllm-gdn-hs {ver("vllm_gdn_hs")}. Dummy weights (`load_format="dummy"`), bf16, '
        "`language_model_only`, prefix caching off, `gdn_prefill_backend=triton`, "
        "`VLLM_USE_FLASHINFER_SAMPLER=0`, plain and upstream without vLLM plugins "
        f"(`VLLM_PLUGINS=`), gpu_memory_utilization "
        f"{flag('gpu_memory_utilization')}, max_model_len {flag('max_model_len')}, extra engine "
        f"kwargs {flag('extra_engine_kwargs')}. Random-token prompts, seed {flag('seed')}. "
        f"Roofline: {PEAK_TFLOPS} TFLOP/s bf16 (formula in benchmarks/report.py)."
    )


COLUMNS = (
    "variant | vLLM | mode | write to | tok/s | x plain | % roofline | samples/s | drain s | "
    "tok/s incl. drain | KV cache tokens | max concurrency | peak GPU GiB | bytes/token | "
    "startup s | note"
)


def row(r: dict, records: list[dict]) -> str:
    hf = r["variant"] == "hf"
    cells = [
        r["variant"],
        f"none (transformers {r['versions']['transformers']})" if hf else r["versions"]["vllm"],
        r["mode"],
        "none" if r["variant"] == "plain" else f"{r['write_target']} ({r.get('out_fs')})",
    ]
    if ok(r):
        plain = plain_for(r, records)
        total = r["gen_s"] + r.get("drain_s", 0)
        peak = r.get("peak_gpu_mib")
        cells += [
            fmt(tok_s(r)),
            fmt(tok_s(r) / tok_s(plain), ".2f") if plain else "n/a",
            fmt(100 * roofline_frac(r), ".0f") + "%",
            fmt(r["num_requests"] / r["gen_s"], ",.1f"),
            fmt(r.get("drain_s"), ".2f"),
            fmt(r["prompt_tokens"] / total),
            fmt(r.get("kv_cache_tokens")),
            fmt(r.get("max_concurrency"), ".1f"),
            fmt(peak / 1024 if peak else None, ".1f"),
            fmt(r["bytes_written"] / r["processed_tokens"]) if r.get("files") else "0",
        ]
    else:
        cells += ["n/a"] * 6 + [fmt(r.get("kv_cache_tokens")), fmt(r.get("max_concurrency"), ".1f")]
        cells += ["n/a", "n/a"]
    cells += [fmt(r.get("startup_s"), ".0f"), note(r)]
    return "| " + " | ".join(cells) + " |"


def markdown(rows: list[dict], records: list[dict], source: str) -> str:
    out = [
        f"<!-- generated by benchmarks/report.py from {source}; edit the JSON, not this -->",
        "",
        conditions(rows),
        "",
    ]
    groups = defaultdict(list)
    for r in rows:
        groups[(r["gpu"], r["shape"], tuple(r["layers"]), r["workload"])].append(r)

    def order(k):
        return (k[0], k[1], k[2], workload_order(k[3], groups[k]))

    for key in sorted(groups, key=order):
        gpu, shape, layers, workload = key
        rs = sorted(
            groups[key],
            key=lambda r: (
                VARIANT_ORDER.get(r["variant"], 9),
                vkey(r["versions"]["vllm"]),
                r["mode"],
                r["write_target"],
            ),
        )
        r0, m = rs[0], rs[0]["model"]
        gen = (
            f"{r0['output_tokens_requested']} generated tokens with include_output_tokens"
            if r0["output_tokens_requested"]
            else "prefill only (max_tokens=1)"
        )
        ideal = len(layers) * m["hidden_size"] * 2 + 8
        out += [
            f"### {shape} ({m['num_hidden_layers']} layers, hidden {m['hidden_size']}, "
            f"{total_params(m) / 1e9:.1f}B params), {workload} on {gpu}",
            "",
            f"{r0['num_requests']} requests, {r0['prompt_tokens']:,} prompt tokens (mean "
            f"{r0['mean_len']:,}, median {r0['median_len']:,.0f}, "
            f"range {r0['min_len']}-{r0['max_len']}), "
            f"{gen}. Hidden states of layers {list(layers)}: ideal {ideal:,} bytes/token "
            f"({len(layers)} x {m['hidden_size']} x 2 B + 8 B token id). Roofline "
            f"{roofline_tok_s(r0):,.0f} tok/s ({flops_per_token(m, r0['attn_ctx_mean']) / 1e9:.1f} "
            f"GFLOP/token at mean context {r0['attn_ctx_mean']:,.0f}).",
            "",
            "| " + COLUMNS + " |",
            "|" + " --- |" * len(COLUMNS.split("|")),
            *(row(r, records) for r in rs),
            "",
        ]
    return "\n".join(out)


README_BEGIN = "<!-- begin: generated by benchmarks/report.py --readme; edit the JSON, not this -->"
README_END = "<!-- end: generated by benchmarks/report.py --readme -->"


def summary(rows: list[dict], records: list[dict]) -> str:
    """The README's table: each extraction row against plain vLLM of the same run, and
    against the best HF transformers figure on the same shape and workload."""
    hf_rows = sorted(
        (r for r in rows if r["variant"] == "hf" and ok(r)),
        key=lambda r: (r["gpu"], -r["model"]["hidden_size"], workload_order(r["workload"], rows)),
    )
    hf_best = {(r["gpu"], r["shape"], r["workload"]): tok_s(r) for r in hf_rows}
    out = [
        "| model, workload | variant | mode | write to | tok/s | x plain | x HF | "
        "KV cache tokens (x plain) | drain s | commit, run |",
        "|" + " --- |" * 10,
    ]
    extraction = [r for r in rows if r["variant"] in ("ours", "upstream") and ok(r)]

    def order(r):
        return (
            r["gpu"],
            -r["model"]["hidden_size"],
            workload_order(r["workload"], rows),
            VARIANT_ORDER[r["variant"]],
            r["mode"],
            r["write_target"],
        )

    for r in sorted(extraction, key=order):
        m, plain = r["model"], plain_for(r, records)
        hf = hf_best.get((r["gpu"], r["shape"], r["workload"]))
        kv = fmt(r.get("kv_cache_tokens"))
        if plain and r.get("kv_cache_tokens") and plain.get("kv_cache_tokens"):
            kv += f" ({r['kv_cache_tokens'] / plain['kv_cache_tokens']:.1%})"
        out.append(
            "| "
            + " | ".join(
                [
                    f"{r['shape']} ({m['num_hidden_layers']} layers, hidden {m['hidden_size']}), "
                    f"{r['workload']}",
                    f"{r['variant']} (vLLM {r['versions']['vllm']})",
                    r["mode"],
                    f"{r['write_target']} ({r.get('out_fs')})",
                    fmt(tok_s(r)),
                    f"{tok_s(r) / tok_s(plain):.2f} ({fmt(tok_s(plain))})" if plain else "n/a",
                    f"{tok_s(r) / hf:.2f}" if hf else "n/a",
                    kv,
                    fmt(r.get("drain_s"), ".2f"),
                    ", ".join(str(x) for x in (r.get("commit"), r.get("run")) if x) or "n/a",
                ]
            )
            + " |"
        )
    notes = [
        f"HF transformers {r['versions']['transformers']} on {r['shape']}, {r['workload']}: "
        f"{fmt(tok_s(r))} tok/s, {r.get('hf_batch_note', '')}"
        for r in hf_rows
    ]
    return "\n".join([*out, "", *(f"- {n}" for n in notes)])


def readme_block(rows: list[dict], records: list[dict]) -> str:
    """What --readme puts in README.md: the conditions, then the summary table."""
    return conditions(rows) + "\n\n" + summary(rows, records)


def splice_readme(path: str, text: str) -> None:
    """Replace what lies between README_BEGIN and README_END in ``path`` with ``text``."""
    with open(path) as f:
        doc = f.read()
    if README_BEGIN not in doc or README_END not in doc:
        raise SystemExit(f"{path} has no {README_BEGIN} ... {README_END} block to fill")
    head, rest = doc.split(README_BEGIN, 1)
    _, tail = rest.split(README_END, 1)
    with open(path, "w") as f:
        f.write(f"{head}{README_BEGIN}\n{text}\n{README_END}{tail}")


def plot(rows: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot written", file=sys.stderr)
        return
    good = [r for r in rows if ok(r)]
    shapes = sorted({(r["gpu"], r["shape"]) for r in good})
    if not shapes:
        print("no successful records: no plot written", file=sys.stderr)
        return
    fig, axes = plt.subplots(len(shapes), 1, figsize=(13, 4.5 * len(shapes)), squeeze=False)
    multi_target = len({r["write_target"] for r in good}) > 1
    for ax, (gpu, shape) in zip(axes[:, 0], shapes, strict=True):
        rs = [r for r in good if (r["gpu"], r["shape"]) == (gpu, shape)]
        workloads = sorted({r["workload"] for r in rs}, key=lambda w: workload_order(w, rs))

        def label(r):
            if r["variant"] == "hf":
                s = "hf transformers"
            else:
                s = f"{r['variant']} (vLLM {r['versions']['vllm']}, {r['mode']})"
            if multi_target and r["variant"] != "plain":
                s += f", {r['write_target']}"
            return s

        series = sorted({label(r) for r in rs}, key=lambda s: (series_order(s), s))
        width = 0.8 / len(series)
        for i, s in enumerate(series):
            xs, ys = [], []
            for j, w in enumerate(workloads):
                match = [r for r in rs if r["workload"] == w and label(r) == s]
                if match:
                    xs.append(j - 0.4 + width * (i + 0.5))
                    ys.append(tok_s(match[-1]))
            bars = ax.bar(xs, ys, width, label=s)
            ax.bar_label(bars, labels=[f"{y / 1000:.1f}k" for y in ys], fontsize=7)
        for j, w in enumerate(workloads):
            r0 = next(r for r in rs if r["workload"] == w)
            if not r0["output_tokens_requested"]:
                ax.hlines(
                    roofline_tok_s(r0),
                    j - 0.45,
                    j + 0.45,
                    colors="k",
                    linestyles="--",
                    label=f"roofline ({PEAK_TFLOPS} TFLOP/s)" if j == 0 else None,
                )
        ax.set_xticks(range(len(workloads)), workloads)
        ax.set_ylabel("prompt tokens/s")
        ax.set_title(f"{shape} shape on {gpu}: hidden-state extraction throughput")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("results", nargs="+", help="results JSON file(s) written by bench.py")
    p.add_argument("--md", help="write the Markdown here (default: print it)")
    p.add_argument("--png", help="write the plot here (needs matplotlib)")
    p.add_argument(
        "--readme",
        help="fill this file's generated block (README.md's Measured section) with the summary",
    )
    args = p.parse_args(argv)
    records = load(args.results)
    rows = select(records)
    if not rows:
        p.error("no records in " + ", ".join(args.results))
    text = markdown(rows, records, ", ".join(os.path.basename(x) for x in args.results))
    if args.md:
        with open(args.md, "w") as f:
            f.write(text + "\n")
        print(f"wrote {args.md}")
    else:
        print(text)
    if args.png:
        plot(rows, args.png)
    if args.readme:
        splice_readme(args.readme, readme_block(rows, records))
        print(f"wrote {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
