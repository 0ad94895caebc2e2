#!/usr/bin/env bash
# The GPU-box driver: one set-up, one provenance header, then a suite.
#   GIT_SHA=<sha> bash tools/gpu_box/run.sh SUITE [ARGS...]      (from the repository root)
# Suites (README.md beside this file gives each one's arguments and variables):
#   tests       the tests that need CUDA (-m gpu), then the kernel tests compiled for the GPU
#   kernels     the depth-read kernel table against peers
#   block       the two-phase depth-block benchmark
#   profile     lrattn-profile at a preset (arms built side by side, run alternating)
#   bench       bench_step.py against compiled plain PyTorch and lrattn-profile, every preset
#   train       N iterations of a preset per arm, median step times
#   parallel    TP=2 / PP=2 loss curves against one GPU, GPU determinism (two GPUs)
#   study       the multi-seed quality study (docs/results.md)
#   te          Transformer Engine: te carry NN | te build | te train
# Set-up: the wheels carried in .whl/ installed to /tmp/lrattn_site (NO_WHEEL=1 skips them),
# the checkout on PYTHONPATH, NVLink multicast off, and a header (GPU, driver, versions, git
# SHA, date) at the top of $OUT/log. PACK=1 writes into a scratch folder and returns $OUT/log
# plus $OUT/results.tgz (a call brings back at most 8 files, two folders down), refreshed
# every PACK_EVERY seconds (30) while the suite runs.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
SUITE=${1:?usage: run.sh SUITE [ARGS...] (tests kernels block profile bench train parallel study te)}
shift
if [ -n "${PACK:-}" ]; then
    case ${PACK_EVERY:-30} in
    *[!0-9]*|0*) echo "PACK_EVERY=${PACK_EVERY}: a whole number of seconds > 0" >&2; exit 2 ;;
    esac
    real=${OUT:-/tmp/lrattn_out} scratch=$(mktemp -d /tmp/lrattn_pack.XXXX)
    mkdir -p "$real"
    # a snapshot every PACK_EVERY seconds while the suite runs, so that a call cut short
    # (its time limit, the device budget) still brings back what had finished; each one is
    # written aside and renamed, so results.tgz is always a whole archive
    pack() {
        [ -f "$scratch/log" ] && cp "$scratch/log" "$real/log"
        tar czf "$real/results.tgz.part" -C "$scratch" . 2>/dev/null \
            && mv "$real/results.tgz.part" "$real/results.tgz"
    }
    OUT=$scratch PACK="" bash "$0" "$SUITE" "$@" &
    child=$! waited=0 snapshots=0
    while kill -0 "$child" 2>/dev/null; do
        sleep 1
        waited=$((waited + 1))
        if [ $((waited % ${PACK_EVERY:-30})) -eq 0 ]; then pack; snapshots=$((snapshots + 1)); fi
    done
    wait "$child"
    rc=$?
    pack
    echo "pack: $SUITE exited $rc; $(du -sh "$real/results.tgz" | cut -f1) packed" \
         "($snapshots snapshots while it ran)"
    exit $rc
fi

OUT=${OUT:-/tmp/lrattn_out}
# the study's corpora, run logs, checkpoints and exports (two studies at once need two)
STUDY_TMP=${STUDY_TMP:-/tmp/study}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
export LRATTN_CACHE=${LRATTN_CACHE:-/tmp/lrattn_cache}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# .whl/ds/*.whl: DeepSpeed and the packages it needs that the box lacks, carried only for
# tests/test_deepspeed.py (tools/gpu_box/README.md)
if [ -z "${NO_WHEEL:-}" ] && compgen -G ".whl/*.whl" >/dev/null; then
    wheels=(.whl/*.whl)
    compgen -G ".whl/ds/*.whl" >/dev/null && wheels+=(.whl/ds/*.whl)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/lrattn_site "${wheels[@]}" || { echo "installing ${wheels[*]} failed" >&2; exit 1; }
    export PYTHONPATH="$PYTHONPATH:/tmp/lrattn_site"
fi
[ -f /tmp/te_env.sh ] && . /tmp/te_env.sh   # written by `te build` on this machine
NGPU=$( (nvidia-smi -L 2>/dev/null || true) | wc -l)
if [ -z "${GIT_SHA:-}" ] && [ "$(git rev-parse --show-toplevel 2>/dev/null)" = "$PWD" ]; then
    GIT_SHA=$(git rev-parse --short HEAD)$(git diff --quiet HEAD 2>/dev/null || echo -dirty)
fi
status=0

log() { echo "$@" | tee -a "$OUT/log"; }
# step NAME SECONDS CMD...: CMD under a time limit, its output in $OUT/log; a failure or a
# timeout sets status=1 (the driver's exit code) and the next step still runs
step() {
    local name=$1 limit=$2
    shift 2
    log "== $name ($(date -u +%T), limit ${limit}s)"
    # bash -c: CMD may be one of the functions below (exported after their definitions)
    if ! timeout "$limit" bash -c '"$@"' step "$@" 2>&1 | { grep -v -i "warn" || true; } | tee -a "$OUT/log"; then
        log "== $name FAILED or timed out"
        status=1
    fi
}
clocks() {
    nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active \
        --format=csv,noheader 2>&1 | sed "s/^/clocks (sm, mem, power, temp, events) $1: /" \
        | tee -a "$OUT/log"
}
# exit 5 (nothing selected, e.g. a -k filter matching no test of one step) is not a failure
pytest_() {
    python3 -m pytest -q -p no:cacheprovider -rfE "$@"
    local rc=$?
    [ "$rc" -eq 5 ] && { echo "(no test selected here)"; return 0; }
    return "$rc"
}
pretrain() { python3 -m megatron_lrattn.cli.pretrain --no-progress "$@"; }
torchrun_() { python3 -m torch.distributed.run --standalone --nproc-per-node "$@"; }
export -f pytest_ pretrain torchrun_
table() { python3 "$HERE/metrics.py" table "$@" | tee -a "$OUT/log"; }
default_data() {  # the embedded corpus and tokenizer, built once per machine; prints the tokenizer
    python3 -c "from megatron_lrattn.data.default_corpus import ensure_default_data as e; print(e().tokenizer_dir)" \
        2>>"$OUT/data.err" || { tail "$OUT/data.err" | tee -a "$OUT/log" >&2; exit 1; }
}

# The op tests (beside the GPU-marked tests, they run whole: their CPU-sized shapes then
# run compiled for the GPU instead of under the interpreter) and the two benchmarks.
KERNEL_TESTS=(tests/ops)
KERNEL_TABLE=(benchmarks/bench_kernels.py)
BLOCK_BENCH=(benchmarks/bench_block.py)

suite_tests() {  # [pytest args]
    step "tests that need CUDA (-m gpu)" "${TESTS_S:-420}" pytest_ -m gpu tests "$@"
    step "kernel tests, compiled for the GPU" "${TESTS_S:-420}" pytest_ -m "not gpu" \
        "${KERNEL_TESTS[@]}" "$@"
}

suite_kernels() {  # [kernel-table args, e.g. --sources 9 --widths 2048 4096]
    clocks before
    step "depth-read kernel table" "${KERNELS_S:-540}" python3 "${KERNEL_TABLE[@]}" \
        --csv "$OUT/kernels.csv" "$@"
    clocks after
}

suite_block() {  # [block-benchmark args]
    clocks before
    step "two-phase depth block" "${BLOCK_S:-300}" python3 "${BLOCK_BENCH[@]}" \
        --csv "$OUT/block.csv" "$@"
    clocks after
}

suite_profile() {  # [lrattn-profile flags, which win over the defaults]
    local preset=${PRESET:-1b} layout
    local base=(--preset "$preset" --micro-batch-size "${MBS:-4}"
                --arms "${ARMS:-standard,attnres,lr_attnres}" --warmup-steps 3 --rounds 6
                --steps-per-round 4)
    for layout in ${LAYOUTS:-1gpu}; do
        local io=(--json "$OUT/profile_$layout.json" --plot "$OUT/profile_$layout.png")
        case $layout in
        1gpu) step "lrattn-profile, $preset, one GPU" "${PROFILE_S:-420}" \
                  python3 -m megatron_lrattn.cli.profile "${base[@]}" "$@" "${io[@]}" ;;
        pp2|pp2vp)
            if [ "$NGPU" -lt 2 ]; then log "== $layout skipped: $NGPU GPU visible"; continue; fi
            local pp=(--pipeline-model-parallel-size 2)
            [ "$layout" = pp2vp ] && pp+=(--num-layers-per-virtual-pipeline-stage "${VPL:-4}")
            step "lrattn-profile, $preset, $layout" "${PROFILE_S:-420}" torchrun_ 2 \
                -m megatron_lrattn.cli.profile "${base[@]}" "${pp[@]}" "$@" "${io[@]}" ;;
        *) log "unknown layout $layout (1gpu, pp2, pp2vp)"; status=2 ;;
        esac
    done
}

suite_bench() {  # the step-time benchmark of every preset (docs/performance.md)
    # Per preset in PRESETS: benchmarks/bench_step.py (BENCH_ARMS beside the compiled
    # plain-PyTorch model, alternating, kernel tables) where two models fit one GPU, then
    # lrattn-profile for all four arms. 4b runs lrattn-profile only (--sequential): one 4b
    # model with its optimizer is about 56 GB, so two do not fit beside the activations.
    local preset flags common=(--no-qk-layernorm --vocab-size 32768 --warmup-steps 4) v entry
    local variants=()  # BENCH_VARIANTS: NAME=FLAGS entries separated by ';' (bench_step --variant)
    IFS=';' read -ra v <<< "${BENCH_VARIANTS:-}"
    for entry in "${v[@]}"; do [ -n "$entry" ] && variants+=(--variant "$entry"); done
    # the optimizer passes alone (two copies of a 4b model's optimizer state do not fit)
    local opt=()
    for preset in ${PRESETS:-0.5b 1b 4b}; do [ "$preset" != 4b ] && opt+=("$preset"); done
    if [ "$NGPU" -gt 0 ] && [ ${#opt[@]} -gt 0 ]; then
        step "bench_optimizer.py, ${opt[*]}" "${OPT_S:-180}" python3 benchmarks/bench_optimizer.py \
            --presets "${opt[@]}" --csv "$OUT/optimizer.csv"
    fi
    for preset in ${PRESETS:-0.5b 1b 4b}; do
        case $preset in
        4b) flags=(--micro-batch-size 1 --global-batch-size 1 --tensor-model-parallel-size 1
                   --pipeline-model-parallel-size 1) ;;
        *) flags=(--micro-batch-size 8 --global-batch-size 8) ;;
        esac
        if [ "$preset" != 4b ]; then
            step "bench_step.py, $preset" "${BENCH_S:-300}" python3 benchmarks/bench_step.py \
                --preset "$preset" "${flags[@]}" "${common[@]}" \
                --arms "${BENCH_ARMS:-standard,lr_attnres}" --rounds 5 --steps-per-round 3 \
                "${variants[@]}" --csv "$OUT/step.csv" --kernels-csv "$OUT/step_kernels.csv" \
                --copies-csv "$OUT/step_copies.csv" --saved-csv "$OUT/step_saved.csv" \
                --launchers-csv "$OUT/step_launchers.csv"
        fi
        # PROFILE_ARMS set but empty: bench_step.py only
        [ -n "${PROFILE_ARMS-x}" ] || continue
        local seq=()
        [ "$preset" = 4b ] && seq=(--sequential)
        step "lrattn-profile, $preset" "${PROFILE_S:-420}" python3 -m \
            megatron_lrattn.cli.profile --preset "$preset" "${flags[@]}" "${common[@]}" \
            --arms "${PROFILE_ARMS-standard,attnres,lr_attnres,lr_attnres_projected}" --rounds 3 \
            --steps-per-round 3 "${seq[@]}" --json "$OUT/profile_$preset.json"
    done
}

suite_train() {  # [ARM...]: residual[:schedule[:flag]], default standard attnres lr_attnres
    local preset=${PRESET:-1b} iters=${ITERS:-12} arm res rest sched extra tag files=()
    local data=()
    if [ -n "${DATA:-}" ]; then  # DATA=1: the corpus through lrattn-preprocess, not the cache
        local tok prefix
        tok=$(default_data)
        mkdir -p /tmp/lrattn_data
        python3 -c "from megatron_lrattn.data.corpus import write_stdlib_corpus as w; w('/tmp/lrattn_data/stdlib.jsonl')"
        step "lrattn-preprocess the standard-library corpus" 300 python3 -m \
            megatron_lrattn.cli.preprocess --input /tmp/lrattn_data/stdlib.jsonl \
            --output-prefix /tmp/lrattn_data/stdlib --tokenizer "$tok" --workers 8 --no-progress
        prefix=$(ls /tmp/lrattn_data/stdlib*.bin | head -1)
        data=(--data-path "${prefix%.bin}" --tokenizer-model "$tok" --split 90,5,5)
    else
        default_data >/dev/null
    fi
    [ $# -eq 0 ] && set -- standard attnres lr_attnres
    # shellcheck disable=SC2206
    local shape=(${TRAIN_ARGS---micro-batch-size 4 --global-batch-size 8})
    for arm in "$@"; do
        res=${arm%%:*} rest=${arm#"$res"} rest=${rest#:}
        sched=${rest%%:*} extra=${rest#"$sched"} extra=${extra#:}
        tag=${preset}_${res}${sched:+_$sched}${extra:+_${extra//-/}}
        # shellcheck disable=SC2086
        step "$preset, $arm, $iters iterations" "${TRAIN_S:-300}" pretrain --preset "$preset" \
            --residual "$res" --depth-schedule "${sched:-auto}" $extra "${shape[@]}" \
            "${data[@]}" --train-iters "$iters" --lr-warmup-iters 2 --eval-interval "$iters" \
            --eval-iters 1 --log-json "$OUT/train_$tag.jsonl"
        files+=("$OUT/train_$tag.jsonl")
    done
    table "${files[@]}" --skip 4
}

suite_parallel() {  # loss curves of TP=2 and PP=2 against one GPU, from one checkpoint
    # two GPUs, or none (a CPU smoke run on gloo: NO_WHEEL=1 PRESET=tiny EXTRA=--bf16)
    [ "$NGPU" -ne 1 ] || { log "parallel needs two GPUs (one visible)"; return 2; }
    default_data >/dev/null
    local ck=/tmp/lrattn_x2_ckpt layout flag g
    # shellcheck disable=SC2206
    local run=(--preset "${PRESET:-1b}" --micro-batch-size 2 --global-batch-size 8
               --train-iters 21 --lr-warmup-iters 5 --eval-interval 1000 --eval-iters 2
               --log-interval 5 --depth-schedule "${SCHEDULE:-per_site}" ${LR:+--lr "$LR"}
               ${EXTRA:-})
    rm -rf "$ck"
    step "one GPU, iteration 1, saved (a fresh TP or PP run initialises other weights)" 300 \
        env CUDA_VISIBLE_DEVICES=0 python3 -m megatron_lrattn.cli.pretrain --no-progress \
        "${run[@]}" --exit-interval 1 --save "$ck" --log-json "$OUT/x2_init.jsonl"
    log "== one GPU, resumed, --deterministic, on GPU 0 and GPU 1 at once"
    for g in 0 1; do
        CUDA_VISIBLE_DEVICES=$g pretrain "${run[@]}" --load "$ck" --deterministic \
            --log-json "$OUT/x2_single_gpu$g.jsonl" >"$OUT/x2_single_gpu$g.out" 2>&1 &
    done
    wait
    for layout in tp2 pp2; do
        flag=--tensor-model-parallel-size; [ $layout = pp2 ] && flag=--pipeline-model-parallel-size
        step "$layout, resumed" 400 torchrun_ 2 -m megatron_lrattn.cli.pretrain --no-progress \
            "${run[@]}" $flag 2 --load "$ck" --log-json "$OUT/x2_$layout.jsonl"
    done
    step "bf16 noise floor: one GPU, resumed, micro-batch 4 (same global batch)" 300 \
        env CUDA_VISIBLE_DEVICES=0 python3 -m megatron_lrattn.cli.pretrain --no-progress \
        "${run[@]}" --micro-batch-size 4 --load "$ck" --log-json "$OUT/x2_single_mbs4.jsonl"
    table "$OUT"/x2_single_gpu0.jsonl "$OUT"/x2_single_gpu1.jsonl "$OUT"/x2_single_mbs4.jsonl \
        "$OUT"/x2_tp2.jsonl "$OUT"/x2_pp2.jsonl --skip 3
    python3 "$HERE/metrics.py" compare "$OUT/x2_single_gpu0.jsonl" "$OUT/x2_single_gpu1.jsonl" \
        "$OUT/x2_single_mbs4.jsonl" "$OUT/x2_tp2.jsonl" "$OUT/x2_pp2.jsonl" | tee -a "$OUT/log"
    rm -rf "$ck"
}

suite_study() {  # ARMS x (LRS or ARM_LRS) x SEEDS of PRESET on every visible GPU at once
    local seeds=${SEEDS:-"1 2 3"} iters=${ITERS:-500} preset=${PRESET:-study-25m}
    local arms=${ARMS:-standard attnres lr_sliced lr_projected} lrs=${LRS:-preset}
    local slots=$((NGPU > 0 ? NGPU : 1)) tok prefix seed arm lr name entry i=0 fail=0 p
    local pids=() runs=() saved=() number='^([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?$' hidden
    # sliced keys at r = d/4 of the preset (128 at study-25m, 192 at study-100m)
    hidden=$(python3 -c "import sys; from megatron_lrattn.training.presets import PRESETS
p = PRESETS.get(sys.argv[1]); print(p['hidden_size']) if p else sys.exit(sorted(PRESETS))" \
        "$preset" 2>&1) || { log "study: unknown PRESET $preset (one of $hidden)"; return 2; }
    declare -A flags=(
        [standard]="--residual standard"
        [attnres]="--residual attnres --num-blocks 8"
        [lr_sliced]="--residual lr_attnres --key sliced --rank $((hidden / 4)) --num-blocks 8"
        [lr_projected]="--residual lr_attnres --key projected --rank 32 --num-blocks 8")
    declare -A arm_lr=()
    for arm in $arms; do
        [ -n "${flags[$arm]:-}" ] || { log "study: unknown arm $arm (standard attnres lr_sliced lr_projected)"; return 2; }
    done
    for entry in ${LRS:-}; do  # a sweep entry is LR (every arm) or arm=LR (that arm only)
        arm=${entry%%=*} lr=${entry#*=}
        [[ $lr =~ $number ]] \
            || { log "study: LRS entry '$entry' is not LR or arm=LR (e.g. 1e-3, standard=4e-3)"; return 2; }
        [ "$arm" = "$entry" ] || [[ " $arms " == *" $arm "* ]] \
            || { log "study: LRS entry '$entry' names arm $arm, which is not in ARMS ($arms)"; return 2; }
    done
    if [ -n "${ARM_LRS:-}" ]; then  # the seeds phase: each arm at its own LR
        [ -z "${LRS:-}" ] || { log "study: set LRS (a sweep) or ARM_LRS (an LR per arm), not both"; return 2; }
        for entry in $ARM_LRS; do
            arm=${entry%%=*} lr=${entry#*=}
            [ "$arm" != "$entry" ] && [[ $lr =~ $number ]] \
                || { log "study: ARM_LRS entry '$entry' is not arm=LR (e.g. attnres=2e-3)"; return 2; }
            [ -n "${flags[$arm]:-}" ] \
                || { log "study: ARM_LRS names unknown arm $arm (standard attnres lr_sliced lr_projected)"; return 2; }
            arm_lr[$arm]=$lr
        done
        for arm in $arms; do
            [ -n "${arm_lr[$arm]:-}" ] \
                || { log "study: ARM_LRS has no LR for arm $arm (ARM_LRS=\"$ARM_LRS\")"; return 2; }
        done
        lrs=per-arm
    fi
    mkdir -p "$OUT/study" "$STUDY_TMP"
    case ${CORPUS:-code} in
    code) study_code_data ;;
    prose) study_prose_data || return 2 ;;
    *) log "study: unknown CORPUS=$CORPUS (code or prose)"; return 2 ;;
    esac
    # checkpoints and Hugging Face exports of an earlier call on this machine
    rm -rf "$STUDY_TMP"/ckpt_* "$STUDY_TMP"/hf_* "$STUDY_TMP"/eval_*
    log "study: corpus ${CORPUS:-code}, $preset, $iters iterations, arms $arms," \
        "LRs ${ARM_LRS:-$lrs}, seeds $seeds"
    for seed in $seeds; do
        for lr in $lrs; do
            for arm in $arms; do
                # LRS="1e-3 2e-3 ...": a sweep, each run at --lr LR --min-lr LR/10, named
                # <arm>_lr<LR>_seed<k>; no checkpoints; an entry arm=LR runs only that arm.
                # Otherwise (the seeds phase) each arm at its ARM_LRS entry (same --min-lr
                # rule) or the preset's LR, named <arm>_seed<k>, every run's final
                # checkpoint saved.
                local save=() lrflags=() run_lr=$lr
                if [ "${lr#*=}" != "$lr" ]; then
                    [ "${lr%%=*}" = "$arm" ] || continue
                    run_lr=${lr#*=}
                fi
                [ "$lr" = per-arm ] && run_lr=${arm_lr[$arm]}
                if [ "$run_lr" != preset ]; then
                    lrflags=(--lr "$run_lr" --min-lr "$(python3 -c "print(float('$run_lr') / 10)")")
                fi
                if [ -n "${LRS:-}" ]; then
                    name=${arm}_lr${run_lr}_seed$seed
                else
                    name=${arm}_seed$seed
                    save=(--save "$STUDY_TMP/ckpt_$name") saved+=("$name")
                fi
                # shellcheck disable=SC2086
                CUDA_VISIBLE_DEVICES=$((i % slots)) OMP_NUM_THREADS=2 pretrain --preset "$preset" \
                    ${flags[$arm]} "${lrflags[@]}" --seed "$seed" --train-iters "$iters" \
                    --data-path "$prefix" --tokenizer-model "$tok" --split 98,2,0 "${save[@]}" \
                    --depth-schedule "${SCHEDULE:-per_site}" \
                    --log-json "$OUT/study/$name.jsonl" >"$STUDY_TMP/$name.out" 2>&1 &
                pids+=($!) runs+=("$name") i=$((i + 1))
                while [ "$(jobs -rp | wc -l)" -ge $((${PER_GPU:-6} * slots)) ]; do sleep 2; done
            done
        done
    done
    for p in "${pids[@]}"; do wait "$p" || fail=$((fail + 1)); done
    log "training done, failed runs: $fail"
    if [ "$fail" -ne 0 ]; then
        status=1
        for name in "${runs[@]}"; do
            log "== last lines of $STUDY_TMP/$name.out"; tail -3 "$STUDY_TMP/$name.out" | tee -a "$OUT/log"
        done
    fi
    for arm in attnres lr_sliced lr_projected; do
        [ -d "$STUDY_TMP/ckpt_${arm}_seed1" ] && step "lrattn-analyze $arm (seed 1)" 300 \
            python3 -m megatron_lrattn.cli.analyze "$STUDY_TMP/ckpt_${arm}_seed1" \
            --out "$OUT/study/analyze_$arm" --num-batches 4 --no-progress
    done
    [ "${EVAL:-1}" != 0 ] && [ ${#saved[@]} -gt 0 ] && study_eval "$tok" "${saved[@]}"
    step "study report" 120 python3 tools/study_report.py "$OUT/study" --out "$OUT/study"
}

study_eval() {  # TOKENIZER NAME...: each saved run -> lrattn-convert-hf -> lrattn-eval
    # EVAL_JOBS runs at a time (default PER_GPU per GPU), each a pair of steps logged to its
    # own file (the steps' time limit EVAL_S, 300 s), appended to $OUT/log in order after all
    local tok=$1 dest=$OUT/study slots=$((NGPU > 0 ? NGPU : 1)) name n=0 rc d
    shift
    local names=() pids=() jobs=${EVAL_JOBS:-$((${PER_GPU:-6} * slots))}
    for name in "$@"; do
        if [ ! -d "$STUDY_TMP/ckpt_$name" ]; then
            log "== convert and evaluate $name: skipped, no checkpoint"
            status=1
            continue
        fi
        d=$STUDY_TMP/eval_$name
        mkdir -p "$d"
        (
            # step's log and status, for this run only; the exit code carries the status
            OUT=$d status=0
            export CUDA_VISIBLE_DEVICES=$((n % slots)) OMP_NUM_THREADS=2
            step "lrattn-convert-hf $name" "${EVAL_S:-300}" python3 -m \
                megatron_lrattn.cli.convert_hf "$STUDY_TMP/ckpt_$name" "$STUDY_TMP/hf_$name" \
                --tokenizer "$tok"
            [ "$status" -eq 0 ] && step "lrattn-eval $name" "${EVAL_S:-300}" python3 -m \
                megatron_lrattn.cli.eval "$STUDY_TMP/hf_$name" --output "$dest/${name}_eval.json" \
                --data-path "$prefix" --split 98,2,0 --split-part valid \
                --limit "${EVAL_LIMIT:-500}" --no-progress
            exit "$status"
        ) >/dev/null 2>&1 &
        names+=("$name") pids+=($!) n=$((n + 1))
        while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do sleep 1; done
    done
    for n in "${!pids[@]}"; do
        wait "${pids[$n]}"; rc=$?
        tee -a "$OUT/log" <"$STUDY_TMP/eval_${names[$n]}/log"
        [ "$rc" -eq 0 ] || status=1
    done
}

study_code_data() {  # sets tok and prefix: the box's own .py files, the embedded tokenizer
    tok=$(default_data)
    # the box's own .py files (standard library and site-packages): the largest real text there
    CORPUS_MB="${CORPUS_MB:-}" STUDY_TMP="$STUDY_TMP" python3 - <<'PY' 2>&1 | tee -a "$OUT/log"
import os
import sysconfig
from megatron_lrattn.data.corpus import write_stdlib_corpus
paths = sysconfig.get_paths()
cap = int(float(os.environ["CORPUS_MB"]) * 1e6) if os.environ.get("CORPUS_MB") else None
for name, root in (("stdlib", paths["stdlib"]), ("site", paths["purelib"])):
    s = write_stdlib_corpus(f"{os.environ['STUDY_TMP']}/{name}.jsonl", max_bytes=cap, root=root)
    print(f"corpus {name}: {root}: {s.documents} documents, {s.num_bytes / 1e6:.1f} MB")
PY
    step "lrattn-preprocess the study corpus" 600 python3 -m megatron_lrattn.cli.preprocess \
        --input "$STUDY_TMP/stdlib.jsonl" "$STUDY_TMP/site.jsonl" --output-prefix "$STUDY_TMP/pycode" \
        --tokenizer "$tok" --workers 24 --no-progress
    prefix=$(ls "$STUDY_TMP"/pycode*.bin | head -1); prefix=${prefix%.bin}
}

study_prose_data() {  # sets tok and prefix: PROSE_DIR from tools/build_prose_corpus.py
    local dir=${PROSE_DIR:-data/prose} want have
    if [ ! -f "$dir/prose.jsonl.gz" ] || [ ! -f "$dir/tokenizer/tokenizer.json" ] \
        || [ ! -f "$dir/manifest.json" ]; then
        log "study: $dir needs prose.jsonl.gz, tokenizer/ and manifest.json (tools/build_prose_corpus.py)"
        return 2
    fi
    want=$(python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['output']['gz_sha256'])" \
        "$dir/manifest.json")
    have=$(sha256sum "$dir/prose.jsonl.gz" | cut -d' ' -f1)
    [ "$want" = "$have" ] || { log "study: $dir/prose.jsonl.gz sha256 $have, manifest $want"; return 2; }
    log "corpus prose: $dir/prose.jsonl.gz, sha256 $have, $(du -h "$dir/prose.jsonl.gz" | cut -f1)"
    tok=$dir/tokenizer
    step "lrattn-preprocess the prose corpus" 600 python3 -m megatron_lrattn.cli.preprocess \
        --input "$dir/prose.jsonl.gz" --output-prefix "$STUDY_TMP/prose" --tokenizer "$tok" \
        --workers "${WORKERS:-14}" --no-progress
    prefix=$STUDY_TMP/prose_text_document
    [ -f "$prefix.bin" ] || { log "study: preprocessing wrote no $prefix.bin"; return 2; }
}

te_carry() {  # NN: keep piece NN of the TE core wheel in /tmp/te_chunks (outlives the call)
    local n=${1:?usage: run.sh te carry NN} dst=/tmp/te_chunks want have
    local src=.whl/te_chunks/$n sums=.whl/te_chunks/SHA256SUMS
    [ -f "$src" ] && [ -f "$sums" ] || { log "te carry: carry $src and $sums"; return 2; }
    want=$(awk -v f="chunks/$n" '$2 == f {print $1}' "$sums")
    have=$(sha256sum "$src" | cut -d' ' -f1)
    [ -n "$want" ] && [ "$want" = "$have" ] \
        || { log "te carry: $src: sha256 $have, manifest ${want:-none}"; return 1; }
    mkdir -p "$dst"
    cp "$src" "$dst/$n.part" && mv "$dst/$n.part" "$dst/$n" && cp "$sums" "$dst/SHA256SUMS"
    log "te carry: piece $n stored; $(cd "$dst" && ls | grep -cE '^[0-9]{2}$') of" \
        "$(grep -c ' chunks/' "$sums") pieces in $dst"
}

te_train() {  # [pretrain flags]: the TE tests, then PRESET for ITERS iterations per arm (ARMS)
    [ -f /tmp/te_env.sh ] || { log "te train: run 'run.sh te build' on this machine first"; return 2; }
    local runs=/tmp/te_runs arm files=()
    mkdir -p "$runs"
    default_data >/dev/null
    [ "${TE_TESTS:-1}" != 0 ] && step "TE tests" 300 pytest_ tests/test_te_spec.py
    # shellcheck disable=SC2206
    local common=(--preset "${PRESET:-1b}" --residual "${RESIDUAL:-lr_attnres}"
                  --micro-batch-size 4 --global-batch-size 8 --train-iters "${ITERS:-100}"
                  --lr-warmup-iters 10 --eval-interval "${ITERS:-100}" --eval-iters 2
                  --seed 1234 ${LR:+--lr "$LR"})
    declare -A arm_flags=(
        [local]="--transformer-impl local"
        [te_bf16]="--transformer-impl transformer_engine"
        [te_fp8_delayed]="--transformer-impl transformer_engine --fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 1024 --fp8-amax-compute-algo max"
        [te_fp8_tensorwise]="--transformer-impl transformer_engine --fp8-format hybrid --fp8-recipe tensorwise")
    for arm in ${ARMS:-local te_bf16 te_fp8_delayed te_fp8_tensorwise}; do
        rm -f "$runs/te_$arm.jsonl"
        # shellcheck disable=SC2086
        step "TE arm $arm: ${arm_flags[$arm]} $*" "${TRAIN_S:-300}" pretrain "${common[@]}" \
            ${arm_flags[$arm]} "$@" --log-json "$runs/te_$arm.jsonl"
        [ -f "$runs/te_$arm.jsonl" ] && cp "$runs/te_$arm.jsonl" "$OUT/"
    done
    # every arm run on this machine so far (arms split over calls share one table)
    for arm in local te_bf16 te_fp8_delayed te_fp8_tensorwise; do
        [ -f "$runs/te_$arm.jsonl" ] && files+=("$runs/te_$arm.jsonl")
    done
    [ ${#files[@]} -gt 0 ] && table "${files[@]}" --skip 10 --json "$OUT/te_train_summary.json"
}

suite_te() {  # carry NN | build | train [pretrain flags]
    case ${1:-} in
    carry) shift; te_carry "$@" || status=$? ;;
    build) step "TE build (tools/gpu_box/te_build.sh)" "${BUILD_S:-580}" bash "$HERE/te_build.sh"
           [ -f /tmp/te_env.sh ] && . /tmp/te_env.sh
           step "megatron-core sees TE" 60 python3 -c \
               "from megatron_lrattn.compat.te import require_te; require_te(); print('TE importable by megatron-core')" ;;
    train) shift; te_train "$@" ;;
    *) log "usage: run.sh te carry NN | te build | te train [pretrain flags]"; status=2 ;;
    esac
}

case $SUITE in
tests|kernels|block|profile|bench|train|parallel|study|te) ;;
*) echo "unknown suite '$SUITE' (tests kernels block profile train parallel study te)" >&2; exit 2 ;;
esac
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null \
        || echo "no GPU visible"
    python3 -W ignore - <<'PY'
import importlib.metadata as md
import sys
parts = ["python", sys.version.split()[0]]
for name in ("torch", "triton", "megatron-core", "transformer-engine"):
    try:
        parts += [name, md.version(name)]
    except md.PackageNotFoundError:
        parts += [name, "absent"]
try:
    import torch
    parts += ["cuda", str(torch.version.cuda)]
except ImportError:
    pass
print(" ".join(parts))
PY
    echo "git ${GIT_SHA:-unknown} date $(date -u +%FT%TZ) gpus $NGPU suite $SUITE $*"
} 2>&1 | tee -a "$OUT/log"
"suite_$SUITE" "$@" || { rc=$?; [ "$status" -eq 0 ] && status=$rc; }
log "== done $(date -u +%T), status $status"
exit "$status"
