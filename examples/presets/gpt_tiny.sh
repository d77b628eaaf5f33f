# A tiny GPT that trains in minutes on a CPU (the quick-start's model): 4 layers, hidden 128, 4 heads, seq 128.
# Picked by examples/gpt_common.sh when no GPU is found and PRESET is not set.
GPT_MODEL_ARGS="--num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128"
: "${MICRO_BATCH_SIZE:=8}"
: "${GLOBAL_BATCH_SIZE:=16}"
: "${LR:=0.001}"
: "${MIN_LR:=0.0001}"
: "${TRAIN_ITERS:=300}"
: "${LR_DECAY_ITERS:=300}"
: "${LOG_INTERVAL:=25}"
: "${SAVE_INTERVAL:=150}"
: "${EVAL_INTERVAL:=100}"
: "${CPU_PROCESSES:=2}"
