# Shared settings of the finetuning examples (sourced by examples/finetune_{mnli,qqp,race}_distributed.sh).
# Override from the environment:
#   PRESET=345m|tiny (the pretrained BERT's shape: examples/presets/bert_*.sh), PRETRAINED_CHECKPOINT (a
#   pretrain_bert.py checkpoint), VOCAB_FILE (its WordPiece vocab.txt), CHECKPOINT_PATH (where the finetuned
#   model and the predictions go), GPUS_PER_NODE, NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT, PRECISION_ARGS,
#   DRY_RUN=1 (print the command instead of running it). The script's micro-batch is lowered to fit a small
#   --train-data file (fit_micro_batch); a --micro-batch-size among the extra flags wins.
# Without a GPU (and PRESET unset) the tiny preset is used and 2 CPU processes are started.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
detect_gpu tiny "(2 layers, hidden 128); set PRESET=345m for BERT-345M"
: "${PRESET:=345m}"
load_preset "$EXAMPLES_DIR/presets/bert_${PRESET}.sh" \
  "$(ls "$EXAMPLES_DIR/presets" | grep '^bert_' | sed 's/bert_//;s/\.sh//' | tr '\n' ' ')"
: "${PRETRAINED_CHECKPOINT:=checkpoints/bert_${PRESET}}"
: "${VOCAB_FILE:=bert-vocab.txt}"
if [ "$HAS_GPU" = 1 ]; then
  PRECISION_ARGS="${PRECISION_ARGS---fp16}"
  : "${GPUS_PER_NODE:=8}"
else
  PRECISION_ARGS="${PRECISION_ARGS-}"
  : "${GPUS_PER_NODE:=2}"
fi
: "${NNODES:=1}"
: "${NODE_RANK:=0}"
: "${MASTER_ADDR:=localhost}"
COMMON_ARGS="$BERT_MODEL_ARGS --tokenizer-type BertWordPieceLowerCase --vocab-file $VOCAB_FILE \
  --pretrained-checkpoint $PRETRAINED_CHECKPOINT --seed 1234 --tensor-model-parallel-size 1"

# run_task ARGS...: torchrun tasks/main.py (or print the command with DRY_RUN=1), through megatron.quiet_torchrun:
# torchrun itself, except that a user error (bad flag or file) prints its one line once and no crash report.
run_task() {
  for f in "$VOCAB_FILE"; do
    if [ ! -f "$f" ] && [ -z "${DRY_RUN:-}" ]; then
      echo "missing $f: set VOCAB_FILE to the pretrained BERT's WordPiece vocab.txt" >&2
      exit 1
    fi
  done
  local cmd=("${QUIET_TORCHRUN[@]}" --nproc_per_node "$GPUS_PER_NODE" --nnodes "$NNODES" --node_rank "$NODE_RANK"
             --master_addr "$MASTER_ADDR" ${MASTER_PORT:+--master_port "$MASTER_PORT"} "$REPO_DIR/tasks/main.py" "$@")
  if [ -n "${DRY_RUN:-}" ]; then
    echo "${cmd[*]}"
  else
    "${cmd[@]}"
  fi
}

# fit_micro_batch DEFAULT FILE...: echo the micro-batch size to use: DEFAULT, lowered (with a note on stderr) when the TSV files (header line excluded) hold fewer examples than one global batch of
# DEFAULT x GPUS_PER_NODE x NNODES processes, so that a small sample file trains instead of stopping. Exits 1 before
# launching when there are fewer examples than processes.
fit_micro_batch() {
  local default=$1; shift
  local n=0 f procs=$((GPUS_PER_NODE * NNODES))
  for f in "$@"; do
    [ -f "$f" ] || { echo "$default"; return; }  # a folder or a missing file: tasks/main.py reports it
    n=$((n + $(tail -n +2 "$f" | grep -c '[^[:space:]]' || true)))
  done
  if [ "$n" -ge $((default * procs)) ]; then echo "$default"; return; fi
  if [ "$n" -lt "$procs" ]; then
    echo "error: --train-data has $n examples, fewer than the $procs processes (GPUS_PER_NODE x NNODES); use a larger file or GPUS_PER_NODE=1" >&2
    exit 1
  fi
  echo "note: --train-data has $n examples, fewer than one batch of $((default * procs)) (micro-batch $default x $procs processes): using micro-batch $((n / procs)) (pass --micro-batch-size to choose)" >&2
  echo $((n / procs))
}
