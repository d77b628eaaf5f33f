# Mistral 7B (v0.2/v0.3 layout): 32 layers, hidden 4096, 32 query heads in 8 KV groups (GQA), SwiGLU ffn 14336,
# RMSNorm (eps 1e-5), RoPE base 1e6, untied output layer, no linear biases, no dropout, 32k context (no sliding
# window). 7.24B params with Mistral's 32,768-piece SentencePiece vocab (Llama2Tokenizer). Sourced by
# examples/pretrain_llama.sh; sets LLAMA_MODEL_ARGS and defaults. SEQ_LENGTH=4096 trains on shorter sequences.
: "${SEQ_LENGTH:=32768}"
LLAMA_MODEL_ARGS="--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --ffn-hidden-size 14336 \
  --group-query-attention --num-query-groups 8 \
  --seq-length $SEQ_LENGTH --max-position-embeddings 32768 \
  --normalization RMSNorm --norm-epsilon 1e-5 --swiglu --position-embedding-type rope --rotary-base 1000000 \
  --untie-embeddings-and-output-weights --disable-bias-linear --hidden-dropout 0.0 --attention-dropout 0.0"
: "${MICRO_BATCH_SIZE:=1}"
: "${GLOBAL_BATCH_SIZE:=128}"
: "${LR:=3.0e-4}"
: "${MIN_LR:=3.0e-5}"
: "${LR_WARMUP_ITERS:=2000}"
