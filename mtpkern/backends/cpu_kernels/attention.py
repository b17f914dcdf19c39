"""GQA attention over the paged KV cache on the CPU (spec: mtpkern.ops.attention).

The rows of one sequence share its KV: a decode step has one row per sequence, an
exact-mode module m + 1 rows (its input and the drafts so far), a prefill chunk many.
So the unit of work is a *unit*: up to ``RMAX`` rows of one sequence (grouped by
``row_seq``, in their order), and a task is one (unit, chunk of the unit's KV blocks),
serving all Hq query heads of all its rows: each K/V row is read from memory once per
task for every row of the unit that sees it, not once per row (and not G = Hq / Hkv
times). Each row keeps its own causal length ``row_len`` and window start ``row_start``:
a block is read when one of the unit's rows sees part of it, and each row's softmax and
values take only the KV rows it sees. The launcher asks for ``tasks`` tasks (a few per
thread); the chunk count per unit (``splits``) is what makes that many, so one sequence
at batch 1 keeps every thread busy.

A task walks its blocks a *span* at a time: the next ``max(1, SPAN_ROWS // BS)`` blocks
that some row of the unit sees (``[BS, Hkv, D]`` each, read front to back). For a span:

- block by block and KV head by KV head, the scores of the unit's R x G query vectors of
  that head against the block's K rows, side by side in one score row per vector
  (``_scores``: 4 query vectors against 2 K rows, 6 loads per 8 multiply-adds; the
  queries are copied once per task by KV head, scale folded in);
- per (row, head) one online softmax step over all the span's KV rows it sees (running
  max m, sum l, FP32 accumulator [Dv], rescaled when the span raises m: ``_above`` counts
  the scores over m, vectorised, and only then is the span's max taken); ``p = exp(s - m)``
  by ``exp_le0``, a polynomial that vectorises over the rows (Numba has no vector ``exp``
  without SVML, and ``np.exp`` is a libm call per score). A step per span, not per block:
  its fixed costs (the count, the sum's reduction, the loops' ends) were a quarter of an
  exact-mode module's attention at blocks of 16 (benchmarks/README.md);
- block by block again, the values (``_values``): ``_pv4x4`` adds 4 V rows, each times
  its p, to 4 accumulators in one pass; a block at a time, so the passes over a block's
  V rows find them in L1.

The rows a span's block holds for row u are contiguous, and so are the span's columns row
u sees: its KV rows are one range, so a block it sees only in part is its first or last,
and the blocks between are whole; a block no row sees is left out of the span.

While a block is computed, the next one's K and V lines are prefetched: the blocks of a
sequence lie anywhere in the pool, and the hardware prefetcher starts cold on each (one row
over 32768 KV rows, one thread: 14.4 -> 8.7 ms of CPU time). The tiles of ``simd`` ask for
each line of the next block as they load the same line of theirs (docs/cpu.md); ``_scores``
and ``_pv_rows`` have a KV head's share of them asked for (``_prefetch``) before they run.

The steps are helper calls per (block, KV head), the small helpers inlined into them
(``inline="always"``): a Numba call passing 6 arrays cost more than its 8 dots. A helper
inlined at Numba's level takes its caller's flags, so the softmax step runs in its own
``_softmax_span`` (with the dot flags: the sum of p vectorises), not in ``_chunk_task``.
The cpu backend's own key cache (``CpuBackend.empty_keys``, blocks of 16k rows) is
``[NB, Hkv, D, BS]``, a block's rows innermost (``keys_t``): there ``_scores_t`` computes
the scores with the 16-lane tiles of ``simd`` instead. The values use ``simd``'s tiles
wherever Dv % 16 == 0, whichever the keys' layout (MLA's latent attention included).

Then one pass per (row, head) merges the chunks' (m, l, acc) states in chunk order (a
fixed order: the result does not depend on the schedule; the chunk count comes from
``tasks``, so two thread counts may differ in the last bits, as they did before). A chunk that
holds none of a row's KV rows leaves the state (-inf, 0, 0), which adds nothing. Sinks
join in the merge, once per (row, head), as a state of max ``s_h``, sum 1 and no value.
The value head dim ``Dv`` is ``out``'s (``v_cache``'s rows may be wider: MLA's latent
rows). Absent inputs come as empty arrays (one compiled kernel serves both).

A sliding window (``row_start``) moves where a row's KV begins: a block no row of the
unit sees is not read, nor is its table entry (it may already be freed), and a row
takes from a block only the rows from its ``row_start`` on.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from numba.extending import intrinsic, overload

from .linear import _DOT_FLAGS, SMALL
from .simd import VL, emit_prefetch, exp_le0, pv1, pv4, pv8, qk1, qk4, qk8

#: rows of one sequence per unit: a prefill chunk of n rows becomes ceil(n / RMAX) units,
#: each reading the KV its rows see once; the unit's queries and accumulators
#: (RMAX * Hq * (D + Dv) floats: 64 KiB at Hq = 16, D = Dv = 64) stay in L1 / L2
RMAX = 8
#: KV rows of a span, in whole blocks (max(1, SPAN_ROWS // BS) of them): a query vector's
#: online softmax step takes a span at once, so its fixed costs (a count of the scores above
#: the running max, a sum, the loops' ends) are paid once per 128 rows, not once per block
SPAN_ROWS = 128


@intrinsic
def _prefetch(typingctx, a, i):
    """Ask for the cache line of element i of the C-contiguous array a (flat index) to be
    loaded (``llvm.prefetch``: read, keep in every cache level); no effect on the results."""
    if isinstance(a, types.Array) and isinstance(i, types.Integer):
        def codegen(context, builder, sig, args):
            arr = context.make_array(sig.args[0])(context, builder, args[0])
            emit_prefetch(builder, arr.data, args[1], locality=3)
            return context.get_dummy_value()

        return types.none(a, i), codegen
    return None


@njit(cache=True, fastmath=_DOT_FLAGS, inline="always")
def _qk4(k, q0, q1, q2, q3):
    """4 query vectors [D] against one key row k [D]: 4 dots, k loaded once per step."""
    a0 = np.float32(0.0)
    a1 = np.float32(0.0)
    a2 = np.float32(0.0)
    a3 = np.float32(0.0)
    for d in range(q0.shape[0]):
        kd = k[d]
        a0 += q0[d] * kd
        a1 += q1[d] * kd
        a2 += q2[d] * kd
        a3 += q3[d] * kd
    return a0, a1, a2, a3


@njit(cache=True, fastmath=_DOT_FLAGS, inline="always")
def _qk4x2(k0, k1, q0, q1, q2, q3):
    """4 query vectors against two key rows: 8 dots, 6 loads per 8 multiply-adds."""
    a0 = np.float32(0.0)
    a1 = np.float32(0.0)
    a2 = np.float32(0.0)
    a3 = np.float32(0.0)
    b0 = np.float32(0.0)
    b1 = np.float32(0.0)
    b2 = np.float32(0.0)
    b3 = np.float32(0.0)
    for d in range(q0.shape[0]):
        x0, x1, x2, x3 = q0[d], q1[d], q2[d], q3[d]
        ka, kb = k0[d], k1[d]
        a0 += x0 * ka
        a1 += x1 * ka
        a2 += x2 * ka
        a3 += x3 * ka
        b0 += x0 * kb
        b1 += x1 * kb
        b2 += x2 * kb
        b3 += x3 * kb
    return a0, a1, a2, a3, b0, b1, b2, b3


@njit(cache=True, fastmath=_DOT_FLAGS, inline="always")
def _qk1(k, q0):
    a0 = np.float32(0.0)
    for d in range(q0.shape[0]):
        a0 += q0[d] * k[d]
    return a0


@njit(cache=True, fastmath=False, inline="always")
def _above(s, m):
    """How many of s [J] are above m: a count, which vectorises where a running max (a
    chain of compares) did not; a NaN is never above."""
    c = 0
    for j in range(s.shape[0]):
        c += 1 if s[j] > m else 0
    return c


@njit(cache=True, fastmath=False, inline="always")
def _max(s):
    """The largest of s [J >= 1] in 4 interleaved chains (one chain waits 4 cycles per
    compare). A NaN may or may not be taken: either way the row's p and sum are NaN."""
    J = s.shape[0]
    m0 = s[0]
    m1 = m0
    m2 = m0
    m3 = m0
    j = 1
    while j + 4 <= J:
        m0 = s[j] if s[j] > m0 else m0
        m1 = s[j + 1] if s[j + 1] > m1 else m1
        m2 = s[j + 2] if s[j + 2] > m2 else m2
        m3 = s[j + 3] if s[j + 3] > m3 else m3
        j += 4
    while j < J:
        m0 = s[j] if s[j] > m0 else m0
        j += 1
    m0 = m1 if m1 > m0 else m0
    m2 = m3 if m3 > m2 else m2
    return m2 if m2 > m0 else m0


@njit(cache=True, fastmath=_DOT_FLAGS)
def _scores(qk, kb, kvh, ulo, uhi, sc, c):
    """sc[i, c + j] = qk[i] . kb[j, kvh] for the unit's R x G query vectors qk [R * G, D] and
    the block's K rows ulo .. uhi - 1 (kb: the block of the K cache, [BS, Hkv, D]), 2 K rows
    x 4 query vectors at a time. The helpers it inlines (``inline="always"``) are inlined at
    Numba's level and take its flags."""
    RG = qk.shape[0]
    j = ulo
    while j + 2 <= uhi:
        k0, k1 = kb[j, kvh], kb[j + 1, kvh]
        i = 0
        while i + 4 <= RG:
            s0, s1, s2, s3, t0, t1, t2, t3 = _qk4x2(k0, k1, qk[i], qk[i + 1], qk[i + 2], qk[i + 3])
            sc[i, c + j] = s0
            sc[i + 1, c + j] = s1
            sc[i + 2, c + j] = s2
            sc[i + 3, c + j] = s3
            sc[i, c + j + 1] = t0
            sc[i + 1, c + j + 1] = t1
            sc[i + 2, c + j + 1] = t2
            sc[i + 3, c + j + 1] = t3
            i += 4
        while i < RG:
            sc[i, c + j] = _qk1(k0, qk[i])
            sc[i, c + j + 1] = _qk1(k1, qk[i])
            i += 1
        j += 2
    if j < uhi:
        kr = kb[j, kvh]
        i = 0
        while i + 4 <= RG:
            s0, s1, s2, s3 = _qk4(kr, qk[i], qk[i + 1], qk[i + 2], qk[i + 3])
            sc[i, c + j] = s0
            sc[i + 1, c + j] = s1
            sc[i + 2, c + j] = s2
            sc[i + 3, c + j] = s3
            i += 4
        while i < RG:
            sc[i, c + j] = _qk1(kr, qk[i])
            i += 1


@njit(cache=True, fastmath=_DOT_FLAGS)
def _scores_t(qk, kt, ulo, uhi, sc, c, kpf, kpo):
    """``_scores`` over a block of the transposed key cache: kt [D, BS] is the block's keys of
    one head with the rows innermost (``BS % 16 == 0``), so the scores of 16 KV rows are
    vector FMAs without a reduction (``simd.qk8`` / ``qk4`` / ``qk1``: 8, 4 or 1 query vectors
    a pass), for the 16-row groups that hold ``ulo .. uhi - 1`` (the group's other rows lie in
    the block and go unused). The tiles ask for kpf's lines from ``kpo`` on as they load theirs."""
    RG = qk.shape[0]
    j0 = (ulo // VL) * VL
    while j0 < uhi:
        i = 0
        while i + 8 <= RG:
            qk8(kt, qk, sc, i, j0, c, kpf, kpo)
            i += 8
        while i + 4 <= RG:
            qk4(kt, qk, sc, i, j0, c, kpf, kpo)
            i += 4
        while i < RG:
            qk1(kt, qk, sc, i, j0, c, kpf, kpo)
            i += 1
        j0 += VL


@njit(cache=True, fastmath=_DOT_FLAGS)
def _values(ah, sc, c, vb, kvh, jlo, jhi, G, vpf, vpo):
    """ah[i] += sum_j sc[i, c + j] vb[j, kvh, :Dv] over the rows jlo[u] .. jhi[u] - 1 of the
    block vb ([BS, Hkv, >= Dv]) that row u of the unit sees, for its G query vectors
    i = u * G .. u * G + G - 1 (ah [R * G, Dv]; the block's weights are sc's columns from c
    on). Consecutive rows of the unit that see the same rows of the block go in one pass:
    the 16-column tiles of ``simd.pv8`` / ``pv4`` / ``pv1`` where Dv % 16 == 0 (asking for
    vpf's lines from ``vpo`` on as they load theirs), else ``_pv_rows``. A block at a time,
    not a span: the tiles' passes over a block's V rows (two for 8 query vectors of
    Dv = 64, each over half the columns) find them in L1, where a span's would not."""
    R = jlo.shape[0]
    vec = ah.shape[1] % VL == 0
    u = 0
    while u < R:
        lo, hi = jlo[u], jhi[u]
        u1 = u + 1
        while u1 < R and jlo[u1] == lo and jhi[u1] == hi:
            u1 += 1
        i, i1 = u * G, u1 * G
        u = u1
        if lo >= hi:
            continue
        if not vec:
            _pv_rows(ah, sc, c, vb, lo, hi, kvh, i, i1)
            continue
        while i + 8 <= i1:
            pv8(vb, kvh, sc, ah, i, lo, hi, c, vpf, vpo)
            i += 8
        while i + 4 <= i1:
            pv4(vb, kvh, sc, ah, i, lo, hi, c, vpf, vpo)
            i += 4
        while i < i1:
            pv1(vb, kvh, sc, ah, i, lo, hi, c, vpf, vpo)
            i += 1


@njit(cache=True, fastmath=_DOT_FLAGS)
def _softmax_span(sc, clo, chi, G, mh, lh, ah):
    """The online softmax step of a span for each row u of the unit (its G query vectors
    u * G ..): over its scores sc[i, clo[u]:chi[u]] (replaced by their weights)."""
    for u in range(clo.shape[0]):
        if clo[u] < chi[u]:
            _softmax_step(sc, clo[u], chi[u], u * G, u * G + G, mh, lh, ah)


@njit(cache=True, fastmath=_DOT_FLAGS, inline="always")
def _softmax_step(sc, lo, hi, i0, i1, mh, lh, ah):
    """The online softmax step of query vectors i0 .. i1 - 1 over the scores sc[i, lo:hi]
    (replaced by their weights p)."""
    J = hi - lo
    for i in range(i0, i1):
        si = sc[i, lo:hi]
        if _above(si, mh[i]) > 0:                      # a new running max: rescale what we have
            bm = _max(si)
            a = ah[i]
            corr = np.exp(mh[i] - bm)
            lh[i] *= corr
            for d in range(a.shape[0]):
                a[d] *= corr
            mh[i] = bm
        m = mh[i]
        tot = np.float32(0.0)
        for j in range(J):
            # a -inf score weighs 0, also while m is still -inf (exp(-inf - -inf) would
            # be NaN); a NaN score stays NaN. si is a view indexed from 0: si[lo + j]
            # would carry Numba's negative-index wraparound, which kept the loop scalar
            sj = si[j]
            p = np.float32(0.0) if sj == -np.inf else exp_le0(sj - m)
            si[j] = p
            tot += p
        lh[i] += tot


@njit(cache=True, fastmath=_DOT_FLAGS, inline="always")
def _pv_rows(ah, sc, c, vb, lo, hi, kvh, i0, i1):
    """ah[i] += sum_j sc[i, c + j] vb[j, kvh] (j = lo .. hi - 1) for query vectors i0 .. i1 - 1."""
    a, b = c + lo, c + hi
    i = i0
    while i + 4 <= i1:                                 # 4 vectors x 4 V rows per pass
        _pv4x4(ah[i], ah[i + 1], ah[i + 2], ah[i + 3], sc[i, a:b], sc[i + 1, a:b], sc[i + 2, a:b],
               sc[i + 3, a:b], vb, lo, kvh)
        i += 4
    while i < i1:
        _pv1x4(ah[i], sc[i, a:b], vb, lo, kvh)
        i += 1


@njit(cache=True, fastmath=_DOT_FLAGS, inline="always")
def _pv4x4(a0, a1, a2, a3, p0, p1, p2, p3, vb, lo, kvh):
    """a0..a3 [Dv] += sum_j p0..p3[j] vb[lo + j, kvh] (the first Dv values): 4 V rows per pass
    over the 4 accumulators, each V row loaded once for the 4 of them."""
    J = p0.shape[0]
    j = 0
    while j + 4 <= J:
        v0, v1, v2, v3 = vb[lo + j, kvh], vb[lo + j + 1, kvh], vb[lo + j + 2, kvh], vb[lo + j + 3, kvh]
        w00, w01, w02, w03 = p0[j], p0[j + 1], p0[j + 2], p0[j + 3]
        w10, w11, w12, w13 = p1[j], p1[j + 1], p1[j + 2], p1[j + 3]
        w20, w21, w22, w23 = p2[j], p2[j + 1], p2[j + 2], p2[j + 3]
        w30, w31, w32, w33 = p3[j], p3[j + 1], p3[j + 2], p3[j + 3]
        for d in range(a0.shape[0]):
            x0, x1, x2, x3 = v0[d], v1[d], v2[d], v3[d]
            a0[d] += w00 * x0 + w01 * x1 + w02 * x2 + w03 * x3
            a1[d] += w10 * x0 + w11 * x1 + w12 * x2 + w13 * x3
            a2[d] += w20 * x0 + w21 * x1 + w22 * x2 + w23 * x3
            a3[d] += w30 * x0 + w31 * x1 + w32 * x2 + w33 * x3
        j += 4
    while j < J:
        v0 = vb[lo + j, kvh]
        w00, w10, w20, w30 = p0[j], p1[j], p2[j], p3[j]
        for d in range(a0.shape[0]):
            x0 = v0[d]
            a0[d] += w00 * x0
            a1[d] += w10 * x0
            a2[d] += w20 * x0
            a3[d] += w30 * x0
        j += 1


@njit(cache=True, fastmath=_DOT_FLAGS, inline="always")
def _pv1x4(a0, p0, vb, lo, kvh):
    """a0 [Dv] += sum_j p0[j] vb[lo + j, kvh]: 4 V rows per pass over a0."""
    J = p0.shape[0]
    j = 0
    while j + 4 <= J:
        v0, v1, v2, v3 = vb[lo + j, kvh], vb[lo + j + 1, kvh], vb[lo + j + 2, kvh], vb[lo + j + 3, kvh]
        w0, w1, w2, w3 = p0[j], p0[j + 1], p0[j + 2], p0[j + 3]
        for d in range(a0.shape[0]):
            a0[d] += w0 * v0[d] + w1 * v1[d] + w2 * v2[d] + w3 * v3[d]
        j += 4
    while j < J:
        v0 = vb[lo + j, kvh]
        w0 = p0[j]
        for d in range(a0.shape[0]):
            a0[d] += w0 * v0[d]
        j += 1


def kv_block(cache, scale, tab, blk, lo, hi, dec):
    """Block ``blk`` of a KV cache as FP32 rows ``[BS, Hkv, W]`` (inside jitted code only)."""
    raise NotImplementedError("kv_block runs inside the cpu kernels only")


@overload(kv_block, jit_options={"fastmath": False})
def _kv_block(cache, scale, tab, blk, lo, hi, dec):
    """An FP32 cache: its block, as it is. An FP8 cache (uint8 E4M3 codes, ``scale`` [NB, BS,
    Hkv] FP32): rows lo .. hi - 1 of the block decoded into ``dec`` [BS, Hkv, W], each code read
    once, ``tab[code] * scale`` (``tab``: ``quant.e4m3_table()``, the FP8 weights' decode; one
    FP32 rounding, as mtpkern.ops.kv_fp8.dequantize), and ``dec`` returned."""
    if isinstance(cache, types.Array) and cache.dtype == types.uint8:
        def decode(cache, scale, tab, blk, lo, hi, dec):
            cb, sb = cache[blk], scale[blk]
            for j in range(lo, hi):
                for h in range(cb.shape[1]):
                    s = sb[j, h]
                    src, dst = cb[j, h], dec[j, h]
                    for d in range(src.shape[0]):
                        dst[d] = tab[src[d]] * s
            return dec
        return decode
    return lambda cache, scale, tab, blk, lo, hi, dec: cache[blk]


def kv_prefetch(cache, dec):
    """The FP32 array the value tiles ask lines of (inside jitted code only)."""
    raise NotImplementedError("kv_prefetch runs inside the cpu kernels only")


@overload(kv_prefetch)
def _kv_prefetch(cache, dec):
    """An FP32 cache: the cache (its next block's lines); an FP8 one: its decoded rows ``dec``
    (the tiles' prefetch takes FP32 arrays; the codes are a quarter of the lines)."""
    if isinstance(cache, types.Array) and cache.dtype == types.uint8:
        return lambda cache, dec: dec
    return lambda cache, dec: cache


@njit(cache=True, fastmath=False)
def _seen(first, last, b, BS):
    """Whether some row u (its KV rows first[u] .. last[u] - 1) sees a row of block b."""
    for u in range(first.shape[0]):
        if first[u] < (b + 1) * BS and last[u] > b * BS and first[u] < last[u]:
            return True
    return False


@njit(cache=True, fastmath=False)
def _first_row(row_start, r):
    """Row r's first visible KV row: row_start[r], or 0 when row_start is empty (absent)."""
    return row_start[r] if row_start.shape[0] > 0 else 0


@njit(cache=True, fastmath=False)
def _units(row_seq, row_start, row_len, BS):
    """The rows grouped into units: ``rows`` (row indices, sorted by sequence, stable),
    ``ptr`` [U + 1] (unit u is rows[ptr[u]:ptr[u + 1]], at most RMAX of one sequence),
    and per unit its first block and block count (of KV rows min row_start .. max row_len - 1)."""
    n = row_seq.shape[0]
    rows = np.argsort(row_seq, kind="mergesort").astype(np.int32)
    ptr = np.empty(n + 1, np.int32)
    U = 0
    i = 0
    while i < n:
        ptr[U] = i
        j = i + 1
        while j < n and j - i < RMAX and row_seq[rows[j]] == row_seq[rows[i]]:
            j += 1
        U += 1
        i = j
    ptr[U] = n
    b0 = np.empty(U, np.int32)
    nblk = np.empty(U, np.int32)
    for u in range(U):
        lo = np.int32(2 ** 31 - 1)
        hi = np.int32(0)
        for i in range(ptr[u], ptr[u + 1]):
            lo = min(lo, _first_row(row_start, rows[i]))
            hi = max(hi, row_len[rows[i]])
        b0[u] = lo // BS
        nblk[u] = (hi + BS - 1) // BS - lo // BS
    return rows, ptr[:U + 1], b0, nblk


@njit(cache=True, fastmath=False)
def _chunk_task(q, k_cache, v_cache, block_tables, row_seq, row_start, row_len, scale, rows, lo_row, R,
                b_lo, b_hi, m, l, acc, keys_t, k_scale, v_scale, tab):
    """One task: the unit of rows rows[lo_row : lo_row + R] over blocks b_lo .. b_hi - 1 of
    their sequence. Its states are per (KV head, query vector i = u * G + g: row u of the
    unit, query head kvh * G + g): m, l [Hkv, R * G] (running max, sum) and acc
    [Hkv, R * G, Dv]. ``keys_t``: k_cache is [NB, Hkv, D, BS] (``_scores_t``). FP8 caches
    (uint8, scales ``k_scale`` / ``v_scale``): each block's rows some row sees are decoded
    into a block of FP32 rows (``kv_block``) before the scores and before the values."""
    Hq, D = q.shape[1], q.shape[2]
    BS, Hkv = _block_size_heads(k_cache, keys_t)
    G = Hq // Hkv
    RG = R * G
    s = row_seq[rows[lo_row]]
    qs = np.empty((Hkv, RG, D), np.float32)            # the unit's queries by KV head, times scale
    first = np.empty(R, np.int32)
    last = np.empty(R, np.int32)
    for u in range(R):
        r = rows[lo_row + u]
        first[u] = _first_row(row_start, r)
        last[u] = row_len[r]
        for kvh in range(Hkv):
            for g in range(G):
                for d in range(D):
                    qs[kvh, u * G + g, d] = q[r, kvh * G + g, d] * scale
    m[:] = -np.inf
    l[:] = 0.0
    acc[:] = 0.0
    SB = max(1, SPAN_ROWS // BS)                       # blocks of a span
    sc = np.empty((Hkv, RG, SB * BS), np.float32)      # a span's scores, then weights, by KV head
    tbk = np.empty(SB, np.int32)                       # the table entries of the span's blocks some row sees,
    tpf = np.empty(SB, np.int32)                       # and those of the blocks after them (or theirs)
    tlo = np.empty((SB, R), np.int32)                  # row u sees rows tlo[t, u] .. thi[t, u] - 1
    thi = np.empty((SB, R), np.int32)                  # of the span's t-th block,
    clo = np.empty(R, np.int32)                        # columns clo[u] .. chi[u] - 1 of its scores
    chi = np.empty(R, np.int32)
    kblock = BS * Hkv * D                              # floats of one block of each cache
    vblock = BS * Hkv * v_cache.shape[3]
    vec = acc.shape[2] % VL == 0                       # the values by the tiles of simd (their own prefetch)
    fp8 = k_scale.shape[0] > 0
    kdec = np.empty((BS if fp8 else 0, Hkv, D), np.float32)                 # an FP8 block, decoded
    vdec = np.empty((BS if fp8 else 0, Hkv, v_cache.shape[3]), np.float32)
    kpf = kv_prefetch(k_cache, kdec)                   # (never an FP8 cache's: keys_t is FP32 only)
    vpf = kv_prefetch(v_cache, vdec)
    b = b_lo
    while b < b_hi:
        ns = 0                                         # the span: the next SB blocks some row sees
        clo[:] = SB * BS
        chi[:] = 0
        while ns < SB and b < b_hi:
            if _seen(first, last, b, BS):              # a block no row sees is not read, nor its entry
                base = b * BS
                for u in range(R):
                    lo = max(0, first[u] - base)
                    hi = min(BS, last[u] - base)
                    tlo[ns, u] = lo
                    thi[ns, u] = hi
                    if lo < hi:
                        clo[u] = min(clo[u], ns * BS + lo)
                        chi[u] = max(chi[u], ns * BS + hi)
                # the next block is most likely elsewhere in the pool, where the prefetcher is
                # cold: its lines are asked for a KV head's share at a time, as this block's are
                # used (its entry only if some row reads it: one no row reads may be freed)
                nxt = block_tables[s, b + 1] if b + 1 < b_hi and _seen(first, last, b + 1, BS) else -1
                tbk[ns] = block_tables[s, b]
                tpf[ns] = nxt if 0 <= nxt < k_cache.shape[0] else tbk[ns]
                ns += 1
            b += 1
        for t in range(ns):                            # scores, block by block
            blk = tbk[t]
            nxt = tpf[t]
            ulo = BS
            uhi = 0
            for u in range(R):
                if tlo[t, u] < thi[t, u]:
                    ulo = min(ulo, tlo[t, u])
                    uhi = max(uhi, thi[t, u])
            kb = kv_block(k_cache, k_scale, tab, blk, ulo, uhi, kdec)
            for kvh in range(Hkv):
                if keys_t:
                    _scores_t(qs[kvh], kb[kvh], ulo, uhi, sc[kvh], t * BS, kpf, nxt * kblock + kvh * (kblock // Hkv))
                    continue
                if nxt != blk:
                    for off in range(kvh * kblock // Hkv, (kvh + 1) * kblock // Hkv, 16):
                        _prefetch(k_cache, nxt * kblock + off)
                _scores(qs[kvh], kb, kvh, ulo, uhi, sc[kvh], t * BS)
        for kvh in range(Hkv):                         # one softmax step a span per (row, head)
            _softmax_span(sc[kvh], clo, chi, G, m[kvh], l[kvh], acc[kvh])
        for t in range(ns):                            # the values, block by block
            vlo = BS
            vhi = 0
            for u in range(R):
                if tlo[t, u] < thi[t, u]:
                    vlo = min(vlo, tlo[t, u])
                    vhi = max(vhi, thi[t, u])
            vb = kv_block(v_cache, v_scale, tab, tbk[t], vlo, vhi, vdec)
            for kvh in range(Hkv):
                if not vec and tpf[t] != tbk[t]:
                    for off in range(kvh * vblock // Hkv, (kvh + 1) * vblock // Hkv, 16):
                        _prefetch(v_cache, tpf[t] * vblock + off)
                _values(acc[kvh], sc[kvh], t * BS, vb, kvh, tlo[t], thi[t], G, vpf,
                        0 if fp8 else tpf[t] * vblock)


@njit(cache=True, fastmath=False)
def _block_size_heads(k_cache, keys_t):
    """(BS, Hkv) of a key cache [NB, BS, Hkv, D], or of the transposed [NB, Hkv, D, BS]."""
    if keys_t:
        return k_cache.shape[3], k_cache.shape[1]
    return k_cache.shape[1], k_cache.shape[2]


@njit(cache=True, fastmath=False, error_model="numpy")
def _merge(m_part, l_part, acc_part, r, h, sinks, out):
    """out[r, h] from the (m, l, acc) states of row r's chunks, in chunk order, and, when
    ``sinks`` is not empty, the sink of head h (max s_h, sum 1, no value). A chunk whose
    scores are all -inf, or that holds none of the row's KV, counts with m = -inf, l = 0
    (0 * a NaN in its V stays NaN, as in the reference); every score -inf gives 0 / 0 =
    NaN, as the reference (a finite sink: 0)."""
    splits = m_part.shape[1]
    sink = sinks.shape[0] > 0
    top = np.float32(-np.inf)
    for c in range(splits):
        if m_part[r, c, h] > top:
            top = m_part[r, c, h]
    if sink and sinks[h] > top:
        top = sinks[h]
    o = out[r, h]
    o[:] = 0.0
    tot = np.float32(0.0)
    for c in range(splits):
        f = np.exp(m_part[r, c, h] - top)              # top = -inf: NaN, and so is the row
        tot += f * l_part[r, c, h]
        a = acc_part[r, c, h]
        for d in range(o.shape[0]):
            o[d] += f * a[d]
    if sink:
        tot += np.exp(sinks[h] - top)
    for d in range(o.shape[0]):
        o[d] = o[d] / tot


@njit(cache=True, fastmath=False, parallel=True)
def paged_attention_kernel(q, k_cache, v_cache, block_tables, row_seq, row_start, row_len, sinks, scale, tasks,
                           out, keys_t, k_scale, v_scale, tab):
    """q [n, Hq, D], out [n, Hq, Dv]; k_cache [NB, BS, Hkv, D] (``keys_t``: [NB, Hkv, D, BS],
    BS % 16 == 0, the cpu backend's key cache), v_cache [NB, BS, Hkv, >= Dv] FP32,
    C-contiguous: the values are the first Dv = out.shape[2] columns of v_cache's rows (MLA's
    latent attention passes the latent cache as both: keys [c | k_pe], values c; a column
    slice instead would be a strided array, whose loops do not vectorise: 3.3x slower);
    row_start [n] (or empty: 0), sinks [Hq] (or empty: none); indices checked in range by the
    launcher; scale float32; tasks: about how many tasks to make (>= 1; a few per thread).
    FP8 caches: k_cache / v_cache uint8 E4M3 codes [NB, BS, Hkv, *] (not ``keys_t``), their
    scales k_scale / v_scale [NB, BS, Hkv] FP32, tab the 256 E4M3 values; FP32 caches: the
    scales empty [0, 0, 0] (tab unread)."""
    n, Hq, D = q.shape
    BS, Hkv = _block_size_heads(k_cache, keys_t)
    Dv = out.shape[2]
    G = Hq // Hkv
    rows, ptr, b0, nblk = _units(row_seq, row_start, row_len, BS)
    U = b0.shape[0]
    splits = max(1, min(nblk.max(), (tasks + U - 1) // U))      # chunks per unit
    m_part = np.empty((n, splits, Hq), np.float32)              # per (row, chunk): running max,
    l_part = np.empty((n, splits, Hq), np.float32)              # running sum,
    acc_part = np.empty((n, splits, Hq, Dv), np.float32)        # and unnormalised output
    for t in prange(U * splits):
        u, c = t // splits, t % splits
        R = ptr[u + 1] - ptr[u]
        per = (nblk[u] + splits - 1) // splits
        m = np.empty((Hkv, R * G), np.float32)
        l = np.empty((Hkv, R * G), np.float32)
        acc = np.empty((Hkv, R * G, Dv), np.float32)
        _chunk_task(q, k_cache, v_cache, block_tables, row_seq, row_start, row_len, scale, rows, ptr[u], R,
                    b0[u] + min(nblk[u], c * per), b0[u] + min(nblk[u], (c + 1) * per), m, l, acc, keys_t,
                    k_scale, v_scale, tab)
        for i in range(R):
            r = rows[ptr[u] + i]
            for kvh in range(Hkv):
                for g in range(G):
                    m_part[r, c, kvh * G + g] = m[kvh, i * G + g]
                    l_part[r, c, kvh * G + g] = l[kvh, i * G + g]
                    acc_part[r, c, kvh * G + g] = acc[kvh, i * G + g]
    if n * Hq * splits * Dv <= SMALL:                # merge the chunks of each (row, head)
        for t in range(n * Hq):
            _merge(m_part, l_part, acc_part, t // Hq, t % Hq, sinks, out)
    else:
        for t in prange(n * Hq):
            _merge(m_part, l_part, acc_part, t // Hq, t % Hq, sinks, out)
