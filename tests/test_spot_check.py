"""Run: python -m pytest tests/test_spot_check.py -q (CPU, no network)

``vllm-gdn-hs check DIR --reference MODEL``: a sample of a folder's files held to HF
transformers on the same weights, with the GPU suite's bar. The folder is written with the
connector's own ``write_file``; the rows a correct run would give are HF bf16's (the GPU that
makes them cannot run here). It must pass them, bf16 and fp8, and fail the wrong states that
``check`` alone cannot see: a recycled state in one file, rows shifted by a token, another
layer. A file still being written is left out; bad input gets an error that names the fix. Each
hybrid family of tests/tiny_models.py is held to HF the same way.
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import (
    build_model,
    build_tiny_dense,
    build_tiny_hybrid,
    dense_config_dict,
    family_config_dict,
)

from vllm_gdn_hs.cli import main
from vllm_gdn_hs.files import request_path, write_file
from vllm_gdn_hs.locks import release_lock, take_lock
from vllm_gdn_hs.verify.check import run_spot_check, sample, scan
from vllm_gdn_hs.verify.checkpoint import load_text_model
from vllm_gdn_hs.verify.reference import HFReference

LAYERS = [1, 3, 6, 8]
_rng = random.Random(5)
PROMPTS = [[_rng.randrange(0, 1000) for _ in range(n)] for n in (1, 9, 17, 40)]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return build_tiny_hybrid(str(tmp_path_factory.mktemp("model") / "hybrid"))


@pytest.fixture(scope="module")
def hf_bf16(model) -> dict:
    """HF bf16's hidden states of each prompt: what a correct run writes."""
    ref = HFReference(model, LAYERS, device="cpu")
    ref.precompute(PROMPTS)
    out = {tuple(p): ref(p)[1] for p in PROMPTS}
    ref.close()
    return out


def _folder(root, hf_bf16, change=None) -> str:
    """A hidden-states folder of one file per prompt; ``change(i, rows)`` edits file i's."""
    folder = str(root)
    os.makedirs(folder, exist_ok=True)
    for i, p in enumerate(PROMPTS):
        rows = hf_bf16[tuple(p)].clone()
        if change:
            rows = change(i, rows)
        write_file(request_path(folder, f"req-{i}"), rows, torch.tensor(p, dtype=torch.int64))
    return folder


def _check(capsys, folder, model, *extra, ids=None) -> tuple[int, str]:
    ids = ids or [",".join(map(str, LAYERS))]
    args = ["check", folder, "--reference", model, "--layer-ids", *ids]
    status = main(args + list(extra))
    return status, capsys.readouterr().out


@pytest.mark.parametrize(
    "ids", [["1,3,6,8"], ["1", "3", "6", "8"], ["1, 3", "6,8"]], ids=["commas", "spaces", "both"]
)
def test_correct_files_pass(tmp_path, model, hf_bf16, capsys, ids):
    status, out = _check(capsys, _folder(tmp_path, hf_bf16), model, ids=ids)
    assert status == 0, out
    assert f"{len(PROMPTS)} of the complete files" in out
    assert out.count("within the per-file bound") == len(PROMPTS)
    assert "pooled over 4 files" in out and "passed" in out


def test_fp8_files_pass(tmp_path, model, hf_bf16, capsys):
    from hs_connectors.fp8_utils import quantize_tensor_to_fp8

    for i, p in enumerate(PROMPTS):
        q, scales = quantize_tensor_to_fp8(hf_bf16[tuple(p)])
        path = request_path(str(tmp_path), f"req-{i}")
        write_file(path, q, torch.tensor(p, dtype=torch.int64), scales)
    status, out = _check(capsys, str(tmp_path), model)
    assert status == 0, out


def test_a_recycled_state_in_one_file_fails(tmp_path, model, hf_bf16, capsys):
    """The 1-token prompt's rows are another prompt's first row: finite, not zero, wrong."""
    other = hf_bf16[tuple(PROMPTS[2])][:1]

    def recycle(i, rows):
        return other.clone() if i == 0 else rows

    folder = _folder(tmp_path, hf_bf16, recycle)
    assert main(["check", folder, "--rows"]) == 0  # the header and row checks see nothing
    capsys.readouterr()
    status, out = _check(capsys, folder, model)
    assert status == 1, out
    files = [line for line in out.splitlines() if line.startswith(f"  {folder}")]
    bad = [line for line in files if "within the per-file bound" not in line]
    assert len(files) == 4 and len(bad) == 1 and request_path(folder, "req-0") in bad[0], out
    assert "FAILED: 1 of 4 files" in out and "do not train on this folder" in out


@pytest.mark.parametrize("bug", ["shifted", "other_layer"])
def test_shifted_rows_and_another_layer_fail(tmp_path, model, hf_bf16, capsys, bug):
    def change(i, rows):
        if bug == "shifted":
            return torch.roll(rows, 1, dims=0)
        return torch.roll(rows, 1, dims=1)  # each column holds the next layer's states

    status, out = _check(capsys, _folder(tmp_path, hf_bf16, change), model)
    assert status == 1, out
    assert "FAILED: " in out


def test_each_file_is_judged_on_its_first_tokens(tmp_path, model, hf_bf16, capsys):
    """Rows past --max-tokens are not judged: a bad tail passes, a bad head does not."""

    def bad_tail(i, rows):
        if len(rows) > 16:
            rows[16:] = torch.roll(rows[16:], 1, dims=0)
        return rows

    folder = _folder(tmp_path / "tail", hf_bf16, bad_tail)
    status, out = _check(capsys, folder, model, "--max-tokens", "16")
    assert status == 0 and "first 16 tokens" in out, out
    status, out = _check(capsys, folder, model)
    assert status == 1, out


def test_files_being_written_are_left_out(tmp_path, model, hf_bf16, capsys):
    folder = _folder(tmp_path, hf_bf16)
    busy = request_path(folder, "req-3")
    fd = take_lock(busy)
    try:
        assert busy not in scan(folder)["complete_paths"]
        status, out = _check(capsys, folder, model)
    finally:
        release_lock(fd, busy, remove=True)
    assert "3 of the complete files" in out and busy not in out
    assert os.path.exists(busy) and status in (0, 1)  # check's own report counts it too
    assert sample(list(range(10)), 3) == [0, 3, 6] and sample([1, 2], 5) == [1, 2]


def test_a_truncated_file_is_left_out_and_reported(tmp_path, model, hf_bf16, capsys):
    folder = _folder(tmp_path, hf_bf16)
    broken = request_path(folder, "req-1")
    with open(broken, "r+b") as f:
        f.truncate(100)
    status, out = _check(capsys, folder, model)
    assert status == 1, out  # check's own report: a broken file, not among the complete ones
    spot = out[out.index("3 of the complete files") :]  # check's own report comes first
    assert f"  {broken}:" not in spot
    assert "1 broken" in out and "passed: as close to HF fp32" in out
    # A file that breaks after check listed it: named and left out, the rest judged.
    paths = sorted(request_path(folder, f"req-{i}") for i in range(len(PROMPTS)))
    status = run_spot_check(folder, paths, model, LAYERS, device="cpu")
    out = capsys.readouterr().out
    assert f"  {broken}: left out, unreadable" in out and "3 of the complete files" in out
    assert status == 0 and "passed: as close to HF fp32" in out


def test_bad_input_names_the_fix(tmp_path, model, hf_bf16, capsys):
    folder = _folder(tmp_path, hf_bf16)
    status = main(["check", folder, "--reference", model, "--layer-ids", "1,3,6"])
    assert status == 2 and "pass the layer ids the server extracted" in capsys.readouterr().err
    status = main(["check", folder, "--reference", str(tmp_path), "--layer-ids", "1,3,6,8"])
    assert status == 2 and "pass the served model's folder" in capsys.readouterr().err
    status = main(["check", folder, "--reference", "no-org/no-model", "--layer-ids", "1,3,6,8"])
    assert status == 2 and "nor a HF hub id in the local cache" in capsys.readouterr().err
    status = main(["check", folder, "--reference", model, "--layer-ids", "1,3,6,9"])
    assert status == 2 and "are out of range" in capsys.readouterr().err
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    (config_only / "config.json").write_text(open(os.path.join(model, "config.json")).read())
    status = main(["check", folder, "--reference", str(config_only), "--layer-ids", "1,3,6,8"])
    assert status == 2 and "no model.safetensors" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    status = main(["check", str(empty), "--reference", model, "--layer-ids", "1,3,6,8"])
    assert status == 2 and "no complete file" in capsys.readouterr().err
    for args in (["--reference", model], ["--reference", model, "--layer-ids", "1,x"]):
        with pytest.raises(SystemExit) as e:
            main(["check", folder, *args])
        assert e.value.code == 2
    assert "layer-ids" in capsys.readouterr().err


def test_sharded_checkpoint_with_vision_and_mtp_weights(tmp_path, model):
    """A HF checkpoint as published: shards, an index, vision and MTP weights beside the
    language model's; it loads the same model as the one-file folder."""
    state = load_file(os.path.join(model, "model.safetensors"))
    keys = sorted(state)
    halves = {
        "model-00001-of-00002.safetensors": keys[::2],
        "model-00002-of-00002.safetensors": keys[1::2],
    }
    folder = tmp_path / "sharded"
    folder.mkdir()
    (folder / "config.json").write_text(open(os.path.join(model, "config.json")).read())
    weight_map = {}
    for shard, names in halves.items():
        extra = (
            {"mtp.fc.weight": torch.zeros(2, 2)}
            if shard.startswith("model-00002")
            else {"model.visual.patch_embed.weight": torch.zeros(2, 2)}
        )
        save_file({**{k: state[k] for k in names}, **extra}, str(folder / shard))
        weight_map.update(dict.fromkeys([*names, *extra], shard))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))

    one = dict(load_text_model(model, "cpu").named_parameters())
    two = dict(load_text_model(str(folder), "cpu").named_parameters())
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)

    os.remove(folder / "model-00002-of-00002.safetensors")
    weight_map = {k: v for k, v in weight_map.items() if "00002" not in v}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError, match="weights missing from the checkpoint"):
        load_text_model(str(folder), "cpu")


def test_tied_embeddings_load_from_their_one_saved_name(tmp_path):
    """A model with tied embeddings (Qwen3-0.6B) saves the embedding once, not lm_head."""
    config = {**dense_config_dict(num_hidden_layers=2), "tie_word_embeddings": True}
    built = load_text_model(build_tiny_dense(str(tmp_path / "untied"), num_hidden_layers=2), "cpu")
    state = {k: v for k, v in built.state_dict().items() if k != "lm_head.weight"}
    folder = tmp_path / "tied"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    save_file(state, str(folder / "model.safetensors"))
    model = load_text_model(str(folder), "cpu")
    assert model.lm_head.weight is model.get_input_embeddings().weight
    assert torch.equal(model.lm_head.weight, state["model.embed_tokens.weight"])


# Qwen3.5 dense is the module's model; Qwen3.5-MoE's text-only class has the same text model.
NEW_FAMILIES = ["qwen3_5_moe", "qwen3_next", "nemotron_h", "nemotron_h_moe"]


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_each_family_held_to_hf(tmp_path, capsys, family):
    """`check --reference` on each hybrid family's tiny model (weights by HF transformers' own
    class), layer ids 0 and N unsorted: HF bf16's rows pass."""
    model = build_model(str(tmp_path / "model"), family_config_dict(family))
    folder = str(tmp_path / "hidden_states")
    ids, prompts = [8, 0, 3, 5], PROMPTS[1:3]
    ref = HFReference(model, ids, device="cpu")
    ref.precompute(prompts)
    for i, p in enumerate(prompts):
        write_file(request_path(folder, f"req-{i}"), ref(p)[1], torch.tensor(p))
    ref.close()
    status, out = _check(capsys, folder, model, ids=["8,0,3,5"])
    assert status == 0, out
    assert out.count("within the per-file bound") == len(prompts), out
