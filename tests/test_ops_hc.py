"""Hyper-connection ops (mtpkern.ops.hc: DeepSeek-V4's mHC) against a float64 computation
written here from the model's formulas (the normed flattened streams through ``fn``, sigmoid
pre / post, a softmax comb made doubly stochastic by Sinkhorn's iterations, the collapse, the
write-back with comb transposed, the head's collapse), on the numpy reference, the cpu
backend and the CUDA kernels on the emulator; negative controls (comb read untransposed, the
post factor's 2 dropped) must differ; bad shapes refused by name. Then the cpu and cuda
backends against the numpy reference on the same inputs: FP32 and BF16 streams, 1 to 16
streams, widths off the kernels' 4-column vectors, 1 and 3 Sinkhorn iterations, no rows,
given output buffers; the write-back onto its own streams; the cuda limit of 16 streams.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from mtpkern.backends.cuda import CudaBackend
from mtpkern.ops import hc
from mtpkern.tolerance import assert_close
from test_ops_mla import BACKENDS, EMU_BACKENDS, OTHER_BACKENDS, backend, emulator, rng_for  # noqa: F401


def mix64(X, fn, eps):
    x = X.astype(np.float64)
    x = x / np.sqrt((x * x).mean(1, keepdims=True) + eps)
    return x @ fn.astype(np.float64).T


def pre64(X, fn, base, scale, m, eps, hc_eps, iters, transposed=True, post_mult=2.0):
    n, mH = X.shape
    H = mH // m
    z = mix64(X, fn, eps)
    sg = lambda v: 1 / (1 + np.exp(-v))  # noqa: E731
    pre = sg(z[:, :m] * scale[0] + base[:m]) + hc_eps
    post = post_mult * sg(z[:, m:2 * m] * scale[1] + base[m:2 * m])
    c = z[:, 2 * m:].reshape(n, m, m) * scale[2] + base[2 * m:].reshape(m, m)
    c = np.exp(c - c.max(2, keepdims=True))
    c = c / c.sum(2, keepdims=True) + hc_eps
    c = c / (c.sum(1, keepdims=True) + hc_eps)
    for _ in range(iters - 1):
        c = c / (c.sum(2, keepdims=True) + hc_eps)
        c = c / (c.sum(1, keepdims=True) + hc_eps)
    Xs = X.astype(np.float64).reshape(n, m, H)
    u = np.einsum("ni,nih->nh", pre, Xs)
    return u, post, c if transposed else np.swapaxes(c, 1, 2)


def post64(f, X, post, comb):
    n, mH = X.shape
    m = post.shape[1]
    Xs = X.astype(np.float64).reshape(n, m, mH // m)
    return (post[:, :, None] * f.astype(np.float64)[:, None, :] + np.einsum("nij,nih->njh", comb, Xs)).reshape(n, mH)


def case(m, H, n, seed):
    rng = rng_for("hc", m, H, n, seed)
    X = rng.standard_normal((n, m * H)).astype(np.float32)
    fn = (rng.standard_normal(((2 + m) * m, m * H)) * (m * H) ** -0.5).astype(np.float32)
    base = rng.standard_normal((2 + m) * m).astype(np.float32) * 0.5
    scale = (rng.random(3) + 0.5).astype(np.float32)
    f = rng.standard_normal((n, H)).astype(np.float32)
    return X, fn, base, scale, f


SHAPES = [(4, 64, 5), (1, 32, 3), (2, 48, 1), (4, 256, 9), (3, 40, 4)]


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("m,H,n", SHAPES)
def test_pre_post_equal_float64(backend, name, m, H, n):
    be = backend(name)
    X, fn, base, scale, f = case(m, H, n, 0)
    mix = be.linear(be.from_host(X), be.prepare_weight(fn), norm=(be.prepare_vector(np.ones(m * H, np.float32)),
                                                                   1e-6))
    u, post, comb = (be.to_host(a) for a in be.hc_pre(be.from_host(X), mix, be.prepare_vector(base),
                                                        be.prepare_vector(scale), 1e-6, 20))
    u64, post64_, comb64 = pre64(X, fn, base, scale, m, 1e-6, 1e-6, 20)
    assert_close(u, u64, "float32", f"{name}: u")
    assert_close(post, post64_, "float32", f"{name}: post")
    assert_close(comb, comb64, "float32", f"{name}: comb")
    if m > 1:      # doubly stochastic, near enough
        assert np.allclose(comb.sum(1), 1, atol=1e-4) and np.allclose(comb.sum(2), 1, atol=1e-4)
    got = be.to_host(be.hc_post(be.from_host(f), be.from_host(X), be.from_host(post), be.from_host(comb)))
    want = post64(f, X, post.astype(np.float64), comb.astype(np.float64))
    assert_close(got, want, "float32", f"{name}: hc_post")
    if m > 2:      # negative controls (a 2 x 2 doubly stochastic comb is symmetric): comb untransposed
        wrong = post64(f, X, post.astype(np.float64), np.swapaxes(comb, 1, 2).astype(np.float64))
        assert not np.allclose(got, wrong, atol=1e-3)
    assert not np.allclose(post, post64_ / 2, atol=1e-3)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("m,H,n", SHAPES)
def test_head_equals_float64(backend, name, m, H, n):
    be = backend(name)
    X, fn, base, scale, _ = case(m, H, n, 1)
    fn_h, base_h, scale_h = fn[:m], base[:m], scale[:1]
    mix = be.linear(be.from_host(X), be.prepare_weight(fn_h), norm=(be.prepare_vector(np.ones(m * H, np.float32)),
                                                                     1e-6))
    got = be.to_host(be.hc_head(be.from_host(X), mix, be.prepare_vector(base_h), be.prepare_vector(scale_h), 1e-6))
    z = mix64(X, fn_h, 1e-6)
    pre = 1 / (1 + np.exp(-(z * scale_h[0] + base_h))) + 1e-6
    want = np.einsum("ni,nih->nh", pre, X.astype(np.float64).reshape(n, m, H))
    assert_close(got, want, "float32", f"{name}: hc_head")


@pytest.mark.parametrize("name", BACKENDS)
def test_bad_shapes_are_refused_by_name(backend, name):
    be = backend(name)
    X, fn, base, scale, f = case(4, 64, 3, 2)
    mix = np.zeros((3, 24), np.float32)
    with pytest.raises(ValueError, match="mix"):
        be.hc_pre(be.from_host(X), be.from_host(mix[:, :23]), base, scale, 1e-6, 20)
    with pytest.raises(ValueError, match="base"):
        be.hc_pre(be.from_host(X), be.from_host(mix), base[:5], scale, 1e-6, 20)
    with pytest.raises(ValueError, match="iters"):
        be.hc_pre(be.from_host(X), be.from_host(mix), base, scale, 1e-6, 0)
    with pytest.raises(ValueError, match="X"):
        be.hc_pre(be.from_host(X[:, :250]), be.from_host(mix), base, scale, 1e-6, 20)
    post, comb = np.ones((3, 4), np.float32), np.ones((3, 4, 4), np.float32)
    with pytest.raises(ValueError, match="f"):
        be.hc_post(be.from_host(f[:, :63]), be.from_host(X), be.from_host(post), be.from_host(comb))
    with pytest.raises(ValueError, match="comb"):
        be.hc_post(be.from_host(f), be.from_host(X), be.from_host(post), be.from_host(comb[:, :3]))


def test_one_sinkhorn_iteration_is_not_twenty():
    """iters matters: the numpy op with 1 iteration differs from 20 (the test above would
    catch an op that ignores it)."""
    X, fn, base, scale, _ = case(4, 64, 5, 3)
    mix = hc.np.asarray(mix64(X, fn, 1e-6), np.float32)
    a = hc.hc_pre(X, mix, base, scale, 1e-6, 1)[2]
    b = hc.hc_pre(X, mix, base, scale, 1e-6, 20)[2]
    assert not np.allclose(a, b, atol=1e-4)


def streams_in(be, a32: np.ndarray, dtype: str):
    """``a32`` as ``be`` takes an activation of ``dtype``: FP32, or rounded to BF16 (its bits in
    uint16 on the cuda backend, as it stores BF16; ``ml_dtypes.bfloat16`` elsewhere). ->
    (the backend's array, the host values the reference reads)."""
    if dtype == "float32":
        return be.from_host(a32), a32
    b = a32.astype(ml_dtypes.bfloat16)
    return be.from_host(b.view(np.uint16) if isinstance(be, CudaBackend) else b), b


#: (m, H, n, iters): m 16 (the cuda kernels' most: hc_post's 16-stream registers) and 5 (a
#: register set partly used), H not a multiple of 4 (the kernels' scalar path), 1 and 3
#: Sinkhorn iterations, no rows
ODD = [(16, 24, 3, 20), (5, 37, 4, 3), (3, 33, 2, 1), (2, 8, 0, 20), (4, 4096, 2, 20)]


@pytest.mark.parametrize("name", OTHER_BACKENDS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("m,H,n,iters", ODD)
def test_backends_equal_the_reference(backend, name, dtype, m, H, n, iters):
    """Each backend against the numpy reference on the same inputs (X and f in ``dtype``, f's
    own dtype the other one for hc_post, so mixed kinds run too), into given output buffers."""
    be = backend(name)
    rng = rng_for("hc-ref", m, H, n, iters, dtype)
    X32 = rng.standard_normal((n, m * H)).astype(np.float32)
    mix = (rng.standard_normal((n, (2 + m) * m)) * 2).astype(np.float32)
    base = rng.standard_normal((2 + m) * m).astype(np.float32)
    scale = (rng.random(3) + 0.5).astype(np.float32)
    X, Xh = streams_in(be, X32, dtype)
    f, fh = streams_in(be, rng.standard_normal((n, H)).astype(np.float32),
                       "float32" if dtype == "bfloat16" else "bfloat16")
    bufs = {k: be.from_host(np.full(s, np.nan, np.float32)) for k, s in
            (("u", (n, H)), ("post", (n, m)), ("comb", (n, m, m)))}
    got = be.hc_pre(X, be.from_host(mix), be.prepare_vector(base), be.prepare_vector(scale), 1e-6, iters, **bufs)
    want = hc.hc_pre(Xh, mix, base, scale, 1e-6, iters)
    for k, g, w in zip(bufs, got, want):
        assert g is bufs[k], f"{name}: {k} not written into its buffer"
        assert_close(be.to_host(g), w, "float32", f"{name}: {k}")
    post, comb = got[1], got[2]
    out = be.from_host(np.full((n, m * H), np.nan, np.float32))
    assert be.hc_post(f, X, post, comb, out=out) is out
    want = hc.hc_post(fh, Xh, be.to_host(post), be.to_host(comb))
    assert_close(be.to_host(out), want, "float32", f"{name}: hc_post")
    if name == "cpu":                # rounded as the reference: no contraction, sums in order
        assert np.array_equal(be.to_host(out), want)
    mh = mix[:, :m].copy()
    out = be.from_host(np.full((n, H), np.nan, np.float32))
    assert be.hc_head(X, be.from_host(mh), be.prepare_vector(base[:m]), be.prepare_vector(scale[:1]), 1e-6,
                      out=out) is out
    assert_close(be.to_host(out), hc.hc_head(Xh, mh, base[:m], scale[:1], 1e-6), "float32", f"{name}: hc_head")


@pytest.mark.parametrize("name", OTHER_BACKENDS)
def test_write_back_onto_its_streams(backend, name):
    """hc_post's out on top of X: the cpu backend reads a copy (the reference's result), the
    cuda launcher refuses the overlap by name (its kernel would read streams another block
    already wrote)."""
    be = backend(name)
    X, _, _, _, f = case(3, 40, 4, 4)
    post = np.full((4, 3), 0.5, np.float32)
    comb = np.tile(np.float32([[0.1, 0.2, 0.7], [0.3, 0.5, 0.2], [0.6, 0.3, 0.1]]), (4, 1, 1))
    want = hc.hc_post(f, X, post, comb)
    Xd = be.from_host(X)
    if isinstance(be, CudaBackend):
        with pytest.raises(ValueError, match="out must not overlap X"):
            be.hc_post(be.from_host(f), Xd, be.from_host(post), be.from_host(comb), out=Xd)
    else:
        be.hc_post(be.from_host(f), Xd, be.from_host(post), be.from_host(comb), out=Xd)
        assert_close(be.to_host(Xd), want, "float32", f"{name}: hc_post in place")


@pytest.mark.parametrize("name", EMU_BACKENDS)
def test_cuda_takes_at_most_16_streams(backend, name):
    """m 17 passes the shared check (hc_mult up to 64 there) and is refused by the cuda launchers
    by name; host BF16 (ml_dtypes) streams are taken as their bits."""
    be = backend(name)
    m, H, n = 17, 8, 2
    X = np.ones((n, m * H), np.float32)
    with pytest.raises(ValueError, match="m: expected at most 16"):
        be.hc_pre(X, np.zeros((n, (2 + m) * m), np.float32), np.zeros((2 + m) * m, np.float32),
                  np.ones(3, np.float32), 1e-6, 20)
    with pytest.raises(ValueError, match="m: expected at most 16"):
        be.hc_post(np.ones((n, H), np.float32), X, np.ones((n, m), np.float32), np.ones((n, m, m), np.float32))
    with pytest.raises(ValueError, match="m: expected at most 16"):
        be.hc_head(X, np.zeros((n, m), np.float32), np.zeros(m, np.float32), np.ones(1, np.float32), 1e-6)
    Xb = X[:, :4 * H].astype(ml_dtypes.bfloat16) * 3
    got = be.to_host(be.hc_head(Xb, np.zeros((n, 4), np.float32), np.zeros(4, np.float32), np.ones(1, np.float32),
                                0.0))
    assert_close(got, np.full((n, H), 6.0), "float32", "hc_head of host BF16 streams")
