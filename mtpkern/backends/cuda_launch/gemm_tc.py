"""Launcher of ``gemm_tc_kernel`` (kernels/gemm_tc.cu): the GEMV of 4 input rows or more on
BF16 tensor cores.

``gemm_tc(x [n, K], w [N, K] BF16 bits, bias [N] | None, residual [n, N] | None, *,
norm=(g [K], eps) | None) -> y [n, N]`` FP32:
``y = inv_rms(x) * (x * g) @ w^T + bias + residual`` with the norm (inv_rms = 1 / sqrt(mean(x^2)
+ eps) per row), ``x @ w^T + bias + residual`` without. ``out`` may be ``residual``.

:func:`selected` is the rule ``linear`` uses to hand a launch to this kernel (n >= 4, BF16
weights, K % 8 == 0); FP32 and FP8 weights, fewer rows and other K keep ``linear_kernel``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...ops._check import dtype_name, shape_of
from ...ops.linear import check_linear
from ._util import (CudaFp8, cdiv, device, device_weight, expect_disjoint, expect_same_or_disjoint, f32, i32,
                    opt_in_smem, optional, output, ptr, sm_count)
from .loader import GEMM_TC_NT, get_kernel

#: kTcThreads in gemm_tc.cu: 8 warps
TC_THREADS = 256
TC_WARPS = 8
#: kTcTerms, kTcLd in gemm_tc.cu: BF16 terms of x, staged row stride in BF16 elements
TC_TERMS = 3
TC_LD = 256 + 32
#: input rows per launch (NT n-tiles of 8); more rows are cut into launches of this many
TC_ROWS = 8 * max(GEMM_TC_NT)
#: fewest input rows for which linear takes the tensor cores: below, the scalar kernel's
#: weight stream (read once for up to 8 rows) costs the same and its FP32 x is exact
MIN_ROWS = 4


def selected(n: int, K: int, w: Any) -> bool:
    """Whether ``linear`` runs ``x [n, K] @ w^T`` on ``gemm_tc_kernel``: n >= MIN_ROWS, BF16
    weights (uint16 bits; not ``CudaFp8``), K a positive multiple of 8."""
    return (n >= MIN_ROWS and not isinstance(w, CudaFp8) and dtype_name(w) == "uint16"
            and K > 0 and K % 8 == 0)


def tc_config(N: int) -> tuple[tuple[int], int]:
    """-> (grid, kw) for N weight rows: kw k-warps per row warp of 16 rows, the smallest of
    (1, 2, 4, 8) whose grid (``ceil(N / (16 * 8 / kw))`` blocks) covers every SM, else 8.
    Fewer k-warps mean more weight rows per block, so fewer blocks re-stage the same x."""
    target = sm_count()
    for kw in (1, 2, 4):
        if cdiv(N, 16 * (TC_WARPS // kw)) >= target:
            return (cdiv(N, 16 * (TC_WARPS // kw)),), kw
    return (cdiv(N, 16),), 8


def tc_smem_bytes(nt: int) -> int:
    """Dynamic shared memory of gemm_tc_kernel<nt, *>: the staged x, TC_TERMS x 8 nt rows x TC_LD
    BF16 (13.5 KiB per n-tile: 54 KiB at nt = 4, past 48 KiB: the kernel opts in)."""
    return TC_TERMS * 8 * nt * TC_LD * 2


def launch_gemm_tc(x, w, bias, residual, y, norm=None) -> None:
    """Validated, contiguous device arrays: x [n, K], w [N, K] uint16 (K % 8 == 0), y [n, N];
    ``norm``: (g [K] FP32 device array, eps) or None. One launch per TC_ROWS input rows."""
    n, K = shape_of(x)
    N = shape_of(w)[0]
    if n == 0 or N == 0:
        return
    if K % 8:
        raise ValueError(f"w: gemm_tc_kernel needs K % 8 == 0, got K = {K}")
    grid, kw = tc_config(N)
    g, eps = (None, 0.0) if norm is None else norm
    for r0 in range(0, n, TC_ROWS):
        m = min(TC_ROWS, n - r0)
        rows = (lambda a: a) if m == n else (lambda a: None if a is None else a[r0:r0 + m])
        nt = cdiv(m, 8)
        kernel = get_kernel("gemm_tc", f"gemm_tc_kernel<{nt}, {'false' if g is None else 'true'}>")
        smem = tc_smem_bytes(nt)
        opt_in_smem(kernel, smem)
        kernel(grid, (TC_THREADS,), (rows(x), w, ptr(bias), ptr(rows(residual)), ptr(g), f32(eps), rows(y),
                                     i32(m), i32(N), i32(K), i32(kw)), shared_mem=smem)


def gemm_tc(x, w, bias=None, residual=None, *, norm=None, out=None):
    """y [n, N] = (inv_rms(x) *) (x (* g)) @ w [N, K]^T (+ bias [N]) (+ residual [n, N]) on
    tensor cores; ``w`` BF16 bits (uint16), K % 8 == 0; ``norm``: ``(g [K] FP32, eps > 0)``."""
    check_linear(x, w, bias, residual)
    x = device(x, "x", "float32")
    w = device_weight(w, "w")
    if isinstance(w, CudaFp8) or dtype_name(w) != "uint16":
        raise TypeError(f"w: expected BF16 bits (uint16), got {'fp8' if isinstance(w, CudaFp8) else dtype_name(w)}")
    n, K = shape_of(x)
    if K % 8:
        raise ValueError(f"x: expected K % 8 == 0 (gemm_tc_kernel's 16-byte weight groups), got K = {K}")
    if norm is not None:
        g, eps = norm
        g = device(g, "norm g", "float32")
        if shape_of(g) != (K,):
            raise ValueError(f"norm g: expected shape [{K}], got {list(shape_of(g))}")
        if not float(eps) > 0:
            raise ValueError(f"norm eps: expected > 0, got {eps}")
        norm = (g, float(eps))
    bias = optional(bias, "bias", "float32")
    residual = optional(residual, "residual", "float32")
    y = output(out, "out", (n, shape_of(w)[0]), np.float32)
    expect_disjoint("out", y, "x", x)
    expect_same_or_disjoint("out", y, "residual", residual)
    if bias is not None:
        expect_disjoint("out", y, "bias", bias)
    if norm is not None:
        expect_disjoint("out", y, "norm g", norm[0])
    launch_gemm_tc(x, w, bias, residual, y, norm)
    return y
