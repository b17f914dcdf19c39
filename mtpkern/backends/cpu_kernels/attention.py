"""GQA attention over the paged KV cache on the CPU (spec: mtpkern.ops.attention).

One task per (row, chunk of the row's KV blocks), serving all Hq query heads,
so each K/V row is read from memory once per task, not G = Hq / Hkv times, and
a block of the paged cache ([BS, Hkv, D], contiguous) is read front to back.
Within a task, a single pass over its blocks with an online softmax per head
(running max m, running sum l, FP32 accumulator [Hq, D], rescaled when a block
raises m); then one task per (row, head) merges the chunks' (m, l, acc)
states. The launcher picks the chunk count so that a decode step has a few
tasks per thread: at n = 1, context 512 (KV cold in memory, 2 cores), 4 chunks
took 174 us against 241 us for one task per (row, KV head), which read each KV
head's 256-byte slices of the blocks at a 1 KiB stride.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .linear import _DOT_FLAGS, SMALL


@njit(cache=True, fastmath=_DOT_FLAGS)
def _dot(a, b):
    """a [D] . b [D] (1-D views: see linear._dot_*)."""
    s = np.float32(0.0)
    for d in range(a.shape[0]):
        s += a[d] * b[d]
    return s


@njit(cache=True, fastmath=False)
def _chunks_used(L, BS, splits):
    """Chunks of a row of ``L`` KV rows that hold blocks (the first ones; see the kernel)."""
    nblk = (L + BS - 1) // BS
    per = (nblk + splits - 1) // splits
    return (nblk + per - 1) // per if per > 0 else 0


@njit(cache=True, fastmath=False, error_model="numpy")
def _merge(m_part, l_part, acc_part, splits, used, r, h, out):
    """out[r, h] from the (m, l, acc) states of row r's first ``used`` chunks (r * splits ..).
    A chunk whose scores are all -inf still counts (m = -inf, l = 0; 0 * a NaN in its V
    stays NaN, as in the reference); every score -inf gives 0 / 0 = NaN, as the reference."""
    c0 = r * splits
    top = np.float32(-np.inf)
    for c in range(c0, c0 + used):
        if m_part[c, h] > top:
            top = m_part[c, h]
    o = out[r, h]
    o[:] = 0.0
    tot = np.float32(0.0)
    for c in range(c0, c0 + used):
        f = np.exp(m_part[c, h] - top)                  # top = -inf: NaN, and so is the row
        tot += f * l_part[c, h]
        for d in range(o.shape[0]):
            o[d] += f * acc_part[c, h, d]
    for d in range(o.shape[0]):
        o[d] = o[d] / tot


@njit(cache=True, fastmath=False, parallel=True)
def paged_attention_kernel(q, k_cache, v_cache, block_tables, row_seq, row_len, scale, splits, out):
    """q, out [n, Hq, D]; caches [NB, BS, Hkv, D] FP32; indices checked in range by
    the launcher; scale float32; splits: chunks of KV blocks per row (>= 1)."""
    n, Hq, D = q.shape
    BS = k_cache.shape[1]
    Hkv = k_cache.shape[2]
    G = Hq // Hkv
    m_part = np.empty((n * splits, Hq), np.float32)                 # per (row, chunk): running max,
    l_part = np.empty((n * splits, Hq), np.float32)                 # running sum,
    acc_part = np.empty((n * splits, Hq, D), np.float32)            # and unnormalised output
    for t in prange(n * splits):
        r = t // splits
        s = row_seq[r]
        L = row_len[r]
        nblk = (L + BS - 1) // BS
        per = (nblk + splits - 1) // splits
        m, l, acc = m_part[t], l_part[t], acc_part[t]
        m[:] = -np.inf
        l[:] = 0.0
        acc[:] = 0.0
        sc = np.empty((Hq, BS), np.float32)
        for b in range((t % splits) * per, min(nblk, (t % splits + 1) * per)):
            blk = block_tables[s, b]
            cnt = min(BS, L - b * BS)
            for j in range(cnt):                        # each K row read once for its G heads
                for kvh in range(Hkv):
                    kr = k_cache[blk, j, kvh]
                    for g in range(G):
                        sc[kvh * G + g, j] = _dot(q[r, kvh * G + g], kr) * scale
            for h in range(Hq):
                bm = sc[h, 0]
                for j in range(1, cnt):
                    if sc[h, j] > bm:
                        bm = sc[h, j]
                a = acc[h]
                if bm > m[h]:                           # new running max: rescale what we have
                    corr = np.exp(m[h] - bm)
                    l[h] *= corr
                    for d in range(D):
                        a[d] *= corr
                    m[h] = bm
                mh = m[h]
                for j in range(cnt):
                    sj = sc[h, j]
                    # a -inf score weighs 0, also while the running max is still -inf
                    # (exp(-inf - -inf) would be NaN); NaN scores stay NaN
                    p = np.float32(0.0) if sj == -np.inf else np.exp(sj - mh)
                    l[h] += p
                    vr = v_cache[blk, j, h // G]
                    for d in range(D):
                        a[d] += p * vr[d]
    if n * Hq * splits * D <= SMALL:                 # merge the chunks of each (row, head)
        for t in range(n * Hq):
            r = t // Hq
            _merge(m_part, l_part, acc_part, splits, _chunks_used(row_len[r], BS, splits), r, t % Hq, out)
    else:
        for t in prange(n * Hq):
            r = t // Hq
            _merge(m_part, l_part, acc_part, splits, _chunks_used(row_len[r], BS, splits), r, t % Hq, out)
