"""Per-row time of the cpu backend's sampled draw (``cpu_kernels/sampling.sample_kernel``) over
given logits, one Numba thread.

    python benchmarks/cpu_sampling.py [--vocab 32768,151936] [--runs 200] [--scale 3.0]

Logits: one row of ``scale * N(0, 1)`` FP32 (seeded), no mask; each case (temperature 0.8
alone, with ``top_k = 50``, with ``top_p = 0.95``) runs ``--runs`` times after one warm-up
call (the compile), and the median per row is printed with the size of the kept set (the
top_p nucleus). The logits' GEMV is not included: this is the draw alone.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from numba import set_num_threads

from mtpkern.backends.cpu_kernels.sampling import sample_kernel
from mtpkern.ops.sampling import SamplingParams, check_params, row_keys

CASES = {"T 0.8": (0.8, 0, 1.0), "T 0.8, top_k 50": (0.8, 50, 1.0), "T 0.8, top_p 0.95": (0.8, 0, 0.95)}


def time_case(logits: np.ndarray, params: SamplingParams, runs: int) -> tuple[float, int]:
    """-> (median ms per row, entries of q above 0)."""
    n, V = logits.shape
    T, K, P = check_params("sampling", [params] * n, n)
    keys = row_keys([params] * n, list(range(n)), 0)
    bitmask = np.zeros((0, 0), np.int32)
    noise_ids = np.arange(V, dtype=np.int32)
    ids, probs = np.empty(n, np.int32), np.empty(n, np.float32)
    dist = np.empty((n, V), np.float32)
    sample_kernel(logits, bitmask, noise_ids, keys, T, K, P, ids, probs, dist)     # compile / warm
    kept = int(np.count_nonzero(dist[0]))
    none = np.empty((0, 0), np.float32)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        sample_kernel(logits, bitmask, noise_ids, keys, T, K, P, ids, probs, none)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3 / n, kept


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", default="32768,151936")
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--scale", type=float, default=3.0)
    a = ap.parse_args(argv)
    set_num_threads(1)
    print(f"{'V':>7}  {'case':<20} {'ms/row':>8} {'kept':>7}")
    for V in (int(v) for v in a.vocab.split(",")):
        logits = (np.random.default_rng(0).standard_normal((1, V)) * a.scale).astype(np.float32)
        for name, (T, k, p) in CASES.items():
            ms, kept = time_case(logits, SamplingParams(T, k, p, seed=1), a.runs)
            print(f"{V:>7}  {name:<20} {ms:>8.3f} {kept:>7}")


if __name__ == "__main__":
    main()
