"""The runner-to-connector hook (vllm_gdn_hs.hook): who takes the runner's rows.

Run: python -m pytest tests/test_hook.py -q (CPU, no network).
vLLM's own connector classes, KVTransferConfig and connector factory; instances are made
without their constructors (only their type is looked at). The connector class is checked at
startup (the runner patch's set-up), and ranks that do not write stack nothing.
"""

from __future__ import annotations

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

from vllm_gdn_hs.connector import HybridHiddenStatesConnector
from vllm_gdn_hs.hook import (
    TakesHiddenStates,
    hidden_states_connector,
    hidden_states_connector_class,
)
from vllm_gdn_hs.names import CONNECTOR_NAME


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


def _config(kv_connector: str, **extra):
    """What the hook reads of a VllmConfig: vLLM's own KVTransferConfig."""
    from types import SimpleNamespace

    from vllm.config import KVTransferConfig

    kv = KVTransferConfig(
        kv_connector=kv_connector, kv_role="kv_both", kv_connector_extra_config=extra
    )
    return SimpleNamespace(kv_transfer_config=kv)


def test_the_connector_class_is_checked_at_startup_through_vllms_factory():
    """Before any connector exists (the runner's __init__ and profile_run), the class vLLM's
    factory will make is found and checked: ours, alone or inside MultiConnector."""
    import vllm_gdn_hs.plugin

    vllm_gdn_hs.plugin.register()  # what vLLM's plugin loader does in every process
    assert hidden_states_connector_class(_config(CONNECTOR_NAME)) is HybridHiddenStatesConnector
    inside = [{"kv_connector": "ExampleConnector"}, {"kv_connector": CONNECTOR_NAME}]
    multi = _config("MultiConnector", connectors=inside)
    assert hidden_states_connector_class(multi) is HybridHiddenStatesConnector
    for name in ("ExampleHiddenStatesConnector", "NoSuchConnector"):
        with pytest.raises(RuntimeError, match="use kv_connector HybridHiddenStatesConnector"):
            hidden_states_connector_class(_config(name))


def test_the_runner_refuses_a_connector_that_takes_no_rows_when_it_is_made(monkeypatch):
    """The runner patch's set-up (run in the runner's __init__) checks the hook: a class
    registered under our name that does not take the rows fails at startup, naming the fix."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    import vllm_gdn_hs.plugin
    from vllm_gdn_hs.patch import extraction as patch_mod

    vllm_gdn_hs.plugin.register()
    cfg = _config(CONNECTOR_NAME, layer_ids=[1, 2])
    runner = type("Runner", (), {})()
    patch_mod.set_up_extraction(runner, cfg)
    ours = patch_mod.extraction(runner)
    assert ours is not None and ours.connector_class is HybridHiddenStatesConnector
    registry = dict(KVConnectorFactory._registry)
    registry[CONNECTOR_NAME] = lambda: ExampleHiddenStatesConnector
    monkeypatch.setattr(KVConnectorFactory, "_registry", registry)
    with pytest.raises(RuntimeError, match="does not take them"):
        patch_mod.set_up_extraction(type("Runner", (), {})(), cfg)


def test_ranks_that_do_not_write_stack_nothing():
    """A tensor-parallel rank without a writer says so through the hook, and the runner's
    hand-over then stacks and copies nothing."""
    from vllm_gdn_hs.patch import extraction as patch_mod

    ours = _bare(HybridHiddenStatesConnector, _worker=None)
    assert not ours.wants_hidden_states()
    runner = type("Runner", (), {})()
    kept = patch_mod.Extraction([1], [0], HybridHiddenStatesConnector, connector=ours)
    setattr(runner, patch_mod.RUNNER_ATTR, kept)
    calls = []
    ours.save_hidden_states = lambda **kw: calls.append(kw)
    aux = [_Exploding()]  # the rows would be stacked from these: untouched on this rank
    patch_mod.hand_over(runner, aux, ["r"], torch.tensor([0, 3]), torch.arange(3))
    assert calls == []
    ours._worker = object()  # the writing rank
    assert ours.wants_hidden_states()
    patch_mod.hand_over(runner, [torch.ones(3, 4)], ["r"], torch.tensor([0, 3]), torch.arange(3))
    assert len(calls) == 1 and calls[0]["hidden_states"].shape == (3, 1, 4)


class _Exploding:
    def __getitem__(self, index):
        raise AssertionError("rows stacked on a rank that does not write")
