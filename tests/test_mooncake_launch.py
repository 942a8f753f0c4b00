"""The launcher's ``--hidden-states-backend mooncake`` and the connector's mooncake options.

Run: python -m pytest tests/test_mooncake_launch.py -q (CPU, no network, no master needed).
Checks the options, defaults and ``kv_connector_extra_config.mooncake`` against
hs-connectors' own ``MooncakeBackend`` (what speculators' launcher builds), that vLLM's own
``vllm serve`` parser accepts the printed command, that the connector's config validates it,
and ``mooncake-fp8``: the same options with ``fp8``, as its trainer backend
(``vllm_gdn_hs.cli.train``) builds the server's config.
"""

from __future__ import annotations

import argparse

import harness
import pytest
from hs_connectors.transfer import MooncakeBackend
from test_launch import dry_run, fail, kv_config, mooncake_parser

from vllm_gdn_hs.cli import launch
from vllm_gdn_hs.config import HiddenStatesConfig

ARGS = [
    "--mooncake-master",
    "10.1.2.3:50051",
    "--mooncake-protocol",
    "rdma",
    "--mooncake-device",
    "mlx5_0",
    "--mooncake-global-segment-gib",
    "1.5",
    "--mooncake-local-buffer-gib",
    "0.5",
    "--mooncake-writer-threads",
    "6",
    "--mooncake-metadata-server",
    "http://10.1.2.3:8080/metadata",
]


@pytest.fixture
def hybrid(tmp_path):
    from test_launch import text_hybrid_config
    from tiny_models import write_config

    return write_config(str(tmp_path / "m"), text_hybrid_config())


def theirs(argv: list[str]) -> dict:
    """hs-connectors' own kv_transfer_config for these options (speculators' launcher)."""
    args = mooncake_parser().parse_args(argv)
    return MooncakeBackend.build_kv_transfer_config(args)


@pytest.mark.parametrize("argv", [[], ARGS], ids=["defaults", "all-options"])
def test_extra_config_is_speculators(capsys, hybrid, monkeypatch, argv):
    monkeypatch.setenv("MOONCAKE_LOCAL_HOSTNAME", "10.9.9.9")
    cmd = dry_run(capsys, hybrid, "--hidden-states-backend", "mooncake", *argv)
    kv = kv_config(cmd)
    assert kv["kv_connector"] == "HybridHiddenStatesConnector"
    assert kv["kv_role"] == "kv_producer"
    assert kv["kv_connector_extra_config"] == theirs(argv)["kv_connector_extra_config"]
    cfg = HiddenStatesConfig(**kv["kv_connector_extra_config"])
    assert cfg.mooncake is not None and cfg.write_workers == (6 if argv else 4)
    # vLLM's own serve parser takes the printed command.
    parsed = harness.serve_parser().parse_args(cmd[4:])  # after "serve"
    assert parsed.kv_transfer_config is not None


def test_a_field_hs_connectors_adds_later_is_left_out(capsys, hybrid, monkeypatch):
    """A later hs-connectors 0.9.x whose ``MooncakeStoreConfig`` has one more field: the
    launcher still starts, without it (the connector's options forbid unknown keys)."""
    build = MooncakeBackend.build_kv_transfer_config

    def newer(args):
        config = build(args)
        config["kv_connector_extra_config"]["mooncake"]["a_later_field"] = 1
        return config

    monkeypatch.setattr(MooncakeBackend, "build_kv_transfer_config", staticmethod(newer))
    kv = kv_config(dry_run(capsys, hybrid, "--hidden-states-backend", "mooncake"))
    assert "a_later_field" not in kv["kv_connector_extra_config"]["mooncake"]
    assert HiddenStatesConfig(**kv["kv_connector_extra_config"]).mooncake is not None


def test_defaults_are_speculators():
    ours = launch.parse_args(["m", "--hidden-states-backend", "mooncake"])
    their = mooncake_parser().parse_args([])
    assert {k: getattr(ours, k) for k in vars(their)} == vars(their)


@pytest.mark.parametrize("argv", [[], ARGS], ids=["defaults", "all-options"])
def test_mooncake_fp8_is_mooncake_with_fp8(capsys, hybrid, monkeypatch, argv):
    """The launcher's ``mooncake-fp8``: speculators' mooncake options plus ``fp8``, which the
    trainer side's backend (registered by vllm_gdn_hs.cli.train) builds the same way."""
    from vllm_gdn_hs.cli.train import MooncakeFP8Train

    monkeypatch.setenv("MOONCAKE_LOCAL_HOSTNAME", "10.9.9.9")
    cmd = dry_run(capsys, hybrid, "--hidden-states-backend", "mooncake-fp8", *argv)
    kv = kv_config(cmd)
    extra = kv["kv_connector_extra_config"]
    assert extra == {**theirs(argv)["kv_connector_extra_config"], "fp8": True}
    cfg = HiddenStatesConfig(**extra)
    assert cfg.fp8 and cfg.mooncake is not None
    assert harness.serve_parser().parse_args(cmd[4:]).kv_transfer_config is not None
    trainer_side = MooncakeFP8Train.build_kv_transfer_config(mooncake_parser().parse_args(argv))
    assert trainer_side == {k: kv[k] for k in trainer_side}


@pytest.mark.parametrize("backend", ["mooncake", "mooncake-fp8"])
def test_unreachable_master_named_before_vllm_starts(capsys, hybrid, backend, monkeypatch):
    """Without --dry-run the launcher checks the master on a GPU machine before vLLM starts
    (the dry runs above reach nothing: their 10.1.2.3 would time out) and names the address."""
    from mooncake_master import free_port

    monkeypatch.setattr(launch, "gpu_visible", lambda: True)  # the check after the GPU's

    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    rc = launch.main([hybrid, "--hidden-states-backend", backend, "--mooncake-master", address])
    captured = capsys.readouterr()
    assert rc == 2 and "Would run" not in captured.out
    assert f"cannot reach the Mooncake master at {address}" in captured.err, captured.err


def test_mooncake_options_are_checked(capsys, hybrid):
    err = fail(capsys, hybrid, "--hidden-states-backend", "mooncake", "--mooncake-master", "x")
    assert "mooncake.master_server_address" in err
    err = fail(
        capsys,
        hybrid,
        "--hidden-states-backend=mooncake",
        "--",
        '--kv-transfer-config={"kv_connector_extra_config": {"mooncake": {}}}',
    )
    assert "use --hidden-states-backend mooncake and its --mooncake-* options" in err


def test_storage_is_not_needed(hybrid_model):
    """The scheduler side checks no folder with mooncake (the trainers may be elsewhere)."""
    from vllm_gdn_hs.connector.scheduler import HybridHiddenStatesConnectorScheduler

    cfg = HiddenStatesConfig(shared_storage_path="/proc/no", mooncake={})
    from vllm_gdn_hs.storage.mooncake import MooncakeStorage

    sched = HybridHiddenStatesConnectorScheduler(cfg, [1, 2], 2048, hidden=8, dtype=None)
    assert isinstance(sched.storage, MooncakeStorage)


_ = argparse


def test_train_module_is_speculators_train_with_mooncake_fp8():
    """``python -m vllm_gdn_hs.cli.train`` (as torchrun -m runs it) is speculators' own train
    command, its --hidden-states-backend choices with mooncake-fp8 added."""
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-m", "vllm_gdn_hs.cli.train", "--help"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "--hidden-states-backend {file,fp8,mooncake,mooncake-fp8}" in run.stdout
    assert "--verifier-name-or-path" in run.stdout and "--mooncake-master" in run.stdout
