"""tools/device/bundle.py, the GPU machine's vLLM bundle: which packages travel for a machine
inventory and a requirement set, and how the bundle is cut into parts. No network: small fake
wheels in tmp_path."""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
import zipfile

import bundle as db  # tools/device/bundle.py (pytest's pythonpath: pyproject.toml)
import pytest

ENV = db.target_env("3.12")

# What a 0.33-like release resolves to: name -> (version, Requires-Dist).
RESOLVED_33 = {
    "torch": ("2.14.0", [
        "cuda-toolkit[cublas,cudart]==13.0.3; platform_system == 'Linux'",
        "nvidia-cudnn-cu13==9.24.0.43; platform_system == 'Linux'",
        "nvidia-nccl-cu13==2.30.7; platform_system == 'Linux'",
        "nvidia-cusparselt-cu13==0.8.1",
        "triton~=3.8.0; platform_system == 'Linux' and python_version < '3.15'",
        "setuptools>=77.0.3",
        "optree>=0.13.0; extra == 'optree'",
    ]),
    "cuda-toolkit": ("13.0.3", [
        "nvidia-cublas==13.1.1.3.*; extra == 'cublas'",
        "nvidia-cuda-runtime==13.0.96.*; extra == 'cudart'",
        "nvidia-npp==13.0.1.2.*; extra == 'npp'",
    ]),
    "nvidia-cublas": ("13.1.1.3", []),
    "nvidia-cuda-runtime": ("13.0.96", []),
    "nvidia-cudnn-cu13": ("9.24.0.43", []),
    "nvidia-nccl-cu13": ("2.30.7", []),
    "nvidia-cusparselt-cu13": ("0.8.1", []),
    "triton": ("3.8.0", []),
    "setuptools": ("80.10.2", []),
    "numpy": ("2.3.5", []),
    "mistral-common": ("1.13.1", ["numpy<2.4,>=1.25; python_version <= '3.12'"]),
    "requests": ("2.33.1", []),
    "pydantic": ("2.14.4", []),
    "transformers": ("5.17.0", []),
}  # fmt: skip
TOP_33 = [
    "torch==2.14.0", "numpy", "requests>=2.33.0", "pydantic>=2.12", "mistral-common",
    "setuptools<81.0.0,>=78.1.1; python_version > '3.11'", "transformers<5.21,>=5.16.1",
]  # fmt: skip
# The GPU machine: torch 2.11 and its CUDA 13.0 libraries; None where only the name is known.
MACHINE = {
    "torch": "2.11.0", "triton": "3.6.0", "cuda-toolkit": "13.0.2", "nvidia-cublas": "13.1.0.3",
    "nvidia-cuda-runtime": "13.0.96", "nvidia-cudnn-cu13": "9.19.0.56",
    "nvidia-nccl-cu13": "2.28.9", "nvidia-cusparselt-cu13": "0.8.0", "setuptools": "81.0.0",
    "numpy": "2.5.2", "transformers": "5.17.0", "requests": None,
}  # fmt: skip


def split(top, resolved, machine=MACHINE, env=ENV, **kw):
    specs = db.constraints(db.active(top, env), resolved, env)
    return db.travelling(resolved, specs, machine, **kw)


def test_constraints_follow_extras_and_markers():
    specs = db.constraints(db.active(TOP_33, ENV), RESOLVED_33, ENV)
    assert specs["nvidia-cublas"].contains("13.1.1.3")  # asked through cuda-toolkit[cublas]
    assert not specs["nvidia-cublas"].contains("13.1.0.3")
    assert "nvidia-npp" not in specs and "optree" not in specs  # extras nobody asked for
    assert str(specs["numpy"]) == "<2.4,>=1.25"  # mistral-common's cap on Python <= 3.12
    assert not specs["setuptools"].contains("81.0.0")  # vLLM's cap applies on 3.12 ...
    specs311 = db.constraints(db.active(TOP_33, db.target_env("3.11")), RESOLVED_33, ENV)
    assert specs311["setuptools"].contains("81.0.0")  # ... not on 3.11


def test_what_travels_for_a_newer_torch():
    travel, kept = split(TOP_33, RESOLVED_33, reuse={"nvidia-cudnn-cu13"})
    assert travel == {
        "torch": "2.14.0", "triton": "3.8.0", "nvidia-nccl-cu13": "2.30.7", "numpy": "2.3.5",
        "setuptools": "80.10.2", "mistral-common": "1.13.1", "pydantic": "2.14.4",
    }  # fmt: skip
    assert kept["nvidia-cublas"] == ("13.1.0.3", "13.1.1.3", "same CUDA ABI (major.minor)")
    assert kept["cuda-toolkit"][2] == kept["nvidia-cusparselt-cu13"][2]
    assert kept["nvidia-cuda-runtime"][2] == "satisfies ==13.0.96.*"
    assert kept["nvidia-cudnn-cu13"] == ("9.19.0.56", "9.24.0.43", "reused (--reuse)")
    assert kept["requests"] == (None, "2.33.1", "on the machine, version not recorded")
    assert kept["transformers"][0] == "5.17.0"


def test_cudnn_travels_without_reuse_and_carry_beats_reuse():
    travel, _ = split(TOP_33, RESOLVED_33)
    assert travel["nvidia-cudnn-cu13"] == "9.24.0.43"
    travel, kept = split(TOP_33, RESOLVED_33, reuse={"transformers"}, carry={"transformers"})
    assert "transformers" in travel and "transformers" not in kept


def test_a_release_on_the_machines_torch_leaves_torch_and_cuda_there():
    resolved = {
        "torch": ("2.11.0", ["nvidia-cudnn-cu13==9.19.0.56", "triton==3.6.0"]),
        "nvidia-cudnn-cu13": ("9.19.0.56", []),
        "triton": ("3.6.0", []),
        "apache-tvm-ffi": ("0.1.11", []),  # always carried, as the shared script does
        "fastapi": ("0.136.3", []),
    }
    top = ["torch==2.11.0", "fastapi", "apache-tvm-ffi==0.1.11"]
    travel, kept = split(top, resolved, machine={**MACHINE, "apache-tvm-ffi": "0.1.11"})
    assert travel == {"apache-tvm-ffi": "0.1.11", "fastapi": "0.136.3"}
    assert set(kept) == {"torch", "nvidia-cudnn-cu13", "triton"}


def test_load_machine(tmp_path):
    (tmp_path / "gpu-machine-packages.txt").write_text("torch\nPyYAML\ntyping_extensions\n")
    (tmp_path / "gpu-machine-versions.txt").write_text("# pip freeze\ntorch==2.11.0\n")
    m = db.load_machine(str(tmp_path))
    assert m == {"torch": "2.11.0", "pyyaml": None, "typing-extensions": None}


def test_parts_are_cut_at_the_size_with_names_past_z(tmp_path):
    parts = db.Parts(str(tmp_path), size=10)
    data = os.urandom(275)
    for i in range(0, len(data), 7):
        assert parts.write(data[i : i + 7]) == len(data[i : i + 7])
    parts.close()
    names = [p["name"] for p in parts.parts]
    assert names[:2] == ["part-aa", "part-ab"] and names[26:] == ["part-ba", "part-bb"]
    sizes = [os.path.getsize(tmp_path / n) for n in names]
    assert sizes == [10] * 27 + [5] and [p["size"] for p in parts.parts] == sizes
    assert b"".join((tmp_path / n).read_bytes() for n in names) == data
    assert parts.parts[3]["sha256"] == hashlib.sha256(data[30:40]).hexdigest()


def fake_wheel(path, name, version, files=(), requires=()):
    whl = path / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        for f, data in files:
            z.writestr(f, data)
        meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        meta += "".join(f"Requires-Dist: {r}\n" for r in requires)
        z.writestr(f"{name}-{version}.dist-info/METADATA", meta)
        record = "".join(f"{f},,\n" for f, _ in files)
        z.writestr(f"{name}-{version}.dist-info/RECORD", record)
    return whl


def test_bundle_parts_manifest_and_install_script(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    wheels = {
        f"wheels/{w.name}": str(w)
        for w in (
            fake_wheel(src, "alpha", "1.0", [("alpha/big.bin", os.urandom(2500))]),
            fake_wheel(src, "beta", "2.0", [("beta/__init__.py", b"")]),
        )
    }
    out = tmp_path / "out"
    out.mkdir()
    (out / "part-zz").write_bytes(b"stale")  # from an earlier build: removed
    m = db.write_bundle(wheels, str(out), {"vllm": "0.33.0"}, size=1000)
    names = sorted(p.name for p in out.glob("part-*"))
    assert names == [p["name"] for p in m["parts"]] and m["part_count"] == len(names) > 3
    assert all(os.path.getsize(out / n) <= 1000 for n in names)
    assert m["total_bytes"] == sum(os.path.getsize(out / n) for n in names)
    on_disk = json.loads((out / "MANIFEST.json").read_text())
    assert on_disk["vllm"] == "0.33.0" and on_disk["parts"] == m["parts"]
    for p, line in zip(m["parts"], (out / "SHA256SUMS").read_text().splitlines(), strict=True):
        assert hashlib.sha256((out / p["name"]).read_bytes()).hexdigest() == p["sha256"]
        assert line == f"{p['sha256']}  {p['name']}"  # the format of sha256sum -c
    blob = b"".join((out / n).read_bytes() for n in names)  # cat part-* | tar xf -
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        assert sorted(tar.getnames()) == ["install.sh", *sorted(wheels)]
        sh = tar.extractfile("install.sh").read().decode()
    assert '--no-index --no-deps --no-compile --target "$SITE" wheels/*.whl' in sh
    assert 'SITE="${SITE:-/tmp/site}"' in sh
    assert db.PART_SIZE == 60_000_000


def test_trim_drops_unused_kernels_and_their_record_lines(tmp_path):
    keep = ("vllm/_C.abi3.so", b"c")
    drop = [(f, b"x") for f in db.DROP[:3]] + [("vllm/vllm-rs", b"rs")]
    src = fake_wheel(tmp_path, "vllm", "0.33.0", [keep, *drop], ["torch==2.14.0"])
    (tmp_path / "out").mkdir()
    dst = tmp_path / "out" / src.name
    db.trim(str(src), str(dst))
    with zipfile.ZipFile(dst) as z:
        assert set(z.namelist()) == {
            "vllm/_C.abi3.so", "vllm-0.33.0.dist-info/METADATA", "vllm-0.33.0.dist-info/RECORD",
        }  # fmt: skip
        assert z.read("vllm-0.33.0.dist-info/RECORD").decode() == "vllm/_C.abi3.so,,\n"
    assert db.wheel_requires(str(dst)) == ["torch==2.14.0"]


def test_calls_carry_one_part_each_and_install_on_the_last():
    out = os.path.join(db.REPO, ".devbundle33")
    env = db.env_line({"torch": {}}, {"nvidia-cudnn-cu13": ()})
    assert env.endswith("PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1")
    assert "PYTORCH_SKIP" not in db.env_line({}, {"nvidia-cudnn-cu13": ()})
    got = db.calls(out, ["part-aa", "part-ab", "part-ac"], env)
    assert [c for c, _ in got] == [
        [".devbundle33/part-aa"], [".devbundle33/part-ab"],
        [".devbundle33/part-ac", ".devbundle33/SHA256SUMS"],
    ]  # fmt: skip
    assert got[0][1] == "mkdir -p /tmp/devsite && cp .devbundle33/part-aa /tmp/devsite/"
    # every call makes the folder: one refused start costs only its own part
    assert got[1][1] == "mkdir -p /tmp/devsite && cp .devbundle33/part-ab /tmp/devsite/"
    last = got[2][1]
    assert "sha256sum -c" in last and "cat part-* | tar xf -" in last and "sh install.sh" in last
    assert env in last


@pytest.mark.parametrize("python", ["3.12", "3.13"])
def test_platform_args_ask_for_binary_cpython_wheels(python):
    args = db.platform_args(python)
    assert args[:5] == ["--only-binary=:all:", "--python-version", python, "--implementation", "cp"]
    assert "manylinux_2_28_x86_64" in args and args[-2:] == ["--platform", "any"]
