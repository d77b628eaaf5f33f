# A tiny Mixtral-style model that trains on a CPU: 4 layers, hidden 128, 4 heads with 2 K/V groups, 8 SwiGLU
# experts (ffn 256), top-2, load-balancing loss 1e-2 and z-loss 1e-3, RMSNorm, RoPE, untied output, seq 256.
# Sourced by examples/pretrain_mixtral.sh; sets LLAMA_MODEL_ARGS and defaults.
: "${SEQ_LENGTH:=256}"
LLAMA_MODEL_ARGS="--num-layers 4 --hidden-size 128 --num-attention-heads 4 --ffn-hidden-size 256 \
  --group-query-attention --num-query-groups 2 --seq-length $SEQ_LENGTH --max-position-embeddings 256 \
  --normalization RMSNorm --norm-epsilon 1e-5 --swiglu --position-embedding-type rope --rotary-base 10000 \
  --untie-embeddings-and-output-weights --disable-bias-linear --hidden-dropout 0.0 --attention-dropout 0.0 \
  --num-experts 8 --moe-router-topk 2 --moe-aux-loss-coeff 1e-2 --moe-z-loss-coeff 1e-3"
: "${MICRO_BATCH_SIZE:=4}"
: "${GLOBAL_BATCH_SIZE:=8}"
: "${LR:=6.0e-4}"
: "${MIN_LR:=6.0e-5}"
: "${LR_WARMUP_ITERS:=10}"
