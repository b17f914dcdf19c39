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

**Sliding windows** (``WindowRule``). A windowed module's rows keep their numbering
and keys, but the leading blocks that no later forward can read go back to the pool:
``SeqKv._base`` counts the block-table entries already released (row ``r`` is in
``_blocks[r // BS - _base]``), so a sequence holds ``O(window)`` blocks whatever its
length. Two moments release them:

- ``release_window``, after a call has committed (no rollback can need its rows):
  every full block before ``WindowRule.first_visible_row`` goes back to the pool;
- ``recycle``, between the forwards of one long call (prefill, catch-up): a block
  holding only rows this call wrote, all out of the window, stays the sequence's
  and is moved to the end of its table for the call's next rows; its old entry
  becomes a ``HOLE``. A rollback drops those rows anyway, and the pool's free list
  does not change until the call commits. This is what bounds a call's peak, so
  that a budget needs only ``WindowRule.max_blocks`` blocks.

Released entries (and holes) are written into block tables as block 0: attention
never reads the table entries of blocks wholly before a row's window.

**Ownership.** The pool is the only authority on who owns a block. Every
``SeqKv`` is made by ``new_seq(holder)`` and registered under a serial number;
the pool records how many sequences hold each block in use (``Sharing``) and the
holder of each sequence (a proposer state, a carried entry, an ``MtpHead`` user). Every
mutation checks, before any block moves, that the sequence is registered here
and that its block list agrees with the pool's record; ``check_holder`` tells
a caller whether the object it was handed is the one the pool knows. A copy
of a ``SeqKv`` (or a hand-built one) is therefore refused, never obeyed.

**Sharing** (``fork``, ``share_rows``; docs/kv_pool.md). A block may be held by several
sequences: a forked proposer state, or a state that took another's rows for a common
prefix, lists the same block ids as its source. The pool counts the holders of each
block (``refs``): a release (trim, window, retire) drops one reference, and the block
goes back to the free list when the last one goes. Only a sequence's last, partial
block can ever be written again (rows are appended, never rewritten), so that is the
only copy-on-write there is: a growth of a sequence whose last partial block is shared
first copies the block's rows into a fresh block of its own (``BlockPool.copy_rows``,
the backend's ``copy_kv_rows``, as a draft tree's lines copy theirs), counted in the
room check like any other block it takes. The other holders keep the original.

**Threads.** Every method that reads or changes the free list, the owners or
the reservations runs under the pool's lock, and ``grow_all`` checks room and
takes the blocks for several sequences as one step, so concurrent calls on
distinct sequences cannot both count the same free block.
"""

from __future__ import annotations

import threading
from array import array
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from .argtypes import kind, scalar_int
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

    def key_at(self, row: int) -> int:
        """The key of row ``row`` (0 <= row < len). Walks back from the last run: O(runs
        past ``row``), cheap for the rows near the end that the window rules ask about."""
        if not 0 <= row < self._n:
            raise IndexError(f"row: expected 0 .. {self._n - 1}, got {row}")
        n = self._n
        for s, c in reversed(self._runs):
            n -= c
            if row >= n:
                return s + row - n
        raise AssertionError("unreachable: the runs hold len(self) rows")

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


#: a block-table entry released inside a call (``BlockPool.recycle``): its block now
#: holds later rows of the same sequence; gone once the call commits
HOLE = -1


def _entries(values=()) -> array:
    """A sequence's block-table entries: a list's operations on int64 machine words, which
    NumPy reads without converting each (``BlockPool.table``: a 2048-entry table took ~25 us as
    a list, ~0.3 us as this)."""
    return array("q", values)


@dataclass(frozen=True, slots=True)
class WindowRule:
    """Which rows of a sliding-window module's sequences a forward may still read, and
    how many blocks that leaves a sequence.

    ``window`` W: a row with key ``j`` reads the rows with keys ``> j - W`` (itself
    included). ``margin`` T: rows a later call may still remove from the end of a
    sequence (the KV mode's ``after_verify``: exact mode drops at most ``m`` keys of
    module ``m``, draft mode at most one row, of modules ``m >= 1``; a rollback never
    goes below the rows a call started with). ``max_forward_rows`` C: the most rows
    one forward appends to one sequence (the proposer's ``prefill_chunk + M``).

    Every later row has a key above ``key_at(rows - 1 - T)`` (the last key any trim
    can leave), so it reads no key below ``cutoff = key_at(rows - 1 - T) + 2 - W``:
    rows ``0 .. first_visible_row - 1`` are dead, and the full blocks among them can
    go. At most ``W - 1 + T`` rows have a key ``>= cutoff`` (``W - 1`` keys up to
    ``key_at(rows - 1 - T)``, then the ``T`` rows after it), and the first live block
    starts at most ``BS - 1`` rows before the first visible row, hence the bounds.
    """

    window: int
    margin: int = 0
    max_forward_rows: int = 1

    def __post_init__(self) -> None:
        for name, lo in (("window", 1), ("margin", 0), ("max_forward_rows", 1)):
            v = getattr(self, name)
            i = scalar_int(v)                    # the integer rule (mtpkern.argtypes)
            if i is None:
                raise TypeError(f"{name}: expected an int >= {lo}, got {kind(v)} {v!r}")
            if i < lo:
                raise ValueError(f"{name}: expected an int >= {lo}, got {i}")
            object.__setattr__(self, name, i)

    def first_visible_row(self, keys: KeyRuns, margin: int | None = None) -> int:
        """The first row that a later forward of this sequence may read, when at most
        ``margin`` rows (default: ``self.margin``) may still be trimmed away first."""
        T = self.margin if margin is None else margin
        n = len(keys)
        if n <= T:
            return 0
        return keys.rows_before(keys.key_at(n - 1 - T) + 2 - self.window)

    def idle_blocks(self, block_size: int) -> int:
        """Blocks a sequence holds between calls: ``ceil((W + T + BS - 2) / BS)``."""
        return ceil_div(self.window + self.margin + block_size - 2, block_size)

    def call_blocks(self, block_size: int) -> int:
        """Blocks a call may add on top, at its peak (its rows' blocks that the window
        still reads, one forward of C rows ahead): ``ceil((C + W + T + BS - 2) / BS)``."""
        return ceil_div(self.max_forward_rows + self.window + self.margin + block_size - 2, block_size)

    def max_blocks(self, block_size: int) -> int:
        """The most blocks a sequence holds, inside a call included."""
        return self.idle_blocks(block_size) + self.call_blocks(block_size)


class SeqKv:
    """One sequence's rows in one module's pool (made by ``BlockPool.new_seq``).

    ``blocks`` (the live block-table entries, a tuple) and ``keys`` (the keys of the
    rows, a copy) are read-only views: only the pool changes a sequence, so nothing
    handed to an engine can make the pool write into, or free, a block it did not
    give out. ``base``: the leading entries of the table already released (a
    sliding-window module's rows out of its window; 0 otherwise), so row ``r`` lives
    in ``blocks[r // block_size - base]``."""

    __slots__ = ("_blocks", "_base", "_keys", "_budget", "_reserved", "_serial", "__weakref__")

    def __init__(self, serial: int = 0):
        self._blocks = _entries()      # table entries base .. (HOLE: released inside the running call)
        self._base = 0                 # leading table entries released (their rows out of the window)
        self._keys = KeyRuns()
        self._budget = 0        # blocks promised to this sequence by reserve(); 0 = none
        self._reserved = 0      # of the budget, blocks still held back in the pool
        self._serial = serial   # the pool's registration number; 0 = not registered anywhere

    @property
    def blocks(self) -> tuple[int, ...]:
        return tuple(self._blocks)

    @property
    def base(self) -> int:
        return self._base

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
        base = f", released={self._base}" if self._base else ""
        return f"SeqKv(rows={self.rows}, blocks={len(self._blocks)}{base}, keys={self._keys!r})"


def _unregistered_copy(seq: SeqKv) -> SeqKv:
    """A copy with the same contents that no pool knows (every pool refuses it)."""
    new = SeqKv(serial=0)
    new._blocks, new._base, new._keys = _entries(seq._blocks), seq._base, seq._keys.copy()
    new._budget, new._reserved = seq._budget, seq._reserved
    return new


def check_fp8_kv(block: Any, module: int, hc_mult: int = 1, sharded: bool = False) -> None:
    """Refuse, by name and before anything is allocated, a module ``kv_dtype="fp8"`` does not
    implement: FP8 KV (mtpkern.ops.kv_fp8) is GQA attention's K and V caches, unsharded; MLA's
    latent rows (and DSA's indexer keys), DeepSeek-V4's attention, hyper-connections and a
    sharded head keep their caches in FP32 / BF16 (docs/kv_pool.md, "FP8 KV cache").
    ``block``: the module's ``BlockSpec``."""
    if block.mla:
        what = f"uses MLA (kv_lora_rank {block.kv_lora_rank}{', with a DSA indexer' if block.dsa else ''})"
    elif block.shared_kv or block.out_rope or block.o_groups:
        what = (f"uses DeepSeek-V4's attention (shared_kv {block.shared_kv}, out_rope {block.out_rope}, "
                f"o_groups {block.o_groups})")
    elif hc_mult > 1:
        what = f"has hyper-connections (hc_mult {hc_mult})"
    elif sharded:
        what = "is one rank's shard of a sharded head"
    else:
        return
    raise ValueError(f"kv_dtype: 'fp8' is implemented for GQA attention on one rank; module {module}'s block "
                     f"{what}; expected kv_dtype 'float32' (cpu / numpy) or 'bfloat16' (cuda)")


class BlockPool:
    """K/V caches of one module, the free list of their blocks, and the registry of
    the sequences that own them. Every method that changes a sequence names its
    holder, and is refused (``StateError``, nothing changed) unless the pool's
    registry says that holder holds that very sequence."""

    #: block ids, rows and slots are int32 in the kernels
    MAX_BLOCKS = 2**31 - 1

    def __init__(self, module: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, backend: Any, v_head_dim: int | None = None, window: WindowRule | None = None,
                 latent_width: int = 0, index_width: int = 0):
        """``latent_width`` > 0: an MLA pool, one latent row of that many values per token
        (``k`` is the ``[num_blocks, block_size, latent_width]`` cache, ``v`` None); else
        K ``[.., num_kv_heads, head_dim]`` and V ``[.., num_kv_heads, v_head_dim]`` caches.
        ``index_width`` > 0 (DSA, mtpkern.ops.dsa): a plane ``index_k`` ``[num_blocks,
        block_size, index_width]`` of indexer keys beside the latent rows, one per token under
        the same block tables (written, trimmed, windowed, copied and counted with them)."""
        if not 1 <= num_blocks <= self.MAX_BLOCKS:
            raise ValueError(f"num_blocks: expected 1 .. {self.MAX_BLOCKS}, got {num_blocks}")
        if not 1 <= block_size <= self.MAX_BLOCKS // num_blocks:
            raise ValueError(f"block_size: expected 1 .. {self.MAX_BLOCKS // num_blocks} (num_blocks * block_size "
                             f"slots must fit int32), got {block_size}")
        if window is not None and not isinstance(window, WindowRule):
            raise TypeError(f"window: expected a WindowRule or None, got {type(window).__name__}")
        self.module = module
        #: a sliding-window module's rule (leading blocks go back once out of the window); None: full attention
        self.window = window
        #: copy-on-write copies made (a shared partial block copied before a row was appended)
        self.cow_copies = 0
        #: block-table entries released because no later forward could read their rows, ever:
        #: given back to the pool (release_window) or reused by the same call (recycle)
        self.window_released = 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        #: an MLA pool's latent row width (0: K and V caches)
        self.latent_width = int(latent_width)
        self._backend = backend
        if index_width and not latent_width:
            raise ValueError(f"index_width: an indexer plane needs an MLA pool (latent_width > 0), got {index_width}")
        #: the DSA indexer keys' plane (None without an indexer)
        self.index_k = backend.empty_latent_kv(num_blocks, block_size, index_width) if index_width else None
        fp8 = bool(getattr(backend, "kv_fp8", False))
        if fp8 and (latent_width or index_width):
            raise ValueError(f"kv_dtype: 'fp8' is implemented for GQA attention's K and V caches; module "
                             f"{module}'s pool holds MLA latent rows (latent_width {latent_width})")
        if latent_width:
            self.k, self.v = backend.empty_latent_kv(num_blocks, block_size, latent_width), None
        else:
            self.k = backend.empty_keys(num_blocks, block_size, num_kv_heads, head_dim)
            self.v = backend.empty_kv(num_blocks, block_size, num_kv_heads, v_head_dim or head_dim)
        #: an FP8 pool's scale planes, FP32 [num_blocks, block_size, Hkv], one scale per row and KV
        #: head of K and of V (mtpkern.ops.kv_fp8); planes like the caches: every copy of rows
        #: (copy-on-write, a tree's lines) moves codes and scales together. None otherwise.
        self.k_scale = backend.empty_kv_scales(num_blocks, block_size, num_kv_heads) if fp8 else None
        self.v_scale = backend.empty_kv_scales(num_blocks, block_size, num_kv_heads) if fp8 else None
        #: the scale planes as the KV write's and the attention's keyword arguments ({}: no FP8)
        self.scale_kw = {"k_scale": self.k_scale, "v_scale": self.v_scale} if fp8 else {}
        # A stack: pop() hands out the lowest free id first.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._refs = np.zeros(num_blocks, np.int64)        # sequences holding each block; 0 = free
        self._seqs: dict[int, tuple[SeqKv, Any]] = {}       # serial -> (sequence, its holder)
        #: serials of the scratch sequences among them: a draft tree's other lines (mtpkern.tree),
        #: held by the state beside its own sequence, registered as such in the same locked step
        self._scratch: set[int] = set()
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
    def bytes_per_block(block_size: int, row_values: int, itemsize: int) -> int:
        """Bytes of one block: ``block_size`` tokens of ``row_values`` values each
        (``BlockSpec.kv_row_values``: K and V of every KV head, or one MLA latent row)."""
        return block_size * row_values * itemsize

    def block_bytes(self) -> int:
        """Bytes of one block: K and V (and their FP8 scales; or the latent rows, and the indexer keys),
        ``block_size`` rows each."""
        return sum(int(c.nbytes) for c in self.planes()) // self.num_blocks

    def planes(self) -> tuple[Any, ...]:
        """The caches of this pool, each ``[num_blocks, block_size, ...]``: K and V (and an FP8
        pool's scale planes), or the latent rows (and the indexer keys)."""
        return tuple(c for c in (self.k, self.v, self.index_k, self.k_scale, self.v_scale) if c is not None)

    def available_to(self, seq: SeqKv) -> int:
        """Blocks ``seq`` may still take: the unpromised free ones plus its own reservation."""
        return self.num_free - self.reserved + seq._reserved

    def blocks_needed(self, seq: SeqKv, new_rows: int) -> int:
        """Blocks ``seq`` must take to append ``new_rows`` rows now."""
        return max(0, ceil_div(seq.rows + new_rows, self.block_size) - seq._base - len(seq._blocks))

    def call_blocks(self, seq: SeqKv, new_rows: int) -> int:
        """Blocks a call that appends ``new_rows`` rows to ``seq`` takes up front: all it
        needs, and for a sliding-window module no more than ``WindowRule.call_blocks``
        (between its forwards the call reuses the blocks its window left behind: ``recycle``)."""
        need = self.blocks_needed(seq, new_rows)
        return need if self.window is None else min(need, self.window.call_blocks(self.block_size))

    def blocks_for_tokens(self, tokens: int) -> int:
        """Blocks a sequence of ``tokens`` rows holds at most (a budget, ``alloc_state_for``):
        ``ceil(tokens / block_size)``, and for a sliding-window module no more than
        ``WindowRule.max_blocks``, whatever the length."""
        need = ceil_div(tokens, self.block_size)
        return need if self.window is None else min(need, self.window.max_blocks(self.block_size))

    def check_room(self, seqs_rows: Iterable[tuple[SeqKv, int]]) -> None:
        """Raise ``KvCacheFull`` unless every ``(seq, new_rows)`` can grow at once."""
        seqs_rows = list(seqs_rows)
        with self._lock:
            cows = self._cow_plan(seqs_rows)
            self._check_blocks([(seq, self.blocks_needed(seq, n) + c) for (seq, n), c in zip(seqs_rows, cows)])

    def is_shared(self, block: int) -> bool:
        """Whether more than one sequence holds ``block``."""
        return bool(self._refs[block] > 1)

    def refs(self, block: int) -> int:
        """How many sequences hold ``block`` (0: free)."""
        return int(self._refs[block])

    def _tail_index(self, seq: SeqKv) -> int:
        """The table index of the block the next row of ``seq`` goes into when it is partial
        (holds earlier rows), else -1."""
        r = seq.rows
        if r % self.block_size == 0:
            return -1
        i = r // self.block_size - seq._base
        return i if 0 <= i < len(seq._blocks) and seq._blocks[i] != HOLE else -1

    def _cow_blocks(self, seq: SeqKv, new_rows: int) -> int:
        """1 when appending ``new_rows`` > 0 rows to ``seq`` must first copy its shared last
        partial block (copy-on-write), else 0."""
        if new_rows <= 0:
            return 0
        i = self._tail_index(seq)
        return int(i >= 0 and self._refs[seq._blocks[i]] > 1)

    def _check_blocks(self, seqs_blocks: list[tuple[SeqKv, int]]) -> None:
        with self._lock:
            need = 0
            own_reserved = 0
            for seq, k in seqs_blocks:
                need += k
                own_reserved += min(k, seq._reserved)
            avail = self.num_free - self.reserved + own_reserved
            if need > avail:
                raise KvCacheFull(self.module, need, avail, self.num_blocks)

    def slots(self, seq: SeqKv, first_row: int, count: int) -> np.ndarray:
        """``[count]`` int32 cache slots of rows ``first_row ..`` (rows in live blocks)."""
        bs, base, blocks = self.block_size, seq._base, seq._blocks
        out = []                                   # a few rows a call: Python ints beat NumPy's per-call cost
        for r in range(first_row, first_row + count):
            i = r // bs - base
            if i < 0 or i >= len(blocks) or blocks[i] < 0:
                raise StateError(f"module {self.module}: rows {first_row} .. {first_row + count - 1} are not in "
                                 f"live blocks (entries {base} .. {base + len(blocks) - 1}, released ones included)")
            out.append(blocks[i] * bs + r % bs)
        return np.array(out, np.int32)

    def table(self, seq: SeqKv) -> np.ndarray:
        """``seq``'s block table as the kernels read it, ``[base + len(blocks)]`` int32:
        released entries (and holes) written as block 0, which attention never reads
        (they lie wholly before every row's window)."""
        t = np.zeros(seq._base + len(seq._blocks), np.int32)
        t[seq._base:] = np.maximum(np.asarray(seq._blocks, np.int64), 0)
        return t

    def copy_rows(self, src: Any, dst: Any) -> None:
        """Cache slots ``dst`` take the K/V (or latent) rows of slots ``src`` (int32 arrays of
        equal length, on the host or the backend): a draft tree's copy-on-write of a partial
        block (mtpkern.tree). The caller owns the blocks of ``dst``."""
        for cache in self.planes():
            self._backend.copy_kv_rows(cache, src, dst)

    # -- registry -------------------------------------------------------------
    def new_seq(self, holder: Any, scratch: bool = False) -> SeqKv:
        """A new, empty sequence of this pool, held by ``holder``. ``scratch``: a sequence a
        state holds beside its own one (a draft tree's other lines), counted apart by
        ``holders`` / ``scratch_seqs``, so that an invariant check running while a tree is
        drafted sees it as what it is from the moment it exists."""
        with self._lock:
            self._check_open()
            seq = SeqKv(serial=next(self._serials))
            self._seqs[seq._serial] = (seq, holder)
            if scratch:
                self._scratch.add(seq._serial)
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
            self._scratch.discard(seq._serial)

    # -- mutation (each names the sequence's holder) -------------------------
    def grow(self, seq: SeqKv, new_rows: int, holder: Any) -> None:
        """Make room for ``new_rows`` more rows (raises ``KvCacheFull``, changing nothing,
        when the pool cannot)."""
        self.grow_all([(seq, new_rows, holder)])

    def grow_all(self, seqs_rows: Iterable[tuple[SeqKv, int, Any]]) -> None:
        """Room check and allocation for several sequences as one step: either every
        ``(seq, new_rows, holder)`` gets its blocks, or ``KvCacheFull`` and nothing changed."""
        self._take([(seq, n, holder, self.blocks_needed) for seq, n, holder in seqs_rows])

    def grow_for_call(self, seqs_rows: Iterable[tuple[SeqKv, int, Any]]) -> None:
        """``grow_all`` for whole calls (``txn.guarded``): each ``(seq, new_rows, holder)``
        gets ``call_blocks(seq, new_rows)`` blocks, ahead of the rows, as one step."""
        self._take([(seq, n, holder, self.call_blocks) for seq, n, holder in seqs_rows])

    def _take(self, todo: list) -> None:
        with self._lock:
            for seq, _, holder, _ in todo:
                self.check_holder(seq, holder)
            cows = self._cow_plan([(seq, n) for seq, n, _, _ in todo])
            counts = [(seq, count(seq, n), c) for (seq, n, _, count), c in zip(todo, cows)]
            self._check_blocks([(seq, k + c) for seq, k, c in counts])
            for seq, k, c in counts:
                if c:
                    self._unshare_tail(seq)
                for _ in range(k):
                    seq._blocks.append(self._take_one(seq))

    def _cow_plan(self, seqs_rows: list[tuple[SeqKv, int]]) -> list[int]:
        """Per ``(seq, new_rows)`` of one growth step, 1 when it copies its last partial block
        first. A block held by ``r`` sequences, ``c`` of them growing here, is copied
        ``min(c, r - 1)`` times: the last holder keeps the original (the others have left it)."""
        out = [0] * len(seqs_rows)
        left: dict[int, int] = {}                    # shared block -> copies still to make
        for j, (seq, n) in enumerate(seqs_rows):
            if self._cow_blocks(seq, n):
                b = seq._blocks[self._tail_index(seq)]
                left.setdefault(b, int(self._refs[b]) - 1)
                if left[b] > 0:
                    left[b] -= 1
                    out[j] = 1
        return out

    def _take_one(self, seq: SeqKv) -> int:
        """A free block for ``seq`` (room checked by the caller, lock held), from its
        reservation first."""
        b = self._free.pop()
        self._refs[b] = 1
        if seq._reserved:
            seq._reserved -= 1
            self.reserved -= 1
        return b

    def _unshare_tail(self, seq: SeqKv) -> None:
        """Copy-on-write: ``seq``'s last partial block, shared with other sequences, is
        replaced by a fresh block holding a copy of its rows (theirs keep the original)."""
        i = self._tail_index(seq)
        old = seq._blocks[i]
        new = self._take_one(seq)
        n, BS = seq.rows % self.block_size, self.block_size
        off = np.arange(n, dtype=np.int32)
        self.copy_rows(old * BS + off, new * BS + off)
        seq._blocks[i] = new
        self._refs[old] -= 1                     # > 0: other sequences still hold it
        self.cow_copies += 1

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
            keep = ceil_div(seq.rows - max(0, drop_rows), self.block_size) - seq._base
            if seq.rows - max(0, drop_rows) < seq._base * self.block_size:
                # the window rule keeps every row a trim can reach (WindowRule.margin)
                raise StateError(f"module {self.module}: cannot drop {drop_rows} rows of {seq.rows}: rows before "
                                 f"{seq._base * self.block_size} were released (outside the sliding window)")
            if drop_rows > 0:
                seq._keys.pop(drop_rows)
            extra = seq._blocks[keep:]
            del seq._blocks[keep:]
            self._release([b for b in extra if b != HOLE], seq)

    def release_window(self, seq: SeqKv, holder: Any) -> int:
        """After a call committed: give back the leading blocks of a sliding-window
        sequence that no later forward can read (every row before
        ``WindowRule.first_visible_row``), with the holes the call left; returns how many
        blocks went back. A no-op for full attention. Never inside a call: a rollback
        may still need the rows its call started with."""
        with self._lock:
            self.check_holder(seq, holder)
            if self.window is None:
                return 0
            dead = self.window.first_visible_row(seq._keys) // self.block_size - seq._base
            if dead <= 0:
                return 0
            gone = [b for b in seq._blocks[:dead] if b != HOLE]
            del seq._blocks[:dead]
            seq._base += dead
            self._release(gone, seq)
            self.window_released += len(gone)
            return len(gone)

    def recycle(self, seq: SeqKv, holder: Any, first_new_row: int) -> int:
        """Between two forwards of one call that began with ``first_new_row`` rows: every
        block holding only rows this call wrote, all before the window's first visible
        row, becomes a ``HOLE`` in the table and its block is appended as an entry ahead,
        for the call's next rows. The block stays this sequence's (the free list does not
        change), and a rollback drops those rows anyway; ``release_window`` clears the
        holes at commit. Returns the blocks moved; a no-op for full attention."""
        with self._lock:
            self.check_holder(seq, holder)
            if self.window is None:
                return 0
            lo = max(ceil_div(first_new_row, self.block_size), seq._base)
            hi = self.window.first_visible_row(seq._keys) // self.block_size
            moved = []
            for j in range(hi - 1, lo - 1, -1):          # holes from earlier forwards sit below
                i = j - seq._base
                if seq._blocks[i] == HOLE:
                    break
                moved.append(seq._blocks[i])
                seq._blocks[i] = HOLE
            seq._blocks.extend(reversed(moved))
            self.window_released += len(moved)
            return len(moved)

    def settle(self, seq: SeqKv, holder: Any) -> None:
        """After a call committed: ``release_window``, then the blocks taken ahead for rows
        that were not written go back."""
        with self._lock:
            self.release_window(seq, holder)
            self.trim(seq, 0, holder)

    def release_all(self, seq: SeqKv, holder: Any) -> None:
        """Return every block and the reservation of ``seq``; it ends empty with no budget
        (and stays registered)."""
        with self._lock:
            self.check_holder(seq, holder)
            self._release_all(seq)

    def _release_all(self, seq: SeqKv) -> None:
        blocks = [b for b in seq._blocks if b != HOLE]
        del seq._blocks[:]
        seq._base = 0
        seq._keys = KeyRuns()
        self._release(blocks, None)
        self._drop_budget(seq)

    def _release(self, blocks: list[int], seq: SeqKv | None) -> None:
        """Drop one reference to each of ``blocks`` (the caller holds the lock; the
        sequence held them, since only the pool ever writes a block table): a block no other
        sequence holds goes back to the free list."""
        freed = 0
        for b in reversed(blocks):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)
                freed += 1
        if seq is not None and seq._budget:
            # Keep the sequence's promise whole: what it gave back to the free list is held for it
            # again (a block other sequences still hold is not free, so cannot be held back).
            back = min(freed, seq._budget - len(seq._blocks) - seq._reserved)
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
            if dst._blocks or dst.rows or dst._base:
                raise StateError(f"module {self.module}: rows can only move into an empty sequence")
            dst._blocks, src._blocks = src._blocks, []
            dst._base, src._base = src._base, 0
            dst._keys, src._keys = src._keys, KeyRuns()

    def share_rows(self, src: SeqKv, src_holder: Any, holder: Any, rows: int | None = None) -> SeqKv:
        """A new sequence held by ``holder`` whose first ``rows`` rows (None: all of ``src``'s)
        are ``src``'s, in the same blocks: each block gains a holder, nothing is copied (a
        later append into a shared partial block copies it first). ``src`` must be between
        calls (no holes); a sliding-window sequence must still hold every row the new one's
        window can read (``StateError`` otherwise). A budgeted ``src`` whose own last partial
        block becomes shared gets one more block reserved for its copy of it
        (``share_budget_blocks``; ``KvCacheFull``, nothing changed, when none is free). A sliding-window sequence then gives back
        the leading blocks its shorter window no longer reads (``release_window``)."""
        with self._lock:
            self.check_holder(src, src_holder)
            rows = src.rows if rows is None else rows
            if not 0 <= rows <= src.rows:
                raise ValueError(f"rows: expected 0 .. {src.rows} (the source's rows), got {rows}")
            if HOLE in src._blocks:
                raise StateError(f"module {self.module}: the source sequence is inside a call")
            keys = src._keys.copy()
            keys.pop(src.rows - rows)
            base = src._base
            if not self.can_share(src, rows):
                raise StateError(f"module {self.module}: the source released the rows before "
                                 f"{base * self.block_size} (out of its sliding window), but {rows} shared rows "
                                 f"may still read rows from {self.window.first_visible_row(keys, 0)}")
            if rows == 0:
                keys, base = KeyRuns(), 0
            bump = self.share_budget_blocks(src, rows)
            if bump and self.num_free - self.reserved < 1:
                raise KvCacheFull(self.module, 1, self.num_free - self.reserved, self.num_blocks)
            if bump:                                 # src's copy-on-write stays within its promise
                src._budget += 1
                src._reserved += 1
                self.reserved += 1
            seq = self.new_seq(holder)
            take = ceil_div(rows, self.block_size) - base if rows else 0
            seq._blocks = _entries(src._blocks[:take])
            seq._base, seq._keys = base, keys
            for b in seq._blocks:
                self._refs[b] += 1
            self.release_window(seq, holder)
            return seq

    def can_share(self, src: SeqKv, rows: int) -> bool:
        """Whether ``share_rows(src, .., rows)`` finds every row the new sequence's window
        may read still in ``src``'s blocks (always, for full attention)."""
        if rows == 0 or self.window is None:
            return True
        keys = src._keys.copy()
        keys.pop(src.rows - rows)
        # margin 0: the new state starts between calls, with no verify pending; a later trim
        # removes only rows a later call adds (as for any state, check_seq)
        return src._base * self.block_size <= self.window.first_visible_row(keys, 0)

    def share_budget_blocks(self, src: SeqKv, rows: int) -> int:
        """1 when sharing ``src``'s first ``rows`` rows makes ``src``'s own last partial block,
        held by it alone so far, shared while ``src`` has a budget: ``src`` may then have to copy
        it on write, one block its reservation did not count, so ``share_rows`` reserves one
        more for it (its budget grows by one). Else 0 (also for a sequence already past its
        budget: it is promised nothing)."""
        BS = self.block_size
        if len(src._blocks) >= src._budget or rows == 0 or src.rows % BS == 0:
            return 0                                 # (no budget, or past it: nothing promised)
        return int(ceil_div(rows, BS) == ceil_div(src.rows, BS) and self._refs[src._blocks[-1]] == 1)

    def unreserve_share(self, src: SeqKv, src_holder: Any) -> None:
        """Undo the block ``share_rows`` reserved for ``src`` (``share_budget_blocks``): a share
        rolled back."""
        with self._lock:
            self.check_holder(src, src_holder)
            src._budget = max(0, src._budget - 1)
            if src._reserved:
                src._reserved -= 1
                self.reserved -= 1

    def fork(self, src: SeqKv, src_holder: Any, holder: Any) -> SeqKv:
        """``share_rows`` of every row: a new sequence that holds all of ``src``'s blocks."""
        return self.share_rows(src, src_holder, holder)

    def restore_blocks(self, seq: SeqKv, holder: Any, blocks: tuple[int, ...]) -> None:
        """After a failed call trimmed ``seq`` back to its rows (``Snapshot.restore``): a
        block the call copied on write (``blocks``: the table before the call) is swapped
        back for the shared original when another sequence still holds it, so the failed call
        leaves the sharing as it found it."""
        with self._lock:
            self.check_holder(seq, holder)
            for i, (now, was) in enumerate(zip(seq._blocks, blocks)):
                if now != was and now != HOLE and was != HOLE and self._refs[was] > 0:
                    self._refs[was] += 1
                    seq._blocks[i] = was
                    self._release([now], seq)
                    self.cow_copies -= 1

    def restore_reserved(self, seq: SeqKv, holder: Any, reserved: int) -> None:
        """After a failed call gave back every block it took (``restore_blocks``): ``seq``'s
        reservation is set back to ``reserved``, its value before the call. The releases on the
        way top a budgeted sequence's reservation up to ``budget - held``, which is more than it
        held where a share's reservation for a copy was spent, or a carry fitted it lower."""
        with self._lock:
            self.check_holder(seq, holder)
            self.reserved += reserved - seq._reserved
            seq._reserved = reserved

    def close(self) -> None:
        """Drop every sequence and the caches; later calls raise ``StateError``."""
        with self._lock:
            for seq, _ in self._seqs.values():
                seq._blocks, seq._base, seq._keys, seq._budget, seq._reserved = _entries(), 0, KeyRuns(), 0, 0
            self._seqs.clear()
            self._scratch.clear()
            self._free = list(range(self.num_blocks - 1, -1, -1))
            self._refs[:] = 0
            self.reserved = 0
            self.closed = True
            self.k = self.v = self.index_k = None

    def _check_open(self) -> None:
        if self.closed:
            raise StateError(f"module {self.module}'s KV pool is closed (its proposer's close() released it)")

    # -- invariants ---------------------------------------------------------
    def holders(self) -> list[Any]:
        """The holder of every registered sequence but the scratch ones (with repetition)."""
        with self._lock:
            return [h for serial, (_, h) in self._seqs.items() if serial not in self._scratch]

    def scratch_seqs(self) -> list[tuple[SeqKv, Any]]:
        """(sequence, holder) of every registered scratch sequence (``new_seq(scratch=True)``)."""
        with self._lock:
            return [self._seqs[serial] for serial in self._scratch]

    def is_registered(self, seq: SeqKv) -> bool:
        """Whether ``seq`` itself is still registered in this pool."""
        with self._lock:
            entry = self._seqs.get(seq._serial)
            return entry is not None and entry[0] is seq

    def check_invariants(self) -> None:
        """The free list, the reference counts and the registered sequences agree: every
        block is free (no reference) or held by as many registered sequences as its count
        says, each listing it once."""
        with self._lock:
            seen = np.zeros(self.num_blocks, np.int64)
            for serial, (seq, _) in self._seqs.items():
                if seq._serial != serial:
                    raise AssertionError(f"module {self.module}: sequence {serial} now calls itself {seq._serial}")
                blocks = np.asarray([b for b in seq._blocks if b != HOLE], np.int64)
                if len(set(blocks.tolist())) != blocks.size:
                    raise AssertionError(f"module {self.module}: sequence {serial} lists a block twice: "
                                         f"{blocks.tolist()}")
                np.add.at(seen, blocks, 1)
            if len(set(self._free)) != len(self._free):
                raise AssertionError(f"module {self.module}: the free list holds a block twice")
            free = np.zeros(self.num_blocks, bool)
            free[self._free] = True
            if not np.array_equal(free, self._refs == 0):
                raise AssertionError(f"module {self.module}: free list and reference counts disagree")
            if not np.array_equal(seen, self._refs):
                bad = np.flatnonzero(seen != self._refs)
                raise AssertionError(f"module {self.module}: reference counts {self._refs[bad].tolist()} of blocks "
                                     f"{bad.tolist()} differ from their holders {seen[bad].tolist()} (leaked, or "
                                     f"freed while held)")
            reservations = sum(seq._reserved for seq, _ in self._seqs.values())
            if reservations != self.reserved or self.reserved > self.num_free:
                raise AssertionError(f"module {self.module}: {self.reserved} blocks reserved in the pool, "
                                     f"{reservations} by the sequences, {self.num_free} free")

    def check_seq(self, seq: SeqKv, margin: int | None = None) -> None:
        """The rules of a sequence between calls: its table covers its rows exactly; a
        sliding-window sequence released no row a later forward may read (``margin``: the
        rows a pending call may still trim from its end first, as while a propose awaits
        its verify, 0 when none may; None: the window's ``margin``, the most any may) and
        holds at most ``WindowRule.idle_blocks`` blocks."""
        BS = self.block_size
        if HOLE in seq._blocks:
            raise AssertionError(f"module {self.module}: a hole left in the block table between calls: {seq._blocks}")
        if seq._base + len(seq._blocks) != ceil_div(seq.rows, BS):
            raise AssertionError(f"module {self.module}: {len(seq._blocks)} blocks after {seq._base} released for "
                                 f"{seq.rows} rows (block_size {BS})")
        w = self.window
        if w is None and seq._base:
            raise AssertionError(f"module {self.module}: {seq._base} blocks released without a sliding window")
        if w is not None:
            visible = w.first_visible_row(seq._keys, margin)
            if seq._base * BS > visible:
                raise AssertionError(f"module {self.module}: rows from {visible} may still be read, but blocks "
                                     f"before row {seq._base * BS} were released")
            if len(seq._blocks) > w.idle_blocks(BS):
                raise AssertionError(f"module {self.module}: a sliding-window sequence holds {len(seq._blocks)} "
                                     f"blocks, expected at most {w.idle_blocks(BS)} (window {w.window}, margin "
                                     f"{w.margin}, block_size {BS})")
        if seq._budget and len(seq._blocks) + seq._reserved > max(seq._budget, len(seq._blocks)):
            raise AssertionError(f"module {self.module}: held {len(seq._blocks)} + reserved {seq._reserved} "
                                 f"exceeds budget {seq._budget}")


def _holder_name(holder: Any) -> str:
    name = type(holder).__name__
    return {"MtpState": "a proposer state", "DrafterKv": "a carried entry (DrafterKv)",
            "MtpHead": "an MtpHead user (alloc_seq)"}.get(name, name)
