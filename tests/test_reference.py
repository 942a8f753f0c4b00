"""Run: python -m pytest tests/test_reference.py -q (CPU, no network)

The GPU suite's bar (vllm_gdn_hs.verify.reference), on HF transformers run on the CPU in fp32
and bf16 on the same tiny random-weight models: per run and layer, ours' error against HF
fp32 pooled over the run's files may be at most BAR_FACTOR x HF bf16's, and per file at
most GROSS_FACTOR x. It must pass HF's own runs and fail the bugs the suite is there to
catch: one noisy layer (pooled), rows shifted by a token (per file), broken files.
"""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import build_deep_hybrid, build_tiny_dense, build_tiny_hybrid

from vllm_gdn_hs.verify.reference import (
    BAR_FACTOR,
    GROSS_FACTOR,
    HFReference,
    describe_pooled,
    file_problems,
    hf_hidden_states,
    within_bar,
    worst_by_layer,
)

BUILD = {"hybrid": build_tiny_hybrid, "dense": build_tiny_dense, "deep": build_deep_hybrid}
LAYERS = {"hybrid": [1, 6, 3, 8, 4], "dense": [8, 1, 4, 2], "deep": [1, 3, 6, 9, 11, 12]}
_rng = random.Random(0)
PROMPT = [_rng.randrange(0, 1000) for _ in range(12)]
RUN = [[_rng.randrange(0, 1000) for _ in range(n)] for n in (1, 2, 5, 12, 30)]  # one run


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    """refs(kind) -> HFReference on the CPU for that tiny model, built on first use."""
    root, built = tmp_path_factory.mktemp("models"), {}

    def get(kind: str) -> HFReference:
        if kind not in built:
            built[kind] = HFReference(BUILD[kind](str(root / kind)), LAYERS[kind], device="cpu")
        return built[kind]

    yield get
    for ref in built.values():
        ref.close()


def _file(hidden_states: torch.Tensor, token_ids=PROMPT) -> dict:
    """What load_hidden_states returns for a file."""
    return {
        "hidden_states": hidden_states.to(torch.bfloat16),
        "token_ids": torch.tensor(token_ids, dtype=torch.int64),
    }


@pytest.mark.parametrize("kind", ["hybrid", "dense", "deep"])
def test_bar_accepts_hf_bf16_and_fp32(refs, kind):
    ref = refs(kind)
    ref32, ref16 = ref(PROMPT)
    assert ref32.dtype == torch.float32 and ref16.dtype == torch.bfloat16
    assert ref32.shape == ref16.shape == (len(PROMPT), len(LAYERS[kind]), ref32.shape[-1])
    # The fp32 model holds the bf16 weights, upcast.
    p32, p16 = (dict(ref.model(d).named_parameters()) for d in (torch.float32, torch.bfloat16))
    assert all(torch.equal(p32[n], p.float()) for n, p in p16.items())

    ours, hf, failing = within_bar(ref16, ref32, ref16, LAYERS[kind])
    assert ours == hf and not failing  # ratio 1.0 <= BAR_FACTOR
    assert all(0 < e < 0.05 for e in hf), hf  # bf16 differs from fp32, a little
    ours, _, failing = within_bar(ref32, ref32, ref16)
    assert ours == [0.0] * len(hf) and not failing

    result = ref.check(_file(ref16), PROMPT)
    assert result == {"problems": [], "ours": hf, "hf_bf16": hf}
    assert worst_by_layer([result])["worst_ratio"] == 1.0


def test_bar_rejects_one_noisy_layer(refs):
    ref, layers = refs("hybrid"), LAYERS["hybrid"]
    ref32, ref16 = ref(PROMPT)
    hf = within_bar(ref16, ref32, ref16)[1]
    j = 2
    noise = torch.randn(ref32[:, j].shape, generator=torch.Generator().manual_seed(0))

    def with_noise(times_bf16_error: float) -> torch.Tensor:
        ours = ref16.float().clone()
        ours[:, j] += noise * (times_bf16_error * hf[j] * ref32[:, j].norm() / noise.norm())
        return ours

    assert not within_bar(with_noise(0.2), ref32, ref16)[2]  # within bf16's own noise
    ours, _, failing = within_bar(with_noise(4.0), ref32, ref16, layers)
    assert ours[j] > 3 * hf[j]
    assert len(failing) == 1 and failing[0].startswith(f"layer {layers[j]}:"), failing
    problems = ref.check(_file(with_noise(4.0)), PROMPT)["problems"]
    assert len(problems) == 1 and problems[0].startswith(f"layer {layers[j]}:"), problems
    assert worst_by_layer([ref.check(_file(with_noise(4.0)), PROMPT)])["worst_ratio"] > BAR_FACTOR


@pytest.mark.parametrize("kind", ["hybrid", "dense"])
def test_gross_bound_rejects_rows_shifted_by_one_token(refs, kind):
    ref, layers = refs(kind), LAYERS[kind]
    ref32, ref16 = ref(PROMPT)
    shifted = torch.roll(ref16, 1, dims=0)  # row t holds token t - 1's hidden states
    ours, hf, failing = within_bar(shifted, ref32, ref16, layers)
    assert len(failing) == len(layers), (ours, hf)
    assert min(ours) > 0.2 and min(o / h for o, h in zip(ours, hf, strict=True)) > 2 * GROSS_FACTOR
    # One such file fails on its own, whatever the rest of its run.
    ref.reset()
    problems = ref.check(_file(shifted), PROMPT)["problems"]
    assert [p.split(":")[0] for p in problems] == [f"layer {i}" for i in layers], problems
    assert all("per-file bound" in p for p in problems), problems


def _with_noise(ref32, ref16, layer: int, times_bf16_error: float, seed: int) -> torch.Tensor:
    """HF bf16 plus noise in one layer, of ``times_bf16_error`` x HF bf16's error there."""
    ours = ref16.float().clone()
    bf16_error = (ref16.float() - ref32)[:, layer].norm()
    noise = torch.randn(ours[:, layer].shape, generator=torch.Generator().manual_seed(seed))
    ours[:, layer] += noise * (times_bf16_error * bf16_error / noise.norm())
    return ours


@pytest.mark.parametrize("kind", ["hybrid", "dense"])
def test_pooled_bar_accepts_a_run_of_hf_bf16(refs, kind):
    ref = refs(kind)
    ref.reset()
    checks = [ref.check(_file(ref(p)[1], p), p) for p in RUN]
    assert all(not c["problems"] for c in checks), checks
    pooled = ref.pooled()
    assert pooled["files"] == len(RUN) and pooled["problems"] == [], pooled
    assert pooled["ours"] == pooled["hf_bf16"]
    assert all(r == pytest.approx(1.0) for r in pooled["ratio"]), pooled  # <= BAR_FACTOR
    # Pooled: the per-file errors weighted by each file's ||fp32||^2, per layer.
    norms = torch.stack([ref(p)[0].double().pow(2).sum(dim=(0, 2)) for p in RUN])
    errors = torch.tensor([c["ours"] for c in checks], dtype=torch.float64)
    want = ((errors**2 * norms).sum(0) / norms.sum(0)).sqrt()
    assert torch.allclose(torch.tensor(pooled["ours"], dtype=torch.float64), want, rtol=1e-5)
    assert "pooled over 5 files" in describe_pooled(pooled)

    ref.reset()  # a new run: nothing pooled yet, and nothing to pass
    assert ref.pooled()["files"] == 0 and ref.pooled()["problems"]
    ref.check(_file(ref(PROMPT)[1]), PROMPT)
    assert ref.pooled()["files"] == 1 and not ref.pooled()["problems"]


def test_pooled_bar_rejects_one_noisy_layer_in_every_file(refs):
    ref, layers, j = refs("hybrid"), LAYERS["hybrid"], 2

    def run(times_bf16_error: float) -> tuple[list[dict], dict]:
        ref.reset()
        checks = []
        for seed, p in enumerate(RUN):
            ours = _with_noise(*ref(p), j, times_bf16_error, seed)
            checks.append(ref.check(_file(ours, p), p))
        return checks, ref.pooled()

    checks, pooled = run(0.2)  # within bf16's own noise
    assert not pooled["problems"] and pooled["ratio"][j] < BAR_FACTOR, pooled
    checks, pooled = run(4.0)
    assert pooled["ratio"][j] > 3.5, pooled
    assert len(pooled["problems"]) == 1, pooled
    assert pooled["problems"][0].startswith(f"layer {layers[j]}: pooled error"), pooled
    # Noise of 2 x bf16's error passes every file's gross bound; the pooled bar catches it.
    checks, pooled = run(2.0)
    assert all(not c["problems"] for c in checks), checks
    assert [p.split(":")[0] for p in pooled["problems"]] == [f"layer {layers[j]}"], pooled


def test_file_problems_still_caught(refs):
    ref = refs("hybrid")
    layers, ref16 = LAYERS["hybrid"], ref(PROMPT)[1]
    num_layers, hidden = len(layers), ref16.shape[-1]
    assert file_problems(_file(ref16), PROMPT, num_layers, hidden) == []

    zero = ref16.clone()
    zero[3, 1] = 0
    nan = ref16.clone()
    nan[5, 2, 7] = float("nan")
    cases = {
        "all-zero rows at token positions [3]": _file(zero),
        "non-finite values at token positions [5]": _file(nan),
        "token_ids differ from the prompt": _file(ref16, PROMPT[1:] + PROMPT[:1]),
        f"shape {(len(PROMPT), num_layers - 1, hidden)}": _file(ref16[:, 1:]),
    }
    for want, data in cases.items():
        problems = file_problems(data, PROMPT, num_layers, hidden)
        assert any(p.startswith(want) for p in problems), (want, problems)
        result = ref.check(data, PROMPT)
        assert any(p.startswith(want) for p in result["problems"]), (want, result)
        if want.startswith("shape"):
            assert result["ours"] == result["hf_bf16"] == []  # no numbers for a wrong shape


@pytest.mark.parametrize("kind", ["hybrid", "dense"])
def test_batched_references_match_one_prompt_a_pass(refs, kind):
    """Prompts of one length go through HF together, at most batch_tokens tokens a pass:
    each gets the reference it gets alone (fp32 to rounding; bf16 far closer than its own
    error), in the prompts' order."""
    alone = refs(kind)
    rng = random.Random(3)
    prompts = [[rng.randrange(0, 1000) for _ in range(n)] for n in (7, 30, 7, 30, 7, 1, 7)]
    for dtype in (torch.float32, torch.bfloat16):
        model, shapes = alone.model(dtype), []

        def record(_module, _args, kwargs, shapes=shapes):
            shapes.append(tuple(kwargs["input_ids"].shape))

        hook = model.register_forward_pre_hook(record, with_kwargs=True)
        try:
            together = hf_hidden_states(model, prompts, LAYERS[kind], batch_tokens=21)
        finally:
            hook.remove()
        assert sorted(shapes) == [(1, 1), (1, 7), (1, 30), (1, 30), (3, 7)]
        for prompt, got in zip(prompts, together, strict=True):
            (one,) = hf_hidden_states(model, [prompt], LAYERS[kind])
            ref32 = alone(prompt)[0]
            scale = (alone(prompt)[1].float() - ref32).norm() if dtype == torch.bfloat16 else 0
            assert got.shape == one.shape
            assert (got.float() - one.float()).norm() <= 1e-5 * one.float().norm() + 0.1 * scale
    batched = HFReference(alone.model_dir, LAYERS[kind], device="cpu", batch_tokens=21)
    batched.precompute(prompts)
    for prompt in prompts:
        torch.testing.assert_close(batched(prompt)[0], alone(prompt)[0], rtol=1e-4, atol=1e-5)
    batched.close()


def test_cache_drops_the_oldest_references_first(refs):
    ref = HFReference(refs("dense").model_dir, LAYERS["dense"], device="cpu", max_cached=2)
    a, b, c, d = ([i + 1] * 3 for i in range(4))
    ref.precompute([a, b])
    ref(c)  # one more: a goes
    assert list(ref._cache) == [tuple(b), tuple(c)]
    ref.precompute([c, d])  # c is cached; d needs room: b goes
    assert list(ref._cache) == [tuple(c), tuple(d)]
    with pytest.raises(ValueError, match="more than max_cached=2"):
        ref.precompute([a, b, c])
    ref.close()
