# A tiny T5 that trains in minutes on a CPU: 2 + 2 layers, hidden 128, 4 heads, encoder 128 / decoder 32 tokens.
# Picked by examples/t5_common.sh when no GPU is found and PRESET is not set.
T5_MODEL_ARGS="--num-layers 2 --hidden-size 128 --num-attention-heads 4 --kv-channels 32 --ffn-hidden-size 512 \
  --encoder-seq-length 128 --decoder-seq-length 32 --max-position-embeddings 128 --vocab-extra-ids 100"
: "${MICRO_BATCH_SIZE:=8}"
: "${GLOBAL_BATCH_SIZE:=16}"
: "${LR:=0.001}"
: "${MIN_LR:=0.0001}"
: "${TRAIN_ITERS:=200}"
: "${LR_DECAY_ITERS:=200}"
: "${LOG_INTERVAL:=20}"
: "${SAVE_INTERVAL:=100}"
: "${EVAL_INTERVAL:=100}"
: "${CPU_PROCESSES:=2}"
