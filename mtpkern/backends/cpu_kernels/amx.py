"""Intel AMX BF16 tiles for the CPU LM head's screening pass (Numba intrinsics).

On a core with AMX (``amx_bf16``: Sapphire Rapids and later) one ``tdpbf16ps`` multiplies a
16 x 32 BF16 tile by a 32 x 16 one into FP32 sums: 8192 multiply-adds an instruction, where a
vector FMA does 16. At 8 input rows the LM head on the FMA tiles (``gemv_tiles``) is bound by
its multiply-adds on 2 cores (its weights widened from BF16 on the FMA ports), not by its bytes.
``lm_head.lm_head_argmax_screened_kernel`` uses these tiles to screen the vocabulary with the
input rows rounded to BF16, then computes the few tokens that may still be a row's best on the
FMA tiles: its result is the FMA kernel's, bit for bit (docs/cpu.md, "The LM head's AMX screen").

The layout: the weights are the A tile as stored (a ``group8`` task's 8 rows a stride apart,
one row repeated with stride 0), so nothing is repacked at load; the input rows, rounded to
BF16, are the B tile in AMX's pairs layout (``pack_bf16``), one column a row (at most 16 rows).
Every product is exact in FP32 (8 x 8 bits); AMX reads BF16 denormals as zero and flushes
FP32 denormal sums, both inside the bounds ``pack_bf16`` returns.

The tile state is per thread and must be configured (``tile_config``, 64 bytes: ``config``)
before any other tile instruction and released after (``tile_release``); that costs about a
microsecond, so a kernel configures once per parallel iteration, not per task. Linux grants
a process the tile state only on request (``arch_prctl``, ``ARCH_REQ_XCOMP_PERM``);
``available()`` asks once and says whether these kernels may run. ``MTPKERN_CPU_AMX=0``
turns them off (the FMA tiles run alone).

Tiles: 0 the sums (C), 1 the weights (A), 2 the inputs (B).
"""


from __future__ import annotations

import ctypes
import functools
import os
import platform

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from .gemv_tiles import PREFETCH_BYTES
from .simd import emit_prefetch

#: ``MTPKERN_CPU_AMX=0`` keeps the cpu backend on its FMA tiles
ENV = "MTPKERN_CPU_AMX"

#: input rows a B tile holds (16 columns of 4 bytes: a BF16 pair each)
MAX_ROWS = 16
#: weight columns an A tile holds (64 bytes of BF16 a row)
COLS_PER_STEP = 32

_SYS_ARCH_PRCTL = 158
_ARCH_GET_XCOMP_PERM = 0x1022
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18

_I8P = ir.IntType(8).as_pointer()
_I64 = ir.IntType(64)
_VOID = ir.VoidType()


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """Whether the AMX kernels may run in this process: not turned off by ``MTPKERN_CPU_AMX=0``,
    an x86-64 Linux whose CPU has ``amx_tile`` and ``amx_bf16``, the kernel granted this process
    the tile state, and LLVM can assemble the instructions. Asked once per process."""
    if os.environ.get(ENV, "1") == "0":
        return False
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    if not {"amx_tile", "amx_bf16"} <= _cpu_flags():
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) != 0:
            return False
        granted = ctypes.c_uint64(0)
        if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_GET_XCOMP_PERM, ctypes.byref(granted)) != 0:
            return False
        if not (granted.value >> _XFEATURE_XTILEDATA) & 1:
            return False
        from llvmlite import binding
        binding.initialize_native_asmparser()       # inline assembly needs the target's parser
    except (OSError, AttributeError, RuntimeError):
        return False
    return True


@functools.lru_cache(maxsize=None)
def config(n: int) -> np.ndarray:
    """The 64-byte tile configuration for ``n`` input rows (1 .. ``MAX_ROWS``): C (tile 0) 8
    weight rows of n FP32 sums, A (tile 1) 8 weight rows of 32 BF16 columns, B (tile 2) 16
    pairs of rows of n columns. Read-only: shared by every call. (A configuration the
    instructions do not accept, such as C and A of different row counts, raises SIGILL at the
    first ``tdpbf16ps``: tests/test_cpu_amx.py runs these.)"""
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_ROWS:
        raise ValueError(f"n: expected an int 1 .. {MAX_ROWS}, got {n!r}")
    c = np.zeros(64, np.uint8)
    c[0] = 1                                        # palette 1
    colsb = c[16:32].view(np.uint16)                # bytes a row, per tile
    rows = c[48:56]
    for t, width, height in ((0, 4 * n, 8), (1, 64, 8), (2, 4 * n, 16)):
        colsb[t], rows[t] = width, height
    c.flags.writeable = False
    return c


def _addr(context, builder, aty, arr, off):
    a = context.make_array(aty)(context, builder, arr)
    return builder.bitcast(builder.gep(a.data, [context.cast(builder, off[0], off[1], types.intp)]), _I8P)


def _asm(builder, text, constraint="", args=()):
    builder.asm(ir.FunctionType(_VOID, [a.type for a in args]), text, constraint, list(args), side_effect=True)


@intrinsic
def tile_config(typingctx, cfg):
    """``ldtilecfg``: this thread's tiles take the shapes of ``cfg`` (``config``), zeroed."""
    if not (isinstance(cfg, types.Array) and cfg.dtype == types.uint8):
        return None

    def codegen(context, builder, sig, args):
        _asm(builder, "ldtilecfg ($0)", "r,~{memory}",
             [_addr(context, builder, sig.args[0], args[0], (ir.Constant(_I64, 0), types.int64))])
        return context.get_dummy_value()

    return types.void(cfg), codegen


def _make_op(text: str, constraint: str = ""):
    """An intrinsic of no arguments running the instruction ``text``."""
    @intrinsic
    def op(typingctx):
        def codegen(context, builder, sig, args):
            _asm(builder, text, constraint)
            return context.get_dummy_value()

        return types.void(), codegen

    return op


#: ``tilerelease``: this thread's tile state back to its initial (unused) state
tile_release = _make_op("tilerelease", "~{memory}")


def make_zero(t: int):
    """``tilezero``: tile t <- 0."""
    return _make_op(f"tilezero %tmm{t}")


def make_rows(text: str):
    """An intrinsic ``(arr, off, stride)`` running the tile load or store ``text`` (``$0``: the
    address of ``arr``'s flat element ``off``, ``$1``: ``stride``, the bytes between rows)."""
    @intrinsic
    def rows(typingctx, arr, off, stride):
        if not (isinstance(arr, types.Array) and arr.layout == "C" and isinstance(off, types.Integer)
                and isinstance(stride, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            p = _addr(context, builder, sig.args[0], args[0], (args[1], sig.args[1]))
            s = context.cast(builder, args[2], sig.args[2], types.int64)
            _asm(builder, text, "r,r,~{memory}", [p, s])
            return context.get_dummy_value()

        return types.void(arr, off, stride), codegen

    return rows


def make_dot(c: int, a: int, b: int):
    """``tdpbf16ps``: tile c += tile a (BF16) x tile b (BF16 pairs), in FP32."""
    return _make_op(f"tdpbf16ps %tmm{b}, %tmm{a}, %tmm{c}")


@intrinsic
def prefetch(typingctx, arr, off):
    """Ask for the cache line of ``arr``'s flat element ``off`` (into L2: ``simd.emit_prefetch``).
    A hint: an address past the array is never read, and no result depends on it."""
    if not (isinstance(arr, types.Array) and isinstance(off, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        a = context.make_array(sig.args[0])(context, builder, args[0])
        emit_prefetch(builder, a.data, context.cast(builder, args[1], sig.args[1], types.intp))
        return context.get_dummy_value()

    return types.void(arr, off), codegen


zero_c = make_zero(0)
# tile 1 / 2 <- rows of memory; tile 0 -> rows of memory
load_a, load_b = make_rows("tileloadd ($0,$1,1), %tmm1"), make_rows("tileloadd ($0,$1,1), %tmm2")
store_c = make_rows("tilestored %tmm0, ($0,$1,1)")
dot_c = make_dot(0, 1, 2)


@njit(cache=True, fastmath=False)
def task_dots(w, a_off, a_stride, xb, c, c_off, c_stride):
    """One task: the 8 weight rows at flat element a_off of w (BF16 bits [*, K]), ``a_stride``
    bytes apart, against the n packed input rows xb (``pack_bf16``), over K = 2 xb.shape[0]
    columns (a multiple of 32), one ``tdpbf16ps`` a step of 32 columns in order; the [8, n]
    sums stored into c from flat element c_off, a row every ``c_stride`` bytes. Each step asks
    for the line ``PREFETCH_BYTES`` ahead in each weight row, as the FMA tiles do: a row's
    stream continues into the next task's row across a 4 KiB page, where the hardware
    prefetcher stops (the head from DRAM, 8 rows: 2.30-2.57 ms against 2.54-2.76 without; from
    L3 the same). The caller has configured this thread's tiles with ``config(n)``."""
    n = xb.shape[1]
    K = xb.shape[0] * 2
    bstride = n * 4
    row = a_stride // 2                              # elements from one weight row to the next
    ahead = PREFETCH_BYTES // 2
    zero_c()
    for j in range(K // COLS_PER_STEP):
        for s in range(8):                           # each row's line PREFETCH_BYTES ahead
            prefetch(w, a_off + s * row + j * COLS_PER_STEP + ahead)
        load_b(xb, j * 16 * n * 2, bstride)
        load_a(w, a_off + j * COLS_PER_STEP, a_stride)
        dot_c()
    store_c(c, c_off, c_stride)


@njit(cache=True, fastmath=False)
def pack_bf16(x, xb, err):
    """x [n, K] FP32 -> xb [K / 2, n, 2] uint16: each value rounded to the nearest BF16 x~ (ties
    to even; a denormal result flushed to 0, as the tiles read it), in AMX's pairs layout
    (B[kp, i, p] = row i's value at k = 2 kp + p); and err [n, 2] float64, the bounds of
    ``lm_head.lm_head_argmax_screened_kernel``: a tile sum of weight row w and row i is within
    ||w||_2 err[i, 0] + err[i, 1] of the FMA tiles' dot of w and x_i, with
    err[i, 0] = ||x - x~||_2 + g (||x||_2 + ||x~||_2) (g = K u / (1 - K u), u = 2^-24: both
    sums' rounding, in any order) and err[i, 1] = 2^-126 (||x~||_1 + 2 K) (the weights AMX
    reads as 0 and the sums it flushes). Returns False when some value is not finite or
    rounds to an infinity (the caller then takes the FMA tiles alone)."""
    n, K = x.shape
    xu = x.view(np.uint32)
    word = np.empty(1, np.uint32)
    wordf = word.view(np.float32)
    u = 2.0 ** -24
    g = K * u / (1.0 - K * u)
    for i in range(n):
        d2, x2, t2, t1 = 0.0, 0.0, 0.0, 0.0
        for k in range(K):
            b = np.int64(xu[i, k])
            if (b & 0x7F800000) == 0x7F800000:
                return False
            r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
            if (r & 0x7F80) == 0x7F80:                   # rounded up to an infinity
                return False
            if (r & 0x7F80) == 0:                        # a BF16 denormal (or zero): the tiles read 0
                r = r & 0x8000
            word[0] = r << 16
            t = np.float64(wordf[0])
            v = np.float64(x[i, k])
            d2 += (v - t) * (v - t)
            x2 += v * v
            t2 += t * t
            t1 += abs(t)
            xb[k >> 1, i, k & 1] = r
        err[i, 0] = np.sqrt(d2) + g * (np.sqrt(x2) + np.sqrt(t2))
        err[i, 1] = 2.0 ** -126 * (t1 + 2 * K)
    return True
