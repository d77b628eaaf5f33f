# A tiny Qwen3-style model that trains on a CPU: 4 layers, hidden 128, 4 heads of 48 channels (--kv-channels != hidden/heads)
# in 2 K/V groups, per-head q/k RMSNorm (--qk-layernorm), SwiGLU ffn 384, RoPE base 1e6, untied output, no biases,
# seq 256. Sourced by examples/pretrain_qwen3.sh; sets LLAMA_MODEL_ARGS and defaults.
: "${SEQ_LENGTH:=256}"
LLAMA_MODEL_ARGS="--num-layers 4 --hidden-size 128 --num-attention-heads 4 --kv-channels 48 --ffn-hidden-size 384 \
  --group-query-attention --num-query-groups 2 --qk-layernorm --seq-length $SEQ_LENGTH --max-position-embeddings 256 \
  --normalization RMSNorm --norm-epsilon 1e-6 --swiglu --position-embedding-type rope --rotary-base 1000000 \
  --untie-embeddings-and-output-weights --disable-bias-linear --hidden-dropout 0.0 --attention-dropout 0.0"
: "${MICRO_BATCH_SIZE:=4}"
: "${GLOBAL_BATCH_SIZE:=8}"
: "${LR:=6.0e-4}"
: "${MIN_LR:=6.0e-5}"
: "${LR_WARMUP_ITERS:=10}"
