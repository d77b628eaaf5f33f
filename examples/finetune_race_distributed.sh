#!/usr/bin/env bash
# Finetune a pretrained BERT on RACE (Megatron's examples/finetune_race_distributed.sh settings: 3 epochs, lr 1e-5,
# 6% warmup, micro-batch 4 questions = 16 sequences, clip-grad 1.0; its removed --activations-checkpoint-method
# flag is left out). Accuracy lines for dev-middle / dev-high after every epoch.
#   RACE_DIR=data/RACE PRETRAINED_CHECKPOINT=checkpoints/bert_345m VOCAB_FILE=bert-vocab.txt \
#     bash examples/finetune_race_distributed.sh [extra tasks/main.py flags]
set -euo pipefail
source "$(cd "$(dirname "$0")" && pwd)/finetune_common.sh"
: "${RACE_DIR:=data/RACE}"
: "${TRAIN_DATA:=$RACE_DIR/train/middle $RACE_DIR/train/high}"
: "${VALID_DATA:=$RACE_DIR/dev/middle $RACE_DIR/dev/high}"
: "${CHECKPOINT_PATH:=checkpoints/bert_${PRESET}_race}"
: "${EPOCHS:=3}"
# shellcheck disable=SC2086
run_task --task RACE --train-data $TRAIN_DATA --valid-data $VALID_DATA $COMMON_ARGS --epochs "$EPOCHS" \
  --micro-batch-size 4 --lr 1.0e-5 --lr-decay-style linear --lr-warmup-fraction 0.06 --weight-decay 1.0e-1 \
  --clip-grad 1.0 --hidden-dropout 0.1 --attention-dropout 0.1 --save-interval 100000 --save "$CHECKPOINT_PATH" \
  --log-interval 10 --eval-interval 100 --eval-iters 50 $PRECISION_ARGS "$@"
