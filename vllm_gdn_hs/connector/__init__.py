"""HybridHiddenStatesConnector: vLLM's ``ExampleHiddenStatesConnector`` contract (the files
and ``kv_transfer_params`` speculators reads), with hidden states streamed out of the GPU every
step instead of kept in the KV cache, and ``SupportsHMA`` for GDN hybrid models. A thin facade:
:mod:`.scheduler` and :mod:`.worker` do the work, told by the runner patches through
:class:`vllm_gdn_hs.hook.TakesLayerRows`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.parallel_state import get_tp_group

from vllm_gdn_hs.connector.checks import config_from, validate_vllm_config
from vllm_gdn_hs.connector.metadata import HybridHiddenStatesConnectorMetadata
from vllm_gdn_hs.connector.scheduler import HybridHiddenStatesConnectorScheduler
from vllm_gdn_hs.connector.staging import HostSlot, rows_and_norms
from vllm_gdn_hs.connector.stats import HiddenStatesKVConnectorStats, HiddenStatesPromMetrics
from vllm_gdn_hs.connector.worker import HybridHiddenStatesConnectorWorker
from vllm_gdn_hs.hook import RowSlot, TakesLayerRows

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


class HybridHiddenStatesConnector(KVConnectorBase_V1, SupportsHMA, TakesLayerRows):
    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.cfg = config_from(vllm_config)
        self.layer_ids = validate_vllm_config(vllm_config, self.cfg)
        self._scheduler: HybridHiddenStatesConnectorScheduler | None = None
        self._worker: HybridHiddenStatesConnectorWorker | None = None
        model = vllm_config.model_config
        hidden, dtype = model.get_hidden_size(), model.dtype
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = HybridHiddenStatesConnectorScheduler(
                self.cfg, self.layer_ids, model.max_model_len, hidden, dtype
            )
        elif get_tp_group().rank_in_group == 0:  # only tensor-parallel rank 0 writes
            max_tokens = vllm_config.scheduler_config.max_num_batched_tokens
            cuda = torch.cuda.is_available()
            device = torch.device(f"cuda:{torch.cuda.current_device()}" if cuda else "cpu")
            self._worker = HybridHiddenStatesConnectorWorker(
                self.cfg, max_tokens, len(self.layer_ids), hidden, dtype, device
            )

    # -- worker side ------------------------------------------------------------------
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        # Here, not in start_load_kv: from 0.29.0 vLLM may call that after the forward pass.
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            assert isinstance(connector_metadata, HybridHiddenStatesConnectorMetadata)
            self._worker.on_metadata(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None: ...

    @staticmethod
    def profile_save_hidden_states(vllm_config: VllmConfig, hidden_states: torch.Tensor) -> None:
        rows_and_norms(hidden_states, config_from(vllm_config).fp8)

    def wants_hidden_states(self) -> bool:
        return self._worker is not None

    def save_hidden_states(
        self,
        hidden_states: torch.Tensor,
        req_ids: list[str],
        query_start_loc_cpu: torch.Tensor,
        positions: torch.Tensor,
    ) -> None:
        if self._worker is not None:
            self._worker.save(hidden_states, req_ids, query_start_loc_cpu, positions)

    def take_rows(self, num_tokens: int) -> HostSlot | None:
        if self._worker is None or self.cfg.fp8:  # fp8: a row's scale spans all its layers
            return None
        return self._worker.take(num_tokens)

    def save_taken_rows(
        self,
        slot: RowSlot,
        req_ids: list[str],
        query_start_loc_cpu: torch.Tensor,
        norms: torch.Tensor,
        positions: torch.Tensor,
    ) -> None:
        assert self._worker is not None, "take_rows gave the slot"
        taken = cast(HostSlot, slot)  # the one take_rows gave: a slot of this worker's ring
        self._worker.save_taken(taken, req_ids, query_start_loc_cpu, norms, positions)

    def wait_for_layer_load(self, layer_name: str) -> None: ...  # nothing is loaded

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None: ...  # nothing lives in the KV cache

    def wait_for_save(self) -> None: ...  # save_hidden_states returns at once

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None

    def get_kv_connector_stats(self) -> HiddenStatesKVConnectorStats | None:
        data = self._worker.interval_stats() if self._worker is not None else None
        return HiddenStatesKVConnectorStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> HiddenStatesKVConnectorStats:
        return HiddenStatesKVConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> HiddenStatesPromMetrics | None:
        return HiddenStatesPromMetrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues
        )

    # -- scheduler side ---------------------------------------------------------------
    def shutdown_drain(self) -> HybridHiddenStatesConnectorScheduler | None:
        return self._scheduler

    def _sched(self) -> HybridHiddenStatesConnectorScheduler:
        if self._scheduler is None:
            raise RuntimeError(f"{type(self).__name__}: a scheduler-side call on the worker side")
        return self._scheduler

    def on_new_request(self, request: Request) -> None:  # vLLM 0.33.0 calls it
        self._sched().on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._sched().on_allocated(request)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._sched().build_meta(scheduler_output)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return False, self._sched().on_finished(request)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))
