# Tiny Llama-style model that trains on a CPU in minutes: 4 layers, hidden 128, 4 query heads in 2 KV groups (GQA),
# SwiGLU ffn 352, RMSNorm, RoPE, untied output layer, no linear biases, no dropout, seq 256.
# Sourced by examples/pretrain_llama.sh; sets LLAMA_MODEL_ARGS and defaults.
: "${SEQ_LENGTH:=256}"
LLAMA_MODEL_ARGS="--num-layers 4 --hidden-size 128 --num-attention-heads 4 --ffn-hidden-size 352 \
  --group-query-attention --num-query-groups 2 \
  --seq-length $SEQ_LENGTH --max-position-embeddings $SEQ_LENGTH \
  --normalization RMSNorm --norm-epsilon 1e-5 --swiglu --position-embedding-type rope --rotary-base 10000 \
  --untie-embeddings-and-output-weights --disable-bias-linear --hidden-dropout 0.0 --attention-dropout 0.0"
: "${MICRO_BATCH_SIZE:=8}"
: "${GLOBAL_BATCH_SIZE:=16}"
: "${LR:=1.0e-3}"
: "${MIN_LR:=1.0e-4}"
: "${LR_WARMUP_ITERS:=20}"
