"""Block pool: allocation on append, trimming returns blocks at once, reservations, double free."""

from __future__ import annotations

import numpy as np
import pytest

from mtpkern import KvCacheFull, StateError
from mtpkern.backends import get_backend
from mtpkern.kv import BlockPool, KeyRuns, SeqKv


@pytest.fixture
def pool():
    return BlockPool(0, 6, 4, 2, 8, get_backend("numpy"))


def append(pool, seq, first_key, n):
    pool.check_room([(seq, n)])
    pool.grow(seq, n)
    seq.keys.append(first_key, n)


def test_grow_trim_release(pool):
    a, b = SeqKv(), SeqKv()
    append(pool, a, 0, 5)                    # 2 blocks
    append(pool, b, 0, 4)                    # 1 block
    assert (len(a.blocks), len(b.blocks), pool.num_free) == (2, 1, 3)
    assert pool.slots(a, 3, 2).tolist() == [a.blocks[0] * 4 + 3, a.blocks[1] * 4]
    pool.trim(a, 1)                          # 4 rows left: the second block is empty -> back now
    assert (len(a.blocks), pool.num_free) == (1, 4)
    pool.check_invariants([a.blocks, b.blocks], 0)
    pool.release_all(a)
    pool.release_all(b)
    assert pool.num_free == 6
    pool.check_invariants([], 0)


def test_full_pool_raises_before_changing_anything(pool):
    a = SeqKv()
    append(pool, a, 0, 20)                   # 5 blocks
    with pytest.raises(KvCacheFull, match=r"needs 2 more block\(s\), 1 of 6 are available"):
        pool.check_room([(a, 8)])
    assert pool.num_free == 1 and a.rows == 20


def test_double_free_detected(pool):
    a = SeqKv()
    append(pool, a, 0, 4)
    blocks = list(a.blocks)
    pool.release_all(a)
    with pytest.raises(StateError, match=f"block {blocks[0]} freed twice"):
        pool.release_blocks(blocks)
    with pytest.raises(StateError, match="outside the pool"):
        pool.release_blocks([99])


def test_reservation_is_held_for_its_owner(pool):
    a, b = SeqKv(), SeqKv()
    pool.reserve(a, 4)                       # 4 of 6 blocks promised to a
    assert pool.available_to(b) == 2 and pool.available_to(a) == 6
    with pytest.raises(KvCacheFull):
        pool.check_room([(b, 9)])            # b cannot dip into a's reservation
    append(pool, a, 0, 16)                   # a takes its 4 reserved blocks
    assert (a.reserved, pool.reserved) == (0, 0)
    pool.trim(a, 8)                          # 2 blocks back; a's promise is whole again
    assert (a.reserved, pool.reserved, len(a.blocks)) == (2, 2, 2)
    pool.check_invariants([a.blocks], 2)
    pool.release_all(a)
    assert pool.reserved == 0 and pool.num_free == 6


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
