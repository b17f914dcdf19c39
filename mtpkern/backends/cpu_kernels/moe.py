"""MoE router on the CPU (spec: mtpkern.ops.moe). The routed experts run on
``mlp.grouped_swiglu_kernel``.

Phase 1 computes the [n, E] logits (one task per group of 8 gate rows,
``linear.group8``, each read once for all rows); phase 2 runs the whole
selection of one row in one task, in the reference's order and with its tie
rules (larger value first, lowest index on ties, NaN last). A decode step's
router is small enough to run on the calling thread (``linear.SMALL``).
``moe_router_fp8_kernel`` takes an FP8 gate (phase 1 by row chunks, ``linear.fp8_chunk``).
``scoring``: the score function's index in ``mtpkern.ops.moe.SCORINGS`` (0 sigmoid, 1 softmax,
2 sqrtsoftplus), an int64; one branch per row, outside every loop over the logits.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .linear import SMALL, chunks, gemv_task, group8, qchunk


@njit(cache=True, fastmath=False)
def _better(v, best):
    """v ranks before best: larger, or best is NaN and v is not."""
    return v > best or (best != best and v == v)


@njit(cache=True, fastmath=False)
def _route_row(s, c, bias, n_group, topk_group, top_k, ids, weights, r):
    """s [E]: this row's scores; c [E]: scratch. Writes ids[r], weights[r] (unscaled s)."""
    E = s.shape[0]
    gsz = E // n_group
    for e in range(E):
        c[e] = s[e] + bias[e]
    # group score: sum of the group's top-2 c (top-1 when groups have one expert)
    gscore = np.empty(n_group, np.float32)
    for g in range(n_group):
        e0 = g * gsz
        a = e0
        for e in range(e0 + 1, e0 + gsz):
            if _better(c[e], c[a]):
                a = e
        if gsz >= 2:
            b = e0 if a != e0 else e0 + 1
            for e in range(e0, e0 + gsz):
                if e != a and e != b and _better(c[e], c[b]):
                    b = e
            gscore[g] = c[a] + c[b]
        else:
            gscore[g] = c[a]
    keep = np.zeros(n_group, np.bool_)
    for _ in range(topk_group):
        best = -1
        for g in range(n_group):
            if not keep[g] and (best < 0 or _better(gscore[g], gscore[best])):
                best = g
        keep[best] = True
    for e in range(E):
        if not keep[e // gsz]:
            c[e] = np.float32(-np.inf)             # never chosen over a kept expert (mtpkern.ops.moe, 3.)
    chosen = np.zeros(E, np.bool_)
    for k in range(top_k):
        best = -1
        for e in range(E):
            if not chosen[e] and (best < 0 or _better(c[e], c[best])):
                best = e
        chosen[best] = True
        ids[r, k] = best
        weights[r, k] = s[best]


@njit(cache=True, fastmath=False)
def _gate_task(gate_w, x, t, q, logits):
    """Logits of the gate rows of task t (``linear.group8``, q = E // 8) for every row of x."""
    zero, no = np.int64(0), np.bool_(False)          # typed, not literal: see gemv_task
    rows, count = group8(t, q, zero)
    gemv_task(gate_w, rows, count, zero, x, zero, x.shape[0], logits, rows, no)


#: SCORINGS' indices (mtpkern.ops.moe)
SOFTMAX, SQRTSOFTPLUS = 1, 2


@njit(cache=True, fastmath=False)
def _select_row(logits, bias, n_group, topk_group, scoring, norm_topk_prob, scale, ids, weights, r):
    """Row r's scores (in place of its logits), selection and weights."""
    E = logits.shape[1]
    top_k = ids.shape[1]
    s = logits[r]
    if scoring == SQRTSOFTPLUS:                    # torch's softplus: l itself past 20; NaN stays NaN
        for e in range(E):
            v = s[e]
            s[e] = np.sqrt(v if v > np.float32(20.0) else np.log1p(np.exp(v)))
    elif scoring == SOFTMAX:
        mx = s[0]
        for e in range(1, E):
            if s[e] > mx or s[e] != s[e]:
                mx = s[e]
        tot = np.float32(0.0)
        for e in range(E):
            s[e] = np.exp(s[e] - mx)
            tot += s[e]
        for e in range(E):
            s[e] = s[e] / tot
    else:
        for e in range(E):
            s[e] = np.float32(1.0) / (np.float32(1.0) + np.exp(-s[e]))
    c = np.empty(E, np.float32)
    _route_row(s, c, bias, n_group, topk_group, top_k, ids, weights, r)
    if norm_topk_prob:
        tot = np.float32(0.0)
        for k in range(top_k):
            tot += weights[r, k]
        for k in range(top_k):
            weights[r, k] = weights[r, k] / (tot + np.float32(1e-20))
    for k in range(top_k):
        weights[r, k] = weights[r, k] * scale


@njit(cache=True, fastmath=False, parallel=True)
def moe_router_kernel(x, gate_w, bias, n_group, topk_group, scoring, norm_topk_prob, scale,
                      logits, ids, weights):
    """x [n, H], gate_w [E, H], bias [E]; scratch logits [n, E]; out ids [n, K] int32,
    weights [n, K] float32; scale float32 (routed_scaling_factor)."""
    n, H = x.shape
    E = gate_w.shape[0]
    q = E // 8
    if n * E * H <= 2 * SMALL:                       # one row's gate (32K multiply-adds, 64 KB of BF16
        for t in range(q + E - 8 * q):              # at E = 32, H = 1024): on the calling thread
            _gate_task(gate_w, x, t, q, logits)
    else:
        for t in prange(q + E - 8 * q):
            _gate_task(gate_w, x, t, q, logits)
    _select(logits, bias, n_group, topk_group, scoring, norm_topk_prob, scale, ids, weights, n * E * H)


@njit(cache=True, fastmath=False, parallel=True)
def moe_router_fp8_kernel(x, gate8, bias, n_group, topk_group, scoring, norm_topk_prob, scale,
                          logits, ids, weights):
    """``moe_router_kernel`` with the gate in FP8 (gate8: the tuple of ``linear.fp8_chunk``)."""
    n, H = x.shape
    E = gate8[0].shape[0]
    zero, no = np.int64(0), np.bool_(False)
    if n * E * H <= 2 * SMALL:
        for c in range(chunks(gate8)):
            qchunk(gate8, c, zero, x, zero, n, logits, zero, no)
    else:
        for c in prange(chunks(gate8)):
            qchunk(gate8, c, zero, x, zero, n, logits, zero, no)
    _select(logits, bias, n_group, topk_group, scoring, norm_topk_prob, scale, ids, weights, n * E * H)


@njit(cache=True, fastmath=False, parallel=True)
def _select(logits, bias, n_group, topk_group, scoring, norm_topk_prob, scale, ids, weights, work):
    """Phase 2 for every row, on the calling thread when the gate was ``work`` <= 2 SMALL multiply-adds."""
    n = logits.shape[0]
    if work <= 2 * SMALL:
        for r in range(n):
            _select_row(logits, bias, n_group, topk_group, scoring, norm_topk_prob, scale, ids, weights, r)
    else:
        for r in prange(n):
            _select_row(logits, bias, n_group, topk_group, scoring, norm_topk_prob, scale, ids, weights, r)
