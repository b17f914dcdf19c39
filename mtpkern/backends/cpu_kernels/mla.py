"""MLA on the CPU: the latent-row write and absorbed attention (spec: mtpkern.ops.mla).

``mla_latent_write_kernel``: one serial pass over the rows, in order (a slot given
twice ends with the later row, as the reference's assignment): RMSNorm of the L
compressed values straight into the row's slot, then the R rope-key values
rotated there, then (when a query is given) the row's query copied out with each
head's R rope dims rotated by the same angles. A row is L + R values (576 for DeepSeek-V3): a parallel region
would cost more to start than the whole write (``linear.SMALL``).

The absorbed attention, in three steps (the launcher: ``CpuBackend.mla_attention_absorbed``):

- ``mla_absorb_kernel``: one task per (row, head): ``q_full[r, h] = [w_uk[h]^T q_nope |
  q_pe]`` (P x L multiply-adds, the weight widened from BF16 bits or FP32 by
  ``linear.widen``, indexed directly: one specialisation per weight dtype);
- the latent attention is ``attention.paged_attention_kernel`` itself, with one KV head:
  keys the latent rows ``[c | k_pe]``, values their first L columns (``c``: the kernel
  reads the first ``out.shape[2]`` columns of the value rows, so the latent cache is passed
  as both, contiguous). Tasks per (row, chunk of blocks) serve every head, so each latent
  row is read once per task, not once per head, with an online softmax and a merge;
- ``mla_out_kernel``: one task per (row, head): ``out = w_uv[h] o_lat``.

DSA's sparse attention (``index``) is the same latent attention over a gathered cache:
``gather_listed_kernel`` copies row r's listed rows, in list order, to the positions 0, 1, ..
of a sequence of its own (blocks of ``LISTED_BS`` rows), and ``paged_attention_kernel`` runs
over those sequences, each row a unit of its own; list position p is read where the dense
form reads visible row p, with the same arithmetic. An index that lists every visible row of
every row needs no copy: the launcher runs the dense call itself, so the result is the dense
one bit for bit (a row's bits depend on the rows sharing its unit and on the chunking of its
blocks, so only the dense call's own schedule can give them).

Measured (this machine, 1 thread, 16 heads, L 512, R 64, one row over 2048 latent rows in
blocks of 16): the attention step 1.8-2.1 ms, against 5.9 ms for one task per (row, head)
that re-read every latent row per head, and 5.9 ms too when the values were a column
slice of the cache (a strided array: its loops do not vectorise).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .linear import SMALL, widen

#: rows per block of the gathered sequences of a sparse attention: 16 latent rows (37 KiB at
#: DeepSeek-V3's 576 values) stay in L1 while the value pass reads them (cpu_kernels/attention.py)
LISTED_BS = 16


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


@njit(cache=True, fastmath=False)
def _absorb(r, h, q, w_uk, q_full):
    """q_full[r, h] = [w_uk[h]^T q_nope | q_pe] (q = [q_nope (P) | q_pe (R)])."""
    P, L = w_uk.shape[1], w_uk.shape[2]
    R = q.shape[2] - P
    dst = q_full[r, h]
    dst[:L] = 0.0
    for p in range(P):
        qp = q[r, h, p]
        wr = w_uk[h, p]
        for l in range(L):
            dst[l] += qp * widen(wr[l])
    for k in range(R):
        dst[L + k] = q[r, h, P + k]


@njit(cache=True, fastmath=False)
def _project_out(r, h, o_lat, w_uv, out):
    """out[r, h] = w_uv[h] o_lat[r, h]."""
    L, Dv = w_uv.shape[2], w_uv.shape[1]
    o, x = out[r, h], o_lat[r, h]
    for v in range(Dv):
        wr = w_uv[h, v]
        a = np.float32(0.0)
        for l in range(L):
            a += widen(wr[l]) * x[l]
        o[v] = a


@njit(cache=True, fastmath=False, parallel=True)
def mla_absorb_kernel(q, w_uk, q_full):
    """q [n, Hq, P + R] FP32, w_uk [Hq, P, L] (BF16 bits or FP32) -> q_full [n, Hq, L + R]."""
    n, Hq = q.shape[0], q.shape[1]
    if n * Hq * w_uk.shape[1] * w_uk.shape[2] <= SMALL:
        for t in range(n * Hq):
            _absorb(t // Hq, t % Hq, q, w_uk, q_full)
    else:
        for t in prange(n * Hq):
            _absorb(t // Hq, t % Hq, q, w_uk, q_full)


@njit(cache=True, fastmath=False, parallel=True)
def mla_out_kernel(o_lat, w_uv, out):
    """o_lat [n, Hq, L] FP32, w_uv [Hq, Dv, L] (BF16 bits or FP32) -> out [n, Hq, Dv]."""
    n, Hq = o_lat.shape[0], o_lat.shape[1]
    if n * Hq * w_uv.shape[1] * w_uv.shape[2] <= SMALL:
        for t in range(n * Hq):
            _project_out(t // Hq, t % Hq, o_lat, w_uv, out)
    else:
        for t in prange(n * Hq):
            _project_out(t // Hq, t % Hq, o_lat, w_uv, out)


@njit(cache=True, fastmath=False)
def _gather_block(cache, block_tables, row_seq, index, counts, owner, vbase, b, dst):
    """Block b of dst: the listed rows of row r = owner[b] at positions (b - vbase[r]) * BS' .."""
    BS, VBS = cache.shape[1], dst.shape[1]
    r = owner[b]
    s = row_seq[r]
    p0 = (b - vbase[r]) * VBS
    for o in range(min(VBS, counts[r] - p0)):
        j = index[r, p0 + o]
        src = cache[block_tables[s, j // BS], j % BS]
        d = dst[b, o]
        for k in range(src.shape[0]):
            d[k] = src[k]


@njit(cache=True, fastmath=False, parallel=True)
def gather_listed_kernel(cache, block_tables, row_seq, index, counts, owner, vbase, dst):
    """cache [NB, BS, W] FP32; index [n, T] int32 (checked: rows each row sees, ascending, then
    -1s; counts [n] the entries before the first -1); owner [NBv] the row of each block of dst,
    vbase [n] row r's first block -> dst [NBv, BS', W]: position p of row r at block
    vbase[r] + p // BS', offset p % BS' (the rest of a row's last block is left as it is)."""
    NBv, W = dst.shape[0], dst.shape[2]
    if NBv * dst.shape[1] * W <= SMALL:
        for b in range(NBv):
            _gather_block(cache, block_tables, row_seq, index, counts, owner, vbase, b, dst)
    else:
        for b in prange(NBv):
            _gather_block(cache, block_tables, row_seq, index, counts, owner, vbase, b, dst)
