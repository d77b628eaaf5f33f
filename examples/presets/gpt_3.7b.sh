# "3.7B": 32 layers, hidden 3072, 32 heads, seq 2048 (3.79B params with a 50,304 vocab; 36 layers would be 4.2B,
# 30 layers is Megatron-LM's 3.6B). Usually run with --tensor-model-parallel-size 2 or more.
GPT_MODEL_ARGS="--num-layers 32 --hidden-size 3072 --num-attention-heads 32 --seq-length 2048 --max-position-embeddings 2048"
: "${MICRO_BATCH_SIZE:=1}"
: "${GLOBAL_BATCH_SIZE:=512}"
: "${LR:=0.00012}"
: "${MIN_LR:=1.2e-5}"
