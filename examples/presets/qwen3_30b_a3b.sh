# Qwen3-30B-A3B: 48 layers, hidden 2048, 32 query heads of 128 channels in 4 K/V groups, --qk-layernorm, every MLP
# a mixture of 128 SwiGLU experts (ffn 768), top-8 renormalised (HF norm_topk_prob), no shared expert, RMSNorm (eps
# 1e-6), RoPE base 1e6, untied output, 40,960 positions, 151,936-row vocabulary. 30.5B params (3.3B active per token).
# Sourced by examples/pretrain_qwen3.sh (PRESET=qwen3_30b_a3b).
: "${SEQ_LENGTH:=4096}"
LLAMA_MODEL_ARGS="--num-layers 48 --hidden-size 2048 --num-attention-heads 32 --kv-channels 128 --ffn-hidden-size 6144 \
  --group-query-attention --num-query-groups 4 --qk-layernorm --seq-length $SEQ_LENGTH --max-position-embeddings 40960 \
  --normalization RMSNorm --norm-epsilon 1e-6 --swiglu --position-embedding-type rope --rotary-base 1000000 \
  --untie-embeddings-and-output-weights --disable-bias-linear --hidden-dropout 0.0 --attention-dropout 0.0 \
  --num-experts 128 --moe-ffn-hidden-size 768 --moe-router-topk 8 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3 \
  --moe-grouped-gemm --moe-token-dispatcher-type alltoall"
: "${MICRO_BATCH_SIZE:=1}"
: "${GLOBAL_BATCH_SIZE:=256}"
: "${LR:=1.0e-4}"
: "${MIN_LR:=1.0e-5}"
: "${LR_WARMUP_ITERS:=500}"
