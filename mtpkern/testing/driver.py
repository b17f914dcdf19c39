"""Random call sequences over many sequences of one proposer, as data.

A ``Call`` names a kind of step and the numbers it needs; ``Driver.run(call)``
turns it into real proposer calls through a ``CheckedProposer`` (every call
checked against the model; a failed call must change nothing), picking the
sequence among those the step applies to (``pick`` modulo their count) and
drawing tokens, hiddens and masks from ``seed``. A call that applies to no
sequence does nothing. ``mtpkern.testing.strategies`` draws ``Call`` lists;
the state machine (``mtpkern.testing.machine``) runs the same steps as rules.

Kinds (``KINDS``): ``alloc`` (with or without a budget), ``prefill``,
``propose`` (grammar masks of every form, one that allows nothing, skipped
positions in draft mode; half of them asking for the drafts' confidences, some stopping
early at a random ``min_confidence``), ``propose_batch``, ``tree`` (a draft tree of random widths or a static shape, verified
along a random path at once or by a later ``verify``; some unmasked ones of no drafts,
a checked no-op; now and then ``propose_tree_batch`` over several ready states, one
widths / shape for all or one each, verified by ``after_verify_tree_batch`` or one by one),
``verify``, ``catchup`` (the accepted drafts, in both modes; also
extending the sequence past them: steps decoded without drafting), ``round`` (propose, verify and
catch-up with checks between), ``take`` / ``install`` / ``free_carried``
(carrying KV across turns), ``fork`` (a state sharing every block of another) and
``share`` (a state sharing the rows of a prefix of another's tokens, ``share_prefix``),
``free``, ``bad_input`` (refused input, a copied
state or carried entry, another proposer's state) and ``reenter`` (a grammar
callback that calls back into the proposer with the state in use).

With a ``target`` (``Driver(prop, weights, max_states, target)``) the hiddens and verified
tokens are the target's instead of random ones, and the kit checks them (``Driver``).
"""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import KvCacheFull, NoAllowedToken, StateError
from ..ops.sampling import SamplingParams
from .checked import CheckedProposer, checked
from .model import SeqModel

KINDS = ("alloc", "prefill", "propose", "propose_batch", "verify", "catchup", "round", "take", "install",
         "free_carried", "free", "bad_input", "reenter", "tree", "fork", "share")
MASKS = ("none", "one", "per_position", "callable", "none_allowed")
BAD = ("token", "hidden", "dtype", "nan", "accepted", "position", "drafts", "foreign", "copy_state", "copy_carried",
       "bool", "huge")
#: the integer forms a count, position or id may take (docs/api.md, "Integers"): the driver
#: passes each argument in one of them at random
INT_FORMS = (int, np.int64, np.int32, np.uint32, lambda v: np.array(v, np.int64))
REENTER = ("free_state", "take_drafter_kv", "propose", "after_verify", "catchup_drafter")


@dataclass(frozen=True)
class Call:
    """One step: ``kind``, and ``pick`` (which applicable sequence), ``seed`` (its data),
    ``size`` (prompt length, drafts, batch width or budget), ``frac`` (the accepted share
    of the drafts), ``variant`` (mask form, bad-input kind, callback call)."""

    kind: str
    pick: int = 0
    seed: int = 0
    size: int = 1
    frac: float = 0.5
    variant: str = ""


class Driver:
    """Runs ``Call``s on one proposer, checking everything after every call.

    ``prop``: a ``MultiModuleMtpHead`` (wrapped with ``checked(prop, weights, target)``) or a
    ``CheckedProposer``. With a ``target`` (a ``ReferenceTarget``; or a ``CheckedProposer``
    that has one) the steps hand in what a correct engine would: every hidden the target's at
    its position, each propose's token the target's next one, acceptances never above the
    target's (a tree's path along its greedy tokens), the bonus first in a catch-up that
    extends past a verify, a draft-mode catch-up before the next propose, no skipped
    positions; the kit then checks all of them against the target. ``max_states``: live states
    at most (``alloc`` beyond does nothing). ``steps`` counts the proposer calls made, by kind;
    ``accepted`` the drafts the verifies accepted."""

    def __init__(self, prop: Any, weights: Any = None, max_states: int = 4, target: Any = None):
        self.p: CheckedProposer = prop if isinstance(prop, CheckedProposer) else checked(prop, weights, target)
        #: with a target: the kit's view of each sequence, which every hidden and verified token is drawn from
        self.truth = self.p.truth
        self.prop = self.p.prop
        self.model = self.p.model
        self.cfg = self.prop.config
        self.M = self.prop.num_modules
        self.max_states = max_states
        self.carried: list[Any] = []
        self.steps: Counter = Counter()
        #: drafts accepted by the verifies (chains and trees)
        self.accepted = 0
        self._other: Any = None
        #: whether the proposer's LM heads sample drafts (then some proposes pass ``sampling=``)
        self.samples = all(getattr(getattr(h, "lm", None), "samples", False) for h in self.prop.modules)

    # -- the public loop ------------------------------------------------------------------
    def run(self, call: Call) -> bool:
        """Run one step; False when it applied to nothing."""
        if call.kind not in KINDS:
            raise ValueError(f"call.kind: expected one of {KINDS}, got {call.kind!r}")
        done = getattr(self, f"_{call.kind}")(call, np.random.default_rng(call.seed))
        return done is not False

    def run_all(self, calls: list[Call]) -> None:
        for c in calls:
            self.run(c)
        self.model.check()

    def close(self) -> None:
        """Free every state and carried entry; no block may stay in use."""
        for st in [st for st, _ in self.model.seqs.values()]:
            self.p.free_state(st)
        for kv in self.carried:
            self.p.free_drafter_kv(kv)
        self.carried = []
        self.model.check()
        assert self.prop.kv_blocks_in_use() == [0] * self.M, "blocks still in use after every state was freed"
        if self.truth is not None:
            tgt = self.truth.target
            assert not self.truth.lines and tgt.kv_blocks_in_use() == [0] * len(tgt.layers), \
                "the kit's target sequences outlived their states"

    # -- helpers ---------------------------------------------------------------------------
    def _choose(self, call: Call, phases: tuple[str, ...]) -> tuple[Any, SeqModel] | None:
        cands = [(st, s) for st, s in self.model.seqs.values() if s.phase in phases]
        if not cands:
            return None
        return cands[call.pick % len(cands)]

    @staticmethod
    def _int(rng: np.random.Generator, v: int) -> Any:
        """``v`` in one of ``INT_FORMS``, drawn from ``rng``."""
        return INT_FORMS[int(rng.integers(0, len(INT_FORMS)))](v)

    def _h(self, rng: np.random.Generator, n: int = 1) -> np.ndarray:
        return rng.standard_normal((n, self.cfg.stream_size)).astype(np.float32)

    # -- with a target: what a correct engine hands in ----------------------------------------
    def _forward(self, tokens: list[int]) -> Any:
        """The target's prefill of ``tokens`` on a scratch sequence (hiddens, greedy tokens)."""
        return self.truth.forward(tokens)

    def _head(self, st: Any, s: SeqModel, rng) -> tuple[int, np.ndarray, int]:
        """``(t_P, h_{P-1}, P)`` of the next propose: random ones, or with a target the right ones."""
        if self.truth is None:
            return int(rng.integers(0, self.cfg.vocab_size)), self._h(rng)[0], s.next_position
        if s.accepted:              # draft mode takes a propose past a skipped catch-up; an engine catches up
            self._catchup_one(st, s, Call("catchup"), rng)
        line = self.truth.lines[id(st)]
        return line.next_token, line.hiddens[line.length - 1], line.length

    def _skip(self, call: Call, rng) -> int:
        """Positions a draft-mode propose skips (none with a target: a skipped catch-up is a bug there)."""
        if self.model.mode != "draft" or call.variant != "skip" or self.truth is not None:
            return 0
        return int(rng.integers(0, 3))

    def _target_accepts(self, st: Any, drafts: list[int]) -> int:
        """How many of ``drafts`` (after the pending propose's ``t_P``) the target's greedy accepts."""
        line = self.truth.lines[id(st)]
        greedy = self._forward(line.seq.tokens + [line.last_token] + list(drafts)).greedy[line.P:]
        a = 0
        while a < len(drafts) and drafts[a] == int(greedy[a]):
            a += 1
        return a

    def _catchup_hiddens(self, st: Any, hn: int, toks: list[int], rng) -> np.ndarray:
        """Hiddens ``h_hn .. h_{hn+c-1}`` of a catch-up of ``toks`` (positions ``hn + 1 ..``)."""
        if self.truth is None:
            return self._h(rng, len(toks))
        line = self.truth.lines[id(st)]
        new = toks[line.length - hn - 1:]                       # the tokens past the committed ones
        hid = self._forward(line.seq.tokens + new).hiddens if new else np.stack(line.hiddens)
        return np.ascontiguousarray(hid[hn:hn + len(toks)])

    def _count(self, kind: str, calls: int = 1) -> None:
        self.steps[kind] += calls

    def _mask(self, rng: np.random.Generator, variant: str) -> Any:
        W = self.cfg.bitmask_words

        def words(*shape):
            return rng.integers(-2**31, 2**31 - 1, shape, dtype=np.int64).astype(np.int32)

        if variant == "one":
            return words(W)
        if variant == "per_position":
            return words(max(2, self.M), W)
        if variant == "callable":
            rows = words(self.M, W)
            return lambda i, drafts: rows[i]
        if variant == "none_allowed":
            return np.zeros(W, np.int32)
        return None

    # -- steps ------------------------------------------------------------------------------
    def _alloc(self, call: Call, rng) -> bool:
        if len(self.model.seqs) >= self.max_states:
            return False
        self._count("alloc")
        try:
            if call.variant == "budget":
                self.p.alloc_state_for(max(1, call.size))
            else:
                self.p.alloc_state()
        except KvCacheFull:
            pass
        return True

    def _prefill(self, call: Call, rng) -> bool:
        pick = self._choose(call, ("fresh",))
        if pick is None:
            return False
        st, s = pick
        n = max(1, call.size)
        self._count("prefill")
        try:
            toks = rng.integers(0, self.cfg.vocab_size, n).tolist()
            hid = self._h(rng, n) if self.truth is None else self._forward(toks).hiddens
            self.p.prefill_drafter(toks, hid, st)
        except KvCacheFull:                  # the checked proxy asserts the budget rule
            pass
        return True

    def _sampling(self, call: Call, salt: int) -> Any:
        """A ``SamplingParams`` for about a third of the proposes (when the heads sample), or
        None; drawn from its own generator so the call sequence is the one without it."""
        if not self.samples:
            return None
        r = np.random.default_rng([call.seed, call.pick, call.size, salt, 0x5A])
        if r.random() >= 0.35:
            return None
        self._count("sampled")
        return SamplingParams(float(r.choice([0.3, 0.7, 1.0, 2.5])), int(r.choice([0, 0, 1, 4])),
                              float(r.choice([1.0, 1.0, 0.8, 0.3])), int(r.integers(0, 2**63)))

    def _propose_one(self, st: Any, s: SeqModel, call: Call, rng) -> bool:
        """One propose; True when it drafted."""
        k = max(1, call.size)
        tok, h, P = self._head(st, s, rng)
        P += self._skip(call, rng)
        mask = self._mask(rng, call.variant)
        self._count("propose")
        conf = [] if rng.random() < 0.5 else None               # half the calls ask for confidences,
        stop = float(rng.uniform(0.05, 0.9)) if rng.random() < 0.3 else None   # some stop early
        try:
            d = self.p.propose(self._int(rng, tok), h, self._int(rng, P), self._int(rng, k), st,
                               grammar_bitmask=mask, out_conf=conf, min_confidence=stop,
                               sampling=self._sampling(call, P))
        except NoAllowedToken:
            # a mask may allow tokens outside a draft vocabulary only
            assert call.variant == "none_allowed" or getattr(self.prop, "draft_vocab", None) is not None, \
                "NoAllowedToken without a mask that allows nothing"
            return False
        except KvCacheFull:
            return False
        assert call.variant != "none_allowed", "a mask that allows nothing drafted"
        assert self.prop.read_deferred_draft_token(st) == d[-1]
        return True

    def _no_drafts(self, st: Any, s: SeqModel, rng) -> None:
        """A step without drafting: ``propose(..., num_drafts=0)``, a checked no-op (the step's
        token reaches the drafter by a later ``catchup`` that extends the sequence)."""
        tok, h, P = self._head(st, s, rng)
        self._count("propose")
        self.p.propose(tok, h, P, 0, st)

    def _propose(self, call: Call, rng) -> bool:
        pick = self._choose(call, ("ready",))
        if pick is None:
            return False
        if call.variant == "none" and call.size == 5:
            self._no_drafts(*pick, rng)          # K = 0 (some of the unmasked proposes)
            return True
        self._propose_one(*pick, call, rng)
        return True

    def _propose_batch(self, call: Call, rng) -> bool:
        ready = [(st, s) for st, s in self.model.seqs.values() if s.phase == "ready"]
        if not ready:
            return False
        start = call.pick % len(ready)
        group = (ready[start:] + ready[:start])[:max(1, min(call.size, len(ready)))]
        k = int(rng.integers(1, self.M + 2))
        masks = [self._mask(rng, str(rng.choice(["none", "one", "callable"]))) for _ in group]
        self._count("propose_batch")
        try:
            heads = [self._head(st, s, rng) for st, s in group]
            self.p.propose_batch([t for t, _, _ in heads], [h for _, h, _ in heads], [P for _, _, P in heads], k,
                                 [st for st, _ in group], masks, out_conf=[] if rng.random() < 0.5 else None,
                                 min_confidence=float(rng.uniform(0.05, 0.9)) if rng.random() < 0.3 else None,
                                 sampling=[self._sampling(call, 1000 + i) for i in range(len(group))])
        except KvCacheFull:
            pass
        return True

    def _verify_one(self, st: Any, s: SeqModel, frac: float) -> None:
        if s.tree is not None:
            return self._verify_tree(st, s, frac)
        self._count("verify")
        a = int(round(min(max(frac, 0.0), 1.0) * s.k))
        if self.truth is not None:                  # never more than the target accepts
            a = min(a, self._target_accepts(st, s.drafts))
        self.accepted += a
        self.p.after_verify(INT_FORMS[int(frac * 997) % len(INT_FORMS)](a), st)

    def _tree_path(self, st: Any, frac: float) -> list[int]:
        """A random path: ``frac`` of the depth, each step a child picked by ``frac``'s digits;
        with a target, the child holding the target's greedy token (the path ends without one)."""
        tree = st._tree.tree
        a = int(round(min(max(frac, 0.0), 1.0) * tree.depth))
        path, e = [], -1
        if self.truth is not None:
            line = self.truth.lines[id(st)]
            prefix = line.seq.tokens + [line.last_token]
        for j in range(a):
            kids = tree.children(e)
            if self.truth is not None:
                g = self._forward(prefix).next_token
                kids = [c for c in kids if int(tree.tokens[c]) == g]
                prefix.append(g)
            if not kids:
                break
            e = kids[int(frac * 10 ** (j + 1)) % len(kids)]
            path.append(e)
        return path

    def _verify_tree(self, st: Any, s: SeqModel, frac: float) -> None:
        """One tree's verify; now and then, with every other state awaiting a tree's verify
        (``after_verify_tree_batch``, each along its own path)."""
        others = [o for o, so in self.model.seqs.values() if so.tree is not None and o is not st]
        if others and int(frac * 7919) % 3 == 0:
            group = [st] + others
            paths = [self._tree_path(o, (frac * (i + 1) * 1.618) % 1.0) for i, o in enumerate(group)]
            self._count("verify_tree", len(group))
            self._count("verify_tree_batch")
            self.accepted += sum(len(p) for p in paths)
            self.p.after_verify_tree_batch(paths, group)
            return
        path = self._tree_path(st, frac)
        self._count("verify_tree")
        self.accepted += len(path)
        self.p.after_verify_tree(path, st)

    def _tree_shape(self, rng) -> tuple[Any, Any]:
        """Random widths (3 in 4) or a static shape: the rank-0 path, and a sibling at random depths."""
        D = int(rng.integers(1, self.M + 1))
        if rng.random() < 0.75:
            return [self._int(rng, int(w)) for w in rng.integers(1, 3, D)], None
        shape = [[0] * d for d in range(1, D + 1)]
        return None, shape + [[0] * d + [1] for d in range(D) if rng.random() < 0.6]

    def _tree(self, call: Call, rng) -> bool:
        pick = self._choose(call, ("ready",))
        if pick is None:
            return False
        ready = [(st, s) for st, s in self.model.seqs.values() if s.phase == "ready"]
        if len(ready) > 1 and rng.random() < 0.4:
            return self._tree_batch(call, rng, ready)
        st, s = pick
        widths, shape = self._tree_shape(rng)
        mask = self._mask(rng, str(rng.choice(["none", "one", "callable"])))   # pure masks: the model asks again
        self._count("tree")
        tok, h, P = self._head(st, s, rng)
        try:
            self.p.propose_tree(tok, h, P + self._skip(call, rng), st, widths=widths, shape=shape, grammar_bitmask=mask)
        except (KvCacheFull, NoAllowedToken):
            return True
        if rng.random() < 0.5:
            self._verify_tree(st, s, call.frac)
        return True

    def _tree_batch(self, call: Call, rng, ready: list) -> bool:
        """``propose_tree_batch`` over some ready states: one widths / shape for all or one each,
        a mask (or none) each; verified at once (batched) or by later verifies."""
        start = call.pick % len(ready)
        group = (ready[start:] + ready[:start])[:max(2, min(call.size + 1, len(ready)))]
        B = len(group)
        widths, shape = self._tree_shape(rng)
        if rng.random() < 0.5:                  # one each, of the same kind (widths, or static shapes)
            many = [self._tree_shape(rng) for _ in range(B)]
            widths = [w or [1] for w, _ in many] if widths is not None else None
            shape = [sh or [[0]] for _, sh in many] if shape is not None else None
        masks = [self._mask(rng, str(rng.choice(["none", "one", "callable"]))) for _ in group]
        skip = self._skip(call, rng)
        heads = [self._head(st, s, rng) for st, s in group]
        self._count("tree", B)
        self._count("tree_batch")
        try:
            self.p.propose_tree_batch([t for t, _, _ in heads], np.stack([h for _, h, _ in heads]),
                                      [P + skip for _, _, P in heads], [st for st, _ in group],
                                      widths=widths, shape=shape, grammar_bitmask=masks)
        except (KvCacheFull, NoAllowedToken):
            return True
        if rng.random() < 0.5:
            paths = [self._tree_path(st, float(rng.random())) for st, _ in group]
            self._count("verify_tree", B)
            self._count("verify_tree_batch")
            self.accepted += sum(len(p) for p in paths)
            self.p.after_verify_tree_batch(paths, [st for st, _ in group])
        return True

    def _verify(self, call: Call, rng) -> bool:
        pick = self._choose(call, ("drafted",))
        if pick is None:
            return False
        self._verify_one(*pick, call.frac)
        return True

    def _catchup_one(self, st: Any, s: SeqModel, call: Call, rng) -> None:
        a = s.accepted if s.phase == "catchup" or self.model.mode == "draft" else 0    # draft: left after a verify
        toks = s.drafts[:a]
        if call.variant == "extend" and s.phase in ("ready", "catchup") and s.tokens:      # a step without drafting
            more = rng.integers(0, self.cfg.vocab_size, int(rng.integers(1, 3))).tolist()
            line = None if self.truth is None else self.truth.lines[id(st)]
            if line is not None and line.bonus_due and len(s.hiddens) + len(toks) + 1 == line.length:
                more[0] = line.next_token               # right after a verify: its bonus token comes first
            toks = toks + more
        hid = self._catchup_hiddens(st, len(s.hiddens), toks, rng)
        self._count("catchup")
        try:
            self.p.catchup_drafter(toks, hid, st)
        except KvCacheFull:
            pass

    def _catchup(self, call: Call, rng) -> bool:
        pick = self._choose(call, ("catchup", "ready"))
        if pick is None:
            return False
        self._catchup_one(*pick, call, rng)
        return True

    def _round(self, call: Call, rng) -> bool:
        pick = self._choose(call, ("ready",))
        if pick is None:
            return False
        st, s = pick
        if self._propose_one(st, s, Call("propose", size=call.size, variant="none"), rng):
            self._verify_one(st, s, call.frac)
            self._catchup_one(st, s, call, rng)
        return True

    def _take(self, call: Call, rng) -> bool:
        pick = self._choose(call, ("ready",))
        if pick is None:
            return False
        st, s = pick
        rows0, last0 = self.prop.drafter_rows(st), self.prop.last_pair_key(st)
        self._count("take")
        kv = self.p.take_drafter_kv(st)
        if kv is not None:
            assert (kv.rows, kv.last_pair_key) == (rows0, last0)
            self.carried.append(kv)
        return True

    def _install(self, call: Call, rng) -> bool:
        pick = self._choose(call, ("fresh",))
        if pick is None or not self.carried:
            return False
        kv = self.carried.pop(int(call.size) % len(self.carried))
        self._count("install")
        self.p.install_drafter_kv(pick[0], kv)
        try:
            self.p.install_drafter_kv(pick[0], kv)
            raise AssertionError("a carried entry was installed twice")
        except StateError:
            pass
        return True

    def _free_carried(self, call: Call, rng) -> bool:
        if not self.carried:
            return False
        kv = self.carried.pop(int(call.size) % len(self.carried))
        self._count("free_carried")
        self.p.free_drafter_kv(kv)
        try:
            self.p.free_drafter_kv(kv)
            raise AssertionError("a carried entry was freed twice")
        except StateError:
            pass
        return True

    def _fork(self, call: Call, rng) -> bool:
        pick = self._choose(call, ("fresh", "ready", "catchup"))
        if pick is None or len(self.model.seqs) >= self.max_states:
            return False
        self._count("fork")
        try:
            self.p.fork_state(pick[0])
        except KvCacheFull:         # a budgeted source's copy of its shared last block finds no room
            pass                    # (the checked proxy checks that nothing changed)
        return True

    def _share(self, call: Call, rng) -> bool:
        """A prefix of ``frac`` of a sequence's verified tokens (1 at least)."""
        pick = self._choose(call, ("ready", "catchup"))
        if pick is None or len(self.model.seqs) >= self.max_states:
            return False
        st, s = pick
        L = 1 + int(min(max(call.frac, 0.0), 1.0) * (len(s.tokens) - 1))
        self._count("share")
        try:
            # (draft mode: a position a propose skipped holds -1 in the model, a token no one knows)
            self.p.share_prefix(st, [max(0, t) for t in s.tokens[:L]])
        except KvCacheFull:         # as a fork: no room for a budgeted source's copy of its last block
            pass
        except StateError:
            # a sliding-window module of the source released rows this prefix still reads
            if not any(self.cfg.block(m).sliding_window for m in range(self.M)):
                raise
        return True

    def _free(self, call: Call, rng) -> bool:
        if len(self.model.seqs) < 2:                   # keep one sequence alive
            return False
        pick = self._choose(call, ("fresh", "ready", "drafted", "catchup"))
        st = pick[0]
        self._count("free")
        self.p.free_state(st)
        try:
            self.prop.propose(0, self._h(rng)[0], 1, 1, st)
            raise AssertionError("a freed state was used")
        except StateError:
            pass
        return True

    def _bad_input(self, call: Call, rng) -> bool:
        pick = self._choose(call, ("ready", "drafted"))
        if pick is None:
            return False
        st, s = pick
        what = call.variant or "token"
        P, H, V = s.next_position, self.cfg.stream_size, self.cfg.vocab_size
        h = self._h(rng)[0]
        self._count("bad_input")
        try:
            if s.phase == "drafted" and s.tree is not None:          # a tree awaits its verify
                tree = st._tree.tree
                if what == "accepted":                               # a node that is not a root's child
                    self.p.after_verify_tree([len(tree) - 1] if tree.depth > 1 else [len(tree)], st)
                elif what == "position":
                    self.p.after_verify(0, st)                       # a chain's verify
                else:
                    self.p.propose_tree(0, h, P, st, widths=[1])
            elif s.phase == "drafted":
                if what == "accepted":
                    self.p.after_verify(s.k + 1, st)
                else:
                    self.p.propose(0, h, P, 1, st)                           # a verify is pending
            elif what == "token":
                self.p.propose(V, h, P, 1, st)
            elif what == "bool":                                     # True is an int to Python, not a count
                self.p.propose(0, h, P, True, st)
            elif what == "huge":                                     # uint64's max: out of range, never -1
                self.p.propose(np.uint64(2**64 - 1), h, P, 1, st)
            elif what == "hidden":
                self.p.propose(0, np.zeros(H + 1, np.float32), P, 1, st)
            elif what == "dtype":
                self.p.propose(0, h.astype(np.float64), P, 1, st)
            elif what == "nan":
                self.p.propose(0, np.full(H, np.nan, np.float32), P, 1, st)
            elif what == "position":
                self.p.propose(0, h, P - 1, 1, st)
            elif what == "drafts":
                if call.size % 2:
                    self.p.propose(0, h, P, -1, st)
                else:                                               # deeper than the draft steps
                    self.p.propose_tree(0, h, P, st, widths=[1] * (self.M + 1))
            elif what == "foreign":
                self.p.propose(0, h, P, 1, self._foreign_state())
            elif what == "copy_state":
                self.p.propose(0, h, P, 1, copy.copy(st))
            elif what == "copy_carried" and self.carried:
                self.p.free_drafter_kv(copy.copy(self.carried[call.size % len(self.carried)]))
            else:
                self.p.propose(0, h, P, 1, copy.deepcopy(st))
            raise AssertionError(f"bad input ({what}) was accepted")
        except (ValueError, TypeError, StateError):
            pass                                             # the checked proxy saw nothing change
        return True

    def _foreign_state(self) -> Any:
        if self._other is None:
            from ..proposer import MultiModuleMtpHead

            self._other = MultiModuleMtpHead(self.cfg, self.prop.weights, self.prop.backend,
                                             kv_mode=self.prop.kv_mode, num_blocks=4, block_size=4)
        return self._other.alloc_state()

    def _reenter(self, call: Call, rng) -> bool:
        pick = self._choose(call, ("ready",))
        if pick is None:
            return False
        st, s = pick
        what = call.variant or "free_state"
        prop, h = self.prop, self._h(rng)[0]
        inner = {"free_state": lambda: prop.free_state(st), "take_drafter_kv": lambda: prop.take_drafter_kv(st),
                 "propose": lambda: prop.propose(1, h, s.next_position, 1, st),
                 "after_verify": lambda: prop.after_verify(0, st),
                 "catchup_drafter": lambda: prop.catchup_drafter([1], h[None], st)}[what]
        refused = []

        def grammar(i, drafts):
            try:
                inner()
            except StateError as e:
                refused.append(e)
                raise
            raise AssertionError(f"a callback's {what} on the state in use was accepted")

        self._count("reenter")
        try:
            self.p.propose(1, h, s.next_position, 2, st, grammar_bitmask=grammar)
            raise AssertionError("a propose whose callback raised succeeded")
        except StateError as e:
            assert refused and "in use" in str(e), e
        except KvCacheFull:                     # no room: the callback never ran
            assert not refused
        return True
