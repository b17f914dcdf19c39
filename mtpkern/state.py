"""Per-sequence state of ``MultiModuleMtpHead``, carried entries, acceptance counters.

Vocabulary (SPEC section 2). The target at position ``j`` yields ``h_j``.
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
from dataclasses import dataclass, field, fields
from typing import Any, Iterator

from .errors import StateError
from .kv import KeyRuns, SeqKv
from .trait import ProposerState


@dataclass(slots=True, eq=False)
class MtpState(ProposerState):
    """Per-sequence state of a ``MultiModuleMtpHead``: read its fields, change it only
    through the proposer. ``num_verified``: verified tokens ``t_0 .. t_{n-1}``;
    ``next_position``: the lowest position the next propose may take (exact mode:
    the only one); ``rows_per_module()``: KV rows of each module."""

    owner: Any
    kv: list[SeqKv]
    freed: bool = False
    num_verified: int = 0
    num_hiddens: int = 0
    tail: list[int] = field(default_factory=list)   # tokens tail_start .. num_tokens - 1
    tail_start: int = 0
    win: list[Any] = field(default_factory=list)    # per module: chained outputs [w, H] (exact mode)
    win_start: list[int] = field(default_factory=list)
    drafted: bool = False                           # a propose awaits after_verify
    next_position: int = 1                          # the lowest position the next propose may take
    last_position: int = -1
    last_k: int = 0
    last_drafts: list[int] = field(default_factory=list)
    _busy: Any = field(default_factory=threading.Lock, repr=False)
    _busy_call: str = ""

    @property
    def num_tokens(self) -> int:
        return self.tail_start + len(self.tail)

    def rows_per_module(self) -> list[int]:
        return [s.rows for s in self.kv]

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the state breaks a rule of its proposer's KV mode."""
        self.owner.check_state(self)

    def reset(self, num_modules: int) -> None:
        """The counters of a state that holds nothing (its KV is emptied by the caller)."""
        self.num_verified = self.num_hiddens = self.tail_start = 0
        self.tail = []
        self.win = [None] * num_modules
        self.win_start = [0] * num_modules
        self.next_position = 1
        self.drafted = False
        self.last_position, self.last_k, self.last_drafts = -1, 0, []

    def __deepcopy__(self, memo: dict) -> "MtpState":
        return _deepcopy_handle(self, memo)

    def __repr__(self) -> str:                           # not the window's hidden arrays
        status = "freed" if self.freed else "awaiting after_verify" if self.drafted else "ready"
        return (f"MtpState(rows per module={self.rows_per_module()}, verified tokens={self.num_verified}, "
                f"hiddens={self.num_hiddens}, next position={self.next_position}, {status})")


def _deepcopy_handle(obj: Any, memo: dict) -> Any:
    """A deep copy of a state or carried entry that still names the same proposer (which
    is not copied): the proposer then refuses it like any copy. A copy is never in use."""
    memo[id(obj.owner)] = obj.owner
    new = object.__new__(type(obj))
    for f in fields(obj):
        if f.name == "_busy":
            value = threading.Lock()
        else:
            value = "" if f.name == "_busy_call" else copy.deepcopy(getattr(obj, f.name), memo)
        object.__setattr__(new, f.name, value)
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


@dataclass(slots=True, eq=False)
class DrafterKv:
    """A sequence's drafter KV taken out of its state (``take_drafter_kv``), to be
    installed into a fresh state next turn or released with ``free_drafter_kv``.

    ``seqs[m]`` is module ``m``'s sequence, registered in its pool as held by this
    entry; ``blocks`` / ``keys`` are read-only copies. ``rows`` / ``last_pair_key``
    are module 0's (the trait's triple); the rest is the exact-mode window. Only the
    entry the proposer handed out is honoured: a copy is refused.
    """

    owner: Any
    seqs: list[SeqKv]
    num_verified: int
    num_hiddens: int
    tail: list[int]
    tail_start: int
    win: list[Any]
    win_start: list[int]
    next_position: int
    consumed: bool = False

    @property
    def blocks(self) -> list[list[int]]:
        return [list(s.blocks) for s in self.seqs]

    @property
    def keys(self) -> list[KeyRuns]:
        return [s.keys.copy() for s in self.seqs]

    @property
    def rows(self) -> int:
        return self.seqs[0].rows

    @property
    def last_pair_key(self) -> int | None:
        return self.seqs[0].keys.last

    def __deepcopy__(self, memo: dict) -> "DrafterKv":
        return _deepcopy_handle(self, memo)

    def __repr__(self) -> str:                           # not the window's hidden arrays
        state = "consumed" if self.consumed else "live"
        return (f"DrafterKv(rows per module={[s.rows for s in self.seqs]}, "
                f"blocks per module={[len(s.blocks) for s in self.seqs]}, verified tokens={self.num_verified}, "
                f"last_pair_key={self.last_pair_key}, {state})")


@dataclass(slots=True)
class AcceptanceStats:
    """Per-module drafted / accepted counters since the last ``reset`` (thread-safe)."""

    drafted: list[int]
    accepted: list[int]
    verifies: int = 0
    accepted_total: int = 0
    _lock: Any = field(default_factory=threading.Lock, repr=False)

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
        """One verify of ``k`` drafts that accepted ``a``."""
        with self._lock:
            for m in range(k):
                self.drafted[m] += 1
                self.accepted[m] += m < a
            self.verifies += 1
            self.accepted_total += a

    def reset(self) -> None:
        with self._lock:
            self.drafted = [0] * len(self.drafted)
            self.accepted = [0] * len(self.accepted)
            self.verifies = self.accepted_total = 0


_FIELDS = ("num_verified", "num_hiddens", "tail_start", "drafted", "next_position", "last_position", "last_k")


@dataclass(slots=True)
class Snapshot:
    """What a call may change in a state, to put back if the call fails."""

    rows: list[int]
    scalars: tuple
    tail: list[int]
    win: list[Any]
    win_start: list[int]
    last_drafts: list[int]

    @classmethod
    def of(cls, st: MtpState) -> "Snapshot":
        return cls([s.rows for s in st.kv], tuple(getattr(st, f) for f in _FIELDS), list(st.tail),
                   list(st.win), list(st.win_start), list(st.last_drafts))

    def restore(self, st: MtpState, pools: list[Any]) -> None:
        """Rows written since are dropped, blocks taken since go back."""
        for pool, seq, rows in zip(pools, st.kv, self.rows):
            pool.trim(seq, seq.rows - rows)
        for f, v in zip(_FIELDS, self.scalars):
            setattr(st, f, v)
        st.tail, st.win, st.win_start, st.last_drafts = self.tail, self.win, self.win_start, self.last_drafts
