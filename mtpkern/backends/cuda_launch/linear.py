"""Launcher of ``linear_kernel`` (kernels/linear.cu): the GEMV / small-n GEMM.

``linear(x [n, K], w [N, K], bias [N] | None, residual [n, N] | None) -> y [n, N]``
(``mtpkern.ops.linear``). ``w`` is FP32, BF16 bits (uint16) or FP8 (``CudaFp8``:
codes and scales, dequantized in the kernel); x, bias, residual, y are FP32. ``out`` may be ``residual`` (in-place residual add).

:func:`gemv_config` is the launch configuration of every row-group GEMV
(linear, swiglu gate/up): also used by mlp, moe (router logits), lm_head
(logits) and norm (eh_proj of mtp_input).
"""

from __future__ import annotations

import numpy as np

from ...ops.linear import check_linear
from ._util import (NULL, cdiv, ctype, device, device_norm, device_weight, expect_disjoint,
                    expect_same_or_disjoint, expect_weight, f32, i32, optional, output, ptr, sm_count,
                    weight_args)
from .gemm_tc import launch_gemm_tc, selected as tensor_cores_selected
from .loader import GEMV_NR, get_kernel

#: kGemvThreads in common.cuh: 4 warps, one row group (2 weight rows) per warp
GEMV_THREADS = 128
GEMV_WARPS = 4


def gemv_rows(n: int) -> int:
    """The GEMV kernels' NR instantiation for n input rows: the smallest of ``GEMV_NR``
    (1, 2, 4, 8) >= min(n, 8). The kernel takes the rows NR at a time (n > 8: chunks of 8,
    the last one run by the smallest code path that holds it), and its registers, so its
    occupancy, are NR's: a 1-row launch does not pay for the 8-row path."""
    return next(nr for nr in GEMV_NR if nr >= min(max(n, 1), GEMV_NR[-1]))


def gemv_config(groups: int) -> tuple[tuple[int], int]:
    """-> (grid, wpr) for ``groups`` row groups of two weight rows.

    wpr warps split K for one group; the smallest wpr in (1, 2, 4) that still
    gives >= 2 blocks per SM is taken, so a short output (router logits, E = 128
    rows -> 64 groups) spreads its K loop over 4 warps instead of idling the GPU."""
    target = 2 * sm_count()
    wpr = 4
    for w in (1, 2):
        if cdiv(groups, GEMV_WARPS // w) >= target:
            wpr = w
            break
    return (cdiv(groups, GEMV_WARPS // wpr),), wpr


def norm_args(norm, K: int) -> tuple[str, tuple]:
    """``norm`` as ``device_norm`` takes it -> (the GEMV kernels' NORM template argument,
    their ``norm_w, eps`` arguments)."""
    dn = device_norm(norm, K)
    if dn is None:
        return "false", (NULL, f32(0.0))
    return "true", (dn[0], f32(dn[1]))


def launch_linear(x, w, bias, residual, y, norm=None) -> None:
    """Validated, contiguous device arrays: x [n, K], w [N, K] (``device_weight``), y [n, N];
    ``norm``: (weight [K], eps) or None."""
    n, K = x.shape
    N = w.shape[0]
    if n == 0 or N == 0:
        return
    if tensor_cores_selected(n, K, w):  # n >= 4 rows, BF16 weights: kernels/gemm_tc.cu
        return launch_gemm_tc(x, w, bias, residual, y, device_norm(norm, K))
    nm, nargs = norm_args(norm, K)
    grid, wpr = gemv_config(cdiv(N, 2))
    kernel = get_kernel("linear", f"linear_kernel<{ctype(w)}, {gemv_rows(n)}, {nm}>")
    kernel(grid, (GEMV_THREADS,), (x, *weight_args(w), ptr(bias), ptr(residual), y, i32(n), i32(N), i32(K), i32(wpr),
                                   *nargs))


def linear(x, w, bias=None, residual=None, *, out=None, norm=None):
    """y [n, N] = x [n, K] @ w [N, K]^T (+ bias [N]) (+ residual [n, N]); ``out``: [n, N] FP32;
    ``norm=(g [K], eps)``: x is first RMS-normalised with weight g (fused: ``NORM``)."""
    check_linear(x, w, bias, residual)
    expect_weight("w", w)
    x = device(x, "x", "float32")
    w = device_weight(w, "w")
    bias = optional(bias, "bias", "float32")
    residual = optional(residual, "residual", "float32")
    y = output(out, "out", (x.shape[0], w.shape[0]), np.float32)
    expect_disjoint("out", y, "x", x)
    expect_same_or_disjoint("out", y, "residual", residual)
    if bias is not None:
        expect_disjoint("out", y, "bias", bias)
    launch_linear(x, w, bias, residual, y, norm)
    return y
