"""DSA's lightning indexer on the CPU: the key write and the top-k selection (spec:
mtpkern.ops.dsa; the launchers: ``CpuBackend.dsa_key_write`` / ``dsa_select``).

``dsa_key_write_kernel``: one serial pass over the rows, in order (a slot given twice ends
with the later row, as the reference's assignment): the row's LayerNorm (mean, then the
biased variance of the centred values, FP32) straight into its slot, its first R dims
rotated there, then (when a query is given) each query head copied out with its first R
dims rotated by the same angles. A key is Di values (128 in the releases): a parallel region
would cost more to start than the whole write (``linear.SMALL``), as for MLA's latent write.

``dsa_select_kernel``, in two parallel steps:

- the scores, one task per (query row, chunk of ``CHUNK`` of its visible rows), for the rows
  that see more than ``topk`` rows: ``s[j] = sum_h w_h * max(q_h . k_j, 0)``, the weights
  already times ``scale``. A block's keys at a time: their dots with every head by the
  16-lane tiles of ``simd`` (8 keys as a tile's query rows, 16 heads a vector: no horizontal
  sums, no copy of the keys but a block's last few), then each key's weighted sum, the heads
  added in order (``_head_sums``). Every key goes through the same 8-key tile, so equal keys
  score equal wherever they sit in their blocks (the tie rule needs it; tests/test_cpu_dsa.py).
  One query row at batch 1 still fills every thread. One row over 32768 keys of 64 heads x 128:
  7.5 ms on one core (docs/cpu.md, "DSA");
- the selection, one task per query row: each score becomes an int32 key that orders as
  the score does (its bits, the negative ones' magnitude bits flipped; -0 as +0; NaN below
  -inf), ``np.partition`` finds the topk-th largest key (linear time, no sort), and one pass
  in row order takes every row above it and the earliest rows equal to it: the list comes
  out ascending, the ties go to the earlier row, as the rule says.

A row that sees at most ``topk`` rows lists them all (no scores: the dense attention).

``dsa_select_pools_kernel``, GLM-5.3's pooled indexer (``kpool`` P; the cache's rows
``[key | gate scores]``, 2 Di), in three parallel steps over the rows that see more than
``topk / P`` complete pools:

- the pooled keys, once per sequence and call (the rows of one sequence, a prefill chunk's
  or a draft's, share them), up to the most pools one of its rows sees: one task per
  (sequence, ``CHUNK / P`` pools, i.e. CHUNK cache rows read); per pool and dim the max of
  ``gate + ape`` over its P rows, their ``exp`` (``simd.exp_le0``, vectorised: P Di of them a
  pool), the keys weighed by exp / sum added in row order, FP32 (about 4 P Di operations and
  P Di exps a pool, against the Hi Di multiply-adds of its score in every row);
- the scores, one task per (query row, ``CHUNK`` of its pools), as the per-row scores with the
  pooled keys as keys: 8 pooled keys a ``simd.qk8`` tile (padded to a multiple of 8 with zero
  rows), ``_head_sums``; every pooled key takes the same tile and sums, so equal pooled keys
  score equal (the tie rule over pools);
- the lists, one task per query row: ``_select_row`` picks the ``topk / P`` best pools
  (ascending, ties to the earlier pool, NaN lowest), each gives its P rows, then, with
  ``tail``, the rows past the last complete pool, then -1.

A row with at most ``topk / P`` complete pools lists their rows (and its tail) unscored.
One row over 32768 rows of GLM-5.3's indexer (P 16, 32 heads x 128): see docs/cpu.md, "DSA".
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .linear import SMALL
from .simd import VL, exp_le0, qk8

#: visible rows per scoring task: 512 keys of Di = 128 are 256 KiB read (L2-sized), 64
#: heads x 128 x 512 = 4M multiply-adds (~0.12 ms on one core), enough to pay for the task
CHUNK = 512

#: the key of a NaN score: below every number's (the lowest, -inf's, is -2^31 + 2^23 - 1)
_NAN_KEY = np.int32(-2 ** 31)


@njit(cache=True, fastmath=False)
def _rotate_first(x, dst, inv_freq, pos, interleave, rope_scale):
    """dst [D] = x [D] with its first R = 2 * len(inv_freq) dims rotated at ``pos``
    (pairs (2k, 2k + 1) when ``interleave``, else (k, k + R/2); cos and sin times
    ``rope_scale``); dst may be x."""
    half = inv_freq.shape[0]
    step, second = (2, 1) if interleave else (1, half)   # pair k: dims (step k, step k + second)
    p = np.float32(pos)
    for k in range(half):
        f = p * inv_freq[k]
        c = np.cos(f) * rope_scale
        sn = np.sin(f) * rope_scale
        a = step * k
        x1 = x[a]
        x2 = x[a + second]
        dst[a] = x1 * c - x2 * sn
        dst[a + second] = x2 * c + x1 * sn


@njit(cache=True, fastmath=False)
def _layernorm_row(x, w, b, eps, dst):
    """dst [Di] = (x - mean) / sqrt(var + eps) * w + b, FP32, the variance the biased one of
    the centred values (as mtpkern.ops.dsa.layernorm)."""
    Di = x.shape[0]
    s = np.float32(0.0)
    for k in range(Di):
        s += x[k]
    mean = s / np.float32(Di)
    v = np.float32(0.0)
    for k in range(Di):
        d = x[k] - mean
        v += d * d
    den = np.sqrt(v / np.float32(Di) + eps)
    for k in range(Di):
        dst[k] = (x[k] - mean) / den * w[k] + b[k]


@njit(cache=True, fastmath=False)
def dsa_key_write_kernel(k, w, b, eps, inv_freq, positions, rows, slots, interleave, rope_scale, q, q_out):
    """k [n, Di] FP32; w, b [Di]; rows [NB * BS, Di] (the index cache, one row per slot); slots
    checked in range by the launcher; eps and rope_scale float32; q [n, Hi, Di] FP32 and q_out
    like it (or q empty: no query to rotate)."""
    for r in range(k.shape[0]):
        dst = rows[slots[r]]
        _layernorm_row(k[r], w, b, eps, dst)
        _rotate_first(dst, dst, inv_freq, positions[r], interleave, rope_scale)
        if q.shape[0]:
            for h in range(q.shape[1]):
                x, o = q[r, h], q_out[r, h]
                for d in range(x.shape[0]):
                    o[d] = x[d]
                _rotate_first(x, o, inv_freq, positions[r], interleave, rope_scale)


@njit(cache=True, fastmath=False)
def _relu(d):
    """max(d, 0), a NaN kept (as np.maximum)."""
    return np.float32(0.0) if d < np.float32(0.0) else d


@njit(cache=True, fastmath=False)
def _head_sums(sc, wr, lo, hi, scores, at):
    """scores[at + i - lo] = sum_h wr[h] * max(sc[i, h], 0) for i in lo .. hi - 1, the heads
    added in order (strict FP32), 4 keys' sums side by side (4 chains of adds in flight)."""
    Hi = wr.shape[0]
    i = lo
    while i + 4 <= hi:
        a0 = np.float32(0.0)
        a1 = np.float32(0.0)
        a2 = np.float32(0.0)
        a3 = np.float32(0.0)
        for h in range(Hi):
            w = wr[h]
            a0 += w * _relu(sc[i, h])
            a1 += w * _relu(sc[i + 1, h])
            a2 += w * _relu(sc[i + 2, h])
            a3 += w * _relu(sc[i + 3, h])
        scores[at + i - lo] = a0
        scores[at + i + 1 - lo] = a1
        scores[at + i + 2 - lo] = a2
        scores[at + i + 3 - lo] = a3
        i += 4
    while i < hi:
        a0 = np.float32(0.0)
        for h in range(Hi):
            a0 += wr[h] * _relu(sc[i, h])
        scores[at + i - lo] = a0
        i += 1


@njit(cache=True, fastmath=False)
def _score_task(q, wts, cache, block_tables, row_seq, first, r, j0, j1, scores, base):
    """scores[base + j - first] for row r's visible rows j0 .. j1 - 1, a block's rows at a time:
    their dots with every head by ``simd.qk8`` (keys as the tile's 8 query rows, 16 heads a
    vector: qt = q[r] transposed, zero heads up to a multiple of 16), then ``_head_sums``. The
    rows past a block's last group of 8 go through the same 8-row tile from a copy (the last
    row repeated): a qk4 or qk1 tile sums the head dim in another order, and equal keys must
    score equal wherever they sit (the tie rule)."""
    BS, Di = cache.shape[1], cache.shape[2]
    Hi = q.shape[1]
    Hp = (Hi + VL - 1) // VL * VL
    qt = np.zeros((Di, Hp), np.float32)               # [Di, Hp]: a head's dims down a column
    for h in range(Hi):
        for d in range(Di):
            qt[d, h] = q[r, h, d]
    sc = np.empty((BS, Hp), np.float32)               # a block's dots: [key in the block, head]
    tail = np.empty((8, Di), np.float32)              # a block's last < 8 keys, padded
    tsc = np.empty((8, Hp), np.float32)
    s = row_seq[r]
    j = j0
    while j < j1:
        lo = j % BS
        hi = min(BS, lo + j1 - j)
        kb = cache[block_tables[s, j // BS]]          # [BS, Di]
        i8 = lo + (hi - lo) // 8 * 8
        for h0 in range(0, Hp, VL):
            for i in range(lo, i8, 8):
                qk8(qt, kb, sc, i, h0, 0, qt, 0)
        if i8 < hi:
            for t in range(8):
                src = kb[min(i8 + t, hi - 1)]
                for d in range(Di):
                    tail[t, d] = src[d]
            for h0 in range(0, Hp, VL):
                qk8(qt, tail, tsc, 0, h0, 0, qt, 0)
            for t in range(hi - i8):
                for h in range(Hi):
                    sc[i8 + t, h] = tsc[t, h]
        _head_sums(sc, wts[r], lo, hi, scores, base + j - first)
        j += hi - lo


@njit(cache=True, fastmath=False)
def _order_key(bits, v):
    """An int32 that orders as the FP32 score v does (``bits`` its bit pattern): +0 and -0
    equal, NaN below every number."""
    if v != v:
        return _NAN_KEY
    if v == np.float32(0.0):
        return np.int32(0)
    return bits if bits >= 0 else bits ^ np.int32(0x7FFFFFFF)


@njit(cache=True, fastmath=False)
def _select_row(scores, bits, base, count, first, topk, dst):
    """dst [topk] = the topk best of the count scores at ``base`` (row ``first + i`` for the
    i-th), ascending by row: every row scoring above the topk-th largest, then the earliest
    rows equal to it."""
    keys = np.empty(count, np.int32)
    for i in range(count):
        keys[i] = _order_key(bits[base + i], scores[base + i])
    kth = np.partition(keys, count - topk)[count - topk]       # the topk-th largest key
    above = 0
    for i in range(count):
        above += 1 if keys[i] > kth else 0
    ties = topk - above                                         # >= 1 of the rows equal to kth
    o = 0
    for i in range(count):
        if keys[i] > kth or (keys[i] == kth and ties > 0):
            if keys[i] == kth:
                ties -= 1
            dst[o] = first + i
            o += 1


@njit(cache=True, fastmath=False, parallel=True)
def dsa_select_kernel(q, wts, cache, block_tables, row_seq, row_start, row_len, topk, out):
    """q [n, Hi, Di] FP32, wts [n, Hi] FP32 (times scale), cache [NB, BS, Di] FP32;
    row_start [n] (or empty: 0); indices checked in range by the launcher -> out [n, topk]
    int32."""
    n = q.shape[0]
    Hi, Di = q.shape[1], q.shape[2]
    first = np.empty(n, np.int64)
    count = np.empty(n, np.int64)
    base = np.zeros(n + 1, np.int64)                 # the scored rows' scores, one after another
    tptr = np.zeros(n + 1, np.int64)                 # and their tasks
    for r in range(n):
        first[r] = row_start[r] if row_start.shape[0] > 0 else 0
        count[r] = row_len[r] - first[r]
        scored = count[r] > topk
        base[r + 1] = base[r] + (count[r] if scored else 0)
        tptr[r + 1] = tptr[r] + ((count[r] + CHUNK - 1) // CHUNK if scored else 0)
        if not scored:                               # every visible row: the dense attention
            for i in range(topk):
                out[r, i] = first[r] + i if i < count[r] else -1
    T = tptr[n]
    if T == 0:
        return
    scores = np.empty(base[n], np.float32)
    bits = scores.view(np.int32)
    owner = np.empty(T, np.int64)
    for r in range(n):
        for t in range(tptr[r], tptr[r + 1]):
            owner[t] = r
    if base[n] * Hi * Di <= SMALL:
        for t in range(T):
            r = owner[t]
            j0 = first[r] + (t - tptr[r]) * CHUNK
            _score_task(q, wts, cache, block_tables, row_seq, first[r], r, j0, min(j0 + CHUNK, row_len[r]),
                        scores, base[r])
        for r in range(n):
            if count[r] > topk:
                _select_row(scores, bits, base[r], count[r], first[r], topk, out[r])
    else:
        for t in prange(T):
            r = owner[t]
            j0 = first[r] + (t - tptr[r]) * CHUNK
            _score_task(q, wts, cache, block_tables, row_seq, first[r], r, j0, min(j0 + CHUNK, row_len[r]),
                        scores, base[r])
        for r in prange(n):
            if count[r] > topk:
                _select_row(scores, bits, base[r], count[r], first[r], topk, out[r])


@njit(cache=True, fastmath=False)
def _pool_task(cache, table, ape, j0, j1, pk):
    """pk[j - j0] [Di] = pool j's pooled key for j0 <= j < j1 (module docstring, "Pools"): per
    dim d, m = max_t (gate[t, d] + ape[t, d]), e_t = exp(g_t - m) (``exp_le0``: g_t - m <= 0),
    then the rows' keys weighed by e_t / sum_t e_t added in row order; FP32, d innermost (loops
    that vectorise)."""
    BS = cache.shape[1]
    P, Di = ape.shape[0], ape.shape[1]
    e = np.empty((P, Di), np.float32)                  # gate + ape, then its exp
    m = np.empty(Di, np.float32)
    s = np.empty(Di, np.float32)
    for j in range(j0, j1):
        for d in range(Di):
            m[d] = -np.inf
            s[d] = np.float32(0.0)
        for t in range(P):
            row = j * P + t
            kg = cache[table[row // BS], row % BS]    # [2 Di]: key | gate scores
            for d in range(Di):
                g = kg[Di + d] + ape[t, d]
                e[t, d] = g
                mv = m[d]
                m[d] = g if g > mv else mv             # a NaN g: its exp, the sum, every weight NaN
        for t in range(P):
            for d in range(Di):
                x = exp_le0(e[t, d] - m[d])            # <= 0, or NaN
                e[t, d] = x
                s[d] += x
        o = pk[j - j0]
        for d in range(Di):
            o[d] = np.float32(0.0)
        for t in range(P):
            row = j * P + t
            kg = cache[table[row // BS], row % BS]
            for d in range(Di):
                o[d] += (e[t, d] / s[d]) * kg[d]


@njit(cache=True, fastmath=False)
def _pool_score_task(q, wts, pk, r, j0, j1, scores, at):
    """scores[at + j - j0] for pools j0 .. j1 - 1 of row r (pk: their pooled keys from row 0,
    padded with zero rows to a multiple of 8 past j1): 8 pooled keys a tile by ``simd.qk8``
    (16 heads a vector, as ``_score_task``), then ``_head_sums``. Every pooled key goes through
    the same tile and sums, so equal pooled keys score equal (the tie rule)."""
    Hi, Di = q.shape[1], q.shape[2]
    Hp = (Hi + VL - 1) // VL * VL
    qt = np.zeros((Di, Hp), np.float32)               # [Di, Hp]
    for h in range(Hi):
        for d in range(Di):
            qt[d, h] = q[r, h, d]
    m8 = (j1 - j0 + 7) // 8 * 8
    kb = pk[j0:j0 + m8]                               # [m8, Di]
    sc = np.empty((m8, Hp), np.float32)
    for h0 in range(0, Hp, VL):
        for i in range(0, m8, 8):
            qk8(qt, kb, sc, i, h0, 0, qt, 0)
    _head_sums(sc, wts[r], 0, j1 - j0, scores, at)


@njit(cache=True, fastmath=False)
def _pool_list(scores, bits, base, n_pools, P, kp, L, tail, dst):
    """dst = row r's list: the rows of its kp best pools of n_pools (scored at ``base``;
    every complete pool when n_pools <= kp), ascending, then with ``tail`` rows n_pools P ..
    L - 1, then -1."""
    o = 0
    if n_pools <= kp:
        for i in range(n_pools * P):
            dst[i] = i
        o = n_pools * P
    else:
        best = np.empty(kp, np.int32)
        _select_row(scores, bits, base, n_pools, 0, kp, best)    # ascending pools
        for b in range(kp):
            for t in range(P):
                dst[o] = best[b] * P + t
                o += 1
    if tail:
        for i in range(n_pools * P, L):
            dst[o] = i
            o += 1
    for i in range(o, dst.shape[0]):
        dst[i] = -1


@njit(cache=True, fastmath=False, parallel=True)
def dsa_select_pools_kernel(q, wts, cache, block_tables, row_seq, row_len, topk, ape, tail, out):
    """The pooled indexer's selection (module docstring, "Pools"). q [n, Hi, Di] FP32, wts [n, Hi]
    FP32 (times scale), cache [NB, BS, 2 Di] FP32 (key | gate scores), ape [P, Di] FP32, topk a
    multiple of P; rows checked in range by the launcher -> out [n, topk (+ P - 1 with tail)]
    int32."""
    n = q.shape[0]
    S = block_tables.shape[0]
    Hi, Di = q.shape[1], q.shape[2]
    P = ape.shape[0]
    kp = topk // P
    pch = max(1, CHUNK // P)                         # pools per pooled-key task: CHUNK rows read
    need = np.zeros(S, np.int64)                     # pools a sequence's scored rows see, at most
    base = np.zeros(n + 1, np.int64)                 # the scored rows' scores, one after another
    tptr = np.zeros(n + 1, np.int64)                 # and their scoring tasks
    for r in range(n):
        npl = row_len[r] // P
        scored = npl > kp
        if scored:
            need[row_seq[r]] = max(need[row_seq[r]], npl)
        base[r + 1] = base[r] + (npl if scored else 0)
        tptr[r + 1] = tptr[r] + ((npl + CHUNK - 1) // CHUNK if scored else 0)
    pbase = np.zeros(S + 1, np.int64)                # a sequence's pooled keys, 8-row padded
    aptr = np.zeros(S + 1, np.int64)                 # and their tasks
    for s in range(S):
        pbase[s + 1] = pbase[s] + (need[s] + 7) // 8 * 8
        aptr[s + 1] = aptr[s] + (need[s] + pch - 1) // pch
    T, A = tptr[n], aptr[S]
    pk = np.zeros((pbase[S], Di), np.float32)
    scores = np.empty(base[n], np.float32)
    bits = scores.view(np.int32)
    aown = np.empty(A, np.int64)
    for s in range(S):
        for a in range(aptr[s], aptr[s + 1]):
            aown[a] = s
    town = np.empty(T, np.int64)
    for r in range(n):
        for t in range(tptr[r], tptr[r + 1]):
            town[t] = r
    if pbase[S] * P * Di + base[n] * Hi * Di <= SMALL:
        for a in range(A):
            s = aown[a]
            j0 = (a - aptr[s]) * pch
            j1 = min(j0 + pch, need[s])
            _pool_task(cache, block_tables[s], ape, j0, j1, pk[pbase[s] + j0:pbase[s] + j1])
        for t in range(T):
            r = town[t]
            j0 = (t - tptr[r]) * CHUNK
            s = row_seq[r]
            _pool_score_task(q, wts, pk[pbase[s]:pbase[s + 1]], r, j0, min(j0 + CHUNK, row_len[r] // P), scores,
                             base[r] + j0)
        for r in range(n):
            _pool_list(scores, bits, base[r], row_len[r] // P, P, kp, row_len[r], tail, out[r])
    else:
        for a in prange(A):
            s = aown[a]
            j0 = (a - aptr[s]) * pch
            j1 = min(j0 + pch, need[s])
            _pool_task(cache, block_tables[s], ape, j0, j1, pk[pbase[s] + j0:pbase[s] + j1])
        for t in prange(T):
            r = town[t]
            j0 = (t - tptr[r]) * CHUNK
            s = row_seq[r]
            _pool_score_task(q, wts, pk[pbase[s]:pbase[s + 1]], r, j0, min(j0 + CHUNK, row_len[r] // P), scores,
                             base[r] + j0)
        for r in prange(n):
            _pool_list(scores, bits, base[r], row_len[r] // P, P, kp, row_len[r], tail, out[r])
