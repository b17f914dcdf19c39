"""RMSNorm and the fused MTP input block on the CPU (spec: mtpkern.ops.norm).

``mtp_input`` runs in one call: phase 1 (one task per row) gathers and widens
the embedding row and normalises it and the hidden row into two [n, H]
scratch rows; phase 2 (one task per group of 8 eh_proj rows, ``linear.group8``)
reads each eh_w row once and dots its left half with the embedding part and its
right half with the hidden part, so the [n, 2H] concat is never built.
``zero`` (uint8 [n], or [0]: no flags): a row with a nonzero flag reads no embedding row and
gets a zero embedding part (``mtpkern.ops.norm.mtp_input``'s ``zero_embed``).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .linear import _DOT_FLAGS, SMALL, chunks, gemv_task, group8, qchunk, widen


@njit(cache=True, fastmath=_DOT_FLAGS)
def sumsq(a, i, k0, K):
    """sum_k a[i, k0 + k]^2 over k < K, a BF16-bits or FP32 matrix."""
    # a 1-D view: indexing a[i, k0 + k] in the loop would carry Numba's negative-index
    # wraparound per element and stop vectorisation (2.5 ms instead of 0.63 ms for a
    # [4096, 1024] BF16 GEMV on one core, when the GEMV was such a loop)
    row = a[i, k0:k0 + K]
    s = np.float32(0.0)
    for k in range(row.shape[0]):
        v = widen(row[k])
        s += v * v
    return s


@njit(cache=True, fastmath=False)
def row_scale(src, i, k0, K):
    """``mtpkern.ops.norm.norm_scale`` of src[i, k0:k0+K]: 2^(32 - floor(log2(m))) where the
    largest finite |value|, m, is >= 2^56 (its FP32 sum of squares could overflow), else 1."""
    row = src[i, k0:k0 + K]
    m = np.float32(0.0)
    for k in range(row.shape[0]):
        a = abs(widen(row[k]))
        if a > m and a != np.inf:
            m = a
    if m < np.float32(2.0 ** 56):
        return np.float32(1.0)
    e = math.frexp(float(m))[1] - 1                     # m in [2^e, 2^(e + 1))
    return np.float32(math.ldexp(1.0, 32 - e))


@njit(cache=True, fastmath=False)
def rms_row(src, i, k0, K, w, eps, dst, di, dk0):
    """dst[di, dk0:dk0+K] = src[i, k0:k0+K] / sqrt(mean(src^2) + eps) * w, as the
    reference orders it (divide, then scale); a row of |values| >= 2^56 scaled first by an
    exact power of two, eps by its square (``row_scale``; mtpkern.ops.norm)."""
    s, o = src[i, k0:k0 + K], dst[di, dk0:dk0 + K]
    sc = row_scale(src, np.int64(i), np.int64(k0), np.int64(K))
    if sc != np.float32(1.0):
        ss = np.float32(0.0)
        for k in range(K):
            v = widen(s[k]) * sc
            ss += v * v
        d = np.sqrt(ss / np.float32(K) + np.float32(eps) * sc * sc)
        for k in range(K):
            o[k] = widen(s[k]) * sc / d * w[k]
        return
    var = sumsq(src, np.int64(i), np.int64(k0), np.int64(K)) / np.float32(K)
    d = np.sqrt(var + eps)
    for k in range(K):
        o[k] = widen(s[k]) / d * w[k]


@njit(cache=True, fastmath=False, parallel=True)
def rmsnorm_kernel(x, w, eps, out):
    """x, out [n, H] FP32; w [H]; eps float32. One task per row (serial up to ``SMALL`` elements)."""
    n, H = x.shape
    if n * H <= SMALL:
        for i in range(n):
            rms_row(x, i, 0, H, w, eps, out, i, 0)
    else:
        for i in prange(n):
            rms_row(x, i, 0, H, w, eps, out, i, 0)


@njit(cache=True, fastmath=False)
def _input_rows(embed, tokens, g, enorm_w, hnorm_w, eps, e, h, i, flags):
    """Row i: e[i] = enorm(embed[tokens[i]]) (zeros where flags[i] is set), h[i] = hnorm(g[i])."""
    H = g.shape[1]
    if flags.shape[0] and flags[i]:
        e[i, :] = np.float32(0.0)
    else:
        rms_row(embed, tokens[i], 0, H, enorm_w, eps, e, i, 0)
    rms_row(g, i, 0, H, hnorm_w, eps, h, i, 0)


@njit(cache=True, fastmath=False, parallel=True)
def input_norms(embed, tokens, g, enorm_w, hnorm_w, eps, e, h, flags):
    """Phase 1 of mtp_input: every row's two norms (serial up to ``SMALL`` elements)."""
    n, H = g.shape
    if n * H <= SMALL:
        for i in range(n):
            _input_rows(embed, tokens, g, enorm_w, hnorm_w, eps, e, h, i, flags)
    else:
        for i in prange(n):
            _input_rows(embed, tokens, g, enorm_w, hnorm_w, eps, e, h, i, flags)


@njit(cache=True, fastmath=False, parallel=True)
def mtp_input_kernel(embed, tokens, g, enorm_w, hnorm_w, eh_w, eps, e, h, out, flags):
    """embed [V, H], tokens [n] int64 (checked in range), g [n, H], eh_w [H, 2H];
    scratch e, h [n, H]; out [n, H] = eh_w[:, :H] @ e + eh_w[:, H:] @ h; flags uint8 [n]
    or [0] (the module docstring)."""
    n, H = g.shape
    zero = np.int64(0)                               # typed, not literal: see gemv_task
    input_norms(embed, tokens, g, enorm_w, hnorm_w, eps, e, h, flags)
    q = H // 8
    for t in prange(q + H - 8 * q):
        rows, count = group8(t, q, zero)
        for half in range(2):                       # one call site: the GEMV core is inlined once
            src = e if half == 0 else h
            gemv_task(eh_w, rows, count, half * H, src, zero, n, out, rows, half == 1)


@njit(cache=True, fastmath=False, parallel=True)
def mtp_input_fp8_kernel(embed, tokens, g, enorm_w, hnorm_w, eh8, eps, e, h, out, flags):
    """``mtp_input_kernel`` with eh_proj in FP8 (``linear.fp8_chunk``; the embedding stays
    BF16 or FP32): one task per row chunk of eh_w, its left half against the normed
    embeddings, its right half against the normed hiddens."""
    n, H = g.shape
    zero, no, yes = np.int64(0), np.bool_(False), np.bool_(True)
    input_norms(embed, tokens, g, enorm_w, hnorm_w, eps, e, h, flags)
    for c in prange(chunks(eh8)):
        qchunk(eh8, c, zero, e, zero, n, out, zero, no)
        qchunk(eh8, c, np.int64(H), h, zero, n, out, zero, yes)
