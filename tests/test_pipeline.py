"""Run: python -m pytest tests/test_pipeline.py -q (CPU, no network; speculators and hs-connectors
0.9.0): the CPU parts of tools/gpu_runs/pipeline.py.

speculators' real prepare-data step (its CLI, in this process) renders the tiny dataset on
vLLM's own GPU-less render server (``vllm launch render``, started here on vLLM's CPU
platform) with the locally built tokenizer and processor files; the command lines the
pipeline builds are parsed by speculators' own parsers (the trainer's TrainConfig, the
generator's typer command), by our launcher and by vLLM's ``serve`` parser; the trainer's log
lines come from speculators' own formatter; the resume check and the verdict on made-up runs.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import subprocess
import sys
import time
import urllib.request

import launched  # tests/gpu/launched.py (pytest's pythonpath, pyproject.toml)
import pipeline  # tools/gpu_runs/pipeline.py (the same)
import pytest
import soak
from tiny_models import hybrid_config_dict, write_config

TESTS = os.path.dirname(os.path.abspath(__file__))
CONVERSATIONS = 40
# Run with tests/ on PYTHONPATH (render_server below).
RENDER = """
import sys
import cpu_engine  # tests/cpu_engine.py: vLLM's CPU platform, no GPU here
from vllm.entrypoints.cli.main import main
sys.argv = ["vllm", "launch", "render", *sys.argv[1:]]
main()
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny hybrid's config, tokenizer, chat template and processor files (no weights:
    rendering and speculators' processor need none)."""
    path = str(tmp_path_factory.mktemp("model"))
    write_config(path, hybrid_config_dict())
    soak.build_tokenizer(path)
    return pipeline.write_processor_files(path)


@pytest.fixture(scope="module")
def render_server(model_dir, tmp_path_factory):
    """vLLM's render server, started when the module starts (its startup overlaps the other
    tests); yields its URL and process once /health answers."""
    port = launched.free_port()
    log_path = tmp_path_factory.mktemp("render") / "render.log"
    log = open(log_path, "w")
    cmd = [sys.executable, "-c", RENDER, model_dir, "--port", str(port), "--host", "127.0.0.1"]
    cmd += ["--language-model-only"]
    env = pipeline.child_env()
    env["PYTHONPATH"] = os.pathsep.join([TESTS, env["PYTHONPATH"]])
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    try:
        yield {"url": f"http://127.0.0.1:{port}", "proc": proc, "log": log_path}
    finally:
        pipeline.kill_group(proc, wait=30)
        log.close()


@pytest.fixture(scope="module", autouse=True)
def _start_render_early(render_server):
    return render_server


def wait_healthy(server, timeout=240):
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(server["url"] + "/health", timeout=2):
                return
        except OSError:
            if server["proc"].poll() is not None or time.monotonic() > deadline:
                text = server["log"].read_text()[-3000:]
                if "invalid choice: 'launch'" in text or "invalid choice: 'render'" in text:
                    pytest.skip("this vLLM has no `vllm launch render`")
                pytest.fail(f"render server not healthy:\n{text}")
            time.sleep(0.5)


# -- the dataset ---------------------------------------------------------------------------


def test_dataset_is_fixed_by_its_seed(tmp_path):
    a, b, c = (tmp_path / n for n in ("a.jsonl", "b.jsonl", "c.jsonl"))
    turns = pipeline.write_dataset(str(a), 200, seed=0)
    assert pipeline.write_dataset(str(b), 200, seed=0) == turns
    pipeline.write_dataset(str(c), 200, seed=1)
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()
    rows = [json.loads(line) for line in a.read_text().splitlines()]
    assert len(rows) == 200 and 200 < turns < 300  # one in five has a second turn
    for row in rows:
        conv = row["conversations"]
        assert [t["from"] for t in conv] == ["human", "gpt"] * (len(conv) // 2)
        for q, a_ in zip(conv[::2], conv[1::2], strict=True):
            task, words = q["value"].split(": ")
            assert a_["value"] == pipeline.answer(task, words.split())
            assert q["value"].isascii() and len(q["value"]) < 80


# -- the command lines, parsed by their programs' own parsers -------------------------------


def test_train_command_is_accepted_by_speculators(tmp_path):
    from speculators.train.config import TrainConfig

    common = dict(model="/m", prepared="/p", seed=2, steps=300, epochs=11, save=str(tmp_path))
    for drafter in pipeline.DRAFTERS:
        for backend in ("file", "fp8"):
            argv = pipeline.train_args(
                hidden_states="/hs", backend=backend, drafter=drafter, **common
            )
            assert argv[0] == "train"
            cfg = TrainConfig.resolve(argv[1:])  # what `speculators train` hands on
            f = cfg.flatten()
            assert f["speculator_type"] == drafter and f["hidden_states_backend"] == backend
            assert f["hidden_states_path"] == "/hs" and f["on_missing"] == "raise"
            assert f["target_layer_ids"] == pipeline.LAYERS
            assert f["verifier_name_or_path"] == "/m" and f["data_path"] == "/p"
            assert (f["max_steps"], f["epochs"], f["seed"]) == (300, 11, 2)
            assert f["num_layers"] == pipeline.DRAFT_LAYERS[drafter]
            assert f["checkpoint_freq"] == 11 and f["no_resume_from_checkpoint"]
    online = pipeline.train_args(
        hidden_states="/empty", backend="file", drafter="eagle3", online_endpoint="http://h/v1",
        **common,
    )  # fmt: skip
    f = TrainConfig.resolve(online[1:]).flatten()
    assert (f["on_missing"], f["vllm_endpoint"], f["on_generate"]) == (
        "generate",
        "http://h/v1",
        "delete",
    )


def test_generate_command_is_accepted_by_speculators():
    import typer
    from speculators.cli import app

    argv = pipeline.generate_args("/m", "http://h:1/v1", "/p", "/o", "file", concurrency=2)
    command = typer.main.get_command(app).commands[argv[0]]
    params = command.make_context(argv[0], argv[1:]).params
    assert params["model"] == "/m" and params["endpoint"] == "http://h:1/v1"
    assert (params["preprocessed_data"], params["output"]) == ("/p", "/o")
    assert params["concurrency"] == 2 and params["validate_outputs"] and params["fail_on_error"]
    assert pipeline.speculators(*argv)[1:4] == ["-m", "speculators", "generate-offline-data"]


@pytest.mark.parametrize("backend", ["file", "fp8"])
def test_server_command_is_accepted_by_our_launcher_and_vllm(hybrid_model, backend):
    from harness import serve_parser

    from vllm_gdn_hs.cli import launch

    cmd = pipeline.server_command(hybrid_model, "/data/hs", 8123, backend)
    assert cmd[1:4] == ["-m", "vllm_gdn_hs.cli", "launch"]
    serve = launch.build_plan(launch.parse_args(cmd[4:])).command
    assert serve[3:5] == ["serve", hybrid_model]
    args = serve_parser().parse_args(serve[4:])
    assert args.port == 8123 and args.enforce_eager and args.language_model_only
    assert not args.skip_tokenizer_init  # prepare-data renders on this server
    kv = json.loads(serve[serve.index("--kv_transfer_config") + 1])
    assert kv["kv_connector_extra_config"]["shared_storage_path"] == "/data/hs"
    assert kv["kv_connector_extra_config"].get("fp8", False) == (backend == "fp8")
    spec = json.loads(serve[serve.index("--speculative_config") + 1])
    ids = spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"]
    assert ids == pipeline.LAYERS + [pipeline.NUM_LAYERS]


# -- the trainer's log ---------------------------------------------------------------------


def _speculators_log(records: list, width: int) -> str:
    """``records`` logged as the trainer logs them: speculators' FormatDictFilter on rich's
    RichHandler (speculators' setup_root_logger), into a console ``width`` wide."""
    from rich.console import Console
    from rich.logging import RichHandler
    from speculators.train.logger import FormatDictFilter

    buf = io.StringIO()
    handler = RichHandler(console=Console(file=buf, width=width))
    handler.addFilter(FormatDictFilter())
    log = logging.getLogger("test_pipeline.metrics")
    log.addHandler(handler)
    log.propagate, level = False, log.level
    log.setLevel(logging.INFO)
    try:
        for rec in records:
            log.info(rec, extra={"step": rec.get("global_step", 0)})
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    return buf.getvalue()


def _train_record(step: int, loss: float) -> dict:
    train = {"loss": loss, "loss_0": loss * 0.9, "loss_1": loss * 1.1, "full_acc_0": 0.3}
    train.update(error_records=0.0)
    profile = {k: 12.5 for k in ("fetch_ms", "fwd_ms", "bwd_ms", "opt_ms", "step_ms")}
    lr = {"Muon": 1e-3, "AdamW": 1e-3}
    return {"train": train, "profile": profile, "epoch": 0, "lr": lr, "global_step": step}


@pytest.mark.parametrize("width", [80, 2000])  # 80: rich wraps each record
def test_losses_parsed_from_speculators_log_lines(width):
    losses = [5.0 - 0.01 * i for i in range(40)] + [1.23e-4, 1234.5]
    records = [_train_record(i, x) for i, x in enumerate(losses)]
    records.insert(20, {"val": {"loss_epoch": 3.25, "full_acc_0_epoch": 0.4}, "epoch": 0})
    records.append({"val": {"loss_epoch": 2.5}, "epoch": 1})
    text = "Training epoch 1/2 started\n" + _speculators_log(records, width)
    parsed = pipeline.parse_losses(text)
    assert [s for s, _ in parsed["train"]] == list(range(len(losses)))
    want = [float(f"{x:.3f}") if 1e-3 <= abs(x) <= 999 else float(f"{x:.2e}") for x in losses]
    assert [x for _, x in parsed["train"]] == want
    assert parsed["val"] == [3.25, 2.5]
    fig = pipeline.loss_figures(parsed)
    assert fig["steps"] == 42 and fig["last_step"] == 41 and fig["final"] == 2.5
    assert fig["start"] == pytest.approx(sum(want[:10]) / 10, abs=1e-5)
    assert fig["end"] == pytest.approx(sum(want[-10:]) / 10, abs=1e-5)


def test_loss_figures_without_validation_or_steps():
    parsed = {"train": [(i, 4.0 - i / 100) for i in range(100)], "val": []}
    fig = pipeline.loss_figures(parsed)
    assert fig["final"] == fig["end"] == pytest.approx(3.055) and fig["start"] == 3.955
    assert pipeline.loss_figures({"train": [], "val": []}) == {"steps": 0}


# -- the resume check ----------------------------------------------------------------------


def _write(folder, *indices):
    for i in indices:
        (folder / f"hs_{i}.safetensors").write_bytes(b"x" * (i + 1))


def test_resume_check(tmp_path):
    _write(tmp_path, 0, 1, 2, 3)
    first = pipeline.snapshot(str(tmp_path))
    _write(tmp_path, 4, 5, 6, 7)
    good = pipeline.resume_check(first, pipeline.snapshot(str(tmp_path)), [], 8)
    assert good["ok"] and (good["after_kill"], good["final"], good["redone"]) == (4, 8, 0)

    os.remove(tmp_path / "hs_2.safetensors")  # redone: a new inode
    _write(tmp_path, 2)
    st = os.stat(tmp_path / "hs_3.safetensors")  # touched: a new mtime
    os.utime(tmp_path / "hs_3.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    os.remove(tmp_path / "hs_7.safetensors")
    _write(tmp_path, 9)
    bad = pipeline.resume_check(first, pipeline.snapshot(str(tmp_path)), ["x.tmp"], 8)
    assert not bad["ok"] and (bad["redone"], bad["missing"], bad["unexpected"]) == (2, 1, 2)
    assert any("redone" in p for p in bad["problems"])

    everything = pipeline.snapshot(str(tmp_path))
    not_cut = pipeline.resume_check(everything, everything, [], len(everything))
    assert not not_cut["ok"] and "not exercised" in not_cut["problems"][0]


# -- the verdict ---------------------------------------------------------------------------


def _runs(finals: dict, start=5.0, end=2.0, steps=300) -> dict:
    """name -> run, from {(drafter, source): [final loss per seed]}."""
    runs = {}
    for (drafter, source), values in finals.items():
        for seed, final in enumerate(values):
            fig = dict(steps=steps, start=start, end=end, final=final)
            runs[f"{drafter}-{source}-s{seed}"] = dict(
                drafter=drafter, source=source, seed=seed, steps=steps, rc=0, figures=fig
            )
    return runs


OK_STEPS = {"build": {"status": "ok"}, "online": {"status": "ok"}}


def test_judge_passes_within_the_noise():
    finals = {("eagle3", "hf"): [2.00, 2.10, 2.05], ("eagle3", "file"): [2.08, 2.12]}
    finals |= {("eagle3", "fp8"): [2.02], ("dflash", "hf"): [3.0, 3.2]}
    finals |= {("dflash", "file"): [3.25], ("dflash", "fp8"): [3.05]}
    v = pipeline.judge(OK_STEPS, _runs(finals), ["file", "fp8"])
    assert v["passed"], v["failures"]
    e = v["comparison"]["eagle3"]
    assert e["hf_spread"] == pytest.approx(0.1) and e["noise"] == pytest.approx(0.1)
    assert e["file"]["diff_vs_hf"] == pytest.approx(0.05) and e["file"]["within_noise"]


def test_judge_failures_name_their_reason():
    finals = {("eagle3", "hf"): [2.0, 2.01], ("eagle3", "file"): [2.3]}
    v = pipeline.judge(OK_STEPS, _runs(finals), ["file"])
    assert not v["passed"] and "outside the noise" in v["failures"][0]
    # the floor: seeds that agree exactly still leave 1% of the loss
    assert v["comparison"]["eagle3"]["noise"] == pytest.approx(0.02005)

    runs = _runs({("eagle3", "hf"): [2.0, 2.1], ("eagle3", "file"): [2.05]}, start=2, end=2.5)
    runs["eagle3-file-s0"]["rc"] = 1
    steps = dict(OK_STEPS, prepare={"status": "failed", "error": "boom"})
    steps["generate_file_resume"] = {"status": "failed", "problems": ["3 samples missing"]}
    v = pipeline.judge(steps, runs, ["file", "fp8"])
    text = "\n".join(v["failures"])
    assert "step prepare: failed (boom)" in text and "3 samples missing" in text
    assert "eagle3-file-s0: exit status 1" in text and "loss did not fall" in text
    assert "eagle3 on fp8: no finished run" in text and "eagle3 on file: no finished run" in text

    short = _runs({("dflash", "hf"): [1.0], ("dflash", "file"): [1.0]})
    short["dflash-file-s0"]["figures"]["steps"] = 120
    text = "\n".join(pipeline.judge(OK_STEPS, short, ["file"])["failures"])
    assert "120 of 300 steps logged" in text and "no noise to measure" in text


def test_epochs_hold_the_steps():
    assert pipeline.epochs_for(300, 27) == 12 and pipeline.epochs_for(300, 300) == 1
    assert pipeline.epochs_for(20, 0) == 20


# -- speculators' prepare-data, for real (last: the render server starts with the module) ---


def test_prepare_data_renders_on_vllm_and_masks_the_answers(model_dir, render_server, tmp_path):
    from datasets import load_from_disk
    from speculators.cli import app
    from transformers import AutoTokenizer

    data, out = str(tmp_path / "chat.jsonl"), str(tmp_path / "prepared")
    turns = pipeline.write_dataset(data, CONVERSATIONS, seed=0)
    wait_healthy(render_server)
    # workers=0: datasets maps in this process. With 1 it forks a pool from this process, which
    # has vLLM's and torch's threads; such a child has died (SIGSEGV importing httpcore).
    argv = pipeline.prepare_args(model_dir, data, out, render_server["url"], workers=0)
    with contextlib.suppress(SystemExit):
        app(argv, standalone_mode=False)  # speculators' CLI, in this process
    rows = load_from_disk(out)
    assert len(rows) == turns  # one row per assistant turn, none dropped
    assert {"input_ids", "loss_mask", "seq_len"} <= set(rows.column_names)
    assert "messages" in rows.column_names  # a processor: Qwen3.5's multimodal path
    tok = AutoTokenizer.from_pretrained(model_dir)
    answers = {
        t["value"]
        for line in open(data)
        for t in json.loads(line)["conversations"]
        if t["from"] == "gpt"
    }
    for row in rows.with_format(None):
        ids, mask = row["input_ids"], row["loss_mask"]
        assert row["seq_len"] == len(ids) == len(mask) < pipeline.SEQ_LENGTH
        first = mask.index(1)
        assert all(mask[first:]) and not any(mask[:first])  # the last turn is supervised
        text = tok.decode(ids[first:])
        assert text.endswith("<|im_end|>\n") and text[: -len("<|im_end|>\n")] in answers
        assert tok.decode(ids[:first]).endswith("<|im_start|>assistant\n")
        assert tok.decode(ids).startswith("<s><|im_start|>user\n")
    per_epoch = pipeline.steps_per_epoch(out, seed=0, total_seq_len=512)
    assert 1 <= per_epoch <= len(rows)


def test_fp8_files_are_generated_without_speculators_validation():
    argv = pipeline.generate_args("/m", "http://h:1/v1", "/p", "/o", "fp8")
    assert "--validate-outputs" not in argv and "--fail-on-error" in argv
