"""What the plugin needs to know about a target model, read from its HF config.

Multimodal checkpoints such as Qwen3.5/3.6 keep the language model's shape
under ``text_config``; everything here reads through it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

# HF ``layer_types`` values, grouped by the vLLM KV cache spec they get.
_LINEAR = {"linear_attention", "mamba", "mamba2", "gdn"}
_FULL = {"full_attention", "attention"}
_SLIDING = {"sliding_attention", "chunked_attention"}


class ModelConfigError(ValueError):
    pass


@dataclass(frozen=True)
class ModelInfo:
    path: str
    architectures: tuple[str, ...]
    model_type: str
    num_hidden_layers: int
    hidden_size: int
    layer_types: tuple[str, ...]
    multimodal: bool

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t in _LINEAR]

    @property
    def full_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t in _FULL]

    @property
    def sliding_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t in _SLIDING]

    @property
    def is_hybrid(self) -> bool:
        """True when the model mixes linear attention (GDN/Mamba) with attention."""
        return bool(self.linear_layers)


def _load_config_dict(model: str, trust_remote_code: bool = False) -> dict:
    path = os.path.join(model, "config.json")
    if os.path.isdir(model):
        try:
            with open(path) as f:
                return json.load(f)
        except FileNotFoundError:
            raise ModelConfigError(
                f"{model} has no config.json: is it a HF model folder?"
            ) from None
        except (OSError, json.JSONDecodeError) as e:
            raise ModelConfigError(f"cannot read {path}: {e}") from None
    if os.path.exists(model):
        raise ModelConfigError(f"{model} is not a folder: pass the model folder or a HF model id")
    if model.startswith(("/", "./", "../", "~")) or model in (".", ".."):
        raise ModelConfigError(
            f"model folder {model} does not exist: pass a HF model folder or a hub id such as "
            "Qwen/Qwen3.6-27B"
        )
    try:  # A hub id: let transformers resolve it (cache or download).
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code).to_dict()
    except Exception as e:
        raise ModelConfigError(
            f"cannot load the config of {model!r}: it is no local folder and transformers "
            f"failed: {e}"
        ) from None


def read_model_info(model: str, trust_remote_code: bool = False) -> ModelInfo:
    cfg = _load_config_dict(model, trust_remote_code)
    text = cfg.get("text_config") or cfg
    try:
        n = int(text["num_hidden_layers"])
        hidden = int(text["hidden_size"])
    except (KeyError, TypeError, ValueError):
        raise ModelConfigError(
            f"{model}: config has no num_hidden_layers/hidden_size (also looked in text_config)"
        ) from None
    layer_types = text.get("layer_types")
    if not layer_types:
        interval = text.get("full_attention_interval")
        if interval:  # Qwen3-Next style: every interval-th layer is full attention
            layer_types = [
                "full_attention" if (i + 1) % interval == 0 else "linear_attention"
                for i in range(n)
            ]
        else:
            layer_types = ["full_attention"] * n
    return ModelInfo(
        path=model,
        architectures=tuple(cfg.get("architectures") or ()),
        model_type=str(cfg.get("model_type", "")),
        num_hidden_layers=n,
        hidden_size=hidden,
        layer_types=tuple(layer_types),
        multimodal="text_config" in cfg and "vision_config" in cfg,
    )


def default_layer_ids(num_hidden_layers: int) -> list[int]:
    """speculators' default target layers: [2, N // 2, N - 3, N]."""
    n = num_hidden_layers
    return [2, n // 2, n - 3, n]


def validate_layer_ids(layer_ids: list[int], num_hidden_layers: int) -> list[int]:
    """Layer id k is the residual stream after k decoder layers (0 = embeddings)."""
    n = num_hidden_layers
    bad = [i for i in layer_ids if not 0 <= int(i) <= n]
    if bad:
        raise ValueError(
            f"layer ids {bad} are out of range: this model has {n} layers, so ids must be "
            f"in 0..{n} (id {n} is the last layer's output, before the final norm)"
        )
    dup = sorted({i for i in layer_ids if layer_ids.count(i) > 1})
    if dup:
        raise ValueError(f"layer ids {dup} are repeated; give each layer id once")
    if not layer_ids:
        raise ValueError("no layer ids given; pass at least one")
    return [int(i) for i in layer_ids]
