#!/usr/bin/env bash
# Pretrain T5 in one process (one GPU, or the CPU). Extra flags are passed through, e.g.
#   PRESET=220m DATA_PATH=data/my-t5_text_sentence VOCAB_FILE=bert-vocab.txt bash examples/pretrain_t5.sh
# (--encoder-num-layers / --decoder-num-layers override --num-layers per stack).
set -euo pipefail
source "$(cd "$(dirname "$0")" && pwd)/t5_common.sh"

# shellcheck disable=SC2086
python "$REPO_DIR/pretrain_t5.py" $T5_ARGS $DATA_ARGS $OUTPUT_ARGS $PRECISION_ARGS "$@"
