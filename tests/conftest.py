"""Shared test setup: the CPU harness, tiny model folders and the `gpu` marker.

Run: python -m pytest tests -q -m "not gpu" (CPU only, no network).
On the device: python -m pytest tests -q -m gpu.

Two modes, chosen by whether torch sees a CUDA GPU:

- No GPU (CI, laptops): ``harness`` is imported first; it installs vLLM's CpuPlatform
  before any other vLLM module looks at the platform. Tests marked ``gpu`` are skipped,
  with the reason (:func:`pytest_collection_modifyitems`).
- A GPU is visible: the CpuPlatform switch is process-wide and would break in-process
  GPU engines, so it is not made: a test module that imports ``harness`` is skipped as a
  whole, by the harness itself. Run those on a CPU machine, or here with
  ``CUDA_VISIBLE_DEVICES=``.

Either way the plugin is loaded once, through vLLM's own loader, so the runtime patches
are on for every test whatever the order (``EngineArgs`` and ``LLM`` would load it anyway
on first use). Tests of stock vLLM (no plugin) run in a fresh interpreter with
``VLLM_PLUGINS=""``: the ``run_python`` fixture.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)

GPU = torch.cuda.is_available()

if not GPU:
    import harness  # noqa: F401  (must come before any other vLLM import)

import vllm.plugins  # noqa: E402

import vllm_gdn_hs.plugin  # noqa: E402

vllm.plugins.load_general_plugins()
if not vllm_gdn_hs.plugin._registered:
    raise RuntimeError(
        "vLLM's plugin loader did not load vllm_gdn_hs: is it installed (pip install -e .) "
        "and not excluded by VLLM_PLUGINS?"
    )

from tiny_models import (  # noqa: E402
    dense_config_dict,
    family_config_dict,
    hybrid_config_dict,
    write_config,
)


def pytest_collection_modifyitems(config, items):
    if GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none visible); run on the device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _vllm_logs_to_caplog(caplog):
    """Our loggers live under ``vllm``, which vLLM's logging setup sets not to propagate to the
    root logger, where caplog listens; hand caplog's handler to the ``vllm`` logger as well
    while it does not. vLLM 0.33.0 and later set their logging up when an engine starts, and
    that setup drops the handlers it finds: set it up first, as the engine would, so that an
    engine started in the test finds it done and keeps caplog's handler."""
    import vllm.logger

    configure = getattr(vllm.logger, "configure_logging_if_needed", None)  # 0.33.0+
    if configure is not None:
        from vllm.config import LoggingConfig

        configure(LoggingConfig())
    vllm_logger = logging.getLogger("vllm")
    added = not vllm_logger.propagate
    if added:
        vllm_logger.addHandler(caplog.handler)
    yield
    if added:
        vllm_logger.removeHandler(caplog.handler)


@pytest.fixture(scope="session")
def hybrid_model(tmp_path_factory) -> str:
    """Tiny multimodal Qwen3.5 (8 layers: GDN x3 + full attention, twice), config only."""
    return write_config(str(tmp_path_factory.mktemp("models") / "hybrid"), hybrid_config_dict())


@pytest.fixture(scope="session")
def dense_model(tmp_path_factory) -> str:
    """Tiny Qwen3 (8 layers: speculators' default ids for 6 layers repeat one)."""
    path = str(tmp_path_factory.mktemp("models") / "dense")
    return write_config(path, dense_config_dict(num_hidden_layers=8))


@pytest.fixture(scope="session")
def family_model(tmp_path_factory):
    """``family_model(family)``: the config-only folder of a tiny model of tiny_models.FAMILIES."""
    root = tmp_path_factory.mktemp("families")

    def get(family: str) -> str:
        path = root / family
        return str(path) if path.exists() else write_config(str(path), family_config_dict(family))

    return get


def _run_python(code: str, *, plugins: bool, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter, with tests/ on its path.

    ``plugins=False`` sets ``VLLM_PLUGINS=""`` so vLLM loads no general plugin: that
    process sees stock vLLM, without our patches or connector. The code is a CPU harness
    script: the interpreter sees no GPU (``CUDA_VISIBLE_DEVICES=``), so that ``harness``
    runs there on a GPU machine too.
    """
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]))
    env["CUDA_VISIBLE_DEVICES"] = ""
    if plugins:
        env.pop("VLLM_PLUGINS", None)
    else:
        env["VLLM_PLUGINS"] = ""
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="session")
def run_python():
    """``run_python(code, plugins=...)``: a fresh interpreter (see :func:`_run_python`)."""
    return _run_python


@pytest.fixture(params=["v1", "v2"], ids=["runner-v1", "runner-v2"])
def runner(request):
    """Which model runner hands the rows over (tests that step the patched runner): V1 where
    the release has it, and Model Runner V2 where it is patched."""
    from vllm_gdn_hs.version import has_v1_runner, runs_model_runner_v2

    if request.param == "v2" and not runs_model_runner_v2():
        pytest.skip("Model Runner V2 is patched from vLLM 0.33.0")
    if request.param == "v1" and not has_v1_runner():
        pytest.skip("vLLM 0.34.0 and later have no V1 runner")
    return request.param
