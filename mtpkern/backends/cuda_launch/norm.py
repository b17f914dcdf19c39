"""Launchers of kernels/norm.cu: ``rmsnorm`` and ``mtp_input``.

``rmsnorm(x [..., H], w [H], eps) -> [..., H]`` FP32; ``out`` may be ``x``.

``mtp_input(embed [V, H], tokens [n] int32, g [n, H], enorm_w [H], hnorm_w [H],
eh_w [H, 2H], eps) -> [n, H]`` = ``mtp_norms_kernel`` (gather + both RMSNorms
into the workspace ``xcat [n, 2H]`` FP32) then ``linear_kernel`` (eh_proj).
``embed`` and ``eh_w`` are stored weights (FP32 or BF16 bits; ``eh_w`` may be FP8,
an FP8 ``embed`` is refused); a token outside [0, V) yields a NaN row. ``zero_embed``:
None (a null pointer) or [n] bool / int8 / uint8 flags, passed as their bytes: a flagged
row's embedding half of ``xcat`` is zeros, its token never read.
"""

from __future__ import annotations

import numpy as np

from ...ops._check import expect_dtype, expect_shape
from ...ops.norm import ZERO_EMBED_DTYPES, check_mtp_input
from ._util import (NULL, ctype, dense_weight, device, device_weight, expect_disjoint, expect_same_or_disjoint,
                    expect_weight, f32, i32, output)
from .linear import launch_linear
from .loader import get_kernel

#: kNormThreads in norm.cu: one block of 256 threads per row
NORM_THREADS = 256


def rmsnorm(x, w, eps: float, *, out=None):
    """x [..., H] FP32, w [H] FP32 -> [..., H] FP32 (rows = every leading index)."""
    if x.ndim < 1:
        raise ValueError(f"x: expected at least 1 dimension, got shape {tuple(x.shape)}")
    H = x.shape[-1]
    expect_shape("w", w, (H,))
    x = device(x, "x", "float32")
    w = device(w, "w", "float32")
    y = output(out, "out", tuple(x.shape), np.float32)
    expect_same_or_disjoint("out", y, "x", x)
    expect_disjoint("out", y, "w", w)
    n = x.size // H if H else 0
    if n:
        get_kernel("norm", "rmsnorm_kernel")((n,), (NORM_THREADS,), (x, w, y, i32(H), f32(eps)))
    return y


def mtp_input(embed, tokens, g, enorm_w, hnorm_w, eh_w, eps: float, *, out=None, xcat=None, zero_embed=None):
    """-> x [n, H] FP32. ``xcat``: workspace [n, 2H] FP32 (the normalised concat)."""
    check_mtp_input(embed, tokens, g, enorm_w, hnorm_w, eh_w, zero_embed)
    expect_weight("embed", embed)
    expect_weight("eh_w", eh_w)
    expect_dtype("tokens", tokens, "int32")
    V, H = embed.shape
    n = tokens.shape[0]
    embed, eh_w = dense_weight(embed, "embed"), device_weight(eh_w, "eh_w")
    tokens = device(tokens, "tokens", "int32")
    g = device(g, "g", "float32")
    enorm_w = device(enorm_w, "enorm_w", "float32")
    hnorm_w = device(hnorm_w, "hnorm_w", "float32")
    flags = NULL if zero_embed is None else device(zero_embed, "zero_embed", *ZERO_EMBED_DTYPES).view(np.uint8)
    xcat = output(xcat, "xcat", (n, 2 * H), np.float32)
    y = output(out, "out", (n, H), np.float32)
    expect_disjoint("out", y, "xcat", xcat)
    expect_disjoint("xcat", xcat, "g", g)
    if n == 0:
        return y
    kernel = get_kernel("norm", f"mtp_norms_kernel<{ctype(embed)}>")
    kernel((n, 2), (NORM_THREADS,), (embed, tokens, flags, g, enorm_w, hnorm_w, xcat, i32(V), i32(H), f32(eps)))
    launch_linear(xcat, eh_w, None, None, y)
    return y
