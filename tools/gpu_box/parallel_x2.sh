#!/usr/bin/env bash
# Two-GPU checks (nvidia-h200-x2), in one call:
#  1. loss curves: the 1b preset (bf16, lr_attnres sliced r=d/4, N=8) for 20 steps on one GPU,
#     with TP=2 and with PP=2, all resumed from one checkpoint written after iteration 1 (a
#     fresh TP or PP run initialises other weights than one GPU does);
#  2. determinism: the one-GPU run twice with --deterministic, once on each GPU, same seed;
#  3. lrattn-profile with PP=2 and 2 virtual stages per rank (interleaved schedule).
#   GIT_SHA=<sha> bash tools/gpu_box/parallel_x2.sh      (carry .whl/: the megatron-core wheel)
# STEPS=(curves profile) selects parts; PRESET (1b) and VPL (layers per virtual stage, 4)
# allow a CPU smoke run (PRESET=tiny VPL=1); SCHEDULE sets --depth-schedule (per_site); LR
# overrides the preset's learning rate; EXTRA adds flags (e.g. EXTRA=--bf16 on CPU). The curves part also runs one GPU at micro-batch 4
# (the same global batch): its distance from the micro-batch-2 run is the bf16 noise floor
# that TP=2 and PP=2 are compared with. Logs, JSON lines and the profile JSON/PNG land in $OUT.
set -uo pipefail
STEPS=${STEPS:-"curves profile"}
export PYTHONWARNINGS=ignore
HEADER="steps $STEPS" source "$(dirname "$0")/common.sh"
start=$SECONDS
python3 -c "from megatron_lrattn.data.default_corpus import ensure_default_data as e; e()" \
    >/dev/null 2>"$OUT/data.err" || { tail "$OUT/data.err"; exit 1; }
log "default data ready ($((SECONDS - start)) s)"

pretrain() { python3 -m megatron_lrattn.cli.pretrain "$@"; }
torchrun2() { python3 -m torch.distributed.run --standalone --nproc-per-node 2 "$@"; }
CK=/tmp/lrattn_x2_ckpt
run=(--preset "${PRESET:-1b}" --micro-batch-size 2 --global-batch-size 8 --train-iters 21 --lr-warmup-iters 5
     --eval-interval 1000 --eval-iters 2 --log-interval 5 --no-progress
     --depth-schedule "${SCHEDULE:-per_site}" ${LR:+--lr "$LR"} ${EXTRA:-})
summary() {  # JSON-lines files...: iterations, losses, median step time
    python3 - "$@" <<'PY' | tee -a "$OUT/log"
import json, statistics, sys
for path in sys.argv[1:]:
    try:
        rows = [json.loads(l) for l in open(path)]
    except OSError:
        print(f"{path}: missing"); continue
    tr = [r for r in rows if r["type"] == "train"]
    if not tr:
        print(f"{path}: no training rows"); continue
    t = [r["step_time_s"] for r in tr[3:]] or [r["step_time_s"] for r in tr]
    print(f"{path.rsplit('/', 1)[-1]}: iterations {tr[0]['iteration']}-{tr[-1]['iteration']}, "
          f"median step {statistics.median(t) * 1e3:.1f} ms, peak "
          f"{max(r.get('peak_memory_gib') or 0 for r in tr):.1f} GiB, losses "
          + " ".join(f"{r['loss']:.4f}" for r in tr))
PY
}

if [[ " $STEPS " == *" curves "* ]]; then
    log "== init: one GPU, iteration 1, saved to $CK"
    rm -rf "$CK"
    CUDA_VISIBLE_DEVICES=0 pretrain "${run[@]}" --exit-interval 1 --save "$CK" \
        --log-json "$OUT/x2_init.jsonl" >"$OUT/x2_init.out" 2>&1 || tail -20 "$OUT/x2_init.out"
    log "($((SECONDS - start)) s)"
    log "== one GPU, resumed, --deterministic, twice at once (GPU 0 and GPU 1)"
    for g in 0 1; do
        CUDA_VISIBLE_DEVICES=$g pretrain "${run[@]}" --load "$CK" --deterministic \
            --log-json "$OUT/x2_single_gpu$g.jsonl" >"$OUT/x2_single_gpu$g.out" 2>&1 &
    done
    wait
    for g in 0 1; do grep -q "final validation" "$OUT/x2_single_gpu$g.out" || tail -20 "$OUT/x2_single_gpu$g.out"; done
    summary "$OUT/x2_single_gpu0.jsonl" "$OUT/x2_single_gpu1.jsonl"
    cmp -s <(python3 -c "import json,sys; [print(repr(json.loads(l).get('loss'))) for l in open(sys.argv[1])]" "$OUT/x2_single_gpu0.jsonl") \
           <(python3 -c "import json,sys; [print(repr(json.loads(l).get('loss'))) for l in open(sys.argv[1])]" "$OUT/x2_single_gpu1.jsonl") \
        && log "determinism: the two runs' losses are bitwise identical" \
        || log "determinism: the two runs' losses DIFFER"
    log "($((SECONDS - start)) s)"
    for layout in tp2 pp2; do
        flag=--tensor-model-parallel-size; [ $layout = pp2 ] && flag=--pipeline-model-parallel-size
        log "== $layout, resumed"
        torchrun2 -m megatron_lrattn.cli.pretrain "${run[@]}" $flag 2 --load "$CK" \
            --log-json "$OUT/x2_$layout.jsonl" >"$OUT/x2_$layout.out" 2>&1 || tail -20 "$OUT/x2_$layout.out"
        summary "$OUT/x2_$layout.jsonl"
        log "($((SECONDS - start)) s)"
    done
    log "== bf16 noise floor: one GPU, resumed, micro-batch 4 instead of 2 (same global batch)"
    CUDA_VISIBLE_DEVICES=0 pretrain "${run[@]}" --micro-batch-size 4 --load "$CK" \
        --log-json "$OUT/x2_single_mbs4.jsonl" >"$OUT/x2_single_mbs4.out" 2>&1 \
        || tail -20 "$OUT/x2_single_mbs4.out"
    summary "$OUT/x2_single_mbs4.jsonl"
    python3 - "$OUT" <<'PY' | tee -a "$OUT/log"
import json, sys
out = sys.argv[1]
def losses(name):
    try:
        return {r["iteration"]: r["loss"] for r in map(json.loads, open(f"{out}/x2_{name}.jsonl"))
                if r["type"] == "train"}
    except OSError:
        return {}
ref = losses("single_gpu0")
for name in ("single_gpu1", "single_mbs4", "tp2", "pp2"):
    got = losses(name)
    common = sorted(set(ref) & set(got))
    if not common:
        print(f"{name}: no common iterations with the one-GPU run"); continue
    rel = [abs(got[i] - ref[i]) / abs(ref[i]) for i in common]
    print(f"{name} vs one GPU: {len(common)} iterations, max |dloss|/loss {max(rel):.2e}, "
          f"mean {sum(rel) / len(rel):.2e}")
PY
    rm -rf "$CK"
fi

if [[ " $STEPS " == *" profile "* ]]; then
    log "== lrattn-profile, PP=2 with 2 virtual stages per rank (8 micro-batches of 4)"
    torchrun2 -m megatron_lrattn.cli.profile --preset "${PRESET:-1b}" --seq-length 2048 --micro-batch-size 4 \
        --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage "${VPL:-4}" \
        --depth-schedule "${SCHEDULE:-per_site}" \
        --arms standard,attnres,lr_attnres --warmup-steps 2 --rounds 4 --steps-per-round 3 \
        --json "$OUT/profile_pp2vp2.json" --plot "$OUT/profile_pp2vp2.png" \
        >"$OUT/profile_pp2vp2.out" 2>"$OUT/profile_pp2vp2.err" \
        || { log "profile FAILED"; tail -30 "$OUT/profile_pp2vp2.err" | tee -a "$OUT/log"; }
    grep -v -i warn "$OUT/profile_pp2vp2.out" | tee -a "$OUT/log"
    log "($((SECONDS - start)) s)"
fi
log "all done ($((SECONDS - start)) s)"
