#!/usr/bin/env bash
# Two-phase block schedule on the GPU box (one H200, under 6 minutes): the GPU-only tests of
# depth_read_multi / depth_merge, the depth-block benchmark (per-site fused reads vs phase 1
# + merges, L=24 N=8: K=6 sites, d=2048, T=16384, bf16, S=5 and 9), a phase-1 tile sweep
# and the standard S=9 single-site rows at d=2048. Everything lands in $OUT (log, CSVs).
#   GIT_SHA=$(git rev-parse --short HEAD) bash tools/gpu_box/two_phase.sh
# Wheels carried in .whl/ (fla-core, fast-attnres peers) are installed when present.
set -euo pipefail
source "$(dirname "$0")/common.sh"
status=0
step() {  # step NAME SECONDS CMD...: run with a time limit, log, remember a failure
    local name=$1 limit=$2
    shift 2
    echo "== $name ($(date -u +%T), limit ${limit}s)" | tee -a "$OUT/log"
    if ! timeout "$limit" "$@" 2>&1 | tee -a "$OUT/log"; then
        echo "== $name FAILED or timed out" | tee -a "$OUT/log"
        status=1
    fi
}
# Each step has its own time limit (sum 330 s) so the whole script stays under 6 minutes;
# the benchmark gates its own numbers on a correctness check, so it runs after red tests too.
step "GPU tests: depth_read_multi / depth_merge (large bf16 shapes)" 75 \
    python3 -m pytest -q -p no:cacheprovider tests/test_two_phase_ops.py -k large_bf16
step "block benchmark: per-site reads vs two-phase" 110 \
    python3 benchmarks/bench_depth_read.py --block --csv "$OUT/two_phase_block.csv"
step "phase-1 tile sweep (query groups, warps, prefetch depth)" 75 \
    python3 benchmarks/bench_depth_read.py --block --sweep --sweep-only \
        --csv "$OUT/two_phase_block.csv"
step "standard single-site rows, S=9, d=2048 (no torch.compile peer)" 70 \
    python3 benchmarks/bench_depth_read.py --widths 2048 --sources 9 --extra "" --no-compile \
        --csv "$OUT/depth_read.csv"
echo "== done $(date -u +%T), status $status" | tee -a "$OUT/log"
exit $status
