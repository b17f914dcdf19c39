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

**Ownership.** The pool is the only authority on who owns a block. Every
``SeqKv`` is made by ``new_seq(holder)`` and registered under a serial number;
the pool records the owner's serial of each block in use and the holder of
each sequence (a proposer state, a carried entry, an ``MtpHead`` user). Every
mutation checks, before any block moves, that the sequence is registered here
and that its block list agrees with the pool's record; ``check_holder`` tells
a caller whether the object it was handed is the one the pool knows. A copy
of a ``SeqKv`` (or a hand-built one) is therefore refused, never obeyed.

**Threads.** Every method that reads or changes the free list, the owners or
the reservations runs under the pool's lock, and ``grow_all`` checks room and
takes the blocks for several sequences as one step, so concurrent calls on
distinct sequences cannot both count the same free block.
"""

from __future__ import annotations

import threading
from typing import Any, Iterable

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

    def rows_before(self, key: int) -> int:
        """How many rows have a key < ``key`` (the first row a sliding window that starts
        at ``key`` shows). Walks back from the last run: O(runs at or past ``key``)."""
        n = self._n
        for s, c in reversed(self._runs):
            if s + c <= key:                       # the whole run lies before key
                break
            n -= c - max(0, key - s)               # the run's rows at or past key
            if s < key:
                break
        return n

    def to_list(self) -> list[int]:
        return [s + i for s, c in self._runs for i in range(c)]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KeyRuns) and self._runs == other._runs

    def __repr__(self) -> str:
        return f"KeyRuns({self._runs})"


class SeqKv:
    """One sequence's rows in one module's pool (made by ``BlockPool.new_seq``).

    ``blocks`` (the block table, a tuple) and ``keys`` (the keys of the rows, a copy)
    are read-only views: only the pool changes a sequence, so nothing handed to an
    engine can make the pool write into, or free, a block it did not give out."""

    __slots__ = ("_blocks", "_keys", "_budget", "_reserved", "_serial", "__weakref__")

    def __init__(self, serial: int = 0):
        self._blocks: list[int] = []
        self._keys = KeyRuns()
        self._budget = 0        # blocks promised to this sequence by reserve(); 0 = none
        self._reserved = 0      # of the budget, blocks still held back in the pool
        self._serial = serial   # the pool's registration number; 0 = not registered anywhere

    @property
    def blocks(self) -> tuple[int, ...]:
        return tuple(self._blocks)

    @property
    def keys(self) -> KeyRuns:
        return self._keys.copy()

    @property
    def last_key(self) -> int | None:
        return self._keys.last

    @property
    def rows(self) -> int:
        return len(self._keys)

    @property
    def budget(self) -> int:
        return self._budget

    @property
    def reserved(self) -> int:
        return self._reserved

    @property
    def serial(self) -> int:
        return self._serial

    def __copy__(self) -> "SeqKv":
        return _unregistered_copy(self)

    def __deepcopy__(self, memo: dict) -> "SeqKv":
        return _unregistered_copy(self)

    def __reduce__(self):
        raise TypeError("SeqKv cannot be pickled: it is a handle into a live KV pool")

    def __repr__(self) -> str:
        return f"SeqKv(rows={self.rows}, blocks={len(self._blocks)}, keys={self._keys!r})"


def _unregistered_copy(seq: SeqKv) -> SeqKv:
    """A copy with the same contents that no pool knows (every pool refuses it)."""
    new = SeqKv(serial=0)
    new._blocks, new._keys = list(seq._blocks), seq._keys.copy()
    new._budget, new._reserved = seq._budget, seq._reserved
    return new


class BlockPool:
    """K/V caches of one module, the free list of their blocks, and the registry of
    the sequences that own them. Every method that changes a sequence names its
    holder, and is refused (``StateError``, nothing changed) unless the pool's
    registry says that holder holds that very sequence."""

    #: block ids, rows and slots are int32 in the kernels
    MAX_BLOCKS = 2**31 - 1

    def __init__(self, module: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, backend: Any, v_head_dim: int | None = None):
        if not 1 <= num_blocks <= self.MAX_BLOCKS:
            raise ValueError(f"num_blocks: expected 1 .. {self.MAX_BLOCKS}, got {num_blocks}")
        if not 1 <= block_size <= self.MAX_BLOCKS // num_blocks:
            raise ValueError(f"block_size: expected 1 .. {self.MAX_BLOCKS // num_blocks} (num_blocks * block_size "
                             f"slots must fit int32), got {block_size}")
        self.module = module
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.k = backend.empty_kv(num_blocks, block_size, num_kv_heads, head_dim)
        self.v = backend.empty_kv(num_blocks, block_size, num_kv_heads, v_head_dim or head_dim)
        # A stack: pop() hands out the lowest free id first.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._owner = np.zeros(num_blocks, np.int64)       # serial of the owning sequence; 0 = free
        self._seqs: dict[int, tuple[SeqKv, Any]] = {}       # serial -> (sequence, its holder)
        self._serials = iter(range(1, 2**62))
        self.reserved = 0    # blocks promised to sequences and not yet taken by them
        self.closed = False
        self._lock = threading.RLock()

    # -- queries ----------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_seqs(self) -> int:
        return len(self._seqs)

    @staticmethod
    def bytes_per_block(block_size: int, num_kv_heads: int, head_dim: int, itemsize: int,
                        v_head_dim: int | None = None) -> int:
        """Bytes of one block: K and V rows of ``block_size`` tokens."""
        return block_size * num_kv_heads * (head_dim + (v_head_dim or head_dim)) * itemsize

    def block_bytes(self) -> int:
        """Bytes of one block: K and V, ``block_size`` rows each."""
        return (int(self.k.nbytes) + int(self.v.nbytes)) // self.num_blocks

    def available_to(self, seq: SeqKv) -> int:
        """Blocks ``seq`` may still take: the unpromised free ones plus its own reservation."""
        return self.num_free - self.reserved + seq._reserved

    def blocks_needed(self, seq: SeqKv, new_rows: int) -> int:
        return max(0, ceil_div(seq.rows + new_rows, self.block_size) - len(seq._blocks))

    def check_room(self, seqs_rows: Iterable[tuple[SeqKv, int]]) -> None:
        """Raise ``KvCacheFull`` unless every ``(seq, new_rows)`` can grow at once."""
        with self._lock:
            need = 0
            own_reserved = 0
            for seq, n in seqs_rows:
                k = self.blocks_needed(seq, n)
                need += k
                own_reserved += min(k, seq._reserved)
            avail = self.num_free - self.reserved + own_reserved
            if need > avail:
                raise KvCacheFull(self.module, need, avail, self.num_blocks)

    def slots(self, seq: SeqKv, first_row: int, count: int) -> np.ndarray:
        """``[count]`` int32 cache slots of rows ``first_row ..``."""
        r = np.arange(first_row, first_row + count)
        table = np.asarray(seq._blocks, np.int64)
        return (table[r // self.block_size] * self.block_size + r % self.block_size).astype(np.int32)

    # -- registry -------------------------------------------------------------
    def new_seq(self, holder: Any) -> SeqKv:
        """A new, empty sequence of this pool, held by ``holder``."""
        with self._lock:
            self._check_open()
            seq = SeqKv(serial=next(self._serials))
            self._seqs[seq._serial] = (seq, holder)
            return seq

    def check_holder(self, seq: Any, holder: Any, name: str = "seq") -> SeqKv:
        """``seq`` itself (not a copy) is registered in this pool and held by ``holder``;
        else ``StateError`` (``TypeError`` for something that is not a ``SeqKv``)."""
        if not isinstance(seq, SeqKv):
            raise TypeError(f"{name}: expected a SeqKv, got {type(seq).__name__}")
        self._check_open()
        entry = self._seqs.get(seq._serial)
        if entry is None or entry[0] is not seq:
            raise StateError(f"{name}: not a live sequence of module {self.module}'s KV pool (freed, made by "
                             f"another pool, or a copy)")
        if entry[1] is not holder:
            raise StateError(f"{name}: held by {_holder_name(entry[1])}, not by this caller")
        return seq

    def retire(self, seq: SeqKv, holder: Any) -> None:
        """Release every block and the reservation of ``seq`` and unregister it."""
        with self._lock:
            self.check_holder(seq, holder)
            self._release_all(seq)
            del self._seqs[seq._serial]

    # -- mutation (each names the sequence's holder) -------------------------
    def grow(self, seq: SeqKv, new_rows: int, holder: Any) -> None:
        """Make room for ``new_rows`` more rows (raises ``KvCacheFull``, changing nothing,
        when the pool cannot)."""
        self.grow_all([(seq, new_rows, holder)])

    def grow_all(self, seqs_rows: Iterable[tuple[SeqKv, int, Any]]) -> None:
        """Room check and allocation for several sequences as one step: either every
        ``(seq, new_rows, holder)`` gets its blocks, or ``KvCacheFull`` and nothing changed."""
        seqs_rows = list(seqs_rows)
        with self._lock:
            for seq, _, holder in seqs_rows:
                self.check_holder(seq, holder)
            self.check_room([(seq, n) for seq, n, _ in seqs_rows])
            for seq, n, _ in seqs_rows:
                for _ in range(self.blocks_needed(seq, n)):
                    b = self._free.pop()
                    self._owner[b] = seq._serial
                    seq._blocks.append(b)
                    if seq._reserved:
                        seq._reserved -= 1
                        self.reserved -= 1

    def append(self, seq: SeqKv, first_key: int, count: int, holder: Any) -> int:
        """Append ``count`` rows with keys ``first_key ..`` (blocks taken as needed);
        returns the index of the first new row."""
        with self._lock:
            self.grow_all([(seq, count, holder)])
            first = seq.rows
            seq._keys.append(first_key, count)
            return first

    def trim(self, seq: SeqKv, drop_rows: int, holder: Any) -> None:
        """Drop the last ``drop_rows`` rows (0: none); blocks that hold no row (left empty,
        or taken ahead for rows never written) go back at once."""
        with self._lock:
            self.check_holder(seq, holder)
            if drop_rows > seq.rows:
                raise ValueError(f"module {self.module}: cannot drop {drop_rows} rows of {seq.rows}")
            keep = ceil_div(seq.rows - max(0, drop_rows), self.block_size)
            if drop_rows > 0:
                seq._keys.pop(drop_rows)
            extra = seq._blocks[keep:]
            del seq._blocks[keep:]
            self._release(extra, seq)

    def release_all(self, seq: SeqKv, holder: Any) -> None:
        """Return every block and the reservation of ``seq``; it ends empty with no budget
        (and stays registered)."""
        with self._lock:
            self.check_holder(seq, holder)
            self._release_all(seq)

    def _release_all(self, seq: SeqKv) -> None:
        blocks = seq._blocks[:]
        seq._blocks.clear()
        seq._keys = KeyRuns()
        self._release(blocks, None)
        self._drop_budget(seq)

    def _release(self, blocks: list[int], seq: SeqKv | None) -> None:
        """Free ``blocks`` (the caller holds the lock; the blocks are the sequence's own,
        since only the pool ever writes a block table)."""
        for b in reversed(blocks):
            self._owner[b] = 0
            self._free.append(b)
        if seq is not None and seq._budget:
            # Keep the sequence's promise whole: what it gave back is held for it again.
            back = min(len(blocks), seq._budget - len(seq._blocks) - seq._reserved)
            if back > 0:
                seq._reserved += back
                self.reserved += back

    def reserve(self, seq: SeqKv, budget_blocks: int, holder: Any) -> None:
        """Promise ``seq`` up to ``budget_blocks`` blocks in all (held ones included)."""
        with self._lock:
            self.check_holder(seq, holder)
            want = max(0, budget_blocks - len(seq._blocks)) - seq._reserved
            if want > self.num_free - self.reserved:
                raise KvCacheFull(self.module, want, self.num_free - self.reserved, self.num_blocks)
            seq._budget = budget_blocks
            seq._reserved += want
            self.reserved += want

    def drop_budget(self, seq: SeqKv, holder: Any) -> None:
        """Forget ``seq``'s budget: its blocks still held back go back to everyone."""
        with self._lock:
            self.check_holder(seq, holder)
            self._drop_budget(seq)

    def _drop_budget(self, seq: SeqKv) -> None:
        self.reserved -= seq._reserved
        seq._reserved = 0
        seq._budget = 0

    def fit_budget(self, seq: SeqKv, holder: Any) -> None:
        """After blocks joined ``seq`` from outside (an installed carry): they count
        within its budget, so the reservation shrinks to ``budget - held`` (never grows)."""
        with self._lock:
            self.check_holder(seq, holder)
            keep = max(0, seq._budget - len(seq._blocks))
            if keep < seq._reserved:
                self.reserved -= seq._reserved - keep
                seq._reserved = keep

    def move_rows(self, src: SeqKv, src_holder: Any, dst: SeqKv, dst_holder: Any) -> None:
        """Give ``src``'s blocks and keys to the empty ``dst`` (both held as named);
        ``src`` ends empty. Budgets stay where they were (the caller fits them). The
        block ids and their contents do not change."""
        with self._lock:
            self.check_holder(src, src_holder)
            self.check_holder(dst, dst_holder)
            if dst._blocks or dst.rows:
                raise StateError(f"module {self.module}: rows can only move into an empty sequence")
            for b in src._blocks:
                self._owner[b] = dst._serial
            dst._blocks, src._blocks = src._blocks, []
            dst._keys, src._keys = src._keys, KeyRuns()

    def close(self) -> None:
        """Drop every sequence and the caches; later calls raise ``StateError``."""
        with self._lock:
            for seq, _ in self._seqs.values():
                seq._blocks, seq._keys, seq._budget, seq._reserved = [], KeyRuns(), 0, 0
            self._seqs.clear()
            self._free = list(range(self.num_blocks - 1, -1, -1))
            self._owner[:] = 0
            self.reserved = 0
            self.closed = True
            self.k = self.v = None

    def _check_open(self) -> None:
        if self.closed:
            raise StateError(f"module {self.module}'s KV pool is closed (its proposer's close() released it)")

    # -- invariants ---------------------------------------------------------
    def holders(self) -> list[Any]:
        """The holder of every registered sequence (with repetition)."""
        with self._lock:
            return [h for _, h in self._seqs.values()]

    def check_invariants(self) -> None:
        """The free list, the owner record and the registered sequences agree: every block
        is free or owned by exactly one registered sequence, whose table lists it."""
        with self._lock:
            seen = np.zeros(self.num_blocks, np.int64)
            for serial, (seq, _) in self._seqs.items():
                if seq._serial != serial:
                    raise AssertionError(f"module {self.module}: sequence {serial} now calls itself {seq._serial}")
                blocks = np.asarray(seq._blocks, np.int64)
                if blocks.size and (self._owner[blocks] != serial).any():
                    raise AssertionError(f"module {self.module}: sequence {serial} lists blocks it does not own: "
                                         f"{blocks[self._owner[blocks] != serial].tolist()}")
                np.add.at(seen, blocks, 1)
            if (seen > 1).any():
                raise AssertionError(f"module {self.module}: blocks owned twice: {np.flatnonzero(seen > 1).tolist()}")
            if len(set(self._free)) != len(self._free):
                raise AssertionError(f"module {self.module}: the free list holds a block twice")
            free = np.zeros(self.num_blocks, bool)
            free[self._free] = True
            if not np.array_equal(free, self._owner == 0):
                raise AssertionError(f"module {self.module}: free list and owner record disagree")
            if not np.array_equal(seen == 1, self._owner != 0):
                lost = np.flatnonzero((self._owner != 0) & (seen == 0)).tolist()
                raise AssertionError(f"module {self.module}: in-use blocks without an owner (leaked): {lost}")
            reservations = sum(seq._reserved for seq, _ in self._seqs.values())
            if reservations != self.reserved or self.reserved > self.num_free:
                raise AssertionError(f"module {self.module}: {self.reserved} blocks reserved in the pool, "
                                     f"{reservations} by the sequences, {self.num_free} free")

    def check_seq(self, seq: SeqKv) -> None:
        if len(seq._blocks) != ceil_div(seq.rows, self.block_size):
            raise AssertionError(f"module {self.module}: {len(seq._blocks)} blocks for {seq.rows} rows "
                                 f"(block_size {self.block_size})")
        if seq._budget and len(seq._blocks) + seq._reserved > max(seq._budget, len(seq._blocks)):
            raise AssertionError(f"module {self.module}: held {len(seq._blocks)} + reserved {seq._reserved} "
                                 f"exceeds budget {seq._budget}")


def _holder_name(holder: Any) -> str:
    name = type(holder).__name__
    return {"MtpState": "a proposer state", "DrafterKv": "a carried entry (DrafterKv)",
            "MtpHead": "an MtpHead user (alloc_seq)"}.get(name, name)
