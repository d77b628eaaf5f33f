#!/usr/bin/env bash
# Pretrain a Llama-family model (RMSNorm, SwiGLU, RoPE, GQA, untied output, no biases) with pretrain_gpt.py.
# One process by default; NPROC>1 starts torchrun with that many processes (TP/PP flags pass through). Examples:
#   PRESET=llama2_7b DATA_PATH=data/my-llama_text_document TOKENIZER_MODEL=tokenizer.model \
#     NPROC=8 bash examples/pretrain_llama.sh --tensor-model-parallel-size 2 --sequence-parallel
#   PRESET=llama_tiny ... bash examples/pretrain_llama.sh --train-iters 200     # CPU
# Presets: examples/presets/{llama2_7b,mistral_7b,llama_tiny}.sh. Data: tools/preprocess_data.py with
#   --tokenizer-type Llama2Tokenizer --tokenizer-model tokenizer.model --append-eod (documents become [bos] ... [eos]).
# Tokenizer: Llama2Tokenizer with TOKENIZER_MODEL (SentencePiece tokenizer.model), or TOKENIZER_TYPE=HuggingFaceTokenizer
#   with TOKENIZER_MODEL=<folder with tokenizer.json>.
# Other variables: CHECKPOINT_PATH, TENSORBOARD_DIR, TRAIN_ITERS, LR_DECAY_ITERS, LOG_INTERVAL, SAVE_INTERVAL,
#   EVAL_INTERVAL, PRECISION_ARGS (default --bf16 on GPUs, fp32 on the CPU), NPROC, MASTER_PORT.
set -euo pipefail
source "$(dirname "$0")/common.sh"
detect_gpu llama_tiny "(4 layers, hidden 128, runs on this CPU)"
: "${PRESET:=llama2_7b}"
PRESET_FILE="$EXAMPLES_DIR/presets/${PRESET}.sh"
case "$PRESET" in llama*|mistral*|mixtral*|qwen3*|deepseek*|gpt_oss*) ;; *) PRESET_FILE=/nonexistent ;; esac
load_preset "$PRESET_FILE" "$(cd "$EXAMPLES_DIR/presets" && ls llama*.sh mistral*.sh | sed 's/\.sh//' | tr '\n' ' ')"
: "${DATA_PATH:=my-llama_text_document}"
: "${TOKENIZER_TYPE:=Llama2Tokenizer}"
: "${TOKENIZER_MODEL:=tokenizer.model}"
: "${CHECKPOINT_PATH:=checkpoints/${PRESET}}"
: "${TENSORBOARD_DIR:=$CHECKPOINT_PATH/tensorboard}"
: "${TRAIN_ITERS:=500000}"
: "${LR_DECAY_ITERS:=$TRAIN_ITERS}"
: "${LOG_INTERVAL:=100}"
# The preset's warmup suits its full-length run; a shorter run (TRAIN_ITERS=20, or --train-iters 20) decays over its
# own length, warms up over its first tenth and logs every quarter of it (common.sh: fit_run_length).
fit_run_length "$@"
: "${SAVE_INTERVAL:=10000}"
: "${EVAL_INTERVAL:=1000}"
: "${NPROC:=1}"
require_inputs -e "set DATA_PATH (prefix written by tools/preprocess_data.py) and TOKENIZER_MODEL (tokenizer.model, or a tokenizer.json folder with TOKENIZER_TYPE=HuggingFaceTokenizer)" \
  "$TOKENIZER_MODEL" "$DATA_PATH.bin" "$DATA_PATH.idx"

TRAIN_ARGS="$LLAMA_MODEL_ARGS \
  --micro-batch-size $MICRO_BATCH_SIZE --global-batch-size $GLOBAL_BATCH_SIZE \
  --train-iters $TRAIN_ITERS --lr-decay-iters $LR_DECAY_ITERS --lr-decay-style cosine \
  --lr $LR --min-lr $MIN_LR --lr-warmup-iters $LR_WARMUP_ITERS \
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-5 --clip-grad 1.0 --init-method-std 0.02"
DATA_ARGS="--data-path $DATA_PATH --tokenizer-type $TOKENIZER_TYPE --tokenizer-model $TOKENIZER_MODEL --split 949,50,1"
OUTPUT_ARGS="--log-interval $LOG_INTERVAL --save-interval $SAVE_INTERVAL --eval-interval $EVAL_INTERVAL --eval-iters 10 \
  --save $CHECKPOINT_PATH --load $CHECKPOINT_PATH --tensorboard-dir $TENSORBOARD_DIR"
if [ "$HAS_GPU" = 1 ]; then
  PRECISION_ARGS="${PRECISION_ARGS:---bf16}"
else
  PRECISION_ARGS="${PRECISION_ARGS:-}"
fi

if [ "$NPROC" -gt 1 ]; then
  LAUNCH=("${QUIET_TORCHRUN[@]}" --nproc_per_node "$NPROC" ${MASTER_PORT:+--master_port "$MASTER_PORT"})
else
  LAUNCH=(python)
fi
# shellcheck disable=SC2086
"${LAUNCH[@]}" "$REPO_DIR/pretrain_gpt.py" $TRAIN_ARGS $DATA_ARGS $OUTPUT_ARGS $PRECISION_ARGS "$@"
