# GPT-2 medium / Megatron "345M": 24 layers, hidden 1024, 16 heads, seq 1024 (354.9M params with a 50,304 vocab).
# Sourced by examples/pretrain_gpt*.sh and examples/slurm/pretrain_gpt.slurm; sets GPT_MODEL_ARGS and defaults.
GPT_MODEL_ARGS="--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --max-position-embeddings 1024"
: "${MICRO_BATCH_SIZE:=4}"
: "${GLOBAL_BATCH_SIZE:=8}"
: "${LR:=0.00015}"
: "${MIN_LR:=1.0e-5}"
