# gpt-oss-20b: 24 layers, hidden 2880, 64 heads of 64 with 8 K/V groups, attention sinks, linear biases, RMSNorm,
# RoPE (base 150000), untied output; every MLP is 32 experts (ffn 2880, clamped quick-GeGLU: limit 7, offset 1), top-4.
# 20.9B params, 4.2B active per token (3.6B without the input embedding table: the model card's count) with its
# 201,088-token vocab; YaRN RoPE (factor 32 over 4096, unrounded correction range); the 128-token
# sliding window of every other layer. Sourced by examples/pretrain_gpt_oss.sh.
: "${SEQ_LENGTH:=4096}"
LLAMA_MODEL_ARGS="--num-layers 24 --hidden-size 2880 --num-attention-heads 64 --kv-channels 64 --ffn-hidden-size 2880 \
  --group-query-attention --num-query-groups 8 --seq-length $SEQ_LENGTH --max-position-embeddings 131072 \
  --normalization RMSNorm --norm-epsilon 1e-5 --position-embedding-type rope --rotary-base 150000 \
  --rope-type yarn --rotary-scaling-factor 32 --yarn-original-max-position-embeddings 4096 --no-yarn-correction-range-round-to-int --window-size 127,0 --window-attn-skip-freq 2 \
  --untie-embeddings-and-output-weights --hidden-dropout 0.0 --attention-dropout 0.0 \
  --softmax-type learnable --quick-geglu --glu-linear-offset 1.0 --activation-func-clamp-value 7.0 \
  --num-experts 32 --moe-router-topk 4 --moe-aux-loss-coeff 1e-3 --moe-token-dispatcher-type alltoall"
: "${MICRO_BATCH_SIZE:=1}"
: "${GLOBAL_BATCH_SIZE:=256}"
: "${LR:=1.0e-4}"
: "${MIN_LR:=1.0e-5}"
: "${LR_WARMUP_ITERS:=500}"
