"""``vllm-gdn-hs check DIR --reference MODEL``: a sample of a run's files against HF transformers.

``check`` alone sees truncated files, NaN/Inf and all-zero rows; a wrong state that is finite
and not zero (a recycled GDN state, rows shifted by a token, another layer) is only seen
against the model itself. This holds a sample of the complete files to the GPU suite's bar
(:mod:`vllm_gdn_hs.reference`), each on its first ``max_tokens`` tokens (a row depends only on
the tokens up to it). Files are read without their lock: the trainer still finds them.
"""

from __future__ import annotations

import os
import sys

from vllm_gdn_hs.files import hidden_states_of


def sample(paths: list[str], n: int) -> list[str]:
    """``n`` of ``paths`` spread evenly over them (all of them if there are no more)."""
    return list(paths) if len(paths) <= n else [paths[i * len(paths) // n] for i in range(n)]


def _error(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def _read(path: str, max_tokens: int) -> dict:
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        return {k: f.get_slice(k)[:max_tokens] for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__


def run_spot_check(
    root: str,
    complete_paths: list[str],
    model: str,
    layer_ids: list[int],
    files: int = 8,
    max_tokens: int = 512,
    device: str = "cpu",
) -> int:
    """A sample of ``complete_paths`` (the files ``check.scan`` found complete under ``root``)
    against HF transformers on ``model``. 0: the sample is within the bar; 1: a file or the
    pooled sample is not; 2: bad input."""
    from vllm_gdn_hs.model_info import cached_model_folder, read_model_info, validate_layer_ids
    from vllm_gdn_hs.reference import HFReference, describe_pooled, worst_by_layer

    folder = model if os.path.isdir(model) else cached_model_folder(model)
    if not folder or not os.path.isfile(os.path.join(folder, "config.json")):
        return _error(
            f"{model} is no model folder with a config.json, nor a HF hub id in the local "
            "cache; pass the served model's folder (or `hf download` it first: the weights too)"
        )
    try:
        validate_layer_ids(layer_ids, read_model_info(folder).num_hidden_layers)
    except ValueError as e:
        return _error(
            f"--layer-ids for {model}: {e}; pass the layer ids the server extracted, "
            "for the model it served"
        )
    chosen = sample(complete_paths, files)
    if not chosen:
        return _error(f"no complete file under {root} to check")
    data, width = {}, set()
    for path in chosen:
        try:
            data[path] = _read(path, max_tokens)
            width.add(hidden_states_of(data[path]).shape[1])
        except Exception as e:  # truncated or foreign: check's own report lists it
            data.pop(path, None)
            print(f"  {path}: left out, unreadable ({e or type(e).__name__})")
    if not data:
        return _error(f"no readable file among the {len(chosen)} sampled")
    if width != {len(layer_ids)}:
        return _error(
            f"the files hold {sorted(width)} layers, --layer-ids names {len(layer_ids)}; "
            "pass the layer ids the server extracted (in its order, as the launcher prints "
            "them)"
        )
    print(
        f"{len(data)} of the complete files under {root}, first {max_tokens} tokens each, "
        f"against HF transformers ({model}, fp32 then bf16 on {device}, one model at a time: "
        f"minutes for a large model on the CPU), layers {layer_ids}",
        flush=True,
    )
    ref = HFReference(folder, layer_ids, device=device, max_cached=len(data))
    try:
        try:
            ref.precompute([d["token_ids"].tolist() for d in data.values()])
        except (OSError, ValueError) as e:  # no weights, or not this model's
            return _error(f"HF transformers on {model}: {e}")
        bad = 0
        for path, d in data.items():
            result = ref.check(d, d["token_ids"].tolist())
            ratio = worst_by_layer([result]).get("worst_ratio", float("nan"))
            verdict = "; ".join(result["problems"]) or "within the per-file bound"
            print(
                f"  {path}: {len(d['token_ids'])} token(s), worst layer {ratio:.2f} x HF bf16's "
                f"error: {verdict}"
            )
            bad += bool(result["problems"])
        pooled = ref.pooled()
    finally:
        ref.close()
    print(describe_pooled(pooled))
    if bad or pooled["problems"]:
        for line in pooled["problems"]:
            print(f"  {line}")
        print(
            f"FAILED: {bad} of {len(data)} files over the per-file bound"
            + (", the pooled sample over the bar" if pooled["problems"] else "")
            + ". These hidden states are not the model's: do not train on this folder; "
            "run `vllm-gdn-hs doctor` and report the vLLM version and flags"
        )
        return 1
    print("passed: as close to HF fp32 as HF transformers in bf16 is")
    return 0
