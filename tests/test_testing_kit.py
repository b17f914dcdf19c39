"""mtpkern.testing: the kit engines use to property-test an integration.

Its checks must be able to fail: a proposer with a planted bug (the draft-mode trim of
the design mtpkern comes from, `m < a`, a call that changes state before raising, a wrong draft) is
caught at the first call that shows it. The examples in docs/testing.md run
as written.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from conftest import rand_hiddens
from mtpkern.testing import Call, Driver, checked, oracle, reference_weights
from mtpkern.testing.strategies import call_sequences

H, V = 64, 301
DOC = Path(__file__).resolve().parents[1] / "docs" / "testing.md"


def _checked_state(make_prop, mode, seed, weights=None, n=4):
    """A checked proposer and a state prefilled with ``n`` tokens."""
    prop = make_prop(mode)
    d = checked(prop, weights)
    rng = np.random.default_rng(seed)
    st = d.alloc_state()
    d.prefill_drafter(rng.integers(0, V, n).tolist(), rand_hiddens(rng, n, H), st)
    return prop, d, st, rng


def _round(d, st, rng, a):
    drafts = d.propose(1, rand_hiddens(rng, 1, H)[0], st.next_position, 3, st)
    d.after_verify(a, st)
    d.catchup_drafter(drafts[:a], rand_hiddens(rng, a, H), st)


def test_a_correct_run_passes(make_prop, tiny_ckpt):
    prop = make_prop("exact")
    d = checked(prop, reference_weights(tiny_ckpt))
    rng = np.random.default_rng(0)
    st = d.alloc_state()
    d.prefill_drafter(rng.integers(0, V, 8).tolist(), rand_hiddens(rng, 8, H), st)
    for a in (3, 0, 1, 2):
        _round(d, st, rng, a)
    kv = d.take_drafter_kv(st)
    nxt = d.alloc_state()
    d.install_drafter_kv(nxt, kv)
    _round(d, nxt, rng, 2)
    d.free_state(nxt)
    d.free_state(st)
    d.check()


def test_the_seed_designs_trim_is_caught(make_prop, monkeypatch):
    """The Rust engine kept module m's row iff m < a (dropping module a's valid row)."""
    prop, d, st, rng = _checked_state(make_prop, "draft", 1)
    mode = prop.mode

    def seed_trim(state, P, a, k):
        for m in range(a, k):                                   # the bug: m >= a dropped
            mode.modules[m].pool.trim(state.kv[m], 1, state)
        state._num_verified = P + 1 + a

    monkeypatch.setattr(mode, "after_verify", seed_trim)
    d.propose(1, rand_hiddens(rng, 1, H)[0], 4, 3, st)
    with pytest.raises(AssertionError, match=r"module 1: keys \[\], expected \[3\]"):
        d.after_verify(1, st)


def test_a_failed_call_that_changed_state_is_caught(make_prop, monkeypatch):
    prop, d, st, rng = _checked_state(make_prop, "exact", 2)
    real = prop.mode.after_verify

    def half_done(state, P, a, k):
        real(state, P, a, k)
        raise RuntimeError("lost connection")

    monkeypatch.setattr(prop.mode, "after_verify", half_done)
    d.propose(1, rand_hiddens(rng, 1, H)[0], 4, 3, st)
    with pytest.raises(AssertionError, match="a call that raised changed the proposer's state"):
        d.after_verify(0, st)


def test_a_wrong_draft_is_caught_by_the_oracle(make_prop, tiny_ckpt, monkeypatch):
    prop, d, st, rng = _checked_state(make_prop, "exact", 3, reference_weights(tiny_ckpt), n=6)
    real = prop._draft_ids
    def wrong(*a, **kw):
        ids, stops = real(*a, **kw)
        return (ids + 1) % V, stops

    monkeypatch.setattr(prop, "_draft_ids", wrong)
    with pytest.raises(AssertionError, match="differ from the oracle's"):
        d.propose(1, rand_hiddens(rng, 1, H)[0], 6, 2, st)


def test_a_wrong_confidence_is_caught_by_the_oracle(make_prop, tiny_ckpt, monkeypatch):
    """The checked proxy compares out_conf with the oracle's softmax: a confidence off by
    a few percent fails."""
    prop, d, st, rng = _checked_state(make_prop, "exact", 3, reference_weights(tiny_ckpt), n=6)
    real = prop.modules[1].argmax_conf
    monkeypatch.setattr(prop.modules[1], "argmax_conf", lambda normed, bm=None: (real(normed, bm)[0],
                                                                                  real(normed, bm)[1] * 0.97))
    with pytest.raises(AssertionError, match="confidences .* differ from the oracle's softmax"):
        d.propose(1, rand_hiddens(rng, 1, H)[0], 6, 2, st, out_conf=[])


def test_the_oracle_module_is_the_dense_recomputation(make_prop, tiny_ckpt, tiny_cfg):
    prop = make_prop("exact")
    w = reference_weights(tiny_ckpt)
    rng = np.random.default_rng(4)
    toks, hid = rng.integers(0, V, 9).tolist(), rand_hiddens(rng, 9, H)
    st = prop.alloc_state()
    prop.prefill_drafter(toks, hid, st)
    assert prop.propose(5, hid[-1], 9, 3, st) == oracle.propose(tiny_cfg, w, toks + [5], list(hid), 3, "prenorm")


def test_driver_steps_apply_or_do_nothing(make_prop):
    """A call that applies to no sequence does nothing; an unknown kind is refused."""
    drv = Driver(make_prop("exact"))
    assert not drv.run(Call("propose"))
    assert drv.run(Call("alloc"))
    assert drv.run(Call("prefill", size=5))
    assert drv.run(Call("round", size=3, frac=1.0))
    with pytest.raises(ValueError, match="call.kind: expected one of"):
        drv.run(Call("teleport"))
    drv.close()


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(calls=call_sequences(max_size=25))
def test_call_sequences_run_clean(make_prop, calls):
    drv = Driver(make_prop("draft", num_blocks=20))
    drv.run_all(calls)
    drv.close()


def _doc_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)


def test_the_docs_examples_run_as_written(tiny_ckpt):
    """docs/testing.md's four examples, in order, with ``ckpt`` a tiny checkpoint; the fourth's
    reports are the ones the page prints."""
    blocks = _doc_blocks()
    assert len(blocks) == 4
    env = {"ckpt": tiny_ckpt}
    for code in blocks:
        exec(compile(code, str(DOC), "exec"), env)                 # noqa: S102 (the doc's own code)
    assert sum(env["Machine"].steps.values()) > 0
    reports = env["reports"]
    assert sorted(reports) == ["stale_hidden", "wrong_bonus"]
    text = DOC.read_text()
    for bug, report in reports.items():
        assert f"\n{bug}: {report}\n" in text, f"docs/testing.md does not print {bug}'s report: {report}"


# -- what the audit found the kit missing, or refusing wrongly ---------------------------------

def test_masks_of_every_legal_form_and_stateful_grammars_pass(make_prop, tiny_ckpt):
    """A callable may return a [1, W] array, and may refuse to answer a position twice
    (an xgrammar matcher advances with each draft): checked never calls it again."""
    prop, d, st, rng = _checked_state(make_prop, "exact", 20, reference_weights(tiny_ckpt), n=6)
    W = prop.config.bitmask_words
    calls = []

    def matcher(i, drafts):
        assert i == len(calls), f"asked for position {i}, the matcher is at {len(calls)}"
        calls.append(i)
        return np.full((1, W), -1, np.int32)

    d.propose(1, rand_hiddens(rng, 1, H)[0], 6, 3, st, grammar_bitmask=matcher)
    assert calls == [0, 1, 2]


def test_a_broken_budget_promise_is_caught(make_prop):
    prop = make_prop("draft", num_blocks=20, block_size=4)
    d = checked(prop)
    rng = np.random.default_rng(21)
    vip = d.alloc_state_for(12)                                 # 4 blocks promised in every module
    prop.pools[0].drop_budget(vip.kv[0], vip)                   # plant: module 0 forgets the promise
    hog = d.alloc_state()
    d.prefill_drafter(list(range(77)), rand_hiddens(rng, 77, H), hog)          # 19 of 20 blocks
    with pytest.raises(AssertionError, match="KvCacheFull for sequences inside their budgets"):
        d.prefill_drafter(list(range(12)), rand_hiddens(rng, 12, H), vip)     # needs 3 blocks


def test_draft_mode_drafts_are_checked_by_the_oracle(make_prop, tiny_ckpt, monkeypatch):
    """The planted bug: modules after the first fed t_P instead of the previous draft."""
    prop, d, st, rng = _checked_state(make_prop, "draft", 22, reference_weights(tiny_ckpt), n=7)
    _round(d, st, rng, 1)                                       # the unplanted proposer passes
    real = prop.mode.propose

    def wrong(sts, toks, poss, hid, k, draft_ids):
        def ids(m, normed, drafts, active):
            out, stops = draft_ids(m, normed, drafts, active)
            return (out if m == 0 else np.full_like(out, toks[0])), stops
        return real(sts, toks, poss, hid, k, ids)

    monkeypatch.setattr(prop.mode, "propose", wrong)
    with pytest.raises(AssertionError, match="draft-mode drafts .* differ from the oracle's"):
        d.propose(1, rand_hiddens(rng, 1, H)[0], st.next_position, 3, st)


@pytest.mark.parametrize("plant", ["stats", "deferred"])
def test_counters_are_checked(make_prop, monkeypatch, plant):
    prop, d, st, rng = _checked_state(make_prop, "exact", 23)
    if plant == "stats":
        monkeypatch.setattr(type(prop.stats), "record", lambda self, k, a: None)
        drafts = d.propose(1, rand_hiddens(rng, 1, H)[0], 4, 3, st)
        with pytest.raises(AssertionError, match="counters"):
            d.after_verify(len(drafts), st)
    else:
        real = prop._propose

        def zeroed(*a, **kw):
            out = real(*a, **kw)
            prop._last_drafts = [0]
            return out

        monkeypatch.setattr(prop, "_propose", zeroed)
        with pytest.raises(AssertionError):
            d.propose(1, rand_hiddens(rng, 1, H)[0], 4, 3, st)


def test_a_failed_call_that_changed_the_window_is_caught(make_prop, monkeypatch):
    """The plant: rollback forgets the exact-mode window, and a catch-up fails after its
    forwards; the window the next propose reads is then the failed call's."""
    from mtpkern.state import Snapshot

    prop, d, st, rng = _checked_state(make_prop, "exact", 24, n=8)
    real_restore, real_catch_up = Snapshot.restore, prop.exact.catch_up

    def restore_but_the_window(self, state, pools):
        win, start = list(state._win), list(state._win_start)
        real_restore(self, state, pools)
        state._win, state._win_start = win, start

    def failing(sts, hids):
        real_catch_up(sts, hids)
        raise RuntimeError("interrupted")

    drafts = d.propose(1, rand_hiddens(rng, 1, H)[0], 8, 3, st)
    d.after_verify(2, st)
    monkeypatch.setattr(Snapshot, "restore", restore_but_the_window)
    monkeypatch.setattr(prop.exact, "catch_up", failing)
    with pytest.raises(AssertionError, match="a call that raised changed"):
        d.catchup_drafter(drafts[:2], rand_hiddens(rng, 2, H), st)
