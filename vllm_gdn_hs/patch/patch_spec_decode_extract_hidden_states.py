"""Stream hidden states to the connector instead of caching them in the KV cache.

Why: vLLM's ``ExtractHiddenStatesProposer`` runs a draft model whose single
cache-only attention layer writes the stacked aux hidden states into the
paged KV cache, where a connector reads them back. On GDN hybrid models that
layer's page size cannot be unified with the GDN and attention pages ("The
page size of the layer is not divisible by the maximum page size"), and
where it can (later vLLM) it takes most of the KV cache: hidden states of 6
layers cost more per token than the attention KV itself.

How: only when ``HybridHiddenStatesConnector`` is configured, the proposer
no longer loads the draft model (so the layer gets no KV cache spec and no
pages). ``propose()`` stacks the aux hidden states, in the configured layer
order, into the proposer's own one-step buffer; the runner then calls
``prepare_next_token_ids_padded()`` with the input batch, and there the rows
are handed to the worker-side connector with their request ids, which starts
the device-to-host copy on a side stream. Nothing here waits on the GPU.
Every other configuration runs vLLM's code unchanged.

Upstream: no equivalent; a candidate for an upstream "streaming" mode of
the extract_hidden_states method. Source twin: ``patches/0.20.1/0003-*.patch``.
"""

from __future__ import annotations

import torch
from vllm.v1.spec_decode.extract_hidden_states import ExtractHiddenStatesProposer

from vllm_gdn_hs import CONNECTOR_NAME
from vllm_gdn_hs.patch import Patch

_orig_init = ExtractHiddenStatesProposer.__init__
_orig_load_model = ExtractHiddenStatesProposer.load_model
_orig_propose = ExtractHiddenStatesProposer.propose
_orig_prepare = ExtractHiddenStatesProposer.prepare_next_token_ids_padded
_orig_dummy_run = ExtractHiddenStatesProposer.dummy_run
_orig_validate = ExtractHiddenStatesProposer.validate_same_kv_cache_group


def streams_hidden_states(vllm_config) -> bool:
    kv = vllm_config.kv_transfer_config
    return kv is not None and kv.kv_connector == CONNECTOR_NAME


def layer_order(layer_ids) -> list[int]:
    """Index into vLLM's aux hidden states (ascending layer order) for each
    configured layer id, so the file keeps the configured order."""
    ascending = sorted(layer_ids)
    return [ascending.index(i) for i in layer_ids]


def __init__(self, vllm_config, device) -> None:
    _orig_init(self, vllm_config, device)
    self.streams_hidden_states = streams_hidden_states(vllm_config)
    self.aux_layer_order = layer_order(list(self.hf_config.eagle_aux_hidden_state_layer_ids))
    self._staged = None
    self._connector = None
    if self.streams_hidden_states:
        # The runner skips the drafter for a whole step when a sequence plus
        # its draft token exceeds the drafter's max length; with no draft model
        # that limit must not drop the rows of a prompt of max_model_len tokens.
        draft = vllm_config.speculative_config.draft_model_config
        draft.max_model_len = vllm_config.model_config.max_model_len + 1


def load_model(self, target_model) -> None:
    if not self.streams_hidden_states:
        return _orig_load_model(self, target_model)
    # No draft model: its cache-only layer would get KV cache pages. The
    # worker-side connector is created after the KV cache, so it is looked
    # up at the first step.


def _get_connector(self):
    if self._connector is None:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        if not has_kv_transfer_group():
            raise RuntimeError(f"{CONNECTOR_NAME} is configured but no KV connector exists")
        self._connector = get_kv_transfer_group()
    return self._connector


def propose(
    self, sampled_token_ids, target_hidden_states, common_attn_metadata, slot_mappings=None
):
    if not self.streams_hidden_states:
        return _orig_propose(
            self, sampled_token_ids, target_hidden_states, common_attn_metadata, slot_mappings
        )
    num_tokens = target_hidden_states[0].shape[0]
    _get_connector(self).wait_staging_free()  # GPU-side wait for last step's copy out
    torch.stack(
        [target_hidden_states[i] for i in self.aux_layer_order],
        dim=1,
        out=self.hidden_states[:num_tokens],
    )
    self._staged = (num_tokens, common_attn_metadata)
    return sampled_token_ids[:, :1]


def prepare_next_token_ids_padded(
    self, sampled_token_ids, requests, gpu_input_batch, discard_request_mask
):
    if self._staged is not None:
        num_tokens, cm = self._staged
        self._staged = None
        num_reqs = cm.num_reqs
        self._connector.save_hidden_states(
            hidden_states=self.hidden_states[:num_tokens],
            req_ids=list(gpu_input_batch.req_ids[:num_reqs]),
            query_start_loc_cpu=cm.query_start_loc_cpu[: num_reqs + 1],
            num_computed_tokens=cm.compute_num_computed_tokens()[:num_reqs],
        )
    return _orig_prepare(self, sampled_token_ids, requests, gpu_input_batch, discard_request_mask)


def dummy_run(self, *args, **kwargs) -> None:
    if not self.streams_hidden_states:
        return _orig_dummy_run(self, *args, **kwargs)


def validate_same_kv_cache_group(self, kv_cache_config) -> None:
    if not self.streams_hidden_states:
        return _orig_validate(self, kv_cache_config)


PATCH = Patch(
    ExtractHiddenStatesProposer,
    {
        "__init__": __init__,
        "load_model": load_model,
        "propose": propose,
        "prepare_next_token_ids_padded": prepare_next_token_ids_padded,
        "dummy_run": dummy_run,
        "validate_same_kv_cache_group": validate_same_kv_cache_group,
    },
)
