"""Draft confidences (the original interface's ``out_conf``): the probability the drafter
gives each draft, the softmax of the grammar-masked logits at the draft, computed in the
LM head's argmax epilogue (``lm_head_argmax(..., conf=buf)``, mtpkern.ops.lm_head) and
returned by ``propose`` / ``propose_batch(..., out_conf=[])``.

Op level: every backend against a float64 softmax of the reference's exact logits, over
odd vocabularies, masks (one allowed token: 1), NaN logits, ties, BF16 / FP32 / FP8 heads;
``conf`` absent changes nothing."""

from __future__ import annotations

import zlib

import ml_dtypes
import numpy as np
import pytest

from mtpkern.backends import get_backend
from mtpkern.ops import lm_head as ref_lm
from mtpkern.quant import Fp8Weight
from mtpkern.tolerance import assert_close

BF16 = ml_dtypes.bfloat16


def rng_for(*key):
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def conf64(x, w, bitmask=None):
    """(ids, conf) in float64 from the reference's exact logits."""
    logits = ref_lm.lm_head_logits(x, w).astype(np.float64)
    ids = ref_lm.masked_argmax(logits.astype(np.float32), bitmask)
    ok = ~np.isnan(logits)
    if bitmask is not None:
        ok &= ref_lm.bitmask_allowed(bitmask, logits.shape[1])
    out = np.empty(len(ids))
    for r, i in enumerate(ids):
        out[r] = 1.0 / np.exp(logits[r, ok[r]] - logits[r, i]).sum()
    return ids, out


def mask_of(rng, n, V, kind):
    if kind is None:
        return None
    W = (V + 31) // 32
    if kind == "one":                                    # exactly one allowed token per row
        m = np.zeros((n, W), np.int64)
        for r in range(n):
            j = int(rng.integers(0, V))
            m[r, j >> 5] |= 1 << (j & 31)
        return m.astype(np.uint32).view(np.int32)
    return rng.integers(-2**31, 2**31 - 1, (n, W), dtype=np.int64).astype(np.int32)


@pytest.mark.parametrize("name", ["numpy", "cpu"])
@pytest.mark.parametrize("V,n", [(1, 1), (63, 2), (64, 3), (65, 1), (301, 5), (4099, 8), (9000, 2)])
@pytest.mark.parametrize("kind", [None, "random", "one"])
@pytest.mark.parametrize("wdtype", ["float32", "bfloat16", "fp8"])
def test_confidence_is_the_masked_softmax_at_the_draft(name, V, n, kind, wdtype):
    be = get_backend(name)
    rng = rng_for(V, n, kind, wdtype)
    H = 48
    x = rng.standard_normal((n, H)).astype(np.float32)
    w = (rng.standard_normal((V, H)) * 0.3).astype(np.float32)    # logits of a few units: a spread softmax
    if wdtype == "bfloat16":
        w = w.astype(BF16).astype(np.float32)
    prepared = be.prepare_weight(w.astype(BF16) if wdtype == "bfloat16" else
                                 Fp8Weight.quantize(w, (16, 16)) if wdtype == "fp8" else w)
    if wdtype == "fp8":
        w = Fp8Weight.quantize(w, (16, 16)).dequantize()
    bm = mask_of(rng, n, V, kind)
    if kind == "random" and V < 64:                      # a random mask may leave a small row nothing
        bm[:, 0] |= 1
    ids_want, conf_want = conf64(x, w, bm)
    conf = np.full(n, np.nan, np.float32)
    ids = be.lm_head_argmax(be.from_host(x), prepared, None if bm is None else be.from_host(bm), conf=conf)
    np.testing.assert_array_equal(be.to_host(ids), ids_want)
    assert_close(conf, conf_want, what="confidence")
    assert np.all((conf > 0) & (conf <= 1.0 + 1e-6))
    if kind == "one":
        np.testing.assert_allclose(conf, 1.0, rtol=1e-6)
    np.testing.assert_array_equal(be.to_host(be.lm_head_argmax(be.from_host(x), prepared,
                                                               None if bm is None else be.from_host(bm))), ids_want)


@pytest.mark.parametrize("name", ["numpy", "cpu"])
def test_nan_logits_do_not_count_and_ties_share(name):
    """NaN logits never win and add nothing; two tied best tokens each carry half (or less)."""
    be = get_backend(name)
    H, V = 4, 70
    w = np.zeros((V, H), np.float32)
    w[:, 0] = -50.0                                      # every other logit far below
    w[5, 0], w[66, 0] = 2.0, 2.0                         # a tie across the 64-row chunks
    w[9, :] = np.nan                                     # a NaN logit
    x = np.ones((1, H), np.float32)
    conf = np.zeros(1, np.float32)
    ids = be.lm_head_argmax(x, be.prepare_weight(w), conf=conf)
    assert int(be.to_host(ids)[0]) == 5
    assert_close(conf, np.array([0.5]), what="tied confidence")


@pytest.mark.parametrize("name", ["numpy", "cpu"])
def test_a_bad_conf_buffer_is_refused_by_name(name):
    be = get_backend(name)
    x, w = np.ones((2, 4), np.float32), be.prepare_weight(np.ones((10, 4), np.float32))
    with pytest.raises(ValueError, match="conf: expected shape \\[2\\]"):
        be.lm_head_argmax(x, w, conf=np.zeros(3, np.float32))


@pytest.mark.parametrize("name", ["numpy", "cpu"])
def test_infinite_logits_follow_the_equal_to_the_best_rule(name):
    """A logit equal to the draft's counts 1: -inf adds nothing beside a finite best, three
    allowed -inf logits give 1/3, two +inf give 1/2 (every backend the same: the cuda
    kernels' rule too)."""
    be = get_backend(name)
    H, V = 1, 70
    x = np.ones((3, H), np.float32)
    w = np.full((V, H), -1.0, np.float32)
    out = []
    for case in ("finite", "all -inf", "two +inf"):
        ww = w.copy()
        if case == "finite":
            ww[:10, 0] = -np.inf
        elif case == "all -inf":
            ww[:, 0] = -np.inf
        else:
            ww[[3, 67], 0] = np.inf
        conf = np.zeros(3, np.float32)
        mask = None if case != "all -inf" else np.array([[0b111, 0, 0]] * 3, np.int32)   # tokens 0, 1, 2
        be.lm_head_argmax(x, be.prepare_weight(ww), mask, conf=conf)
        out.append(float(conf[0]))
    assert_close(np.array(out), np.array([1 / 60, 1 / 3, 1 / 2]), what="confidences with infinite logits")


# -- the proposer: out_conf and early stop ---------------------------------------------------------

from conftest import kv_rows, rand_hiddens  # noqa: E402

from mtpkern import MultiModuleMtpHead  # noqa: E402


def _fingerprint(prop, st):
    return (st.rows_per_module(), [s.keys.to_list() for s in st.kv], st.num_verified, st.num_hiddens,
            [kv_rows(prop, st, m) for m in range(prop.num_modules)])


def _same(p0, s0, p1, s1):
    """The same rows, keys and counters; the same KV values (a batch of rows and one row
    sum their GEMVs in other orders: equal to FP32 rounding)."""
    f0, f1 = _fingerprint(p0, s0), _fingerprint(p1, s1)
    assert f0[:4] == f1[:4]
    for (k0, v0), (k1, v1) in zip(f0[4], f1[4]):
        assert_close(k0, k1, what="K rows")
        assert_close(v0, v1, what="V rows")


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
@pytest.mark.parametrize("mode", ["exact", "draft"])
@pytest.mark.parametrize("ckpt", ["tiny_ckpt", "mla_ckpt"])
def test_an_early_stop_is_a_propose_of_that_many_drafts(backend, mode, ckpt, request):
    """A batch with ``min_confidence``: each sequence ends at its first draft below it, and
    its drafts, confidences, rows, keys and KV equal those of its own propose asking for
    that many drafts; later rounds (verify, catch-up, propose) stay equal too."""
    path = request.getfixturevalue(ckpt)
    kw = dict(backend=backend, kv_mode=mode, block_size=4, num_blocks=128)
    stop, plain = MultiModuleMtpHead.from_pretrained(path, **kw), MultiModuleMtpHead.from_pretrained(path, **kw)
    rng = np.random.default_rng(5)
    H, V, B = stop.config.hidden_size, stop.config.vocab_size, 4
    s0, s1 = [stop.alloc_state() for _ in range(B)], [plain.alloc_state() for _ in range(B)]
    pos = []
    for a, b in zip(s0, s1):
        n = int(rng.integers(5, 12))
        toks, hid = rng.integers(0, V, n).tolist(), rand_hiddens(rng, n, H)
        stop.prefill_drafter(toks, hid, a)
        plain.prefill_drafter(toks, hid, b)
        pos.append(n)
    lengths = set()
    for round_ in range(6):
        last, hs = rng.integers(0, V, B).tolist(), rand_hiddens(rng, B, H)
        thr = [0.6, 0.3, 0.9, 0.45, 0.75, 0.2][round_]
        conf: list = []
        d0 = stop.propose_batch(last, hs, pos, 3, s0, out_conf=conf, min_confidence=thr)
        for i, (a, b) in enumerate(zip(s0, s1)):
            c1: list = []
            d1 = plain.propose(last[i], hs[i], pos[i], len(d0[i]), b, out_conf=c1)
            assert d0[i] == d1
            assert_close(np.array(conf[i]), np.array(c1), what="confidences")
            assert all(c >= np.float32(thr) for c in conf[i][:-1]) and (len(d0[i]) == 3 or conf[i][-1] < thr)
            lengths.add(len(d0[i]))
            _same(stop, a, plain, b)
            acc = int(rng.integers(0, len(d0[i]) + 1))
            for p, st in ((stop, a), (plain, b)):
                p.after_verify(acc, st)
                p.catchup_drafter(d0[i][:acc], rand_hiddens(np.random.default_rng(round_ * 10 + i), acc, H), st)
            _same(stop, a, plain, b)
            pos[i] += 1 + acc
        stop.check_invariants()
        plain.check_invariants()
    assert len(lengths) >= 2, f"the thresholds stopped nothing early (lengths {lengths}): the test tests nothing"
    assert stop.stats.drafted == plain.stats.drafted and stop.stats.accepted == plain.stats.accepted


@pytest.mark.parametrize("name", ["numpy", "cpu"])
def test_min_confidence_is_checked(name, tiny_ckpt):
    prop = MultiModuleMtpHead.from_pretrained(tiny_ckpt, backend=name, block_size=4, num_blocks=32)
    st = prop.alloc_state()
    rng = np.random.default_rng(0)
    prop.prefill_drafter(rng.integers(0, 301, 6).tolist(), rand_hiddens(rng, 6, 64), st)
    for bad in (1.5, -0.1, "0.5", True, float("nan")):
        with pytest.raises(ValueError, match="min_confidence: expected a number in \\[0, 1\\]"):
            prop.propose(1, rand_hiddens(rng, 1, 64)[0], 6, 3, st, min_confidence=bad)
    with pytest.raises(TypeError, match="out_conf: expected a list"):
        prop.propose(1, rand_hiddens(rng, 1, 64)[0], 6, 3, st, out_conf=())
    assert prop.propose(1, rand_hiddens(rng, 1, 64)[0], 6, 3, st, min_confidence=0.0) and st.rows_per_module()
    prop.check_invariants()
