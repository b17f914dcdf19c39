"""SwiGLU on the CPU, for the dense MLP and for the routed experts
(spec: mtpkern.ops.mlp and mtpkern.ops.moe).

One kernel serves both: ``grouped_swiglu_kernel`` runs U experts, expert u
over a contiguous range of gathered input rows; the dense MLP is the case of
one expert and one slot per row. (One kernel also means one compilation per
weight dtype: each kernel that inlines the GEMV core costs ~3 s cold.)

A serial prologue sorts the n * K (row, slot) pairs by expert (a stable
counting sort: the launcher used to do it with ``np.argsort`` and ``np.unique``,
~15 us of the ~50 us a call cost at n = 1); then phases, each one parallel loop:

0. gather: xg[p] = x[row of pair p];
1. gate/up + SiLU*mul: one task per (expert, 4 intermediate columns j, j + q,
   j + 2q, j + 3q with q = I // 4) reads those gate rows and the 4 up rows I + j ..
   of w13[e] together (``gate_up_group``: 8 streams, as ``linear.group8``), once
   for all the expert's rows, and writes act[p, j] = swiglu(gate, up, limit);
2. down: one task per (expert, group of 8 w2 rows, ``linear.group8``), once for
   all its rows;
3. combine: one task per input row adds its K expert outputs, weighted, to the
   residual in slot order (the reference's order of additions).

Phases 0 and 3 of a decode step run on the calling thread (``linear.SMALL``).

So each selected expert's weights are read once per call, however many rows chose it.

``limit`` and ``gate_limit`` (float32) are the SwiGLU clamps (``mtpkern.ops.mlp.swiglu_bounds``):
L on silu(gate) (Step-3.5 / 3.7), Lg on the gate before silu (DeepSeek-V4), up clipped by
min(L, Lg). The kernels always take both, +inf for a clamp not in use, because min(v, +inf)
is v bit for bit. Four comparisons per activation, beside its H multiply-adds, cost nothing
measurable (docs/cpu.md): no second kernel and no branch on which clamp there is.

``grouped_swiglu_fp8_kernel`` is the same with FP8 weights (``linear.fp8_chunk``): phase 1
is one task per (expert, row chunk of w13) writing gate | up, a pass pairs them, phase 2 is
one task per (expert, row chunk of w2). A second kernel rather than a branch: the tasks are
row chunks (each with its own scaled copy of the inputs), not groups of 8 rows.

``act`` (int: ``ACT_SWIGLU`` 0, ``ACT_SITU`` 1) picks the gated activation of the same kernels
(``gated``): Kimi K3's SiTU (``situ``) takes (beta, linear_beta) where SwiGLU takes its bounds
(``mtpkern.ops.mlp.act_params``). A branch on a loop-invariant int beside the H multiply-adds
of each activation, rather than two more copies of both kernels.

``grouped_relu2_kernel`` / ``grouped_relu2_fp8_kernel``: Nemotron-H's non-gated experts
(``down(relu(up x) ** 2)``, w1 the up rows alone): a separate kernel, not a flag in the
SwiGLU one (phase 1 reads 8 up rows per task instead of 4 gate/up pairs).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .linear import SMALL, chunks, expert, gemv_task, group8, qchunk


@njit(cache=True, fastmath=False)
def silu(v):
    return v / (np.float32(1.0) + np.exp(-v))


@njit(cache=True, fastmath=False)
def swiglu(g, u, L, Lg):
    """min(silu(min(g, Lg)), L) * min(max(u, -Lu), Lu) with Lu = min(L, Lg): the reference's
    clamps (``ops.mlp.swiglu_act``; one of L, Lg is +inf). Written as comparisons, which keep
    a NaN as ``np.minimum`` / ``np.maximum`` do; with L = Lg = +inf nothing changes, bit for bit."""
    if g > Lg:
        g = Lg
    a = silu(g)
    if a > L:
        a = L
    Lu = L if L < Lg else Lg
    if u > Lu:
        u = Lu
    elif u < -Lu:
        u = -Lu
    return a * u


#: the ``act`` codes of the gated kernels
ACT_SWIGLU, ACT_SITU = 0, 1


@njit(cache=True, fastmath=False)
def situ(g, u, beta, linear_beta):
    """Kimi K3's SituAndMul (``ops.mlp.situ_act``): beta tanh(g / beta) sigmoid(g) u', with
    u' = linear_beta tanh(u / linear_beta) for linear_beta > 0, else u; FP32 throughout."""
    one = np.float32(1.0)
    if linear_beta > 0:
        u = linear_beta * np.tanh(u / linear_beta)
    return beta * np.tanh(g / beta) * (one / (one + np.exp(-g))) * u


@njit(cache=True, fastmath=False)
def gated(g, u, act, p0, p1):
    """The gated activation ``act`` of gate g and up u: SwiGLU with bounds (p0, p1) = (L, Lg),
    or SiTU with (p0, p1) = (beta, linear_beta)."""
    if act == ACT_SITU:
        return situ(g, u, p0, p1)
    return swiglu(g, u, p0, p1)


@njit(cache=True, fastmath=False)
def gate_up_group(t, q, I):
    """Task t of phase 1 over w13 [2I, H] with q = I // 4 -> ``(rows, count)``: gate
    rows t + s q and up rows I + t + s q (s < 4) for t < q, else the gate/up pair
    of column j = 4q + (t - q) (count 2). Gate rows first, then their up rows."""
    t, q = np.int64(t), np.int64(q)
    if t < q:
        g = t
        u = I + t
        return (g, g + q, g + 2 * q, g + 3 * q, u, u + q, u + 2 * q, u + 3 * q), 8
    j = 3 * q + t
    return (j, I + j, j, j, j, j, j, j), 2


@njit(cache=True, fastmath=False)
def sort_pairs(ids, E):
    """ids [n, K] (values in -1..E-1; -1: an empty slot, as a rank of an expert-parallel head
    leaves the experts it does not hold) -> the P (row, slot) pairs that name an expert
    (pair index r K + k) grouped by expert, in pair order within an expert: ``perm`` [P]
    (the pair at each sorted position), ``inv`` [n K] (each pair's sorted position, -1 for
    an empty slot), ``experts`` [U] (the distinct experts, ascending) and ``starts`` [U + 1]
    (their position ranges)."""
    n, K = ids.shape
    count = np.zeros(E, np.int64)
    P = 0
    for p in range(n * K):
        e = ids[p // K, p % K]
        if e >= 0:
            count[e] += 1
            P += 1
    U = 0
    for e in range(E):
        U += count[e] > 0
    experts = np.empty(U, np.int64)
    starts = np.empty(U + 1, np.int64)
    at = np.zeros(E, np.int64)                       # next free position of each expert
    u = 0
    pos = 0
    for e in range(E):
        if count[e] > 0:
            experts[u] = e
            starts[u] = pos
            at[e] = pos
            pos += count[e]
            u += 1
    starts[U] = P
    perm = np.empty(P, np.int64)
    inv = np.full(n * K, -1, np.int64)
    for p in range(n * K):
        e = ids[p // K, p % K]
        if e >= 0:
            perm[at[e]] = p
            inv[p] = at[e]
            at[e] += 1
    return perm, inv, experts, starts


@njit(cache=True, fastmath=False)
def _combine_row(residual, weights, y2, inv, r, out):
    """out[r] = residual[r] (if given) + sum_k weights[r, k] * y2[position of pair (r, k)], in
    slot order; an empty slot (position -1) adds nothing."""
    K = weights.shape[1]
    has_res = residual.shape[0] > 0
    for h in range(out.shape[1]):
        v = residual[r, h] if has_res else np.float32(0.0)
        for k in range(K):
            at = inv[r * K + k]
            if at >= 0:
                v = v + weights[r, k] * y2[at, h]
        out[r, h] = v


@njit(cache=True, fastmath=False, parallel=True)
def grouped_swiglu_kernel(x, ids, weights, w13, w2, residual, act_code, limit, gate_limit, out):
    """out [n, H] = residual + sum_k weights[:, k] * swiglu_{ids[:, k]}(x).

    x [n, H]; ids [n, K] (checked in -1..E-1 by the launcher; -1 an empty slot), weights [n, K];
    w13 [E, 2I, H]; w2 [E, H, I]; residual [n, H] or empty (it may be ``out``
    itself: each element is read before it is written); act_code: ``ACT_SWIGLU`` or ``ACT_SITU``;
    limit, gate_limit float32, the SwiGLU clamps (``swiglu``; +inf: none), or SiTU's beta and
    linear beta (``gated``)."""
    n, H = x.shape
    I = w2.shape[2]
    perm, inv, experts, starts, xg = _sorted_inputs(x, ids, w13.shape[0])
    P = perm.shape[0]
    U = experts.shape[0]
    gu = np.empty((P, 2 * I), np.float32)            # gate | up
    act = np.empty((P, I), np.float32)               # silu(gate) * up
    y2 = np.empty((P, H), np.float32)                # expert outputs
    zero, no = np.int64(0), np.bool_(False)          # typed, not literal: see gemv_task
    q1 = I // 4
    T1 = q1 + I - 4 * q1                             # tasks per expert, phase 1
    for t in prange(U * T1):
        u = t // T1
        rows, count = gate_up_group(t % T1, q1, I)
        gemv_task(w13[experts[u]], rows, count, zero, xg, starts[u], starts[u + 1], gu, rows, no)
        half = count // 2
        for s in range(half):                        # gate column rows[s], up column rows[s + half]
            for p in range(starts[u], starts[u + 1]):
                act[p, rows[s]] = gated(gu[p, rows[s]], gu[p, rows[s + half]], act_code, limit, gate_limit)
    q2 = H // 8
    T2 = q2 + H - 8 * q2                             # tasks per expert, phase 2
    for t in prange(U * T2):
        u = t // T2
        rows, count = group8(t % T2, q2, zero)
        gemv_task(w2[experts[u]], rows, count, zero, act, starts[u], starts[u + 1], y2, rows, no)
    _combine(residual, weights, y2, inv, out)


@njit(cache=True, fastmath=False, parallel=True)
def _sorted_inputs(x, ids, E):
    """The (row, slot) pairs sorted by expert (``sort_pairs``) and xg [P, H], the input row
    of each sorted pair (phase 0)."""
    K = ids.shape[1]
    perm, inv, experts, starts = sort_pairs(ids, E)
    P, H = perm.shape[0], x.shape[1]
    xg = np.empty((P, H), np.float32)                # gathered rows, expert-sorted
    if P * H <= SMALL:
        for p in range(P):
            xg[p] = x[perm[p] // K]
    else:
        for p in prange(P):
            xg[p] = x[perm[p] // K]
    return perm, inv, experts, starts, xg


@njit(cache=True, fastmath=False, parallel=True)
def _combine(residual, weights, y2, inv, out):
    """Phase 3: every input row's weighted expert outputs added to its residual."""
    n, H = out.shape
    if y2.shape[0] * H <= SMALL:
        for r in range(n):
            _combine_row(residual, weights, y2, inv, r, out)
    else:
        for r in prange(n):
            _combine_row(residual, weights, y2, inv, r, out)


@njit(cache=True, fastmath=False, parallel=True)
def grouped_swiglu_fp8_kernel(x, ids, weights, w13, w2, residual, act_code, limit, gate_limit, out):
    """``grouped_swiglu_kernel`` with FP8 expert weights: w13, w2 the tuples of
    ``linear.fp8_chunk`` over [E, 2I, H] and [E, H, I] codes."""
    I = w13[0].shape[1] // 2                     # w13 [E, 2I, *]: an FP4 w2 holds I / 2 bytes a row
    perm, inv, experts, starts, xg = _sorted_inputs(x, ids, w13[0].shape[0])
    P, H = xg.shape
    U = experts.shape[0]
    gu = np.empty((P, 2 * I), np.float32)            # gate | up
    act = np.empty((P, I), np.float32)
    y2 = np.empty((P, H), np.float32)
    zero, no = np.int64(0), np.bool_(False)
    T1, T2 = chunks(w13), chunks(w2)
    for t in prange(U * T1):
        u = t // T1
        qchunk(expert(w13, experts[u]), t % T1, zero, xg, starts[u], starts[u + 1], gu, zero, no)
    if P * I <= SMALL:
        for p in range(P):
            silu_mul_row(gu, p, act_code, limit, gate_limit, act)
    else:
        for p in prange(P):
            silu_mul_row(gu, p, act_code, limit, gate_limit, act)
    for t in prange(U * T2):
        u = t // T2
        qchunk(expert(w2, experts[u]), t % T2, zero, act, starts[u], starts[u + 1], y2, zero, no)
    _combine(residual, weights, y2, inv, out)


@njit(cache=True, fastmath=False)
def silu_mul_row(gu, p, act_code, limit, gate_limit, act):
    """act[p, j] = gated(gate, up, act_code, limit, gate_limit) with gu[p] = gate | up."""
    I = act.shape[1]
    for j in range(I):
        act[p, j] = gated(gu[p, j], gu[p, I + j], act_code, limit, gate_limit)


@njit(cache=True, fastmath=False)
def relu2(u):
    """relu(u) ** 2 (``mtpkern.ops.mlp.relu2``); a NaN stays NaN (u > 0 is false, u * 0 ...:
    written as the reference's max(u, 0) squared, which keeps NaN)."""
    r = u if (u > np.float32(0.0) or u != u) else np.float32(0.0)
    return r * r


@njit(cache=True, fastmath=False, parallel=True)
def grouped_relu2_kernel(x, ids, weights, w1, w2, residual, out):
    """``grouped_swiglu_kernel`` for Nemotron-H's non-gated experts: out [n, H] = residual +
    sum_k weights[:, k] * w2[e] relu(w1[e] x) ** 2 with e = ids[:, k]; w1 [E, I, H] (the up
    rows alone), w2 [E, H, I]. Phase 1 is one task per (expert, group of 8 w1 rows,
    ``linear.group8``), whose 8 dots become act columns through relu2; phases 0, 2, 3 as there."""
    n, H = x.shape
    I = w2.shape[2]
    perm, inv, experts, starts, xg = _sorted_inputs(x, ids, w1.shape[0])
    P = perm.shape[0]
    U = experts.shape[0]
    up = np.empty((P, I), np.float32)                # w1 x
    act = np.empty((P, I), np.float32)               # relu(w1 x) ** 2
    y2 = np.empty((P, H), np.float32)                # expert outputs
    zero, no = np.int64(0), np.bool_(False)
    q1 = I // 8
    T1 = q1 + I - 8 * q1
    for t in prange(U * T1):
        u = t // T1
        rows, count = group8(t % T1, q1, zero)
        gemv_task(w1[experts[u]], rows, count, zero, xg, starts[u], starts[u + 1], up, rows, no)
        for s in range(count):
            for p in range(starts[u], starts[u + 1]):
                act[p, rows[s]] = relu2(up[p, rows[s]])
    q2 = H // 8
    T2 = q2 + H - 8 * q2
    for t in prange(U * T2):
        u = t // T2
        rows, count = group8(t % T2, q2, zero)
        gemv_task(w2[experts[u]], rows, count, zero, act, starts[u], starts[u + 1], y2, rows, no)
    _combine(residual, weights, y2, inv, out)


@njit(cache=True, fastmath=False, parallel=True)
def grouped_relu2_fp8_kernel(x, ids, weights, w1, w2, residual, out):
    """``grouped_relu2_kernel`` with FP8 expert weights (the tuples of ``linear.fp8_chunk``
    over [E, I, H] and [E, H, I] codes), tasks by row chunks as ``grouped_swiglu_fp8_kernel``."""
    I = w1[0].shape[1]
    perm, inv, experts, starts, xg = _sorted_inputs(x, ids, w1[0].shape[0])
    P, H = xg.shape
    U = experts.shape[0]
    up = np.empty((P, I), np.float32)
    act = np.empty((P, I), np.float32)
    y2 = np.empty((P, H), np.float32)
    zero, no = np.int64(0), np.bool_(False)
    T1, T2 = chunks(w1), chunks(w2)
    for t in prange(U * T1):
        u = t // T1
        qchunk(expert(w1, experts[u]), t % T1, zero, xg, starts[u], starts[u + 1], up, zero, no)
    for p in prange(P):
        for j in range(I):
            act[p, j] = relu2(up[p, j])
    for t in prange(U * T2):
        u = t // T2
        qchunk(expert(w2, experts[u]), t % T2, zero, act, starts[u], starts[u + 1], y2, zero, no)
    _combine(residual, weights, y2, inv, out)
