# A tiny DeepSeek-V3-style model that trains on a CPU: 4 layers (the first dense), hidden 128, 4 heads of multi-latent
# attention (q-lora 64, kv-lora 32, head 32 + rope 16, value 32, YaRN x4 over 64 positions), 8 SwiGLU experts (ffn 64)
# in 4 groups, top-2 from 2 groups, sigmoid scores with the aux-loss-free expert bias, weights x 2.5, one shared
# expert, one multi-token-prediction layer, RMSNorm, untied output, seq 256. Sourced by examples/pretrain_deepseek.sh;
# sets LLAMA_MODEL_ARGS and defaults.
: "${SEQ_LENGTH:=256}"
LLAMA_MODEL_ARGS="--num-layers 4 --hidden-size 128 --num-attention-heads 4 --ffn-hidden-size 256 \
  --seq-length $SEQ_LENGTH --max-position-embeddings 256 \
  --multi-latent-attention --qk-layernorm --q-lora-rank 64 --kv-lora-rank 32 --qk-head-dim 32 --qk-pos-emb-head-dim 16 --v-head-dim 32 \
  --position-embedding-type rope --rope-type yarn --rotary-base 10000 --rotary-scaling-factor 4 --mscale 1.0 --mscale-all-dim 1.0 --yarn-original-max-position-embeddings 64 \
  --normalization RMSNorm --norm-epsilon 1e-6 --swiglu --untie-embeddings-and-output-weights --disable-bias-linear --hidden-dropout 0.0 --attention-dropout 0.0 \
  --num-experts 8 --moe-layer-freq ([0]+[1]*3) --moe-ffn-hidden-size 64 --moe-shared-expert-intermediate-size 64 --moe-router-topk 2 \
  --moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-num-groups 4 --moe-router-group-topk 2 --moe-router-topk-scaling-factor 2.5 \
  --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-4 --moe-router-dtype fp32 \
  --mtp-num-layers 1 --mtp-loss-scaling-factor 0.1"
: "${MICRO_BATCH_SIZE:=4}"
: "${GLOBAL_BATCH_SIZE:=8}"
: "${LR:=6.0e-4}"
: "${MIN_LR:=6.0e-5}"
: "${LR_WARMUP_ITERS:=10}"
