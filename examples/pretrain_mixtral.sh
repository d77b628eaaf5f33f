#!/usr/bin/env bash
# Pretrain a Mixtral-style mixture-of-experts model (Llama layers whose MLPs are 8 SwiGLU experts, top-2 routing,
# load-balancing loss) with pretrain_gpt.py: examples/pretrain_llama.sh with a Mixtral preset. Examples:
#   PRESET=mixtral_8x7b DATA_PATH=data/my-llama_text_document TOKENIZER_MODEL=tokenizer.model \
#     NPROC=8 bash examples/pretrain_mixtral.sh --tensor-model-parallel-size 2 --sequence-parallel
#   PRESET=mixtral_tiny ... bash examples/pretrain_mixtral.sh --train-iters 200     # CPU
# Presets: examples/presets/{mixtral_8x7b,mixtral_tiny}.sh; the other variables are those of pretrain_llama.sh.
# The log line carries Megatron-LM's load_balancing_loss (and z_loss with --moe-z-loss-coeff).
set -euo pipefail
source "$(dirname "$0")/common.sh"
detect_gpu mixtral_tiny "(4 layers, hidden 128, 8 experts, runs on this CPU)"
: "${PRESET:=mixtral_8x7b}"
case "$PRESET" in
  mixtral*) ;;
  *) echo "unknown PRESET=$PRESET: use mixtral_8x7b or mixtral_tiny" >&2; exit 1 ;;
esac
PRESET="$PRESET" exec bash "$EXAMPLES_DIR/pretrain_llama.sh" "$@"
