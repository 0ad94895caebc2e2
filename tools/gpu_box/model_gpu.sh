#!/usr/bin/env bash
# The model on the GPU box: lrattn-pretrain end to end on CUDA (SDPA core attention, fused
# depth read, bf16 with fp32 depth queries) for every residual mode, then a short 1b-preset
# step-time comparison. megatron-core travels as a py3.12 wheel in .whl/.
#   GIT_SHA=$(git rev-parse --short HEAD) bash tools/gpu_box/model_gpu.sh
# TINY_MODES="" skips the tiny-preset runs.
set -euo pipefail
source "$(dirname "$0")/common.sh"
train() { python3 -m megatron_lrattn.cli.pretrain --no-progress "$@"; }
for mode in ${TINY_MODES-standard attnres lr_attnres}; do
    echo "== tiny preset, $mode, CUDA bf16" | tee -a "$OUT/log"
    train --preset tiny --residual "$mode" --log-json "$OUT/tiny_$mode.jsonl" 2>&1 \
        | grep -v -i warn | tail -4 | tee -a "$OUT/log"
done
[ -n "${TINY_MODES-x}" ] && echo "== tiny preset, lr_attnres projected r=16" | tee -a "$OUT/log" &&
train --preset tiny --key projected --rank 16 --train-iters 100 --eval-interval 50 2>&1 \
    | grep -v -i warn | tail -3 | tee -a "$OUT/log"
for mode in standard attnres lr_attnres; do
    echo "== 1b preset step time, $mode (mbs 4, gbs 8, seq 2048, 12 iters)" | tee -a "$OUT/log"
    train --preset 1b --residual "$mode" --micro-batch-size 4 --global-batch-size 8 \
        --train-iters 12 --lr-warmup-iters 2 --eval-interval 12 --eval-iters 1 \
        --log-json "$OUT/1b_$mode.jsonl" 2>&1 | grep -v -i warn | tail -2 | tee -a "$OUT/log"
    python3 - "$OUT/1b_$mode.jsonl" <<'PY' | tee -a "$OUT/log"
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
t = [r["step_time_s"] for r in rows if r["type"] == "train"][4:]
print(f"median step {statistics.median(t) * 1000:.1f} ms over {len(t)} steps")
PY
done
