#!/usr/bin/env bash
# Phase-1 passes of the two-phase schedule on the GPU box (one H200, about 6
# minutes): the GPU-only tests of the two-phase ops (large bf16 shapes) and the bf16 DDP
# model tests on the fused kernels; the two-phase block (L=24 N=8: K=6 sites after S=9
# sources, d=2048, T=16384) under the phase-1 settings of PHASE1_AB in
# benchmarks/bench_depth_read.py, interleaved rounds, with the GPU time per kernel; the
# block as the model runs it (partial sums formed from outputs, each read's RMSNorm); then
# the 1b preset through lrattn-profile (standard, attnres, lr_attnres built side by side
# and run alternating: step time, MFU, memory, depth-read share).
#   GIT_SHA=$(git rev-parse --short HEAD) bash tools/gpu_box/phase1_passes.sh
# SKIP_TESTS=1 leaves the tests out; ROUNDS (3) for the block; PROFILE_ARGS adds
# lrattn-profile flags; TRAIN_1B=1 also trains the 1b arms (ARMS_1B / ITERS_1B as in
# norm_fusion.sh).
set -uo pipefail
export PYTHONWARNINGS=ignore
source "$(dirname "$0")/common.sh"
status=0
DROP_WARNINGS=1
[ -z "${SKIP_TESTS:-}" ] && two_phase_gpu_tests
step "two-phase block under the phase-1 settings" 240 \
    python3 benchmarks/bench_depth_read.py --block --sweep-only --block-phase1-ab \
        --rounds "${ROUNDS:-3}" --csv /tmp/unused_block.csv
step "block with partial sums formed from outputs, with and without each read's RMSNorm" 150 \
    python3 benchmarks/bench_depth_read.py --block --sweep-only --block-updates \
        --csv "$OUT/phase1_block.csv"
# shellcheck disable=SC2086
step "1b preset through lrattn-profile (arms alternating)" 240 \
    python3 -m megatron_lrattn.cli.profile --preset 1b --seq-length 2048 --micro-batch-size 4 \
        --arms standard,attnres,lr_attnres --warmup-steps 3 --rounds 6 --steps-per-round 4 \
        ${PROFILE_ARGS:-} --json "$OUT/phase1_profile.json" --plot "$OUT/phase1_profile.png"
[ -n "${TRAIN_1B:-}" ] && train_1b "${ITERS_1B:-12}" 120 ${ARMS_1B:-standard:auto lr_attnres:auto attnres:auto}
echo "== done $(date -u +%T), status $status" | tee -a "$OUT/log"
exit $status
