"""GQA attention over a paged KV cache, for causal rows of several sequences.

``paged_attention(q [n, Hq, D], k_cache [NB, BS, Hkv, D], v_cache [NB, BS, Hkv, Dv],
block_tables [S, max_blocks], row_seq [n], row_len [n], scale, *,
row_start [n] | None = None, sinks [Hq] | None = None) -> [n, Hq * Dv]``

Row ``r`` belongs to sequence ``s = row_seq[r]`` and sees that sequence's KV
rows ``row_start[r] .. row_len[r] - 1`` (``row_start`` absent: from 0, the whole
causal prefix, itself included): KV row ``i`` lives at
``block_tables[s, i // BS] * BS + i % BS``. Query head ``h`` reads KV head
``h // (Hq / Hkv)``. Softmax in FP32 with the running max subtracted. One
decode row per sequence, the rows of one prefill chunk, and the ragged rows of
a batched exact-mode propose are all this one shape. RoPE is already applied
to q and to the cached k.

Features of the released MTP families (each off by default; off, the op is
bit for bit what it was without it):

- **Sliding window** (``row_start``, int32): the caller turns its window into
  the first visible row (Hugging Face's sliding window: a query at position
  ``p`` sees keys at positions ``> p - window``), ``0 <= row_start[r] < row_len[r]``.
  Rows before ``row_start[r]`` are never read, nor are the block-table entries
  of blocks wholly before it (those blocks may already be freed).
- **Attention sinks** (``sinks``, FP32, gpt-oss / MiMo-V2 ``attention_sink_bias``):
  a per-query-head logit ``s_h`` that joins the softmax denominator and adds no
  value, as a key of value 0: with ``l_j`` the scaled scores and
  ``m = max(s_h, max_j l_j)``, ``p_j = exp(l_j - m) / (exp(s_h - m) + sum_i exp(l_i - m))``
  and ``out = sum_j p_j v_j``, which shrinks towards 0 when the sink dominates.
- **A value head dim** ``Dv`` **other than the key head dim** ``D`` (MiMo-V2:
  192 and 128): read from ``v_cache``'s last axis; the output is ``[n, Hq * Dv]``.

- **An FP8 KV cache** (uint8 ``k_cache`` / ``v_cache`` of E4M3 codes, ``kv_dtype="fp8"``):
  ``k_scale`` / ``v_scale`` ``[NB, BS, Hkv]`` FP32, one scale per (row, KV head); the reference
  reads each visible row dequantized (``mtpkern.ops.kv_fp8.dequantize``: ``e4m3(code) * scale``,
  one FP32 rounding) and computes as above.

Every score ``-inf`` without a sink gives NaN (0 / 0), as the softmax does; with
a finite sink it gives 0.
"""

from __future__ import annotations

import numpy as np

from ._check import expect_dtype, expect_ndim, expect_shape
from .kv_fp8 import check_scales, dequantize


def check_row_index(n: int, block_tables, row_seq, row_len, row_start=None) -> None:
    """The row index of a paged attention over ``n`` rows (dense or latent KV): int32
    ``block_tables [S, max_blocks]``, ``row_seq`` / ``row_len`` / ``row_start`` ``[n]``."""
    expect_ndim("block_tables", block_tables, 2)
    expect_shape("row_seq", row_seq, (n,))
    expect_shape("row_len", row_len, (n,))
    for name, a in (("block_tables", block_tables), ("row_seq", row_seq), ("row_len", row_len)):
        expect_dtype(name, a, "int32")
    if row_start is not None:
        expect_shape("row_start", row_start, (n,))
        expect_dtype("row_start", row_start, "int32")


def visible_rows(r: int, block_tables, row_seq, row_len, row_start, BS: int) -> tuple[np.ndarray, np.ndarray]:
    """Row ``r``'s visible KV rows ``row_start[r] .. row_len[r] - 1`` as (block, offset)
    index arrays into a paged cache; a length < 1 or a start outside the rows raises."""
    s, L = int(row_seq[r]), int(row_len[r])
    if L <= 0:
        raise ValueError(f"row_len[{r}]: expected >= 1, got {L}")
    start = 0 if row_start is None else int(row_start[r])
    if not 0 <= start < L:
        raise ValueError(f"row_start[{r}]: expected 0 <= row_start < row_len[{r}] = {L}, got {start}")
    idx = np.arange(start, L)
    return block_tables[s, idx // BS], idx % BS


def check_paged_attention(q, k_cache, v_cache, block_tables, row_seq, row_len, row_start=None,
                          sinks=None) -> None:
    expect_ndim("k_cache", k_cache, 4)
    NB, BS, Hkv, D = k_cache.shape
    expect_ndim("v_cache", v_cache, 4)
    expect_shape("v_cache", v_cache, (NB, BS, Hkv, None))
    if v_cache.shape[3] < 1:
        raise ValueError(f"v_cache: expected a value head dim >= 1, got shape {list(v_cache.shape)}")
    expect_ndim("q", q, 3)
    n, Hq, Dq = q.shape
    if Dq != D or Hq % Hkv:
        raise ValueError(f"q: expected [n, a multiple of {Hkv}, {D}], got {list(q.shape)}")
    check_row_index(n, block_tables, row_seq, row_len, row_start)
    if sinks is not None:
        expect_shape("sinks", sinks, (Hq,))
        expect_dtype("sinks", sinks, "float32")


def paged_attention(q, k_cache, v_cache, block_tables, row_seq, row_len, scale: float, *,
                    row_start=None, sinks=None, k_scale=None, v_scale=None) -> np.ndarray:
    check_paged_attention(q, k_cache, v_cache, block_tables, row_seq, row_len, row_start, sinks)
    check_scales("k_scale", k_cache, k_scale)
    check_scales("v_scale", v_cache, v_scale)
    NB, BS, Hkv, D = k_cache.shape
    Dv = v_cache.shape[3]
    n, Hq, _ = q.shape
    group = Hq // Hkv
    out = np.zeros((n, Hq, Dv), np.float32)
    for r in range(n):
        blk, off = visible_rows(r, block_tables, row_seq, row_len, row_start, BS)
        k = (np.asarray(k_cache[blk, off], np.float32) if k_scale is None     # [L', Hkv, D]
             else dequantize(k_cache[blk, off], k_scale[blk, off]))
        v = (np.asarray(v_cache[blk, off], np.float32) if v_scale is None     # [L', Hkv, Dv]
             else dequantize(v_cache[blk, off], v_scale[blk, off]))
        k = np.repeat(k, group, axis=1)                               # [L', Hq, D]
        v = np.repeat(v, group, axis=1)                               # [L', Hq, Dv]
        s_ = np.einsum("hd,lhd->hl", np.asarray(q[r], np.float32), k) * np.float32(scale)   # [Hq, L']
        if sinks is None:
            p = np.exp(s_ - s_.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
        else:
            sk = np.asarray(sinks, np.float32)                        # [Hq]
            m = np.maximum(s_.max(axis=1), sk)[:, None]               # [Hq, 1]
            e = np.exp(s_ - m)
            p = e / (e.sum(axis=1, keepdims=True) + np.exp(sk[:, None] - m))
        out[r] = np.einsum("hl,lhd->hd", p, v)
    return out.reshape(n, Hq * Dv)
