# DeepSeek-V2-Lite: 27 layers (the first dense, ffn 10944), hidden 2048, 16 heads of multi-latent attention without
# q-lora (kv-lora 512, head 128 + rope 64, value 128), YaRN x40 over 4096 positions (mscale 0.707), 64 SwiGLU experts
# (ffn 1408) with 2 shared, top-6 of the softmax over all experts (not renormalised), aux loss 1e-3, RMSNorm (eps
# 1e-6), untied output. 15.7B params (2.4B active) with its 102,400-token vocab. Sourced by examples/pretrain_deepseek.sh;
# sets LLAMA_MODEL_ARGS and defaults.
: "${SEQ_LENGTH:=4096}"
LLAMA_MODEL_ARGS="--num-layers 27 --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 10944 \
  --seq-length $SEQ_LENGTH --max-position-embeddings 163840 \
  --multi-latent-attention --qk-layernorm --kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128 \
  --position-embedding-type rope --rope-type yarn --rotary-base 10000 --rotary-scaling-factor 40 --mscale 0.707 --mscale-all-dim 0.707 --yarn-original-max-position-embeddings 4096 \
  --normalization RMSNorm --norm-epsilon 1e-6 --swiglu --untie-embeddings-and-output-weights --disable-bias-linear --hidden-dropout 0.0 --attention-dropout 0.0 \
  --num-experts 64 --moe-layer-freq ([0]+[1]*26) --moe-ffn-hidden-size 1408 --moe-shared-expert-intermediate-size 2816 --moe-router-topk 6 \
  --moe-router-pre-softmax --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3 --moe-router-dtype fp32 \
  --moe-grouped-gemm --moe-token-dispatcher-type alltoall"
: "${MICRO_BATCH_SIZE:=1}"
: "${GLOBAL_BATCH_SIZE:=256}"
: "${LR:=4.2e-4}"
: "${MIN_LR:=4.2e-5}"
: "${LR_WARMUP_ITERS:=2000}"
