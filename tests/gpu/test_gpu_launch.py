"""GPU end to end: `vllm-gdn-hs launch` starts a real `vllm serve`, driven as speculators drives it.

Run on a CUDA machine with the plugin installed:
    pytest -m gpu tests/gpu/test_gpu_launch.py -v -s
Optional: SPECULATORS_SITE=/path/to/site with the speculators wheel unpacked, to
drive the server with speculators' own client (speculators.data_generation.vllm_client).
Set VLLM_GDN_HS_LAUNCH_RESULTS=/path.json to keep the figures.
Files are judged against HF fp32 on the same weights (vllm_gdn_hs.verify.reference): each file
within the per-file bound, then each test's files, pooled, within the bar.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import random
import time
import urllib.request

import launched
import pytest
from test_gpu_extract import assert_pooled, describe, pooled_figures
from tiny_models import build_tiny_hybrid

from vllm_gdn_hs.files import load_hidden_states
from vllm_gdn_hs.verify.reference import HFReference, describe_pooled, worst_by_layer

pytestmark = pytest.mark.gpu

LAYERS = [1, 3, 6]  # the launcher appends N = 8
RESULTS: dict = {}


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)


@contextlib.contextmanager
def _serve(root, model: str, *extra: str):
    """`vllm-gdn-hs launch` in the background until /health answers; stopped on exit."""
    storage, log_path = root / "hs", root / "server.log"
    with open(log_path, "w") as log:
        proc, url = launched.start(model, storage, LAYERS, log, "--skip-tokenizer-init", *extra)
        try:
            launched.wait_healthy(proc, url, log_path)
            yield {"url": url, "model": model, "storage": storage, "log": log_path}
        finally:
            launched.stop(proc, grace=60)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build_tiny_hybrid(str(tmp_path_factory.mktemp("model") / "tiny-qwen3.5-hybrid"))


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model):
    with _serve(tmp_path_factory.mktemp("launch"), tiny_model) as srv:
        text = srv["log"].read_text()
        RESULTS["printed_command"] = next(
            (line for line in text.splitlines() if "vllm.entrypoints.cli.main serve" in line), None
        )
        yield srv
    _save_results()


def _save_results() -> None:
    out = os.environ.get("VLLM_GDN_HS_LAUNCH_RESULTS")
    if out:
        with open(out, "w") as f:
            json.dump(RESULTS, f, indent=1)


@pytest.fixture(scope="module")
def hf(tiny_model):
    """HF fp32 and bf16 references of the tiny model, for the launcher's layers."""
    ref = HFReference(tiny_model, LAYERS + [8])
    yield ref
    ref.close()


def _check(hf, prompt, path, name) -> dict:
    """The file at ``path`` complete, sane and within the per-file bound; its
    HFReference.check result (its errors pooled into hf's run: see _run_figures)."""
    result = hf.check(load_hidden_states(path, timeout=30), prompt)
    assert not result["problems"], f"{name}: {result['problems']}"
    return result


def _run_figures(hf, checks: list[dict], name: str) -> dict:
    """The figures to keep of the run hf checked since its reset() (``checks``, each file
    already asserted): the worst in one file and, per layer, the errors pooled over the
    files, of ours and of HF bf16. The caller keeps them, then asserts the pooled bar."""
    worst, pooled = worst_by_layer(checks), hf.pooled()
    print(f"\n{name}: {describe_pooled(pooled)}\n  one file at worst: {describe(worst)}")
    return {"files": len(checks), **worst, "pooled_vs_fp32": pooled_figures(pooled)}


def test_completions_like_speculators(server, hf):
    """POST /v1/completions with token ids, max_tokens=1, return_token_ids=true."""
    rng = random.Random(0)
    prompts = [[rng.randrange(0, 1000) for _ in range(n)] for n in (1, 17, 100, 700)]
    hf.reset()  # this test's files are one run
    checks = []
    for prompt in prompts:
        resp = _post(
            server["url"] + "/v1/completions",
            {"model": server["model"], "prompt": prompt, "max_tokens": 1, "return_token_ids": True},
        )
        assert resp["choices"][0]["prompt_token_ids"] == prompt
        path = resp["kv_transfer_params"]["hidden_states_path"]
        assert os.path.isabs(path) and path.startswith(str(server["storage"]))
        assert os.path.exists(path) or os.path.exists(path + ".lock"), "lock protocol broken"
        checks.append(_check(hf, prompt, path, f"{len(prompt)} tokens"))
    RESULTS["completions"] = _run_figures(hf, checks, "/v1/completions")
    assert_pooled("/v1/completions", hf.pooled())


def _speculators_client():
    site = os.environ.get("SPECULATORS_SITE")
    path = site and os.path.join(site, "speculators", "data_generation", "vllm_client.py")
    if not path or not os.path.exists(path):
        pytest.skip("speculators wheel not unpacked (set SPECULATORS_SITE)")
    spec = importlib.util.spec_from_file_location("speculators_vllm_client", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # needs only openai
    return module


def test_speculators_client(server, hf):
    """speculators' own client sends the requests and takes the lock as it does."""
    import openai

    client_mod = _speculators_client()
    client = openai.Client(base_url=server["url"] + "/v1", api_key="none")
    rng = random.Random(1)
    hf.reset()  # this test's files are one run
    checks = []
    for n in (5, 64, 300):
        prompt = [rng.randrange(0, 1000) for _ in range(n)]
        handle, params = client_mod.generate_hidden_states(
            client, server["model"], {"input_ids": prompt}
        )
        if os.path.exists(handle + ".lock"):
            client_mod.wait_for_lock(handle + ".lock")  # speculators' reader step
        from safetensors.torch import load_file

        data = load_file(handle)
        assert data["token_ids"].tolist() == prompt
        checks.append(hf.check(data, prompt))
        assert not checks[-1]["problems"], f"{n} tokens: {checks[-1]['problems']}"
    RESULTS["speculators_client"] = _run_figures(hf, checks, "speculators client")
    assert_pooled("speculators client", hf.pooled())


def _saved_on_metrics(url: str) -> float:
    """``vllm:hidden_states_saved_total`` on the server's /metrics, summed over engines."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        families = text_string_to_metric_families(r.read().decode())
    return sum(
        s.value for f in families for s in f.samples if s.name == "vllm:hidden_states_saved_total"
    )


def test_metrics_count_the_files(server):
    """vLLM's /metrics shows the writer's figures: every file complete before a later engine
    step is counted by then (the figures travel with each step's output)."""
    prompt = {"model": server["model"], "max_tokens": 1, "return_token_ids": True}
    for n in (3, 40):
        resp = _post(server["url"] + "/v1/completions", {**prompt, "prompt": list(range(1, n))})
        load_hidden_states(resp["kv_transfer_params"]["hidden_states_path"], timeout=30)
    written = len(list(server["storage"].glob("*.safetensors")))  # every test's so far
    _post(server["url"] + "/v1/completions", {**prompt, "prompt": [7, 8, 9]})  # a later step
    end = time.monotonic() + 30
    while (saved := _saved_on_metrics(server["url"])) < written and time.monotonic() < end:
        time.sleep(0.5)
    RESULTS["metrics"] = {"files_before": written, "saved_total": saved}
    assert written <= saved <= written + 1, (written, saved)
