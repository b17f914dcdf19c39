"""SwiGLU MLP: ``swiglu_mlp(x [n, H], w13 [2I, H], w2 [H, I], residual [n, H] | None, *,
limit=None) -> [n, H] = residual + w2 @ (silu(w1 x) * (w3 x))``.

``w13`` stacks the gate projection (rows ``0..I``) over the up projection
(rows ``I..2I``), so one pass over memory reads both. Used for the dense MLP
and the shared experts (whose ``I`` is ``moe_intermediate_size * n_shared_experts``).

``limit`` is the SwiGLU clamp of Step-3.5 / Step-3.7 (``swiglu_limits_shared[layer]`` for
the shared expert and the dense MLP; the routed experts take ``swiglu_limits[layer]``,
``mtpkern.ops.moe``), as Hugging Face ``Step3p7MLP`` applies it, in FP32::

    gate = min(silu(x w1^T), L)          # clamped after the activation, from above only
    up   = min(max(x w3^T, -L), L)
    out  = (gate * up) w2^T

with ``L = float32(limit)``. ``None`` or 0 means no clamp (the checkpoints' 0.0 entries):
the result is bit for bit the unclamped one. A NaN stays NaN (``np.minimum`` /
``np.maximum``, as ``torch.clamp``): a clamp never turns a NaN row finite. Anything else
but a finite value > 0 is refused, naming ``limit`` (``swiglu_limit``).
"""

from __future__ import annotations

import math

import numpy as np

from ._check import expect_ndim, expect_shape
from .norm import normed

#: the bound the kernels take when there is no clamp: min(v, +inf) is v, bit for bit (NaN too)
NO_LIMIT = np.float32(np.inf)
#: the limits FP32 holds (one lookup here: np.finfo costs ~0.15 us a call)
_F32_TINY, _F32_MAX = float(np.finfo(np.float32).smallest_subnormal), float(np.finfo(np.float32).max)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (np.float32(1.0) + np.exp(-x))


def swiglu_limit(limit) -> np.float32:
    """``limit`` (``None``, 0, or a finite value > 0) -> the FP32 bound every backend clamps
    with: ``np.float32(limit)``, or ``NO_LIMIT`` (+inf) for None / 0. Raises ``TypeError``
    for a non-number and ``ValueError`` for a negative, NaN, infinite value or one FP32
    cannot hold (it would round to 0 or overflow to inf)."""
    if limit is None:
        return NO_LIMIT
    if isinstance(limit, (bool, np.bool_)) or not isinstance(limit, (int, float, np.integer, np.floating)):
        raise TypeError(f"limit: expected a number (finite, > 0; None or 0: no clamp), got {type(limit).__name__}")
    v = float(limit)
    if v == 0.0:
        return NO_LIMIT
    if not (math.isfinite(v) and v > 0.0):
        raise ValueError(f"limit: expected a finite value > 0 (None or 0: no clamp), got {limit!r}")
    L = np.float32(v) if v <= _F32_MAX else NO_LIMIT
    if not 0.0 < L < NO_LIMIT:                                       # rounded to 0, or past FP32's largest
        raise ValueError(f"limit: expected a value FP32 holds (between {_F32_TINY:g} and {_F32_MAX:g}), "
                         f"got {limit!r}")
    return L


def swiglu_act(gu: np.ndarray, L: np.float32 = NO_LIMIT) -> np.ndarray:
    """gu [.., 2I] = gate | up (FP32) -> silu(gate) * up [.., I], clamped by the bound
    ``L = swiglu_limit(limit)`` (see above)."""
    I = gu.shape[-1] // 2
    gate, up = silu(gu[..., :I]), gu[..., I:]
    if L != NO_LIMIT:
        gate = np.minimum(gate, L)
        up = np.minimum(np.maximum(up, -L), L)
    return gate * up


def check_swiglu_mlp(x, w13, w2, residual) -> None:
    expect_ndim("x", x, 2)
    n, H = x.shape
    expect_ndim("w13", w13, 2)
    if w13.shape[0] % 2 or w13.shape[1] != H:
        raise ValueError(f"w13: expected [2I, {H}], got {list(w13.shape)}")
    expect_shape("w2", w2, (H, w13.shape[0] // 2))
    if residual is not None:
        expect_shape("residual", residual, (n, H))


def swiglu_mlp(x, w13, w2, residual=None, *, limit=None, norm=None) -> np.ndarray:
    """``norm=(g [H], eps)``: of ``rmsnorm(x, g, eps)`` (mtpkern.ops.norm.normed); the
    residual stays as given (it may be x itself)."""
    check_swiglu_mlp(x, w13, w2, residual)
    L = swiglu_limit(limit)
    gu = np.asarray(normed(x, norm), np.float32) @ np.asarray(w13, np.float32).T     # [n, 2I]
    act = swiglu_act(gu, L)                                            # [n, I]
    y = act @ np.asarray(w2, np.float32).T                             # [n, H]
    if residual is not None:
        y = y + np.asarray(residual, np.float32)
    return y
