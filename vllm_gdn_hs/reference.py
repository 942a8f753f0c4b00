"""Hidden states from HF transformers on the same weights, and how close ours are.

Layer id k is the residual stream after k decoder layers (0 = embeddings), so
id k is the output of decoder layer k - 1, taken with a forward hook: for id
N that is before the final norm, unlike ``output_hidden_states[-1]``.
"""

from __future__ import annotations

import torch

from vllm_gdn_hs.files import check_rows


def _decoder_layers(model: torch.nn.Module, num_layers: int) -> torch.nn.ModuleList:
    for name, module in model.named_modules():
        if (
            isinstance(module, torch.nn.ModuleList)
            and len(module) == num_layers
            and name.endswith("layers")
            and "visual" not in name
        ):
            return module
    raise ValueError(f"no decoder layer list of length {num_layers} in {type(model).__name__}")


def load_hf_model(model_dir: str, device: str = "cuda"):
    """HF transformers' model for a folder built by :mod:`vllm_gdn_hs.testing`
    (text-only: the language model of a multimodal checkpoint)."""
    from vllm_gdn_hs.testing import load_text_model

    return load_text_model(model_dir, device)


@torch.inference_mode()
def hf_hidden_states(model, prompts: list[list[int]], layer_ids: list[int]) -> list[torch.Tensor]:
    """[T, L, H] bf16 on the CPU for each prompt, layers in the given order."""
    cfg = model.config.get_text_config()
    layers = _decoder_layers(model, cfg.num_hidden_layers)
    captured: dict[int, torch.Tensor] = {}

    def hook(layer_id):
        def fn(_module, _inputs, output):
            captured[layer_id] = output[0] if isinstance(output, tuple) else output

        return fn

    handles = [layers[i - 1].register_forward_hook(hook(i)) for i in layer_ids if i > 0]
    if 0 in layer_ids:
        handles.append(model.get_input_embeddings().register_forward_hook(hook(0)))
    device = next(model.parameters()).device
    out = []
    try:
        for prompt in prompts:
            captured.clear()
            model(input_ids=torch.tensor([prompt], device=device), use_cache=False)
            out.append(torch.stack([captured[i][0] for i in layer_ids], dim=1).cpu())
    finally:
        for h in handles:
            h.remove()
    return out


def relative_errors(got: torch.Tensor, ref: torch.Tensor) -> list[float]:
    """||got - ref|| / ||ref|| per layer, for [T, L, H] tensors."""
    got, ref = got.float(), ref.float()
    return [((got[:, i] - ref[:, i]).norm() / ref[:, i].norm()).item() for i in range(ref.shape[1])]


def file_problems(data: dict, prompt: list[int], num_layers: int, hidden: int) -> list[str]:
    """What is wrong with one extracted file, beyond numbers (empty if nothing)."""
    hs, ids = data["hidden_states"], data["token_ids"]
    problems = []
    if ids.dtype != torch.int64 or ids.tolist() != list(prompt):
        problems.append("token_ids differ from the prompt")
    if tuple(hs.shape) != (len(prompt), num_layers, hidden):
        problems.append(f"shape {tuple(hs.shape)} != {(len(prompt), num_layers, hidden)}")
    if why := check_rows(hs):  # the same check the connector makes before writing
        problems.append(why)
    return problems
