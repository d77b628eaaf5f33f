#!/usr/bin/env bash
# Data-parallel BERT pretraining with torchrun on one or more nodes (GPUS_PER_NODE processes per node).
# Multi-node: set NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT on every node.
set -euo pipefail
source "$(cd "$(dirname "$0")" && pwd)/bert_common.sh"
: "${GPUS_PER_NODE:=$DEFAULT_PROCESSES}"  # 8 with GPUs, 2 on a CPU-only machine
: "${NNODES:=1}"
: "${NODE_RANK:=0}"
: "${MASTER_ADDR:=localhost}"

# shellcheck disable=SC2086
exec "${QUIET_TORCHRUN[@]}" --nproc_per_node "$GPUS_PER_NODE" --nnodes "$NNODES" --node_rank "$NODE_RANK" \
  --master_addr "$MASTER_ADDR" ${MASTER_PORT:+--master_port "$MASTER_PORT"} \
  "$REPO_DIR/pretrain_bert.py" $BERT_ARGS $DATA_ARGS $OUTPUT_ARGS $PRECISION_ARGS --DDP-impl local "$@"
