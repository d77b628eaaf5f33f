# Llama-2 7B: 32 layers, hidden 4096, 32 heads (no GQA), SwiGLU ffn 11008, RMSNorm (eps 1e-5), RoPE (base 10000),
# untied output layer, no linear biases, no dropout, seq 4096, 32,000-piece SentencePiece vocab (Llama2Tokenizer).
# 6.74B params. Sourced by examples/pretrain_llama.sh; sets LLAMA_MODEL_ARGS and defaults (Llama-2 paper: AdamW
# beta2 0.95, eps 1e-5, weight decay 0.1, clip 1.0, cosine to 10% of the peak lr, 2,000 warm-up steps, 4M tokens/batch).
: "${SEQ_LENGTH:=4096}"
LLAMA_MODEL_ARGS="--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --ffn-hidden-size 11008 \
  --seq-length $SEQ_LENGTH --max-position-embeddings 4096 \
  --normalization RMSNorm --norm-epsilon 1e-5 --swiglu --position-embedding-type rope --rotary-base 10000 \
  --untie-embeddings-and-output-weights --disable-bias-linear --hidden-dropout 0.0 --attention-dropout 0.0"
: "${MICRO_BATCH_SIZE:=1}"
: "${GLOBAL_BATCH_SIZE:=1024}"
: "${LR:=3.0e-4}"
: "${MIN_LR:=3.0e-5}"
: "${LR_WARMUP_ITERS:=2000}"
