#!/usr/bin/env bash
# T5 pretraining with tensor (+ sequence) model parallelism and data parallelism via torchrun. The world size
# (GPUS_PER_NODE x NNODES) must be a multiple of TP; --decoder-seq-length a multiple of TP (sequence parallelism).
# Pipeline parallelism for T5 (--pipeline-model-parallel-split-rank) is not implemented yet: pretrain_t5.py refuses
# PP > 1 with one line.
set -euo pipefail
source "$(cd "$(dirname "$0")" && pwd)/t5_common.sh"
: "${GPUS_PER_NODE:=$DEFAULT_PROCESSES}"  # 8 with GPUs, 2 on a CPU-only machine
: "${NNODES:=1}"
: "${NODE_RANK:=0}"
: "${MASTER_ADDR:=localhost}"
: "${MASTER_PORT:=6000}"
: "${TP:=2}"

# shellcheck disable=SC2086
torchrun --nproc_per_node "$GPUS_PER_NODE" --nnodes "$NNODES" --node_rank "$NODE_RANK" \
  --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
  "$REPO_DIR/pretrain_t5.py" $T5_ARGS $DATA_ARGS $OUTPUT_ARGS $PRECISION_ARGS \
  --tensor-model-parallel-size "$TP" --sequence-parallel --DDP-impl local "$@"
