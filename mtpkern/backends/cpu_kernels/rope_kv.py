"""Per-head q/k RMSNorm + partial RoPE (neox halves or interleaved pairs) + paged KV
write, in one call; and the rotation alone of every head (``rope_heads``, forward or
inverse) (spec: mtpkern.ops.rope_kv).

A serial pass first fills the per-row cos/sin tables [n, R/2], both multiplied by
``rope_scale`` (YaRN's attention factor; 1 otherwise) (a second
parallel loop would cost more to start than it saves, and ~1.5 s more to
compile). Then one task per head (Hq query heads, then Hkv key heads, each carrying its
value head) and walks the rows in order: each head is normed and rotated
straight into its destination (q_out, or the k cache at the row's slot), so
the data is read once and written once. Rows in order means a slot given twice
ends with the last row's values, as the reference's fancy assignment does.
With ``v_is_k`` (DeepSeek-V4's shared KV) a key head's task copies the key as it wrote it
(normed, rotated) into the value cache: qkv holds no value columns.
A decode step's few rows run on the calling thread (``linear.SMALL``).

``rope_heads_kernel`` fills the same tables (sin negated for the inverse rotation:
``x1 c - x2 (-s) = x1 c + x2 s`` bit for bit as the reference's) and runs the same head
routine without a norm, one task per head over the rows.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .linear import SMALL
from .norm import sumsq


@njit(cache=True, fastmath=False)
def _norm_rope_head(src, r, c0, D, w, eps, cos, sin, dst, dr, dc0, interleave):
    """dst[dr, dc0:dc0+D] = rope(rmsnorm(src[r, c0:c0+D], w)) (no norm when w is empty);
    pair k is dims (2k, 2k + 1) when ``interleave``, else (k, k + R/2)."""
    x, o = src[r, c0:c0 + D], dst[dr, dc0:dc0 + D]  # 1-D views: see norm.sumsq
    if w.shape[0] > 0:
        d = np.sqrt(sumsq(src, np.int64(r), np.int64(c0), np.int64(D)) / np.float32(D) + eps)
        for k in range(D):
            o[k] = x[k] / d * w[k]
    else:
        for k in range(D):
            o[k] = x[k]
    half = cos.shape[1]
    step, second = (2, 1) if interleave else (1, half)   # pair k: dims (step k, step k + second)
    for k in range(half):
        a = step * k
        x1 = o[a]
        x2 = o[a + second]
        c = cos[r, k]
        s = sin[r, k]
        o[a] = x1 * c - x2 * s
        o[a + second] = x2 * c + x1 * s


@njit(cache=True, fastmath=False)
def _cos_sin(positions, inv_freq, rope_scale, sin_sign):
    """-> cos, sin [n, R/2] FP32: ``rope_scale cos f``, ``sin_sign rope_scale sin f``,
    ``f = float32(pos) * inv_freq[k]``. Serial: n * R/2 pairs, ~15 ns each."""
    n, half = positions.shape[0], inv_freq.shape[0]
    cos = np.empty((n, half), np.float32)
    sin = np.empty((n, half), np.float32)
    for r in range(n):
        p = np.float32(positions[r])
        for k in range(half):
            f = p * inv_freq[k]
            cos[r, k] = np.cos(f) * rope_scale
            sin[r, k] = np.sin(f) * rope_scale * sin_sign
    return cos, sin


@njit(cache=True, fastmath=False)
def _head_rows(qkv, h, Hq, Hkv, D, Dv, q_norm_w, k_norm_w, eps, cos, sin, q_out, k_rows, v_rows, slots,
               interleave, v_is_k):
    """Head h (a query head, or KV head h - Hq with its value head) of every row, rows in order;
    ``v_is_k``: the value head is the key head as written (Dv = D)."""
    for r in range(qkv.shape[0]):
        if h < Hq:
            _norm_rope_head(qkv, r, h * D, D, q_norm_w, eps, cos, sin, q_out, r, h * D, interleave)
        else:
            kv = h - Hq
            slot = slots[r]
            _norm_rope_head(qkv, r, h * D, D, k_norm_w, eps, cos, sin, k_rows, slot, kv * D, interleave)
            if v_is_k:
                for k in range(D):
                    v_rows[slot, kv * D + k] = k_rows[slot, kv * D + k]
            else:
                v0 = (Hq + Hkv) * D + kv * Dv
                for k in range(Dv):
                    v_rows[slot, kv * Dv + k] = qkv[r, v0 + k]


@njit(cache=True, fastmath=False, parallel=True)
def qk_norm_rope_kv_write_kernel(qkv, Hq, Hkv, D, Dv, q_norm_w, k_norm_w, eps, inv_freq, positions,
                                 k_rows, v_rows, slots, q_out, interleave, rope_scale, v_is_k):
    """qkv [n, W >= (Hq + Hkv) D + Hkv Dv] (``v_is_k``: (Hq + Hkv) D; columns past that unread);
    k_rows [NB * BS, Hkv * D], v_rows [NB * BS, Hkv * Dv] (the caches, one row per slot);
    q_out [n, Hq * D]; eps and rope_scale float32; interleave bool (pairs (2k, 2k + 1), else
    (k, k + R/2)); v_is_k bool (the value written is the key as written; Dv = D)."""
    cos, sin = _cos_sin(positions, inv_freq, rope_scale, np.float32(1.0))
    if qkv.shape[0] * qkv.shape[1] <= SMALL:
        for h in range(Hq + Hkv):
            _head_rows(qkv, h, Hq, Hkv, D, Dv, q_norm_w, k_norm_w, eps, cos, sin, q_out, k_rows, v_rows, slots,
                       interleave, v_is_k)
    else:
        for h in prange(Hq + Hkv):
            _head_rows(qkv, h, Hq, Hkv, D, Dv, q_norm_w, k_norm_w, eps, cos, sin, q_out, k_rows, v_rows, slots,
                       interleave, v_is_k)


@njit(cache=True, fastmath=False, parallel=True)
def rope_heads_kernel(x, heads, D, inv_freq, positions, out, interleave, rope_scale, inverse):
    """x, out [n, heads * D] FP32 (apart); the first R = 2 len(inv_freq) dims of every head
    rotated by ``positions[r] * inv_freq`` (``inverse``: by the opposite angle), the rest copied;
    rope_scale float32, interleave / inverse bool. One task per head, rows in order."""
    cos, sin = _cos_sin(positions, inv_freq, rope_scale, np.float32(-1.0 if inverse else 1.0))
    no_norm = np.empty(0, np.float32)
    eps = np.float32(0.0)
    if x.shape[0] * x.shape[1] <= SMALL:
        for h in range(heads):
            for r in range(x.shape[0]):
                _norm_rope_head(x, r, h * D, D, no_norm, eps, cos, sin, out, r, h * D, interleave)
    else:
        for h in prange(heads):
            for r in range(x.shape[0]):
                _norm_rope_head(x, r, h * D, D, no_norm, eps, cos, sin, out, r, h * D, interleave)


# -- the FP8 KV cache's write (spec: mtpkern.ops.kv_fp8) ------------------------------------

@njit(cache=True, fastmath=False)
def e4m3_code(x):
    """float64 x -> its E4M3 code (``float8_e4m3fn``), rounded to nearest, ties to even, in one
    rounding; |x| over 448 is clamped to 448 first (the write never passes more than
    448 (1 + 2^-24)), NaN gives 0x7F. As ml_dtypes' ``float64 -> float8_e4m3fn``."""
    if x != x:
        return np.uint8(0x7F)
    sign = 0x80 if math.copysign(1.0, x) < 0 else 0
    a = min(abs(x), 448.0)
    if a < 2.0 ** -6:                                   # subnormal codes: steps of 2^-9
        return np.uint8(sign | int(np.rint(math.ldexp(a, 9))))     # 8: 2^-6, the least normal code
    e = math.frexp(a)[1] - 1                            # a = 1.f 2^e
    r = int(np.rint(math.ldexp(a, 3 - e)))              # 8 .. 16: the mantissa with its leading 1
    if r == 16:                                         # rounded up into the next binade
        r = 8
        e += 1
    return np.uint8(sign | ((e + 7) << 3) | (r - 8))


@njit(cache=True, fastmath=False)
def fp8_quantize_row(src, codes):
    """src [D] FP32 -> codes [D] uint8 (written), returns the row's FP32 scale amax / 448."""
    amax = np.float32(0.0)
    for d in range(src.shape[0]):
        a = abs(src[d])
        if a > amax or a != a:                          # NaN wins, as np.max
            amax = a
            if a != a:
                break
    scale = amax / np.float32(448.0)
    s = np.float64(scale)
    for d in range(src.shape[0]):
        codes[d] = np.uint8(0) if s == 0.0 else e4m3_code(np.float64(src[d]) / s)
    return scale


@njit(cache=True, fastmath=False)
def fp8_kv_write_kernel(rows, Hkv, D, codes, scales, slots):
    """rows [n, Hkv * D] FP32 (a KV write's rows, apart) -> codes [NB * BS, Hkv * D] uint8 and
    scales [NB * BS, Hkv] FP32 at ``slots``: each (row, KV head) quantized with its own scale
    (``fp8_quantize_row``). Rows in order: a slot given twice keeps the last row's."""
    for r in range(rows.shape[0]):
        slot = slots[r]
        for h in range(Hkv):
            scales[slot, h] = fp8_quantize_row(rows[r, h * D:(h + 1) * D], codes[slot, h * D:(h + 1) * D])
