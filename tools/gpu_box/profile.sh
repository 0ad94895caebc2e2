#!/usr/bin/env bash
# lrattn-profile on the GPU box: the 1b preset (seq 2048, micro-batch 4, synthetic tokens,
# bf16, fused depth read) with the arms standard, attnres, lr_attnres sliced r=d/4 and
# lr_attnres projected r=32 built side by side and run alternating.
#   GIT_SHA=<sha> bash tools/gpu_box/profile.sh            (carry .whl/: megatron-core wheel)
# Layouts (LAYOUTS, default "1gpu pp2"): 1gpu = one GPU; pp2 = PP=2 over two GPUs under
# torchrun, run only when two GPUs are visible (nvidia-h200-x2). JSON, PNG and logs land in
# $OUT. PROFILE_ARGS adds flags to every run (e.g. "--rounds 3"). PP=2 with two virtual
# stages per rank: parallel_x2.sh (profile part).
set -euo pipefail
source "$(dirname "$0")/common.sh"

model=(--preset 1b --seq-length 2048 --micro-batch-size 4)
arms=(--arms standard,attnres,lr_attnres,lr_attnres_projected --projected-rank 32)
timing=(--warmup-steps 3 --rounds 6 --steps-per-round 4)
# shellcheck disable=SC2206
extra=(${PROFILE_ARGS:-})

profile() {  # name, launcher..., -- profiler flags...
    local name=$1; shift
    echo "== $name" | tee -a "$OUT/log"
    local start=$SECONDS
    "$@" "${model[@]}" "${arms[@]}" "${timing[@]}" "${extra[@]}" \
        --json "$OUT/profile_$name.json" --plot "$OUT/profile_$name.png" \
        >"$OUT/profile_$name.out" 2>"$OUT/profile_$name.err" \
        || { echo "FAILED (rc $?), last lines of stderr:"; tail -20 "$OUT/profile_$name.err"; } \
        | tee -a "$OUT/log"
    { grep -v -i warn "$OUT/profile_$name.out" || true; } | tee -a "$OUT/log"
    echo "($((SECONDS - start)) s)" | tee -a "$OUT/log"
}

for layout in ${LAYOUTS:-1gpu pp2}; do
    case $layout in
    1gpu)
        profile 1gpu python3 -m megatron_lrattn.cli.profile
        ;;
    pp2)
        if [ "$NGPU" -lt 2 ]; then
            echo "== pp2 skipped: $NGPU GPU visible (run on nvidia-h200-x2)" | tee -a "$OUT/log"
            continue
        fi
        # 8 micro-batches of 4 per step (the profiler's default for PP=2: 4 x PP)
        profile pp2 python3 -m torch.distributed.run --standalone --nproc-per-node 2 \
            -m megatron_lrattn.cli.profile --pipeline-model-parallel-size 2
        ;;
    *)
        echo "unknown layout $layout (1gpu, pp2)" | tee -a "$OUT/log"; exit 2
        ;;
    esac
done
