#!/usr/bin/env bash
# The quick-start's Llama leg (bash examples/quickstart.sh llama, or this script directly), offline on a CPU:
#   1. train a 2,000-piece Llama-style SentencePiece tokenizer.model (BPE, byte fallback, <s>/</s> as BOS/EOS) on
#      examples/data/python_docs.jsonl (tools/train_sentencepiece_tokenizer.py),
#   2. preprocess the corpus with --tokenizer-type Llama2Tokenizer --append-eod (documents become <s> ... </s>),
#   3. pretrain a tiny Llama (examples/pretrain_llama.sh, PRESET=llama_tiny: RMSNorm, SwiGLU, RoPE, GQA, untied),
#      stopping at half to save a checkpoint, 4. resume it to the end and check that the loss went down,
#   5. generate greedy samples, 6. evaluate it zero-shot on WikiText-103 and LAMBADA slices from tests/fixtures/,
#   7. convert it to a Hugging Face folder (AutoTokenizer gives our ids) and back, and check that the round-tripped
#      checkpoint generates the same tokens.
# Everything lands in $OUT/llama_* (default OUT=quickstart_out). LLAMA_TRAIN_ITERS (default 60) sets the run length,
# LOG_INTERVAL (10), WIKI_LINES / LAMBADA_LINES (50) the evaluation slices.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-quickstart_out}
PY=${PYTHON:-python}
ITERS=${LLAMA_TRAIN_ITERS:-60}
HALF=$((ITERS / 2))
LOG_INTERVAL=${LOG_INTERVAL:-10}
WIKI_LINES=${WIKI_LINES:-50}
LAMBADA_LINES=${LAMBADA_LINES:-50}
export SEQ_LENGTH=${SEQ_LENGTH:-128}
TOK="$OUT/llama_tokenizer/tokenizer.model"
DATA="$OUT/llama_data/python_docs_text_document"
CKPT="$OUT/llama_checkpoints"

echo "== llama 1/7 training a SentencePiece tokenizer.model on examples/data/python_docs.jsonl"
$PY tools/train_sentencepiece_tokenizer.py --input examples/data/python_docs.jsonl --vocab-size 2000 \
  --output-dir "$OUT/llama_tokenizer"

echo "== llama 2/7 preprocessing into $DATA.{bin,idx} (<s> ... </s> per document)"
mkdir -p "$OUT/llama_data"
$PY tools/preprocess_data.py --input examples/data/python_docs.jsonl --output-prefix "$OUT/llama_data/python_docs" \
  --tokenizer-type Llama2Tokenizer --tokenizer-model "$TOK" --append-eod --workers 2

echo "== llama 3/7 pretraining a tiny Llama (stops at iteration $HALF and saves a checkpoint)"
rm -rf "$CKPT" "$OUT/llama_hf" "$OUT/llama_from_hf"
TRAIN_ENV=(PRESET=llama_tiny DATA_PATH="$DATA" TOKENIZER_MODEL="$TOK" CHECKPOINT_PATH="$CKPT" TRAIN_ITERS="$ITERS"
           LOG_INTERVAL="$LOG_INTERVAL" SAVE_INTERVAL="$HALF" EVAL_INTERVAL="$HALF" PATH="$(dirname "$(command -v "$PY")"):$PATH")
env "${TRAIN_ENV[@]}" bash examples/pretrain_llama.sh --eval-iters 5 --seed 1234 --exit-interval "$HALF" \
  | tee "$OUT/llama_train_part1.log"
echo "== llama 4/7 resuming from the checkpoint to iteration $ITERS"
env "${TRAIN_ENV[@]}" bash examples/pretrain_llama.sh --eval-iters 5 --seed 1234 | tee "$OUT/llama_train_part2.log"
$PY - "$OUT/llama_train_part1.log" "$OUT/llama_train_part2.log" <<'PYEOF'
import re, sys
losses = [(int(m.group(1)), float(m.group(2))) for path in sys.argv[1:] for m in re.finditer(
    r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)", open(path).read())]
print("\nlm loss by iteration:", ", ".join(f"{i}: {v:.3f}" for i, v in losses))
if len(losses) < 2 or not losses[-1][1] < losses[0][1]:
    sys.exit("quick-start (llama): the loss did not go down")
print(f"Llama training OK: loss {losses[0][1]:.3f} -> {losses[-1][1]:.3f}")
PYEOF

# shellcheck source=/dev/null
source examples/presets/llama_tiny.sh
# shellcheck disable=SC2206
MODEL=($LLAMA_MODEL_ARGS --tokenizer-type Llama2Tokenizer --tokenizer-model "$TOK")
echo "== llama 5/7 greedy samples from the checkpoint"
printf 'The for statement\nA class definition\n' > "$OUT/llama_prompts.txt"
GEN=(--micro-batch-size 2 --sample-input-file "$OUT/llama_prompts.txt" --out-seq-length 24 --temperature 0)
$PY tools/generate_samples_gpt.py "${MODEL[@]}" --load "$CKPT" "${GEN[@]}" --sample-output-file "$OUT/llama_samples.jsonl"
$PY - "$OUT/llama_samples.jsonl" <<'PYEOF'
import json, sys
for row in map(json.loads, open(sys.argv[1])):
    print(f"--- {row['prompt']!r} ->\n{row['text']}")
PYEOF

echo "== llama 6/7 zero-shot evaluation on WikiText-103 ($WIKI_LINES lines) and LAMBADA ($LAMBADA_LINES examples)"
head -n "$WIKI_LINES" tests/fixtures/wikitext-103/wiki.test.tokens > "$OUT/llama_wiki.test.tokens"
head -n "$LAMBADA_LINES" tests/fixtures/lambada/lambada_test.jsonl > "$OUT/llama_lambada_test.jsonl"
EVAL=("${MODEL[@]}" --load "$CKPT" --no-load-optim --no-load-rng --micro-batch-size 8)
$PY tasks/main.py --task WIKITEXT103 --valid-data "$OUT/llama_wiki.test.tokens" --overlapping-eval 32 "${EVAL[@]}"
$PY tasks/main.py --task LAMBADA --valid-data "$OUT/llama_lambada_test.jsonl" "${EVAL[@]}"
echo "note: these evaluation numbers are expected for a 4-layer Llama trained for $ITERS iterations on 0.1M tokens" \
  "of Python documentation (huge adjusted perplexity, LAMBADA near 0%); they are not a fault (see the README)."

echo "== llama 7/7 converting to Hugging Face ($OUT/llama_hf) and back ($OUT/llama_from_hf)"
$PY tools/checkpoint/convert.py --model-type GPT --saver hf --load-dir "$CKPT" --save-dir "$OUT/llama_hf"
$PY tools/checkpoint/convert.py --model-type GPT --loader hf --load-dir "$OUT/llama_hf" --save-dir "$OUT/llama_from_hf"
$PY tools/generate_samples_gpt.py "${MODEL[@]}" --load "$OUT/llama_from_hf" "${GEN[@]}" \
  --sample-output-file "$OUT/llama_samples_from_hf.jsonl"
$PY - "$OUT" "$TOK" <<'PYEOF'
import json, sys
from transformers import AutoTokenizer
from megatron.tokenizer.llama2_tokenizer import Llama2Tokenizer

out, tok = sys.argv[1:]
ours, hf = Llama2Tokenizer(tok), AutoTokenizer.from_pretrained(f"{out}/llama_hf")
texts = [json.loads(line)["text"][:2000] for line in open("examples/data/python_docs.jsonl")][:10]
if any(hf(t)["input_ids"] != ours.tokenize(t) for t in texts):
    sys.exit("quick-start (llama): the Hugging Face tokenizer gives other ids than the training tokenizer")
before, after = ([json.loads(line)["text"] for line in open(f"{out}/{name}")]
                 for name in ("llama_samples.jsonl", "llama_samples_from_hf.jsonl"))
if before != after:
    sys.exit("quick-start (llama): the checkpoint converted to Hugging Face and back generates other tokens")
print("Hugging Face round trip OK: AutoTokenizer gives our ids (BOS first), the converted-back checkpoint "
      "generates the same greedy tokens")
PYEOF
echo "quick-start (llama) done in ${SECONDS} s: tokenizer.model, dataset, checkpoints, samples and the HF folder are" \
  "in $OUT/llama_*"
echo "CPU time (user system) of this script, then of the processes it ran:"
times
