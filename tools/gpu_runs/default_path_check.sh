#!/usr/bin/env bash
# The default path on one GPU, as a user gets it, in priority order; each step writes its
# records under $SESSION/results as it ends, so a lease cut short keeps what finished:
#   1 bench     the 27B shape (dummy weights), vLLM's default GDN kernels, CUDA graphs, the
#               extensible KV cache, max_num_seqs 256, prefix caching off: plain vLLM, ours
#               with its defaults (graph_aux_buffers on, host_buffers 3), on 128x1024 and
#               chat -> bench.json (KV blocks, vLLM's peak activation and
#               CUDA-graph lines, throughput; 7.7 min on an H100 on 2026-12-07)    (~8 min)
#   2 accuracy  the tiny hybrid held to HF, eager and CUDA graphs, the default hand-over
#               (tests/gpu/test_gpu_extract.py; each tiny engine's first start JIT-compiles
#               FlashInfer's GDN kernel for its widths, ~2 min)                     (~7 min)
#   3 shutdown  SIGTERM, and SIGTERM then SIGINT, with 64 requests in flight, through the
#               launcher and through plain `vllm serve` (tests/gpu/test_gpu_shutdown.py) (~7 min)
#   4 families  every model family against HF (tests/gpu/test_gpu_families.py), then the
#               demo                                                               (~7 min)
#   5 e2e       samples/s through `vllm serve`: plain and the file backend, chat, the 4b shape
#               (the writer's bytes at the highest rate) -> e2e.json                 (~4 min)
#   6 memory    CUDA-graph memory and peak within one block of plain's (tests/gpu/test_gpu_memory.py)
#   7 owners    who owns the CUDA-graph memory: torch's memory history over plain's, ours' and
#               ours' with one layer id capture, 27b-8 shape, grouped by the code that allocated
#               (benchmarks/graph_memory.py)                                       (~3 min)
# Usage (the device call that installs vLLM; see tools/device/session.sh):
#   bash tools/device/session.sh start tools/gpu_runs/default_path_check.sh
#   STEPS="1 2" bash tools/device/session.sh start tools/gpu_runs/default_path_check.sh
#   WORKLOADS=128x1024 STEPS=1 ...   the bench alone, one workload (a lease with minutes left)
#   STEPS="1 2+3+4 5" ...   steps joined by + run at once (the tiny-model suites: each engine
#               takes 0.3 of the GPU, and their JIT compiles overlap); never join the bench or
#               e2e, whose speed and KV figures need the GPU alone. Joined, an engine can fail
#               to start on vLLM's own profiling check (another engine freed memory meanwhile)
#               and each start is slower (2026-12-08, 2+3+4 on an H100: two shutdown cases and
#               the demo failed so, and slow starts cut accuracy and families at their
#               limits): join only for a lease too short to run them in turn
#   bash tools/device/session.sh stop   (to start another: it ends this job, and only it)
set -u
cd "$(dirname "$0")/../.."
SESSION=${SESSION:-/tmp/device-session}
R=$SESSION/results
mkdir -p "$R/logs"
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
export VLLM_GDN_HS_COMMIT=$(cat commit.txt 2>/dev/null || git rev-parse --short HEAD)
export VLLM_GDN_HS_RESULTS_DIR=$R
log() { echo "[check] $(date -u +%H:%M:%S) $*"; }
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/site --upgrade . \
    >"$R/logs/install.log" 2>&1 || log "install failed: see $R/logs/install.log"
log "commit $VLLM_GDN_HS_COMMIT, $(nvidia-smi --query-gpu=name --format=csv,noheader)"
suite() {  # a name, a time limit, then pytest node ids
    local name=$1 limit=$2
    shift 2
    log "$name start"
    SITE=/tmp/site INSTALL=0 BASETEMP=/tmp/pytest-suite-$name RUN_DEMO=${RUN_DEMO:-0} SUITE_TIMEOUT=$limit OUT="$R/$name" \
        bash tools/gpu_runs/run_gpu_suite.sh "$@" >"$R/logs/$name.txt" 2>&1
    log "$name end: $(grep -E "^pytest exit" "$R/$name/env.txt" 2>/dev/null)"
}
step() {
    case $1 in
    1)
        log "bench start"
        python3 benchmarks/bench.py --shape 27b --variants ${VARIANTS:-plain,ours} \
            --workloads ${WORKLOADS:-128x1024,chat} \
            --gpu-memory-utilization 0 --max-num-seqs 256 --run default-path --timeout 600 \
            --out-dir /dev/shm/hs-check --log-dir "$R/logs" --model-root /tmp/m27 \
            --results "$R/bench.json" >"$R/logs/bench.txt" 2>&1
        log "bench end rc=$?"
        ;;
    2) suite accuracy 420 "tests/gpu/test_gpu_extract.py::test_hybrid_layer_by_layer" \
        tests/gpu/test_gpu_extract.py::test_hybrid_cudagraph ;;
    3) suite shutdown 600 \
        tests/gpu/test_gpu_shutdown.py::test_sigterm_with_requests_running_answers_each_with_file_or_reason ;;
    # then `vllm-gdn-hs demo` (its files through check's bar), while the others still run
    4) RUN_DEMO=1 suite families 420 tests/gpu/test_gpu_families.py ;;
    5)
        log "e2e start"
        python3 benchmarks/e2e.py --shape 4b --backends plain,file --workload chat \
            --run default-path --out-dir /dev/shm/e2e-check --log-dir "$R/logs" \
            --model-root /tmp/m4 --results "$R/e2e.json" -- --max-num-seqs 256 \
            >"$R/logs/e2e.txt" 2>&1
        log "e2e end rc=$?"
        ;;
    6) suite memory 420 tests/gpu/test_gpu_memory.py ;;
    7)
        # plain, ours, and ours with one layer id (does the difference scale with the aux states?)
        for v in plain ours ours1; do
            log "owners $v start"
            args=(--variant "${v%1}")
            [ "$v" = ours1 ] && args+=(--layers 4)
            python3 benchmarks/graph_memory.py "${args[@]}" --out "$R/graph-memory-$v.json" \
                >"$R/logs/graph-memory-$v.txt" 2>&1
            log "owners $v end rc=$?"
        done
        for v in ours ours1; do
            python3 benchmarks/graph_memory.py --compare "$R/graph-memory-plain.json" \
                "$R/graph-memory-$v.json" >"$R/graph-memory-compare-$v.txt" 2>&1
        done
        head -c 6000 "$R/graph-memory-compare-ours.txt"
        ;;
    esac
}
for group in ${STEPS:-1 2 3 4 5 6 7}; do
    for s in ${group//+/ }; do step "$s" & done
    wait
done
log "done"
