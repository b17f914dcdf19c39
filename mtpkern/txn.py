"""A call over several states that either completes or changes nothing.

``guarded(pools, states, new_rows, body)``:

1. takes, in every module's pool, the blocks that module ``m`` of ``states[i]``
   needs for ``new_rows[m][i]`` more rows: one locked step per pool (room check
   and allocation together, so two threads cannot both count one free block);
   if a later pool is full, the blocks taken in the earlier ones go back and
   ``KvCacheFull`` is raised, nothing changed;
2. snapshots every state and runs ``body()``;
3. if ``body`` raises (a grammar that allows nothing, a callback that raises,
   an interrupt), restores every state: rows truncated, blocks returned,
   counters put back; then re-raises;
4. on success, returns blocks taken for rows that were not written (none when
   ``new_rows`` is exact, as the proposer computes it).

The caller holds the states (``state.exclusive``) around all of this.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

from .state import MtpState, Snapshot

T = TypeVar("T")


def guarded(pools: list[Any], states: list[MtpState], new_rows: list[list[int]], body: Callable[[], T]) -> T:
    snaps = [Snapshot.of(st) for st in states]
    try:
        for m, (pool, rows) in enumerate(zip(pools, new_rows)):
            pool.grow_all([(st._kv[m], r, st) for st, r in zip(states, rows) if r > 0])
        out = body()
    except BaseException:
        for st, snap in zip(states, snaps):
            snap.restore(st, pools)
        raise
    for st in states:
        for pool, seq in zip(pools, st._kv):
            if len(seq._blocks) * pool.block_size - seq.rows >= pool.block_size:
                pool.trim(seq, 0, st)
    return out
