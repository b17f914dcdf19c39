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

A sliding window (``row_start``) moves where a row's blocks begin: the chunks cut
the blocks of rows ``row_start .. row_len - 1`` only, and the first of them skips
its rows before ``row_start``, so nothing before the window is read (its table
entries included). Sinks join in the merge, once per (row, head), as a state of
max ``s_h``, sum 1 and no value. The value head dim ``Dv`` is ``v_cache``'s.
Absent inputs come as empty arrays (one compiled kernel serves both).
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
def _first_row(row_start, r):
    """Row r's first visible KV row: row_start[r], or 0 when row_start is empty (absent)."""
    return row_start[r] if row_start.shape[0] > 0 else 0


@njit(cache=True, fastmath=False)
def _blocks(start, L, BS, splits):
    """The blocks of KV rows ``start .. L - 1``: the first one, how many, and per chunk."""
    b0 = start // BS
    nblk = (L + BS - 1) // BS - b0
    return b0, nblk, (nblk + splits - 1) // splits


@njit(cache=True, fastmath=False)
def _chunks_used(start, L, BS, splits):
    """Chunks of a row's visible KV rows that hold blocks (the first ones; see the kernel)."""
    _, nblk, per = _blocks(start, L, BS, splits)
    return (nblk + per - 1) // per if per > 0 else 0


@njit(cache=True, fastmath=False, error_model="numpy")
def _merge(m_part, l_part, acc_part, splits, used, r, h, sinks, out):
    """out[r, h] from the (m, l, acc) states of row r's first ``used`` chunks (r * splits ..)
    and, when ``sinks`` is not empty, the sink of head h (max s_h, sum 1, no value).
    A chunk whose scores are all -inf still counts (m = -inf, l = 0; 0 * a NaN in its V
    stays NaN, as in the reference); every score -inf gives 0 / 0 = NaN, as the reference
    (a finite sink: 0)."""
    c0 = r * splits
    sink = sinks.shape[0] > 0
    top = np.float32(-np.inf)
    for c in range(c0, c0 + used):
        if m_part[c, h] > top:
            top = m_part[c, h]
    if sink and sinks[h] > top:
        top = sinks[h]
    o = out[r, h]
    o[:] = 0.0
    tot = np.float32(0.0)
    for c in range(c0, c0 + used):
        f = np.exp(m_part[c, h] - top)                  # top = -inf: NaN, and so is the row
        tot += f * l_part[c, h]
        for d in range(o.shape[0]):
            o[d] += f * acc_part[c, h, d]
    if sink:
        tot += np.exp(sinks[h] - top)
    for d in range(o.shape[0]):
        o[d] = o[d] / tot


@njit(cache=True, fastmath=False, parallel=True)
def paged_attention_kernel(q, k_cache, v_cache, block_tables, row_seq, row_start, row_len, sinks, scale, splits,
                           out):
    """q [n, Hq, D], out [n, Hq, Dv]; k_cache [NB, BS, Hkv, D], v_cache [NB, BS, Hkv, >= Dv] FP32,
    C-contiguous: the values are the first Dv = out.shape[2] columns of v_cache's rows (MLA's
    latent attention passes the latent cache as both: keys [c | k_pe], values c; a column
    slice instead would be a strided array, whose loops do not vectorise: 3.3x slower);
    row_start [n] (or empty: 0), sinks [Hq] (or empty: none); indices checked in range by the
    launcher; scale float32; splits: chunks of KV blocks per row (>= 1)."""
    n, Hq, D = q.shape
    BS = k_cache.shape[1]
    Hkv = k_cache.shape[2]
    Dv = out.shape[2]
    G = Hq // Hkv
    m_part = np.empty((n * splits, Hq), np.float32)                 # per (row, chunk): running max,
    l_part = np.empty((n * splits, Hq), np.float32)                 # running sum,
    acc_part = np.empty((n * splits, Hq, Dv), np.float32)           # and unnormalised output
    for t in prange(n * splits):
        r = t // splits
        s = row_seq[r]
        L = row_len[r]
        start = _first_row(row_start, r)
        b0, nblk, per = _blocks(start, L, BS, splits)
        m, l, acc = m_part[t], l_part[t], acc_part[t]
        m[:] = -np.inf
        l[:] = 0.0
        acc[:] = 0.0
        sc = np.empty((Hq, BS), np.float32)
        for b in range(b0 + (t % splits) * per, b0 + min(nblk, (t % splits + 1) * per)):
            blk = block_tables[s, b]
            # rows j0 + j of the block, j < cnt: the window's first block starts inside. The
            # loops count from 0 (sc holds the block's rows from j0): loops from j0 took 11 %
            # more at n = 1, context 512 (small shapes, 1 thread), 114 against 103 us
            j0 = max(0, start - b * BS)
            cnt = min(BS, L - b * BS) - j0
            for j in range(cnt):                        # each K row read once for its G heads
                for kvh in range(Hkv):
                    kr = k_cache[blk, j0 + j, kvh]
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
                    for d in range(Dv):
                        a[d] *= corr
                    m[h] = bm
                mh = m[h]
                for j in range(cnt):
                    sj = sc[h, j]
                    # a -inf score weighs 0, also while the running max is still -inf
                    # (exp(-inf - -inf) would be NaN); NaN scores stay NaN
                    p = np.float32(0.0) if sj == -np.inf else np.exp(sj - mh)
                    l[h] += p
                    vr = v_cache[blk, j0 + j, h // G]
                    for d in range(Dv):
                        a[d] += p * vr[d]
    if n * Hq * splits * Dv <= SMALL:                # merge the chunks of each (row, head)
        for t in range(n * Hq):
            r = t // Hq
            used = _chunks_used(_first_row(row_start, r), row_len[r], BS, splits)
            _merge(m_part, l_part, acc_part, splits, used, r, t % Hq, sinks, out)
    else:
        for t in prange(n * Hq):
            r = t // Hq
            used = _chunks_used(_first_row(row_start, r), row_len[r], BS, splits)
            _merge(m_part, l_part, acc_part, splits, used, r, t % Hq, sinks, out)
