"""The runner-to-connector hook (vllm_gdn_hs.hook): who takes the runner's rows.

Run: python -m pytest tests/test_hook.py -q (CPU, no network).
vLLM's own connector classes; instances are made without their constructors (only their
type is looked at).
"""

from __future__ import annotations

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

from vllm_gdn_hs.connector import HybridHiddenStatesConnector
from vllm_gdn_hs.hook import TakesHiddenStates, hidden_states_connector


def _bare(cls, **attrs):
    obj = object.__new__(cls)
    obj.__dict__.update(attrs)
    return obj


def test_ours_takes_hidden_states_and_vllms_does_not():
    assert issubclass(HybridHiddenStatesConnector, TakesHiddenStates)
    assert not issubclass(ExampleHiddenStatesConnector, TakesHiddenStates)
    ours = _bare(HybridHiddenStatesConnector)
    assert hidden_states_connector(ours) is ours


def test_found_inside_multi_connector():
    ours = _bare(HybridHiddenStatesConnector)
    multi = _bare(MultiConnector, _connectors=[_bare(ExampleHiddenStatesConnector), ours])
    assert hidden_states_connector(multi) is ours


@pytest.mark.parametrize("cls", [ExampleHiddenStatesConnector, MultiConnector])
def test_any_other_connector_is_refused_naming_the_fix(cls):
    other = _bare(cls, _connectors=[_bare(ExampleHiddenStatesConnector)])
    with pytest.raises(RuntimeError, match="use kv_connector HybridHiddenStatesConnector"):
        hidden_states_connector(other)
