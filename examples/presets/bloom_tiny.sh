# Tiny BLOOM-style model that trains on a CPU in minutes: 4 layers, hidden 96, 6 heads (ALiBi slopes of a head count
# that is not a power of two), --embed-layernorm, 4h tanh-GeLU MLP with biases, tied output layer, seq 256.
# Sourced by examples/pretrain_bloom.sh; sets BLOOM_MODEL_ARGS and defaults.
: "${SEQ_LENGTH:=256}"
BLOOM_MODEL_ARGS="--num-layers 4 --hidden-size 96 --num-attention-heads 6 \
  --seq-length $SEQ_LENGTH --max-position-embeddings $SEQ_LENGTH \
  --position-embedding-type alibi --embed-layernorm --hidden-dropout 0.0 --attention-dropout 0.0 \
  --init-method-std 0.02"
: "${MICRO_BATCH_SIZE:=4}"
: "${GLOBAL_BATCH_SIZE:=8}"
: "${LR:=1.0e-3}"
: "${MIN_LR:=1.0e-4}"
: "${LR_WARMUP_ITERS:=20}"
