"""The speculative loop against a real verifier, and plain greedy decoding beside it.

``speculative_generate`` runs an engine's loop (docs/api.md, "A reference target and the real
loop"), in either KV mode of the proposer, with the same calls in the same order::

    out = target.prefill(seq, prompt)                   # h_0 .. h_{n-1}, t_n
    proposer.prefill_drafter(prompt, out.hiddens, st)
    P, t, h = n, t_n, h_{n-1}
    loop:
        drafts = proposer.propose(t, h, P, k, st)       # d_0 .. d_{k'-1}
        v = target.verify(seq, t, drafts)               # a, bonus, [h_P .. h_{P+a}]
        proposer.after_verify(v.num_accepted, st)
        proposer.catchup_drafter(drafts[:a], v.hiddens[:a], st)   # exact: every module; draft: module 0
        P, t, h = P + a + 1, v.bonus, v.hiddens[a]

The tokens it returns are the target's greedy tokens whatever the drafts are (greedy
verification is lossless): ``greedy_generate``'s, token for token. Its acceptance figures
come from the verifier's decisions only (``Decisions``), never from the proposer's counters.
``num_drafts`` may be a function of the decisions so far (a K policy, ``mtpkern.k_policy``):
a step of 0 drafts is a plain decode (``verify`` of no drafts, the step's token caught up).

``tree_generate`` runs the same loop with a draft tree a step (``propose_tree`` ->
``verify_tree`` -> ``after_verify_tree``). ``verify_tree`` is greedy verification of a tree
by its paths: the accepted path is the longest root-to-node path whose tokens equal the
target's greedy continuation (children of a node have distinct tokens, so there is at most
one). It is found with chain verifies: the rank-0 path first; where the target's token
after the accepted prefix is another child of the last accepted node, that child and its
rank-0 descendants are verified next, and so on. Exact for greedy verification (the same
path, bonus and hiddens a verify over all nodes with the tree's ancestor mask gives), at the
cost of one target forward per branch taken instead of one in all.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

from .checks import check_int


@dataclass(slots=True)
class Decisions:
    """The verifier's decisions over a run: per verify, the drafts offered (``offered``) and
    accepted (``accepted``); per draft position ``j``, how many verifies offered a ``d_j``
    (``offered_at[j]``) and accepted it (``accepted_at[j]``)."""

    offered: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    offered_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)

    def record(self, k: int, a: int) -> None:
        if not 0 <= a <= k:
            raise ValueError(f"num_accepted: expected 0 <= a <= {k}, got {a}")
        grow = k - len(self.offered_at)
        if grow > 0:
            self.offered_at.extend([0] * grow)
            self.accepted_at.extend([0] * grow)
        for j in range(k):
            self.offered_at[j] += 1
            self.accepted_at[j] += j < a
        self.offered.append(k)
        self.accepted.append(a)

    @property
    def verifies(self) -> int:
        return len(self.offered)

    def acceptance_rate(self, j: int) -> float:
        """Of the verifies that offered a draft at position ``j``, the share that accepted it."""
        return self.accepted_at[j] / self.offered_at[j] if j < len(self.offered_at) and self.offered_at[j] else 0.0

    @property
    def mean_accepted(self) -> float:
        """Drafts accepted per verify."""
        return float(np.mean(self.accepted)) if self.accepted else 0.0

    @property
    def tokens_per_verify(self) -> float:
        """Tokens each verify adds (the accepted drafts and the bonus token): 1 + mean_accepted."""
        return 1.0 + self.mean_accepted if self.accepted else 0.0


@dataclass(slots=True)
class Generation:
    """``tokens``: the ``max_new`` generated tokens (after the prompt); ``decisions``: the
    verifier's (empty for ``greedy_generate``)."""

    tokens: list[int]
    decisions: Decisions


def _check(prompt: Any, max_new: Any, vocab_size: int) -> tuple[list[int], int]:
    from .checks import check_tokens

    toks = check_tokens("prompt", prompt, vocab_size)
    if toks.shape[0] < 1:
        raise ValueError("prompt: expected at least 1 token, got 0")
    return [int(t) for t in toks], check_int("max_new", max_new, 1, 2 ** 31 - 1)


def greedy_generate(target: Any, prompt: Any, max_new: int) -> Generation:
    """``max_new`` greedy tokens after ``prompt``: a prefill, then one decode per token."""
    toks, max_new = _check(prompt, max_new, target.config.vocab_size)
    seq = target.alloc_seq()
    try:
        out = [target.prefill(seq, toks).next_token]
        while len(out) < max_new:
            out.append(target.decode(seq, out[-1]).next_token)
        return Generation(out, Decisions())
    finally:
        target.free_seq(seq)


def _check_pair(target: Any, proposer: Any) -> None:
    cfg, pc = target.config, proposer.config
    if (pc.vocab_size, pc.stream_size) != (cfg.vocab_size, cfg.hidden_size):
        raise ValueError(f"proposer: expected vocab_size {cfg.vocab_size} and hidden size {cfg.hidden_size} "
                         f"(the target's), got {pc.vocab_size} and {pc.stream_size}")


@contextmanager
def _started(target: Any, proposer: Any, toks: list[int]) -> Iterator[tuple[Any, Any, Any]]:
    """A target sequence and a proposer state, both prefilled with ``toks``: (seq, state, the
    target's prefill output); both freed on leaving, whatever happens."""
    seq = target.alloc_seq()
    st = None
    try:
        st = proposer.alloc_state()
        first = target.prefill(seq, toks)
        proposer.prefill_drafter(toks, first.hiddens, st)
        yield seq, st, first
    finally:
        if st is not None:
            proposer.free_state(st)
        target.free_seq(seq)


def speculative_generate(target: Any, proposer: Any, prompt: Any, max_new: int, num_drafts: Any,
                         min_confidence: float | None = None, catchup: bool = True) -> Generation:
    """``max_new`` tokens after ``prompt`` by the loop of the module docstring, ``num_drafts``
    drafts a propose (clamped to the proposer's modules as ``propose`` does; >= 1), or a
    function ``num_drafts(decisions) -> k`` asked before every step (``k >= 0``; 0: a decode
    step without drafts). ``min_confidence``: ``propose``'s early stop (None: off). The target
    and the proposer must share the vocabulary and hidden size. ``catchup=False`` (draft mode
    only) skips ``catchup_drafter``: module 0 then holds the rows of the prefill and one row
    per propose, as a drafter without a catch-up does (positions skip forward; the tokens stay
    the target's). The target sequence and the proposer state are freed at the end, whatever
    happens."""
    cfg = target.config
    if not isinstance(catchup, bool):
        raise TypeError(f"catchup: expected a bool, got {type(catchup).__name__}")
    if not catchup and getattr(proposer, "kv_mode", None) != "draft":
        raise ValueError(f"catchup: expected True with a proposer in kv_mode {getattr(proposer, 'kv_mode', None)!r} "
                         "(only draft mode may skip the catch-up: exact mode's later modules read its rows), got False")
    toks, max_new = _check(prompt, max_new, cfg.vocab_size)
    policy = num_drafts if callable(num_drafts) else None
    k = None if policy else check_int("num_drafts", num_drafts, 1, 2 ** 31 - 1)
    _check_pair(target, proposer)
    with _started(target, proposer, toks) as (seq, st, first):
        out, dec = [first.next_token], Decisions()
        P, t, h = len(toks), first.next_token, first.hiddens[-1]
        while len(out) < max_new:
            step_k = check_int("num_drafts(decisions)", policy(dec), 0, 2 ** 31 - 1) if policy else k
            if step_k == 0:                     # a decode step: t_P's drafter row comes by catch-up
                v = target.verify(seq, t, [])
                dec.record(0, 0)
                if catchup:
                    proposer.catchup_drafter([t], h[None, :], st)
                out.append(v.bonus)
                P, t, h = P + 1, v.bonus, v.hiddens[0]
                continue
            early = {} if min_confidence is None else {"min_confidence": min_confidence}   # duck-typed proposers
            drafts = [int(d) for d in proposer.propose(t, h, P, step_k, st, **early)]
            v = target.verify(seq, t, drafts)
            a = v.num_accepted
            dec.record(len(drafts), a)
            proposer.after_verify(a, st)
            if a and catchup:
                proposer.catchup_drafter(drafts[:a], v.hiddens[:a], st)
            out.extend(drafts[:a] + [v.bonus])
            P, t, h = P + a + 1, v.bonus, v.hiddens[a]
        return Generation(out[:max_new], dec)


@dataclass(slots=True)
class TreeVerdict:
    """``verify_tree``'s decision: ``path`` the accepted nodes (indices into the tree, depth 0
    down), ``bonus`` the target's token after them, ``hiddens`` [len(path) + 1, H]
    ``[h_P .. h_{P+a}]`` (as ``Verdict.hiddens``), ``forwards`` the chain verifies it took."""

    path: list[int]
    bonus: int
    hiddens: np.ndarray
    forwards: int


def verify_tree(target: Any, seq: Any, last_token: int, tree: Any) -> TreeVerdict:
    """Greedy verification of ``tree`` (a ``DraftTree`` drafted after ``last_token`` = ``t_P``)
    by its paths (module docstring): leaves ``seq`` holding ``t_P`` and the accepted path's
    tokens, as ``target.verify`` of that path would."""
    path: list[int] = []
    hiddens = []
    node, tok, forwards = -1, int(last_token), 0
    while True:
        chain = []                                 # node's rank-0 descendants
        e = node
        while True:
            kids = tree.children(e)
            if not kids:
                break
            e = kids[0]
            chain.append(e)
        v = target.verify(seq, tok, [int(tree.tokens[i]) for i in chain])
        forwards += 1
        a = v.num_accepted
        path += chain[:a]
        hiddens.append(v.hiddens)
        last = path[-1] if path else -1
        # the target's token after the accepted prefix: is it another child of the last accepted node?
        other = [c for c in tree.children(last) if int(tree.tokens[c]) == v.bonus]
        if not other:
            return TreeVerdict(path, v.bonus, np.concatenate(hiddens), forwards)
        node, tok = other[0], v.bonus
        path.append(node)


def tree_generate(target: Any, proposer: Any, prompt: Any, max_new: int, widths: Any) -> Generation:
    """``max_new`` tokens after ``prompt``, a ``propose_tree(widths=widths)`` a step, verified by
    ``verify_tree``; ``decisions`` records per step the tree's depth as offered and the accepted
    path's length as accepted. Lossless as ``speculative_generate``."""
    cfg = target.config
    toks, max_new = _check(prompt, max_new, cfg.vocab_size)
    _check_pair(target, proposer)
    with _started(target, proposer, toks) as (seq, st, first):
        out, dec = [first.next_token], Decisions()
        P, t, h = len(toks), first.next_token, first.hiddens[-1]
        while len(out) < max_new:
            tree = proposer.propose_tree(t, h, P, st, widths=widths)
            v = verify_tree(target, seq, t, tree)
            a = len(v.path)
            dec.record(tree.depth, a)
            proposer.after_verify_tree(v.path, st)
            accepted = [int(tree.tokens[i]) for i in v.path]
            if a:
                proposer.catchup_drafter(accepted, v.hiddens[:a], st)
            out.extend(accepted + [v.bonus])
            P, t, h = P + a + 1, v.bonus, v.hiddens[a]
        return Generation(out[:max_new], dec)


def speculative_generate_batch(target: Any, proposer: Any, prompts: Any, max_new: int,
                               num_drafts: Any) -> list[Generation]:
    """``speculative_generate`` for a batch: ``max_new`` tokens after each of ``prompts`` (a list
    of ``B`` prompts), one ``propose_batch`` a step for the sequences still generating (one
    forward per module over all of them), the target verifying each sequence in turn (a
    ``ReferenceTarget`` has no batched verify, so the verify's cost grows with ``B``), then
    ``after_verify`` per sequence and one ``catchup_batch`` over the accepted drafts.
    ``num_drafts``: drafts a propose (>= 1), or a function ``num_drafts(decisions) -> k``
    (``decisions``: the batch's ``Decisions`` so far, one list) asked before every step: one
    ``K`` for the whole batch; ``k = 0`` is a decode step for every sequence (``verify`` of no
    drafts, the step's tokens caught up in one ``catchup_batch``). Returns one ``Generation``
    per prompt (its own decisions); lossless per sequence, as ``speculative_generate``."""
    cfg = target.config
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError(f"prompts: expected a non-empty list of prompts, got {prompts!r:.60}")
    checked = [_check(p, max_new, cfg.vocab_size) for p in prompts]
    toks, max_new = [c[0] for c in checked], checked[0][1]
    policy = num_drafts if callable(num_drafts) else None
    k = None if policy else check_int("num_drafts", num_drafts, 1, 2 ** 31 - 1)
    _check_pair(target, proposer)
    B = len(toks)
    seqs: list[Any] = []
    sts: list[Any] = []
    try:
        for _ in range(B):
            seqs.append(target.alloc_seq())
            sts.append(proposer.alloc_state())
        outs, decs, P, t, h = [], [Decisions() for _ in range(B)], [], [], []
        for i in range(B):
            first = target.prefill(seqs[i], toks[i])
            proposer.prefill_drafter(toks[i], first.hiddens, sts[i])
            outs.append([first.next_token])
            P.append(len(toks[i]))
            t.append(first.next_token)
            h.append(first.hiddens[-1])
        batch = Decisions()
        while True:
            live = [i for i in range(B) if len(outs[i]) < max_new]
            if not live:
                break
            step_k = check_int("num_drafts(decisions)", policy(batch), 0, 2 ** 31 - 1) if policy else k
            if step_k:
                drafts = proposer.propose_batch([t[i] for i in live], np.stack([h[i] for i in live]),
                                                [P[i] for i in live], step_k, [sts[i] for i in live])
            else:
                drafts = [[] for _ in live]
            up_toks, up_hid, up_st = [], [], []
            for i, ds in zip(live, drafts):
                ds = [int(d) for d in ds]
                v = target.verify(seqs[i], t[i], ds)
                a = v.num_accepted
                decs[i].record(len(ds), a)
                batch.record(len(ds), a)
                if ds:
                    proposer.after_verify(a, sts[i])
                caught = ds[:a] if ds else [t[i]]           # a decode step catches up its own token
                if caught:
                    up_toks.append(caught)
                    up_hid.append(v.hiddens[:a] if ds else h[i][None, :])
                    up_st.append(sts[i])
                outs[i].extend(ds[:a] + [v.bonus])
                P[i], t[i], h[i] = P[i] + a + 1, v.bonus, v.hiddens[a]
            if up_st:
                proposer.catchup_batch(up_toks, up_hid, up_st)
        return [Generation(o[:max_new], d) for o, d in zip(outs, decs)]
    finally:
        for st in sts:
            proposer.free_state(st)
        for seq in seqs:
            target.free_seq(seq)
