"""Paged KV: one block pool per module, one block table per sequence and module.

A pool holds K and V caches ``[num_blocks, block_size, Hkv, D]``. A sequence's
rows of one module live in its block table: row ``r`` is at slot
``blocks[r // BS] * BS + r % BS``. Rows are compact (row ``r`` is the ``r``-th
row written, whatever its key), so each ``SeqKv`` also records the keys of
its rows, as runs of consecutive keys.

Blocks are allocated when rows are appended, and returned to the pool the
moment trimming leaves them empty. ``reserve`` sets a per-sequence budget
(``alloc_state_for``): reserved blocks are held back from every other
sequence, so a sequence that stays within its budget never meets a full pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .config import ceil_div
from .errors import KvCacheFull, StateError


class KeyRuns:
    """The keys of a module's rows in row order, stored as runs ``[start, count]``.

    Exact-mode rows are one run (keys 0..n-1); draft-mode rows are a run for the
    prefill plus short runs per propose, so this stays small either way.
    """

    __slots__ = ("_runs", "_n")

    def __init__(self, runs: list[list[int]] | None = None):
        self._runs: list[list[int]] = [list(r) for r in runs] if runs else []
        self._n = sum(c for _, c in self._runs)

    def __len__(self) -> int:
        return self._n

    def copy(self) -> "KeyRuns":
        return KeyRuns(self._runs)

    @property
    def last(self) -> int | None:
        if not self._runs:
            return None
        s, c = self._runs[-1]
        return s + c - 1

    def append(self, start: int, count: int) -> None:
        if count <= 0:
            return
        last = self.last
        if last is not None and start <= last:
            raise ValueError(f"keys must increase: appending key {start} after key {last}")
        if last is not None and start == last + 1:
            self._runs[-1][1] += count
        else:
            self._runs.append([start, count])
        self._n += count

    def pop(self, count: int) -> None:
        if count > self._n:
            raise ValueError(f"cannot drop {count} rows of {self._n}")
        self._n -= count
        while count:
            s, c = self._runs[-1]
            if c <= count:
                self._runs.pop()
                count -= c
            else:
                self._runs[-1][1] = c - count
                count = 0

    def to_list(self) -> list[int]:
        return [s + i for s, c in self._runs for i in range(c)]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KeyRuns) and self._runs == other._runs

    def __repr__(self) -> str:
        return f"KeyRuns({self._runs})"


@dataclass(slots=True)
class SeqKv:
    """One sequence's rows in one module's pool."""

    blocks: list[int] = field(default_factory=list)
    keys: KeyRuns = field(default_factory=KeyRuns)
    budget: int = 0      # blocks promised to this sequence by reserve(); 0 = none
    reserved: int = 0    # of the budget, blocks still held back in the pool (not in `blocks`)

    @property
    def rows(self) -> int:
        return len(self.keys)


class BlockPool:
    """K/V caches of one module and the free list of their blocks."""

    def __init__(self, module: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, backend: Any):
        if num_blocks < 1:
            raise ValueError(f"num_blocks: expected >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size: expected >= 1, got {block_size}")
        self.module = module
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.k = backend.empty_kv(num_blocks, block_size, num_kv_heads, head_dim)
        self.v = backend.empty_kv(num_blocks, block_size, num_kv_heads, head_dim)
        # A stack: pop() hands out the lowest free id first.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._in_use = np.zeros(num_blocks, bool)
        self.reserved = 0    # blocks promised to sequences and not yet taken by them

    # -- queries ----------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def available_to(self, seq: SeqKv) -> int:
        """Blocks ``seq`` may still take: the unpromised free ones plus its own reservation."""
        return self.num_free - self.reserved + seq.reserved

    def blocks_needed(self, seq: SeqKv, new_rows: int) -> int:
        return max(0, ceil_div(seq.rows + new_rows, self.block_size) - len(seq.blocks))

    def check_room(self, seqs_rows: list[tuple[SeqKv, int]]) -> None:
        """Raise ``KvCacheFull`` unless every ``(seq, new_rows)`` can grow at once."""
        need = 0
        own_reserved = 0
        for seq, n in seqs_rows:
            k = self.blocks_needed(seq, n)
            need += k
            own_reserved += min(k, seq.reserved)
        avail = self.num_free - self.reserved + own_reserved
        if need > avail:
            raise KvCacheFull(self.module, need, avail, self.num_blocks)

    # -- mutation -----------------------------------------------------------
    def grow(self, seq: SeqKv, new_rows: int) -> None:
        """Make room for ``new_rows`` more rows (call ``check_room`` first)."""
        k = self.blocks_needed(seq, new_rows)
        if k > self.available_to(seq):
            raise KvCacheFull(self.module, k, self.available_to(seq), self.num_blocks)
        for _ in range(k):
            b = self._free.pop()
            self._in_use[b] = True
            seq.blocks.append(b)
            if seq.reserved:
                seq.reserved -= 1
                self.reserved -= 1

    def slots(self, seq: SeqKv, first_row: int, count: int) -> np.ndarray:
        """``[count]`` int32 cache slots of rows ``first_row ..``."""
        r = np.arange(first_row, first_row + count)
        table = np.asarray(seq.blocks, np.int64)
        return (table[r // self.block_size] * self.block_size + r % self.block_size).astype(np.int32)

    def trim(self, seq: SeqKv, drop_rows: int) -> None:
        """Drop the last ``drop_rows`` rows; blocks left empty go back at once."""
        if drop_rows <= 0:
            return
        seq.keys.pop(drop_rows)
        keep = ceil_div(seq.rows, self.block_size)
        extra = seq.blocks[keep:]
        del seq.blocks[keep:]
        self._release(extra, seq)

    def release_all(self, seq: SeqKv) -> None:
        """Return every block and the reservation of ``seq``; it ends empty with no budget."""
        blocks = seq.blocks[:]
        seq.blocks.clear()
        seq.keys = KeyRuns()
        self._release(blocks, None)
        self.drop_budget(seq)

    def release_blocks(self, blocks: list[int]) -> None:
        """Return blocks that no sequence owns (a carried entry being dropped)."""
        self._release(list(blocks), None)

    def _release(self, blocks: list[int], seq: SeqKv | None) -> None:
        for b in blocks:
            if not (0 <= b < self.num_blocks):
                raise StateError(f"module {self.module}: block id {b} is outside the pool of {self.num_blocks}")
            if not self._in_use[b]:
                raise StateError(f"module {self.module}: block {b} freed twice")
        for b in reversed(blocks):
            self._in_use[b] = False
            self._free.append(b)
        if seq is not None and seq.budget:
            # Keep the sequence's promise whole: what it gave back is held for it again.
            back = min(len(blocks), seq.budget - len(seq.blocks) - seq.reserved)
            if back > 0:
                seq.reserved += back
                self.reserved += back

    def reserve(self, seq: SeqKv, budget_blocks: int) -> None:
        """Promise ``seq`` up to ``budget_blocks`` blocks in all (held ones included)."""
        want = max(0, budget_blocks - len(seq.blocks)) - seq.reserved
        if want > self.num_free - self.reserved:
            raise KvCacheFull(self.module, want, self.num_free - self.reserved, self.num_blocks)
        seq.budget = budget_blocks
        seq.reserved += want
        self.reserved += want

    def drop_budget(self, seq: SeqKv) -> None:
        """Forget ``seq``'s budget: its blocks still held back go back to everyone."""
        self.reserved -= seq.reserved
        seq.reserved = 0
        seq.budget = 0

    def fit_budget(self, seq: SeqKv) -> None:
        """After blocks joined ``seq`` from outside (an installed carry): they count
        within its budget, so the reservation shrinks to ``budget - held`` (never grows)."""
        keep = max(0, seq.budget - len(seq.blocks))
        if keep < seq.reserved:
            self.reserved -= seq.reserved - keep
            seq.reserved = keep

    # -- invariants ---------------------------------------------------------
    def check_invariants(self, owners: list[list[int]], reservations: int) -> None:
        """``owners``: the block lists of every live owner (sequences and carried entries)."""
        seen = np.zeros(self.num_blocks, np.int64)
        for blocks in owners:
            np.add.at(seen, np.asarray(blocks, np.int64), 1)
        if (seen > 1).any():
            raise AssertionError(f"module {self.module}: blocks owned twice: {np.flatnonzero(seen > 1).tolist()}")
        free = np.zeros(self.num_blocks, bool)
        free[self._free] = True
        if len(set(self._free)) != len(self._free):
            raise AssertionError(f"module {self.module}: the free list holds a block twice")
        if not np.array_equal(free, ~self._in_use):
            raise AssertionError(f"module {self.module}: free list and in-use map disagree")
        if not np.array_equal(seen == 1, self._in_use):
            lost = np.flatnonzero(self._in_use & (seen == 0)).tolist()
            raise AssertionError(f"module {self.module}: in-use blocks without an owner (leaked): {lost}; "
                                 f"owned but free: {np.flatnonzero(~self._in_use & (seen == 1)).tolist()}")
        if reservations != self.reserved or self.reserved > self.num_free:
            raise AssertionError(f"module {self.module}: {self.reserved} blocks reserved in the pool, "
                                 f"{reservations} by the sequences, {self.num_free} free")

    def check_seq(self, seq: SeqKv) -> None:
        if len(seq.blocks) != ceil_div(seq.rows, self.block_size):
            raise AssertionError(f"module {self.module}: {len(seq.blocks)} blocks for {seq.rows} rows "
                                 f"(block_size {self.block_size})")
        if seq.budget and len(seq.blocks) + seq.reserved > max(seq.budget, len(seq.blocks)):
            raise AssertionError(f"module {self.module}: held {len(seq.blocks)} + reserved {seq.reserved} "
                                 f"exceeds budget {seq.budget}")
