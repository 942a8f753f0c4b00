"""What both runner patches do: set extraction up, and hand a step's rows to the connector.
Runner-neutral (it imports no runner); ``self`` is the runner in every function.

The layer sink (:class:`LayerSink`, ``layer_by_layer``): in a step that runs eager, each aux
state leaves for its column of a pinned host slot as the model makes it, and the model keeps an
empty placeholder, so the aux states are never all alive at the activation peak (docs/memory.md).
CUDA-graph steps keep the stacked hand-over: a graph would bake one host address into a replay.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, cast

import torch

from vllm_gdn_hs import hook
from vllm_gdn_hs.config import config_from, configured_layer_ids, is_ours
from vllm_gdn_hs.names import init_logger
from vllm_gdn_hs.rows import CHUNK_TOKENS, row_norms


def layer_order(layer_ids) -> list[int]:
    """Index into the model's aux hidden states (ascending layer order) for each
    configured layer id, so the file keeps the configured order."""
    ascending = sorted(layer_ids)
    return [ascending.index(i) for i in layer_ids]


RUNNER_ATTR = "_vllm_gdn_hs"  # the one attribute the patches set on vLLM's runner


@dataclass
class Extraction:
    """What the runner patches keep on vLLM's runner, under ``RUNNER_ATTR``."""

    layer_ids: list[int]
    order: list[int]  # layer_order(layer_ids)
    connector_class: type[hook.TakesHiddenStates]  # checked at startup
    sink: LayerSink | None = None  # install_sink's, Model Runner V2 only
    connector: hook.TakesHiddenStates | None = None  # the first step's (made after profiling)


def extraction(runner) -> Extraction | None:
    """The runner's extraction, or None where the connector does not extract (another
    connector, none, or a runner made without :func:`set_up_extraction`)."""
    return getattr(runner, RUNNER_ATTR, None)


def set_up_extraction(self, vllm_config) -> None:
    """After a runner's own ``__init__``: aux hidden states on, where the connector extracts."""
    kv = vllm_config.kv_transfer_config
    ids = configured_layer_ids(kv) if is_ours(kv) else None
    ours = None
    if ids:
        # At startup, not at the first step: the configured connector must take the rows.
        ours = Extraction(ids, layer_order(ids), hook.hidden_states_connector_class(vllm_config))
        self.use_aux_hidden_state_outputs = True
    setattr(self, RUNNER_ATTR, ours)


def init_and_profile_run(runner: Any) -> dict:
    """Both runners' ``__init__`` and ``profile_run``, wrapping ``runner``'s."""
    orig_init, orig_profile_run = runner.__init__, runner.profile_run

    def __init__(self, vllm_config, device) -> None:
        orig_init(self, vllm_config, device)
        set_up_extraction(self, vllm_config)

    def profile_run(self, *args, **kwargs) -> None:
        orig_profile_run(self, *args, **kwargs)
        if extraction(self) is not None:
            profile_step(self)

    return {"__init__": __init__, "profile_run": profile_run}


def profile_step(self) -> None:
    """Inside ``profile_run``: allocate what the stacked hand-over of the largest step allocates
    (with the layer sink, the largest step a CUDA graph runs)."""
    ours = cast(Extraction, extraction(self))
    num_tokens = self.max_num_tokens
    if ours.sink is not None:
        num_tokens = min(num_tokens, largest_graph_step(self))
    if num_tokens == 0:
        return
    shape = (num_tokens, self.model_config.get_hidden_size())
    outputs = [  # the model's output and aux states, alive during the hand-over
        torch.empty(shape, dtype=self.model_config.dtype, device=self.device)
        for _ in range(len(ours.layer_ids) + 1)
    ]
    rows = torch.stack(outputs[1:], dim=1)
    positions = torch.empty(shape[0], dtype=torch.int64, device=self.device)
    ours.connector_class.profile_save_hidden_states(self.vllm_config, rows)
    del outputs, rows, positions


def graph_aux_buffers(self) -> list[torch.Tensor]:
    """The CUDA-graph manager's aux output buffers, one [largest capture, hidden] view per layer
    id, all of one tensor made after the cache is emptied: a segment of their own."""
    cc = self.vllm_config.compilation_config
    rows = max([cc.max_cudagraph_capture_size or 0, *(cc.cudagraph_capture_sizes or [])])
    torch.cuda.empty_cache()
    ids = cast(Extraction, extraction(self)).layer_ids
    shape = (len(set(ids)), rows, self.model_config.get_hidden_size())
    return list(torch.empty(shape, dtype=self.model_config.dtype, device=self.device).unbind(0))


def _connector(ours: Extraction) -> hook.TakesHiddenStates:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    if ours.connector is None:  # made after profiling
        ours.connector = hook.hidden_states_connector(get_kv_transfer_group())
    return ours.connector


def hand_over(self, aux_hidden_states, req_ids, query_start_loc_cpu, positions) -> None:
    """Give the connector the scheduled tokens' rows (configured layer order) and positions."""
    num_tokens = int(query_start_loc_cpu[-1])
    if num_tokens == 0:
        return
    ours = cast(Extraction, extraction(self))
    connector = _connector(ours)
    if not connector.wants_hidden_states():
        return  # a tensor-parallel rank that does not write: nothing to stack or copy
    sink = ours.sink
    if sink is not None and sink.slot is not None:  # the rows left during the forward pass
        slot, norms = sink.slot, sink.norms
        sink.slot = sink.norms = None
        if sink.taken != len(ours.order):
            raise RuntimeError(f"the model made {sink.taken} aux states in an eager step")
        cast(hook.TakesLayerRows, connector).save_taken_rows(
            slot, req_ids, query_start_loc_cpu, norms, positions[:num_tokens].clone()
        )
        return
    # Fresh tensors: CUDA-graph outputs and the runner's positions are rewritten next step.
    rows = torch.stack([aux_hidden_states[i][:num_tokens] for i in ours.order], dim=1)
    connector.save_hidden_states(
        hidden_states=rows,
        req_ids=req_ids,
        query_start_loc_cpu=query_start_loc_cpu,
        positions=positions[:num_tokens].clone(),
    )


class LayerSink:
    """Takes each aux state from the model as it is made, while open (an eager step's forward
    pass): with a slot, its rows go to their column and their norms are taken; without one
    (dummy runs, warm-up, a rank that does not write) they are dropped, as real steps drop them."""

    def __init__(self, order: list[int], hidden: int, dtype, device):
        self.column = {k: j for j, k in enumerate(order)}  # ascending aux index -> file column
        self.placeholder = torch.empty((0, hidden), dtype=dtype, device=device)
        self.open = False
        self.slot = self.norms = None
        self.num_tokens = self.taken = 0

    def start(self, num_tokens: int, slot) -> None:
        self.open, self.num_tokens, self.taken, self.slot = True, num_tokens, 0, slot
        if slot is not None:
            self.norms = torch.empty(
                (num_tokens, len(self.column)), dtype=torch.float32, device=self.placeholder.device
            )

    def take(self, aux: torch.Tensor) -> torch.Tensor:
        """One aux state [padded tokens, H]; returns what the model keeps in its place."""
        column = self.column[self.taken]
        self.taken += 1
        if self.slot is not None:
            rows = aux[: self.num_tokens]
            # float32 norm temporaries of one layer's chunk: 20 MiB at 27B size
            for s in range(0, self.num_tokens, CHUNK_TOKENS):
                self.norms[s : s + CHUNK_TOKENS, column] = row_norms(rows[s : s + CHUNK_TOKENS])
            self.slot.fill_layer(column, rows)
        return self.placeholder


def compiled_forward(self) -> bool:
    """Whether vLLM runs the forward through torch.compile (compiled submodules, as Qwen3-Next's
    and Nemotron-H's on 0.34.0, or ``STOCK_TORCH_COMPILE``): dynamo would trace the sink."""
    from vllm.config import CompilationMode

    if self.vllm_config.compilation_config.mode == CompilationMode.STOCK_TORCH_COMPILE:
        return True
    try:
        from vllm.v1.worker.gpu.cudagraph_utils import has_compiled_submodule
    except ImportError:  # a release without it: taken as compiled, the safe side
        return True
    return has_compiled_submodule(self.model)


def install_sink(self) -> None:
    """After ``load_model`` (Model Runner V2): wrap ``_maybe_add_hidden_state`` so that an open
    :class:`LayerSink` takes each aux state. Not installed (every step stacked) without
    ``EagleModelMixin``, for a compiled model, with sequence parallelism, fp8 (a row's scale
    spans its layers), a connector without slots, a failing strided copy, or the option off."""
    from vllm_gdn_hs.connector.staging import strided_copy_works  # the connector: lazily

    ours = cast(Extraction, extraction(self))
    ours.sink = None
    try:
        from vllm.model_executor.models.interfaces import EagleModelMixin
    except ImportError:
        return
    modules = self.model.modules() if isinstance(self.model, torch.nn.Module) else ()
    holder = next((m for m in modules if isinstance(m, EagleModelMixin)), None)
    if holder is None or compiled_forward(self):
        return
    cfg = config_from(self.vllm_config)
    if (
        getattr(holder, "use_sequence_parallel", False)
        or not issubclass(ours.connector_class, hook.TakesLayerRows)
        or not cfg.layer_by_layer
        or cfg.fp8
    ):
        return
    if self.device.type == "cuda" and not strided_copy_works(self.device):
        init_logger(__name__).warning(
            "layer_by_layer is off: a strided copy out of the GPU (cudaMemcpy2DAsync, "
            "cuda-bindings) failed its check here; eager steps stack their rows after the "
            "forward pass, which raises vLLM's warm-up peak"
        )
        return
    sink = ours.sink = LayerSink(
        ours.order, self.model_config.get_hidden_size(), self.model_config.dtype, self.device
    )
    original = holder._maybe_add_hidden_state  # vLLM's, bound to the model

    def _maybe_add_hidden_state(aux_hidden_states, layer_idx, hidden_states, residual):
        n = len(aux_hidden_states)
        out = original(aux_hidden_states, layer_idx, hidden_states, residual)
        if sink.open and len(aux_hidden_states) > n:
            aux_hidden_states[-1] = sink.take(aux_hidden_states[-1])
        return out

    holder._maybe_add_hidden_state = _maybe_add_hidden_state
    init_logger(__name__).info(
        "layer_by_layer: each layer's rows leave the GPU as the model makes them in steps "
        "of more than %d tokens",
        largest_graph_step(self),
    )


def largest_graph_step(self) -> int:
    """The most tokens a CUDA graph runs (0 without graphs): larger steps run eager."""
    from vllm.config import CUDAGraphMode

    cc = self.vllm_config.compilation_config
    if self.model_config.enforce_eager or cc.cudagraph_mode == CUDAGraphMode.NONE:
        return 0
    return cc.max_cudagraph_capture_size or 0


@contextlib.contextmanager
def sink_open(self, num_tokens: int, dummy_run: bool):
    """Around one ``execute_model`` of ``num_tokens`` scheduled tokens: the sink open when the
    step runs eager, with a host slot when this rank writes the step's rows."""
    ours = extraction(self)
    if ours is None or ours.sink is None or num_tokens <= largest_graph_step(self):
        yield
        return
    sink = ours.sink
    from vllm.distributed.kv_transfer import has_kv_transfer_group

    slot = None
    if not dummy_run and has_kv_transfer_group():  # off in vLLM's warm-up and dummy runs
        slot = cast(hook.TakesLayerRows, _connector(ours)).take_rows(num_tokens)
    sink.start(num_tokens, slot)
    try:
        yield
    except BaseException:
        if sink.slot is not None:  # no hand-over follows: give the rows back to the ring
            sink.slot.release()
            sink.slot = None
        raise
    finally:
        sink.open = False
