"""What the launcher needs to know about a target model, read from its HF config (through
``text_config`` for multimodal checkpoints such as Qwen3.5/3.6)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
from dataclasses import dataclass

from vllm_gdn_hs.layer_ids import validate_layer_ids

# HF ``layer_types`` values, grouped by the vLLM KV cache spec they get.
_LINEAR = {"linear_attention", "mamba", "mamba2", "gdn"}
_FULL = {"full_attention", "attention"}
_SLIDING = {"sliding_attention", "chunked_attention"}
_MLP = {"mlp", "moe"}  # Nemotron-H's blocks without a sequence mixer
# Nemotron-H's hybrid_override_pattern, one letter a block (transformers' NemotronHConfig)
_PATTERN = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}


class ModelConfigError(ValueError): ...


@dataclass(frozen=True)
class ModelInfo:
    path: str
    architectures: tuple[str, ...]
    model_type: str
    num_hidden_layers: int
    hidden_size: int
    layer_types: tuple[str, ...]
    multimodal: bool

    def _of(self, types: set[str]) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t in types]

    linear_layers = property(lambda self: self._of(_LINEAR))
    full_attention_layers = property(lambda self: self._of(_FULL))
    sliding_layers = property(lambda self: self._of(_SLIDING))
    mlp_layers = property(lambda self: self._of(_MLP))
    is_hybrid = property(lambda self: bool(self.linear_layers))  # linear attention (GDN/Mamba)


HUB_PROBE_TIMEOUT_S = 3.0  # one probe, no retries: a machine without network says so at once
# config.json files the package carries (vision tower cut to 2 blocks), for `vllm-gdn-hs config`.
PACKAGED_CONFIGS = {"Qwen/Qwen3.6-27B": "qwen3.6-27b.json"}


def packaged_config_path(model: str) -> str | None:
    name = PACKAGED_CONFIGS.get(model)
    return name and os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", name)


def write_config(model: str, folder: str) -> str:
    """The packaged config.json of ``model``, written into ``folder`` (made if missing), offline."""
    if (src := packaged_config_path(model)) is None:
        raise ModelConfigError(
            f"no config of {model!r} is packaged (only {', '.join(PACKAGED_CONFIGS)}): "
            f"`hf download {model} config.json --local-dir {folder}`, with network"
        )
    os.makedirs(folder, exist_ok=True)
    return shutil.copyfile(src, os.path.join(folder, "config.json"))


def hub_fix(model: str) -> str:
    """What to do when a hub id's config cannot be had: the words every command uses."""
    fix = (
        f"pass the model's folder instead, or download its config.json first (`hf download {model} "
        "config.json --local-dir DIR`, then pass DIR; enough for --dry-run and doctor)"
    )
    if model in PACKAGED_CONFIGS:
        fix += f"; offline, `vllm-gdn-hs config {model} DIR` writes the packaged one"
    return fix


def cached_model_folder(model: str) -> str | None:
    """A hub id's snapshot folder in the local HF cache, or None (nothing is downloaded)."""
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model, local_files_only=True)
    except Exception:  # not a hub id, not in the cache, or no huggingface_hub
        return None


def _hub_config_path(model: str) -> str:
    """config.json of a hub id: the local cache's, else downloaded after one probe. The probe is
    one request, no retries (downloads retry for 20 s): a hub without ``model`` fails at once."""
    folder = cached_model_folder(model)
    if folder and os.path.isfile(os.path.join(folder, "config.json")):
        return os.path.join(folder, "config.json")
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_download, hf_hub_url

    why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else None
    try:
        if not why:  # retry_on_errors is False by default
            get_hf_file_metadata(hf_hub_url(model, "config.json"), timeout=HUB_PROBE_TIMEOUT_S)
    except Exception as e:
        why = (
            f"the hub answered {str(e).splitlines()[0]}"
            if getattr(e, "response", None) is not None
            else f"cannot reach the HF hub at {constants.ENDPOINT} ({type(e).__name__})"
        )
    if why:
        raise ModelConfigError(
            f"{model!r} is no local folder and not in the local HF cache, and {why}: "
            f"{hub_fix(model)}"
        )
    try:
        return hf_hub_download(model, "config.json")
    except Exception as e:
        raise ModelConfigError(
            f"cannot download the config of {model!r} ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}): {hub_fix(model)}"
        ) from None


def _load_config_dict(model: str) -> dict:
    """The model's config.json as written (no code runs), from its folder or the hub."""
    if os.path.isdir(model):
        path = os.path.join(model, "config.json")
        if not os.path.exists(path):
            if os.listdir(model) == [".cache"]:  # what `hf download` leaves when it fails
                raise ModelConfigError(
                    f"{model} holds only .cache/: an `hf download` into it did not finish "
                    "(no network?). Run it again with network, or offline: `vllm-gdn-hs config "
                    f"MODEL {model}` for {', '.join(PACKAGED_CONFIGS)}"
                )
            raise ModelConfigError(f"{model} has no config.json: is it a HF model folder?")
    elif os.path.exists(model):
        raise ModelConfigError(f"{model} is not a folder: pass the model folder or a HF model id")
    elif model.startswith(("/", "./", "../", "~")) or model in (".", ".."):
        raise ModelConfigError(
            f"model folder {model} does not exist: pass a HF model folder or a hub id such as "
            "Qwen/Qwen3.6-27B"
        )
    else:
        path = _hub_config_path(model)
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ModelConfigError(f"cannot read {path}: {e}") from None


def read_model_info(model: str, trust_remote_code: bool = False) -> ModelInfo:
    """The model's shape from its config.json, read as JSON (no model code runs, whatever
    ``trust_remote_code``, taken for speculators' interface, says)."""
    cfg = _load_config_dict(model)
    text = cfg.get("text_config") or cfg
    try:
        n = int(text["num_hidden_layers"])
        hidden = int(text["hidden_size"])
    except (KeyError, TypeError, ValueError):
        raise ModelConfigError(
            f"{model}: config has no num_hidden_layers/hidden_size (also looked in text_config)"
        ) from None
    interval = text.get("full_attention_interval") or 1  # Qwen3-Next: every interval-th layer
    layer_types = (
        text.get("layer_types")
        or text.get("layers_block_type")
        or [_PATTERN.get(c, c) for c in text.get("hybrid_override_pattern") or ""]
        or ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
    )
    return ModelInfo(
        path=model,
        architectures=tuple(cfg.get("architectures") or ()),
        model_type=str(cfg.get("model_type", "")),
        num_hidden_layers=n,
        hidden_size=hidden,
        layer_types=tuple(layer_types),
        multimodal="text_config" in cfg and "vision_config" in cfg,
    )


def layer_ids_arg(text: str) -> list[int]:
    """An argparse ``type`` (``nargs="+"``, then :func:`flat`): ``1,16,31`` or ``1 16 31``."""
    try:
        return [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give integer layer ids separated by spaces or commas, e.g. 1 16 31 or "
            "1,16,31"
        ) from None


def flat(lists: list[list[int]] | None) -> list[int] | None:
    return None if lists is None else [i for ids in lists for i in ids]


def reference_folder(model: str, layer_ids: list[int]) -> str:
    """``model``'s folder (a hub id: in the local cache) for ``check --reference``, once
    ``layer_ids`` fit it; ValueError naming the fix."""
    folder = model if os.path.isdir(model) else cached_model_folder(model)
    if not folder or not os.path.isfile(os.path.join(folder, "config.json")):
        raise ValueError(
            f"{model} is no model folder with a config.json, nor a HF hub id in the local "
            "cache; pass the served model's folder (or `hf download` it first: the weights too)"
        )
    try:
        validate_layer_ids(layer_ids, read_model_info(folder).num_hidden_layers)
    except ValueError as e:
        raise ValueError(
            f"--layer-ids for {model}: {e}; pass the layer ids the server extracted, "
            "for the model it served"
        ) from None
    return folder
