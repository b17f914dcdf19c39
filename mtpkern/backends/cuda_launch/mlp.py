"""Launcher of the SwiGLU MLP: ``swiglu_gate_up_kernel`` (kernels/mlp.cu) then
``linear_kernel`` (down projection with the residual fused).

``swiglu_mlp(x [n, H], w13 [2I, H], w2 [H, I], residual [n, H] | None, *, limit=None,
clamp_gate=False) -> [n, H]`` FP32 activations, stored weights (FP32, BF16 bits, or both FP8:
``CudaFp8``). ``act``: workspace [n, I] FP32 (silu(gate) * up, clamped by ``limit``, of the
gate before silu with ``clamp_gate``: ``mtpkern.ops.mlp``; the kernel takes both bounds of
``swiglu_bounds``, +inf for none). ``out`` may be ``residual``.

``activation="relu2"`` (Nemotron-H; ``w13`` is then the up rows alone ``[I, H]``): ``act = x w1^T``
by ``linear_kernel`` (the norm fused as there), ``relu2_kernel`` in place, then the down
projection as above.

``activation="situ"`` (Kimi K3; ``w13`` as SwiGLU's): the same launches as SwiGLU's, each
gate/up kernel's ``SITU`` instantiation, which takes ``situ_beta`` / ``situ_linear_beta`` where
SwiGLU's takes its two bounds (``mtpkern.ops.mlp.act_params``).
"""

from __future__ import annotations

import numpy as np

from ...ops.mlp import act_params, check_swiglu_mlp, gated_rows
from ..base import all_fp8_or_none
from ._util import (CudaFp8, cdiv, ctype, device, device_norm, device_weight, expect_disjoint, expect_same_or_disjoint,
                    expect_weight, i32, optional, output, weight_args)
from .gemm_tc import launch_swiglu_tc, selected as tensor_cores_selected
from .linear import GEMV_THREADS, gemv_config, gemv_rows, launch_linear, norm_args
from .loader import get_kernel

#: relu2_kernel's block (kernels/mlp.cu)
RELU2_THREADS = 256


def swiglu_mlp(x, w13, w2, residual=None, *, out=None, act=None, limit=None, clamp_gate=False, norm=None,
               activation="swiglu", situ_beta=0.0, situ_linear_beta=0.0):
    """-> y [n, H] FP32 = residual + w2 @ (silu(w13[:I] x) * w13[I:] x), clamped by ``limit``
    (of the gate before silu with ``clamp_gate``);
    ``norm=(g [H], eps)``: x RMS-normalised first, fused into the gate/up GEMV (residual may
    then be x itself: y = x + mlp(rmsnorm(x)))."""
    check_swiglu_mlp(x, w13, w2, residual, activation)
    L, Lg = act_params(activation, limit, clamp_gate, situ_beta, situ_linear_beta)
    relu2, situ = activation == "relu2", activation == "situ"
    expect_weight("w13", w13)
    expect_weight("w2", w2)
    n, H = x.shape
    I = w13.shape[0] // gated_rows(activation)
    x = device(x, "x", "float32")
    w13, w2 = device_weight(w13, "w13"), device_weight(w2, "w2")
    all_fp8_or_none("w13, w2", isinstance(w13, CudaFp8), isinstance(w2, CudaFp8))
    residual = optional(residual, "residual", "float32")
    act = output(act, "act", (n, I), np.float32)
    y = output(out, "out", (n, H), np.float32)
    expect_disjoint("out", y, "act", act)
    expect_disjoint("act", act, "x", x)
    expect_same_or_disjoint("out", y, "residual", residual)
    if n == 0:
        return y
    if I and relu2:             # up (linear_kernel or the tensor cores), relu2 in place, then down
        launch_linear(x, w13, None, None, act, norm)
        count = n * I
        get_kernel("mlp", "relu2_kernel")((min(cdiv(count, RELU2_THREADS), 65535),), (RELU2_THREADS,),
                                          (act, np.int64(count)))
    elif I and tensor_cores_selected(n, H, w13):  # n >= 4 rows, BF16 weights: kernels/gemm_tc.cu
        launch_swiglu_tc(x, w13, act, L, Lg, device_norm(norm, H), situ=situ)
    elif I:
        grid, wpr = gemv_config(I)  # row group u = (gate row u, up row I + u)
        nm, nargs = norm_args(norm, H)
        kernel = get_kernel("mlp", f"swiglu_gate_up_kernel<{ctype(w13)}, {gemv_rows(n)}, {nm}"
                                   f"{', true' if situ else ''}>")
        kernel(grid, (GEMV_THREADS,), (x, *weight_args(w13), act, i32(n), i32(I), i32(H), i32(wpr), L, Lg, *nargs))
    launch_linear(act, w2, None, residual, y)
    return y
