#!/usr/bin/env bash
# Pretrain a GPT-OSS-style model (attention sinks, linear biases, experts with the clamped quick-GeGLU, top-k routing
# with a router bias) with pretrain_gpt.py: examples/pretrain_llama.sh with a GPT-OSS preset. Examples:
#   PRESET=gpt_oss_20b DATA_PATH=data/my-gpt-oss_text_document TOKENIZER_MODEL=gpt-oss-tokenizer-folder \
#     TOKENIZER_TYPE=HuggingFaceTokenizer NPROC=8 bash examples/pretrain_gpt_oss.sh --expert-model-parallel-size 8
#   PRESET=gpt_oss_tiny ... bash examples/pretrain_gpt_oss.sh --train-iters 200     # CPU
# Presets: examples/presets/{gpt_oss_20b,gpt_oss_120b,gpt_oss_tiny}.sh; the other variables are those of
# pretrain_llama.sh. A converted HF checkpoint (tools/checkpoint/convert.py --loader hf) continues with --load.
set -euo pipefail
source "$(dirname "$0")/common.sh"
detect_gpu gpt_oss_tiny "(4 layers, hidden 128, 8 experts, runs on this CPU)"
: "${PRESET:=gpt_oss_20b}"
case "$PRESET" in
  gpt_oss*) ;;
  *) echo "unknown PRESET=$PRESET: use gpt_oss_20b, gpt_oss_120b or gpt_oss_tiny" >&2; exit 1 ;;
esac
PRESET="$PRESET" exec bash "$EXAMPLES_DIR/pretrain_llama.sh" "$@"
