#!/usr/bin/env bash
# Run the emulated CUDA kernel tests (tests/test_cuda_emulated.py) with emulator options.
#
#   tests/cuda_emu/run.sh [--asan] [--contract] [--order forward|reverse|shuffle] [--seed N] [pytest args...]
#
#   --asan    build the kernels with -fsanitize=address,undefined (a separate cached build)
#             and preload the ASan runtime into Python, which is not built with it;
#             a sanitizer report aborts the run (ASAN_OPTIONS / UBSAN_OPTIONS are kept)
#   --contract  build the kernels with floating-point contraction on (-ffp-contract=fast -mfma,
#             as NVRTC fuses multiply-adds; a separate cached build; needs a CPU with FMA);
#             the tests that depend on unfused rounding are listed in docs/testing.md
#   --order   order of the blocks of a grid and of the threads between synchronisation
#             points (default forward); --seed picks the shuffle
#   pytest args: tests/test_cuda_emulated.py unless a test path is given; add e.g. -m slow,
#             -k attention, -x
#
# PYTHON selects the interpreter (default: python3). Builds are cached in
# $MTPKERN_CUDA_EMU_CACHE, else ~/.cache/mtpkern/cuda_emu.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-python3}"
while [ $# -gt 0 ]; do
  case "$1" in
    --asan) export MTPKERN_CUDA_EMU_ASAN=1; shift ;;
    --contract) export MTPKERN_CUDA_EMU_CONTRACT=1; shift ;;
    --order) export MTPKERN_CUDA_EMU_ORDER="$2"; shift 2 ;;
    --seed) export MTPKERN_CUDA_EMU_SEED="$2"; shift 2 ;;
    *) break ;;
  esac
done
if [ "${MTPKERN_CUDA_EMU_ASAN:-0}" = 1 ]; then
  CXX_="${CXX:-g++}"
  LD_PRELOAD="$("$CXX_" -print-file-name=libasan.so) $("$CXX_" -print-file-name=libubsan.so)${LD_PRELOAD:+ $LD_PRELOAD}"
  export LD_PRELOAD
  # Python's own allocations are never freed at exit: leak reports would be noise.
  export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=0}"
  export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1}"
fi
case " $* " in
  *" tests"*|*.py*) ;;
  *) set -- "$@" tests/test_cuda_emulated.py ;;
esac
exec "$PY" -m pytest -p no:cacheprovider "$@"
