#!/usr/bin/env bash
# Finetune a pretrained BERT on MNLI (Megatron's examples/finetune_mnli_distributed.sh settings: 5 epochs, lr 5e-5,
# linear decay, 6.5% warmup, micro-batch 8). Accuracy lines for dev-matched / dev-mismatched after every epoch.
#   GLUE_DIR=data/glue_data PRETRAINED_CHECKPOINT=checkpoints/bert_345m VOCAB_FILE=bert-vocab.txt \
#     bash examples/finetune_mnli_distributed.sh [extra tasks/main.py flags]
set -euo pipefail
source "$(cd "$(dirname "$0")" && pwd)/finetune_common.sh"
: "${GLUE_DIR:=data/glue_data}"
: "${TRAIN_DATA:=$GLUE_DIR/MNLI/train.tsv}"
: "${VALID_DATA:=$GLUE_DIR/MNLI/dev_matched.tsv $GLUE_DIR/MNLI/dev_mismatched.tsv}"
: "${CHECKPOINT_PATH:=checkpoints/bert_${PRESET}_mnli}"
: "${EPOCHS:=5}"
# shellcheck disable=SC2086
MICRO_BATCH=$(fit_micro_batch 8 $TRAIN_DATA)
# shellcheck disable=SC2086
run_task --task MNLI --train-data $TRAIN_DATA --valid-data $VALID_DATA $COMMON_ARGS --epochs "$EPOCHS" \
  --micro-batch-size "$MICRO_BATCH" --lr 5.0e-5 --lr-decay-style linear --lr-warmup-fraction 0.065 --weight-decay 1.0e-1 \
  --save-interval 500000 --save "$CHECKPOINT_PATH" --log-interval 10 --eval-interval 100 --eval-iters 50 \
  $PRECISION_ARGS "$@"
