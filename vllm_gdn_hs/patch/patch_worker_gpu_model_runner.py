"""Hand the target model's aux hidden states to the connector after every forward pass.

Why: the config patch drops the ``extract_hidden_states`` speculative config (no drafter, no
draft tokens, no extra GDN state), so the runner itself asks the model for the chosen layers'
aux hidden states and gives them to the connector.

How, only when the connector is configured (what both runners do is in ``extraction.py``):
- ``__init__``: ``use_aux_hidden_state_outputs`` on; ``_get_eagle3_aux_layers_from_config``:
  the connector's layer ids;
- ``profile_run``: the largest step's hand-over is allocated once, so the KV cache is sized
  with it and nothing is held between steps;
- ``_model_forward`` (real steps only): the scheduled tokens' aux states, stacked in the
  configured layer order into a fresh tensor, go to the connector, which copies them on a
  side stream; nothing here waits on the GPU;
- ``_determine_batch_execution_and_padding``: a step of one-token requests that starts a
  prompt runs as a piecewise graph, not as a FULL decode CUDA graph, which would not run the
  GDN backend's prefill of the prompt's first chunk: the request would read a recycled state.

Applied up to vLLM 0.33.0 (``version.V1_RUNNER_UNTIL``); on 0.33.0 only when vLLM picks this
runner. Upstream: no equivalent. Remove when vLLM extracts hidden states without speculative
decoding, or when 0.33.0 leaves the supported releases. Twin: ``patches/*/0004-*.patch``.
"""

from __future__ import annotations

import inspect

from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_gdn_hs.patch import Patch
from vllm_gdn_hs.patch.extraction import extraction, hand_over, init_and_profile_run

_orig_aux_layers = GPUModelRunner._get_eagle3_aux_layers_from_config
_orig_model_forward = GPUModelRunner._model_forward
_orig_batch_execution = GPUModelRunner._determine_batch_execution_and_padding
_BATCH_EXECUTION_ARGS = inspect.signature(_orig_batch_execution)
_MODEL_FORWARD_ARGS = inspect.signature(_orig_model_forward)


def _get_eagle3_aux_layers_from_config(self):
    ours = extraction(self)
    return _orig_aux_layers(self) if ours is None else tuple(ours.layer_ids)


def _model_forward(self, *args, **kwargs):
    output = _orig_model_forward(self, *args, **kwargs)
    if extraction(self) is not None:
        positions = _MODEL_FORWARD_ARGS.bind(self, *args, **kwargs).arguments["positions"]
        num_reqs = self.input_batch.num_reqs
        hand_over(  # the scheduled tokens' rows, no padding
            self,
            output[1],
            req_ids=list(self.input_batch.req_ids[:num_reqs]),
            query_start_loc_cpu=self.query_start_loc.cpu[: num_reqs + 1].clone(),
            positions=positions[0] if positions.dim() == 2 else positions,  # M-RoPE: [3, tokens]
        )
    return output


def _determine_batch_execution_and_padding(self, *args, **kwargs):
    if extraction(self) is not None:
        call = _BATCH_EXECUTION_ARGS.bind(self, *args, **kwargs).arguments
        # Dummy runs (profiling, CUDA graph capture) say force_uniform_decode themselves. A step
        # of one token per request is not a uniform decode batch if one of them starts its prompt.
        if (
            "force_uniform_decode" not in call
            and call["max_num_scheduled_tokens"] == self.uniform_decode_query_len
            and (self.input_batch.num_computed_tokens_cpu[: call["num_reqs"]] == 0).any()
        ):
            kwargs["force_uniform_decode"] = False
    return _orig_batch_execution(self, *args, **kwargs)


PATCH = Patch(
    GPUModelRunner,
    {
        **init_and_profile_run(GPUModelRunner),
        "_get_eagle3_aux_layers_from_config": _get_eagle3_aux_layers_from_config,
        "_model_forward": _model_forward,
        "_determine_batch_execution_and_padding": _determine_batch_execution_and_padding,
    },
)
