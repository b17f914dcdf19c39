"""Per-head q/k RMSNorm, partial RoPE (neox halves or interleaved pairs), and the paged
KV write, in one op.

``qk_norm_rope_kv_write(qkv [n, W >= (Hq + Hkv) D + Hkv Dv], num_q_heads, num_kv_heads,
q_norm_w [D] | None, k_norm_w [D] | None, eps, inv_freq [R/2], positions [n],
k_cache [NB, BS, Hkv, D], v_cache [NB, BS, Hkv, Dv], slots [n], *, interleave=False,
rope_scale=1.0) -> q [n, Hq, D]``

- ``qkv`` row layout: ``Hq`` query heads and ``Hkv`` key heads, each ``D`` wide,
  then ``Hkv`` value heads, each ``Dv`` wide (``v_cache``'s last axis; MiMo-V2 has
  D = 192, Dv = 128; usually Dv = D), the q/k/v projections stacked at load time.
  Columns past ``(Hq + Hkv) D + Hkv Dv`` are ignored: a projection stacked after
  q | k | v in the same GEMM (an attention output gate, Step-3.5's ``g_proj``)
  rides along, and its columns are read from the same buffer by the next op.
- q and k are RMS-normalised per head (when the weights are given), then the
  first ``R = 2 * len(inv_freq)`` dims of every head are rotated: pair ``i`` (angle
  ``f_i = pos * inv_freq[i]``) is dims ``(i, i + R/2)`` (neox halves, the default) or
  ``(2i, 2i + 1)`` with ``interleave`` (GPT-J order: DeepSeek-V3's and GLM-4.7-Flash's
  ``rope_interleave``); with ``(x1, x2)`` the pair, ``c = rope_scale cos f``,
  ``s = rope_scale sin f``: ``x1' = x1 c - x2 s``, ``x2' = x2 c + x1 s``; dims
  ``R..D`` pass unscaled. ``rope_scale`` is YaRN's attention factor (Hugging Face's
  ``attention_scaling``, multiplied into cos and sin: 1 for the default RoPE).
- k (rotated) and v are written at ``slot = block * BS + offset`` of the caches,
  converted to the cache dtype; q (rotated) is returned in FP32.
- FP8 caches (uint8 ``k_cache`` / ``v_cache``, ``kv_dtype="fp8"``): each written row of each
  KV head is quantized (``mtpkern.ops.kv_fp8.quantize_rows``) into codes and one FP32 scale,
  stored at the slot in ``k_scale`` / ``v_scale`` ``[NB, BS, Hkv]``.
- ``v_is_k`` (DeepSeek-V4's shared-KV attention: one projection is both key and value):
  ``qkv`` holds q and k only (``(Hq + Hkv) D`` columns read), and the value written is the
  key as written (normed and rotated); ``Dv`` must be ``D``.

``rope_heads(x [n, heads, D], positions [n], inv_freq [R/2], *, interleave=False,
rope_scale=1.0, inverse=False) -> [n, heads, D]`` FP32: the first R dims of every head
rotated as above; ``inverse`` rotates by the opposite angle (``x1' = x1 c + x2 s``,
``x2' = x2 c - x1 s``): DeepSeek-V4 turns its attention output's rotary dims back to the
query's frame this way.
"""

from __future__ import annotations

import numpy as np

from ._check import expect_dtype, expect_ndim, expect_shape
from .kv_fp8 import check_scales, quantize_rows
from .norm import rmsnorm


def inv_freq(rotary_dim: int, theta: float) -> np.ndarray:
    """``[R/2]`` FP32: ``theta ** (-2i / R)``, as Hugging Face's default RoPE."""
    exps = np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim
    return (1.0 / (theta ** exps)).astype(np.float32)


def yarn_inv_freq(rotary_dim: int, theta: float, factor: float, original_max_position_embeddings: int,
                  beta_fast: float = 32.0, beta_slow: float = 1.0, truncate: bool = True) -> np.ndarray:
    """``[R/2]`` FP32: YaRN's blend of the default frequencies (``theta ** (-2i / R)``,
    kept where a dim turns more than ``beta_fast`` times over the original context) and
    the interpolated ones (divided by ``factor``, where it turns fewer than ``beta_slow``
    times), linearly in between; as Hugging Face's ``_compute_yarn_parameters``."""
    R, half = rotary_dim, rotary_dim // 2
    extra = theta ** -(np.arange(0, R, 2, dtype=np.float64) / R)         # [R/2]

    def dim_of(turns: float) -> float:      # the dim whose wave turns `turns` times in the original context
        return R * np.log(original_max_position_embeddings / (turns * 2 * np.pi)) / (2 * np.log(theta))

    lo, hi = dim_of(beta_fast), dim_of(beta_slow)
    if truncate:
        lo, hi = np.floor(lo), np.ceil(hi)
    lo, hi = max(lo, 0.0), min(hi, R - 1.0)
    if lo == hi:
        hi += 0.001
    ramp = np.clip((np.arange(half, dtype=np.float64) - lo) / (hi - lo), 0.0, 1.0)   # 0: keep, 1: interpolate
    return (extra / factor * ramp + extra * (1.0 - ramp)).astype(np.float32)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 mscale ln(factor) + 1`` (1 when factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * float(np.log(factor)) + 1.0


def rope_pairs(D: int, half: int, interleave: bool) -> tuple[np.ndarray, np.ndarray]:
    """The dims (x1, x2) of each rotated pair: ``(i, i + half)`` or ``(2i, 2i + 1)``."""
    i = np.arange(half)
    return (2 * i, 2 * i + 1) if interleave else (i, i + half)


def rope(x: np.ndarray, positions: np.ndarray, inv_freq_: np.ndarray, interleave: bool = False,
         rope_scale: float = 1.0) -> np.ndarray:
    """x: [n, heads, D] FP32; rotates the first R dims of every head (module docstring)."""
    half = inv_freq_.shape[0]
    f = positions.astype(np.float32)[:, None] * inv_freq_[None, :]    # [n, R/2]
    sc = np.float32(rope_scale)
    cos, sin = (np.cos(f) * sc)[:, None, :], (np.sin(f) * sc)[:, None, :]   # [n, 1, R/2]
    a, b = rope_pairs(x.shape[-1], half, interleave)
    x1, x2 = x[..., a], x[..., b]
    out = x.copy()
    out[..., a] = x1 * cos - x2 * sin
    out[..., b] = x2 * cos + x1 * sin
    return out


def rope_neox(x: np.ndarray, positions: np.ndarray, inv_freq_: np.ndarray) -> np.ndarray:
    """x: [n, heads, D] FP32; rotates the first R dims of every head, neox halves."""
    return rope(x, positions, inv_freq_)


def check_qk_norm_rope_kv_write(qkv, num_q_heads, num_kv_heads, q_norm_w, k_norm_w,
                                inv_freq_, positions, k_cache, v_cache, slots, interleave=False,
                                rope_scale=1.0, v_is_k=False) -> None:
    expect_ndim("k_cache", k_cache, 4)
    NB, BS, Hkv, D = k_cache.shape
    if Hkv != num_kv_heads:
        raise ValueError(f"k_cache: expected {num_kv_heads} kv heads, got shape {list(k_cache.shape)}")
    expect_ndim("v_cache", v_cache, 4)
    expect_shape("v_cache", v_cache, (NB, BS, Hkv, None))
    Dv = v_cache.shape[3]
    if Dv < 1:
        raise ValueError(f"v_cache: expected a value head dim >= 1, got shape {list(v_cache.shape)}")
    expect_ndim("qkv", qkv, 2)
    n = qkv.shape[0]
    if not isinstance(v_is_k, (bool, np.bool_)):
        raise TypeError(f"v_is_k: expected a bool, got {type(v_is_k).__name__} {v_is_k!r}")
    if v_is_k and Dv != D:
        raise ValueError(f"v_cache: expected the key's head dim {D} with v_is_k (the value is the key), got "
                         f"shape {list(v_cache.shape)}")
    need = (num_q_heads + num_kv_heads) * D + (0 if v_is_k else num_kv_heads * Dv)
    if qkv.shape[1] < need:
        raise ValueError(f"qkv: expected [n, at least (Hq + Hkv) * D + Hkv * Dv = {need}] "
                         f"(Hq={num_q_heads}, Hkv={num_kv_heads}, D={D}, Dv={Dv}), got {list(qkv.shape)}")
    for name, w in (("q_norm_w", q_norm_w), ("k_norm_w", k_norm_w)):
        if w is not None:
            expect_shape(name, w, (D,))
    expect_ndim("inv_freq", inv_freq_, 1)
    if not 1 <= inv_freq_.shape[0] <= D // 2:
        raise ValueError(f"inv_freq: expected 1..{D // 2} entries, got {inv_freq_.shape[0]}")
    expect_shape("positions", positions, (n,))
    expect_shape("slots", slots, (n,))
    expect_dtype("positions", positions, "int32")
    expect_dtype("slots", slots, "int32")
    check_rope_options(interleave, rope_scale)


def check_rope_options(interleave, rope_scale) -> None:
    """``interleave`` a bool, ``rope_scale`` a finite number in (0, 1e3] (every rope op's)."""
    if not isinstance(interleave, (bool, np.bool_)):
        raise TypeError(f"interleave: expected a bool, got {type(interleave).__name__} {interleave!r}")
    if (isinstance(rope_scale, bool) or not isinstance(rope_scale, (int, float, np.floating))
            or not (np.isfinite(rope_scale) and 0 < rope_scale <= 1e3)):
        raise ValueError(f"rope_scale: expected a finite number in (0, 1e3], got {rope_scale!r}")


def qk_norm_rope_kv_write(qkv, num_q_heads: int, num_kv_heads: int, q_norm_w, k_norm_w,
                          eps: float, inv_freq_, positions, k_cache, v_cache, slots, *,
                          interleave: bool = False, rope_scale: float = 1.0, v_is_k: bool = False,
                          k_scale=None, v_scale=None) -> np.ndarray:
    check_qk_norm_rope_kv_write(qkv, num_q_heads, num_kv_heads, q_norm_w, k_norm_w,
                                inv_freq_, positions, k_cache, v_cache, slots, interleave, rope_scale, v_is_k)
    check_scales("k_scale", k_cache, k_scale)
    check_scales("v_scale", v_cache, v_scale)
    NB, BS, Hkv, D = k_cache.shape
    Dv = v_cache.shape[3]
    n, Hq = qkv.shape[0], num_q_heads
    qkv = np.asarray(qkv, np.float32)
    q = qkv[:, : Hq * D].reshape(n, Hq, D)                              # [n, Hq, D]
    k = qkv[:, Hq * D: (Hq + Hkv) * D].reshape(n, Hkv, D)               # [n, Hkv, D]
    if not v_is_k:
        v = qkv[:, (Hq + Hkv) * D: (Hq + Hkv) * D + Hkv * Dv].reshape(n, Hkv, Dv)   # [n, Hkv, Dv]
    if q_norm_w is not None:
        q = rmsnorm(q, q_norm_w, eps)
    if k_norm_w is not None:
        k = rmsnorm(k, k_norm_w, eps)
    q = rope(q, positions, inv_freq_, interleave, rope_scale)
    k = rope(k, positions, inv_freq_, interleave, rope_scale)
    blk, off = np.divmod(slots.astype(np.int64), BS)
    for cache, scale, rows in ((k_cache, k_scale, k), (v_cache, v_scale, k if v_is_k else v)):
        if scale is None:
            cache[blk, off] = rows.astype(cache.dtype)
        else:                                   # FP8: codes and their per-(row, head) scales
            cache[blk, off], scale[blk, off] = quantize_rows(rows)
    return q


def check_rope_heads(x, positions, inv_freq_, interleave=False, rope_scale=1.0, inverse=False) -> None:
    expect_ndim("x", x, 3)
    n, heads, D = x.shape
    expect_dtype("x", x, "float32", "bfloat16")
    expect_ndim("inv_freq", inv_freq_, 1)
    if not 1 <= inv_freq_.shape[0] <= D // 2:
        raise ValueError(f"inv_freq: expected 1..{D // 2} entries, got {inv_freq_.shape[0]}")
    expect_dtype("inv_freq", inv_freq_, "float32")
    expect_shape("positions", positions, (n,))
    expect_dtype("positions", positions, "int32")
    check_rope_options(interleave, rope_scale)
    if not isinstance(inverse, (bool, np.bool_)):
        raise TypeError(f"inverse: expected a bool, got {type(inverse).__name__} {inverse!r}")


def rope_heads(x, positions, inv_freq_, *, interleave: bool = False, rope_scale: float = 1.0,
               inverse: bool = False) -> np.ndarray:
    check_rope_heads(x, positions, inv_freq_, interleave, rope_scale, inverse)
    x = np.array(x, np.float32)
    if not inverse:
        return rope(x, positions, inv_freq_, interleave, rope_scale)
    half = inv_freq_.shape[0]
    f = positions.astype(np.float32)[:, None] * inv_freq_[None, :]
    sc = np.float32(rope_scale)
    cos, sin = (np.cos(f) * sc)[:, None, :], (np.sin(f) * sc)[:, None, :]
    a, b = rope_pairs(x.shape[-1], half, interleave)
    x1, x2 = x[..., a], x[..., b]
    out = x.copy()
    out[..., a] = x1 * cos + x2 * sin
    out[..., b] = x2 * cos - x1 * sin
    return out
