"""What the scheduler side tells the worker side, once per step."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class NewRequest:
    req_id: str
    path: str
    num_prompt_tokens: int
    # Rows to reserve (untouched pages: unused ones cost no memory), outputs included.
    num_rows: int = 0


@dataclass
class FinishedRequest:
    req_id: str
    token_ids: list[int] | None  # None: aborted, drop everything


@dataclass
class HybridHiddenStatesConnectorMetadata(KVConnectorMetadata):
    new_requests: list[NewRequest] = field(default_factory=list)
    finished_requests: list[FinishedRequest] = field(default_factory=list)
