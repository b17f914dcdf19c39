"""Hyper-connections on the CPU (spec: mtpkern.ops.hc; DeepSeek-V4's mHC).

``m`` streams of ``H`` per row (``X [n, m H]``, stream ``i`` at columns ``i H .. (i + 1) H``),
read as FP32 or as BF16 bits (uint16, widened in the loops: ``linear.widen``).

- ``hc_pre_kernel``: one task per row: its coefficients (pre, post and the m x m comb made
  doubly stochastic by Sinkhorn's iterations, in place in the row's ``comb``), then the
  collapse ``u = sum_i pre[i] X[i]``, streams added one after another over the row's columns.
- ``hc_post_kernel``: one task per (row, tile of ``TILE`` columns): every output stream j's
  ``out[j] = post[j] f + sum_i comb[i, j] X[i]`` over the tile, the m input streams added in
  order.
- ``hc_head_kernel``: as hc_pre's collapse with the head's sigmoid weights.

Every product and sum is rounded as the reference rounds it (FP32, no contraction, sums in
index order): hc_post equals numpy's bit for bit; hc_pre's and hc_head's coefficients differ
in the last bits of ``exp`` (LLVM's ``expf`` against NumPy's) and, from m = 8, of NumPy's
pairwise row sums. A call of at most ``linear.SMALL`` multiply-adds (one row of
DeepSeek-V4's m 4 x H 4096: 16384 for the collapse, 65536 for the write-back) runs on the
calling thread; larger ones split their tasks across threads.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .linear import SMALL, widen

#: columns of hc_post's tiles: the m input streams' tiles (8 KB at m 4, FP32) come from memory
#: once for the m outputs, then from L1. 64 rows of m 4 x H 4096 on one core: 535 us, where one
#: task per output stream (each input stream read m times, from L2) took 694 us; both near the
#: memory's pace (12 MB moved, the writes' line fills counted); one row: 5.4 and 5.7 us
TILE = 512


@njit(cache=True, fastmath=False)
def _sigmoid(x):
    return np.float32(1.0) / (np.float32(1.0) + np.exp(-x))


@njit(cache=True, fastmath=False)
def _row_sums_divide(c, m, eps):
    """c[a, :] /= sum(c[a, :]) + eps, each sum in column order."""
    for a in range(m):
        s = np.float32(0.0)
        for b in range(m):
            s += c[a, b]
        d = s + eps
        for b in range(m):
            c[a, b] = c[a, b] / d


@njit(cache=True, fastmath=False)
def _col_sums_divide(c, m, eps):
    """c[:, b] /= sum(c[:, b]) + eps, each sum in row order."""
    for b in range(m):
        s = np.float32(0.0)
        for a in range(m):
            s += c[a, b]
        d = s + eps
        for a in range(m):
            c[a, b] = c[a, b] / d


@njit(cache=True, fastmath=False)
def _coefficients(mix, base, scale, eps, iters, r, m, pre, post, comb):
    """Row r's pre [m] (into ``pre``), post [m] and comb [m, m] (into its rows of ``post`` /
    ``comb``)."""
    z = mix[r]
    for i in range(m):
        pre[i] = _sigmoid(z[i] * scale[0] + base[i]) + eps
        post[r, i] = np.float32(2.0) * _sigmoid(z[m + i] * scale[1] + base[m + i])
    c = comb[r]                                                  # [m, m]
    for a in range(m):                                           # softmax over each row, + eps
        mx = np.float32(-np.inf)
        for b in range(m):
            k = 2 * m + a * m + b
            v = z[k] * scale[2] + base[k]
            c[a, b] = v
            if v > mx or v != v:                                 # a NaN stays: np.max's row max
                mx = v
        s = np.float32(0.0)
        for b in range(m):
            e = np.exp(c[a, b] - mx)
            c[a, b] = e
            s += e
        for b in range(m):
            c[a, b] = c[a, b] / s + eps
    _col_sums_divide(c, m, eps)
    for _ in range(iters - 1):                                   # Sinkhorn's iterations
        _row_sums_divide(c, m, eps)
        _col_sums_divide(c, m, eps)


@njit(cache=True, fastmath=False)
def _collapse(X, w, r, m, H, u):
    """u[r] = sum_i w[i] X[r, i H:(i + 1) H], streams added in order."""
    o = u[r]
    x = X[r, 0:H]
    w0 = w[0]
    for h in range(H):
        o[h] = w0 * widen(x[h])
    for i in range(1, m):
        x = X[r, i * H:(i + 1) * H]
        wi = w[i]
        for h in range(H):
            o[h] = o[h] + wi * widen(x[h])


@njit(cache=True, fastmath=False)
def _pre_row(X, mix, base, scale, eps, iters, r, m, H, u, post, comb):
    pre = np.empty(m, np.float32)
    _coefficients(mix, base, scale, eps, iters, r, m, pre, post, comb)
    _collapse(X, pre, r, m, H, u)


@njit(cache=True, fastmath=False, parallel=True)
def hc_pre_kernel(X, mix, base, scale, eps, iters, u, post, comb):
    """X [n, m H] FP32 or BF16 bits; mix [n, (2 + m) m], base [(2 + m) m], scale [3] FP32;
    eps FP32, iters >= 1 -> u [n, H], post [n, m], comb [n, m, m] FP32 (none overlapping an
    input)."""
    n, m = post.shape
    H = u.shape[1]
    if n * m * H <= SMALL:
        for r in range(n):
            _pre_row(X, mix, base, scale, eps, iters, r, m, H, u, post, comb)
    else:
        for r in prange(n):
            _pre_row(X, mix, base, scale, eps, iters, r, m, H, u, post, comb)


@njit(cache=True, fastmath=False)
def _post_tile(f, X, post, comb, r, h0, h1, m, H, out):
    """Columns h0 .. h1 of every output stream j of row r: post[r, j] f[r] + sum_i comb[r, i, j]
    X[r, i] (the m input tiles, ``TILE`` columns each, stay in L1 across the j)."""
    fr = f[r, h0:h1]
    for j in range(m):
        o = out[r, j * H + h0:j * H + h1]
        p = post[r, j]
        for h in range(h1 - h0):
            o[h] = p * widen(fr[h])
        for i in range(m):
            x = X[r, i * H + h0:i * H + h1]
            c = comb[r, i, j]
            for h in range(h1 - h0):
                o[h] = o[h] + c * widen(x[h])


@njit(cache=True, fastmath=False, parallel=True)
def hc_post_kernel(f, X, post, comb, out):
    """f [n, H], X [n, m H] (each FP32 or BF16 bits); post [n, m], comb [n, m, m] FP32 ->
    out [n, m H] FP32 (not overlapping an input). One task per (row, tile of ``TILE`` columns)."""
    n, m = post.shape
    H = f.shape[1]
    tiles = (H + TILE - 1) // TILE
    if n * m * m * H <= SMALL:
        for t in range(n * tiles):
            h0 = (t % tiles) * TILE
            _post_tile(f, X, post, comb, t // tiles, h0, min(h0 + TILE, H), m, H, out)
    else:
        for t in prange(n * tiles):
            h0 = (t % tiles) * TILE
            _post_tile(f, X, post, comb, t // tiles, h0, min(h0 + TILE, H), m, H, out)


@njit(cache=True, fastmath=False)
def _head_row(X, mix, base, scale, eps, r, m, H, out):
    pre = np.empty(m, np.float32)
    for i in range(m):
        pre[i] = _sigmoid(mix[r, i] * scale[0] + base[i]) + eps
    _collapse(X, pre, r, m, H, out)


@njit(cache=True, fastmath=False, parallel=True)
def hc_head_kernel(X, mix, base, scale, eps, out):
    """X [n, m H] FP32 or BF16 bits; mix [n, m], base [m], scale [1] FP32 -> out [n, H] FP32."""
    n, m = mix.shape
    H = out.shape[1]
    if n * m * H <= SMALL:
        for r in range(n):
            _head_row(X, mix, base, scale, eps, r, m, H, out)
    else:
        for r in prange(n):
            _head_row(X, mix, base, scale, eps, r, m, H, out)
