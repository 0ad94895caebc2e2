#!/usr/bin/env bash
# The depth-read kernels at their defaults on one H200, in one call: the large bf16 parity
# tests, the benchmark table (peers side by side, wall and GPU-busy time, no sweep), the bf16
# Float16Module + DDP model tests (two-phase and per-site reads through the kernels, NCCL
# group), and a short 1b-preset lr_attnres run (its reads take the source-tiled kernels).
#   GIT_SHA=<sha> bash tools/gpu_box/kernels_table.sh [bench args, e.g. --sources 9]
# (carry .whl/ with megatron-core and, for the peers, fla-core and fast-attnres wheels).
# Budget: about 8 minutes; each step has its own time limit so that the log always returns.
# TABLE_S: the table's time limit (default 300 s); SKIP_MODEL=1 stops after the table;
# SKIP_TESTS=1 leaves out the parity tests.
set -uo pipefail
export PYTHONWARNINGS=ignore
HEADER="depth-read kernels at their defaults" source "$(dirname "$0")/common.sh"
clocks() {
    nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active \
        --format=csv,noheader 2>&1 | sed "s/^/clocks (sm, mem, power, temp, events) $1: /" \
        | tee -a "$OUT/log"
}
PT=(python3 -m pytest -q -p no:cacheprovider -rf)
if [ -z "${SKIP_TESTS:-}" ]; then  # SKIP_TESTS=1: the table checks every row anyway
    log "== large bf16 parity tests, both kernel families"
    timeout 120 "${PT[@]}" tests/test_kernels.py -k "large" 2>&1 | tail -4 | tee -a "$OUT/log"
fi
clocks before
timeout "${TABLE_S:-300}" python3 benchmarks/bench_depth_read.py --csv "$OUT/depth_read.csv" \
    --no-compile "$@" 2>&1 | tee -a "$OUT/log"
clocks after
if [ -n "${SKIP_MODEL:-}" ]; then  # SKIP_MODEL=1: the kernels' tests and table only
    exit 0
fi
log "== bf16 model tests on CUDA (two-phase and per-site reads through the kernels)"
timeout 120 "${PT[@]}" tests/test_two_phase_model.py -k "bf16" 2>&1 | tail -4 | tee -a "$OUT/log"
python3 -c "from megatron_lrattn.data.default_corpus import ensure_default_data as e; e()" \
    >/dev/null 2>&1
log "== 1b preset, lr_attnres, 12 iterations (mbs 4, gbs 8, seq 2048)"
timeout 150 python3 -m megatron_lrattn.cli.pretrain --no-progress --preset 1b \
    --residual lr_attnres --micro-batch-size 4 --global-batch-size 8 --train-iters 12 \
    --lr-warmup-iters 2 --eval-interval 12 --eval-iters 1 --log-json "$OUT/1b_lr_attnres.jsonl" \
    2>&1 | grep -E "iteration|validation|Error|error" | tail -8 | tee -a "$OUT/log"
