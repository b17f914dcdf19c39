"""Timings of repeated runs and the checks that say whether a figure can be trusted.

Used by the benchmark harness (``bench.py``) and its PyTorch peer
(``bench_torch.py``); a figure is judged by two rules:

- **spread**: p80 / p20 of the runs above ``MAX_SPREAD`` means the machine was
  busy or the clock unsteady; the median of such runs moves from one run to the
  next, so the figure is marked, not trusted.
- **floor**: a time below the physical floor (the bytes a call must read over the
  fastest read rate the machine showed) cannot be real: the floor's bandwidth was
  under-measured, or the timed call skipped work. It is marked as a measurement error.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

#: p80 / p20 above this: too noisy to trust (back-to-back runs on a quiet 2-core VM: 1.02-1.2)
MAX_SPREAD = 1.5


@dataclass(slots=True)
class Timing:
    median_us: float
    p20_us: float
    p80_us: float
    p99_us: float
    runs: int

    @classmethod
    def of(cls, seconds: Sequence[float]) -> "Timing":
        """The timing of runs that took ``seconds`` each."""
        if len(seconds) == 0:
            raise ValueError("seconds: expected at least one run, got none")
        a = np.asarray(seconds, np.float64) * 1e6
        p20, p50, p80, p99 = np.percentile(a, [20, 50, 80, 99])
        return cls(float(p50), float(p20), float(p80), float(p99), len(a))

    @property
    def spread(self) -> float:
        """p80 / p20 (1.0: every run alike; inf when p20 is 0)."""
        return self.p80_us / self.p20_us if self.p20_us > 0 else float("inf")


def measure(fn: Callable[[], Any], warmup: int, runs: int, sync: Callable[[], None] = lambda: None) -> Timing:
    """``warmup`` untimed calls of ``fn``, then ``runs`` timed ones (``sync`` after each)."""
    for _ in range(warmup):
        fn()
    sync()
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return Timing.of(ts)


def spread_warning(t: Timing, limit: float = MAX_SPREAD) -> str | None:
    """Why ``t`` is too noisy to trust, or None."""
    if t.spread > limit:
        return f"runs spread too widely (p80/p20 = {t.spread:.2f} > {limit}): not to be trusted"
    return None


def floor_error(median_us: float, floor_us: float) -> str | None:
    """Why a time below its physical floor is a measurement error, or None."""
    if floor_us > 0 and median_us < floor_us:
        return (f"{median_us:.1f} us is below the {floor_us:.1f} us floor: a measurement error "
                f"(the read bandwidth was under-measured, or the call skipped work)")
    return None


def warnings_of(t: Timing, floor_us: float | None = None) -> list[str]:
    """Every reason not to trust ``t`` (empty: none)."""
    found = [spread_warning(t)] + ([floor_error(t.median_us, floor_us)] if floor_us is not None else [])
    return [w for w in found if w]
