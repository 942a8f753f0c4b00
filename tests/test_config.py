"""The connector's options and per-request parameters (vllm_gdn_hs.config).

Run: python -m pytest tests/test_config.py -q (CPU, no network).
"""

from __future__ import annotations

import pytest
from vllm.config import KVTransferConfig

from vllm_gdn_hs.config import extraction_config, is_ours, request_params
from vllm_gdn_hs.names import CONNECTOR_NAME


def test_is_ours_from_dict_or_object():
    assert is_ours({"kv_connector": CONNECTOR_NAME})
    assert is_ours(KVTransferConfig(kv_connector=CONNECTOR_NAME, kv_role="kv_producer"))
    assert not is_ours(KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both"))
    assert not is_ours(None) and not is_ours({})


def test_extraction_config_is_what_speculators_asks_for():
    kw = extraction_config([2, 8], "/data/hs", write_workers=8)
    assert kw["speculative_config"] == {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [2, 8]}},
    }
    assert kw["kv_transfer_config"] == {
        "kv_connector": CONNECTOR_NAME,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": "/data/hs", "write_workers": 8},
    }
    other = extraction_config([1], "/x", "ExampleHiddenStatesConnector")["kv_transfer_config"]
    assert other["kv_connector"] == "ExampleHiddenStatesConnector"


def test_request_params():
    assert request_params(None).include_output_tokens is False
    p = request_params({"include_output_tokens": True, "other_connector_key": [1]})
    assert p.include_output_tokens is True and p.hidden_states_path is None
    for bad, field in [
        ({"include_output_tokens": "false"}, "include_output_tokens"),
        ({"include_output_tokens": 0}, "include_output_tokens"),
        ({"hidden_states_path": 1}, "hidden_states_path"),
        ([], "must be an object"),
    ]:
        with pytest.raises(ValueError, match=field):
            request_params(bad)
