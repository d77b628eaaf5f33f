# GPT-3 "2.7B": 32 layers, hidden 2560, 32 heads, seq 2048 (2.65B params with a 50,304 vocab).
GPT_MODEL_ARGS="--num-layers 32 --hidden-size 2560 --num-attention-heads 32 --seq-length 2048 --max-position-embeddings 2048"
: "${MICRO_BATCH_SIZE:=1}"
: "${GLOBAL_BATCH_SIZE:=512}"
: "${LR:=0.00016}"
: "${MIN_LR:=1.6e-5}"
