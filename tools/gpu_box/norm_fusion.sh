#!/usr/bin/env bash
# The merge fused with the next sub-layer's RMSNorm on the GPU box (one H200, about 8
# minutes): the GPU-only tests of the two-phase ops (large bf16 shapes, the fused norm
# included) and the bf16 DDP model tests on the fused kernels, the depth block whose partial
# sums are formed from sub-layer outputs with and without each read's RMSNorm (the norm run
# by torch after the read, or inside the merge), then 1b-preset step times: standard,
# lr_attnres per-site, and two-phase with the fused norm on and off.
#   GIT_SHA=$(git rev-parse --short HEAD) bash tools/gpu_box/norm_fusion.sh
# ARMS_1B overrides the 1b arms ("residual:schedule[:extra flag]" words), ITERS_1B their
# length (default 12); SKIP_TESTS=1 leaves the tests out; NORM_SWEEP=1 also times merge
# settings on the fused-norm block.
set -uo pipefail
export PYTHONWARNINGS=ignore
source "$(dirname "$0")/common.sh"
status=0
DROP_WARNINGS=1
[ -z "${SKIP_TESTS:-}" ] && two_phase_gpu_tests
step "block with partial sums formed from outputs, with and without each read's RMSNorm" 200 \
    python3 benchmarks/bench_depth_read.py --block --sweep-only --block-updates \
        ${NORM_SWEEP:+--block-norm-sweep} --csv "$OUT/norm_fusion_block.csv"
train_1b "${ITERS_1B:-12}" 150 ${ARMS_1B:-standard:auto lr_attnres:per_site lr_attnres:auto lr_attnres:auto:--no-fuse-depth-norm}
echo "== done $(date -u +%T), status $status" | tee -a "$OUT/log"
exit $status
