"""Per-head q/k RMSNorm, partial neox RoPE, and the paged KV write, in one op.

``qk_norm_rope_kv_write(qkv [n, W >= (Hq + Hkv) D + Hkv Dv], num_q_heads, num_kv_heads,
q_norm_w [D] | None, k_norm_w [D] | None, eps, inv_freq [R/2], positions [n],
k_cache [NB, BS, Hkv, D], v_cache [NB, BS, Hkv, Dv], slots [n]) -> q [n, Hq, D]``

- ``qkv`` row layout: ``Hq`` query heads and ``Hkv`` key heads, each ``D`` wide,
  then ``Hkv`` value heads, each ``Dv`` wide (``v_cache``'s last axis; MiMo-V2 has
  D = 192, Dv = 128; usually Dv = D), the q/k/v projections stacked at load time.
  Columns past ``(Hq + Hkv) D + Hkv Dv`` are ignored: a projection stacked after
  q | k | v in the same GEMM (an attention output gate, Step-3.5's ``g_proj``)
  rides along, and its columns are read from the same buffer by the next op.
- q and k are RMS-normalised per head (when the weights are given), then the
  first ``R = 2 * len(inv_freq)`` dims of every head are rotated neox style:
  with ``x1 = x[:R/2]``, ``x2 = x[R/2:R]``, ``f = pos * inv_freq``:
  ``x1' = x1 cos f - x2 sin f``, ``x2' = x2 cos f + x1 sin f``; dims ``R..D`` pass.
- k (rotated) and v are written at ``slot = block * BS + offset`` of the caches,
  converted to the cache dtype; q (rotated) is returned in FP32.
"""

from __future__ import annotations

import numpy as np

from ._check import expect_dtype, expect_ndim, expect_shape
from .norm import rmsnorm


def inv_freq(rotary_dim: int, theta: float) -> np.ndarray:
    """``[R/2]`` FP32: ``theta ** (-2i / R)``, as Hugging Face's default RoPE."""
    exps = np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim
    return (1.0 / (theta ** exps)).astype(np.float32)


def rope_neox(x: np.ndarray, positions: np.ndarray, inv_freq_: np.ndarray) -> np.ndarray:
    """x: [n, heads, D] FP32; rotates the first R dims of every head."""
    half = inv_freq_.shape[0]
    f = positions.astype(np.float32)[:, None] * inv_freq_[None, :]    # [n, R/2]
    cos, sin = np.cos(f)[:, None, :], np.sin(f)[:, None, :]           # [n, 1, R/2]
    x1, x2 = x[..., :half], x[..., half:2 * half]
    out = x.copy()
    out[..., :half] = x1 * cos - x2 * sin
    out[..., half:2 * half] = x2 * cos + x1 * sin
    return out


def check_qk_norm_rope_kv_write(qkv, num_q_heads, num_kv_heads, q_norm_w, k_norm_w,
                                inv_freq_, positions, k_cache, v_cache, slots) -> None:
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
    need = (num_q_heads + num_kv_heads) * D + num_kv_heads * Dv
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


def qk_norm_rope_kv_write(qkv, num_q_heads: int, num_kv_heads: int, q_norm_w, k_norm_w,
                          eps: float, inv_freq_, positions, k_cache, v_cache, slots) -> np.ndarray:
    check_qk_norm_rope_kv_write(qkv, num_q_heads, num_kv_heads, q_norm_w, k_norm_w,
                                inv_freq_, positions, k_cache, v_cache, slots)
    NB, BS, Hkv, D = k_cache.shape
    Dv = v_cache.shape[3]
    n, Hq = qkv.shape[0], num_q_heads
    qkv = np.asarray(qkv, np.float32)
    q = qkv[:, : Hq * D].reshape(n, Hq, D)                              # [n, Hq, D]
    k = qkv[:, Hq * D: (Hq + Hkv) * D].reshape(n, Hkv, D)               # [n, Hkv, D]
    v = qkv[:, (Hq + Hkv) * D: (Hq + Hkv) * D + Hkv * Dv].reshape(n, Hkv, Dv)   # [n, Hkv, Dv]
    if q_norm_w is not None:
        q = rmsnorm(q, q_norm_w, eps)
    if k_norm_w is not None:
        k = rmsnorm(k, k_norm_w, eps)
    q = rope_neox(q, positions, inv_freq_)
    k = rope_neox(k, positions, inv_freq_)
    blk, off = np.divmod(slots.astype(np.int64), BS)
    k_cache[blk, off] = k.astype(k_cache.dtype)
    v_cache[blk, off] = v.astype(v_cache.dtype)
    return q
