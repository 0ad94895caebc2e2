#!/usr/bin/env bash
# Depth-read kernels on the GPU box (one H200): GPU tests, then the benchmark, in one call.
#   bash tools/gpu_box/kernels.sh [bench args...]     (e.g. --sweep)
# Logs and the CSV land in $OUT; peers (fla-core, fast-attnres) are used when their wheels
# were carried in .whl/. GIT_SHA may be set by the caller (the box's copy has no .git).
set -euo pipefail
source "$(dirname "$0")/common.sh"
# the benchmark gates its own numbers on a correctness check, so it runs after red tests too
python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py 2>&1 | tee -a "$OUT/log" \
    || echo "KERNEL TESTS FAILED" | tee -a "$OUT/log"
python3 benchmarks/bench_depth_read.py --csv "$OUT/depth_read.csv" "$@" 2>&1 | tee "$OUT/bench.log"
