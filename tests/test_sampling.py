"""Sampled drafts (mtpkern.ops.sampling): the reference against an FP64 formula written here,
the draws against the distribution, the cpu kernel against the reference bit for bit in the
drafts, top_k = 1 = the argmax, grammar masks and draft vocabularies, the proposer's
``sampling=`` / ``out_prob=`` / ``out_dist=``, and negative controls that show the checks
can fail."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mtpkern import MultiModuleMtpHead, NoAllowedToken, SamplingParams
from mtpkern.backends import get_backend
from mtpkern.ops import lm_head as ref_lm
from mtpkern.ops import sampling as S

from conftest import rand_hiddens


def q64(l, allowed, T, top_k=0, top_p=1.0):
    """The draft distribution of one row, written out from the definition (finite logits)."""
    l = np.asarray(l, np.float64)
    cand = [v for v in range(l.size) if allowed[v]]
    cand.sort(key=lambda v: (-l[v], v))
    if top_k:
        cand = cand[:top_k]
    z = {v: l[v] / T for v in cand}
    m = max(z.values())
    w = {v: math.exp(z[v] - m) for v in cand}
    if top_p < 1.0:
        tot, run, kept = sum(w[v] for v in cand), 0.0, []
        for v in cand:
            kept.append(v)
            run += w[v]
            if run >= top_p * tot:
                break
        cand = kept
    tot = sum(w[v] for v in cand)
    q = np.zeros(l.size)
    for v in cand:
        q[v] = w[v] / tot
    return q


def params_for(n, T=0.8, top_k=0, top_p=1.0, seed=0):
    ps = [SamplingParams(T, top_k, top_p, seed + i) for i in range(n)]
    return ps, S.row_keys(ps, list(range(5, 5 + n)), 0)


def sample(be, logits, ps, keys, bitmask=None, id_map=None, dist=None):
    """``lm_head_sample`` over given logits: x = I, w = logits^T (each logit is one product)."""
    n, V = logits.shape
    x = np.eye(n, dtype=np.float32)
    w = np.ascontiguousarray(logits.T)
    T, K, P = S.check_params("sampling", ps, n)
    return be.lm_head_sample(x, be.prepare_weight(w), bitmask, keys=keys, temperature=T, top_k=K, top_p=P,
                             id_map=id_map, dist=dist)


@pytest.mark.parametrize("T,top_k,top_p", [(1.0, 0, 1.0), (0.6, 0, 1.0), (1.7, 5, 1.0), (0.9, 0, 0.7),
                                           (1.2, 8, 0.5), (0.5, 0, 0.05)])
def test_reference_distribution_is_the_formula(T, top_k, top_p):
    rng = np.random.default_rng(1)
    n, V = 6, 29
    logits = (rng.standard_normal((n, V)) * 2).astype(np.float32)
    bm = rng.integers(-2**31, 2**31, (n, 1), dtype=np.int64).astype(np.int32)
    allowed = ref_lm.bitmask_allowed(bm, V)
    ps, keys = params_for(n, T, top_k, top_p)
    ids, probs, dist = S.masked_sample(logits, bm, keys, *S.check_params("s", ps, n), want_dist=True)
    for r in range(n):
        q = q64(logits[r], allowed[r], T, top_k, top_p)
        np.testing.assert_allclose(dist[r], q, rtol=1e-6, atol=1e-7)
        assert q[ids[r]] > 0 and allowed[r, ids[r]]
        np.testing.assert_allclose(probs[r], q[ids[r]], rtol=1e-6)


def test_draws_follow_the_distribution():
    """Over 4000 seeds on a vocabulary of 6, the drafts' frequencies match ``q`` (a chi-square
    statistic far below its 5-degrees-of-freedom tail); with top_k / top_p the cut tokens
    never come."""
    logits = np.array([[1.0, 0.2, -0.5, 1.4, 0.0, -1.0]], np.float32)
    N = 4000
    for T, top_k, top_p in ((0.8, 0, 1.0), (1.5, 4, 0.9)):
        q = q64(logits[0], [True] * 6, T, top_k, top_p)
        counts = np.zeros(6)
        for seed in range(N):
            ps = [SamplingParams(T, top_k, top_p, seed)]
            ids, probs, _ = S.masked_sample(logits, None, S.row_keys(ps, [3], 1), *S.check_params("s", ps, 1))
            counts[ids[0]] += 1
            assert probs[0] == pytest.approx(q[ids[0]], rel=1e-6)
        live = q > 0
        assert counts[~live].sum() == 0
        chi2 = (((counts - N * q) ** 2)[live] / (N * q[live])).sum()
        assert chi2 < 25.0, (T, top_k, top_p, counts, N * q, chi2)     # p < 1e-4 at 5 dof


def test_noise_not_keyed_on_the_position_is_detected(monkeypatch):
    """The check the draws depend on (position, step): with a key that ignores them, two
    positions draw identical drafts on every seed; the real key gives different ones."""
    logits = np.zeros((1, 50), np.float32)                               # uniform: only the noise decides

    def draws(keyfn):
        out = []
        for seed in range(40):
            ps = [SamplingParams(1.0, seed=seed)]
            a = S.masked_sample(logits, None, keyfn(ps, 7), *S.check_params("s", ps, 1))[0][0]
            b = S.masked_sample(logits, None, keyfn(ps, 8), *S.check_params("s", ps, 1))[0][0]
            out.append(a == b)
        return out

    assert sum(draws(lambda ps, p: S.row_keys(ps, [p], 0))) < 10
    assert all(draws(lambda ps, p: np.array([S.mix64(ps[0].seed)], np.uint64)))    # the control fails
    ps = [SamplingParams(1.0, seed=3)]
    steps = {int(S.masked_sample(logits, None, S.row_keys(ps, [7], m), *S.check_params("s", ps, 1))[0][0])
             for m in range(6)}
    assert len(steps) > 1, "the draft step does not reach the noise"


def test_wrong_normalisation_is_detected():
    """The formula check catches a probability normalised over the whole vocabulary instead of
    the top-p set (the mistake an engine's rejection sampling would then divide by)."""
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((1, 20)).astype(np.float32)
    ps, keys = params_for(1, 1.0, 0, 0.6)
    ids, probs, _ = S.masked_sample(logits, None, keys, *S.check_params("s", ps, 1))
    good = q64(logits[0], [True] * 20, 1.0, 0, 0.6)[ids[0]]
    wrong = q64(logits[0], [True] * 20, 1.0)[ids[0]]
    assert probs[0] == pytest.approx(good, rel=1e-6)
    assert probs[0] != pytest.approx(wrong, rel=1e-3)


@pytest.mark.parametrize("V", [1, 19, 99, 989])
def test_cpu_equals_numpy(V):
    """The cpu kernel draws the reference's drafts bit for bit (the same hash) and its
    probabilities and distributions to FP32 rounding; with a mask, a draft vocabulary, ties
    and top_k / top_p."""
    rng = np.random.default_rng(V)
    n = 7
    logits = np.round(rng.standard_normal((n, V)) * 4).astype(np.float32) / 2     # many ties
    bm = rng.integers(-2**31, 2**31, (n, (V + 31) // 32), dtype=np.int64).astype(np.int32)
    bm[:, 0] |= 1                                                        # token 0 always allowed
    id_map = np.sort(rng.choice(4 * V, V, replace=False)).astype(np.int32)
    ps = [SamplingParams(float(T), int(k), float(p), int(s)) for T, k, p, s in
          zip(rng.uniform(0.2, 2.0, n), [0, 1, 3, 0, 7, 0, 2], [1.0, 1.0, 1.0, 0.6, 0.9, 0.3, 0.8], range(n))]
    keys = S.row_keys(ps, rng.integers(1, 1000, n).tolist(), 2)
    npb, cpu = get_backend("numpy"), get_backend("cpu")
    for mask, imap in ((None, None), (bm, None), (bm, id_map)):
        d0, d1 = np.empty((n, V), np.float32), np.empty((n, V), np.float32)
        i0, p0 = sample(npb, logits, ps, keys, mask, imap, d0)
        i1, p1 = sample(cpu, logits, ps, keys, mask, imap, d1)
        np.testing.assert_array_equal(i0, i1)
        np.testing.assert_allclose(p0, p1, rtol=2e-7)
        np.testing.assert_allclose(d0, d1, rtol=2e-7, atol=1e-30)


@pytest.mark.parametrize("V", [1, 2, 33, 2049, 40000])
def test_cpu_top_p_order_is_the_stable_sort(V):
    """top_p without top_k (the cpu kernel's radix sort of packed keys): the rank order equals
    the reference's stable sort of -logit (ties, -0 and +0 tied, +-inf, every radix digit in
    use at V = 40000), and the drafts, probabilities and distributions equal the reference's
    bit for bit (the running sums are added in the same order). Negative control: the same
    keys ordered with ties to the higher id give another order."""
    from mtpkern.backends.cpu_kernels.sampling import _rank_order, sample_kernel

    rng = np.random.default_rng(V)
    n = 4
    logits = (rng.standard_normal((n, V)) * 3).astype(np.float32)
    logits[1] = np.round(logits[1] * 2) / 2                              # ties
    logits[2, rng.random(V) < 0.2] = -0.0
    logits[2, rng.random(V) < 0.2] = 0.0
    logits[2, rng.random(V) < 0.05] = np.inf
    logits[3, rng.random(V) < 0.3] = -np.inf
    cand = np.arange(V, dtype=np.int64)
    for r in range(n):
        want = np.argsort(-logits[r].astype(np.float64), kind="mergesort")
        np.testing.assert_array_equal(_rank_order(logits[r].view(np.uint32), cand, V), want)
    if V >= 33:                                                          # ties present: the control bites
        ties_high = np.lexsort((-cand, -logits[1].astype(np.float64)))
        assert (ties_high != _rank_order(logits[1].view(np.uint32), cand, V)).any()
    ps = [SamplingParams(T, 0, p, seed=s) for T, p, s in ((0.8, 0.95, 1), (1.3, 0.5, 2), (0.7, 0.9, 3),
                                                           (1.0, 0.3, 4))]
    keys = S.row_keys(ps, [5, 6, 7, 8], 0)
    T, K, P = S.check_params("sampling", ps, n)
    i0, p0, d0 = S.masked_sample(logits, None, keys, T, K, P, want_dist=True)   # the logits as they are:
    i1, p1, d1 = np.empty(n, np.int32), np.empty(n, np.float32), np.empty((n, V), np.float32)   # no GEMV's 0 * inf
    assert sample_kernel(logits, np.zeros((0, 0), np.int32), np.arange(V, dtype=np.int32), keys, T, K, P, i1, p1,
                         d1) == -1
    np.testing.assert_array_equal(i1, i0)
    assert p1.tobytes() == p0.tobytes() and d1.tobytes() == d0.tobytes()


@pytest.mark.parametrize("name", ["numpy", "cpu"])
def test_top_k_1_is_the_argmax(name):
    be = get_backend(name)
    rng = np.random.default_rng(4)
    n, V = 9, 77
    logits = np.round(rng.standard_normal((n, V)) * 3).astype(np.float32)        # ties: the lowest id
    bm = rng.integers(-2**31, 2**31, (n, 3), dtype=np.int64).astype(np.int32)
    for T in (0.05, 1.0, 30.0):
        ps, keys = params_for(n, T, 1, 1.0, seed=int(T * 100))
        for mask in (None, bm):
            ids, probs = sample(be, logits, ps, keys, mask)
            np.testing.assert_array_equal(ids, ref_lm.masked_argmax(logits, mask))
            assert (probs == 1.0).all()


@pytest.mark.parametrize("name", ["numpy", "cpu"])
def test_the_mask_composes_and_empty_rows_raise(name):
    be = get_backend(name)
    rng = np.random.default_rng(6)
    n, V = 4, 40
    logits = rng.standard_normal((n, V)).astype(np.float32)
    bm = np.zeros((n, 2), np.int32)
    bm[:, 0] = 0b1010_0000                                             # tokens 5 and 7
    for seed in range(30):
        ps, keys = params_for(n, 1.0, 0, 1.0, seed * n)
        d = np.empty((n, V), np.float32)
        ids, probs = sample(be, logits, ps, keys, bm, dist=d)
        assert set(ids.tolist()) <= {5, 7}
        assert (d[:, [5, 7]].sum(1) == pytest.approx(1.0)) and (np.delete(d, [5, 7], axis=1) == 0).all()
    bm[2] = 0
    with pytest.raises(NoAllowedToken, match="row 2"):
        sample(be, logits, *params_for(n), bm)


def test_sampling_params_are_validated_by_name():
    for kw, msg in (({"temperature": 0.0}, "temperature: expected a finite number > 0, got 0.0"),
                    ({"temperature": float("inf")}, "temperature"), ({"temperature": True}, "temperature"),
                    ({"temperature": 1.0, "top_k": -1}, "top_k: expected an int in \\[0, 2\\^31\\)"),
                    ({"temperature": 1.0, "top_k": 1.5}, "top_k"),
                    ({"temperature": 1.0, "top_p": 0.0}, "top_p: expected a number in \\(0, 1\\], got 0.0"),
                    ({"temperature": 1.0, "top_p": 1.01}, "top_p"),
                    ({"temperature": 1.0, "seed": -1}, "seed: expected an int in \\[0, 2\\^64\\), got -1"),
                    ({"temperature": 1.0, "seed": 2**64}, "seed")):
        with pytest.raises(ValueError, match=msg):
            SamplingParams(**kw)
    sp = SamplingParams(1, np.int64(3), 1, np.uint64(5))
    assert (sp.temperature, sp.top_k, sp.top_p, sp.seed) == (1.0, 3, 1.0, 5)
    with pytest.raises(AttributeError):
        sp.temperature = 2.0                                             # frozen


# -- the proposer ---------------------------------------------------------------------------------

def _two(path, backend):
    kw = dict(backend=backend, kv_mode="exact", block_size=4, num_blocks=64)
    return MultiModuleMtpHead.from_pretrained(path, **kw), MultiModuleMtpHead.from_pretrained(path, **kw)


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_propose_sampled(backend, tiny_ckpt):
    """A batch with one argmax sequence and two sampled ones: the argmax one equals a plain
    propose (probability 1, one-hot distribution); a sampled one draws what its own propose
    with the same params draws (same seed, position, step), its probabilities are its distributions at
    the drafts, each summing to 1; a new seed changes the drafts."""
    a, b = _two(tiny_ckpt, backend)
    rng = np.random.default_rng(3)
    H, V, B = a.config.hidden_size, a.config.vocab_size, 3
    sa, sb = [a.alloc_state() for _ in range(B)], [b.alloc_state() for _ in range(B)]
    for x, y in zip(sa, sb):
        toks, hid = rng.integers(0, V, 7).tolist(), rand_hiddens(rng, 7, H)
        a.prefill_drafter(toks, hid, x)
        b.prefill_drafter(toks, hid, y)
    last, hs, pos = rng.integers(0, V, B).tolist(), rand_hiddens(rng, B, H), [7] * B
    sp = [None, SamplingParams(1.5, seed=11), SamplingParams(0.9, top_k=20, top_p=0.9, seed=12)]
    prob, dist, conf = [], [], []
    d = a.propose_batch(last, hs, pos, 3, sa, sampling=sp, out_prob=prob, out_dist=dist, out_conf=conf)
    for i in range(B):
        p1, q1 = [], []
        if sp[i] is None:
            assert d[i] == b.propose(last[i], hs[i], pos[i], 3, sb[i])
        else:
            assert d[i] == b.propose(last[i], hs[i], pos[i], 3, sb[i], sampling=sp[i], out_prob=p1, out_dist=q1)
            assert prob[i] == conf[i]                     # a batch's hidden rows: equal to FP32 rounding
            np.testing.assert_allclose(prob[i], p1, rtol=1e-4)
            for x, y in zip(dist[i], q1):
                np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-9)
        for t, p, q in zip(d[i], prob[i], dist[i]):
            assert q.shape == (V,) and q.sum() == pytest.approx(1.0, rel=1e-5)
            assert p == q[t] and (p == 1.0) == (sp[i] is None or q.max() == 1.0)
    a.check_invariants()
    # other seeds draw other drafts from the same sequence (a high temperature: near uniform)
    toks, hid = rng.integers(0, V, 7).tolist(), rand_hiddens(rng, 7, H)
    same = [b.alloc_state() for _ in range(6)]
    for st in same:
        b.prefill_drafter(toks, hid, st)
    d = b.propose_batch([last[1]] * 6, np.repeat(hs[1:2], 6, 0), [7] * 6, 3, same,
                        sampling=[SamplingParams(50.0, seed=s) for s in range(6)])
    assert len({tuple(x) for x in d}) > 1
    b.check_invariants()


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_greedy_stays_bit_identical(backend, tiny_ckpt):
    """sampling=None and sampling=[None, ...] give the drafts of a call without the keyword."""
    a, b = _two(tiny_ckpt, backend)
    rng = np.random.default_rng(8)
    H, V = a.config.hidden_size, a.config.vocab_size
    x, y = a.alloc_state(), b.alloc_state()
    toks, hid = rng.integers(0, V, 6).tolist(), rand_hiddens(rng, 6, H)
    a.prefill_drafter(toks, hid, x)
    b.prefill_drafter(toks, hid, y)
    h = rand_hiddens(rng, 1, H)
    prob: list = []
    assert a.propose_batch([3], h, [6], 3, [x], sampling=[None], out_prob=prob) == [b.propose(3, h[0], 6, 3, y)]
    assert prob == [[1.0] * 3]


def test_sampling_with_a_grammar_mask_and_refusals(tiny_ckpt):
    prop = MultiModuleMtpHead.from_pretrained(tiny_ckpt, backend="numpy", block_size=4, num_blocks=32)
    st = prop.alloc_state()
    rng = np.random.default_rng(0)
    H, V = prop.config.hidden_size, prop.config.vocab_size
    prop.prefill_drafter(rng.integers(0, V, 6).tolist(), rand_hiddens(rng, 6, H), st)
    mask = np.zeros(prop.config.bitmask_words, np.int32)
    mask[1] = 0b1011                                                    # tokens 32, 33, 35
    got = set()
    for seed in range(8):
        prob: list = []
        d = prop.propose(1, rand_hiddens(rng, 1, H)[0], 6 + seed, 1, st, grammar_bitmask=mask,
                         sampling=SamplingParams(3.0, seed=seed), out_prob=prob)
        assert d[0] in (32, 33, 35) and 0 < prob[0] < 1
        got.add(d[0])
        prop.after_verify(0, st)
    assert len(got) > 1
    P = 14
    with pytest.raises(TypeError, match="sampling: expected a SamplingParams"):
        prop.propose(1, rand_hiddens(rng, 1, H)[0], P, 1, st, sampling=0.7)
    with pytest.raises(TypeError, match="out_prob: expected a list"):
        prop.propose(1, rand_hiddens(rng, 1, H)[0], P, 1, st, out_prob=())
    with pytest.raises(ValueError, match="sampling: expected 1 entries"):
        prop.propose_batch([1], rand_hiddens(rng, 1, H), [P], 1, [st], sampling=[None, None])
    prop.check_invariants()


@pytest.mark.parametrize("size", [2, 4])
def test_sharded_head_samples_the_single_rank_drafts(tiny_ckpt, size):
    """Every rank of a vocabulary-parallel head draws the one-rank head's drafts, with its
    probabilities and distributions (a grammar mask, top_k / top_p, a greedy sequence beside)."""
    from comm_cases import ThreadWorld

    sp = [SamplingParams(1.4, seed=3), None, SamplingParams(0.8, top_k=30, top_p=0.85, seed=4)]

    def run(comm):
        prop = MultiModuleMtpHead.from_pretrained(tiny_ckpt, backend="numpy", comm=comm, block_size=4, num_blocks=64)
        rng = np.random.default_rng(0)
        H, V = prop.config.hidden_size, prop.config.vocab_size
        sts = [prop.alloc_state() for _ in sp]
        for st in sts:
            prop.prefill_drafter(rng.integers(0, V, 6).tolist(), rand_hiddens(rng, 6, H), st)
        mask = np.full(prop.config.bitmask_words, -1, np.int32)
        mask[2] = 0                                                     # tokens 64..95 never
        out = []
        for r in range(3):
            prob, dist = [], []
            d = prop.propose_batch([1, 2, 3], rand_hiddens(rng, 3, H), [6 + r] * 3, 3, sts,
                                   [mask, None, mask], sampling=sp, out_prob=prob, out_dist=dist)
            out.append((d, prob, dist))
            for st in sts:
                prop.after_verify(0, st)
        return out

    one = run(None)
    for got in ThreadWorld(size, timeout=20).run(run):
        for (d0, p0, q0), (d1, p1, q1) in zip(one, got):
            assert d0 == d1
            np.testing.assert_allclose(np.array(p0), np.array(p1), rtol=1e-5)
            for a, b in zip(q0, q1):
                np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-9)
    assert all(not (64 <= t < 96) for d, _, _ in one for i in (0, 2) for t in d[i])


def test_a_backend_without_sampling_refuses_by_name(tiny_ckpt, monkeypatch):
    prop = MultiModuleMtpHead.from_pretrained(tiny_ckpt, backend="numpy", block_size=4, num_blocks=32)
    monkeypatch.setattr(type(prop.backend), "samples", False)
    st = prop.alloc_state()
    rng = np.random.default_rng(0)
    H, V = prop.config.hidden_size, prop.config.vocab_size
    prop.prefill_drafter(rng.integers(0, V, 6).tolist(), rand_hiddens(rng, 6, H), st)
    with pytest.raises(NotImplementedError, match="sampling: the numpy backend does not sample drafts"):
        prop.propose(1, rand_hiddens(rng, 1, H)[0], 6, 2, st, sampling=SamplingParams(0.7))
    assert prop.propose(1, rand_hiddens(rng, 1, H)[0], 6, 2, st)
    prop.check_invariants()


def _doc_accept():
    """``accept_sampled`` as docs/api.md prints it (the block under "Sampled drafts")."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).parents[1] / "docs" / "api.md").read_text()
    block = re.search(r"```python\n(import numpy as np\nfrom mtpkern import SamplingParams\n\n"
                      r"def accept_sampled.*?)\n\nprobs, dists", text, re.S).group(1)
    ns: dict = {}
    exec(block, ns)
    return ns["accept_sampled"]


def test_the_documented_rejection_loop_samples_the_target():
    """The first token the docs' loop appends is distributed as the target's ``p`` when the
    drafts and ``q(draft)`` come from ``masked_sample``; the control, dividing by 1 (what an
    argmax draft would claim), is caught by the same statistic."""
    accept = _doc_accept()
    logits = np.array([[0.5, 1.5, -0.3, 0.9, 0.0]], np.float32)
    p = np.array([0.1, 0.3, 0.25, 0.15, 0.2])
    rng = np.random.default_rng(0)
    N = 4000

    def freq(claimed_one: bool):
        counts = np.zeros(5)
        for seed in range(N):
            ps = [SamplingParams(1.3, seed=seed)]
            ids, probs, dist = S.masked_sample(logits, None, S.row_keys(ps, [9], 0), *S.check_params("s", ps, 1),
                                               want_dist=True)
            qp = 1.0 if claimed_one else float(probs[0])
            counts[accept([int(ids[0])], [qp], [dist[0]], [p], p, rng)[0]] += 1
        return (((counts - N * p) ** 2) / (N * p)).sum()

    assert freq(False) < 25.0                                           # chi-square, 4 dof: p < 1e-4
    assert freq(True) > 100.0


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_sampling_with_a_draft_vocabulary(backend, tiny_ckpt):
    """The noise is keyed on target ids: a draft vocabulary holding the whole vocabulary (in any
    order) draws the drafts of the head without one; a subset draws only its tokens, and its
    distributions are zero outside it."""
    V = 301
    rng = np.random.default_rng(12)
    sub_ids = np.sort(rng.choice(V, 40, replace=False))
    kw = dict(backend=backend, block_size=4, num_blocks=64)
    plain = MultiModuleMtpHead.from_pretrained(tiny_ckpt, **kw)
    whole = MultiModuleMtpHead.from_pretrained(tiny_ckpt, draft_vocab=np.arange(V)[::-1], **kw)
    sub = MultiModuleMtpHead.from_pretrained(tiny_ckpt, draft_vocab=sub_ids, **kw)
    H = plain.config.hidden_size
    assert plain.config.vocab_size == V
    toks, hid = rng.integers(0, V, 6).tolist(), rand_hiddens(rng, 6, H)
    sts = [p.alloc_state() for p in (plain, whole, sub)]
    for p, st in zip((plain, whole, sub), sts):
        p.prefill_drafter(toks, hid, st)
    for r in range(4):
        h, sp = rand_hiddens(rng, 1, H)[0], SamplingParams(2.0, seed=r)
        dists: list = []
        d = [p.propose(5, h, 6 + r, 3, st, sampling=sp, out_dist=dists if p is sub else None)
             for p, st in zip((plain, whole, sub), sts)]
        assert d[0] == d[1]
        assert set(d[2]) <= set(sub_ids.tolist())
        outside = np.setdiff1d(np.arange(V), sub_ids)
        assert all((q[outside] == 0).all() and q.sum() == pytest.approx(1.0, rel=1e-5) for q in dists)
        for p, st in zip((plain, whole, sub), sts):
            p.after_verify(0, st)


@pytest.mark.parametrize("name", ["numpy", "cpu"])
def test_bad_op_arguments_are_refused_by_name(name):
    be = get_backend(name)
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, 10)).astype(np.float32)
    ps, keys = params_for(3)
    with pytest.raises(ValueError, match=r"keys: expected \[3\] uint64, got \[3\] int64"):
        sample(be, logits, ps, keys.astype(np.int64))
    with pytest.raises(ValueError, match=r"dist: expected shape \[3, 10\]"):
        sample(be, logits, ps, keys, dist=np.empty((3, 9), np.float32))
    with pytest.raises(ValueError, match=r"id_map: expected shape \[10\]"):
        sample(be, logits, ps, keys, id_map=np.arange(9, dtype=np.int32))
    T, K, P = S.check_params("sampling", ps, 3)
    with pytest.raises(ValueError, match=r"temperature: expected shape \[3\]"):
        be.lm_head_sample(np.eye(3, dtype=np.float32), be.prepare_weight(np.ascontiguousarray(logits.T)), keys=keys,
                          temperature=T[:2], top_k=K, top_p=P)
    with pytest.raises(TypeError, match="sampling: expected 3 SamplingParams"):
        S.check_params("sampling", ps[:2], 3)


class _Refusing(list):
    def __setitem__(self, i, v):
        raise RuntimeError("refused")


@pytest.mark.parametrize("which", ["out_prob", "out_dist"])
def test_a_failed_output_write_changes_nothing(which, tiny_ckpt):
    """An output list that refuses the write fails the call: the state and the list are as
    before, and the same call then succeeds with the drafts it would have drawn."""
    prop = MultiModuleMtpHead.from_pretrained(tiny_ckpt, backend="numpy", block_size=4, num_blocks=32)
    st = prop.alloc_state()
    rng = np.random.default_rng(1)
    H, V = prop.config.hidden_size, prop.config.vocab_size
    prop.prefill_drafter(rng.integers(0, V, 6).tolist(), rand_hiddens(rng, 6, H), st)
    h, sp = rand_hiddens(rng, 1, H)[0], SamplingParams(1.0, seed=9)
    before = (st.rows_per_module(), st.num_verified)
    bad = _Refusing([0.5])
    with pytest.raises(RuntimeError, match="refused"):
        prop.propose(1, h, 6, 3, st, sampling=sp, **{which: bad})
    assert (st.rows_per_module(), st.num_verified) == before and list(bad) == [0.5]
    prop.check_invariants()
    got: list = []
    assert len(prop.propose(1, h, 6, 3, st, sampling=sp, **{which: got})) == 3 and len(got) == 3


@pytest.mark.parametrize("name", ["numpy", "cpu"])
def test_top_k_ties_keep_the_lowest_ids(name):
    """All logits equal: top_k keeps the k lowest allowed ids (the tie rule), each 1 / k."""
    be = get_backend(name)
    n, V = 3, 50
    logits = np.zeros((n, V), np.float32)
    bm = np.full((n, 2), -1, np.int32)
    bm[:, 0] = ~0b1011                                                  # tokens 0, 1, 3 not allowed
    ps, keys = params_for(n, 1.0, 5, 1.0)
    d = np.empty((n, V), np.float32)
    ids, probs = sample(be, logits, ps, keys, bm, dist=d)
    kept = [2, 4, 5, 6, 7]
    assert set(ids.tolist()) <= set(kept) and np.allclose(probs, 0.2)
    np.testing.assert_allclose(d[:, kept], 0.2, rtol=1e-6)
    assert d.sum() == pytest.approx(n, rel=1e-6)
