"""`vllm-gdn-hs doctor` and `vllm-gdn-hs demo` on a machine without a GPU.

Run: python -m pytest tests/test_doctor.py -q   (CPU; the CLI runs in subprocesses)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from vllm_gdn_hs import doctor
from vllm_gdn_hs.doctor import _compress, checks
from vllm_gdn_hs.version import describe_releases, installed_vllm

CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "vllm_gdn_hs.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_compress():
    assert _compress([0, 1, 2, 4, 5, 7]) == "0-2,4-5,7"
    assert _compress([]) == "-"


def test_doctor_table_for_hybrid_model(hybrid_model):
    r = _cli("doctor", "--model", hybrid_model)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [line for line in r.stdout.splitlines() if line[:4] in ("ok  ", "FAIL")]
    lines = {re.split(r"\s{2,}", line[6:].strip())[0]: line for line in rows}
    assert installed_vllm().base_version in lines["vllm"] and lines["vllm"].startswith("ok")
    assert "V1 (" in lines["model runner"]
    assert (
        lines["plugin via vllm.general_plugins"].startswith("ok")
        and "found" in lines["plugin via vllm.general_plugins"]
    )
    assert "patch_config_vllm" in lines["runtime patches"]
    assert lines["hybrid"].rstrip().endswith("yes")
    assert lines["layers"].rstrip().endswith("8")
    assert lines["linear attention (GDN/Mamba)"].rstrip().endswith("0-2,4-6")
    assert lines["full attention"].rstrip().endswith("3,7")
    assert lines["hidden size"].rstrip().endswith("256")


def test_doctor_dense_model(dense_model):
    rows = {item.strip(): value for item, value, _ in checks(dense_model)}
    assert rows["hybrid"] == "no (dense)"
    assert rows["full attention"] == "0-7"


def test_doctor_bad_model_fails_and_names_the_fix(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    r = _cli("doctor", "--model", str(tmp_path))
    assert r.returncode == 1
    assert "FAIL" in r.stdout and "cannot read" in r.stdout and "fix model" in r.stdout


@CPU_ONLY
def test_demo_without_gpu_says_so_and_runs_doctor(tmp_path):
    r = _cli("demo", "--workdir", str(tmp_path))
    assert r.returncode == 1
    assert "needs a CUDA GPU" in r.stdout
    assert "plugin via vllm.general_plugins" in r.stdout  # the doctor table followed


def test_doctor_unsupported_vllm_names_the_supported_versions(monkeypatch, capsys):
    from packaging.version import Version

    import vllm_gdn_hs.version as version
    from vllm_gdn_hs.doctor import run_doctor

    monkeypatch.setattr(version, "installed_vllm", lambda: Version("0.19.0"))
    assert run_doctor() == 1
    out = capsys.readouterr().out
    assert "FAIL  vllm" in out
    assert f"supports vllm {describe_releases()}, found vllm 0.19.0" in out
    assert "pip install 'vllm==0.20.2'" in out


def test_doctor_storage_checks(hybrid_model, tmp_path, monkeypatch):
    monkeypatch.setattr(doctor, "PROBE_BYTES", 1 << 26)
    folder = tmp_path / "hs" / "new"  # made, as the connector makes it
    rows = {
        item.strip(): (value, problem) for item, value, problem in checks(hybrid_model, str(folder))
    }
    assert all(p is None for _, p in rows.values()), rows
    assert rows["hidden-states path"][0] == str(folder)
    assert float(rows["write speed (one stream, fsync)"][0].split()[0]) > 0
    # hidden 256, 4 layers of bf16: 2,048 bytes a token
    assert rows["at 4 layers (speculators' default)"][0].startswith("2.0 KB/token")
    assert os.listdir(folder) == []  # the probe file is gone


def test_doctor_unwritable_hidden_states_path_names_the_fix(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    r = _cli("doctor", "--hidden-states-path", str(blocker / "hs"))
    assert r.returncode == 1, r.stdout + r.stderr
    fix = [line for line in r.stdout.splitlines() if line.startswith("fix hidden-states path")]
    assert fix and "is not writable" in fix[0] and "--hidden-states-path" in fix[0], r.stdout


def test_doctor_on_a_placeholder_path_names_the_fix(tmp_path):
    r = _cli("doctor", "--model", "/path/to/Qwen3.6-27B")
    assert r.returncode == 1
    fix = [line for line in r.stdout.splitlines() if line.startswith("fix model")]
    assert fix and "model folder /path/to/Qwen3.6-27B does not exist" in fix[0], r.stdout
    assert "Repo id" not in r.stdout


_NO_TORCH = """
import sys
sys.modules["torch"] = None  # an environment without torch: importing it fails
from vllm_gdn_hs.cli import main
sys.exit(main(["doctor", "--hidden-states-path", sys.argv[1]]))
"""


def test_doctor_storage_check_needs_no_torch(tmp_path):
    """doctor reports what is missing instead of crashing where torch is not installed."""
    r = subprocess.run(
        [sys.executable, "-c", _NO_TORCH, str(tmp_path / "hs")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    rows = [line for line in r.stdout.splitlines() if "hidden-states path" in line]
    assert rows and rows[0].startswith("ok"), r.stdout


@pytest.mark.parametrize("command", [[], ["doctor"], ["check"], ["demo"], ["launch"]])
def test_help_is_plain_text(command):
    """--help is read in a terminal: no reST markup."""
    r = _cli(*command, "--help")
    assert r.returncode == 0 and "usage:" in r.stdout
    assert "``" not in r.stdout and ":func:" not in r.stdout


@pytest.mark.parametrize("env", [None, "1"])
def test_doctor_names_the_runner_extraction_runs_on(env, monkeypatch):
    from vllm_gdn_hs.version import runs_model_runner_v2

    if env is None:
        monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    else:
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", env)
    runner = doctor.model_runner()
    if env == "1" and runs_model_runner_v2():
        assert runner.startswith("Model Runner V2")
    else:  # the default on every release (before 0.33.0 the variable is refused at startup)
        assert runner.startswith("V1 (")
