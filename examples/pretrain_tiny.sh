#!/usr/bin/env bash
# Tiny LR-AttnRes model on the embedded standard-library corpus (CPU or one GPU; no data
# needed). Usage: examples/pretrain_tiny.sh SAVE_DIR [more lrattn-pretrain flags...]
# NPROC_PER_NODE=2 runs two data-parallel processes (gloo on CPU).
set -euo pipefail

if [[ $# -lt 1 ]]; then
    echo "usage: $0 SAVE_DIR [lrattn-pretrain flags...]" >&2
    exit 2
fi
SAVE_DIR=$1
shift
HERE=$(cd "$(dirname "$0")" && pwd)

DISTRIBUTED_ARGS=(--standalone --nproc-per-node "${NPROC_PER_NODE:-1}")
MODEL_ARGS=(--config "$HERE/presets/tiny.yaml")
CHECKPOINT_ARGS=(--save "$SAVE_DIR" --save-interval 100 --keep-last 2)
if [[ -f "$SAVE_DIR/latest" ]]; then
    CHECKPOINT_ARGS+=(--load "$SAVE_DIR")
fi
LOGGING_ARGS=(--log-json "$SAVE_DIR/metrics.jsonl")

torchrun "${DISTRIBUTED_ARGS[@]}" -m megatron_lrattn.cli.pretrain \
    "${MODEL_ARGS[@]}" "${CHECKPOINT_ARGS[@]}" "${LOGGING_ARGS[@]}" "$@"
