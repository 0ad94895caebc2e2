#!/usr/bin/env bash
# Multi-node pretraining: run this on every node. The rendezvous comes from the environment:
#   MASTER_ADDR  host name or IP of node 0 (required)
#   MASTER_PORT  a free TCP port on node 0 (default 29500)
#   NNODES       number of nodes (required)
#   NODE_RANK    this node's index, 0..NNODES-1 (required)
#   NPROC_PER_NODE  GPUs per node (default 8)
# The parallel layout:
#   LAYOUT       auto (default): every node runs lrattn-plan on CONFIG for NNODES x
#                NPROC_PER_NODE GPUs and takes the recommended lrattn-pretrain flags (TP, PP,
#                VPP, CP, sequence parallelism, micro- and global batch, distributed
#                optimizer, overlap, activation recomputation); the planner is deterministic
#                and imports no torch, so every node gets the same flags. If no layout fits,
#                the script stops with the planner's reason. manual: no planner; only the
#                flags you pass set the layout.
#   PLAN_ARGS    extra lrattn-plan flags for LAYOUT=auto, e.g. "--gpu-memory-gib 80
#                --inter-node-gbps 200" (the cluster; defaults: H200, 400 Gbit/s per GPU) or
#                "--seq-length 8192" (model flags, repeated in the flags it recommends)
#   DRY_RUN=1    print the torchrun command and exit
#   PYTHON       the interpreter that runs lrattn-plan (default: python)
# Usage: examples/pretrain_multinode.sh CONFIG DATA_PREFIX TOKENIZER_DIR SAVE_DIR [flags...]
#   CONFIG: a preset file such as examples/presets/1b.yaml (or your edited copy); the
#   planner reads it as lrattn-pretrain does. Flags after SAVE_DIR come last, so they
#   override the planned ones (the planner does not see them: model or batch changes
#   belong in CONFIG or PLAN_ARGS).
# SAVE_DIR must be on a file system every node sees.
set -euo pipefail

if [[ $# -lt 4 ]]; then
    echo "usage: $0 CONFIG DATA_PREFIX TOKENIZER_DIR SAVE_DIR [lrattn-pretrain flags...]" >&2
    exit 2
fi
CONFIG=$1
DATA_PREFIX=$2
TOKENIZER_DIR=$3
SAVE_DIR=$4
shift 4
: "${MASTER_ADDR:?set MASTER_ADDR to the address of node 0}"
: "${NNODES:?set NNODES}"
: "${NODE_RANK:?set NODE_RANK}"
NPROC_PER_NODE=${NPROC_PER_NODE:-8}
LAYOUT=${LAYOUT:-auto}
PYTHON=${PYTHON:-python}

DISTRIBUTED_ARGS=(--nnodes "$NNODES" --node-rank "$NODE_RANK"
                  --nproc-per-node "$NPROC_PER_NODE"
                  --master-addr "$MASTER_ADDR" --master-port "${MASTER_PORT:-29500}")
MODEL_ARGS=(--config "$CONFIG" --bf16)
case "$LAYOUT" in
    auto)
        read -r -a PLAN_EXTRA <<< "${PLAN_ARGS:-}"
        PLAN_JSON=$("$PYTHON" -m megatron_lrattn.cli.plan --config "$CONFIG" \
            --nodes "$NNODES" --gpus-per-node "$NPROC_PER_NODE" ${PLAN_EXTRA[@]+"${PLAN_EXTRA[@]}"} \
            --json)
        # First line: the layout in words; then one lrattn-pretrain flag per line.
        PLAN=$(printf '%s' "$PLAN_JSON" | "$PYTHON" -c '
import json, sys
plan = json.load(sys.stdin)
if plan["recommended"] is None:
    sys.exit("lrattn-plan: " + plan["reason"])
print(plan["recommended"]["summary"])
print("\n".join(plan["recommended"]["flags"]))')
        LAYOUT_TEXT=$(head -n 1 <<< "$PLAN")
        mapfile -t PARALLEL_ARGS < <(tail -n +2 <<< "$PLAN")
        ;;
    manual)
        LAYOUT_TEXT="manual (the flags below)"
        PARALLEL_ARGS=()
        ;;
    *)
        echo "LAYOUT=$LAYOUT: use auto or manual" >&2
        exit 2
        ;;
esac
DATA_ARGS=(--data-path "$DATA_PREFIX" --tokenizer-model "$TOKENIZER_DIR" --split 989,10,1)
CHECKPOINT_ARGS=(--save "$SAVE_DIR" --save-interval 1000 --keep-last 3 --async-save)
if [[ -f "$SAVE_DIR/latest" ]]; then
    CHECKPOINT_ARGS+=(--load "$SAVE_DIR")
fi
LOGGING_ARGS=(--log-json "$SAVE_DIR/metrics.jsonl" --log-interval 10 --no-progress)

if [[ "$NODE_RANK" == 0 ]]; then
    # lrattn-pretrain logs the resolved arguments, git SHA and versions itself.
    echo "launch: $NNODES node(s) x $NPROC_PER_NODE GPUs, config $CONFIG, layout $LAYOUT:" \
         "$LAYOUT_TEXT" >&2
    LOGGED=(${PARALLEL_ARGS[@]+"${PARALLEL_ARGS[@]}"} "$@")
    echo "launch: flags ${LOGGED[*]:-none}" >&2
fi

COMMAND=(torchrun "${DISTRIBUTED_ARGS[@]}" -m megatron_lrattn.cli.pretrain
         "${MODEL_ARGS[@]}" ${PARALLEL_ARGS[@]+"${PARALLEL_ARGS[@]}"} "${DATA_ARGS[@]}"
         "${CHECKPOINT_ARGS[@]}" "${LOGGING_ARGS[@]}" "$@")
if [[ "${DRY_RUN:-0}" == 1 ]]; then
    printf '%q ' "${COMMAND[@]}"
    echo
    exit 0
fi
"${COMMAND[@]}"
