"""Hypothesis drives one proposer with many sequences through random call orders.

After every step: the pools' accounting (every block free or owned by exactly
one sequence-module or carried entry, reservations consistent), every state's
own rules, and a model of the rows each module must hold (SPEC section 2 in
draft mode, the exact-mode rule otherwise; in exact mode drafts are also
compared with the from-scratch oracle). Failed calls (full pool, bad input,
a grammar that allows nothing) must leave everything as it was.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as hs
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import oracle
from mtpkern import KvCacheFull, MultiModuleMtpHead, NoAllowedToken, StateError
from mtpkern.backends import get_backend
from mtpkern.config import tiny_config
from mtpkern.weights import load_weights, write_synthetic_checkpoint

CFG = tiny_config()
MAX_STATES = 4
_CKPT: dict = {}


def _ckpt(tmp_root):
    if "path" not in _CKPT:
        _CKPT["path"] = write_synthetic_checkpoint(tmp_root / "sm_ckpt", CFG, seed=21)
        _CKPT["weights"] = load_weights(_CKPT["path"], CFG, get_backend("numpy"))
    return _CKPT["path"], _CKPT["weights"]


@dataclass
class Seq:
    """The test's model of one sequence."""

    keys: list[list[int]]                 # expected keys per module (draft mode)
    tokens: list[int] = field(default_factory=list)    # verified tokens
    hiddens: list = field(default_factory=list)        # consumed target hiddens
    pending_h: object = None             # h_{P-1} of the next propose
    phase: str = "fresh"                 # fresh | ready | drafted | catchup
    P: int = 0
    k: int = 0
    drafts: list[int] = field(default_factory=list)
    accepted: int = 0


class ProposerMachine(RuleBasedStateMachine):
    kv_mode = "exact"
    backend = "numpy"
    tmp_root = None
    steps: Counter = Counter()     # calls made on the proposer, by rule (set per test)

    def __init__(self):
        super().__init__()
        path, self.weights = _ckpt(self.tmp_root)
        self.prop = MultiModuleMtpHead.from_pretrained(path, backend=self.backend, kv_mode=self.kv_mode,
                                                       block_size=4, num_blocks=28, prefill_chunk=5)
        self.other = None
        self.seqs: dict[int, tuple[object, Seq]] = {}     # by allocation number (ids vary between runs)
        self.next_id = 0
        self.carried: list = []
        self.rng = np.random.default_rng(0)
        self.M = self.prop.num_modules

    # -- helpers -------------------------------------------------------------
    def _h(self, n=1):
        return self.rng.standard_normal((n, CFG.hidden_size)).astype(np.float32)

    def _pick(self, data, phase):
        ids = [i for i, (_, s) in self.seqs.items() if s.phase in phase]
        if not ids:
            return None
        i = data.draw(hs.sampled_from(sorted(ids)))
        self._count()
        self._picked = i
        return self.seqs[i]

    def _any(self, phases) -> bool:
        return any(s.phase in phases for _, s in self.seqs.values())

    def _count(self):
        self.steps[self._rule] += 1

    def _fingerprint(self):
        return (tuple(self.prop.kv_blocks_in_use()),
                {i: (tuple(st.rows_per_module()), st.num_verified, st.num_hiddens, tuple(st.tail), st.drafted)
                 for i, (st, _) in self.seqs.items()})

    def _exact_rows(self, s: Seq, T: int) -> list[int]:
        return [max(0, min(len(s.hiddens), T - m - 1)) for m in range(self.M)]

    # -- rules ------------------------------------------------------------------
    @precondition(lambda self: len(self.seqs) < MAX_STATES)
    @rule(budget=hs.one_of(hs.none(), hs.integers(1, 60)))
    def alloc(self, budget):
        self._rule = "alloc"
        self._count()
        before = self._fingerprint()
        try:
            st = self.prop.alloc_state_for(budget) if budget is not None else self.prop.alloc_state()
        except KvCacheFull:
            assert self._fingerprint() == before
            return
        self.seqs[self.next_id] = (st, Seq([[] for _ in range(self.M)]))
        self.next_id += 1

    @precondition(lambda self: self._any(('fresh',)))
    @rule(data=hs.data(), n=hs.integers(1, 18))
    def prefill(self, data, n):
        self._rule = "prefill"
        pick = self._pick(data, ("fresh",))
        if pick is None:
            return
        st, s = pick
        toks = self.rng.integers(0, CFG.vocab_size, n).tolist()
        hid = self._h(n)
        before = self._fingerprint()
        try:
            self.prop.prefill_drafter(toks, hid, st)
        except KvCacheFull:
            assert self._fingerprint() == before
            return
        s.tokens, s.hiddens, s.pending_h = toks, list(hid[:-1]), hid[-1]
        s.keys[0] = list(range(n - 1))
        s.phase = "ready"

    @precondition(lambda self: self._any(('ready',)))
    @rule(data=hs.data(), k=hs.integers(1, 5), masked=hs.sampled_from([None, "one", "none_allowed", "callable"]))
    def propose(self, data, k, masked):
        self._rule = "propose"
        pick = self._pick(data, ("ready",))
        if pick is None:
            return
        self._propose(*pick, k, masked)

    def _propose(self, st, s, k, masked) -> bool:
        P = len(s.tokens)
        t_P = int(self.rng.integers(0, CFG.vocab_size))
        W = CFG.bitmask_words
        mask = None
        if masked == "one":
            mask = self.rng.integers(-2**31, 2**31 - 1, W, dtype=np.int64).astype(np.int32)
        elif masked == "none_allowed":
            mask = np.zeros(W, np.int32)
        elif masked == "callable":
            rows = self.rng.integers(-2**31, 2**31 - 1, (self.M, W), dtype=np.int64).astype(np.int32)
            mask = lambda i, drafts: rows[i]  # noqa: E731
        before = self._fingerprint()
        try:
            drafts = self.prop.propose(t_P, s.pending_h, P, k, st, grammar_bitmask=mask)
        except (KvCacheFull, NoAllowedToken) as e:
            assert masked == "none_allowed" or isinstance(e, KvCacheFull)
            assert self._fingerprint() == before
            return False
        assert masked != "none_allowed"
        kk = min(k, self.M)
        assert len(drafts) == kk
        assert self.prop.read_deferred_draft_token(st) == drafts[-1]
        if mask is not None:
            for i, d in enumerate(drafts):
                words = mask if not callable(mask) else mask(i, drafts[:i])
                assert (int(words[d >> 5]) >> (d & 31)) & 1, f"draft {d} violates the grammar mask"
        s.hiddens.append(s.pending_h)
        s.tokens.append(t_P)
        if self.kv_mode == "exact":
            mfn = None
            if mask is not None:
                mfn = (lambda i, dr: mask(i, dr)) if callable(mask) else (lambda i, dr: mask)
            want = oracle.propose(CFG, self.weights, s.tokens, s.hiddens, k, "prenorm", masks=mfn)
            assert drafts == want
        for m in range(kk):
            s.keys[m].append(P - 1)
        s.phase, s.P, s.k, s.drafts = "drafted", P, kk, drafts
        return True

    @precondition(lambda self: self._any(('drafted',)))
    @rule(data=hs.data(), frac=hs.floats(0, 1))
    def verify(self, data, frac):
        self._rule = "verify"
        pick = self._pick(data, ("drafted",))
        if pick is None:
            return
        self._verify(*pick, frac)

    def _verify(self, st, s, frac) -> None:
        a = int(round(frac * s.k))
        self.prop.after_verify(a, st)
        for m in range(a + 1, s.k):
            s.keys[m].pop()
        s.tokens += s.drafts[:a]
        s.accepted = a
        s.phase = "catchup" if self.kv_mode == "exact" and a else "ready"
        s.pending_h = self._h()[0]

    @precondition(lambda self: self._any(('catchup', 'ready')))
    @rule(data=hs.data())
    def catchup(self, data):
        self._rule = "catchup"
        pick = self._pick(data, ("catchup", "ready"))
        if pick is None:
            return
        self._catchup(*pick)

    def _catchup(self, st, s) -> None:
        a = s.accepted if s.phase == "catchup" else 0
        acc = s.drafts[:a]
        hid = self._h(a)
        before = self._fingerprint()
        try:
            rows = self.prop.catchup_drafter(acc, hid, st)
        except KvCacheFull:
            assert self._fingerprint() == before
            return
        if self.kv_mode == "draft" or a == 0:
            assert rows == 0
        # The hidden list gets h_P .. h_{P+a-1}; h_{P+a} comes with the next propose.
        s.hiddens += list(hid)
        s.accepted = 0
        s.phase = "ready"

    @precondition(lambda self: self._any(("ready",)))
    @rule(data=hs.data(), k=hs.integers(1, 4), frac=hs.floats(0, 1))
    def speculative_round(self, data, k, frac):
        """propose, after_verify, catchup_drafter on one sequence, checking between calls."""
        self._rule = "round"
        pick = self._pick(data, ("ready",))
        if not self._propose(*pick, k, None):
            return
        self.pools_and_states()
        self._verify(*pick, frac)
        self.pools_and_states()
        self._catchup(*pick)
        self.steps["round"] += 2      # three proposer calls in this step

    @precondition(lambda self: self._any(('ready',)))
    @rule(data=hs.data())
    def take(self, data):
        self._rule = "take"
        pick = self._pick(data, ("ready",))
        if pick is None:
            return
        st, s = pick
        rows0, last0 = self.prop.drafter_rows(st), self.prop.last_pair_key(st)
        kv = self.prop.take_drafter_kv(st)
        assert kv is not None
        assert (kv.rows, kv.last_pair_key) == (rows0, last0)
        self.carried.append((kv, s))
        self.seqs[self._picked] = (st, Seq([[] for _ in range(self.M)]))
        assert st.rows_per_module() == [0] * self.M

    @precondition(lambda self: self.carried and self._any(("fresh",)))
    @rule(data=hs.data())
    def install(self, data):
        self._rule = "install"
        if not self.carried:
            return
        pick = self._pick(data, ("fresh",))
        if pick is None:
            return
        st, _ = pick
        kv, s = self.carried.pop(data.draw(hs.integers(0, len(self.carried) - 1)))
        assert self.prop.install_drafter_kv(st, kv)
        self.seqs[self._picked] = (st, s)
        with pytest.raises(StateError):
            self.prop.install_drafter_kv(st, kv)

    @precondition(lambda self: self.carried)
    @rule(data=hs.data())
    def free_carried(self, data):
        self._rule = "free_carried"
        if not self.carried:
            return
        kv, _ = self.carried.pop(data.draw(hs.integers(0, len(self.carried) - 1)))
        self._count()
        self.prop.free_drafter_kv(kv)
        with pytest.raises(StateError):
            self.prop.free_drafter_kv(kv)

    @precondition(lambda self: len(self.seqs) >= 2)
    @rule(data=hs.data())
    def free(self, data):
        self._rule = "free"
        pick = self._pick(data, ("fresh", "ready", "drafted", "catchup"))
        if pick is None:
            return
        st, _ = pick
        self.prop.free_state(st)
        del self.seqs[self._picked]
        with pytest.raises(StateError):
            self.prop.propose(0, self._h()[0], 1, 1, st)

    @precondition(lambda self: self._any(('ready', 'drafted')))
    @rule(data=hs.data(), what=hs.sampled_from(["token", "hidden", "accepted", "position", "foreign", "drafts"]))
    def bad_input(self, data, what):
        self._rule = "bad_input"
        pick = self._pick(data, ("ready", "drafted"))
        if pick is None:
            return
        st, s = pick
        before = self._fingerprint()
        with pytest.raises((ValueError, TypeError, StateError)):
            if what == "accepted" and s.phase == "drafted":
                self.prop.after_verify(s.k + 1, st)
            elif s.phase == "drafted":
                self.prop.propose(0, s.pending_h, len(s.tokens), 1, st)   # verify pending
            elif what == "token":
                self.prop.propose(CFG.vocab_size, s.pending_h, len(s.tokens), 1, st)
            elif what == "hidden":
                self.prop.propose(0, np.zeros(CFG.hidden_size + 1, np.float32), len(s.tokens), 1, st)
            elif what == "position":
                self.prop.propose(0, s.pending_h, len(s.tokens) - 1, 1, st)
            elif what == "foreign":
                if self.other is None:
                    self.other = MultiModuleMtpHead.from_pretrained(_CKPT["path"], backend="numpy", num_blocks=4)
                self.other.propose(0, s.pending_h, len(s.tokens), 1, st)
            else:
                self.prop.propose(0, s.pending_h, len(s.tokens), 0, st)
        assert self._fingerprint() == before

    # -- invariants -----------------------------------------------------------------
    @invariant()
    def pools_and_states(self):
        self.prop.check_invariants()
        for st, s in self.seqs.values():
            st.check_invariants()
            rows = st.rows_per_module()
            if self.kv_mode == "draft":
                for m in range(self.M):
                    assert st.kv[m].keys.to_list() == s.keys[m], f"module {m}"
            elif s.phase != "fresh":
                T = len(s.tokens) + (len(s.drafts) if s.phase == "drafted" else 0)
                assert rows == self._exact_rows(s, T)

    def teardown(self):
        for st, _ in list(self.seqs.values()):
            self.prop.free_state(st)
        for kv, _ in self.carried:
            self.prop.free_drafter_kv(kv)
        self.prop.check_invariants()
        assert self.prop.kv_blocks_in_use() == [0] * self.M, "blocks leaked after every state was freed"


SETTINGS = settings(max_examples=60, stateful_step_count=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
@pytest.mark.parametrize("kv_mode", ["exact", "draft"])
def test_proposer_state_machine(kv_mode, backend, tmp_path_factory):
    cls = type(f"Machine_{kv_mode}_{backend}", (ProposerMachine,),
               {"kv_mode": kv_mode, "backend": backend, "tmp_root": tmp_path_factory.getbasetemp()})
    cls.steps = Counter()
    cls.TestCase.settings = SETTINGS
    cls.TestCase().runTest()
    total = sum(cls.steps.values())
    print(f"{kv_mode}/{backend}: {total} proposer calls: {dict(cls.steps)}")
    # The issue asks for >= 2,000 steps per CI run over both modes.
    assert total >= 1000, f"only {total} proposer calls in {kv_mode} mode: {dict(cls.steps)}"
