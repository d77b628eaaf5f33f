# A tiny BERT that trains in minutes on a CPU (the quick-start's BERT): 2 layers, hidden 128, 4 heads, seq 128.
# Picked by examples/bert_common.sh when no GPU is found and PRESET is not set.
BERT_MODEL_ARGS="--num-layers 2 --hidden-size 128 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128"
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
