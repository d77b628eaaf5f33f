#!/usr/bin/env bash
# Pretrain BERT in one process (one GPU, or the CPU). Extra flags are passed through, e.g.
#   PRESET=345m DATA_PATH=data/my-bert_text_sentence VOCAB_FILE=bert-vocab.txt bash examples/pretrain_bert.sh
# (add --bert-no-binary-head to train the masked LM alone).
set -euo pipefail
source "$(cd "$(dirname "$0")" && pwd)/bert_common.sh"

# shellcheck disable=SC2086
python "$REPO_DIR/pretrain_bert.py" $BERT_ARGS $DATA_ARGS $OUTPUT_ARGS $PRECISION_ARGS "$@"
