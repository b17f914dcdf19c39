"""GQA attention over the paged KV cache on the CPU (spec: mtpkern.ops.attention).

One task per (row, query head): a single pass over the row's L visible KV
rows with an online softmax (running max m, running sum l, FP32 accumulator
[D] kept in the output row, rescaled when m grows), then out /= l. Rows and
heads are independent, so n * Hq tasks split evenly over the threads.
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
    group = Hq // k_cache.shape[2]
    for t in prange(n * Hq):
        r = t // Hq
        h = t % Hq
        kvh = h // group
        s = row_seq[r]
        m = np.float32(-np.inf)
        l = np.float32(0.0)
        for d in range(D):
            out[r, h, d] = 0.0
        for i in range(row_len[r]):
            blk = block_tables[s, i // BS]
            off = i % BS
            sc = _qk(q, r, h, k_cache, blk, off, kvh) * scale
            if sc > m:                                   # new running max: rescale what we have
                corr = np.exp(m - sc)
                l *= corr
                for d in range(D):
                    out[r, h, d] *= corr
                m = sc
            p = np.exp(sc - m)
            l += p
            for d in range(D):
                out[r, h, d] += p * v_cache[blk, off, kvh, d]
        for d in range(D):
            out[r, h, d] /= l
