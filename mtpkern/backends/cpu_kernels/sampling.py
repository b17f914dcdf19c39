"""Sampled drafts on the CPU over an [n, V] block of logits (spec: mtpkern.ops.sampling).

One task per input row: the row's candidates (allowed, non-NaN), ordered by logit
descending with ties to the lower id (a stable merge sort of the ascending ids; with
``top_k``, of the k selected by ``np.partition`` only) when ``top_k`` or ``top_p`` needs
the order, the FP64 weights, the kept prefix, then the
Gumbel-max draw over the kept tokens: the same counter-based hash of (row key, returned id)
as the reference, in uint64 arithmetic, so the drafts match it bit for bit. The logits come
from ``lm_head_logits`` (the FMA tiles whose argmax ``lm_head_argmax`` returns), so a
``top_k = 1`` row is the greedy draft.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from ...ops.sampling import GOLDEN, MIX1, MIX2

_GOLDEN = np.uint64(GOLDEN)
_MIX1 = np.uint64(MIX1)
_MIX2 = np.uint64(MIX2)
_ONE = np.uint64(1)
_S11, _S27, _S30, _S31 = np.uint64(11), np.uint64(27), np.uint64(30), np.uint64(31)


@njit(cache=True, inline="always")
def _gumbel(key, tok):
    """-log(-log(u)) of ``ops.sampling.token_uniform`` for one (row key, token id)."""
    x = key + (np.uint64(tok) + _ONE) * _GOLDEN
    x = (x ^ (x >> _S30)) * _MIX1
    x = (x ^ (x >> _S27)) * _MIX2
    x = x ^ (x >> _S31)
    u = (np.float64(x >> _S11) + 0.5) * 2.0**-53
    return -math.log(-math.log(u))


@njit(cache=True)
def _sample_row(logits, bitmask, noise_ids, keys, temperature, top_k, top_p, r, ids, probs, dist):
    V = logits.shape[1]
    cand = np.empty(V, np.int64)
    c = 0
    for v in range(V):
        lv = logits[r, v]
        if lv != lv:
            continue
        if bitmask.shape[0] > 0 and ((bitmask[r, v >> 5] >> (v & 31)) & 1) == 0:
            continue
        cand[c] = v
        c += 1
    if c == 0:
        return False
    k, tp, T = top_k[r], top_p[r], temperature[r]
    if k > 0 or tp < 1.0:
        neg = np.empty(c, np.float64)
        for i in range(c):
            neg[i] = -np.float64(logits[r, cand[i]])
        if 0 < k < c:
            # the first k of the order without sorting every candidate: the k-th smallest key
            # (np.partition), the keys below it and then its ties in id order; only those sorted
            kth = np.partition(neg, k - 1)[k - 1]
            sub = np.empty(k, np.int64)
            j = 0
            for i in range(c):
                if neg[i] < kth:
                    sub[j] = i
                    j += 1
            for i in range(c):
                if j < k and neg[i] == kth:
                    sub[j] = i
                    j += 1
            cand_k = np.empty(k, np.int64)
            neg_k = np.empty(k, np.float64)
            for i in range(k):                      # back in id order, for the stable sort's ties
                cand_k[i] = cand[sub[i]]
            cand_k.sort()
            for i in range(k):
                neg_k[i] = -np.float64(logits[r, cand_k[i]])
            cand, neg, c = cand_k, neg_k, k
        o = np.argsort(neg, kind="mergesort")                               # stable: ties stay id-ascending
        order = np.empty(c, np.int64)
        for i in range(c):
            order[i] = cand[o[i]]
    else:
        order = cand
    z = np.empty(c, np.float64)
    m = -np.inf
    for i in range(c):
        z[i] = np.float64(logits[r, order[i]]) / T
        m = max(m, z[i])
    w = np.empty(c, np.float64)
    finite = math.isfinite(m)
    for i in range(c):
        if finite:
            w[i] = math.exp(z[i] - m)
        elif m > 0:
            w[i] = 1.0 if z[i] == m else 0.0
        else:
            w[i] = 1.0
    if tp < 1.0:
        total = 0.0
        for i in range(c):
            total += w[i]
        run = 0.0
        cut = c
        for i in range(c):
            run += w[i]
            if run >= tp * total:
                cut = i + 1
                break
        c = cut
    total = 0.0
    best = -np.inf
    bv = -1
    bw = 0.0
    key = keys[r]
    for i in range(c):
        total += w[i]
        if w[i] > 0.0:
            v = order[i]
            sc = (z[i] if finite else 0.0) + _gumbel(key, noise_ids[v])
            if sc > best or (sc == best and v < bv):
                best, bv, bw = sc, v, w[i]
    ids[r] = bv
    probs[r] = np.float32(bw / total)
    if dist.shape[0] > 0:
        for v in range(V):
            dist[r, v] = np.float32(0.0)
        for i in range(c):
            dist[r, order[i]] = np.float32(w[i] / total)
    return True


@njit(cache=True, parallel=True)
def sample_kernel(logits, bitmask, noise_ids, keys, temperature, top_k, top_p, ids, probs, dist):
    """ids [n] int32 (head rows), probs [n] FP32, dist [n, V] FP32 or [0, 0]: each row's sampled
    draft. Returns the first row without a candidate, or -1."""
    n = logits.shape[0]
    ok = np.ones(n, np.bool_)
    for r in prange(n):
        ok[r] = _sample_row(logits, bitmask, noise_ids, keys, temperature, top_k, top_p, r, ids, probs, dist)
    for r in range(n):
        if not ok[r]:
            return r
    return -1
