# A tiny GPT-OSS-style model that trains on a CPU: 4 layers, hidden 128, 4 heads with 2 K/V groups, attention sinks,
# linear biases everywhere, 8 experts (ffn 128) with the clamped quick-GeGLU, top-2, RMSNorm, RoPE, untied output, seq 256.
# Sourced by examples/pretrain_gpt_oss.sh; sets LLAMA_MODEL_ARGS and defaults.
: "${SEQ_LENGTH:=256}"
LLAMA_MODEL_ARGS="--num-layers 4 --hidden-size 128 --num-attention-heads 4 --kv-channels 32 --ffn-hidden-size 128 \
  --group-query-attention --num-query-groups 2 --seq-length $SEQ_LENGTH --max-position-embeddings 256 \
  --normalization RMSNorm --norm-epsilon 1e-5 --position-embedding-type rope --rotary-base 150000 \
  --untie-embeddings-and-output-weights --hidden-dropout 0.0 --attention-dropout 0.0 \
  --softmax-type learnable --quick-geglu --glu-linear-offset 1.0 --activation-func-clamp-value 7.0 \
  --num-experts 8 --moe-router-topk 2 --moe-aux-loss-coeff 1e-3"
: "${MICRO_BATCH_SIZE:=4}"
: "${GLOBAL_BATCH_SIZE:=8}"
: "${LR:=6.0e-4}"
: "${MIN_LR:=6.0e-5}"
: "${LR_WARMUP_ITERS:=10}"
