"""DSA (DeepSeek Sparse Attention: DeepSeek-V3.2, GLM-5): the lightning indexer that picks,
per query row, the keys its MLA attention reads.

Letters: ``Hi`` indexer heads (``index_n_heads``), ``Di`` the indexer head dim
(``index_head_dim``), ``R`` = ``qk_rope_head_dim`` (the indexer rotates the **first** ``R``
dims of its query heads and key; MLA rotates the last ``R``), ``T`` = ``index_topk``.

``dsa_key_write(k [n, Di], k_norm_w [Di], k_norm_b [Di], eps, inv_freq [R/2], positions [n],
index_cache [NB, BS, Di], slots [n], *, q=None, interleave=False, rope_scale=1.0)
-> None, or q roped [n, Hi, Di] when q is given``

- ``k`` is ``indexer.wk``'s output. ``k_n = layernorm(k) * k_norm_w + k_norm_b`` (FP32: the
  row's mean subtracted, divided by ``sqrt(mean of squares + eps)``; the releases' ``eps``
  is 1e-6 whatever ``rms_norm_eps`` is), then its first ``R`` dims rotated at
  ``positions`` as ``mtpkern.ops.rope_kv`` rotates (pairs ``(2i, 2i + 1)`` with
  ``interleave``, GLM-5's ``indexer_rope_interleave``; else ``(i, i + R/2)``, DeepSeek-V3.2's;
  cos and sin times ``rope_scale``, the MLA's YaRN factor). With the MLA's ``R = 0`` (NoPE,
  GLM-5.3) ``inv_freq`` is empty and neither the key nor the query is rotated.
- ``k_n`` goes to row ``slot = block * BS + offset`` of ``index_cache`` (cache dtype): the
  indexer's plane of the module's KV pool, beside the latent rows and under the same
  block tables. A slot given twice ends with the later row.
- ``q`` [n, Hi, Di] (``indexer.wq_b`` of the normed query latent ``q_a_layernorm(q_a_proj(x))``):
  returned in FP32 with each head's first ``R`` dims rotated as the key's.

The releases quantize ``q`` and ``k`` to FP8 after a Hadamard rotation of both; the rotation
is orthogonal (it leaves every ``q . k`` unchanged) and mtpkern keeps the key in the cache's
dtype, so neither is done (docs/families.md, "DSA").

``dsa_select(q [n, Hi, Di], weights [n, Hi], index_cache, block_tables, row_seq, row_len,
topk, scale, *, row_start=None) -> [n, topk] int32``

Rows, sequences, block tables and ``row_start`` mean what they mean in
``mtpkern.ops.attention.paged_attention``. ``weights`` is ``indexer.weights_proj`` of the
normed hidden; ``scale`` the releases' ``index_n_heads^-0.5 * index_head_dim^-0.5``. Row
``r``'s score of its visible row ``j`` (``row_start[r] <= j < row_len[r]``)::

    s[j] = sum_h (weights[r, h] * scale) * max(q[r, h] . k_j, 0)      # FP32, heads in order

and the result's row ``r`` lists the ``topk`` best visible rows (their row numbers in the
sequence, as ``row_len`` counts them) **in ascending order**, ``-1`` after the last when the
row sees fewer. The tie rule: a higher score wins; of equal scores, the earlier row; a NaN
score ranks below every number. A row that sees at most ``topk`` rows lists all of them,
so the sparse attention over the list is the dense one (``mla_attention_absorbed(index=)``).

**Pools** (GLM-5.3's pooled indexer: ``kpool`` P >= 2, with ``ape`` [P, Di] and ``tail``).
The plane holds ``[key | gate scores]`` per row (2 Di: ``dsa_key_write(gate=)``, the gate
scores being ``index_kpool_compress_gate`` of the normed hidden). A sequence's rows form
pools of P consecutive rows from its first (rows ``jP .. jP + P - 1``); a query row that
sees ``row_len`` L rows (no window) has ``L // P`` complete pools, the rest its tail.
Pool j's key is, per dim d, ``sum_t softmax_t(gate[t, d] + ape[t, d]) * key[t, d]`` over its
P rows (``pooled_keys``), scored as a row's key above; the result lists the rows of the
``topk / P`` best complete pools (the tie rule over pools), then, with ``tail``, the tail's
rows, ascending, ``-1`` after: ``topk + P - 1`` columns with ``tail`` (``list_width``). A row
whose complete pools are at most ``topk / P`` lists every row it sees (with ``tail``: the
dense attention). vLLM and transformers append the tail whenever ``always_select_tail``.
"""

from __future__ import annotations

import numpy as np

from ._check import expect_dtype, expect_ndim, expect_shape
from .attention import check_row_index
from .mla import slots_refused
from .rope_kv import check_rope_options, rope

#: the indexer key's LayerNorm epsilon in every release (not the config's rms_norm_eps)
DSA_NORM_EPS = 1e-6


def check_dsa_key_write(k, k_norm_w, k_norm_b, inv_freq_, positions, index_cache, slots, interleave=False,
                        rope_scale=1.0, q=None, gate=None) -> None:
    expect_ndim("index_cache", index_cache, 3)
    NB, BS, Di = index_cache.shape
    expect_dtype("index_cache", index_cache, "float32", "bfloat16")
    if gate is not None:                 # a pooled indexer's plane: [key | gate scores]
        if Di % 2:
            raise ValueError(f"index_cache: expected [NB, BS, 2 Di] (key and gate scores) with gate, got shape "
                             f"{list(index_cache.shape)}")
        Di //= 2
        expect_ndim("gate", gate, 2)
        expect_shape("gate", gate, (gate.shape[0], Di))
        expect_dtype("gate", gate, "float32", "bfloat16")
    expect_ndim("inv_freq", inv_freq_, 1)
    R = 2 * inv_freq_.shape[0]
    if not R <= Di:             # R = 0 (an MLA without RoPE, GLM-5.3): an empty inv_freq, nothing rotated
        raise ValueError(f"inv_freq: expected 0..{Di // 2} entries (R/2, with R <= {Di} the indexer head dim), "
                         f"got {inv_freq_.shape[0]}")
    expect_dtype("inv_freq", inv_freq_, "float32")
    expect_ndim("k", k, 2)
    n = k.shape[0]
    expect_shape("k", k, (n, Di))
    expect_dtype("k", k, "float32", "bfloat16")
    if gate is not None:
        expect_shape("gate", gate, (n, Di))
    for name, a in (("k_norm_w", k_norm_w), ("k_norm_b", k_norm_b)):
        expect_shape(name, a, (Di,))
        expect_dtype(name, a, "float32")
    expect_shape("positions", positions, (n,))
    expect_shape("slots", slots, (n,))
    expect_dtype("positions", positions, "int32")
    expect_dtype("slots", slots, "int32")
    check_rope_options(interleave, rope_scale)
    if q is not None:
        expect_ndim("q", q, 3)
        expect_shape("q", q, (n, None, Di))
        if q.shape[1] < 1:
            raise ValueError(f"q: expected [{n}, Hi >= 1, {Di}], got shape {list(q.shape)}")
        expect_dtype("q", q, "float32", "bfloat16")


def layernorm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    """[n, D] FP32: ``(x - mean) / sqrt(var + eps) * w + b`` per row (var: the biased one)."""
    x = np.asarray(x, np.float32)
    d = x - x.mean(axis=-1, keepdims=True)
    var = np.mean(d * d, axis=-1, keepdims=True)
    return d / np.sqrt(var + np.float32(eps)) * np.asarray(w, np.float32) + np.asarray(b, np.float32)


def dsa_key_write(k, k_norm_w, k_norm_b, eps: float, inv_freq_, positions, index_cache, slots, *, q=None,
                  interleave: bool = False, rope_scale: float = 1.0, gate=None):
    check_dsa_key_write(k, k_norm_w, k_norm_b, inv_freq_, positions, index_cache, slots, interleave, rope_scale, q,
                        gate)
    NB, BS, _ = index_cache.shape
    err = slots_refused(slots, NB * BS)
    if err is not None:
        raise err
    kn = layernorm(k, k_norm_w, k_norm_b, eps)                                      # [n, Di]
    kn = rope(kn[:, None, :], positions, inv_freq_, interleave, rope_scale)[:, 0]   # first R dims rotated
    if gate is not None:                                                            # [key | gate scores]
        kn = np.concatenate([kn, np.asarray(gate, np.float32)], axis=1)
    blk, off = np.divmod(slots.astype(np.int64), BS)
    index_cache[blk, off] = kn.astype(index_cache.dtype)
    if q is None:
        return None
    return rope(np.array(q, np.float32), positions, inv_freq_, interleave, rope_scale)


def check_dsa_select(q, weights, index_cache, block_tables, row_seq, row_len, topk, row_start=None,
                     kpool: int = 0, ape=None, tail: bool = True) -> None:
    expect_ndim("index_cache", index_cache, 3)
    Di = index_cache.shape[2]
    expect_dtype("index_cache", index_cache, "float32", "bfloat16")
    if isinstance(kpool, bool) or not isinstance(kpool, (int, np.integer)) or not (kpool == 0 or 2 <= kpool <= 1024):
        raise ValueError(f"kpool: expected 0 (a key per row) or an int in [2, 1024] (rows per pool), got {kpool!r}")
    if kpool:
        if Di % 2:
            raise ValueError(f"index_cache: expected [NB, BS, 2 Di] (key and gate scores) with kpool, got shape "
                             f"{list(index_cache.shape)}")
        Di //= 2
        if ape is None:
            raise ValueError("ape: expected the pools' position bias [kpool, Di] with kpool, got None")
        expect_shape("ape", ape, (int(kpool), Di))
        expect_dtype("ape", ape, "float32")
        if not isinstance(tail, (bool, np.bool_)):
            raise TypeError(f"tail: expected a bool, got {tail!r}")
        if row_start is not None and np.any(np.asarray(row_start) != 0):
            raise ValueError("row_start: a pooled indexer's pools start at a sequence's first row; expected None "
                             "or zeros (no window)")
    expect_ndim("q", q, 3)
    n, Hi = q.shape[0], q.shape[1]
    expect_shape("q", q, (n, Hi, Di))
    if Hi < 1:
        raise ValueError(f"q: expected [n, Hi >= 1, {Di}], got shape {list(q.shape)}")
    expect_dtype("q", q, "float32", "bfloat16")
    expect_shape("weights", weights, (n, Hi))
    expect_dtype("weights", weights, "float32", "bfloat16")
    if isinstance(topk, bool) or not isinstance(topk, (int, np.integer)) or not 1 <= topk <= 2**20:
        raise ValueError(f"topk: expected an int in [1, 2^20], got {topk!r}")
    if kpool and topk % kpool:
        raise ValueError(f"topk: expected a multiple of kpool = {kpool} (the pools picked are topk / kpool), "
                         f"got {topk}")
    check_row_index(n, block_tables, row_seq, row_len, row_start)


def rank_rows(scores: np.ndarray, rows: np.ndarray, topk: int) -> np.ndarray:
    """The ``topk`` best of ``rows`` by ``scores`` (the tie rule above), ascending, -1 padded."""
    s = np.where(np.isnan(scores), -np.inf, scores)
    nan = np.isnan(scores)
    order = np.lexsort((rows, nan, -s))       # last key first: score descending, numbers before NaN, row
    out = np.full(topk, -1, np.int32)
    pick = np.sort(rows[order[:topk]])
    out[:pick.shape[0]] = pick
    return out


def list_width(topk: int, kpool: int = 0, tail: bool = True) -> int:
    """Columns of ``dsa_select``'s lists: ``topk``, and a pooled indexer's tail's ``kpool - 1``."""
    return int(topk) + (int(kpool) - 1 if kpool and tail else 0)


def pooled_keys(keys: np.ndarray, gates: np.ndarray, ape: np.ndarray) -> np.ndarray:
    """[m, P, Di] rows of m pools (keys and gate scores) -> their pooled keys [m, Di] FP32:
    each dim's softmax over the pool's rows of ``gate + ape`` weighs the rows' keys."""
    g = np.asarray(gates, np.float32) + np.asarray(ape, np.float32)
    e = np.exp(g - g.max(axis=1, keepdims=True))
    p = e / e.sum(axis=1, keepdims=True)
    return (p * np.asarray(keys, np.float32)).sum(axis=1, dtype=np.float32)


def _select_pools(q, wts, cache, table, BS: int, L: int, topk: int, P: int, ape, tail: bool, width: int):
    """One query row's list under a pooled indexer (module docstring, "Pools")."""
    out = np.full(width, -1, np.int32)
    n_pools, Di = L // P, ape.shape[1]
    done = n_pools * P
    if n_pools * P <= topk:                              # every complete pool: with the tail, every row
        picked = np.arange(done)
    else:
        rows = np.arange(done)
        a = np.asarray(cache[table[rows // BS], rows % BS], np.float32).reshape(n_pools, P, 2 * Di)
        keys = pooled_keys(a[..., :Di], a[..., Di:], ape)                           # [n_pools, Di]
        dots = np.maximum(q @ keys.T, np.float32(0.0))                             # [Hi, n_pools]
        best = rank_rows((wts @ dots).astype(np.float32), np.arange(n_pools), topk // P)
        picked = (best[:, None] * P + np.arange(P)).ravel()                        # ascending pools: rows too
    if tail:
        picked = np.concatenate([picked, np.arange(done, L)])
    out[:picked.shape[0]] = picked
    return out


def dsa_select(q, weights, index_cache, block_tables, row_seq, row_len, topk: int, scale: float, *,
               row_start=None, kpool: int = 0, ape=None, tail: bool = True) -> np.ndarray:
    check_dsa_select(q, weights, index_cache, block_tables, row_seq, row_len, topk, row_start, kpool, ape, tail)
    BS = index_cache.shape[1]
    q = np.asarray(q, np.float32)
    wts = np.asarray(weights, np.float32) * np.float32(scale)                     # [n, Hi]
    width = list_width(topk, kpool, tail)
    out = np.full((q.shape[0], width), -1, np.int32)
    for r in range(q.shape[0]):
        if kpool:
            s, L = int(row_seq[r]), int(row_len[r])
            if L <= 0:
                raise ValueError(f"row_len[{r}]: expected > 0, got {L}")
            out[r] = _select_pools(q[r], wts[r], index_cache, block_tables[s], BS, L, int(topk), int(kpool),
                                   ape, bool(tail), width)
            continue
        s, L = int(row_seq[r]), int(row_len[r])
        start = 0 if row_start is None else int(row_start[r])
        if L <= 0 or not 0 <= start < L:
            raise ValueError(f"row_len[{r}] / row_start[{r}]: expected 0 <= row_start < row_len, got {start}, {L}")
        rows = np.arange(start, L)
        if rows.shape[0] <= topk:                   # every visible row: the dense attention
            out[r, :rows.shape[0]] = rows
            continue
        keys = np.asarray(index_cache[block_tables[s, rows // BS], rows % BS], np.float32)   # [L', Di]
        dots = np.maximum(q[r] @ keys.T, np.float32(0.0))                                  # [Hi, L']
        out[r] = rank_rows((wts[r] @ dots).astype(np.float32), rows, int(topk))
    return out
