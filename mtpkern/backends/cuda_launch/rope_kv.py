"""Launchers of ``qk_norm_rope_kv_write_kernel`` and ``rope_heads_kernel`` (kernels/rope_kv.cu).

``qk_norm_rope_kv_write(qkv [n, W >= (Hq + Hkv) D + Hkv Dv], Hq, Hkv, q_norm_w [D] | None,
k_norm_w [D] | None, eps, inv_freq [R/2], positions [n] int32,
k_cache [NB, BS, Hkv, D], v_cache [NB, BS, Hkv, Dv], slots [n] int32, *, interleave=False,
rope_scale=1.0, v_is_k=False) -> q [n, Hq, D]``

``interleave`` selects the kernel's ``Interleave`` instantiation (pairs (2i, 2i + 1), else
(i, i + R/2)); ``rope_scale`` (YaRN's attention factor) multiplies cos and sin. ``v_is_k``
selects ``VIsK`` (DeepSeek-V4's shared KV): qkv holds q | k only (W >= (Hq + Hkv) D) and the
key's warp writes its converted values into both caches (Dv = D).

The kernel reads row r of qkv at ``r * W``: columns past q | k | v (a gate stacked
into the same projection) are skipped, not copied.

The caches (BF16 bits in uint16, or FP32; both the same dtype) are written in
place, so they must be contiguous GPU arrays. A slot outside [0, NB * BS)
(e.g. -1 for padding) skips that row's K/V write.

``rope_heads(x [n, heads, D], positions [n] int32, inv_freq [R/2], *, interleave=False,
rope_scale=1.0, inverse=False) -> [n, heads, D]`` FP32: ``Interleave`` and ``Inverse``
instantiations; x FP32 (a host BF16 array is widened first); ``out`` must not overlap x.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from ...ops._check import expect_dtype
from ...ops.kv_fp8 import check_scales
from ...ops.rope_kv import check_qk_norm_rope_kv_write, check_rope_heads
from ._util import cdiv, ctype, device, expect_disjoint, expect_grid_yz, f32, i32, inplace, optional, output, ptr
from .loader import get_kernel

#: kRopeWarps in rope_kv.cu: one warp per (row, head), 4 heads per block
ROPE_WARPS = 4


def qk_norm_rope_kv_write(qkv, num_q_heads: int, num_kv_heads: int, q_norm_w, k_norm_w, eps: float,
                          inv_freq, positions, k_cache, v_cache, slots, *, interleave: bool = False,
                          rope_scale: float = 1.0, v_is_k: bool = False, out=None, k_scale=None, v_scale=None):
    """-> q [n, Hq, D] FP32 (``out``: the same, preallocated). FP8 caches (uint8 E4M3 codes):
    ``k_scale`` / ``v_scale`` [NB, BS, Hkv] FP32 take each written row's scale (mtpkern.ops.kv_fp8)."""
    check_qk_norm_rope_kv_write(qkv, num_q_heads, num_kv_heads, q_norm_w, k_norm_w,
                                inv_freq, positions, k_cache, v_cache, slots, interleave, rope_scale, v_is_k)
    check_scales("k_scale", k_cache, k_scale)
    check_scales("v_scale", v_cache, v_scale)
    k_cache = inplace(k_cache, "k_cache", "uint16", "float32", "uint8")
    v_cache = inplace(v_cache, "v_cache", k_cache.dtype.name)
    fp8 = k_cache.dtype.name == "uint8"
    if fp8 and v_is_k:
        raise ValueError("v_is_k: an FP8 KV cache does not take DeepSeek-V4's shared KV (kv_dtype 'fp8' is "
                         "implemented for GQA attention); expected False, got True")
    ks = inplace(k_scale, "k_scale", "float32") if fp8 else None
    vs = inplace(v_scale, "v_scale", "float32") if fp8 else None
    expect_dtype("inv_freq", inv_freq, "float32")
    NB, BS, Hkv, D = k_cache.shape
    Dv = v_cache.shape[3]
    n, Hq, half = qkv.shape[0], num_q_heads, inv_freq.shape[0]
    expect_grid_yz("qkv rows", n)
    qkv = device(qkv, "qkv", "float32")
    q_norm_w = optional(q_norm_w, "q_norm_w", "float32")
    k_norm_w = optional(k_norm_w, "k_norm_w", "float32")
    inv_freq = device(inv_freq, "inv_freq", "float32")
    positions = device(positions, "positions", "int32")
    slots = device(slots, "slots", "int32")
    q = output(out, "out", (n, Hq, D), np.float32)
    expect_disjoint("out", q, "qkv", qkv)
    if n == 0:
        return q
    grid = (cdiv(Hq + (1 if v_is_k else 2) * Hkv, ROPE_WARPS), n)
    il, vk = _flag(interleave), _flag(v_is_k)
    kernel = get_kernel("rope_kv", f"qk_norm_rope_kv_write_kernel<{ctype(k_cache)}, {il}, {vk}>")
    kernel(grid, (ROPE_WARPS * 32,),
           (qkv, i32(qkv.shape[1]), ptr(q_norm_w), ptr(k_norm_w), f32(eps), inv_freq, i32(half),
            f32(rope_scale), positions,
            k_cache, v_cache, slots, np.int64(NB * BS), q, i32(Hq), i32(Hkv), i32(D), i32(Dv), ptr(ks), ptr(vs)))
    return q


def rope_heads(x, positions, inv_freq, *, interleave: bool = False, rope_scale: float = 1.0, inverse: bool = False,
               out=None):
    """-> [n, heads, D] FP32 (``out``: the same, preallocated, apart from x)."""
    check_rope_heads(x, positions, inv_freq, interleave, rope_scale, inverse)
    n, heads, D = x.shape
    expect_grid_yz("x rows", n)
    if isinstance(x, np.ndarray) and x.dtype == ml_dtypes.bfloat16:
        x = x.astype(np.float32)                        # exact
    x = device(x, "x", "float32")
    inv_freq = device(inv_freq, "inv_freq", "float32")
    positions = device(positions, "positions", "int32")
    y = output(out, "out", (n, heads, D), np.float32)
    expect_disjoint("out", y, "x", x)
    if n == 0 or heads == 0:
        return y
    kernel = get_kernel("rope_kv", f"rope_heads_kernel<{_flag(interleave)}, {_flag(inverse)}>")
    kernel((cdiv(heads, ROPE_WARPS), n), (ROPE_WARPS * 32,),
           (x, inv_freq, i32(inv_freq.shape[0]), f32(rope_scale), positions, y, i32(heads), i32(D)))
    return y


def _flag(on: bool) -> str:
    return "true" if on else "false"
