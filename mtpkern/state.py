"""Per-sequence state of ``MultiModuleMtpHead``, carried entries, acceptance counters.

Vocabulary (docs/semantics.md). The target at position ``j`` yields ``h_j``.
Module ``m``'s KV row with **key** ``j`` is built from ``(t_{j+m+1}, g^m_j)``
at RoPE position ``j+m+1``; ``g^0_j = h_j`` and ``g^m_j`` is module ``m-1``'s
chained output at key ``j``. Per-sequence counters (``MtpState``):

- ``num_tokens`` ``T``: tokens known to the drafter, verified ones then the
  drafts of a propose not yet verified;
- ``num_verified``: of those, how many are verified;
- ``num_hiddens`` ``Hn``: target hiddens consumed, ``h_0 .. h_{Hn-1}``.

A state is used by one call at a time (``exclusive``): a second call on it,
from another thread or from a callback of the first, gets ``StateError``.
"""

from __future__ import annotations

import copy
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

from .errors import StateError
from .kv import KeyRuns, SeqKv
from .trait import ProposerState


class MtpState(ProposerState):
    """Per-sequence state of a ``MultiModuleMtpHead``. Its public attributes are read-only
    views (``num_verified``: verified tokens ``t_0 .. t_{n-1}``; ``next_position``: the
    lowest position the next propose may take, in exact mode the only one; ``drafted``:
    a propose awaits ``after_verify``; ``rows_per_module()``: KV rows of each module);
    only the proposer changes a state, inside one of its calls."""

    __slots__ = ("owner", "_kv", "_freed", "_num_verified", "_num_hiddens", "_tail", "_tail_start", "_win",
                 "_win_start", "_drafted", "_next_position", "_last_position", "_last_k", "_last_drafts",
                 "_busy", "_busy_call", "_tree")

    def __init__(self, owner: Any, num_modules: int):
        self.owner = owner
        self._kv: tuple[SeqKv, ...] = ()
        self._freed = False
        self._busy = threading.Lock()
        self._busy_call = ""
        self.reset(num_modules)

    # -- read-only views ----------------------------------------------------------
    kv = property(lambda self: self._kv, doc="Per module, this sequence's SeqKv (a tuple).")
    freed = property(lambda self: self._freed)
    num_verified = property(lambda self: self._num_verified)
    num_hiddens = property(lambda self: self._num_hiddens, doc="Target hiddens consumed, h_0 .. h_{Hn-1}.")
    next_position = property(lambda self: self._next_position)
    drafted = property(lambda self: self._drafted)
    last_drafts = property(lambda self: list(self._last_drafts), doc="The last propose's drafts (a copy).")
    tail = property(lambda self: tuple(self._tail), doc="Tokens num_tokens - len(tail) .. (exact mode).")

    @property
    def num_tokens(self) -> int:
        return self._tail_start + len(self._tail)

    def rows_per_module(self) -> list[int]:
        return [s.rows for s in self._kv]

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the state breaks a rule of its proposer's KV mode."""
        self.owner.check_state(self)

    def reset(self, num_modules: int) -> None:
        """The counters of a state that holds nothing (its KV is emptied by the caller)."""
        self._num_verified = self._num_hiddens = self._tail_start = 0
        self._tail: list[int] = []
        self._win: list[Any] = [None] * num_modules       # per module: chained outputs [w, H] (exact mode)
        self._win_start = [0] * num_modules
        self._next_position = 1
        self._drafted = False
        self._last_position, self._last_k, self._last_drafts = -1, 0, []
        self._tree: Any = None          # a propose_tree awaiting after_verify_tree (mtpkern.tree.PendingTree)

    def __copy__(self) -> "MtpState":
        return _copy_handle(self, {}, deep=False)

    def __deepcopy__(self, memo: dict) -> "MtpState":
        return _copy_handle(self, memo, deep=True)

    def __reduce__(self):
        raise TypeError("MtpState cannot be pickled: it is a handle into a live proposer")

    def __repr__(self) -> str:                           # not the window's hidden arrays
        status = "freed" if self._freed else "awaiting after_verify" if self._drafted else "ready"
        return (f"MtpState(rows per module={self.rows_per_module()}, verified tokens={self._num_verified}, "
                f"hiddens={self._num_hiddens}, next position={self._next_position}, {status})")


def _copy_handle(obj: Any, memo: dict, deep: bool) -> Any:
    """A copy of a state or carried entry that still names the same proposer (which
    is not copied): the proposer then refuses it, as it refuses any copy. A copy is
    never in use, and its sequences are copies too (no pool knows them)."""
    memo[id(obj.owner)] = obj.owner
    new = object.__new__(type(obj))
    for name in type(obj).__slots__:
        if name in ("_busy", "__weakref__"):
            continue
        value = getattr(obj, name)
        if name == "_busy_call":
            value = ""
        elif deep:
            value = copy.deepcopy(value, memo)
        elif isinstance(value, list):
            value = list(value)
        object.__setattr__(new, name, value)
    if "_busy" in type(obj).__slots__:
        object.__setattr__(new, "_busy", threading.Lock())
    for name in ("_kv", "_seqs"):
        if name in type(obj).__slots__:
            object.__setattr__(new, name, tuple(copy.copy(q) for q in getattr(obj, name)))
    return new


@contextmanager
def exclusive(states: list[MtpState], call: str, names: list[str]) -> Iterator[None]:
    """Hold ``states`` for the duration of ``call``: one call per state at a time.

    Never waits: a state already held (by another thread, or by the call whose
    callback is running now) raises ``StateError`` and nothing is held."""
    taken: list[MtpState] = []
    try:
        for st, name in zip(states, names):
            if not st._busy.acquire(blocking=False):
                raise StateError(f"{name}: in use by {st._busy_call or 'another call'}; a state takes one call "
                                 f"at a time (a second thread, or a callback re-entering the proposer with it)")
            st._busy_call = f"{call} (thread {threading.current_thread().name!r})"
            taken.append(st)
        yield
    finally:
        for st in taken:
            st._busy_call = ""
            st._busy.release()


def is_busy(st: MtpState) -> bool:
    return st._busy.locked()


class DrafterKv:
    """A sequence's drafter KV taken out of its state (``take_drafter_kv``), to be
    installed into a fresh state next turn or released with ``free_drafter_kv``.

    Read-only: ``seqs[m]`` is module ``m``'s sequence (registered in its pool as held
    by this entry), ``blocks`` / ``keys`` copies of their tables; ``rows`` /
    ``last_pair_key`` are module 0's (the trait's triple); ``num_verified`` and
    ``next_position`` the sequence's counters. Only the entry the proposer handed out
    is honoured: a copy is refused.
    """

    __slots__ = ("owner", "_seqs", "_num_verified", "_num_hiddens", "_tail", "_tail_start", "_win",
                 "_win_start", "_next_position", "_consumed")

    def __init__(self, owner: Any, st: MtpState):
        self.owner = owner
        self._seqs: tuple[SeqKv, ...] = ()
        self._num_verified, self._num_hiddens = st._num_verified, st._num_hiddens
        self._tail, self._tail_start = list(st._tail), st._tail_start
        self._win, self._win_start = list(st._win), list(st._win_start)
        self._next_position = st._next_position
        self._consumed = False

    seqs = property(lambda self: self._seqs)
    num_verified = property(lambda self: self._num_verified)
    next_position = property(lambda self: self._next_position)
    consumed = property(lambda self: self._consumed)

    @property
    def blocks(self) -> list[list[int]]:
        return [list(s.blocks) for s in self._seqs]

    @property
    def keys(self) -> list[KeyRuns]:
        return [s.keys for s in self._seqs]

    @property
    def rows(self) -> int:
        return self._seqs[0].rows

    @property
    def last_pair_key(self) -> int | None:
        return self._seqs[0].last_key

    def restore_into(self, st: MtpState) -> None:
        """The sequence's counters and exact-mode window into ``st`` (install)."""
        st._num_verified, st._num_hiddens = self._num_verified, self._num_hiddens
        st._tail, st._tail_start = list(self._tail), self._tail_start
        st._win, st._win_start = list(self._win), list(self._win_start)
        st._next_position = self._next_position

    def __copy__(self) -> "DrafterKv":
        return _copy_handle(self, {}, deep=False)

    def __deepcopy__(self, memo: dict) -> "DrafterKv":
        return _copy_handle(self, memo, deep=True)

    def __reduce__(self):
        raise TypeError("DrafterKv cannot be pickled: it is a handle into a live proposer")

    def __repr__(self) -> str:                           # not the window's hidden arrays
        state = "consumed" if self._consumed else "live"
        return (f"DrafterKv(rows per module={[s.rows for s in self._seqs]}, "
                f"blocks per module={[len(s.blocks) for s in self._seqs]}, verified tokens={self._num_verified}, "
                f"last_pair_key={self.last_pair_key}, {state})")


@dataclass(slots=True)
class AcceptanceStats:
    """Per-draft-position counters since the last ``reset`` (thread-safe; position ``m`` is
    draft ``d_m``, made by module ``m``, or by draft step ``m`` under a module schedule).

    - ``drafted[m]``: verifies that were offered draft ``m``;
    - ``reached[m]``: of those, the ones that accepted every draft before it, so that the
      verify's verdict on draft ``m`` was its own (``reached[0] == drafted[0]``);
    - ``accepted[m]``: of those, the ones that accepted draft ``m``.

    ``accepted[m] / drafted[m]`` (``acceptance_rate``) is the rate at which draft ``m`` is
    kept; ``accepted[m] / reached[m]`` is its conditional acceptance, ``P(d_m accepted |
    d_0 .. d_{m-1} accepted)``, which is what choosing the number of drafts needs
    (mtpkern.k_policy): with a varying number of drafts per verify it cannot be told from
    ``drafted`` and ``accepted`` alone. An engine may keep one per sequence
    (``AcceptanceStats.zeros(M)``, then ``record(k, a)`` after each verify)."""

    drafted: list[int]
    accepted: list[int]
    verifies: int = 0
    accepted_total: int = 0
    reached: list[int] = field(default_factory=list)
    _lock: Any = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if not self.reached:
            self.reached = [0] * len(self.drafted)
        if not len(self.drafted) == len(self.accepted) == len(self.reached):
            raise ValueError(f"accepted, reached: expected {len(self.drafted)} positions each (as drafted), got "
                             f"{len(self.accepted)} and {len(self.reached)}")

    @classmethod
    def zeros(cls, positions: int) -> "AcceptanceStats":
        """Counters for ``positions`` draft positions, all 0."""
        from .checks import check_int

        n = check_int("positions", positions, 1, 64)
        return cls([0] * n, [0] * n)

    def snapshot(self) -> tuple[list[int], list[int], list[int]]:
        """``(drafted, reached, accepted)`` copies, read as one (no verify counted half-way)."""
        with self._lock:
            return list(self.drafted), list(self.reached), list(self.accepted)

    @property
    def mean_accepted_length(self) -> float:
        """Mean accepted drafts per verify (0.0 before any verify)."""
        return self.accepted_total / self.verifies if self.verifies else 0.0

    def acceptance_rate(self, module: int) -> float:
        """Accepted / drafted for drafts made by ``module``."""
        from .checks import check_int

        module = check_int("module", module, 0, len(self.drafted) - 1)
        d = self.drafted[module]
        return self.accepted[module] / d if d else 0.0

    def record(self, k: int, a: int) -> None:
        """One verify of ``k`` drafts that accepted ``a`` (checked: ``0 <= a <= k <= positions``)."""
        from .checks import check_int

        k = check_int("k", k, 0, len(self.drafted))
        a = check_int("a", a, 0, k)
        with self._lock:
            for m in range(k):
                self.drafted[m] += 1
                self.reached[m] += m <= a
                self.accepted[m] += m < a
            self.verifies += 1
            self.accepted_total += a

    def reset(self) -> None:
        with self._lock:
            self.drafted = [0] * len(self.drafted)
            self.accepted = [0] * len(self.accepted)
            self.reached = [0] * len(self.reached)
            self.verifies = self.accepted_total = 0


_FIELDS = ("_num_verified", "_num_hiddens", "_tail_start", "_drafted", "_next_position", "_last_position", "_last_k")


@dataclass(slots=True)
class Snapshot:
    """What a call may change in a state, to put back if the call fails."""

    rows: list[int]
    blocks: list[tuple[int, ...]]
    scalars: tuple
    tail: list[int]
    win: list[Any]
    win_start: list[int]
    last_drafts: list[int]
    reserved: list[int]

    @classmethod
    def of(cls, st: MtpState) -> "Snapshot":
        return cls([s.rows for s in st._kv], [s.blocks for s in st._kv], tuple(getattr(st, f) for f in _FIELDS), list(st._tail),
                   list(st._win), list(st._win_start), list(st._last_drafts), [s.reserved for s in st._kv])

    def restore(self, st: MtpState, pools: list[Any]) -> None:
        """Rows written since are dropped, blocks taken since go back, and a shared block
        the call copied on write is shared again (``BlockPool.restore_blocks``), and each
        sequence's reservation is what it was (``BlockPool.restore_reserved``)."""
        for pool, seq, rows, blocks, reserved in zip(pools, st._kv, self.rows, self.blocks, self.reserved):
            pool.trim(seq, seq.rows - rows, st)
            pool.restore_blocks(seq, st, blocks)
            pool.restore_reserved(seq, st, reserved)
        for f, v in zip(_FIELDS, self.scalars):
            setattr(st, f, v)
        st._tail, st._win, st._win_start, st._last_drafts = self.tail, self.win, self.win_start, self.last_drafts
