#!/usr/bin/env bash
# GPU checks for a device machine (no network, no install needed):
#   1. the gpu-marked tests (tests/test_gpu.py and every other gpu-marked test),
#   2. the cuda op tests against the NumPy reference (tests/test_ops_backends.py -k cuda),
#   3. benchmarks/gpu_bench.py (GLM-4.5-Air-sized kernels and propose steps).
# Usage: bash scripts/gpu_check.sh [OUT_DIR]      (default: $OUT, else ./out)
# Writes to OUT_DIR: gpu_check.log (this script's timeline), status.txt (one "step rc" line per
# step), device.txt, <step>.log for each step, gpu_tests.xml / op_tests.xml (JUnit), and the
# benchmark's gpu_bench.json / gpu_bench.md. Runs every step even if an earlier one fails; the
# exit status is 1 if any step failed. Budget: under 6 minutes on an H200 (per-step timeouts).
set -u

cd "$(dirname "$0")/.." || exit 1
OUT_DIR="${1:-${OUT:-./out}}"
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
SCRATCH="$(mktemp -d "${TMPDIR:-/tmp}/mtpkern-gpu.XXXXXX")"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"   # the checkout, installed or not
export NUMBA_CACHE_DIR="$SCRATCH/numba"
export CUPY_CACHE_DIR="$SCRATCH/cupy"                  # one compile per family, shared by every step
export PYTHONDONTWRITEBYTECODE=1
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"

START=$(date +%s)
STATUS=0
: > "$OUT_DIR/status.txt"

log() {
  echo "[gpu_check +$(( $(date +%s) - START ))s] $*" | tee -a "$OUT_DIR/gpu_check.log"
}

# step NAME LIMIT_S COMMAND...: run with a timeout, keep its output, record its status, go on.
step() {
  local name="$1" limit="$2"
  shift 2
  local t0=$(date +%s)
  log "start $name (limit ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@" > "$OUT_DIR/$name.log" 2>&1
  local rc=$?
  [ "$rc" -eq 124 ] && echo "TIMEOUT after ${limit}s" >> "$OUT_DIR/$name.log"
  log "end $name: rc $rc after $(( $(date +%s) - t0 ))s"
  tail -n 25 "$OUT_DIR/$name.log"
  echo "$name $rc" >> "$OUT_DIR/status.txt"
  [ "$rc" -eq 0 ] || STATUS=1
}

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv 2>&1 || true
  "$PY" -c 'import sys, numpy, cupy; print("python", sys.version.split()[0], "numpy", numpy.__version__, "cupy", cupy.__version__); print("devices", cupy.cuda.runtime.getDeviceCount())' 2>&1 || true
} > "$OUT_DIR/device.txt"
cat "$OUT_DIR/device.txt"

step gpu_tests 140 "$PY" -m pytest -q -m gpu -p no:cacheprovider --tb=short \
  --ignore=tests/test_ops_backends.py --junitxml="$OUT_DIR/gpu_tests.xml" tests/
step op_tests 45 "$PY" -m pytest -q -p no:cacheprovider --tb=short \
  --junitxml="$OUT_DIR/op_tests.xml" tests/test_ops_backends.py -k cuda
step bench 135 "$PY" benchmarks/gpu_bench.py --out "$OUT_DIR" --budget-s 120

log "done: status $STATUS; results in $OUT_DIR"
rm -rf "$SCRATCH"
exit "$STATUS"
