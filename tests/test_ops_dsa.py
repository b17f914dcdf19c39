"""DSA ops (mtpkern.ops.dsa, and ``mla_attention_absorbed(index=)``): the indexer key write
against a float64 LayerNorm + RoPE of the first R dims (R = 0 too: GLM-5.3's NoPE MLA, whose
indexer rotates nothing), the selection against a float64
scorer and a sort written here (its tie rule and NaN rule constructed), the sparse attention
against float64 attention over the listed rows, a full list equal to the dense attention bit
for bit, and bad input refused by name with the caches unchanged. Every test runs on the
numpy reference, the cpu backend and the CUDA kernels on the emulator (tests/cuda_emu).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from mtpkern.ops import dsa, mla
from mtpkern.ops.rope_kv import inv_freq, yarn_inv_freq
from mtpkern.tolerance import assert_close
from test_ops_mla import (BACKENDS, OTHER_BACKENDS, REF, attention64, backend, case, cat, emulator,  # noqa: F401
                          filled, kv_tol, rnd, rng_for, rope64)


def empty_index(be, NB, BS, Di):
    return be.empty_latent_kv(NB, BS, Di)


def to_f32(be, cache) -> np.ndarray:
    return np.asarray(be.kv_to_host(cache), np.float32)


def key64(k_row, w, b, eps, f, pos, interleave, a):
    """The indexer key in float64: LayerNorm (biased variance) with weight and bias, then the
    first R dims rotated."""
    x = k_row.astype(np.float64)
    d = x - x.mean()
    y = d / np.sqrt(np.mean(d * d) + eps) * w.astype(np.float64) + b.astype(np.float64)
    R = 2 * f.shape[0]
    y[:R] = rope64(y[:R], pos, f, interleave, a)
    return y


# -- the key write --------------------------------------------------------------------------

@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("Di,R,Hi,BS,n,yarn", [(16, 8, 1, 1, 5, False), (40, 16, 3, 3, 7, True),
                                               (128, 64, 8, 16, 19, True), (24, 24, 2, 5, 4, False),
                                               (16, 0, 2, 3, 5, False), (40, 0, 3, 4, 7, True)])
def test_key_write_norm_rope_slots_and_query(backend, name, interleave, Di, R, Hi, BS, n, yarn):
    be = backend(name)
    rng = rng_for("dsa-key", Di, R, BS, n, yarn)
    NB = -(-n // BS) + 2
    f = yarn_inv_freq(R, 1e4, 40.0, 4096) if yarn else inv_freq(R, 1e4)
    a = 1.3 if yarn else 1.0
    k = rnd(rng, n, Di, scale=3.0) + 0.7
    w, b = rnd(rng, Di) + 1.0, rnd(rng, Di, scale=0.2)
    q = rnd(rng, n, Hi, Di)
    pos = rng.integers(0, 5000, n).astype(np.int32)
    slots = rng.permutation(NB * BS)[:n].astype(np.int32)
    cache = empty_index(be, NB, BS, Di)
    kw = {"interleave": True} if interleave else {}
    if yarn:
        kw["rope_scale"] = a
    got_q = be.dsa_key_write(be.from_host(k), w, b, 1e-6, f, pos, cache, slots, q=be.from_host(q), **kw)
    host = to_f32(be, cache).reshape(NB * BS, Di)
    tol = kv_tol(be)
    for i in range(n):
        want = key64(k[i], w, b, 1e-6, f, pos[i], interleave, a)
        assert_close(host[slots[i]], want, tol, f"{name}: key row {i}")
        for h in range(Hi):
            wq = q[i, h].astype(np.float64)
            wq[:R] = rope64(wq[:R], pos[i], f, interleave, a)
            assert_close(be.to_host(got_q)[i, h], wq, "float32", f"{name}: query row {i} head {h}")
    untouched = np.setdiff1d(np.arange(NB * BS), slots)
    assert not host[untouched].any(), "rows outside the slots were written"


@pytest.mark.parametrize("name", BACKENDS)
def test_key_write_refuses_bad_slots_and_leaves_the_cache(backend, name):
    be = backend(name)
    rng = rng_for("dsa-bad")
    cache = empty_index(be, 3, 4, 16)
    k, w, b = rnd(rng, 2, 16), np.ones(16, np.float32), np.zeros(16, np.float32)
    with pytest.raises(ValueError, match="slots"):
        be.dsa_key_write(be.from_host(k), w, b, 1e-6, inv_freq(8, 1e4), np.zeros(2, np.int32), cache,
                         np.array([0, 12], np.int32))
    assert not to_f32(be, cache).any()
    with pytest.raises(ValueError, match="k_norm_b"):
        be.dsa_key_write(be.from_host(k), w, b[:8], 1e-6, inv_freq(8, 1e4), np.zeros(2, np.int32), cache,
                         np.array([0, 1], np.int32))
    assert not to_f32(be, cache).any()
    with pytest.raises(ValueError, match=r"inv_freq: expected 0\.\.8 entries \(R/2, with R <= 16 the indexer head "
                                         r"dim\), got 9"):
        be.dsa_key_write(be.from_host(k), w, b, 1e-6, inv_freq(18, 1e4), np.zeros(2, np.int32), cache,
                         np.array([0, 1], np.int32))
    assert not to_f32(be, cache).any()


# -- the selection -----------------------------------------------------------------------------

def select64(q, wts, scale, keys, rows, topk):
    """float64 scores; the best ``topk`` by (score desc, row asc), NaN last; ascending."""
    s = (wts.astype(np.float64) * scale) @ np.maximum(q.astype(np.float64) @ keys.astype(np.float64).T, 0.0)
    ranked = sorted(range(rows.size), key=lambda i: (np.isnan(s[i]), -(0.0 if np.isnan(s[i]) else s[i]), rows[i]))
    return np.sort(rows[ranked[:topk]])


def select_case(key, Hi, Di, BS, topk, window=False, ties=False):
    cache, tables, row_seq, row_len, row_start, *_ = case(key, 1, 8, 8, 8, 8, BS, window)
    rng = rng_for(key, "dsa", Hi, Di, BS, topk, ties)
    NB = cache.shape[0]
    icache = rnd(rng, NB, BS, Di)
    if ties:                         # every other row of a sequence equals one row: equal scores
        flat = icache.reshape(NB * BS, Di)
        flat[::2] = flat[0]
    q = rnd(rng, row_seq.size, Hi, Di)
    wts = rnd(rng, row_seq.size, Hi) + 0.5
    return icache, tables, row_seq, row_len, row_start, q, wts


def want_select(icache, tables, row_seq, row_len, row_start, q, wts, scale, topk):
    BS = icache.shape[1]
    out = np.full((row_seq.size, topk), -1, np.int32)
    for r in range(row_seq.size):
        rows = np.arange(0 if row_start is None else row_start[r], row_len[r])
        keys = icache[tables[row_seq[r], rows // BS], rows % BS]
        pick = select64(q[r], wts[r], scale, keys, rows, topk)
        out[r, :pick.size] = pick
    return out


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("window", [False, True])
@pytest.mark.parametrize("Hi,Di,BS,topk", [(1, 8, 1, 3), (4, 16, 3, 5), (8, 32, 5, 9), (3, 24, 16, 16),
                                           (2, 8, 4, 1)])
def test_select_equals_float64_sort(backend, name, window, Hi, Di, BS, topk):
    be = backend(name)
    icache, tables, row_seq, row_len, row_start, q, wts = select_case("sel", Hi, Di, BS, topk, window)
    scale = Hi ** -0.5 * Di ** -0.5
    ic = filled(be, icache)
    got = be.to_host(be.dsa_select(be.from_host(q), be.from_host(wts), ic, tables, row_seq, row_len, topk, scale,
                                   row_start=row_start))
    want = want_select(to_f32(be, ic), tables, row_seq, row_len, row_start, q, wts, scale, topk)
    np.testing.assert_array_equal(got, want, err_msg=f"{name}: the selected rows")
    short = (row_len - (0 if row_start is None else row_start)) <= topk
    assert short.any() and ((~short).any() or (window and topk >= 7)), "rows both sides of topk"


@pytest.mark.parametrize("name", BACKENDS)
def test_select_ties_go_to_the_earlier_row(backend, name):
    be = backend(name)
    icache, tables, row_seq, row_len, row_start, q, wts = select_case("tie", 2, 16, 3, 4, ties=True)
    scale = 0.125
    ic = filled(be, icache)
    got = be.to_host(be.dsa_select(be.from_host(q), be.from_host(wts), ic, tables, row_seq, row_len, 4, scale))
    want = want_select(to_f32(be, ic), tables, row_seq, row_len, None, q, wts, scale, 4)
    np.testing.assert_array_equal(got, want)
    # the rule matters here: a later-row tie break picks other rows for some query row
    later = []
    for r in range(row_seq.size):
        rows = np.arange(row_len[r])
        keys = to_f32(be, ic)[tables[row_seq[r], rows // 3], rows % 3]
        s = (wts[r].astype(np.float64) * scale) @ np.maximum(q[r].astype(np.float64) @ keys.astype(np.float64).T, 0)
        later.append(np.sort(rows[sorted(range(rows.size), key=lambda i: (-s[i], -rows[i]))[:4]]))
    assert any(not np.array_equal(got[r][got[r] >= 0], later[r]) for r in range(row_seq.size) if row_len[r] > 4)


@pytest.mark.parametrize("name", BACKENDS)
def test_select_ranks_nan_below_every_number(backend, name):
    be = backend(name)
    icache, tables, row_seq, row_len, _, q, wts = select_case("nan", 2, 8, 4, 3)
    icache = icache.copy()
    flat = icache.reshape(-1, 8)
    seq1 = tables[1]
    for j in (0, 2, 5):            # three rows of sequence 1 give NaN scores
        flat[seq1[j // 4] * 4 + j % 4, 0] = np.nan
    ic = filled(be, icache)
    got = be.to_host(be.dsa_select(be.from_host(q), be.from_host(wts), ic, tables, row_seq, row_len, 3, 1.0))
    for r in np.flatnonzero(row_seq == 1):
        if row_len[r] > 3:
            assert not set(got[r].tolist()) & {0, 2, 5}, f"row {r} selected a NaN-scored row: {got[r]}"


@pytest.mark.parametrize("name", BACKENDS)
def test_select_refuses_bad_topk(backend, name):
    be = backend(name)
    icache, tables, row_seq, row_len, _, q, wts = select_case("bad", 2, 8, 4, 3)
    ic = filled(be, icache)
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="topk"):
            be.dsa_select(be.from_host(q), be.from_host(wts), ic, tables, row_seq, row_len, bad, 1.0)


# -- the sparse attention ----------------------------------------------------------------------

def sparse_case(key, Hq, P, R, L, Dv, BS, topk, window=False):
    cache, tables, row_seq, row_len, row_start, q_nope, q_pe, kv_b = case(key, Hq, P, R, L, Dv, BS, window)
    rng = rng_for(key, "index", topk)
    index = np.full((row_seq.size, topk), -1, np.int32)
    for r in range(row_seq.size):
        rows = np.arange(0 if row_start is None else row_start[r], row_len[r])
        pick = np.sort(rng.permutation(rows)[:topk])
        index[r, :pick.size] = pick
    return cache, tables, row_seq, row_len, row_start, q_nope, q_pe, kv_b, index


def attention64_listed(q_nope, q_pe, kv_b, cache, tables, row_seq, row_len, scale, index):
    """float64 attention of each row over its listed rows (one row at a time, attention64)."""
    out = []
    for r in range(row_seq.size):
        rows = index[r][index[r] >= 0]
        one = np.zeros((1, 1), np.int32)
        sub_tables = np.zeros((1, rows.size), np.int32)
        BS = cache.shape[1]
        flat = cache.reshape(-1, cache.shape[2])
        picked = flat[tables[row_seq[r], rows // BS] * BS + rows % BS][:, None, :]     # [c, 1, W]: BS 1
        sub_tables[0] = np.arange(rows.size)
        out.append(attention64(q_nope[r:r + 1], q_pe[r:r + 1], kv_b, picked, sub_tables, one[0], 
                               np.array([rows.size]), scale))
    return np.concatenate(out)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("window", [False, True])
@pytest.mark.parametrize("Hq,P,R,L,Dv,BS,topk", [(1, 16, 8, 40, 24, 1, 4), (3, 24, 16, 72, 20, 3, 7),
                                                 (16, 48, 64, 127, 32, 16, 9), (7, 32, 32, 100, 48, 5, 30),
                                                 (3, 24, 0, 71, 20, 3, 7), (16, 32, 0, 64, 24, 4, 9)])
def test_sparse_attention_equals_float64_over_the_listed_rows(backend, name, window, Hq, P, R, L, Dv, BS, topk):
    be = backend(name)
    cache, tables, row_seq, row_len, row_start, q_nope, q_pe, kv_b, index = sparse_case(
        "sparse", Hq, P, R, L, Dv, BS, topk, window)
    w_uk, w_uv = mla.split_kv_b_proj(kv_b, Hq, P, Dv)
    scale = (P + R) ** -0.5
    lc = filled(be, cache)
    got = be.to_host(be.mla_attention_absorbed(be.from_host(cat(q_nope, q_pe)), be.prepare_weight(w_uk),
                                               be.prepare_weight(w_uv), lc, tables, row_seq, row_len, scale,
                                               row_start=row_start, index=index))
    want = attention64_listed(q_nope, q_pe, kv_b, to_f32(be, lc), tables, row_seq, row_len, scale, index)
    from test_ops_mla import attention_tol
    assert_close(got, want, attention_tol(be, Hq, L, R, tables.shape[1] * BS), f"{name}: sparse attention")
    dense = be.to_host(be.mla_attention_absorbed(be.from_host(cat(q_nope, q_pe)), be.prepare_weight(w_uk),
                                                 be.prepare_weight(w_uv), lc, tables, row_seq, row_len, scale,
                                                 row_start=row_start))
    cut = [r for r in range(row_seq.size) if (index[r] >= 0).sum() < row_len[r] - (0 if row_start is None
                                                                                    else row_start[r])]
    if cut or not window:
        assert cut and not np.allclose(got[cut], dense[cut], atol=1e-3), "the list must change the cut rows"


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("window", [False, True])
def test_full_list_is_the_dense_attention_bit_for_bit(backend, name, window):
    be = backend(name)
    Hq, P, R, L, Dv, BS = 16, 48, 64, 127, 32, 16
    cache, tables, row_seq, row_len, row_start, q_nope, q_pe, kv_b = case("full", Hq, P, R, L, Dv, BS, window)
    start = np.zeros_like(row_len) if row_start is None else row_start
    T = int((row_len - start).max())
    index = np.full((row_seq.size, T), -1, np.int32)
    for r in range(row_seq.size):
        index[r, :row_len[r] - start[r]] = np.arange(start[r], row_len[r])
    w_uk, w_uv = mla.split_kv_b_proj(kv_b.astype(ml_dtypes.bfloat16), Hq, P, Dv)
    lc = filled(be, cache)
    args = (be.from_host(cat(q_nope, q_pe)), be.prepare_weight(w_uk), be.prepare_weight(w_uv), lc, tables,
            row_seq, row_len, (P + R) ** -0.5)
    dense = be.to_host(be.mla_attention_absorbed(*args, row_start=row_start))
    sparse = be.to_host(be.mla_attention_absorbed(*args, row_start=row_start, index=index))
    np.testing.assert_array_equal(sparse, dense)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("bad,what", [(lambda ix: ix.__setitem__((1, 0), -1), "index\\[1, 0\\]"),
                                      (lambda ix: ix.__setitem__((2, 1), ix[2, 0]), "index\\[2, 1\\]"),
                                      (lambda ix: ix.__setitem__((0, 0), 5), "index\\[0, 0\\]"),
                                      (lambda ix: ix.__setitem__((3, 0), -2), "index\\[3, 0\\]")])
def test_sparse_attention_refuses_bad_lists(backend, name, bad, what):
    be = backend(name)
    Hq, P, R, L, Dv, BS = 3, 24, 16, 72, 20, 3
    cache, tables, row_seq, row_len, row_start, q_nope, q_pe, kv_b, index = sparse_case(
        "badlist", Hq, P, R, L, Dv, BS, 7)
    bad(index)
    w_uk, w_uv = mla.split_kv_b_proj(kv_b, Hq, P, Dv)
    with pytest.raises(ValueError, match=what):
        be.mla_attention_absorbed(be.from_host(cat(q_nope, q_pe)), be.prepare_weight(w_uk), be.prepare_weight(w_uv),
                                  filled(be, cache), tables, row_seq, row_len, 0.1, index=index)


def test_layernorm_is_float64s():
    rng = rng_for("ln")
    x, w, b = rnd(rng, 5, 24, scale=4.0) + 3, rnd(rng, 24), rnd(rng, 24)
    x64 = x.astype(np.float64)
    d = x64 - x64.mean(1, keepdims=True)
    want = d / np.sqrt((d * d).mean(1, keepdims=True) + 1e-6) * w + b
    assert_close(dsa.layernorm(x, w, b, 1e-6), want, "float32", "layernorm")
