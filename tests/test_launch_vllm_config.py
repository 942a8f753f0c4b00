"""The launcher's command, parsed by vLLM's own `vllm serve` parser, builds the config we want.

Run: python -m pytest tests/test_launch_vllm_config.py -q   (CPU; needs the harness platform)
Real parts: vLLM 0.20.1's serve argument parser, AsyncEngineArgs.from_cli_args and
create_engine_config, with the plugin loaded, on tiny hybrid (multimodal) and dense configs, and on
each hybrid family of tests/tiny_models.py (Qwen3.5-MoE, Qwen3-Next, Nemotron-H).
"""

from __future__ import annotations

import harness  # noqa: F401  (vLLM's CpuPlatform first)
import pytest
from tiny_models import CPU_FAMILIES, FAMILIES
from vllm.engine.arg_utils import AsyncEngineArgs

from vllm_gdn_hs.cli import launch
from vllm_gdn_hs.names import CONNECTOR_NAME


def _vllm_config(argv):
    cmd = launch.build_plan(launch.parse_args(argv)).command
    i = cmd.index("serve")
    args = harness.serve_parser().parse_args(cmd[i + 2 :])
    args.model = cmd[i + 1]  # `vllm serve MODEL`: the subcommand's positional
    return AsyncEngineArgs.from_cli_args(args).create_engine_config()


def test_hybrid_command_builds_hma_text_only_extraction(hybrid_model, tmp_path):
    cfg = _vllm_config(
        [
            hybrid_model,
            "--target-layer-ids",
            "1",
            "4",
            "--hidden-states-path",
            str(tmp_path),
            "--",
            "--max-model-len",
            "2048",
            "--skip-tokenizer-init",
        ]
    )
    kv = cfg.kv_transfer_config
    assert kv.kv_connector == CONNECTOR_NAME
    assert kv.kv_connector_extra_config == {
        "shared_storage_path": str(tmp_path),
        "layer_ids": [1, 4, 8],
    }
    assert cfg.speculative_config is None  # the layer ids only; no speculative decoding
    assert cfg.scheduler_config.disable_hybrid_kv_cache_manager is False
    assert cfg.cache_config.enable_prefix_caching is False
    assert cfg.model_config.multimodal_config.language_model_only is True


def test_dense_command_with_default_layer_ids(dense_model, tmp_path):
    cfg = _vllm_config(
        [
            dense_model,
            "--hidden-states-path",
            str(tmp_path),
            "--",
            "--max-model-len",
            "2048",
            "--skip-tokenizer-init",
        ]
    )
    assert cfg.kv_transfer_config.kv_connector_extra_config["layer_ids"] == [2, 4, 5, 8]
    assert cfg.cache_config.enable_prefix_caching is False


def test_user_flags_reach_vllm(dense_model, tmp_path):
    cfg = _vllm_config(
        [
            dense_model,
            "--hidden-states-path",
            str(tmp_path),
            "--",
            "--max-model-len",
            "1024",
            "--skip-tokenizer-init",
            "--max-num-batched-tokens",
            "512",
            "--seed",
            "7",
        ]
    )
    assert cfg.model_config.max_model_len == 1024
    assert cfg.scheduler_config.max_num_batched_tokens == 512
    assert cfg.model_config.seed == 7


def test_connector_options_reach_the_connector(hybrid_model, tmp_path):
    from vllm_gdn_hs.connector.checks import config_from

    cfg = _vllm_config(
        [
            hybrid_model,
            "--hidden-states-path",
            str(tmp_path),
            "--",
            "--max-model-len",
            "1024",
            "--skip-tokenizer-init",
            "--kv-transfer-config",
            '{"kv_connector_extra_config": {"write_workers": 8}}',
            "--kv-transfer-config.kv_connector_extra_config.write_backlog_gb=2",
        ]
    )
    hs = config_from(cfg)
    assert (hs.write_workers, hs.write_backlog_gb, hs.shared_storage_path) == (
        8,
        2.0,
        str(tmp_path),
    )
    assert cfg.kv_transfer_config.kv_connector == CONNECTOR_NAME


def test_out_of_range_ids_fail_in_the_launcher_first(hybrid_model, capsys):
    assert launch.main([hybrid_model, "--dry-run", "--target-layer-ids", "1", "9"]) == 2
    assert "out of range" in capsys.readouterr().err
    with pytest.raises(ValueError, match="out of range"):  # and in vLLM's config, if bypassed
        harness.engine_config(hybrid_model, layer_ids=(1, 9))


@pytest.mark.parametrize("family", CPU_FAMILIES)
def test_each_familys_plan_builds_hma_extraction(family_model, tmp_path, family):
    """The launcher's plan for each hybrid family, parsed by vLLM: ids 0 and N in the given
    (unsorted) order, HMA on, prefix caching off, the vision tower off where there is one."""
    model = family_model(family)
    argv = [model, "--target-layer-ids", "8", "0", "3", "--hidden-states-path", str(tmp_path)]
    cfg = _vllm_config([*argv, "--", "--max-model-len", "2048", "--skip-tokenizer-init"])
    assert cfg.kv_transfer_config.kv_connector_extra_config["layer_ids"] == [8, 0, 3]
    assert cfg.model_config.architecture == FAMILIES[family]()["architectures"][0]
    assert cfg.scheduler_config.disable_hybrid_kv_cache_manager is False
    assert cfg.cache_config.enable_prefix_caching is False
    mm = cfg.model_config.multimodal_config
    assert (mm is not None and mm.language_model_only) == ("vision_config" in FAMILIES[family]())
