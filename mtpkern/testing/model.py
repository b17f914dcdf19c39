"""A model of what a ``MultiModuleMtpHead`` must hold, independent of how it does it.

``ProposerModel`` follows every successful call (``alloc``, ``prefill``,
``propose``, ``verify``, ``catchup``, ``take``, ``install``, ``free``,
``free_carried``) and ``check()`` compares the proposer with it:

- the proposer's own invariants (pool accounting, registries, each state's rules);
- every module's rows: draft mode, the keys docs/semantics.md says each module keeps
  (module ``m``'s row of a propose survives ``after_verify(a)`` iff ``m <= a``; a
  catch-up gives module 0 one row per token, keys from ``Hn``);
  exact mode, ``max(0, min(Hn, T - m - 1))`` rows, keys ``0 ..`` (``Hn`` hiddens
  consumed, ``T`` tokens known: verified, plus the drafts awaiting a verify);
- the counters engines read (``num_verified``, ``next_position``, ``drafted``);
- memory: a sliding-window module's sequence (a state's or a carried entry's) holds
  at most ``window_blocks(m)`` blocks, whatever its length (docs/api.md).

With host FP32 ``weights`` (``reference_weights``), exact-mode drafts are also
compared with the dense float64 oracle (``mtpkern.testing.oracle``): tiny models
only. ``fingerprint()`` is what a failed call must leave unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from . import oracle

MaskFn = Callable[[int, list], Any]


#: confidences against the float64 oracle: the logits the backends compute differ from its
#: own by their rounding (FP32, BF16 weights), which a softmax carries over as
#: ~exp(error) - 1 relative to each probability
CONF_RTOL, CONF_ATOL = 1e-3, 1e-5


@dataclass
class SeqModel:
    """One sequence as the model sees it."""

    keys: list[list[int]]                               # draft mode: expected keys per module
    tokens: list[int] = field(default_factory=list)     # verified tokens t_0 ..
    hiddens: list = field(default_factory=list)         # consumed target hiddens h_0 .. (host FP32 [H])
    phase: str = "fresh"                                # fresh | ready | drafted | catchup
    P: int = 0                                          # position of the last propose
    k: int = 0                                          # drafts it made
    drafts: list[int] = field(default_factory=list)
    accepted: int = 0                                   # of the last verify, still to catch up
    budget: int | None = None                           # alloc_state_for's budget_tokens
    draft: Any = None                                   # oracle.DraftRows (draft mode, with weights)
    tree: Any = None                                    # a propose_tree awaiting its verify

    @property
    def next_position(self) -> int:
        return len(self.tokens)


def _row(words: Any) -> np.ndarray | None:
    """One mask as [W] words (a [1, W] array, as xgrammar allocates one, too)."""
    if words is None:
        return None
    if hasattr(words, "get") and not isinstance(words, np.ndarray):
        words = words.get()
    return np.asarray(words).reshape(-1)


def mask_fn(grammar_bitmask: Any) -> MaskFn | None:
    """``grammar_bitmask`` in any array form ``propose`` takes -> ``(i, drafts) -> [W] words
    | None``. (A callable is never called again here: ``CheckedProposer`` records what
    the proposer got from it, since a stateful grammar cannot answer twice.)"""
    if grammar_bitmask is None:
        return None
    if callable(grammar_bitmask):
        return lambda i, drafts: _row(grammar_bitmask(i, list(drafts)))
    a = np.asarray(grammar_bitmask)
    if a.ndim == 1 or a.shape[0] == 1:
        row = a.reshape(-1)
        return lambda i, drafts: row
    return lambda i, drafts: a[i]


def allowed(words: Any, token: int) -> bool:
    if words is None:
        return True
    w = _row(words).astype(np.int64) & 0xFFFFFFFF
    return bool((int(w[token >> 5]) >> (token & 31)) & 1)


def _host(x: Any) -> np.ndarray:
    if hasattr(x, "get") and not isinstance(x, np.ndarray):
        x = x.get()
    return np.asarray(x, np.float32)


class ProposerModel:
    """The expected state of every sequence and carried entry of one proposer."""

    def __init__(self, prop: Any, weights: Any = None):
        self.prop = prop
        self.M = prop.num_modules
        self.mode = prop.kv_mode
        self.weights = weights
        self.seqs: dict[int, tuple[Any, SeqModel]] = {}       # id(state) -> (state, model)
        self.carried: dict[int, tuple[Any, SeqModel]] = {}    # id(DrafterKv) -> (entry, model)

    def new_seq(self, budget: int | None = None) -> SeqModel:
        draft = None
        if self.weights is not None and self.mode == "draft":
            draft = oracle.DraftRows(self.prop.config, self.weights, self.prop.chain, self.weights.target_norm,
                                     vocab=self._vocab())
        return SeqModel([[] for _ in range(self.M)], budget=budget, draft=draft)

    def of(self, st: Any) -> SeqModel:
        entry = self.seqs.get(id(st))
        if entry is None or entry[0] is not st:
            raise KeyError("a state the model does not know (allocated around the checked proposer?)")
        return entry[1]

    # -- transitions (successful calls) -----------------------------------------------
    def alloc(self, st: Any, budget: int | None = None) -> None:
        self.seqs[id(st)] = (st, self.new_seq(budget))

    def prefill(self, st: Any, tokens: Any, hiddens: Any, rows: int) -> None:
        s = self.of(st)
        assert s.phase == "fresh", f"prefill_drafter accepted a state in phase {s.phase}"
        toks = [int(t) for t in np.asarray(tokens).reshape(-1)]
        n = len(toks)
        hid = _host(hiddens).reshape(n, -1)
        s.tokens, s.hiddens = toks, list(hid[:-1])         # h_{n-1} comes again with the first propose
        s.keys[0] = list(range(n - 1))
        s.phase = "ready"
        if s.draft is not None:
            s.draft.prefill(toks, hid)
        want = n - 1 if self.mode == "draft" else sum(max(0, n - 1 - m) for m in range(self.M))
        assert rows == want, f"prefill_drafter wrote {rows} rows, expected {want}"

    def _vocab(self):
        """The proposer's draft vocabulary's ids (its LM heads' rows), or None."""
        dv = getattr(self.prop, "draft_vocab", None)
        return None if dv is None else dv.ids

    def propose(self, st: Any, last_token: int, hidden: Any, P: int, num_drafts: int, grammar: Any,
                drafts: list[int], confs: list[float] | None = None, min_confidence: float | None = None,
                forced: bool = False, sampling: Any = None) -> None:
        """``forced``: ``drafts`` hold the forced ones only (a draft tree's accepted path, with
        ``grammar`` allowing only those): the rest are the oracle's (not checked).
        ``confs``: the call's confidences of ``drafts`` (out_conf), checked against the
        oracle's softmax of its logits when given; ``min_confidence``: an early stop, which
        must end at the first draft below it (everything after is the state of a propose of
        that many drafts: the oracle is asked for as many). ``sampling``: the call's
        ``SamplingParams`` or None: the oracle draws with the same key (its confidences are then
        the drafts' probabilities under the sampling distribution)."""
        s = self.of(st)
        assert s.phase == "ready", f"propose accepted a state in phase {s.phase}"
        k = min(int(num_drafts), self.M)
        if min_confidence is None:
            assert len(drafts) == k, f"propose returned {len(drafts)} drafts, expected min(num_drafts, M) = {k}"
        else:
            assert 1 <= len(drafts) <= k, f"an early-stopping propose returned {len(drafts)} drafts, expected 1..{k}"
            assert confs is not None and len(confs) == len(drafts)
            thr = np.float32(min_confidence)
            assert all(np.float32(c) >= thr for c in confs[:-1]), \
                f"drafting went on past a confidence below {min_confidence}: {confs}"
            assert len(drafts) == k or np.float32(confs[-1]) < thr, \
                f"drafting stopped at {len(drafts)} of {k} with confidences {confs} >= {min_confidence}"
            k = len(drafts)
        if self.mode == "exact":
            assert P == s.next_position, f"exact-mode propose accepted position {P}, expected {s.next_position}"
        else:
            assert P >= s.next_position, f"draft-mode propose accepted position {P} < {s.next_position}"
        fn = mask_fn(grammar)
        for i, d in enumerate([] if forced else drafts):
            assert 0 <= d < self.prop.config.vocab_size, f"draft {i} = {d} is outside the vocabulary"
            if fn is not None:
                assert allowed(fn(i, drafts[:i]), d), f"draft {i} = {d} violates the grammar mask"
        if self.mode == "draft" and P > s.next_position:       # positions may skip forward
            s.tokens += [-1] * (P - s.next_position)           # (unknown tokens; draft mode reads none)
        if self.mode == "draft":                               # skipped hiddens too: h_{P-1} is the P-th
            s.hiddens += [None] * (P - 1 - len(s.hiddens))
        s.accepted = 0                                         # drafts not caught up stay skipped
        s.tokens.append(int(last_token))
        s.hiddens.append(_host(hidden).reshape(-1))
        if confs is not None:
            assert len(confs) == k and all(isinstance(c, float) and 0.0 < c <= 1.0 + 1e-5 for c in confs), \
                f"confidences {confs}: expected {k} floats in (0, 1]"
        want_conf: list[float] = []
        if self.mode == "exact" and self.weights is not None:
            want = oracle.propose(self.prop.config, self.weights, s.tokens, s.hiddens, k, self.prop.chain,
                                  vocab=self._vocab(),
                                  masks=fn, target_norm=self.weights.target_norm, confs=want_conf, sampling=sampling)
            assert forced or drafts == want, f"drafts {drafts} differ from the oracle's {want}"
            drafts = want if forced else drafts
        if s.draft is not None:
            want = s.draft.propose(last_token, hidden, P, k, masks=fn, confs=want_conf, sampling=sampling)
            assert forced or drafts == want, f"draft-mode drafts {drafts} differ from the oracle's {want}"
            drafts = want if forced else drafts
        if confs is not None and want_conf:
            got, ref = np.asarray(confs), np.asarray(want_conf)
            assert np.allclose(got, ref, rtol=CONF_RTOL, atol=CONF_ATOL), \
                f"confidences {confs} differ from the oracle's softmax {want_conf}"
        for m in range(k):
            s.keys[m].append(P - 1)
        s.phase, s.P, s.k, s.drafts = "drafted", P, k, list(drafts)

    # -- draft trees -------------------------------------------------------------------
    def propose_tree(self, st: Any, last_token: int, hidden: Any, P: int, tree: Any, grammar: Any) -> None:
        """A ``propose_tree``: the layout's rules; with weights, every expanded node's children
        are the oracle's top-c along the node's path, with its probabilities; the state is then
        the state of a chain propose along the rank-0 path (checked as one)."""
        s = self.of(st)
        assert s.phase == "ready", f"propose_tree accepted a state in phase {s.phase}"
        N = len(tree)
        par, dep = tree.parents.tolist(), tree.depths.tolist()
        assert N >= 1 and all(-1 <= par[i] < i for i in range(N)), f"parents {par}: each before its child"
        assert par == sorted(par), f"parents {par}: breadth-first order (never decreasing)"
        assert all(dep[i] == (0 if par[i] < 0 else dep[par[i]] + 1) for i in range(N)), f"depths {dep}"
        assert all(0.0 < p <= 1.0 + 1e-5 for p in tree.probs.tolist()), f"probs {tree.probs}"
        for i in range(N):
            base = 0.0 if par[i] < 0 else float(tree.scores[par[i]])
            assert np.isclose(tree.scores[i], base + np.log(tree.probs[i]), rtol=1e-4, atol=1e-4), "scores"
        fn = mask_fn(grammar)
        for i in range(N):
            if fn is not None:
                assert allowed(fn(dep[i], tree.path_tokens(par[i]) if par[i] >= 0 else []), int(tree.tokens[i])), \
                    f"node {i} = {tree.tokens[i]} violates the grammar mask"
        D = tree.depth
        if self.weights is not None:
            for e in [-1] + list(range(N)):
                kids = tree.children(e)
                if not kids:
                    continue
                path = [] if e < 0 else tree.path_tokens(e)
                d = len(path)
                if self.mode == "exact":
                    h = oracle.forced_normed(self.prop.config, self.weights, s.tokens + [int(last_token)],
                                             s.hiddens + [_host(hidden).reshape(-1)], path, self.prop.chain,
                                             self.weights.target_norm)
                else:
                    h = s.draft.forced_normed(last_token, hidden, P, path)
                vocab = self._vocab()
                head = self.weights.modules[d].head if vocab is None else np.asarray(self.weights.modules[d].head)[vocab]
                ids, probs = oracle.topk64(h, head, len(kids), None if fn is None else fn(d, path), vocab)
                got = [int(tree.tokens[c]) for c in kids]
                assert got == ids, f"node {e}'s children {got} differ from the oracle's top-{len(kids)} {ids}"
                assert np.allclose(tree.probs[kids], probs, rtol=CONF_RTOL, atol=CONF_ATOL), \
                    f"node {e}'s children's probabilities {tree.probs[kids]} differ from the oracle's {probs}"
        greedy = tree.greedy_path()
        before = (len(s.tokens), len(s.hiddens), [list(k) for k in s.keys],
                  None if s.draft is None else ([list(r) for r in s.draft.rows], s.draft.k))
        self.propose(st, last_token, hidden, P, D, grammar, [int(tree.tokens[i]) for i in greedy],
                     [float(tree.probs[i]) for i in greedy])
        s.tree = (last_token, hidden, P, D, grammar, before)

    def verify_tree(self, st: Any, path_tokens: list[int]) -> None:
        """``after_verify_tree`` along a path of these tokens: the state of a chain propose
        forced along them, after ``after_verify(len(path))``."""
        s = self.of(st)
        assert s.phase == "drafted" and s.tree is not None, f"after_verify_tree accepted phase {s.phase}"
        last_token, hidden, P, D, grammar, before = s.tree
        nt, nh, keys, draft = before
        del s.tokens[nt:], s.hiddens[nh:]
        s.keys = keys
        if draft is not None:
            s.draft.rows, s.draft.k = draft
        s.phase, s.tree = "ready", None
        a = len(path_tokens)
        V, fn = self.prop.config.vocab_size, mask_fn(grammar)

        def forced(i: int, drafts: list) -> Any:
            if i < a:
                words = np.zeros((V + 31) // 32, np.int32)
                words[path_tokens[i] >> 5] = np.int32(np.uint32(1) << np.uint32(path_tokens[i] & 31))
                return words
            return None if fn is None else fn(i, drafts)

        self.propose(st, last_token, hidden, P, D, forced, list(path_tokens) + [0] * (D - a), forced=True)
        if self.weights is None:
            s.drafts = list(path_tokens) + s.drafts[a:]
        self.verify(st, a)

    def verify(self, st: Any, a: int) -> None:
        s = self.of(st)
        assert s.phase == "drafted" and 0 <= a <= s.k, f"after_verify({a}) accepted in phase {s.phase}"
        for m in range(a + 1, s.k):
            s.keys[m].pop()
        if s.draft is not None:
            s.draft.verify(a)
        s.tokens += s.drafts[:a]
        s.accepted = a
        s.phase = "catchup" if self.mode == "exact" and a else "ready"

    def catchup(self, st: Any, tokens: Any, hiddens: Any) -> int:
        """Returns the rows the call must have written (all modules)."""
        s = self.of(st)
        toks = [int(t) for t in np.asarray(tokens).reshape(-1)]
        if not toks:
            return 0
        assert s.phase in ("ready", "catchup"), f"catchup_drafter accepted a state in phase {s.phase}"
        assert s.tokens, "catchup_drafter accepted a fresh state"
        before = sum(self.exact_rows(s))
        base = len(s.hiddens) + 1                              # sequence index of toks[0]
        known = s.tokens[base:base + len(toks)]
        assert toks[:len(known)] == known, f"catchup_drafter accepted tokens {toks}, verified ones are {known}"
        hid = _host(hiddens).reshape(len(toks), -1)
        if self.mode == "draft":                               # module 0: one row per token, keys from Hn
            s.keys[0] += range(base - 1, base - 1 + len(toks))
            if s.draft is not None:
                s.draft.catchup(toks, hid, base - 1)
        s.tokens += toks[len(known):]                          # tokens past the verified ones extend it
        s.hiddens += list(hid)
        s.accepted = 0
        s.phase = "ready"
        return len(toks) if self.mode == "draft" else sum(self.exact_rows(s)) - before

    def take(self, st: Any, kv: Any) -> None:
        s = self.of(st)
        if kv is None:
            assert not s.tokens, "take_drafter_kv returned None for a state that holds a sequence"
            return
        self.carried[id(kv)] = (kv, s)
        s.budget = None                                        # taking ends the sequence a budget was for
        self.seqs[id(st)] = (st, self.new_seq())

    def install(self, st: Any, kv: Any) -> None:
        entry = self.carried.pop(id(kv))
        old = self.of(st)
        assert old.phase == "fresh", "install_drafter_kv accepted a state that holds a sequence"
        entry[1].budget = old.budget
        self.seqs[id(st)] = (st, entry[1])

    def free(self, st: Any) -> None:
        del self.seqs[id(st)]

    def fork(self, src: Any, st: Any) -> None:
        """``fork_state(src)`` returned ``st``: the same sequence, no budget."""
        s = self.of(src)
        assert s.phase != "drafted", "fork_state accepted a state whose propose awaits its verify"
        self.seqs[id(st)] = (st, SeqModel([list(k) for k in s.keys], list(s.tokens), list(s.hiddens), s.phase, s.P,
                                          s.k, list(s.drafts), s.accepted,
                                          draft=None if s.draft is None else s.draft.share()))

    def share(self, src: Any, st: Any, num_tokens: int) -> None:
        """``share_prefix(src, t_0 .. t_{L-1})`` returned ``st``: module ``m``'s rows built
        from the prefix alone (keys ``<= L - 2 - m``), cut at ``Hn = st.num_hiddens`` hiddens
        (draft mode: ``L - 1`` or the source's hiddens if fewer; exact mode: the proposer picks
        it, within ``L - 1 - M .. L - 1`` and the source's hiddens), so the state awaits a
        catch-up of ``t_{Hn+1} .. t_{L-1}`` when ``Hn < L - 1``."""
        s, L = self.of(src), int(num_tokens)
        assert s.phase in ("ready", "catchup") and 1 <= L <= len(s.tokens), \
            f"share_prefix accepted {L} tokens of a state in phase {s.phase} with {len(s.tokens)} verified"
        new = self.new_seq()
        new.tokens = s.tokens[:L]
        new.phase = "ready"
        h = st.num_hiddens
        if self.mode == "draft":
            new.keys = [[k for k in keys if k <= L - 2 - m] for m, keys in enumerate(s.keys)]
            assert h == min(L - 1, len(s.hiddens)), \
                f"share_prefix cut {L} tokens at {h} hiddens (the source consumed {len(s.hiddens)})"
            if s.draft is not None:
                new.draft = s.draft.share(L)
        else:
            assert max(0, L - 1 - self.M) <= h <= min(L - 1, len(s.hiddens)), \
                f"share_prefix cut {L} tokens at {h} hiddens (the source consumed {len(s.hiddens)})"
        new.hiddens = s.hiddens[:h]
        if h < L - 1:                                           # the tokens past the cut, to catch up
            new.phase, new.drafts, new.accepted = "catchup", new.tokens[h + 1:], L - 1 - h
        self.seqs[id(st)] = (st, new)

    def free_carried(self, kv: Any) -> None:
        del self.carried[id(kv)]

    # -- expectations ------------------------------------------------------------------
    def trim_margin(self, m: int) -> int:
        """Rows of module ``m`` a verify may still remove (docs/semantics.md): exact mode
        drops at most ``m`` keys, draft mode at most the one row of the last propose, of
        modules ``m >= 1``."""
        return m if self.mode == "exact" else min(m, 1)

    def window_blocks(self, m: int) -> int | None:
        """The most blocks a sliding-window module ``m``'s sequence holds between calls:
        rows a later row may read are those with keys above ``last - T - W`` (at most
        ``W - 1 + T`` of them), plus up to ``BS - 1`` rows of the block they start in:
        ``ceil((W + T + BS - 2) / BS)``. None for full attention."""
        W = self.prop.config.block(m).sliding_window
        if not W:
            return None
        BS = self.prop.block_size
        return -(-(W + self.trim_margin(m) + BS - 2) // BS)

    def _check_window(self, seqs: Any, what: str) -> None:
        for m, q in enumerate(seqs):
            most = self.window_blocks(m)
            if most is not None:
                assert len(q.blocks) <= most, (f"module {m}: {what} holds {len(q.blocks)} blocks for {q.rows} rows, "
                                               f"expected at most {most} (sliding window)")

    def exact_rows(self, s: SeqModel, extra_tokens: int = 0) -> list[int]:
        T = len(s.tokens) + (len(s.drafts) if s.phase == "drafted" else 0) + extra_tokens
        return [max(0, min(len(s.hiddens), T - m - 1)) for m in range(self.M)]

    def rows_after_prefill(self, n: int) -> list[int]:
        return [max(0, n - 1 - m) for m in range(self.M)] if self.mode == "exact" else \
            [n - 1] + [0] * (self.M - 1)

    def rows_after_propose(self, s: SeqModel, P: int, num_drafts: int) -> list[int]:
        k = min(num_drafts, self.M)
        if self.mode == "exact":
            return [max(0, min(P, P + k - m)) for m in range(self.M)]
        return [len(s.keys[m]) + (m < k) for m in range(self.M)]

    def rows_after_catchup(self, s: SeqModel, tokens: Any) -> list[int]:
        toks = [int(t) for t in np.asarray(tokens).reshape(-1)]
        if self.mode == "draft" or not toks:
            return [len(k) + (len(toks) if m == 0 else 0) for m, k in enumerate(s.keys)]
        known = len(s.tokens[len(s.hiddens) + 1:len(s.hiddens) + 1 + len(toks)])
        Hn, T = len(s.hiddens) + len(toks), len(s.tokens) + len(toks) - known
        return [max(0, min(Hn, T - m - 1)) for m in range(self.M)]

    def fits_budget(self, s: SeqModel, rows_after: list[int]) -> bool:
        """Whether rows ``rows_after`` per module lie within what ``alloc_state_for``
        reserved (budget + M tokens per module): a call that stays there must never
        meet a full pool."""
        if s.budget is None:
            return False
        return max(rows_after) <= s.budget + self.M

    def check(self) -> None:
        """The proposer agrees with the model (``AssertionError`` naming the first difference)."""
        prop = self.prop
        prop.check_invariants()
        for st, s in self.seqs.values():
            st.check_invariants()
            rows = st.rows_per_module()
            if self.mode == "draft":
                for m in range(self.M):
                    got = st.kv[m].keys.to_list()
                    assert got == s.keys[m], f"module {m}: keys {got}, expected {s.keys[m]}"
            elif s.phase != "fresh":
                assert rows == self.exact_rows(s), f"rows {rows}, expected {self.exact_rows(s)}"
            if s.phase != "fresh":
                assert st.num_verified == len(s.tokens), f"num_verified {st.num_verified}, expected {len(s.tokens)}"
                assert st.num_hiddens == len(s.hiddens), f"num_hiddens {st.num_hiddens}, expected {len(s.hiddens)}"
            assert st.drafted == (s.phase == "drafted"), f"drafted {st.drafted} in phase {s.phase}"
            self._check_window(st.kv, "a state")
        for kv, s in self.carried.values():
            assert kv.num_verified == len(s.tokens) and not kv.consumed
            self._check_window(kv.seqs, "a carried entry")

    def _window(self, st: Any) -> tuple:
        """The exact-mode window (chained outputs) of ``st``, by value."""
        be = self.prop.backend
        return tuple((start, None if w is None else np.asarray(be.to_host(w)).tobytes())
                     for start, w in zip(st._win_start, st._win))

    def fingerprint(self) -> tuple:
        """What a failed call must leave as it was: pools, every state and carried entry,
        the proposer's counters and last drafts."""
        prop = self.prop
        pools = tuple((p.num_used, p.reserved) for p in prop.pools)
        sts = tuple((id(st), tuple(st.rows_per_module()), tuple(tuple(q.blocks) for q in st.kv), st.num_verified,
                     st.num_hiddens, tuple(st.tail), st.drafted, st.next_position, tuple(st.last_drafts),
                     self._window(st)) for st, _ in self.seqs.values())
        carried = tuple((id(kv), tuple(map(tuple, kv.blocks)), kv.consumed) for kv, _ in self.carried.values())
        dev = prop.last_drafts_device
        stats = (tuple(prop.stats.drafted), tuple(prop.stats.accepted), tuple(prop.stats.reached), prop.stats.verifies,
                 prop.clamped_calls)
        return pools, sts, carried, stats, None if dev is None else prop.backend.to_host(dev).tolist()
