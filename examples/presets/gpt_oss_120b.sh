# gpt-oss-120b: gpt-oss-20b's layers (hidden 2880, 64 heads of 64, 8 K/V groups, sinks, biases) x 36, 128 experts
# (ffn 2880, clamped quick-GeGLU), top-4. 116.8B params, 5.7B active per token (5.1B without the input embedding
# table: the model card's count) with its 201,088-token vocab; YaRN RoPE; the 128-token sliding window of every other layer. Sourced by
# examples/pretrain_gpt_oss.sh.
: "${SEQ_LENGTH:=4096}"
LLAMA_MODEL_ARGS="--num-layers 36 --hidden-size 2880 --num-attention-heads 64 --kv-channels 64 --ffn-hidden-size 2880 \
  --group-query-attention --num-query-groups 8 --seq-length $SEQ_LENGTH --max-position-embeddings 131072 \
  --normalization RMSNorm --norm-epsilon 1e-5 --position-embedding-type rope --rotary-base 150000 \
  --rope-type yarn --rotary-scaling-factor 32 --yarn-original-max-position-embeddings 4096 --no-yarn-correction-range-round-to-int --window-size 127,0 --window-attn-skip-freq 2 \
  --untie-embeddings-and-output-weights --hidden-dropout 0.0 --attention-dropout 0.0 \
  --softmax-type learnable --quick-geglu --glu-linear-offset 1.0 --activation-func-clamp-value 7.0 \
  --num-experts 128 --moe-router-topk 4 --moe-aux-loss-coeff 1e-3 --moe-token-dispatcher-type alltoall"
: "${MICRO_BATCH_SIZE:=1}"
: "${GLOBAL_BATCH_SIZE:=256}"
: "${LR:=1.0e-4}"
: "${MIN_LR:=1.0e-5}"
: "${LR_WARMUP_ITERS:=500}"
