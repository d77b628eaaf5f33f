#!/usr/bin/env bash
# Install this repository's package and its requirements into the current Python (a virtualenv is recommended):
#   bash examples/install.sh          # torch (when missing) + requirements.txt + `pip install -e .`
#   bash examples/install.sh --dev    # the same + requirements-dev.txt (pytest, ruff): what the tests need
# torch, when it is not installed yet:
#   - no NVIDIA GPU (no nvidia-smi): the CPU build of torch 2.13.0 (a wheel pip already has on this machine, e.g. in
#     its find-links, else from https://download.pytorch.org/whl/cpu), about 200 MB instead of ~4 GB of CUDA wheels;
#   - NVIDIA GPU: the CUDA build from PyPI within requirements.txt's range (torch>=2.1,<2.14).
#   TORCH_SPEC (e.g. "torch==2.12.0") and TORCH_INDEX_URL override the choice.
# pip's progress is shown. PYTHON selects the interpreter (default: python).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
EXTRA=()
[ "${1:-}" = "--dev" ] && EXTRA=(-r requirements-dev.txt)

if ! $PY -c "import torch" 2>/dev/null; then
  if [ -n "${TORCH_INDEX_URL:-}" ]; then
    echo "== installing ${TORCH_SPEC:-torch==2.13.0} from $TORCH_INDEX_URL"
    $PY -m pip install "${TORCH_SPEC:-torch==2.13.0}" --index-url "$TORCH_INDEX_URL"
  elif command -v nvidia-smi >/dev/null 2>&1; then
    echo "== installing torch, CUDA build from PyPI (an NVIDIA GPU was found)"
    $PY -m pip install "${TORCH_SPEC:-torch>=2.1,<2.14}"
  else
    echo "== installing torch 2.13.0, CPU build (no NVIDIA GPU found)"
    if ! $PY -m pip install --no-index --no-deps "${TORCH_SPEC:-torch==2.13.0}" 2>/dev/null; then
      echo "   (no local wheel: downloading from the PyTorch CPU index)"
      $PY -m pip install "${TORCH_SPEC:-torch==2.13.0}" --index-url https://download.pytorch.org/whl/cpu
    fi
  fi
fi
echo "== installing requirements${EXTRA:+ and test requirements}"
$PY -m pip install -r requirements.txt "${EXTRA[@]}" setuptools wheel
if [ "${1:-}" = "--dev" ]; then
  # NVIDIA's megatron-core, the oracle of the MoE and Megatron Core checkpoint tests. Its top-level package is also
  # named `megatron`, so it goes into its own folder (never this environment) and tests run it in a subprocess with
  # PYTHONPATH pointing there (tests/mcore_oracle.py). MCORE_ORACLE_DIR overrides the folder.
  ORACLE_DIR=${MCORE_ORACLE_DIR:-$PWD/.oracles/megatron-core-0.16.1}
  if [ ! -f "$ORACLE_DIR/megatron/core/__init__.py" ]; then
    echo "== installing the megatron-core 0.16.1 oracle into $ORACLE_DIR (tests only)"
    $PY -m pip install -q --no-deps --target "$ORACLE_DIR" megatron-core==0.16.1
  fi
  $PY -m pip install -q psutil
fi
INSTALLED_FROM=$($PY -m pip show megatron-lite 2>/dev/null | sed -n 's/^Editable project location: //p' || true)
if [ "$INSTALLED_FROM" = "$PWD" ]; then
  echo "== this package is already installed from $PWD (editable)"
else
  echo "== installing this package (pip install -e .; compiles csrc/helpers.cpp)"
  $PY -m pip install --no-build-isolation -e .
fi
