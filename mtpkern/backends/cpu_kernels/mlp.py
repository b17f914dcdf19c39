"""SwiGLU on the CPU, for the dense MLP and for the routed experts
(spec: mtpkern.ops.mlp and mtpkern.ops.moe).

One kernel serves both: ``grouped_swiglu_kernel`` runs U experts, expert u
over a contiguous range of gathered input rows; the dense MLP is the case of
one expert and one slot per row. (One kernel also means one compilation per
weight dtype: each kernel that inlines the GEMV core costs ~3 s cold.)

Phases, each one parallel loop:

0. gather: xg[p] = x[row of pair p] (pairs sorted by expert by the launcher);
1. gate/up + SiLU*mul: one task per (expert, intermediate column j) reads gate
   row j and up row I + j of w13[e] together, once for all the expert's rows,
   and writes act[p, j] = silu(gate) * up;
2. down: one task per (expert, pair of w2 rows), once for all its rows;
3. combine: one task per input row adds its K expert outputs, weighted, to the
   residual in slot order (the reference's order of additions).

So each selected expert's weights are read once per call, however many rows chose it.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .linear import gemv_rows


@njit(cache=True, fastmath=False)
def silu(v):
    return v / (np.float32(1.0) + np.exp(-v))


@njit(cache=True, fastmath=False, parallel=True)
def grouped_swiglu_kernel(x, weights, w13, w2, residual, perm, inv, experts, starts,
                          xg, gu, act, y2, out):
    """x [n, H]; weights [n, K] (slot k of row r has pair index r * K + k);
    w13 [E, 2I, H]; w2 [E, H, I]; residual [n, H] or empty.
    perm [P]: the pair index at each expert-sorted position; inv: its inverse;
    experts [U], starts [U + 1]: the distinct experts and their position ranges.
    Scratch xg [P, H], gu [P, 2I], act [P, I], y2 [P, H]; out [n, H]."""
    n, H = x.shape
    K = weights.shape[1]
    I = act.shape[1]
    U = experts.shape[0]
    zero, no = np.int64(0), np.bool_(False)          # typed, not literal: see gemv_rows
    for p in prange(perm.shape[0]):
        r = perm[p] // K
        for h in range(H):
            xg[p, h] = x[r, h]
    for t in prange(U * I):
        u = t // I
        j = t % I
        w = w13[experts[u]]                                          # [2I, H]
        gemv_rows(w, j, I + j, zero, xg, starts[u], starts[u + 1], gu, j, I + j, no)
        for p in range(starts[u], starts[u + 1]):
            act[p, j] = silu(gu[p, j]) * gu[p, I + j]
    half = (H + 1) // 2
    for t in prange(U * half):
        u = t // half
        j0 = 2 * (t % half)
        j1 = j0 + 1 if j0 + 1 < H else -1
        gemv_rows(w2[experts[u]], j0, j1, zero, act, starts[u], starts[u + 1], y2, j0, j1, no)
    has_res = residual.shape[0] > 0
    for r in prange(n):
        for h in range(H):
            v = residual[r, h] if has_res else np.float32(0.0)
            for k in range(K):
                v = v + weights[r, k] * y2[inv[r * K + k], h]
            out[r, h] = v
