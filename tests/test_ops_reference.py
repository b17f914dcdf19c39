"""Each NumPy reference op against an independent, straightforward formula."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from mtpkern import NoAllowedToken
from mtpkern.ops import attention, gate, linear, lm_head, mlp, moe, norm, rope_kv

rng = np.random.default_rng(0)


def f32(*shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


@pytest.mark.parametrize("n,H", [(1, 1), (3, 17), (5, 1000)])
def test_rmsnorm(n, H):
    x, w = f32(n, H), f32(H)
    for i in range(n):                                   # per row, a Python loop over elements
        ms = sum(float(v) ** 2 for v in x[i]) / H
        want = [float(v) / np.sqrt(ms + 1e-6) * float(wj) for v, wj in zip(x[i], w)]
        np.testing.assert_allclose(norm.rmsnorm(x, w, 1e-6)[i], want, rtol=1e-5, atol=1e-6)


def test_mtp_input_concat_order():
    V, H, n = 11, 6, 3
    E, g, we, wh, eh = f32(V, H), f32(n, H), f32(H), f32(H), f32(H, 2 * H)
    t = np.array([4, 0, 10], np.int32)
    got = norm.mtp_input(E, t, g, we, wh, eh, 1e-5)
    # eh_proj splits into the half reading enorm(E[t]) and the half reading hnorm(g).
    want = norm.rmsnorm(E[t], we, 1e-5) @ eh[:, :H].T + norm.rmsnorm(g, wh, 1e-5) @ eh[:, H:].T
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["bool", "int8", "uint8"])
def test_mtp_input_zero_embed(dtype):
    """Flagged rows: the embedding half zero (vLLM's position-0 mask: zeros before enorm, whose
    norm is zeros), so x = eh[:, H:] @ hnorm(g), against float64; a flagged row's token is never
    read (V itself, past the table, gives no IndexError). Unflagged rows: the unflagged call's
    bits."""
    V, H, n = 11, 6, 5
    E, g, we, wh, eh = f32(V, H), f32(n, H), f32(H), f32(H), f32(H, 2 * H)
    t = np.array([4, V, 10, 0, V], np.int32)
    z = np.array([0, 1, 0, 0, 2 if dtype != "bool" else 1]).astype(dtype)
    flagged = z != 0
    got = norm.mtp_input(E, t, g, we, wh, eh, 1e-5, zero_embed=z)
    keep = ~flagged

    def rms(x, w):                                                 # float64, row by row
        x = np.asarray(x, np.float64)
        return x / np.sqrt((x * x).mean(1, keepdims=True) + 1e-5) * np.asarray(w, np.float64)

    e = np.zeros((n, H))                                           # enorm(0) = 0 on flagged rows
    e[keep] = rms(E[t[keep]], we)
    want = np.concatenate([e, rms(g, wh)], 1) @ eh.astype(np.float64).T
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[flagged], rms(g[flagged], wh) @ eh[:, H:].T.astype(np.float64),
                               rtol=1e-5, atol=1e-5)
    t_ok = np.where(flagged, 3, t)
    np.testing.assert_array_equal(got[keep], norm.mtp_input(E, t_ok, g, we, wh, eh, 1e-5)[keep])
    # the negative control: the same rows unflagged differ
    assert not np.allclose(norm.mtp_input(E, t_ok, g, we, wh, eh, 1e-5)[flagged], got[flagged], atol=1e-3)


@pytest.mark.parametrize("bad,err,msg", [
    (np.zeros(4, bool), ValueError, r"zero_embed: expected shape \[3\], got \[4\]"),
    (np.zeros((3, 1), bool), ValueError, r"zero_embed: expected shape \[3\], got \[3, 1\]"),
    (np.zeros(3, np.int32), TypeError, "zero_embed: expected dtype bool or int8 or uint8, got int32"),
    (np.zeros(3, np.float32), TypeError, "zero_embed: expected dtype bool or int8 or uint8, got float32"),
    ([0, 1, 0], TypeError, r"zero_embed: expected None or a \[3\] bool / int8 / uint8 array, got list"),
])
def test_mtp_input_refuses_bad_zero_embed(bad, err, msg):
    V, H = 11, 6
    with pytest.raises(err, match=msg):
        norm.mtp_input(f32(V, H), np.array([1, 2, 3], np.int32), f32(3, H), f32(H), f32(H), f32(H, 2 * H), 1e-5,
                       zero_embed=bad)


def test_linear_bias_residual():
    x, w, b, r = f32(3, 7), f32(5, 7), f32(5), f32(3, 5)
    want = np.array([[sum(x[i, k] * w[j, k] for k in range(7)) + b[j] + r[i, j] for j in range(5)] for i in range(3)])
    np.testing.assert_allclose(linear.linear(x, w, b, r), want, rtol=1e-5, atol=1e-5)


def test_rope_is_a_rotation_of_complex_pairs():
    """Neox RoPE on the first R dims = multiplying (x_i + i x_{i+R/2}) by e^{i pos theta_i}."""
    D, R, theta = 16, 8, 500.0
    x = f32(4, 3, D)
    pos = np.array([0, 1, 7, 1000], np.int32)
    got = rope_kv.rope_neox(x, pos, rope_kv.inv_freq(R, theta))
    z = x[..., :R // 2] + 1j * x[..., R // 2:R]
    ang = pos[:, None, None] * theta ** (-np.arange(R // 2) * 2.0 / R)
    rz = z * np.exp(1j * ang)
    np.testing.assert_allclose(got[..., :R // 2], rz.real, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got[..., R // 2:R], rz.imag, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(got[..., R:], x[..., R:])
    np.testing.assert_array_equal(got[0], x[0])                      # position 0: identity


def test_interleaved_rope_rotates_adjacent_pairs_scaled():
    """Interleaved RoPE: (x_{2i} + i x_{2i+1}) times rope_scale e^{i pos theta_i}; dims past R
    untouched (unscaled)."""
    D, R, theta, sc = 14, 10, 500.0, 1.3
    x = f32(4, 3, D)
    pos = np.array([0, 1, 7, 1000], np.int32)
    got = rope_kv.rope(x, pos, rope_kv.inv_freq(R, theta), interleave=True, rope_scale=sc)
    z = x[..., 0:R:2] + 1j * x[..., 1:R:2]
    rz = z * sc * np.exp(1j * pos[:, None, None] * theta ** (-np.arange(R // 2) * 2.0 / R))
    np.testing.assert_allclose(got[..., 0:R:2], rz.real, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got[..., 1:R:2], rz.imag, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(got[..., R:], x[..., R:])


def _hf_yarn(dim, base, factor, omax, beta_fast=32, beta_slow=1, mscale=None, mscale_all_dim=None):
    """Hugging Face's ``_compute_yarn_parameters`` re-derived here, in float64, from its formulas:
    (inv_freq [dim/2], attention_factor)."""
    def get_mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
    if mscale and mscale_all_dim:
        att = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
    else:
        att = get_mscale(factor)
    corr = [dim * math.log(omax / (b * 2 * math.pi)) / (2 * math.log(base)) for b in (beta_fast, beta_slow)]
    low, high = max(math.floor(corr[0]), 0), min(math.ceil(corr[1]), dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = [base ** (2 * i / dim) for i in range(dim // 2)]
    out = []
    for i, pf in enumerate(pos_freqs):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        extrap = 1.0 - ramp                                  # HF's inv_freq_extrapolation_factor
        out.append((1.0 / (factor * pf)) * (1 - extrap) + (1.0 / pf) * extrap)
    return np.array(out), att


@pytest.mark.parametrize("dim,base,factor,omax,bf,bs", [(64, 10000.0, 40.0, 4096, 32, 1), (16, 10000.0, 8.0, 16, 32, 1),
                                                        (10, 5e5, 4.0, 64, 8, 2), (128, 1e6, 2.0, 32768, 32, 1)])
def test_yarn_inv_freq_matches_hugging_face(dim, base, factor, omax, bf, bs):
    want, _ = _hf_yarn(dim, base, factor, omax, bf, bs)
    got = rope_kv.yarn_inv_freq(dim, base, factor, omax, bf, bs)
    assert got.dtype == np.float32 and got.shape == (dim // 2,)
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=2e-7, atol=0)
    plain = rope_kv.inv_freq(dim, base).astype(np.float64)
    assert got[0] == np.float32(plain[0]) and np.isclose(got[-1], plain[-1] / factor, rtol=1e-6)


def test_yarn_mscale():
    assert rope_kv.yarn_mscale(1.0) == 1.0 and rope_kv.yarn_mscale(0.5, 3.0) == 1.0
    assert math.isclose(rope_kv.yarn_mscale(40.0, 1.0), 0.1 * math.log(40.0) + 1.0)
    assert math.isclose(rope_kv.yarn_mscale(40.0, 0.707), 0.0707 * math.log(40.0) + 1.0)


def test_qk_norm_rope_kv_write_slots_and_layout():
    Hq, Hkv, D, NB, BS = 4, 2, 8, 5, 3
    n = 4
    qkv = f32(n, (Hq + 2 * Hkv) * D)
    kc = np.zeros((NB, BS, Hkv, D), np.float32)
    vc = np.zeros_like(kc)
    slots = np.array([14, 0, 7, 5], np.int32)
    pos = np.array([3, 4, 5, 6], np.int32)
    inv = rope_kv.inv_freq(D, 10000.0)
    qn, kn = f32(D) + 1, f32(D) + 1
    q = rope_kv.qk_norm_rope_kv_write(qkv, Hq, Hkv, qn, kn, 1e-6, inv, pos, kc, vc, slots)
    for i, s in enumerate(slots):
        b, o = divmod(int(s), BS)
        v = qkv[i, (Hq + Hkv) * D:].reshape(Hkv, D)
        np.testing.assert_array_equal(vc[b, o], v)                  # V is moved untouched
        k = norm.rmsnorm(qkv[i, Hq * D:(Hq + Hkv) * D].reshape(Hkv, D), kn, 1e-6)
        np.testing.assert_allclose(kc[b, o], rope_kv.rope_neox(k[None], pos[i:i + 1], inv)[0], rtol=1e-5)
        qq = norm.rmsnorm(qkv[i, :Hq * D].reshape(Hq, D), qn, 1e-6)
        np.testing.assert_allclose(q[i], rope_kv.rope_neox(qq[None], pos[i:i + 1], inv)[0], rtol=1e-5)
    untouched = np.ones(NB * BS, bool)
    untouched[slots] = False
    assert not kc.reshape(NB * BS, -1)[untouched].any()


def test_paged_attention_matches_dense_causal():
    Hq, Hkv, D, BS = 6, 2, 8, 4
    lens = [1, 5, 9]
    NB = 12
    kc, vc = f32(NB, BS, Hkv, D), f32(NB, BS, Hkv, D)
    perm = rng.permutation(NB)
    tables = np.zeros((3, 3), np.int32)
    at = 0
    for s, L in enumerate(lens):
        nb = -(-L // BS)
        tables[s, :nb] = perm[at:at + nb]
        at += nb
    rows = [(0, 1), (1, 3), (1, 5), (2, 9), (2, 8)]           # (sequence, visible length)
    q = f32(len(rows), Hq, D)
    got = attention.paged_attention(q, kc, vc, tables, np.array([r[0] for r in rows], np.int32),
                                    np.array([r[1] for r in rows], np.int32), 0.3)
    for i, (s, L) in enumerate(rows):
        idx = np.arange(L)
        K = kc[tables[s, idx // BS], idx % BS]                  # [L, Hkv, D]
        Vv = vc[tables[s, idx // BS], idx % BS]
        for h in range(Hq):
            sc = np.array([0.3 * float(q[i, h] @ K[j, h // 3]) for j in range(L)])
            p = np.exp(sc - sc.max()) / np.exp(sc - sc.max()).sum()
            np.testing.assert_allclose(got[i].reshape(Hq, D)[h], p @ Vv[:, h // 3], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("Dv", [8, 5])
def test_paged_attention_window_sinks_as_a_softmax_with_an_extra_column(Dv):
    """A sliding window is a mask on the keys before ``row_start``; a sink is one more logit
    in each head's softmax whose value is 0 (gpt-oss: concatenate it, softmax, drop it), so
    the rows' weights no longer sum to 1; V may be Dv wide. The tables' entries for blocks
    wholly before every row's window are -1: never read."""
    Hq, Hkv, D, BS = 4, 2, 8, 4
    NB = 12
    kc, vc = f32(NB, BS, Hkv, D), f32(NB, BS, Hkv, Dv)
    tables = rng.permutation(NB)[:10].reshape(2, 5).astype(np.int32)
    rows = [(0, 20, 17), (0, 19, 12), (1, 6, 0), (1, 7, 6), (0, 13, 8)]   # (sequence, length, first row)
    tables[0, :2] = -1                                                 # rows of sequence 0 start at 8 or later
    sinks = np.array([1.5, -0.5, 20.0, -20.0], np.float32)
    q = f32(len(rows), Hq, D)
    got = attention.paged_attention(q, kc, vc, tables, np.array([r[0] for r in rows], np.int32),
                                    np.array([r[1] for r in rows], np.int32), 0.4,
                                    row_start=np.array([r[2] for r in rows], np.int32), sinks=sinks)
    assert got.shape == (len(rows), Hq * Dv)
    for i, (s, L, a) in enumerate(rows):
        for h in range(Hq):
            sc, vals = [], []
            for j in range(a, L):                                      # only the window's keys
                blk, off = tables[s, j // BS], j % BS
                sc.append(0.4 * float(q[i, h] @ kc[blk, off, h // 2]))
                vals.append(vc[blk, off, h // 2].astype(np.float64))
            z = np.array(sc + [float(sinks[h])])                       # the sink: one more logit
            p = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
            want = sum(pj * v for pj, v in zip(p[:-1], vals))          # ... with value 0
            np.testing.assert_allclose(got[i].reshape(Hq, Dv)[h], want, rtol=1e-4, atol=1e-6)
    # no sink and no window: what it was (weights sum to 1), bit for bit with the defaults
    full = np.array([r[1] for r in rows], np.int32)
    valid = np.arange(NB, dtype=np.int32)[:10].reshape(2, 5)
    plain = attention.paged_attention(q, kc, vc, valid, np.array([r[0] for r in rows], np.int32), full, 0.4)
    np.testing.assert_array_equal(plain, attention.paged_attention(
        q, kc, vc, valid, np.array([r[0] for r in rows], np.int32), full, 0.4,
        row_start=np.zeros(len(rows), np.int32)))
    with pytest.raises(ValueError, match=r"row_start\[1\]: expected 0 <= row_start < row_len\[1\] = 19, got 19"):
        attention.paged_attention(q, kc, vc, valid, np.array([r[0] for r in rows], np.int32), full, 0.4,
                                  row_start=np.array([0, 19, 0, 0, 0], np.int32))


def test_a_dominant_sink_shrinks_the_output_to_zero():
    kc, vc = f32(2, 4, 1, 8), f32(2, 4, 1, 8) + 3.0
    q = f32(1, 1, 8)
    args = (q, kc, vc, np.array([[0, 1]], np.int32), np.zeros(1, np.int32), np.array([7], np.int32), 0.3)
    base = attention.paged_attention(*args)
    for s, frac in ((-80.0, 1.0), (60.0, 0.0)):
        np.testing.assert_allclose(attention.paged_attention(*args, sinks=np.array([s], np.float32)), frac * base,
                                   atol=1e-20)


def test_qk_norm_rope_kv_write_value_dim_and_extra_columns():
    """V heads are Dv wide after the q and k heads; columns past them are left alone."""
    Hq, Hkv, D, Dv, extra, NB, BS = 3, 2, 8, 4, 6, 3, 2
    n = 3
    qkv = f32(n, (Hq + Hkv) * D + Hkv * Dv + extra)
    qkv[:, -extra:] = np.nan
    kc, vc = np.zeros((NB, BS, Hkv, D), np.float32), np.zeros((NB, BS, Hkv, Dv), np.float32)
    slots = np.array([5, 0, 3], np.int32)
    pos = np.array([1, 2, 3], np.int32)
    inv = rope_kv.inv_freq(D, 10000.0)
    q = rope_kv.qk_norm_rope_kv_write(qkv, Hq, Hkv, None, None, 1e-6, inv, pos, kc, vc, slots)
    for i, s in enumerate(slots):
        b, o = divmod(int(s), BS)
        np.testing.assert_array_equal(vc[b, o], qkv[i, (Hq + Hkv) * D:(Hq + Hkv) * D + Hkv * Dv].reshape(Hkv, Dv))
        k = qkv[i, Hq * D:(Hq + Hkv) * D].reshape(Hkv, D)
        np.testing.assert_allclose(kc[b, o], rope_kv.rope_neox(k[None], pos[i:i + 1], inv)[0], rtol=1e-6)
    assert np.isfinite(q).all() and np.isfinite(kc).all() and np.isfinite(vc).all()
    with pytest.raises(ValueError, match=r"qkv: expected \[n, at least \(Hq \+ Hkv\) \* D \+ Hkv \* Dv = 48\]"):
        rope_kv.qk_norm_rope_kv_write(qkv[:, :47], Hq, Hkv, None, None, 1e-6, inv, pos, kc, vc, slots)


@pytest.mark.parametrize("F,G", [(12, 1), (12, 3), (12, 12)])
def test_sigmoid_gate_by_its_definition(F, G):
    x, gt, res = f32(3, F), f32(3, G, scale=3.0), f32(3, F)
    c = F // G
    for r in (None, res):
        want = [[(0.0 if r is None else float(r[i, j])) + float(x[i, j]) / (1.0 + np.exp(-float(gt[i, j // c])))
                 for j in range(F)] for i in range(3)]
        np.testing.assert_allclose(gate.sigmoid_gate(x, gt, r), want, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match=r"gate: expected \[3, G\] with G dividing 12"):
        gate.sigmoid_gate(x, f32(3, 5))


def _softplus64(v: float) -> float:
    """torch.nn.functional.softplus (beta 1, threshold 20), one float64 value at a time."""
    return v if v > 20 else math.log1p(math.exp(v))


def _score64(logits, scoring: str) -> np.ndarray:
    """One row's router scores in float64, from the definitions."""
    if scoring == "sigmoid":
        return 1 / (1 + np.exp(-logits))
    if scoring == "softmax":
        return np.exp(logits) / np.exp(logits).sum()
    return np.array([math.sqrt(_softplus64(float(v))) for v in logits])          # DeepSeek-V4's sqrtsoftplus


def brute_router(x, W, bias, spec):
    """Enumerate every admissible group choice, as the definition reads."""
    logits = x.astype(np.float64) @ W.T.astype(np.float64)
    E = W.shape[0]
    G = spec.n_group
    out_ids, out_w = [], []
    for r in range(x.shape[0]):
        s = _score64(logits[r], spec.scoring)
        c = s + bias
        gsz = E // G
        gscore = [sum(sorted(c[g * gsz:(g + 1) * gsz], reverse=True)[:min(2, gsz)]) for g in range(G)]
        best = max(itertools.combinations(range(G), spec.topk_group),
                   key=lambda comb: (sorted((gscore[g] for g in comb), reverse=True), [-g for g in comb]))
        masked = [c[e] if e // gsz in best else -np.inf for e in range(E)]
        ids = sorted(range(E), key=lambda e: (-masked[e], e))[:spec.top_k]
        w = np.array([s[e] for e in ids])
        if spec.norm_topk_prob:
            w = w / (w.sum() + 1e-20)
        out_ids.append(ids)
        out_w.append(w * spec.routed_scaling_factor)
    return np.array(out_ids), np.array(out_w)


@settings(max_examples=60, deadline=None)
@given(seed=hs.integers(0, 2**31 - 1), G=hs.sampled_from([1, 2, 4]), per=hs.sampled_from([2, 3, 4]),
       tg=hs.integers(1, 4), k=hs.integers(1, 4), scoring=hs.sampled_from(moe.SCORINGS),
       norm_p=hs.booleans())
def test_router_matches_brute_force(seed, G, per, tg, k, scoring, norm_p):
    tg = min(tg, G)
    k = min(k, tg * per)
    E = G * per
    r = np.random.default_rng(seed)
    x = r.standard_normal((3, 8)).astype(np.float32)
    W = r.standard_normal((E, 8)).astype(np.float32)
    bias = (r.standard_normal(E) * 0.5).astype(np.float32)
    spec = moe.RouterSpec(k, G, tg, 1.5, norm_p, scoring)
    ids, w = moe.moe_router(x, W, bias, spec)
    bids, bw = brute_router(x, W, bias, spec)
    np.testing.assert_array_equal(ids, bids)
    np.testing.assert_allclose(w, bw, rtol=1e-5)


def test_sqrtsoftplus_scores_by_the_definition():
    """sqrt(softplus(l)) in FP32 over the softplus threshold (l itself past 20), deep negatives
    (softplus underflows toward 0: exp(-80) is still a normal FP32), the infinities and NaN."""
    vals = np.array([-np.inf, -200.0, -80.0, -30.0, -1.5, -1e-3, 0.0, 1e-3, 0.7, 5.0, 19.99, 20.0, 20.01, 21.0,
                     300.0, 3e38, np.inf, np.nan], np.float32)
    got = moe.router_scores(vals[None], "sqrtsoftplus")[0]
    assert got.dtype == np.float32
    for v, g in zip(vals.tolist(), got.tolist()):
        if math.isnan(v):
            assert math.isnan(g)
        elif v == -math.inf:
            assert g == 0.0
        else:
            assert g == pytest.approx(math.sqrt(_softplus64(v)), rel=2e-7, abs=1e-37), (v, g)
    assert got[vals == 21.0][0] == np.sqrt(np.float32(21.0))           # past the threshold: l itself, exact


@pytest.mark.parametrize("scoring,want", [("sigmoid", [1, 2]), ("softmax", [2, 3])])
def test_sqrtsoftplus_routes_otherwise_than_the_other_scorings(scoring, want):
    """A negative control: on the same logits and bias, sqrtsoftplus picks other experts than
    sigmoid (which saturates near 1 where sqrt(softplus(l)) keeps growing like sqrt(l)) and
    softmax (whose scores sum to 1), so a backend scoring with another function fails."""
    logits = np.array([[9.0, 4.0, 1.0, 0.0]], np.float32)             # through an identity gate
    W = np.eye(4, dtype=np.float32)
    bias = np.array([-1.6, -0.05, 0.0, 0.0], np.float32)
    ids, w = moe.moe_router(logits, W, bias, moe.RouterSpec(2, 1, 1, 1.0, False, "sqrtsoftplus"))
    s = [math.sqrt(_softplus64(v)) for v in (9.0, 4.0, 1.0, 0.0)]     # 3.00, 2.00, 1.15, 0.83
    assert ids.tolist() == [[1, 0]]                                    # c = 1.95 > 1.40 > 1.15 > 0.83
    np.testing.assert_allclose(w[0], [s[1], s[0]], rtol=1e-6)
    other, _ = moe.moe_router(logits, W, bias, moe.RouterSpec(2, 1, 1, 1.0, False, scoring))
    assert other.tolist() == [want]


def test_router_masks_with_minus_inf_not_zero():
    """A kept group's negative-biased expert beats every expert of a dropped group (-inf: DeepSeek,
    vLLM, transformers since #45441); the 0.0 fill of older transformers picked expert 2 here."""
    spec = moe.RouterSpec(top_k=2, n_group=2, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False)
    x = np.zeros((1, 1), np.float32)                  # every score sigmoid(0) = 0.5
    W = np.zeros((4, 1), np.float32)
    bias = np.array([0.0, -0.9, -2.0, -2.0], np.float32)   # group 0 wins; expert 1 has c = -0.4 < 0
    ids, w = moe.moe_router(x, W, bias, spec)
    assert ids.tolist() == [[0, 1]]                  # c = -0.4 of expert 1 beats the dropped group's -inf
    np.testing.assert_allclose(w, [[0.5, 0.5]])


def test_moe_experts_and_swiglu():
    n, H, E, I, K = 3, 5, 4, 6, 2
    x, w13, w2 = f32(n, H), f32(E, 2 * I, H), f32(E, H, I)
    ids = np.array([[0, 3], [2, 2], [1, 0]], np.int32)
    wts = f32(n, K)
    res = f32(n, H)

    def expert(e, v):
        g, u = w13[e, :I] @ v, w13[e, I:] @ v
        return w2[e] @ (g / (1 + np.exp(-g)) * u)

    want = res + np.array([sum(wts[i, j] * expert(ids[i, j], x[i]) for j in range(K)) for i in range(n)])
    np.testing.assert_allclose(moe.moe_experts(x, ids, wts, w13, w2, res), want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(mlp.swiglu_mlp(x, w13[1], w2[1], None), np.array([expert(1, v) for v in x]),
                               rtol=1e-4, atol=1e-5)


def test_masked_argmax_rules():
    V = 70                                              # W = 3 words, 26 padding bits
    logits = np.zeros((5, V), np.float32)
    logits[0, [3, 40]] = 5.0                            # tie: lowest id wins
    logits[1, 2] = np.nan                               # NaN never wins
    logits[1, 9] = -1.0
    logits[1, :] = np.where(np.isnan(logits[1]), np.nan, -3.0)
    logits[1, 9] = -1.0
    logits[2, 69] = 1.0
    logits[3, 33] = 2.0
    mask = np.full((5, 3), -1, np.int32)                # all allowed
    mask[3] = 0
    mask[3, 1] = np.int32(1 << 1)                       # only token 33 allowed
    mask[4] = 0
    mask[4, 2] = np.int32(-1 << 6)                      # only padding bits (70..95) set: nothing allowed
    got = lm_head.masked_argmax(logits[:4], mask[:4])
    assert got.tolist() == [3, 9, 69, 33]
    with pytest.raises(NoAllowedToken, match="row 0: the grammar bitmask allows no token"):
        lm_head.masked_argmax(logits[4:], mask[4:])
    allnan = np.full((1, V), np.nan, np.float32)
    with pytest.raises(NoAllowedToken):
        lm_head.masked_argmax(allnan, None)
    # bit 31 of a word (sign bit of the int32) is token 31 + 32 w
    only31 = np.zeros((1, 3), np.int32)
    only31[0, 0] = np.int32(-2**31)
    assert lm_head.masked_argmax(np.zeros((1, V), np.float32), only31).tolist() == [31]


@settings(max_examples=80, deadline=None)
@given(seed=hs.integers(0, 2**31 - 1), V=hs.integers(1, 100), n=hs.integers(1, 4))
def test_masked_argmax_matches_definition(seed, V, n):
    r = np.random.default_rng(seed)
    logits = r.integers(-3, 3, (n, V)).astype(np.float32)        # small integers: many ties
    logits[r.random((n, V)) < 0.1] = np.nan
    W = (V + 31) // 32
    mask = r.integers(-2**31, 2**31, (n, W), dtype=np.int64).astype(np.int32)
    for i in range(n):
        allowed = [j for j in range(V) if (int(mask[i, j // 32]) >> (j % 32)) & 1 and not np.isnan(logits[i, j])]
        if not allowed:
            with pytest.raises(NoAllowedToken):
                lm_head.masked_argmax(logits[i:i + 1], mask[i:i + 1])
            continue
        best = min(allowed, key=lambda j: (-logits[i, j], j))
        assert lm_head.masked_argmax(logits[i:i + 1], mask[i:i + 1]).tolist() == [best]


# -- SwiGLU clamp (Step-3.5 / 3.7) ------------------------------------------------------

def _silu64(g: float) -> float:
    """silu in float64, with the FP32 formula's values at the ends: silu(-inf) = -inf / inf
    is NaN, and where exp(-g) overflows, g / inf is -0."""
    if math.isnan(g) or g == -math.inf:
        return math.nan
    try:
        return g / (1.0 + math.exp(-g))
    except OverflowError:
        return -0.0


def brute_swiglu_expert(x_row, w13, w2, L, clamp_gate=False):
    """One SwiGLU expert on one row, in float64, one activation at a time, as Hugging Face
    Step3p7MLP reads: gate = silu(g).clamp(max=L), up = u.clamp(-L, L); with ``clamp_gate`` as
    DeepseekV4MLP reads: gate = silu(g.clamp(max=L)), the same up; L None: no clamp."""
    I = w13.shape[0] // 2
    x64 = x_row.astype(np.float64)
    act = np.empty(I)
    clipped = 0
    for j in range(I):
        g = float(w13[j].astype(np.float64) @ x64)
        u = float(w13[I + j].astype(np.float64) @ x64)
        if L is not None and clamp_gate:
            clipped += (g > L) + (abs(u) > L)
            a = _silu64(min(g, L))
        elif L is not None:
            a = _silu64(g)
            clipped += (a > L) + (abs(u) > L)
            a = min(a, L)
        else:
            a = _silu64(g)
        if L is not None:
            u = L if u > L else (-L if u < -L else u)
        act[j] = a * u
    return w2.astype(np.float64) @ act, clipped


@pytest.mark.parametrize("n", [1, 3, 17])
@pytest.mark.parametrize("I", [7, 32, 100])
@pytest.mark.parametrize("limit", [None, 0.25, 1.5, 1e30])
def test_swiglu_mlp_limit_matches_brute_force(n, I, limit):
    H = 24
    x, res = f32(n, H), f32(n, H)
    w13, w2 = f32(2 * I, H, scale=H ** -0.5), f32(H, I, scale=I ** -0.5)
    rows = [brute_swiglu_expert(x[r], w13, w2, limit) for r in range(n)]
    want = np.array([y for y, _ in rows]) + res
    clipped = sum(c for _, c in rows)
    if limit == 0.25:                                                 # "clips often" means it
        assert clipped >= 0.5 * n * I, clipped
    if limit == 1e30:
        assert clipped == 0
    np.testing.assert_allclose(mlp.swiglu_mlp(x, w13, w2, res, limit=limit), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("n,E,K", [(1, 16, 1), (3, 5, 2), (17, 16, 4), (17, 3, 3)])
@pytest.mark.parametrize("I", [7, 32, 100])
@pytest.mark.parametrize("limit", [None, 0.25, 1.5])
def test_moe_experts_limit_matches_brute_force(n, E, K, I, limit):
    H = 24
    x, res = f32(n, H), f32(n, H)
    w13, w2 = f32(E, 2 * I, H, scale=H ** -0.5), f32(E, H, I, scale=I ** -0.5)
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(n)]).astype(np.int32)
    wts = rng.random((n, K)).astype(np.float32)
    want = res.astype(np.float64)
    for r in range(n):
        for k in range(K):
            want[r] += float(wts[r, k]) * brute_swiglu_expert(x[r], w13[ids[r, k]], w2[ids[r, k]], limit)[0]
    np.testing.assert_allclose(moe.moe_experts(x, ids, wts, w13, w2, res, limit=limit), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("n", [1, 3, 17])
@pytest.mark.parametrize("I", [7, 100])
@pytest.mark.parametrize("limit", [0.25, 1.5])
def test_swiglu_clamp_gate_matches_brute_force(n, I, limit):
    """DeepSeek-V4's clamp (the gate before silu): swiglu_mlp and moe_experts against the
    float64 definition (at 0.25 most gates and ups are clamped)."""
    H, E, K = 24, 5, 2
    x, res = f32(n, H), f32(n, H)
    w13, w2 = f32(2 * I, H, scale=H ** -0.5), f32(H, I, scale=I ** -0.5)
    rows = [brute_swiglu_expert(x[r], w13, w2, limit, clamp_gate=True) for r in range(n)]
    if limit == 0.25:                                                 # P(g > 0.25) ~ 0.4, P(|u| > 0.25) ~ 0.8
        assert sum(c for _, c in rows) >= 0.5 * n * I
    want = np.array([y for y, _ in rows]) + res
    np.testing.assert_allclose(mlp.swiglu_mlp(x, w13, w2, res, limit=limit, clamp_gate=True), want,
                               rtol=1e-4, atol=1e-5)
    e13, e2 = f32(E, 2 * I, H, scale=H ** -0.5), f32(E, H, I, scale=I ** -0.5)
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(n)]).astype(np.int32)
    wts = rng.random((n, K)).astype(np.float32)
    want = res.astype(np.float64)
    for r in range(n):
        for k in range(K):
            want[r] += float(wts[r, k]) * brute_swiglu_expert(x[r], e13[ids[r, k]], e2[ids[r, k]], limit,
                                                              clamp_gate=True)[0]
    np.testing.assert_allclose(moe.moe_experts(x, ids, wts, e13, e2, res, limit=limit, clamp_gate=True), want,
                               rtol=1e-4, atol=1e-5)


def test_the_two_clamps_differ_where_the_gate_passes_the_limit():
    """A negative control: with gates above L, clamping before silu (DeepSeek-V4) and after it
    (Step-3.5) give other activations: silu(min(g, L)) = silu(L) < L = min(silu(g), L) once
    silu(g) > L; below L both leave the gate alone and agree bit for bit."""
    L = mlp.swiglu_limit(2.0)
    g = np.array([2.5, 4.0, 50.0, 1.0, -3.0, np.nan], np.float32)
    u = np.array([1.0, -5.0, 0.5, 1.0, 1.0, 1.0], np.float32)
    gu = np.concatenate([g, u])[None]
    v4 = mlp.swiglu_act(gu, L, clamp_gate=True)[0]
    step = mlp.swiglu_act(gu, L)[0]
    silu_L = 2.0 / (1 + math.exp(-2.0))                               # 1.7616
    np.testing.assert_allclose(v4[:3], [silu_L * 1.0, silu_L * -2.0, silu_L * 0.5], rtol=1e-6)
    np.testing.assert_allclose(step[:3], [2.0, 2.0 * -2.0, 2.0 * 0.5], rtol=1e-6)      # silu(2.5) = 2.31 > 2
    assert (np.abs(v4[:3] - step[:3]) > 0.1).all()
    assert v4[3:5].tobytes() == step[3:5].tobytes() and np.isnan(v4[5]) and np.isnan(step[5])
    # through the ops: rows whose gates pass the limit come out otherwise
    x, w13, w2 = f32(4, 16, scale=3.0), f32(2 * 9, 16, scale=16 ** -0.5), f32(16, 9)
    a = mlp.swiglu_mlp(x, w13, w2, limit=0.5, clamp_gate=True)
    b = mlp.swiglu_mlp(x, w13, w2, limit=0.5)
    assert np.abs(a - b).max() > 1e-2


def test_clamp_gate_without_a_limit_and_its_type():
    """clamp_gate says where a clamp goes: with no limit (None / 0) nothing is clamped, bit for
    bit; anything but a bool is refused, naming clamp_gate."""
    n, H, I, E = 3, 16, 9, 4
    x, w13, w2 = f32(n, H), f32(2 * I, H), f32(H, I)
    plain = mlp.swiglu_mlp(x, w13, w2)
    for off in (None, 0):
        assert mlp.swiglu_mlp(x, w13, w2, limit=off, clamp_gate=True).tobytes() == plain.tobytes()
    assert mlp.swiglu_bounds(None, True) == (mlp.NO_LIMIT, mlp.NO_LIMIT)
    assert mlp.swiglu_bounds(3.0, True) == (mlp.NO_LIMIT, np.float32(3.0))
    assert mlp.swiglu_bounds(3.0) == (np.float32(3.0), mlp.NO_LIMIT)
    e13, e2 = f32(E, 2 * I, H), f32(E, H, I)
    ids, wts = np.array([[0, 3]] * n, np.int32), f32(n, 2)
    for bad in (1, "yes", None):
        with pytest.raises(TypeError, match=r"clamp_gate: expected a bool .* got"):
            mlp.swiglu_mlp(x, w13, w2, limit=1.0, clamp_gate=bad)
        with pytest.raises(TypeError, match="clamp_gate: expected a bool"):
            moe.moe_experts(x, ids, wts, e13, e2, limit=1.0, clamp_gate=bad)


def test_swiglu_limit_off_is_the_unclamped_result_bit_for_bit():
    n, H, I, E = 5, 16, 9, 4
    x, w13, w2 = f32(n, H), f32(2 * I, H), f32(H, I)
    plain = mlp.swiglu_mlp(x, w13, w2)
    for off in (None, 0, 0.0, np.float32(0.0)):
        assert mlp.swiglu_mlp(x, w13, w2, limit=off).tobytes() == plain.tobytes()
    e13, e2 = f32(E, 2 * I, H), f32(E, H, I)
    ids, wts = np.array([[0, 3]] * n, np.int32), f32(n, 2)
    plain = moe.moe_experts(x, ids, wts, e13, e2)
    assert moe.moe_experts(x, ids, wts, e13, e2, limit=0).tobytes() == plain.tobytes()


def test_swiglu_act_elementwise():
    """min(silu(g), L) * clip(u, -L, L) on the edges: NaN stays NaN (the clamp must not hide
    it), infinities are clipped, -0 and values at the limit are kept, the limit is FP32."""
    L = mlp.swiglu_limit(7.3)
    assert L == np.float32(7.3) and L.dtype == np.float32
    Lf = float(L)
    vals = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 7.3, -7.3, 7.31, -100.0, 3.0, -3.0, 1e-30], np.float32)
    g, u = (a.ravel() for a in np.meshgrid(vals, vals, indexing="ij"))
    with np.errstate(over="ignore", invalid="ignore"):                # exp(inf), -inf / inf
        got = mlp.swiglu_act(np.stack([g, u], axis=1), L)[:, 0]
    for gi, ui, v in zip(g.tolist(), u.tolist(), got.tolist()):
        a = _silu64(gi)
        gate = a if math.isnan(a) else min(a, Lf)
        up = ui if math.isnan(ui) else max(-Lf, min(ui, Lf))
        want = gate * up
        if math.isnan(want):
            assert math.isnan(v), (gi, ui, v)
        else:
            assert v == pytest.approx(want, rel=1e-6, abs=1e-37), (gi, ui, v, want)


def test_swiglu_limit_keeps_nan_rows():
    n, H, I = 3, 8, 5
    x, w13, w2 = f32(n, H), f32(2 * I, H), f32(H, I)
    x[1, 2] = np.nan
    for limit in (None, 0.1, 16.0):
        y = mlp.swiglu_mlp(x, w13, w2, limit=limit)
        assert np.isnan(y[1]).all() and np.isfinite(y[[0, 2]]).all()
        y = moe.moe_experts(x, np.zeros((n, 1), np.int32), np.ones((n, 1), np.float32), w13[None], w2[None],
                            limit=limit)
        assert np.isnan(y[1]).all() and np.isfinite(y[[0, 2]]).all()


@pytest.mark.parametrize("bad,error,message", [
    (-1.0, ValueError, r"limit: expected a finite value > 0 \(None or 0: no clamp\), got -1.0"),
    (float("nan"), ValueError, "limit: expected a finite value > 0"),
    (float("-inf"), ValueError, "limit: expected a finite value > 0"),
    (1e39, ValueError, "limit: expected a value FP32 holds"),
    (1e-46, ValueError, "limit: expected a value FP32 holds"),
    ("16", TypeError, "limit: expected a number .* got str"),
    (False, TypeError, "limit: expected a number .* got bool"),
    ([7.0], TypeError, "limit: expected a number .* got list"),
])
def test_swiglu_limit_refused(bad, error, message):
    with pytest.raises(error, match=message):
        mlp.swiglu_limit(bad)
    x, w13, w2 = f32(1, 4), f32(4, 4), f32(4, 2)
    with pytest.raises(error, match="limit"):
        mlp.swiglu_mlp(x, w13, w2, limit=bad)
    with pytest.raises(error, match="limit"):
        moe.moe_experts(x, np.zeros((1, 1), np.int32), np.ones((1, 1), np.float32), w13[None], w2[None], limit=bad)
