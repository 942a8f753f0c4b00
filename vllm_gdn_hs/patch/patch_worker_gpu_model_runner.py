"""Hand the target model's aux hidden states to the connector after every forward pass.

Why: ``HybridHiddenStatesConnector`` streams hidden states out of the GPU each
step instead of keeping them in the paged KV cache. The config patch drops the
``extract_hidden_states`` speculative config (no drafter, no draft tokens, no
extra GDN state), so the runner must itself ask the model for the aux hidden
states of the chosen layers and give them to the connector.

How, only when the connector is configured:
- ``__init__``: ``use_aux_hidden_state_outputs`` on, and one-step GPU buffers
  (``max_num_batched_tokens`` x layers x hidden for the rows, plus positions);
- ``load_model``: those buffers are added to ``model_memory_usage``. vLLM sizes
  the KV cache from that figure plus the peak measured while profiling, which
  leaves out tensors allocated before profiling; without this the buffers
  (0.94 GiB for Qwen3.6-27B, 6 layers, 16,384 tokens a step) would sit outside
  ``gpu_memory_utilization``;
- ``_get_eagle3_aux_layers_from_config``: the connector's layer ids, which
  ``load_model`` gives to the model;
- ``_model_forward`` (called only for real steps, never for dummy runs): after
  the original, the aux states and positions of the scheduled tokens are copied,
  layers in the configured order, into buffers of our own (so CUDA-graph outputs
  and the runner's inputs can be reused at once) and handed to the connector
  with the step's request ids and query start locations, through
  ``vllm_gdn_hs.hook.TakesHiddenStates`` (the active connector, or ours inside
  ``MultiConnector``; any other connector is refused with a message at the first
  step). The connector copies them to pinned host memory on a side stream;
  nothing here waits on the GPU.

Upstream: no equivalent. Remove when vLLM offers hidden-state extraction
without speculative decoding. Source twin: ``patches/<vllm version>/0004-*.patch``.
"""

from __future__ import annotations

import math

import torch
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_gdn_hs.config import is_ours
from vllm_gdn_hs.hook import hidden_states_connector
from vllm_gdn_hs.patch import Patch

_orig_init = GPUModelRunner.__init__
_orig_aux_layers = GPUModelRunner._get_eagle3_aux_layers_from_config
_orig_model_forward = GPUModelRunner._model_forward
_orig_load_model = GPUModelRunner.load_model


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


def buffer_shapes(vllm_config) -> tuple[tuple[int, int, int], int]:
    """(rows, positions) shapes of the one-step GPU buffers: every token of one step."""
    tokens = vllm_config.scheduler_config.max_num_batched_tokens
    layers = len(extraction_layer_ids(vllm_config))
    return (tokens, layers, vllm_config.model_config.get_hidden_size()), tokens


def buffer_bytes(vllm_config) -> int:
    """GPU memory the runner holds for hidden states, counted into vLLM's memory budget."""
    rows, positions = buffer_shapes(vllm_config)
    return math.prod(rows) * vllm_config.model_config.dtype.itemsize + positions * 8


def __init__(self, vllm_config, device) -> None:
    _orig_init(self, vllm_config, device)
    ids = extraction_layer_ids(vllm_config)
    self.hidden_states_layer_ids = ids
    if ids:
        self.use_aux_hidden_state_outputs = True
        self.hidden_states_order = layer_order(ids)
        rows, positions = buffer_shapes(vllm_config)
        self.hidden_states_buffer = torch.empty(
            rows, dtype=self.model_config.dtype, device=self.device
        )
        self.hidden_states_positions = torch.empty(positions, dtype=torch.int64, device=self.device)


def load_model(self, *args, **kwargs) -> None:
    _orig_load_model(self, *args, **kwargs)
    if getattr(self, "hidden_states_layer_ids", None):
        self.model_memory_usage += buffer_bytes(self.vllm_config)


def _get_eagle3_aux_layers_from_config(self):
    if getattr(self, "hidden_states_layer_ids", None):
        return tuple(self.hidden_states_layer_ids)
    return _orig_aux_layers(self)


def _model_forward(
    self,
    input_ids=None,
    positions=None,
    intermediate_tensors=None,
    inputs_embeds=None,
    **model_kwargs,
):
    output = _orig_model_forward(
        self,
        input_ids=input_ids,
        positions=positions,
        intermediate_tensors=intermediate_tensors,
        inputs_embeds=inputs_embeds,
        **model_kwargs,
    )
    if getattr(self, "hidden_states_layer_ids", None):
        save_step(self, output[1], positions)
    return output


def save_step(self, aux_hidden_states: list[torch.Tensor], positions: torch.Tensor) -> None:
    """Hand this step's rows (scheduled tokens only, no padding) to the connector."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    num_reqs = self.input_batch.num_reqs
    query_start_loc = self.query_start_loc.cpu[: num_reqs + 1].clone()
    num_tokens = int(query_start_loc[-1])
    if num_tokens == 0:
        return
    connector = getattr(self, "hidden_states_connector", None)
    if connector is None:  # first real step: the connector exists only after profiling
        connector = self.hidden_states_connector = hidden_states_connector(get_kv_transfer_group())
    connector.wait_staging_free()  # GPU-side wait for the last step's copy out
    rows = self.hidden_states_buffer[:num_tokens]
    torch.stack(
        [aux_hidden_states[i][:num_tokens] for i in self.hidden_states_order], dim=1, out=rows
    )
    if positions.dim() == 2:  # M-RoPE: [3, tokens]; text positions are the first row
        positions = positions[0]
    # The runner rewrites its positions buffer next step: keep our own copy, which,
    # like the rows, is only overwritten after the connector's copy out is done.
    own_positions = self.hidden_states_positions[:num_tokens]
    own_positions.copy_(positions[:num_tokens])
    connector.save_hidden_states(
        hidden_states=rows,
        req_ids=list(self.input_batch.req_ids[:num_reqs]),
        query_start_loc_cpu=query_start_loc,
        positions=own_positions,
    )


PATCH = Patch(
    GPUModelRunner,
    {
        "__init__": __init__,
        "load_model": load_model,
        "_get_eagle3_aux_layers_from_config": _get_eagle3_aux_layers_from_config,
        "_model_forward": _model_forward,
    },
)
