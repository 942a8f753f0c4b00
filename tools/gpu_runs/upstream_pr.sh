#!/usr/bin/env bash
# The upstream pull request (patches/upstream/) on the GPU, on vLLM 0.34.0 unpacked under
# ${SITE:-/tmp/site} (the device bundle, as tools/gpu_runs/run_gpu_suite.sh). Needs no network
# and does not install this project: vLLM runs with its plugins off (VLLM_PLUGINS=), so what
# runs is stock vLLM plus the patch; this checkout, tests/ and benchmarks/ are on PYTHONPATH
# only for the test models, the HF reference and the workloads (tests/tiny_models.py,
# vllm_gdn_hs.verify.reference, benchmarks/workloads.py).
#   1. copies the installed vllm package to $PR_SITE and applies the patch there (git apply,
#      or patch -p1 where git is missing; no fuzz either way);
#   2. runs the unit tests the patch adds (CPU tests, run here against the patched copy);
#   3. accuracy (tools/gpu_runs/upstream_pr.py accuracy): tiny hybrid + dense, eager + CUDA graphs
#      (UPSTREAM_PR_MODES=eager or cudagraph, UPSTREAM_PR_MODELS=hybrid or dense for one),
#      against HF fp32/bf16 and against ExampleHiddenStatesConnector's files;
#   4. unless UPSTREAM_PR_BENCH=0: 27B shape, KV cache tokens + prompt tok/s of plain vLLM,
#      the PR and ExampleHiddenStatesConnector, CUDA graphs (UPSTREAM_PR_WORKLOADS,
#      UPSTREAM_PR_VARIANTS, UPSTREAM_PR_VARIANT_TIMEOUT: seconds per variant,
#      UPSTREAM_PR_MAX_NUM_SEQS: 256 by default);
#   5. only when UPSTREAM_PR_PARTS names tp, on two GPUs (tools/gpu_runs/upstream_pr.py tp): the
#      tiny hybrid at TP=2 against TP=1, each against HF fp32 (TP_TIMEOUT, seconds).
# UPSTREAM_PR_PARTS (default unit,accuracy,bench) picks steps 2-5, e.g. to run the bench in a
# second call on the same machine. Writes $OUT/upstream-pr.json (the summary) and at most 7
# logs. Usage:
#   OUT=$OUT bash tools/gpu_runs/upstream_pr.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
OUT="${OUT:-./gpu-out}"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
SITE="${SITE:-/tmp/site}"
PR_SITE="${PR_SITE:-/tmp/site-upstream-pr}"
PATCHES=(patches/upstream/*.patch)
export PATH=$SITE/bin:$PATH PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_PLUGINS=
SUMMARY="$OUT/upstream-pr.json"
step() { echo "[upstream-pr] $(date -u +%T) $*"; }
# The PR's connector logs these when a request loses its file (a lock it could not take, a
# failed or short write, a request left at shutdown): any of them fails the step.
LOST='cannot lock|Hidden-states write failed|get no hidden-states file'
lost() {
    grep -E "$LOST" "$1" | cut -c1-300 | head -5 | sed 's/^/[upstream-pr] logged: /'
    ! grep -qE "$LOST" "$1"
}

version=$(PYTHONPATH=$SITE python3 -c 'import importlib.metadata as m; print(m.version("vllm"))')
[ "$version" = 0.34.0 ] || { echo "needs vLLM 0.34.0 under $SITE, found '$version'"; exit 2; }

step "1. patch a copy of $SITE/vllm"
rm -rf "$PR_SITE" && mkdir -p "$PR_SITE" && cp -r "$SITE/vllm" "$PR_SITE/vllm"
find "$PR_SITE/vllm" -name __pycache__ -prune -exec rm -rf {} +
(
    cd "$PR_SITE" || exit 1
    for p in "${PATCHES[@]}"; do
        if command -v git >/dev/null; then
            git init -q . && git apply --check "$REPO/$p" && git apply "$REPO/$p"
        else
            patch -p1 -F0 --dry-run <"$REPO/$p" >/dev/null && patch -p1 -F0 -s <"$REPO/$p"
        fi || exit 1
    done
) >"$OUT/upstream-pr-apply.log" 2>&1
APPLY=$?
[ $APPLY = 0 ] || { cat "$OUT/upstream-pr-apply.log"; echo "the patch does not apply"; exit 1; }
rm -f "$OUT/upstream-pr-apply.log"
PARTS=",${UPSTREAM_PR_PARTS:-unit,accuracy,bench},"
[ "${UPSTREAM_PR_BENCH:-1}" = 0 ] && PARTS=${PARTS/,bench,/,}
UNIT=skipped ACC=skipped BENCH=skipped TP=skipped
# The patched copy first, then the rest of vLLM's dependencies, then this checkout.
export PYTHONPATH=$PR_SITE:$SITE:$REPO:$REPO/tests:$REPO/benchmarks

if [[ $PARTS == *,unit,* ]]; then
    step "2. the PR's unit tests"
    TESTS=$(cd "$PR_SITE" && git apply --numstat "${PATCHES[@]/#/$REPO/}" 2>/dev/null \
        | awk '{print $3}' | grep -E '^tests/.*test_[a-z0-9_]+\.py$' \
        || ls tests/v1/kv_connector/unit/test_aux_hidden_states_connector.py)
    printf '[pytest]\n' >"$PR_SITE/pytest.ini"
    # shellcheck disable=SC2086
    (cd "$PR_SITE" && timeout 300 python3 -m pytest $TESTS -q -p no:cacheprovider) \
        >"$OUT/upstream-pr-unit.log" 2>&1
    UNIT=$?
    tail -3 "$OUT/upstream-pr-unit.log"
fi

if [[ $PARTS == *,accuracy,* ]]; then
    step "3. accuracy: tiny hybrid and dense, eager and CUDA graphs"
    timeout "${ACCURACY_TIMEOUT:-330}" python3 tools/gpu_runs/upstream_pr.py accuracy \
        "$OUT/accuracy.json" >"$OUT/upstream-pr-accuracy.log" 2>&1
    ACC=$?
    grep '^\[upstream-pr\]' "$OUT/upstream-pr-accuracy.log" | cut -c1-400
    lost "$OUT/upstream-pr-accuracy.log" || { [ $ACC = 0 ] && ACC=1; }
fi

if [[ $PARTS == *,bench,* ]]; then
    step "4. 27B shape: KV cache and throughput"
    python3 tools/gpu_runs/upstream_pr.py bench "$OUT/bench.json" >"$OUT/upstream-pr-bench.log" 2>&1
    BENCH=$?
    grep '^\[upstream-pr\]' "$OUT/upstream-pr-bench.log" | cut -c1-400
fi

if [[ $PARTS == *,tp,* ]]; then
    step "5. tensor parallelism: TP=2 against TP=1, two GPUs"
    timeout "${TP_TIMEOUT:-600}" python3 tools/gpu_runs/upstream_pr.py tp "$OUT/tp.json" \
        >"$OUT/upstream-pr-tp.log" 2>&1
    TP=$?
    grep '^\[upstream-pr\]' "$OUT/upstream-pr-tp.log" | cut -c1-400
    lost "$OUT/upstream-pr-tp.log" || { [ $TP = 0 ] && TP=1; }
fi

python3 - "$SUMMARY" "$OUT" "$UNIT" "$ACC" "$BENCH" "$TP" <<'EOF'
import json, os, re, subprocess, sys
summary, out, unit, acc, bench, tp = sys.argv[1:]
def load(name):
    path = os.path.join(out, name)
    return json.load(open(path)) if os.path.exists(path) else None
unit_path = os.path.join(out, "upstream-pr-unit.log")
unit_log = open(unit_path).read() if os.path.exists(unit_path) else ""
num = lambda rc: int(rc) if rc.lstrip("-").isdigit() else rc
rev = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
import torch, vllm
result = {
    "commit": rev or None,
    "vllm": vllm.__version__,
    "torch": torch.__version__,
    "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    "unit_tests": {"rc": num(unit), "summary": (re.findall(r"^\d+ passed.*$", unit_log, re.M) or [unit_log[-300:]])[-1]},
    "accuracy": {"rc": num(acc), **(load("accuracy.json") or {})},
    "bench": {"rc": num(bench), **(load("bench.json") or {})},
    "tp": {"rc": num(tp), **(load("tp.json") or {})},
}
json.dump(result, open(summary, "w"), indent=1)
EOF
rm -f "$OUT/accuracy.json" "$OUT/bench.json" "$OUT/tp.json"
step "done: unit=$UNIT accuracy=$ACC bench=$BENCH tp=$TP; summary in $SUMMARY"
for rc in "$UNIT" "$ACC" "$BENCH" "$TP"; do [ "$rc" = 0 ] || [ "$rc" = skipped ] || exit 1; done
