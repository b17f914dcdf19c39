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

import ml_dtypes
import numpy as np
from numba import njit, prange, types
from numba.extending import intrinsic, overload

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
def fp8_expert(w8, e):
    """Expert e of a stacked FP8 weight (q [E, N, K], xs [E, NC, KB], post [E, N], crow [E, N + 1])."""
    q, xs, post, crow, ccol, cval, C, bk = w8
    return q[e], xs[e], post[e], crow[e], ccol, cval, C, bk


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


# -- FP4 E2M1 weights with E8M0 block scales -------------------------------------------------
# An FP4 weight reaches the kernels as the tuple ``w4 = (q, s, C)`` (``CpuFp4.kernel_args`` in
# backends/cpu_fp4.py; an [E, N, K] one per expert through ``expert``):
#   q     uint8 [N, K / 2]   E2M1 codes, column 2j in the low nibble of byte j, 2j + 1 in the high
#   s     uint8 [N, KB]      E8M0 codes, one per 32 columns: the scale is 2^(s - 127)
#   C     int64              rows per chunk (FP4_ROWS)
# or, for NVFP4, ``w4 = (q, s, C, g)``:
#   s     uint8 [N, KB]      E4M3 codes, one per 16 columns
#   g     float32 [N]        the row scale: w = (e2m1 * e4m3(s)) * g[n], the product exact, one rounding
# ``fp4_chunk`` decodes the C rows of a chunk into an FP32 scratch block (e2m1 * 2^(s - 127), exact:
# the reference's dequantized weight, bit for bit) and runs the GEMV core on it, so a row's dot
# has the bits the same weight in FP32 gives (``gemv_task``: a dot depends on its two rows only).
# The weights stay half a byte each in memory; the scratch block (C x K FP32, 229 KB at K = 7168)
# stays in L2 while every input row passes over it.

#: rows per FP4 chunk: one ``group8`` task's worth, so the decoded block stays in L2
FP4_ROWS = 8
_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
#: 2^(c - 127) for every E8M0 code c (the bits c << 23; c = 0 is the subnormal 2^-127); 0xFF is
#: refused at load (``Fp4Weight``), its entry a NaN here
_E8M0 = np.concatenate([np.array([0x00400000], np.uint32), np.arange(1, 255, dtype=np.uint32) << 23,
                        np.array([0x7FC00000], np.uint32)]).view(np.float32)


@njit(cache=True, fastmath=False, inline="always")
def _e2m1(v, h, nh):
    """E2M1 code v (int32, < 16) times 2 h (h = half the block's scale, nh = -h): twice the
    magnitude is the small integer (2 [e > 0] + m) << (e - [e > 0]) (e = exponent bits, m the
    mantissa bit: 0, 1, 2, 3, 4, 6, 8, 12), widened exactly and multiplied by h or -h (a
    power of two: exact; -h keeps code 8's -0). Integer operations and a select, which LLVM
    vectorises; a 16-entry table lookup is a gather it does not (2 ns a weight against 0.3)."""
    e = (v >> 1) & 3
    nz = np.int32(e > 0)
    twice = ((nz << 1) + (v & 1)) << (e - nz)
    return np.float32(twice) * (nh if (v & 8) else h)


@njit(cache=True, fastmath=False)
def fp4_rows(q, s, lo, R, k0, out):
    """out [R, K] = the FP4 weight's rows lo .. lo + R - 1, columns k0 .. k0 + K - 1, dequantized:
    ``e2m1(code) * 2^(scale - 127)`` (exact in FP32)."""
    K = out.shape[1]
    for r in range(R):
        qr, sr, o = q[lo + r], s[lo + r], out[r]
        k = np.int64(0)
        while k < K:
            col = k0 + k
            kb = col >> 5
            end = min(K, ((kb + 1) << 5) - k0)               # the end of this 32-column scale block
            f = _E8M0[sr[kb]]
            if (col & 1) == 0 and ((end - k) & 1) == 0:      # whole bytes: both nibbles
                h = f * np.float32(0.5)
                nh = -h
                b0 = col >> 1
                src, dst = qr[b0: b0 + ((end - k) >> 1)], o[k:end]
                for j in range(src.shape[0]):
                    b = np.int32(src[j])
                    dst[2 * j] = _e2m1(b & 15, h, nh)
                    dst[2 * j + 1] = _e2m1(b >> 4, h, nh)
            else:                                            # a block cut by an odd k0
                for kk in range(k, end):
                    c2 = k0 + kk
                    o[kk] = _E2M1[(qr[c2 >> 1] >> ((c2 & 1) * 4)) & 15] * f
            k = end


#: every E4M3 code's value (``float8_e4m3fn``; NaN codes are refused at load: ``Fp4Weight``)
_E4M3_TABLE = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


@njit(cache=True, fastmath=False)
def nvfp4_rows(q, s, g, tab, lo, R, k0, out):
    """out [R, K] = the NVFP4 weight's rows lo .. lo + R - 1, columns k0 .. k0 + K - 1,
    dequantized as the reference does: ``(e2m1(code) * e4m3(scale)) * g[row]`` (the product
    exact, one rounding). ``tab``: the 256 E4M3 values. With k0 and K even (every GEMV but an
    odd H's mtp_input) a row decodes in two loops LLVM vectorises: the bytes to twice each
    code's value (``_e2m1`` times 1: exact), then each 16-column block times half its scale
    (exact: E4M3's least value is 2^-9) and the row scale. Else one nibble at a time."""
    K = out.shape[1]
    one, m_one, half = np.float32(1.0), np.float32(-1.0), np.float32(0.5)
    for r in range(R):
        qr, sr, o, gr = q[lo + r], s[lo + r], out[r], g[lo + r]
        if k0 & 1 or K & 1:
            for kk in range(K):
                col = k0 + kk
                o[kk] = (_E2M1[(qr[col >> 1] >> ((col & 1) * 4)) & 15] * tab[sr[col >> 4]]) * gr
            continue
        src = qr[k0 >> 1: (k0 + K) >> 1]
        for j in range(src.shape[0]):
            b = np.int32(src[j])
            o[2 * j] = _e2m1(b & 15, one, m_one)
            o[2 * j + 1] = _e2m1(b >> 4, one, m_one)
        k = np.int64(0)
        while k < K:
            kb = (k0 + k) >> 4
            end = min(K, ((kb + 1) << 4) - k0)               # the end of this 16-column scale block
            h = tab[sr[kb]] * half
            blk = o[k:end]
            for i in range(blk.shape[0]):
                blk[i] = (blk[i] * h) * gr
            k = end


def decode_rows(w4, lo, R, k0, out):
    """``fp4_rows`` or ``nvfp4_rows`` by the tuple's form (inside jitted code only)."""
    raise NotImplementedError("decode_rows runs inside the cpu kernels only")


@overload(decode_rows, jit_options={"fastmath": False})
def _decode_rows(w4, lo, R, k0, out):
    if len(w4) == 4:
        tab = _E4M3_TABLE
        return lambda w4, lo, R, k0, out: nvfp4_rows(w4[0], w4[1], w4[3], tab, lo, R, k0, out)
    return lambda w4, lo, R, k0, out: fp4_rows(w4[0], w4[1], lo, R, k0, out)


@njit(cache=True, fastmath=False)
def fp4_chunk(w4, c, k0, x, i0, i1, y, shift, accumulate):
    """``fp8_chunk`` for an FP4 weight (the tuple ``w4``, see above): for input rows i in i0..i1
    of x [*, K] and the weight rows j of chunk c: ``y[i, j - shift] (+)= w[j, k0:k0+K] . x[i]``."""
    C = w4[2]
    N, K = w4[0].shape[0], x.shape[1]
    lo = c * C
    R = min(N, lo + C) - lo
    wt = np.empty((R, K), np.float32)                 # the chunk's rows, dequantized
    decode_rows(w4, lo, R, k0, wt)
    zero = np.int64(0)
    q8 = R // 8
    for t in range(q8 + R - 8 * q8):
        rows, count = group8(t, q8, zero)
        d = lo - shift
        cols = (rows[0] + d, rows[1] + d, rows[2] + d, rows[3] + d, rows[4] + d, rows[5] + d, rows[6] + d,
                rows[7] + d)
        gemv_task(wt, rows, count, zero, x, i0, i1, y, cols, accumulate)


# -- one name for either quantized form: the ``*_fp8_kernel`` variants take w8 or w4 --------------
# Numba compiles a kernel once per argument type, so an FP8 and an FP4 weight each get their own
# specialisation of the same kernel; these pick the form's helpers at compile time.

def qchunk(w, c, k0, x, i0, i1, y, shift, accumulate):
    """``fp8_chunk`` or ``fp4_chunk``, by the weight tuple's form (inside jitted code only)."""
    raise NotImplementedError("qchunk runs inside the cpu kernels only")


def chunks(w):
    """Row chunks of a quantized weight [N, K] (or [E, N, K])."""
    raise NotImplementedError("chunks runs inside the cpu kernels only")


def chunk_rows(w):
    """Rows per chunk of a quantized weight."""
    raise NotImplementedError("chunk_rows runs inside the cpu kernels only")


def expert(w, e):
    """Expert e of a stacked quantized weight."""
    raise NotImplementedError("expert runs inside the cpu kernels only")


def _is_fp4(w) -> bool:
    return isinstance(w, types.BaseTuple) and len(w) in (3, 4)


@overload(qchunk, jit_options={"fastmath": False})
def _qchunk(w, c, k0, x, i0, i1, y, shift, accumulate):
    if _is_fp4(w):
        return lambda w, c, k0, x, i0, i1, y, shift, accumulate: fp4_chunk(w, c, k0, x, i0, i1, y, shift, accumulate)
    return lambda w, c, k0, x, i0, i1, y, shift, accumulate: fp8_chunk(w, c, k0, x, i0, i1, y, shift, accumulate)


@overload(chunk_rows, jit_options={"fastmath": False})
def _chunk_rows(w):
    if _is_fp4(w):
        return lambda w: w[2]
    return lambda w: w[6]


@overload(chunks, jit_options={"fastmath": False})
def _chunks(w):
    return lambda w: (w[0].shape[-2] + chunk_rows(w) - 1) // chunk_rows(w)


@overload(expert, jit_options={"fastmath": False})
def _expert(w, e):
    if _is_fp4(w) and len(w) == 4:
        return lambda w, e: (w[0][e], w[1][e], w[2], w[3][e])
    if _is_fp4(w):
        return lambda w, e: (w[0][e], w[1][e], w[2])
    return lambda w, e: fp8_expert(w, e)


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
    """``linear_kernel`` for an FP8 or FP4 weight (the tuple ``w8`` or ``w4``, see above): one
    task per row chunk."""
    n = x.shape[0]
    N = w8[0].shape[0]
    C = chunk_rows(w8)
    zero, no = np.int64(0), np.bool_(False)
    for c in prange(chunks(w8)):
        qchunk(w8, c, zero, x, zero, n, out, zero, no)
        for j in range(c * C, min(N, (c + 1) * C)):
            for i in range(n):
                bias_residual(out, i, j, bias, residual)
