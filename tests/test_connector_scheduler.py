"""The connector's scheduler side, driven by vLLM's real Scheduler; CPU only.

Run: python -m pytest tests/test_connector_scheduler.py -q (no GPU, no
network).
Covers, with HMA on and the tiny hybrid Qwen3.5's real KV cache groups: the metadata handed
to the worker each step (new requests with their file path and prompt length, listed once
even under chunked prefill; finished requests with the token ids to write), the
kv_transfer_params.hidden_states_path returned to the client, include_output_tokens, aborts
(hidden_states_error instead of a path, token_ids None) and the per-request hidden_states_path
gate; the basic lifecycle and the KV cache groups also on the tiny dense Qwen3 and each hybrid
family of tests/tiny_models.py (Qwen3.5-MoE, Qwen3-Next, Nemotron-H). Requests and model
runner outputs are built as vLLM's own scheduler tests build them.
"""

from __future__ import annotations

import os
import re

import harness
import pytest
from tiny_models import CPU_FAMILIES
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec
from vllm.v1.request import Request, RequestStatus

from vllm_gdn_hs.cli.model_info import read_model_info
from vllm_gdn_hs.connector import HybridHiddenStatesConnector
from vllm_gdn_hs.connector.metadata import (
    FinishedRequest,
    HybridHiddenStatesConnectorMetadata,
    NewRequest,
)

MAX_BATCHED = 256


def make_scheduler(model: str, storage: str, **extra):
    cfg = harness.engine_config(
        model,
        connector=harness.OURS,
        storage=storage,
        max_num_batched_tokens=MAX_BATCHED,
        max_num_seqs=16,
    )
    cfg.kv_transfer_config.kv_connector_extra_config.update(extra)
    sched = harness.scheduler(cfg)
    assert isinstance(sched.connector, HybridHiddenStatesConnector)
    # Spy (calls through) on what the scheduler gets back for each finished request.
    conn, orig = sched.connector, sched.connector.request_finished_all_groups
    conn.finished_calls = []

    def spy(request, block_ids):
        result = orig(request, block_ids)
        conn.finished_calls.append((request.request_id, request.status, block_ids, result))
        return result

    conn.request_finished_all_groups = spy
    return sched


@pytest.fixture
def sched(hybrid_model, tmp_path):
    return make_scheduler(hybrid_model, str(tmp_path))


def make_request(req_id: str, prompt: list[int], max_tokens: int = 1, params=None) -> Request:
    extra = {"kv_transfer_params": params} if params is not None else None
    sp = SamplingParams(max_tokens=max_tokens, extra_args=extra)
    return Request(req_id, prompt, sp, None)


def prompt(n: int, start: int = 1) -> list[int]:
    return [(start + i) % 1000 for i in range(n)]


def meta_of(so: SchedulerOutput) -> HybridHiddenStatesConnectorMetadata:
    meta = so.kv_connector_metadata
    assert isinstance(meta, HybridHiddenStatesConnectorMetadata)
    return meta


def step(sched, sampled: dict[str, list[int]] | None = None):
    """One engine step: schedule, then feed back a ModelRunnerOutput.

    Requests still in a prefill chunk sample nothing; the others sample ``sampled[id]``
    (default one token, 500 + step)."""
    so = sched.schedule()
    ids = list(so.num_scheduled_tokens)
    tokens = []
    for rid in ids:
        req = sched.requests[rid]
        if req.is_prefill_chunk:
            tokens.append([])
        else:
            tokens.append((sampled or {}).get(rid, [500 + len(req.output_token_ids)]))
    out = harness.model_runner_output(ids, tokens)
    outputs = sched.update_from_output(so, out)
    finished = {o.request_id: o for eco in outputs.values() for o in eco.outputs if o.finish_reason}
    return so, finished


@pytest.mark.smoke
def test_hma_on_with_hybrid_groups(sched):
    assert sched.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False
    kinds = {type(g.kv_cache_spec) for g in sched.kv_cache_config.kv_cache_groups}
    assert kinds == {MambaSpec, FullAttentionSpec}
    assert len(sched.kv_cache_config.kv_cache_groups) == 4


@pytest.mark.parametrize("family", CPU_FAMILIES)
def test_each_familys_kv_cache_groups(family_model, tmp_path, family):
    """HMA on, and every GDN or Mamba2 layer of the model in a state group (MambaSpec), every
    attention layer in an attention group, as the config's layer types say."""
    model = family_model(family)
    sched = make_scheduler(model, str(tmp_path))
    assert sched.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False
    layers: dict[type, set[int]] = {}
    for group in sched.kv_cache_config.kv_cache_groups:
        ids = {int(re.search(r"layers\.(\d+)\.", name)[1]) for name in group.layer_names}
        layers.setdefault(type(group.kv_cache_spec), set()).update(ids)
    info = read_model_info(model)
    assert layers == {
        MambaSpec: set(info.linear_layers),
        FullAttentionSpec: set(info.full_attention_layers),
    }


@pytest.mark.parametrize(
    "model",
    [pytest.param("hybrid_model", marks=pytest.mark.smoke), "dense_model"]
    + [f for f in CPU_FAMILIES if f != "qwen3_5"],  # the hybrid is Qwen3.5's
)
def test_request_lifecycle(model, request, family_model, tmp_path):
    path = request.getfixturevalue(model) if model.endswith("_model") else family_model(model)
    sched = make_scheduler(path, str(tmp_path))
    prompts = {"r0": prompt(17), "r1": prompt(1, 40), "r2": prompt(100, 7)}
    for rid, p in prompts.items():
        sched.add_request(make_request(rid, p))

    so, finished = step(sched)
    assert meta_of(so).new_requests == [
        NewRequest(rid, os.path.join(tmp_path, f"{rid}.safetensors"), len(p), len(p))
        for rid, p in prompts.items()
    ]
    assert meta_of(so).finished_requests == []
    # max_tokens=1: all finish in the first step, each with its file path.
    assert set(finished) == set(prompts)
    for rid, out in finished.items():
        assert out.kv_transfer_params == {
            "hidden_states_path": os.path.join(tmp_path, f"{rid}.safetensors")
        }
        assert out.new_token_ids == [500]
    # The scheduler handed the connector one block list per KV cache group.
    for rid, status, block_ids, result in sched.connector.finished_calls:
        assert status == RequestStatus.FINISHED_LENGTH_CAPPED
        assert len(block_ids) == len(sched.kv_cache_config.kv_cache_groups)
        assert result == (
            False,
            {"hidden_states_path": finished[rid].kv_transfer_params["hidden_states_path"]},
        )

    # The next step tells the worker which token ids to write: the prompt.
    so, _ = step(sched)
    assert meta_of(so).new_requests == []
    assert meta_of(so).finished_requests == [FinishedRequest(r, p) for r, p in prompts.items()]
    # ...and only once.
    so, _ = step(sched)
    assert meta_of(so) == HybridHiddenStatesConnectorMetadata()
    assert sched.requests == {}


def test_include_output_tokens(sched):
    p = prompt(9)
    sched.add_request(make_request("gen", p, max_tokens=4, params={"include_output_tokens": True}))
    sched.add_request(make_request("plain", prompt(5, 50), max_tokens=4))
    done = {}
    for _ in range(6):
        so, finished = step(sched)
        done.update(finished)
        fin = {f.req_id: f.token_ids for f in meta_of(so).finished_requests}
        if "gen" in fin:
            break
    outputs = sched.connector.finished_calls
    assert {c[0] for c in outputs} == {"gen", "plain"}
    assert done["gen"].kv_transfer_params["hidden_states_path"].endswith("/gen.safetensors")
    # Prompt + every output token but the last (it was sampled, never run through the model).
    assert fin["gen"] == p + [500, 501, 502]
    assert fin["plain"] == prompt(5, 50)


def test_chunked_prefill_listed_new_once(sched):
    long = prompt(2 * MAX_BATCHED + 88)
    sched.add_request(make_request("long", long))
    sched.add_request(make_request("short", prompt(3, 9)))
    news, fins, scheduled = [], [], []
    for _ in range(5):
        so, _ = step(sched)
        news += [n.req_id for n in meta_of(so).new_requests]
        fins += meta_of(so).finished_requests
        scheduled.append(so.num_scheduled_tokens.get("long", 0))
    assert news == ["long", "short"]
    # Both end in the third step, in batch order.
    assert fins == [FinishedRequest("long", long), FinishedRequest("short", prompt(3, 9))]
    # Three chunks, none over the token budget.
    assert scheduled[:4] == [MAX_BATCHED, MAX_BATCHED, 88, 0]
    assert sum(scheduled) == len(long)


def test_new_request_lists_prompt_length(sched, tmp_path):
    sched.add_request(make_request("a", prompt(42)))
    so = sched.schedule()
    (new,) = meta_of(so).new_requests
    assert new == NewRequest("a", os.path.join(tmp_path, "a.safetensors"), 42, 42)


def test_new_request_reserves_rows_for_output_tokens(sched, tmp_path):
    """With include_output_tokens the worker reserves the outputs' rows up front, so
    decode never regrows a buffer (a copy of every row so far, per request)."""
    sched.add_request(make_request("a", prompt(42), 9, {"include_output_tokens": True}))
    sched.add_request(make_request("b", prompt(5), 9))
    so = sched.schedule()
    assert [(n.req_id, n.num_rows) for n in meta_of(so).new_requests] == [("a", 51), ("b", 5)]


def test_abort_after_scheduling(sched):
    sched.add_request(make_request("keep", prompt(10)))
    sched.add_request(make_request("gone", prompt(2 * MAX_BATCHED, 3)))
    so = sched.schedule()  # "gone" is mid-prefill
    assert [n.req_id for n in meta_of(so).new_requests] == ["keep", "gone"]
    sched.finish_requests("gone", RequestStatus.FINISHED_ABORTED)
    ((rid, status, _, (delay, params)),) = sched.connector.finished_calls
    assert (rid, status, delay) == ("gone", RequestStatus.FINISHED_ABORTED, False)
    assert "aborted" in params["hidden_states_error"] and "hidden_states_path" not in params
    so = sched.schedule()
    assert meta_of(so).finished_requests == [FinishedRequest("gone", None)]
    assert "gone" not in sched.connector._scheduler._placed


def test_abort_while_waiting_tells_worker_nothing(sched):
    sched.add_request(make_request("never", prompt(10)))
    sched.finish_requests("never", RequestStatus.FINISHED_ABORTED)
    (call,) = sched.connector.finished_calls
    assert call[0] == "never" and call[3][0] is False and "hidden_states_error" in call[3][1]
    so = sched.schedule()
    assert meta_of(so) == HybridHiddenStatesConnectorMetadata()


def test_custom_path_ignored_by_default(sched, tmp_path, caplog):
    custom = str(tmp_path / "elsewhere" / "x.safetensors")
    sched.add_request(make_request("c", prompt(5), params={"hidden_states_path": custom}))
    so, finished = step(sched)
    default = os.path.join(tmp_path, "c.safetensors")
    assert meta_of(so).new_requests[0].path == default
    assert finished["c"].kv_transfer_params == {"hidden_states_path": default}
    assert any("allow_custom_save_path" in r.getMessage() for r in caplog.records)


def test_custom_path_allowed(hybrid_model, tmp_path):
    sched = make_scheduler(hybrid_model, str(tmp_path), allow_custom_save_path=True)
    assert sched.connector.cfg.allow_custom_save_path is True
    custom = str(tmp_path / "elsewhere" / "x.safetensors")
    sched.add_request(make_request("c", prompt(5), params={"hidden_states_path": custom}))
    sched.add_request(make_request("d", prompt(5)))
    so, finished = step(sched)
    assert [n.path for n in meta_of(so).new_requests] == [
        custom,
        os.path.join(tmp_path, "d.safetensors"),
    ]
    assert finished["c"].kv_transfer_params == {"hidden_states_path": custom}


@pytest.mark.parametrize(
    "custom", ["/etc/passwd", "../outside.safetensors", "sub/../../x.safetensors", "x.txt", ""]
)
def test_custom_path_outside_its_root_refused(hybrid_model, tmp_path, custom):
    """allow_custom_save_path confines clients to custom_save_root (default: the folder)."""
    root = tmp_path / "hs"
    sched = make_scheduler(hybrid_model, str(root), allow_custom_save_path=True)
    sched.add_request(make_request("c", prompt(5), params={"hidden_states_path": custom}))
    sched.add_request(make_request("d", prompt(5)))
    so, finished = step(sched)
    assert [n.req_id for n in meta_of(so).new_requests] == ["d"]
    assert "hidden_states_path" not in finished["c"].kv_transfer_params
    assert finished["c"].kv_transfer_params["hidden_states_error"]
    assert finished["d"].kv_transfer_params == {"hidden_states_path": str(root / "d.safetensors")}
    assert sorted(os.listdir(tmp_path)) == ["hs"]
