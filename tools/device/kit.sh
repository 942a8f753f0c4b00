#!/usr/bin/env bash
# The offline GPU machine's kit, built in one command from the repository root:
#   bash tools/device/kit.sh [VLLM_RELEASE]         (default 0.34.0)
# commit.txt      `git rev-parse --short HEAD` (the device's own git HEAD may be stale)
# .devbundleNN/   vLLM and what it needs there (tools/device/bundle.py): part-aa.. of at most
#                 60,000,000 bytes, MANIFEST.json, SHA256SUMS; NN = major/minor (0.34.0: 34)
# .whl/           pure-Python wheels the GPU tests and benchmarks import there, which neither
#                 the machine nor the bundle has (WHL below)
# .whlmc/         mooncake-transfer-engine-cuda13 (cp312) and libibverbs1 with its libnl (.deb,
#                 from this machine's apt)
# Then it prints each folder's files and sizes and the device calls in carry order.
# Re-running keeps what is complete: a bundle whose SHA256SUMS verify, each pinned wheel and
# .deb present and readable. Needs the network only for what is missing. Python 3.12 (the GPU
# machine's) is looked for as python3.12, under pyenv and through uv; pip and packaging go
# into a venv under /tmp (DEVICE_KIT_VENV, default /tmp/device-kit-venv312).
set -eu -o pipefail
cd "$(dirname "$0")/../.."
START=$SECONDS
REL=${1:-0.34.0}
STEP="checking the arguments"
trap 'echo "device_kit: FAILED while $STEP (line $LINENO)" >&2' ERR
die() {
    echo "device_kit: FAILED while $STEP: $*" >&2
    trap - ERR
    exit 1
}
[[ $REL =~ ^([0-9]+)\.([0-9]+)\.[0-9]+$ ]] || die "'$REL' is not a release like 0.34.0"
MAJOR=${BASH_REMATCH[1]} MINOR=${BASH_REMATCH[2]}
[ "$MAJOR" = 0 ] && B=.devbundle$MINOR || B=.devbundle$MAJOR$MINOR

# .whl: what the device imports that is neither on the machine (../shared/device/
# gpu-machine-packages.txt) nor in the bundle. fla: transformers' fast GDN kernels
# (benchmarks/hf_worker.py; 0.6.0 is what ran, the newest on the index, needs transformers>=5.6.2).
# hs-connectors: the plugin's own dependency (fp8 format, mooncake reader). speculators:
# tools/gpu_runs/run_gpu_suite.sh unpacks it for speculators' client, tools/gpu_runs/pipeline.py
# runs its CLI.
# quack-kernels 0.6.5 (imported by vLLM 0.34.0's kernel warm-up) travels in the bundle.
WHL=(flash-linear-attention==0.6.0 fla-core==0.6.0 hs-connectors==0.9.0 speculators==0.9.0)
# What speculators' CLI needs besides (datasets: pipeline.py imports it too); each goes into .whl
# only where the bundle has no copy (vLLM 0.34.0's brings dill, loguru, pydantic-settings, dotenv).
WHL_UNLESS_BUNDLED=(
    datasets==5.1.0 multiprocess==0.70.19 dill==0.4.1 loguru==0.7.3 pydantic-settings==2.16.3
    python-dotenv==1.2.4
)
WHLMC=(mooncake-transfer-engine-cuda13==0.3.14)
# mooncake's libraries need libibverbs.so.1, which needs libnl-3 and libnl-route-3
DEBS=(libibverbs1 libnl-3-200 libnl-route-3-200)
# Distributions the device imports (tests/gpu, benchmarks, the plugin): each must be carried or
# on the machine; the check below also resolves every carried wheel's own requirements.
DEVICE_IMPORTS=(
    datasets openai matplotlib tokenizers pytest safetensors numpy transformers pydantic
    hs-connectors speculators flash-linear-attention fla-core mooncake-transfer-engine-cuda13
)
LIMIT=$((64 * 1024 * 1024)) # one device call: the working tree plus the carried paths
PART_MAX=60000000

# Small helpers in Python (stdlib, and packaging through tools/device/bundle.py's import).
KITPY=$(
    cat <<'EOF'
import json, os, sys, zipfile
from bundle import MACHINE_DIR, Requirement, active, load_machine, norm, target_env

def wheels(d):
    return sorted(f for f in os.listdir(d) if f.endswith(".whl")) if os.path.isdir(d) else []

def name_ver(f):
    name, ver = f.split("-")[:2]
    return norm(name), ver

cmd, args = sys.argv[1], sys.argv[2:]
if cmd == "missing":  # DIR PIN...: the pins without a readable wheel; wheels no pin names
    d, pins = args[0], [Requirement(p) for p in args[1:]]
    found = set()
    for f in wheels(d):
        n, v = name_ver(f)
        pin = next((p for p in pins if norm(p.name) == n and p.specifier.contains(v, True)), None)
        try:
            ok = pin is not None and zipfile.ZipFile(os.path.join(d, f)).testzip() is None
        except zipfile.BadZipFile:
            ok = False
        if ok and str(pin) not in found:
            found.add(str(pin))
        else:
            print("stray", f)
    for p in pins:
        if str(p) not in found:
            print("missing", p)
elif cmd == "treesize":  # the files of the working tree that travel with every call
    print(sum(os.path.getsize(f) for f in sys.stdin.read().split("\0") if os.path.isfile(f)))
elif cmd == "unbundled":  # BUNDLE PIN...: the pins whose package the bundle does not carry
    packages = json.load(open(os.path.join(args[0], "MANIFEST.json")))["packages"]
    print(" ".join(p for p in args[1:] if norm(Requirement(p).name) not in packages))
elif cmd == "check":  # BUNDLE DIR... -- DIST...: does every carried wheel find what it needs?
    bundle, rest = args[0], args[1:]
    dirs, dists = rest[: rest.index("--")], rest[rest.index("--") + 1 :]
    where = {n: ("the GPU machine", v) for n, v in load_machine(MACHINE_DIR).items()}
    manifest = json.load(open(os.path.join(bundle, "MANIFEST.json")))
    where.update({n: (bundle, p["version"]) for n, p in manifest["packages"].items()})
    carried = {}
    for d in dirs:
        for f in wheels(d):
            n, v = name_ver(f)
            if n in manifest["packages"]:
                print(f"note: {n} {v} in {d} and {manifest['packages'][n]['version']} in {bundle}")
            carried[n] = (d, v, os.path.join(d, f))
            where[n] = (d, v)
    missing, env = [], target_env()
    for n, (d, v, path) in sorted(carried.items()):
        meta = zipfile.ZipFile(path)
        text = meta.read(next(m for m in meta.namelist() if m.endswith(".dist-info/METADATA")))
        reqs = [ln.split(":", 1)[1].strip() for ln in text.decode().splitlines()
                if ln.startswith("Requires-Dist:")]
        for r in active(reqs, env):
            got = where.get(norm(r.name))
            if got is None:
                missing.append(f"{r.name} (needed by {n} {v})")
            elif got[1] and not r.specifier.contains(got[1], True):
                print(f"warning: {n} {v} asks for {r}; {got[0]} has {got[1]}")
    missing += [f"{x} (imported on the device)" for x in dists if norm(x) not in where]
    if missing:
        print("missing on the device:\n  " + "\n  ".join(missing))
        sys.exit(1)
    print(f"every carried wheel's requirements are met ({len(carried)} wheels)")
EOF
)
kitpy() { PYTHONPATH=tools/device${PYTHONPATH:+:$PYTHONPATH} python3 -c "$KITPY" "$@"; }

STEP="finding Python 3.12 and pip"
VENV=${DEVICE_KIT_VENV:-/tmp/device-kit-venv312}
PY=
NET_OK=
py312() {
    local c
    for c in "${DEVICE_KIT_PYTHON:-}" python3.12 "$(pyenv root 2>/dev/null || echo /nonexistent)"/versions/3.12*/bin/python3.12 \
        "$(uv python find 3.12 2>/dev/null || true)"; do
        if [ -n "$c" ] && "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
            echo "$c"
            return
        fi
    done
    return 1
}
# The venv is made only when something must be downloaded.
need_pip() {
    [ -n "$PY" ] && return
    local ok='import sys, packaging, pip; assert sys.version_info[:2] == (3, 12)'
    if ! "$VENV/bin/python" -c "$ok" 2>/dev/null; then
        local base
        base=$(py312) || die "no Python 3.12 found (the GPU machine's): install one, e.g. 'uv python install 3.12', or set DEVICE_KIT_PYTHON=/path/to/python3.12"
        rm -rf "$VENV"
        "$base" -m venv "$VENV" || die "'$base -m venv $VENV' failed"
        "$VENV/bin/python" -m pip install -q --upgrade pip packaging 2>&1 | grep -v "is ignored" ||
            true
        "$VENV/bin/python" -c "$ok" || die "pip and packaging did not install into $VENV (no network?)"
    fi
    PY=$VENV/bin/python
}
need_net() {
    [ -n "$NET_OK" ] && return
    need_pip
    local out
    out=$("$PY" -m pip index versions --retries 1 --timeout 20 vllm 2>/dev/null) ||
        die "the package index cannot be reached (no network?): 'pip index versions vllm' failed"
    NET_OK=1
    if [ ! -f "$B/SHA256SUMS" ] && ! grep -qE "(^|[ ,])${REL//./\\.}(,|$)" <<<"$out"; then
        die "vllm $REL is not on the package index; its newest: $(sed -n 's/.*Available versions: //p' <<<"$out" | cut -d, -f1-6)"
    fi
}
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp)
for n in $(seq 39 -1 17); do PLAT+=(--platform "manylinux_2_${n}_x86_64"); done
PLAT+=(--platform manylinux2014_x86_64 --platform linux_x86_64 --platform any)

# Fetch the pinned wheels a folder lacks; drop wheels that no pin names (one version each).
wheel_dir() {
    local d=$1
    shift
    mkdir -p "$d"
    local todo=() kind what
    while read -r kind what; do
        if [ "$kind" = stray ]; then
            echo "  $d: removing $what (no pin names it, a second copy, or it does not read)"
            rm -f "$d/$what"
        else
            todo+=("$what")
        fi
    done < <(kitpy missing "$d" "$@")
    if [ ${#todo[@]} -eq 0 ]; then
        echo "  $d: every pinned wheel is there ($#)"
        return
    fi
    need_net
    echo "  $d: downloading ${todo[*]}"
    "$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$d" "${todo[@]}" 2>&1 | grep -v "is ignored" ||
        true
    if [ -n "$(kitpy missing "$d" "$@")" ]; then
        die "pip could not download every pin into $d (see pip's message above: a version the index lacks?): $(kitpy missing "$d" "$@" | tr '\n' ' ')"
    fi
}
bytes() { du -cb "$@" | tail -1 | cut -f1; }

echo "== device kit for vLLM $REL: commit.txt, $B/, .whl/, .whlmc/"

STEP="writing commit.txt"
git rev-parse --short HEAD >commit.txt
if git check-ignore -q commit.txt; then die "commit.txt is git-ignored: the device would not get it"; fi
git diff --quiet HEAD -- || echo "  note: tracked files differ from HEAD; commit.txt names HEAD ($(cat commit.txt))"
echo "  commit.txt: $(cat commit.txt)"

STEP="building the vLLM bundle $B (tools/device/bundle.py)"
bundle_ok() {
    [ -f "$B/SHA256SUMS" ] && [ -f "$B/MANIFEST.json" ] || return 1
    [ "$(cd "$B" && ls -1 part-* 2>/dev/null)" = "$(awk '{print $2}' "$B/SHA256SUMS" | sort)" ] || return 1
    python3 -c 'import json, sys; sys.exit(json.load(open(sys.argv[1]))["vllm"] != sys.argv[2])' \
        "$B/MANIFEST.json" "$REL" || return 1
    (cd "$B" && sha256sum -c --quiet SHA256SUMS)
}
if bundle_ok; then
    echo "  $B: complete, SHA256SUMS verify"
else
    need_net
    echo "  $B: building (downloads about 1.5 GB) ..."
    rm -f "$B/SHA256SUMS" # an interrupted build never looks complete
    # its own list of calls is left out: the kit's, below, adds .whlmc and .whl
    "$PY" tools/device/bundle.py "$REL" "$B" 2>&1 | grep -v "is ignored" |
        sed -e '/device calls, back to back/,$d' -e '/^$/d' -e 's/^/    /' ||
        die "tools/device/bundle.py $REL $B failed (its message above)"
    bundle_ok || die "$B does not verify after the build"
fi
for p in "$B"/part-*; do
    [ "$(stat -c %s "$p")" -le $PART_MAX ] || die "$p is over $PART_MAX bytes"
done

STEP="downloading the wheels into .whl"
read -ra MORE <<<"$(kitpy unbundled "$B" "${WHL_UNLESS_BUNDLED[@]}")"
wheel_dir .whl "${WHL[@]}" "${MORE[@]}"

STEP="downloading mooncake and libibverbs into .whlmc"
wheel_dir .whlmc "${WHLMC[@]}"
for deb in "${DEBS[@]}"; do
    f=$(find .whlmc -maxdepth 1 -name "${deb}_*.deb" | head -1)
    if [ -n "$f" ] && dpkg-deb -f "$f" Package >/dev/null 2>&1; then continue; fi
    rm -f .whlmc/"${deb}"_*.deb
    command -v apt-get >/dev/null || die "no apt-get here: put the $deb .deb (amd64) into .whlmc by hand"
    echo "  .whlmc: apt-get download $deb"
    (cd .whlmc && apt-get download -q -o APT::Sandbox::User=root "$deb") ||
        die "apt-get download $deb failed (no network, or run apt-get update first)"
done

STEP="checking that every carried wheel finds what it needs"
kitpy check "$B" .whl .whlmc -- "${DEVICE_IMPORTS[@]}" | sed 's/^/  /'

STEP="checking the sizes against a device call's 64 MiB"
TREE=$(git ls-files -z --cached --others --exclude-standard | kitpy treesize)
PARTS=("$B"/part-*)
N=${#PARTS[@]}
LAST=${PARTS[N - 1]}
WHL_B=$(bytes .whl)
WHLMC_B=$(bytes .whlmc)
BUNDLE_B=$(bytes "${PARTS[@]}")
for x in "$B/part-aa:$(stat -c %s "${PARTS[0]}")" ".whl:$WHL_B" ".whlmc:$WHLMC_B"; do
    [ $((TREE + ${x#*:})) -le $LIMIT ] ||
        die "${x%%:*} (${x#*:} bytes) and the working tree ($TREE bytes) are over 64 MiB for one call"
done
LAST_B=$(bytes "$LAST" "$B/SHA256SUMS" .whl)
SPLIT=
[ $((TREE + LAST_B)) -le $LIMIT ] || SPLIT=1

STEP="printing the summary"
MB() { awk -v b="$1" 'BEGIN { printf "%.1f MB", b / 1e6 }'; }
echo
echo "== the kit (vLLM $REL, commit $(cat commit.txt))"
for d in "$B" .whl .whlmc; do
    echo "$d/  $(bytes "$d") bytes ($(MB "$(bytes "$d")"))"
    for f in "$d"/*; do printf '  %-72s %11d\n' "${f#"$d"/}" "$(stat -c %s "$f")"; done
done
echo "parts: $N, $BUNDLE_B bytes; .whl $WHL_B, .whlmc $WHLMC_B; in all $((BUNDLE_B + WHL_B + WHLMC_B)) bytes"
echo "working tree that travels with every call: $TREE bytes; the last call carries $((TREE + LAST_B)) of $LIMIT"
ENV=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["env"])' "$B/MANIFEST.json")
echo
echo "== carry order: one device call each, back to back (the machine goes back 30 s after a call)"
i=0
for p in "${PARTS[@]:0:N-1}"; do
    i=$((i + 1))
    echo "call $i: carry [\"$p\"]  command: mkdir -p /tmp/devsite && cp $p /tmp/devsite/"
done
i=$((i + 1))
echo "call $i: carry [\".whlmc\"]  command: mkdir -p /tmp/whlmc && cp .whlmc/* /tmp/whlmc/"
WHEELS='.whl/*.whl'
if [ -n "$SPLIT" ]; then
    i=$((i + 1))
    echo "call $i: carry [\".whl\"]  command: mkdir -p /tmp/whl && cp .whl/*.whl /tmp/whl/"
    WHEELS='/tmp/whl/*.whl'
fi
i=$((i + 1))
CARRY="\"$LAST\", \"$B/SHA256SUMS\""
[ -n "$SPLIT" ] || CARRY+=", \".whl\""
echo "call $i: carry [$CARRY]  command: mkdir -p /tmp/devsite && cp $LAST $B/SHA256SUMS /tmp/devsite/ && (cd /tmp/devsite && sha256sum -c --quiet SHA256SUMS && cat part-* | tar xf - && sh install.sh) && python3 -m pip install -q --no-index --no-deps --target /tmp/site $WHEELS && $ENV && <your command>"
echo "later calls start with: $ENV"
echo "mooncake, where used: python3 -m pip install -q --no-index --no-deps --target /tmp/site /tmp/whlmc/*.whl; ldconfig -p | grep -q libibverbs.so.1 || { for d in /tmp/whlmc/*.deb; do dpkg-deb -x \$d /tmp/ibv; done; export LD_LIBRARY_PATH=/tmp/ibv/usr/lib/x86_64-linux-gnu:/tmp/ibv/lib/x86_64-linux-gnu:\${LD_LIBRARY_PATH:-}; }"
echo
echo "device_kit: done in $((SECONDS - START)) s"
