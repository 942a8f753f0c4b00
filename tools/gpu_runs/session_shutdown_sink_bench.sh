#!/usr/bin/env bash
# One GPU session (vLLM 0.34.0 under /tmp/site, the checkout installed there by the call that
# starts this), in priority order for the device time left; each step writes its records as it
# finishes:
#   1. SIGTERM with 64 requests in flight, with and without a second SIGINT, through the
#      launcher and plain vllm serve (tests/gpu/test_gpu_shutdown.py)
#   2. accuracy of the layer sink (layer_by_layer) against HF (tiny hybrid, eager and CUDA
#      graphs)
#   3. the 27B-shape bench, plain then ours with layer_by_layer, vLLM's default GDN kernels
#      (bench_27b.sh 1a, 1b on 128x1024, then both on chat): the KV cache, the warm-up peak,
#      throughput
#   4. while device time lasts: ours stacked, fp8, the end-to-end rate (bench_27b.sh 1c, 2, 3a,
#      3b), speculators' generator SIGKILLed and resumed, the deep hybrid, /metrics
# Started by tools/device/session.sh start; SESSION is where everything goes.
set -u
cd "$(dirname "$0")/../.."
export VLLM_GDN_HS_COMMIT=$(cat commit.txt) VLLM_GDN_HS_RESULTS_DIR=$SESSION/results
mkdir -p "$VLLM_GDN_HS_RESULTS_DIR"
echo "commit $VLLM_GDN_HS_COMMIT"
log() { echo "[session] $(date -u +%H:%M:%S) $*"; }
suite() {  # OUT folder, then the pytest node ids
    local out=$SESSION/$1; shift
    log "suite $(basename "$out") start"
    SITE=/tmp/site INSTALL=0 RUN_DEMO=0 SUITE_TIMEOUT=${T:-600} OUT="$out" \
        bash tools/gpu_runs/run_gpu_suite.sh "$@"
    log "suite $(basename "$out") end"
}
T=420 suite shutdown \
    "tests/gpu/test_gpu_shutdown.py::test_sigterm_with_requests_running_answers_each_with_file_or_reason"
T=300 suite accuracy tests/gpu/test_gpu_extract.py::test_hybrid_layer_by_layer
for wl in 128x1024 chat; do  # the KV cache and 128x1024 of both first, then chat of both
    for step in 1a 1b; do WL=$wl BUDGET=300 bash tools/gpu_runs/bench_27b.sh "$SESSION/r48" $step; done
done
for step in 1c 2 3a 3b; do BUDGET=480 bash tools/gpu_runs/bench_27b.sh "$SESSION/r48" $step; done
log "pipeline start"
PYTHONPATH=/tmp/site:tests/gpu:tests timeout 900 python3 tools/gpu_runs/pipeline.py \
    --out "$SESSION/pipeline" --backend file --steps 1 --seeds 1 > "$SESSION/pipeline.log" 2>&1
log "pipeline end rc=$?"
T=540 suite deep tests/gpu/test_gpu_extract.py::test_deep_hybrid_chunked_and_unchunked
T=420 suite metrics tests/gpu/test_gpu_launch.py::test_metrics_count_the_files
