"""Draft mode (docs/semantics.md, ``kv_mode="draft"``): one row per drafting module per propose.

A propose at ``P`` with ``k'`` drafts writes module ``m < k'``'s row at key
``P - 1`` (RoPE position ``P + m``), built from ``(t_P, h_{P-1})`` for module 0
and ``(d_{m-1}, module m-1's output)`` after it. ``after_verify(a)`` keeps
module ``m``'s row iff ``m <= a`` (every token it was built from is verified).
``prefill_drafter`` fills module 0 only; ``catchup_drafter`` writes module 0's
rows of the verified tokens it is given (key ``Hn + i`` for pair ``i``, ``Hn`` the
hiddens consumed: the keys no prefill or propose wrote), so module 0 holds every
verified key of a sequence whose every token reached it (accepted drafts, steps
decoded without drafting, a chunked prompt, a new turn after a carry); modules
``m >= 1`` get rows from proposes only.
Positions may skip forward (rows leave gaps in key space) but never go back.
Sliding-window modules: ``after_verify`` drops at most one row of a module
``m >= 1`` and none of module 0 (``trim_margin``); between the chunks of a prefill,
module 0's blocks its window left behind are reused (``BlockPool.recycle``).
The same methods as ``mtpkern.exact.ExactChain``, so the proposer runs either.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .exact import DraftFn
from .head import MtpHead, RowJob
from .state import MtpState


class DraftChain:
    """Runs the modules of a ``MultiModuleMtpHead`` in draft mode."""

    def __init__(self, modules: list[MtpHead], chain: str, prefill_chunk: int):
        self.modules = modules
        self.chain = chain
        self.prefill_chunk = prefill_chunk
        self.M = len(modules)

    @staticmethod
    def trim_margin(m: int) -> int:
        """Rows of module ``m`` a later call may trim: its row of the last propose, for ``m >= 1``."""
        return min(m, 1)

    def pending_trim(self, st: MtpState, m: int) -> int:
        """Rows of module ``m`` the verify of ``st``'s last propose may trim: ``trim_margin``
        for the modules it ran (m < k', ``after_verify``); none of the others."""
        return self.trim_margin(m) if m < st._last_k else 0

    def prefill_rows(self, n: int) -> list[list[int]]:
        return [[n - 1]] + [[0]] * (self.M - 1)

    def prefill(self, st: MtpState, toks: np.ndarray, hid: Any) -> int:
        """Module 0's keys ``0 .. n-2`` over the prompt, in chunks."""
        n = toks.shape[0]
        for a in range(0, n - 1, self.prefill_chunk):
            b = min(n - 1, a + self.prefill_chunk)
            self.modules[0]._forward([RowJob(st._kv[0], toks[a + 1:b + 1], a, 1, st)], hid[a:b])
            self.modules[0].pool.recycle(st._kv[0], st, 0)    # a fresh state: every row is this call's
        st._num_verified = st._tail_start = st._next_position = n
        st._num_hiddens = n - 1
        return n - 1

    def catchup_rows(self, m: int, n: int) -> int:
        """Rows module ``m`` gains from a catch-up of ``n`` verified tokens: module 0's, one each."""
        return n if m == 0 else 0

    def catch_up(self, sts: list[MtpState], toks: list[np.ndarray], hids: list[Any]) -> int:
        """Module 0's rows for the pairs ``(toks[i][j], hids[i][j])`` of every state: keys
        ``Hn .. Hn + n - 1`` (``Hn`` = hiddens consumed; every key below it is written or
        skipped already), RoPE positions one above, in chunks of ``prefill_chunk`` rows per
        state, one forward over every state per chunk. ``hids[i]`` [n_i, H], target-normed.
        No chain: modules ``m >= 1`` keep the rows of proposes only."""
        head = self.modules[0]
        start = [st._kv[0].rows for st in sts]            # rows before this call: a rollback keeps them
        ns = [t.shape[0] for t in toks]
        C = self.prefill_chunk
        for a in range(0, max(ns, default=0), C):
            jobs, gs = [], []
            for st, tk, h, n in zip(sts, toks, hids, ns):
                if a < n:
                    b = min(n, a + C)
                    jobs.append(RowJob(st._kv[0], tk[a:b], st._num_hiddens + a, 1, st))
                    gs.append(h[a:b])
            head._forward(jobs, gs[0] if len(gs) == 1 else head.backend.xp.concatenate(gs, axis=0))
            for st, r0 in zip(sts, start):                # a window's blocks left behind: next chunk's
                head.pool.recycle(st._kv[0], st, r0)
        for st, n in zip(sts, ns):
            st._num_hiddens += n
            st._num_verified = st._tail_start = max(st._num_verified, st._num_hiddens + 1)
            st._next_position = max(st._next_position, st._num_verified)
        return sum(ns)

    def check_position(self, st: MtpState, p: int, name: str) -> None:
        if p < st._next_position:
            raise ValueError(f"{name}: expected >= {st._next_position} (positions never go back), got {p}")

    @staticmethod
    def propose_rows(st: MtpState, m: int, p: int, k: int) -> int:
        return 1 if m < k else 0

    @staticmethod
    def highest_position(p: int, k: int, M: int) -> int:
        return p + k - 1

    def propose(self, sts: list[MtpState], toks: list[int], poss: list[int], hid: Any, k: int,
                draft_ids: DraftFn) -> list[list[int]]:
        B = len(sts)
        drafts: list[list[int]] = [[] for _ in range(B)]
        cur_tok = np.asarray(toks, np.int32)
        g = hid
        active = list(range(B))                  # the sequences still drafting (row j: active[j])
        for m in range(k):
            jobs = [RowJob(sts[i]._kv[m], cur_tok[j:j + 1], poss[i] - 1, m + 1, sts[i]) for j, i in enumerate(active)]
            y, normed = self.modules[m]._forward(jobs, g, pad_tables=True)
            ids, stops = draft_ids(m, normed, drafts, active)
            for j, i in enumerate(active):
                drafts[i].append(int(ids[j]))
            cur_tok = ids.astype(np.int32)
            g = normed if self.chain == "postnorm" else y
            if stops is not None and stops.any():            # early stop: the rest go on alone
                keep = np.flatnonzero(~stops)
                if keep.size == 0:
                    break
                active = [active[j] for j in keep]
                cur_tok = cur_tok[keep]
                g = g[self.modules[m].backend.from_host(keep.astype(np.int64))]
        for st, p in zip(sts, poss):
            st._num_hiddens = p
            st._num_verified = st._tail_start = p + 1
        return drafts

    def after_verify(self, st: MtpState, P: int, a: int, k: int) -> None:
        for m in range(a + 1, k):
            self.modules[m].pool.trim(st._kv[m], 1, st)
        st._num_verified = P + 1 + a

    def check(self, st: MtpState) -> None:
        """Draft mode keeps no window or tail; the keys' order is checked by the caller.
        Module 0's keys lie below ``Hn`` (the next catch-up writes key ``Hn``)."""
        last = st._kv[0].last_key
        if last is not None and last >= st._num_hiddens:
            raise AssertionError(f"draft mode, module 0: last key {last}, expected below num_hiddens "
                                 f"{st._num_hiddens} (the next catch-up's key)")
