"""LM head and grammar-masked argmax.

``lm_head_logits(x [n, H], w [V, H]) -> [n, V]`` (x already normed by
``shared_head.norm``). In this reference each logit is the exact dot product
``x · w_v`` rounded to FP64 and then to FP32: a function of the row's values
alone, so equal rows of ``w`` give equal logits and the tie rule below decides.
(A BLAS product sums different rows in different orders: with identical LM-head
rows the argmax then landed on a non-lowest id for about a third of inputs.)

``masked_argmax(logits [n, V], bitmask [n, W] int32 | None) -> ids [n] int32``
with xgrammar's layout, ``W = ceil(V / 32)``: bit ``j & 31`` of word ``j >> 5``
set means token ``j`` is allowed. Padding bits past ``V`` are ignored (never
allowed). Ties go to the lowest id; NaN never wins; a row where no allowed
token has a non-NaN logit raises ``NoAllowedToken`` naming the row.

``lm_head_argmax(x, w, bitmask) = masked_argmax(lm_head_logits(x, w), bitmask)``;
the fast backends fuse it so the logits are never written out in full.

**A draft vocabulary** (every backend's ``lm_head_argmax(..., id_map=ids)``, ``ids`` int32
``[V]``): ``w`` holds the rows of a token subset (mtpkern.vocab) and the result is
``ids[argmax]``, the target id (-1 stays -1); ties go to the lowest row, which is the lowest
target id when ``ids`` is sorted.

**Confidence** (every backend's ``lm_head_argmax(..., conf=buf)``, ``buf`` an FP32 ``[n]``
output): ``conf[r]`` is the probability the drafter gives its draft, the softmax of row
``r``'s allowed, non-NaN logits at ``ids[r]``:
``1 / sum_{j allowed, l_j not NaN} exp(l_j - l_{ids[r]})``, in ``(0, 1]`` (1 when one token is
allowed). A term whose logit equals the draft's counts exactly 1 (never ``exp(inf - inf)``):
``-inf`` logits add 0 beside a finite best, a row of ``c`` allowed logits all ``-inf`` (or
``c`` tied at ``+inf``) gives ``1 / c``. The fast backends compute it by an online
log-sum-exp in the argmax's own reduction (one ``exp`` per logit), never from stored logits.

**A vocabulary shard's partial result** (every backend's ``lm_head_argmax(..., best=buf,
sum_exp=buf)``, FP32 ``[n]`` outputs; ``masked_best`` here): ``best[r]`` the winning logit
(``-inf`` where the row has no candidate), ``sum_exp[r]`` the confidence's denominator
``sum_{j allowed, l_j not NaN} t_j`` (``t_j`` as above: 1 where ``l_j`` equals the best, 0
where there is no candidate). With either given, a row without a candidate gets id -1 and
raises nothing: a rank of a vocabulary-parallel head may hold none of the allowed tokens;
``mtpkern.comm.sharded_argmax`` / ``sharded_confidence`` combine the ranks' results.
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import NoAllowedToken, no_token_reason
from ._check import expect_dtype, expect_ndim, expect_shape


#: vocabulary rows per FP64 chunk of the reference's logits (bounds its scratch)
_CHUNK = 2048


def lm_head_logits(x, w) -> np.ndarray:
    expect_ndim("x", x, 2)
    expect_shape("w", w, (None, x.shape[1]))
    n, H = x.shape
    V = w.shape[0]
    x64 = np.asarray(x, np.float64)                                      # [n, H]
    # |fl(x . w) - x . w| <= gamma_H * (|x| . |w|) for any summation order (u = 2^-53);
    # doubled for the rounding of the bound itself.
    gamma = 2 * H * 2.0**-53 / (1 - H * 2.0**-53)
    out = np.empty((n, V), np.float32)
    for v0 in range(0, V, _CHUNK):
        wc = np.asarray(w[v0:v0 + _CHUNK], np.float64)                    # [c, H]
        dot = x64 @ wc.T                                                 # [n, c]
        err = gamma * (np.abs(x64) @ np.abs(wc).T)
        out[:, v0:v0 + wc.shape[0]] = dot
        # Where the error interval straddles an FP32 rounding boundary the rounded value
        # could depend on the summation order: recompute those few exactly (the FP64
        # products of FP32 values are exact; fsum rounds their sum once).
        unsure = ((dot - err).astype(np.float32) != (dot + err).astype(np.float32)) & np.isfinite(dot)
        for r, c in zip(*np.nonzero(unsure)):
            out[r, v0 + c] = math.fsum((x64[r] * wc[c]).tolist())
    return out                                                           # [n, V]


def bitmask_allowed(bitmask: np.ndarray, V: int) -> np.ndarray:
    """[n, W] int32 words -> [n, V] bool (token j allowed)."""
    words = np.asarray(bitmask).astype(np.int64) & 0xFFFFFFFF            # unsigned view of the int32
    j = np.arange(V)
    return ((words[:, j >> 5] >> (j & 31)) & 1).astype(bool)


def check_bitmask(bitmask, n: int, V: int) -> None:
    expect_shape("bitmask", bitmask, (n, (V + 31) // 32))
    expect_dtype("bitmask", bitmask, "int32")


def _candidates(logits, bitmask) -> tuple[np.ndarray, np.ndarray]:
    """(FP32 logits [n, V], the allowed non-NaN entries [n, V] bool), the mask checked."""
    expect_ndim("logits", logits, 2)
    n, V = logits.shape
    logits = np.asarray(logits, np.float32)
    ok = ~np.isnan(logits)
    if bitmask is not None:
        check_bitmask(bitmask, n, V)
        ok &= bitmask_allowed(bitmask, V)
    return logits, ok


def masked_argmax(logits, bitmask=None) -> np.ndarray:
    logits, ok = _candidates(logits, bitmask)
    n, V = logits.shape
    out = np.empty(n, np.int32)
    for r in range(n):
        cand = np.flatnonzero(ok[r])
        if cand.size == 0:
            raise NoAllowedToken(f"row {r}: {no_token_reason(bitmask is not None, V)}", row=r)
        vals = logits[r, cand]
        out[r] = cand[int(np.argmax(vals))]                              # first maximum = lowest id
    return out


def lm_head_argmax(x, w, bitmask=None) -> np.ndarray:
    return masked_argmax(lm_head_logits(x, w), bitmask)


def check_id_map(id_map, V: int) -> None:
    """``id_map`` of a head of ``V`` rows: ``[V]`` int32 (checked before anything is computed)."""
    expect_shape("id_map", id_map, (V,))
    expect_dtype("id_map", id_map, "int32")


def map_ids(ids, id_map) -> np.ndarray:
    """[n] int32: ``id_map[ids]``, -1 staying -1 (a draft vocabulary's rows -> target ids)."""
    ids = np.asarray(ids)
    return np.where(ids >= 0, np.asarray(id_map)[np.maximum(ids, 0)], -1).astype(np.int32)


def masked_confidence(logits, ids, bitmask=None) -> np.ndarray:
    """[n] FP32: the softmax of each row's allowed, non-NaN logits at ``ids`` (float64 sums)."""
    n, V = logits.shape
    lg = np.asarray(logits, np.float64)
    ok = ~np.isnan(lg)
    if bitmask is not None:
        ok &= bitmask_allowed(bitmask, V)
    top = lg[np.arange(n), ids][:, None]                                 # the drafts' logits
    with np.errstate(invalid="ignore"):                                  # inf - inf: counted as 1 below
        e = np.where(ok, np.where(lg == top, 1.0, np.exp(np.where(ok, lg, 0.0) - top)), 0.0)
    return (1.0 / e.sum(axis=1)).astype(np.float32)


def masked_best(logits, bitmask=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids [n] int32, best [n] FP32, sum_exp [n] FP32): a vocabulary shard's partial result
    (module docstring): id -1, best -inf and sum 0 where a row has no candidate; never raises."""
    logits, ok = _candidates(logits, bitmask)
    n = logits.shape[0]
    ids = np.full(n, -1, np.int32)
    best = np.full(n, -np.inf, np.float32)
    sums = np.zeros(n, np.float32)
    for r in range(n):
        cand = np.flatnonzero(ok[r])
        if cand.size == 0:
            continue
        vals = logits[r, cand]
        i = int(np.argmax(vals))                                         # first maximum = lowest id
        ids[r], best[r] = cand[i], vals[i]
        v64, top = vals.astype(np.float64), np.float64(vals[i])
        with np.errstate(invalid="ignore", over="ignore"):               # inf - inf: counted as 1
            sums[r] = np.where(v64 == top, 1.0, np.exp(v64 - top)).sum()
    return ids, best, sums


def lm_head_argmax_conf(x, w, bitmask=None) -> tuple[np.ndarray, np.ndarray]:
    """(ids, conf): ``lm_head_argmax`` and each draft's confidence (module docstring)."""
    logits = lm_head_logits(x, w)
    ids = masked_argmax(logits, bitmask)
    return ids, masked_confidence(logits, ids, bitmask)


#: the most candidates per row ``masked_topk`` takes (a draft tree's widest node)
MAX_TOPK = 64


def check_topk(k) -> int:
    """``k`` of a top-k: an int in [1, MAX_TOPK]."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= MAX_TOPK:
        raise ValueError(f"k: expected an int in [1, {MAX_TOPK}], got {k!r}")
    return int(k)


def _topk_order(vals: np.ndarray, cand: np.ndarray) -> np.ndarray:
    """``cand`` (ascending ids) ordered by value descending, ties to the lower id."""
    return cand[np.lexsort((cand, -vals.astype(np.float64)))]


def masked_topk(logits, bitmask=None, k: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(ids [n, k] int32, probs [n, k] FP32): each row's ``k`` best allowed, non-NaN tokens,
    by logit descending with ties to the lowest id (column 0 is ``masked_argmax``), and the
    probability of each: the softmax of the row's allowed, non-NaN logits at it, by the
    confidence rule (``1 / sum_j t_j``, ``t_j = 1`` where ``l_j`` equals the candidate's logit,
    else ``exp(l_j - l_c)``; column 0 is ``masked_confidence``). A row with fewer than ``k``
    candidates pads with id -1 and probability 0; a row with none raises ``NoAllowedToken``."""
    k = check_topk(k)
    lg, ok = _candidates(logits, bitmask)
    n, V = lg.shape
    ids = np.full((n, k), -1, np.int32)
    probs = np.zeros((n, k), np.float32)
    for r in range(n):
        cand = np.flatnonzero(ok[r])
        if cand.size == 0:
            raise NoAllowedToken(f"row {r}: {no_token_reason(bitmask is not None, V)}", row=r)
        top = _topk_order(lg[r, cand], cand)[:k]
        vals = lg[r, cand].astype(np.float64)
        for j, c in enumerate(top):
            lc = float(lg[r, c])
            with np.errstate(invalid="ignore", over="ignore"):
                t = np.where(vals == lc, 1.0, np.exp(vals - lc))
            ids[r, j] = c
            probs[r, j] = 1.0 / t.sum()
    return ids, probs


def masked_topk_partial(logits, bitmask=None, k: int = 1):
    """A vocabulary shard's share of ``masked_topk``: (ids [n, k] int32 (-1 past the row's
    candidates), vals [n, k] FP32 (their logits; -inf past), best [n], sum_exp [n]
    (``masked_best``'s)); never raises: a shard may hold none of a row's candidates.
    ``mtpkern.comm.sharded_topk`` merges the shards' into the whole vocabulary's."""
    k = check_topk(k)
    lg, ok = _candidates(logits, bitmask)
    n = lg.shape[0]
    ids = np.full((n, k), -1, np.int32)
    vals = np.full((n, k), -np.inf, np.float32)
    for r in range(n):
        cand = np.flatnonzero(ok[r])
        top = _topk_order(lg[r, cand], cand)[:k]
        ids[r, :top.size], vals[r, :top.size] = top, lg[r, top]
    _, best, sums = masked_best(lg, bitmask)
    return ids, vals, best, sums


def lm_head_topk(x, w, bitmask=None, k: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """``masked_topk(lm_head_logits(x, w), bitmask, k)``: a draft tree's candidates."""
    return masked_topk(lm_head_logits(x, w), bitmask, k)


def map_id_rows(ids, id_map) -> np.ndarray:
    """``map_ids`` over an [n, k] array."""
    ids = np.asarray(ids)
    return map_ids(ids.reshape(-1), id_map).reshape(ids.shape)
