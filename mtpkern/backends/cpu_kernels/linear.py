"""Dense projection on the CPU, and the GEMV core every other family reuses.

Weights arrive either as BF16 bits (``uint16``, the top half of an FP32) or as
FP32; ``widen`` turns one element of either into FP32 inside the loops, and
Numba compiles one specialisation per weight dtype.

Decode is n = 1..8 input rows against weights of several MB: memory-bound.
So the loops run weight rows outer and input rows inner, and each pass over a
weight row serves up to 4 input rows from registers (``_dot_2x4``: 2 weight rows
x 4 input rows = 8 accumulators, 6 loads per 8 multiply-adds).

Large n (prefill chunks) is compute-bound and OpenBLAS sgemm is faster there,
but only FP32 weights go to it (the ``linear`` launcher, n >= 256): widening
BF16 for BLAS ate the gain below n = 512, and every switch between the
OpenBLAS and Numba thread pools stalls (both spin-wait; on 2 cores a
[4096, 1024] n=8 linear went from 0.8 ms to 8 ms when alternated with a tiny sgemm).

Floating-point flags: every kernel is ``fastmath=False`` except the ``_dot_*``
helpers, which allow ``reassoc`` and ``contract`` and nothing else. Without
``reassoc`` LLVM cannot vectorise an FP reduction (and Numba leaves the SLP
vectoriser off), so a scalar loop with 8 manual accumulators ran a
[4096, 1024] BF16 GEMV in 1.7 ms against 0.28 ms vectorised (2 cores). Only the
summation order changes (and FMA rounding, which is more accurate); NaN and
Inf keep IEEE semantics (no ``nnan`` / ``ninf``).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

_DOT_FLAGS = {"reassoc", "contract"}


@intrinsic
def widen(typingctx, v):
    """One weight element -> FP32: BF16 bits (uint16) shift into the top half
    of an FP32 word; FP32 passes through."""
    if v == types.uint16:
        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            word = builder.shl(builder.zext(args[0], i32), ir.Constant(i32, 16))
            return builder.bitcast(word, ir.FloatType())

        return types.float32(v), codegen
    if v == types.float32:
        def codegen(context, builder, sig, args):
            return args[0]

        return types.float32(v), codegen
    return None


# -- dot products: weight rows (j0, j1) of w[:, k0:k0+K] against input rows of x [*, K] ----
# Rows are sliced to 1-D views first: indexing w[j0, k0 + k] in the loop would
# carry Numba's negative-index wraparound per element and stop vectorisation
# (2.5 ms instead of 0.63 ms for a [4096, 1024] BF16 GEMV on one core).

@njit(cache=True, fastmath=_DOT_FLAGS)
def _dot_1x1(w, j, k0, x, i):
    wa, x0 = w[j, k0:], x[i]
    a0 = np.float32(0.0)
    for k in range(x0.shape[0]):
        a0 += widen(wa[k]) * x0[k]
    return a0


@njit(cache=True, fastmath=_DOT_FLAGS)
def _dot_2x4(w, j0, j1, k0, x, i):
    wa, wb = w[j0, k0:], w[j1, k0:]
    x0, x1, x2, x3 = x[i], x[i + 1], x[i + 2], x[i + 3]
    a0 = np.float32(0.0)
    a1 = np.float32(0.0)
    a2 = np.float32(0.0)
    a3 = np.float32(0.0)
    b0 = np.float32(0.0)
    b1 = np.float32(0.0)
    b2 = np.float32(0.0)
    b3 = np.float32(0.0)
    for k in range(x0.shape[0]):
        u = widen(wa[k])
        v = widen(wb[k])
        a0 += u * x0[k]
        a1 += u * x1[k]
        a2 += u * x2[k]
        a3 += u * x3[k]
        b0 += v * x0[k]
        b1 += v * x1[k]
        b2 += v * x2[k]
        b3 += v * x3[k]
    return a0, a1, a2, a3, b0, b1, b2, b3


@njit(cache=True, fastmath=False)
def _put(y, i, c, v, accumulate):
    if accumulate:
        y[i, c] += v
    else:
        y[i, c] = v


@njit(cache=True, fastmath=False)
def gemv_rows(w, j0, j1, k0, x, i0, i1, y, c0, c1, accumulate):
    """For input rows i0..i1 of x [*, K]:
    ``y[i, c0] (+)= w[j0, k0:k0+K] . x[i]`` and, when ``j1 >= 0``, likewise
    ``y[i, c1]`` for weight row j1. Both weight rows are read once for all rows.
    A lone row (``j1 < 0``) runs as the pair (j0, j0): its second read hits L1,
    and the GEMV core every kernel inlines stays two functions.

    Numba compiles a copy of a function per argument type, and a literal
    argument (``0``, ``False``) is a type of its own: callers pass
    ``np.int64(0)`` / ``np.bool_(False)``, and the indices are cast to int64
    before the ``_dot_*`` calls (a uint64 prange index is another type), so each
    weight dtype compiles one copy (left to literals, ``_dot_2x4`` was compiled
    16 times for the ops of this backend)."""
    pair = j1 >= 0
    j0 = np.int64(j0)
    j1 = np.int64(j1) if pair else j0
    k0 = np.int64(k0)
    i = np.int64(i0)
    while i + 4 <= i1:
        a0, a1, a2, a3, b0, b1, b2, b3 = _dot_2x4(w, j0, j1, k0, x, i)
        _put(y, i, c0, a0, accumulate)
        _put(y, i + 1, c0, a1, accumulate)
        _put(y, i + 2, c0, a2, accumulate)
        _put(y, i + 3, c0, a3, accumulate)
        if pair:
            _put(y, i, c1, b0, accumulate)
            _put(y, i + 1, c1, b1, accumulate)
            _put(y, i + 2, c1, b2, accumulate)
            _put(y, i + 3, c1, b3, accumulate)
        i += 4
    while i < i1:
        # One weight row at a time: a single stream per dot streams faster than the
        # interleaved pair (19 vs 14 GB/s for a [32768, 1024] BF16 LM head, n = 1).
        _put(y, i, c0, _dot_1x1(w, j0, k0, x, i), accumulate)
        if pair:
            _put(y, i, c1, _dot_1x1(w, j1, k0, x, i), accumulate)
        i += 1


@njit(cache=True, fastmath=False, parallel=True)
def linear_kernel(x, w, bias, residual, out):
    """out [n, N] = x [n, K] @ w[N, K].T (+ bias [N] unless empty) (+ residual [n, N] unless empty).

    One task per pair of weight rows; tasks split evenly over the threads."""
    n = x.shape[0]
    N = w.shape[0]
    has_bias = bias.shape[0] > 0
    has_res = residual.shape[0] > 0
    zero, no = np.int64(0), np.bool_(False)          # typed, not literal: see gemv_rows
    for p in prange((N + 1) // 2):
        j0 = 2 * p
        j1 = j0 + 1 if j0 + 1 < N else -1
        gemv_rows(w, j0, j1, zero, x, zero, n, out, j0, j1, no)
        for j in range(j0, j0 + 2 if j1 >= 0 else j0 + 1):
            for i in range(n):
                y = out[i, j]
                if has_bias:
                    y = y + bias[j]                  # same order as the reference:
                if has_res:
                    y = y + residual[i, j]           # (x @ w.T + bias) + residual
                out[i, j] = y
