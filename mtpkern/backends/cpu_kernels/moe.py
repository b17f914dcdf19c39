"""MoE router on the CPU (spec: mtpkern.ops.moe). The routed experts run on
``mlp.grouped_swiglu_kernel``.

Phase 1 computes the [n, E] logits (one task per pair of gate rows, each read
once for all rows); phase 2 runs the whole selection of one row in one task,
in the reference's order and with its tie rules (larger value first, lowest
index on ties, NaN last).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .linear import gemv_rows


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
            c[e] = np.float32(0.0)                 # Hugging Face masks with 0.0, not -inf
    chosen = np.zeros(E, np.bool_)
    for k in range(top_k):
        best = -1
        for e in range(E):
            if not chosen[e] and (best < 0 or _better(c[e], c[best])):
                best = e
        chosen[best] = True
        ids[r, k] = best
        weights[r, k] = s[best]


@njit(cache=True, fastmath=False, parallel=True)
def moe_router_kernel(x, gate_w, bias, n_group, topk_group, softmax, norm_topk_prob, scale,
                      logits, ids, weights):
    """x [n, H], gate_w [E, H], bias [E]; scratch logits [n, E]; out ids [n, K] int32,
    weights [n, K] float32; scale float32 (routed_scaling_factor)."""
    n = x.shape[0]
    E = gate_w.shape[0]
    top_k = ids.shape[1]
    zero, no = np.int64(0), np.bool_(False)          # typed, not literal: see gemv_rows
    for p in prange((E + 1) // 2):
        j0 = 2 * p
        j1 = j0 + 1 if j0 + 1 < E else -1
        gemv_rows(gate_w, j0, j1, zero, x, zero, n, logits, j0, j1, no)
    for r in prange(n):
        s = logits[r]                               # scores overwrite the logits in place
        if softmax:
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
