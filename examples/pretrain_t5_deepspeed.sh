#!/usr/bin/env bash
# T5 pretraining under the DeepSpeed launcher with ZeRO (stage ZERO_STAGE, default 1) and data parallelism
# (tensor parallelism via TP; PP stays 1: T5 pipelines with a split rank run without DeepSpeed, see
# pretrain_t5_distributed_with_mp.sh).
#   PRESET=220m DATA_PATH=... VOCAB_FILE=... ZERO_STAGE=2 bash examples/pretrain_t5_deepspeed.sh
# The DeepSpeed config is written to $CHECKPOINT_PATH/ds_config.json from the batch sizes and precision (the file's
# batch sizes must match the flags). DRY_RUN=1 prints the command instead of running it.
set -euo pipefail
source "$(cd "$(dirname "$0")" && pwd)/t5_common.sh"
: "${N_GPUS:=$DEFAULT_PROCESSES}"
: "${ZERO_STAGE:=1}"
: "${TP:=1}"
: "${MASTER_PORT:=29500}"
: "${DRY_RUN:=0}"
DS_CONFIG="$CHECKPOINT_PATH/ds_config.json"
mkdir -p "$CHECKPOINT_PATH"
FP16=$([ "$PRECISION_ARGS" = "--fp16" ] && echo true || echo false)
BF16=$([ "$PRECISION_ARGS" = "--bf16" ] && echo true || echo false)
cat > "$DS_CONFIG" <<JSON
{
  "train_micro_batch_size_per_gpu": $MICRO_BATCH_SIZE,
  "train_batch_size": $GLOBAL_BATCH_SIZE,
  "gradient_clipping": 1.0,
  "zero_optimization": {"stage": $ZERO_STAGE},
  "fp16": {"enabled": $FP16, "loss_scale": 0, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
  "bf16": {"enabled": $BF16},
  "steps_per_print": 2000,
  "wall_clock_breakdown": false
}
JSON
# shellcheck disable=SC2206
CMD=(deepspeed --num_gpus "$N_GPUS" --master_port "$MASTER_PORT" "$REPO_DIR/pretrain_t5.py"
     $T5_ARGS $DATA_ARGS $OUTPUT_ARGS $PRECISION_ARGS --tensor-model-parallel-size "$TP"
     --deepspeed --deepspeed_config "$DS_CONFIG" --zero-stage "$ZERO_STAGE" "$@")
if [ "$DRY_RUN" = 1 ]; then
  printf '%q ' "${CMD[@]}"
  echo
  exit 0
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
"${CMD[@]}"
