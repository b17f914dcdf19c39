"""GQA attention over the paged KV cache on the CPU (spec: mtpkern.ops.attention).

One task per (row, KV head), serving the G = Hq / Hkv query heads that share
it, so each K/V row is read from memory once per task, not G times (the
traffic that bounds decode attention). A single pass over the row's L visible
KV rows, a block of the paged cache at a time, with an online softmax per
head (running max m, running sum l, FP32 accumulator [G, D], rescaled when
the block raises m), then acc / l. n * Hkv tasks split over the threads.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .linear import _DOT_FLAGS


@njit(cache=True, fastmath=_DOT_FLAGS)
def _qk(q, r, h, k_cache, blk, off, kvh):
    s = np.float32(0.0)
    for d in range(q.shape[2]):
        s += q[r, h, d] * k_cache[blk, off, kvh, d]
    return s


@njit(cache=True, fastmath=False, parallel=True)
def paged_attention_kernel(q, k_cache, v_cache, block_tables, row_seq, row_len, scale, out):
    """q, out [n, Hq, D]; caches [NB, BS, Hkv, D] FP32; indices checked in range by
    the launcher; scale float32."""
    n, Hq, D = q.shape
    BS = k_cache.shape[1]
    Hkv = k_cache.shape[2]
    G = Hq // Hkv
    for t in prange(n * Hkv):
        r = t // Hkv
        kvh = t % Hkv
        s = row_seq[r]
        L = row_len[r]
        acc = np.zeros((G, D), np.float32)
        m = np.full(G, -np.inf, np.float32)
        l = np.zeros(G, np.float32)
        sc = np.empty((G, BS), np.float32)
        for b in range((L + BS - 1) // BS):
            blk = block_tables[s, b]
            cnt = min(BS, L - b * BS)
            for j in range(cnt):                        # each K row read once for the G heads
                for g in range(G):
                    sc[g, j] = _qk(q, r, kvh * G + g, k_cache, blk, j, kvh) * scale
            for g in range(G):
                bm = sc[g, 0]
                for j in range(1, cnt):
                    if sc[g, j] > bm:
                        bm = sc[g, j]
                if bm > m[g]:                           # new running max: rescale what we have
                    corr = np.exp(m[g] - bm)
                    l[g] *= corr
                    for d in range(D):
                        acc[g, d] *= corr
                    m[g] = bm
                for j in range(cnt):
                    p = np.exp(sc[g, j] - m[g])
                    l[g] += p
                    for d in range(D):
                        acc[g, d] += p * v_cache[blk, j, kvh, d]
        for g in range(G):
            for d in range(D):
                out[r, kvh * G + g, d] = acc[g, d] / l[g]
