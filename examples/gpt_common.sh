# Shared settings for the GPT example scripts (sourced). Override any variable from the environment:
#   PRESET=345m|1.3b|2.7b|3.7b   DATA_PATH=<prefix of tools/preprocess_data.py output>
#   VOCAB_FILE, MERGE_FILE (GPT-2 BPE), CHECKPOINT_PATH, TENSORBOARD_DIR, TRAIN_ITERS
EXAMPLES_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_DIR="$(dirname "$EXAMPLES_DIR")"
: "${PRESET:=345m}"
PRESET_FILE="$EXAMPLES_DIR/presets/gpt_${PRESET}.sh"
if [ ! -f "$PRESET_FILE" ]; then
  echo "unknown PRESET=$PRESET: use one of $(ls "$EXAMPLES_DIR/presets" | sed 's/gpt_//;s/\.sh//' | tr '\n' ' ')" >&2
  exit 1
fi
# shellcheck source=/dev/null
source "$PRESET_FILE"
: "${DATA_PATH:=my-gpt2_text_document}"
: "${VOCAB_FILE:=gpt2-vocab.json}"
: "${MERGE_FILE:=gpt2-merges.txt}"
: "${CHECKPOINT_PATH:=checkpoints/gpt_${PRESET}}"
: "${TENSORBOARD_DIR:=$CHECKPOINT_PATH/tensorboard}"
: "${TRAIN_ITERS:=500000}"
for f in "$VOCAB_FILE" "$MERGE_FILE" "$DATA_PATH.bin" "$DATA_PATH.idx"; do
  if [ ! -f "$f" ]; then
    echo "missing $f: set DATA_PATH (preprocessed prefix), VOCAB_FILE and MERGE_FILE" >&2
    exit 1
  fi
done

GPT_ARGS="$GPT_MODEL_ARGS \
  --micro-batch-size $MICRO_BATCH_SIZE --global-batch-size $GLOBAL_BATCH_SIZE \
  --train-iters $TRAIN_ITERS --lr-decay-iters 320000 --lr-decay-style cosine \
  --lr $LR --min-lr $MIN_LR --lr-warmup-fraction .01 --weight-decay 1e-2 --clip-grad 1.0"
DATA_ARGS="--data-path $DATA_PATH --vocab-file $VOCAB_FILE --merge-file $MERGE_FILE --split 949,50,1"
OUTPUT_ARGS="--log-interval 100 --save-interval 10000 --eval-interval 1000 --eval-iters 10 \
  --save $CHECKPOINT_PATH --load $CHECKPOINT_PATH --tensorboard-dir $TENSORBOARD_DIR"
# fp16 on GPUs; plain fp32 on CPU (gloo).
if python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  PRECISION_ARGS="${PRECISION_ARGS:---fp16}"
else
  PRECISION_ARGS="${PRECISION_ARGS:-}"
fi
