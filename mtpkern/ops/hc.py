"""Hyper-connections (manifold-constrained, DeepSeek-V4's mHC): a module's hidden is ``m``
streams of ``H`` (``hc_mult``), collapsed into one block input before attention and before
the FFN, and written back after them; ``hc_head`` collapses them for the LM head.

Letters: ``m`` streams, ``H`` the hidden size, ``X`` a row's streams ``[m, H]`` (a row of
``[n, m * H]``, stream ``i`` at columns ``i H .. (i + 1) H``).

The coefficients come from a learned projection ``fn`` of the RMS-normed flattened streams
(no norm weight), which the caller computes with the linear op's fused norm:
``mix = linear(X, fn, norm=(ones(m H), rms_norm_eps))``; ``fn`` is ``[(2 + m) m, m H]``
(rows: ``m`` pre, ``m`` post, ``m * m`` comb), ``base`` ``[(2 + m) m]``, ``scale`` ``[3]``.

``hc_pre(X [n, m H], mix [n, (2 + m) m], base, scale, hc_eps, iters) -> (u [n, H], post [n, m],
comb [n, m, m])``, per row, in FP32::

    pre  = sigmoid(mix[:m] * scale[0] + base[:m]) + hc_eps
    post = 2 * sigmoid(mix[m:2m] * scale[1] + base[m:2m])
    comb = softmax(mix[2m:].reshape(m, m) * scale[2] + base[2m:].reshape(m, m), rows) + hc_eps
    comb = comb / (column sums + hc_eps)                     # then iters - 1 times:
    comb = comb / (row sums + hc_eps); comb = comb / (column sums + hc_eps)
    u    = sum_i pre[i] X[i]                                  # the block's input

(Sinkhorn's iterations towards a doubly stochastic ``comb``; the releases: ``hc_eps`` 1e-6,
``iters`` = ``hc_sinkhorn_iters`` 20.) Sums run in index order.

``hc_post(f [n, H], X [n, m H], post [n, m], comb [n, m, m]) -> [n, m H]``: the streams after
the block whose output is ``f``::

    X'[j] = post[j] * f + sum_i comb[i, j] X[i]               # comb read transposed

``hc_head(X [n, m H], mix [n, m], base [m], scale [1], hc_eps) -> [n, H]``: the LM head's
collapse (``hc_head_fn`` ``[m, m H]`` makes ``mix`` as above): ``pre = sigmoid(mix * scale[0]
+ base) + hc_eps``, ``h = sum_i pre[i] X[i]``; no post, no comb.
"""

from __future__ import annotations

import numpy as np

from ._check import expect_dtype, expect_ndim, expect_shape


def _streams(name: str, X, m: int) -> tuple[int, int]:
    expect_ndim(name, X, 2)
    n, mH = X.shape
    if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or not 1 <= m <= 64:
        raise ValueError(f"m: expected an int in [1, 64] (hc_mult), got {m!r}")
    if mH % m or mH == 0:
        raise ValueError(f"{name}: expected [n, m * H] with m = {m}, got shape {list(X.shape)}")
    expect_dtype(name, X, "float32", "bfloat16")
    return n, mH // m


def check_hc_pre(X, mix, base, scale, hc_eps, iters) -> tuple[int, int, int]:
    expect_ndim("mix", mix, 2)
    w = mix.shape[1]
    m = int(round((np.sqrt(1 + w) - 1)))                       # w = (2 + m) m
    if (2 + m) * m != w:
        raise ValueError(f"mix: expected [n, (2 + m) m] columns (m pre, m post, m * m comb), got {w}")
    n, H = _streams("X", X, m)
    expect_shape("mix", mix, (n, w))
    expect_dtype("mix", mix, "float32")
    expect_shape("base", base, (w,))
    expect_dtype("base", base, "float32")
    expect_shape("scale", scale, (3,))
    expect_dtype("scale", scale, "float32")
    _eps_iters(hc_eps, iters)
    return n, m, H


def _eps_iters(hc_eps, iters=1) -> None:
    if isinstance(hc_eps, bool) or not isinstance(hc_eps, (int, float, np.floating)) or not 0 <= hc_eps <= 1:
        raise ValueError(f"hc_eps: expected a number in [0, 1], got {hc_eps!r}")
    if isinstance(iters, bool) or not isinstance(iters, (int, np.integer)) or not 1 <= iters <= 1000:
        raise ValueError(f"iters: expected an int in [1, 1000] (hc_sinkhorn_iters), got {iters!r}")


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return np.float32(1.0) / (np.float32(1.0) + np.exp(-x))


def _collapse(X: np.ndarray, w: np.ndarray, m: int, H: int) -> np.ndarray:
    """sum_i w[:, i] X[:, i], streams added in index order, FP32."""
    Xs = np.asarray(X, np.float32).reshape(X.shape[0], m, H)
    u = w[:, 0, None] * Xs[:, 0]
    for i in range(1, m):
        u = u + w[:, i, None] * Xs[:, i]
    return u.astype(np.float32)


def hc_pre(X, mix, base, scale, hc_eps: float, iters: int):
    n, m, H = check_hc_pre(X, mix, base, scale, hc_eps, iters)
    eps = np.float32(hc_eps)
    z = np.asarray(mix, np.float32)
    b = np.asarray(base, np.float32)
    s = np.asarray(scale, np.float32)
    pre = _sigmoid(z[:, :m] * s[0] + b[:m]) + eps
    post = np.float32(2.0) * _sigmoid(z[:, m:2 * m] * s[1] + b[m:2 * m])
    c = z[:, 2 * m:].reshape(n, m, m) * s[2] + b[2 * m:].reshape(m, m)
    c = np.exp(c - c.max(axis=2, keepdims=True))
    c = c / c.sum(axis=2, keepdims=True) + eps
    c = c / (c.sum(axis=1, keepdims=True) + eps)
    for _ in range(int(iters) - 1):
        c = c / (c.sum(axis=2, keepdims=True) + eps)
        c = c / (c.sum(axis=1, keepdims=True) + eps)
    return _collapse(X, pre, m, H), post.astype(np.float32), c.astype(np.float32)


def check_hc_post(f, X, post, comb) -> tuple[int, int, int]:
    expect_ndim("post", post, 2)
    m = post.shape[1]
    n, H = _streams("X", X, m)
    expect_shape("f", f, (n, H))
    expect_dtype("f", f, "float32", "bfloat16")
    expect_shape("post", post, (n, m))
    expect_dtype("post", post, "float32")
    expect_shape("comb", comb, (n, m, m))
    expect_dtype("comb", comb, "float32")
    return n, m, H


def hc_post(f, X, post, comb) -> np.ndarray:
    n, m, H = check_hc_post(f, X, post, comb)
    Xs = np.asarray(X, np.float32).reshape(n, m, H)
    fo = np.asarray(f, np.float32)
    out = np.empty((n, m, H), np.float32)
    for j in range(m):
        acc = post[:, j, None] * fo
        for i in range(m):
            acc = acc + comb[:, i, j, None] * Xs[:, i]
        out[:, j] = acc
    return out.reshape(n, m * H)


def check_hc_head(X, mix, base, scale, hc_eps) -> tuple[int, int, int]:
    expect_ndim("mix", mix, 2)
    m = mix.shape[1]
    n, H = _streams("X", X, m)
    expect_shape("mix", mix, (n, m))
    expect_dtype("mix", mix, "float32")
    expect_shape("base", base, (m,))
    expect_dtype("base", base, "float32")
    expect_shape("scale", scale, (1,))
    expect_dtype("scale", scale, "float32")
    _eps_iters(hc_eps)
    return n, m, H


def hc_head(X, mix, base, scale, hc_eps: float) -> np.ndarray:
    n, m, H = check_hc_head(X, mix, base, scale, hc_eps)
    pre = _sigmoid(np.asarray(mix, np.float32) * np.float32(scale[0]) + np.asarray(base, np.float32))
    return _collapse(X, pre + np.float32(hc_eps), m, H)
