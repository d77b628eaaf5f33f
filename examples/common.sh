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

# The torchrun of the example scripts: megatron.quiet_torchrun is torchrun, except that a user error (bad flag or file)
# is its one line (no crash report), a SIGTERM waits for the workers' --exit-signal-handler save instead of killing
# them after 30 s, and a busy --master_port is named. Pass --master_port only when MASTER_PORT is set: on one node
# torchrun then picks a free port, so two runs at once do not collide.
QUIET_TORCHRUN=(env "PYTHONPATH=$REPO_DIR${PYTHONPATH:+:$PYTHONPATH}" python -m megatron.quiet_torchrun)
