#!/usr/bin/env bash
# Pretrain a Qwen3-style model (Llama layers with per-head q/k RMSNorm, --qk-layernorm, and 128-channel heads,
# --kv-channels) or its mixture-of-experts sibling Qwen3-MoE (top-k renormalised, no shared expert) with
# pretrain_gpt.py: examples/pretrain_llama.sh with a Qwen3 preset. Examples:
#   PRESET=qwen3_8b DATA_PATH=data/my-qwen_text_document TOKENIZER_TYPE=HuggingFaceTokenizer \
#     TOKENIZER_MODEL=Qwen3-8B NPROC=8 bash examples/pretrain_qwen3.sh --tensor-model-parallel-size 2 --sequence-parallel
#   PRESET=qwen3_tiny ... bash examples/pretrain_qwen3.sh --train-iters 200     # CPU
# Presets: examples/presets/{qwen3_8b,qwen3_30b_a3b,qwen3_tiny,qwen3_moe_tiny}.sh; the other variables are those of
# pretrain_llama.sh. Continue from a Hugging Face folder: tools/checkpoint/convert.py --loader hf (docs/conversion.md).
set -euo pipefail
source "$(dirname "$0")/common.sh"
detect_gpu qwen3_tiny "(4 layers, hidden 128, runs on this CPU)"
: "${PRESET:=qwen3_8b}"
case "$PRESET" in
  qwen3*) ;;
  *) echo "unknown PRESET=$PRESET: use qwen3_8b, qwen3_30b_a3b, qwen3_tiny or qwen3_moe_tiny" >&2; exit 1 ;;
esac
PRESET="$PRESET" exec bash "$EXAMPLES_DIR/pretrain_llama.sh" "$@"
