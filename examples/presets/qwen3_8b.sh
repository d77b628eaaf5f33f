# Qwen3-8B: 36 layers, hidden 4096, 32 query heads of 128 channels in 8 K/V groups, per-head q/k RMSNorm
# (--qk-layernorm), SwiGLU ffn 12288, RMSNorm (eps 1e-6), RoPE base 1e6, untied output layer, no biases, 40,960
# positions, Qwen's 151,936-row vocabulary (HuggingFaceTokenizer Qwen/Qwen3-8B). 8.19B params. Sourced by
# examples/pretrain_qwen3.sh; sets LLAMA_MODEL_ARGS and defaults.
: "${SEQ_LENGTH:=4096}"
LLAMA_MODEL_ARGS="--num-layers 36 --hidden-size 4096 --num-attention-heads 32 --kv-channels 128 --ffn-hidden-size 12288 \
  --group-query-attention --num-query-groups 8 --qk-layernorm --seq-length $SEQ_LENGTH --max-position-embeddings 40960 \
  --normalization RMSNorm --norm-epsilon 1e-6 --swiglu --position-embedding-type rope --rotary-base 1000000 \
  --untie-embeddings-and-output-weights --disable-bias-linear --hidden-dropout 0.0 --attention-dropout 0.0"
: "${MICRO_BATCH_SIZE:=1}"
: "${GLOBAL_BATCH_SIZE:=256}"
: "${LR:=3.0e-4}"
: "${MIN_LR:=3.0e-5}"
: "${LR_WARMUP_ITERS:=2000}"
