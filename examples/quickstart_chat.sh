#!/usr/bin/env bash
# The quick-start's chat leg (bash examples/quickstart.sh chat, or this script directly), offline on a CPU: from a
# Hugging Face model to a chat server (docs/sft.md).
#   1. write a tiny Hugging Face Qwen2 with a ChatML chat template (examples/make_tiny_hf_chat_model.py),
#   2. convert it to a Megatron checkpoint (tools/checkpoint/convert.py --loader hf: the architecture flags and the
#      tokenizer, chat template included, go into the checkpoint),
#   3. finetune it with --sft on the shipped chat sample (examples/data/chat_sample.jsonl, loss on the assistant's
#      tokens only) and check that the loss went down,
#   4. serve the result (tools/run_text_generation_server.py --use-checkpoint-args),
#   5. chat with it through the openai client (plain and streaming give the same reply).
# Everything lands in $OUT/chat_* (default OUT=quickstart_out). CHAT_TRAIN_ITERS (default 40) sets the SFT run length.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-quickstart_out}
PY=${PYTHON:-python}
ITERS=${CHAT_TRAIN_ITERS:-40}
LOG_INTERVAL=${LOG_INTERVAL:-10}
HF="$OUT/chat_hf"
BASE="$OUT/chat_base"
SFT="$OUT/chat_sft"

echo "== chat 1/5 a tiny Hugging Face Qwen2 with a ChatML chat template ($HF)"
rm -rf "$HF" "$BASE" "$SFT"
$PY examples/make_tiny_hf_chat_model.py "$HF"

echo "== chat 2/5 converting it to a Megatron checkpoint ($BASE)"
$PY tools/checkpoint/convert.py --model-type GPT --loader hf --load-dir "$HF" --save-dir "$BASE"

echo "== chat 3/5 supervised finetuning on examples/data/chat_sample.jsonl (--sft, $ITERS iterations)"
$PY pretrain_gpt.py --load "$BASE" --use-checkpoint-args --finetune --sft --sft-tokenizer-prompt-format hf \
  --data-path examples/data/chat_sample.jsonl --split 98,2,0 --seq-length 128 \
  --micro-batch-size 1 --global-batch-size 4 --train-iters "$ITERS" --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine \
  --lr-warmup-iters 2 --clip-grad 1.0 --hidden-dropout 0.0 --attention-dropout 0.0 --seed 1234 \
  --log-interval "$LOG_INTERVAL" --eval-iters 1 --eval-interval "$ITERS" --save "$SFT" --save-interval "$ITERS" | tee "$OUT/chat_sft.log"
$PY - "$OUT/chat_sft.log" <<'PYEOF'
import re, sys
losses = [(int(m.group(1)), float(m.group(2))) for m in re.finditer(
    r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)", open(sys.argv[1]).read())]
print("\nlm loss by iteration:", ", ".join(f"{i}: {v:.3f}" for i, v in losses))
if len(losses) < 2 or not losses[-1][1] < losses[0][1]:
    sys.exit("quick-start (chat): the SFT loss did not go down")
print(f"SFT OK: loss {losses[0][1]:.3f} -> {losses[-1][1]:.3f}")
PYEOF

echo "== chat 4/5 serving it (tools/run_text_generation_server.py --load $SFT --use-checkpoint-args)"
$PY tools/run_text_generation_server.py --load "$SFT" --use-checkpoint-args --port 0 > "$OUT/chat_server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
URL=""
for _ in $(seq 600); do
  URL=$(sed -n 's|.*serving text generation on \(http://[0-9.]*:[0-9]*\)/.*|\1|p' "$OUT/chat_server.log")
  [ -n "$URL" ] && break
  kill -0 $SERVER 2>/dev/null || { cat "$OUT/chat_server.log"; exit 1; }
  sleep 0.5
done
[ -n "$URL" ] || { cat "$OUT/chat_server.log"; echo "quick-start (chat): the server did not start"; exit 1; }
echo "serving on $URL"

echo "== chat 5/5 chatting with it through the openai client"
$PY - "$URL" <<'PYEOF'
import sys
import openai

client = openai.OpenAI(base_url=f"{sys.argv[1]}/v1", api_key="unused", max_retries=0)
messages = [{"role": "system", "content": "Reply in one sentence."},
            {"role": "user", "content": "What color is the sky?"}]
reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0)
streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
    model="tiny", messages=messages, max_tokens=24, temperature=0, stream=True) if chunk.choices)
choice = reply.choices[0]
print(f"user: {messages[-1]['content']}\nassistant: {choice.message.content!r} (finish_reason {choice.finish_reason},"
      f" {reply.usage.completion_tokens} tokens)")
if streamed != choice.message.content:
    sys.exit(f"quick-start (chat): the streamed reply {streamed!r} differs from the plain one")
print("chat OK: the openai client's plain and streamed replies agree")
PYEOF
kill $SERVER
wait $SERVER || true
trap - EXIT
echo "quick-start (chat) done in ${SECONDS} s: the HF model, checkpoints, logs are in $OUT/chat_*"
echo "CPU time (user system) of this script, then of the processes it ran:"
times
