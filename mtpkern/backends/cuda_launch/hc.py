"""Launchers of kernels/hc.cu: ``hc_pre``, ``hc_post``, ``hc_head`` (spec: mtpkern/ops/hc.py).

``hc_pre(X [n, m H], mix [n, (2 + m) m], base [(2 + m) m], scale [3], hc_eps, iters, *, u, post,
comb) -> (u [n, H], post [n, m], comb [n, m, m])``: ``hc_pre_kernel<T>``, one block per row.

``hc_post(f [n, H], X [n, m H], post [n, m], comb [n, m, m], *, out) -> [n, m H]``:
``hc_post_kernel<TF, TX, MR>``, MR the smaller of ``loader.HC_MR`` (4, 16) holding m.

``hc_head(X [n, m H], mix [n, m], base [m], scale [1], hc_eps, *, out) -> [n, H]``:
``hc_head_kernel<T>``.

``X`` and ``f``: FP32, or BF16 (on the device its bits in uint16, as the backend stores BF16; a
host ``ml_dtypes.bfloat16`` array is uploaded as its bits), each read in its own type. The
rest FP32; results FP32. At most ``MAX_STREAMS`` (16) streams: hc_pre's comb is one element
per thread of a 256-thread block. Given the outputs as contiguous device arrays (``u`` /
``post`` / ``comb``, ``out``), a launch allocates nothing (CUDA-graph capture); an output may
not overlap an input nor another output.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from ...ops.hc import check_hc_head, check_hc_post, check_hc_pre
from ._util import cdiv, ctype, device, expect_disjoint, expect_grid_yz, f32, i32, output
from .loader import HC_MR, get_kernel
from .mla import _as_checked

#: kHcMaxStreams, kHcPreThreads, kHcThreads in hc.cu; 4 columns per thread
MAX_STREAMS = 16
PRE_THREADS = 256
THREADS = 128
COLS = 4 * THREADS


def _max_streams(m: int) -> None:
    if m > MAX_STREAMS:
        raise ValueError(f"m: expected at most {MAX_STREAMS} streams (hc_mult) on cuda, got {m}")


def _streams(a, name: str):
    """X or f on the device: FP32, or BF16 bits (uint16); a host BF16 array as its bits."""
    if isinstance(a, np.ndarray) and a.dtype == ml_dtypes.bfloat16:
        a = a.view(np.uint16)
    return device(a, name, "float32", "uint16")


def _apart(outs: dict, ins: dict) -> None:
    """No output overlaps an input or another output (the kernels read while others write)."""
    names = list(outs)
    for i, o in enumerate(names):
        for other in names[i + 1:]:
            expect_disjoint(o, outs[o], other, outs[other])
        for name, a in ins.items():
            expect_disjoint(o, outs[o], name, a)


def hc_pre(X, mix, base, scale, hc_eps: float, iters: int, *, u=None, post=None, comb=None):
    """-> (u [n, H], post [n, m], comb [n, m, m]) FP32 (the keywords: their buffers)."""
    n, m, H = check_hc_pre(_as_checked(X), mix, base, scale, hc_eps, iters)
    _max_streams(m)
    ins = {"X": _streams(X, "X"), "mix": device(mix, "mix", "float32"), "base": device(base, "base", "float32"),
           "scale": device(scale, "scale", "float32")}
    outs = {"u": output(u, "u", (n, H), np.float32), "post": output(post, "post", (n, m), np.float32),
            "comb": output(comb, "comb", (n, m, m), np.float32)}
    _apart(outs, ins)
    if n:
        get_kernel("hc", f"hc_pre_kernel<{ctype(ins['X'])}>")(
            (n,), (PRE_THREADS,), (*ins.values(), f32(hc_eps), i32(iters), i32(m), i32(H), *outs.values()))
    return tuple(outs.values())


def hc_post(f, X, post, comb, *, out=None):
    """-> out [n, m H] FP32 (``out``: its buffer)."""
    n, m, H = check_hc_post(_as_checked(f), _as_checked(X), post, comb)
    _max_streams(m)
    expect_grid_yz("X rows", n)
    ins = {"f": _streams(f, "f"), "X": _streams(X, "X"), "post": device(post, "post", "float32"),
           "comb": device(comb, "comb", "float32")}
    y = output(out, "out", (n, m * H), np.float32)
    _apart({"out": y}, ins)
    if n:
        mr = next(r for r in HC_MR if m <= r)
        get_kernel("hc", f"hc_post_kernel<{ctype(ins['f'])}, {ctype(ins['X'])}, {mr}>")(
            (cdiv(H, COLS), n), (THREADS,), (*ins.values(), i32(m), i32(H), y))
    return y


def hc_head(X, mix, base, scale, hc_eps: float, *, out=None):
    """-> out [n, H] FP32 (``out``: its buffer)."""
    n, m, H = check_hc_head(_as_checked(X), mix, base, scale, hc_eps)
    _max_streams(m)
    expect_grid_yz("X rows", n)
    ins = {"X": _streams(X, "X"), "mix": device(mix, "mix", "float32"), "base": device(base, "base", "float32"),
           "scale": device(scale, "scale", "float32")}
    y = output(out, "out", (n, H), np.float32)
    _apart({"out": y}, ins)
    if n:
        get_kernel("hc", f"hc_head_kernel<{ctype(ins['X'])}>")(
            (cdiv(H, COLS), n), (THREADS,), (*ins.values(), f32(hc_eps), i32(m), i32(H), y))
    return y
