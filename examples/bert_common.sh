# Shared settings for the BERT example scripts (sourced). Override any variable from the environment:
#   PRESET=345m|tiny   DATA_PATH=<prefix of tools/preprocess_data.py --split-sentences output, e.g. my-bert_text_sentence>
#   VOCAB_FILE (WordPiece vocab.txt), CHECKPOINT_PATH, TENSORBOARD_DIR, TRAIN_ITERS, LR_DECAY_ITERS,
#   LOG_INTERVAL, SAVE_INTERVAL, EVAL_INTERVAL
# Data: python tools/preprocess_data.py --input corpus.jsonl --output-prefix my-bert --vocab-file bert-vocab.txt \
#         --tokenizer-type BertWordPieceLowerCase --split-sentences --workers 8
# Without a GPU (and PRESET unset) the tiny preset is used, with one line saying so; the distributed scripts then
# start CPU_PROCESSES (2) processes instead of 8.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
detect_gpu tiny "(2 layers, hidden 128, runs on this CPU); set PRESET=345m for BERT-345M"
: "${PRESET:=345m}"
load_preset "$EXAMPLES_DIR/presets/bert_${PRESET}.sh" \
  "$(ls "$EXAMPLES_DIR/presets" | grep '^bert_' | sed 's/bert_//;s/\.sh//' | tr '\n' ' ')"
: "${DATA_PATH:=my-bert_text_sentence}"
: "${VOCAB_FILE:=bert-vocab.txt}"
: "${CHECKPOINT_PATH:=checkpoints/bert_${PRESET}}"
: "${TENSORBOARD_DIR:=$CHECKPOINT_PATH/tensorboard}"
: "${TRAIN_ITERS:=2000000}"
: "${LR_DECAY_ITERS:=990000}"  # 1% of it warms up
: "${LOG_INTERVAL:=100}"
fit_run_length "$@"  # a shorter run (TRAIN_ITERS=20): decay over it, a log line every quarter of it
: "${SAVE_INTERVAL:=10000}"
: "${EVAL_INTERVAL:=1000}"
require_inputs -f "set DATA_PATH (prefix of tools/preprocess_data.py --split-sentences output) and VOCAB_FILE (bash examples/quickstart.sh bert makes quickstart_out/bert_data/python_docs_text_sentence and quickstart_out/bert_tokenizer/vocab.txt)" \
  "$VOCAB_FILE" "$DATA_PATH.bin" "$DATA_PATH.idx"

# Megatron's examples/pretrain_bert.sh settings (linear decay, 1% warmup).
BERT_ARGS="$BERT_MODEL_ARGS \
  --micro-batch-size $MICRO_BATCH_SIZE --global-batch-size $GLOBAL_BATCH_SIZE \
  --train-iters $TRAIN_ITERS --lr-decay-iters $LR_DECAY_ITERS --lr-decay-style linear \
  --lr $LR --min-lr $MIN_LR --lr-warmup-fraction .01 --weight-decay 1e-2 --clip-grad 1.0"
DATA_ARGS="--data-path $DATA_PATH --vocab-file $VOCAB_FILE --tokenizer-type BertWordPieceLowerCase --split 949,50,1"
OUTPUT_ARGS="--log-interval $LOG_INTERVAL --save-interval $SAVE_INTERVAL --eval-interval $EVAL_INTERVAL --eval-iters 10 \
  --save $CHECKPOINT_PATH --load $CHECKPOINT_PATH --tensorboard-dir $TENSORBOARD_DIR"
if [ "$HAS_GPU" = 1 ]; then
  PRECISION_ARGS="${PRECISION_ARGS:---fp16}"
  DEFAULT_PROCESSES=8
else
  PRECISION_ARGS="${PRECISION_ARGS:-}"
  DEFAULT_PROCESSES=${CPU_PROCESSES:-2}
fi
