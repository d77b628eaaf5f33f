#!/usr/bin/env bash
# The quick-start's optional BERT leg (bash examples/quickstart.sh bert, or this script directly), offline on a CPU:
#   1. train a 4,096-entry lower-case WordPiece vocabulary on examples/data/python_docs.jsonl (`tokenizers`),
#   2. preprocess the corpus one sentence per item (tools/preprocess_data.py --split-sentences), as Megatron's BERT
#      data needs,
#   3. pretrain a tiny BERT (masked LM + sentence-order prediction) and check that the lm loss goes down.
# Everything lands in $OUT (default quickstart_out/). BERT_TRAIN_ITERS (default 100) shortens the run.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-quickstart_out}
PY=${PYTHON:-python}
ITERS=${BERT_TRAIN_ITERS:-100}
LOG_INTERVAL=${LOG_INTERVAL:-10}

echo "== bert 1/3 training a WordPiece vocabulary on examples/data/python_docs.jsonl"
mkdir -p "$OUT/bert_tokenizer" "$OUT/bert_data"
$PY - examples/data/python_docs.jsonl "$OUT/bert_tokenizer" <<'PYEOF'
import json, sys
from tokenizers import BertWordPieceTokenizer

texts = [json.loads(line)["text"] for line in open(sys.argv[1], encoding="utf-8")]
wordpiece = BertWordPieceTokenizer(lowercase=True)
wordpiece.train_from_iterator(texts, vocab_size=4096, min_frequency=2, show_progress=False)
print("vocabulary:", wordpiece.save_model(sys.argv[2])[0], f"({wordpiece.get_vocab_size()} entries)")
PYEOF

echo "== bert 2/3 preprocessing into $OUT/bert_data/python_docs_text_sentence.{bin,idx} (one item per sentence)"
$PY tools/preprocess_data.py --input examples/data/python_docs.jsonl --output-prefix "$OUT/bert_data/python_docs" \
  --tokenizer-type BertWordPieceLowerCase --vocab-file "$OUT/bert_tokenizer/vocab.txt" --split-sentences --workers 2

echo "== bert 3/3 pretraining a tiny BERT for $ITERS iterations (lm loss + sop loss)"
$PY pretrain_bert.py --num-layers 2 --hidden-size 128 --num-attention-heads 4 --seq-length 128 \
  --max-position-embeddings 128 --micro-batch-size 16 --global-batch-size 16 --train-iters "$ITERS" \
  --lr 1e-3 --min-lr 1e-4 --lr-decay-style linear --lr-warmup-iters $((ITERS / 10)) --weight-decay 0.01 \
  --clip-grad 1.0 --vocab-file "$OUT/bert_tokenizer/vocab.txt" --data-path "$OUT/bert_data/python_docs_text_sentence" \
  --split 949,50,1 --log-interval "$LOG_INTERVAL" --eval-interval "$ITERS" --eval-iters 5 \
  --save "$OUT/bert_checkpoints" --save-interval "$ITERS" --seed 1234 | tee "$OUT/bert_train.log"

$PY - "$OUT/bert_train.log" <<'PYEOF'
import re, sys
losses = [(int(m.group(1)), float(m.group(2)), float(m.group(3))) for m in re.finditer(
    r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+) \| sop loss: ([0-9.E+-]+)", open(sys.argv[1]).read())]
print("\nlm loss / sop loss by iteration:", ", ".join(f"{i}: {lm:.3f}/{sop:.3f}" for i, lm, sop in losses))
if len(losses) < 2 or not losses[-1][1] < losses[0][1] - 0.5:
    sys.exit("quick-start (bert): the lm loss did not go down")
print(f"BERT training OK: lm loss {losses[0][1]:.3f} -> {losses[-1][1]:.3f}")
PYEOF
echo "quick-start (bert) done: vocabulary, dataset and checkpoint are in $OUT/"
