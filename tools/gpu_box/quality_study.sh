#!/usr/bin/env bash
# The multi-seed quality study (docs/results.md) on the GPU box: four arms x SEEDS seeds of
# the study-25m preset, same data, tokens and hyper-parameters, on every visible GPU at once.
#   GIT_SHA=<sha> bash tools/gpu_box/quality_study.sh     (carry .whl/: megatron-core wheel)
# Corpus: every .py file of the box's Python installation (standard library and
# site-packages, tests excluded), the largest real text on a machine without network,
# tokenized with the embedded BPE tokenizer; 2% of the documents are held out. Every run's
# JSON-lines log lands in $OUT/study/; depth-routing analyses of the seed-1 checkpoints in
# $OUT/study/analyze_<arm>/. Then: python tools/study_report.py <that folder>.
# SCHEDULE sets --depth-schedule (default per_site). A CPU smoke run of the whole pipeline:
#   NO_WHEEL=1 PRESET=tiny ITERS=20 CORPUS_MB=2 SEEDS="1 2" bash tools/gpu_box/quality_study.sh
set -uo pipefail
SEEDS=${SEEDS:-"1 2 3"}
ITERS=${ITERS:-500}
PER_GPU=${PER_GPU:-6}     # concurrent runs per GPU (a 25M model leaves an H200 mostly idle)
PRESET=${PRESET:-study-25m}
CORPUS_MB=${CORPUS_MB:-}  # cap on each corpus part (default: all of it)
export PYTHONWARNINGS=ignore OMP_NUM_THREADS=2
HEADER="seeds $SEEDS iters $ITERS" source "$(dirname "$0")/common.sh"
mkdir -p "$OUT/study" /tmp/study
SLOTS=$((NGPU > 0 ? NGPU : 1))

start=$SECONDS
tok=$(python3 -c "from megatron_lrattn.data.default_corpus import ensure_default_data as e; print(e().tokenizer_dir)" 2>>"$OUT/study/data.err") || { tail "$OUT/study/data.err"; exit 1; }
CORPUS_MB="$CORPUS_MB" python3 - <<'PY' 2>&1 | tee -a "$OUT/log"
import os
import sysconfig
from megatron_lrattn.data.corpus import write_stdlib_corpus
paths = sysconfig.get_paths()
cap = int(float(os.environ["CORPUS_MB"]) * 1e6) if os.environ.get("CORPUS_MB") else None
for name, root in (("stdlib", paths["stdlib"]), ("site", paths["purelib"])):
    s = write_stdlib_corpus(f"/tmp/study/{name}.jsonl", max_bytes=cap, root=root)
    print(f"corpus {name}: {root}: {s.documents} documents, {s.num_bytes / 1e6:.1f} MB")
PY
python3 -m megatron_lrattn.cli.preprocess --input /tmp/study/stdlib.jsonl /tmp/study/site.jsonl \
    --output-prefix /tmp/study/pycode --tokenizer "$tok" --workers 24 --no-progress 2>&1 \
    | grep -v -i warn | tail -3 | tee -a "$OUT/log"
prefix=$(ls /tmp/study/pycode*.bin | head -1); prefix=${prefix%.bin}
python3 - "$prefix" <<'PY' 2>&1 | tee -a "$OUT/log"
import os, sys
n = os.path.getsize(sys.argv[1] + ".bin")
print(f"dataset {sys.argv[1]}: {n / 1e6:.1f} MB of tokens")
PY
log "data ready ($((SECONDS - start)) s)"

declare -A ARM=(
    [standard]="--residual standard"
    [attnres]="--residual attnres --num-blocks 8"
    [lr_sliced]="--residual lr_attnres --key sliced --rank 128 --num-blocks 8"
    [lr_projected]="--residual lr_attnres --key projected --rank 32 --num-blocks 8"
)
i=0
pids=()
for seed in $SEEDS; do
    for arm in standard attnres lr_sliced lr_projected; do
        gpu=$((i % SLOTS)); i=$((i + 1))
        save=()
        [ "$seed" = "1" ] && [ "$arm" != standard ] && save=(--save "/tmp/study/ckpt_$arm")
        # shellcheck disable=SC2086
        CUDA_VISIBLE_DEVICES=$gpu python3 -m megatron_lrattn.cli.pretrain --preset "$PRESET" \
            ${ARM[$arm]} --seed "$seed" --train-iters "$ITERS" --data-path "$prefix" \
            --tokenizer-model "$tok" --split 98,2,0 --no-progress "${save[@]}" \
            --depth-schedule "${SCHEDULE:-per_site}" \
            --log-json "$OUT/study/${arm}_seed$seed.jsonl" \
            >"/tmp/study/${arm}_seed$seed.out" 2>&1 &
        pids+=($!)
        # keep at most PER_GPU x NGPU runs in flight
        while [ "$(jobs -rp | wc -l)" -ge $((PER_GPU * SLOTS)) ]; do sleep 2; done
    done
done
fail=0
for p in "${pids[@]}"; do wait "$p" || fail=$((fail + 1)); done
log "training done ($((SECONDS - start)) s), failed runs: $fail"
for f in /tmp/study/*.out; do
    grep -q "final validation loss" "$f" || { log "== $f"; tail -5 "$f" | tee -a "$OUT/log"; }
done

for arm in attnres lr_sliced lr_projected; do
    [ -d "/tmp/study/ckpt_$arm" ] || continue
    python3 -m megatron_lrattn.cli.analyze "/tmp/study/ckpt_$arm" --out "$OUT/study/analyze_$arm" \
        --num-batches 4 --no-progress 2>&1 | grep -v -i warn | tail -2 | tee -a "$OUT/log"
done
python3 tools/study_report.py "$OUT/study" --out "$OUT/study" 2>&1 | tee -a "$OUT/log"
log "all done ($((SECONDS - start)) s)"
