"""Sampled drafts on the CPU over an [n, V] block of logits (spec: mtpkern.ops.sampling).

One task per input row: the row's candidates (allowed, non-NaN), ordered by logit
descending with ties to the lower id when ``top_k`` or ``top_p`` needs the order: with
``top_k``, a stable merge sort of the k selected by ``np.partition`` only; without, a stable
LSD radix sort of one uint64 word per candidate (the logit's order-preserving bits above its
id; three passes of 11 bits: the same order as a stable sort of the FP64 logits, without a
comparison sort of every candidate); then the FP64 weights, the kept prefix
(their running sum added in that order, as the reference's cumsum), then the
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


#: radix digits of _rank_order: 3 passes of 11 bits over the 32 key bits of a packed word
_RADIX_BITS = 11
_RADIX = 1 << _RADIX_BITS
_LOW32 = np.uint64(0xFFFFFFFF)


@njit(cache=True)
def _rank_order(bits, cand, c):
    """[c] int64: the candidate ids ``cand[:c]`` (ascending) ordered by logit descending, ties to
    the lower id, from the logits' FP32 bits ``bits`` [V] uint32. One uint64 word a candidate,
    ``key << 32 | id`` (key: ascends as the logit descends; -0 taken as +0, as the reference's
    comparison ties them), stably LSD radix-sorted by its key bits; equal keys keep their id
    order, so this is the stable sort of ``-logit``. One 8-byte array moved a pass (the ids
    ride in the words), against a merge sort's comparisons of every candidate
    (benchmarks/README.md, "The draw alone")."""
    a = np.empty(c, np.uint64)
    for i in range(c):
        u = np.uint64(bits[cand[i]])
        if u == np.uint64(0x80000000):
            u = np.uint64(0)
        key = u if u >= np.uint64(0x80000000) else u ^ np.uint64(0x7FFFFFFF)   # l < 0: bits ascend as l descends
        a[i] = (key << np.uint64(32)) | np.uint64(cand[i])
    b = np.empty(c, np.uint64)
    count = np.empty(_RADIX, np.int64)
    mask = np.uint64(_RADIX - 1)
    for shift in (32, 32 + _RADIX_BITS, 32 + 2 * _RADIX_BITS):
        sh = np.uint64(shift)
        count[:] = 0
        for i in range(c):
            count[(a[i] >> sh) & mask] += 1
        if count[(a[0] >> sh) & mask] == c:                                   # one digit: the order stands
            continue
        at = 0
        for d in range(_RADIX):
            n_d = count[d]
            count[d] = at
            at += n_d
        for i in range(c):
            d = (a[i] >> sh) & mask
            j = count[d]
            b[j] = a[i]
            count[d] = j + 1
        a, b = b, a
    order = np.empty(c, np.int64)
    for i in range(c):
        order[i] = np.int64(a[i] & _LOW32)
    return order


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
        if 0 < k < c:
            neg = np.empty(c, np.float64)
            for i in range(c):
                neg[i] = -np.float64(logits[r, cand[i]])
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
            o = np.argsort(neg_k, kind="mergesort")                         # stable: ties stay id-ascending
            order = np.empty(k, np.int64)
            for i in range(k):
                order[i] = cand_k[o[i]]
            c = k
        else:
            order = _rank_order(logits[r].view(np.uint32), cand, c)
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
