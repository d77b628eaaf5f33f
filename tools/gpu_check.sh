#!/usr/bin/env bash
# One command that checks a GPU: sets up what the GPU machine lacks, runs the `gpu` tests (tests/gpu/, which skip
# cleanly without CUDA), then tools/benchmarks/bench_gpu.py (GPT 1.3B bf16 step, MFU, HF ratio, bf16 matmul peak,
# profiler table, generation, Triton kernels vs torch), and writes one report: OUT/gpu_check.json + OUT/gpu_check.txt.
#
#   bash tools/gpu_check.sh [--quick] [--dry-run] [--out DIR]   # whole run < 8 min on one H100, --quick < 3 min
#   bash tools/gpu_check.sh --fetch-wheels                       # on a machine with the registry: fill .whl/
#
# --dry-run (and any run without CUDA): every GPU-only step skips with its reason; the benchmark runs its --smoke
# mode on the CPU instead, so the whole script is known to start and finish. The GPU machine has its own Python with
# CUDA torch, Triton and transformers but no registry: the pure-Python packages it lacks (DeepSpeed and its needs,
# ours) travel as wheels in .whl/ (ignored by git; `--fetch-wheels` fills it, ~10 MB) and are installed into a
# temporary folder put first on PYTHONPATH.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
QUICK=0 DRY=0 FETCH=0 OUT=gpu_check_out
while [ $# -gt 0 ]; do
    case "$1" in
        --quick) QUICK=1 ;;
        --dry-run) DRY=1 ;;
        --fetch-wheels) FETCH=1 ;;
        --out) OUT=$2; shift ;;
        -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument '$1' (use --quick, --dry-run, --out DIR or --fetch-wheels)"; exit 2 ;;
    esac
    shift
done
PY=${PYTHON:-python3}
# What the GPU image lacks (KINDS.md's package list): DeepSpeed (an sdist: built here into a pure-Python wheel with
# no ops) and its needs, and our own runtime needs.
WHEELS_PURE="hjson pydantic annotated-types typing-inspection typing-extensions nltk defusedxml"
WHEELS_BINARY="pydantic-core orjson"

if [ $FETCH = 1 ]; then
    mkdir -p .whl
    DS_BUILD_OPS=0 $PY -m pip wheel --no-deps -w .whl "deepspeed>=0.14" || exit 1
    plat="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
    # shellcheck disable=SC2086
    $PY -m pip download --no-deps $plat -d .whl $WHEELS_PURE $WHEELS_BINARY || exit 1
    du -sh .whl; exit 0
fi

mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
START=$(date +%s)
if [ $DRY = 1 ]; then export CUDA_VISIBLE_DEVICES=""; fi
SITE=/tmp/gpu_check_site
if ls .whl/*.whl >/dev/null 2>&1 && [ $DRY = 0 ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
        || echo "gpu_check: installing .whl/ failed; going on with what is installed"
    export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

echo "== gpu_check: environment" | tee "$OUT/gpu_check.log"
$PY - <<'PYEOF' 2>&1 | tee -a "$OUT/gpu_check.log"
import importlib, torch
print(f"python torch {torch.__version__} cuda={torch.cuda.is_available()}"
      + (f" gpu={torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""))
for name in ("triton", "transformers", "deepspeed", "orjson", "nltk", "pybind11", "pytest"):
    try:
        print(f"  {name} {getattr(importlib.import_module(name), '__version__', '?')}")
    except Exception as exc:
        print(f"  {name} MISSING ({type(exc).__name__}: {exc})")
PYEOF

echo "== gpu_check: gpu tests" | tee -a "$OUT/gpu_check.log"
TESTS=(tests/gpu)
SELECT=()
if [ $QUICK = 1 ]; then SELECT=(-k "not deepspeed and not checkpoint_moves and not tasks_main and not deterministic"); fi
timeout $([ $QUICK = 1 ] && echo 100 || echo 270) $PY -m pytest "${TESTS[@]}" -m gpu -q -rs -p no:cacheprovider \
    "${SELECT[@]}" --junitxml "$OUT/gpu_tests.xml" 2>&1 | tee "$OUT/gpu_tests.log"
TEST_RC=${PIPESTATUS[0]}

echo "== gpu_check: benchmark" | tee -a "$OUT/gpu_check.log"
BENCH=()
if [ $QUICK = 1 ]; then BENCH=(--quick); fi
if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then BENCH+=(--smoke); fi
timeout $([ $QUICK = 1 ] && echo 100 || echo 270) $PY tools/benchmarks/bench_gpu.py --out "$OUT" "${BENCH[@]}" 2>&1 \
    | tee "$OUT/bench.log"
BENCH_RC=${PIPESTATUS[0]}

$PY - "$OUT" "$TEST_RC" "$BENCH_RC" "$START" "$QUICK" "$DRY" <<'PYEOF'
import json, os, sys, time
import xml.etree.ElementTree as ET
out, test_rc, bench_rc, start, quick, dry = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), \
    sys.argv[5] == "1", sys.argv[6] == "1"
tests = {"rc": test_rc, "passed": 0, "failed": 0, "skipped": 0, "failures": [], "skip_reasons": {}}
try:
    for case in ET.parse(os.path.join(out, "gpu_tests.xml")).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        failed = case.find("failure") if case.find("failure") is not None else case.find("error")
        skipped = case.find("skipped")
        if failed is not None:
            tests["failed"] += 1
            tests["failures"].append({"test": name, "message": (failed.get("message") or "")[:500]})
        elif skipped is not None:
            tests["skipped"] += 1
            reason = skipped.get("message") or ""
            tests["skip_reasons"][reason] = tests["skip_reasons"].get(reason, 0) + 1
        else:
            tests["passed"] += 1
except (OSError, ET.ParseError) as exc:
    tests["error"] = f"no junit report ({exc})"
try:
    bench = json.load(open(os.path.join(out, "bench_gpu.json")))
except (OSError, ValueError) as exc:
    bench = {"error": f"no benchmark report ({exc})"}
report = {"quick": quick, "dry_run": dry, "elapsed_s": int(time.time()) - start, "tests": tests,
          "benchmark_rc": bench_rc, "benchmark": bench}
json.dump(report, open(os.path.join(out, "gpu_check.json"), "w"), indent=1)
lines = [f"gpu check ({'quick' if quick else 'full'}{', dry run' if dry else ''}): {report['elapsed_s']} s",
         f"gpu tests: {tests['passed']} passed, {tests['failed']} failed, {tests['skipped']} skipped"]
lines += [f"  FAILED {f['test']}: {f['message']}" for f in tests["failures"]]
lines += [f"  skipped {n}: {r}" for r, n in tests["skip_reasons"].items()]
try:
    lines.append(open(os.path.join(out, "bench_gpu.txt")).read().rstrip())
except OSError:
    lines.append(f"benchmark: {bench.get('error')}")
open(os.path.join(out, "gpu_check.txt"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PYEOF
