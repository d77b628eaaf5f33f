# Mixtral 8x7B: 32 layers, hidden 4096, 32 heads with 8 K/V groups, RMSNorm (eps 1e-5), RoPE (base 1e6), untied
# output layer, no linear biases, no dropout; every MLP is a mixture of 8 SwiGLU experts (ffn 14336), top-2 routing
# (top-k over the logits then softmax), load-balancing loss 1e-2 (Megatron-LM's Mixtral recipe). 46.7B params
# (12.9B active per token) with the 32,000-piece SentencePiece vocab. Sourced by examples/pretrain_mixtral.sh;
# sets LLAMA_MODEL_ARGS and defaults.
: "${SEQ_LENGTH:=4096}"
LLAMA_MODEL_ARGS="--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --ffn-hidden-size 14336 \
  --group-query-attention --num-query-groups 8 --seq-length $SEQ_LENGTH --max-position-embeddings 32768 \
  --normalization RMSNorm --norm-epsilon 1e-5 --swiglu --position-embedding-type rope --rotary-base 1000000 \
  --untie-embeddings-and-output-weights --disable-bias-linear --hidden-dropout 0.0 --attention-dropout 0.0 \
  --num-experts 8 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2 \
  --moe-grouped-gemm --moe-token-dispatcher-type alltoall"
: "${MICRO_BATCH_SIZE:=1}"
: "${GLOBAL_BATCH_SIZE:=256}"
: "${LR:=1.0e-4}"
: "${MIN_LR:=1.0e-5}"
: "${LR_WARMUP_ITERS:=500}"
