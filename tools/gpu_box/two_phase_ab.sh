#!/usr/bin/env bash
# Short GPU check of the two-phase schedule: its large bf16 op tests, then the tiny preset
# (attnres) trained with --depth-schedule per_site on GPU 0 and two_phase on GPU 1 at once,
# then the depth-block benchmark.   GIT_SHA=<sha> bash tools/gpu_box/two_phase_ab.sh
set -uo pipefail
export PYTHONWARNINGS=ignore
source "$(dirname "$0")/common.sh"
for s in per_site two_phase; do
    g=0; [ $s = two_phase ] && g=1
    CUDA_VISIBLE_DEVICES=$g timeout 150 python3 -m megatron_lrattn.cli.pretrain --preset tiny \
        --residual attnres --depth-schedule $s --no-progress --log-json "$OUT/ab_$s.jsonl" \
        >"/tmp/ab_$s.out" 2>&1 &
done
CUDA_VISIBLE_DEVICES=0 timeout 60 python3 -m pytest -q -p no:cacheprovider \
    tests/test_two_phase_ops.py -k large_bf16 2>&1 | tail -4 | tee -a "$OUT/log"
wait
for s in per_site two_phase; do
    echo "== tiny attnres $s: $(grep -E 'first validation|final validation' /tmp/ab_$s.out | tr '\n' ' ')" | tee -a "$OUT/log"
    grep -q "final validation" "/tmp/ab_$s.out" || tail -8 "/tmp/ab_$s.out" | tee -a "$OUT/log"
done
CUDA_VISIBLE_DEVICES=0 timeout 100 python3 benchmarks/bench_depth_read.py --block --no-compile \
    --csv "$OUT/two_phase_block.csv" 2>&1 | tail -25 | tee -a "$OUT/log"
