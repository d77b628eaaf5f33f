#!/usr/bin/env bash
# T5 pretraining with tensor (+ sequence) and pipeline model parallelism (and data parallelism over the rest) via
# torchrun. Pipeline stages follow Megatron 23.06's --pipeline-model-parallel-split-rank: stages 0..SPLIT_RANK-1 run
# the encoder, SPLIT_RANK..PP-1 the decoder (decoder stages pass the encoder output on); --encoder-num-layers must
# divide over SPLIT_RANK stages and --decoder-num-layers over PP - SPLIT_RANK. The world size (GPUS_PER_NODE x NNODES)
# must be a multiple of TP x PP; --decoder-seq-length a multiple of TP (sequence parallelism). Without a GPU the
# script starts TP x PP processes (4) on this CPU. Interleaved (virtual) pipeline stages are not supported for T5.
set -euo pipefail
source "$(cd "$(dirname "$0")" && pwd)/t5_common.sh"
: "${TP:=2}"
: "${PP:=2}"
: "${SPLIT_RANK:=$((PP / 2))}"
if [ "$HAS_GPU" = 1 ]; then : "${GPUS_PER_NODE:=$DEFAULT_PROCESSES}"; else : "${GPUS_PER_NODE:=$((TP * PP))}"; fi
: "${NNODES:=1}"
: "${NODE_RANK:=0}"
: "${MASTER_ADDR:=localhost}"

# shellcheck disable=SC2086
exec "${QUIET_TORCHRUN[@]}" --nproc_per_node "$GPUS_PER_NODE" --nnodes "$NNODES" --node_rank "$NODE_RANK" \
  --master_addr "$MASTER_ADDR" ${MASTER_PORT:+--master_port "$MASTER_PORT"} \
  "$REPO_DIR/pretrain_t5.py" $T5_ARGS $DATA_ARGS $OUTPUT_ARGS $PRECISION_ARGS \
  --tensor-model-parallel-size "$TP" --sequence-parallel \
  --pipeline-model-parallel-size "$PP" --pipeline-model-parallel-split-rank "$SPLIT_RANK" --DDP-impl local "$@"
