#!/usr/bin/env bash
# The README's test command: install what the tests need, then run the test suite.
#   bash tests/run.sh                     # everything (what .ci/run runs), with the 40 slowest tests listed
#   bash tests/run.sh tests/tokenizer -x  # pytest arguments replace the default `tests`
# Installs with examples/install.sh --dev (torch when missing: a CPU build without an NVIDIA GPU; requirements.txt,
# requirements-dev.txt, `pip install -e .`); SKIP_INSTALL=1 skips that step. The test data ships in tests/fixtures/;
# MEGATRON_SHARED_DATA (or ../shared/data) only widens a few tests. PYTHON selects the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
if [ "${SKIP_INSTALL:-0}" != 1 ]; then
  bash examples/install.sh --dev
fi
if [ $# -eq 0 ]; then
  set -- tests --durations=40  # the whole suite: every CI log lists its 40 slowest tests
fi
echo "== $PY -m pytest $*"
exec $PY -m pytest "$@"
