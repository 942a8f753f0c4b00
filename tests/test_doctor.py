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

from vllm_gdn_hs.cli import doctor, host
from vllm_gdn_hs.cli.doctor import _compress
from vllm_gdn_hs.version import describe_releases, installed_vllm, runner_in_use

CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")


def checks(*args, **kwargs) -> list[host.Row]:
    """Every row of the doctor's groups, in order."""
    return [row for rows in doctor.iter_checks(*args, **kwargs) for row in rows]


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
    r = _cli("doctor", "--model", hybrid_model, "--load")
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [line for line in r.stdout.splitlines() if line[:4] in ("ok  ", "FAIL")]
    lines = {re.split(r"\s{2,}", line[6:].strip())[0]: line for line in rows}
    assert installed_vllm().base_version in lines["vllm"] and lines["vllm"].startswith("ok")
    assert runner_in_use() in lines["model runner"]
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


# family -> (linear attention (GDN/Mamba2), full attention, MLP or MoE only) as doctor prints them
FAMILY_ROWS = {
    "qwen3_5": ("0-2,4-6", "3,7", None),
    "qwen3_5_moe": ("0-2,4-6", "3,7", None),
    "qwen3_5_moe_text": ("0-2,4-6", "3,7", None),
    "qwen3_next": ("0-2,4-6", "3,7", None),
    "nemotron_h": ("0,2,5", "3,6", "1,4,7"),  # M-M*-M*-
    "nemotron_h_moe": ("0,2,5", "3,6", "1,4,7"),  # M-M*EM*E
}


@pytest.mark.parametrize("family", FAMILY_ROWS)
def test_doctor_model_rows_of_each_family(family_model, family):
    rows, info = doctor.model_checks(family_model(family))
    values = {item.strip(): value for item, value, problem in rows if not problem}
    assert len(values) == len(rows), rows  # no row fails
    linear, full, mlp = FAMILY_ROWS[family]
    assert values["aux hidden states in vLLM"] == "yes"
    assert (values["hybrid"], values["layers"], info.hidden_size) == ("yes", "8", 256)
    assert values["linear attention (GDN/Mamba)"] == linear
    assert values["full attention"] == full
    assert values.get("MLP or MoE only") == mlp


def test_doctor_bad_model_fails_and_names_the_fix(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    r = _cli("doctor", "--model", str(tmp_path))
    assert r.returncode == 1
    assert "FAIL" in r.stdout and "cannot read" in r.stdout and "fix model" in r.stdout


@CPU_ONLY
def test_demo_without_gpu_says_so_in_one_line(tmp_path):
    r = _cli("demo", "--workdir", str(tmp_path))
    assert r.returncode == 2 and r.stdout == ""
    said = [line for line in r.stderr.splitlines() if "demo" in line]
    assert said == [
        "error: vllm-gdn-hs demo needs a CUDA GPU and none is visible here; run it on a GPU "
        "machine (vllm-gdn-hs doctor checks this one's install)"
    ], r.stderr
    assert not os.listdir(tmp_path)


_BARE = """
import os, sys, time
t0 = time.perf_counter()
from vllm_gdn_hs.cli import main
rc = main(["doctor"])
print("IMPORTED", "vllm" in sys.modules, "torch" in sys.modules)
sys.exit(rc)
"""


def test_doctor_without_arguments_imports_nothing_heavy_and_writes_nothing(tmp_path):
    """The README's install line: package metadata, /proc and the RECORDs only (seconds, not
    the minute that importing vLLM and torch takes on 2 cores), offline, writing nothing; the
    plugin's load through vLLM is one row that names --load."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HOME": str(tmp_path), "HF_HOME": str(tmp_path)}
    r = subprocess.run(
        [sys.executable, "-c", _BARE], capture_output=True, text=True, timeout=300,
        cwd=tmp_path, env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "IMPORTED False False" in r.stdout
    assert not os.listdir(tmp_path)
    rows = {line[6:48].strip(): line[:4] for line in r.stdout.splitlines() if line[4:6] == "  "}
    assert rows["plugin entry point"] == rows["installed files"] == rows["vllm"] == "ok  "
    assert rows["plugin via vllm.general_plugins"] == "skip"
    assert "skipped (needs --load: it imports vLLM and torch" in r.stdout


def test_overlapping_files_reads_each_distributions_metadata_once(monkeypatch):
    """dist.metadata parses METADATA at each read: once per file was 41 s of doctor's 68."""
    reads: dict[int, int] = {}

    class Counted:
        def __init__(self, dist):
            self.dist = dist

        @property
        def metadata(self):
            reads[id(self)] = reads.get(id(self), 0) + 1
            return self.dist.metadata

        @property
        def files(self):
            return self.dist.files

    real = [Counted(d) for d in doctor.metadata.distributions()]
    monkeypatch.setattr(doctor.metadata, "distributions", lambda **kw: iter(real))
    doctor.overlapping_files()
    assert len(reads) == len(real) and set(reads.values()) == {1}


def test_doctor_unsupported_vllm_names_the_supported_versions(monkeypatch, capsys):
    from packaging.version import Version

    import vllm_gdn_hs.version as version
    from vllm_gdn_hs.cli.doctor import run_doctor

    monkeypatch.setattr(version, "installed_vllm", lambda: Version("0.19.0"))
    assert run_doctor() == 1
    out = capsys.readouterr().out
    assert "FAIL  vllm" in out
    assert f"supports vllm {describe_releases()}, found vllm 0.19.0" in out
    assert "pip install 'vllm==0.20.2'" in out


def test_doctor_untested_vllm_says_how_to_run_it(monkeypatch, capsys):
    from packaging.version import Version

    import vllm_gdn_hs.version as version
    from vllm_gdn_hs.cli.doctor import run_doctor

    monkeypatch.setattr(version, "installed_vllm", lambda: Version("0.99.0"))
    monkeypatch.delenv(version.ALLOW_UNTESTED, raising=False)
    assert run_doctor() == 1
    out = capsys.readouterr().out
    assert re.search(r"FAIL\s+vllm\s+0\.99\.0 \(untested, run with VLLM_GDN_HS_ALLOW_UNTE", out)
    assert f"or set {version.ALLOW_UNTESTED}=1 to run vllm 0.99.0 untested" in out
    monkeypatch.setenv(version.ALLOW_UNTESTED, "1")
    rows = {item.strip(): (value, problem) for item, value, problem in checks(load=True)}
    assert rows["vllm"] == (f"0.99.0 (untested, run with {version.ALLOW_UNTESTED}=1)", None)
    assert rows["plugin via vllm.general_plugins"] == ("found", None)


@pytest.mark.parametrize(
    "ids, label", [(None, "2,4,5,8"), ([1, 3], "1,3,8"), ([1, 8, 3], "1,8,3"), ([9], None)]
)
def test_doctor_storage_checks(hybrid_model, tmp_path, monkeypatch, ids, label):
    """The folder is probed, not made; the probe's size and place come in a row before it is
    written; the bytes per token are those of the ids the launcher would extract (its
    defaults, or the ids given plus the last layer; none for ids it refuses)."""
    monkeypatch.setattr(host, "PROBE_BYTES", 1 << 26)
    folder = tmp_path / "hs" / "new"  # the launcher would make it; doctor does not
    said = []
    real = host.write_speed

    def speed(where, nbytes):
        assert said and said[-1][0] == "  write probe", "the probe is said before it is written"
        return real(where, nbytes)

    monkeypatch.setattr(host, "write_speed", speed)
    for group in doctor.iter_checks(hybrid_model, str(folder), layer_ids=ids):
        said += group
    rows = {item.strip(): (value, problem) for item, value, problem in said}
    assert all(p is None for _, p in rows.values()), rows
    assert rows["hidden-states path"][0] == f"{folder} (missing: the launcher makes it; " \
        f"probed in {tmp_path})"  # fmt: skip
    assert rows["write probe"][0] == (
        f"writes 0.06 GiB to {tmp_path}/.vllm-gdn-hs-probe-{os.getpid()}, then removes it"
    )
    assert float(rows["write speed (one stream, fsync)"][0].split()[0]) > 0
    sizing = [item for item in rows if item.startswith("at layers")]
    if label is None:
        assert not sizing
    else:  # hidden 256, bf16: 512 bytes a token per layer
        assert sizing == [f"at layers {label}"]
        per_token = 512 * len(label.split(",")) / 1e3
        assert rows[sizing[0]][0].startswith(f"{per_token:.1f} KB/token"), rows[sizing[0]]
    assert os.listdir(tmp_path) == []  # nothing made, the probe file gone


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


@pytest.mark.parametrize("env", [None, "1", "0"])
def test_doctor_names_the_runner_extraction_runs_on(env, monkeypatch):
    from vllm_gdn_hs.version import has_v1_runner, runs_model_runner_v2

    if env is None:
        monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    else:
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", env)
    runner = runner_in_use()
    if not has_v1_runner():  # 0.34.0: one runner, whatever the variable says
        assert runner.startswith("Model Runner V2 (the only runner")
    elif runs_model_runner_v2():  # 0.33.0: V1 unless the variable asks for V2
        assert runner.startswith("Model Runner V2 (" if env == "1" else "V1 (")
    else:  # before 0.33.0 V1 (the variable asking for V2 is refused at startup)
        assert runner.startswith("V1 (")


def _kernel_files(root, cgroup_line: str, files: dict[str, str], avail_kb: int = 100 << 20):
    """A /proc and a /sys/fs/cgroup as the kernel shows them: the process's cgroup line,
    MemAvailable, and the cgroup's files (paths relative to the cgroup mount)."""
    proc, cg = root / "proc", root / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup_line + "\n")
    (proc / "meminfo").write_text(f"MemTotal: {2 * avail_kb} kB\nMemAvailable: {avail_kb} kB\n")
    for rel, text in files.items():
        (cg / rel).parent.mkdir(parents=True, exist_ok=True)
        (cg / rel).write_text(text + "\n")
    return str(proc), str(cg)


@pytest.mark.parametrize(
    "cgroup_line, files",
    [
        # cgroup v2 (Slurm's cgroup/v2 plugin): the job's folder holds memory.max
        ("0::/slurm/job_7", {"slurm/job_7/memory.max": "8000000000",
                             "slurm/job_7/memory.current": "2000000000"}),
        # cgroup v1, the job's folder under the memory controller's mount
        ("4:memory:/slurm/job_7", {"memory/slurm/job_7/memory.limit_in_bytes": "8000000000",
                                   "memory/slurm/job_7/memory.usage_in_bytes": "2000000000"}),
        # cgroup v1 in a container that shows only its own cgroup at the mount's root
        ("4:memory:/docker/abc", {"memory/memory.limit_in_bytes": "8000000000",
                                  "memory/memory.usage_in_bytes": "2000000000"}),
    ],
)  # fmt: skip
def test_doctor_host_memory_fails_below_write_backlog_under_a_cgroup_cap(
    tmp_path, cgroup_line, files
):
    """A job capped at 8 GB with 2 GB in use has 6 GB left, below the writer's default
    write_backlog_gb (16): FAIL, naming a write_backlog_gb that fits (3) as the dotted vLLM
    flag, which the connector's config takes."""
    from vllm_gdn_hs.config import HiddenStatesConfig

    proc, cg = _kernel_files(tmp_path, cgroup_line, files)
    assert host.memory_limit(proc, cg) == 6_000_000_000
    ((item, value, problem),) = host.host_memory_checks(proc, cg)
    assert item == "host memory" and value.startswith("6.0 GB available"), value
    flag = "--kv-transfer-config.kv_connector_extra_config.write_backlog_gb=3"
    assert problem and flag in problem and "write_backlog_gb=16" in problem, problem
    assert HiddenStatesConfig(write_backlog_gb=int(flag.rsplit("=", 1)[1])).write_backlog_gb == 3


@pytest.mark.parametrize(
    "cgroup_line, files",
    [
        ("0::/user.slice", {"user.slice/memory.max": "max", "user.slice/memory.current": "1"}),
        ("4:memory:/", {"memory/memory.limit_in_bytes": "9223372036854771712",
                        "memory/memory.usage_in_bytes": "1"}),
        ("0::/", {}),  # no memory files at all
    ],
)  # fmt: skip
def test_doctor_host_memory_reported_without_a_cap(tmp_path, cgroup_line, files):
    """No cgroup cap ("max", v1's near-2^63, or none): MemAvailable is reported and never
    fails the doctor, even when low (free memory on a shared machine moves)."""
    proc, cg = _kernel_files(tmp_path, cgroup_line, files, avail_kb=4 << 20)
    assert host.memory_limit(proc, cg) is None
    ((_, value, problem),) = host.host_memory_checks(proc, cg)
    assert value == "4.3 GB available" and problem is None


def test_doctor_host_memory_of_this_machine():
    ((item, value, problem),) = host.host_memory_checks()
    assert item == "host memory" and value.endswith(("available", "GB more)")), value
    assert "host memory" in dict((r[0], r[1]) for r in checks())


def test_doctor_mooncake_master(tmp_path):
    """doctor --mooncake-master: the Mooncake wheel loads here and a real mooncake_master on
    127.0.0.1 answers; a port where none listens, and an address without a port, FAIL with
    the fix (the CLI exits 1)."""
    from mooncake_master import Master, free_port, require_mooncake

    master = Master(require_mooncake(), str(tmp_path))
    master.start()
    try:
        r = _cli("doctor", "--mooncake-master", master.address)
    finally:
        master.kill()
    rows = {
        m[2]: (m[1], m[3])
        for line in r.stdout.splitlines()
        if (m := re.match(r"(ok|FAIL)\s+(.+?)\s{2,}(.*)", line))
    }
    assert rows["mooncake"][0] == "ok" and "mooncake-transfer-engine" in rows["mooncake"][1]
    assert rows["mooncake master"] == ("ok", f"{master.address} answers")
    dead = f"127.0.0.1:{free_port()}"
    r = _cli("doctor", "--mooncake-master", dead)
    assert r.returncode == 1
    assert f"cannot reach the Mooncake master at {dead}" in r.stdout, r.stdout
    r = _cli("doctor", "--mooncake-master", "10.0.0.1")
    assert r.returncode == 1 and "fix mooncake master: String should match pattern" in r.stdout


def _dist(site, name: str, files: list[str]) -> None:
    """An installed distribution as a wheel leaves it: METADATA and a RECORD of its files."""
    info = site / f"{name.replace('-', '_')}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "RECORD").write_text("".join(f"{f},,\n" for f in [*files, f"{info.name}/RECORD"]))


def test_overlapping_files_names_both_owners_and_the_fix(tmp_path):
    """cuda-python < 12.8 and cuda-bindings 13 both claim cuda/bindings' files: whichever
    unpacked last won, so the check reads the RECORDs, not the import."""
    _dist(tmp_path, "cuda-bindings", ["cuda/bindings/runtime.py", "cuda/bindings/__init__.py"])
    _dist(tmp_path, "cuda-python", ["cuda/bindings/runtime.py", "cuda/cuda.py"])
    _dist(tmp_path, "flashinfer-python", ["build_backend.py", "flashinfer/__init__.py"])
    _dist(tmp_path, "torch-c-dlpack-ext", ["build_backend.py"])  # a loose top-level module
    clashes = doctor.overlapping_files([str(tmp_path)])
    assert clashes == {("cuda-bindings", "cuda-python"): ["cuda/bindings/runtime.py"]}


def test_install_checks_of_this_environment():
    """The README's install: no two distributions own a file of a package."""
    assert doctor.install_checks() == [("installed files", "one owner each", None)], (
        doctor.overlapping_files()
    )


def test_install_checks_fail_naming_the_fix(monkeypatch):
    clash = {("cuda-bindings", "cuda-python"): ["cuda/bindings/runtime.py"]}
    monkeypatch.setattr(doctor, "overlapping_files", lambda: clash)
    ((item, value, problem),) = doctor.install_checks()
    assert value == "1 owned by cuda-bindings and cuda-python (e.g. cuda/bindings/runtime.py)"
    assert problem.endswith("uv pip install 'cuda-python>=12.8' --reinstall-package cuda-bindings")


def test_doctor_prints_the_model_first_and_skips_what_needs_a_failed_check(tmp_path, monkeypatch):
    """A model that cannot be read fails on the first line, before vLLM is imported; checks
    that need a failed one say skipped."""
    from vllm_gdn_hs import version

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    r = subprocess.run(
        [sys.executable, "-c", "import sys\nfrom vllm_gdn_hs.cli.doctor import iter_checks\n"
         "rows = next(iter_checks('Qwen/Qwen3.6-27B'))\nprint(rows[0][2])\n"
         "print('vllm' in sys.modules, 'torch' in sys.modules)"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HOME": str(tmp_path)},
    )  # fmt: skip
    problem, imported = r.stdout.strip().splitlines()
    assert "HF_HUB_OFFLINE is set" in problem and "vllm-gdn-hs config Qwen/Qwen3.6-27B" in problem
    assert imported == "False False", r.stdout
    monkeypatch.setattr(version, "installed_vllm", lambda: version.Version("0.19.0"))
    rows = {item.strip(): value for item, value, _ in checks()}
    assert rows["plugin via vllm.general_plugins"] == "skipped (needs a supported vllm)"
    assert (
        rows["runtime patches"] == rows["model runner"] == rows["plugin via vllm.general_plugins"]
    )


def test_config_writes_the_packaged_config_offline(tmp_path):
    r = _cli("config", "Qwen/Qwen3.6-27B", str(tmp_path / "cfg"))
    assert r.returncode == 0 and os.listdir(tmp_path / "cfg") == ["config.json"], r.stderr
    r = _cli("doctor", "--model", str(tmp_path / "cfg"))
    assert re.search(r"layers\s+64\b", r.stdout) and "hybrid" in r.stdout, r.stdout
    r = _cli("config", "Qwen/Qwen9-1B", str(tmp_path / "x"))
    assert r.returncode == 2 and "invalid choice" in r.stderr and not (tmp_path / "x").exists()


def test_an_unfinished_download_is_named(tmp_path):
    """What `hf download` leaves when it cannot reach the hub: a folder with only .cache/."""
    (tmp_path / "qwen3.6-config" / ".cache" / "huggingface").mkdir(parents=True)
    r = _cli("doctor", "--model", str(tmp_path / "qwen3.6-config"))
    assert r.returncode == 1
    assert "holds only .cache/: an `hf download` into it did not finish" in r.stdout, r.stdout
    assert "vllm-gdn-hs config MODEL" in r.stdout


def test_version(capsys):
    from importlib import metadata

    r = _cli("--version")
    assert r.stdout.strip() == f"vllm-gdn-hs {metadata.version('vllm-gdn-hs')}"
