"""vllm_gdn_hs.patch.patch_spec_decode_extract_hidden_states: the proposer streams; CPU only.

Run: python -m pytest tests/test_patch_spec_decode_extract_hidden_states.py -q
(no GPU, no network).
Covers: layer_order keeps the configured layer order; with HybridHiddenStatesConnector the
real (patched) ExtractHiddenStatesProposer.load_model builds no draft model, so the drafter's
cache-only layer gets no KV cache spec, while other connectors still get vLLM's draft model;
propose() + prepare_next_token_ids_padded() hand the real worker-side connector each
request's rows, in the configured layer order, and the files hold exactly those rows.
Edges replaced: weights (meta device), the runner's input batch, torch.distributed (gloo).
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from unittest import mock

import harness
import numpy as np
import pytest
import torch
import vllm.distributed.kv_transfer as kv_transfer
from safetensors.torch import load_file
from vllm.config import set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.spec_decode import extract_hidden_states as ehs

from vllm_gdn_hs.connector import (
    FinishedRequest,
    HybridHiddenStatesConnector,
    HybridHiddenStatesConnectorMetadata,
    NewRequest,
)
from vllm_gdn_hs.patch import patch_spec_decode_extract_hidden_states as patch_mod


@pytest.mark.parametrize(
    "ids, order",
    [
        ([16, 1, 64], [1, 0, 2]),
        ([1, 16, 64], [0, 1, 2]),
        ([64, 16, 1], [2, 1, 0]),
        ([2, 4, 5, 8], [0, 1, 2, 3]),
        ([8, 2, 5, 4], [3, 0, 2, 1]),
    ],
)
def test_layer_order(ids, order):
    got = patch_mod.layer_order(ids)
    assert got == order
    # Reordering the ascending list by it gives back the configured order.
    assert [sorted(ids)[i] for i in got] == ids


def test_patch_replaces_proposer_methods():
    for name, fn in patch_mod.PATCH.attrs.items():
        assert getattr(ehs.ExtractHiddenStatesProposer, name) is fn


def _target_layer_names(model: str) -> set[str]:
    cfg = harness.engine_config(model, connector=None, layer_ids=None)
    return set(harness.kv_cache_specs(cfg))


def test_our_connector_gives_the_drafter_no_kv_cache_spec(hybrid_model):
    target = _target_layer_names(hybrid_model)
    specs = harness.kv_cache_specs(harness.engine_config(hybrid_model, connector=harness.OURS))
    assert set(specs) == target


def test_stock_connector_still_gets_the_draft_model(hybrid_model):
    target = _target_layer_names(hybrid_model)
    cfg = harness.engine_config(hybrid_model, connector=harness.STOCK)
    specs = harness.kv_cache_specs(cfg)
    extra = set(specs) - target
    assert len(extra) == 1, extra  # vLLM's cache-only layer, unchanged by the patch
    assert set(specs) > target


def _proposer(cfg) -> ehs.ExtractHiddenStatesProposer:
    with set_current_vllm_config(cfg):
        return ehs.ExtractHiddenStatesProposer(cfg, torch.device("cpu"))


def test_patched_load_model_builds_no_draft_model(hybrid_model):
    cfg = harness.engine_config(hybrid_model, connector=harness.OURS, layer_ids=(8, 1, 4))
    p = _proposer(cfg)
    assert p.streams_hidden_states is True
    assert p.aux_layer_order == [2, 0, 1]
    get_model = mock.Mock(side_effect=AssertionError("draft model built"))
    with set_current_vllm_config(cfg), mock.patch.object(ehs, "get_model", get_model):
        p.load_model(None)
    get_model.assert_not_called()
    assert p.model is None and p.attn_layer_names == []
    # vLLM's check would assert a drafter layer; with no drafter there is nothing to check.
    p.validate_same_kv_cache_group(None)
    p.dummy_run(4)


def test_propose_needs_the_connector(hybrid_model):
    cfg = harness.engine_config(hybrid_model, connector=harness.OURS)
    p = _proposer(cfg)
    p.load_model(None)
    hidden = cfg.model_config.get_hidden_size()
    aux = [torch.zeros(2, hidden, dtype=torch.bfloat16)] * 3
    sampled = torch.zeros((1, 1), dtype=torch.int64)
    with mock.patch.object(kv_transfer, "has_kv_transfer_group", lambda: False):
        with pytest.raises(RuntimeError, match="no KV connector"):
            p.propose(sampled, aux, _common_attn_metadata([2], [0]))


def test_other_connectors_run_vllms_code(hybrid_model):
    cfg = harness.engine_config(hybrid_model, connector=harness.STOCK)
    p = _proposer(cfg)
    assert p.streams_hidden_states is False
    # vLLM's own checks still run: no drafter layer loaded yet -> its assert fires.
    with pytest.raises(AssertionError):
        p.validate_same_kv_cache_group(None)
    with pytest.raises(AssertionError, match="Model must be initialized"):
        p.dummy_run(4)


def _common_attn_metadata(query_lens: list[int], num_computed: list[int]):
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(query_lens)]), dtype=torch.int32)
    seq_lens = torch.tensor(
        [c + q for c, q in zip(num_computed, query_lens, strict=True)], dtype=torch.int32
    )
    n = int(qsl[-1])
    return CommonAttentionMetadata(
        query_start_loc=qsl.clone(),
        query_start_loc_cpu=qsl,
        seq_lens=seq_lens,
        num_reqs=len(query_lens),
        num_actual_tokens=n,
        max_query_len=max(query_lens),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=torch.zeros((len(query_lens), 1), dtype=torch.int32),
        slot_mapping=torch.zeros(n, dtype=torch.int64),
    )


class _Req:
    """The runner's per-request state, as far as prepare_next_token_ids_padded reads it."""

    def __init__(self, token_ids):
        self.token_ids = token_ids

    def get_token_id(self, i):
        return self.token_ids[i]


def _step(p, req_ids, query_lens, num_computed, aux, prompts):
    cm = _common_attn_metadata(query_lens, num_computed)
    sampled = torch.tensor([[7]] * len(req_ids), dtype=torch.int64)
    drafts = p.propose(sampled, aux, cm)
    assert drafts.tolist() == sampled.tolist()
    batch = SimpleNamespace(
        req_ids=list(req_ids),
        num_reqs=len(req_ids),
        num_tokens_no_spec=np.array([c + q for c, q in zip(num_computed, query_lens, strict=True)]),
        vocab_size=1024,
    )
    requests = {r: _Req(prompts[r]) for r in req_ids}
    mask = torch.zeros(len(req_ids), dtype=torch.bool)
    next_ids, valid = p.prepare_next_token_ids_padded(sampled, requests, batch, mask)
    assert next_ids.tolist() == [7] * len(req_ids) and valid.tolist() == [1] * len(req_ids)
    assert p._staged is None


def test_propose_streams_rows_to_the_connector(hybrid_model, tmp_path):
    layer_ids = (8, 1, 4)  # configured order; vLLM hands aux states in ascending order
    cfg = harness.engine_config(
        hybrid_model, connector=harness.OURS, layer_ids=layer_ids, storage=str(tmp_path)
    )
    harness._init_dist(cfg)
    hidden = cfg.model_config.get_hidden_size()
    prompts = {"a": [1, 2, 3], "b": [4, 5, 6, 7, 8, 9]}
    path = {r: os.path.join(tmp_path, f"{r}.safetensors") for r in prompts}
    # ascending[k][t] = the residual stream after layer sorted(layer_ids)[k] at token t.
    g = torch.Generator().manual_seed(0)
    full = {r: torch.randn(len(t), 3, hidden, generator=g).bfloat16() for r, t in prompts.items()}

    with set_current_vllm_config(cfg):
        conn = HybridHiddenStatesConnector(cfg, KVConnectorRole.WORKER)
        p = ehs.ExtractHiddenStatesProposer(cfg, torch.device("cpu"))
        p.load_model(None)

        def step(meta, sched):  # sched: (req_id, start, count) in batch order
            conn.bind_connector_metadata(meta)
            conn.start_load_kv(None)
            aux = [torch.cat([full[r][s : s + n, k] for r, s, n in sched]) for k in range(3)]
            _step(
                p,
                [r for r, _, _ in sched],
                [n for _, _, n in sched],
                [s for _, s, _ in sched],
                aux,
                prompts,
            )
            conn.clear_connector_metadata()

        new = [NewRequest(r, path[r], len(t)) for r, t in prompts.items()]
        fin = [FinishedRequest(r, t) for r, t in prompts.items()]
        # The worker's KV transfer group (vLLM's global) is our connector.
        with (
            mock.patch.object(kv_transfer, "has_kv_transfer_group", lambda: True),
            mock.patch.object(kv_transfer, "get_kv_transfer_group", lambda: conn),
        ):
            step(HybridHiddenStatesConnectorMetadata(new_requests=new), [("a", 0, 3), ("b", 0, 4)])
            step(HybridHiddenStatesConnectorMetadata(), [("b", 4, 2)])
            conn.bind_connector_metadata(HybridHiddenStatesConnectorMetadata(finished_requests=fin))
            conn.start_load_kv(None)
        conn.shutdown()

    for r, tokens in prompts.items():
        got = load_file(path[r])
        # File layers in the configured order [8, 1, 4] = ascending indices [2, 0, 1].
        assert torch.equal(got["hidden_states"], full[r][:, [2, 0, 1]])
        assert got["hidden_states"].dtype == torch.bfloat16
        assert got["token_ids"].tolist() == tokens
