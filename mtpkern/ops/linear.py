"""Dense projection: ``linear(x [n, K], w [N, K], bias [N] | None,
residual [n, N] | None) -> [n, N] = x @ w.T + bias + residual`` in FP32.

Used for the fused q/k/v projection (rows of q, k, v stacked at load time)
and for o_proj with the attention residual added in the same pass.
"""

from __future__ import annotations

import numpy as np

from ._check import expect_ndim, expect_shape
from .norm import normed


def check_linear(x, w, bias, residual) -> None:
    expect_ndim("x", x, 2)
    expect_shape("w", w, (None, x.shape[1]))
    N = w.shape[0]
    if bias is not None:
        expect_shape("bias", bias, (N,))
    if residual is not None:
        expect_shape("residual", residual, (x.shape[0], N))


def linear(x, w, bias=None, residual=None, *, norm=None) -> np.ndarray:
    """``norm=(g [K], eps)``: of ``rmsnorm(x, g, eps)`` (mtpkern.ops.norm.normed)."""
    check_linear(x, w, bias, residual)
    x = normed(x, norm)
    y = np.asarray(x, np.float32) @ np.asarray(w, np.float32).T      # [n, N]
    if bias is not None:
        y = y + np.asarray(bias, np.float32)
    if residual is not None:
        y = y + np.asarray(residual, np.float32)
    return y
