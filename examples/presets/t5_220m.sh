# T5-220M (Megatron's documented examples/pretrain_t5.sh shape): 12 encoder + 12 decoder layers, hidden 768,
# 12 heads, kv-channels 64, FFN 3072, encoder 512 / decoder 128 tokens, 100 sentinel ids.
# Sourced by examples/pretrain_t5*.sh; sets T5_MODEL_ARGS and defaults.
T5_MODEL_ARGS="--num-layers 12 --hidden-size 768 --num-attention-heads 12 --kv-channels 64 --ffn-hidden-size 3072 \
  --encoder-seq-length 512 --decoder-seq-length 128 --max-position-embeddings 512 --vocab-extra-ids 100"
: "${MICRO_BATCH_SIZE:=16}"
: "${GLOBAL_BATCH_SIZE:=16}"
: "${LR:=0.0001}"
: "${MIN_LR:=0.00001}"
