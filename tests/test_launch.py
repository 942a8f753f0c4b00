"""The launcher (vllm_gdn_hs.cli.launch, launch/launch_vllm.py, `vllm-gdn-hs launch`); CPU only.

Run: python -m pytest tests/test_launch.py -q (needs no GPU, no network).
Covers parity with speculators' scripts/launch_vllm.py (options, defaults, layer ids, `--`
passthrough, the command it builds), hybrid/dense and multimodal/text-only configs, the flags
we add and the user flags that win or are refused, every bad input's message, and the checks
before vLLM starts (the folder, the GPU). A hub id without network: tests/test_offline.py.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest
from tiny_models import dense_config_dict, hybrid_config_dict, write_config

from vllm_gdn_hs import probes
from vllm_gdn_hs.cli import launch, serve_args

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REAL_CHECK = probes.check_storage_path  # the storage_checks fixture stands in for it


def text_hybrid_config(num_hidden_layers: int = 8) -> dict:
    cfg = dict(hybrid_config_dict(num_hidden_layers)["text_config"])
    cfg["architectures"] = ["Qwen3_5ForCausalLM"]
    return cfg


@pytest.fixture(autouse=True)
def no_exec(monkeypatch):
    """A test that reaches os.execvp by mistake fails instead of starting vLLM."""

    def refuse(file, args):
        raise AssertionError(f"os.execvp called: {args}")

    monkeypatch.setattr(launch.os, "execvp", refuse)
    # main() exports the plan's environment before it execs: undone after each test
    monkeypatch.setenv(serve_args.SHUTDOWN_ENV, "")  # records the original, for the undo
    monkeypatch.delenv(serve_args.SHUTDOWN_ENV)
    # flashinfer present, unless a test says otherwise (see test_triton_gdn_prefill_*).
    monkeypatch.setattr(serve_args, "_has_flashinfer", lambda: True)


@pytest.fixture(autouse=True)
def storage_checks(monkeypatch, tmp_path):
    """The launcher's folder check, for real under tmp_path; other folders (the default
    /tmp/hidden_states, "/x") are recorded, not made. Returns the paths checked."""
    seen, real = [], probes.check_storage_path

    def check(path, make=True):
        seen.append(path)
        return real(path, make) if path.startswith(str(tmp_path)) else None

    monkeypatch.setattr(probes, "check_storage_path", check)
    return seen


@pytest.fixture
def hybrid(tmp_path):
    return write_config(str(tmp_path / "hybrid"), hybrid_config_dict(8))


@pytest.fixture
def dense(tmp_path):
    return write_config(str(tmp_path / "dense"), dense_config_dict(8))


@pytest.fixture
def text_hybrid(tmp_path):
    return write_config(str(tmp_path / "text_hybrid"), text_hybrid_config(8))


def with_dry_run(argv) -> list[str]:
    """--dry-run right after MODEL: after "--" it would go to vLLM and the test would exec it."""
    return [*argv[:1], "--dry-run", *argv[1:]]


def dry_run(capsys, *argv: str) -> list[str]:
    """Run main(... --dry-run), check it succeeded, return the printed command, split back."""
    rc = launch.main(with_dry_run(argv))
    out = capsys.readouterr().out
    assert rc == 0, out
    lines = out.strip().splitlines()
    assert lines[0] == "Would run:"
    return shlex.split(lines[-1])


def fail(capsys, *argv: str) -> str:
    """Run main(argv), check it failed with exit code 2, return stderr."""
    rc = launch.main(with_dry_run(argv))
    captured = capsys.readouterr()
    assert rc == 2, captured
    assert "Would run" not in captured.out
    assert "Traceback" not in captured.err
    return captured.err


def spec_ids(cmd: list[str]) -> list[int]:
    spec = json.loads(cmd[cmd.index("--speculative_config") + 1])
    return spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"]


def kv_config(cmd: list[str]) -> dict:
    return json.loads(cmd[cmd.index("--kv_transfer_config") + 1])


def tail(cmd: list[str]) -> list[str]:
    """What follows the two JSON configs: our extra flags, then the user's (without the
    --shutdown-timeout a release gets when it ignores the launcher's shutdown variable:
    tests/test_shutdown.py)."""
    rest = cmd[cmd.index("--kv_transfer_config") + 2 :]
    ours = serve_args.shutdown_args([], 120.0)
    if ours and "--shutdown-timeout" in rest:
        i = rest.index("--shutdown-timeout")
        del rest[i : i + 2]
    return rest


# --- Argument parity with speculators' launch_vllm.py ---------------------------------------


def test_options_match_speculators():
    opts = {s for a in launch.make_parser()._actions for s in a.option_strings}
    assert opts == {
        "-h",
        "--help",
        "--hidden-states-backend",
        "--hidden-states-path",
        "--target-layer-ids",
        "--include-last-layer",
        "--no-include-last-layer",
        "--dry-run",
        "--trust-remote-code",
    } | {o for a in mooncake_parser()._actions for o in a.option_strings if "mooncake" in o}


def mooncake_parser():
    """A parser with hs-connectors' own --mooncake-* launch options (speculators' launcher's)."""
    import argparse

    from hs_connectors.transfer import MooncakeBackend

    parser = argparse.ArgumentParser()
    MooncakeBackend.add_launch_args(parser)
    return parser


def test_defaults_match_speculators():
    args = launch.parse_args(["some/model"])
    assert args.model == "some/model"
    assert args.hidden_states_backend == "file"
    assert args.hidden_states_path == "/tmp/hidden_states"
    assert args.target_layer_ids is None
    assert args.include_last_layer is True
    assert args.dry_run is False
    assert args.trust_remote_code is False
    assert args.vllm_args == []


def test_every_option_parsed():
    args = launch.parse_args(
        [
            "m",
            "--hidden-states-backend",
            "file",
            "--hidden-states-path",
            "/data/hs",
            "--target-layer-ids",
            "1",
            "5",
            "--no-include-last-layer",
            "--dry-run",
            "--trust-remote-code",
            "--",
            "--port",
            "8001",
        ]
    )
    assert args.hidden_states_path == "/data/hs"
    assert args.target_layer_ids == [1, 5]
    assert args.include_last_layer is False
    assert args.dry_run and args.trust_remote_code
    assert args.vllm_args == ["--port", "8001"]


def test_help_returns_zero(capsys):
    assert launch.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "--hidden-states-path" in out and "--no-include-last-layer" in out


@pytest.mark.parametrize(
    "n, expected", [(8, [2, 4, 5, 8]), (32, [2, 16, 29, 32]), (64, [2, 32, 61, 64])]
)
@pytest.mark.parametrize("kind", ["hybrid", "text_hybrid", "dense"])
def test_default_layer_ids(tmp_path, capsys, n, expected, kind):
    cfg = {
        "hybrid": hybrid_config_dict,
        "text_hybrid": text_hybrid_config,
        "dense": dense_config_dict,
    }[kind](n)
    model = write_config(str(tmp_path / kind), cfg)
    assert spec_ids(dry_run(capsys, model)) == expected


def test_default_ids_ignore_no_include_last_layer(capsys, hybrid):
    # speculators applies --no-include-last-layer only to custom ids; we say so.
    rc = launch.main([hybrid, "--no-include-last-layer", "--dry-run"])
    captured = capsys.readouterr()
    assert rc == 0 and spec_ids(shlex.split(captured.out.splitlines()[-1])) == [2, 4, 5, 8]
    assert "--no-include-last-layer applies only to --target-layer-ids" in captured.err
    assert launch.main([hybrid, "--dry-run"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_custom_ids_get_last_layer_and_warning(capsys, hybrid):
    rc = launch.main([hybrid, "--target-layer-ids", "1", "3", "--dry-run"])
    captured = capsys.readouterr()
    assert rc == 0
    assert spec_ids(shlex.split(captured.out.splitlines()[-1])) == [1, 3, 8]
    assert "warning: using custom target layer ids [1, 3, 8]" in captured.err
    assert "without the last one (8)" in captured.err


def test_custom_ids_no_include_last_layer(capsys, hybrid):
    assert spec_ids(
        dry_run(capsys, hybrid, "--target-layer-ids", "1", "3", "--no-include-last-layer")
    ) == [1, 3]


def test_custom_ids_with_last_layer_not_repeated(capsys, hybrid):
    assert spec_ids(dry_run(capsys, hybrid, "--target-layer-ids", "0", "8", "4")) == [0, 8, 4]


def test_custom_ids_out_of_order_are_kept_with_a_warning(capsys, hybrid):
    # The files keep the order given; speculators' trainer takes the last as the verifier's.
    rc = launch.main([hybrid, "--target-layer-ids", "1", "8", "2", "--dry-run"])
    captured = capsys.readouterr()
    assert rc == 0 and spec_ids(shlex.split(captured.out.splitlines()[-1])) == [1, 8, 2]
    assert "do not end with the deepest one, so the trainer would take layer 2, not 8" in (
        captured.err
    )
    # Out of order but ending with the deepest: said as it is ("layer 8, not 8" was wrong).
    launch.main([hybrid, "--target-layer-ids", "7", "3", "--dry-run"])
    err = capsys.readouterr().err
    assert "[7, 3, 8] are not in increasing order; the files keep this order" in err
    assert "deepest" not in err
    launch.main([hybrid, "--target-layer-ids", "1", "3", "--dry-run"])
    assert "increasing order" not in capsys.readouterr().err


def test_passthrough_after_double_dash(capsys, dense):
    user = ["--port", "8001", "--chat-template", "{{ 'a b' }}", "--", "-tp", "2"]
    cmd = dry_run(capsys, dense, "--", *user)
    assert tail(cmd) == ["--no-enable-prefix-caching", *user]


@pytest.mark.parametrize(
    "typo, near",
    [
        (["--hidden-state-path", "/x"], "--hidden-states-path"),
        (["--target-layers", "1", "3"], "--target-layer-ids"),
        (["--dryrun"], "--dry-run"),
        (["--include-lastlayer", "--hidden-states-backend=file"], "--include-last-layer"),
        (["--moncake-master", "h:1"], "--mooncake-master"),
    ],
)
def test_unknown_option_is_refused_with_the_nearest(capsys, monkeypatch, dense, typo, near):
    """speculators' launcher forwards what it does not know to vLLM: a misspelt launcher flag
    would then be dropped silently (the default folder, the default ids). Here it is refused,
    before the model is read or a GPU looked for (`--dryrun` alone would otherwise launch)."""
    looked = []
    monkeypatch.setattr(launch, "gpu_visible", lambda: looked.append(1) or True)
    monkeypatch.setattr(launch.model_info, "read_model_info", lambda *a, **k: looked.append(2))
    assert launch.main([dense, *typo]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and not looked
    said = f"error: unrecognized launcher option {typo[0]}: did you mean {near}? "
    assert said in captured.err and "flags for vllm serve go after '--'" in captured.err


def test_vllm_flag_before_double_dash_is_refused(capsys, dense):
    err = fail(capsys, dense, "--port", "8001", "--", "--enforce-eager")
    assert "unrecognized launcher option --port: flags for vllm serve go after '--'" in err
    assert "did you mean" not in err
    err = fail(capsys, dense, "extra")
    assert "unexpected argument 'extra': flags for vllm serve go after '--'" in err


@pytest.mark.parametrize(
    "typo, near",
    [
        (["--max-num-seqz", "8"], "--max-num-seqs"),
        (["--gpu_memory_utilisation=0.8"], "--gpu-memory-utilization"),
        (["--enable-prefix-cache"], "--enable-prefix-caching"),
    ],
)
def test_misspelled_vllm_flag_is_refused_even_in_dry_run(capsys, dense, typo, near):
    """A vLLM flag after `--` that the installed vLLM's serve does not know: `vllm serve` would
    refuse it only after starting, and `--dry-run` would print it as if it were fine."""
    err = fail(capsys, dense, "--", "-tp", "1", *typo)
    assert f"has no such option (did you mean {near}?)" in err


def test_vllm_flags_in_every_spelling_vllm_reads_pass(capsys, dense):
    user = [
        "--max_num_seqs",
        "8",
        "--compilation-config.mode",
        "3",
        "--no-enforce-eager",
        "--disable-log-requests",
        "--max-num-seq",
        "4",
        "-O3",
        "--enable-chunked-prefill",
    ]
    assert tail(dry_run(capsys, dense, "--", *user))[-len(user) :] == user


def test_serve_flags_are_every_option_of_vllm_serve(monkeypatch):
    """The flags read from vLLM's sources are the options of vLLM's own `vllm serve` parser,
    built here (its device probe, which needs a GPU, is skipped: it only fills a default)."""
    from vllm.config.device import DeviceConfig
    from vllm.entrypoints.cli.serve import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_gdn_hs.cli import vllm_flags

    monkeypatch.setattr(DeviceConfig, "__post_init__", lambda self: None)
    parser = make_arg_parser(FlexibleArgumentParser())
    options = {s for action in parser._actions for s in action.option_strings if s.startswith("--")}
    assert len(options) > 300
    assert vllm_flags.misspelled(sorted(options)) is None
    assert vllm_flags.misspelled(["--max-num-seqz"]) is not None


# --- The command ------------------------------------------------------------------------------


def test_dense_command_is_speculators_command(capsys, dense):
    cmd = dry_run(
        capsys, dense, "--hidden-states-path", "/data/hs", "--", "--max-model-len", "4096"
    )
    expected = [
        sys.executable,
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        dense,
        "--speculative_config",
        json.dumps(
            {
                "method": "extract_hidden_states",
                "num_speculative_tokens": 1,
                "draft_model_config": {
                    "hf_config": {"eagle_aux_hidden_state_layer_ids": [2, 4, 5, 8]}
                },
            }
        ),
        "--kv_transfer_config",
        json.dumps(
            {
                "kv_connector": "HybridHiddenStatesConnector",
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": "/data/hs"},
            }
        ),
        "--no-enable-prefix-caching",
        *serve_args.shutdown_args([], 120.0),  # on releases that need it: test_shutdown.py
        "--max-model-len",
        "4096",
    ]
    assert cmd == expected


def test_six_layers_default_ids_repeat(capsys, tmp_path):
    # N=6 gives [2, 3, 3, 6]; speculators rejects the repeat too (len(set(ids)) != len(ids)).
    model = write_config(str(tmp_path / "six"), dense_config_dict(6))
    err = fail(capsys, model)
    assert "error: layer ids [3] are repeated" in err
    assert spec_ids(dry_run(capsys, model, "--target-layer-ids", "2", "3")) == [2, 3, 6]


def test_hidden_states_path_made_absolute(capsys, hybrid, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cmd = dry_run(capsys, hybrid, "--hidden-states-path", "out/hs")
    path = kv_config(cmd)["kv_connector_extra_config"]["shared_storage_path"]
    assert path == str(tmp_path / "out" / "hs")
    assert kv_config(dry_run(capsys, hybrid))["kv_connector_extra_config"] == {
        "shared_storage_path": "/tmp/hidden_states"
    }


def test_multimodal_hybrid_extras(capsys, hybrid):
    cmd = dry_run(capsys, hybrid, "--hidden-states-backend=file")
    assert cmd[1:5] == ["-m", "vllm.entrypoints.cli.main", "serve", hybrid]
    assert kv_config(cmd)["kv_connector"] == "HybridHiddenStatesConnector"
    assert kv_config(cmd)["kv_role"] == "kv_producer"
    spec = json.loads(cmd[cmd.index("--speculative_config") + 1])
    assert spec["method"] == "extract_hidden_states" and spec["num_speculative_tokens"] == 1
    assert tail(cmd) == ["--no-enable-prefix-caching", "--language-model-only"]
    assert "--disable-hybrid-kv-cache-manager" not in cmd


def test_text_only_hybrid_has_no_language_model_only(capsys, text_hybrid):
    cmd = dry_run(capsys, text_hybrid)
    assert tail(cmd) == ["--no-enable-prefix-caching"]
    assert "--disable-hybrid-kv-cache-manager" not in cmd


def test_printed_command_pastes_into_a_shell(capsys, hybrid, tmp_path):
    # The JSON holds quotes and spaces: shlex.join must quote it so a shell gets one argument.
    odd = str(tmp_path / "dir with space")
    cmd = dry_run(capsys, hybrid, "--hidden-states-path", odd)
    assert kv_config(cmd)["kv_connector_extra_config"]["shared_storage_path"] == odd
    assert json.loads(cmd[cmd.index("--speculative_config") + 1])


def test_main_execs_the_command(capsys, monkeypatch, hybrid):
    calls = []
    monkeypatch.setattr(launch, "gpu_visible", lambda: True)
    monkeypatch.setattr(launch.os, "execvp", lambda file, args: calls.append((file, args)))
    assert launch.main([hybrid, "--", "--port", "9000"]) == 0
    printed = shlex.split(capsys.readouterr().out.splitlines()[-1])
    assert calls == [(sys.executable, printed)]
    assert printed[-2:] == ["--port", "9000"]


def test_dry_run_does_not_exec(capsys, hybrid):
    dry_run(capsys, hybrid)  # no_exec fails the test if it execs


def test_build_command_with_given_info(hybrid):
    from vllm_gdn_hs.cli.model_info import read_model_info

    args = launch.parse_args(["served-name", "--", "--seed", "1"])
    cmd = launch.build_plan(args, read_model_info(hybrid)).command
    assert cmd[4] == "served-name"
    assert spec_ids(cmd) == [2, 4, 5, 8]
    assert tail(cmd) == ["--no-enable-prefix-caching", "--language-model-only", "--seed", "1"]


# --- User flags win, contradicting flags are refused -------------------------------------------


@pytest.mark.parametrize(
    "user, expected",
    [
        (["--no-enable-prefix-caching"], ["--language-model-only"]),
        (["--no_enable_prefix_caching"], ["--language-model-only"]),
        (["--no-language-model-only"], ["--no-enable-prefix-caching"]),
        (["--language_model_only"], ["--no-enable-prefix-caching"]),
        (["--language-model-only=true"], ["--no-enable-prefix-caching"]),
        (["--enable-prefix-caching", "--no-enable-prefix-caching"], ["--language-model-only"]),
        (["--no-enable-prefix-caching", "--no-language-model-only"], []),
    ],
)
def test_user_flags_win(capsys, hybrid, user, expected):
    cmd = dry_run(capsys, hybrid, "--", *user)
    assert tail(cmd) == [*expected, *user]


def test_allowed_flags_pass_through(capsys, hybrid, dense):
    assert tail(dry_run(capsys, hybrid, "--", "-pp", "1"))[-2:] == ["-pp", "1"]
    assert tail(dry_run(capsys, hybrid, "--", "--pipeline-parallel-size=1"))[-1] == (
        "--pipeline-parallel-size=1"
    )
    assert tail(dry_run(capsys, hybrid, "--", "--no-disable-hybrid-kv-cache-manager"))[-1] == (
        "--no-disable-hybrid-kv-cache-manager"
    )
    # A dense model has no hybrid KV cache manager to keep on.
    assert tail(dry_run(capsys, dense, "--", "--disable-hybrid-kv-cache-manager")) == [
        "--no-enable-prefix-caching",
        "--disable-hybrid-kv-cache-manager",
    ]


@pytest.mark.parametrize(
    "user",
    [
        [
            "--kv-transfer-config",
            '{"kv_connector_extra_config": {"write_workers": 8, "write_backlog_gb": 4.5}}',
        ],
        [
            "--kv-transfer-config.kv_connector_extra_config.write_workers=8",
            "--kv_transfer_config.kv_connector_extra_config.write_backlog_gb",
            "4.5",
        ],
        [
            "--kv-transfer-config",
            '{"kv_connector": "HybridHiddenStatesConnector", "kv_role": "kv_producer", '
            '"kv_connector_extra_config": {"write_workers": 2}}',
            "--kv-transfer-config",
            '{"kv_connector_extra_config": {"write_workers": 8, "write_backlog_gb": 4.5}}',
        ],
    ],
)
def test_connector_options_merged(capsys, hybrid, tmp_path, user):
    """Connector options after -- reach the connector, merged into the launcher's config;
    the flag itself is not passed on (vLLM would take the last one, replacing ours)."""
    cmd = dry_run(
        capsys, hybrid, "--hidden-states-path", str(tmp_path), "--", "--port", "8001", *user
    )
    assert kv_config(cmd) == {
        "kv_connector": "HybridHiddenStatesConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {
            "write_workers": 8,
            "write_backlog_gb": 4.5,
            "shared_storage_path": str(tmp_path),
        },
    }
    assert not any("kv-transfer-config" in a or "kv_transfer_config" in a for a in tail(cmd))
    assert tail(cmd)[-2:] == ["--port", "8001"]


@pytest.mark.parametrize(
    "user, words",
    [
        (["--enable-prefix-caching"], ["--enable-prefix-caching", "prefix caching off"]),
        (["--enable_prefix_caching"], ["--enable-prefix-caching", "prefix caching off"]),
        (["--no-enable-prefix-caching", "--enable-prefix-caching"], ["prefix caching off"]),
        (["--disable-hybrid-kv-cache-manager"], ["--disable-hybrid-kv-cache-manager", "hybrid"]),
        (["--disable_hybrid_kv_cache_manager"], ["--disable-hybrid-kv-cache-manager", "drop"]),
        (["-pp", "2"], ["-pp 2", "pipeline parallelism is not supported"]),
        (["-pp=2"], ["-pp 2", "pipeline parallelism"]),
        (["--pipeline-parallel-size", "4"], ["--pipeline-parallel-size 4", "pipeline"]),
        (["--pipeline_parallel_size=2"], ["--pipeline-parallel-size 2", "--tensor-parallel"]),
        (["--speculative-config", "{}"], ["--speculative-config", "--target-layer-ids"]),
        (["--speculative_config", "{}"], ["--speculative-config", "--target-layer-ids"]),
        (["-sc", "{}"], ["-sc", "--target-layer-ids"]),
        (["--speculative-config.method=eagle"], ["--speculative-config", "launcher"]),
        (
            ["--kv-transfer-config", '{"kv_connector": "ExampleHiddenStatesConnector"}'],
            ["kv_connector='ExampleHiddenStatesConnector'", "HybridHiddenStatesConnector"],
        ),
        (["--kv-transfer-config.kv_role=kv_both"], ["kv_role='kv_both'", "drop kv_role"]),
        (
            ["--kv_transfer_config.kv_connector_extra_config.shared_storage_path=/x"],
            ["shared_storage_path", "--hidden-states-path"],
        ),
        (
            ["--kv-transfer-config", '{"kv_connector_extra_config": {"layer_ids": [1]}}'],
            ["layer_ids", "--target-layer-ids"],
        ),
        (
            ["--kv-transfer-config.kv_connector_extra_config.write_worker=8"],
            ["write_worker: Extra inputs are not permitted", "write_workers", "host_buffers"],
        ),
        (
            ["--kv-transfer-config.kv_connector_extra_config.host_buffers=0"],
            ["host_buffers: Input should be greater than or equal to 1"],
        ),
        (["--kv-transfer-config", "{bad"], ["is not JSON", "write_workers"]),
        (["--kv-transfer-config", "[1]"], ["pass a JSON object"]),
        (["--kv-transfer-config"], ["--kv-transfer-config needs a value"]),
    ],
)
def test_conflicting_flags_refused(capsys, hybrid, user, words):
    err = fail(capsys, hybrid, "--", *user)
    assert err.startswith("error: ")
    for word in words:
        assert word in err, err


def test_conflicting_flag_before_double_dash_refused(capsys, hybrid):
    err = fail(capsys, hybrid, "--enable-prefix-caching")
    assert "error: unrecognized launcher option --enable-prefix-caching: " in err
    err = fail(capsys, hybrid, "--", "--enable-prefix-caching")
    assert "error: --enable-prefix-caching: HybridHiddenStatesConnector needs prefix" in err


# --- Bad inputs -------------------------------------------------------------------------------


def test_missing_model_path(capsys, tmp_path):
    missing = str(tmp_path / "no_such_model")
    err = fail(capsys, missing)
    assert err == (
        f"error: model folder {missing} does not exist: pass a HF model folder or a hub id "
        "such as Qwen/Qwen3.6-27B\n"
    )


def test_folder_without_config(capsys, tmp_path):
    (tmp_path / "empty").mkdir()
    err = fail(capsys, str(tmp_path / "empty"))
    assert "has no config.json" in err and err.startswith("error: ")


def test_corrupt_config(capsys, tmp_path):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text('{"num_hidden_layers": 8,')
    err = fail(capsys, str(tmp_path / "bad"))
    assert err.startswith("error: cannot read ") and "config.json" in err


def test_unreadable_config(capsys, tmp_path):
    # A directory where config.json should be: unreadable even as root.
    (tmp_path / "odd" / "config.json").mkdir(parents=True)
    err = fail(capsys, str(tmp_path / "odd"))
    assert err.startswith("error: cannot read ") and "config.json" in err


def test_config_without_layers(capsys, tmp_path):
    model = write_config(str(tmp_path / "m"), {"architectures": ["X"], "hidden_size": 8})
    err = fail(capsys, model)
    assert "no num_hidden_layers/hidden_size" in err


@pytest.mark.parametrize(
    "ids, words",
    [
        (["9"], ["[9] are out of range", "0..8"]),
        (["-1", "3"], ["[-1] are out of range", "0..8"]),
        (["3", "3"], ["[3] are repeated"]),
    ],
)
def test_bad_layer_ids(capsys, hybrid, ids, words):
    err = fail(capsys, hybrid, "--target-layer-ids", *ids)
    assert err.splitlines()[-1].startswith("error: layer ids ")
    for word in words:
        assert word in err, err


@pytest.mark.parametrize("ids", [["8"], ["3", "--no-include-last-layer"]])
def test_ids_that_leave_the_trainer_no_layer_are_refused(capsys, hybrid, ids):
    """The trainer takes every id but the last (the verifier's): one id leaves it none."""
    err = fail(capsys, hybrid, "--target-layer-ids", *ids)
    assert err == (
        f"error: --target-layer-ids {ids[0]} leaves the trainer no layer: each file's last "
        f"layer ({ids[0]}) is the verifier's hidden state and the trainer conditions on the "
        "ones before it; give those, e.g. --target-layer-ids 2 4 5\n"
    )


def test_no_include_last_layer_with_out_of_range(capsys, hybrid):
    err = fail(capsys, hybrid, "--target-layer-ids", "2", "12", "--no-include-last-layer")
    assert "[12] are out of range" in err


def test_non_integer_layer_id(capsys, hybrid):
    err = fail(capsys, hybrid, "--target-layer-ids", "two")
    assert "'two': give integer layer ids separated by spaces or commas" in err
    err = fail(capsys, hybrid, "--target-layer-ids", "1,x")
    assert "'1,x': give integer layer ids" in err


@pytest.mark.parametrize("ids", [["1,3,5"], ["1", "3", "5"], ["1,", "3, 5"], ["1, 3", "5"]])
def test_layer_ids_with_spaces_or_commas(capsys, hybrid, ids):
    assert spec_ids(dry_run(capsys, hybrid, "--target-layer-ids", *ids)) == [1, 3, 5, 8]


def test_out_of_range_id_warns_of_nothing_else(capsys, tmp_path):
    """An id past the last layer is an error, with no warning about the ids before it (which
    once said "the trainer would take layer 64, not 65": 64 was appended, 65 refused)."""
    model = write_config(str(tmp_path / "m64"), hybrid_config_dict(64))
    err = fail(capsys, model, "--target-layer-ids", "2", "32", "65")
    assert err == (
        "error: layer ids [65] are out of range: this model has 64 layers, so ids must be in "
        "0..64 (id 64 is the last layer's output, before the final norm)\n"
    )


@pytest.mark.parametrize("backend", ["redis", "File"])
def test_unknown_backend(capsys, hybrid, backend):
    err = fail(capsys, hybrid, "--hidden-states-backend", backend)
    assert err.endswith(
        f"launch_vllm.py: error: argument --hidden-states-backend: invalid choice: {backend!r} "
        "(choose from 'file', 'fp8', 'mooncake', 'mooncake-fp8')\n"
    )


def test_fp8_backend_as_speculators_names_it(capsys, hybrid):
    """--hidden-states-backend fp8: the same options and files as the file backend, with
    the connector's fp8 option on; it cannot be set by hand beside another backend."""
    cmd = dry_run(capsys, hybrid, "--hidden-states-backend", "fp8", "--hidden-states-path", "/x")
    kv = json.loads(cmd[cmd.index("--kv_transfer_config") + 1])
    assert kv["kv_connector"] == "HybridHiddenStatesConnector"
    assert kv["kv_connector_extra_config"] == {"shared_storage_path": "/x", "fp8": True}
    plain = dry_run(capsys, hybrid, "--hidden-states-path", "/x")
    kv = json.loads(plain[plain.index("--kv_transfer_config") + 1])
    assert "fp8" not in kv["kv_connector_extra_config"]
    err = fail(capsys, hybrid, "--", "--kv-transfer-config.kv_connector_extra_config.fp8=true")
    assert "use --hidden-states-backend fp8 or mooncake-fp8 instead" in err


# --- Checks before vLLM starts --------------------------------------------------------------


@pytest.mark.parametrize("dry", [True, False])
def test_unwritable_folder_is_refused_before_vllm(capsys, hybrid, tmp_path, monkeypatch, dry):
    monkeypatch.setattr(launch, "gpu_visible", lambda: True)
    (tmp_path / "a_file").write_text("")
    folder = str(tmp_path / "a_file" / "hs")
    rc = launch.main([hybrid, "--hidden-states-path", folder, *(["--dry-run"] if dry else [])])
    captured = capsys.readouterr()
    assert rc == 2 and "Would run" not in captured.out  # no_exec: execvp not reached
    assert captured.err.startswith(f"error: --hidden-states-path {folder} is not writable (")
    assert "Not a directory" in captured.err
    assert "pass a folder this user can write to" in captured.err


@pytest.mark.parametrize("where", ["/proc/hs-bar/x", "/proc/hs-bar", "a_file/hs"])
def test_dry_run_refuses_a_folder_a_launch_could_not_make(
    capsys, hybrid, tmp_path, where, monkeypatch
):
    """A dry run makes nothing, and still refuses what the launch would: a folder no one can
    make (/proc takes no new entries, even from root) or one under a file."""
    monkeypatch.setattr(probes, "check_storage_path", REAL_CHECK)
    (tmp_path / "a_file").write_text("")
    folder = where if where.startswith("/") else str(tmp_path / where)
    before = sorted(os.listdir("/proc")), sorted(os.listdir(tmp_path))
    rc = launch.main([hybrid, "--dry-run", "--hidden-states-path", folder])
    captured = capsys.readouterr()
    assert rc == 2 and captured.out == ""
    assert captured.err.startswith(f"error: --hidden-states-path {folder} is not writable (")
    assert "/proc" not in folder or "no folder can be made in /proc" in captured.err
    assert not os.path.exists(folder)
    assert sorted(os.listdir(tmp_path)) == before[1]


def test_dry_run_probes_a_missing_folder_and_leaves_nothing(capsys, hybrid, tmp_path):
    """The missing folders are made under a temporary name, a file written, all removed; a
    name too long for the file system is refused as the launch would refuse it."""
    deep = tmp_path / "new" / "a" / "hs"
    dry_run(capsys, hybrid, "--hidden-states-path", str(deep))
    assert os.listdir(tmp_path) == ["hybrid"]
    assert probes.check_storage_path(str(tmp_path / "x" / ("y" * 300)), make=False)


def test_folder_is_made_and_checked(capsys, hybrid, tmp_path, storage_checks, monkeypatch):
    """A launch makes the folder; a dry run checks it and makes nothing."""
    folder = tmp_path / "new" / "hs"
    dry_run(capsys, hybrid, "--hidden-states-path", str(folder))
    assert storage_checks == [str(folder)] and not (tmp_path / "new").exists()
    monkeypatch.setattr(launch, "gpu_visible", lambda: True)
    monkeypatch.setattr(launch.os, "execvp", lambda *a: None)
    assert launch.main([hybrid, "--hidden-states-path", str(folder)]) == 0
    assert capsys.readouterr().out.startswith("Running command:\n")
    assert folder.is_dir() and not list(folder.iterdir())


def test_no_gpu_is_said_in_one_line(capsys, hybrid, tmp_path, monkeypatch):
    monkeypatch.setattr(launch, "gpu_visible", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    rc = launch.main([hybrid, "--hidden-states-path", str(tmp_path / "hs")])
    captured = capsys.readouterr()
    assert rc == 2 and captured.out == ""
    assert captured.err == (
        "error: no GPU is visible here (CUDA_VISIBLE_DEVICES=''): vllm serve needs one; run on "
        "a GPU machine, or add --dry-run to print the command\n"
    )
    assert launch.main([hybrid, "--dry-run", "--hidden-states-path", str(tmp_path / "hs")]) == 0
    assert not (tmp_path / "hs").exists()  # neither the refused launch nor the dry run made it


def test_help_imports_neither_vllm_nor_torch():
    """--help answers at once: nothing heavy is imported for it (the mooncake backends' options,
    whose definitions import torch, are listed by their own --help)."""
    code = (
        "import sys\nfrom vllm_gdn_hs.cli import main\n"
        "for argv in (['--help'], ['launch', '--help'], ['check', '--help'], ['doctor', '--help'],"
        " ['config', '--help'], ['demo', '--help'], ['--version']):\n"
        "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
        "print(sorted(m for m in ('vllm', 'torch', 'huggingface_hub') if m in sys.modules))"
    )
    r = run("-c", code)
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == "[]", r.stdout + r.stderr
    assert "--hidden-states-backend mooncake --help" in r.stdout
    r = run("-m", "vllm_gdn_hs.cli", "launch", "m", "--hidden-states-backend", "mooncake", "-h")
    assert r.returncode == 0 and "--mooncake-master" in r.stdout, r.stdout + r.stderr


def test_gpu_visible_is_torchs_answer(monkeypatch):
    import torch

    for seen in (True, False):
        monkeypatch.setattr(torch.cuda, "is_available", lambda seen=seen: seen)
        assert launch.gpu_visible() is seen


def test_missing_model_argument(capsys):
    err = fail(capsys)
    assert "the following arguments are required: model" in err


# --- As a script and through the CLI ----------------------------------------------------------


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, cwd=REPO, timeout=120
    )


def test_script_dry_run(hybrid, tmp_path):
    hs = str(tmp_path / "hs")
    p = run(
        "launch/launch_vllm.py",
        hybrid,
        "--hidden-states-path",
        hs,
        "--dry-run",
        "--",
        "--port",
        "8001",
    )
    assert p.returncode == 0, p.stderr
    cmd = shlex.split(p.stdout.strip().splitlines()[-1])
    assert cmd[2:5] == ["vllm.entrypoints.cli.main", "serve", hybrid]
    assert spec_ids(cmd) == [2, 4, 5, 8]
    assert kv_config(cmd)["kv_connector_extra_config"]["shared_storage_path"] == hs
    assert tail(cmd) == ["--no-enable-prefix-caching", "--language-model-only", "--port", "8001"]


def test_script_error_has_no_traceback(tmp_path):
    p = run("launch/launch_vllm.py", str(tmp_path / "missing"), "--dry-run")
    assert p.returncode == 2
    assert p.stderr.startswith("error: model folder ") and "Traceback" not in p.stderr
    assert p.stdout == ""


def test_script_usage_names_launch_vllm():
    p = run("launch/launch_vllm.py", "--help")
    assert p.returncode == 0 and p.stdout.startswith("usage: launch_vllm.py ")


def test_cli_launch_dry_run(text_hybrid, tmp_path):
    hs = str(tmp_path / "hs")
    p = run(
        "-m", "vllm_gdn_hs.cli", "launch", text_hybrid, "--target-layer-ids", "1,2", "--dry-run",
        "--hidden-states-path", hs,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    cmd = shlex.split(p.stdout.strip().splitlines()[-1])
    assert spec_ids(cmd) == [1, 2, 8]
    assert tail(cmd) == ["--no-enable-prefix-caching"]
    assert "warning: using custom target layer ids [1, 2, 8]" in p.stderr


def test_cli_launch_error(hybrid):
    p = run("-m", "vllm_gdn_hs.cli", "launch", hybrid, "--dry-run", "--", "-pp", "2")
    assert p.returncode == 2
    assert "pipeline parallelism is not supported" in p.stderr and "Traceback" not in p.stderr
    q = run("-m", "vllm_gdn_hs.cli", "launch", "--help")
    assert q.returncode == 0 and q.stdout.startswith("usage: vllm-gdn-hs launch ")


# --- GDN prefill backend without flashinfer --------------------------------------------------


def test_triton_gdn_prefill_without_flashinfer(hybrid, monkeypatch):
    monkeypatch.setattr(serve_args, "_has_flashinfer", lambda: False)
    cmd = launch.build_plan(launch.parse_args([hybrid])).command
    i = cmd.index("--additional-config")
    assert json.loads(cmd[i + 1]) == {"gdn_prefill_backend": "triton"}


def test_triton_gdn_prefill_user_additional_config_wins(hybrid, monkeypatch):
    monkeypatch.setattr(serve_args, "_has_flashinfer", lambda: False)
    user = '{"gdn_prefill_backend": "flashinfer"}'
    cmd = launch.build_plan(launch.parse_args([hybrid, "--", "--additional-config", user])).command
    assert cmd.count("--additional-config") == 1
    assert cmd[cmd.index("--additional-config") + 1] == user


def test_user_additional_config_without_gdn_backend_gets_a_warning(hybrid, monkeypatch, capsys):
    monkeypatch.setattr(serve_args, "_has_flashinfer", lambda: False)
    user = '{"some_key": 1}'
    cmd = launch.build_plan(launch.parse_args([hybrid, "--", "--additional-config", user])).command
    assert cmd.count("--additional-config") == 1  # the user's JSON is passed on as given
    assert 'add "gdn_prefill_backend": "triton" to it' in capsys.readouterr().err
    launch.build_plan(
        launch.parse_args([hybrid, "--", "--additional-config", '{"gdn_prefill_backend": "x"}'])
    )
    assert "warning" not in capsys.readouterr().err


def test_no_gdn_backend_flag_for_dense_models(dense, monkeypatch):
    monkeypatch.setattr(serve_args, "_has_flashinfer", lambda: False)
    assert "--additional-config" not in launch.build_plan(launch.parse_args([dense])).command


def test_untested_vllm_refused_unless_allowed_then_the_command_carries_it(
    hybrid, monkeypatch, capsys
):
    """A vLLM newer than the newest tested release: refused, naming the variable that runs it;
    with it set, the printed command exports it, so that it runs where it is pasted too."""
    from packaging.version import Version

    from vllm_gdn_hs import version

    monkeypatch.setattr(version, "installed_vllm", lambda: Version("0.99.0"))
    monkeypatch.delenv(version.ALLOW_UNTESTED, raising=False)
    err = fail(capsys, hybrid)
    assert "found vllm 0.99.0" in err and f"or set {version.ALLOW_UNTESTED}=1 to run" in err
    monkeypatch.setenv(version.ALLOW_UNTESTED, "1")
    assert launch.main([hybrid, "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert f"export {version.ALLOW_UNTESTED}=1" in lines[1:-1]
