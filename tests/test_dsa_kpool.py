"""GLM-5.3's pooled DSA indexer (``index_kpool``): pools of P consecutive rows, each a
per-dim softmax of ``gate + ape`` over its rows weighing their keys; the rows of the
``index_topk / P`` best complete pools, then the incomplete pool's (the tail).

The selection against a float64 one written here (numpy reference and cpu backend; the
cpu backend equal to the reference), the dense rule (a row with at most T / P complete
pools lists every row it sees), the key write's plane ``[key | gate]``; a proposer whose
MLA module runs the pooled indexer drafts and keeps the KV the float64 oracle does, and the
oracle test fails with the pools off, another top-k, or the position bias dropped.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numba
import numpy as np
import pytest

import test_oracle
from conftest import MLA_FIELDS
from mtpkern import MultiModuleMtpHead, write_synthetic_checkpoint
from mtpkern.backends import get_backend
from mtpkern.backends.cpu import CpuBackend
from mtpkern.backends.cpu_kernels import dsa as dsa_k
from mtpkern.backends.cpu_kernels.linear import SMALL
from mtpkern.config import tiny_config
from mtpkern.ops import dsa
from mtpkern.testing import reference_weights


def select64(q, w, rows_kg, L, topk, P, ape, tail, scale):
    """One query row's list: float64 from the formulas (rows_kg [L, 2 Di] in row order)."""
    Di = ape.shape[1]
    n_pools = L // P
    k = rows_kg[:n_pools * P, :Di].astype(np.float64).reshape(n_pools, P, Di)
    g = rows_kg[:n_pools * P, Di:].astype(np.float64).reshape(n_pools, P, Di) + ape.astype(np.float64)
    pw = np.exp(g - g.max(1, keepdims=True))
    pk = (pw / pw.sum(1, keepdims=True) * k).sum(1)
    score = (w.astype(np.float64) * scale) @ np.maximum(q.astype(np.float64) @ pk.T, 0)
    pools = sorted(range(n_pools), key=lambda j: (-score[j], j))[:topk // P]
    rows = sorted(r for j in pools for r in range(j * P, (j + 1) * P))
    if tail:
        rows += list(range(n_pools * P, L))
    return rows, score


def case(seed, n=3, NB=12, BS=8, Di=6, Hi=3, P=4):
    rng = np.random.default_rng(seed)
    cache = rng.standard_normal((NB, BS, 2 * Di)).astype(np.float32)
    tables = np.stack([rng.permutation(NB), rng.permutation(NB)]).astype(np.int32)
    q = rng.standard_normal((n, Hi, Di)).astype(np.float32)
    w = rng.standard_normal((n, Hi)).astype(np.float32)
    ape = rng.standard_normal((P, Di)).astype(np.float32)
    return cache, tables, q, w, ape


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
@pytest.mark.parametrize("tail", [True, False])
def test_selection_equals_float64(backend, tail):
    be = get_backend(backend)
    cache, tables, q, w, ape = case(1)
    BS, P, T = cache.shape[1], 4, 8
    row_seq = np.array([0, 1, 1], np.int32)
    row_len = np.array([94, 37, 7], np.int32)              # 23 pools + 2, 9 pools + 1, 1 pool + 3 (dense)
    got = be.dsa_select(q, w, cache, tables, row_seq, row_len, T, 0.3, kpool=P, ape=ape, tail=tail)
    assert got.shape == (3, T + (P - 1 if tail else 0)) and got.dtype == np.int32
    for r in range(3):
        s, L = row_seq[r], row_len[r]
        rows_kg = cache[tables[s, np.arange(L) // BS], np.arange(L) % BS]
        want, score = select64(q[r], w[r], rows_kg, L, T, P, ape, tail, 0.3)
        listed = got[r][got[r] >= 0].tolist()
        assert listed == want, (r, listed, want)
        assert (got[r][len(want):] == -1).all()
        if L // P > T // P:                   # a real choice: the margin at the cut is not a near tie
            top = np.sort(score)[::-1]
            assert top[T // P - 1] - top[T // P] > 1e-4
    if backend == "cpu":
        assert np.array_equal(got, dsa.dsa_select(q, w, cache, tables, row_seq, row_len, T, 0.3, kpool=P, ape=ape,
                                                  tail=tail))


def test_a_row_with_few_pools_lists_every_row_and_ties_take_the_earlier_pool():
    cache, tables, q, w, ape = case(2, n=2)
    BS = cache.shape[1]
    got = dsa.dsa_select(q, w, cache, tables, np.zeros(2, np.int32), np.array([11, 8], np.int32), 8, 1.0,
                         kpool=4, ape=ape)
    assert got[0].tolist() == list(range(11)) + [-1] * 0 and got[1].tolist()[:8] == list(range(8))
    flat = cache.copy()                        # every row alike: every pool scores the same
    flat[:] = flat[0, 0]
    got = dsa.dsa_select(q, w, flat, tables, np.zeros(2, np.int32), np.array([40, 40], np.int32), 8, 1.0,
                         kpool=4, ape=ape)
    assert got[0].tolist() == list(range(8)) + [-1] * 3
    del BS


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_key_write_keeps_key_and_gate(backend):
    be = get_backend(backend)
    rng = np.random.default_rng(3)
    n, Di, Hi = 5, 8, 2
    k, gate = rng.standard_normal((n, Di)).astype(np.float32), rng.standard_normal((n, Di)).astype(np.float32)
    nw, nb = np.ones(Di, np.float32), np.zeros(Di, np.float32)
    cache = np.zeros((4, 4, 2 * Di), np.float32)
    slots = np.array([3, 7, 3, 0, 9], np.int32)           # slot 3 twice: the later row wins
    be.dsa_key_write(k, nw, nb, 1e-6, np.array([1.0], np.float32), np.arange(n, dtype=np.int32), cache, slots,
                     gate=gate)
    rows = cache.reshape(16, 2 * Di)
    assert np.array_equal(rows[slots[[1, 2, 3, 4]], Di:], gate[[1, 2, 3, 4]])
    plain = np.zeros((4, 4, Di), np.float32)
    be.dsa_key_write(k, nw, nb, 1e-6, np.array([1.0], np.float32), np.arange(n, dtype=np.int32), plain, slots)
    assert np.array_equal(rows[:, :Di], plain.reshape(16, Di))


#: a pooled selection's bad arguments and the refusal each gets, on every backend
#: (tests/test_cuda_emulated_dsa_kpool.py takes them for the cuda launcher)
POOL_REFUSALS = [
    (dict(kpool=3, ape="short"), r"topk: expected a multiple of kpool = 3"),
    (dict(kpool=1), r"kpool: expected 0 \(a key per row\) or an int in \[2, 1024\]"),
    (dict(ape="short"), r"ape: expected shape"),
    (dict(ape=None), r"ape: expected the pools' position bias"),
    (dict(row_start=np.array([1, 0, 0], np.int32)), r"row_start: a pooled indexer's pools start"),
]


@pytest.mark.parametrize("kw,match", POOL_REFUSALS)
def test_bad_arguments_are_refused_by_name(kw, match):
    cache, tables, q, w, ape = case(4)
    kw = dict(dict(kpool=4, ape=ape), **kw)
    if isinstance(kw.get("ape"), str):
        kw["ape"] = ape[:3]
    for name in ("numpy", "cpu"):
        with pytest.raises((ValueError, TypeError), match=match):
            get_backend(name).dsa_select(q, w, cache, tables, np.zeros(3, np.int32), np.full(3, 20, np.int32),
                                         8, 1.0, **kw)


#: an MLA block with a pooled indexer: 4 rows = 2 pools of 2 (and a tail of 1), 2 heads of 16
KPOOL_FIELDS = dict(MLA_FIELDS, index_topk=4, index_n_heads=2, index_head_dim=16, index_kpool=2)


@pytest.fixture(scope="module")
def kpool_ckpt(tmp_path_factory):
    cfg = tiny_config(**KPOOL_FIELDS)
    path = write_synthetic_checkpoint(tmp_path_factory.mktemp("kpool"), cfg, seed=9, dtype="float32")
    return path, cfg, reference_weights(path)


SCENARIO = [(3, 1.0), (3, 0.4), (2, 0.0), (3, 1.0)]


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_proposer_drafts_and_kv_equal_the_oracle(kpool_ckpt, backend):
    path, cfg, weights = kpool_ckpt
    prop = MultiModuleMtpHead.from_pretrained(path, backend=backend, kv_mode="exact", block_size=4, num_blocks=96,
                                              prefill_chunk=7)
    assert prop.modules[0].pool.index_k.shape[2] == 32 and prop.modules[0].w.idx_ape.shape == (2, 16)
    test_oracle.run_scenario(prop, cfg, weights, 5, 20, SCENARIO, "prenorm", None)


@pytest.mark.parametrize("wrong", ["no_pools", "other_topk", "no_ape"])
def test_negative_controls_fail(kpool_ckpt, wrong):
    path, cfg, weights = kpool_ckpt
    other, w = cfg, weights
    if wrong == "no_pools":
        other = dataclasses.replace(cfg, index_kpool=0)
    elif wrong == "other_topk":
        other = dataclasses.replace(cfg, index_topk=6)
    else:
        mods = [dataclasses.replace(m, idx_ape=np.zeros_like(m.idx_ape)) for m in weights.modules]
        w = dataclasses.replace(weights, modules=mods)
    prop = MultiModuleMtpHead(other, w, get_backend("numpy"), kv_mode="exact", block_size=4, num_blocks=96)
    with pytest.raises(AssertionError):
        test_oracle.run_scenario(prop, cfg, weights, 5, 20, SCENARIO, "prenorm", None)


def test_a_pooled_block_without_its_tail_is_refused():
    from mtpkern.errors import ConfigError
    with pytest.raises((ConfigError, ValueError), match="index_kpool_always_select_tail expected true"):
        tiny_config(**KPOOL_FIELDS, index_kpool_always_select_tail=False).block(0)


# -- the cpu backend's pooled kernel (cpu_kernels/dsa.py, dsa_select_pools_kernel) -------------

def big_case(seed, dtype="float32", BS=16, Di=16, Hi=20, P=4):
    """Two sequences over a shuffled pool: a row past one scoring task (600 pools > CHUNK), one
    whose L is no multiple of P, one with few pools (dense), one of the other sequence; enough
    work for the parallel path."""
    rng = np.random.default_rng(seed)
    long = 600 * P + 3
    mb = -(-long // BS)
    NB = 2 * mb + 1
    cache = rng.standard_normal((NB, BS, 2 * Di)).astype(np.float32)
    perm = rng.permutation(NB).astype(np.int32)
    tables = np.stack([perm[:mb], perm[mb:2 * mb]])
    row_seq = np.array([0, 0, 1, 0, 1], np.int32)
    row_len = np.array([long, long - 2 * P - 1, 9 * P + 2, P + 1, 1], np.int32)
    q = rng.standard_normal((5, Hi, Di)).astype(np.float32)
    w = rng.standard_normal((5, Hi)).astype(np.float32)
    ape = rng.standard_normal((P, Di)).astype(np.float32)
    if dtype == "bfloat16":
        cache = cache.astype(ml_dtypes.bfloat16)
    return cache, tables, q, w, ape, row_seq, row_len


def rows_of(cache, table, L):
    BS = cache.shape[1]
    return np.asarray(cache[table[np.arange(L) // BS], np.arange(L) % BS], np.float32)


def assert_cpu_is_reference(be, cache, tables, q, w, ape, row_seq, row_len, T, P, tail, scale=0.3):
    got = be.dsa_select(q, w, cache, tables, row_seq, row_len, T, scale, kpool=P, ape=ape, tail=tail)
    want = dsa.dsa_select(q, w, cache, tables, row_seq, row_len, T, scale, kpool=P, ape=ape, tail=tail)
    assert got.shape == want.shape == (q.shape[0], dsa.list_width(T, P, tail)) and got.dtype == np.int32
    for r in range(q.shape[0]):
        if not np.array_equal(got[r], want[r]):       # only a near tie at the cut may differ
            _, score = select64(q[r], w[r], rows_of(cache, tables[row_seq[r]], row_len[r]), row_len[r], T, P,
                                ape, tail, scale)
            top = np.sort(score[~np.isnan(score)])[::-1]
            raise AssertionError(f"row {r}: cpu {got[r].tolist()} != numpy {want[r].tolist()}; "
                                 f"scores at the cut {top[T // P - 1:T // P + 1]}")
    return got


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tail", [True, False])
def test_cpu_pools_kernel_is_the_reference(threads, dtype, tail):
    cache, tables, q, w, ape, row_seq, row_len = big_case(5, dtype)
    P, T = ape.shape[0], 12
    Hi, Di = q.shape[1], q.shape[2]
    assert (row_len[0] // P) > dsa_k.CHUNK and (row_len[0] // P) * Hi * Di > SMALL, "the parallel path"
    be = CpuBackend(threads=min(threads, numba.config.NUMBA_NUM_THREADS))
    got = assert_cpu_is_reference(be, cache, tables, q, w, ape, row_seq, row_len, T, P, tail)
    dense = list(range(P)) + ([P] if tail else [])            # row 3: one pool (+ 1 tail row): every row
    assert got[3, :len(dense)].tolist() == dense and (got[3, len(dense):] == -1).all()
    assert got[4].tolist() == ([0] if tail else []) + [-1] * (got.shape[1] - (1 if tail else 0))
    for r in range(3):                                         # a real choice, against float64 as well
        want, _ = select64(q[r], w[r], rows_of(cache, tables[row_seq[r]], row_len[r]), row_len[r], T, P, ape,
                           tail, 0.3)
        assert got[r][got[r] >= 0].tolist() == want


def test_cpu_equal_pooled_keys_tie_to_the_earlier_pool():
    """The best pool copied (key and gate rows) to pools in other blocks, tiles of 8, pooled-key
    tasks and scoring tasks: of the equal pools the earliest win, on the serial and parallel
    paths."""
    cache, tables, q, w, ape, row_seq, row_len = big_case(6)
    P, T = ape.shape[0], 8                                     # 2 pools picked
    q, w, row_seq, row_len = q[:1], w[:1], row_seq[:1], row_len[:1]
    BS = cache.shape[1]
    L = int(row_len[0])
    _, score = select64(q[0], w[0], rows_of(cache, tables[0], L), L, T, P, ape, True, 1.0)
    best = int(np.argmax(score))
    copies = [j for j in (3, 130, 517, 599) if j != best]
    for j in copies:
        for t in range(P):
            src, dst = best * P + t, j * P + t
            cache[tables[0, dst // BS], dst % BS] = cache[tables[0, src // BS], src % BS]
    first_two = sorted([best] + copies)[:2]
    want = [j * P + t for j in first_two for t in range(P)] + list(range(L // P * P, L))
    for n_rows, threads in ((1, 1), (2, numba.config.NUMBA_NUM_THREADS)):
        be = CpuBackend(threads=threads)
        qq, ww = np.repeat(q, n_rows, 0), np.repeat(w, n_rows, 0)
        got = be.dsa_select(qq, ww, cache, tables, np.repeat(row_seq, n_rows), np.repeat(row_len, n_rows), T,
                            1.0, kpool=P, ape=ape)
        for r in range(n_rows):
            assert got[r][got[r] >= 0].tolist() == want


@pytest.mark.parametrize("where", ["gate", "key"])
def test_cpu_a_nan_pool_ranks_lowest(where):
    cache, tables, q, w, ape = case(7, n=1)
    BS, Di, P = cache.shape[1], ape.shape[1], 4
    L, T = 6 * P + 1, 5 * P                                    # 6 pools, 5 picked: one is left out
    for j in (1, 4):                                           # pools 1 and 4 score NaN
        row = j * P + 2
        cache[tables[0, row // BS], row % BS, (Di if where == "gate" else 0) + 3] = np.nan
    got = get_backend("cpu").dsa_select(q, w, cache, tables, np.zeros(1, np.int32), np.array([L], np.int32), T,
                                        1.0, kpool=P, ape=ape)
    want = dsa.dsa_select(q, w, cache, tables, np.zeros(1, np.int32), np.array([L], np.int32), T, 1.0, kpool=P,
                          ape=ape)
    assert np.array_equal(got, want)
    left_out = sorted(set(range(6)) - {int(i) // P for i in got[0, :T]})
    assert left_out == [4], "of the two NaN pools the later one is left out"
    assert got[0, T:].tolist() == [L - 1, -1, -1]


def test_cpu_the_position_bias_decides_a_constructed_case():
    """Negative control: pool 0's first row and pool 1's second carry the large key; ape weighs
    each pool's second row: pool 1 wins, and with ape zeroed the pools tie (pool 0 wins)."""
    P, Di = 2, 1
    cache = np.zeros((1, 4, 2 * Di), np.float32)
    cache[0, 0, 0] = cache[0, 3, 0] = 10.0                     # keys 10 0 | 0 10, gates all 0
    args = (np.ones((1, 1, Di), np.float32), np.ones((1, 1), np.float32), cache, np.zeros((1, 1), np.int32),
            np.zeros(1, np.int32), np.array([4], np.int32), P, 1.0)
    ape = np.array([[-5.0], [5.0]], np.float32)
    for be in (get_backend("cpu"), get_backend("numpy")):
        assert be.dsa_select(*args, kpool=P, ape=ape).tolist() == [[2, 3, -1]]
        assert be.dsa_select(*args, kpool=P, ape=np.zeros_like(ape)).tolist() == [[0, 1, -1]]


def test_cpu_pools_never_call_the_reference(monkeypatch):
    def refused(*a, **k):
        raise AssertionError("the cpu backend called mtpkern.ops.dsa.dsa_select")
    cache, tables, q, w, ape, row_seq, row_len = big_case(8)
    want = dsa.dsa_select(q, w, cache, tables, row_seq, row_len, 12, 0.3, kpool=4, ape=ape)
    monkeypatch.setattr(dsa, "dsa_select", refused)
    got = get_backend("cpu").dsa_select(q, w, cache, tables, row_seq, row_len, 12, 0.3, kpool=4, ape=ape)
    assert np.array_equal(got, want)
