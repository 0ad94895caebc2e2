#!/usr/bin/env bash
# Two-phase block schedule on the GPU box (one H200, about 6 minutes): the GPU-only tests of
# depth_read_multi / depth_merge / depth_merge_update, the depth-block benchmark (per-site
# fused reads against phase 1 + merges; L=24 N=8: K=6 sites, d=2048, T=16384, bf16, S=5 and
# 9; wall and GPU busy time; then a block whose partial sums are formed from sub-layer
# outputs: adds then merges against merges that form them), the tile sweep of the
# width-chunked phase 1 and the GPU time per kernel of one block. Everything lands in $OUT.
#   GIT_SHA=$(git rev-parse --short HEAD) bash tools/gpu_box/two_phase.sh
# BLOCK_S (default 240) and SWEEP_S (default 120) bound the benchmark steps; SKIP_SWEEP=1 and
# PROFILE="" skip the sweep and the profile; BLOCK_TILES3D=1 adds the 3-D phase-1 tiles
# (the phase 1 before the width-chunked one) to the block rows.
set -euo pipefail
source "$(dirname "$0")/common.sh"
status=0
# the benchmark gates its own numbers on a correctness check, so it runs after red tests too
step "GPU tests: depth_read_multi / depth_merge (large bf16 shapes)" 90 \
    python3 -m pytest -q -p no:cacheprovider tests/test_two_phase_ops.py -k "large_bf16 or gpu"
step "block benchmark: per-site reads vs two-phase, then partial sums formed in the block" \
    "${BLOCK_S:-240}" python3 benchmarks/bench_depth_read.py --block --block-updates \
        --csv "$OUT/two_phase_block.csv"
[ -z "${SKIP_SWEEP:-}" ] && step "width-chunked phase-1 tile sweep" "${SWEEP_S:-120}" \
    python3 benchmarks/bench_depth_read.py --block --sweep --sweep-only \
        --csv "$OUT/two_phase_block.csv"
[ -n "${PROFILE:-1}" ] && step "GPU time per kernel of one depth block" 90 \
    python3 benchmarks/bench_depth_read.py --block --block-profile --sweep-only \
        --csv /tmp/unused_block.csv
echo "== done $(date -u +%T), status $status" | tee -a "$OUT/log"
exit $status
