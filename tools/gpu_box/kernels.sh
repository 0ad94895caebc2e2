#!/usr/bin/env bash
# Depth-read kernels on the GPU box (one H200): GPU tests, then the benchmark, in one call.
#   bash tools/gpu_box/kernels.sh [bench args...]     (e.g. --sweep)
# Logs and the CSV land in $OUT; peers (fla-core, fast-attnres) are used when their wheels
# were carried in .whl/. GIT_SHA may be set by the caller (the box's copy has no .git).
set -euo pipefail
OUT=${OUT:-/tmp/lrattn_out}
mkdir -p "$OUT" /tmp/lrattn_pk
ln -sfn "$PWD/kernels" /tmp/lrattn_pk/lrattn_kernels
export PYTHONPATH="$PWD:/tmp/lrattn_pk${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/lrattn_site .whl/*.whl
    export PYTHONPATH="$PYTHONPATH:/tmp/lrattn_site"
fi
set -o pipefail
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
    echo "git ${GIT_SHA:-unknown}"
} 2>&1 | tee "$OUT/log"
# the benchmark gates its own numbers on a correctness check, so it runs after red tests too
python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py 2>&1 | tee -a "$OUT/log" \
    || echo "KERNEL TESTS FAILED" | tee -a "$OUT/log"
python3 benchmarks/bench_depth_read.py --csv "$OUT/depth_read.csv" "$@" 2>&1 | tee "$OUT/bench.log"
