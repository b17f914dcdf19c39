"""GQA attention over a paged KV cache, for causal rows of several sequences.

``paged_attention(q [n, Hq, D], k_cache [NB, BS, Hkv, D], v_cache [NB, BS, Hkv, D],
block_tables [S, max_blocks], row_seq [n], row_len [n], scale) -> [n, Hq * D]``

Row ``r`` belongs to sequence ``s = row_seq[r]`` and sees that sequence's
first ``L = row_len[r]`` KV rows (the causal prefix, itself included): KV row
``i`` lives at ``block_tables[s, i // BS] * BS + i % BS``. Query head ``h``
reads KV head ``h // (Hq / Hkv)``. Softmax in FP32 with the running max
subtracted. One decode row per sequence, the rows of one prefill chunk, and
the ragged rows of a batched exact-mode propose are all this one shape.
RoPE is already applied to q and to the cached k.
"""

from __future__ import annotations

import numpy as np

from ._check import expect_dtype, expect_ndim, expect_shape


def check_paged_attention(q, k_cache, v_cache, block_tables, row_seq, row_len) -> None:
    expect_ndim("k_cache", k_cache, 4)
    NB, BS, Hkv, D = k_cache.shape
    expect_shape("v_cache", v_cache, (NB, BS, Hkv, D))
    expect_ndim("q", q, 3)
    n, Hq, Dq = q.shape
    if Dq != D or Hq % Hkv:
        raise ValueError(f"q: expected [n, a multiple of {Hkv}, {D}], got {list(q.shape)}")
    expect_ndim("block_tables", block_tables, 2)
    expect_shape("row_seq", row_seq, (n,))
    expect_shape("row_len", row_len, (n,))
    for name, a in (("block_tables", block_tables), ("row_seq", row_seq), ("row_len", row_len)):
        expect_dtype(name, a, "int32")


def paged_attention(q, k_cache, v_cache, block_tables, row_seq, row_len, scale: float) -> np.ndarray:
    check_paged_attention(q, k_cache, v_cache, block_tables, row_seq, row_len)
    NB, BS, Hkv, D = k_cache.shape
    n, Hq, _ = q.shape
    group = Hq // Hkv
    out = np.zeros((n, Hq, D), np.float32)
    for r in range(n):
        s, L = int(row_seq[r]), int(row_len[r])
        if L <= 0:
            raise ValueError(f"row_len[{r}]: expected >= 1, got {L}")
        idx = np.arange(L)
        blk = block_tables[s, idx // BS]
        k = np.asarray(k_cache[blk, idx % BS], np.float32)           # [L, Hkv, D]
        v = np.asarray(v_cache[blk, idx % BS], np.float32)           # [L, Hkv, D]
        k = np.repeat(k, group, axis=1)                               # [L, Hq, D]
        v = np.repeat(v, group, axis=1)
        s_ = np.einsum("hd,lhd->hl", np.asarray(q[r], np.float32), k) * np.float32(scale)   # [Hq, L]
        p = np.exp(s_ - s_.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        out[r] = np.einsum("hl,lhd->hd", p, v)
    return out.reshape(n, Hq * D)
