"""The cpu backend's GEMV tiles (``cpu_kernels/gemv_tiles.py``) against float64 NumPy, and
the property the GEMV core is built on: a dot's bits depend on its weight row and its
input row only, not on the tile that computes it, its place in the tile, the rows asked
for ahead or the input row count of the call.

Weights are BF16 bits, FP32 or FP8 E4M3 codes (decoded as ``linear.widen``: the value
times 2^-120; the cpu backend stores subnormal codes as zeros, so none is drawn here);
K covers a whole number of 16-column steps, a tail after them, and a tail alone."""

import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("numba")

from numba import njit  # noqa: E402

from mtpkern import Fp8Weight  # noqa: E402
from mtpkern.backends import get_backend  # noqa: E402
from mtpkern.backends.cpu_kernels import gemv_tiles  # noqa: E402

TILES = {8: gemv_tiles.dots8, 4: gemv_tiles.dots4, 3: gemv_tiles.dots3, 2: gemv_tiles.dots2, 1: gemv_tiles.dots1}


def _caller(f):
    @njit
    def call(w, rows, k0, x, i):
        return f(w, rows, k0, x, i)
    return call


CALLERS = {T: _caller(f) for T, f in TILES.items()}
#: K of one range, of whole ranges and a tail, and of a short last range (PASS_MAX < K)
KS = [1024, 1000, 37, 5, 2 * gemv_tiles.PASS_COLS + 48, gemv_tiles.PASS_MAX + 40]


def _weights(rng, shape, wdtype):
    """(the array the tile reads, its values as float64)."""
    if wdtype == "f32":
        w = rng.standard_normal(shape).astype(np.float32)
        return w, w.astype(np.float64)
    if wdtype == "bf16":
        w = rng.standard_normal(shape).astype(ml_dtypes.bfloat16)
        return w.view(np.uint16), w.astype(np.float64)
    codes = rng.integers(0, 256, shape).astype(np.uint8)
    exp = (codes >> 3) & 0xF
    codes[exp == 0] &= 0x80                               # subnormals: a zero of their sign
    codes[(codes & 0x7F) == 0x7F] = 0x70                  # no NaN codes
    return codes, codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64) * 2.0 ** -120


@pytest.mark.parametrize("T", sorted(TILES))
@pytest.mark.parametrize("wdtype", ["bf16", "f32", "fp8"])
@pytest.mark.parametrize("K", KS)
@pytest.mark.parametrize("k0", [0, 3])
def test_tiles_match_float64(T, wdtype, K, k0):
    rng = np.random.default_rng(T * 100 + K + k0)
    N, i = 19, 2
    w, w64 = _weights(rng, (N, k0 + K + 7), wdtype)       # wider than k0 + K: only k0 .. k0 + K - 1 are read
    x = rng.standard_normal((i + T + 1, K)).astype(np.float32)
    rows = tuple(int(r) for r in rng.choice(N, 8, replace=False))
    got = np.array(CALLERS[T](w, rows, k0, x, i), np.float64).reshape(8, T)
    prods = w64[list(rows), None, k0:k0 + K] * x[None, i:i + T].astype(np.float64)   # [8, T, K]
    want = prods.sum(-1)
    scale = np.abs(prods).sum(-1)
    assert (np.abs(got - want) <= 1e-6 * scale + 1e-30).all(), np.abs(got - want).max()


@pytest.mark.parametrize("wdtype", ["bf16", "f32", "fp8"])
@pytest.mark.parametrize("K", [1024, 1000, 37, gemv_tiles.PASS_MAX + 40])
def test_a_dot_has_the_same_bits_in_every_tile(wdtype, K):
    """Every pass gives each (weight row, input row) pair the same bits, wherever the pair
    falls in it (which tile, which place in the tile)."""
    rng = np.random.default_rng(K)
    N = 12
    w, _ = _weights(rng, (N, K), wdtype)
    x = rng.standard_normal((12, K)).astype(np.float32)
    ref = {}
    for T, call in CALLERS.items():
        for start in range(0, N - 8 + 1, 2):
            rows = tuple(range(start, start + 8))[::-1 if start % 4 else 1]
            for i in sorted({*range(0, x.shape[0] - T + 1, 3), x.shape[0] - T}):
                got = np.array(call(w, rows, 0, x, i), np.float32)
                for s in range(8):
                    for t in range(T):
                        key = (rows[s], i + t)
                        ref.setdefault(key, got[s * T + t])
                        assert got[s * T + t].tobytes() == ref[key].tobytes(), (T, key)
    assert len(ref) == N * x.shape[0]


@pytest.mark.parametrize("wdtype", ["bfloat16", "float32", "fp8_block"])
@pytest.mark.parametrize("K", [1024, 2100])
def test_linear_rows_do_not_depend_on_the_batch(wdtype, K):
    """cpu linear: input row i of a call of n rows gives the bits it gives alone, for every n
    (the GEMV core picks its tiles by the rows left, and every tile computes a dot alike)."""
    be = get_backend("cpu")
    rng = np.random.default_rng(K)
    N, n = 45, 24
    if wdtype == "fp8_block":
        codes, _ = _weights(rng, (N, K), "fp8")
        scale = rng.uniform(0.5, 2.0, (-(-N // 128), -(-K // 128))).astype(np.float32)
        w = be.prepare_weight(Fp8Weight(codes, scale, (128, 128)))
    else:
        w = be.prepare_weight(rng.standard_normal((N, K)).astype(getattr(ml_dtypes, wdtype, np.float32)))
    x = rng.standard_normal((n, K)).astype(np.float32)
    alone = np.concatenate([be.linear(x[i:i + 1], w) for i in range(n)])
    for m in (2, 3, 5, 8, 11, 16, 24):
        np.testing.assert_array_equal(be.linear(x[:m], w), alone[:m])
