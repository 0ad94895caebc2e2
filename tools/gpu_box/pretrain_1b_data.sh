#!/usr/bin/env bash
# The 1b preset on data made by lrattn-preprocess (the standard-library corpus as JSON
# lines, tokenized with the embedded BPE tokenizer), 50 iterations on one GPU; throughput
# and memory land in $OUT/pretrain_1b_data.jsonl and the log.
#   GIT_SHA=<sha> bash tools/gpu_box/pretrain_1b_data.sh      (carry .whl/: megatron-core wheel)
set -euo pipefail
source "$(dirname "$0")/common.sh"
mkdir -p /tmp/lrattn_data
tok=$(python3 -c "from megatron_lrattn.data.default_corpus import ensure_default_data as e; print(e().tokenizer_dir)")
python3 -c "from megatron_lrattn.data.corpus import write_stdlib_corpus as w; print(w('/tmp/lrattn_data/stdlib.jsonl'))"
python3 -m megatron_lrattn.cli.preprocess --input /tmp/lrattn_data/stdlib.jsonl \
    --output-prefix /tmp/lrattn_data/stdlib --tokenizer "$tok" --workers 8 --no-progress 2>&1 \
    | tail -3 | tee -a "$OUT/log"
prefix=$(ls /tmp/lrattn_data/stdlib*.bin | head -1); prefix=${prefix%.bin}
echo "== 1b preset, 50 iterations on $prefix" | tee -a "$OUT/log"
python3 -m megatron_lrattn.cli.pretrain --preset 1b --data-path "$prefix" --tokenizer-model "$tok" \
    --split 90,5,5 --micro-batch-size 4 --global-batch-size 8 --train-iters 50 \
    --lr-warmup-iters 5 --eval-interval 50 --eval-iters 2 --no-progress \
    --log-json "$OUT/pretrain_1b_data.jsonl" 2>&1 | grep -v -i warn | tail -4 | tee -a "$OUT/log"
python3 - "$OUT/pretrain_1b_data.jsonl" <<'PY' | tee -a "$OUT/log"
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
train = [r for r in rows if r["type"] == "train"][5:]
print(f"median step {statistics.median(r['step_time_s'] for r in train) * 1000:.1f} ms, "
      f"median tokens/s {statistics.median(r['tokens_per_s'] for r in train):,.0f}, "
      f"peak memory {max((r.get('peak_memory_gib') or 0) for r in rows):.1f} GiB")
PY
