"""What the patched runner needs of the connector that takes its rows, apart from the connector
so that the patches import it without loading it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from vllm_gdn_hs.config import sub_connectors

if TYPE_CHECKING:
    import torch

_FIX = "use kv_connector HybridHiddenStatesConnector, alone or inside MultiConnector"


@runtime_checkable
class TakesHiddenStates(Protocol):
    def save_hidden_states(
        self,
        hidden_states: torch.Tensor,
        req_ids: list[str],
        query_start_loc_cpu: torch.Tensor,
        positions: torch.Tensor,
    ) -> None:
        """One step's rows [tokens, L, H] in batch order (the runner drops them after the call:
        a copy on another stream must keep them alive)."""

    def wants_hidden_states(self) -> bool:
        """Whether this rank takes rows (else the runner stacks nothing)."""

    @staticmethod
    def profile_save_hidden_states(vllm_config: Any, hidden_states: torch.Tensor) -> None:
        """``save_hidden_states``' GPU work on the largest step's dummy rows, in ``profile_run``."""


class RowSlot(Protocol):
    """A step's rows in pinned host memory, which the runner fills a layer at a time."""

    def fill_layer(self, column: int, rows: torch.Tensor) -> None:
        """Copy one layer's rows [tokens, H] (on the GPU) into column ``column``."""

    def release(self) -> None:
        """Give the slot back unused (the step failed before its hand-over)."""


@runtime_checkable
class TakesLayerRows(TakesHiddenStates, Protocol):
    """A connector that also takes a step's rows layer by layer, during its forward pass."""

    def take_rows(self, num_tokens: int) -> RowSlot | None:
        """A pinned host slot the runner fills a layer at a time, or None: stack them."""

    def save_taken_rows(
        self,
        slot: RowSlot,
        req_ids: list[str],
        query_start_loc_cpu: torch.Tensor,
        norms: torch.Tensor,
        positions: torch.Tensor,
    ) -> None:
        """After the forward pass that filled ``slot``: its norms and positions."""


class DrainsAtShutdown(Protocol):
    """What the shutdown patch (patch/shutdown.py) needs of the connector's scheduler side."""

    @property
    def drain_s(self) -> float:
        """Seconds for the running requests to finish, and as long again for their files."""

    def refuse(self, reason: str) -> None:
        """The reason the requests aborted from now on give in their responses."""

    def abort_params(self, request_id: str) -> dict[str, Any] | None:
        """An aborted request's ``kv_transfer_params`` for its response, once."""


@runtime_checkable
class HasShutdownDrain(Protocol):
    """A connector whose scheduler side drains at shutdown (None on the worker side)."""

    def shutdown_drain(self) -> DrainsAtShutdown | None: ...


def hidden_states_connector(connector: object) -> TakesHiddenStates:
    """The active connector, or the one inside ``MultiConnector``, that takes the rows."""
    for candidate in (connector, *getattr(connector, "_connectors", ())):
        if isinstance(candidate, TakesHiddenStates):
            return candidate
    raise RuntimeError(
        f"hidden states are extracted but the KV connector {type(connector).__name__} does not "
        f"take them (no save_hidden_states): {_FIX}"
    )


def hidden_states_connector_class(vllm_config) -> type[TakesHiddenStates]:
    """At startup, before any connector exists: the class that will take the rows."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    kv = vllm_config.kv_transfer_config
    names = [getattr(kv, "kv_connector", None)]
    names += [c.get("kv_connector") for c in sub_connectors(kv)]
    for name in filter(None, names):
        try:
            cls = KVConnectorFactory.get_connector_class_by_name(name)
        except ValueError:
            continue
        if isinstance(cls, type) and issubclass(cls, TakesHiddenStates):
            return cls
    raise RuntimeError(
        f"hidden states are extracted but the KV connector {names[0]!r} does not take them "
        f"(no save_hidden_states): {_FIX}"
    )
