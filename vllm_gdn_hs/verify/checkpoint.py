"""A model folder's language model as HF transformers loads it, and random weights saved in
its layout (multimodal checkpoints: under ``model.language_model.``, vision and MTP skipped).
"""

from __future__ import annotations

import json
import os

# Multimodal checkpoints keep the language model under this prefix: (text model's, checkpoint's).
_MM_PREFIX = ("model.", "model.language_model.")
_NOT_LANGUAGE_MODEL = ("model.visual.", "mtp.")


def write_config(path: str, config: dict) -> str:
    """A model folder with config.json only: enough for configs and dummy weights."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return path


def text_model(config: dict):
    """The HF causal LM of a config: its language model alone for multimodal configs."""
    from transformers import AutoConfig, AutoModelForCausalLM

    text = dict(config.get("text_config") or config)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(text.pop("model_type"), **text))


def save_random_checkpoint(path: str, config: dict, seed: int = 0) -> str:
    """A model folder holding ``config`` and random bf16 language-model weights."""
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    model = text_model(config).to(torch.bfloat16)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if "vision_config" in config:
        old, new = _MM_PREFIX
        state = {(new + k[len(old) :] if k.startswith(old) else k): v for k, v in state.items()}
    write_config(path, config)
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path


def load_text_model(path: str, device: str = "cuda", dtype=None):
    """The HF causal LM of a model folder (a multimodal one's language model) in ``dtype``
    (default bf16; fp32 upcasts the same weights)."""
    import torch
    from safetensors.torch import load_file

    dtype = dtype or torch.bfloat16
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    model = text_model(config).to(dtype)  # built in fp32: 4 bytes per parameter at peak
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.exists(os.path.join(path, "model.safetensors")):
        shards = ["model.safetensors"]
    else:
        raise FileNotFoundError(
            f"{path}: no model.safetensors or model.safetensors.index.json; pass the folder "
            "of a HF checkpoint in safetensors"
        )
    new, old = _MM_PREFIX
    # A weight is missing if none of its names was loaded (tied embeddings: one name saved).
    names: dict[int, set[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        names.setdefault(id(tensor), set()).add(name)
    loaded = set()
    for shard in (os.path.join(path, s) for s in shards):
        state = {
            (new + k[len(old) :] if "vision_config" in config and k.startswith(old) else k): v
            for k, v in load_file(shard).items()
            if not k.startswith(_NOT_LANGUAGE_MODEL)
        }
        if unexpected := model.load_state_dict(state, strict=False).unexpected_keys:
            raise ValueError(f"{shard}: weights the model does not have: {unexpected[:5]}")
        loaded |= set(state)
    if missing := [sorted(group)[0] for group in names.values() if not group & loaded]:
        raise ValueError(f"{path}: weights missing from the checkpoint: {sorted(missing)[:5]}")
    return model.to(device).eval()
