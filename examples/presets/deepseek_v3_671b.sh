# DeepSeek-V3 671B: 61 layers (the first 3 dense, ffn 18432), hidden 7168, 128 heads of multi-latent attention
# (q-lora 1536, kv-lora 512, head 128 + rope 64, value 128), YaRN x40 over 4096 positions, 256 SwiGLU experts (ffn 2048)
# in 8 groups, top-8 from 4 groups, sigmoid scores with the aux-loss-free expert bias (rate 1e-3), weights x 2.5, one
# shared expert, sequence aux loss 1e-4, one multi-token-prediction layer (loss x 0.1), RMSNorm (eps 1e-6), untied
# output. 671B params (37B active) with its 129,280-token vocab, the MTP layer besides. Sourced by examples/pretrain_deepseek.sh;
# sets LLAMA_MODEL_ARGS and defaults.
: "${SEQ_LENGTH:=4096}"
LLAMA_MODEL_ARGS="--num-layers 61 --hidden-size 7168 --num-attention-heads 128 --ffn-hidden-size 18432 \
  --seq-length $SEQ_LENGTH --max-position-embeddings 163840 \
  --multi-latent-attention --qk-layernorm --q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128 \
  --position-embedding-type rope --rope-type yarn --rotary-base 10000 --rotary-scaling-factor 40 --mscale 1.0 --mscale-all-dim 1.0 --yarn-original-max-position-embeddings 4096 \
  --normalization RMSNorm --norm-epsilon 1e-6 --swiglu --untie-embeddings-and-output-weights --disable-bias-linear --hidden-dropout 0.0 --attention-dropout 0.0 \
  --num-experts 256 --moe-layer-freq ([0]*3+[1]*58) --moe-ffn-hidden-size 2048 --moe-shared-expert-intermediate-size 2048 --moe-router-topk 8 \
  --moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-3 --moe-router-num-groups 8 --moe-router-group-topk 4 --moe-router-topk-scaling-factor 2.5 \
  --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-4 --moe-router-dtype fp32 \
  --mtp-num-layers 1 --mtp-loss-scaling-factor 0.1 \
  --moe-grouped-gemm --moe-token-dispatcher-type alltoall"
: "${MICRO_BATCH_SIZE:=1}"
: "${GLOBAL_BATCH_SIZE:=15360}"
: "${LR:=2.2e-4}"
: "${MIN_LR:=2.2e-5}"
: "${LR_WARMUP_ITERS:=2000}"
