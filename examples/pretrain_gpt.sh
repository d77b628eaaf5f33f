#!/usr/bin/env bash
# Pretrain GPT in one process (one GPU, or the CPU). Extra flags are passed through, e.g.
#   PRESET=345m DATA_PATH=data/my-gpt2_text_document VOCAB_FILE=gpt2-vocab.json MERGE_FILE=gpt2-merges.txt \
#     bash examples/pretrain_gpt.sh --train-iters 100
set -euo pipefail
source "$(cd "$(dirname "$0")" && pwd)/gpt_common.sh"

# shellcheck disable=SC2086
python "$REPO_DIR/pretrain_gpt.py" $GPT_ARGS $DATA_ARGS $OUTPUT_ARGS $PRECISION_ARGS "$@"
