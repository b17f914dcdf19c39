"""The thread contract (docs/api.md, "Threads"), in bounded stress runs.

- Distinct states on one proposer may be used from several threads at once: the
  drafts equal a sequential run's, and the pools' accounting holds (room check and
  allocation are one step per pool: racing for the last free block gives
  ``KvCacheFull``, never an ``IndexError``).
- One state used by two calls at once: the second gets ``StateError`` at once, and
  the state is never corrupted.

Python switches threads every 5 ms by default; the runs below switch every few
microseconds so that the windows between a check and an allocation are hit often.
"""

from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager

import numpy as np
import pytest

from conftest import rand_hiddens
from mtpkern import KvCacheFull, StateError

H, V = 64, 301


@contextmanager
def fast_switching(interval: float = 2e-6):
    old = sys.getswitchinterval()
    sys.setswitchinterval(interval)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


def run_threads(fns, timeout: float = 120.0) -> list:
    """Run ``fns`` in threads started together; return what each returned or raised."""
    out: list = [None] * len(fns)
    barrier = threading.Barrier(len(fns))

    def wrap(i, fn):
        barrier.wait()
        try:
            out[i] = fn()
        except BaseException as e:  # noqa: BLE001 (reported to the test)
            out[i] = e

    threads = [threading.Thread(target=wrap, args=(i, fn), name=f"worker-{i}") for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a worker thread did not finish (deadlock?)"
    return out


def conversation(prop, seed: int, rounds: int = 12) -> list[list[int]]:
    """One sequence's life on its own state: prefill, speculative rounds, free. The
    inputs depend only on ``seed``; returns every propose's drafts."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(3, 20))
    st = prop.alloc_state()
    prop.prefill_drafter(rng.integers(0, V, n).tolist(), rand_hiddens(rng, n, H), st)
    P, out = n, []
    for _ in range(rounds):
        d = prop.propose(int(rng.integers(0, V)), rand_hiddens(rng, 1, H)[0], P, int(rng.integers(1, 4)), st)
        a = int(rng.integers(0, len(d) + 1))
        prop.after_verify(a, st)
        prop.catchup_drafter(d[:a], rand_hiddens(rng, a, H), st)
        out.append(d)
        P += 1 + a
    prop.free_state(st)
    return out


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
@pytest.mark.parametrize("mode", ["exact", "draft"])
def test_distinct_states_from_threads_draft_as_a_sequential_run(make_prop, backend, mode):
    prop = make_prop(mode, backend=backend, num_blocks=256)
    seeds = list(range(4))
    want = [conversation(prop, s) for s in seeds]
    with fast_switching():
        for _ in range(3):
            got = run_threads([lambda s=s: conversation(prop, s) for s in seeds])
            assert got == want
    prop.check_invariants()
    assert prop.kv_blocks_in_use() == [0] * prop.num_modules


def test_the_last_free_block_goes_to_one_thread(make_prop):
    """Two threads each need the pool's one free block: one gets it, the other
    ``KvCacheFull``; never an ``IndexError`` from an empty free list, never a leak."""
    prop = make_prop("draft", num_blocks=4, block_size=4)
    rng = np.random.default_rng(0)
    hog = prop.alloc_state()
    prop.prefill_drafter(rng.integers(0, V, 13).tolist(), rand_hiddens(rng, 13, H), hog)   # 3 of 4 blocks
    toks, hid = [1, 2], rand_hiddens(rng, 2, H)
    outcomes = {"won": 0, "full": 0}
    with fast_switching(1e-6):
        for _ in range(300):
            sts = [prop.alloc_state(), prop.alloc_state()]
            res = run_threads([lambda s=s: prop.prefill_drafter(toks, hid, s) for s in sts])
            for r in res:
                if isinstance(r, KvCacheFull):
                    outcomes["full"] += 1
                elif r == 1:
                    outcomes["won"] += 1
                else:
                    raise AssertionError(f"unexpected outcome {r!r}")
            assert sorted(type(r).__name__ for r in res) == ["KvCacheFull", "int"]
            prop.check_invariants()
            for s in sts:
                prop.free_state(s)
    assert outcomes == {"won": 300, "full": 300}
    prop.free_state(hog)
    assert prop.kv_blocks_in_use() == [0] * prop.num_modules


def test_a_state_in_use_refuses_a_second_call(make_prop):
    """While thread A's propose runs (held inside its grammar callback), thread B's
    calls on the same state fail at once with StateError; A then completes."""
    prop = make_prop("exact")
    rng = np.random.default_rng(1)
    st = prop.alloc_state()
    prop.prefill_drafter(rng.integers(0, V, 7).tolist(), rand_hiddens(rng, 7, H), st)
    inside, release = threading.Event(), threading.Event()

    def grammar(i, drafts):
        if i == 0:
            inside.set()
            assert release.wait(30)
        return None

    h = rand_hiddens(rng, 1, H)[0]
    res: list = []
    a = threading.Thread(target=lambda: res.append(prop.propose(1, h, 7, 3, st, grammar_bitmask=grammar)))
    a.start()
    assert inside.wait(30)
    calls = [lambda: prop.propose(1, h, 7, 3, st), lambda: prop.after_verify(0, st),
             lambda: prop.catchup_drafter([1], h[None], st), lambda: prop.free_state(st),
             lambda: prop.take_drafter_kv(st), lambda: prop.propose_batch([1], [h], [7], 1, [st])]
    for call in calls:
        with pytest.raises(StateError, match=r"state(s\[0\])?: in use by propose \(thread 'Thread"):
            call()
    release.set()
    a.join(30)
    assert len(res) == 1 and len(res[0]) == 3
    prop.after_verify(1, st)
    prop.check_invariants()


@pytest.mark.parametrize("trial", range(4))
def test_one_state_hammered_by_two_threads_is_never_corrupted(make_prop, trial):
    """Both threads drive the same state through rounds as fast as they can. Every call
    either succeeds or fails cleanly (in use, wrong phase, stale position); afterwards
    the state's rules hold and it keeps working."""
    prop = make_prop("exact", num_blocks=256)
    rng = np.random.default_rng(trial)
    st = prop.alloc_state()
    prop.prefill_drafter(rng.integers(0, V, 5).tolist(), rand_hiddens(rng, 5, H), st)
    clean = (StateError, ValueError)

    def hammer(seed):
        r = np.random.default_rng(seed)
        ok = 0
        for _ in range(400):
            try:
                if st.drafted:
                    a = int(r.integers(0, len(st.last_drafts) + 1))
                    drafts = list(st.last_drafts)
                    prop.after_verify(a, st)
                    prop.catchup_drafter(drafts[:a], rand_hiddens(r, a, H), st)
                else:
                    prop.propose(int(r.integers(0, V)), rand_hiddens(r, 1, H)[0], st.next_position,
                                 int(r.integers(1, 4)), st)
                ok += 1
            except clean:
                pass
        return ok

    with fast_switching():
        res = run_threads([lambda: hammer(10 + 2 * trial), lambda: hammer(11 + 2 * trial)])
    bad = [r for r in res if not isinstance(r, int)]
    assert not bad, bad
    assert sum(res) > 0
    if st.drafted:
        prop.after_verify(0, st)
    missing = st.num_verified - 1 - st.num_hiddens           # a catch-up lost to the other thread
    if missing:
        prop.catchup_drafter(st.tail[:missing], rand_hiddens(rng, missing, H), st)
    prop.check_invariants()
    st.check_invariants()
    prop.propose(1, rand_hiddens(rng, 1, H)[0], st.next_position, 3, st)
    prop.after_verify(3, st)
    prop.catchup_drafter(st.last_drafts, rand_hiddens(rng, 3, H), st)
    prop.check_invariants()


def test_check_invariants_while_other_threads_allocate_free_and_carry(make_prop):
    """The registries are read as one snapshot: no false alarm while another thread
    allocates, frees, takes and installs (the audit saw thousands per second)."""
    prop = make_prop("exact", num_blocks=64)
    rng = np.random.default_rng(3)
    stop = threading.Event()
    toks, hid = rng.integers(0, V, 6).tolist(), rand_hiddens(rng, 6, H)

    def churn():
        while not stop.is_set():
            st = prop.alloc_state()
            prop.prefill_drafter(toks, hid, st)
            kv = prop.take_drafter_kv(st)
            prop.install_drafter_kv(st, kv)
            prop.free_state(st)

    def check():
        for _ in range(300):
            prop.check_invariants()
        stop.set()

    with fast_switching():
        res = run_threads([churn, check])
    assert res == [None, None], res
    prop.check_invariants()


def test_close_racing_allocations_and_frees_is_all_or_nothing(make_prop):
    """close() against threads that allocate, propose and free carried entries: each
    call either completes before close or gets StateError; close releases everything."""
    for trial in range(20):
        prop = make_prop("draft", num_blocks=64)
        rng = np.random.default_rng(trial)
        entries = []
        for _ in range(20):
            st = prop.alloc_state()
            prop.prefill_drafter([1, 2, 3], rand_hiddens(rng, 3, H), st)
            entries.append(prop.take_drafter_kv(st))

        def worker():
            for _ in range(50):
                try:
                    st = prop.alloc_state()
                    prop.prefill_drafter([1, 2, 3], rand_hiddens(rng, 3, H), st)
                    prop.propose(1, rand_hiddens(rng, 1, H)[0], 3, 2, st)
                except StateError as e:
                    assert "closed" in str(e) or "freed" in str(e), e
                    return "closed"
            return "done"

        def freer():
            for kv in entries:
                try:
                    prop.free_drafter_kv(kv)
                except StateError as e:
                    assert "closed" in str(e) or "already installed or freed" in str(e), e
            return "done"

        def closer():
            # close() never waits: against a call holding a state it is refused whole
            # (nothing released) and the caller tries again, as an engine's shutdown would
            for _ in range(10_000):
                try:
                    prop.close()
                    return "closed"
                except StateError as e:
                    assert "in use by" in str(e), e
                    time.sleep(0)
            return "never closed"

        with fast_switching():
            res = run_threads([worker, freer, closer])
        assert res[2] == "closed", res
        assert not [r for r in res if isinstance(r, BaseException)], res
        assert prop.kv_blocks_in_use() == [0] * prop.num_modules
        assert all(p.num_seqs == 0 for p in prop.pools)
        with pytest.raises(StateError, match="closed"):
            prop.alloc_state()
