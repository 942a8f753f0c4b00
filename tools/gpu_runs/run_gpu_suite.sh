#!/usr/bin/env bash
# The whole GPU suite in one go, for a CUDA machine where vLLM is unpacked under
# ${SITE:-/tmp/site} (an offline GPU machine: unpack vLLM's wheels there; one folder per
# vLLM release, e.g. SITE=/tmp/site26 for 0.26.0). Installs this checkout there
# (vLLM finds plugins only by entry point), then runs the GPU tests
# and the demo, writing JSON figures and gzip-compressed logs (zcat them) to ${OUT:-./gpu-out}.
#   bash tools/gpu_runs/run_gpu_suite.sh [pytest node ids...]   (default: every GPU test)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-./gpu-out}"
mkdir -p "$OUT"
SITE="${SITE:-/tmp/site}"
export PYTHONPATH=$SITE PATH=$SITE/bin:$PATH PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
# INSTALL=0 skips the install, for several suites run at once on one machine (one per GPU
# via CUDA_VISIBLE_DEVICES, each with its own OUT) after one install.
if [ "${INSTALL:-1}" = 1 ]; then
    python3 -m pip install -q --upgrade --no-deps --no-build-isolation --no-index --target "$SITE" . \
        2>&1 | grep -v WARNING
    if ls .whl/speculators-*.whl >/dev/null 2>&1; then
        python3 -m zipfile -e .whl/speculators-*.whl /tmp/speculators-site
    fi
fi
[ -d /tmp/speculators-site ] && export SPECULATORS_SITE=/tmp/speculators-site
{ echo "commit ${VLLM_GDN_HS_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}"; date -u; echo "CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-all}"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import vllm, torch, transformers; print(vllm.__version__, torch.__version__, transformers.__version__)"
} > "$OUT/env.txt" 2>&1
TESTS=("$@")
# BASETEMP gives this suite's pytest a temp folder of its own, so that suites run at once on one
# machine stop only their own left-over servers below
BASETEMP=${BASETEMP:-}
BT_ARGS=()
[ -n "$BASETEMP" ] && BT_ARGS=(--basetemp "$BASETEMP")
[ ${#TESTS[@]} -eq 0 ] && TESTS=(tests/gpu/test_gpu_extract.py tests/gpu/test_gpu_launch.py tests/gpu/test_gpu_tp.py)
VLLM_GDN_HS_RESULTS="$OUT/gpu.json" VLLM_GDN_HS_LAUNCH_RESULTS="$OUT/launch.json" \
    PYTHONPATH=$SITE:tests/gpu:tests timeout "${SUITE_TIMEOUT:-3600}" python3 -m pytest --noconftest -m gpu -v -s \
    -p no:cacheprovider -p gpu_report "${BT_ARGS[@]}" \
    "${TESTS[@]}" > "$OUT/gpu.log" 2>&1
echo "pytest exit $?" >> "$OUT/env.txt"
# A test's server runs in its own session (its model under pytest's temp folder) and outlives a
# pytest cut by SUITE_TIMEOUT, holding its GPU memory (run 38: 43 GiB under the next engines).
for pid in $(pgrep -f "entrypoints.cli.main serve ${BASETEMP:-/tmp/pytest-of-}"); do
    echo "stopping a test server left running: $pid" | tee -a "$OUT/env.txt"
    kill -9 -- "-$pid" 2>/dev/null || kill -9 "$pid"
done
grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|max rel err|max relative|preemptions|aborts|chunked vs|KV cache tokens|^E " "$OUT/gpu.log" | grep -v "^(EngineCore" | head -80
if [ "${RUN_DEMO:-1}" = 1 ]; then
    timeout "${DEMO_TIMEOUT:-300}" python3 -m vllm_gdn_hs.cli demo --workdir /tmp/vllm-gdn-hs-demo > "$OUT/demo.log" 2>&1
    echo "demo exit $?" >> "$OUT/env.txt"
    grep -v "^INFO\|^(EngineCore\|^WARNING\|^\[" "$OUT/demo.log" | tail -12
fi
gzip -9nf "$OUT/gpu.log" "$OUT/demo.log" 2>/dev/null  # read above; kept compressed
cat "$OUT/env.txt"
