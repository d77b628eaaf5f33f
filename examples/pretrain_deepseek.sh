#!/usr/bin/env bash
# Pretrain a DeepSeek-V3-style model (multi-latent attention with YaRN, first-k dense layers, sigmoid group-limited
# routing with the aux-loss-free expert bias, shared experts, multi-token prediction) with pretrain_gpt.py:
# examples/pretrain_llama.sh with a DeepSeek preset. Examples:
#   PRESET=deepseek_v3_671b DATA_PATH=data/my-ds_text_document TOKENIZER_TYPE=HuggingFaceTokenizer \
#     TOKENIZER_MODEL=deepseek-v3-tokenizer/ NPROC=8 bash examples/pretrain_deepseek.sh \
#     --tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 4
#   PRESET=deepseek_v3_tiny ... bash examples/pretrain_deepseek.sh --train-iters 200     # CPU
# Presets: examples/presets/{deepseek_v3_671b,deepseek_v2_lite,deepseek_v3_tiny}.sh; the other variables are those
# of pretrain_llama.sh. The log line carries the MTP loss and the MoE auxiliary losses as Megatron-LM reports them.
set -euo pipefail
source "$(dirname "$0")/common.sh"
detect_gpu deepseek_v3_tiny "(4 layers, hidden 128, MLA + 8 experts + MTP, runs on this CPU)"
: "${PRESET:=deepseek_v3_671b}"
case "$PRESET" in
  deepseek*) ;;
  *) echo "unknown PRESET=$PRESET: use deepseek_v3_671b, deepseek_v2_lite or deepseek_v3_tiny" >&2; exit 1 ;;
esac
PRESET="$PRESET" exec bash "$EXAMPLES_DIR/pretrain_llama.sh" "$@"
