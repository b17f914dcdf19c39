"""Dense projection on the CPU, and the GEMV core every other family reuses.

Weights arrive as BF16 bits (``uint16``, the top half of an FP32), as FP32, or
as FP8 E4M3 bytes (``uint8``, with scales: ``fp8_chunk`` below); ``widen``
turns one element of any of them into FP32 inside the loops, and Numba compiles
one specialisation per weight dtype.

Decode is n = 1..8 input rows against weights of several MB: memory-bound, and
on this machine bound by how many streams each core has in flight rather than
by the instructions: weight rows read one after another streamed 12-15 GB/s
from DRAM (2 cores), 8 rows from 8 places in the matrix at a time 24-35 GB/s
(n = 1, BF16: [32768, 1024] 4.8 -> 2.8 ms, [1536, 1024] 243 -> 125 us,
[1024, 1024] 158 -> 60 us; 4 places streamed 8-20 % slower than 8, 16 no
faster). The hardware prefetcher follows a stream within a 4 KiB page, so more
pages in flight keep more lines in flight.

So the unit of work is a *task* of up to 8 weight rows, normally 8 rows a
stride ``q`` apart (``group8``: rows t, t + q, .. t + 7q of an [8q, K] block),
computed by ``gemv_task`` for all input rows at once through the vector tiles of
``gemv_tiles`` (8 input rows a pass, then 4, then the last 3, 2 or 1). With the
tasks split evenly over the threads, each thread reads 8 disjoint ranges side by
side. Rows past the last full group of 8 are tasks of their own, the row in all 8
slots of the same code; and since every tile computes a dot alike, a row's result
depends neither on its group nor on the input rows beside it.

Large n (prefill chunks) is compute-bound and OpenBLAS sgemm is faster there,
but only FP32 weights go to it (the ``linear`` launcher, n >= 256): widening
BF16 for BLAS ate the gain below n = 512, and every switch between the
OpenBLAS and Numba thread pools stalls (both spin-wait; on 2 cores a
[4096, 1024] n=8 linear went from 0.8 ms to 8 ms when alternated with a tiny sgemm).

Floating-point flags: every kernel is ``fastmath=False``; the tiles' FMAs are
``llvm.fma`` calls in a fixed order. ``_DOT_FLAGS`` (``reassoc`` and ``contract``, nothing
else) is for the other families' small reductions left to LLVM's vectoriser (a norm's sum
of squares): without ``reassoc`` LLVM cannot vectorise an FP reduction (and Numba leaves
the SLP vectoriser off). Only the summation order changes (and FMA rounding, which is more
accurate); NaN and Inf keep IEEE semantics (no ``nnan`` / ``ninf``).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from numba.extending import intrinsic

from .gemv_tiles import dots1, dots2, dots3, dots4, dots8, emit_widen

_DOT_FLAGS = {"reassoc", "contract"}

#: a loop over at most this many elements (or multiply-adds) runs on the calling
#: thread: starting a parallel region cost 3 us with the threads spinning and
#: ~11 us after a 64 MB weight stream had flushed the caches (2 cores), against
#: ~1 us of work per 1024 elements
SMALL = 1 << 16


#: FP8 codes decode to their value times 2^-120 (``widen``); the scales the FP8 kernels fold
#: into their inputs carry 2^60 of the 2^120 and the per-row factor the other 2^60, so that
#: neither the scaled inputs nor the products leave FP32's normal range (docs/fp8.md)
FP8_HALF_BIAS = 2.0 ** 60


@intrinsic
def widen(typingctx, v):
    """One weight element -> FP32: BF16 bits (uint16) shift into the top half
    of an FP32 word; FP32 passes through; an FP8 E4M3 code (uint8) becomes its
    value times 2^-120: ``(sext(b) << 20) & 0x87FFFFFF`` puts the sign at bit 31
    and the 4 exponent and 3 mantissa bits at the top of FP32's exponent and
    mantissa (E4M3's bias 7 against FP32's 127). Three integer operations, where
    converting through FP16 (``vcvtph2ps``) took 2 more uops per 8 codes and ran
    a [4096, 1024] GEMV 22 % slower (1 thread). Subnormal codes would become FP32
    denormals (a 60x slower GEMV on this Xeon, and zeros under DAZ): the cpu
    backend stores them as zeros and adds them from a sparse list (``fp8_chunk``);
    the NaN codes decode to finite junk that the per-row factor turns into NaN."""
    if v in (types.uint8, types.uint16, types.float32):
        def codegen(context, builder, sig, args):
            return emit_widen(builder, sig.args[0], args[0])

        return types.float32(v), codegen
    return None


@njit(cache=True, fastmath=False)
def _put(y, i, c, v, accumulate):
    if accumulate:
        y[i, c] += v
    else:
        y[i, c] = v


@njit(cache=True, fastmath=False)
def group8(t, q, lo):
    """Task t over the weight rows lo, lo + 1, .. with q = (row count) // 8 full
    groups -> ``(rows, count)``: rows lo + t + s q (s < 8) for t < q, else the
    single row lo + 8q + (t - q), repeated to fill the tuple. A range of N rows
    has q + N - 8q tasks."""
    t, q, lo = np.int64(t), np.int64(q), np.int64(lo)
    if t < q:
        j = lo + t
        return (j, j + q, j + 2 * q, j + 3 * q, j + 4 * q, j + 5 * q, j + 6 * q, j + 7 * q), 8
    j = lo + 7 * q + t
    return (j, j, j, j, j, j, j, j), 1


@njit(cache=True, fastmath=False)
def _put_tile(y, i, cols, count, T, r, accumulate):
    """The dots r ([s * T + t]: weight row s, input row i + t) into y[i + t, cols[s]], for the
    weight rows below count."""
    for s in range(count):
        for t in range(T):
            _put(y, i + t, cols[s], r[s * T + t], accumulate)


@njit(cache=True, fastmath=False)
def gemv_task(w, rows, count, k0, x, i0, i1, y, cols, accumulate):
    """For input rows i0..i1 of x [*, K] and s < count:
    ``y[i, cols[s]] (+)= w[rows[s], k0:k0+K] . x[i]``. ``rows`` / ``cols``: 8-tuples
    of int64, every entry a valid row (a smaller count repeats its rows: ``group8``): the 8
    weight rows are read for every input row whatever the count, and only the first ``count``
    results are stored. Input rows go 8 at a time (``gemv_tiles.dots8``: 2 weight rows x 8
    input rows a tile), then 4, then the last 3, 2 or 1 (``dots4`` / ``dots3``: 4 x 4 and 4 x 3
    tiles, ``dots2`` / ``dots1``: 8 x 2 and 8 x 1); K over ``gemv_tiles.PASS_MAX`` columns is
    taken in ranges, so those columns of the input rows stay in L1 for the 8 weight rows.

    A dot's bits depend on its two rows only (``gemv_tiles``), so a row's result does not
    depend on its group, the matrix's row count, a vocabulary shard's bounds, a grammar mask
    or the input rows beside it (tests/test_ops_backends.py::test_gemv_rows_do_not_depend_on_their_group,
    tests/test_cpu_gemv_tiles.py). Each weight row is read from memory once for all the input
    rows (the other passes hit L1/L2).

    Numba compiles a copy of a function per argument type, and a literal
    argument (``0``, ``False``) is a type of its own: callers pass
    ``np.int64(0)`` / ``np.bool_(False)`` and int64 tuples, so each weight dtype
    compiles one copy (left to literals, a helper was once compiled 16 times
    for the ops of this backend)."""
    k0 = np.int64(k0)
    i = np.int64(i0)
    while i + 8 <= i1:
        _put_tile(y, i, cols, count, 8, dots8(w, rows, k0, x, i), accumulate)
        i += 8
    if i + 4 <= i1:
        _put_tile(y, i, cols, count, 4, dots4(w, rows, k0, x, i), accumulate)
        i += 4
    if i + 3 == i1:
        _put_tile(y, i, cols, count, 3, dots3(w, rows, k0, x, i), accumulate)
    elif i + 2 == i1:
        _put_tile(y, i, cols, count, 2, dots2(w, rows, k0, x, i), accumulate)
    elif i + 1 == i1:
        _put_tile(y, i, cols, count, 1, dots1(w, rows, k0, x, i), accumulate)


# -- FP8 E4M3 weights ----------------------------------------------------------------------
# An FP8 weight reaches the kernels as the tuple ``w8 = (q, xs, post, crow, ccol, cval, C, bk)``
# (``CpuFp8.kernel_args`` in backends/cpu.py builds it; an [E, N, K] one per expert through
# ``expert``):
#   q     uint8 [N, K]     E4M3 codes, subnormal codes replaced by a zero of their sign
#   xs    f32 [NC, KB]     input factor of row chunk c (rows c C .. c C + C - 1), k-block kb:
#                          the block's scale times 2^60 (per-channel scales: 2^60)
#   post  f32 [N]          output factor of row j: 2^60 (per-channel: its scale times 2^60);
#                          NaN for a row holding a NaN code (any product with NaN is NaN)
#   crow  int64 [N + 1]    row j's subnormal weights are entries crow[j] .. crow[j + 1] - 1 of
#   ccol  int32, cval f32    (column, dequantized value): added exactly after the dot
#   C, bk int64            rows per chunk (a divisor of the block's rows), columns per k-block
# so that w[j, k] . x[k] = post[j] * (widen(q[j, k]) * (x[k] * xs[j // C, k // bk])), plus the
# sparse part: the GEMV core runs unchanged on the codes and a scaled copy of x per chunk.

@njit(cache=True, fastmath=False)
def expert(w8, e):
    """Expert e of a stacked FP8 weight (q [E, N, K], xs [E, NC, KB], post [E, N], crow [E, N + 1])."""
    q, xs, post, crow, ccol, cval, C, bk = w8
    return q[e], xs[e], post[e], crow[e], ccol, cval, C, bk


@njit(cache=True, fastmath=False)
def chunks(w8):
    """Row chunks of an FP8 weight [N, K] (or [E, N, K])."""
    N = w8[0].shape[-2]
    return (N + w8[6] - 1) // w8[6]


@njit(cache=True, fastmath=False)
def fp8_chunk(w8, c, k0, x, i0, i1, y, shift, accumulate):
    """For input rows i in i0..i1 of x [*, K] and the weight rows j of chunk c of w8 (``q``
    [N, *], see above): ``y[i, j - shift] (+)= w[j, k0:k0+K] . x[i]``, w dequantized.

    x is scaled by the chunk's block factors into a scratch copy once, every 8 rows of the
    chunk go through ``gemv_task`` against it, then each result is multiplied by its row's
    factor and the row's subnormal weights inside columns k0 .. k0 + K - 1 are added."""
    q, xs, post, crow, ccol, cval, C, bk = w8
    N, K = q.shape[0], x.shape[1]
    lo = c * C
    R = min(N, lo + C) - lo
    m = i1 - i0
    xp = np.empty((m, K), np.float32)                # x * the chunk's factors
    for i in range(m):
        k = np.int64(0)
        while k < K:                                 # one k-block at a time: a vectorised multiply
            kb = (k0 + k) // bk
            end = min(K, (kb + 1) * bk - k0)
            f = xs[c, kb]
            src, dst = x[i0 + i, k:end], xp[i, k:end]
            for kk in range(end - k):
                dst[kk] = src[kk] * f
            k = end
    yc = np.empty((m, R), np.float32)                # the chunk's dots
    no = np.bool_(False)                             # typed, not literal: see gemv_task
    q8 = R // 8
    for t in range(q8 + R - 8 * q8):                 # groups of 8 weight rows, all the input rows
        rows, count = group8(t, q8, lo)
        cols = (rows[0] - lo, rows[1] - lo, rows[2] - lo, rows[3] - lo,
                rows[4] - lo, rows[5] - lo, rows[6] - lo, rows[7] - lo)
        gemv_task(q, rows, count, k0, xp, np.int64(0), m, yc, cols, no)
    for i in range(m):                               # contiguous rows of yc, post and y: vectorised
        yi, ci, pc = y[i0 + i, lo - shift: lo - shift + R], yc[i], post[lo: lo + R]
        if accumulate:
            for r in range(R):
                yi[r] += ci[r] * pc[r]
        else:
            for r in range(R):
                yi[r] = ci[r] * pc[r]
    if crow[lo + R] > crow[lo]:                      # the chunk holds subnormal weights
        for r in range(R):
            j = lo + r
            for e in range(crow[j], crow[j + 1]):
                kk = ccol[e] - k0
                if 0 <= kk < K:
                    for i in range(m):
                        y[i0 + i, j - shift] += cval[e] * x[i0 + i, kk]


@njit(cache=True, fastmath=False)
def bias_residual(out, i, j, bias, residual):
    """out[i, j] + bias[j] + residual[i, j] (each unless empty), in the reference's order."""
    y = out[i, j]
    if bias.shape[0] > 0:
        y = y + bias[j]
    if residual.shape[0] > 0:
        y = y + residual[i, j]
    out[i, j] = y


@njit(cache=True, fastmath=False, parallel=True)
def linear_kernel(x, w, bias, residual, out):
    """out [n, N] = x [n, K] @ w[N, K].T (+ bias [N] unless empty) (+ residual [n, N] unless empty).

    One task per group of 8 weight rows (``group8``); tasks split evenly over the threads."""
    n = x.shape[0]
    N = w.shape[0]
    zero, no = np.int64(0), np.bool_(False)          # typed, not literal: see gemv_task
    q = N // 8
    for t in prange(q + N - 8 * q):
        rows, count = group8(t, q, zero)
        gemv_task(w, rows, count, zero, x, zero, n, out, rows, no)
        for s in range(count):
            for i in range(n):
                bias_residual(out, i, rows[s], bias, residual)


@njit(cache=True, fastmath=False, parallel=True)
def linear_fp8_kernel(x, w8, bias, residual, out):
    """``linear_kernel`` for an FP8 weight (the tuple ``w8``, see above): one task per row chunk."""
    n = x.shape[0]
    N = w8[0].shape[0]
    zero, no = np.int64(0), np.bool_(False)
    for c in prange(chunks(w8)):
        fp8_chunk(w8, c, zero, x, zero, n, out, zero, no)
        for j in range(c * w8[6], min(N, (c + 1) * w8[6])):
            for i in range(n):
                bias_residual(out, i, j, bias, residual)
