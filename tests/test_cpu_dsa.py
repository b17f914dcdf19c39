"""The cpu backend's DSA paths that tests/test_ops_dsa.py's small cases leave out: the selection's
parallel tasks (several chunks of ``CHUNK`` keys a row, heads past one 16-lane tile) against the
reference with exact ties and NaN scores, the sparse attention's gathered sequences at sizes
where the copy runs in parallel, and the checks that must run on every call (a list's values,
``topk`` given as True or 2.0 after 1 and 2 passed with the same shapes).
"""

from __future__ import annotations

import numba
import numpy as np
import pytest

from mtpkern.backends import get_backend
from mtpkern.backends.cpu import CpuBackend
from mtpkern.backends.cpu_kernels import dsa as dsa_k
from mtpkern.backends.cpu_kernels.linear import SMALL
from mtpkern.ops import mla
from mtpkern.tolerance import assert_close

REF = get_backend("numpy")


def select_case(seed: int, Hi: int, Di: int, BS: int):
    """Two sequences over a shuffled pool: a long one (rows past several CHUNKs, a window, a row
    at its end) and a short one; exact ties (every 7th key a copy of key 3) and NaN keys."""
    rng = np.random.default_rng(seed)
    long = 3 * dsa_k.CHUNK + 37
    mb = -(-long // BS)
    NB = 2 * mb + 1
    cache = rng.standard_normal((NB, BS, Di)).astype(np.float32)
    flat = cache.reshape(-1, Di)
    flat[5::7] = flat[3]
    flat[11::13, 1] = np.nan
    perm = rng.permutation(NB).astype(np.int32)
    tables = np.stack([perm[:mb], perm[mb:2 * mb]])
    row_seq = np.array([0, 0, 1, 0, 1], np.int32)
    row_len = np.array([long, long - 1, 40, 900, 7], np.int32)
    row_start = np.array([0, 700, 3, 1, 0], np.int32)
    q = rng.standard_normal((5, Hi, Di)).astype(np.float32)
    w = rng.standard_normal((5, Hi)).astype(np.float32)
    return q, w, cache, tables, row_seq, row_len, row_start


def scores64(q, w, scale, cache, table, rows):
    BS = cache.shape[1]
    keys = cache[table[rows // BS], rows % BS].astype(np.float64)
    return (w.astype(np.float64) * scale) @ np.maximum(q.astype(np.float64) @ keys.T, 0.0)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("Hi,Di,BS", [(20, 32, 16), (3, 24, 5)])
def test_parallel_selection_is_the_reference(threads, Hi, Di, BS):
    be = CpuBackend(threads=min(threads, numba.config.NUMBA_NUM_THREADS))
    q, w, cache, tables, row_seq, row_len, row_start = select_case(Hi, Hi, Di, BS)
    assert (row_len[0] - dsa_k.CHUNK) * Hi * Di > SMALL, "the scores must take the parallel path"
    # topk values that cut through row 0's tied scores (the copies of key 3) and its NaN scores
    rows = np.arange(row_len[0])
    s = scores64(q[0], w[0], 0.3, cache, tables[0], rows)
    keys = cache[tables[0, rows // BS], rows % BS]
    tied = (keys == cache.reshape(-1, Di)[3]).all(axis=1)             # the copies: one score, exactly
    nan = np.isnan(s)
    assert tied.sum() > 10 and nan.sum() > 10
    cut_ties = int((s[~nan] > s[tied][0]).sum() + tied.sum() // 2)     # (float64: no near-ties at random)
    cut_nan = int(row_len[0] - nan.sum() // 2)
    for topk in (1, 5, 64, 900, cut_ties, cut_nan):
        for rs in (None, row_start):
            got = be.dsa_select(q, w, cache, tables, row_seq, row_len, topk, 0.3, row_start=rs)
            want = REF.dsa_select(q, w, cache, tables, row_seq, row_len, topk, 0.3, row_start=rs)
            np.testing.assert_array_equal(got, want, err_msg=f"topk {topk}, window {rs is not None}")
            if rs is None and topk in (cut_ties, cut_nan):     # the cut splits equal scores: earliest first
                split = tied if topk == cut_ties else nan
                kept = np.isin(rows, got[0]) & split
                assert 0 < kept.sum() < split.sum()
                assert rows[kept].max() < rows[split & ~kept].min()
                assert topk == cut_ties or np.isin(rows[~nan], got[0]).all(), "every number before a NaN"


def test_selection_writes_out_and_refuses_topk_by_type_every_call():
    be = get_backend("cpu")
    q, w, cache, tables, row_seq, row_len, _ = select_case(0, 2, 8, 4)
    out = np.full((5, 9), 7, np.int32)
    assert be.dsa_select(q, w, cache, tables, row_seq, row_len, 9, 0.5, out=out) is out
    np.testing.assert_array_equal(out, REF.dsa_select(q, w, cache, tables, row_seq, row_len, 9, 0.5))
    with pytest.raises(ValueError, match="out: expected shape"):
        be.dsa_select(q, w, cache, tables, row_seq, row_len, 9, 0.5, out=np.empty((5, 8), np.int32))
    be.dsa_select(q, w, cache, tables, row_seq, row_len, 1, 0.5)
    be.dsa_select(q, w, cache, tables, row_seq, row_len, 2, 0.5)
    for bad in (True, 2.0):                         # equal and hashed alike to the 1 and 2 that passed
        with pytest.raises(ValueError, match="topk"):
            be.dsa_select(q, w, cache, tables, row_seq, row_len, bad, 0.5)


def sparse_case(seed: int, Hq: int, L: int, R: int, BS: int, n: int, long: int):
    rng = np.random.default_rng(seed)
    P, Dv = 16, 24
    mb = -(-long // BS)
    NB = 2 * mb
    cache = rng.standard_normal((NB, BS, L + R)).astype(np.float32)
    tables = rng.permutation(NB).astype(np.int32).reshape(2, mb)
    row_seq = (np.arange(n) % 2).astype(np.int32)
    row_len = (long - np.arange(n)).astype(np.int32)
    q = rng.standard_normal((n, Hq, P + R)).astype(np.float32)
    w_uk = (rng.standard_normal((Hq, P, L)) * 0.2).astype(np.float32)
    w_uv = (rng.standard_normal((Hq, Dv, L)) * 0.2).astype(np.float32)
    return rng, q, w_uk, w_uv, cache, tables, row_seq, row_len


def test_gathered_sparse_attention_at_size_and_with_full_rows_beside_cut_ones():
    """Cut lists large enough for the parallel copy, a row whose list is full beside them (it
    is gathered too, and still the dense result within FP32's tolerance), against the reference."""
    be = get_backend("cpu")
    rng, q, w_uk, w_uv, cache, tables, row_seq, row_len = sparse_case(1, 4, 72, 16, 16, 4, 1500)
    T = 600
    index = np.full((4, row_len.max()), -1, np.int32)
    for r in range(4):
        pick = np.sort(rng.choice(int(row_len[r]), T, replace=False)) if r != 2 else np.arange(row_len[r])
        index[r, :pick.size] = pick
    assert T * 4 * cache.shape[2] > SMALL
    args = (q, w_uk, w_uv, cache, tables, row_seq, row_len, 0.2)
    got = be.mla_attention_absorbed(*args, index=index)
    assert_close(got, REF.mla_attention_absorbed(*args, index=index), "float32", "sparse attention")
    dense = be.mla_attention_absorbed(*args)
    assert_close(got[2], dense[2], "float32", "the full row")
    assert not np.allclose(got[[0, 1, 3]], dense[[0, 1, 3]], atol=1e-3), "the lists must change the cut rows"
    out = np.empty_like(got)
    assert be.mla_attention_absorbed(*args, index=index, out=out) is out
    np.testing.assert_array_equal(out, got)


def test_every_list_full_is_the_dense_call_bit_for_bit_in_parallel():
    be = CpuBackend(threads=numba.config.NUMBA_NUM_THREADS)
    _, q, w_uk, w_uv, cache, tables, row_seq, row_len = sparse_case(2, 3, 40, 8, 5, 5, 333)
    start = np.array([0, 10, 0, 300, 2], np.int32)
    index = np.full((5, 400), -1, np.int32)
    for r in range(5):
        index[r, :row_len[r] - start[r]] = np.arange(start[r], row_len[r])
    args = (q, w_uk, w_uv, cache, tables, row_seq, row_len, 0.2)
    np.testing.assert_array_equal(be.mla_attention_absorbed(*args, row_start=start, index=index),
                                  be.mla_attention_absorbed(*args, row_start=start))


def test_a_bad_list_is_refused_after_a_good_one_of_the_same_shape():
    be = get_backend("cpu")
    _, q, w_uk, w_uv, cache, tables, row_seq, row_len = sparse_case(3, 2, 40, 8, 4, 3, 50)
    index = np.tile(np.arange(20, dtype=np.int32), (3, 1))
    args = (q, w_uk, w_uv, cache, tables, row_seq, row_len, 0.2)
    be.mla_attention_absorbed(*args, index=index)
    for r, i, v in ((0, 3, 2), (1, 0, 60), (2, 5, -2)):
        bad = index.copy()
        bad[r, i] = v
        with pytest.raises(ValueError, match=rf"index\[{r}, {i}\]"):
            be.mla_attention_absorbed(*args, index=bad)
    assert mla.check_index(index, 3, row_len) is None
