"""GLM-5.3's pooled DSA indexer on the CUDA kernels (kernels/dsa.cu: the key write's gate
columns, dsa_pool_score_kernel, dsa_topk_kernel over pools) on the CPU emulator, against the
NumPy reference (mtpkern/ops/dsa.py, "Pools") and tests/test_dsa_kpool.py's float64 selection:

- the key write with ``gate``: the key in columns [0, Di) as the plain write puts it, the gate
  scores in [Di, 2 Di) as the cache stores them (FP32 and BF16 caches, FP32 and BF16 gates), a
  slot given twice ending with the later row, host slots outside the cache refused and device
  ones writing nothing;
- the selection with and without the tail, rows whose length is no multiple of P, a row with few
  pools (every row: the dense attention), a wrong ``ape`` caught (the negative control);
- exact pool scores (the bias gives each pool's first row all the weight) over 4400 rows: ties
  on the threshold to the earlier pool, NaN pools below every number, more picks than a block
  has threads (the expansion's chunks), against a sort written here;
- the caller's workspace (``workspace_shapes(kpool=)``) used, none needed when every row fits.

The check_* functions run on the device too (tests/test_gpu.py::test_dsa_kpool_kernels_on_the_device).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import test_dsa_kpool
from cuda_emu import emu_backend
from mtpkern.backends import get_backend
from mtpkern.backends.cuda_launch import dsa as dsa_launch
from mtpkern.ops import dsa
from mtpkern.tolerance import assert_close
from test_cuda_emulated_dsa import index_cache, rnd

REF = get_backend("numpy")
BF16 = ml_dtypes.bfloat16
KV_DTYPES = ("bfloat16", "float32")


@pytest.fixture(scope="module")
def emu():
    yield from emu_backend.installed_emulator()


# -- the key write ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kv", KV_DTYPES)
@pytest.mark.parametrize("gate_dtype", ["float32", "bfloat16"])
def test_key_write_with_gate(emu, kv, gate_dtype):
    check_key_write_gate(emu_backend.backend(kv), gate_dtype)


def check_key_write_gate(be, gate_dtype: str) -> None:
    """[key | gate] rows against the reference: the key within the cache's tolerance (the plain
    write's bits), the gate scores exact in the cache's dtype; slot 3 twice: the later row."""
    rng = np.random.default_rng(21)
    n, Di, Hi, NB, BS = 6, 24, 2, 3, 4
    k, q = rnd(rng, n, Di, scale=3.0), rnd(rng, n, Hi, Di)
    gate = rnd(rng, n, Di, scale=4.0)
    if gate_dtype == "bfloat16":
        gate = gate.astype(BF16)
    w, b = rnd(rng, Di), rnd(rng, Di)
    pos, slots = np.arange(n, dtype=np.int32) * 7, np.array([3, 7, 3, 0, 9, 11], np.int32)
    f = np.array([0.5, 0.01], np.float32)                                       # R 4
    cache, plain = be.empty_latent_kv(NB, BS, 2 * Di), be.empty_latent_kv(NB, BS, Di)
    got_q = be.dsa_key_write(k, w, b, 1e-6, f, pos, cache, slots, q=q, gate=gate)
    be.dsa_key_write(k, w, b, 1e-6, f, pos, plain, slots)
    ref = np.zeros((NB, BS, 2 * Di), np.float32)
    want_q = REF.dsa_key_write(k, w, b, 1e-6, f, pos, ref, slots, q=q, gate=gate)
    host = np.asarray(be.kv_to_host(cache), np.float32)
    tol = "bfloat16" if np.dtype(be.kv_dtype) == np.uint16 else "float32"
    assert_close(host[..., :Di], ref[..., :Di], tol, "the keys")
    np.testing.assert_array_equal(host[..., :Di], np.asarray(be.kv_to_host(plain), np.float32))
    stored = ref[..., Di:].astype(BF16).astype(np.float32) if tol == "bfloat16" else ref[..., Di:]
    np.testing.assert_array_equal(host[..., Di:], stored)
    assert np.array_equal(host.reshape(-1, 2 * Di)[3, Di:], stored.reshape(-1, Di)[3])
    assert_close(be.to_host(got_q), want_q, "float32", "roped query")


def test_key_write_with_gate_refuses_and_skips_bad_slots(emu, monkeypatch):
    be = emu_backend.backend("float32")
    rng = np.random.default_rng(22)
    n, Di = 3, 8
    k, gate = rnd(rng, n, Di), rnd(rng, n, Di)
    args = (k, np.ones(Di, np.float32), np.zeros(Di, np.float32), 1e-6, np.zeros(0, np.float32),
            np.arange(n, dtype=np.int32))
    cache = be.empty_latent_kv(2, 4, 2 * Di)
    with pytest.raises(ValueError, match="slots"):
        be.dsa_key_write(*args, cache, np.array([0, 8, 1], np.int32), gate=gate)
    with pytest.raises(ValueError, match=r"gate: expected shape \[3, 8\]"):
        be.dsa_key_write(*args, cache, np.array([0, 2, 1], np.int32), gate=gate[:, :7])
    with pytest.raises(ValueError, match=r"index_cache: expected \[NB, BS, 2 Di\]"):
        be.dsa_key_write(*args, be.empty_latent_kv(2, 4, 2 * Di + 1), np.array([0, 2, 1], np.int32), gate=gate)
    assert not cache.any()
    monkeypatch.setattr(dsa_launch, "is_device_array", lambda a: True)       # device slots: not read back
    be.dsa_key_write(*args, cache, np.array([0, 8, 1], np.int32), gate=gate)
    assert not cache.any()


# -- the selection -----------------------------------------------------------------------------------

@pytest.mark.parametrize("kv", KV_DTYPES)
@pytest.mark.parametrize("tail", [True, False])
def test_select_equals_reference(emu, kv, tail):
    check_select_kpool(emu_backend.backend(kv), tail)


def check_select_kpool(be, tail: bool) -> None:
    """tests/test_dsa_kpool.py's case (margins at the cut checked there) on ``be``: each row's list
    equals the reference's and the float64 one's: 23 pools + 2 tail rows, 9 + 1, 1 + 3 (dense)."""
    cache, tables, q, w, ape = test_dsa_kpool.case(1)
    BS, P, T = cache.shape[1], 4, 8
    ic = index_cache(be, cache)
    host = np.asarray(be.kv_to_host(ic), np.float32)
    row_seq, row_len = np.array([0, 1, 1], np.int32), np.array([94, 37, 7], np.int32)
    got = be.to_host(be.dsa_select(be.from_host(q), be.from_host(w), ic, tables, row_seq, row_len, T, 0.3, kpool=P,
                                   ape=ape, tail=tail))
    want = REF.dsa_select(q, w, host, tables, row_seq, row_len, T, 0.3, kpool=P, ape=ape, tail=tail)
    assert got.shape == (3, dsa.list_width(T, P, tail)) and got.dtype == np.int32
    np.testing.assert_array_equal(got, want)
    for r in range(3):
        L = row_len[r]
        rows_kg = host[tables[row_seq[r], np.arange(L) // BS], np.arange(L) % BS]
        listed, _ = test_dsa_kpool.select64(q[r], w[r], rows_kg, L, T, P, ape, tail, 0.3)
        assert got[r][got[r] >= 0].tolist() == listed, r


def test_select_without_the_bias_differs(emu):
    """The negative control: ``ape`` dropped, another selection (so the comparisons above see it)."""
    be = emu_backend.backend("float32")
    cache, tables, q, w, ape = test_dsa_kpool.case(1)
    args = (q, w, cache, tables, np.array([0, 1, 1], np.int32), np.array([94, 37, 7], np.int32), 8, 0.3)
    with_ape = be.dsa_select(*args, kpool=4, ape=ape)
    assert np.array_equal(with_ape, REF.dsa_select(*args, kpool=4, ape=ape))
    assert not np.array_equal(be.dsa_select(*args, kpool=4, ape=np.zeros_like(ape)), with_ape)


def exact_pool_case(rng, pools: int, P: int, levels: int):
    """One sequence of ``pools`` pools whose score is exactly their first row's dim 0: the bias
    gives row 0 of every pool weight 1 and the others exp(-200) = 0 in FP32 (the pooled key is
    row 0's), and heads (e0, -e0) with weights (1, -1) give relu(k0) - relu(-k0) = k0 (inf, -inf
    and NaN too). Values on a grid of ``levels`` BF16-exact numbers (heavy ties)."""
    Di, Hi, BS = 8, 2, 64
    rows = pools * P + P - 1                                     # and an incomplete pool
    NB = -(-rows // BS) + 1
    vals = rnd(rng, NB, BS, 2 * Di)
    vals[..., Di:] = 0.0                                         # gate scores 0: the bias alone decides
    k0 = (rng.integers(-levels, levels, pools) / 8).astype(np.float32)
    k0[rng.choice(pools, 30, replace=False)] = np.nan
    k0[rng.choice(pools, 10, replace=False)] = np.inf
    k0[rng.choice(pools, 10, replace=False)] = -np.inf
    tables = rng.permutation(NB)[None, : NB - 1].astype(np.int32)
    flat = vals.reshape(-1, 2 * Di)
    first = np.arange(pools) * P                                 # each pool's first row's slot
    flat[tables[0, first // BS] * BS + first % BS, 0] = k0
    ape = np.full((P, Di), -200.0, np.float32)
    ape[0] = 0.0
    q = np.zeros((2, Hi, Di), np.float32)
    q[:, 0, 0], q[:, 1, 0] = 1.0, -1.0
    w = np.tile(np.array([1.0, -1.0], np.float32), (2, 1))
    row_len = np.array([rows, rows - 2 * P - 1], np.int32)
    return vals, tables, q, w, ape, row_len, k0


def check_select_exact_pools(be, pools: int, P: int, topk: int) -> None:
    """exact_pool_case's lists on ``be``: the pools a sort picks (NaN last, higher first, the
    earlier pool), their rows ascending, then the tail; bit for bit."""
    rng = np.random.default_rng(pools + topk)
    vals, tables, q, w, ape, row_len, k0 = exact_pool_case(rng, pools, P, 3)
    got = be.to_host(be.dsa_select(be.from_host(q), be.from_host(w), index_cache(be, vals), tables,
                                   np.zeros(2, np.int32), row_len, topk, 1.0, kpool=P, ape=ape))
    for r in range(2):
        n_pools = row_len[r] // P
        s = k0[:n_pools]
        nan = np.isnan(s)
        order = np.lexsort((np.arange(n_pools), np.where(nan, 0.0, -s.astype(np.float64)), nan))
        picked = np.sort(order[:topk // P])
        want = np.r_[(picked[:, None] * P + np.arange(P)).ravel(), np.arange(n_pools * P, row_len[r])]
        np.testing.assert_array_equal(got[r, :want.size], want, err_msg=f"row {r}")
        assert (got[r, want.size:] == -1).all()


@pytest.mark.parametrize("pools,P,topk,kpt", [(2200, 2, 1200, 16), (700, 4, 64, 4)])
def test_select_exact_pool_scores(emu, pools, P, topk, kpt):
    """Ties on the threshold (3 levels: hundreds of pools share a score), NaN pools, +-inf; 600
    picks of 2200 pools (the expansion in two chunks of 512) and 16 of 700."""
    assert dsa_launch.topk_kpt(dsa_launch.workspace_shapes(2, (-(-(pools * P + P - 1) // 64)) * 64, topk,
                                                           P)["scores"][1]) == kpt
    before = emu.launches.copy()
    check_select_exact_pools(emu_backend.backend("float32"), pools, P, topk)
    ran = emu.launches - before
    assert ran["dsa_pool_score_kernel<float>"] >= 1 and ran[f"dsa_topk_kernel<{kpt}>"] == 1


def test_select_all_tied_takes_the_earlier_pools_and_nan_ranks_last(emu):
    """Every row alike: every pool scores the same, the earliest topk / P pools win; a NaN in one
    of them (its gate scores) drops it below every number: the next pool comes in."""
    be = emu_backend.backend("bfloat16")
    cache, tables, q, w, ape = test_dsa_kpool.case(2, n=2)
    cache[:] = cache[0, 0]
    BS = cache.shape[1]
    args = (q, w, None, tables, np.zeros(2, np.int32), np.array([40, 41], np.int32), 8, 1.0)
    got = be.dsa_select(*args[:2], index_cache(be, cache), *args[3:], kpool=4, ape=ape)
    assert got[0].tolist() == list(range(8)) + [-1] * 3 and got[1].tolist() == list(range(8)) + [40, -1, -1]
    row = 5                                                       # pool 1's second row
    cache[tables[0, row // BS], row % BS, 6 + 2] = np.nan         # one of its gate scores (Di 6)
    got = be.dsa_select(*args[:2], index_cache(be, cache), *args[3:], kpool=4, ape=ape)
    want = [0, 1, 2, 3, 8, 9, 10, 11]
    assert got[0].tolist() == want + [-1] * 3 and got[1].tolist() == want + [40, -1, -1]
    np.testing.assert_array_equal(got, REF.dsa_select(*args[:2], be.kv_to_host(index_cache(be, cache)), *args[3:],
                                                      kpool=4, ape=ape))


def test_select_workspace_and_dense_tables(emu, monkeypatch):
    """The caller's ``out`` and ``scores`` ([n, cap // P]) are used, nothing allocated, a wrong
    shape refused by name; a table of at most topk / P pools launches no score kernel."""
    be = emu_backend.backend("float32")
    cache, tables, q, w, ape = test_dsa_kpool.case(1)
    row_seq, row_len = np.array([0, 1, 1], np.int32), np.array([94, 37, 7], np.int32)
    cap, P, T = tables.shape[1] * cache.shape[1], 4, 8
    shapes = dsa_launch.workspace_shapes(3, cap, T, P)
    assert shapes == {"scores": (3, 24)} and dsa_launch.workspace_shapes(3, 11, 8, 4) == {}
    out, scores = np.zeros((3, T + P - 1), np.int32), np.zeros(shapes["scores"], np.float32)
    real_output = dsa_launch.output

    def no_alloc(buf, name, shape, dtype):
        assert buf is not None, f"{name}: allocated by the launcher"
        return real_output(buf, name, shape, dtype)

    monkeypatch.setattr(dsa_launch, "output", no_alloc)
    args = (q, w, cache, tables, row_seq, row_len, T, 0.3)
    assert be.dsa_select(*args, kpool=P, ape=ape, out=out, scores=scores) is out
    np.testing.assert_array_equal(out, REF.dsa_select(*args, kpool=P, ape=ape))
    assert scores[0, :23].any() and scores[1, :9].any() and not scores[2].any()
    with pytest.raises(ValueError, match=r"scores: expected shape \[3, 24\]"):
        be.dsa_select(*args, kpool=P, ape=ape, out=out, scores=scores[:, :23].copy())
    with pytest.raises(ValueError, match=r"out: expected shape \[3, 11\]"):
        be.dsa_select(*args, kpool=P, ape=ape, out=out[:, :8].copy(), scores=scores)
    monkeypatch.undo()
    before = emu.launches.copy()
    small = np.ascontiguousarray(tables[:, :1])                   # 8 rows: 2 pools, every row listed
    got = be.dsa_select(q, w, cache, small, row_seq, np.array([8, 7, 3], np.int32), T, 0.3, kpool=P, ape=ape,
                        tail=False)
    assert not any(k.startswith("dsa_pool_score_kernel") for k in (emu.launches - before))
    assert got.tolist() == [list(range(8)), [0, 1, 2, 3] + [-1] * 4, [-1] * 8]


@pytest.mark.parametrize("kw,match", test_dsa_kpool.POOL_REFUSALS + [
    (dict(row_len=np.array([20, 0, 20], np.int32)), r"row_len\[1\]"),
])
def test_bad_arguments_are_refused_by_name(emu, kw, match):
    """As tests/test_dsa_kpool.py's refusals on numpy and cpu, on the cuda launcher; ``out`` untouched."""
    be = emu_backend.backend("float32")
    cache, tables, q, w, ape = test_dsa_kpool.case(4)
    kw = dict(dict(kpool=4, ape=ape), **kw)
    if isinstance(kw.get("ape"), str):
        kw["ape"] = ape[:3]
    row_len = kw.pop("row_len", np.full(3, 20, np.int32))
    out = np.full((3, 11), 7, np.int32)
    with pytest.raises((ValueError, TypeError), match=match):
        be.dsa_select(q, w, cache, tables, np.zeros(3, np.int32), row_len, 8, 1.0, out=out, **kw)
    assert (out == 7).all()
