"""Carrying a sequence's drafter KV to the next turn: the registry of carried entries.

``take`` moves a state's rows (every module's blocks and keys) and its exact-mode
window into a new ``DrafterKv``; ``install`` moves them into a fresh state;
``free`` returns them to the pools. The registry is the only authority: an
entry is honoured only if it is the very object ``take`` returned and is still
registered, checked before any block moves, so a copy, a hand-built entry or
one already installed or freed gets ``StateError`` and nothing changes.
Registration, lookup and removal hold the registry's lock: two threads
installing one entry cannot both succeed.
"""

from __future__ import annotations

import threading
from typing import Any

from .errors import StateError
from .head import MtpHead
from .state import DrafterKv, MtpState


class CarryRegistry:
    """The live ``DrafterKv`` entries of one proposer."""

    def __init__(self, owner: Any, modules: list[MtpHead]):
        self.owner = owner
        self.modules = modules
        self._live: dict[int, DrafterKv] = {}
        self._lock = threading.Lock()

    def live(self) -> list[DrafterKv]:
        with self._lock:
            return list(self._live.values())

    def take(self, st: MtpState) -> DrafterKv | None:
        """``st``'s rows and window into a new entry; ``st`` is left as ``alloc_state()``
        leaves one (no rows, no budget). None when ``st`` holds nothing."""
        if st._num_verified == 0 and not any(s.rows for s in st._kv):
            return None
        kv = DrafterKv(self.owner, st)
        kv._seqs = tuple(h.pool.new_seq(kv) for h in self.modules)
        for h, s, dst in zip(self.modules, st._kv, kv._seqs):
            h.pool.move_rows(s, st, dst, kv)
            h.pool.drop_budget(s, st)       # taking ends the sequence its budget was for
        st.reset(len(self.modules))
        with self._lock:
            self._live[id(kv)] = kv
        return kv

    def install(self, st: MtpState, carried: Any) -> None:
        """The entry's rows and window into the fresh ``st``; the entry is consumed. A
        budgeted ``st`` counts the carried blocks within its budget."""
        if st._num_verified or any(s.rows for s in st._kv):
            raise StateError("state: install_drafter_kv needs a fresh state (from alloc_state or "
                             "left by take_drafter_kv)")
        kv = self._claim(carried)                          # from here on, no other call can use it
        for h, src, dst in zip(self.modules, kv._seqs, st._kv):
            h.pool.move_rows(src, kv, dst, st)
            h.pool.fit_budget(dst, st)
            h.pool.retire(src, kv)
        kv.restore_into(st)

    def free(self, carried: Any) -> None:
        """Return the entry's blocks to the pools; the entry is consumed."""
        kv = self._claim(carried)
        for h, s in zip(self.modules, kv._seqs):
            h.pool.retire(s, kv)

    def claim_all(self) -> list[DrafterKv]:
        """Every live entry, taken out of the registry as one step (close)."""
        with self._lock:
            out = list(self._live.values())
            self._live.clear()
            for kv in out:
                kv._consumed = True
        return out

    def _claim(self, carried: Any) -> DrafterKv:
        """Check ``carried`` against the registry and take it out, as one step."""
        if not isinstance(carried, DrafterKv):
            raise TypeError(f"carried: expected a DrafterKv from take_drafter_kv, got {type(carried).__name__}")
        if carried.owner is not self.owner:
            raise StateError("carried: belongs to another proposer")
        with self._lock:
            if self._live.get(id(carried)) is not carried:
                if carried._consumed:
                    raise StateError("carried: already installed or freed")
                raise StateError("carried: not an entry take_drafter_kv handed out (a copy, or built by hand); "
                                 "only the original is honoured")
            for h, s in zip(self.modules, carried._seqs):   # the pools agree (they always should)
                h.pool.check_holder(s, carried, name="carried")
            del self._live[id(carried)]
            carried._consumed = True
        return carried
