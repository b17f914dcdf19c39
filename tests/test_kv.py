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


def append(pool, seq, first_key, n, holder=HOLDER):
    pool.append(seq, first_key, n, holder)


def test_grow_trim_release(pool):
    a, b = pool.new_seq(HOLDER), pool.new_seq(HOLDER)
    append(pool, a, 0, 5)                    # 2 blocks
    append(pool, b, 0, 4)                    # 1 block
    assert (len(a.blocks), len(b.blocks), pool.num_free) == (2, 1, 3)
    assert pool.slots(a, 3, 2).tolist() == [a.blocks[0] * 4 + 3, a.blocks[1] * 4]
    pool.trim(a, 1, HOLDER)                  # 4 rows left: the second block is empty -> back now
    assert (len(a.blocks), pool.num_free) == (1, 4)
    pool.check_invariants()
    pool.release_all(a, HOLDER)
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
        pool.grow_all([(b, 1, HOLDER), (a, 8, HOLDER)])
    assert pool.num_free == 1 and a.rows == 20 and b.blocks == ()
    pool.check_invariants()


def test_blocks_taken_ahead_go_back_on_trim(pool):
    a = pool.new_seq(HOLDER)
    pool.grow_all([(a, 9, HOLDER)])          # 3 blocks for rows not written yet
    append(pool, a, 0, 2)
    pool.trim(a, 0, HOLDER)                  # keep what 2 rows need
    assert len(a.blocks) == 1 and pool.num_free == 5
    pool.check_invariants()


def test_reservation_is_held_for_its_owner(pool):
    a, b = pool.new_seq(HOLDER), pool.new_seq(HOLDER)
    pool.reserve(a, 4, HOLDER)               # 4 of 6 blocks promised to a
    assert pool.available_to(b) == 2 and pool.available_to(a) == 6
    with pytest.raises(KvCacheFull):
        pool.check_room([(b, 9)])            # b cannot dip into a's reservation
    append(pool, a, 0, 16)                   # a takes its 4 reserved blocks
    assert (a.reserved, pool.reserved) == (0, 0)
    pool.trim(a, 8, HOLDER)                  # 2 blocks back; a's promise is whole again
    assert (a.reserved, pool.reserved, len(a.blocks)) == (2, 2, 2)
    pool.check_invariants()
    pool.release_all(a, HOLDER)
    assert pool.reserved == 0 and pool.num_free == 6


# -- ownership: the pool's record is the authority, consulted before any block moves ---------

def _copies(seq):
    return [copy.copy(seq), copy.deepcopy(seq), SeqKv(), SeqKv(serial=seq.serial)]


@pytest.mark.parametrize("op", ["release_all", "trim", "grow", "append", "reserve", "retire", "move_rows"])
def test_copies_and_hand_built_sequences_are_refused(pool, op):
    a = pool.new_seq(HOLDER)
    append(pool, a, 0, 6)
    before = (pool.num_free, a.blocks, a.rows)
    for fake in _copies(a):
        with pytest.raises(StateError):
            if op == "release_all":
                pool.release_all(fake, HOLDER)
            elif op == "trim":
                pool.trim(fake, 2, HOLDER)
            elif op == "grow":
                pool.grow(fake, 9, HOLDER)
            elif op == "append":
                pool.append(fake, 6, 1, HOLDER)
            elif op == "reserve":
                pool.reserve(fake, 2, HOLDER)
            elif op == "retire":
                pool.retire(fake, HOLDER)
            else:
                pool.move_rows(fake, HOLDER, pool.new_seq(HOLDER), HOLDER)
        assert (pool.num_free, a.blocks, a.rows) == before
    pool.check_invariants()


@pytest.mark.parametrize("op", ["release_all", "trim", "grow", "append", "reserve", "drop_budget", "retire",
                                "move_rows"])
def test_every_mutation_needs_the_sequences_holder(pool, op):
    mine, theirs = object(), object()
    a, b = pool.new_seq(mine), pool.new_seq(mine)
    append(pool, a, 0, 6, mine)
    before = (pool.num_free, a.blocks, a.rows)
    with pytest.raises(StateError, match="held by object, not by this caller"):
        {"release_all": lambda: pool.release_all(a, theirs), "trim": lambda: pool.trim(a, 2, theirs),
         "grow": lambda: pool.grow(a, 9, theirs), "append": lambda: pool.append(a, 6, 1, theirs),
         "reserve": lambda: pool.reserve(a, 2, theirs), "drop_budget": lambda: pool.drop_budget(a, theirs),
         "retire": lambda: pool.retire(a, theirs), "move_rows": lambda: pool.move_rows(a, theirs, b, mine)}[op]()
    assert (pool.num_free, a.blocks, a.rows) == before
    pool.check_invariants()


def test_tables_and_keys_are_read_only_views(pool):
    a, b = pool.new_seq(HOLDER), pool.new_seq(HOLDER)
    append(pool, a, 0, 4)
    append(pool, b, 0, 4)
    assert isinstance(a.blocks, tuple)
    with pytest.raises(AttributeError):
        a.blocks.append(b.blocks[0])          # noqa: B018 (a tuple has no append)
    with pytest.raises(AttributeError):
        a.blocks = [b.blocks[0]]
    with pytest.raises(AttributeError):
        a.keys = KeyRuns()
    a.keys.append(4, 1)                       # a copy: the sequence's own keys do not change
    assert a.rows == 4 and a.last_key == 3
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


def test_close_drops_everything(pool):
    a = pool.new_seq(HOLDER)
    append(pool, a, 0, 6)
    pool.close()
    assert pool.num_free == 6 and pool.k is None and a.blocks == ()
    with pytest.raises(StateError, match="closed"):
        pool.new_seq(HOLDER)


def test_bounds_name_the_argument():
    be = get_backend("numpy")
    with pytest.raises(ValueError, match="num_blocks: expected 1 .. 2147483647, got 18446744073709551616"):
        BlockPool(0, 2**64, 4, 2, 8, be)
    with pytest.raises(ValueError, match="block_size: expected 1 .. "):
        BlockPool(0, 1 << 20, 1 << 20, 2, 8, be)


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
                pool.append(seq, seq.rows, 1, HOLDER)
            except KvCacheFull:
                full.append(1)
            except Exception as e:           # noqa: BLE001 (the test reports any other failure)
                errors.append(e)
            if seq.rows:
                pool.trim(seq, 1, HOLDER)

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
