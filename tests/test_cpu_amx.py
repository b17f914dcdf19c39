"""The cpu backend's AMX screen for the LM head (``cpu_kernels/amx.py``,
``lm_head.lm_head_argmax_screened_kernel``): the inputs' rounding to BF16 and the bounds it
returns, and the screened argmax against the FMA kernel's, id for id, where near-ties, a
reversed order, NaN and infinite logits, and chunk and group edges make the screen keep more
than one candidate. The tests that run the tiles skip on a CPU or kernel without AMX."""

import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("numba")

from mtpkern.backends import cpu as cpu_mod  # noqa: E402
from mtpkern.backends import get_backend  # noqa: E402
from mtpkern.backends.cpu_kernels import amx  # noqa: E402
from mtpkern.errors import NoAllowedToken  # noqa: E402

needs_amx = pytest.mark.skipif(not amx.available(), reason="no AMX on this CPU (or the kernel refused the tile state)")
MIN = cpu_mod.AMX_MIN_ROWS


def _bf16_bits(a):
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def _f32(bits):
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


def _pack(x):
    n, K = x.shape
    xb = np.empty((K // 2, n, 2), np.uint16)
    err = np.empty((n, 2), np.float64)
    return amx.pack_bf16(x, xb, err), xb, err


def test_pack_rounds_to_bf16_and_bounds_the_error():
    """Each value to the nearest BF16 (ties to even, as ml_dtypes rounds), denormal results
    flushed to signed zeros, in the pairs layout; err[i, 0] covers ||x - x~|| and both
    sums' rounding, err[i, 1] the values the tiles read as zero."""
    rng = np.random.default_rng(1)
    n, K = 5, 96
    x = (rng.standard_normal((n, K)) * np.exp2(rng.integers(-30, 30, (n, K)))).astype(np.float32)
    x[0, :4] = [1e-39, -1e-39, 0.0, -0.0]                   # BF16 denormals and zeros
    x[1, 0] = np.float32(1.0 + 2.0 ** -8)                   # a tie: to even (1.0)
    ok, xb, err = _pack(x)
    assert ok
    want = _bf16_bits(x)
    want = np.where((want & 0x7F80) == 0, want & 0x8000, want)
    got = xb.transpose(1, 0, 2).reshape(n, K)
    np.testing.assert_array_equal(got, want)
    assert got[1, 0] == 0x3F80
    t = _f32(got).astype(np.float64)
    x64 = x.astype(np.float64)
    g = K * 2.0 ** -24 / (1 - K * 2.0 ** -24)
    np.testing.assert_allclose(err[:, 0], np.linalg.norm(x64 - t, axis=1)
                               + g * (np.linalg.norm(x64, axis=1) + np.linalg.norm(t, axis=1)), rtol=1e-12)
    np.testing.assert_allclose(err[:, 1], 2.0 ** -126 * (np.abs(t).sum(1) + 2 * K), rtol=1e-12)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, np.finfo(np.float32).max])
def test_pack_refuses_values_the_bounds_do_not_cover(bad):
    """A NaN, an infinity or a value that rounds to one: False (the FMA kernel runs alone)."""
    x = np.ones((2, 32), np.float32)
    x[1, 7] = bad
    assert not _pack(x)[0]


def test_config_takes_only_the_row_counts_the_kernel_uses():
    for bad in (0, amx.MAX_ROWS + 1, True, 2.0):
        with pytest.raises(ValueError, match="n: expected an int"):
            amx.config(bad)
    c = amx.config(8)
    assert c[0] == 1 and not c.flags.writeable and amx.config(8) is c


def _heads(be, rng, V, K):
    return be.prepare_weight(rng.standard_normal((V, K)).astype(ml_dtypes.bfloat16))


#: the backend's rule, kept before any test replaces it
SCREENS = cpu_mod._screens


def _both(be, x, w, *args, monkeypatch):
    """(screened ids, FMA ids), or the NoAllowedToken rows of each."""
    out = []
    for screen in (True, False):
        monkeypatch.setattr(cpu_mod, "_screens", SCREENS if screen else (lambda w, n: False))
        try:
            out.append(be.lm_head_argmax(x, w, *args).tolist())
        except NoAllowedToken as e:
            out.append(("none", e.row))
    return out


@needs_amx
@pytest.mark.parametrize("V,K", [(32768, 1024), (1001, 64), (37, 32), (300, 256)])
@pytest.mark.parametrize("n", [MIN, 8, 13, 16])
def test_screened_ids_are_the_fma_kernels(V, K, n, monkeypatch):
    """Random heads: the screen's ids are the FMA kernel's at every row count it takes, V
    covering full groups, the rows past them and chunks of a few rows."""
    be = get_backend("cpu")
    rng = np.random.default_rng(V + K + n)
    w = _heads(be, rng, V, K)
    x = rng.standard_normal((n, K)).astype(np.float32)
    assert cpu_mod._screens(w, n)
    screened, fma = _both(be, x, w, monkeypatch=monkeypatch)
    assert screened == fma


@needs_amx
def test_screened_ids_at_near_ties_and_exact_ties(monkeypatch):
    """Rows built to tie: copies of one weight row (an exact tie: the lowest id), copies with
    one weight moved by a BF16 step (logits apart by far less than the screen's bound, so
    both stay candidates and the FMA logits decide), at ids in different groups and chunks."""
    be = get_backend("cpu")
    rng = np.random.default_rng(3)
    V, K, n = 4099, 256, 8
    wf = rng.standard_normal((V, K)).astype(np.float32)
    x = rng.standard_normal((n, K)).astype(np.float32)
    best = int(np.argmax(x[0] @ wf.T))
    for j in (5, 1030, 4000, 4098):                          # exact copies of row 0's best
        wf[j] = wf[best]
    nudged = wf[best].copy()
    nudged[np.argmax(np.abs(x[1]))] *= 1 + 2.0 ** -7         # one BF16 step on row 1's largest input
    for j in (7, 2050):
        wf[j] = nudged
    w = be.prepare_weight(wf.astype(ml_dtypes.bfloat16))
    screened, fma = _both(be, x, w, monkeypatch=monkeypatch)
    assert screened == fma
    assert screened[0] == min(best, 5)


@needs_amx
def test_the_screen_keeps_a_best_that_rounding_puts_second(monkeypatch):
    """Two rows A and B whose order the inputs' rounding to BF16 reverses: x = (1 + 2^-10,
    1 - 2^-10, 2^-12, ...) rounds to (1, 1, 2^-12, ...); A has weights (1, 0, 0), B (0, 1, 1),
    the rest alike. On the tiles B leads A by 2^-12, in FP32 A leads B by 2^-9 - 2^-12: the
    bounds keep both, and the FMA logits pick A (a screen without its bounds picks B)."""
    be = get_backend("cpu")
    rng = np.random.default_rng(8)
    V, K, n = 512, 64, MIN
    x = rng.standard_normal((n, K)).astype(np.float32)
    x[0, :3] = [1 + 2.0 ** -10, 1 - 2.0 ** -10, 2.0 ** -12]
    wf = rng.standard_normal((V, K)).astype(np.float32) * 0.1
    common = 0.5 * np.sign(x[0])
    A, B = 77, 300
    wf[A], wf[B] = common, common
    wf[A, :3], wf[B, :3] = [1, 0, 0], [0, 1, 1]
    w = be.prepare_weight(wf.astype(ml_dtypes.bfloat16))
    screened, fma = _both(be, x, w, monkeypatch=monkeypatch)
    assert screened == fma and screened[0] == A


@needs_amx
def test_screened_ids_with_nan_and_infinite_logits(monkeypatch):
    """A NaN weight row (never chosen, on both paths), a row of huge weights (infinite logits,
    which the bounds cannot cover: always computed on the FMA tiles), and a row whose best is
    that infinite logit."""
    be = get_backend("cpu")
    rng = np.random.default_rng(4)
    V, K, n = 2048, 128, 6
    wf = rng.standard_normal((V, K)).astype(np.float32)
    wf[9] = np.nan
    wf[300] = 3e38 * np.sign(rng.standard_normal(K))         # its logits overflow to +-inf
    w = be.prepare_weight(wf.astype(ml_dtypes.bfloat16))
    x = rng.standard_normal((n, K)).astype(np.float32)
    x[2] = np.sign(wf[300]) * 0.5                            # row 2: +inf at token 300
    screened, fma = _both(be, x, w, monkeypatch=monkeypatch)
    assert screened == fma and 9 not in screened and screened[2] == 300


@needs_amx
def test_the_screen_serves_only_the_ids(monkeypatch):
    """Confidences, a shard's partial result and a grammar mask take the FMA kernel (the
    screen would not give the confidences' bits; the FMA kernel reads only the rows a mask
    allows), as do FP32 and FP8 heads, K not a multiple of 32 and rows outside AMX_MIN_ROWS ..
    MAX_ROWS; ``MTPKERN_CPU_AMX=0`` turns it off."""
    be = get_backend("cpu")
    rng = np.random.default_rng(5)
    w = _heads(be, rng, 256, 64)
    assert not cpu_mod._screens(w, MIN - 1) and not cpu_mod._screens(w, amx.MAX_ROWS + 1)
    assert not cpu_mod._screens(be.prepare_weight(rng.standard_normal((256, 64)).astype(np.float32)), 8)
    assert not cpu_mod._screens(_heads(be, rng, 256, 48), 8)

    def boom(*a, **k):
        raise AssertionError("screened")
    monkeypatch.setattr(cpu_mod.lm_head_k, "lm_head_argmax_screened_kernel", boom)
    x = rng.standard_normal((8, 64)).astype(np.float32)
    be.lm_head_argmax(x, w, conf=np.empty(8, np.float32))
    be.lm_head_argmax(x, w, best=np.empty(8, np.float32))
    be.lm_head_argmax(x, w, np.full((8, 256 // 32), -1, np.int32))
    with pytest.raises(AssertionError, match="screened"):
        be.lm_head_argmax(x, w)
    env = dict(os.environ, **{amx.ENV: "0"})
    out = subprocess.run([sys.executable, "-c", "from mtpkern.backends.cpu_kernels import amx; print(amx.available())"],
                         env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@needs_amx
def test_row_norms_follow_the_weight_array():
    """The rows' norms are computed once per head array and not reused for another array,
    even one that takes the first one's place in memory."""
    be = get_backend("cpu")
    rng = np.random.default_rng(6)
    for _ in range(3):
        w = _heads(be, rng, 100, 64)
        norms = be._row_norms(w)
        np.testing.assert_allclose(norms, np.linalg.norm(_f32(w).astype(np.float64), axis=1), rtol=1e-14)
        assert be._row_norms(w) is norms
        del w
    assert not be._norms                                   # dropped with their heads
