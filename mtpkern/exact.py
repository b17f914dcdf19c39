"""The exact-mode row rule and the forwards that keep it (docs/semantics.md, ``kv_mode="exact"``).

After every call module ``m`` of a state holds exactly keys ``0 .. rows_m - 1``
with ``rows_m = max(0, min(Hn, T - m - 1))``: every key whose token and hidden
are known. A call raises ``Hn`` (hiddens consumed) and/or ``T`` (tokens known)
and each module computes its missing keys in order ``m = 0, 1, ..``, module
``m`` taking ``g`` from module ``m-1``'s chained outputs. The state keeps those
for the trailing ``M + 1`` keys of every module (``win``: a window bounded by
``M``, not by the sequence) and the tokens past ``Hn`` (``tail``: at most
``M``). ``after_verify`` lowers ``T`` and trims each module to ``rows_m``.

Sliding-window modules: ``after_verify`` drops at most ``m`` keys of module ``m``
(``trim_margin``), so the pool keeps the rows a window may read after such a trim;
between the chunks of a catch-up, the blocks of rows the call wrote and its window
left behind are reused for its next rows (``BlockPool.recycle``).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .errors import StateError
from .head import MtpHead, RowJob
from .state import MtpState

#: drafts of module m for rows [n, H], row j = sequence active[j], given the drafts so far:
#: ``(m, rows, drafts, active) -> (ids [n], stops [n] bool or None)``; a sequence whose
#: ``stops`` entry is True drafts no further in this propose (early stop)
DraftFn = Callable[[int, Any, list[list[int]], list[int]], tuple[np.ndarray, np.ndarray | None]]


def exact_rows(st: MtpState, m: int) -> int:
    """The rows module ``m`` of ``st`` holds in exact mode."""
    return max(0, min(st._num_hiddens, st.num_tokens - m - 1))


class ExactChain:
    """Runs the modules of a ``MultiModuleMtpHead`` so that the exact-mode rule holds."""

    def __init__(self, modules: list[MtpHead], backend: Any, chain: str, prefill_chunk: int):
        self.modules = modules
        self.backend = backend
        self.xp = backend.xp
        self.chain = chain
        self.prefill_chunk = prefill_chunk
        self.M = len(modules)
        self.window = self.M + 1       # chained outputs kept per module (trailing keys)

    @staticmethod
    def trim_margin(m: int) -> int:
        """Rows of module ``m`` a later call may trim: ``after_verify(a)`` after a propose
        of ``k`` drafts drops ``min(m, k) - a`` keys at most when ``a < m``, so ``m``."""
        return m

    def pending_trim(self, st: MtpState, m: int) -> int:
        """Rows of module ``m`` the verify of ``st``'s last propose may trim: ``trim_margin``
        (every module runs in a propose)."""
        return self.trim_margin(m)

    # -- rows a call will add (for the room check), and position rules --------------
    def prefill_rows(self, n: int) -> list[list[int]]:
        return [[max(0, n - 1 - m)] for m in range(self.M)]

    @staticmethod
    def check_position(st: MtpState, p: int, name: str) -> None:
        if st._num_verified == 0:
            raise StateError("state: exact kv_mode needs prefill_drafter before the first propose")
        if p != st._num_verified:
            raise ValueError(f"{name}: expected {st._num_verified} (the next position of this sequence), got {p}")
        if st._num_hiddens != p - 1:
            raise StateError(f"state: {p - 1 - st._num_hiddens} accepted token(s) still need their target hiddens; "
                             f"call catchup_drafter(accepted_tokens, accepted_hiddens, state) first")

    @staticmethod
    def catchup_rows(st: MtpState, m: int, hiddens: int, new_tokens: int) -> int:
        hn, T = st._num_hiddens + hiddens, st.num_tokens + new_tokens
        return max(0, max(0, min(hn, T - m - 1)) - st._kv[m].rows)

    def propose_rows(self, st: MtpState, m: int, p: int, k: int) -> int:
        """A propose at ``p`` with ``k`` drafts: modules ``m < k`` reach key ``p - 1``;
        the others follow the drafts as far as they reach (key ``p + k - m - 1``)."""
        target = p if m < k else max(0, min(p, p + k - m))
        return max(0, target - st._kv[m].rows)

    @staticmethod
    def highest_position(p: int, k: int, M: int) -> int:
        """The highest RoPE position a propose at ``p`` with ``k`` drafts writes:
        module ``m``'s last row, key ``min(p, p + k - m) - 1``, sits at that + m + 1."""
        return max(min(p, p + k - m) + m for m in range(M))

    # -- the forwards ---------------------------------------------------------------
    def prefill(self, st: MtpState, toks: np.ndarray, hid: Any) -> int:
        """Every module's keys over the prompt (module ``m``: ``0 .. n-2-m``)."""
        st._tail, st._tail_start = toks.tolist(), 0
        st._num_verified = st._next_position = toks.shape[0]
        return self.catch_up([st], [hid])

    def catch_up(self, sts: list[MtpState], hids: list[Any]) -> int:
        """Consume hiddens ``hids[i]`` (keys from ``num_hiddens``) and bring every module of
        every state to its exact rows, in chunks of ``prefill_chunk`` hiddens."""
        stage = [(st._num_hiddens, h) for st, h in zip(sts, hids)]
        ends = [st._num_hiddens + h.shape[0] for st, h in zip(sts, hids)]
        start = [st.rows_per_module() for st in sts]          # rows before this call: a rollback keeps them
        before = sum(sum(r) for r in start)
        while any(st._num_hiddens < e for st, e in zip(sts, ends)):
            for st, e in zip(sts, ends):
                st._num_hiddens = min(e, st._num_hiddens + self.prefill_chunk)
            for m in range(self.M):
                self.run(m, sts, stage)
                pool = self.modules[m].pool
                for st, r0 in zip(sts, start):                # a window's blocks left behind: next chunk's
                    pool.recycle(st._kv[m], st, r0[m])
            for st in sts:
                self.trim_windows(st)
        for st in sts:
            self.trim_tail(st)
        return sum(sum(st.rows_per_module()) for st in sts) - before

    def propose(self, sts: list[MtpState], toks: list[int], poss: list[int], hid: Any, k: int,
                draft_ids: DraftFn) -> list[list[int]]:
        """Every module reaches its exact rows over ``t_P`` and the drafts; modules
        ``m < k`` draft from their key ``P - 1`` row, for the sequences that have not stopped
        (a stopped sequence's later modules reach the rows of its shorter tail: the state
        of a propose that asked for as many drafts as it made)."""
        B = len(sts)
        drafts: list[list[int]] = [[] for _ in range(B)]
        active = list(range(B))
        for i, (st, p) in enumerate(zip(sts, poss)):
            st._num_hiddens = p
            st._num_verified = p + 1
            st._tail.append(toks[i])
        stage = [(p - 1, hid[i:i + 1]) for i, p in enumerate(poss)]
        for m in range(self.M):
            normed, last_rows = self.run(m, sts, stage, pad_tables=True,
                                         drafting=[sts[i] for i in active] if m < k else [])
            if m < k and active:
                idx = self.backend.from_host(np.asarray([last_rows[i] for i in active], np.int64))
                ids, stops = draft_ids(m, normed[idx], drafts, active)
                for j, i in enumerate(active):
                    drafts[i].append(int(ids[j]))
                    sts[i]._tail.append(int(ids[j]))
                if stops is not None:
                    active = [i for j, i in enumerate(active) if not stops[j]]
        for st in sts:
            self.trim_windows(st)
            self.trim_tail(st)
        return drafts

    def run(self, m: int, sts: list[MtpState], stage: list[tuple[int, Any]], pad_tables: bool = False,
            drafting: list[MtpState] | None = None):
        """Compute module ``m``'s missing rows for every state. ``stage[i]``: (first key,
        [c, H] hiddens) feeding module 0. Returns ``(normed, last_row_index per state)``.
        ``pad_tables``: padded block tables, as the planned propose step launches them.

        No module reads the last one's outputs: its rows only need their K/V, and its outputs
        only the last row of each state in ``drafting`` (None: none), which it drafts from. So
        the last module's other rows stop after the KV write (``MtpHead.compute(out_rows=)``),
        and its ``normed`` holds the drafting rows only, ``last_row_index`` pointing into them
        (-1 for the others). At batch 8 with 3 drafts that skips the attention, o_proj and
        FFN of 16 of its 24 rows; a catch-up runs none of them."""
        jobs, gs, last_rows, ran = [], [], [], []
        at = 0
        for st, (hk, harr) in zip(sts, stage):
            seq = st._kv[m]
            a, b = seq.rows, exact_rows(st, m)
            if b <= a:
                last_rows.append(-1)
                continue
            toks = np.asarray(st._tail[a + m + 1 - st._tail_start: b + m + 1 - st._tail_start], np.int32)
            if m == 0:
                g = harr[a - hk: b - hk]
            else:
                ws = st._win_start[m - 1]
                if st._win[m - 1] is None or a < ws or b > ws + st._win[m - 1].shape[0]:
                    raise AssertionError(f"module {m - 1}'s window [{ws}, ..) does not cover keys [{a}, {b})")
                g = st._win[m - 1][a - ws: b - ws]
            jobs.append(RowJob(seq, toks, a, m + 1, st))
            gs.append(g)
            ran.append(st)
            at += b - a
            last_rows.append(at - 1)
        if not jobs:
            return None, last_rows
        g = gs[0] if len(gs) == 1 else self.xp.concatenate(gs, axis=0)
        if m == self.M - 1:                               # no module reads the last one's outputs
            want = {id(st) for st in drafting or ()}
            picked, index = [], []                        # rows computed on; each state's among them
            for st, r in zip(sts, last_rows):
                index.append(len(picked) if r >= 0 and id(st) in want else -1)
                if index[-1] >= 0:
                    picked.append(r)
            _, normed = self.modules[m]._forward(jobs, g, pad_tables, out_rows=np.asarray(picked, np.int64))
            return normed, index
        y, normed = self.modules[m]._forward(jobs, g, pad_tables)
        chain = normed if self.chain == "postnorm" else y
        at = 0
        for st, job in zip(ran, jobs):
            self.append_window(st, m, job.first_key, chain[at: at + job.count])
            at += job.count
        return normed, last_rows

    # -- the window and the token tail ------------------------------------------------
    def append_window(self, st: MtpState, m: int, first_key: int, new: Any) -> None:
        """Module ``m``'s chained outputs ``new`` [c, H] for keys ``first_key ..`` join its window."""
        if st._win[m] is None or st._win[m].shape[0] == 0:
            st._win[m], st._win_start[m] = new, first_key
        else:
            st._win[m] = self.xp.concatenate([st._win[m], new], axis=0)

    def trim_windows(self, st: MtpState) -> None:
        """Keep module ``m``'s chained outputs for its last ``M + 1`` existing keys."""
        for m in range(self.M):
            w = st._win[m]
            if w is None:
                continue
            end = st._kv[m].rows - st._win_start[m]        # keys past the module's rows are gone
            start = max(0, end - self.window)
            st._win[m] = w[start:max(start, end)]
            st._win_start[m] += start

    @staticmethod
    def trim_tail(st: MtpState) -> None:
        """Drop tokens no module will read again: module m's next key j reads t_{j+m+1},
        and j + m + 1 > num_hiddens for every module."""
        drop = max(0, min(st._num_hiddens + 1, st.num_tokens) - st._tail_start)
        del st._tail[:drop]
        st._tail_start += drop

    def after_verify(self, st: MtpState, P: int, a: int, k: int) -> None:
        """Drop the drafts past the ``a`` accepted and the rows built from them."""
        del st._tail[P + 1 + a - st._tail_start:]
        st._num_verified = P + 1 + a
        for m, h in enumerate(self.modules):
            h.pool.trim(st._kv[m], st._kv[m].rows - exact_rows(st, m), st)
        self.trim_windows(st)

    # -- invariants -------------------------------------------------------------------
    def check(self, st: MtpState) -> None:
        for m, seq in enumerate(st._kv):
            want = exact_rows(st, m)
            if seq.rows != want or seq.keys.to_list() != list(range(want)):
                raise AssertionError(f"exact mode, module {m}: keys {seq.keys!r}, expected 0..{want - 1} "
                                     f"(num_hiddens {st._num_hiddens}, num_tokens {st.num_tokens})")
            w = st._win[m]
            if want and m < self.M - 1 and (w is None or st._win_start[m] + w.shape[0] != want
                                            or w.shape[0] > self.window):
                raise AssertionError(f"exact mode, module {m}: window does not end at its last key {want - 1}")
        if st._num_verified and (st._tail_start > st._num_hiddens + 1 or len(st._tail) > self.M):
            raise AssertionError(f"exact mode: token tail [{st._tail_start}, {st.num_tokens}) should start at "
                                 f"num_hiddens + 1 = {st._num_hiddens + 1} and hold at most M tokens")
