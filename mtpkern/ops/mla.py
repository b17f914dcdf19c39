"""MLA (multi-head latent attention, DeepSeek-V2/V3, GLM-5) over a paged latent cache.

Letters: ``Hq`` query heads, ``L`` = ``kv_lora_rank``, ``R`` = ``qk_rope_head_dim``,
``P`` = ``qk_nope_head_dim``, ``Dv`` = ``v_head_dim``. One latent row is
``W = L + R`` values: the RMS-normed compressed KV ``c`` (``L``) then the roped
shared key ``k_pe`` (``R``), one row per token, shared by every head (FlashMLA's
layout: ``[NB, BS, 1, L + R]``, here without the unit head axis).

``mla_latent_write(kv_a [n, L + R], kv_a_norm_w [L], eps, inv_freq [R/2], positions [n],
latent_cache [NB, BS, L + R], slots [n], *, q=None, interleave=False, rope_scale=1.0)
-> None, or q roped [n, Hq, P + R] when q is given``

``R`` may be 0 (NoPE: GLM-5.3's MTP layer, ``qk_rope_head_dim = 0``): ``inv_freq`` is empty,
the latent row is ``c`` alone (``kv_a_proj_with_mqa`` has ``L`` rows), nothing is rotated and
the query comes back as it was given (in FP32); every score is ``q_lat . c``. ``R > 0`` with
``inv_freq`` all zeros (``BlockSpec.nope``, Kimi K3's gated MLA): the R dims are there but turn
by angle 0 (cos 1, sin 0), so ``k_pe`` goes to the cache and ``q_pe`` comes back as given.

- ``kv_a`` is ``kv_a_proj_with_mqa``'s output as released: ``L`` compressed values, then
  the ``R`` rope-key values; it may be a column slice of a wider output (with an element-wise
  output gate, the first ``L + R`` columns of ``kv_a_proj_with_mqa | g_proj``'s), which the
  backends read in place or copy. ``c = rmsnorm(kv_a[:, :L], kv_a_norm_w, eps)``
  (``kv_a_layernorm``); ``k_pe`` = ``kv_a[:, L:]`` rotated at ``positions`` as
  ``mtpkern.ops.rope_kv`` rotates (all ``R`` dims; pairs ``(2i, 2i + 1)`` with
  ``interleave``, DeepSeek-V3's ``rope_interleave``, else ``(i, i + R/2)``; cos and sin
  times ``rope_scale``). Hugging Face de-interleaves q_pe and k_pe before a neox
  rotation; the pair order differs from GPT-J's by the same permutation of q_pe and
  k_pe, so every score ``q_pe . k_pe`` is the same.
- ``[c | k_pe]`` goes to row ``slot = block * BS + offset`` of the cache (cache dtype);
  a slot given twice ends with the later row. Slots are checked in ``[0, NB * BS)``
  before anything is written.
- ``q`` [n, Hq, P + R] (``q_b_proj``'s or ``q_proj``'s output as released: per head
  ``P`` no-rope dims, then ``R`` rope dims): returned in FP32 with each head's last
  ``R`` dims rotated as ``k_pe`` is (same positions, pairs, factor), the first ``P``
  unchanged: the query ``mla_attention_absorbed`` takes.

``mla_attention_absorbed(q [n, Hq, P + R], w_uk [Hq, P, L], w_uv [Hq, Dv, L],
latent_cache [NB, BS, L + R], block_tables [S, max_blocks], row_seq [n], row_len [n], scale,
*, row_start [n] | None = None, index [n, T] | None = None) -> [n, Hq * Dv]``

Rows, sequences, block tables and ``row_start`` mean what they mean in
``mtpkern.ops.attention.paged_attention``. ``q`` per head is ``[q_nope (P) | q_pe (R)]``
with ``q_pe`` already roped (``mla_latent_write(q=...)``). ``w_uk`` / ``w_uv`` are
``kv_b_proj``'s key and value parts (``split_kv_b_proj``). The naive form decompresses
every visible row ``j`` per head: ``k_j = [w_uk[h] c_j ; k_pe_j]``, ``v_j = w_uv[h] c_j``.
The absorbed form never does:

    q_lat[h]  = w_uk[h]^T q_nope[h]                        # [L]   (q_nope . (w_uk c) = (w_uk^T q_nope) . c)
    s[h, j]   = scale * (q_lat[h] . c_j + q_pe[h] . k_pe_j)  # over the visible latent rows j
    p[h, :]   = softmax(s[h, :])                           # FP32, running max subtracted
    o_lat[h]  = sum_j p[h, j] c_j                          # [L]   (output in latent space)
    out[h]    = w_uv[h] o_lat[h]                           # [Dv]  (sum_j p w_uv c_j = w_uv sum_j p c_j)

so each latent row is read once per head and never widened to ``Hq * (P + R + Dv)``.
``scale`` is the caller's: DeepSeek-V3's ``(P + R)^-0.5``, times YaRN's
``mscale(factor, mscale_all_dim)^2`` when set. Results are FP32.

``index`` (DSA's sparse attention, ``mtpkern.ops.dsa.dsa_select``'s result): row ``r``
attends only to the rows ``index[r, :c]``, ``c`` its entries before the first ``-1``: row
numbers of its sequence, strictly ascending, each visible to the row (``row_start[r] <= j <
row_len[r]``; ``check_index`` refuses others). The rows are read in list order, as the
dense form reads the visible rows: a call in which every row lists every row it sees is the
dense attention, bit for bit, in every backend (a full row beside cut ones: to FP32
rounding on the cpu backend, whose dense tasks depend on the call's shape).

``mla_attention_naive(q, kv_b_proj [Hq * (P + Dv), L], latent_cache, block_tables,
row_seq, row_len, scale, *, row_start=None)`` (reference only) is the specification the
absorbed form is tested against: decompress the whole cache per head through
``kv_b_proj`` into ordinary K / V caches (``Hkv = Hq``, ``D = P + R``) and run
``paged_attention`` on them.
"""

from __future__ import annotations

import numpy as np

from ._check import expect_dtype, expect_ndim, expect_shape
from .attention import check_row_index, paged_attention, visible_rows
from .norm import rmsnorm
from .rope_kv import check_rope_options, rope


def split_kv_b_proj(kv_b_proj, num_heads: int, qk_nope_head_dim: int, v_head_dim: int):
    """``kv_b_proj [Hq * (P + Dv), L]`` as released (per head: ``P`` key rows, then ``Dv``
    value rows) -> ``(w_uk [Hq, P, L], w_uv [Hq, Dv, L])``, contiguous, in its dtype."""
    for name, v in (("num_heads", num_heads), ("qk_nope_head_dim", qk_nope_head_dim),
                    ("v_head_dim", v_head_dim)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
    expect_ndim("kv_b_proj", kv_b_proj, 2)
    Hq, P, Dv = int(num_heads), int(qk_nope_head_dim), int(v_head_dim)
    expect_shape("kv_b_proj", kv_b_proj, (Hq * (P + Dv), None))
    w = kv_b_proj.reshape(Hq, P + Dv, kv_b_proj.shape[1])                # [Hq, P + Dv, L]
    return np.ascontiguousarray(w[:, :P]), np.ascontiguousarray(w[:, P:])


def check_mla_latent_write(kv_a, kv_a_norm_w, inv_freq_, positions, latent_cache, slots,
                           interleave=False, rope_scale=1.0, q=None) -> None:
    expect_ndim("latent_cache", latent_cache, 3)
    NB, BS, W = latent_cache.shape
    expect_dtype("latent_cache", latent_cache, "float32", "bfloat16")
    expect_ndim("inv_freq", inv_freq_, 1)
    R = 2 * inv_freq_.shape[0]
    if not R < W:               # R = 0 (NoPE): an empty inv_freq, no dim rotated
        raise ValueError(f"inv_freq: expected 0..{(W - 1) // 2} entries (R/2, with L + R = {W} the "
                         f"latent row and L >= 1), got {inv_freq_.shape[0]}")
    expect_dtype("inv_freq", inv_freq_, "float32")
    L = W - R
    expect_ndim("kv_a", kv_a, 2)
    n = kv_a.shape[0]
    expect_shape("kv_a", kv_a, (n, W))
    expect_dtype("kv_a", kv_a, "float32", "bfloat16")
    expect_shape("kv_a_norm_w", kv_a_norm_w, (L,))
    expect_dtype("kv_a_norm_w", kv_a_norm_w, "float32")
    expect_shape("positions", positions, (n,))
    expect_shape("slots", slots, (n,))
    expect_dtype("positions", positions, "int32")
    expect_dtype("slots", slots, "int32")
    check_rope_options(interleave, rope_scale)
    if q is not None:
        expect_ndim("q", q, 3)
        expect_shape("q", q, (n, None, None))
        if q.shape[1] < 1 or q.shape[2] <= R:
            raise ValueError(f"q: expected [{n}, Hq >= 1, P + {R}] with P >= 1 (the rope dims last), "
                             f"got shape {list(q.shape)}")
        expect_dtype("q", q, "float32", "bfloat16")


def slots_refused(slots, num_slots: int) -> ValueError | None:
    """The error for a slot outside ``[0, num_slots)`` (every backend's words), or None."""
    bad = np.flatnonzero((slots < 0) | (slots >= num_slots))
    if bad.size == 0:
        return None
    return ValueError(f"slots: expected values in [0, {num_slots}), got {int(slots[bad[0]])}")


def mla_latent_write(kv_a, kv_a_norm_w, eps: float, inv_freq_, positions, latent_cache, slots, *, q=None,
                     interleave: bool = False, rope_scale: float = 1.0):
    check_mla_latent_write(kv_a, kv_a_norm_w, inv_freq_, positions, latent_cache, slots, interleave, rope_scale, q)
    NB, BS, W = latent_cache.shape
    L = kv_a_norm_w.shape[0]
    err = slots_refused(slots, NB * BS)
    if err is not None:
        raise err
    kv_a = np.asarray(kv_a, np.float32)
    c = rmsnorm(kv_a[:, :L], kv_a_norm_w, eps)                                    # [n, L]
    k_pe = rope(kv_a[:, None, L:], positions, inv_freq_, interleave, rope_scale)[:, 0]   # [n, R]
    blk, off = np.divmod(slots.astype(np.int64), BS)
    latent_cache[blk, off] = np.concatenate([c, k_pe], axis=1).astype(latent_cache.dtype)
    if q is None:
        return None
    R = W - L
    q = np.array(q, np.float32)                                                   # a copy: [n, Hq, P + R]
    P = q.shape[2] - R
    q[:, :, P:] = rope(np.ascontiguousarray(q[:, :, P:]), positions, inv_freq_, interleave, rope_scale)
    return q


def check_index(index, n: int, row_len, row_start=None) -> None:
    """``index`` [n, T] int32 (host): per row, rows it may see, strictly ascending, then -1s."""
    expect_ndim("index", index, 2)
    expect_shape("index", index, (n, None))
    expect_dtype("index", index, "int32")
    if index.shape[1] < 1:
        raise ValueError(f"index: expected [{n}, T >= 1], got shape {list(index.shape)}")
    ix = np.asarray(index, np.int64)
    valid = ix >= 0
    lo = np.zeros(n, np.int64) if row_start is None else np.asarray(row_start, np.int64)
    hi = np.asarray(row_len, np.int64)
    bad = (ix < -1) | (valid & ((ix < lo[:, None]) | (ix >= hi[:, None])))
    bad[:, 1:] |= valid[:, 1:] & ~valid[:, :-1]                     # an entry after a -1
    bad[:, 1:] |= valid[:, 1:] & valid[:, :-1] & (ix[:, 1:] <= ix[:, :-1])
    bad[:, 0] |= ~valid[:, 0]                                        # every row attends to one row at least
    if bad.any():
        r, i = (int(v) for v in np.argwhere(bad)[0])
        raise ValueError(f"index[{r}, {i}]: expected a row in [{int(lo[r])}, {int(hi[r])}) above the entry before "
                         f"it, then -1s (row {r}'s list starts with a row), got {int(ix[r, i])}")


def check_mla_attention(q, w_uk, w_uv, latent_cache, block_tables, row_seq, row_len, row_start=None,
                        index=None) -> None:
    expect_ndim("latent_cache", latent_cache, 3)
    NB, BS, W = latent_cache.shape
    expect_ndim("w_uk", w_uk, 3)
    Hq, P, L = w_uk.shape
    if not 1 <= L <= W:        # L = W: R = 0 (NoPE)
        raise ValueError(f"w_uk: expected [Hq, P, L] with 1 <= L <= {W} (L + R = {W} the latent row), "
                         f"got shape {list(w_uk.shape)}")
    R = W - L
    expect_ndim("q", q, 3)
    n = q.shape[0]
    expect_shape("q", q, (n, Hq, P + R))
    expect_ndim("w_uv", w_uv, 3)
    expect_shape("w_uv", w_uv, (Hq, None, L))
    if w_uv.shape[1] < 1:
        raise ValueError(f"w_uv: expected a value head dim >= 1, got shape {list(w_uv.shape)}")
    check_row_index(n, block_tables, row_seq, row_len, row_start)
    if index is not None:
        check_index(index, n, row_len, row_start)


def mla_attention_absorbed(q, w_uk, w_uv, latent_cache, block_tables, row_seq, row_len,
                           scale: float, *, row_start=None, index=None) -> np.ndarray:
    check_mla_attention(q, w_uk, w_uv, latent_cache, block_tables, row_seq, row_len, row_start, index)
    NB, BS, W = latent_cache.shape
    Hq, P, L = w_uk.shape
    n = q.shape[0]
    Dv = w_uv.shape[1]
    w_uk = np.asarray(w_uk, np.float32)
    w_uv = np.asarray(w_uv, np.float32)
    q = np.asarray(q, np.float32)
    out = np.zeros((n, Hq, Dv), np.float32)
    for r in range(n):
        blk, off = visible_rows(r, block_tables, row_seq, row_len, row_start, BS)
        if index is not None:                # DSA: the listed rows only
            j = index[r][index[r] >= 0].astype(np.int64)
            blk, off = block_tables[int(row_seq[r]), j // BS], j % BS
        rows = np.asarray(latent_cache[blk, off], np.float32)                  # [L', L + R]
        c, k_pe = rows[:, :L], rows[:, L:]                                     # [L', L], [L', R]
        q_lat = np.einsum("hp,hpl->hl", q[r, :, :P], w_uk)                     # [Hq, L]
        s = (q_lat @ c.T + q[r, :, P:] @ k_pe.T) * np.float32(scale)           # [Hq, L']
        p = np.exp(s - s.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        o_lat = p @ c                                                          # [Hq, L]
        out[r] = np.einsum("hl,hvl->hv", o_lat, w_uv)                          # [Hq, Dv]
    return out.reshape(n, Hq * Dv)


def mla_attention_naive(q, kv_b_proj, latent_cache, block_tables, row_seq, row_len,
                        scale: float, *, row_start=None, qk_nope_head_dim: int) -> np.ndarray:
    """``qk_nope_head_dim``: P (q's last axis is P + R)."""
    expect_ndim("q", q, 3)
    _, Hq, _ = q.shape
    P = int(qk_nope_head_dim)
    expect_ndim("kv_b_proj", kv_b_proj, 2)
    if kv_b_proj.shape[0] % Hq or kv_b_proj.shape[0] // Hq <= P:
        raise ValueError(f"kv_b_proj: expected [{Hq} * ({P} + Dv), L], got {list(kv_b_proj.shape)}")
    w_uk, w_uv = split_kv_b_proj(np.asarray(kv_b_proj, np.float32), Hq, P, kv_b_proj.shape[0] // Hq - P)
    check_mla_attention(q, w_uk, w_uv, latent_cache, block_tables, row_seq, row_len, row_start)
    NB, BS, W = latent_cache.shape
    L = w_uk.shape[2]
    R = W - L
    cache = np.asarray(latent_cache, np.float32)
    c, k_pe = cache[..., :L], cache[..., L:]                                   # [NB, BS, L], [NB, BS, R]
    k_nope = np.einsum("hpl,bjl->bjhp", w_uk, c)                               # [NB, BS, Hq, P]
    k_cache = np.concatenate([k_nope, np.broadcast_to(k_pe[:, :, None, :], (NB, BS, Hq, R))], axis=3)
    v_cache = np.einsum("hvl,bjl->bjhv", w_uv, c)                              # [NB, BS, Hq, Dv]
    return paged_attention(np.ascontiguousarray(q, np.float32), np.ascontiguousarray(k_cache, np.float32),
                           np.ascontiguousarray(v_cache, np.float32), block_tables, row_seq, row_len,
                           scale, row_start=row_start)
