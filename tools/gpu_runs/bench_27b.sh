#!/usr/bin/env bash
# The 27B-shape benchmark on one H100/H200: 27B shape, dummy weights, CUDA graphs, layers
# 1 16 31 46 61 64, max_num_seqs 256 (plain on one H100 needs it), the extensible KV cache
# (--gpu-memory-utilization 0: vLLM's warm-up line gives the allocated-at-peak figure).
#   usage: [BUDGET=S] [WL=W,...] tools/gpu_runs/bench_27b.sh RESULTS_DIR [STEPS]
#   (STEPS: default "1 2 3 4"; BUDGET: seconds per one-variant step, default 570; WL: the
#   workloads of steps 1*)
# Steps in priority order; each appends its records as each variant finishes:
#   1  bench plain, ours with layer_by_layer, then ours, default GDN backend: 128x1024
#      mixed-out256 chat 32x8192 mixed -> RESULTS_DIR/run48-bench.json          (~18-20 min)
#   2  bench fp8 on 128x1024 and mixed-out256 -> run48-bench.json                  (~5 min)
#   3  e2e plain, file, fp8, mooncake on chat -> run48-e2e.json (~4 min a backend; 3a plain
#      and file, 3b fp8, 3c mooncake, one device call each)
#   4  bench plain and ours with --gdn-backends triton on 128x1024 -> run48-bench.json
# One device call runs at most 10 minutes: give each call one step (1 may need its own call
# per variant: STEPS "1a" plain, "1b" ours-layers, "1c" ours).
set -u
R=${1:?usage: bench_27b.sh RESULTS_DIR [STEPS]}
STEPS=${2:-1 2 3 4}
cd "$(dirname "$0")/../.."
mkdir -p "$R/logs"
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/site \
    --upgrade . >"$R/logs/install.log" 2>&1 || echo "install failed: see $R/logs/install.log"
RUN=run48
COMMON=(--shape 27b --gpu-memory-utilization 0 --max-num-seqs 256 --run "$RUN" --timeout 900
        --out-dir /dev/shm/hs48 --log-dir "$R/logs" --model-root /tmp/m48
        --results "$R/run48-bench.json")
WL=${WL:-128x1024,mixed-out256,chat,32x8192,mixed}
BUDGET=${BUDGET:-570}
log() { echo "[run48] $(date -u +%H:%M:%S) $*"; }
bench() { log "step $1 start"; shift; python3 benchmarks/bench.py "${COMMON[@]}" "$@"; log "end rc=$?"; }
for s in $STEPS; do
  case $s in
    1)  bench 1 --variants plain,ours-layers,ours --workloads $WL --budget 1500 ;;
    1a) bench 1a --variants plain --workloads $WL --budget $BUDGET ;;
    1b) bench 1b --variants ours-layers --workloads $WL --budget $BUDGET ;;
    1c) bench 1c --variants ours --workloads $WL --budget $BUDGET ;;
    2)  bench 2 --variants fp8 --workloads 128x1024,mixed-out256 --budget $BUDGET ;;
    3|3a|3b|3c)  # 3: all four backends; 3a plain,file; 3b fp8; 3c mooncake
        b=plain,file,fp8,mooncake; [ "$s" = 3a ] && b=plain,file
        [ "$s" = 3b ] && b=fp8; [ "$s" = 3c ] && b=mooncake
        log "step $s ($b) start"
        python3 benchmarks/e2e.py --shape 27b --backends $b --workload chat --run "$RUN" \
          --out-dir /dev/shm/e2e48 --log-dir "$R/logs" --model-root /tmp/m48 \
          --results "$R/run48-e2e.json" -- --max-num-seqs 256
        log "step $s end rc=$?" ;;
    4)  bench 4 --variants plain,ours --gdn-backends triton --workloads 128x1024 --budget $BUDGET ;;
    *)  log "unknown step $s" ;;
  esac
done
python3 benchmarks/report.py "$R/run48-bench.json" --md "$R/run48-table.md" >/dev/null 2>&1 &&
  log "table: $R/run48-table.md"
