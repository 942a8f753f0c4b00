"""The hook between the patched model runner and the connector that takes its rows.

The runner patch (``patch/patch_worker_gpu_model_runner.py``) calls this method after
every forward pass; :class:`vllm_gdn_hs.connector.HybridHiddenStatesConnector` implements
it. Kept apart from the connector so that the patch can import it in every vLLM process
without loading the connector.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class TakesHiddenStates(Protocol):
    def save_hidden_states(self, hidden_states, req_ids, query_start_loc_cpu, positions) -> None:
        """One step's rows [tokens, L, H] of the scheduled tokens, in batch order, with the
        request ids, query start locations (CPU) and each row's token position. The tensors
        are the runner's to drop after the call: a copy made later on another stream must
        keep them alive (``record_stream``)."""


def hidden_states_connector(connector: object) -> TakesHiddenStates:
    """The connector that takes the rows: the active one, or the one inside vLLM's
    ``MultiConnector``; RuntimeError naming the fix if there is none."""
    for candidate in (connector, *getattr(connector, "_connectors", ())):
        if isinstance(candidate, TakesHiddenStates):
            return candidate
    raise RuntimeError(
        f"hidden states are extracted but the KV connector {type(connector).__name__} does not "
        "take them (no save_hidden_states): use kv_connector HybridHiddenStatesConnector, "
        "alone or inside MultiConnector"
    )
