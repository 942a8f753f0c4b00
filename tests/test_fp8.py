"""speculators' fp8 backend: our fp8 files, read by hs-connectors and speculators as they are.

Run: python -m pytest tests/test_fp8.py -q (CPU, no network; hs-connectors and speculators
0.9.0 from PyPI). The worker side runs as on a GPU, with plain copies for the device-to-host
copy; the quantization is hs-connectors' own function. hs-connectors' FP8Transfer and
FileTransfer read the fp8 and bf16 files, and speculators' trainer dataset (ArrowDataset,
offline mode) loads a sample from each.
"""

from __future__ import annotations

import os

import pytest
import torch
from hs_connectors import FileTransfer, FP8Transfer
from hs_connectors.fp8_utils import dequantize_fp8_tensor, quantize_tensor_to_fp8
from safetensors.torch import load_file

from vllm_gdn_hs import files
from vllm_gdn_hs.config import HiddenStatesConfig
from vllm_gdn_hs.connector.metadata import (
    FinishedRequest,
    HybridHiddenStatesConnectorMetadata,
    NewRequest,
)
from vllm_gdn_hs.connector.staging import rows_and_norms
from vllm_gdn_hs.connector.worker import HybridHiddenStatesConnectorWorker
from vllm_gdn_hs.rows import row_norms
from vllm_gdn_hs.verify.check import scan

L, H = 4, 64
_gen = torch.Generator().manual_seed(0)


def rows(n: int) -> torch.Tensor:
    return (torch.randn(n, L, H, generator=_gen) * torch.rand(n, 1, 1, generator=_gen) * 8).to(
        torch.bfloat16
    )


def make_worker(folder, fp8: bool) -> HybridHiddenStatesConnectorWorker:
    return HybridHiddenStatesConnectorWorker(
        HiddenStatesConfig(shared_storage_path=str(folder), fp8=fp8),
        max_tokens=256,
        num_layers=L,
        hidden=H,
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
    )


def extract(folder, data: dict[str, torch.Tensor], fp8: bool) -> dict[str, str]:
    """Each request's rows through the worker side: its prompt in two prefill chunks, then
    three decode steps of one row (the short-run path); returns request id -> file."""
    worker = make_worker(folder, fp8)
    paths = {r: os.path.join(folder, files.file_name(r)) for r in data}
    new = [NewRequest(r, paths[r], len(d) - 3, len(d)) for r, d in data.items()]
    worker.on_metadata(HybridHiddenStatesConnectorMetadata(new_requests=new))

    def step(spans):  # spans: (request, start, end) in batch order
        hs = torch.cat([data[r][s:e] for r, s, e in spans])
        qsl = [0]
        for _, s, e in spans:
            qsl.append(qsl[-1] + e - s)
        pos = torch.cat([torch.arange(s, e) for _, s, e in spans])
        worker.save(hs, [r for r, _, _ in spans], torch.tensor(qsl), pos)

    prompt = {r: len(d) - 3 for r, d in data.items()}
    step([(r, 0, p // 2) for r, p in prompt.items()])
    step([(r, p // 2, p) for r, p in prompt.items()])
    for k in range(3):
        step([(r, p + k, p + k + 1) for r, p in prompt.items()])
    fin = [FinishedRequest(r, list(range(len(d)))) for r, d in data.items()]
    worker.on_metadata(HybridHiddenStatesConnectorMetadata(finished_requests=fin))
    worker.close(timeout=30)
    assert worker.stats.files == len(data), worker.stats
    return paths


def payload(path: str) -> int:
    return sum(
        end - begin for begin, end in (t["data_offsets"] for t in files.read_header(path).values())
    )


@pytest.fixture
def data():
    return {"a": rows(40), "b": rows(9)}


def test_fp8_file_is_hs_connectors_format_bit_for_bit(tmp_path, data):
    """Quantized per token on the device side, the file equals hs-connectors' own
    quantization of the whole request: the same scale per token over layers x hidden."""
    paths = extract(tmp_path, data, fp8=True)
    for r, d in data.items():
        got = load_file(paths[r])
        want_fp8, want_scales = quantize_tensor_to_fp8(d)
        assert got["hidden_states"].dtype == torch.float8_e4m3fn
        assert torch.equal(got["hidden_states"].view(torch.uint8), want_fp8.view(torch.uint8))
        assert got[files.SCALES].dtype == torch.float32 and got[files.SCALES].shape == (
            len(d),
            1,
            1,
        )
        assert torch.equal(got[files.SCALES], want_scales)
        assert got["token_ids"].tolist() == list(range(len(d)))


@pytest.mark.parametrize("fp8", [True, False])
def test_staging_in_chunks_changes_no_value(fp8):
    """The device side quantizes and takes norms in chunks of tokens (small temporaries):
    bit for bit what hs-connectors and the norms give for the whole step at once."""
    step = rows(50)
    got_rows, got_norms = rows_and_norms(step, fp8, chunk=7)
    want_norms = row_norms(step)
    if fp8:
        want_rows, want_scales = quantize_tensor_to_fp8(step)
        want_norms = torch.cat([want_norms, want_scales.view(-1, 1)], dim=1)
        assert torch.equal(got_rows.view(torch.uint8), want_rows.view(torch.uint8))
    else:
        assert got_rows is step  # copied out as it is
    assert torch.equal(got_norms, want_norms)


def test_hs_connectors_readers_take_our_files(tmp_path, data):
    fp8_dir, bf16_dir = tmp_path / "fp8", tmp_path / "bf16"
    fp8_dir.mkdir(), bf16_dir.mkdir()
    fp8_paths, bf16_paths = extract(fp8_dir, data, fp8=True), extract(bf16_dir, data, fp8=False)
    for r, d in data.items():
        got = FP8Transfer(fp8_dir).get_generated({"hidden_states_path": fp8_paths[r]})
        assert set(got) == {"hidden_states", "token_ids"}  # the scales are taken off
        assert torch.equal(got["hidden_states"], dequantize_fp8_tensor(*quantize_tensor_to_fp8(d)))
        rel = (got["hidden_states"].float() - d.float()).norm() / d.float().norm()
        assert 0 < rel < 0.05  # e4m3: 3 mantissa bits
        plain = FileTransfer(bf16_dir).get_generated({"hidden_states_path": bf16_paths[r]})
        assert torch.equal(plain["hidden_states"], d)
        # Data bytes per token (the header aside): L x H + 4 (scale) + 8 (token id), against
        # 2 L x H + 8 in bf16 (0.515 here; 0.500 at Qwen3.6-27B's 6 x 5,120).
        ratio = payload(fp8_paths[r]) / payload(bf16_paths[r])
        assert ratio == (L * H + 12) / (2 * L * H + 8) and ratio <= 0.52


def test_rows_are_checked_before_quantization(tmp_path, caplog):
    """An all-zero or NaN row is refused: quantized, a zero row would still be zeros, and a
    NaN one all NaN; the norms are taken from the rows before quantization."""
    zero, nan = rows(6), rows(6)
    zero[3] = 0
    nan[2, 1, 5] = float("nan")
    worker = make_worker(tmp_path, fp8=True)
    reqs = {"zero": zero, "nan": nan}
    new = [NewRequest(r, str(tmp_path / files.file_name(r)), 6) for r in reqs]
    worker.on_metadata(HybridHiddenStatesConnectorMetadata(new_requests=new))
    worker.save(
        torch.cat(list(reqs.values())), list(reqs), torch.tensor([0, 6, 12]), torch.arange(12) % 6
    )
    fin = [FinishedRequest(r, list(range(6))) for r in reqs]
    worker.on_metadata(HybridHiddenStatesConnectorMetadata(finished_requests=fin))
    worker.close(timeout=30)
    assert worker.stats.failed == 2 and os.listdir(tmp_path) == []
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "all-zero rows at token positions [3]" in text
    assert "non-finite values at token positions [2]" in text


def test_check_reads_fp8_files(tmp_path, data):
    paths = extract(tmp_path, data, fp8=True)
    out = scan(str(tmp_path), rows=True)
    assert out["complete"] == 2 and not out["problems"], out["problems"]
    assert set(out["layouts"]) == {(L, H, "F8_E4M3")}
    # fp8 hidden states without their scales are not an fp8 file.
    t = load_file(paths["a"])
    files.write_file(str(tmp_path / "noscale.safetensors"), t["hidden_states"], t["token_ids"])
    problems = scan(str(tmp_path))["problems"]
    assert any("noscale" in p and "hidden_states_scales" in why for k in problems
               for p, why in problems[k])  # fmt: skip


def test_speculators_trainer_dataset_loads_a_sample_of_each(tmp_path, data):
    """speculators' ArrowDataset in offline mode: the generator moves each file to
    hs_{index}.safetensors; the dataset reads it through the backend's transfer."""
    datasets = pytest.importorskip("datasets")
    from speculators.train.data import ArrowDataset

    for fp8, transfer_cls in ((True, FP8Transfer), (False, FileTransfer)):
        root = tmp_path / ("fp8" if fp8 else "bf16")
        hs_dir = root / "hidden_states"
        hs_dir.mkdir(parents=True)
        paths = extract(hs_dir, data, fp8=fp8)
        rows_ = []
        for i, (r, d) in enumerate(data.items()):
            os.replace(paths[r], hs_dir / f"hs_{i}.safetensors")
            n = len(d)
            rows_.append({"input_ids": list(range(n)), "loss_mask": [1] * n, "seq_len": n})
        ds = datasets.Dataset.from_list(rows_).with_format("torch")
        ds.save_to_disk(str(root))
        dataset = ArrowDataset(
            max_len=64, datapath=str(root), transfer=transfer_cls(hs_dir), on_missing="raise"
        )
        for i, d in enumerate(data.values()):
            sample = dataset[i]
            want = dequantize_fp8_tensor(*quantize_tensor_to_fp8(d)) if fp8 else d
            assert torch.equal(sample["verifier_last_hidden_states"], want[:, -1])
            assert torch.equal(sample["hidden_states"], want[:, :-1].flatten(1))
            assert sample["input_ids"].tolist() == list(range(len(d)))
