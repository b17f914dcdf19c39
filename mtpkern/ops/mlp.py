"""SwiGLU MLP: ``swiglu_mlp(x [n, H], w13 [2I, H], w2 [H, I], residual [n, H] | None, *,
limit=None, clamp_gate=False) -> [n, H] = residual + w2 @ (silu(w1 x) * (w3 x))``.

``w13`` stacks the gate projection (rows ``0..I``) over the up projection
(rows ``I..2I``), so one pass over memory reads both. Used for the dense MLP
and the shared experts (whose ``I`` is ``moe_intermediate_size * n_shared_experts``).

``limit`` is the SwiGLU clamp of Step-3.5 / Step-3.7 (``swiglu_limits_shared[layer]`` for
the shared expert and the dense MLP; the routed experts take ``swiglu_limits[layer]``,
``mtpkern.ops.moe``), as Hugging Face ``Step3p7MLP`` applies it, in FP32::

    gate = min(silu(x w1^T), L)          # clamped after the activation, from above only
    up   = min(max(x w3^T, -L), L)
    out  = (gate * up) w2^T

with ``L = float32(limit)``. ``clamp_gate=True`` clamps the gate before the activation
instead, as DeepSeek-V4 (and GLM-5.3) do (Hugging Face ``DeepseekV4MLP`` /
``DeepseekV4Experts._apply_gate``)::

    gate = min(x w1^T, L)                # clamped before the activation, from above only
    up   = min(max(x w3^T, -L), L)
    out  = (silu(gate) * up) w2^T

The two differ wherever the gate passes L: V4's activation stops at silu(L) (< L), Step-3.5's
grows on to L (it bites only where silu(g) > L, i.e. g > L + a little). ``None`` or 0 means no
clamp (the checkpoints' 0.0 entries), whatever ``clamp_gate`` says: the result is bit for bit
the unclamped one. A NaN stays NaN (``np.minimum`` / ``np.maximum``, as ``torch.clamp``): a
clamp never turns a NaN row finite. Anything else but a finite value > 0 is refused, naming
``limit`` (``swiglu_limit``); ``clamp_gate`` must be a bool.

``activation="relu2"`` is Nemotron-H's non-gated MLP (transformers ``NemotronHMLP`` /
``NemotronHExperts``, ``ACT2FN["relu2"]``): ``w13`` is then the up projection alone [I, H] and
``out = relu(x w1^T) ** 2 w2^T`` (no clamp: ``limit`` must be None or 0).

``activation="situ"`` is Kimi K3's gated SituAndMul, w13 laid out as SwiGLU's (gate rows over
up rows), in FP32 (``situ_act``)::

    act = beta * tanh(gate / beta) * sigmoid(gate) * up'
    up' = linear_beta * tanh(up / linear_beta)     # with a linear beta > 0; else up' = up

with ``beta = situ_beta`` (a finite value > 0) and ``linear_beta = situ_linear_beta`` (0: none).
It takes no SwiGLU clamp; the other activations take no ``situ_*`` (``check_activation``).
The kernels take the two SiTU parameters where SwiGLU's take its bounds (``act_params``).

The kernels take both clamps as FP32 bounds (``swiglu_bounds``): ``L`` on silu(gate), ``Lg``
on the gate before silu, the one not in use +inf (``min(v, +inf)`` is ``v``, bit for bit), and
clip up by ``min(L, Lg)``: one code path, no flag, for none, either clamp.
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


def check_clamp_gate(clamp_gate) -> bool:
    if not isinstance(clamp_gate, (bool, np.bool_)):
        raise TypeError(f"clamp_gate: expected a bool (True: clamp the gate before silu), got "
                        f"{type(clamp_gate).__name__} {clamp_gate!r}")
    return bool(clamp_gate)


def swiglu_bounds(limit, clamp_gate=False) -> tuple[np.float32, np.float32]:
    """``limit`` (as ``swiglu_limit``) and ``clamp_gate`` -> ``(L, Lg)``, the FP32 bounds the
    kernels take: L on silu(gate) (Step-3.5), Lg on the gate before silu (DeepSeek-V4), the
    other one ``NO_LIMIT``; both ``NO_LIMIT`` for no clamp. Up is clipped by ``min(L, Lg)``."""
    L = swiglu_limit(limit)
    return (NO_LIMIT, L) if check_clamp_gate(clamp_gate) else (L, NO_LIMIT)


def swiglu_act(gu: np.ndarray, L: np.float32 = NO_LIMIT, *, clamp_gate: bool = False) -> np.ndarray:
    """gu [.., 2I] = gate | up (FP32) -> silu(gate) * up [.., I], clamped by the bound
    ``L = swiglu_limit(limit)``: after silu, or before it with ``clamp_gate`` (see above)."""
    I = gu.shape[-1] // 2
    gate, up = gu[..., :I], gu[..., I:]
    if L == NO_LIMIT:
        return silu(gate) * up
    up = np.minimum(np.maximum(up, -L), L)
    if clamp_gate:
        return silu(np.minimum(gate, L)) * up
    return np.minimum(silu(gate), L) * up


#: the activations ``activation=`` takes (mtpkern/block.py ``MLP_ACTS``)
ACTIVATIONS = ("swiglu", "relu2", "situ")
#: the gated ones: w13 = gate rows over up rows
GATED_ACTIVATIONS = ("swiglu", "situ")


def _situ_number(name: str, v, lo_exclusive: bool) -> np.float32:
    """A SiTU parameter -> FP32: a finite number, > 0 (``lo_exclusive``) or >= 0, that FP32 holds."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name}: expected a number, got {type(v).__name__} {v!r}")
    f = float(v)
    ok = math.isfinite(f) and (f > 0.0 if lo_exclusive else f >= 0.0) and f <= _F32_MAX
    if ok and f and not np.float32(f) > 0.0:                         # rounds to 0 in FP32
        ok = False
    if not ok:
        want = "> 0" if lo_exclusive else ">= 0 (0: none)"
        raise ValueError(f"{name}: expected a finite value {want} that FP32 holds, got {v!r}")
    return np.float32(f)


def activation_name(activation) -> str:
    """``activation`` -> itself, checked: one of ``ACTIVATIONS`` (its parameters: ``check_activation``)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
    return activation


def check_activation(activation, limit=None, situ_beta=0.0, situ_linear_beta=0.0) -> str:
    """``activation`` -> itself, checked: one of ``ACTIVATIONS``; only "swiglu" takes a clamp,
    only "situ" takes ``situ_beta`` (required, > 0) and ``situ_linear_beta`` (>= 0, 0: none)."""
    activation_name(activation)
    if activation != "swiglu" and limit:
        raise ValueError(f"limit: the SwiGLU clamp needs activation 'swiglu', got limit {limit!r} with "
                         f"{activation!r}")
    if activation == "situ":
        _situ_number("situ_beta", situ_beta, True)
        _situ_number("situ_linear_beta", situ_linear_beta, False)
    elif situ_beta or situ_linear_beta:
        raise ValueError(f"situ_beta, situ_linear_beta: expected 0 with activation {activation!r} (they are "
                         f"activation 'situ''s), got {situ_beta!r}, {situ_linear_beta!r}")
    return activation


def act_params(activation, limit=None, clamp_gate=False, situ_beta=0.0,
               situ_linear_beta=0.0) -> tuple[np.float32, np.float32]:
    """The two FP32 numbers a gated kernel takes for its activation, checked: SwiGLU's bounds
    ``(L, Lg)`` (``swiglu_bounds``), SiTU's ``(beta, linear_beta)`` (0: no linear beta)."""
    check_activation(activation, limit, situ_beta, situ_linear_beta)
    if activation == "situ":
        check_clamp_gate(clamp_gate)
        return np.float32(situ_beta), np.float32(situ_linear_beta)
    return swiglu_bounds(limit, clamp_gate)


def gated_rows(activation: str) -> int:
    """Rows of w13 per intermediate column: 2 (gate over up) for SwiGLU and SiTU, 1 (up) for relu2."""
    return 2 if activation in GATED_ACTIVATIONS else 1


def situ_act(gu: np.ndarray, beta, linear_beta=0.0) -> np.ndarray:
    """gu [.., 2I] = gate | up (FP32) -> SiTU(gate) * up' [.., I] (Kimi K3's SituAndMul, see above):
    ``beta * tanh(g / beta) * sigmoid(g) * up'``, ``up' = lb * tanh(up / lb)`` for lb > 0, else up."""
    I = gu.shape[-1] // 2
    g, u = gu[..., :I], gu[..., I:]
    b, lb = np.float32(beta), np.float32(linear_beta)
    one = np.float32(1.0)
    if lb > 0:
        u = lb * np.tanh(u / lb)
    with np.errstate(over="ignore"):                 # exp(-g) = inf for g < -88: sigmoid 0, as the kernels
        sig = one / (one + np.exp(-g))
    return b * np.tanh(g / b) * sig * u


def gated_act(gu: np.ndarray, activation: str, L: np.float32 = NO_LIMIT, *, clamp_gate: bool = False,
              situ_beta=0.0, situ_linear_beta=0.0) -> np.ndarray:
    """The activation of ``activation`` over gu (FP32; gated: gate | up [.., 2I], relu2: up [.., I])."""
    if activation == "relu2":
        return relu2(gu)
    if activation == "situ":
        return situ_act(gu, situ_beta, situ_linear_beta)
    return swiglu_act(gu, L, clamp_gate=clamp_gate)


def relu2(u: np.ndarray) -> np.ndarray:
    """relu(u) ** 2 (FP32), as ``ReLUSquaredActivation``: ``square(relu(u))``."""
    r = np.maximum(u, np.float32(0.0))
    return r * r


def check_swiglu_mlp(x, w13, w2, residual, activation="swiglu") -> None:
    expect_ndim("x", x, 2)
    n, H = x.shape
    expect_ndim("w13", w13, 2)
    g = gated_rows(activation_name(activation))
    if w13.shape[0] % g or w13.shape[1] != H:
        raise ValueError(f"w13: expected [{'2I' if g == 2 else 'I'}, {H}] ({activation}), got {list(w13.shape)}")
    expect_shape("w2", w2, (H, w13.shape[0] // g))
    if residual is not None:
        expect_shape("residual", residual, (n, H))


def swiglu_mlp(x, w13, w2, residual=None, *, limit=None, clamp_gate=False, norm=None,
               activation="swiglu", situ_beta=0.0, situ_linear_beta=0.0) -> np.ndarray:
    """``norm=(g [H], eps)``: of ``rmsnorm(x, g, eps)`` (mtpkern.ops.norm.normed); the
    residual stays as given (it may be x itself). ``activation="relu2"``: w13 is [I, H];
    ``"situ"``: SiTU with ``situ_beta`` / ``situ_linear_beta`` (see above)."""
    check_swiglu_mlp(x, w13, w2, residual, activation)
    check_activation(activation, limit, situ_beta, situ_linear_beta)
    L = swiglu_limit(limit)
    clamp_gate = check_clamp_gate(clamp_gate)
    gu = np.asarray(normed(x, norm), np.float32) @ np.asarray(w13, np.float32).T     # [n, 2I] (relu2: [n, I])
    act = gated_act(gu, activation, L, clamp_gate=clamp_gate, situ_beta=situ_beta,
                    situ_linear_beta=situ_linear_beta)                                 # [n, I]
    y = act @ np.asarray(w2, np.float32).T                             # [n, H]
    if residual is not None:
        y = y + np.asarray(residual, np.float32)
    return y
