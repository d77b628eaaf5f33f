#!/usr/bin/env bash
# Finetune a pretrained BERT on QQP (2 classes; MNLI's recipe with 3 epochs - Megatron ships no QQP script).
#   GLUE_DIR=data/glue_data PRETRAINED_CHECKPOINT=checkpoints/bert_345m VOCAB_FILE=bert-vocab.txt \
#     bash examples/finetune_qqp_distributed.sh [extra tasks/main.py flags]
set -euo pipefail
source "$(cd "$(dirname "$0")" && pwd)/finetune_common.sh"
: "${GLUE_DIR:=data/glue_data}"
: "${TRAIN_DATA:=$GLUE_DIR/QQP/train.tsv}"
: "${VALID_DATA:=$GLUE_DIR/QQP/dev.tsv}"
: "${CHECKPOINT_PATH:=checkpoints/bert_${PRESET}_qqp}"
: "${EPOCHS:=3}"
# shellcheck disable=SC2086
MICRO_BATCH=$(fit_micro_batch 8 $TRAIN_DATA)
# shellcheck disable=SC2086
run_task --task QQP --train-data $TRAIN_DATA --valid-data $VALID_DATA $COMMON_ARGS --epochs "$EPOCHS" \
  --micro-batch-size "$MICRO_BATCH" --lr 5.0e-5 --lr-decay-style linear --lr-warmup-fraction 0.065 --weight-decay 1.0e-1 \
  --save-interval 500000 --save "$CHECKPOINT_PATH" --log-interval 10 --eval-interval 100 --eval-iters 50 \
  $PRECISION_ARGS "$@"
