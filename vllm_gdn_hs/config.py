"""The connector's options (``kv_connector_extra_config``), parsed once (:func:`config_from`);
apart from the connector, so that the launcher checks them without torch or vLLM."""

from __future__ import annotations

import math

from pydantic import AliasChoices, BaseModel, Field, StrictBool, ValidationError, model_validator

from vllm_gdn_hs.names import CONNECTOR_NAME
from vllm_gdn_hs.storage.base import StorageOptions
from vllm_gdn_hs.storage.mooncake_options import MooncakeOptions


class HiddenStatesConfig(BaseModel, extra="forbid"):
    """The connector's options, each explained in docs/options.md."""

    shared_storage_path: str = "/tmp/hidden_states"
    layer_ids: list[int] = Field(default_factory=list)
    host_buffers: int = Field(3, ge=1, le=8)
    write_workers: int = Field(  # vLLM's ExampleHiddenStatesConnector: num_writer_threads
        4, ge=1, le=64, validation_alias=AliasChoices("write_workers", "num_writer_threads")
    )
    validate_rows: bool = True
    fp8: bool = False
    layer_by_layer: bool = True
    graph_aux_buffers: bool = True
    write_backlog_gb: float = Field(16.0, gt=0)
    shutdown_drain_s: float = Field(120.0, ge=0, le=86_400)
    allow_custom_save_path: bool = False
    use_synchronization_lock: bool = True
    custom_save_root: str | None = None
    mooncake: MooncakeOptions | None = None

    @model_validator(mode="after")
    def _storage_options(self) -> HiddenStatesConfig:
        """Each storage backend's options check the options they share with the rest."""
        for name in type(self).model_fields:
            if isinstance(options := getattr(self, name), StorageOptions):
                options.check_config(self)
        return self


class RequestParams(BaseModel, extra="ignore"):
    """The per-request ``kv_transfer_params`` the connector reads, from the network: checked
    before anything uses them; other connectors' keys are left alone."""

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
    """``kv_connector_extra_config`` (of vLLM's object, a dict, or None), unchecked: for the
    patch that fills it in and others' options (``MultiConnector``'s); ours: :func:`config_from`."""
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
    """The layer ids in the options, unchecked (patches leave errors to the connector)."""
    return list(extra_config(kv_transfer_config).get("layer_ids") or [])


def sub_connectors(kv_transfer_config) -> list[dict]:
    """The connectors ``MultiConnector`` runs (its ``connectors`` option), each a dict."""
    subs = extra_config(kv_transfer_config).get("connectors") or ()
    return [c for c in subs if isinstance(c, dict)]


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
