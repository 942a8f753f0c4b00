"""Hidden states from HF transformers on the same weights (layer id k: decoder layer k - 1's
output; 0: the embeddings), and how close ours are.

HF fp32 on the same bf16 weights is the truth; a layer's error is ``||x - hf32|| / ||hf32||``,
and ours is held to HF bf16's own: pooled over a run's files, at most ``BAR_FACTOR`` times it
(:meth:`HFReference.pooled`); per file, at most ``GROSS_FACTOR`` times (:func:`within_bar`),
a gross bound that catches shifted rows or a wrong layer and never flakes on bf16 noise.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from vllm_gdn_hs.files import SCALES, hidden_states_of
from vllm_gdn_hs.rows import check_rows
from vllm_gdn_hs.verify.checkpoint import load_text_model as load_hf_model

BAR_FACTOR = 1.1
GROSS_FACTOR = 3.0  # a bug that moves rows is off by ~1, bf16 noise by ~1x bf16's error
# Floor under HF bf16's own error in both bars, so that a bar is never 0 (bf16 equal to fp32
# on a short prompt); bf16 rounding alone is ~2e-3.
MIN_HF_ERROR = 1e-3


@contextmanager
def _no_tf32():
    """fp32 means fp32: TF32 moves the reference by a noticeable part of bf16's error."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@torch.inference_mode()
@_no_tf32()
def hf_hidden_states(
    model, prompts: list[list[int]], layer_ids: list[int], batch_tokens: int = 0
) -> list[torch.Tensor]:
    """[T, L, H] on the CPU for each prompt, layers in the given order. Prompts of one length
    share a pass of up to ``batch_tokens`` tokens (no padding; 0: one prompt a pass)."""
    num_layers = model.config.get_text_config().num_hidden_layers
    for name, layers in model.named_modules():
        if (
            isinstance(layers, torch.nn.ModuleList)
            and len(layers) == num_layers
            and name.endswith("layers")
            and "visual" not in name
        ):
            break
    else:
        raise ValueError(f"no decoder layer list of length {num_layers} in {type(model).__name__}")
    captured: dict[torch.nn.Module, torch.Tensor] = {}

    def hook(module, _inputs, output):
        captured[module] = output[0] if isinstance(output, tuple) else output

    modules = {i: layers[i - 1] if i else model.get_input_embeddings() for i in layer_ids}
    handles = [module.register_forward_hook(hook) for module in modules.values()]
    device = next(model.parameters()).device
    by_len: dict[int, list[int]] = {}
    for i, prompt in enumerate(prompts):
        by_len.setdefault(len(prompt), []).append(i)
    out: list[torch.Tensor | None] = [None] * len(prompts)
    try:
        for n, group in by_len.items():
            per_pass = max(1, batch_tokens // max(n, 1))
            for start in range(0, len(group), per_pass):
                batch = group[start : start + per_pass]
                captured.clear()
                ids = torch.tensor([prompts[i] for i in batch], device=device)
                model(input_ids=ids, use_cache=False)
                stacked = torch.stack([captured[modules[i]] for i in layer_ids], dim=2).cpu()
                for row, i in enumerate(batch):
                    out[i] = stacked[row]
    finally:
        for h in handles:
            h.remove()
    return out


def relative_errors(got: torch.Tensor, ref: torch.Tensor) -> list[float]:
    got, ref = got.float(), ref.float()
    return [((got[:, i] - ref[:, i]).norm() / ref[:, i].norm()).item() for i in range(ref.shape[1])]


def file_problems(data: dict, prompt: list[int], num_layers: int, hidden: int) -> list[str]:
    """What is wrong with one extracted file, beyond numbers (empty if nothing)."""
    hs, ids = hidden_states_of(data), data["token_ids"]
    problems = []
    if ids.dtype != torch.int64 or ids.tolist() != list(prompt):
        problems.append("token_ids differ from the prompt")
    if tuple(hs.shape) != (len(prompt), num_layers, hidden):
        problems.append(f"shape {tuple(hs.shape)} != {(len(prompt), num_layers, hidden)}")
    if why := check_rows(hs):  # the same check the connector makes before writing
        problems.append(why)
    return problems


def within_bar(
    ours: torch.Tensor, ref32: torch.Tensor, ref16: torch.Tensor, layer_ids: list[int] | None = None
) -> tuple[list[float], list[float], list[str]]:
    """Per layer, the errors of ours and HF bf16 against HF fp32, and a line for each layer
    over ``GROSS_FACTOR`` x HF bf16's error."""
    if not ours.shape == ref32.shape == ref16.shape:
        raise ValueError(f"shapes differ: {ours.shape}, {ref32.shape}, {ref16.shape}")
    got, hf = relative_errors(ours, ref32), relative_errors(ref16, ref32)
    names = layer_ids if layer_ids is not None else range(len(got))
    bars = [GROSS_FACTOR * max(h, MIN_HF_ERROR) for h in hf]
    failing = [
        f"layer {i}: error {g:.4f} vs HF fp32 over the per-file bound {b:.4f} "
        f"({GROSS_FACTOR} x HF bf16's)"
        for i, g, b in zip(names, got, bars, strict=True)
        if not g <= b  # NaN fails too
    ]
    return got, hf, failing


def describe_pooled(pooled: dict) -> str:
    if not pooled["files"]:
        return "pooled: no file"

    def r(xs, digits=4):
        return [round(x, digits) for x in xs]

    return (
        f"pooled over {pooled['files']} files, rel err vs HF fp32 by layer {r(pooled['ours'])} "
        f"(HF bf16 {r(pooled['hf_bf16'])}), ratio {r(pooled['ratio'], 3)} (bar {BAR_FACTOR})"
    )


def worst_by_layer(checks: list[dict]) -> dict:
    """Several :meth:`HFReference.check` results' worst errors (per layer and overall) and worst
    ratio of ours to HF bf16's; empty if none has any."""
    if not (done := [c for c in checks if c["ours"]]):
        return {}
    ours = torch.tensor([c["ours"] for c in done])
    hf = torch.tensor([c["hf_bf16"] for c in done])
    ratio = (ours / hf.clamp(min=MIN_HF_ERROR)).max().item()
    return {
        "max_rel_err_vs_fp32": round(ours.max().item(), 5),
        "max_hf_bf16_err_vs_fp32": round(hf.max().item(), 5),
        "worst_ratio": round(ratio, 3),
        "rel_err_vs_fp32_by_layer": [round(x, 5) for x in ours.amax(0).tolist()],
        "hf_bf16_err_vs_fp32_by_layer": [round(x, 5) for x in hf.amax(0).tolist()],
    }


class HFReference:
    """HF transformers' hidden states of a model folder in fp32 and bf16, cached per prompt;
    :meth:`check` judges a file, :meth:`pooled` the run since :meth:`reset`."""

    def __init__(
        self,
        model_dir: str,
        layer_ids: list[int],
        device: str = "cuda",
        max_cached: int = 256,
        batch_tokens: int = 0,
    ):
        self.model_dir, self.layer_ids, self.device = model_dir, list(layer_ids), device
        self.max_cached, self.batch_tokens = max_cached, batch_tokens
        self._models: dict[torch.dtype, torch.nn.Module] = {}
        self._cache: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}
        self.reset()

    def model(self, dtype: torch.dtype) -> torch.nn.Module:
        if dtype not in self._models:
            self._models[dtype] = load_hf_model(self.model_dir, self.device, dtype)
        return self._models[dtype]

    def __call__(self, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(HF fp32, HF bf16) hidden states [T, L, H] of one prompt, on the CPU."""
        key = tuple(int(t) for t in prompt)
        if key not in self._cache:
            self._make_room(1)
            self._cache[key] = tuple(
                hf_hidden_states(self.model(dtype), [list(key)], self.layer_ids)[0]
                for dtype in (torch.float32, torch.bfloat16)
            )
        return self._cache[key]

    def _make_room(self, n: int) -> None:
        while self._cache and len(self._cache) + n > self.max_cached:
            del self._cache[next(iter(self._cache))]

    def precompute(self, prompts: list[list[int]]) -> None:
        """Cache the references of ``prompts`` one dtype at a time (one model in memory)."""
        keys = list(dict.fromkeys(tuple(int(t) for t in p) for p in prompts))
        if len(keys) > self.max_cached:
            raise ValueError(f"{len(keys)} prompts, more than max_cached={self.max_cached}")
        keys = [k for k in keys if k not in self._cache]
        if not keys:
            return
        self._make_room(len(keys))
        prompts = [list(k) for k in keys]
        states = []  # per dtype, [T, L, H] per prompt
        for dtype in (torch.float32, torch.bfloat16):
            states.append(
                hf_hidden_states(self.model(dtype), prompts, self.layer_ids, self.batch_tokens)
            )
            del self._models[dtype]
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        self._cache.update(zip(keys, zip(*states, strict=True), strict=True))

    def check(self, data: dict, seq: list[int]) -> dict:
        """One file against its tokens: ``problems``, and per layer the errors of ``ours`` and
        ``hf_bf16`` against HF fp32 (pooled into the run when the shape is right)."""
        ref32, ref16 = self(seq)
        hs = hidden_states_of(data)
        if SCALES in data:  # an fp8 file: the yardstick is HF bf16 put through the same fp8
            from hs_connectors.fp8_utils import dequantize_fp8_tensor, quantize_tensor_to_fp8

            ref16 = dequantize_fp8_tensor(*quantize_tensor_to_fp8(ref16))
        problems = file_problems(data, seq, len(self.layer_ids), ref32.shape[-1])
        ours, hf = list[float](), list[float]()
        if hs.shape == ref32.shape:
            ours, hf, failing = within_bar(hs, ref32, ref16, self.layer_ids)
            problems += failing
            r = ref32.double()  # float64 sums of squares per layer: ours - hf32, hf16 - hf32, hf32
            diffs = (hs.double() - r, ref16.double() - r, r)
            self._sums += torch.stack([d.pow(2).sum(dim=(0, 2)) for d in diffs])
            self._files += 1
        return {"problems": problems, "ours": ours, "hf_bf16": hf}

    def reset(self) -> None:
        """Start a new run for :meth:`pooled` (the cached references are kept)."""
        self._files = 0
        self._sums = torch.zeros(3, len(self.layer_ids), dtype=torch.float64)

    def pooled(self) -> dict:
        """The run since :meth:`reset`: per layer the pooled errors of ``ours`` and ``hf_bf16``,
        their ``ratio``, ``files``, and ``problems`` (over BAR_FACTOR; no file fails)."""
        if not self._files:
            problems = ["no file pooled: nothing to judge"]
            return dict(ours=[], hf_bf16=[], ratio=[], files=0, problems=problems)
        ref = self._sums[2].clamp(min=torch.finfo(torch.float64).tiny)
        ours, hf = (self._sums[:2] / ref).sqrt().tolist()
        ratio = [g / max(h, MIN_HF_ERROR) for g, h in zip(ours, hf, strict=True)]
        problems = [
            f"layer {i}: pooled error {g:.4f} vs HF fp32 over {self._files} files is "
            f"{r:.3f} x HF bf16's {h:.4f}, over the bar {BAR_FACTOR}"
            for i, g, h, r in zip(self.layer_ids, ours, hf, ratio, strict=True)
            if not r <= BAR_FACTOR  # NaN fails too
        ]
        return dict(ours=ours, hf_bf16=hf, ratio=ratio, files=self._files, problems=problems)

    def close(self) -> None:
        self._models.clear()
        self._cache.clear()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
