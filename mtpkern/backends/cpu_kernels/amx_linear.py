"""BF16 GEMVs on Intel AMX tiles, exact to FP32 (Numba intrinsics from ``amx``).

At 8-24 input rows the small projections (``linear``, the MTP input's ``eh_proj``, the dense
MLP) are bound by their multiply-adds on the FMA tiles (``gemv_tiles``), not by their bytes.
``tdpbf16ps`` takes BF16 inputs only, and the inputs are FP32: so each input value is split
into three BF16 parts that sum to it exactly, x = h + m + l (``pack_parts``: h keeps the top
8 bits of x's 24-bit significand, m the next 8, l the last 8, each by truncation, so no part
can round up to an infinity). Each part's products with a BF16 weight are exact in FP32
(8 x 8 bits), so a dot's three tile sums carry only FP32's rounding of their sums, and the
result, h . w + (m . w + l . w), is as accurate as an FP32 dot: the tiles' order of
summation is not the FMA tiles', so the bits differ from theirs, by FP32 rounding.

What the tiles cannot give: AMX reads BF16 denormals as zero and flushes denormal sums. A
part below 2^-126 (an input under ~2^-110, or x's low bits when |x| < 2^-110) and a
denormal BF16 weight count as 0, an error under 2^-126 per product, absolute. Infinities
and NaNs keep their kind: such a value is its own h (a NaN quiet), with m = l = 0.

The layout. The weights are the B tiles, in AMX's pairs layout (``repack``): [N / 16, K / 32,
16, 32] BF16 bits (N and K padded with zeros), one 1 KiB tile of 16 output columns by 32 input
columns after another, so a weight tile row (16 outputs) streams K * 32 contiguous bytes. The
input parts are the A tiles (``pack_parts``): [G, K / 32, 3g, 32] for G groups of
g <= ``GROUP_MAX`` input rows, row p * g + i of a group holding part p of its row i, so that
one call's groups all have one shape and the tiles are configured once per thread
(``config``). A group's 3g rows take T = 1 A tile (g <= 5) or 2 (the second 3g - 16 rows).
The tiles' loads set the pace (docs/cpu.md, "BF16 GEMVs on AMX tiles"), so a task takes J
weight tile rows at once, every A tile loaded once a step for all of them: T = 1, J = 4 (sums
0-3, A tile 4, the weight tiles in 6 and 7 in turn: 5 loads for 4 products); T = 2, J = 2
(sums 0-3, A tiles 4 and 5, weight tiles 6 and 7: 4 loads for 4 products).

A row's result depends on its own input row and the weights only (each row of a sum tile is
its own A row against B): not on the group, the other input rows or the thread count.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import njit, prange

from . import amx
from .mlp import silu_mul_row

#: input rows a group holds: its 3 parts fill at most 2 A tiles (30 of their 32 rows); groups
#: of 16 rows (3 A tiles against 1 weight tile a step) ran [1536, 1024] at 16 rows in 132 us
#: against 107 as 2 groups of 8
GROUP_MAX = 10
#: output columns a B tile holds (16 FP32 sums of 4 bytes: one 64-byte tile row)
COLS = 16
#: input columns a step takes (an A tile row: 32 BF16)
STEP = amx.COLS_PER_STEP
#: BF16 elements a weight tile holds (16 pairs of rows x 32)
TILE = COLS * STEP
#: each step asks for the weight lines this many bytes ahead of the tile it loads
PREFETCH_BYTES = 4096

_z0, _z1, _z2, _z3 = (amx.make_zero(t) for t in range(4))
_l4, _l5, _l6, _l7 = (amx.make_rows(f"tileloadd ($0,$1,1), %tmm{t}") for t in range(4, 8))
_s0, _s1, _s2, _s3 = (amx.make_rows(f"tilestored %tmm{t}, ($0,$1,1)") for t in range(4))
# T = 1: sums 0-3 (4 weight tiles), inputs 4, weights 6 / 7 in turn
_d0_46, _d1_47, _d2_46, _d3_47 = (amx.make_dot(0, 4, 6), amx.make_dot(1, 4, 7),
                                  amx.make_dot(2, 4, 6), amx.make_dot(3, 4, 7))
# T = 2: sums 0-3 (2 input tiles x 2 weight tiles), inputs 4, 5, weights 6, 7
_d1_56, _d2_47, _d3_57 = amx.make_dot(1, 5, 6), amx.make_dot(2, 4, 7), amx.make_dot(3, 5, 7)


def groups(n: int) -> tuple[int, int]:
    """(G, g): n input rows as G groups of g rows (the last padded with zero rows)."""
    G = -(-n // GROUP_MAX)
    return G, -(-n // G)


@njit(cache=True)
def tiles(g):
    """(T, J, last) for groups of g input rows: T A tiles of the 3 g part rows (the last one
    ``last`` rows), J weight tiles a task (``config`` and the kernel)."""
    M = 3 * g
    T = (M + 15) // 16
    return T, 4 if T == 1 else 2, M - 16 * (T - 1)


@functools.lru_cache(maxsize=None)
def config(g: int) -> np.ndarray:
    """The 64-byte tile configuration for groups of g input rows (1 .. ``GROUP_MAX``)."""
    if isinstance(g, bool) or not isinstance(g, int) or not 1 <= g <= GROUP_MAX:
        raise ValueError(f"g: expected an int 1 .. {GROUP_MAX}, got {g!r}")
    T, J, last = tiles(g)
    if T == 1:      # sums 0-3, inputs 4, weights 6, 7
        shapes = [(0, 64, last), (1, 64, last), (2, 64, last), (3, 64, last), (4, 64, last),
                  (6, 64, 16), (7, 64, 16)]
    else:           # sums 0 (4 x 6), 1 (5 x 6), 2 (4 x 7), 3 (5 x 7)
        shapes = [(0, 64, 16), (1, 64, last), (2, 64, 16), (3, 64, last), (4, 64, 16), (5, 64, last),
                  (6, 64, 16), (7, 64, 16)]
    c = np.zeros(64, np.uint8)
    c[0] = 1                                        # palette 1
    colsb = c[16:32].view(np.uint16)
    rows = c[48:56]
    for t, width, height in shapes:
        colsb[t], rows[t] = width, height
    c.flags.writeable = False
    return c


@njit(cache=True, fastmath=False, parallel=True)
def repack(w, wp):
    """w [N, K] BF16 bits -> wp [ceil(N / 16), ceil(K / 32), 16, 32]: wp[jb, kb, kp, 2 c + t] =
    w[16 jb + c, 32 kb + 2 kp + t] (AMX's pairs layout, one B tile after another), zeros past
    N and K."""
    N, K = w.shape
    NB = wp.shape[0]
    for jb in prange(NB):
        wp[jb] = 0
        for c in range(min(COLS, N - jb * COLS)):
            src = w[jb * COLS + c]
            for k in range(K):
                wp[jb, k // STEP, (k % STEP) // 2, 2 * c + (k & 1)] = src[k]


@njit(cache=True, fastmath=False)
def pack_parts(x, g, xa):
    """x [n, K] FP32 -> xa [G, ceil(K / 32), 3 g, 32] BF16 bits: row r of group gi = r // g
    holds its parts h, m, l (above) at rows r % g, g + r % g, 2 g + r % g; rows past n and
    columns past K are zeros. Each row goes through three contiguous passes that LLVM
    vectorises (the parts as FP32 words, then their top halves to their tile rows)."""
    n, K = x.shape
    xu = x.view(np.uint32)
    xa[:] = 0
    hu = np.empty(K, np.uint32)
    mu = np.empty(K, np.uint32)
    lf = np.empty(K, np.float32)
    hf, mf, lu = hu.view(np.float32), mu.view(np.float32), lf.view(np.uint32)
    for r in range(n):
        gi, i = r // g, r % g
        xr, br = x[r], xu[r]
        odd = 0
        for k in range(K):
            b = br[k]
            hu[k] = b & np.uint32(0xFFFF0000)        # h: the top 8 significant bits
            odd |= np.int64((b & np.uint32(0x7F800000)) == np.uint32(0x7F800000))
        for k in range(K):
            lf[k] = xr[k] - hf[k]                    # exact: the low 16 bits
        for k in range(K):
            mu[k] = lu[k] & np.uint32(0xFFFF0000)    # m: their top 8
        for k in range(K):
            lf[k] = lf[k] - mf[k]                    # l, exact: the last 8 (fits BF16)
        if odd:                                      # an Inf or NaN is its own h (a NaN made quiet)
            for k in range(K):
                b = br[k]
                if (b & np.uint32(0x7F800000)) == np.uint32(0x7F800000):
                    hu[k] = (b & np.uint32(0xFFFF0000)) | (np.uint32(0x00400000) if b & np.uint32(0x007FFFFF) else np.uint32(0))
                    mu[k] = 0
                    lu[k] = 0
        for kb in range((K + STEP - 1) // STEP):
            k0 = kb * STEP
            for kk in range(min(STEP, K - k0)):
                xa[gi, kb, i, kk] = hu[k0 + kk] >> 16
                xa[gi, kb, g + i, kk] = mu[k0 + kk] >> 16
                xa[gi, kb, 2 * g + i, kk] = lu[k0 + kk] >> 16


@njit(cache=True, fastmath=False)
def _ask(wp, off):
    """Ask for the 16 lines of the weight tile at flat element off."""
    for line in range(0, TILE, 32):
        amx.prefetch(wp, off + line)


@njit(cache=True, fastmath=False)
def _task(wp, jb, nj, xa, gi, T, cs):
    """Group gi's 3 g tile sums against the 16 nj (1 .. J) output columns of weight tile rows
    jb .., into cs [J, 16 T, 16] FP32 (cs[j, m, c]: part row m, output column 16 (jb + j) + c).
    The caller configured this thread's tiles for g (``config``)."""
    KB = wp.shape[1]
    xrow = xa.shape[2] * STEP                        # elements from one step's A rows to the next
    xo = gi * KB * xrow
    wo = jb * KB * TILE
    js = KB * TILE                                   # elements from one weight tile row to the next
    ahead = PREFETCH_BYTES // 2
    if T == 1:
        _z0(); _z1(); _z2(); _z3()
        for kb in range(KB):
            _l4(xa, xo, 64)
            _ask(wp, wo + ahead)
            _l6(wp, wo, 64)
            _d0_46()
            if nj > 1:
                _ask(wp, wo + js + ahead)
                _l7(wp, wo + js, 64)
                _d1_47()
            if nj > 2:
                _ask(wp, wo + 2 * js + ahead)
                _l6(wp, wo + 2 * js, 64)
                _d2_46()
            if nj > 3:
                _ask(wp, wo + 3 * js + ahead)
                _l7(wp, wo + 3 * js, 64)
                _d3_47()
            xo += xrow
            wo += TILE
        _s0(cs, 0, 64); _s1(cs, 256 * T, 64); _s2(cs, 512 * T, 64); _s3(cs, 768 * T, 64)
    else:
        _z0(); _z1(); _z2(); _z3()
        for kb in range(KB):
            _l4(xa, xo, 64)
            _l5(xa, xo + 16 * STEP, 64)
            _ask(wp, wo + ahead)
            _l6(wp, wo, 64)
            _d0_46()
            _d1_56()
            if nj > 1:
                _ask(wp, wo + js + ahead)
                _l7(wp, wo + js, 64)
                _d2_47()
                _d3_57()
            xo += xrow
            wo += TILE
        _s0(cs, 0, 64); _s1(cs, 256, 64); _s2(cs, 512, 64); _s3(cs, 768, 64)


@njit(cache=True, fastmath=False, parallel=True)
def amx_linear_kernel(x, g, wp, bias, residual, nchunks, cfg, out):
    """out [n, N] = x [n, K] @ w.T (+ bias [N] unless empty) (+ residual [n, N] unless empty:
    it may be ``out`` itself), w [N, K] as ``repack`` packed it into wp; x packed by
    ``pack_parts`` in groups of g rows first (in this call: one dispatch less); ``cfg``:
    ``config(g)``. Tasks (J weight tile rows of 16 output columns) split into ``nchunks``
    contiguous ranges, one configuration of the tiles each."""
    n = x.shape[0]
    G = (n + g - 1) // g
    M = 3 * g
    xa = np.empty((G, wp.shape[1], M, STEP), np.uint16)
    pack_parts(x, g, xa)
    N = out.shape[1]
    T, J, _ = tiles(g)
    NB = wp.shape[0]
    tasks = (NB + J - 1) // J
    per = (tasks + nchunks - 1) // nchunks
    has_bias, has_res = bias.shape[0] > 0, residual.shape[0] > 0
    for c in prange(nchunks):
        cs = np.empty((J, 16 * T, COLS), np.float32)
        amx.tile_config(cfg)
        for t in range(c * per, min(tasks, (c + 1) * per)):
            jb = t * J
            nj = min(J, NB - jb)
            for gi in range(G):
                _task(wp, jb, nj, xa, gi, T, cs)
                for i in range(min(g, n - gi * g)):
                    r = gi * g + i
                    for jj in range(nj):
                        j0 = (jb + jj) * COLS
                        for cc in range(min(COLS, N - j0)):
                            y = cs[jj, i, cc] + (cs[jj, g + i, cc] + cs[jj, 2 * g + i, cc])
                            if has_bias:
                                y = y + bias[j0 + cc]
                            if has_res:
                                y = y + residual[r, j0 + cc]
                            out[r, j0 + cc] = y
        amx.tile_release()


@njit(cache=True, fastmath=False)
def swiglu_rows(gu, act_code, limit, gate_limit, act):
    """act [n, I] = gated(gate, up) of gu [n, 2I] = gate | up (``mlp.gated``: SwiGLU or SiTU)."""
    for p in range(act.shape[0]):
        silu_mul_row(gu, p, act_code, limit, gate_limit, act)


@njit(cache=True, fastmath=False)
def logit_bounds(x, err):
    """err [n, 2] float64 for x [n, K]: the tiles' dot a of a BF16 weight row w and x_i is
    within ||w||_2 err[i, 0] + err[i, 1] of the FMA tiles' f (``gemv_tiles``; an upper bound
    ``lm_head.lm_head_argmax_tiled_kernel`` screens with). With S = sum_k |w_k x_k| <=
    ||w|| ||x_i|| (Cauchy-Schwarz): each part's tile sum carries at most gamma_K of its own
    sum |w p| (exact products, K roundings deep in any order), the two sums joining the parts
    2u, and |h| + |m| + |l| <= (1 + 2^-7) |x|, so |a - w.x| <= 1.01 gamma_(K+2) S; the FMA
    tiles' |f - w.x| <= gamma_K S; so err[i, 0] = 2.1 gamma_(K+2) ||x_i|| (+ 2^-126 sqrt(K) for
    the parts the tiles read as zero, sum 2^-126 |w_k| <= 2^-126 sqrt(K) ||w||) and err[i, 1] =
    2^-126 (2 ||x_i||_1 + 4 K + 2) (the denormal weights read as zero and the denormal sums
    flushed, at most 3 K + 2 of them). Non-finite x gives a non-finite bound: every token of
    that row is then recomputed."""
    n, K = x.shape
    u = 2.0 ** -24
    g = (K + 2) * u / (1.0 - (K + 2) * u)
    tiny = 2.0 ** -126
    for i in range(n):
        s2, s1 = 0.0, 0.0
        for k in range(K):
            v = np.float64(x[i, k])
            s2 += v * v
            s1 += abs(v)
        err[i, 0] = 2.1 * g * np.sqrt(s2) + tiny * np.sqrt(K)
        err[i, 1] = tiny * (2.0 * s1 + 4.0 * K + 2.0)

