"""What both runner patches do: set extraction up, and hand a step's rows to the connector.

Runner-neutral (it imports no runner), so that each runner patch imports it on every
release where that runner exists: ``patch_worker_gpu_model_runner`` (vLLM's V1 GPU model
runner, up to 0.33.0) and ``patch_worker_gpu_model_runner_v2`` (Model Runner V2, from 0.33.0;
the only runner from 0.34.0). ``self`` is the runner in every function.
"""

from __future__ import annotations

import torch

from vllm_gdn_hs.config import is_ours
from vllm_gdn_hs.hook import hidden_states_connector, hidden_states_connector_class


def extraction_layer_ids(vllm_config) -> list[int] | None:
    """The connector's layer ids, or None when hidden states are not extracted."""
    kv = vllm_config.kv_transfer_config
    if not is_ours(kv):
        return None
    return list((kv.kv_connector_extra_config or {}).get("layer_ids") or [])


def layer_order(layer_ids) -> list[int]:
    """Index into the model's aux hidden states (ascending layer order) for each
    configured layer id, so the file keeps the configured order."""
    ascending = sorted(layer_ids)
    return [ascending.index(i) for i in layer_ids]


def set_up_extraction(self, vllm_config) -> None:
    """After a runner's own ``__init__``: the connector's layer ids, the model's aux outputs
    on, and the index that keeps the configured layer order."""
    ids = extraction_layer_ids(vllm_config)
    self.hidden_states_layer_ids = ids
    if ids:
        # At startup, not at the first step: the configured connector must take the rows.
        self.hidden_states_connector_class = hidden_states_connector_class(vllm_config)
        self.use_aux_hidden_state_outputs = True
        self.hidden_states_order = layer_order(ids)


def profile_step(self) -> None:
    """Allocate what the hand-over of the largest step allocates, inside the runner's
    ``profile_run``: vLLM sizes the KV cache from that run's peak memory (from 0.34.0, the
    extensible KV cache keeps that peak free as its transient headroom), and its dummy
    forward drops the aux states at once."""
    shape = (self.max_num_tokens, self.model_config.get_hidden_size())
    outputs = [  # the model's output and aux states, alive during the hand-over
        torch.empty(shape, dtype=self.model_config.dtype, device=self.device)
        for _ in range(len(self.hidden_states_layer_ids) + 1)
    ]
    rows = torch.stack(outputs[1:], dim=1)
    positions = torch.empty(shape[0], dtype=torch.int64, device=self.device)
    connector_class = getattr(self, "hidden_states_connector_class", None)
    if connector_class is None:  # a runner made without set_up_extraction
        connector_class = hidden_states_connector_class(self.vllm_config)
    connector_class.profile_save_hidden_states(self.vllm_config, rows)
    del outputs, rows, positions


def hand_over(self, aux_hidden_states, req_ids, query_start_loc_cpu, positions) -> None:
    """Stack the aux states of the scheduled tokens, layers in the configured order, into a
    fresh tensor and give it, with a copy of their positions, to the connector (``self``
    keeps ``hidden_states_order`` and, after the first step, the connector)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    num_tokens = int(query_start_loc_cpu[-1])
    if num_tokens == 0:
        return
    connector = getattr(self, "hidden_states_connector", None)
    if connector is None:  # first real step: the connector exists only after profiling
        connector = self.hidden_states_connector = hidden_states_connector(get_kv_transfer_group())
    if not connector.wants_hidden_states():
        return  # a tensor-parallel rank that does not write: nothing to stack or copy
    # Fresh tensors: CUDA-graph outputs and the runner's positions are rewritten next step.
    rows = torch.stack([aux_hidden_states[i][:num_tokens] for i in self.hidden_states_order], dim=1)
    connector.save_hidden_states(
        hidden_states=rows,
        req_ids=req_ids,
        query_start_loc_cpu=query_start_loc_cpu,
        positions=positions[:num_tokens].clone(),
    )
