"""The cpu backend's 16-lane attention tiles (``cpu_kernels/simd.py``) against float64
NumPy: every query count, head dims with and without a tail of the unrolled loop, value
widths whose 16-column chunks fill a pass or leave some over, any row range, and a
prefetch offset into another block of its array (a prefetch never changes a result)."""

import numpy as np
import pytest

pytest.importorskip("numba")

from numba import njit  # noqa: E402

from mtpkern.backends.cpu_kernels.simd import VL, pv1, pv4, pv8, qk1, qk4, qk8  # noqa: E402

QK = {8: qk8, 4: qk4, 1: qk1}
PV = {8: pv8, 4: pv4, 1: pv1}


def _qk_caller(f):
    @njit
    def call(kt, q, sc, i, j0, c, pf, pfo):
        f(kt, q, sc, i, j0, c, pf, pfo)
    return call


def _pv_caller(f):
    @njit
    def call(vb, kvh, p, acc, i, lo, hi, pc, pf, pfo):
        f(vb, kvh, p, acc, i, lo, hi, pc, pf, pfo)
    return call


@pytest.mark.parametrize("T", [8, 4, 1])
@pytest.mark.parametrize("D", [64, 70, 3])
@pytest.mark.parametrize("c", [0, 32])
def test_score_tiles_match_float64(T, D, c):
    """Scores of rows j0 .. j0 + 15 of the block land in columns c + j0 .. of sc (c: the
    block's place in a span of several blocks' scores), nowhere else."""
    rng = np.random.default_rng(T * 100 + D + c)
    BS, n, i, j0 = 32, T + 3, 2, 16
    kt = rng.standard_normal((D, BS), dtype=np.float32)
    q = rng.standard_normal((n, D), dtype=np.float32)
    sc = np.full((n, 2 * BS), 7.0, np.float32)
    pf = rng.standard_normal(3 * D * BS, dtype=np.float32)
    _qk_caller(QK[T])(kt, q, sc, i, j0, c, pf, 2 * D * BS)      # the tile's lines of the next block
    want = q[i:i + T].astype(np.float64) @ kt[:, j0:j0 + VL].astype(np.float64)
    np.testing.assert_allclose(sc[i:i + T, c + j0:c + j0 + VL], want, rtol=1e-5, atol=1e-5 * np.sqrt(D))
    untouched = np.ones_like(sc, bool)
    untouched[i:i + T, c + j0:c + j0 + VL] = False
    assert (sc[untouched] == 7.0).all()


@pytest.mark.parametrize("T", [8, 4, 1])
@pytest.mark.parametrize("Dv,width", [(64, 64), (48, 64), (16, 24), (80, 80)])
@pytest.mark.parametrize("lo,hi", [(0, 16), (3, 11), (5, 6), (4, 4)])
@pytest.mark.parametrize("pc", [0, 16, 7])
def test_value_tiles_match_float64(T, Dv, width, lo, hi, pc):
    """The weights of the block's row j are p's column pc + j (the block's place in a span)."""
    rng = np.random.default_rng(T * 1000 + Dv + lo + pc)
    BS, Hkv, kvh, n, i = 16, 3, 1, T + 2, 1
    vb = rng.standard_normal((BS, Hkv, width), dtype=np.float32)
    p = rng.random((n, 2 * BS), dtype=np.float32)
    acc = rng.standard_normal((n, Dv), dtype=np.float32)
    before = acc.copy()
    pf = np.zeros((4, BS, Hkv, width), np.float32)
    _pv_caller(PV[T])(vb, kvh, p, acc, i, lo, hi, pc, pf, BS * Hkv * width)
    want = before[i:i + T].astype(np.float64) + p[i:i + T, pc + lo:pc + hi].astype(np.float64) @ vb[lo:hi, kvh, :Dv]
    np.testing.assert_allclose(acc[i:i + T], want, rtol=1e-5, atol=1e-5 * (hi - lo + 1))
    rest = np.ones(n, bool)
    rest[i:i + T] = False
    assert (acc[rest] == before[rest]).all()


@pytest.mark.parametrize("T", [8, 4, 1])
def test_tiles_run_the_same_sums_whatever_the_prefetch(T):
    """The prefetch offset is a hint: two offsets give bitwise the same tiles."""
    rng = np.random.default_rng(T)
    D, BS = 64, 16
    kt = rng.standard_normal((D, BS), dtype=np.float32)
    q = rng.standard_normal((T, D), dtype=np.float32)
    pf = rng.standard_normal((8, D * BS), dtype=np.float32)
    a, b = np.zeros((T, BS), np.float32), np.zeros((T, BS), np.float32)
    call = _qk_caller(QK[T])
    call(kt, q, a, 0, 0, 0, pf, 0)
    call(kt, q, b, 0, 0, 0, pf, 7 * D * BS)
    assert (a == b).all()
