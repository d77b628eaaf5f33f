# Set-up shared by the example scripts (sourced by gpt_common.sh, bert_common.sh, t5_common.sh, pretrain_llama.sh and
# pretrain_bloom.sh): where the repository is, whether a GPU is here (without one, and with PRESET unset, the family's
# tiny preset, said in one line), the preset file, and the input files checked before anything starts.
EXAMPLES_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_DIR="$(dirname "$EXAMPLES_DIR")"

# detect_gpu TINY_PRESET "(WHAT IT IS)": HAS_GPU=1|0; without a GPU and with PRESET unset, PRESET=TINY_PRESET and a note.
detect_gpu() {
  if python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    HAS_GPU=1
  else
    HAS_GPU=0
    if [ -z "${PRESET:-}" ]; then
      PRESET=$1
      echo "note: no GPU found: using PRESET=$1 $2" >&2
    fi
  fi
}

# load_preset FILE CHOICES: source the preset file, or exit 1 with one line naming the choices.
load_preset() {
  if [ ! -f "$1" ]; then
    echo "unknown PRESET=$PRESET: use one of $2" >&2
    exit 1
  fi
  note_user_run_length
  # shellcheck source=/dev/null
  source "$1"
}

# require_inputs TEST HINT FILE...: exit 1 with "missing FILE: HINT" for the first FILE failing `[ TEST FILE ]`
# (-f for files, -e where a folder is allowed).
require_inputs() {
  local test=$1 hint=$2 f
  shift 2
  for f in "$@"; do
    if ! [ "$test" "$f" ]; then
      echo "missing $f: $hint" >&2
      exit 1
    fi
  done
}

# The run-length settings a short run shortens (fit_run_length), unless the user set them: load_preset notes which
# were set before the preset's `:=` defaults fill them in.
RUN_LENGTH_VARS="LR_DECAY_ITERS LR_WARMUP_ITERS LOG_INTERVAL"
USER_RUN_LENGTH=""
note_user_run_length() {
  local v
  for v in $RUN_LENGTH_VARS; do
    if [ -n "${!v:-}" ]; then USER_RUN_LENGTH="$USER_RUN_LENGTH $v"; fi
  done
}

# fit_run_length ARGS...: fit the schedule and the log interval to TRAIN_ITERS (a `--train-iters N` among ARGS, the
# flags passed through to the entry point, wins as it does on the command line). A value the user did not set is
# shortened when the run is shorter than the preset's: LR_DECAY_ITERS to TRAIN_ITERS, LR_WARMUP_ITERS to a tenth of
# the decay, LOG_INTERVAL to a quarter of the run (at least 1): TRAIN_ITERS=20 decays over 20, warms up over 2 and
# logs every 5 iterations.
fit_run_length() {
  local prev="" a quarter
  for a in "$@"; do
    if [ "$prev" = --train-iters ]; then TRAIN_ITERS=$a; fi
    case "$a" in --train-iters=*) TRAIN_ITERS=${a#--train-iters=} ;; esac
    prev=$a
  done
  case " $USER_RUN_LENGTH " in *" LR_DECAY_ITERS "*) ;; *)
    if [ "$LR_DECAY_ITERS" -gt "$TRAIN_ITERS" ]; then LR_DECAY_ITERS=$TRAIN_ITERS; fi ;;
  esac
  case " $USER_RUN_LENGTH " in *" LR_WARMUP_ITERS "*) ;; *)
    if [ -n "${LR_WARMUP_ITERS:-}" ] && [ $((LR_WARMUP_ITERS * 10)) -gt "$LR_DECAY_ITERS" ]; then
      LR_WARMUP_ITERS=$((LR_DECAY_ITERS / 10))
    fi ;;
  esac
  quarter=$((TRAIN_ITERS / 4 > 0 ? TRAIN_ITERS / 4 : 1))
  case " $USER_RUN_LENGTH " in *" LOG_INTERVAL "*) ;; *)
    if [ "$LOG_INTERVAL" -gt "$quarter" ]; then LOG_INTERVAL=$quarter; fi ;;
  esac
}

# context_parallel_dropout ARGS...: "--attention-dropout 0" (and one note) when ARGS ask for --context-parallel-size
# above 1 and ATTENTION_DROPOUT is unset (the ring attention has no dropout; Megatron's default is 0.1), else
# "--attention-dropout $ATTENTION_DROPOUT" when that is set. Put it before ARGS so that a flag there still wins.
context_parallel_dropout() {
  local prev="" a cp=1
  for a in "$@"; do
    if [ "$prev" = --context-parallel-size ]; then cp=$a; fi
    case "$a" in --context-parallel-size=*) cp=${a#--context-parallel-size=} ;; esac
    prev=$a
  done
  if [ -n "${ATTENTION_DROPOUT:-}" ]; then
    echo "--attention-dropout $ATTENTION_DROPOUT"
  elif [ "$cp" != 1 ]; then
    echo "note: --context-parallel-size $cp: attention dropout 0 (the ring has none; ATTENTION_DROPOUT=... sets it)" >&2
    echo "--attention-dropout 0"
  fi
}

# The torchrun of the example scripts: megatron.quiet_torchrun is torchrun, except that a user error (bad flag or file)
# is its one line (no crash report), a SIGTERM waits for the workers' --exit-signal-handler save instead of killing
# them after 30 s, and a busy --master_port is named. Pass --master_port only when MASTER_PORT is set: on one node
# torchrun then picks a free port, so two runs at once do not collide.
QUIET_TORCHRUN=(env "PYTHONPATH=$REPO_DIR${PYTHONPATH:+:$PYTHONPATH}" python -m megatron.quiet_torchrun)
