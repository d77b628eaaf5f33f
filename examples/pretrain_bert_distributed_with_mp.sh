#!/usr/bin/env bash
# BERT pretraining with tensor (+ sequence) and pipeline model parallelism and data parallelism via torchrun.
# The world size (GPUS_PER_NODE x NNODES) must be a multiple of TP x PP; --num-layers a multiple of PP.
set -euo pipefail
source "$(cd "$(dirname "$0")" && pwd)/bert_common.sh"
: "${GPUS_PER_NODE:=$DEFAULT_PROCESSES}"  # 8 with GPUs, 2 on a CPU-only machine
: "${NNODES:=1}"
: "${NODE_RANK:=0}"
: "${MASTER_ADDR:=localhost}"
: "${TP:=2}"
: "${PP:=1}"

# shellcheck disable=SC2086
exec "${QUIET_TORCHRUN[@]}" --nproc_per_node "$GPUS_PER_NODE" --nnodes "$NNODES" --node_rank "$NODE_RANK" \
  --master_addr "$MASTER_ADDR" ${MASTER_PORT:+--master_port "$MASTER_PORT"} \
  "$REPO_DIR/pretrain_bert.py" $BERT_ARGS $DATA_ARGS $OUTPUT_ARGS $PRECISION_ARGS \
  --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" --sequence-parallel \
  --DDP-impl local "$@"
