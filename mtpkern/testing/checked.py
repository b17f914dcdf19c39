"""``checked(prop)``: the proposer with every call verified against ``ProposerModel``.

Hand the returned object to the code under test (an engine's scheduler) in place
of the proposer: it has the same methods and returns the same objects (real
states, real carried entries). Around every call it

- takes the model's fingerprint; if the call raises, asserts that nothing changed
  (pools, every state and its exact-mode window, carried entries, counters) and
  re-raises the error; a ``KvCacheFull`` for a sequence that stays inside its
  ``alloc_state_for`` budget is itself a failure;
- if the call succeeds, moves the model along and runs ``model.check()``: the
  proposer's invariants, every module's rows, and (with ``weights``) the drafts
  against the dense oracle, in both KV modes; then the counters the call must have
  moved: ``stats`` (by deltas, so an engine may ``reset()`` them), ``clamped_calls``,
  ``read_deferred_draft_token`` and ``last_drafts_device``.

With ``target`` (a ``ReferenceTarget`` of the engine's checkpoint, the kit's own), every hidden
and token the engine hands in is checked against what the target computes for the sequence the
engine has committed (``mtpkern.testing.truth``): a hidden at the wrong position, a wrong bonus
token, a skipped catch-up. These checks run after the model's, so the model stays in step
with the proposer.

A grammar callable is called by the proposer only: the proxy records the masks it
returned and checks the drafts against those (a stateful grammar, such as an
xgrammar matcher that advances with each draft, cannot answer twice).

An ``AssertionError`` therefore points at the first call that broke a rule. The
proxy adds no locking: the thread contract is the proposer's own (check from one
thread, or call ``check()`` once the threads have joined).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..errors import KvCacheFull
from ..tree import check_shapes
from .model import ProposerModel
from .truth import TargetTruth


class _Recorder:
    """A grammar callable that remembers what it returned for each draft position."""

    def __init__(self, fn: Callable):
        self.fn, self.got = fn, {}

    def __call__(self, i: int, drafts: list) -> Any:
        mask = self.fn(i, drafts)
        self.got[i] = mask
        return mask

    def replay(self, i: int, drafts: list) -> Any:
        return self.got.get(i)


class CheckedProposer:
    """A ``MultiModuleMtpHead`` whose every call is checked (see the module docstring)."""

    def __init__(self, prop: Any, weights: Any = None, target: Any = None, tol: str = "float32"):
        self.prop = prop
        self.model = ProposerModel(prop, weights)
        #: with a target: the target's hidden and token at every position (``mtpkern.testing.truth``)
        self.truth = None if target is None else TargetTruth(target, prop, tol)

    def __getattr__(self, name: str) -> Any:             # queries and attributes pass through
        return getattr(self.prop, name)

    def check(self) -> None:
        self.model.check()

    def _counters(self) -> tuple:
        st = self.prop.stats
        return (tuple(st.drafted), tuple(st.accepted), st.verifies, st.accepted_total, self.prop.clamped_calls,
                tuple(st.reached))

    def _call(self, fn: Callable[[], Any], then: Callable[[Any], None],
              room: Callable[[], list[tuple[Any, list[int]]]] | None = None, counts: Callable[[tuple], tuple] = None):
        """``fn()`` checked: ``then(result)`` moves the model; ``room()``: (sequence model,
        rows after the call) for the budget rule; ``counts(before)``: the counters the
        call must leave (default: unchanged)."""
        before = self.model.fingerprint()
        counters = self._counters()
        try:
            out = fn()
        except BaseException as e:
            after = self.model.fingerprint()
            assert after == before, "a call that raised changed the proposer's state"
            if isinstance(e, KvCacheFull) and room is not None:
                # a batch may fail for a member outside its budget; only a call whose every
                # sequence stays inside its reservation must never meet a full pool
                inside = [(s, rows) for s, rows in room() if self.model.fits_budget(s, rows)]
                assert len(inside) < len(room()), (
                    f"KvCacheFull for sequences inside their budgets "
                    f"({', '.join(f'{s.budget} tokens, rows after {rows}' for s, rows in inside)}): {e}")
            raise
        then(out)
        self.model.check()
        want = counters if counts is None else counts(counters)
        assert self._counters() == want, f"counters {self._counters()} after the call, expected {want}"
        return out

    def _hn(self, state: Any) -> int:
        """Target hiddens ``state`` has consumed (``Hn``), before the call moves the model."""
        return len(self.model.of(state).hiddens)

    def _grammar(self, grammar: Any) -> Any:
        return _Recorder(grammar) if callable(grammar) else grammar

    def _seen(self, grammar: Any) -> Any:
        return grammar.replay if isinstance(grammar, _Recorder) else grammar

    def _clamp(self, num_drafts: Any) -> Callable[[tuple], tuple]:
        def counts(c: tuple) -> tuple:
            return c[:4] + (c[4] + (int(num_drafts) > self.prop.num_modules),) + c[5:]
        return counts

    def _after_propose(self, states: list, drafts: list[list[int]]) -> None:
        for st, d in zip(states, drafts):
            assert self.prop.read_deferred_draft_token(st) == d[-1], "read_deferred_draft_token(state) is not its last draft"
        assert self.prop.read_deferred_draft_token() == drafts[-1][-1]
        dev = np.asarray(self.prop.backend.to_host(self.prop.last_drafts_device))
        k = dev.shape[1] if dev.ndim == 2 else 0                   # min(num_drafts, M); -1 past an early stop
        want = [d + [-1] * (k - len(d)) for d in drafts]
        assert k >= max(len(d) for d in drafts) and dev.tolist() == want, "last_drafts_device differs from the drafts"

    # -- lifecycle --------------------------------------------------------------------
    def alloc_state(self) -> Any:
        return self._call(self.prop.alloc_state, lambda st: self.model.alloc(st))

    def alloc_state_for(self, budget_tokens: int | None) -> Any:
        return self._call(lambda: self.prop.alloc_state_for(budget_tokens),
                          lambda st: self.model.alloc(st, budget_tokens))

    def free_state(self, state: Any) -> None:
        def then(_: Any) -> None:
            self.model.free(state)
            if self.truth is not None:
                self.truth.free(state)

        return self._call(lambda: self.prop.free_state(state), then)

    # -- drafting ---------------------------------------------------------------------
    def prefill_drafter(self, prompt_tokens: Any, hiddens: Any, state: Any) -> int:
        def then(rows: int) -> None:
            self.model.prefill(state, prompt_tokens, hiddens, rows)
            if self.truth is not None:
                self.truth.prefill(state, prompt_tokens, hiddens)

        return self._call(lambda: self.prop.prefill_drafter(prompt_tokens, hiddens, state), then,
                          room=lambda: [(self.model.of(state),
                                         self.model.rows_after_prefill(len(np.asarray(prompt_tokens).reshape(-1))))])

    def propose(self, last_token: int, target_hidden: Any, position: int, num_drafts: int, state: Any,
                grammar_bitmask: Any = None, out_conf: list | None = None,
                min_confidence: float | None = None, *, sampling: Any = None) -> list[int]:
        gm = self._grammar(grammar_bitmask)
        if out_conf is None and min_confidence is not None:
            out_conf = []                      # the confidences an early stop decided on, to check it
        before = None if out_conf is None else list(out_conf)

        fp: list = []

        def then(d: list[int]) -> None:
            if int(num_drafts) == 0:                      # a checked no-op: nothing moves
                assert d == [] and (out_conf is None or out_conf == []), f"propose of 0 drafts returned {d}"
                assert self.model.fingerprint() == fp[0], "a propose of 0 drafts changed the proposer's state"
                return
            hn = self._hn(state)
            self.model.propose(state, last_token, target_hidden, position, num_drafts, self._seen(gm), d,
                               None if out_conf is None else out_conf, min_confidence, sampling=sampling)
            self._after_propose([state], [d])
            if self.truth is not None:
                self.truth.propose(state, last_token, target_hidden, position, hn, d)

        def call():
            fp.append(self.model.fingerprint())
            try:
                return self.prop.propose(last_token, target_hidden, position, num_drafts, state, gm, out_conf,
                                         min_confidence, sampling=sampling)
            except BaseException:
                assert out_conf is None or out_conf == before, "a failed propose changed out_conf"
                raise

        return self._call(call,
                          then, room=lambda: [(self.model.of(state),
                                               self.model.rows_after_propose(self.model.of(state), position,
                                                                             num_drafts))],
                          counts=self._clamp(num_drafts))

    def propose_batch(self, last_tokens: Any, target_hiddens: Any, positions: Any, num_drafts: int,
                      states: Any, grammar_bitmasks: Any = None, out_conf: list | None = None,
                      min_confidence: float | None = None, *, sampling: Any = None) -> list[list[int]]:
        gms = None if grammar_bitmasks is None else [self._grammar(g) for g in grammar_bitmasks]
        if out_conf is None and min_confidence is not None:
            out_conf = []

        def then(drafts: list[list[int]]) -> None:
            if out_conf is not None:
                assert len(out_conf) == len(drafts), f"out_conf holds {len(out_conf)} lists for {len(drafts)} states"
            if int(num_drafts) == 0:                      # a checked no-op (the model checks nothing moved)
                assert drafts == [[] for _ in states], f"propose_batch of 0 drafts returned {drafts}"
                return
            hns = [self._hn(st) for st in states]
            for i, (st, d) in enumerate(zip(states, drafts)):
                gm = None if gms is None else self._seen(gms[i])
                self.model.propose(st, last_tokens[i], target_hiddens[i], positions[i], num_drafts, gm, d,
                                   None if out_conf is None else out_conf[i], min_confidence,
                                   sampling=None if sampling is None else sampling[i])
            self._after_propose(list(states), drafts)
            for i, (st, d) in enumerate(zip(states, drafts)):
                if self.truth is not None:
                    self.truth.propose(st, last_tokens[i], target_hiddens[i], positions[i], hns[i], d,
                                       "propose_batch", f"[{i}]")

        def room():
            return [(self.model.of(st), self.model.rows_after_propose(self.model.of(st), p, num_drafts))
                    for st, p in zip(states, positions)]

        return self._call(lambda: self.prop.propose_batch(last_tokens, target_hiddens, positions, num_drafts,
                                                          states, gms, out_conf, min_confidence, sampling=sampling),
                          then, room=room,
                          counts=self._clamp(num_drafts))

    def after_verify(self, num_accepted: int, state: Any) -> None:
        entry = self.model.seqs.get(id(state))
        k = entry[1].k if entry is not None and entry[0] is state else 0

        def then(_: Any) -> None:
            self.model.verify(state, int(num_accepted))
            if self.truth is not None:
                self.truth.verify(state, int(num_accepted))

        return self._call(lambda: self.prop.after_verify(num_accepted, state), then,
                          counts=_verify_counts(k, int(num_accepted)))

    def propose_tree(self, last_token: int, target_hidden: Any, position: int, state: Any, widths: Any = None,
                     shape: Any = None, grammar_bitmask: Any = None) -> Any:
        """A draft tree (a grammar callable is asked again by the model: give a pure one)."""
        def then(tree: Any) -> None:
            hn = self._hn(state)
            self.model.propose_tree(state, last_token, target_hidden, position, tree, grammar_bitmask)
            greedy = self.model.of(state).drafts
            assert self.prop.read_deferred_draft_token(state) == greedy[-1], "read_deferred_draft_token after a tree"
            if self.truth is not None:
                self.truth.propose(state, last_token, target_hidden, position, hn, greedy, "propose_tree")

        def room():
            s = self.model.of(state)
            depth = len(widths) if widths is not None else max(len(p) for p in shape)
            return [(s, self.model.rows_after_propose(s, position, depth))]

        # a tree's other lines take blocks outside any budget (mtpkern.tree): the budget rule holds
        # for a chain-shaped tree only
        chain = all(w == 1 for w in widths) if widths is not None else all(set(p) == {0} for p in shape)
        return self._call(lambda: self.prop.propose_tree(last_token, target_hidden, position, state, widths, shape,
                                                         grammar_bitmask), then, room=room if chain else None)

    def after_verify_tree(self, path: Any, state: Any) -> None:
        entry = self.model.seqs.get(id(state))
        k = entry[1].k if entry is not None and entry[0] is state else 0
        tree = getattr(getattr(state, "_tree", None), "tree", None)

        def then(_: Any) -> None:
            toks = [int(tree.tokens[i]) for i in path]
            self.model.verify_tree(state, toks)
            if self.truth is not None:
                self.truth.verify(state, toks, "after_verify_tree")

        return self._call(lambda: self.prop.after_verify_tree(path, state), then,
                          counts=_verify_counts(k, len(path)))

    def propose_tree_batch(self, last_tokens: Any, target_hiddens: Any, positions: Any, states: Any,
                           widths: Any = None, shape: Any = None, grammar_bitmask: Any = None) -> Any:
        """Batched draft trees: each state's tree checked as the model's ``propose_tree`` of
        that state (the layout's rules, and with weights every node against the oracle)."""
        def shapes() -> list:
            return check_shapes(widths, shape, self.prop.num_modules, len(states))

        def then(trees: Any) -> None:
            assert len(trees) == len(states), f"{len(trees)} trees for {len(states)} states"
            hns = [self._hn(st) for st in states]
            for i, (st, tree) in enumerate(zip(states, trees)):
                gm = None if grammar_bitmask is None else grammar_bitmask[i]
                self.model.propose_tree(st, last_tokens[i], target_hiddens[i], positions[i], tree, gm)
                greedy = self.model.of(st).drafts
                assert self.prop.read_deferred_draft_token(st) == greedy[-1], "read_deferred_draft_token after a tree"
            for i, st in enumerate(states):
                if self.truth is not None:
                    self.truth.propose(st, last_tokens[i], target_hiddens[i], positions[i], hns[i],
                                       self.model.of(st).drafts, "propose_tree_batch", f"[{i}]")

        def room():
            return [(self.model.of(st), self.model.rows_after_propose(self.model.of(st), p, D))
                    for st, p, (_, _, D) in zip(states, positions, shapes())]

        def chain() -> bool:
            return all(all(w == 1 for w in ws) if ws is not None else all(c == 1 for c in counts.values())
                       for ws, counts, _ in shapes())

        def call():
            return self.prop.propose_tree_batch(last_tokens, target_hiddens, positions, states, widths, shape,
                                                grammar_bitmask)

        # the budget rule holds for chain-shaped trees only (a tree's other lines are outside any budget)
        try:
            is_chain = chain()
        except (TypeError, ValueError):                     # refused by the call too (checked there)
            is_chain = False
        return self._call(call, then, room=room if is_chain else None)

    def after_verify_tree_batch(self, paths: Any, states: Any) -> None:
        ks, trees = [], []
        for st in states:
            entry = self.model.seqs.get(id(st))
            ks.append(entry[1].k if entry is not None and entry[0] is st else 0)
            trees.append(getattr(getattr(st, "_tree", None), "tree", None))

        def then(_: Any) -> None:
            for st, path, tree in zip(states, paths, trees):
                toks = [int(tree.tokens[i]) for i in path]
                self.model.verify_tree(st, toks)
                if self.truth is not None:
                    self.truth.verify(st, toks, "after_verify_tree_batch")

        def counts(c: tuple) -> tuple:
            for k, path in zip(ks, paths):
                c = _verify_counts(k, len(path))(c)
            return c

        return self._call(lambda: self.prop.after_verify_tree_batch(paths, states), then, counts=counts)

    def catchup_drafter(self, tokens: Any, hiddens: Any, state: Any) -> int:
        return self.catchup_batch([tokens], [hiddens], [state], single=True)

    def catchup_batch(self, tokens: Any, hiddens: Any, states: Any, single: bool = False) -> int:
        def then(rows: int) -> None:
            hns = [self._hn(st) for st in states]
            want = sum(self.model.catchup(st, tk, hd) for tk, hd, st in zip(tokens, hiddens, states))
            assert rows == want, f"catch-up wrote {rows} rows, expected {want}"
            for i, (tk, hd, st) in enumerate(zip(tokens, hiddens, states)):
                if self.truth is not None:
                    self.truth.catchup(st, tk, hd, hns[i], "catchup_drafter" if single else "catchup_batch",
                                       "" if single else f"[{i}]")

        def room():
            return [(self.model.of(st), self.model.rows_after_catchup(self.model.of(st), tk))
                    for tk, st in zip(tokens, states)]

        if single:
            return self._call(lambda: self.prop.catchup_drafter(tokens[0], hiddens[0], states[0]), then, room=room)
        return self._call(lambda: self.prop.catchup_batch(tokens, hiddens, states), then, room=room)

    # -- carry ------------------------------------------------------------------------
    def _and_truth(self, move: Callable[[Any], None], truth: Callable[[Any], None]) -> Callable[[Any], None]:
        """``move(result)`` of the model, then ``truth(result)`` when a target checks the calls."""
        def then(out: Any) -> None:
            move(out)
            if self.truth is not None:
                truth(out)
        return then

    def take_drafter_kv(self, state: Any) -> Any:
        return self._call(lambda: self.prop.take_drafter_kv(state),
                          self._and_truth(lambda kv: self.model.take(state, kv),
                                          lambda kv: kv is not None and self.truth.move(state, kv)))

    def install_drafter_kv(self, state: Any, carried: Any) -> bool:
        return self._call(lambda: self.prop.install_drafter_kv(state, carried),
                          self._and_truth(lambda _: self.model.install(state, carried),
                                          lambda _: self.truth.move(carried, state)))

    def fork_state(self, state: Any) -> Any:
        return self._call(lambda: self.prop.fork_state(state),
                          self._and_truth(lambda st: self.model.fork(state, st), lambda st: self.truth.copy(state, st)))

    def share_prefix(self, source: Any, prefix_tokens: Any) -> Any:
        return self._call(lambda: self.prop.share_prefix(source, prefix_tokens),
                          self._and_truth(lambda st: self.model.share(source, st, len(prefix_tokens)),
                                          lambda st: self.truth.copy(source, st, prefix_tokens)))

    def free_drafter_kv(self, carried: Any) -> None:
        return self._call(lambda: self.prop.free_drafter_kv(carried),
                          self._and_truth(lambda _: self.model.free_carried(carried),
                                          lambda _: self.truth.free(carried)))


def _verify_counts(k: int, a: int) -> Callable[[tuple], tuple]:
    """The counters a verify of ``k`` drafts accepting ``a`` moves."""
    def counts(c: tuple) -> tuple:
        drafted = tuple(d + (m < k) for m, d in enumerate(c[0]))
        accepted = tuple(x + (m < a) for m, x in enumerate(c[1]))
        reached = tuple(r + (m < k and m <= a) for m, r in enumerate(c[5]))
        return drafted, accepted, c[2] + 1, c[3] + a, c[4], reached
    return counts


def checked(prop: Any, weights: Any = None, target: Any = None, tol: str = "float32") -> CheckedProposer:
    """``prop`` with every call checked; ``weights``: host FP32 weights for the oracle
    (``reference_weights(ckpt_dir)``; tiny models only), or None. ``target``: a
    ``ReferenceTarget`` of the engine's checkpoint, for the kit's own sequences (give it a
    target of its own: its pools fill with them), or None; then every hidden and token the
    engine hands in is checked against it (``mtpkern.testing.truth``), each hidden within
    ``tolerance.TOLERANCE[tol]`` (``"bfloat16"`` for an engine whose target runs in BF16)."""
    return CheckedProposer(prop, weights, target, tol)
