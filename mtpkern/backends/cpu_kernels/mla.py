"""MLA on the CPU: the latent-row write and absorbed attention (spec: mtpkern.ops.mla).

``mla_latent_write_kernel``: one serial pass over the rows, in order (a slot given
twice ends with the later row, as the reference's assignment): RMSNorm of the L
compressed values straight into the row's slot, then the R rope-key values
rotated there, then (when a query is given) the row's query copied out with each
head's R rope dims rotated by the same angles. A row is L + R values (576 for DeepSeek-V3): a parallel region
would cost more to start than the whole write (``linear.SMALL``).

``mla_attention_kernel``: one task per (row, head), because a decode step has one
row and its parallelism is in the heads (128 for DeepSeek-V3). A task absorbs its
query through ``w_uk[h]`` (``q_lat = w_uk[h]^T q_nope``: P x L multiply-adds, the
weight widened from BF16 bits or FP32 by ``linear.widen``), scores every visible
latent row against ``q_lat`` and ``q_pe`` in one pass, takes the softmax over those
scores (max, exp, sum: two passes over a [L'] FP32 buffer), accumulates the
latent output ``o_lat = sum_j p_j c_j`` and multiplies it out through ``w_uv[h]``.
Each latent row is read once per head here; FlashMLA's shape (all heads of a row
over one latent tile) is the CUDA kernel's (kernels/mla.cu). The weights are
indexed directly (one specialisation per weight dtype, as the GEMV kernels).
Absent ``row_start`` comes as an empty array. Measured (this machine, 2 cores, BF16
weights, P 128, R 64, L 512, Dv 128, context 512, one sequence): n = 1, 16 heads
1.35 ms on 1 thread, 0.74 ms on 2; n = 4 4.5 / 2.8 ms; 128 heads (DeepSeek-V3's)
10.2 / 5.7 ms: ~8 G multiply-adds a second per thread, the latent rows served
from cache (512 rows x 2,304 bytes).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .attention import _dot, _first_row
from .linear import SMALL, widen


@njit(cache=True, fastmath=False)
def _write_row(kv_a, r, L, w, eps, inv_freq, pos, dst, interleave, rope_scale):
    """dst [L + R] = [rmsnorm(kv_a[r, :L], w) | rope(kv_a[r, L:])]."""
    x = kv_a[r]
    s = np.float32(0.0)
    for k in range(L):
        s += x[k] * x[k]
    d = np.sqrt(s / np.float32(L) + eps)
    for k in range(L):
        dst[k] = x[k] / d * w[k]
    half = inv_freq.shape[0]
    step, second = (2, 1) if interleave else (1, half)   # pair k: dims (step k, step k + second) of the rope part
    p = np.float32(pos)
    for k in range(half):
        f = p * inv_freq[k]
        c = np.cos(f) * rope_scale
        sn = np.sin(f) * rope_scale
        a = L + step * k
        x1 = x[a]
        x2 = x[a + second]
        dst[a] = x1 * c - x2 * sn
        dst[a + second] = x2 * c + x1 * sn


@njit(cache=True, fastmath=False)
def _rope_q(q, r, inv_freq, pos, dst, interleave, rope_scale):
    """dst [Hq, P + R] = q[r] with each head's last R dims rotated (as the key's)."""
    Hq, PR = q.shape[1], q.shape[2]
    half = inv_freq.shape[0]
    P = PR - 2 * half
    step, second = (2, 1) if interleave else (1, half)
    p = np.float32(pos)
    for h in range(Hq):
        x = q[r, h]
        d = dst[h]
        for k in range(P):
            d[k] = x[k]
        for k in range(half):
            f = p * inv_freq[k]
            c = np.cos(f) * rope_scale
            sn = np.sin(f) * rope_scale
            a = P + step * k
            x1 = x[a]
            x2 = x[a + second]
            d[a] = x1 * c - x2 * sn
            d[a + second] = x2 * c + x1 * sn


@njit(cache=True, fastmath=False)
def mla_latent_write_kernel(kv_a, w, eps, inv_freq, positions, rows, slots, interleave, rope_scale, q, q_out):
    """kv_a [n, L + R] FP32; w [L]; rows [NB * BS, L + R] (the cache, one row per slot);
    slots checked in range by the launcher; eps and rope_scale float32; q [n, Hq, P + R]
    FP32 and q_out like it (or q empty: no query to rotate)."""
    L = w.shape[0]
    for r in range(kv_a.shape[0]):
        _write_row(kv_a, r, L, w, eps, inv_freq, positions[r], rows[slots[r]], interleave, rope_scale)
        if q.shape[0]:
            _rope_q(q, r, inv_freq, positions[r], q_out[r], interleave, rope_scale)


@njit(cache=True, fastmath=False, error_model="numpy")
def _row_head(r, h, q, w_uk, w_uv, cache, block_tables, row_seq, row_start, row_len, scale, out):
    """out[r, h] (see the module docstring)."""
    P = w_uk.shape[1]
    L = w_uk.shape[2]
    R = q.shape[2] - P
    Dv = w_uv.shape[1]
    BS = cache.shape[1]
    q_lat = np.zeros(L, np.float32)
    for p in range(P):                                  # q_lat = w_uk[h]^T q_nope[r, h]
        qp = q[r, h, p]
        wr = w_uk[h, p]
        for l in range(L):
            q_lat[l] += qp * widen(wr[l])
    s = row_seq[r]
    start = _first_row(row_start, r)
    cnt = row_len[r] - start
    sc = np.empty(cnt, np.float32)
    qpe = q[r, h, P:]
    for j in range(cnt):
        i = start + j
        row = cache[block_tables[s, i // BS], i % BS]
        sc[j] = (_dot(q_lat, row[:L]) + _dot(qpe, row[L:L + R])) * scale
    m = sc[0]
    for j in range(1, cnt):
        if sc[j] > m:
            m = sc[j]
    o_lat = np.zeros(L, np.float32)
    tot = np.float32(0.0)
    for j in range(cnt):
        p_ = np.exp(sc[j] - m)                          # every score -inf: NaN, as the reference
        tot += p_
        i = start + j
        row = cache[block_tables[s, i // BS], i % BS]
        for l in range(L):
            o_lat[l] += p_ * row[l]
    for l in range(L):
        o_lat[l] = o_lat[l] / tot
    o = out[r, h]
    for v in range(Dv):                                 # out = w_uv[h] o_lat
        wr = w_uv[h, v]
        a = np.float32(0.0)
        for l in range(L):
            a += widen(wr[l]) * o_lat[l]
        o[v] = a


@njit(cache=True, fastmath=False, parallel=True)
def mla_attention_kernel(q, w_uk, w_uv, cache, block_tables, row_seq, row_start, row_len, scale, out):
    """q [n, Hq, P + R] FP32 (rope dims last, roped); w_uk [Hq, P, L], w_uv [Hq, Dv, L] (BF16 bits or
    FP32); cache [NB, BS, L + R] FP32; row_start [n] (or empty: 0); indices checked in range
    by the launcher; scale float32; out [n, Hq, Dv]."""
    n, Hq = q.shape[0], q.shape[1]
    P, L = w_uk.shape[1], w_uk.shape[2]
    if n * Hq * (P + 2 * L) <= SMALL // 16:             # a handful of tiny tasks: the calling thread
        for t in range(n * Hq):
            _row_head(t // Hq, t % Hq, q, w_uk, w_uv, cache, block_tables, row_seq, row_start,
                      row_len, scale, out)
    else:
        for t in prange(n * Hq):
            _row_head(t // Hq, t % Hq, q, w_uk, w_uv, cache, block_tables, row_seq, row_start,
                      row_len, scale, out)
