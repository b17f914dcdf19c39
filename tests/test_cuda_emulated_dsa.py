"""DSA's CUDA kernels (kernels/dsa.cu, and mla.cu's listed walk) on the CPU emulator, at the
shapes tests/test_ops_dsa.py does not reach: selections over 3000..40000 rows (every
keys-per-thread instantiation of dsa_topk_kernel, and past its registers), exact scores built
so that ties, NaN, infinities and signed zeros land on the threshold, DeepSeek-V3.2's indexer
shapes, the sparse attention split over partitions (lists that end before the last one: the
merge's neutral partials), a full list equal to the dense attention bit for bit with several
partitions, device lists and slots outside the cache never read, and the caller's workspaces.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import test_ops_mla
from cuda_emu import emu_backend

from mtpkern.backends import get_backend
from mtpkern.backends.cuda_launch import dsa as dsa_launch
from mtpkern.backends.cuda_launch import mla as mla_launch
from mtpkern.ops import mla
from mtpkern.ops.rope_kv import inv_freq
from mtpkern.tolerance import assert_close

REF = get_backend("numpy")
BF16 = ml_dtypes.bfloat16
KV_DTYPES = ("bfloat16", "float32")


@pytest.fixture(scope="module")
def emu():
    yield from emu_backend.installed_emulator()


@pytest.fixture
def sm_count(emu):
    def set_count(n: int):
        emu.sm_count = n
    yield set_count
    emu.sm_count = emu_backend.DEFAULT_SM_COUNT


def rnd(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def index_cache(be, values):
    """``be``'s index (or latent) cache holding the FP32 ``values`` [NB, BS, W] (BF16 bits for a
    BF16 cache), on its device."""
    bf16 = np.dtype(be.kv_dtype) == np.uint16
    return be.from_host(values.astype(BF16).view(np.uint16) if bf16 else values)


def sort_select(s: np.ndarray, rows: np.ndarray, topk: int) -> np.ndarray:
    """The spec's rule written as a sort: NaN last, higher score first, then the earlier row."""
    nan = np.isnan(s)
    key = np.where(nan, 0.0, -s.astype(np.float64))
    return np.sort(rows[np.lexsort((rows, key, nan))[:topk]])


# -- the selection over long rows, exact scores ---------------------------------------------------

def exact_case(rng, rows: int, BS: int, levels: int):
    """One sequence of ``rows`` keys whose score is exactly their dim 0: heads (e0, -e0) with
    weights (1, -1) give relu(k0) - relu(-k0) = k0 (inf, -inf and NaN too). Values on a grid of
    ``levels`` BF16-exact numbers (heavy ties), with NaN, +-inf and +-0 planted."""
    Di, Hi = 8, 2
    NB = -(-rows // BS) + 1
    vals = rnd(rng, NB, BS, Di)
    k0 = (rng.integers(-levels, levels, NB * BS) / 8).astype(np.float32)
    k0[rng.choice(NB * BS, 40, replace=False)] = np.nan
    k0[rng.choice(NB * BS, 20, replace=False)] = np.inf
    k0[rng.choice(NB * BS, 20, replace=False)] = -np.inf
    k0[rng.choice(NB * BS, 30, replace=False)] = -0.0
    vals.reshape(-1, Di)[:, 0] = k0
    tables = rng.permutation(NB)[None, : NB - 1].astype(np.int32)
    q = np.zeros((3, Hi, Di), np.float32)
    q[:, 0, 0], q[:, 1, 0] = 1.0, -1.0
    weights = np.tile(np.array([1.0, -1.0], np.float32), (3, 1))
    cap = (NB - 1) * BS
    row_len = np.array([cap, rows, rows - 700], np.int32)
    row_start = np.array([0, 5, 100], np.int32)
    return vals, tables, np.zeros(3, np.int32), row_len, row_start, q, weights


@pytest.mark.parametrize("kv", KV_DTYPES)
@pytest.mark.parametrize("rows,topk,kpt,sms,chunk", [(3000, 2048, 16, 132, 64), (3000, 7, 16, 1, 256),
                                                     (20000, 2048, 64, 132, 64), (20000, 2048, 64, 1, 256),
                                                     (40000, 2048, 64, 132, 256), (1500, 1, 4, 132, 64)])
def test_select_long_rows_exact_scores(emu, sm_count, kv, rows, topk, kpt, sms, chunk):
    """Every visible row's score is exact, so the kernel's selection must equal the sort bit for
    bit: ties across threads' runs on the threshold, NaN below -inf, -0 keys (scored +0); 40000 rows
    pass the 32768 keys the registers hold (the rest read again at each pass). Score blocks of
    4 tiles where they fill the device (1 SM; 3 x 157 blocks at 40000 rows), else of one."""
    sm_count(sms)
    cap = (-(-rows // 64)) * 64
    assert dsa_launch.topk_kpt(cap) == kpt
    assert dsa_launch.score_plan(2, 8, 3, cap, 4, 2 * sms).chunk == chunk
    before = emu.launches.copy()
    check_select_exact(emu_backend.backend(kv), rows, topk)
    assert (emu.launches - before)[f"dsa_topk_kernel<{kpt}>"] == 1


def check_select_exact(be, rows: int, topk: int) -> None:
    """exact_case's selection on ``be`` equals the sort's, bit for bit (tests/test_gpu.py too)."""
    rng = np.random.default_rng(rows + topk)
    vals, tables, row_seq, row_len, row_start, q, w = exact_case(rng, rows, 64, 3 if topk == 7 else 50)
    BS = vals.shape[1]
    got = be.to_host(be.dsa_select(be.from_host(q), be.from_host(w), index_cache(be, vals), tables, row_seq,
                                   row_len, topk, 1.0, row_start=row_start))
    flat = vals.reshape(-1, vals.shape[2])
    for r in range(3):
        seen = np.arange(row_start[r], row_len[r])
        s = flat[tables[0, seen // BS] * BS + seen % BS, 0]
        want = sort_select(s, seen, topk)
        np.testing.assert_array_equal(got[r], want, err_msg=f"row {r}: {seen.size} rows, topk {topk}")


def test_select_a_threshold_tie_spanning_many_threads(emu):
    """Every score equal: the earliest ``topk`` rows, whichever threads hold them; all NaN: the
    same; the reference agrees."""
    check_select_all_tied(emu_backend.backend("float32"))


def check_select_all_tied(be) -> None:
    NB, BS, Di, rows = 70, 64, 8, 4400
    tables = np.arange(NB, dtype=np.int32)[None]
    q, w = np.ones((2, 1, Di), np.float32), np.ones((2, 1), np.float32)
    row_seq, row_len, row_start = np.zeros(2, np.int32), np.array([rows, rows], np.int32), np.array([0, 333], np.int32)
    for fill in (0.25, np.nan):
        cache = index_cache(be, np.full((NB, BS, Di), fill, np.float32))
        got = be.to_host(be.dsa_select(be.from_host(q), be.from_host(w), cache, tables, row_seq, row_len, 2048, 1.0,
                                       row_start=row_start))
        np.testing.assert_array_equal(got, np.arange(2048)[None] + row_start[:, None])
        np.testing.assert_array_equal(got, REF.dsa_select(q, w, be.kv_to_host(cache), tables, row_seq, row_len, 2048,
                                                          1.0, row_start=row_start))


def near_tie_equal(got, s64: np.ndarray, rows: np.ndarray, topk: int, rel: float = 1e-5) -> None:
    """``got`` is a valid top-``topk`` of ``rows`` by the float64 scores, up to near ties: every
    chosen row scores at least every left-out row, within ``rel`` of the scores' scale."""
    pick = got[got >= 0]
    assert pick.size == min(topk, rows.size) and np.all(np.diff(pick) > 0), "ascending, complete"
    chosen = np.isin(rows, pick)
    if chosen.all():
        return
    slack = rel * np.abs(s64).max()
    assert s64[chosen].min() >= s64[~chosen].max() - slack, "a left-out row scores above a chosen one"


@pytest.mark.parametrize("kv", KV_DTYPES)
def test_select_deepseek_v32_shapes(emu, kv):
    """DeepSeek-V3.2's indexer (Hi 64, Di 128, topk 2048, scale Hi^-0.5 Di^-0.5) over 3000 rows,
    two query rows; against float64 scores of the values the cache holds (near ties allowed)."""
    Hi, Di, BS = 64, 128, 64
    be = emu_backend.backend(kv)
    plan = dsa_launch.score_plan(Hi, Di, 2, 48 * BS, np.dtype(be.kv_dtype).itemsize, 264,
                                 emu_backend.DEFAULT_SMEM_OPTIN)
    assert plan.tile == 64 and plan.chunk == 64 and plan.smem_bytes > 48 * 1024, plan   # opt-in; 1 tile a block
    check_select_v32(be, 48, (3000, 2100))


def check_select_v32(be, NB: int, lens) -> None:
    """DeepSeek-V3.2's indexer shapes over ``NB`` blocks of 64 rows, a query row per length in
    ``lens``: the selection against float64 scores, near ties allowed (tests/test_gpu.py too)."""
    Hi, Di, BS, topk = 64, 128, 64, 2048
    rng = np.random.default_rng(32)
    n = len(lens)
    vals = rnd(rng, NB, BS, Di)
    cache = index_cache(be, vals)
    host = be.kv_to_host(cache)
    tables = rng.permutation(NB)[None].astype(np.int32)
    q, w = rnd(rng, n, Hi, Di), rnd(rng, n, Hi)
    row_seq, row_len = np.zeros(n, np.int32), np.array(lens, np.int32)
    scale = Hi ** -0.5 * Di ** -0.5
    got = be.to_host(be.dsa_select(be.from_host(q), be.from_host(w), cache, tables, row_seq, row_len, topk, scale))
    flat = host.reshape(-1, Di).astype(np.float64)
    for r in range(n):
        rows = np.arange(row_len[r])
        keys = flat[tables[0, rows // BS] * BS + rows % BS]
        s64 = (w[r].astype(np.float64) * scale) @ np.maximum(q[r].astype(np.float64) @ keys.T, 0.0)
        near_tie_equal(got[r], s64, rows, topk)


def test_select_workspace_and_no_scores_when_every_row_fits(emu, monkeypatch):
    """The caller's ``out`` and ``scores`` (dsa.workspace_shapes) are used and nothing is
    allocated; a wrong shape is refused by name; a table of at most ``topk`` rows launches no
    score kernel and needs no workspace (every row lists all it sees)."""
    be = emu_backend.backend("bfloat16")
    rng = np.random.default_rng(4)
    NB, BS, Di, Hi, topk = 12, 16, 24, 3, 40
    cache = index_cache(be, rnd(rng, NB, BS, Di))
    tables = rng.permutation(NB).reshape(2, 6).astype(np.int32)
    row_seq, row_len = np.array([0, 1, 1], np.int32), np.array([96, 40, 7], np.int32)
    q, w = rnd(rng, 3, Hi, Di), rnd(rng, 3, Hi)
    shapes = dsa_launch.workspace_shapes(3, 96, topk)
    assert shapes == {"scores": (3, 96)} and dsa_launch.workspace_shapes(3, 40, 40) == {}
    out, scores = np.zeros((3, topk), np.int32), np.zeros(shapes["scores"], np.float32)
    real_output = dsa_launch.output

    def no_alloc(buf, name, shape, dtype):
        assert buf is not None, f"{name}: allocated by the launcher"
        return real_output(buf, name, shape, dtype)

    monkeypatch.setattr(dsa_launch, "output", no_alloc)
    want = REF.dsa_select(q, w, be.kv_to_host(cache), tables, row_seq, row_len, topk, 0.5)
    assert be.dsa_select(q, w, cache, tables, row_seq, row_len, topk, 0.5, out=out, scores=scores) is out
    np.testing.assert_array_equal(out, want)
    assert scores[0, :96].any() and not scores[1:].any(), "scores only of the row with more than topk rows"
    with pytest.raises(ValueError, match=r"scores: expected shape \[3, 96\]"):
        be.dsa_select(q, w, cache, tables, row_seq, row_len, topk, 0.5, out=out, scores=scores[:, :95].copy())
    monkeypatch.undo()
    before = emu.launches.copy()
    small = np.ascontiguousarray(tables[:, :2])                                  # 32 rows <= topk
    got = be.dsa_select(q, w, cache, small, row_seq, np.array([32, 20, 7], np.int32), topk, 0.5)
    ran = emu.launches - before
    assert not any(k.startswith("dsa_score_kernel") for k in ran) and ran["dsa_topk_kernel<4>"] == 1
    np.testing.assert_array_equal(got[1], np.r_[np.arange(20), np.full(topk - 20, -1)])


def test_select_refuses_a_row_with_nothing_to_see(emu):
    be = emu_backend.backend("float32")
    cache = be.empty_latent_kv(2, 4, 8)
    args = (np.ones((2, 1, 8), np.float32), np.ones((2, 1), np.float32), cache, np.array([[0, 1]], np.int32),
            np.zeros(2, np.int32))
    with pytest.raises(ValueError, match=r"row_len\[1\] / row_start\[1\]"):
        be.dsa_select(*args, np.array([3, 0], np.int32), 2, 1.0)
    with pytest.raises(ValueError, match=r"row_len\[0\] / row_start\[0\]"):
        be.dsa_select(*args, np.array([3, 3], np.int32), 2, 1.0, row_start=np.array([3, 0], np.int32))


# -- the key write ---------------------------------------------------------------------------------

def test_key_write_device_slots_out_of_range_write_nothing(emu, monkeypatch):
    """Device slots are not read back: one outside the cache and no block writes (each scans
    them all); the query is still roped; a slot given twice ends with the later row."""
    be = emu_backend.backend("bfloat16")
    rng = np.random.default_rng(6)
    Di, R, NB, BS, n = 24, 8, 3, 4, 4
    k, q = rnd(rng, n, Di), rnd(rng, n, 2, Di)
    w, b = rnd(rng, Di), rnd(rng, Di)
    pos = np.arange(n, dtype=np.int32)
    monkeypatch.setattr(dsa_launch, "is_device_array", lambda a: True)
    cache = be.empty_latent_kv(NB, BS, Di)
    got = be.dsa_key_write(k, w, b, 1e-6, inv_freq(R, 1e4), pos, cache, np.array([0, 5, NB * BS, 1], np.int32), q=q)
    assert not cache.any()
    want_q = REF.dsa_key_write(k, w, b, 1e-6, inv_freq(R, 1e4), pos, np.zeros((NB, BS, Di), np.float32),
                               pos, q=q)
    assert_close(got, want_q, "float32", "q roped")
    be.dsa_key_write(k, w, b, 1e-6, inv_freq(R, 1e4), pos, cache, np.array([3, 7, 3, 1], np.int32))
    ref = np.zeros((NB, BS, Di), np.float32)
    REF.dsa_key_write(k, w, b, 1e-6, inv_freq(R, 1e4), pos, ref, np.array([3, 7, 3, 1], np.int32))
    assert_close(be.kv_to_host(cache), ref, "bfloat16", "the later row of slot 3")


# -- the sparse attention: partitions, the full list, device lists -------------------------------

def sparse_case(be, rng, Hq, P, R, L, Dv, BS, max_blocks, n, T, full=False, window=False):
    NB = max_blocks + 2
    lc = index_cache(be, rnd(rng, NB, BS, L + R))
    tables = rng.permutation(NB)[None, :max_blocks].astype(np.int32)
    cap = max_blocks * BS
    row_seq = np.zeros(n, np.int32)
    row_len = np.array([cap, cap - 1, 150, 40, 1][:n], np.int32)
    row_start = np.array([0, cap - 260, 10, 39, 0][:n], np.int32) if window else None
    start = np.zeros(n, np.int32) if row_start is None else row_start
    index = np.full((n, T), -1, np.int32)
    for r in range(n):
        seen = np.arange(start[r], row_len[r])
        pick = seen if full else np.sort(rng.permutation(seen)[:T])
        index[r, :pick.size] = pick[:T]
    q = rnd(rng, n, Hq, P + R)
    w_uk = rnd(rng, Hq, P, L, scale=P ** -0.5).astype(BF16)
    w_uv = rnd(rng, Hq, Dv, L, scale=L ** -0.5).astype(BF16)
    return lc, tables, row_seq, row_len, row_start, q, w_uk, w_uv, index


@pytest.mark.parametrize("kv", KV_DTYPES)
@pytest.mark.parametrize("Hq", [5, 16])
def test_sparse_attention_split_partitions(emu, kv, Hq):
    """Lists of 300 rows over a 640-row context on 132 SMs: 3 partitions of 128 list positions;
    the rows whose lists end in the first or second partition write the merge's neutral partials
    in the others. Against the reference over the same lists (Hq 16 over BF16: tensor cores)."""
    p = mla_launch.plan(Hq, 64, 16, mla_launch.max_rows(640, np.zeros((1, 300))), 5, target_blocks=264,
                        smem_max=emu_backend.DEFAULT_SMEM_OPTIN, kv_itemsize=2 if kv == "bfloat16" else 4)
    assert p.num_parts == 3 and p.part_size == 128, p
    check_sparse_split(emu_backend.backend(kv), Hq)


def check_sparse_split(be, Hq: int) -> None:
    """Lists of up to 300 rows over a 640-row context, some ending early, against the reference
    (tests/test_gpu.py too)."""
    rng = np.random.default_rng(Hq)
    P, R, L, Dv, BS, max_blocks, n, T = 16, 16, 64, 24, 16, 40, 5, 300
    lc, tables, row_seq, row_len, row_start, q, w_uk, w_uv, index = sparse_case(
        be, rng, Hq, P, R, L, Dv, BS, max_blocks, n, T, window=True)
    assert ((index >= 0).sum(1) < 257).any(), "a list that ends before the last partition"
    scale = (P + R) ** -0.5
    got = be.to_host(be.mla_attention_absorbed(be.from_host(q), be.prepare_weight(w_uk), be.prepare_weight(w_uv),
                                               lc, tables, row_seq, row_len, scale, row_start=row_start, index=index))
    want = REF.mla_attention_absorbed(q, w_uk, w_uv, be.kv_to_host(lc), tables, row_seq, row_len, scale,
                                      row_start=row_start, index=index)
    tol = test_ops_mla.attention_tol(be, Hq, L, R, max_blocks * BS)
    assert_close(got, want, tol, "sparse attention, lists over partitions")


@pytest.mark.parametrize("kv", KV_DTYPES)
@pytest.mark.parametrize("window", [False, True])
def test_full_list_is_dense_bit_for_bit_over_partitions(emu, kv, window):
    """T = max_blocks * BS: the sparse plan is the dense one (3 partitions here), so a list of
    every visible row walks the same tiles and merges the same partials: the same bits; the
    rows' lists end in different partitions."""
    assert mla_launch.plan(16, 64, 16, 320, 5, target_blocks=264).num_parts == 3
    check_full_list_dense(emu_backend.backend(kv), window)


def check_full_list_dense(be, window: bool) -> None:
    """T = max_blocks * BS and every visible row listed: the dense result's bits (tests/test_gpu.py too)."""
    rng = np.random.default_rng(9)
    Hq, P, R, L, Dv, BS, max_blocks, n = 16, 16, 16, 64, 24, 16, 20, 5
    T = max_blocks * BS
    lc, tables, row_seq, row_len, row_start, q, w_uk, w_uv, index = sparse_case(
        be, rng, Hq, P, R, L, Dv, BS, max_blocks, n, T, full=True, window=window)
    args = (be.from_host(q), be.prepare_weight(w_uk), be.prepare_weight(w_uv), lc, tables, row_seq, row_len,
            (P + R) ** -0.5)
    dense = be.to_host(be.mla_attention_absorbed(*args, row_start=row_start))
    sparse = be.to_host(be.mla_attention_absorbed(*args, row_start=row_start, index=index))
    np.testing.assert_array_equal(sparse, dense)


def test_device_lists_outside_the_rows_are_never_read(emu, monkeypatch):
    """A device list is not checked on the host: entries past the row's rows, before its window,
    far past the cache, negative or -1 in the middle weigh nothing (their table entries, made
    invalid here, are never read): the result is the attention over the valid entries."""
    be = emu_backend.backend("float32")
    rng = np.random.default_rng(12)
    Hq, P, R, L, Dv, BS, max_blocks, n, T = 3, 16, 8, 40, 12, 8, 12, 3, 20
    lc, tables, row_seq, row_len, row_start, q, w_uk, w_uv, index = sparse_case(
        be, rng, Hq, P, R, L, Dv, BS, max_blocks, n, T, window=True)
    row_len[:] = [60, 50, 40]
    row_start[:] = [8, 20, 39]
    valid = np.full((n, T), -1, np.int32)
    valid[0, :5], valid[1, :3], valid[2, 0] = [8, 9, 30, 41, 59], [20, 33, 49], 39
    bad = valid.copy()
    bad[0, 5:9] = [60, 1 << 30, 7, -7]                   # past the row, far past the cache, before the window
    bad[1, 1], bad[1, 3] = -1, 95                         # a hole; past the row (inside the table)
    bad[2, 1:] = 2 ** 31 - 1
    poisoned = tables.copy()
    poisoned[0, :1] = 1 << 28                             # rows 0..7: before every window
    poisoned[0, 8:] = 1 << 28                             # rows 64..: past every row
    monkeypatch.setattr(mla_launch, "is_device_array", lambda a: a is bad)
    args = (q, be.prepare_weight(w_uk), be.prepare_weight(w_uv), lc, poisoned, row_seq, row_len, 0.2)
    got = be.mla_attention_absorbed(*args, row_start=row_start, index=bad)
    keep = valid.copy()
    keep[1] = -1
    keep[1, :2] = [20, 49]                                # row 1 without the hole's row 33
    want = REF.mla_attention_absorbed(q, w_uk, w_uv, be.kv_to_host(lc), tables, row_seq, row_len, 0.2,
                                      row_start=row_start, index=keep)
    assert_close(got, want, "float32", "sparse attention over the valid entries")
    with pytest.raises(ValueError, match=r"index\[0, 5\]"):            # a host list: refused
        monkeypatch.setattr(mla_launch, "is_device_array", lambda a: False)
        be.mla_attention_absorbed(*args, row_start=row_start, index=bad)
