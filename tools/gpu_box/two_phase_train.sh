#!/usr/bin/env bash
# The two-phase schedule in training on the GPU box (one H200, about 8 minutes): GPU time per
# kernel of one depth block for both schedules, the bf16 DDP model tests on the fused
# kernels, the tiny preset (attnres with 2 depth blocks of 4 sub-layers unless TINY_ARGS
# says otherwise) trained per-site and two-phase (validation losses side by side), then
# 1b-preset step times: standard, and lr_attnres / attnres per-site and with the default
# schedule (two-phase on CUDA).
#   GIT_SHA=$(git rev-parse --short HEAD) bash tools/gpu_box/two_phase_train.sh
# ARMS_1B overrides the 1b arms ("residual:schedule" words); SKIP_TINY=1, SKIP_PROFILE=1.
set -uo pipefail
export PYTHONWARNINGS=ignore
source "$(dirname "$0")/common.sh"
status=0
DROP_WARNINGS=1
TRAIN=(python3 -m megatron_lrattn.cli.pretrain --no-progress)
[ -z "${SKIP_PROFILE:-}" ] && step "GPU time per kernel of one depth block" 90 \
    python3 benchmarks/bench_depth_read.py --block --block-profile --sweep-only \
        --csv /tmp/unused_block.csv
step "bf16 DDP model tests on the fused kernels (two-phase vs per-site)" 120 \
    python3 -m pytest -q -p no:cacheprovider tests/test_two_phase_model.py -k gpu
if [ -z "${SKIP_TINY:-}" ]; then
    for s in per_site two_phase; do
        step "tiny preset, ${TINY_ARGS:-attnres, 2 blocks}, $s" 150 "${TRAIN[@]}" --preset tiny \
            ${TINY_ARGS:---residual attnres --num-blocks 2} --depth-schedule "$s" \
            --log-json "$OUT/tiny_$s.jsonl"
        median_step "$OUT/tiny_$s.jsonl" | tee -a "$OUT/log"
    done
fi
train_1b 12 100 ${ARMS_1B:-standard:auto lr_attnres:per_site lr_attnres:auto attnres:per_site attnres:auto}
echo "== done $(date -u +%T), status $status" | tee -a "$OUT/log"
exit $status
