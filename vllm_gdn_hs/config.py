"""The connector's options (``kv_connector_extra_config``), apart from the connector so that
the launcher can check them before vLLM starts without importing torch or vLLM."""

from __future__ import annotations

import math

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    ValidationError,
    model_validator,
)

from vllm_gdn_hs.names import CONNECTOR_NAME
from vllm_gdn_hs.storage.base import StorageOptions
from vllm_gdn_hs.storage.mooncake_options import MooncakeOptions


class HiddenStatesConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    shared_storage_path: str = "/tmp/hidden_states"
    layer_ids: list[int] = Field(default_factory=list, description="residual stream after k layers")
    host_buffers: int = Field(
        2, ge=1, le=8, description="pinned host rows for this many of the largest steps"
    )
    write_workers: int = Field(
        4,
        ge=1,
        le=64,
        # vLLM's ExampleHiddenStatesConnector (0.22+) calls it num_writer_threads.
        validation_alias=AliasChoices("write_workers", "num_writer_threads"),
        description="threads writing files",
    )
    validate_rows: bool = Field(True, description="refuse files with NaN/Inf or all-zero rows")
    fp8: bool = Field(
        False,
        description="write hidden_states as float8_e4m3fn with one fp32 scale per token "
        "(hidden_states_scales [T, 1, 1]), quantized on the GPU: speculators' fp8 backend",
    )
    layer_by_layer: bool = Field(
        True,
        description="in steps that run eager, copy each layer's rows out of the GPU as the "
        "model makes them, so a step's aux states are never all alive on it (the warm-up peak "
        "stays plain vLLM's, and so does the KV cache); bf16 files on Model Runner V2 (fp8 "
        "and V1 stack a step's rows after its forward pass)",
    )
    graph_aux_buffers: bool = Field(
        False,
        description="allocate vLLM's CUDA-graph aux output buffers before capture, in a "
        "segment of their own (Model Runner V2): made lazily inside the capture they can pin a "
        "GDN kernel's cached workspace segment, 0.78 GiB on an H100 (docs/memory.md); off "
        "until a GPU run of the default path measures it",
    )
    write_backlog_gb: float = Field(
        16.0, gt=0, description="host memory of finished requests waiting for their file writes"
    )
    shutdown_drain_s: float = Field(
        120.0,
        ge=0,
        le=86_400,
        description="at shutdown (SIGINT, SIGTERM), seconds to finish writing every answered "
        "request's file; any not written by then loses its lock and is counted in the log",
    )
    allow_custom_save_path: bool = False
    # As vLLM's ExampleHiddenStatesConnector: off only for offline runs whose files are read
    # after the server has finished (no <file>.lock then; speculators' online reader needs it).
    use_synchronization_lock: bool = True
    # Where a client's own "hidden_states_path" may point, with allow_custom_save_path on;
    # default: shared_storage_path. Anything resolving outside it is refused.
    custom_save_root: str | None = None
    # Set: the mooncake backend (vllm_gdn_hs.storage.mooncake), one object per request, no files.
    mooncake: MooncakeOptions | None = None

    @model_validator(mode="after")
    def _storage_options(self) -> HiddenStatesConfig:
        """Each storage backend's options check the options they share with the rest."""
        for name in type(self).model_fields:
            if isinstance(options := getattr(self, name), StorageOptions):
                options.check_config(self)
        return self


class RequestParams(BaseModel):
    """The per-request ``kv_transfer_params`` the connector reads, from the network: checked
    before anything uses them; other connectors' keys are left alone."""

    model_config = ConfigDict(extra="ignore")

    hidden_states_path: str | None = Field(None, max_length=4096)
    include_output_tokens: StrictBool = False


def request_params(raw: object) -> RequestParams:
    """``kv_transfer_params`` as given (None, a dict, or anything a client sent), checked;
    ValueError naming each bad field."""
    if raw is None:
        return RequestParams()
    if not isinstance(raw, dict):
        raise ValueError(f"kv_transfer_params must be an object, not {type(raw).__name__}")
    try:
        return RequestParams.model_validate(raw)
    except ValidationError as e:
        raise ValueError(problems(e, "kv_transfer_params.")) from None


def problems(e: ValidationError, prefix: str = "") -> str:
    """Each bad field of a pydantic model, and why, on one line."""
    return "; ".join(f"{prefix}{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())


def speculative_config(layer_ids: list[int]) -> dict:
    """speculators' ``extract_hidden_states`` speculative config: it carries only the layer ids."""
    return {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}},
    }


def kv_transfer_config(connector: str | None = None, **extra) -> dict:
    return {
        "kv_connector": connector or CONNECTOR_NAME,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": extra,
    }


def extraction_config(
    layer_ids: list[int], storage: str, connector: str | None = None, **options
) -> dict:
    """Both halves, as keyword arguments for ``LLM(...)``/``EngineArgs``: the layer ids, and
    ``connector`` writing to ``storage`` with connector ``options``."""
    return {
        "speculative_config": speculative_config(layer_ids),
        "kv_transfer_config": kv_transfer_config(connector, shared_storage_path=storage, **options),
    }


def extra_config(kv_transfer_config) -> dict:
    """``kv_connector_extra_config`` of a KV transfer config (vLLM's object, a dict, or None) as
    given, unchecked: the one place that reads it. Readers take :func:`config_from`; this is for
    the patch that fills it in and for options of others (``MultiConnector``'s)."""
    if isinstance(kv_transfer_config, dict):
        extra = kv_transfer_config.get("kv_connector_extra_config")
    else:
        extra = getattr(kv_transfer_config, "kv_connector_extra_config", None)
    return extra if extra is not None else {}


def config_from(config) -> HiddenStatesConfig:
    """The connector's options, checked, from vLLM's engine config or a KV transfer config (the
    object or a dict); ValueError naming each bad option."""
    kv = getattr(config, "kv_transfer_config", config)
    try:
        return HiddenStatesConfig(**extra_config(kv))
    except Exception as e:
        raise ValueError(f"{CONNECTOR_NAME}: bad kv_connector_extra_config: {e}") from None


def configured_layer_ids(kv_transfer_config) -> list[int]:
    """The layer ids in the options, before the connector checks them (a patch reads them at
    config time, where an error is not its to raise)."""
    return list(extra_config(kv_transfer_config).get("layer_ids") or [])


def sub_connectors(kv_transfer_config) -> list[dict]:
    """The connectors ``MultiConnector`` runs (its ``connectors`` option), each a dict."""
    subs = extra_config(kv_transfer_config).get("connectors") or ()
    return [c for c in subs if isinstance(c, dict)]


# -- shutdown: the time an engine core process needs after SIGTERM ---------------------------
TEARDOWN_S = 30  # vLLM's teardown after the drain


def shutdown_window(drain_s: float) -> int:
    """Seconds an engine core process needs between SIGTERM and exit: ``drain_s`` for the
    running requests to finish, ``drain_s`` for their files, and vLLM's teardown."""
    return 2 * math.ceil(drain_s) + TEARDOWN_S


def is_ours(kv_transfer_config) -> bool:
    """Whether a KV transfer config (vLLM's object, a dict, or None) names our connector."""
    if isinstance(kv_transfer_config, dict):
        return kv_transfer_config.get("kv_connector") == CONNECTOR_NAME
    return getattr(kv_transfer_config, "kv_connector", None) == CONNECTOR_NAME
