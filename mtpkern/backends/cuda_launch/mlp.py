"""Launcher of the SwiGLU MLP: ``swiglu_gate_up_kernel`` (kernels/mlp.cu) then
``linear_kernel`` (down projection with the residual fused).

``swiglu_mlp(x [n, H], w13 [2I, H], w2 [H, I], residual [n, H] | None, *, limit=None,
clamp_gate=False) -> [n, H]`` FP32 activations, stored weights (FP32, BF16 bits, or both FP8:
``CudaFp8``). ``act``: workspace [n, I] FP32 (silu(gate) * up, clamped by ``limit``, of the
gate before silu with ``clamp_gate``: ``mtpkern.ops.mlp``; the kernel takes both bounds of
``swiglu_bounds``, +inf for none). ``out`` may be ``residual``.
"""

from __future__ import annotations

import numpy as np

from ...ops.mlp import check_swiglu_mlp, swiglu_bounds
from ..base import all_fp8_or_none
from ._util import (CudaFp8, ctype, device, device_norm, device_weight, expect_disjoint, expect_same_or_disjoint,
                    expect_weight, i32, optional, output, weight_args)
from .gemm_tc import launch_swiglu_tc, selected as tensor_cores_selected
from .linear import GEMV_THREADS, gemv_config, gemv_rows, launch_linear, norm_args
from .loader import get_kernel


def swiglu_mlp(x, w13, w2, residual=None, *, out=None, act=None, limit=None, clamp_gate=False, norm=None):
    """-> y [n, H] FP32 = residual + w2 @ (silu(w13[:I] x) * w13[I:] x), clamped by ``limit``
    (of the gate before silu with ``clamp_gate``);
    ``norm=(g [H], eps)``: x RMS-normalised first, fused into the gate/up GEMV (residual may
    then be x itself: y = x + mlp(rmsnorm(x)))."""
    check_swiglu_mlp(x, w13, w2, residual)
    L, Lg = swiglu_bounds(limit, clamp_gate)
    expect_weight("w13", w13)
    expect_weight("w2", w2)
    n, H = x.shape
    I = w13.shape[0] // 2
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
    if I and tensor_cores_selected(n, H, w13):  # n >= 4 rows, BF16 weights: kernels/gemm_tc.cu
        launch_swiglu_tc(x, w13, act, L, Lg, device_norm(norm, H))
    elif I:
        grid, wpr = gemv_config(I)  # row group u = (gate row u, up row I + u)
        nm, nargs = norm_args(norm, H)
        kernel = get_kernel("mlp", f"swiglu_gate_up_kernel<{ctype(w13)}, {gemv_rows(n)}, {nm}>")
        kernel(grid, (GEMV_THREADS,), (x, *weight_args(w13), act, i32(n), i32(I), i32(H), i32(wpr), L, Lg, *nargs))
    launch_linear(act, w2, None, residual, y)
    return y
