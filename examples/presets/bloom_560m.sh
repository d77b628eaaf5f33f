# BLOOM-560M (BigScience): 24 layers, hidden 1024, 16 heads, 4h tanh-GeLU MLP with biases, ALiBi (no position table),
# LayerNorm after the word embeddings, tied output layer, seq 2048. The BLOOM tokenizer's 250,680 tokens are padded
# to 250,880 rows, as BigScience's --pad-vocab-size-to 250880 did: --make-vocab-size-divisible-by 512 gives exactly
# that at TP 1 and 2. 559,214,592 parameters.
# Sourced by examples/pretrain_bloom.sh; sets BLOOM_MODEL_ARGS and defaults.
: "${SEQ_LENGTH:=2048}"
BLOOM_MODEL_ARGS="--num-layers 24 --hidden-size 1024 --num-attention-heads 16 \
  --seq-length $SEQ_LENGTH --max-position-embeddings $SEQ_LENGTH \
  --position-embedding-type alibi --embed-layernorm --make-vocab-size-divisible-by 512 \
  --hidden-dropout 0.0 --attention-dropout 0.0 --init-method-std 0.0048"
: "${MICRO_BATCH_SIZE:=1}"
: "${GLOBAL_BATCH_SIZE:=256}"
: "${LR:=3.0e-4}"
: "${MIN_LR:=1.0e-5}"
: "${LR_WARMUP_ITERS:=375}"
