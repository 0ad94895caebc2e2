#!/usr/bin/env bash
# On the GPU box after te_build.sh (same warm machine): the TE tests, then the 1b preset for
# 100 iterations in four arms, one process each, one after another: the local spec, the TE
# spec in bf16, and the TE spec with FP8 GEMMs (hybrid format) under delayed and under
# current (tensorwise) scaling. Per-arm metrics: $OUT/te_<arm>.jsonl (also kept in
# /tmp/te_runs); table: $OUT/te_train.log and $OUT/te_train_summary.json over every arm in
# /tmp/te_runs (median step time and tokens/s over iterations 11-100, mean train loss of the
# last 10, validation loss at 100, peak memory), so arms split over calls share one table.
#   GIT_SHA=<sha> bash tools/gpu_box/te_train.sh      carry: the megatron-core wheel (.whl/)
# RESIDUAL=standard|attnres|lr_attnres (default lr_attnres, sliced keys r = d/4, N = 8);
# ARMS="local te_bf16 te_fp8_delayed te_fp8_tensorwise" picks arms; TE_TESTS=0 skips pytest;
# LR overrides the preset's learning rate (docs/performance.md uses LR=3e-4).
set -euo pipefail
OUT=${OUT:-/tmp/lrattn_out}
RESIDUAL=${RESIDUAL:-lr_attnres}
ARMS=${ARMS:-local te_bf16 te_fp8_delayed te_fp8_tensorwise}
[ -f /tmp/te_env.sh ] || { echo "te_train: /tmp/te_env.sh missing: run te_build.sh first"; exit 2; }
RUNS=/tmp/te_runs
mkdir -p "$OUT" /tmp/lrattn_pk "$RUNS"
ln -sfn "$PWD/kernels" /tmp/lrattn_pk/lrattn_kernels
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/lrattn_site .whl/megatron_core-*.whl
export PYTHONPATH="$PWD:/tmp/lrattn_pk:/tmp/lrattn_site" PYTHONUNBUFFERED=1
. /tmp/te_env.sh
export LRATTN_CACHE=/tmp/lrattn_cache NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
log=$OUT/te_train.log
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c "import torch, triton, megatron.core as m, importlib.metadata as md; print('torch', torch.__version__, 'triton', triton.__version__, 'megatron-core', m.__version__, 'transformer-engine', md.version('transformer-engine'))"
    echo "git ${GIT_SHA:-unknown} date $(date -u +%FT%TZ) residual $RESIDUAL"
} 2>&1 | tee "$log"
if [ "${TE_TESTS:-1}" != 0 ]; then
    python3 -m pytest -q -p no:cacheprovider tests/test_te_spec.py 2>&1 | tail -15 | tee -a "$log" \
        || echo "TE TESTS FAILED" | tee -a "$log"
fi

COMMON=(--preset 1b --residual "$RESIDUAL" --micro-batch-size 4 --global-batch-size 8
        --train-iters 100 --lr-warmup-iters 10 --eval-interval 100 --eval-iters 2
        --seed 1234 --no-progress ${LR:+--lr "$LR"})
declare -A ARM_FLAGS=(
    [local]="--transformer-impl local"
    [te_bf16]="--transformer-impl transformer_engine"
    [te_fp8_delayed]="--transformer-impl transformer_engine --fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 1024 --fp8-amax-compute-algo max"
    [te_fp8_tensorwise]="--transformer-impl transformer_engine --fp8-format hybrid --fp8-recipe tensorwise"
)
for arm in $ARMS; do
    echo "== $arm: ${ARM_FLAGS[$arm]}" | tee -a "$log"
    # shellcheck disable=SC2086
    rm -f "$RUNS/te_$arm.jsonl"
    python3 -m megatron_lrattn.cli.pretrain "${COMMON[@]}" ${ARM_FLAGS[$arm]} \
        --log-json "$RUNS/te_$arm.jsonl" >"$OUT/te_$arm.out" 2>&1 \
        || echo "ARM $arm FAILED (exit $?): $(grep -v -i warn "$OUT/te_$arm.out" | tail -3)" | tee -a "$log"
    grep -v -i warn "$OUT/te_$arm.out" | tail -2 | tee -a "$log"
    [ -f "$RUNS/te_$arm.jsonl" ] && cp "$RUNS/te_$arm.jsonl" "$OUT/"
done
python3 - "$RUNS" "$OUT" local te_bf16 te_fp8_delayed te_fp8_tensorwise <<'PY' | tee -a "$log"
import json, os, statistics, sys
runs, out, arms = sys.argv[1], sys.argv[2], sys.argv[3:]
rows = {}
for arm in arms:
    path = os.path.join(runs, f"te_{arm}.jsonl")
    if not os.path.isfile(path):
        continue
    recs = [json.loads(l) for l in open(path)]
    train = [r for r in recs if r["type"] == "train"]
    valid = [r for r in recs if r["type"] == "valid"]
    steady = train[10:] or train
    if not steady:
        continue
    rows[arm] = {
        "iterations": len(train),
        "median_step_ms": 1000 * statistics.median(r["step_time_s"] for r in steady),
        "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
        "train_loss_last10": statistics.mean(r["loss"] for r in train[-10:] if r["loss"] is not None),
        "valid_loss": valid[-1]["loss"] if valid else None,
        "peak_memory_gib": max((r.get("peak_memory_gib") or 0) for r in train),
    }
json.dump(rows, open(os.path.join(out, "te_train_summary.json"), "w"), indent=1)
ref = rows.get("local", {}).get("median_step_ms")
print(f"{'arm':20s} {'iters':>5s} {'step ms':>8s} {'vs local':>8s} {'tokens/s':>9s} "
      f"{'loss(last10)':>12s} {'valid':>7s} {'peak GiB':>8s}")
for arm, r in rows.items():
    ratio = f"{r['median_step_ms'] / ref:.3f}" if ref else "-"
    valid = f"{r['valid_loss']:.4f}" if r["valid_loss"] is not None else "-"
    print(f"{arm:20s} {r['iterations']:5d} {r['median_step_ms']:8.1f} {ratio:>8s} "
          f"{r['median_tokens_per_s']:9,.0f} {r['train_loss_last10']:12.4f} {valid:>7s} "
          f"{r['peak_memory_gib']:8.2f}")
PY
