"""Fused LM head + grammar-masked argmax on the CPU (spec: mtpkern.ops.lm_head).

The vocabulary is cut into ``nchunks`` contiguous chunks, one task each. A
task walks its chunk in groups of 8 weight rows a stride apart
(``linear.group8``: 8 streams, which is what lets the BF16 [32768, 1024] head
stream at 24-26 GB/s instead of 14-17 one row after another), computes their
logits for every input row into an [n, 8] scratch, and keeps per input row its
best allowed non-NaN (value, id): larger value, or the lower id on a tie,
since the groups do not visit ids in order. With a grammar mask, a group whose
rows some input row allows is read whole; in a group where some row is allowed
by no input row, only the allowed rows are read, one at a time (a tight mask
saves their memory reads), each by the group's own code (``linear.gemv_task``), so a
mask changes no logit's bits. A serial pass then reduces the chunks in order with
a strict ``>``, so the lowest id wins a tie; a row left with id -1 had no
allowed non-NaN token. The [n, V] logits are never written out. Asked for the drafts'
confidences, each chunk also keeps per input row the sum of exp(logit - its best),
rescaled when the best rises (an online log-sum-exp), and the reduction combines them.

``lm_head_argmax_fp8_kernel`` takes an FP8 head: its chunks are the weight's row chunks
(``linear.fp8_chunk``: one scaled copy of x per chunk), each read whole unless no input
row allows any of its tokens.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from . import amx
from .linear import _DOT_FLAGS, chunk_rows, chunks, gemv_task, group8, qchunk, widen
from .simd import EXP_MIN, exp_le0


@njit(cache=True, fastmath=False)
def _allowed(bitmask, i, j):
    """Bit j & 31 of word j >> 5 of row i (xgrammar layout); no mask (empty) allows all."""
    if bitmask.shape[0] == 0:
        return True
    return ((bitmask[i, j >> 5] >> (j & 31)) & 1) != 0


@njit(cache=True, fastmath=False)
def _any_allowed(bitmask, n, j):
    for i in range(n):
        if _allowed(bitmask, i, j):
            return True
    return False


@njit(cache=True, fastmath=False, parallel=True)
def lm_head_argmax_kernel(x, w, bitmask, nchunks, ids, conf, stats):
    """x [n, H], w [V, H], bitmask [n, ceil(V/32)] int32 or empty; out ids [n] int32
    (-1: nothing allowed) and, when conf [n] FP32 is not empty, the drafts' confidences;
    when stats [2, n] FP32 is not empty, each row's best logit and (with conf) its
    confidence's denominator (``_reduce``). Returns the first row left with -1, or -1."""
    n = x.shape[0]
    V = w.shape[0]
    best_val = np.empty((nchunks, n), np.float32)               # per chunk and row
    best_id = np.empty((nchunks, n), np.int64)
    sums = np.zeros((nchunks if conf.shape[0] else 0, n), np.float32)
    masked = bitmask.shape[0] > 0
    per = (V + nchunks - 1) // nchunks
    zero, no = np.int64(0), np.bool_(False)                      # typed, not literal: see gemv_task
    cols = (zero, zero + 1, zero + 2, zero + 3, zero + 4, zero + 5, zero + 6, zero + 7)
    for c in prange(nchunks):
        _clear(best_val, best_id, c)
        lo = min(V, c * per)
        m = min(V, lo + per) - lo                                # rows lo .. lo + m - 1
        y = np.empty((n, 8), np.float32)
        ok = np.ones(8, np.bool_)
        q = m // 8
        for t in range(q + m - 8 * q):
            rows, count = group8(t, q, lo)
            read = count
            if masked:
                read = 0
                for s in range(count):
                    ok[s] = _any_allowed(bitmask, n, rows[s])
                    read += ok[s]
            if read == count:
                gemv_task(w, rows, count, zero, x, zero, n, y, cols, no)
            else:
                for s in range(count):          # the row alone, by the group's code (same bits)
                    if ok[s]:
                        j, col = rows[s], np.int64(s)
                        gemv_task(w, (j, j, j, j, j, j, j, j), 1, zero, x, zero, n, y,
                                  (col, col, col, col, col, col, col, col), no)
            _offer_group(best_val, best_id, sums, c, bitmask, y, rows, count, ok)
    return _reduce(best_val, best_id, sums, ids, conf, stats)


#: a bound's slack for its own float64 rounding (relative)
_SLACK = 1.0 + 2.0 ** -40


@njit(cache=True, fastmath=False)
def _bound(wn, e0, e1):
    """How far a tile sum of a weight row of norm wn may lie from its FMA logit, for an input
    row of bounds (e0, e1) (``amx.pack_bf16`` / ``amx_linear.logit_bounds``), with ``_SLACK``
    for this sum's rounding."""
    return (wn * e0 + e1) * _SLACK


@njit(cache=True, fastmath=False)
def _screen_bound(wnorm, err, j, i):
    """b_ij of the screened and tiled kernels: token j's bound for input row i (``_bound``)."""
    return _bound(wnorm[j], err[i, 0], err[i, 1])


@njit(cache=True, fastmath=False, parallel=True)
def row_norms_kernel(w, out):
    """out [V] float64 = ||w[j]||_2 of BF16 bits w [V, K] (exact values, float64 sums)."""
    V, K = w.shape
    for j in prange(V):
        s = 0.0
        for k in range(K):
            v = np.float64(widen(w[j, k]))
            s += v * v
        out[j] = np.sqrt(s)


@njit(cache=True, fastmath=False, parallel=True)
def lm_head_argmax_screened_kernel(x, xb, err, w, wnorm, nchunks, cfg, ids):
    """``lm_head_argmax_kernel``'s ids without a mask (no confidences or shard stats), bit for
    bit, through an AMX screen: x [n, H] FP32, xb / err its ``amx.pack_bf16``, w [V, H] BF16 bits (H a multiple
    of 32), wnorm [V] its ``row_norms_kernel``, cfg ``amx.config(n)``.

    1. Per chunk (``group8``'s tasks, as the FMA kernel walks them): the tile sums a[j, i] of
       every row with the inputs rounded to BF16; each is within b_ij = ||w_j|| err[i, 0] +
       err[i, 1] of the FMA tiles' logit f_ij (``amx.pack_bf16``), so the largest finite
       a[j, i] - b_ij is a lower bound L_i of row i's best f.
    2. Per chunk again: every token with a[j, i] + b_ij >= L_i (or a value or bound that is
       not finite) may be row i's best; its f_ij is computed on the FMA tiles (a dot's
       bits depend on its two rows only, ``linear.gemv_task``) and offered as in the FMA kernel
       (larger, or equal with a lower id; NaN never). Every other token has f below the best,
       so the result is the FMA kernel's. Returns the first row left with -1, or -1."""
    n = x.shape[0]
    V, K = w.shape
    a = np.empty((V, n), np.float32)
    low = np.full((nchunks, n), -np.inf)
    best_val = np.empty((nchunks, n), np.float32)
    best_id = np.empty((nchunks, n), np.int64)
    per = (V + nchunks - 1) // nchunks
    zero, no = np.int64(0), np.bool_(False)
    for c in prange(nchunks):
        lo = min(V, c * per)
        m = min(V, lo + per) - lo
        q = m // 8
        amx.tile_config(cfg)
        for t in range(q + m - 8 * q):
            rows, _ = group8(t, q, lo)
            d = rows[1] - rows[0]
            amx.task_dots(w, rows[0] * K, d * K * 2, xb, a, rows[0] * n, d * n * 4)
        amx.tile_release()
        for j in range(lo, lo + m):
            for i in range(n):
                v = np.float64(a[j, i]) - _screen_bound(wnorm, err, j, i)
                if v - v == 0.0 and v > low[c, i]:               # finite values only
                    low[c, i] = v
    floor = np.full(n, -np.inf)
    for c in range(nchunks):
        for i in range(n):
            floor[i] = max(floor[i], low[c, i])
    for c in prange(nchunks):
        _clear(best_val, best_id, c)
        lo = min(V, c * per)
        hi = min(V, lo + per)
        y = np.empty((n, 8), np.float32)
        cols = (zero, zero, zero, zero, zero, zero, zero, zero)
        for j in range(lo, hi):
            one = (j, j, j, j, j, j, j, j)
            for i in range(n):
                up = np.float64(a[j, i]) + _screen_bound(wnorm, err, j, i)
                if up >= floor[i] or not (up - up == 0.0):     # a candidate, or a value that is not finite
                    gemv_task(w, one, 1, zero, x, np.int64(i), np.int64(i + 1), y, cols, no)
                    f = y[i, 0]
                    if f != f:
                        continue
                    bv, bi = best_val[c, i], best_id[c, i]
                    if bi < 0 or f > bv or (f == bv and j < bi):
                        best_val[c, i] = f
                        best_id[c, i] = j
    return _reduce(best_val, best_id, np.zeros((0, n), np.float32), ids, np.empty(0, np.float32),
                   np.empty((0, n), np.float32))


@njit(cache=True, fastmath=False, parallel=True)
def lm_head_argmax_tiled_kernel(x, a, err, w, wnorm, nchunks, ids, conf, stats):
    """``lm_head_argmax_kernel`` without a mask, from the logits a [n, V] the AMX tiles computed
    (``amx_linear``: FP32-accurate, not the FMA tiles' bits): the ids bit for bit the FMA
    kernel's, the confidences (conf not empty) and a shard's stats from the same logits, within
    FP32 rounding of the FMA kernel's. x [n, H] FP32, err its ``amx_linear.logit_bounds``, w
    [V, H] BF16 bits, wnorm [V] its ``row_norms_kernel``; a is overwritten.

    1. a[i, j] is within b_ij = (||w_j|| err[i, 0] + err[i, 1]) of the FMA tiles' f_ij, so
       L_i = max_j a[i, j] - max_j b_ij (over the finite a) is a lower bound of row i's best f.
    2. Per chunk: a token with a[i, j] + b_ij >= L_i (or a value or bound that is not finite)
       may be row i's best: its f_ij is computed on the FMA tiles (a dot's bits depend on its
       two rows only) and written over a[i, j]; the chunk's best is the largest of those, the
       lowest id on a tie (NaN never); the chunks' bests reduce as in the FMA kernel
       (``_reduce``). Every other token's f is below the best: the ids are the FMA kernel's.
    3. With conf: per chunk, sum_j exp(a[i, j] - best) in one vectorised pass (``_exp_sum``:
       a logit equal to the best counts 1), the chunks' sums added in order; conf = 1 / sum
       and, with stats, stats[1] = the sum. Returns the first row left with -1, or -1."""
    n, V = a.shape
    low = np.full((nchunks, n), -np.inf)
    best_val = np.empty((nchunks, n), np.float32)
    best_id = np.empty((nchunks, n), np.int64)
    sums = np.zeros((nchunks if conf.shape[0] else 0, n), np.float32)
    per = (V + nchunks - 1) // nchunks
    zero, no = np.int64(0), np.bool_(False)
    wmax = 0.0
    for j in range(V):
        if not wnorm[j] <= wmax:                                 # NaN too: then every token a candidate
            wmax = wnorm[j] if wnorm[j] == wnorm[j] else np.inf
    for c in prange(nchunks):
        lo, hi = min(V, c * per), min(V, (c + 1) * per)
        for i in range(n):
            low[c, i] = _finite_max(a[i], lo, hi)
    floor = np.full(n, -np.inf)                                  # max_j a - b_max <= best f
    for i in range(n):
        top = -np.inf
        for c in range(nchunks):
            top = max(top, low[c, i])
        floor[i] = top - _bound(wmax, err[i, 0], err[i, 1])
    for c in prange(nchunks):                  # the candidates' f, over their a, and each chunk's best
        _clear(best_val, best_id, c)
        y = np.empty((n, 1), np.float32)
        zeros = (zero, zero, zero, zero, zero, zero, zero, zero)
        for i in range(n):
            ai, e0, e1, fl = a[i], err[i, 0], err[i, 1], floor[i]
            th = fl - _bound(wmax, e0, e1)                       # below it no bound reaches the floor
            for j in range(min(V, c * per), min(V, (c + 1) * per)):
                if ai[j] < th and ai[j] != -np.inf:              # the usual case: one compare
                    continue
                up = np.float64(ai[j]) + _bound(wnorm[j], e0, e1)
                if up >= fl or not (up - up == 0.0):             # a candidate, or not finite
                    one = (j, j, j, j, j, j, j, j)
                    gemv_task(w, one, 1, zero, x, np.int64(i), np.int64(i + 1), y, zeros, no)
                    f = y[i, 0]
                    ai[j] = f
                    if f == f and (best_id[c, i] < 0 or f > best_val[c, i]):    # ids rise: a tie keeps the lower
                        best_val[c, i] = f
                        best_id[c, i] = j
    first_none = _reduce(best_val, best_id, np.zeros((0, n), np.float32), ids, conf, stats)
    if conf.shape[0]:                          # sum_j exp(l_j - best) over the logits a now holds
        for c in prange(nchunks):
            lo, hi = min(V, c * per), min(V, (c + 1) * per)
            for i in range(n):
                sums[c, i] = _exp_sum(a[i], lo, hi, a[i, ids[i]]) if ids[i] >= 0 else np.float32(0.0)
        for i in range(n):
            tot = np.float32(0.0)
            for c in range(nchunks):
                tot += sums[c, i]
            conf[i] = np.float32(1.0) / tot if ids[i] >= 0 else np.float32(np.nan)
            if stats.shape[0]:
                stats[1, i] = tot
    return first_none


@njit(cache=True, fastmath=False)
def _finite_max(row, lo, hi):
    """max of the finite row[lo .. hi - 1] (float64), -inf if none."""
    top = np.float32(-np.inf)
    for j in range(lo, hi):
        v = row[j]
        v = v if v - v == np.float32(0.0) else np.float32(-np.inf)
        top = v if v > top else top
    return np.float64(top)


@njit(cache=True, fastmath=_DOT_FLAGS)
def _exp_sum(row, lo, hi, b):
    """sum over j in lo .. hi - 1 of exp(row[j] - b), b the row's best: a logit equal to b
    counts exactly 1 (never exp(inf - inf)), a NaN nothing, one under b - 87 nothing (its
    term, under 1.6e-38, is below every tolerance); one vectorised pass (``simd.exp_le0``)."""
    s = np.float32(0.0)
    for j in range(lo, hi):
        v = row[j]
        d = v - b
        t = exp_le0(d)
        t = np.float32(0.0) if (d < EXP_MIN or v != v) else t
        t = np.float32(1.0) if v == b else t
        s += t
    return s


@njit(cache=True, fastmath=False, parallel=True)
def lm_head_argmax_fp8_kernel(x, w8, bitmask, ids, conf, stats):
    """``lm_head_argmax_kernel`` for an FP8 head (w8: the tuple of ``linear.fp8_chunk``):
    one chunk per row chunk of the weight."""
    n = x.shape[0]
    V = w8[0].shape[0]
    C = chunk_rows(w8)
    nchunks = chunks(w8)
    best_val = np.empty((nchunks, n), np.float32)
    best_id = np.empty((nchunks, n), np.int64)
    sums = np.zeros((nchunks if conf.shape[0] else 0, n), np.float32)
    zero, no = np.int64(0), np.bool_(False)
    for c in prange(nchunks):
        _clear(best_val, best_id, c)
        lo = c * C
        hi = min(V, lo + C)
        if _chunk_allowed(bitmask, n, lo, hi):
            y = np.empty((n, hi - lo), np.float32)
            qchunk(w8, c, zero, x, zero, n, y, np.int64(lo), no)
            ok = np.ones(8, np.bool_)
            for j in range(lo, hi, 8):                           # 8 tokens a group, in id order
                rows = (j, j + 1, j + 2, j + 3, j + 4, j + 5, j + 6, j + 7)
                _offer_group(best_val, best_id, sums, c, bitmask, y[:, j - lo:j - lo + 8], rows,
                             min(8, hi - j), ok)
    return _reduce(best_val, best_id, sums, ids, conf, stats)


@njit(cache=True, fastmath=False)
def _chunk_allowed(bitmask, n, lo, hi):
    """Some input row allows some token in lo .. hi - 1 (always, without a mask)."""
    if bitmask.shape[0] == 0:
        return True
    for j in range(lo, hi):
        if _any_allowed(bitmask, n, j):
            return True
    return False


@njit(cache=True, fastmath=False)
def _clear(best_val, best_id, c):
    for i in range(best_id.shape[1]):
        best_id[c, i] = -1
        best_val[c, i] = 0.0


@njit(cache=True, fastmath=False)
def _offer_group(best_val, best_id, sums, c, bitmask, y, rows, count, ok):
    """Offer a group's logits y[:, s] (token rows[s], for s < count with ok[s]: the rows read) to
    chunk c's bests of the input rows that allow them, per input row in s order: a non-NaN
    logit is kept if it is larger than the best, or as large with a lower id; with ``sums``
    (not empty) the chunk's running sum of exp(logit - its best) too, rescaled when the best
    rises (an online log-sum-exp; NaN logits not counted). The row's best, id and sum stay in
    registers across the group (a call per logit was 0.9 ms of a [32768, 1024] head's 2.3 at
    one row, 2.1 of 6.7 at eight, from L3)."""
    with_sums = sums.shape[0] > 0
    for i in range(y.shape[0]):
        bv = best_val[c, i]
        bi = best_id[c, i]
        if not with_sums and bi >= 0 and _group_max(y, i, count, ok) < bv:
            continue                      # nothing read beats the best: the usual case, one compare
        sm = sums[c, i] if with_sums else np.float32(0.0)
        for s in range(count):
            j = rows[s]
            if not ok[s] or not _allowed(bitmask, i, j):
                continue
            v = y[i, s]
            if v != v:
                continue
            if with_sums:                 # a logit equal to the best counts 1 (never exp(inf - inf))
                if bi < 0:
                    sm = np.float32(1.0)
                elif v > bv:
                    sm = sm * np.exp(bv - v) + np.float32(1.0)
                elif v == bv:
                    sm += np.float32(1.0)
                else:
                    sm += np.exp(v - bv)
            if bi < 0 or v > bv or (v == bv and j < bi):
                bv = v
                bi = j
        best_val[c, i] = bv
        best_id[c, i] = bi
        if with_sums:
            sums[c, i] = sm


@njit(cache=True, fastmath=False)
def _group_max(y, i, count, ok):
    """The largest non-NaN y[i, s] over s < count with ok[s] (read), -inf if none: an upper
    bound of what row i may take from the group (its mask can only remove logits)."""
    mx = np.float32(-np.inf)
    for s in range(count):
        v = y[i, s]
        if ok[s] and v > mx:
            mx = v
    return mx


@njit(cache=True, fastmath=False)
def _reduce(best_val, best_id, sums, ids, conf, stats):
    """ids[i] = the best of the chunks' bests (in chunk order, strict >: the lowest id wins a
    tie); with ``sums``, conf[i] = 1 / sum_c sums[c, i] exp(best_c - best) (NaN without a
    candidate); with ``stats`` [2, n] (a vocabulary shard's partial result, ops.lm_head),
    stats[0, i] = the best (-inf without a candidate) and, with ``sums``, stats[1, i] = the
    sum (0 without). Returns the first row left with -1, or -1."""
    nchunks, n = best_id.shape
    first_none = -1
    for i in range(n):
        bi = -1
        bv = np.float32(0.0)
        for c in range(nchunks):
            if best_id[c, i] >= 0 and (bi < 0 or best_val[c, i] > bv):
                bi = best_id[c, i]
                bv = best_val[c, i]
        ids[i] = bi
        if sums.shape[0] > 0:
            tot = np.float32(0.0)
            for c in range(nchunks):
                if best_id[c, i] >= 0:
                    tot += sums[c, i] * (np.float32(1.0) if best_val[c, i] == bv else np.exp(best_val[c, i] - bv))
            conf[i] = np.float32(1.0) / tot if bi >= 0 else np.float32(np.nan)
            if stats.shape[0] > 0:
                stats[1, i] = tot
        if stats.shape[0] > 0:
            stats[0, i] = bv if bi >= 0 else np.float32(-np.inf)
        if bi < 0 and first_none < 0:
            first_none = i
    return first_none


@njit(cache=True, fastmath=False)
def _topk_row(logits, bitmask, i, ids, probs):
    """Row i's top-k (k = ids.shape[1]) by insertion into a list kept sorted (value
    descending, lower id first on a tie: ids are visited in increasing order, so a new
    id goes after an equal value), then each candidate's probability by the confidence
    rule. Returns False when the row has no candidate."""
    V = logits.shape[1]
    k = ids.shape[1]
    vals = np.empty(k, np.float32)
    cnt = 0
    best = np.float32(0.0)
    total = np.float32(0.0)            # sum exp(l - best), a logit equal to the best counting 1
    for j in range(V):
        v = logits[i, j]
        if v != v or not _allowed(bitmask, i, j):
            continue
        if cnt == 0 and total == 0.0:
            best = v
            total = np.float32(1.0)
        elif v > best:
            total = total * np.exp(best - v) + np.float32(1.0)
            best = v
        elif v == best:
            total += np.float32(1.0)
        else:
            total += np.exp(v - best)
        if cnt < k or v > vals[cnt - 1]:
            at = min(cnt, k - 1)
            while at > 0 and v > vals[at - 1]:
                if at < k:
                    vals[at] = vals[at - 1]
                    ids[i, at] = ids[i, at - 1]
                at -= 1
            vals[at] = v
            ids[i, at] = j
            if cnt < k:
                cnt += 1
    for c in range(cnt):
        lc = vals[c]
        probs[i, c] = (np.float32(1.0) if lc == best else np.exp(lc - best)) / total
    for c in range(cnt, k):
        ids[i, c] = -1
        probs[i, c] = np.float32(0.0)
    return cnt > 0


@njit(cache=True, fastmath=False, parallel=True)
def masked_topk_kernel(logits, bitmask, ids, probs):
    """ids / probs [n, k]: each row's k best allowed non-NaN logits (spec:
    mtpkern.ops.lm_head.masked_topk). Returns the first row without a candidate, or -1."""
    n = logits.shape[0]
    ok = np.ones(n, np.bool_)
    for i in prange(n):
        ok[i] = _topk_row(logits, bitmask, i, ids, probs)
    for i in range(n):
        if not ok[i]:
            return i
    return -1
