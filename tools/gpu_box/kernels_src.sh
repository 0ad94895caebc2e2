#!/usr/bin/env bash
# Source-tiled depth-read kernels on one H200, in one call: the large bf16 parity tests of
# both kernel families, then the benchmark with --src-sweep (the sweep picks the settings per
# width and the table that follows is timed with them, peers side by side), with the GPU's
# clocks, power and throttle reasons logged before and after.
#   GIT_SHA=<sha> bash tools/gpu_box/pack.sh tools/gpu_box/kernels_src.sh [bench args...]
# (carry .whl/ with megatron-core and, for the peers, fla-core and fast-attnres wheels)
set -uo pipefail
export PYTHONWARNINGS=ignore
HEADER="source-tiled depth-read kernels" source "$(dirname "$0")/common.sh"
PT=(python3 -m pytest -q -p no:cacheprovider -rf)
if [ -z "${SKIP_TESTS:-}" ]; then  # SKIP_TESTS=1: the sweep checks every candidate anyway
    log "== large bf16 parity tests: both kernel families, phase-1 reads and merges"
    timeout 150 "${PT[@]}" tests/test_kernels.py tests/test_two_phase_ops.py -k "large" 2>&1 \
        | tail -15 | tee -a "$OUT/log"
fi
clocks() {
    nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active \
        --format=csv,noheader 2>&1 | sed "s/^/clocks (sm, mem, power, temp, events) $1: /" \
        | tee -a "$OUT/log"
}
clocks before
log "== sweep (each candidate checked against the reference first), then the table"
timeout "${SWEEP_S:-400}" python3 benchmarks/bench_depth_read.py --csv "$OUT/depth_read.csv" \
    --src-sweep "$@" 2>&1 | tee -a "$OUT/log"
clocks after
