"""Turn bench.py's results JSON into a Markdown table, a PNG plot and the summary block of
benchmarks/README.md.

    python benchmarks/report.py benchmarks/results/h200.json \\
        --md benchmarks/results/README-table.md --png benchmarks/results/throughput.png --readme

Rows: the latest record per (GPU, shape, layers, workload, variant, vLLM version, mode, write
target, GDN backend, batch size); for hf, the best batch size. "x plain" divides by plain
vLLM's tok/s of the same run only (bench.py --run), with the same GPU, commit, shape, workload,
vLLM version, mode and engine settings (hf: plain eager of its run); where the run has no such
plain record the ratio is blank and the row says why (:func:`pair`). "% roofline": see
roofline.py. The plot needs matplotlib; without it only the Markdown is written.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

from records import (
    BASELINES,
    BUSY_GPU_MIB,
    FAULTS,
    OK,
    OURS,
    VARIANT_ORDER,
    files_ready_s,
    ok,
    record_settings,
    status,
    status_note,
    tok_s,
    workload_order,
)
from roofline import PEAK_TFLOPS, flops_per_token, roofline_frac, roofline_tok_s, total_params

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "h200.json")
README = os.path.join(HERE, "README.md")  # its block between README_BEGIN and README_END


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
            "none" if r["variant"] in BASELINES else r["write_target"],  # plain writes nothing
            record_settings(r)["gdn_backend"],
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


def pair(r: dict, records: list[dict]) -> tuple[dict | None, str]:
    """The plain record to divide ``r`` by, and "" ; or None and why there is none.

    A ratio is only ever taken within one run: the plain record must carry the same run label
    (bench.py --run), GPU, commit, shape, workload, mode and vLLM version, and for a vLLM
    variant the same engine settings (records.record_settings: GDN backend, step and batch
    sizes, KV sizing, ...); hf divides by plain eager of its run. Of several such plain records
    the newest. A figure of one run is never divided by another run's: where a run lacks its
    plain row the ratio stays blank."""
    run = r.get("run")
    if not run:
        return None, "no run label, so no plain record of the same run"
    hf = r["variant"] == "hf"
    same_run = [p for p in records if p["variant"] == "plain" and p.get("run") == run]
    if not same_run:
        return None, f"run {run} has no plain record"
    checks = (
        ("GPU", lambda p: p["gpu"] == r["gpu"]),
        ("commit", lambda p: p.get("commit") == r.get("commit")),
        ("shape", lambda p: p["shape"] == r["shape"]),
        ("workload", lambda p: p["workload"] == r["workload"]),
        ("mode", lambda p: p["mode"] == ("eager" if hf else r["mode"])),
        ("vLLM version", lambda p: hf or p["versions"]["vllm"] == r["versions"]["vllm"]),
        ("settings", lambda p: hf or record_settings(p) == record_settings(r)),
        ("a measured figure", ok),
    )
    cands = same_run
    for what, check in checks:
        kept = [p for p in cands if check(p)]
        if not kept:
            return None, f"run {run}'s plain differs in {what}"
        cands = kept
    return max(cands, key=lambda p: p["date"]), ""


def plain_for(r: dict, records: list[dict]) -> dict | None:
    """The plain record of the same run to divide by (see :func:`pair`), or None."""
    return pair(r, records)[0]


def fmt(x, spec: str = ",.0f", none: str = "n/a") -> str:
    return none if x is None else format(x, spec)


def note(r: dict) -> str:
    parts = [r["hf_batch_note"]] if r.get("hf_batch_note") else []
    if r.get("commit"):
        parts.append(f"commit {r['commit']}")
    if r.get("run"):
        parts.append(f"run {r['run']}")
    engine = r.get("engine_config")  # a dict, or the repr of the error that stopped reading it
    if isinstance(engine, dict) and engine.get("model_runner"):
        parts.append(f"model runner {engine['model_runner'].upper()}")
    if (r.get("gpu_used_before_mib") or 0) > BUSY_GPU_MIB:
        gib = r["gpu_used_before_mib"] / 1024
        parts.append(f"{gib:.1f} GiB of the GPU held by another process: KV cache not comparable")
    if r.get("profiler"):  # measured with a profiler attached: read its figure with that
        parts.append(f"profiled ({r['profiler']})")
    st = status(r)
    if st != OK:  # skipped, or cut off by the --budget, is time, not a fault: no "failed"
        text = (status_note(r) or st)[:240]
        parts.append("failed: " + text if st in FAULTS else text)
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

    def engine(name: str) -> str:
        return uniq(lambda r: r.get(name))

    dates = sorted(r["date"][:10] for r in records)
    gdn = uniq(lambda r: None if r["variant"] == "hf" else r.get("gdn_prefill_backend", "triton"))
    return (
        f"GPU {uniq(lambda r: r['gpu'])}; runs {dates[0]} to {dates[-1]}; vLLM {ver('vllm')}; "
        f"torch {ver('torch')}; transformers {ver('transformers')}; fla {ver('fla')}; "
        f'vllm-gdn-hs {ver("vllm_gdn_hs")}. Dummy weights (`load_format="dummy"`), bf16, '
        f"`language_model_only`, prefix caching off, GDN prefill backend {gdn}, "
        "`VLLM_USE_FLASHINFER_SAMPLER=0`, plain and upstream without vLLM plugins "
        f"(`VLLM_PLUGINS=`), gpu_memory_utilization "
        f"{flag('gpu_memory_utilization')}, max_model_len {flag('max_model_len')}, "
        f"max_num_batched_tokens {engine('max_num_batched_tokens')}, max_num_seqs "
        f"{engine('max_num_seqs')}, KV sizing {engine('kv_sizing')}, extra engine "
        f"kwargs {flag('extra_engine_kwargs')}. Random-token prompts, seed {flag('seed')}. "
        f"Roofline: {PEAK_TFLOPS} TFLOP/s bf16 (formula in benchmarks/roofline.py)."
    )


COLUMNS = (
    "variant | vLLM | mode | write to | tok/s | x plain | % roofline | samples/s | "
    "files ready s | tok/s incl. files ready | KV cache tokens | max concurrency | "
    "KV blocks | warm-up peak GiB | GDN prefill | peak GPU GiB | bytes/token | startup s | note"
)


def row(r: dict, records: list[dict]) -> str:
    hf = r["variant"] == "hf"
    cells = [
        r["variant"],
        f"none (transformers {r['versions']['transformers']})" if hf else r["versions"]["vllm"],
        r["mode"],
        "none" if r["variant"] in BASELINES else f"{r['write_target']} ({r.get('out_fs')})",
    ]
    blank = ""
    kv_cells = [
        fmt(r.get("kv_cache_blocks")),
        fmt(r.get("warmup_allocated_peak_gib"), ".2f"),
        "n/a" if hf else r.get("gdn_prefill_backend", "triton"),  # before the field: forced
    ]
    if ok(r):
        plain, why = pair(r, records)
        blank = f"x plain blank: {why}" if why else ""
        ready = files_ready_s(r)
        total = r["gen_s"] + (ready or 0)
        peak = r.get("peak_gpu_mib")
        cells += [
            fmt(tok_s(r)),
            fmt(tok_s(r) / tok_s(plain), ".3f") if plain else "n/a",
            fmt(100 * roofline_frac(r), ".0f") + "%",
            fmt(r["num_requests"] / r["gen_s"], ",.1f"),
            fmt(ready, ".2f"),
            fmt(r["prompt_tokens"] / total),
            fmt(r.get("kv_cache_tokens")),
            fmt(r.get("max_concurrency"), ".1f"),
            *kv_cells,
            fmt(peak / 1024 if peak else None, ".1f"),
            fmt(r["bytes_written"] / r["processed_tokens"]) if r.get("files") else "0",
        ]
    else:
        cells += ["n/a"] * 6 + [fmt(r.get("kv_cache_tokens")), fmt(r.get("max_concurrency"), ".1f")]
        cells += [*kv_cells, "n/a", "n/a"]
    cells += [fmt(r.get("startup_s"), ".0f"), "; ".join(x for x in (note(r), blank) if x)]
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
    hf_best = {(r["gpu"], r["shape"], r["workload"], r.get("run")): tok_s(r) for r in hf_rows}
    out = [
        "| model, workload | variant | mode | write to | tok/s | x plain | x HF | "
        "KV cache tokens (x plain) | files ready s | commit, run |",
        "|" + " --- |" * 10,
    ]
    extraction = [r for r in rows if r["variant"] in (*OURS, "upstream") and ok(r)]

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
        m, (plain, why) = r["model"], pair(r, records)
        hf = (
            hf_best.get((r["gpu"], r["shape"], r["workload"], r.get("run")))
            if r.get("run")
            else None
        )
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
                    f"{tok_s(r) / tok_s(plain):.3f} ({fmt(tok_s(plain))})"
                    if plain
                    else f"n/a ({why})",
                    f"{tok_s(r) / hf:.2f}" if hf else "n/a",
                    kv,
                    fmt(files_ready_s(r), ".2f"),
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
    if any(r["variant"] == "hf" for r in rows):
        notes.append("x HF divides only by HF transformers of the same run: blank otherwise")
    return "\n".join([*out, "", *(f"- {n}" for n in notes)])


def readme_block(rows: list[dict], records: list[dict]) -> str:
    """What --readme puts in benchmarks/README.md: the conditions, then the summary table."""
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


MEMORY_COLUMNS = (
    ("peak activation", "peak_activation_gib"),
    ("CUDA-graph memory", "cudagraph_gib"),
    ("kept for transient activations", "warmup_transient_kept_gib"),
)


def memory_table(records: list[dict]) -> str:
    """vLLM's own memory accounting per variant of one run (one row per variant, its last
    record): GiB from its log lines, its KV cache blocks and tokens, and each figure against
    the plain record of the same run (bench.py --run) in KV cache blocks."""
    last = {}
    for r in records:
        if r.get("kv_cache_blocks") is not None:
            last[(r.get("run"), r.get("gpu"), r.get("variant"))] = r
    head = ["run", "GPU", "variant", *(c for c, _ in MEMORY_COLUMNS), "KV blocks", "KV tokens"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * 3 + " ---: |" * (len(head) - 3)]
    for (run, gpu, variant), r in sorted(last.items(), key=lambda kv: str(kv[0])):
        plain = last.get((run, gpu, "plain"))
        block = (plain or r).get("kv_block_gib")
        cells = [str(run), str(gpu), str(variant)]
        for _, key in MEMORY_COLUMNS:
            cell = fmt(r.get(key), ".2f")
            if plain is not None and r is not plain and block and r.get(key) is not None:
                cell += f" ({(r[key] - plain[key]) / block:+.1f} blocks)"
            cells.append(cell)
        blocks = str(r["kv_cache_blocks"])
        if plain is not None and r is not plain:
            blocks += f" ({r['kv_cache_blocks'] / plain['kv_cache_blocks']:.1%})"
        cells += [blocks, fmt(r.get("kv_cache_tokens"))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "results",
        nargs="*",
        default=[RESULTS],
        help="results JSON file(s) written by bench.py (default: benchmarks/results/h200.json)",
    )
    p.add_argument("--md", help="write the Markdown here (default: print it)")
    p.add_argument("--png", help="write the plot here (needs matplotlib)")
    p.add_argument(
        "--memory", action="store_true", help="print vLLM's memory accounting per variant instead"
    )
    p.add_argument(
        "--readme",
        nargs="?",
        const=README,
        metavar="MD",
        help="fill the generated block of benchmarks/README.md (or of MD) with the summary",
    )
    args = p.parse_args(argv)
    if args.readme and args.readme.endswith(".json"):
        p.error(f"--readme {args.readme}: give the results files before --readme")
    records = load(args.results)
    if args.memory:
        print(memory_table(records))
        return 0
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
        from plot import plot

        plot(rows, args.png)
    if args.readme:
        splice_readme(args.readme, readme_block(rows, records))
        print(f"wrote {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
