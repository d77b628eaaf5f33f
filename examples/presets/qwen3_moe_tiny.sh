# A tiny Qwen3-MoE-style model that trains on a CPU: 4 layers, hidden 128, 4 heads of 48 channels in 2 K/V groups,
# --qk-layernorm, 8 SwiGLU experts (ffn 64), top-2 renormalised (HF norm_topk_prob), no shared expert, load-balancing
# loss 1e-3, RoPE base 1e6, untied output, seq 256. Sourced by examples/pretrain_qwen3.sh (PRESET=qwen3_moe_tiny).
: "${SEQ_LENGTH:=256}"
LLAMA_MODEL_ARGS="--num-layers 4 --hidden-size 128 --num-attention-heads 4 --kv-channels 48 --ffn-hidden-size 384 \
  --group-query-attention --num-query-groups 2 --qk-layernorm --seq-length $SEQ_LENGTH --max-position-embeddings 256 \
  --normalization RMSNorm --norm-epsilon 1e-6 --swiglu --position-embedding-type rope --rotary-base 1000000 \
  --untie-embeddings-and-output-weights --disable-bias-linear --hidden-dropout 0.0 --attention-dropout 0.0 \
  --num-experts 8 --moe-ffn-hidden-size 64 --moe-router-topk 2 --moe-aux-loss-coeff 1e-3"
: "${MICRO_BATCH_SIZE:=4}"
: "${GLOBAL_BATCH_SIZE:=8}"
: "${LR:=6.0e-4}"
: "${MIN_LR:=6.0e-5}"
: "${LR_WARMUP_ITERS:=10}"
