"""The throughput plot: prompt tokens/s by workload and variant, one panel per GPU and shape,
with the roofline of each prefill-only workload (needs matplotlib)."""

from __future__ import annotations

import sys

from records import BASELINES, VARIANT_ORDER, ok, tok_s, workload_order
from roofline import PEAK_TFLOPS, roofline_tok_s


def series_order(label: str) -> int:
    return VARIANT_ORDER.get(label.split()[0], 9)


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
            if multi_target and r["variant"] not in BASELINES:
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
