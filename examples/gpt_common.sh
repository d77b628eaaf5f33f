# Shared settings for the GPT example scripts (sourced). Override any variable from the environment:
#   PRESET=345m|1.3b|2.7b|3.7b|tiny   DATA_PATH=<prefix of tools/preprocess_data.py output>
#   VOCAB_FILE, MERGE_FILE (GPT-2 BPE), CHECKPOINT_PATH, TENSORBOARD_DIR, TRAIN_ITERS, LR_DECAY_ITERS,
#   LOG_INTERVAL, SAVE_INTERVAL, EVAL_INTERVAL, ATTENTION_DROPOUT (0 by default with --context-parallel-size N)
# A run shorter than the preset's (TRAIN_ITERS=20, or --train-iters 20) decays over its own length and logs every
# quarter of it, unless LR_DECAY_ITERS / LOG_INTERVAL are set (common.sh: fit_run_length).
# Without a GPU (and PRESET unset) the tiny preset is used, with one line saying so; the distributed scripts then
# start CPU_PROCESSES (2) processes instead of 8.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
detect_gpu tiny "(4 layers, hidden 128, runs on this CPU); set PRESET=345m for the 345M model"
if [ "$HAS_GPU" = 0 ] && [ "$PRESET" != tiny ]; then
  echo "note: no GPU found: PRESET=$PRESET will run on the CPU (slowly, in fp32); PRESET=tiny trains in minutes" >&2
fi
: "${PRESET:=345m}"
load_preset "$EXAMPLES_DIR/presets/gpt_${PRESET}.sh" \
  "$(cd "$EXAMPLES_DIR/presets" && ls gpt_*.sh | sed 's/gpt_//;s/\.sh//' | tr '\n' ' ')"
: "${DATA_PATH:=my-gpt2_text_document}"
: "${VOCAB_FILE:=gpt2-vocab.json}"
: "${MERGE_FILE:=gpt2-merges.txt}"
: "${CHECKPOINT_PATH:=checkpoints/gpt_${PRESET}}"
: "${TENSORBOARD_DIR:=$CHECKPOINT_PATH/tensorboard}"
: "${TRAIN_ITERS:=500000}"
: "${LR_DECAY_ITERS:=320000}"  # 1% of it warms up
: "${LOG_INTERVAL:=100}"
fit_run_length "$@"  # a shorter run (TRAIN_ITERS=20): decay over it, a log line every quarter of it
: "${SAVE_INTERVAL:=10000}"
: "${EVAL_INTERVAL:=1000}"
require_inputs -f "set DATA_PATH (preprocessed prefix), VOCAB_FILE and MERGE_FILE (bash examples/quickstart.sh makes quickstart_out/data/python_docs_text_document and quickstart_out/tokenizer/{vocab.json,merges.txt})" \
  "$VOCAB_FILE" "$MERGE_FILE" "$DATA_PATH.bin" "$DATA_PATH.idx"

GPT_ARGS="$GPT_MODEL_ARGS \
  --micro-batch-size $MICRO_BATCH_SIZE --global-batch-size $GLOBAL_BATCH_SIZE \
  --train-iters $TRAIN_ITERS --lr-decay-iters $LR_DECAY_ITERS --lr-decay-style cosine \
  --lr $LR --min-lr $MIN_LR --lr-warmup-fraction .01 --weight-decay 1e-2 --clip-grad 1.0 \
  $(context_parallel_dropout "$@")"
DATA_ARGS="--data-path $DATA_PATH --vocab-file $VOCAB_FILE --merge-file $MERGE_FILE --split 949,50,1"
OUTPUT_ARGS="--log-interval $LOG_INTERVAL --save-interval $SAVE_INTERVAL --eval-interval $EVAL_INTERVAL --eval-iters 10 \
  --save $CHECKPOINT_PATH --load $CHECKPOINT_PATH --tensorboard-dir $TENSORBOARD_DIR"
# fp16 on GPUs; plain fp32 on CPU (gloo). Processes per node for the torchrun scripts: 8 GPUs, or 2 on a CPU.
if [ "$HAS_GPU" = 1 ]; then
  PRECISION_ARGS="${PRECISION_ARGS:---fp16}"
  DEFAULT_PROCESSES=8
else
  PRECISION_ARGS="${PRECISION_ARGS:-}"
  DEFAULT_PROCESSES=${CPU_PROCESSES:-2}
fi
