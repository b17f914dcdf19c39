"""Hyper-connection ops (mtpkern.ops.hc: DeepSeek-V4's mHC) against a float64 computation
written here from the model's formulas (the normed flattened streams through ``fn``, sigmoid
pre / post, a softmax comb made doubly stochastic by Sinkhorn's iterations, the collapse, the
write-back with comb transposed, the head's collapse), on the numpy reference, the cpu
backend and the CUDA kernels on the emulator; negative controls (comb read untransposed, the
post factor's 2 dropped) must differ; bad shapes refused by name.
"""

from __future__ import annotations

import numpy as np
import pytest

from mtpkern.ops import hc
from mtpkern.tolerance import assert_close
from test_ops_mla import BACKENDS, backend, emulator, rng_for  # noqa: F401


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
