"""vllm_gdn_hs.patch.patch_engine_arg_utils: prefix caching defaults off for our connector; CPU.

Run: python -m pytest tests/test_patch_engine_arg_utils.py -q (no GPU, no
network).
Covers, on real VllmConfigs built through EngineArgs for the tiny dense model (where vLLM's
own default is prefix caching on): our connector turns the default off; an explicit True is
kept and then refused by the connector with a message naming --no-enable-prefix-caching;
other connectors, and no connector, keep vLLM's default.
"""

from __future__ import annotations

import harness
import pytest
from vllm.engine.arg_utils import EngineArgs

from vllm_gdn_hs.patch import patch_engine_arg_utils


def test_patch_wraps_the_defaults_hook():
    name = "_set_default_chunked_prefill_and_prefix_caching_args"
    assert getattr(EngineArgs, name) is getattr(patch_engine_arg_utils, name)
    assert patch_engine_arg_utils._orig.__qualname__ == f"EngineArgs.{name}"


def test_vllm_default_is_on_without_connector(dense_model):
    cfg = harness.engine_config(dense_model, connector=None, layer_ids=None)
    assert cfg.cache_config.enable_prefix_caching is True


def test_default_off_with_our_connector(dense_model):
    cfg = harness.engine_config(dense_model, connector=harness.OURS)
    assert cfg.cache_config.enable_prefix_caching is False


def test_explicit_false_kept(dense_model):
    cfg = harness.engine_config(dense_model, connector=harness.OURS, enable_prefix_caching=False)
    assert cfg.cache_config.enable_prefix_caching is False


def test_explicit_true_kept_then_refused_by_connector(dense_model, tmp_path):
    args = harness.engine_args(
        dense_model, connector=harness.OURS, storage=str(tmp_path), enable_prefix_caching=True
    )
    with pytest.raises(ValueError, match="--no-enable-prefix-caching") as e:
        args.create_engine_config()
    assert args.enable_prefix_caching is True  # the user's choice was kept, then refused
    assert "does not support prefix caching" in str(e.value)


@pytest.mark.parametrize("connector", [harness.STOCK, "ExampleConnector"])
def test_other_connectors_untouched(dense_model, connector):
    cfg = harness.engine_config(dense_model, connector=connector)
    assert cfg.cache_config.enable_prefix_caching is True
