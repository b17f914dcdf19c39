"""A call over several states that either completes or changes nothing.

``guarded(pools, states, new_rows, body)``:

1. takes, in every module's pool, the blocks that module ``m`` of ``states[i]``
   needs for ``new_rows[m][i]`` more rows (``BlockPool.grow_for_call``: a
   sliding-window module takes only its window's share, and the call reuses the
   blocks its window leaves behind): one locked step per pool (room check and
   allocation together, so two threads cannot both count one free block); if a
   later pool is full, the blocks taken in the earlier ones go back and
   ``KvCacheFull`` is raised, nothing changed;
2. snapshots every state and runs ``body()``, which also writes the call's results into
   any output the caller handed in (``out_conf``: ``fill_list``), so that a write that
   raises is a failure of the call like any other;
3. if ``body`` raises (a grammar that allows nothing, a callback that raises,
   an interrupt), restores every state: rows truncated, blocks returned,
   counters put back; then re-raises;
4. on success (committed: nothing can roll it back any more), every pool settles
   each state's sequence (``BlockPool.settle``): a sliding-window module's blocks
   out of the window go back, and so do blocks taken for rows that were not
   written (none when ``new_rows`` is exact, as the proposer computes it).

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
            pool.grow_for_call([(st._kv[m], r, st) for st, r in zip(states, rows) if r > 0])
        out = body()
    except BaseException:
        for st, snap in zip(states, snaps):
            snap.restore(st, pools)
        raise
    for st in states:
        for pool, seq in zip(pools, st._kv):
            pool.settle(seq, st)
    return out


def fill_list(out: list, values: list) -> None:
    """Replace the contents of ``out``, a caller's list (``out_conf``), by ``values``; called
    inside ``guarded``'s body, so that a write that raises (a list subclass's ``__setitem__``)
    rolls the call back. The list itself is then put back as it was (through ``list``'s own
    methods: the subclass's may be what failed) before the error goes on."""
    before = list.__getitem__(out, slice(None))
    try:
        out[:] = values
    except BaseException:
        list.__setitem__(out, slice(None), before)
        raise
