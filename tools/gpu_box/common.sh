# Set-up shared by the GPU-box scripts; source it from the repository root:
#   HEADER="words for the log header" source tools/gpu_box/common.sh
# Gives $OUT (created), the kernel package under its import name (lrattn_kernels), the wheels
# carried in .whl/ installed to /tmp/lrattn_site (NO_WHEEL=1 skips them, e.g. for a CPU smoke
# run), the environment (NVLink multicast stays off on these machines), $NGPU, log(), step()
# and a provenance header (GPU, driver, versions, git SHA, date) at the top of $OUT/log.
OUT=${OUT:-/tmp/lrattn_out}
mkdir -p "$OUT" /tmp/lrattn_pk
ln -sfn "$PWD/kernels" /tmp/lrattn_pk/lrattn_kernels
export PYTHONPATH="$PWD:/tmp/lrattn_pk${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export LRATTN_CACHE=${LRATTN_CACHE:-/tmp/lrattn_cache}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -z "${NO_WHEEL:-}" ] && compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/lrattn_site .whl/*.whl || { echo "installing .whl/*.whl failed" >&2; exit 1; }
    export PYTHONPATH="$PYTHONPATH:/tmp/lrattn_site"
fi
NGPU=$( (nvidia-smi -L 2>/dev/null || true) | wc -l)
log() { echo "$@" | tee -a "$OUT/log"; }
# step NAME SECONDS CMD...: run CMD with a time limit, its output logged to $OUT/log, and a
# failure or timeout remembered in $status (the caller sets status=0 first and exits with
# it); DROP_WARNINGS=1 leaves lines naming warnings out of the log
step() {
    local name=$1 limit=$2
    shift 2
    echo "== $name ($(date -u +%T), limit ${limit}s)" | tee -a "$OUT/log"
    if ! timeout "$limit" "$@" 2>&1 | _step_filter | tee -a "$OUT/log"; then
        echo "== $name FAILED or timed out" | tee -a "$OUT/log"
        status=1
    fi
}
_step_filter() { if [ -n "${DROP_WARNINGS:-}" ]; then grep -v -i "warn" || true; else cat; fi; }
# two_phase_gpu_tests: the GPU-only tests of the two-phase ops (large bf16 shapes, the fused
# norm included) and the bf16 Float16Module + DDP model tests on the fused kernels
two_phase_gpu_tests() {
    step "GPU tests: two-phase ops at large bf16 shapes" 120 \
        python3 -m pytest -q -p no:cacheprovider tests/test_two_phase_ops.py -k "large_bf16 or gpu"
    step "bf16 DDP model tests on the fused kernels (two-phase vs per-site)" 120 \
        python3 -m pytest -q -p no:cacheprovider tests/test_two_phase_model.py -k gpu
}
# median_step FILE: median step time of a metrics file (iterations 5..) and its losses
median_step() {
    python3 - "$1" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
t = [r["step_time_s"] for r in rows if r["type"] == "train"][4:]
loss = [r["loss"] for r in rows if r["type"] == "train"]
v = [r["loss"] for r in rows if r["type"] == "valid"]
shown = " ".join(f"{x:.4f}" for x in loss) if len(loss) <= 12 else (
    " ".join(f"{x:.4f}" for x in loss[:3]) + " ... " + " ".join(f"{x:.4f}" for x in loss[-3:]))
print(f"median step {statistics.median(t) * 1000:.1f} ms over {len(t)} steps; train loss "
      f"{shown}; validation {' -> '.join(f'{x:.4f}' for x in v)}")
PY
}
# train_1b ITERS LIMIT ARM...: the 1b preset (micro-batch 4, global batch 8, sequence 2048)
# for ITERS iterations per arm, each a step with LIMIT seconds; an arm is
# "residual:schedule[:extra flag]"; metrics in $OUT/1b_<arm>.jsonl, median step in the log
train_1b() {
    local iters=$1 limit=$2 arm res rest sched extra tag
    shift 2
    for arm in "$@"; do
        res=${arm%%:*} rest=${arm#*:}
        sched=${rest%%:*} extra=""
        [ "$rest" != "$sched" ] && extra=${rest#*:}
        tag=${res}_${sched}${extra//-/_}
        step "1b preset, $res, $sched ${extra} (mbs 4, gbs 8, seq 2048, $iters iters)" "$limit" \
            python3 -m megatron_lrattn.cli.pretrain --no-progress --preset 1b --residual "$res" \
            --depth-schedule "$sched" $extra --micro-batch-size 4 --global-batch-size 8 \
            --train-iters "$iters" --lr-warmup-iters 2 --eval-interval "$iters" --eval-iters 1 \
            --log-json "$OUT/1b_$tag.jsonl"
        median_step "$OUT/1b_$tag.jsonl" | tee -a "$OUT/log"
    done
}
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null \
        || echo "no GPU visible"
    python3 -W ignore - <<'PY'
import torch
parts = ["torch", torch.__version__]
for name, mod in (("triton", "triton"), ("megatron-core", "megatron.core")):
    try:
        parts += [name, __import__(mod, fromlist=["__version__"]).__version__]
    except ImportError:
        parts += [name, "absent"]
print(" ".join(parts))
PY
    echo "git ${GIT_SHA:-unknown} date $(date -u +%FT%TZ) gpus $NGPU ${HEADER:-}"
} 2>&1 | tee -a "$OUT/log"
