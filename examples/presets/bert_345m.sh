# BERT-345M (Megatron's BERT-Large shape): 24 layers, hidden 1024, 16 heads, seq 512, with the binary head.
# Sourced by examples/pretrain_bert*.sh and examples/slurm/pretrain_bert.slurm; sets BERT_MODEL_ARGS and defaults.
BERT_MODEL_ARGS="--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 512 --max-position-embeddings 512"
: "${MICRO_BATCH_SIZE:=4}"
: "${GLOBAL_BATCH_SIZE:=8}"
: "${LR:=0.0001}"
: "${MIN_LR:=0.00001}"
