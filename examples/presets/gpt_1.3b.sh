# GPT-3 XL class "1.3B": 24 layers, hidden 2048, 16 heads, seq 2048 (1.32B params with a 50,304 vocab).
GPT_MODEL_ARGS="--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048"
: "${MICRO_BATCH_SIZE:=2}"
: "${GLOBAL_BATCH_SIZE:=512}"
: "${LR:=0.0002}"
: "${MIN_LR:=2.0e-5}"
