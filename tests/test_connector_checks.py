"""Every startup error of HybridHiddenStatesConnector names the fix; CPU only.

Run: python -m pytest tests/test_connector_checks.py -q (no GPU, no network).
Covers, on real VllmConfigs of the tiny models built through EngineArgs (the plugin runs the
connector's checks as the config is built, and the connector again when it starts): no layer
ids, another speculative method, layer ids out of range / repeated / missing, pipeline
parallelism, prefix caching on, an unwritable storage path, and bad kv_connector_extra_config
keys or values (pydantic, extra="forbid"). Both roles are checked where they differ.
"""

from __future__ import annotations

import os
import sys

import harness
import pytest
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from vllm_gdn_hs.config import HiddenStatesConfig
from vllm_gdn_hs.connector import HybridHiddenStatesConnector
from vllm_gdn_hs.connector.checks import config_from, validate_vllm_config
from vllm_gdn_hs.version import (
    has_v1_runner,
    model_runner_v2_asked_for,
    requirement,
    runs_model_runner_v2,
)


def make(cfg, role=KVConnectorRole.SCHEDULER):
    return HybridHiddenStatesConnector(cfg, role)


def config_error(model, **kw) -> str:
    """The error of building the config: the plugin runs the connector's checks right
    after VllmConfig's own, before any model loads."""
    with pytest.raises(ValueError) as e:
        harness.engine_config(model, **kw)
    return str(e.value)


@pytest.mark.smoke
def test_valid_config_starts(hybrid_model, tmp_path):
    storage = tmp_path / "new" / "folder"
    cfg = harness.engine_config(hybrid_model, storage=str(storage), layer_ids=(8, 1, 4))
    conn = make(cfg)
    assert conn.layer_ids == [8, 1, 4]
    assert conn._scheduler.storage.storage_path == str(storage)
    assert storage.is_dir() and os.listdir(storage) == []  # created, probe removed


def test_no_layer_ids_anywhere(hybrid_model, tmp_path):
    msg = config_error(hybrid_model, layer_ids=None, storage=str(tmp_path))
    assert "needs the layer ids to extract" in msg
    assert "--speculative-config" in msg and '"method": "extract_hidden_states"' in msg
    assert "eagle_aux_hidden_state_layer_ids" in msg and "kv_connector_extra_config" in msg


def test_layer_ids_in_extra_config_need_no_speculative_config(hybrid_model, tmp_path):
    args = harness.engine_args(hybrid_model, layer_ids=None, storage=str(tmp_path))
    args.kv_transfer_config["kv_connector_extra_config"]["layer_ids"] = [2, 8]
    assert make(args.create_engine_config()).layer_ids == [2, 8]


def test_layer_ids_given_twice_and_different(hybrid_model, tmp_path):
    args = harness.engine_args(hybrid_model, layer_ids=(1, 8), storage=str(tmp_path))
    args.kv_transfer_config["kv_connector_extra_config"]["layer_ids"] = [1, 4]
    with pytest.raises(ValueError, match=r"layer ids given twice and different: \[1, 8\]"):
        args.create_engine_config()


def test_other_speculative_method(hybrid_model, tmp_path):
    ngram = {
        "method": "ngram",
        "num_speculative_tokens": 2,
        "prompt_lookup_max": 3,
        "prompt_lookup_min": 1,
    }
    msg = config_error(
        hybrid_model, layer_ids=None, storage=str(tmp_path), speculative_config=ngram
    )
    assert "method 'ngram' cannot run with it" in msg


def test_connector_rechecks_a_config_changed_after_build(hybrid_model, tmp_path):
    cfg = harness.engine_config(hybrid_model, storage=str(tmp_path))
    cfg.kv_transfer_config.kv_connector_extra_config["layer_ids"] = [1, 99]
    with pytest.raises(ValueError, match=r"layer ids \[99\] are out of range"):
        make(cfg)


@pytest.mark.parametrize(
    "ids, expected",
    [
        (
            (1, 4, 9),
            "layer ids [9] are out of range: this model has 8 layers, so ids must be in 0..8",
        ),
        ((-1, 4, 8), "layer ids [-1] are out of range"),
        ((1, 4, 4, 8), "layer ids [4] are repeated; give each layer id once"),
    ],
)
def test_bad_layer_ids(hybrid_model, tmp_path, ids, expected):
    msg = config_error(hybrid_model, layer_ids=ids, storage=str(tmp_path))
    assert "HybridHiddenStatesConnector: layer ids: " in msg
    assert expected in msg


def test_bad_layer_ids_dense(dense_model, tmp_path):
    msg = config_error(dense_model, layer_ids=(2, 4, 5, 9), storage=str(tmp_path))
    assert "[9] are out of range: this model has 8 layers" in msg


def test_empty_layer_ids(hybrid_model, tmp_path):
    cfg = harness.engine_config(hybrid_model, storage=str(tmp_path))
    cfg.kv_transfer_config.kv_connector_extra_config["layer_ids"] = []
    with pytest.raises(ValueError, match="needs the layer ids to extract"):
        make(cfg)


def test_pipeline_parallel(hybrid_model, tmp_path):
    # Qwen3.5 has no PP support in vLLM, so set PP on a built config, as a PP-capable
    # model would have it.
    cfg = harness.engine_config(hybrid_model, storage=str(tmp_path))
    cfg.parallel_config.pipeline_parallel_size = 2
    with pytest.raises(ValueError) as e:
        make(cfg)
    msg = str(e.value)
    assert "does not support pipeline parallelism" in msg
    assert "--tensor-parallel-size" in msg and "--pipeline-parallel-size" in msg


def test_prefix_caching(dense_model, tmp_path):
    msg = config_error(dense_model, storage=str(tmp_path), enable_prefix_caching=True)
    assert "does not support prefix caching" in msg
    assert "--no-enable-prefix-caching" in msg


def test_unwritable_storage_path(hybrid_model, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    storage = blocker / "hidden_states"
    cfg = harness.engine_config(hybrid_model, storage=str(storage))
    with pytest.raises(ValueError) as e:
        make(cfg)
    msg = str(e.value)
    assert f"shared_storage_path {str(storage)!r} is not writable" in msg
    assert "Not a directory" in msg
    assert "--hidden-states-path" in msg
    assert '"shared_storage_path"' in msg and "--kv-transfer-config" in msg
    assert blocker.read_text() == "not a folder"


@pytest.mark.parametrize(
    "extra, expected",
    [
        ({"shared_storage_pth": "/tmp/x"}, "shared_storage_pth"),
        ({"host_buffers": 0}, "host_buffers"),
        ({"write_workers": "many"}, "write_workers"),
    ],
)
def test_bad_extra_config(hybrid_model, tmp_path, extra, expected):
    cfg = harness.engine_config(hybrid_model, storage=str(tmp_path))
    cfg.kv_transfer_config.kv_connector_extra_config.update(extra)
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ValueError) as e:
            make(cfg, role)
        msg = str(e.value)
        assert msg.startswith("HybridHiddenStatesConnector: bad kv_connector_extra_config: ")
        assert expected in msg


def test_extra_config_forbids_unknown_keys():
    with pytest.raises(ValueError, match="Extra inputs are not permitted"):
        HiddenStatesConfig(bogus=1)


def test_extra_config_defaults(hybrid_model):
    cfg = harness.engine_config(hybrid_model, connector=harness.OURS)
    cfg.kv_transfer_config.kv_connector_extra_config.clear()
    assert config_from(cfg) == HiddenStatesConfig(shared_storage_path="/tmp/hidden_states")


# vLLM 0.26.0 chooses the model runner in VllmConfig; before 0.33.0 the plugin keeps V1.
VLLM_CHOOSES_RUNNER = hasattr(VllmConfig, "_get_v2_model_runner_unsupported_features")


@pytest.mark.skipif(runs_model_runner_v2(), reason="V2 runs when asked for on this release")
def test_v2_model_runner_is_refused_before_0_33(hybrid_model, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    msg = config_error(hybrid_model, storage=str(tmp_path))
    if VLLM_CHOOSES_RUNNER:
        assert "Model Runner V2" in msg  # (on the CPU harness it first asks for Triton)
    else:
        assert "unset VLLM_USE_V2_MODEL_RUNNER" in msg


@pytest.mark.smoke
@pytest.mark.skipif(
    not VLLM_CHOOSES_RUNNER, reason="VllmConfig picks no runner (V1 only, or V2 only)"
)
def test_dense_model_keeps_the_v1_runner(dense_model, tmp_path, monkeypatch):
    """vLLM 0.26.0 picks Model Runner V2 for dense models by default (on a GPU), 0.33.0 for
    every model; where both runners exist the plugin keeps V1 by default, so with our
    connector vLLM must pick V1."""
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    ours = harness.engine_config(dense_model, storage=str(tmp_path))
    assert ours.use_v2_model_runner is False
    assert "HybridHiddenStatesConnector" in ours._get_v2_model_runner_unsupported_features()


@pytest.mark.smoke
@pytest.mark.skipif(not runs_model_runner_v2(), reason="V2 is refused before 0.33.0")
@pytest.mark.parametrize("env", [None, "1", "0"])
def test_runner_from_0_33(hybrid_model, tmp_path, monkeypatch, env):
    """0.33.0 has both runners: V1 by default (vLLM logs why), Model Runner V2 when
    VLLM_USE_V2_MODEL_RUNNER=1 asks for it. 0.34.0 has only V2 and no variable to ask for
    another. Either way the connector's checks let the engine start."""
    if env == "0" and not has_v1_runner():
        pytest.skip("vLLM 0.34.0 has no V1 runner to ask for")
    if env is None:
        monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    else:
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", env)
    v2 = env == "1" or not has_v1_runner()
    ours = harness.engine_config(hybrid_model, storage=str(tmp_path))
    assert getattr(ours, "use_v2_model_runner", True) is v2
    assert model_runner_v2_asked_for() is v2
    assert make(ours).layer_ids == [1, 4, 8]


def test_prefill_context_parallelism_is_refused(hybrid_model, tmp_path):
    cfg = harness.engine_config(hybrid_model, storage=str(tmp_path))
    if not hasattr(cfg.parallel_config, "prefill_context_parallel_size"):
        pytest.skip("this vLLM has no prefill context parallelism")
    cfg.parallel_config.prefill_context_parallel_size = 2
    with pytest.raises(ValueError, match="--prefill-context-parallel-size at 1"):
        validate_vllm_config(cfg)


def test_fp8_without_hs_connectors(hybrid_model, tmp_path, monkeypatch):
    """fp8 quantizes with hs-connectors' code: without it the engine must not start (rather
    than die at its first step)."""
    args = harness.engine_args(hybrid_model, storage=str(tmp_path))
    kv = args.kv_transfer_config
    extra = (
        kv["kv_connector_extra_config"] if isinstance(kv, dict) else kv.kv_connector_extra_config
    )
    extra["fp8"] = True
    assert make(args.create_engine_config()).layer_ids  # with the package: starts
    monkeypatch.setitem(sys.modules, "hs_connectors.fp8_utils", None)  # as if not installed
    with pytest.raises(ValueError) as e:
        args.create_engine_config()
    assert "fp8 needs hs-connectors" in str(e.value) and "pip install" in str(e.value)
    assert f"'hs-connectors{requirement('hs-connectors')}'" in str(e.value)  # pyproject's pin
