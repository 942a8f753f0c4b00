"""Plugin registration, the vLLM version gate and the patch registry; CPU only.

Run: python -m pytest tests/test_register.py -q (no GPU, no network; the tests of what
vLLM's plugin loader does start fresh interpreters, ~10 s each).
Covers: vLLM's own plugin loader finds the plugin and KVConnectorFactory resolves
HybridHiddenStatesConnector lazily; register() is idempotent and a Patch refuses to apply
twice; an unsupported vLLM is refused naming the supported versions; a newer, untested one
runs only with VLLM_GDN_HS_ALLOW_UNTESTED_VLLM=1 and every hook its patches need, else is
refused naming the missing one, before any patch applies; the supported
versions come from the package metadata and equal the pin in pyproject.toml; every
runtime patch module has a test module and a source twin in patches/<vllm version>/.
"""

from __future__ import annotations

import json
import os

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

import vllm_gdn_hs.names
import vllm_gdn_hs.plugin
from vllm_gdn_hs import patch
from vllm_gdn_hs.version import (
    ALLOW_UNTESTED,
    REFUSED,
    RELEASES,
    UnsupportedVllmError,
    check_vllm,
    describe_releases,
    has_v1_runner,
    install_command,
    installed_vllm,
    is_untested,
    requirement,
    runs_model_runner_v2,
)

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_LOADER = """
import json, sys
import vllm.plugins
vllm.plugins.load_general_plugins()
import vllm_gdn_hs.plugin, vllm_gdn_hs.patch as p
lazy = "vllm_gdn_hs.connector" not in sys.modules
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
cls = KVConnectorFactory.get_connector_class(
    KVTransferConfig(kv_connector="HybridHiddenStatesConnector", kv_role="kv_producer"))
print("RESULT " + json.dumps(dict(
    registered=vllm_gdn_hs.plugin._registered, applied=p._applied, lazy=lazy,
    cls=cls.__module__ + "." + cls.__qualname__)))
"""


@pytest.mark.smoke
def test_vllm_plugin_loader_finds_plugin_and_connector(run_python):
    proc = run_python(_LOADER, plugins=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    got = json.loads(lines[-1][len("RESULT ") :])
    assert got == {
        "registered": True,
        "applied": list(patch.patches_for()),
        # Registered by module path: the connector module loads only when resolved.
        "lazy": True,
        "cls": "vllm_gdn_hs.connector.HybridHiddenStatesConnector",
    }


def test_factory_resolves_our_class_in_process():
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma

    from vllm_gdn_hs.connector import HybridHiddenStatesConnector

    cls = KVConnectorFactory.get_connector_class(
        KVTransferConfig(kv_connector=vllm_gdn_hs.names.CONNECTOR_NAME, kv_role="kv_producer")
    )
    assert cls is HybridHiddenStatesConnector
    assert supports_hma(cls)


def test_register_is_idempotent():
    # conftest loaded the plugin through vLLM; calling register() again changes nothing.
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    loader = KVConnectorFactory._registry[vllm_gdn_hs.names.CONNECTOR_NAME]
    applied = list(patch._applied)
    assert applied == list(patch.patches_for())
    vllm_gdn_hs.plugin.register()
    vllm_gdn_hs.plugin.register()
    assert patch._applied == applied
    assert patch.apply_patches() == applied
    assert KVConnectorFactory._registry[vllm_gdn_hs.names.CONNECTOR_NAME] is loader


@pytest.mark.parametrize("name", patch.patches_for())
def test_applied_patch_refuses_second_apply(name):
    import importlib

    module = importlib.import_module(f"vllm_gdn_hs.patch.{name}")
    assert module.PATCH.target._vllm_gdn_hs_patched is True
    for attr, value in module.PATCH.attrs.items():
        assert getattr(module.PATCH.target, attr) is value
    with pytest.raises(RuntimeError, match="is already patched"):
        module.PATCH.apply()


def test_patch_replaces_adds_and_refuses_twice():
    class Target:
        def old(self):
            return "old"

    def new(self):
        return "new"

    p = patch.Patch(Target, {"old": new, "extra": 42})
    p.apply()
    assert Target().old() == "new" and Target.extra == 42
    with pytest.raises(RuntimeError, match="Target is already patched"):
        p.apply()
    # A second Patch object for the same class is refused too.
    with pytest.raises(RuntimeError, match="Target is already patched"):
        patch.Patch(Target, {"old": new}).apply()


def _pyproject_vllm_pin() -> Requirement:
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    (req,) = [Requirement(d) for d in deps if Requirement(d).name == "vllm"]
    return req


# Every vLLM release published from 0.19.1 to 0.34.0 (PyPI).
PUBLISHED = ["0.19.1", "0.20.0", "0.20.1", "0.20.2", "0.21.0", "0.22.0", "0.22.1", "0.23.0"]
PUBLISHED += ["0.24.0", "0.25.0", "0.25.1", "0.26.0", "0.27.0", "0.27.1", "0.28.0", "0.29.0"]
PUBLISHED += ["0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0"]


def test_supported_vllm_is_the_pyproject_pin():
    pin = _pyproject_vllm_pin()
    assert requirement("vllm") == pin.specifier
    # The requirement admits exactly the supported releases; every published release between
    # the first and the last is supported or refused with its reason, never forgotten.
    assert [v for v in PUBLISHED if v in pin.specifier] == list(RELEASES)
    first, last = PUBLISHED.index(RELEASES[0]), PUBLISHED.index(RELEASES[-1])
    assert sorted([*RELEASES, *REFUSED], key=Version) == PUBLISHED[first : last + 1]
    assert all(reason.strip() for reason in REFUSED.values())


def test_installed_vllm_is_supported():
    installed = installed_vllm()
    assert check_vllm() == installed and installed.base_version in list(RELEASES)
    v1 = (patch.V1_RUNNER_PATCH,) if has_v1_runner() else ()
    v2 = (patch.MODEL_RUNNER_V2_PATCH,) if runs_model_runner_v2() else ()
    assert patch.patches_for() == patch.PATCHES + v1 + v2
    # A local build of a supported release is the same release.
    assert check_vllm(Version("0.20.1+cu130")) == Version("0.20.1+cu130")
    assert check_vllm(Version("0.26.0")) == Version("0.26.0")


@pytest.mark.parametrize(
    "version, nearest",
    [("0.19.0", "0.20.2"), ("0.20.0", "0.20.2"), ("0.35.0", "0.34.0"), ("1.0.0", "0.34.0")],
)
def test_unsupported_vllm_names_supported_versions(version, nearest, monkeypatch):
    monkeypatch.delenv(ALLOW_UNTESTED, raising=False)
    with pytest.raises(UnsupportedVllmError) as e:
        check_vllm(Version(version))
    msg = str(e.value)
    # a newer release names the way to run it untested; an older one cannot run
    assert (ALLOW_UNTESTED in msg) == (Version(version) > Version(RELEASES[-1]))
    assert f"found vllm {version}" in msg
    assert f"supports vllm {describe_releases()}" in msg
    assert (
        f"nearest supported release: {'uv ' * (nearest == '0.34.0')}pip install 'vllm=={nearest}'"
        in msg
    )
    # 0.34.0's flashinfer pin does not resolve from the index without the repository's overrides
    assert ("--override overrides.txt" in msg) == (nearest == "0.34.0")


def test_refused_release_says_why_and_what_to_install(monkeypatch):
    import vllm_gdn_hs.version as v

    monkeypatch.setattr(v, "REFUSED", {"0.24.1": "its hidden states are all zeros"})
    with pytest.raises(UnsupportedVllmError) as e:
        check_vllm(Version("0.24.1"))
    assert str(e.value) == (
        "vllm-gdn-hs refuses vllm 0.24.1: its hidden states are all zeros. "
        "Install the nearest supported release: pip install 'vllm==0.24.0'"
    )
    assert describe_releases().endswith(", except 0.24.1")


# vLLM 0.33.0 configures its logging in each process it starts, not at import: as it does.
_LOGGING = """
import vllm.logger
if hasattr(vllm.logger, "configure_logging_if_needed"):
    from vllm.config.logging import LoggingConfig
    vllm.logger.configure_logging_if_needed(LoggingConfig())
"""

# As if vLLM RELEASE were installed (the code is prefixed with RELEASE = "..." and what to
# take away from vLLM first).
_AS_IF_INSTALLED = """
import json, sys
import vllm_gdn_hs.version as v
from packaging.version import Version
v.installed_vllm = lambda: Version(RELEASE)
import vllm.plugins
vllm.plugins.load_general_plugins()  # must not raise
import vllm_gdn_hs.plugin, vllm_gdn_hs.patch as p
from vllm.config import KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.engine.arg_utils import EngineArgs
import importlib
targets = [VllmConfig, KVTransferConfig, EngineArgs]  # every class a patch may replace
for module in ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner"):
    try:  # each runner the release has: V1 up to 0.33.0, Model Runner V2 from 0.22.0
        targets.append(importlib.import_module(module).GPUModelRunner)
    except ModuleNotFoundError:
        pass
try:
    KVConnectorFactory.get_connector_class(
        KVTransferConfig(kv_connector="HybridHiddenStatesConnector", kv_role="kv_producer"))
    error = None
except Exception as e:
    error = type(e).__name__ + ": " + str(e)
print("RESULT " + json.dumps(dict(
    applied=p._applied, error=error,
    patched=[t.__qualname__ for t in targets if hasattr(t, "_vllm_gdn_hs_patched")])))
"""


def test_unsupported_vllm_warns_and_stays_out_of_the_way(run_python):
    """vLLM calls register() in every process: on an unsupported release it must not break
    vLLM for those who never name the connector, and naming it must say what to install."""
    got, out = _as_if_installed(run_python, "0.19.0")
    assert got["applied"] == [] and got["patched"] == []
    assert got["error"].startswith(
        f"UnsupportedVllmError: vllm-gdn-hs supports vllm {describe_releases()}"
    )
    assert "found vllm 0.19.0" in got["error"]
    warnings = [ln for ln in out if "found vllm 0.19.0" in ln and not ln.startswith("RESULT")]
    assert len(warnings) == 1 and "WARNING" in warnings[0], warnings


def _as_if_installed(run_python, release: str, take_away: str = "") -> tuple[dict, list[str]]:
    """Load vLLM's plugins as if ``release`` were installed, after running ``take_away``: what
    was applied and patched, the error naming the connector gives, and the output's lines."""
    code = f"RELEASE = {release!r}\n{take_away}\n{_AS_IF_INSTALLED}"
    proc = run_python(_LOGGING + code, plugins=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT ") :]), (proc.stdout + proc.stderr).splitlines()


def test_untested_release_runs_only_when_allowed(monkeypatch):
    newest = Version(RELEASES[-1])
    newer = Version(f"{newest.major}.{newest.minor + 1}.0")  # the next release, not yet tested
    monkeypatch.delenv(ALLOW_UNTESTED, raising=False)
    with pytest.raises(UnsupportedVllmError, match=f"or set {ALLOW_UNTESTED}=1 to run vllm"):
        check_vllm(newer)
    for value in ("0", "yes", ""):
        monkeypatch.setenv(ALLOW_UNTESTED, value)
        with pytest.raises(UnsupportedVllmError):
            check_vllm(newer)
    monkeypatch.setenv(ALLOW_UNTESTED, "1")
    assert check_vllm(newer) == newer and check_vllm(Version("1.0.0+cu130"))
    assert is_untested(newer) and not is_untested(RELEASES[-1])
    with pytest.raises(UnsupportedVllmError, match=r"found vllm 0\.19\.0"):
        check_vllm(Version("0.19.0"))  # older than the first: never
    # An untested release takes the newest release's patches.
    assert patch.patches_for(str(newer)) == patch.patches_for(RELEASES[-1]) != ()
    assert patch.patches_for("0.19.0") == ()


def test_untested_release_with_every_hook_runs_and_says_so(run_python, monkeypatch):
    """A newer vLLM whose methods the patches wrap are all there (as the newest release's):
    with the variable set, every patch applies and one warning says the release is untested
    and how to check its files."""
    if installed_vllm().base_version != RELEASES[-1]:
        pytest.skip(f"the newest release's hooks are those of vLLM {RELEASES[-1]}")
    monkeypatch.setenv(ALLOW_UNTESTED, "1")
    got, out = _as_if_installed(run_python, "0.99.0")
    assert got["error"] is None and got["applied"] == list(patch.patches_for(RELEASES[-1]))
    assert len(got["patched"]) == 4  # VllmConfig, KVTransferConfig, EngineArgs, the runner
    warnings = [ln for ln in out if "vllm 0.99.0 is newer than" in ln]
    assert len(warnings) == 1 and "WARNING" in warnings[0], warnings
    assert "vllm-gdn-hs check DIR --reference MODEL" in warnings[0]


_ENGINE_ARGS_METHOD = "_set_default_chunked_prefill_and_prefix_caching_args"
_TAKE_AWAY = {  # what a newer vLLM may rename, and the message that names it
    "a wrapped method": (
        f"from vllm.engine.arg_utils import EngineArgs\ndel EngineArgs.{_ENGINE_ARGS_METHOD}",
        "patch_engine_arg_utils needs (AttributeError: type object 'EngineArgs' has no "
        f"attribute '{_ENGINE_ARGS_METHOD}')",
    ),
    "a field of the forward pass's state": (
        "import typing, vllm.v1.worker.gpu.model_runner as m\n"
        "m.ExecuteModelState = typing.NamedTuple("
        "'ExecuteModelState', [('input_batch', object), ('hidden_states', object)])",
        "patch_worker_gpu_model_runner_v2 needs (AttributeError: ExecuteModelState has no "
        "'aux_hidden_states')",
    ),
}


@pytest.mark.parametrize("what", list(_TAKE_AWAY))
def test_untested_release_without_a_hook_is_refused_naming_it(what, run_python, monkeypatch):
    """A newer vLLM that renamed what a patch wraps or reads: nothing is applied, vLLM runs on
    without the plugin, and naming the connector says what is gone and what to install."""
    if what != "a wrapped method" and not runs_model_runner_v2():
        pytest.skip("the newest release's runner patch needs Model Runner V2 (0.33.0 on)")
    monkeypatch.setenv(ALLOW_UNTESTED, "1")
    take_away, named = _TAKE_AWAY[what]
    got, out = _as_if_installed(run_python, "0.99.0", take_away)
    assert got["applied"] == [] and got["patched"] == []
    assert got["error"].startswith(
        f"UnsupportedVllmError: vllm 0.99.0 lacks what the runtime patch {named}"
    ), got["error"]
    install = install_command(RELEASES[-1])
    assert got["error"].endswith(f"Install the newest tested release: {install}")
    warnings = [ln for ln in out if "vllm 0.99.0 lacks" in ln and not ln.startswith("RESULT")]
    assert len(warnings) == 1 and "WARNING" in warnings[0], warnings


_PLAIN_CONFIG = """
import json, sys
import harness
from vllm.engine.arg_utils import EngineArgs
from vllm.config.utils import hash_factors
out = {}
for model in sys.argv[1:]:
    c = EngineArgs(model=model, skip_tokenizer_init=True, max_model_len=2048,
                   language_model_only="hybrid" in model).create_engine_config()
    out[model] = dict(
        # The compile cache key: compute_hash() up to 0.33.0, compile_factors() from 0.34.0.
        hash=c.compute_hash() if hasattr(c, "compute_hash") else hash_factors(c.compile_factors()),
        prefix_caching=c.cache_config.enable_prefix_caching,
        hma=not c.scheduler_config.disable_hybrid_kv_cache_manager,
        spec=repr(c.speculative_config), kv=repr(c.kv_transfer_config))
print("RESULT " + json.dumps(out))
"""


def test_patches_are_inert_without_our_connector(run_python, hybrid_model, dense_model):
    """The patches are applied in every vLLM process; an engine that does not name our
    connector gets exactly the config it gets from stock vLLM."""
    code = _PLAIN_CONFIG.replace("sys.argv[1:]", repr([hybrid_model, dense_model]))
    results = []
    for plugins in (True, False):
        proc = run_python(code, plugins=plugins)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        assert proc.returncode == 0 and lines, proc.stderr[-3000:]
        results.append(json.loads(lines[-1][len("RESULT ") :]))
    assert results[0] == results[1]


def test_unsupported_vllm_has_no_patches():
    assert patch.patches_for("0.19.0") == ()


def test_each_runner_is_patched_where_it_runs_extraction():
    # V1 up to V1_RUNNER_UNTIL (0.34.0 deleted it), Model Runner V2 from MODEL_RUNNER_V2_FROM.
    from vllm_gdn_hs.version import MODEL_RUNNER_V2_FROM, V1_RUNNER_UNTIL

    v1, v2 = patch.V1_RUNNER_PATCH, patch.MODEL_RUNNER_V2_PATCH
    before = RELEASES[RELEASES.index(MODEL_RUNNER_V2_FROM) - 1]
    assert patch.patches_for(RELEASES[0]) == patch.patches_for(before) == (*patch.PATCHES, v1)
    both = [r for r in RELEASES if Version(MODEL_RUNNER_V2_FROM) <= Version(r)]
    both = [r for r in both if Version(r) <= Version(V1_RUNNER_UNTIL)]
    assert both and all(patch.patches_for(r) == (*patch.PATCHES, v1, v2) for r in both)
    after = RELEASES[RELEASES.index(V1_RUNNER_UNTIL) + 1]
    assert patch.patches_for(after) == patch.patches_for(RELEASES[-1]) == (*patch.PATCHES, v2)


def test_every_patch_module_has_a_test_module():
    tests = os.path.dirname(os.path.abspath(__file__))
    for name in (*patch.PATCHES, patch.V1_RUNNER_PATCH, patch.MODEL_RUNNER_V2_PATCH):
        assert os.path.isfile(os.path.join(tests, f"test_{name}.py")), name


def _series_folder(release: str) -> str:
    """patches/<folder>/ whose VLLM_VERSIONS lists ``release``."""
    patches = os.path.join(REPO, "patches")
    for folder in sorted(os.listdir(patches)):
        listed = os.path.join(patches, folder, "VLLM_VERSIONS")
        if os.path.isfile(listed) and release in open(listed).read().split():
            return os.path.join(patches, folder)
    raise AssertionError(f"vllm {release} is in no patches/*/VLLM_VERSIONS")


@pytest.mark.parametrize(
    "release, name", [(r, n) for r in list(RELEASES) for n in patch.patches_for(r)]
)
def test_every_runtime_patch_has_a_source_twin(release, name):
    # patch_worker_gpu_model_runner -> the one file naming worker, gpu, model and runner
    # whose DEP-3 Origin names vllm_gdn_hs/patch/patch_worker_gpu_model_runner.py
    series = _series_folder(release)
    words = name.removeprefix("patch_").split("_")
    files = [f for f in os.listdir(series) if f.endswith(".patch")]
    origin = f"vllm_gdn_hs/patch/{name}.py)"
    twins = [
        f
        for f in files
        if all(w in f.lower() for w in words) and origin in open(os.path.join(series, f)).read()
    ]
    assert len(twins) == 1, f"{name}: no single twin in {series} among {files}"


_LOG = """
import vllm_gdn_hs.connector.worker as c, vllm_gdn_hs.patch.patch_config_vllm as p
c.logger.info("connector line")
p.logger.info("patch line")
"""


def test_info_lines_reach_vllms_log(run_python):
    """The writer's progress and shutdown lines are INFO: they must go through vLLM's own
    logging setup (its handler on stdout, at VLLM_LOGGING_LEVEL), not be dropped."""
    proc = run_python(_LOGGING + _LOG, plugins=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for line in ("connector line", "patch line"):
        assert any(line in ln and "INFO" in ln for ln in proc.stdout.splitlines()), proc.stdout
