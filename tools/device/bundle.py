#!/usr/bin/env python3
"""Build a vLLM bundle for the offline GPU machine, for any release 0.20.1-0.34.0.

    python3 tools/device/bundle.py 0.33.0 .devbundle33 [--python 3.12]

The project's copy of ../shared/device/build_vllm_bundle.py (see the README beside it), extended
to releases that pin another torch than the machine's (0.27+). It downloads the vLLM wheel,
resolves its requirements for CPython on manylinux x86_64 (torch and its CUDA libraries
included), and keeps only the packages the machine does not already have at an acceptable
version (the inventory in ../shared/device: gpu-machine-packages.txt, gpu-machine-versions.txt).
For 0.20-0.26 that leaves torch, triton and the CUDA libraries where they are; for 0.33.0 it
adds torch 2.14, triton 3.8, torchvision, NCCL and a few small ones. It drops the kernels a
dense or GDN model on Hopper never loads, then writes into the out dir:

    part-aa, part-ab, ...  one tar (wheels/*.whl + install.sh), cut into <= 60,000,000 bytes
    MANIFEST.json          packages, versions, sizes, parts with their sha256
    SHA256SUMS             the same hashes, for `sha256sum -c` on the machine

On the machine: cat part-* | tar xf - && sh install.sh   (pip --target /tmp/site, no network).
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile

try:
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.utils import canonicalize_name
    from packaging.version import Version
except ImportError:  # pip always carries a copy
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.specifiers import SpecifierSet
    from pip._vendor.packaging.utils import canonicalize_name
    from pip._vendor.packaging.version import Version

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))  # the repository root: tools/device/..
MACHINE_DIR = os.path.join(REPO, "..", "shared", "device")
PART_SIZE = 60_000_000
SITE = "/tmp/site"

# From build_vllm_bundle.py: heavy optional kernel packages vLLM imports lazily, and numba /
# opencv (on the machine). torch, torchvision, torchaudio and triton are no longer skipped:
# they are resolved like the rest and travel only when the machine's do not fit.
SKIP = {
    "torchcodec", "flashinfer-python", "flashinfer-cubin", "flashinfer-jit-cache", "tilelang",
    "quack-kernels", "fastsafetensors", "nvidia-cutlass-dsl", "nvidia-cudnn-frontend",
    "humming-kernels", "tokenspeed-mla", "pynvvideocodec", "numba", "opencv-python-headless",
    "apache-tvm-ffi", "xgrammar",
}  # fmt: skip
# Downloaded without their dependencies, which are resolved with the rest (all but
# transformers, which they may cap below what vLLM needs).
NO_DEPS = {"compressed-tensors", "xgrammar"}
# Pins that differ from vLLM's own: xgrammar >= 0.2.9 is a small wheel and needs tvm-ffi 0.1.11.
EXTRA = ["xgrammar==0.2.9", "apache-tvm-ffi==0.1.11"]
# Always carried, even where the machine has the package (as the shared script does).
ALWAYS = {"apache-tvm-ffi"}
# From vLLM 0.34.0, packages SKIP leaves out that an engine imports anyway (run 37, H200): the
# NVIDIA Qwen3.5/3.6 model imports flashinfer.norm (JIT-built with the machine's nvcc), and
# the kernel warm-up imports the MiniMax-M3 ops, which import cutlass (nvidia-cutlass-dsl) and
# quack. Downloaded without their dependencies at these pins (flashinfer 0.7.4: the index lacks
# vLLM's 0.7.3), with transformers (0.34.0's huggingface-hub 2 needs a newer one than the
# machine's 5.17.0).
FROM_0_34 = [
    "flashinfer-python==0.7.4", "cuda-tile==1.7.0", "nccl4py==0.6.0", "nccl-extensions==0.1.0",
    "nvidia-cudnn-frontend==1.32.0", "nvidia-cutlass-dsl==4.8.0",
    "nvidia-cutlass-dsl-libs-base==4.8.0", "nvidia-cutlass-dsl-libs-core==4.8.0",
    "nvidia-cutlass-dsl-libs-cu13==4.8.0", "quack-kernels==0.6.5", "cuda-python==13.4.4",
    "cuda-core==1.2.2", "cuda-pathfinder==1.9.1", "cuda-bindings==13.4.4", "ml-dtypes==0.7.0",
]  # fmt: skip
CARRY_FROM_0_34 = ("transformers",)
DROP = (
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",  # FlashAttention-2: Hopper uses FA3
    "vllm/_moe_C.abi3.so",  # MoE kernels: dense / GDN models only (--with-moe keeps them)
    "vllm/_moe_C_stable_libtorch.abi3.so",
    "vllm/vllm-rs",  # the optional Rust HTTP frontend (0.26+)
)
MOE = ("vllm/_moe_C.abi3.so", "vllm/_moe_C_stable_libtorch.abi3.so")
# CUDA libraries keep their ABI within a major.minor release: the machine's copy is reused when
# it matches the required version in this many leading components (cublas 13.1.0 for 13.1.1,
# cusparselt 0.8.0 for 0.8.1, cuda-toolkit 13.0.2 for 13.0.3). NCCL 2.28 lacks symbols torch 2.14
# links (ncclCommGrow, ...), so a differing minor travels. cuDNN keeps its ABI across 9.x, but
# torch refuses a runtime minor below its build's at first cuDNN use, unless
# PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1: --reuse nvidia-cudnn-cu13 keeps the machine's.
SAME_ABI_PREFIXES = ("nvidia-", "cuda-toolkit")
SAME_ABI_PARTS = 2


def norm(name):
    return canonicalize_name(name.split("[")[0].strip())


def target_env(python="3.12"):
    """The marker environment of the GPU machine's interpreter."""
    return {
        "python_version": python, "python_full_version": python + ".0", "os_name": "posix",
        "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
        "platform_release": "", "platform_version": "", "implementation_name": "cpython",
        "implementation_version": python + ".0", "platform_python_implementation": "CPython",
        "extra": "",
    }  # fmt: skip


def active(requires_dist, env, extras=()):
    """The requirements of a Requires-Dist list that apply in env with these extras."""
    out = []
    for line in requires_dist:
        req = Requirement(line)
        if req.marker is None or any(
            req.marker.evaluate({**env, "extra": e}) for e in ("", *sorted(extras))
        ):
            out.append(req)
    return out


def constraints(top, resolved, env):
    """name -> SpecifierSet: every version requirement on each package, from the top-level
    requirements and from each resolved package's Requires-Dist (with the extras asked of it).
    resolved: name -> (version, requires_dist)."""
    extras = {}
    while True:
        reqs = list(top)
        for name, (_, requires_dist) in resolved.items():
            reqs += active(requires_dist, env, extras.get(name, ()))
        specs, asked = {}, {}
        for req in reqs:
            name = norm(req.name)
            specs[name] = specs.get(name, SpecifierSet()) & req.specifier
            asked.setdefault(name, set()).update(req.extras)
        asked = {n: e for n, e in asked.items() if e}
        if asked == extras:
            return specs
        extras = asked


def same_abi(name, have, want):
    if not name.startswith(SAME_ABI_PREFIXES):
        return False
    return Version(have).release[:SAME_ABI_PARTS] == Version(want).release[:SAME_ABI_PARTS]


def travelling(resolved, specs, machine, reuse=(), carry=()):
    """Split the resolved packages into what travels and what the machine already has.

    resolved: name -> version (or (version, requires_dist)); specs: name -> SpecifierSet;
    machine: name -> version, or None where only the name is known (taken as acceptable, as
    the shared script does). reuse: names whose machine copy is kept whatever its version;
    carry: names that travel whatever the machine has. Returns (travel, kept): travel is
    {name: version}, kept is {name: (machine version, resolved version, why)}."""
    travel, kept = {}, {}
    for name, ver in sorted(resolved.items()):
        ver = ver[0] if isinstance(ver, tuple) else ver
        have = machine.get(name, "absent")
        if name in carry or name in ALWAYS or have == "absent":
            travel[name] = ver
        elif have is None:
            kept[name] = (None, ver, "on the machine, version not recorded")
        elif specs.get(name, SpecifierSet()).contains(have, prereleases=True):
            kept[name] = (have, ver, "satisfies " + (str(specs.get(name, "")) or "any"))
        elif same_abi(name, have, ver):
            kept[name] = (have, ver, "same CUDA ABI (major.minor)")
        elif name in reuse:
            kept[name] = (have, ver, "reused (--reuse)")
        else:
            travel[name] = ver
    return travel, kept


def load_machine(machine_dir):
    """name -> version from gpu-machine-versions.txt, or None for names only listed."""
    machine = {}
    with open(os.path.join(machine_dir, "gpu-machine-packages.txt")) as f:
        machine.update({norm(n): None for n in f.read().split()})
    with open(os.path.join(machine_dir, "gpu-machine-versions.txt")) as f:
        for line in f:
            if "==" in line and not line.startswith("#"):
                name, ver = line.strip().split("==")
                machine[norm(name)] = ver
    return machine


class Parts:
    """A write-only file that lands in part-aa, part-ab, ... of at most `size` bytes each."""

    def __init__(self, out_dir, size=PART_SIZE):
        self.out_dir, self.size, self.parts, self.f = out_dir, size, [], None

    def _next(self):
        self.close()
        n = len(self.parts)
        name = "part-" + chr(97 + n // 26) + chr(97 + n % 26)
        self.f = open(os.path.join(self.out_dir, name), "wb")
        self.parts.append({"name": name, "size": 0, "sha256": hashlib.sha256()})

    def write(self, data):
        data, n = memoryview(data), len(data)
        while len(data):
            if self.f is None or self.parts[-1]["size"] == self.size:
                self._next()
            chunk = data[: self.size - self.parts[-1]["size"]]
            self.f.write(chunk)
            self.parts[-1]["size"] += len(chunk)
            self.parts[-1]["sha256"].update(chunk)
            data = data[len(chunk) :]
        return n

    def close(self):
        if self.f is not None:
            self.f.close()
            self.f = None
            self.parts[-1]["sha256"] = self.parts[-1]["sha256"].hexdigest()


INSTALL_SH = f"""#!/bin/sh
# Installs this bundle's wheels into ${{SITE:-{SITE}}} (pip --target, no network, no deps).
set -e
cd "$(dirname "$0")"
SITE="${{SITE:-{SITE}}}"
python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" wheels/*.whl
# nvidia-cutlass-dsl puts its packages on the path with a .pth file, which PYTHONPATH skips
for d in "$SITE"/nvidia_cutlass_dsl/dsl_packages/*; do [ -e "$d" ] && ln -sfn "$d" "$SITE"/; done
echo "installed $(ls wheels | wc -l) wheels into $SITE"
"""


def write_bundle(files, out_dir, manifest, size=PART_SIZE):
    """Tar files ({arcname: path}) plus install.sh into parts; write MANIFEST.json and
    SHA256SUMS beside them. Returns the manifest."""
    os.makedirs(out_dir, exist_ok=True)
    for old in glob.glob(os.path.join(out_dir, "part-*")):
        os.remove(old)
    with tempfile.NamedTemporaryFile("w", suffix=".sh") as sh:
        sh.write(INSTALL_SH)
        sh.flush()
        parts = Parts(out_dir, size)
        with tarfile.open(fileobj=parts, mode="w|", format=tarfile.GNU_FORMAT) as tar:
            tar.add(sh.name, "install.sh")
            for arcname, path in sorted(files.items()):
                tar.add(path, arcname)
        parts.close()
    manifest = {**manifest, "part_count": len(parts.parts), "parts": parts.parts}
    manifest["total_bytes"] = sum(p["size"] for p in parts.parts)
    with open(os.path.join(out_dir, "MANIFEST.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    with open(os.path.join(out_dir, "SHA256SUMS"), "w") as f:
        f.writelines(f"{p['sha256']}  {p['name']}\n" for p in parts.parts)
    return manifest


def env_line(packages, kept):
    """What each later call exports: the bundle first on the path, before the machine's own."""
    # /usr/local/cuda/bin: flashinfer (0.34.0) builds its kernels with the machine's nvcc
    line = f"export PYTHONPATH={SITE} PATH={SITE}/bin:/usr/local/cuda/bin:$PATH PYTHONUNBUFFERED=1"
    if "torch" in packages and "nvidia-cudnn-cu13" in kept:  # an older cuDNN than torch's build
        line += " PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1"
    return line


def calls(out_dir, parts, env):
    """The device calls (carry, command) that bring the parts one by one and install on the
    last. Carried paths are relative to the repository root, where the device runs commands.
    Each call makes the folder itself, so calls sent together survive a refused first start
    (only its part is lost); the last call's checksum check names any part that is missing."""
    d = os.path.relpath(os.path.abspath(out_dir), REPO)
    out = []
    for i, p in enumerate(parts):
        carry = [f"{d}/{p}"]
        cmd = f"mkdir -p /tmp/devsite && cp {d}/{p} /tmp/devsite/"
        if i == len(parts) - 1:
            carry.append(f"{d}/SHA256SUMS")
            cmd += (
                f" && cp {d}/SHA256SUMS /tmp/devsite/ && (cd /tmp/devsite && sha256sum -c --quiet "
                "SHA256SUMS && cat part-* | tar xf - && rm part-* && sh install.sh) && "
                f"{env} && <your test command>"
            )
        out.append((carry, cmd))
    return out


def find_python(version):
    """An interpreter of the target version to run pip with: pip evaluates the environment
    markers of dependencies for the Python it runs under, whatever --python-version says."""
    for exe in (sys.executable, shutil.which(f"python{version}")):
        if not exe:
            continue
        ask = [exe, "-c", "import sys, pip; print('%d.%d' % sys.version_info[:2])"]
        got = subprocess.run(ask, capture_output=True, text=True)
        if got.returncode == 0 and got.stdout.strip() == version:
            return exe
    here = f"{sys.version_info[0]}.{sys.version_info[1]}"
    print(f"warning: no Python {version} with pip; dependencies' markers follow Python {here}")
    return sys.executable


def pip(python, *args):
    subprocess.run([python, "-m", "pip", "-q", *args], check=True)


def platform_args(python):
    tags = [f"manylinux_2_{n}_x86_64" for n in range(39, 16, -1)]
    tags += ["manylinux2014_x86_64", "manylinux1_x86_64", "linux_x86_64", "any"]
    args = ["--only-binary=:all:", "--python-version", python, "--implementation", "cp"]
    return args + [a for t in tags for a in ("--platform", t)]


def wheel_requires(path):
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    return [line.split(":", 1)[1].strip() for line in lines if line.startswith("Requires-Dist:")]


def trim(src, dst, drop=DROP):
    """Copy the vLLM wheel without the ``drop`` files (and their RECORD lines)."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            if info.filename.startswith(drop):
                continue
            data = zin.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines()
                data = "".join(f"{ln}\n" for ln in lines if not ln.startswith(drop)).encode()
            zout.writestr(info, data)


def build(
    version, out_dir, python="3.12", machine_dir=MACHINE_DIR, reuse=(), carry=(), with_moe=False
):
    machine, env, plat = load_machine(machine_dir), target_env(python), platform_args(python)
    exe = find_python(python)
    with tempfile.TemporaryDirectory() as work:
        raw, wheels = os.path.join(work, "raw"), os.path.join(work, "wheels")
        print(f"downloading vllm=={version} ...", flush=True)
        pip(exe, "download", "--no-deps", *plat, "-d", raw, f"vllm=={version}")
        src = glob.glob(os.path.join(raw, "vllm-*.whl"))[0]
        top = [r for r in active(wheel_requires(src), env) if norm(r.name) not in SKIP]
        top = [r for r in top if norm(r.name) not in {norm(e) for e in EXTRA}]
        top += [Requirement(e) for e in EXTRA]
        no_deps = [r for r in top if norm(r.name) in NO_DEPS]
        top = [r for r in top if norm(r.name) not in NO_DEPS]
        pip(exe, "download", "--no-deps", *plat, "-d", wheels, *map(str, no_deps))
        for whl in glob.glob(os.path.join(wheels, "*.whl")):
            for r in active(wheel_requires(whl), env):
                if norm(r.name) not in SKIP | NO_DEPS | {"transformers"}:
                    top.append(r)
        print("resolving vLLM's requirements for the GPU machine ...", flush=True)
        report = os.path.join(work, "report.json")
        # Markers already evaluated for the target; pip would evaluate them for its own Python.
        reqs = [str(Requirement(f"{r.name}[{','.join(r.extras)}]{r.specifier}")) for r in top]
        target = os.path.join(work, "t")
        pip(exe, "install", "--dry-run", "--ignore-installed", *plat, "--target", target,
            "--report", report, *reqs)  # fmt: skip
        with open(report) as f:
            items = [i["metadata"] for i in json.load(f)["install"]]
        resolved = {norm(m["name"]): (m["version"], m.get("requires_dist", [])) for m in items}
        specs = constraints(top, resolved, env)
        if Version(version) >= Version("0.34.0"):
            carry = (*carry, *CARRY_FROM_0_34)
        reuse, carry = {norm(n) for n in reuse}, {norm(n) for n in carry}
        travel, kept = travelling(resolved, specs, machine, reuse, carry)
        pins = [f"{n}=={v}" for n, v in travel.items()]
        print(f"downloading {len(pins)} packages ...", flush=True)
        if Version(version) >= Version("0.34.0"):
            pins += FROM_0_34
        pip(exe, "download", "--no-deps", *plat, "-d", wheels, *pins)
        drop = tuple(d for d in DROP if not (with_moe and d in MOE))
        trim(src, os.path.join(wheels, os.path.basename(src)), drop)
        files = {f"wheels/{os.path.basename(w)}": w for w in glob.glob(f"{wheels}/*.whl")}
        packages = {}
        for arc, path in sorted(files.items()):
            name, ver = os.path.basename(path).split("-")[:2]
            packages[norm(name)] = {
                "version": ver,
                "wheel": arc[7:],
                "bytes": os.path.getsize(path),
            }
        torch = packages.get("torch", {}).get("version") or machine.get("torch")
        manifest = {
            "vllm": version, "python": python, "torch": torch, "env": env_line(packages, kept),
            "packages": packages,
            "kept_on_machine": {
                n: {"version": v, "resolved": r, "why": w} for n, (v, r, w) in kept.items()
            },
        }  # fmt: skip
        return write_bundle(files, out_dir, manifest)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("version", help="vLLM release, 0.20.1 .. 0.34.0")
    ap.add_argument("out_dir")
    ap.add_argument("--python", default="3.12", help="the GPU machine's Python (3.12)")
    ap.add_argument(
        "--with-moe",
        action="store_true",
        help="keep vLLM's MoE kernels (vllm/_moe_C*.so): MoE models (Qwen3.5-MoE, Qwen3-Next, "
        "Nemotron-H's MoE blocks) need them",
    )
    ap.add_argument("--machine", default=MACHINE_DIR, help="folder of gpu-machine-*.txt")
    ap.add_argument(
        "--reuse",
        action="append",
        default=["nvidia-cudnn-cu13"],
        help="keep the machine's copy of this package whatever its version",
    )
    ap.add_argument(
        "--carry",
        action="append",
        default=[],
        help="carry this package even where the machine has it (beats --reuse)",
    )
    args = ap.parse_args(argv)
    m = build(
        args.version, args.out_dir, args.python, args.machine, args.reuse, args.carry, args.with_moe
    )
    big = sorted(m["packages"].items(), key=lambda kv: -kv[1]["bytes"])[:8]
    mb = m["total_bytes"] / 1e6
    print(f"vllm {m['vllm']} (torch {m['torch']}): {m['part_count']} parts, {mb:.0f} MB, "
          f"{len(m['packages'])} packages; largest:")  # fmt: skip
    for name, p in big:
        print(f"  {name}=={p['version']}  {p['bytes'] / 1e6:.0f} MB")
    print(f"\n{m['part_count']} device calls, back to back (the machine goes back 30 s after one):")
    todo = calls(args.out_dir, [p["name"] for p in m["parts"]], m["env"])
    for i, (carry, cmd) in enumerate(todo, 1):
        print(f"  call {i}: carry {json.dumps(carry)}\n          command: {cmd}")
    print(f"\nIn each later call, start with:\n  {m['env']}")


if __name__ == "__main__":
    main()
