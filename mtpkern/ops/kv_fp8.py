"""The FP8 KV cache's format: E4M3 codes with one FP32 scale per (row, KV head) (docs/kv_pool.md,
"FP8 KV cache").

A cache of ``kv_dtype="fp8"`` is a uint8 array ``[NB, BS, Hkv, D]`` of E4M3 codes
(``float8_e4m3fn``: bias 7, 3 mantissa bits, largest finite 448, no infinity) and beside it a
scale plane ``[NB, BS, Hkv]`` FP32. The row of KV head ``h`` written at slot ``s`` is stored as

- ``amax = max_d |x[d]|`` (FP32), ``scale = float32(amax / 448)`` (one FP32 division);
- ``code[d] = e4m3(clip(float64(x[d]) / float64(scale), -448, 448))``, rounded to nearest, ties
  to even, in one rounding from float64 (the quotient of two FP32 values is never within
  float64's precision of an E4M3 tie unless it is one, so this is the exactly rounded quotient);
  ``scale == 0`` (an all-zero row, or an ``amax`` too small for an FP32 scale) stores codes 0;
  a row holding NaN or infinity has a non-finite scale and reads back as NaN;
- read back as ``float32(e4m3_value(code)) * scale``, one FP32 rounding (``quant.e4m3_table``,
  the FP8 weights' decode).

The scale is dynamic, computed when the row is written: no calibration. Engines (vLLM,
FlashInfer) mostly use one static scale per tensor from calibration; a per-row scale costs 4
bytes per (row, head) (``4 / D`` bytes per element: 1/32 at D = 128) and keeps every row's
largest element at E4M3's top, so a row's relative error is E4M3's own: at most ``2^-4`` of the
element for ``|x| >= 2^-6 scale`` (normal codes), and at most ``2^-10 scale = 2^-10 amax / 448``
absolute below that (subnormal codes).

``quantize_rows(x [..., D]) -> (codes [..., D] uint8, scale [...] FP32)`` (the reference);
``dequantize(codes, scale) -> [..., D] FP32``.
"""

from __future__ import annotations

import numpy as np

from ..quant import E4M3_MAX, e4m3_table
from ._check import expect_dtype, expect_shape

#: an element's relative error through the FP8 KV cache, for normal codes: E4M3 keeps 3
#: mantissa bits, rounding to nearest is off by at most half a unit in the last place
REL_ERROR = 2.0 ** -4
#: the absolute error, as a fraction of the row's amax, for elements in the subnormal range
#: (|x| < 2^-6 scale): half of the least subnormal 2^-9, times scale = amax / 448
SUBNORMAL_ABS = 2.0 ** -10 / E4M3_MAX


def quantize_rows(x) -> tuple[np.ndarray, np.ndarray]:
    """x [..., D] FP32 -> (codes [..., D] uint8, scale [...] FP32): one scale per row of D
    (module docstring)."""
    import ml_dtypes

    x = np.asarray(x, np.float32)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        amax = np.max(np.abs(x), axis=-1) if x.shape[-1] else np.zeros(x.shape[:-1], np.float32)
        scale = (amax / np.float32(E4M3_MAX)).astype(np.float32)
        s = scale.astype(np.float64)[..., None]
        q = np.where(s == 0, 0.0, x.astype(np.float64) / np.where(s == 0, 1.0, s))
        q = np.clip(q, -E4M3_MAX, E4M3_MAX)                  # NaN stays NaN (its E4M3 code)
    codes = q.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    return np.ascontiguousarray(codes), np.ascontiguousarray(scale)


def dequantize(codes, scale) -> np.ndarray:
    """codes [..., D] uint8, scale [...] FP32 -> FP32 values ``e4m3(code) * scale``."""
    return e4m3_table()[np.asarray(codes)] * np.asarray(scale, np.float32)[..., None]


def is_fp8(cache) -> bool:
    """Whether a KV cache holds E4M3 codes (uint8) rather than values."""
    return getattr(cache, "dtype", None) == np.uint8


def check_scales(name: str, cache, scale) -> None:
    """A cache and its scale plane agree: an FP8 (uint8) cache needs an FP32 ``[NB, BS, Hkv]``
    plane, a cache of values none."""
    if is_fp8(cache):
        if scale is None:
            raise ValueError(f"{name}: an FP8 (uint8) cache needs its scale plane, got None")
        expect_shape(name, scale, tuple(cache.shape[:3]))
        expect_dtype(name, scale, "float32")
    elif scale is not None:
        raise ValueError(f"{name}: a scale plane belongs to an FP8 (uint8) cache, got one beside a "
                         f"{np.dtype(cache.dtype).name} cache")
