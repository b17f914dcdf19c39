"""One tolerance table for compute ops, keyed by the storage dtype of the
data the result went through (weights / KV cache).

A result ``y`` matches the reference ``r`` when
``|y - r| <= atol + rtol * |r|`` element-wise: the allowed error grows with
the reference value. Move-only ops (gathers, KV writes of FP32 data, argmax)
are compared exactly instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class Tol:
    atol: float
    rtol: float


TOLERANCE: dict[str, Tol] = {
    # FP32 storage, FP32 accumulation in a different order than NumPy's.
    "float32": Tol(atol=2e-5, rtol=2e-4),
    # BF16 storage (8 mantissa bits: 2^-8 = 3.9e-3 relative rounding per value).
    "bfloat16": Tol(atol=2e-2, rtol=2e-2),
    # An FP8 E4M3 KV cache (mtpkern.ops.kv_fp8), for the logits of a proposer on it against an
    # FP32-KV one: each K / V element within 2^-4 of itself; what that does to a logit is
    # measured, not derived (tests/test_fp8_kv.py: every logit within half of this of the FP32
    # cache's on the synthetic checkpoints), so a draft may differ only where the reference's
    # two best logits are within it (a flip moves both). docs/kv_pool.md, "FP8 KV cache".
    "fp8_kv": Tol(atol=0.25, rtol=0.25),
}


def assert_close(actual, ref, dtype: str = "float32", what: str = "value") -> None:
    tol = TOLERANCE[dtype]
    a = np.asarray(actual, np.float64)
    r = np.asarray(ref, np.float64)
    if a.shape != r.shape:
        raise AssertionError(f"{what}: shape {a.shape} != reference {r.shape}")
    bad = ~(np.abs(a - r) <= tol.atol + tol.rtol * np.abs(r))
    bad &= ~(np.isnan(a) & np.isnan(r))
    bad &= ~(np.isinf(a) & (a == r))                                      # the same infinity
    if bad.any():
        i = np.unravel_index(int(np.argmax(bad)), a.shape)
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {a.size} elements outside {dtype} tolerance "
            f"(atol={tol.atol}, rtol={tol.rtol}); first at {tuple(int(x) for x in i)}: "
            f"got {a[i]!r}, reference {r[i]!r}"
        )
