"""benchmarks/bench.py and logparse.py: log parsing against the writer's real log lines; the
--budget rule; the status of a variant that did not finish.

Run: python -m pytest tests/test_bench.py -q
Covers: the writer's progress and shutdown lines, as the worker side logs them through
vLLM's logger, are found in an engine log and stored in the record (writer_log); plain-v1 is
plain vLLM on the V1 model runner.
"""

from __future__ import annotations

import logging
import os
import re
import time

import bench  # benchmarks/ (pytest's pythonpath, pyproject.toml)
import logparse
import pytest
import records
import torch

from vllm_gdn_hs.config import HiddenStatesConfig
from vllm_gdn_hs.connector.metadata import (
    FinishedRequest,
    HybridHiddenStatesConnectorMetadata,
    NewRequest,
)
from vllm_gdn_hs.connector.worker import HybridHiddenStatesConnectorWorker

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_writer_lines_parsed_from_the_log(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    w = HybridHiddenStatesConnectorWorker(
        HiddenStatesConfig(shared_storage_path=str(tmp_path)),
        max_tokens=8,
        num_layers=2,
        hidden=4,
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
    )
    path = str(tmp_path / "a.safetensors")
    w.on_metadata(HybridHiddenStatesConnectorMetadata(new_requests=[NewRequest("a", path, 3)]))
    w.logged = (0.0, 0, 0)  # the last progress line is long past
    w.save(torch.randn(3, 2, 4).bfloat16(), ["a"], torch.tensor([0, 3]), torch.arange(3))
    w.on_metadata(
        HybridHiddenStatesConnectorMetadata(finished_requests=[FinishedRequest("a", [1, 2, 3])])
    )
    w.close(timeout=30)
    log = "\n".join(f"INFO 11-30 [connector.py:1] {r.getMessage()}" for r in caplog.records)
    info = logparse.writer_info(log)
    assert info["writer_log"].startswith("shut down; 1 files"), log
    assert "1 steps; per step" in info["writer_log"]
    progress = "\n".join(line for line in log.splitlines() if "shut down" not in line)
    assert logparse.writer_info(progress)["writer_log"].startswith("0 files (0.00 GB) written")
    assert logparse.writer_info("no writer here") == {}


def test_budget_does_not_start_a_variant_that_cannot_finish():
    # Run 18 on the H200: plain with CUDA graphs took 270 s from start to its last record;
    # ours got the 230 s left and was cut off while starting. Now it is not started.
    assert not bench.can_start(230, 270)
    assert bench.can_start(300, 270)
    assert bench.can_start(60, 0) and not bench.can_start(40, 0)  # first variant: 30 s floor


def test_a_cut_variant_says_how_far_it_got():
    # Run 22 on the H200: upstream's engine was ready 55 s after its worker started, began
    # mixed-out256 a second later, and the --budget cut it 175 s into generating.
    t0 = 1000.0
    log = "\n".join(
        [
            "INFO ... [core.py:347] init engine (profile, create kv cache, warmup model) took 5 s",
            "Capturing CUDA graphs (decode, FULL):  29%|##9  | 15/51",
            logparse.ready_mark("upstream", t0 + 55),
            logparse.generating_mark("upstream", "mixed-out256", t0 + 56),
        ]
    )
    detail = logparse.cut_detail(log, t0, t0 + 231, "mixed-out256", 405_571)
    assert detail == (
        "engine ready after 55 s; mixed-out256 not done after 175 s of generating: "
        "under 2,318 tok/s"
    )
    assert logparse.cut_detail(log, t0, t0 + 231, "mixed", 405_571) == (
        "engine ready after 55 s; mixed not begun"
    )
    # Run 20: both CUDA-graph engines were still starting when the 310 s ran out.
    assert logparse.cut_detail("Capturing CUDA graphs", t0, t0 + 310, "mixed", 1) == (
        "its engine was not ready after 310 s"
    )


def test_main_records_how_far_a_cut_variant_got(tmp_path, monkeypatch):
    """bench.main() as run, with the worker process replaced: one cut by the --budget after its
    engine was ready and its workload had begun, one that crashed (no detail: not a cut)."""
    calls = []

    def fake_run_child(cmd, log_path, timeout, env):
        now = time.time()
        log = "\n".join(
            [
                "INFO ... [core.py:347] init engine (profile, create kv cache, warmup model)",
                logparse.ready_mark("upstream", now + 0.1),
                logparse.generating_mark("upstream", "4x64", now + 0.2),
            ]
        )
        calls.append(timeout)
        with open(log_path, "w") as f:  # the tee's file, which bench keeps compressed
            f.write(log)
        time.sleep(0.5)
        return (None if len(calls) == 1 else 1), log

    monkeypatch.setattr(bench, "run_child", fake_run_child)
    results = tmp_path / "r.json"
    argv = [
        "--shape", "tiny", "--variants", "upstream", "--workloads", "4x64", "--eager",
        "--out-dir", str(tmp_path / "hs"), "--model-root", str(tmp_path / "m"),
        "--log-dir", str(tmp_path / "logs"), "--results", str(results),
    ]  # fmt: skip
    assert bench.main([*argv, "--budget", "300"]) == 0
    assert bench.main(argv) == 0
    cut, crashed = records.load_records(str(results))
    # the --budget less 20 s to stop, less what building the tiny model took on this machine
    assert 260 < calls[0] <= 280
    assert re.fullmatch(
        rf"cut off by --budget after {calls[0]:.0f} s \(not a fault: time ran out\); "
        r"engine ready after 0 s; "
        r"4x64 not done after 0 s of generating: under [\d,]+ tok/s",
        cut["error"],
    ), cut["error"]
    assert cut["error_summary"] == cut["error"]
    assert crashed["error"] == "worker exited with status 1"
    assert cut["log"].endswith(".log.gz") and not os.path.exists(cut["log"][: -len(".gz")])
    assert logparse.ready_mark("upstream", 0)[:20] in logparse.read_log(cut["log"])


def test_a_run_log_is_kept_compressed_and_read_back_either_way(tmp_path):
    """compress_log replaces a finished log by LOG.gz, the same bytes for the same log (no name
    or time in the header); read_log reads either, by either name, ANSI codes stripped."""
    path = str(tmp_path / "engine.log")
    for name in ("engine.log", "again.log"):
        with open(tmp_path / name, "w") as f:
            f.write("\x1b[1;36mINFO\x1b[0m KV cache size: 1,024 tokens\n")
    assert logparse.compress_log(path) == path + ".gz" and not os.path.exists(path)
    again = logparse.compress_log(str(tmp_path / "again.log"))
    assert (tmp_path / "engine.log.gz").read_bytes() == (tmp_path / "again.log.gz").read_bytes()
    assert (
        logparse.read_log(path) == logparse.read_log(again) == "INFO KV cache size: 1,024 tokens\n"
    )
    assert logparse.compress_log(path) == path  # nothing there (any more): nothing done


def test_the_stored_run_logs_are_compressed_and_their_records_read_them():
    """benchmarks/results and tests/results keep no raw run log; every compressed one reads
    back, and a record's log path (written as .log) finds its compressed log."""
    roots = [os.path.join(REPO, "benchmarks", "results"), os.path.join(REPO, "tests", "results")]
    logs = [os.path.join(d, f) for r in roots for d, _, fs in os.walk(r) for f in fs]
    assert not [p for p in logs if p.endswith(".log")]
    kept = [p for p in logs if p.endswith(".log.gz")]
    assert kept and all(logparse.read_log(p) for p in kept)
    named = {r.get("log") for r in records.load_records(os.path.join(roots[0], "h200.json"))}
    found = [n for n in named if n and os.path.exists(os.path.join(REPO, n) + ".gz")]
    assert found and all(logparse.read_log(os.path.join(REPO, n)) for n in found)


def test_a_variant_without_records_gets_a_status():
    # The status that report.py reads, for each way a variant can end without its records.
    class Args:
        budget, timeout = 300.0, 540.0

    def why(problem=None, out_of_budget=False, rc=None, timeout=540.0, slowest_s=0.0):
        return bench.why_missing(Args, problem, out_of_budget, rc, timeout, 100.0, slowest_s)

    assert why("skipped: no plugin") == (records.SKIPPED, "skipped: no plugin")
    assert why(out_of_budget=True, slowest_s=270)[0] == records.SKIPPED
    assert why(timeout=280) == (
        records.CUT,
        "cut off by --budget after 280 s (not a fault: time ran out)",
    )
    assert why() == (records.TIMED_OUT, "timed out after 540 s (--timeout)")
    assert why(rc=1) == (records.FAILED, "worker exited with status 1")


def test_plain_v1_is_plain_vllm_on_the_v1_model_runner(tmp_path, monkeypatch):
    """plain-v1 runs plain vLLM (no connector, no plugins) with vLLM's own switch to the V1
    model runner, which ours runs on: the two baselines tell the runner's share from ours."""
    import plan
    import report
    import worker

    args = bench.parse_args(["--shape", "tiny", "--variants", "plain,plain-v1", "--eager"])
    d = str(tmp_path)
    plans = {v: plan.make_plan(args, v, d, d, "bench.py") for v in args.variants}
    assert worker.engine_kwargs(plans["plain-v1"].spec) == worker.engine_kwargs(plans["plain"].spec)
    assert plans["plain-v1"].env["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    assert "VLLM_USE_V2_MODEL_RUNNER" not in plans["plain"].env
    assert plans["plain-v1"].env["VLLM_PLUGINS"] == "" and plans["plain-v1"].problem is None
    import vllm.envs as envs

    if not hasattr(envs, "VLLM_USE_V2_MODEL_RUNNER"):
        pytest.skip("this vLLM has no VLLM_USE_V2_MODEL_RUNNER (0.34.0: V2 is its one runner)")
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    assert envs.VLLM_USE_V2_MODEL_RUNNER is False  # as vLLM reads it: V1, whatever it would pick
    # In a table plain-v1 writes nothing and divides by plain of its run; its runner is named.
    base = dict(
        gpu="H200", shape="27b", layers=[1], workload="128x1024", mode="cudagraph",
        versions={"vllm": "0.33.0", "transformers": "5.17.0"}, write_target="tmpfs",
        date="2026-12-02", run="run29", status="ok", num_requests=128, prompt_tokens=131072,
        processed_tokens=131072, output_tokens=128, model={}
    )  # fmt: skip
    rs = [
        dict(base, variant="plain", gen_s=10.0, engine_config=dict(model_runner="v2")),
        dict(base, variant="plain-v1", gen_s=10.1, engine_config=dict(model_runner="v1")),
    ]
    assert report.plain_for(rs[1], rs) is rs[0]
    assert report.select(rs) == rs
    assert report.note(rs[1]) == "run run29; model runner V1"


def test_pyspy_summary_counts_threads_stages_and_leaves():
    import pyspy_summary

    raw = [
        "thread (1): MainThread;run_engine_core (core.py:1);step_with_batch_queue (core.py:2);"
        "execute_model (gpu_model_runner.py:3);forward (qwen.py:4);fused_add_rms_norm (ln.py:5) 6",
        "thread (1): MainThread;step_with_batch_queue (core.py:2);sample_tokens (x.py:6) 3",
        "thread (9): Thread-2 (_drain_loop);_drain_loop (worker.py:7);_on_rows (worker.py:8) 1",
        "not a stack line",
    ]
    s = pyspy_summary.summarize(raw)
    assert s["total"] == 10 and s["threads"]["thread (1): MainThread"] == 9
    assert s["stages"]["execute_model"] == 6 and s["stages"]["sample_tokens"] == 3
    assert s["stages"]["_on_rows"] == 1 and s["leaves"]["fused_add_rms_norm"] == 6
    assert "60.0%  execute_model" in pyspy_summary.render(s)


def test_the_chat_workload_is_seeded_and_chat_shaped():
    """chat: the same lengths and ids for a seed, others for another; most prompts under 1,000
    tokens with a tail to 8,192, inside [16, 8192], prefill only; the four older workloads keep
    their lengths (mixed: 405,571 tokens)."""
    import statistics

    import workloads

    a, b = workloads.make_workload("chat", 0), workloads.make_workload("chat", 0)
    assert a.lengths == b.lengths and workloads.prompt_ids(a, 0) == workloads.prompt_ids(b, 0)
    assert workloads.make_workload("chat", 1).lengths != a.lengths
    n = len(a.lengths)
    assert n == workloads.CHAT_N and a.max_tokens == 1 and a.output_tokens == 0
    assert all(16 <= x <= 8192 for x in a.lengths)
    assert 300 <= statistics.median(a.lengths) <= 500
    assert sum(x < 1000 for x in a.lengths) >= 0.7 * n
    assert max(a.lengths) >= 4096  # the long tail
    ids = workloads.prompt_ids(a, 0)
    assert [len(p) for p in ids] == a.lengths
    assert workloads.make_workload("mixed", 0).stats()["prompt_tokens"] == 405_571
    assert workloads.make_workload("mixed-out256", 0).output_tokens == 256
    assert workloads.make_workload("32x8192", 0).stats()["prompt_tokens"] == 262_144


def test_default_layer_ids_follow_one_rule_40_layers_included():
    """bench.py's default ids: speculators' EAGLE-3 spread for 64 layers, scaled to the others
    (the 32- and 8-layer lists written before the rule are what it gives); 40 layers for the
    35b-a3b shape. The launcher keeps its own rule (speculators' defaults)."""
    import workloads

    from vllm_gdn_hs.layer_ids import target_layer_ids

    assert workloads.DEFAULT_LAYERS[64] == [1, 16, 31, 46, 61, 64]
    assert workloads.DEFAULT_LAYERS[32] == [1, 8, 16, 23, 31, 32]
    assert workloads.DEFAULT_LAYERS[8] == [1, 2, 4, 6, 7, 8]
    assert workloads.DEFAULT_LAYERS[40] == [1, 10, 20, 29, 39, 40]
    assert bench.parse_args(["--shape", "35b-a3b"]).layers == [1, 10, 20, 29, 39, 40]
    assert target_layer_ids(None, 40) == [2, 20, 37, 40]


def test_the_35b_a3b_shape_builds_in_vllm(tmp_path, capsys):
    """Qwen3.5-35B-A3B's shape as bench.py writes its folder (config.json only): vLLM's
    ModelConfig and VllmConfig take it as the MoE class, 40 layers of 256 experts; its layers,
    built on the meta device with our connector and HMA on, make 30 GDN layers in three state
    groups and 10 attention layers; vLLM builds as many parameters as roofline.py counts
    (34.7B, no vision tower); the launcher's plan takes the folder with its 40-layer ids."""
    import harness
    import roofline
    import workloads
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    from vllm_gdn_hs.cli import launch

    folder = workloads.write_model_dir(str(tmp_path), "35b-a3b")
    kw = dict(enable_prefix_caching=False, max_model_len=8448)
    cfg = harness.engine_config(
        folder, connector=harness.OURS, layer_ids=workloads.DEFAULT_LAYERS[40], **kw
    )
    text = cfg.model_config.hf_text_config
    assert cfg.model_config.architectures == ["Qwen3_5MoeForConditionalGeneration"]
    assert cfg.model_config.is_moe and not cfg.scheduler_config.disable_hybrid_kv_cache_manager
    assert (text.hidden_size, text.num_hidden_layers, text.num_experts) == (2048, 40, 256)
    assert (text.num_experts_per_tok, text.shared_expert_intermediate_size) == (8, 512)
    groups = harness.kv_cache_config(cfg).kv_cache_groups
    assert [(type(g.kv_cache_spec), len(g.layer_names)) for g in groups] == [
        *[(MambaSpec, 10)] * 3,
        (FullAttentionSpec, 10),
    ]
    plain = harness.engine_config(folder, connector=None, layer_ids=None, **kw)
    counted = roofline.total_params(workloads.model_summary("35b-a3b"))
    assert abs(harness.model_parameters(plain) - counted) < 1e-5 * counted  # norms, A_log, ...
    rc = launch.main([folder, "--hidden-states-path", str(tmp_path / "hs"), "--dry-run"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert '"eagle_aux_hidden_state_layer_ids": [2, 20, 37, 40]' in out


WARMUP_LINE = (
    "(EngineCore pid=7) INFO 12-06 10:00:00 [extensible_kv_cache.py:694] Memory after warmup: "
    "1.5 GiB free, 60.25 GiB committed to the KV cache, 2.41 GiB kept for transient activations "
    "(2.41 GiB allocated at peak, 0.0 GiB of torch reservation growth); 3861 KV cache blocks "
    "(60.25 GiB) fit within the requested 71.0 GiB. Torch may reserve up to 5.0 GiB."
)
GDN_LINE = (
    "(EngineCore pid=7) INFO 12-06 10:00:00 [qwen_gdn_linear_attn.py:379] Using FlashInfer GDN "
    "prefill kernel (requested=auto, head_k_dim=128)."
)


def test_bench_records_name_backend_settings_and_warmup_peak(tmp_path, monkeypatch):
    """bench.main() with the worker replaced, two GDN backends: one engine start per variant
    and backend, and every record names the backend vLLM used (from its log; the requested
    one where the log has none), step and batch sizes, prefix caching, KV sizing, runner, mode,
    the warm-up peak and KV blocks, date, commit and vLLM version."""
    starts = []

    def fake_run_child(cmd, log_path, timeout, env):
        import json

        with open(cmd[-1]) as f:
            spec = json.load(f)
        starts.append((spec["variant"], spec["gdn_backend"]))
        engine = dict(
            max_num_batched_tokens=16384,
            max_num_seqs=256,
            prefix_caching=False,
            model_runner="v2",
            extensible_kv_cache=True,
        )
        with open(spec["result_file"], "w") as f:
            stats = bench.make_workload("4x64", 0).stats()
            measured = dict(gen_s=1.0, files_ready_s=0.0, files=4, peak_gpu_mib=None)
            json.dump([dict(stats, status="ok", engine_config=engine, **measured)], f)
        log = WARMUP_LINE + ("\n" + GDN_LINE if spec["gdn_backend"] == "default" else "")
        return 0, log

    monkeypatch.setattr(bench, "run_child", fake_run_child)
    results = tmp_path / "r.json"
    argv = [
        "--shape", "tiny", "--variants", "plain,ours", "--workloads", "4x64",
        "--gdn-backends", "default,triton", "--max-num-seqs", "256", "--run", "t1",
        "--out-dir", str(tmp_path / "hs"), "--model-root", str(tmp_path / "m"),
        "--log-dir", str(tmp_path / "logs"), "--results", str(results),
    ]  # fmt: skip
    assert bench.main(argv) == 0
    assert starts == [
        ("plain", "default"), ("ours", "default"), ("plain", "triton"), ("ours", "triton")
    ]  # fmt: skip
    recs = records.load_records(str(results))
    assert len(recs) == 4
    for r in recs:
        for field in ("date", "commit", "gpu", "versions", "mode", "run"):
            assert field in r
        assert r["mode"] == "cudagraph" and r["runner"] == "v2"
        assert (r["max_num_batched_tokens"], r["max_num_seqs"]) == (16384, 256)
        assert r["prefix_caching"] is False and r["kv_sizing"] == "extensible KV cache"
        assert r["warmup_allocated_peak_gib"] == 2.41 and r["kv_cache_blocks"] == 3861
        assert r["settings"]["gdn_backend"] == r["gdn_backend_requested"]
        assert r["settings"]["max_num_seqs"] == 256
    default = [r for r in recs if r["gdn_backend_requested"] == "default"]
    assert {r["gdn_prefill_backend"] for r in default} == {"flashinfer"}
    assert {r["gdn_prefill_backend_source"] for r in default} == {"vllm log"}
    triton = [r for r in recs if r["gdn_backend_requested"] == "triton"]
    assert {r["gdn_prefill_backend"] for r in triton} == {"triton (requested)"}
    spec = triton[0]["flags"]["spec"]
    assert bench.worker.engine_kwargs(spec)["additional_config"] == {
        "gdn_prefill_backend": "triton"
    }
    assert "additional_config" not in bench.worker.engine_kwargs(default[0]["flags"]["spec"])


# vLLM 0.34.0's own lines, from the engine log of the 27B shape with CUDA graphs (H200,
# 2026-12-04, benchmarks/results run 39)
VLLM_MEMORY_LINES = """\
(EngineCore pid=6117) INFO 12-04 20:10:42 [model_runner.py:1216] Graph capturing finished in 14 secs, took 1.66 GiB
(EngineCore pid=6117) INFO 12-04 20:10:42 [gpu_worker.py:1175] Free memory on device (139.1/139.8 GiB) on startup. Desired GPU memory utilization is (1.0, 139.8 GiB). Actual usage is 51.36 GiB for consumed memory (weights + non-torch), 2.88 GiB for peak activation, and 1.66 GiB for CUDAGraph memory
(EngineCore pid=6117) INFO 12-04 20:10:44 [extensible_kv_cache.py:536] Extended KV cache to 1552 blocks (78.81 GiB).
"""  # noqa: E501


def test_memory_lines_of_a_real_engine_log():
    """vLLM's own accounting lines: the peak activation, the CUDA-graph memory and one KV
    cache block's size."""
    assert logparse.memory_info(VLLM_MEMORY_LINES) == {
        "peak_activation_gib": 2.88,
        "cudagraph_gib": 1.66,
        "capture_s": 14,
        "capture_gib": 1.66,
        "kv_block_gib": round(78.81 / 1552, 5),
    }
    assert logparse.memory_info("no memory lines") == {}
