"""mtpkern.testing: the kit engines use to property-test an integration.

Its checks must be able to fail: a proposer with a planted bug (the seed design's
draft-mode trim, a call that changes state before raising, a wrong draft) is
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
from mtpkern import MultiModuleMtpHead
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
    monkeypatch.setattr(prop, "_draft_ids", lambda m, normed, masks, drafts: (real(m, normed, masks, drafts) + 1) % V)
    with pytest.raises(AssertionError, match="differ from the oracle's"):
        d.propose(1, rand_hiddens(rng, 1, H)[0], 6, 2, st)


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
    """docs/testing.md's three examples, in order, with ``ckpt`` a tiny checkpoint."""
    blocks = _doc_blocks()
    assert len(blocks) == 3
    env = {"ckpt": tiny_ckpt}
    for code in blocks:
        exec(compile(code, str(DOC), "exec"), env)                 # noqa: S102 (the doc's own code)
    assert sum(env["Machine"].steps.values()) > 0
