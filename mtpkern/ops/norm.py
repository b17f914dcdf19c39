"""RMSNorm and the MTP input block.

``rmsnorm(x [n, H], w [H], eps) -> [n, H]``: ``x / sqrt(mean(x^2) + eps) * w``
in FP32, as Hugging Face ``Glm4MoeRMSNorm`` computes it. A row whose largest finite
``|x|`` is ``2^56`` or more (``BIG``: its FP32 sum of squares could overflow, and from about
``1.8e19`` did, so the result changed with the hidden's scale) is first multiplied by the
power of two ``2^(32 - e)``, ``e = floor(log2(max |x|))``, and eps by its square: exact
scalings, so the result is the norm of the scaled row, as scale-invariant as the
definition (eps aside). Rows below ``BIG`` are computed as written above, bit for bit.
Every backend's ``rmsnorm`` and ``mtp_input`` norms do this (the CPU backend's ``norm=``
too, through its ``rmsnorm``); the CUDA kernels that fuse a norm into a GEMV (``norm=`` of
``linear`` / ``swiglu_mlp`` / ``moe_*``, the q/k and latent norms) sum unscaled squares:
exact below ``BIG``, where the block's own activations are.

``mtp_input(embed [V, H], tokens [n], g [n, H], enorm_w [H], hnorm_w [H],
eh_w [H, 2H], eps, *, zero_embed=None) -> x [n, H]``::

    x = eh_w @ concat(rmsnorm(embed[t], enorm_w), rmsnorm(g, hnorm_w))

The concat order (embedding first) is DeepSeek-V3's and vLLM's. ``zero_embed``: None, or
[n] bool / int8 / uint8 flags; a flagged (nonzero) row reads no embedding row and its
embedding half is exactly zero, so only ``eh_w[:, H:] @ rmsnorm(g, hnorm_w)`` is left. That is
vLLM's mask of the row at its position 0 (``inputs_embeds = 0`` before ``enorm``: the norm of
a zero row is zero for any eps > 0; ``MtpConfig.embed_mask_pos0``). Unflagged rows are
computed as without flags, bit for bit.

``norm=(w [H], eps)`` on ``linear`` and ``swiglu_mlp`` (``check_norm``, ``normed``): the op of
``rmsnorm(x, w, eps)`` instead of ``x``, the definition; the cuda backend fuses the norm into
the GEMV (one launch, the normed rows never stored).
"""

from __future__ import annotations

import numpy as np

from ._check import expect_dtype, expect_ndim, expect_shape

#: the dtypes ``zero_embed`` may have (one byte a flag: nonzero is set)
ZERO_EMBED_DTYPES = ("bool", "int8", "uint8")


def _f32(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float32)


#: a row's largest finite |x| from which rmsnorm scales it first (module docstring)
BIG = np.float32(2.0 ** 56)


def norm_scale(x: np.ndarray) -> np.ndarray:
    """[..., 1] FP32: ``2^(32 - floor(log2(m)))`` for rows whose largest finite ``|x|``, m, is
    >= ``BIG``, else 1 (NaN and infinities are not counted)."""
    a = np.abs(x)
    m = np.max(np.where(np.isfinite(a), a, np.float32(0.0)), axis=-1, keepdims=True) if a.size else \
        np.zeros(a.shape[:-1] + (1,), np.float32)
    e = np.frexp(m)[1] - 1                                   # m in [2^e, 2^(e + 1))
    return np.where(m >= BIG, np.ldexp(np.float32(1.0), 32 - e), np.float32(1.0)).astype(np.float32)


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x = _f32(x)
    sc = norm_scale(x)                                       # [n, 1]: 1 but for rows >= BIG
    if np.any(sc != 1):
        x = x * sc                                           # exact: a power of two
        eps = np.float32(eps) * sc * sc
    var = np.mean(x * x, axis=-1, keepdims=True)             # [n, 1]
    return (x / np.sqrt(var + np.float32(eps))) * _f32(w)     # [n, H]


def check_norm(norm, H: int) -> tuple[np.ndarray, float]:
    """The ``norm=(weight [H], eps)`` keyword of the GEMV ops (linear, swiglu_mlp): an RMSNorm
    of the op's input ``x`` applied first (the cuda backend fuses it into the GEMV) ->
    ``(weight, eps)``, checked."""
    if not isinstance(norm, tuple) or len(norm) != 2:
        raise TypeError(f"norm: expected a (weight [{H}], eps) pair, got {type(norm).__name__}")
    w, eps = norm
    expect_shape("norm weight", w, (H,))
    eps = float(eps)
    if not eps >= 0.0:
        raise ValueError(f"norm eps: expected >= 0, got {eps}")
    return w, eps


def normed(x, norm) -> np.ndarray:
    """``x`` through the optional ``norm=(weight, eps)`` of a GEMV op: its definition,
    ``rmsnorm(x, weight, eps)``, or ``x`` itself for None."""
    if norm is None:
        return x
    return rmsnorm(x, *check_norm(norm, np.shape(x)[-1]))


def check_mtp_input(embed, tokens, g, enorm_w, hnorm_w, eh_w, zero_embed=None) -> None:
    expect_ndim("embed", embed, 2)
    V, H = embed.shape
    expect_ndim("tokens", tokens, 1)
    n = tokens.shape[0]
    expect_shape("g", g, (n, H))
    expect_shape("enorm_w", enorm_w, (H,))
    expect_shape("hnorm_w", hnorm_w, (H,))
    expect_shape("eh_w", eh_w, (H, 2 * H))
    check_zero_embed(zero_embed, n)


def check_zero_embed(zero_embed, n: int) -> None:
    """``zero_embed`` of ``mtp_input``: None, or a [n] bool / int8 / uint8 array."""
    if zero_embed is None:
        return
    if not (hasattr(zero_embed, "shape") and hasattr(zero_embed, "dtype")):
        raise TypeError(f"zero_embed: expected None or a [{n}] {' / '.join(ZERO_EMBED_DTYPES)} array, "
                        f"got {type(zero_embed).__name__}")
    expect_dtype("zero_embed", zero_embed, *ZERO_EMBED_DTYPES)
    expect_shape("zero_embed", zero_embed, (n,))


def mtp_input(embed, tokens, g, enorm_w, hnorm_w, eh_w, eps: float, *, zero_embed=None) -> np.ndarray:
    check_mtp_input(embed, tokens, g, enorm_w, hnorm_w, eh_w, zero_embed)
    t = np.asarray(tokens, dtype=np.int64)
    if zero_embed is None:
        e = rmsnorm(_f32(embed[t]), enorm_w, eps)                              # [n, H]
    else:                                        # flagged rows: no embedding row read, zeros
        keep = np.asarray(zero_embed) == 0                                     # [n]
        e = np.zeros((t.shape[0], embed.shape[1]), np.float32)
        e[keep] = rmsnorm(_f32(embed[t[keep]]), enorm_w, eps)
    h = rmsnorm(g, hnorm_w, eps)                                               # [n, H]
    return np.concatenate([e, h], axis=1) @ _f32(eh_w).T                        # [n, H]
