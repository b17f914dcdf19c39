"""Block pool: allocation on append, trimming returns blocks at once, reservations,
ownership (the pool refuses sequences it did not make), room and allocation as one step."""

from __future__ import annotations

import copy
import threading

import numpy as np
import pytest

from mtpkern import KvCacheFull, StateError
from mtpkern.backends import get_backend
from mtpkern.kv import BlockPool, KeyRuns, SeqKv


HOLDER = object()          # who holds the test's sequences


@pytest.fixture
def pool():
    return BlockPool(0, 6, 4, 2, 8, get_backend("numpy"))


def append(pool, seq, first_key, n):
    pool.grow(seq, n)
    seq.keys.append(first_key, n)


def test_grow_trim_release(pool):
    a, b = pool.new_seq(HOLDER), pool.new_seq(HOLDER)
    append(pool, a, 0, 5)                    # 2 blocks
    append(pool, b, 0, 4)                    # 1 block
    assert (len(a.blocks), len(b.blocks), pool.num_free) == (2, 1, 3)
    assert pool.slots(a, 3, 2).tolist() == [a.blocks[0] * 4 + 3, a.blocks[1] * 4]
    pool.trim(a, 1)                          # 4 rows left: the second block is empty -> back now
    assert (len(a.blocks), pool.num_free) == (1, 4)
    pool.check_invariants()
    pool.release_all(a)
    pool.retire(b, HOLDER)
    assert pool.num_free == 6 and pool.num_seqs == 1
    pool.check_invariants()


def test_full_pool_raises_before_changing_anything(pool):
    a = pool.new_seq(HOLDER)
    append(pool, a, 0, 20)                   # 5 blocks
    with pytest.raises(KvCacheFull, match=r"needs 2 more block\(s\), 1 of 6 are available"):
        pool.check_room([(a, 8)])
    b = pool.new_seq(HOLDER)
    with pytest.raises(KvCacheFull):         # b's block fits, a's do not: neither is taken
        pool.grow_all([(b, 1), (a, 8)])
    assert pool.num_free == 1 and a.rows == 20 and b.blocks == []
    pool.check_invariants()


def test_blocks_taken_ahead_go_back_on_trim(pool):
    a = pool.new_seq(HOLDER)
    pool.grow_all([(a, 9)])                  # 3 blocks for rows not written yet
    append(pool, a, 0, 2)
    pool.trim(a, 0)                          # keep what 2 rows need
    assert len(a.blocks) == 1 and pool.num_free == 5
    pool.check_invariants()


def test_reservation_is_held_for_its_owner(pool):
    a, b = pool.new_seq(HOLDER), pool.new_seq(HOLDER)
    pool.reserve(a, 4)                       # 4 of 6 blocks promised to a
    assert pool.available_to(b) == 2 and pool.available_to(a) == 6
    with pytest.raises(KvCacheFull):
        pool.check_room([(b, 9)])            # b cannot dip into a's reservation
    append(pool, a, 0, 16)                   # a takes its 4 reserved blocks
    assert (a.reserved, pool.reserved) == (0, 0)
    pool.trim(a, 8)                          # 2 blocks back; a's promise is whole again
    assert (a.reserved, pool.reserved, len(a.blocks)) == (2, 2, 2)
    pool.check_invariants()
    pool.release_all(a)
    assert pool.reserved == 0 and pool.num_free == 6


# -- ownership: the pool's record is the authority, consulted before any block moves ---------

def _copies(seq):
    return [copy.copy(seq), copy.deepcopy(seq), SeqKv(blocks=list(seq.blocks), keys=seq.keys.copy()),
            SeqKv(blocks=list(seq.blocks), keys=seq.keys.copy(), serial=seq.serial)]


@pytest.mark.parametrize("op", ["release_all", "trim", "grow", "reserve", "retire", "move_rows"])
def test_copies_and_hand_built_sequences_are_refused(pool, op):
    a = pool.new_seq(HOLDER)
    append(pool, a, 0, 6)
    before = (pool.num_free, list(a.blocks), a.rows)
    for fake in _copies(a):
        with pytest.raises(StateError):
            if op == "release_all":
                pool.release_all(fake)
            elif op == "trim":
                pool.trim(fake, 2)
            elif op == "grow":
                pool.grow(fake, 9)
            elif op == "reserve":
                pool.reserve(fake, 2)
            elif op == "retire":
                pool.retire(fake, HOLDER)
            else:
                pool.move_rows(fake, pool.new_seq(HOLDER))
        assert (pool.num_free, list(a.blocks), a.rows) == before
    pool.check_invariants()


def test_a_table_that_disagrees_with_the_pool_is_refused(pool):
    a, b = pool.new_seq(HOLDER), pool.new_seq(HOLDER)
    append(pool, a, 0, 4)
    append(pool, b, 0, 4)
    a.blocks.append(b.blocks[0])             # a claims b's block
    a.keys.append(4, 1)
    with pytest.raises(StateError, match="owned by another sequence"):
        pool.release_all(a)
    assert pool.num_free == 4 and b.blocks and pool._owner[b.blocks[0]] == b.serial
    with pytest.raises(AssertionError, match="lists blocks it does not own"):
        pool.check_invariants()


def test_holders(pool):
    mine, theirs = object(), object()
    a = pool.new_seq(mine)
    pool.check_holder(a, mine)
    with pytest.raises(StateError, match="held by object, not by this caller"):
        pool.check_holder(a, theirs)
    with pytest.raises(StateError):
        pool.retire(a, theirs)
    other_pool = BlockPool(1, 6, 4, 2, 8, get_backend("numpy"))
    b = other_pool.new_seq(mine)
    with pytest.raises(StateError, match="not a live sequence of module 0"):
        pool.check_holder(b, mine)
    with pytest.raises(TypeError, match="expected a SeqKv, got dict"):
        pool.check_holder({}, mine)
    pool.retire(a, mine)
    with pytest.raises(StateError):          # retired: gone from the registry
        pool.check_holder(a, mine)


def test_concurrent_growth_never_over_allocates():
    """Room check and allocation are one step: many threads racing for a few blocks get
    them or KvCacheFull, never an IndexError, and every block has one owner."""
    pool = BlockPool(0, 5, 1, 1, 2, get_backend("numpy"))
    seqs = [pool.new_seq(HOLDER) for _ in range(8)]
    errors, full = [], []
    barrier = threading.Barrier(8)

    def worker(seq):
        barrier.wait()
        for _ in range(200):
            try:
                pool.grow(seq, 1)
                seq.keys.append(seq.rows, 1)
            except KvCacheFull:
                full.append(1)
            except Exception as e:           # noqa: BLE001 (the test reports any other failure)
                errors.append(e)
            if seq.rows:
                pool.trim(seq, 1)

    threads = [threading.Thread(target=worker, args=(s,)) for s in seqs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors[:3]
    pool.check_invariants()
    assert pool.num_free == 5


def test_key_runs():
    k = KeyRuns()
    k.append(0, 3)
    k.append(3, 1)
    k.append(7, 2)
    assert k.to_list() == [0, 1, 2, 3, 7, 8] and k.last == 8 and len(k) == 6
    k.pop(3)
    assert k.to_list() == [0, 1, 2] and k.last == 2
    with pytest.raises(ValueError, match="keys must increase"):
        k.append(2, 1)
    with pytest.raises(ValueError):
        k.pop(4)


def test_kv_cache_layout(pool):
    assert pool.k.shape == (6, 4, 2, 8) and pool.k.dtype == np.float32
