#!/usr/bin/env bash
# GPT pretraining on one node under the DeepSpeed launcher, in the bigscience Megatron-DeepSpeed style:
# `deepspeed --num_gpus N pretrain_gpt.py ... --deepspeed --deepspeed_config ds_config.json --zero-stage 1
# --deepspeed-activation-checkpointing`, with TensorBoard logs and DeepSpeed checkpoints (global_step{N}/, latest).
#
# Runs as is on a CPU-only machine: the deepspeed launcher starts N_GPUS processes (gloo) and --fp16 is replaced by
# fp32 with a one-line notice (training needs CUDA for fp16). Takes a couple of minutes on 2 cores. The batch-size
# ramp (2 -> 16 over the first 56 samples) finishes within the 200 training samples. Output goes to
# runs/ds_single_node/ (ignored by git) unless OUT is set.
#
# Data: DATA_PATH (prefix of tools/preprocess_data.py output), VOCAB_FILE and MERGE_FILE when all are set; otherwise a
# 4,096-token BPE tokenizer and the dataset are built from examples/data/python_docs.jsonl into $OUT (as
# examples/quickstart.sh does), once.
# DeepSpeed config: DS_CONFIG=<json> uses that file (e.g. examples/ds_config_gpt.json, the same settings); otherwise
# $OUT/ds_config.json is written from the variables below. Batch sizes in the file must match the flags.
# Every upper-case variable can be set from the environment; extra arguments go to pretrain_gpt.py.
# DRY_RUN=1 prints the launcher command instead of running it.
# Afterwards: tools/convert_deepspeed_checkpoint.py --input-folder $OUT/checkpoints --output-folder <megatron dir>
# turns the DeepSpeed checkpoint into Megatron's layout for generation/evaluation.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${OUT:-runs/ds_single_node}

N_GPUS=${N_GPUS:-2}
MICRO_BATCH_SIZE=${MICRO_BATCH_SIZE:-1}
GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-16}
RAMPUP_BATCH_SIZE=${RAMPUP_BATCH_SIZE-2 2 56}     # start, increment, samples (< TRAIN_SAMPLES); "" disables
TP_SIZE=${TP_SIZE:-1}
PP_SIZE=${PP_SIZE:-1}
NLAYERS=${NLAYERS:-2}
NHIDDEN=${NHIDDEN:-64}
NHEADS=${NHEADS:-2}
SEQ_LEN=${SEQ_LEN:-1024}
TRAIN_SAMPLES=${TRAIN_SAMPLES:-200}
EVAL_ITERS=${EVAL_ITERS:-2}
SAVE_INTERVAL=${SAVE_INTERVAL:-100}
ZERO_STAGE=${ZERO_STAGE:-1}
PRECISION=${PRECISION---fp16}                     # --fp16 | --bf16 | "" (fp32)
MASTER_PORT=${MASTER_PORT:-29500}
CHECKPOINT_PATH=${CHECKPOINT_PATH:-$OUT/checkpoints}
TENSORBOARD_PATH=${TENSORBOARD_PATH:-$OUT/tensorboard}
DRY_RUN=${DRY_RUN:-0}

# ---------------------------------------------------------------------------------------------- data + tokenizer
if [ -z "${DATA_PATH:-}" ] || [ -z "${VOCAB_FILE:-}" ] || [ -z "${MERGE_FILE:-}" ]; then
  VOCAB_FILE="$OUT/tokenizer/vocab.json"
  MERGE_FILE="$OUT/tokenizer/merges.txt"
  DATA_PATH="$OUT/data/python_docs_text_document"
  if [ "$DRY_RUN" != 1 ] && { [ ! -f "$VOCAB_FILE" ] || [ ! -f "$DATA_PATH.idx" ]; }; then
    echo "== building a tokenizer and dataset from examples/data/python_docs.jsonl into $OUT"
    $PY tools/train_bpe_tokenizer.py --input examples/data/python_docs.jsonl --vocab-size 4096 \
      --output-dir "$OUT/tokenizer"
    mkdir -p "$OUT/data"
    $PY tools/preprocess_data.py --input examples/data/python_docs.jsonl --output-prefix "$OUT/data/python_docs" \
      --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE" --append-eod --workers 2
  fi
fi
if [ "$DRY_RUN" != 1 ]; then
  for f in "$VOCAB_FILE" "$MERGE_FILE" "$DATA_PATH.bin" "$DATA_PATH.idx"; do
    [ -f "$f" ] || { echo "missing $f: set DATA_PATH (preprocessed prefix), VOCAB_FILE and MERGE_FILE" >&2; exit 1; }
  done
fi

# ---------------------------------------------------------------------------------------------- DeepSpeed config
if [ -z "${DS_CONFIG:-}" ]; then
  DS_CONFIG="$OUT/ds_config.json"
  mkdir -p "$OUT"
  cat > "$DS_CONFIG" <<EOF
{
  "train_micro_batch_size_per_gpu": $MICRO_BATCH_SIZE,
  "train_batch_size": $GLOBAL_BATCH_SIZE,
  "gradient_clipping": 1.0,
  "zero_optimization": {
    "stage": $ZERO_STAGE
  },
  "fp16": {
    "enabled": $([ "$PRECISION" = "--fp16" ] && echo true || echo false),
    "loss_scale": 0,
    "loss_scale_window": 500,
    "hysteresis": 2,
    "min_loss_scale": 1,
    "initial_scale_power": 12
  },
  "bf16": {
    "enabled": $([ "$PRECISION" = "--bf16" ] && echo true || echo false)
  },
  "steps_per_print": 2000,
  "wall_clock_breakdown": false
}
EOF
fi

# ---------------------------------------------------------------------------------------------- launch
GPT_ARGS=(
  --tensor-model-parallel-size "$TP_SIZE" --pipeline-model-parallel-size "$PP_SIZE"
  --num-layers "$NLAYERS" --hidden-size "$NHIDDEN" --num-attention-heads "$NHEADS"
  --seq-length "$SEQ_LEN" --max-position-embeddings "$SEQ_LEN"
  --micro-batch-size "$MICRO_BATCH_SIZE" --global-batch-size "$GLOBAL_BATCH_SIZE" --train-samples "$TRAIN_SAMPLES"
  --optimizer adam --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --lr 1e-4 --lr-warmup-samples 5
  --clip-grad 1.0 --weight-decay 1e-1
  --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE" --data-path "$DATA_PATH"
  --checkpoint-activations
)
# shellcheck disable=SC2206
[ -n "$RAMPUP_BATCH_SIZE" ] && GPT_ARGS+=(--rampup-batch-size $RAMPUP_BATCH_SIZE)
[ -n "$PRECISION" ] && GPT_ARGS+=("$PRECISION")
OUTPUT_ARGS=(
  --log-interval 10 --save-interval "$SAVE_INTERVAL" --eval-interval 100 --eval-iters "$EVAL_ITERS"
  --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH"
  --tensorboard-dir "$TENSORBOARD_PATH" --tensorboard-queue-size 5 --log-timers-to-tensorboard
  --log-batch-size-to-tensorboard --log-validation-ppl-to-tensorboard
)
DEEPSPEED_ARGS=(
  --deepspeed --deepspeed_config "$DS_CONFIG" --zero-stage "$ZERO_STAGE" --deepspeed-activation-checkpointing
)
CMD=(deepspeed --num_gpus "$N_GPUS" --master_port "$MASTER_PORT" pretrain_gpt.py
     "${GPT_ARGS[@]}" "${OUTPUT_ARGS[@]}" "${DEEPSPEED_ARGS[@]}" "$@")
if [ "$DRY_RUN" = 1 ]; then
  printf '%q ' "${CMD[@]}"
  echo
  exit 0
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
echo "== ${CMD[*]}"
"${CMD[@]}"
