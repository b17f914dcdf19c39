"""The cpu backend's BF16 GEMVs on AMX tiles (``cpu_kernels/amx_linear.py``): the inputs'
exact split into three BF16 parts, the weights' tile layout, FP32 accuracy against float64,
a row's bits independent of its batch and of the weight's shard, non-finite inputs, and which
launchers take the tiles. Every test skips on a CPU or kernel without AMX."""

import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("numba")

from mtpkern.backends import cpu as cpu_mod  # noqa: E402
from mtpkern.backends import get_backend  # noqa: E402
from mtpkern.backends.cpu_kernels import amx  # noqa: E402
from mtpkern.backends.cpu_kernels import amx_linear as al  # noqa: E402

pytestmark = pytest.mark.skipif(not amx.available(), reason="no AMX on this CPU (or the kernel refused the tile state)")

U = 2.0 ** -24


def _bf16(rng, shape, scale=0.1):
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(ml_dtypes.bfloat16)


def _f64(w):
    return np.asarray(w).astype(np.float64)


def _parts(x):
    """pack_parts of x -> (xa, g, the parts [3, n, K] as float64)."""
    n, K = x.shape
    G, g = al.groups(n)
    xa = np.full((G, -(-K // al.STEP), 3 * g, al.STEP), 0xFFFF, np.uint16)     # junk: packing must clear it
    al.pack_parts(x, g, xa)
    rows = xa.transpose(0, 2, 1, 3).reshape(G, 3 * g, -1)[:, :, :K]       # [G, 3g, K]
    parts = np.stack([np.concatenate([rows[gi, p * g:(p + 1) * g] for gi in range(G)])[:n] for p in range(3)])
    return xa, g, (parts.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def test_the_three_parts_sum_to_each_value_exactly():
    """h + m + l == x in float64 over FP32's normal range (FLT_MAX included: truncation never
    rounds up to an infinity); below ~2^-110 the parts the tiles read as zero (BF16 denormals)
    leave under 2^-126; rows past n and columns past K are zeros."""
    rng = np.random.default_rng(0)
    n, K = 7, 77
    x = (rng.standard_normal((n, K)) * np.exp2(rng.integers(-100, 100, (n, K)))).astype(np.float32)
    x[0, :6] = [np.finfo(np.float32).max, -np.finfo(np.float32).max, 0.0, -0.0, 1.0 + 2.0 ** -23, -(2.0 ** -100)]
    x[1, :3] = [1e-36, -3e-39, 2.0 ** -126]                   # small and denormal inputs
    xa, g, parts = _parts(x)
    total = parts[0] + parts[1] + parts[2]
    big = np.abs(x) >= 2.0 ** -100
    np.testing.assert_array_equal(total[big], x.astype(np.float64)[big])
    tiny = np.abs(parts) < 2.0 ** -126                        # what the tiles read as zero
    read = np.where(tiny, 0.0, parts).sum(axis=0)
    assert np.all(np.abs(read - x.astype(np.float64)) < 2.0 ** -126)
    assert np.all(np.abs(parts[1]) <= np.abs(x) * 2.0 ** -7) and np.all(np.abs(parts[2]) <= np.abs(x) * 2.0 ** -15)
    G = xa.shape[0]
    assert not xa[:, :, :, :][:, -1, :, K % al.STEP:].any()           # columns past K
    assert G * g == n or not xa[-1, :, [p * g + i for p in range(3) for i in range(n - (G - 1) * g, g)]].any()


def test_infinities_and_nans_are_their_own_first_part():
    """An infinity keeps its sign, a NaN stays a NaN (made quiet, even one whose payload is in
    the low 16 bits only), and both leave m = l = 0."""
    bits = np.array([[0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFA00000, 0x3F800000]], np.uint32)
    x = bits.view(np.float32)
    _, _, parts = _parts(x)
    assert parts[0, 0, 0] == np.inf and parts[0, 0, 1] == -np.inf
    assert np.isnan(parts[0, 0, 2:5]).all() and parts[0, 0, 5] == 1.0
    assert not parts[1:, 0, :5].any()


def test_repack_is_the_pairs_layout():
    """wp[jb, kb, kp, 2c + t] = w[16 jb + c, 32 kb + 2 kp + t], zeros past N and K."""
    rng = np.random.default_rng(1)
    N, K = 37, 70
    w = rng.integers(1, 1 << 16, (N, K), dtype=np.uint16)
    wp = np.full((3, 3, 16, 32), 7, np.uint16)
    al.repack(w, wp)
    pad = np.zeros((48, 96), np.uint16)
    pad[:N, :K] = w
    want = pad.reshape(3, 16, 3, 16, 2).transpose(0, 2, 3, 1, 4).reshape(3, 3, 16, 32)
    np.testing.assert_array_equal(wp, want)


@pytest.mark.parametrize("n", [1, 2, 5, 6, 8, 10, 11, 16, 21, 24])
@pytest.mark.parametrize("N,K", [(37, 70), (64, 96), (130, 256)])
def test_linear_on_the_tiles_is_fp32_accurate(n, N, K, monkeypatch):
    """Within gamma_K sum |w x| of the float64 dot (a plain FP32 dot's bound), for every shape
    of the row groups (1 or 2 A tiles, 1-3 groups) and of the weights (N, K padded)."""
    be = get_backend("cpu")
    rng = np.random.default_rng(n * 1000 + N)
    w = _bf16(rng, (N, K))
    x = (rng.standard_normal((n, K)) * np.exp2(rng.integers(-8, 8, (n, 1)))).astype(np.float32)
    b = rng.standard_normal(N).astype(np.float32)
    wq = be.prepare_weight(w)
    monkeypatch.setattr(cpu_mod.linear_k, "linear_kernel", None)     # the tiles serve, or this fails
    y = be.linear(x, wq)
    exact = x.astype(np.float64) @ _f64(w).T
    bound = 2 * K * U * (np.abs(x).astype(np.float64) @ np.abs(_f64(w)).T) + 1e-30
    assert np.all(np.abs(y - exact) <= bound)
    res = rng.standard_normal((n, N)).astype(np.float32)
    yb = be.linear(x, wq, b, res)
    np.testing.assert_array_equal(yb, (y + b) + res)          # the reference's order


def test_a_rows_bits_do_not_depend_on_its_batch_or_the_weights_shard():
    """Each row of a sum tile is its own input row against the weights: a row gets the same
    bits alone, in any batch (any group shape) and against any slice of the weight rows."""
    be = get_backend("cpu")
    rng = np.random.default_rng(2)
    N, K = 75, 160
    w = _bf16(rng, (N, K))
    x = rng.standard_normal((24, K)).astype(np.float32)
    wq = be.prepare_weight(w)
    full = be.linear(x, wq)
    for n in (1, 3, 6, 11, 17, 24):
        np.testing.assert_array_equal(be.linear(x[:n], wq), full[:n])
    for r in (0, 9, 23):
        np.testing.assert_array_equal(be.linear(x[r:r + 1], wq), full[r:r + 1])
    shards = [be.linear(x, be.prepare_weight(w[a:b_])) for a, b_ in ((0, 16), (16, 17), (17, 50), (50, N))]
    np.testing.assert_array_equal(np.concatenate(shards, axis=1), full)


def test_non_finite_inputs_give_the_fma_tiles_kinds():
    """A row holding an infinity or a NaN gives NaN, +-inf or finite outputs exactly where the
    FMA tiles do (the same signs); the finite rows beside it are unaffected."""
    be = get_backend("cpu")
    rng = np.random.default_rng(3)
    N, K = 40, 64
    w = _bf16(rng, (N, K)).astype(np.float32)
    w[:, 5] = 0.0                                             # inf * 0: NaN in every column
    w[3, 7] = 0.0
    wq = be.prepare_weight(w.astype(ml_dtypes.bfloat16))
    x = rng.standard_normal((4, K)).astype(np.float32)
    x[0, 7] = np.inf
    x[1, 9] = -np.inf
    x[2, 11] = np.nan
    x[1, 5] = 3e38                                            # finite, with an FP32 overflow nowhere
    y = be.linear(x, wq)
    fma = be._linear(x, wq, None, None, None, None, tiles=False)
    np.testing.assert_array_equal(np.isnan(y), np.isnan(fma))
    np.testing.assert_array_equal(np.isposinf(y), np.isposinf(fma))
    np.testing.assert_array_equal(np.isneginf(y), np.isneginf(fma))
    np.testing.assert_allclose(y[3], fma[3], rtol=1e-5, atol=1e-6)


def test_the_launchers_that_take_the_tiles(monkeypatch):
    """linear, mtp_input's eh_proj and the dense MLP take the tiles for BF16 weights (and
    agree with the NumPy reference); FP32 weights and the LM head's logits do not: the
    logits stay the FMA tiles', whose argmax the LM head's ids are."""
    be, ref = get_backend("cpu"), get_backend("numpy")
    rng = np.random.default_rng(4)
    H, I, V, n = 64, 96, 50, 6
    calls = []
    kernel = al.amx_linear_kernel

    def counted(*a):
        calls.append(a[2].shape)
        return kernel(*a)
    monkeypatch.setattr(cpu_mod.amx_linear_k, "amx_linear_kernel", counted)
    x = rng.standard_normal((n, H)).astype(np.float32)
    embed, eh = _bf16(rng, (V, H), 1.0), _bf16(rng, (H, 2 * H))
    nw = [rng.standard_normal(H).astype(np.float32) for _ in range(2)]
    toks = rng.integers(0, V, n).astype(np.int32)
    got = be.mtp_input(be.prepare_weight(embed), toks, x, *nw, be.prepare_weight(eh), 1e-6)
    want = ref.mtp_input(ref.prepare_weight(embed), toks, x, *nw, ref.prepare_weight(eh), 1e-6)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    assert len(calls) == 1
    w13, w2 = _bf16(rng, (2 * I, H)), _bf16(rng, (H, I))
    res = rng.standard_normal((n, H)).astype(np.float32)
    got = be.swiglu_mlp(x, be.prepare_weight(w13), be.prepare_weight(w2), res)
    want = ref.swiglu_mlp(x, ref.prepare_weight(w13), ref.prepare_weight(w2), res)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    assert len(calls) == 3
    out = res.copy()                                          # the residual is the output itself
    np.testing.assert_array_equal(be.swiglu_mlp(x, be.prepare_weight(w13), be.prepare_weight(w2), out, out=out), got)
    calls.clear()
    be.linear(x, be.prepare_weight(_bf16(rng, (V, H)).astype(np.float32)))
    head = be.prepare_weight(_bf16(rng, (V, H)))
    logits = be.lm_head_logits(x, head)
    assert not calls
    np.testing.assert_array_equal(be.lm_head_argmax(x, head), logits.argmax(axis=1))
    be.linear(x, head)
    assert len(calls) == 1


def test_the_tile_copy_follows_the_weight_array(monkeypatch):
    """A weight is repacked once while the array owning it lives (a raw bfloat16 array, viewed
    as its bits afresh on every call, included; slices of it apart), and its copy is dropped
    as soon as that array is gone."""
    be = get_backend("cpu")
    rng = np.random.default_rng(5)
    for _ in range(3):
        w = be.prepare_weight(_bf16(rng, (20, 40)))
        wt = be._weight_tiles(w)
        assert wt.shape == (2, 2, 16, 32) and be._weight_tiles(w) is wt
        del w, wt
        assert not be._tiles
    assert be._weight_tiles(np.zeros((4, 4), np.float32)) is None
    repacks = []
    real = al.repack
    monkeypatch.setattr(cpu_mod.amx_linear_k, "repack", lambda w, wp: (repacks.append(w.shape), real(w, wp)))
    raw = _bf16(rng, (48, 64))
    x = rng.standard_normal((3, 64)).astype(np.float32)
    for _ in range(3):
        be.linear(x, raw)
        be.linear(x, raw[16:32])
    assert repacks == [(48, 64), (16, 64)] and len(be._tiles) == 2
    del raw
    assert not be._tiles


# -- the LM head's confidences from the tiles' logits ---------------------------------------

#: the backend's method, kept before any test replaces it
TILED_ARGMAX = cpu_mod.CpuBackend._tiled_argmax


def _head_both(be, x, w, monkeypatch, **kw):
    """(ids, conf, best, sum_exp) through the tiled logits, then through the FMA kernel alone."""
    out = []
    n = x.shape[0]
    for tiled in (True, False):
        monkeypatch.setattr(cpu_mod.CpuBackend, "_tiled_argmax", TILED_ARGMAX if tiled else (lambda *a: None))
        conf, best, sums = (np.full(n, -7.0, np.float32) for _ in range(3))
        ids = be.lm_head_argmax(x, w, conf=conf, **({"best": best, "sum_exp": sums} if kw.get("partial") else {}))
        out.append((ids.tolist(), conf, best, sums))
    return out


@pytest.mark.parametrize("V,K", [(32768, 1024), (1001, 64), (37, 32), (4099, 256)])
@pytest.mark.parametrize("n", [1, 4, 8, 13])
def test_confidences_on_the_tiles_match_the_fma_kernel(V, K, n, monkeypatch):
    """Random heads: the ids are the FMA kernel's, the confidences (and a shard's best and
    sum) within FP32 rounding of its."""
    be = get_backend("cpu")
    rng = np.random.default_rng(V + K + n)
    w = be.prepare_weight((rng.standard_normal((V, K)) * 3 / np.sqrt(K)).astype(ml_dtypes.bfloat16))
    x = rng.standard_normal((n, K)).astype(np.float32)
    (ti, tc, tb, ts), (fi, fc, fb, fs) = _head_both(be, x, w, monkeypatch, partial=True)
    assert ti == fi
    np.testing.assert_array_equal(tb, fb)                     # the best: the FMA logit itself
    np.testing.assert_allclose(tc, fc, rtol=1e-5)
    np.testing.assert_allclose(ts, fs, rtol=1e-5)


def test_confidences_at_ties_nan_and_infinite_logits(monkeypatch):
    """Copies of a row's best (an exact tie: the lowest id, counted 1 each in the sum), a copy
    one BF16 step below it, a NaN weight row (never chosen, never counted) and a row of huge weights
    (infinite logits: a row whose best is +inf has confidence 1 / (its count of +inf))."""
    be = get_backend("cpu")
    rng = np.random.default_rng(9)
    V, K, n = 4099, 128, 6
    wf = (rng.standard_normal((V, K)) * 0.2).astype(np.float32)
    x = rng.standard_normal((n, K)).astype(np.float32)
    best = int(np.argmax(x[0] @ wf.T))
    for j in (5, 1030, 4098):
        wf[j] = wf[best]
    nudged = wf[best].copy()
    k = int(np.argmax(np.abs(x[0])))
    nudged[k] *= 1 - 2.0 ** -7 if nudged[k] * x[0, k] > 0 else 1 + 2.0 ** -7      # just below the best
    wf[2050] = nudged
    wf[9] = np.nan
    wf[300] = 3e38 * np.sign(rng.standard_normal(K))
    x[2] = np.sign(wf[300]) * 0.5                             # row 2: +inf at token 300
    w = be.prepare_weight(wf.astype(ml_dtypes.bfloat16))
    (ti, tc, _, _), (fi, fc, _, _) = _head_both(be, x, w, monkeypatch)
    assert ti == fi and ti[0] == min(best, 5) and ti[2] == 300 and 9 not in ti
    np.testing.assert_allclose(tc, fc, rtol=1e-5)
    assert tc[2] == 1.0


def test_a_rows_confidence_does_not_depend_on_its_batch():
    """The tiles' logits of a row depend on that row only, at every row count: its id and
    confidence are the same bits alone and in a batch."""
    be = get_backend("cpu")
    rng = np.random.default_rng(10)
    V, K = 3000, 96
    w = be.prepare_weight((rng.standard_normal((V, K)) * 0.3).astype(ml_dtypes.bfloat16))
    x = rng.standard_normal((11, K)).astype(np.float32)
    conf = np.empty(11, np.float32)
    ids = be.lm_head_argmax(x, w, conf=conf)
    for r in (0, 4, 10):
        c1 = np.empty(1, np.float32)
        assert be.lm_head_argmax(x[r:r + 1], w, conf=c1)[0] == ids[r] and c1[0] == conf[r]


def test_what_takes_the_tiled_confidences(monkeypatch):
    """Confidences or a shard's sums of a BF16 head without a mask take the tiles; a masked
    call (the FMA kernel reads only the allowed rows), an FP32 head and the ids alone (the
    screen, which needs no copy of the head) do not."""
    be = get_backend("cpu")
    rng = np.random.default_rng(11)
    V, K, n = 500, 64, 5
    calls = []
    kernel = cpu_mod.lm_head_k.lm_head_argmax_tiled_kernel

    def counted(*a):
        calls.append(1)
        return kernel(*a)
    monkeypatch.setattr(cpu_mod.lm_head_k, "lm_head_argmax_tiled_kernel", counted)
    w = be.prepare_weight((rng.standard_normal((V, K)) * 0.3).astype(ml_dtypes.bfloat16))
    x = rng.standard_normal((n, K)).astype(np.float32)
    conf = np.empty(n, np.float32)
    be.lm_head_argmax(x, w, conf=conf)
    be.lm_head_argmax(x, w, best=np.empty(n, np.float32), sum_exp=np.empty(n, np.float32))
    assert len(calls) == 2
    be.lm_head_argmax(x, w)
    be.lm_head_argmax(x, w, np.full((n, -(-V // 32)), -1, np.int32), conf=conf)
    be.lm_head_argmax(x, be.prepare_weight(rng.standard_normal((V, K)).astype(np.float32)), conf=conf)
    assert len(calls) == 2
