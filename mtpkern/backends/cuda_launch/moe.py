"""Launchers of kernels/moe.cu: ``moe_router`` and ``moe_experts``.

``moe_router(x [n, H], gate_w [E, H], bias [E], spec) -> (ids [n, K] int32,
weights [n, K] FP32)``: ``linear_kernel`` for the logits (workspace ``logits``
[n, E] FP32) then ``moe_router_select_kernel``, one block per row. E <= 1024. One row
(n = 1, the decode step) takes one launch, ``moe_router_kernel<W, NORM>``: the same GEMV,
whose last block to finish runs the selection, found with a ticket (workspace ``ticket``:
one uint32, zero before the launch and zero again after it; a new zeroed one per call
when none is given).

``moe_experts(x [n, H], ids [n, K], weights [n, K], w13 [E, 2I, H], w2 [E, H, I],
residual [n, H] | None, *, limit=None, clamp_gate=False) -> [n, H]``: three launches, workspaces
``act [n * K, I]`` and ``partial [n * K, H]`` FP32:

1. ``moe_expert_kernel<W, true>``: act[p] = silu(gate) * up of pair p's expert, clamped
   by ``limit``, of the gate before silu with ``clamp_gate`` (``mtpkern.ops.mlp``; the kernel
   takes both bounds of ``swiglu_bounds``, +inf for none);
2. ``moe_expert_kernel<W, false>``: partial[p] = w2[e] @ act[p];
3. ``moe_combine_kernel``: y = residual + sum_k weights[:, k] * partial[:, k] in k order.

``activation="relu2"`` (Nemotron-H; ``w13`` is then the up rows alone ``[E, I, H]``): launch 1
is ``moe_expert_kernel<W, false, NR, NORM, true>``, act[p] = relu2(w1[e] x) (the down pass's row
pairs, its epilogue ``mtp::relu2``); 2 and 3 as above.

``activation="situ"`` (Kimi K3; ``w13`` as SwiGLU's): launch 1 is
``moe_expert_kernel<W, true, NR, NORM, false, true>`` (SiTU, ``mtp::gated_act``), taking
``situ_beta`` / ``situ_linear_beta`` where SwiGLU's takes its bounds; 2 and 3 as above.
LatentMoE runs these on the latent rows (x [n, Lt], experts of width Lt): nothing changes here.

One row (n = 1, the decode step) takes two: 2 and 3 are ``moe_down_combine_kernel<W>``, the
same dots and sum without ``partial`` (a row names each expert once, so no weight is read twice).

Each expert's weights are read once per launch for all the pairs that chose
it (up to NR = ``gemv_rows(n)`` per pass). Slots: by pair when n * K <= E (decode), else by expert.
``out`` may be ``residual``.
"""

from __future__ import annotations

import numpy as np

from ...ops._check import expect_dtype
from ...ops.mlp import NO_LIMIT, act_params, gated_rows
from ...ops.moe import RouterSpec, check_moe_experts, check_moe_router
from ..base import all_fp8_or_none
from ._util import (NULL, CudaFp8, cdiv, ctype, device, device_weight, expect_disjoint, expect_grid_yz,
                    expect_same_or_disjoint, expect_weight, f32, i32, optional, output, ptr, weight_args, zeroed)
from .linear import GEMV_THREADS, GEMV_WARPS, gemv_config, gemv_rows, launch_linear, norm_args
from .loader import get_kernel

#: kRouterMaxExperts in moe.cu: one thread per expert
ROUTER_MAX_EXPERTS = 1024
COMBINE_THREADS = 256


def moe_router(x, gate_w, bias, spec: RouterSpec, *, ids=None, weights=None, logits=None, ticket=None,
               norm=None):
    """-> (ids [n, K] int32, weights [n, K] FP32); ``logits``: workspace [n, E] FP32; ``ticket``:
    workspace [1] uint32 of the one-row launch, zero (it is left zero; a planned step keeps one);
    ``norm=(g, eps)``: x RMS-normalised first (fused into the logits' GEMV)."""
    check_moe_router(x, gate_w, bias, spec)
    expect_weight("gate_w", gate_w)
    n = x.shape[0]
    E, K = gate_w.shape[0], spec.top_k
    if E > ROUTER_MAX_EXPERTS:
        raise ValueError(f"gate_w: at most {ROUTER_MAX_EXPERTS} experts, got {E}")
    x = device(x, "x", "float32")
    gate_w = device_weight(gate_w, "gate_w")
    bias = device(bias, "bias", "float32")
    logits = output(logits, "logits", (n, E), np.float32)
    ids = output(ids, "ids", (n, K), np.int32)
    weights = output(weights, "weights", (n, K), np.float32)
    if n == 1:
        ticket = zeroed(ticket, "ticket", (1,), np.uint32)      # the caller's (checked), or a new one
    elif ticket is not None:
        ticket = output(ticket, "ticket", (1,), np.uint32)      # checked, unused
    if n == 0:
        return ids, weights
    rule = (i32(spec.n_group), i32(spec.topk_group), f32(spec.routed_scaling_factor), i32(spec.norm_topk_prob),
            i32(spec.scoring_code))                              # router_select_row's arguments
    if n == 1:
        H = x.shape[1]
        nm, nargs = norm_args(norm, H)
        grid, wpr = gemv_config(cdiv(E, 2))
        get_kernel("moe", f"moe_router_kernel<{ctype(gate_w)}, {nm}>")(
            grid, (GEMV_THREADS,),
            (x, *weight_args(gate_w), bias, logits, ids, weights, ticket, i32(E), i32(H), i32(wpr), *nargs, i32(K),
             *rule),
        )
        return ids, weights
    launch_linear(x, gate_w, None, None, logits, norm)
    block = cdiv(E, 32) * 32
    get_kernel("moe", "moe_router_select_kernel")((n,), (block,), (logits, bias, ids, weights, i32(E), i32(K), *rule))
    return ids, weights


def moe_experts(x, ids, weights, w13, w2, residual=None, *, out=None, act=None, partial=None, limit=None,
                clamp_gate=False, norm=None, activation="swiglu", situ_beta=0.0, situ_linear_beta=0.0):
    """-> y [n, H] FP32; ``act`` [n * K, I] and ``partial`` [n * K, H]: FP32 workspaces (one row
    uses no ``partial``: none is allocated, a given one is checked and left as it is);
    ``limit``: the SwiGLU clamp of every expert (None / 0: none), of the gate before silu with
    ``clamp_gate`` (DeepSeek-V4), else of silu(gate) (Step-3.5); ``norm=(g, eps)``: x
    RMS-normalised first, fused into the gate/up pass (residual may be x itself)."""
    check_moe_experts(x, ids, weights, w13, w2, residual, activation)
    L, Lg = act_params(activation, limit, clamp_gate, situ_beta, situ_linear_beta)
    relu2 = activation == "relu2"
    expect_weight("w13", w13)
    expect_weight("w2", w2)
    expect_dtype("weights", weights, "float32")
    n, H = x.shape
    K = ids.shape[1]
    E, I = w13.shape[0], w13.shape[1] // gated_rows(activation)
    nK = n * K
    by_pair = nK <= E
    slots = nK if by_pair else E
    expect_grid_yz("expert slots (n * K, or E)", slots)
    expect_grid_yz("x rows", n)
    x = device(x, "x", "float32")
    ids, weights = device(ids, "ids", "int32"), device(weights, "weights", "float32")
    w13, w2 = device_weight(w13, "w13"), device_weight(w2, "w2")
    all_fp8_or_none("w13, w2", isinstance(w13, CudaFp8), isinstance(w2, CudaFp8))
    residual = optional(residual, "residual", "float32")
    act = output(act, "act", (nK, I), np.float32)
    one_row = n == 1           # moe_down_combine_kernel: no partial (a given one is checked, not used)
    partial = None if one_row and partial is None else output(partial, "partial", (nK, H), np.float32)
    y = output(out, "out", (n, H), np.float32)
    expect_disjoint("act", act, "x", x)
    if partial is not None:
        expect_disjoint("out", y, "partial", partial)
        expect_disjoint("partial", partial, "x", x)
        expect_disjoint("act", act, "partial", partial)
    expect_same_or_disjoint("out", y, "residual", residual)
    expect_disjoint("out", y, "weights", weights)
    if n == 0:
        return y
    if nK and H:
        nr = gemv_rows(n)     # the most pairs one expert gets when each row's ids are distinct
        nm, nargs = norm_args(norm, H)
        if I and relu2:        # rows (2u, 2u + 1) of w1[e] [I, H] per warp, relu2 in the epilogue
            up = get_kernel("moe", f"moe_expert_kernel<{ctype(w13)}, false, {nr}, {nm}, true>")
            up((cdiv(cdiv(I, 2), GEMV_WARPS), slots), (GEMV_THREADS,),
               (x, i32(K), ids, i32(nK), i32(E), *weight_args(w13), i32(I), i32(H), act, i32(by_pair),
                NO_LIMIT, NO_LIMIT, *nargs))
        elif I:
            situ = ", false, true" if activation == "situ" else ""
            gate_up = get_kernel("moe", f"moe_expert_kernel<{ctype(w13)}, true, {nr}, {nm}{situ}>")
            gate_up((cdiv(I, GEMV_WARPS), slots), (GEMV_THREADS,),
                    (x, i32(K), ids, i32(nK), i32(E), *weight_args(w13), i32(2 * I), i32(H), act, i32(by_pair),
                     L, Lg, *nargs))
        if one_row:
            get_kernel("moe", f"moe_down_combine_kernel<{ctype(w2)}>")(
                (cdiv(cdiv(H, 2), GEMV_WARPS),), (GEMV_THREADS,),
                (act, ids, weights, i32(K), i32(E), *weight_args(w2), i32(H), i32(I), ptr(residual), y))
            return y
        down = get_kernel("moe", f"moe_expert_kernel<{ctype(w2)}, false, {nr}, false>")
        down((cdiv(cdiv(H, 2), GEMV_WARPS), slots), (GEMV_THREADS,),
             (act, i32(1), ids, i32(nK), i32(E), *weight_args(w2), i32(H), i32(I), partial, i32(by_pair),
              NO_LIMIT, NO_LIMIT, NULL, f32(0.0)))
    if H:
        get_kernel("moe", "moe_combine_kernel")(
            (cdiv(H, COMBINE_THREADS), n), (COMBINE_THREADS,),
            (ptr(partial), ids, weights, ptr(residual), y, i32(K), i32(E), i32(H)))   # K = 0: none read
    return y
