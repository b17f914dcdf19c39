#!/usr/bin/env bash
# GPU checks for a device machine: no network, no install, under 8 minutes in all (docs/cuda.md,
# "On a device: scripts/gpu_check.sh").
#
#   bash scripts/gpu_check.sh [OPTIONS] [OUT_DIR]          OUT_DIR: default $OUT, else ./out
#
#   --steps LIST          which of smoke,profile,tests,bench to run, in the order given (default
#                         smoke,profile,tests,bench); the probe always runs first
#   --limit STEP=SECONDS  a step's time limit (probe 20, smoke 60, profile 45, tests 150, bench 170 by
#                         default); the limits plus 5 s of grace each must add up to at most 470 s
#   --test-timeout S      pytest-timeout's per-test limit in the tests step (default 90)
#   --tests PATHS         what the tests step collects (default tests/; comma or space separated)
#   --bench-args ARGS     extra arguments for benchmarks/gpu_bench.py (e.g. "--no-mla")
#
# Steps, each under its own limit (timeout: SIGTERM, then SIGKILL 5 s later), each run whatever
# the previous one did:
#   probe   versions, the device, whether pytest-timeout is there (python + nvidia-smi)
#   smoke   scripts/gpu_smoke.py: each kernel family built and loaded, timed; a tiny proposer
#           on the device against the NumPy reference, phase by phase, under a watchdog that
#           prints every thread's stack every 20 s (a hung kernel or a slow build shows where)
#   profile Nsight Compute (ncu, --clock-control none) over scripts/gpu_attention_probe.py: paged
#           attention at GLM-4.5-Air's shapes, context 8192, one row; speed of light, occupancy,
#           warp states and scheduler statistics of the kernel and its merge ("ncu not found"
#           is a failed step, nothing more)
#   tests   ONE pytest process: every gpu-marked test (tests/test_gpu.py, the cuda cases of
#           tests/test_ops_backends.py, the rest), --timeout per test when pytest-timeout is there,
#           and faulthandler's stacks of a test still running 10 s before that (pytest-timeout's
#           signal cannot stop a test waiting inside a CUDA call; the stacks still show where)
#   bench   benchmarks/gpu_bench.py: kernels, proposes and the PyTorch eager peer, each row on
#           disk as soon as it is measured
# One python process per step (profile's under ncu), five in all: CuPy's disk cache cannot keep the kernels built
# with name_expressions, so each process that launches kernels (tests, bench) compiles every
# family it uses once with NVRTC.
#
# OUT_DIR gets eight plain files, nothing in subfolders (the device tool returns at most 8 files,
# at most 2 folders down): summary.txt (rewritten at every step's start and end: which steps ran,
# passed, failed, timed out; test counts; the propose table), gpu_check.log (the timeline and
# the probe), smoke.log, profile.log, tests.log, bench.log, gpu_bench.md and gpu_bench.jsonl (the benchmark's rows). A
# file over 15 MiB (the tool's per-file limit is 16) is gzipped in place at the end. The exit
# status is 1 if a step failed or timed out, 2 on a bad option.
set -u

cd "$(dirname "$0")/.." || exit 2
ROOT="$PWD"

usage() { sed -n '5,13p' "$0" | sed 's/^# \{0,1\}//'; }

STEPS="smoke,profile,tests,bench"
declare -A LIMIT=([probe]=20 [smoke]=60 [profile]=45 [tests]=150 [bench]=170)
KILL_AFTER=5
TOTAL_MAX=470
TEST_TIMEOUT=90
TEST_PATHS="tests/"
BENCH_ARGS=""
OUT_ARG=""
MAX_BYTES="${GPU_CHECK_MAX_BYTES:-15728640}"   # 15 MiB; a test sets it lower to see the gzip

die() { echo "gpu_check: $*" >&2; exit 2; }
is_int() { [[ "$1" =~ ^[0-9]+$ ]] && [ "$1" -ge 1 ]; }

while [ $# -gt 0 ]; do
  case "$1" in
    --steps) [ $# -ge 2 ] || die "--steps: expected a list of smoke,profile,tests,bench, got nothing"; STEPS="$2"; shift 2 ;;
    --limit)
      [ $# -ge 2 ] || die "--limit: expected STEP=SECONDS, got nothing"
      name="${2%%=*}"; secs="${2#*=}"
      [[ -n "$name" && -n "${LIMIT[$name]+x}" ]] || die "--limit: expected a step of probe, smoke, profile, tests, bench, got '$name'"
      is_int "$secs" || die "--limit: expected a whole number of seconds >= 1 for $name, got '$secs'"
      LIMIT[$name]="$secs"; shift 2 ;;
    --test-timeout)
      [ $# -ge 2 ] && is_int "$2" || die "--test-timeout: expected a whole number of seconds >= 1, got '${2:-}'"
      TEST_TIMEOUT="$2"; shift 2 ;;
    --tests) [ $# -ge 2 ] || die "--tests: expected paths, got nothing"; TEST_PATHS="${2//,/ }"; shift 2 ;;
    --bench-args) [ $# -ge 2 ] || die "--bench-args: expected arguments, got nothing"; BENCH_ARGS="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    -*) die "unknown option '$1' (--help lists them)" ;;
    *) [ -z "$OUT_ARG" ] || die "expected one OUT_DIR, got '$OUT_ARG' and '$1'"; OUT_ARG="$1"; shift ;;
  esac
done

RUN_STEPS=(probe)
for s in ${STEPS//,/ }; do
  case "$s" in
    smoke|profile|tests|bench) [[ " ${RUN_STEPS[*]} " == *" $s "* ]] || RUN_STEPS+=("$s") ;;
    probe) ;;                                   # always first
    *) die "--steps: expected names among smoke, profile, tests, bench, got '$s'" ;;
  esac
done
TOTAL=0
for s in "${RUN_STEPS[@]}"; do TOTAL=$(( TOTAL + LIMIT[$s] + KILL_AFTER )); done
[ "$TOTAL" -le "$TOTAL_MAX" ] || die "--limit: the steps' limits with ${KILL_AFTER} s of grace each add up to ${TOTAL} s, over the ${TOTAL_MAX} s the script may take (8 minutes less its own few seconds)"

command -v timeout > /dev/null || die "coreutils' timeout is not on PATH: every step runs under it"

OUT_DIR="${OUT_ARG:-${OUT:-./out}}"
mkdir -p "$OUT_DIR" || die "OUT_DIR: cannot create '$OUT_DIR'"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
FILES=(summary.txt gpu_check.log smoke.log profile.log tests.log bench.log gpu_bench.md gpu_bench.jsonl)
for f in "${FILES[@]}"; do rm -f "$OUT_DIR/$f" "$OUT_DIR/$f.gz"; done
SCRATCH="$(mktemp -d "${TMPDIR:-/tmp}/mtpkern-gpu.XXXXXX")" || die "cannot make a scratch directory"
trap 'rm -rf "$SCRATCH"' EXIT

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"   # the checkout, installed or not
export NUMBA_CACHE_DIR="$SCRATCH/numba"
export CUPY_CACHE_DIR="$SCRATCH/cupy"     # keeps ElementwiseKernels; name_expressions builds recompile per process
export MTPKERN_KERNEL_CACHE="$SCRATCH/kernels"  # the families' CUBINs: the smoke builds them, later steps load them
export PYTHONDONTWRITEBYTECODE=1
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"

START=$(date +%s)
STATUS=0
PY_STARTS=0
declare -A STATE ELAPSED
for s in probe smoke profile tests bench; do STATE[$s]="left out (--steps)"; ELAPSED[$s]="-"; done
for s in "${RUN_STEPS[@]}"; do STATE[$s]="not reached"; done
TIMEOUT_NOTE="not known yet (the probe decides)"
COMMIT="$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
DIRTY="$(git -C "$ROOT" status --porcelain 2>/dev/null | wc -l | tr -d ' ')"
[ "$COMMIT" = unknown ] || [ "$DIRTY" = 0 ] || COMMIT="$COMMIT (+$DIRTY uncommitted paths)"

log() {
  echo "[gpu_check +$(( $(date +%s) - START ))s] $*" | tee -a "$OUT_DIR/gpu_check.log"
}

# count PATTERN FILE: lines of FILE matching the extended regex PATTERN (0 when none or no file)
count() { local n; n=$(grep -cE -- "$1" "$2" 2>/dev/null); echo "${n:-0}"; }

RESULT_RE=' (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)( |$)'

tests_report() {
  local f="$OUT_DIR/tests.log"
  [ -f "$f" ] || { echo "tests: no log (the step did not run)"; return; }
  local p x s e final running
  p=$(count "^[^ ]+::.* PASSED( |$)" "$f"); x=$(count "^[^ ]+::.* FAILED( |$)" "$f")
  s=$(count "^[^ ]+::.* SKIPPED( |$)" "$f"); e=$(count "^[^ ]+::.* ERROR( |$)" "$f")
  final=$(grep -E '^=+ .* in [0-9.]+s.* =+$' "$f" | tail -n 1 | sed -E 's/^=+ //; s/ =+$//')
  echo "tests: $p passed, $x failed, $e errors, $s skipped (pytest: ${final:-no final line: the run was cut short})"
  local op_p op_x other_p other_x
  op_p=$(count "^[^ ]*test_ops_backends.py::.* PASSED( |$)" "$f"); op_x=$(count "^[^ ]*test_ops_backends.py::.* (FAILED|ERROR)( |$)" "$f")
  other_p=$((p - op_p)); other_x=$((x + e - op_x))
  echo "  op tests (tests/test_ops_backends.py, cuda cases): $op_p passed, $op_x failed; other gpu-marked tests: $other_p passed, $other_x failed"
  if [ -z "$final" ]; then
    running=$(grep -E '^[^ ]+::' "$f" | grep -vE "$RESULT_RE" | tail -n 1)
    [ -z "$running" ] || echo "  running when the step ended: $running"
  fi
  grep -E '^(FAILED|ERROR) [^ ]' "$f" | head -n 20 | sed 's/^/  /'
  if [ -z "$final" ]; then   # cut short: no summary; the failures printed as they happened, each with its first E line
    awk '/^-+ failure of .* printed as it happened -+$/ { sub(/^-+ failure of /, ""); sub(/, printed as it happened -+$/, "");
           name = $0; want = 1; next }
         want && /^E / { print "  failed: " name ": " substr($0, 1, 160); want = 0 }' "$f" | head -n 20
  fi
  local nf; nf=$(count '^(FAILED|ERROR) [^ ]' "$f")
  [ "$nf" -le 20 ] || echo "  ... and $((nf - 20)) more in tests.log"
}

smoke_report() {
  local f="$OUT_DIR/smoke.log"
  [ -f "$f" ] || { echo "smoke: no log (the step did not run)"; return; }
  echo "smoke:"
  grep -E '^\[gpu_smoke ' "$f" | sed -E 's/^\[gpu_smoke +\+ *([0-9.]+)s\] /  +\1s /' | cut -c1-200 | tail -n 40
  local dumps; dumps=$(count '^Timeout \(' "$f")
  [ "$dumps" = 0 ] || echo "  the watchdog printed the stacks $dumps time(s) (smoke.log): a phase ran past 20 s"
}

profile_report() {
  local f="$OUT_DIR/profile.log"
  [ -f "$f" ] || { echo "profile: no log (the step did not run)"; return; }
  echo "profile (profile.log; the lines naming a kernel, its duration, throughput, occupancy and stalls):"
  grep -E '^ *(paged_attention|  *(Duration|Memory Throughput|DRAM Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Theoretical Occupancy|Warp Cycles Per Issued Instruction|Issued Warp Per Scheduler|No Eligible|Registers Per Thread|Dynamic Shared Memory Per Block|Grid Size|Waves Per SM|SM Frequency|DRAM Frequency))|^plan: |^launch |ncu not found|==ERROR==|==PROF==' "$f" \
    | cut -c1-160 | head -n 60 | sed 's/^/  /'
}

bench_report() {
  local j="$OUT_DIR/gpu_bench.jsonl" md="$OUT_DIR/gpu_bench.md"
  [ -f "$j" ] || { echo "bench: no gpu_bench.jsonl (the step did not run, or stopped before its first record)"; return; }
  local k pr t er end
  k=$(count '"kind": "kernel"' "$j"); pr=$(count '"kind": "propose"' "$j")
  t=$(count '"kind": "propose".*"torch_median_us"' "$j"); er=$(count '"kind": "error"' "$j")
  end=$(grep '"kind": "end"' "$j" | sed -E 's/.*"rc": ([0-9-]+).*"stopped": ("[^"]*"|null).*/rc \1, stopped \2/')
  [ -n "$end" ] && end="end record: $end" || end="no end record (killed before it)"
  echo "bench: $k kernel rows, $pr propose rows ($t beside the torch peer), $er error(s); $end"
  grep '"kind": "error"' "$j" | head -n 5 | sed -E 's/.*"message": "(.*)", "t_s".*/  error: \1/'
  grep -E '^torch: ' "$md" 2>/dev/null | head -n 1 | cut -c1-160 | sed 's/^/  /'
  if grep -q '^## propose_batch' "$md" 2>/dev/null; then
    echo
    awk '/^## propose_batch/ { print; on = 1; next } on && /^\|/ { print; seen = 1; next } seen { exit }' "$md"
  fi
}

summary_text() {
  echo "mtpkern gpu_check: $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $COMMIT, +$(( $(date +%s) - START ))s"
  [ -f "$SCRATCH/probe.txt" ] && sed 's/^/  /' "$SCRATCH/probe.txt"
  echo "per-test timeout: $TIMEOUT_NOTE"
  echo "python processes started: $PY_STARTS (one per step; tests and bench each compile every kernel family they use once, NVRTC)"
  echo
  printf '%-6s %6s %8s  %s\n' step limit elapsed result
  local s
  for s in probe smoke profile tests bench; do
    if [[ " ${RUN_STEPS[*]} " == *" $s "* ]]; then
      printf '%-6s %5ss %8s  %s\n' "$s" "${LIMIT[$s]}" "${ELAPSED[$s]}" "${STATE[$s]}"
    else
      printf '%-6s %6s %8s  %s\n' "$s" - - "${STATE[$s]}"
    fi
  done
  printf '%-6s %5ss %7ss  %s\n' all "$TOTAL" "$(( $(date +%s) - START ))" "(limits with ${KILL_AFTER} s grace each; the script's own time)"
  echo
  [[ " ${RUN_STEPS[*]} " == *" smoke "* ]] && smoke_report && echo
  [[ " ${RUN_STEPS[*]} " == *" profile "* ]] && profile_report && echo
  [[ " ${RUN_STEPS[*]} " == *" tests "* ]] && tests_report && echo
  [[ " ${RUN_STEPS[*]} " == *" bench "* ]] && bench_report && echo
  echo "files in OUT_DIR: $(cd "$OUT_DIR" && find . -type f | sed 's|^\./||' | sort | tr '\n' ' ')"
}

write_summary() {
  summary_text > "$SCRATCH/summary.txt" 2>&1
  cp "$SCRATCH/summary.txt" "$OUT_DIR/summary.txt"
}

# step NAME LOG COMMAND...: run under the step's limit, output to LOG, record the result, go on.
step() {
  local name="$1" logf="$2"
  shift 2
  local limit="${LIMIT[$name]}" t0 rc dt
  STATE[$name]="running"
  PY_STARTS=$((PY_STARTS + 1))
  write_summary
  local shown=() a
  for a in "$@"; do [[ "$a" == *$'\n'* ]] && shown+=("<inline script>") || shown+=("$a"); done
  log "start $name (limit ${limit}s): ${shown[*]}"
  t0=$(date +%s)
  timeout --kill-after="$KILL_AFTER" "$limit" "$@" > "$logf" 2>&1 < /dev/null
  rc=$?
  dt=$(( $(date +%s) - t0 ))
  ELAPSED[$name]="${dt}s"
  if [ "$rc" -eq 0 ]; then
    STATE[$name]="passed"
  elif [ "$rc" -eq 124 ] || { [ "$rc" -eq 137 ] && [ "$dt" -ge "$limit" ]; }; then
    STATE[$name]="timed out (stopped at its ${limit}s limit, rc $rc)"
    printf '\n[gpu_check] TIMEOUT: %s stopped at its %ss limit (rc %s)\n' "$name" "$limit" "$rc" >> "$logf"
  else
    STATE[$name]="failed (rc $rc)"
  fi
  [ "$rc" -eq 0 ] || STATUS=1
  log "end $name: ${STATE[$name]} after ${dt}s"
  write_summary
}

PROBE_PY=$(cat <<'PYEOF'
import importlib
import importlib.metadata
import sys

print("python:", sys.version.split()[0], sys.executable)
ok = False
for name in ("numpy", "cupy", "numba", "torch", "pytest", "pytest_timeout"):
    label = name.replace("_", "-")
    try:
        m = importlib.import_module(name)
    except Exception as e:
        print(f"{label}: absent ({type(e).__name__}: {e})")
        continue
    version = getattr(m, "__version__", None)
    if not isinstance(version, str):
        try:
            version = importlib.metadata.version(label)
        except Exception:
            version = "?"
    line = f"{label}: {version}"
    try:
        if name == "cupy":
            rt = m.cuda.runtime
            n = rt.getDeviceCount()
            p = rt.getDeviceProperties(0) if n else {}
            dev = p.get("name", b"?")
            dev = dev.decode() if isinstance(dev, bytes) else dev
            line += (f"; {n} device(s): {dev}, sm_{p.get('major')}{p.get('minor')}, "
                     f"{p.get('multiProcessorCount')} SMs; CUDA runtime {rt.runtimeGetVersion()}, "
                     f"driver {rt.driverGetVersion()}, NVRTC {m.cuda.nvrtc.getVersion()}")
            ok = n > 0
        elif name == "torch":
            line += f"; CUDA {m.version.cuda}, {m.cuda.device_count() if m.cuda.is_available() else 0} device(s)"
    except Exception as e:
        line += f"; no device ({type(e).__name__}: {e})"
    print(line)
sys.exit(0 if ok else 1)
PYEOF
)

log "mtpkern gpu_check, commit $COMMIT; out $OUT_DIR; steps ${RUN_STEPS[*]} (limits: $(for s in "${RUN_STEPS[@]}"; do printf '%s %ss ' "$s" "${LIMIT[$s]}"; done)= ${TOTAL}s with grace)"

# -- probe ---------------------------------------------------------------------------------------
step probe "$SCRATCH/probe.txt" "$PY" -c "$PROBE_PY"
{ echo "nvidia-smi: $(timeout 10 nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv,noheader 2>&1 | head -n 2 | tr '\n' ' ')"; } >> "$SCRATCH/probe.txt"
# the clocks now, and why they are held down (each its own query: an unknown field fails the whole query)
clocks_now() {
  echo "clocks $1: $(timeout 10 nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader 2>&1 | head -n 1); reasons: $(timeout 10 nvidia-smi --query-gpu=clocks_throttle_reasons.active --format=csv,noheader 2>&1 | head -n 1)"
}
clocks_now "at the probe (idle)" >> "$SCRATCH/probe.txt"
cat "$SCRATCH/probe.txt" | tee -a "$OUT_DIR/gpu_check.log"
if grep -q '^pytest-timeout: ' "$SCRATCH/probe.txt" && ! grep -q '^pytest-timeout: absent' "$SCRATCH/probe.txt"; then
  TIMEOUT_ARGS=(--timeout="$TEST_TIMEOUT" -o "faulthandler_timeout=$(( TEST_TIMEOUT > 20 ? TEST_TIMEOUT - 10 : TEST_TIMEOUT ))")
  TIMEOUT_NOTE="${TEST_TIMEOUT} s a test (pytest-timeout $(sed -n 's/^pytest-timeout: //p' "$SCRATCH/probe.txt")), then the step's limit"
else
  # without the plugin: faulthandler dumps the stacks of a test slower than the limit (it does not stop it)
  TIMEOUT_ARGS=(-p no:timeout -o "faulthandler_timeout=$TEST_TIMEOUT")
  TIMEOUT_NOTE="none: pytest-timeout is not importable, so the tests run without per-test limits (stacks dumped after ${TEST_TIMEOUT} s; the step's limit stops them)"
fi
log "per-test timeout: $TIMEOUT_NOTE"

run_smoke() {
  step smoke "$OUT_DIR/smoke.log" "$PY" scripts/gpu_smoke.py --watchdog-s 20
  [ "${STATE[smoke]}" = passed ] || tail -n 12 "$OUT_DIR/smoke.log"
}

run_profile() {
  local ncu
  ncu="$(command -v ncu || ls -d /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -n 1)"
  if [ -z "$ncu" ]; then
    echo "ncu not found (PATH, /opt/nvidia/nsight-compute/*/ncu, /usr/local/cuda/bin/ncu)" > "$OUT_DIR/profile.log"
    STATE[profile]="failed (ncu not found)"; ELAPSED[profile]="0s"; STATUS=1
    log "profile: ncu not found"
    return
  fi
  # the kernel and its merge, the third and fourth launches (the first two load and warm)
  step profile "$OUT_DIR/profile.log" "$ncu" --clock-control none -k regex:paged_attention --launch-skip 4 \
    --launch-count 2 --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
    --section SchedulerStats --section MemoryWorkloadAnalysis "$PY" scripts/gpu_attention_probe.py --launches 4
  [ "${STATE[profile]}" = passed ] || tail -n 12 "$OUT_DIR/profile.log"
}

run_tests() {
  # shellcheck disable=SC2086  # TEST_PATHS: the paths, split
  # --continue-on-collection-errors: a test module that cannot import there (a package's version)
  # is one error, not the end of every gpu test
  # MTPKERN_PRINT_FAILURES (tests/conftest.py): each failure printed when its test ends, so a step cut
  # short still shows why; the "device" hypothesis profile reports a failing example unshrunk
  MTPKERN_PRINT_FAILURES=1 COLUMNS=200 step tests "$OUT_DIR/tests.log" "$PY" -m pytest -v -m gpu -p no:cacheprovider \
    --tb=short -rfE --hypothesis-profile=device \
    --durations=15 -o console_output_style=classic --continue-on-collection-errors "${TIMEOUT_ARGS[@]}" $TEST_PATHS
  [ "${STATE[tests]}" = passed ] || tail -n 12 "$OUT_DIR/tests.log"
}

run_bench() {
  local budget=$(( LIMIT[bench] > 60 ? LIMIT[bench] - 30 : LIMIT[bench] / 2 ))   # its sections' deadlines, inside the limit
  # shellcheck disable=SC2086  # BENCH_ARGS: the arguments, split
  step bench "$OUT_DIR/bench.log" "$PY" benchmarks/gpu_bench.py --out "$OUT_DIR" --budget-s "$budget" $BENCH_ARGS
  [ "${STATE[bench]}" = passed ] || tail -n 12 "$OUT_DIR/bench.log"
}

for s in "${RUN_STEPS[@]:1}"; do "run_$s"; done

# -- the files' contract: flat, at most 8, each under the tool's 16 MiB ---------------------------
log "$(clocks_now "after the last step")"
log "done: status $STATUS after $(( $(date +%s) - START ))s; results in $OUT_DIR"
write_summary                               # read from the plain logs, before any is gzipped
GZIPPED=""
for f in "${FILES[@]:1}"; do                # all but summary.txt, which stays small and plain
  p="$OUT_DIR/$f"
  if [ -f "$p" ] && [ "$(wc -c < "$p")" -gt "$MAX_BYTES" ]; then
    gzip -f -9 "$p" && GZIPPED="$GZIPPED$f " && echo "[gpu_check] gzipped $f (over $MAX_BYTES bytes): $f.gz"
  fi
done
[ -z "$GZIPPED" ] || echo "gzipped (over $MAX_BYTES bytes) after the summary above was written: $GZIPPED; files now: $(cd "$OUT_DIR" && find . -type f | sed 's|^\./||' | sort | tr '\n' ' ')" >> "$OUT_DIR/summary.txt"
NFILES=$(find "$OUT_DIR" -type f | wc -l | tr -d ' ')
DEEP=$(find "$OUT_DIR" -mindepth 4 -type f | wc -l | tr -d ' ')
if [ "$NFILES" -gt 8 ] || [ "$DEEP" -gt 0 ]; then
  echo "WARNING: $NFILES files in $OUT_DIR ($DEEP more than 2 folders down): the device tool returns 8, at most 2 folders down" | tee -a "$OUT_DIR/summary.txt"
fi
echo
[ -f "$OUT_DIR/gpu_bench.md" ] && cat "$OUT_DIR/gpu_bench.md" && echo
cat "$OUT_DIR/summary.txt"
exit "$STATUS"
