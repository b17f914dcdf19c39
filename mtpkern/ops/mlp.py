"""SwiGLU MLP: ``swiglu_mlp(x [n, H], w13 [2I, H], w2 [H, I], residual [n, H] | None)
-> [n, H] = residual + w2 @ (silu(w1 x) * (w3 x))``.

``w13`` stacks the gate projection (rows ``0..I``) over the up projection
(rows ``I..2I``), so one pass over memory reads both. Used for the dense MLP
and the shared experts (whose ``I`` is ``moe_intermediate_size * n_shared_experts``).
"""

from __future__ import annotations

import numpy as np

from ._check import expect_ndim, expect_shape


def silu(x: np.ndarray) -> np.ndarray:
    return x / (np.float32(1.0) + np.exp(-x))


def check_swiglu_mlp(x, w13, w2, residual) -> None:
    expect_ndim("x", x, 2)
    n, H = x.shape
    expect_ndim("w13", w13, 2)
    if w13.shape[0] % 2 or w13.shape[1] != H:
        raise ValueError(f"w13: expected [2I, {H}], got {list(w13.shape)}")
    expect_shape("w2", w2, (H, w13.shape[0] // 2))
    if residual is not None:
        expect_shape("residual", residual, (n, H))


def swiglu_mlp(x, w13, w2, residual=None) -> np.ndarray:
    check_swiglu_mlp(x, w13, w2, residual)
    I = w13.shape[0] // 2
    gu = np.asarray(x, np.float32) @ np.asarray(w13, np.float32).T     # [n, 2I]
    act = silu(gu[:, :I]) * gu[:, I:]                                  # [n, I]
    y = act @ np.asarray(w2, np.float32).T                             # [n, H]
    if residual is not None:
        y = y + np.asarray(residual, np.float32)
    return y
