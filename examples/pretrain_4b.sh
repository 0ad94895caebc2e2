#!/usr/bin/env bash
# 4B LR-AttnRes model (L=32, d=3072, GQA 8, seq 4096): TP=2 x PP=2, DP=2 per node.
# One 8-GPU H100/H200 node; for several nodes use pretrain_multinode.sh or
# pretrain_slurm.sbatch with the same flags.
# Usage: examples/pretrain_4b.sh DATA_PREFIX TOKENIZER_DIR SAVE_DIR [more flags...]
#   DATA_PREFIX: the dataset lrattn-preprocess wrote, without .bin/.idx (Megatron's naming:
#   data/corpus_text_document for --output-prefix data/corpus), or pass a weighted blend
#   with --data-path after the positional arguments, which overrides it.
set -euo pipefail

if [[ $# -lt 3 ]]; then
    echo "usage: $0 DATA_PREFIX TOKENIZER_DIR SAVE_DIR [lrattn-pretrain flags...]" >&2
    exit 2
fi
DATA_PREFIX=$1
TOKENIZER_DIR=$2
SAVE_DIR=$3
shift 3
HERE=$(cd "$(dirname "$0")" && pwd)

DISTRIBUTED_ARGS=(--standalone --nproc-per-node "${NPROC_PER_NODE:-8}")
# Preset file (model shape and recipe), LR-AttnRes with sliced keys, r = d/4, N = 8.
MODEL_ARGS=(--config "$HERE/presets/4b.yaml" --residual lr_attnres --key sliced
            --rank 768 --num-blocks 8)
PARALLEL_ARGS=(--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
               --use-distributed-optimizer --bf16)
DATA_ARGS=(--data-path "$DATA_PREFIX" --tokenizer-model "$TOKENIZER_DIR" --split 989,10,1)
CHECKPOINT_ARGS=(--save "$SAVE_DIR" --save-interval 1000 --keep-last 3 --async-save)
LOGGING_ARGS=(--log-json "$SAVE_DIR/metrics.jsonl" --log-interval 10 --no-progress)

# Resume when the folder already holds a complete checkpoint.
if [[ -f "$SAVE_DIR/latest" ]]; then
    CHECKPOINT_ARGS+=(--load "$SAVE_DIR")
fi

torchrun "${DISTRIBUTED_ARGS[@]}" -m megatron_lrattn.cli.pretrain \
    "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" \
    "${CHECKPOINT_ARGS[@]}" "${LOGGING_ARGS[@]}" "$@"
