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
        if st.num_verified == 0 and not any(s.rows for s in st.kv):
            return None
        kv = DrafterKv(self.owner, [], st.num_verified, st.num_hiddens, list(st.tail), st.tail_start,
                       list(st.win), list(st.win_start), st.next_position)
        for h, s in zip(self.modules, st.kv):
            kv.seqs.append(h.pool.new_seq(kv))
        for h, s, dst in zip(self.modules, st.kv, kv.seqs):
            h.pool.move_rows(s, dst)
            h.pool.drop_budget(s)          # taking ends the sequence its budget was for
        st.reset(len(self.modules))
        with self._lock:
            self._live[id(kv)] = kv
        return kv

    def install(self, st: MtpState, carried: Any) -> None:
        """The entry's rows and window into the fresh ``st``; the entry is consumed. A
        budgeted ``st`` counts the carried blocks within its budget."""
        if st.num_verified or any(s.rows for s in st.kv):
            raise StateError("state: install_drafter_kv needs a fresh state (from alloc_state or "
                             "left by take_drafter_kv)")
        kv = self._claim(carried)                          # from here on, no other call can use it
        for h, src, dst in zip(self.modules, kv.seqs, st.kv):
            h.pool.move_rows(src, dst)
            h.pool.fit_budget(dst)
            h.pool.retire(src, kv)
        st.num_verified, st.num_hiddens = kv.num_verified, kv.num_hiddens
        st.tail, st.tail_start = list(kv.tail), kv.tail_start
        st.win, st.win_start = list(kv.win), list(kv.win_start)
        st.next_position = kv.next_position

    def free(self, carried: Any) -> None:
        """Return the entry's blocks to the pools; the entry is consumed."""
        kv = self._claim(carried)
        for h, s in zip(self.modules, kv.seqs):
            h.pool.retire(s, kv)

    def _claim(self, carried: Any) -> DrafterKv:
        """Check ``carried`` against the registry and take it out, as one step."""
        if not isinstance(carried, DrafterKv):
            raise TypeError(f"carried: expected a DrafterKv from take_drafter_kv, got {type(carried).__name__}")
        if carried.owner is not self.owner:
            raise StateError("carried: belongs to another proposer")
        with self._lock:
            if self._live.get(id(carried)) is not carried:
                if carried.consumed:
                    raise StateError("carried: already installed or freed")
                raise StateError("carried: not an entry take_drafter_kv handed out (a copy, or built by hand); "
                                 "only the original is honoured")
            for h, s in zip(self.modules, carried.seqs):   # the pools agree (they always should)
                h.pool.check_holder(s, carried, name="carried")
            del self._live[id(carried)]
            carried.consumed = True
        return carried
