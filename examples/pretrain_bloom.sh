#!/usr/bin/env bash
# Pretrain a BLOOM-family model (ALiBi, --embed-layernorm, tanh GeLU, tied embeddings) with pretrain_gpt.py under
# DeepSpeed, in the style of BigScience's training scripts: the DeepSpeed config is written next to the checkpoints
# from the batch sizes (ZeRO stage ZERO_STAGE, default 0 as BigScience's BLOOM runs with the pipeline engine; 1 for
# ZeRO-1), gradient clipping 1.0, bf16 on GPUs. PP>1 uses the DeepSpeed pipeline engine (GPTModelPipe).
#   PRESET=bloom_560m DATA_PATH=data/my-bloom_text_document TOKENIZER_NAME_OR_PATH=bloom-tokenizer/ \
#     NPROC=8 TP=2 PP=2 bash examples/pretrain_bloom.sh
#   PRESET=bloom_tiny ... bash examples/pretrain_bloom.sh --train-iters 200       # CPU
# Tokenizer: --tokenizer-type PretrainedFromHF with TOKENIZER_NAME_OR_PATH = a local folder holding tokenizer.json
#   (BLOOM's tokenizer); data from tools/preprocess_data.py with the same tokenizer flags and --append-eod.
# Other variables: CHECKPOINT_PATH, TRAIN_ITERS, LR_DECAY_ITERS, LOG_INTERVAL, SAVE_INTERVAL, EVAL_INTERVAL,
#   PRECISION_ARGS, NPROC, TP, PP, MASTER_PORT, CHECKPOINT_ACTIVATIONS=1 (full recompute, DeepSpeed's
#   activation checkpointing), DRY_RUN=1 (print the command).
set -euo pipefail
source "$(dirname "$0")/common.sh"
detect_gpu bloom_tiny "(4 layers, hidden 96, runs on this CPU)"
: "${PRESET:=bloom_560m}"
PRESET_FILE="$EXAMPLES_DIR/presets/${PRESET}.sh"
case "$PRESET" in bloom*) ;; *) PRESET_FILE=/nonexistent ;; esac
load_preset "$PRESET_FILE" "$(cd "$EXAMPLES_DIR/presets" && ls bloom*.sh | sed 's/\.sh//' | tr '\n' ' ')"
: "${DATA_PATH:=my-bloom_text_document}"
: "${TOKENIZER_NAME_OR_PATH:=bloom-tokenizer}"
: "${CHECKPOINT_PATH:=checkpoints/${PRESET}}"
: "${TRAIN_ITERS:=500000}"
: "${LR_DECAY_ITERS:=$TRAIN_ITERS}"
: "${LOG_INTERVAL:=10}"
# A run shorter than the preset's warmup (TRAIN_ITERS=20, or --train-iters 20) decays over its own length, warms up
# over its first tenth and logs every quarter of it (common.sh: fit_run_length).
fit_run_length "$@"
: "${SAVE_INTERVAL:=1000}"
: "${EVAL_INTERVAL:=1000}"
: "${NPROC:=1}"
: "${TP:=1}"
: "${PP:=1}"
: "${ZERO_STAGE:=0}"
: "${CHECKPOINT_ACTIVATIONS:=0}"
: "${DRY_RUN:=0}"
if [ "$DRY_RUN" != 1 ]; then
  require_inputs -e "set DATA_PATH (prefix written by tools/preprocess_data.py) and TOKENIZER_NAME_OR_PATH (a folder with tokenizer.json)" \
    "$TOKENIZER_NAME_OR_PATH/tokenizer.json" "$DATA_PATH.bin" "$DATA_PATH.idx"
fi
if [ "$HAS_GPU" = 1 ]; then
  PRECISION_ARGS="${PRECISION_ARGS:---bf16}"
else
  PRECISION_ARGS="${PRECISION_ARGS:-}"
fi

GPT_ARGS="$BLOOM_MODEL_ARGS \
  --tensor-model-parallel-size $TP --pipeline-model-parallel-size $PP \
  --micro-batch-size $MICRO_BATCH_SIZE --global-batch-size $GLOBAL_BATCH_SIZE \
  --train-iters $TRAIN_ITERS --lr-decay-iters $LR_DECAY_ITERS --lr-decay-style cosine \
  --lr $LR --min-lr $MIN_LR --lr-warmup-iters $LR_WARMUP_ITERS \
  --optimizer adam --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --weight-decay 1e-1 --clip-grad 1.0 \
  --tokenizer-type PretrainedFromHF --tokenizer-name-or-path $TOKENIZER_NAME_OR_PATH"
OUTPUT_ARGS="--log-interval $LOG_INTERVAL --save-interval $SAVE_INTERVAL --eval-interval $EVAL_INTERVAL --eval-iters 10 \
  --save $CHECKPOINT_PATH --load $CHECKPOINT_PATH --data-path $DATA_PATH --split 949,50,1"

mkdir -p "$CHECKPOINT_PATH"
config_json="$CHECKPOINT_PATH/ds_config.json"
FP16=$([ "$PRECISION_ARGS" = "--fp16" ] && echo true || echo false)
BF16=$([ "$PRECISION_ARGS" = "--bf16" ] && echo true || echo false)
cat <<EOT > "$config_json"
{
  "train_micro_batch_size_per_gpu": $MICRO_BATCH_SIZE,
  "train_batch_size": $GLOBAL_BATCH_SIZE,
  "gradient_clipping": 1.0,
  "zero_optimization": {
    "stage": $ZERO_STAGE
  },
  "fp16": {
    "enabled": $FP16,
    "loss_scale": 0,
    "loss_scale_window": 500,
    "hysteresis": 2,
    "min_loss_scale": 1,
    "initial_scale_power": 12
  },
  "bf16": {
    "enabled": $BF16
  },
  "steps_per_print": 2000,
  "wall_clock_breakdown": false
}
EOT
DEEPSPEED_ARGS="--deepspeed --deepspeed_config $config_json --zero-stage $ZERO_STAGE"
if [ "$CHECKPOINT_ACTIVATIONS" = 1 ]; then
  DEEPSPEED_ARGS="$DEEPSPEED_ARGS --deepspeed-activation-checkpointing --checkpoint-activations"
fi

if [ "$NPROC" -gt 1 ]; then
  LAUNCH=("${QUIET_TORCHRUN[@]}" --nproc_per_node "$NPROC" ${MASTER_PORT:+--master_port "$MASTER_PORT"})
else
  LAUNCH=(python)
fi
# shellcheck disable=SC2206
CMD=("${LAUNCH[@]}" "$REPO_DIR/pretrain_gpt.py" $GPT_ARGS $OUTPUT_ARGS $PRECISION_ARGS $DEEPSPEED_ARGS "$@")
if [ "$DRY_RUN" = 1 ]; then
  printf '%q ' "${CMD[@]}"
  echo
  exit 0
fi
"${CMD[@]}"
