"""Communicators (mtpkern.comm) and the vocabulary-parallel LM head's reductions: in one
process (a world of threads, any number of ranks) and under ``mpirun -n 2`` / ``-n 4``
(tests/mpi_worker.py, MPICH and mpi4py from the test extras)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from comm_cases import ThreadWorld, local_best, logit_case, reference
from mtpkern.comm import (Communicator, LocalComm, argmax_keys, check_comm, ids_of_keys, sharded_argmax,
                          sharded_confidence, sharded_topk)
from mtpkern.errors import NoAllowedToken
from mtpkern.ops.lm_head import masked_topk, masked_topk_partial

HERE = Path(__file__).resolve().parent


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), ranks=st.integers(1, 5))
def test_sharded_argmax_is_the_single_rank_argmax(seed, ranks):
    """The vocabulary cut in ``ranks`` contiguous shards (some empty when V < ranks): one
    all-reduce of the packed keys gives the whole vocabulary's argmax on every rank (ties
    to the lowest id, -0.0 tying with 0.0, NaN never winning, masks sliced by vocabulary,
    -1 for a row nothing allows), and the confidences its softmax probability."""
    x, w, mask = logit_case(np.random.default_rng(seed))
    want_ids, want_conf = reference(x, w, mask)
    V = w.shape[0]

    def rank(comm):
        lo, hi = comm.rank * V // comm.size, (comm.rank + 1) * V // comm.size
        best, ids, sums, has = local_best(x, w, mask, lo, hi)
        got = sharded_argmax(best, ids, comm)
        return got, sharded_confidence(best, sums, has, got, comm)

    for got, conf in ThreadWorld(ranks).run(rank):
        np.testing.assert_array_equal(got, want_ids)
        np.testing.assert_allclose(conf, want_conf, rtol=1e-5, equal_nan=True)


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), ranks=st.integers(1, 5), k=st.integers(1, 6))
def test_sharded_topk_is_the_single_rank_topk(seed, ranks, k):
    """A draft tree's candidates over shards of whole mask words: each rank's top k and its
    softmax statistics (``masked_topk_partial``), merged by one all-gather, give the whole
    vocabulary's ``masked_topk`` on every rank: the same ids in the same order (ties to the
    lowest id, NaN never taken, -1 past the candidates) and the probabilities within float32
    rounding; a row nothing allows has id -1 in column 0."""
    x, w, mask = logit_case(np.random.default_rng(seed))
    V = w.shape[0]
    with np.errstate(invalid="ignore"):
        logits = np.where(np.isnan(w).any(axis=1)[None, :], np.float32(np.nan), x)
    W = (V + 31) // 32
    want = []                                                  # per row: (ids, probs), or None
    for r in range(x.shape[0]):
        try:
            want.append(masked_topk(logits[r:r + 1], None if mask is None else mask[r:r + 1], k))
        except NoAllowedToken:
            want.append(None)

    def rank(comm):
        w0, w1 = comm.rank * W // comm.size, (comm.rank + 1) * W // comm.size
        lo, hi = 32 * w0, min(V, 32 * w1)
        ids, vals, best, sums = masked_topk_partial(logits[:, lo:hi], None if mask is None else mask[:, w0:w1], k)
        return sharded_topk(np.where(ids >= 0, ids + lo, -1).astype(np.int32), vals, best, sums, comm)

    for ids, probs in ThreadWorld(ranks).run(rank):
        for r, wr in enumerate(want):
            if wr is None:
                assert (ids[r] == -1).all() and (probs[r] == 0).all()
                continue
            np.testing.assert_array_equal(ids[r], wr[0][0])
            np.testing.assert_allclose(probs[r], wr[1][0], rtol=1e-5, atol=1e-7)


def test_argmax_keys_order_values_then_lower_ids():
    vals = np.array([-np.inf, -2.0, -0.0, 0.0, 1e-30, 3.0, np.inf, 5.0], np.float32)
    ids = np.array([0, 1, 9, 4, 2, 7, 3, -1], np.int64)
    keys = argmax_keys(vals, ids)
    assert keys[-1] == 0 and (keys[:-1] > 0).all()                       # no candidate: below all
    assert list(np.argsort(keys[:-1], kind="stable")) == [0, 1, 2, 3, 4, 5, 6]
    assert keys[3] > keys[2]                                             # equal values: id 4 over id 9
    np.testing.assert_array_equal(ids_of_keys(keys), [0, 1, 9, 4, 2, 7, 3, -1])
    assert ids_of_keys(argmax_keys(np.float32([7.0]), np.int64([2**31 - 1])))[0] == 2**31 - 1


def test_local_comm_is_a_world_of_one():
    c = check_comm(LocalComm())
    assert isinstance(c, Communicator) and (c.rank, c.size) == (0, 1)
    a = np.arange(3, dtype=np.float32)
    c.all_reduce(a, "sum")
    c.broadcast(a, 0)
    recv = np.zeros((1, 3), np.float32)
    c.all_gather(a, recv)
    np.testing.assert_array_equal(recv[0], [0, 1, 2])
    np.testing.assert_array_equal(sharded_argmax(np.float32([2.0, 1.0]), np.int64([5, -1]), c), [5, -1])


def test_collectives_refuse_bad_arguments_naming_them():
    c = LocalComm()
    with pytest.raises(ValueError, match="op: expected one of sum, max, got 'min'"):
        c.all_reduce(np.zeros(2, np.float32), "min")
    with pytest.raises(TypeError, match="buf: expected dtype float32 or int32 or int64 or uint64, got float64"):
        c.all_reduce(np.zeros(2), "sum")
    with pytest.raises(ValueError, match="buf: expected a C-contiguous array"):
        c.all_reduce(np.zeros((2, 4), np.float32)[:, ::2], "sum")
    with pytest.raises(ValueError, match=r"recv: expected shape \[1, 2\] float32, got \[2, 2\] float32"):
        c.all_gather(np.zeros(2, np.float32), np.zeros((2, 2), np.float32))
    with pytest.raises(ValueError, match="root: expected an int in 0 .. 0, got 1"):
        c.broadcast(np.zeros(2, np.float32), 1)


def test_check_comm_names_what_is_missing():
    class Half:
        rank, size = 0, 2

        def all_reduce(self, buf, op):
            pass

    with pytest.raises(TypeError, match="got Half without all_gather, broadcast"):
        check_comm(Half())
    bad = LocalComm()
    bad.rank = 1
    with pytest.raises(ValueError, match=r"comm.rank: expected an int in 0 .. 0, got 1"):
        check_comm(bad)


def test_thread_world_collectives():
    def rank(comm):
        r, R = comm.rank, comm.size
        a = np.full(2, r + 1, np.int64)
        comm.all_reduce(a, "max")
        g = np.zeros((R, 1), np.float32)
        comm.all_gather(np.float32([r]), g)
        b = np.uint64([r])
        comm.broadcast(b, 2)
        return a, g, b

    for a, g, b in ThreadWorld(3).run(rank):
        assert list(a) == [3, 3] and list(g[:, 0]) == [0, 1, 2] and b[0] == 2


def _mpirun() -> str | None:
    for cand in (Path(sys.executable).parent / "mpirun", Path(sys.executable).parent / "mpiexec"):
        if cand.exists():
            return str(cand)
    return shutil.which("mpirun") or shutil.which("mpiexec")


@pytest.mark.parametrize("ranks", [2, 4])
def test_mpi_world(ranks, tmp_path):
    """``mpirun -n ranks``: MpiComm's collectives, the sharded argmax / confidences, and the
    sharded proposer's call scripts on the cpu backend, on every rank equal to the
    single-rank answer (tests/mpi_worker.py)."""
    pytest.importorskip("mpi4py", reason="MPI: pip install 'mtpkern[mpi]' (the test extras include it)")
    mpirun = _mpirun()
    if mpirun is None:
        pytest.skip("no mpirun / mpiexec (pip install mpich)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([mpirun, "-n", str(ranks), sys.executable, str(HERE / "mpi_worker.py"), str(tmp_path)],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    done = sorted(tmp_path.glob("rank*"))
    assert [p.name for p in done] == [f"rank{q}" for q in range(ranks)], r.stdout + r.stderr
    assert all(p.read_text() == "ok" for p in done)


def test_mpi_refusals(tmp_path):
    """``mpirun -n 2``: the last rank refuses a call (bad token, NaN hidden, bad prefill token),
    fails mid-draft (a grammar callable raising, chain and tree) or calls otherwise (out_conf,
    min_confidence, num_drafts, tree widths, a chain against a tree, catch-up tokens): both
    ranks raise the same error, keep their states and make the next call together
    (tests/shard_cases.py). Without the agreement the job hangs (the timeout) or MPI aborts
    it ("Message truncated")."""
    import json

    from shard_cases import check_refusals

    pytest.importorskip("mpi4py", reason="MPI: pip install 'mtpkern[mpi]' (the test extras include it)")
    mpirun = _mpirun()
    if mpirun is None:
        pytest.skip("no mpirun / mpiexec (pip install mpich)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    try:
        r = subprocess.run([mpirun, "-n", "2", sys.executable, str(HERE / "mpi_worker.py"), str(tmp_path),
                            "refusals"], capture_output=True, text=True, timeout=180, env=env)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"mpirun -n 2 hung (a rank left waiting in a collective): {e.stdout!r} {e.stderr!r}")
    assert r.returncode == 0, r.stdout + r.stderr
    logs = [json.loads((tmp_path / f"refusals{q}.json").read_text()) for q in range(2)]
    for kv_mode in ("exact", "draft"):
        check_refusals([log[kv_mode] for log in logs], 2)


@pytest.mark.gpu
def test_nccl_world_of_one():
    """NcclComm on the device (scripts/gpu_check.sh): a world of one rank, CuPy buffers on
    the current stream; the sharded argmax / confidences through it as through LocalComm."""
    cupy = pytest.importorskip("cupy")
    from cupy.cuda import nccl

    if not getattr(nccl, "available", True):
        pytest.skip("CuPy built without NCCL")
    from mtpkern.comm import NcclComm

    c = check_comm(NcclComm(1, 0, NcclComm.unique_id()))
    a = cupy.arange(4, dtype=cupy.float32)
    c.all_reduce(a, "sum")
    c.all_reduce(a, "max")
    recv = cupy.zeros((1, 4), cupy.float32)
    c.all_gather(a, recv)
    c.broadcast(a, 0)
    cupy.cuda.get_current_stream().synchronize()
    np.testing.assert_array_equal(cupy.asnumpy(recv[0]), [0, 1, 2, 3])
    np.testing.assert_array_equal(cupy.asnumpy(a), [0, 1, 2, 3])
    with pytest.raises(TypeError, match="NcclComm takes CuPy arrays"):
        c.all_reduce(np.zeros(2, np.float32), "sum")
    x, w, mask = logit_case(np.random.default_rng(3), V=64, masked=True)
    best, ids, sums, has = local_best(x, w, mask, 0, 64)
    want = sharded_argmax(best, ids, LocalComm())
    got = sharded_argmax(cupy.asarray(best), cupy.asarray(ids), c, xp=cupy)
    np.testing.assert_array_equal(cupy.asnumpy(got), want)
    conf = sharded_confidence(cupy.asarray(best), cupy.asarray(sums), cupy.asarray(has), got, c, xp=cupy)
    np.testing.assert_allclose(cupy.asnumpy(conf), sharded_confidence(best, sums, has, want, LocalComm()),
                               rtol=1e-6, equal_nan=True)


def test_check_comm_refuses_what_only_looks_like_a_communicator():
    """rank / size must be ints (a bool is not), the collectives callables."""
    def comm(**kw):
        c = LocalComm()
        for k, v in kw.items():
            setattr(c, k, v)
        return c

    for kw, err, match in (({"rank": True}, TypeError, "comm.rank: expected an int, got bool True"),
                           ({"size": True}, TypeError, "comm.size: expected an int, got bool True"),
                           ({"rank": 0.0}, TypeError, "comm.rank: expected an int, got float"),
                           ({"size": 0}, ValueError, "comm.size: expected an int >= 1, got 0"),
                           ({"rank": -1}, ValueError, r"comm.rank: expected an int in 0 .. 0, got -1"),
                           ({"all_reduce": None}, TypeError, "comm.all_reduce: expected a callable.*NoneType"),
                           ({"all_gather": "x"}, TypeError, "comm.all_gather: expected a callable.*str 'x'"),
                           ({"broadcast": 3}, TypeError, "comm.broadcast: expected a callable")):
        with pytest.raises(err, match=match):
            check_comm(comm(**kw))
    assert check_comm(comm(rank=np.int64(0), size=np.int32(1))).rank == 0


def test_agree_fails_every_rank_alike():
    """mtpkern.comm.agree over 3 thread ranks: equal fields pass; a rank's error is raised on
    every rank as the lowest failing rank's type (KvCacheFull rebuilt from its message, a
    foreign error as its nearest built-in base), naming that rank; different fields raise
    RankMismatch on every rank naming the field and each rank's value."""
    from mtpkern.comm import RankMismatch, agree
    from mtpkern.errors import KvCacheFull

    class Foreign(KeyError):
        pass

    def rank(comm):
        r = comm.rank
        agree(comm, "call", [("a", 1), ("b", np.arange(3))])
        out = []
        for error in ((KvCacheFull(0, 3, 1, 8) if r == 2 else None), (Foreign("boom") if r >= 1 else None)):
            try:
                agree(comm, "call", [("a", 1)], error)
            except Exception as e:           # noqa: BLE001
                out.append((type(e), str(e)))
        try:
            agree(comm, "call", [("a", 1), ("b", r == 1), ("c", "same")])
        except RankMismatch as e:
            out.append((type(e), str(e)))
        return out

    logs = ThreadWorld(3, timeout=10).run(rank)
    assert logs[0] == logs[1] == logs[2]
    (t1, m1), (t2, m2), (t3, m3) = logs[0]
    assert t1 is KvCacheFull and "rank 2 of 3 refused the call (KvCacheFull: KV pool of module 0 is full" in m1
    assert t2 is KeyError and "rank 1 of 3 refused the call (Foreign: 'boom'); rank 2 failed too" in m2
    assert t3 is RankMismatch and "(b): rank 0: b=False | rank 1: b=True | rank 2: b=False" in m3
