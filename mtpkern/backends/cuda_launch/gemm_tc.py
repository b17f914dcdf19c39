"""Launchers of ``gemm_tc_kernel`` and ``swiglu_tc_kernel`` (kernels/gemm_tc.cu): the GEMVs of 4
input rows or more on BF16 tensor cores.

``gemm_tc(x [n, K], w [N, K] BF16 bits, bias [N] | None, residual [n, N] | None, *,
norm=(g [K], eps) | None) -> y [n, N]`` FP32:
``y = inv_rms(x) * (x * g) @ w^T + bias + residual`` with the norm (inv_rms = 1 / sqrt(mean(x^2)
+ eps) per row), ``x @ w^T + bias + residual`` without. ``out`` may be ``residual``.

``swiglu_tc(x [n, H], w13 [2I, H] BF16 bits, *, limit=None, clamp_gate=False, norm=None) -> act [n, I]``:
``mtp::swiglu(x Wg^T, x Wu^T, L, Lg)`` (``mtpkern.ops.mlp.swiglu_bounds``; gate rows ``w13[:I]``, up rows ``w13[I:]``; the norm as
above), the gate/up half of ``swiglu_mlp``.

:func:`selected` is the rule ``linear`` and ``swiglu_mlp`` use to hand a product to these
kernels (n >= 4, BF16 weights, K % 8 == 0); FP32 and FP8 weights, fewer rows and other K keep
``linear_kernel`` / ``swiglu_gate_up_kernel``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...ops._check import dtype_name, expect_ndim, expect_shape, shape_of
from ...ops.linear import check_linear
from ...ops.mlp import GATED_ACTIVATIONS, act_params
from ._util import (CudaFp8, cdiv, device, device_norm, device_weight, expect_disjoint, expect_same_or_disjoint,
                    f32, i32, opt_in_smem, optional, output, ptr, sm_count)
from .loader import GEMM_TC_NT, get_kernel

#: kTcThreads in gemm_tc.cu: 8 warps
TC_THREADS = 256
TC_WARPS = 8
#: kTcTerms, kTcLd in gemm_tc.cu: BF16 terms of x, staged row stride in BF16 elements
TC_TERMS = 3
TC_LD = 512 + 32
#: warps a launch should give each SM: 4 KB of weights in flight per warp (gemm_tc.cu's ring
#: of kTcGroup = 4 steps of 16 rows x 32 k), ~40 KB per SM to cover the memory latency
TC_WARPS_PER_SM = 10
#: input rows per launch (NT n-tiles of 8); more rows are cut into launches of this many
TC_ROWS = 8 * max(GEMM_TC_NT)
#: fewest input rows for which the tensor cores are taken: below, the scalar kernels' weight
#: stream (read once for up to 8 rows) costs the same
MIN_ROWS = 4
#: k-warps per tile the kernels take (kw)
KW = (1, 2, 4, 8)


def selected(n: int, K: int, w: Any) -> bool:
    """Whether ``x [n, K] @ w^T`` runs on the tensor-core kernels: n >= MIN_ROWS, BF16 weights
    (uint16 bits; not ``CudaFp8``), K a positive multiple of 8."""
    return (n >= MIN_ROWS and not isinstance(w, CudaFp8) and dtype_name(w) == "uint16"
            and K > 0 and K % 8 == 0)


def tc_config(tiles: int, kw: int | None = None) -> tuple[tuple[int], int]:
    """-> (grid, kw) for ``tiles`` tiles of 16 weight rows (linear: ceil(N / 16); SwiGLU:
    ceil(I / 8)): kw k-warps per tile, the smallest of (1, 2, 4, 8) that puts TC_WARPS_PER_SM
    warps (each keeping 4 KB of weights in flight: 40 KB per SM) on every SM, else 8; grid
    ``ceil(tiles / (8 / kw))`` blocks. Fewer k-warps mean more tiles per block, so fewer
    blocks stage the same x (x is read from L2 kw n / 64 times the weight bytes). ``kw``
    given (one of KW; the benchmark's sweep): that many instead."""
    if kw is None:
        want = TC_WARPS_PER_SM * sm_count()
        kw = next((k for k in (1, 2, 4) if tiles * k >= want), 8)
    elif kw not in KW:
        raise ValueError(f"kw: expected one of {KW}, got {kw!r}")
    return (cdiv(tiles, TC_WARPS // kw),), kw


def tc_smem_bytes(nt: int) -> int:
    """Dynamic shared memory of the kernels at ``nt`` n-tiles: the staged x, TC_TERMS x 8 nt rows
    x TC_LD BF16 (25.5 KiB per n-tile: 102 KiB at nt = 4, 2 blocks per SM; past 48 KiB (nt >= 2)
    the kernel opts in)."""
    return TC_TERMS * 8 * nt * TC_LD * 2


def _launch(name: str, tiles: int, x, norm, args, kw: int | None = None, more: str = "") -> None:
    """One launch of ``name<NT, NORM>`` per TC_ROWS rows of x [n, K]; ``args(sl, xs, g, eps, m,
    kw)`` -> the kernel's arguments for the rows ``sl`` (a slice; None: all rows, no view taken)
    given x's rows ``xs``, the norm's pointer and eps, the row count and the k-warps; ``kw``:
    the k-warps to take instead of tc_config's (the benchmark's sweep); ``more``: template
    arguments after NT, NORM (", true": swiglu_tc_kernel's SiTU)."""
    n, K = shape_of(x)
    if K % 8:
        raise ValueError(f"x: {name} needs K % 8 == 0, got K = {K}")
    grid, kw = tc_config(tiles, kw)
    g, eps = (None, 0.0) if norm is None else norm
    for r0 in range(0, n, TC_ROWS):
        m = min(TC_ROWS, n - r0)
        sl = None if m == n else slice(r0, r0 + m)
        nt = cdiv(m, 8)
        kernel = get_kernel("gemm_tc", f"{name}<{nt}, {'false' if g is None else 'true'}{more}>")
        smem = tc_smem_bytes(nt)
        opt_in_smem(kernel, smem)
        kernel(grid, (TC_THREADS,), args(sl, _rows(x, sl), ptr(g), f32(eps), i32(m), i32(kw)), shared_mem=smem)


def _rows(a, sl):
    return a if a is None or sl is None else a[sl]


def launch_gemm_tc(x, w, bias, residual, y, norm=None, kw: int | None = None) -> None:
    """Validated, contiguous device arrays: x [n, K], w [N, K] uint16 (K % 8 == 0), y [n, N];
    ``norm``: (g [K] FP32 device array, eps) or None; ``kw``: as _launch."""
    n, K = shape_of(x)
    N = shape_of(w)[0]
    if n == 0 or N == 0:
        return
    _launch("gemm_tc_kernel", cdiv(N, 16), x, norm, lambda sl, xs, g, eps, m, kw: (
        xs, w, ptr(bias), ptr(_rows(residual, sl)), g, eps, _rows(y, sl), m, i32(N), i32(K), kw), kw=kw)


def launch_swiglu_tc(x, w13, act, L, Lg, norm=None, situ: bool = False) -> None:
    """Validated, contiguous device arrays: x [n, H], w13 [2I, H] uint16 (H % 8 == 0),
    act [n, I]; L, Lg the clamps of silu(gate) and of the gate (np.float32, +inf for none:
    ``swiglu_bounds``), or with ``situ`` SiTU's beta and linear beta (``act_params``); ``norm``
    as launch_gemm_tc."""
    n, H = shape_of(x)
    I = shape_of(w13)[0] // 2
    if n == 0 or I == 0:
        return
    _launch("swiglu_tc_kernel", cdiv(I, 8), x, norm, lambda sl, xs, g, eps, m, kw: (
        xs, w13, g, eps, _rows(act, sl), m, i32(I), i32(H), kw, L, Lg), more=", true" if situ else "")


def _bf16_weight(w, name: str):
    w = device_weight(w, name)
    if isinstance(w, CudaFp8) or dtype_name(w) != "uint16":
        raise TypeError(f"{name}: expected BF16 bits (uint16), got {'fp8' if isinstance(w, CudaFp8) else dtype_name(w)}")
    return w


def _norm(norm, K: int):
    """(g [K] FP32 on the device, eps > 0) or None: ``device_norm``'s checks, and eps > 0."""
    dn = device_norm(norm, K)
    if dn is not None and not dn[1] > 0:
        raise ValueError(f"norm eps: expected > 0, got {dn[1]}")
    return dn


def _expect_k8(K: int) -> None:
    if K % 8:
        raise ValueError(f"x: expected K % 8 == 0 (the kernels' 16-byte weight groups), got K = {K}")


def gemm_tc(x, w, bias=None, residual=None, *, norm=None, out=None, kw: int | None = None):
    """y [n, N] = (inv_rms *) (x (* g)) @ w [N, K]^T (+ bias [N]) (+ residual [n, N]) on tensor
    cores; ``w`` BF16 bits (uint16), K % 8 == 0; ``norm``: ``(g [K] FP32, eps > 0)``; ``kw``:
    k-warps per tile (one of KW) instead of tc_config's choice (benchmarks/gpu_bench.py's
    sweep: the same result in another summation order)."""
    check_linear(x, w, bias, residual)
    x = device(x, "x", "float32")
    w = _bf16_weight(w, "w")
    _expect_k8(shape_of(x)[1])
    norm = _norm(norm, shape_of(x)[1])
    bias = optional(bias, "bias", "float32")
    residual = optional(residual, "residual", "float32")
    y = output(out, "out", (shape_of(x)[0], shape_of(w)[0]), np.float32)
    expect_disjoint("out", y, "x", x)
    expect_same_or_disjoint("out", y, "residual", residual)
    if bias is not None:
        expect_disjoint("out", y, "bias", bias)
    if norm is not None:
        expect_disjoint("out", y, "norm g", norm[0])
    launch_gemm_tc(x, w, bias, residual, y, norm, kw)
    return y


def swiglu_tc(x, w13, *, limit=None, clamp_gate=False, norm=None, out=None, activation="swiglu", situ_beta=0.0,
              situ_linear_beta=0.0):
    """act [n, I] = swiglu((inv_rms *) (x (* g)) @ w13[:I]^T, .. @ w13[I:]^T, limit) on tensor
    cores; ``w13`` [2I, H] BF16 bits, H % 8 == 0; ``norm`` as gemm_tc. ``activation="situ"``:
    Kimi K3's SiTU (``situ_beta``, ``situ_linear_beta``) instead of SwiGLU."""
    expect_ndim("x", x, 2)
    n, H = shape_of(x)
    expect_shape("w13", w13, (None, H))
    if shape_of(w13)[0] % 2:
        raise ValueError(f"w13: expected an even number of rows [2I, {H}], got {list(shape_of(w13))}")
    if activation not in GATED_ACTIVATIONS:
        raise ValueError(f"activation: expected one of {GATED_ACTIVATIONS} (a gated one), got {activation!r}")
    L, Lg = act_params(activation, limit, clamp_gate, situ_beta, situ_linear_beta)
    x = device(x, "x", "float32")
    w13 = _bf16_weight(w13, "w13")
    _expect_k8(H)
    norm = _norm(norm, H)
    act = output(out, "out", (n, shape_of(w13)[0] // 2), np.float32)
    expect_disjoint("out", act, "x", x)
    launch_swiglu_tc(x, w13, act, L, Lg, norm, situ=activation == "situ")
    return act
