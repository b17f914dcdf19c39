"""Every public call refuses bad input with a message naming the argument, the
expected and the actual value, and leaves the state unchanged and usable."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import rand_hiddens
from mtpkern import KvCacheFull, MultiModuleMtpHead, StateError

H = 64
V = 301


def fingerprint(prop, st):
    """What a failed call must leave as it was: the pools, the state, and the proposer's
    counters and last drafts."""
    dev = prop.last_drafts_device
    return (tuple(prop.kv_blocks_in_use()), tuple(st.rows_per_module()), st.num_verified,
            st.num_hiddens, tuple(st.tail), st.drafted, st.next_position, prop.clamped_calls,
            tuple(prop.stats.drafted), tuple(prop.stats.accepted),
            None if dev is None else prop.backend.to_host(dev).tolist(), tuple(st.last_drafts or ()))


@pytest.fixture(params=["exact", "draft"])
def ready(request, make_prop):
    """A proposer and a state prefilled with 6 tokens, ready to propose at position 6."""
    prop = make_prop(request.param)
    rng = np.random.default_rng(1)
    st = prop.alloc_state()
    prop.prefill_drafter(rng.integers(0, V, 6).tolist(), rand_hiddens(rng, 6, H), st)
    return prop, st, rng


def still_usable(prop, st, rng):
    drafts = prop.propose(3, rand_hiddens(rng, 1, H)[0], st.next_position, 3, st)
    prop.after_verify(1, st)
    prop.catchup_drafter(drafts[:1], rand_hiddens(rng, 1, H), st)
    prop.check_invariants()


PROPOSE_BAD = [
    (dict(last_token=V), ValueError, "last_token: token id 301 is outside the vocabulary [0, 301)"),
    (dict(last_token=-1), ValueError, "last_token: token id -1"),
    (dict(last_token=2.0), TypeError, "last_token: expected an int token id, got float"),
    (dict(last_token=True), TypeError, "last_token: expected an int token id, got bool"),
    (dict(target_hidden=np.zeros(H + 1, np.float32)), ValueError, "target_hidden: expected shape [64] or [1, 64], got [65]"),
    (dict(target_hidden=np.zeros((2, H), np.float32)), ValueError, "got [2, 64]"),
    (dict(target_hidden=np.zeros(H, np.float64)), TypeError, "target_hidden: expected dtype float32 or bfloat16, got float64"),
    (dict(target_hidden=np.zeros(H, np.int32)), TypeError, "got int32"),
    (dict(target_hidden=[0.5] * H), TypeError, "NumPy reads Python floats as float64"),
    (dict(target_hidden=np.where(np.arange(H) == 7, np.nan, 1.0).astype(np.float32)), ValueError,
     "target_hidden: expected finite values, got nan at row 0, column 7"),
    (dict(position=5), ValueError, "position: expected"),
    (dict(position=0), ValueError, "position: expected >= 1, got 0"),
    (dict(num_drafts=-1), ValueError, "num_drafts: expected >= 0, got -1"),
    (dict(num_drafts="3"), TypeError, "num_drafts: expected an int, got str"),
    (dict(grammar_bitmask=np.zeros(9, np.int32)), ValueError, "grammar_bitmask: expected shape [10]"),
    (dict(grammar_bitmask=np.zeros(10, np.int64)), TypeError, "grammar_bitmask: expected int32"),
    (dict(grammar_bitmask=np.zeros((2, 10), np.int32), num_drafts=3), ValueError, "[k, W] with k >= 3"),
    (dict(grammar_bitmask=np.zeros(10, np.int32)), Exception, "draft position 0: the grammar bitmask allows no token"),
    (dict(grammar_bitmask=np.zeros(10, np.int32), num_drafts=9), Exception, "allows no token"),   # clamped, fails
    (dict(grammar_bitmask=lambda i, d: None if i < 2 else np.zeros(10, np.int32), num_drafts=3), Exception,
     "draft position 2: the grammar bitmask allows no token"),
    (dict(grammar_bitmask=lambda i, d: np.zeros(3, np.int32)), ValueError, "grammar_bitmask(0, ...) result: expected shape [10]"),
]


@pytest.mark.parametrize("bad,exc,msg", PROPOSE_BAD)
def test_propose_bad_input(ready, bad, exc, msg):
    prop, st, rng = ready
    args = dict(last_token=3, target_hidden=rand_hiddens(rng, 1, H)[0], position=6, num_drafts=2, state=st)
    args.update(bad)
    before = fingerprint(prop, st)
    with pytest.raises(exc) as e:
        prop.propose(**args)
    assert msg in str(e.value)
    assert fingerprint(prop, st) == before
    still_usable(prop, st, rng)


def test_failed_propose_keeps_the_last_drafts(ready):
    """After a good propose, a failing one (no allowed token, with num_drafts clamped)
    leaves last_drafts_device, clamped_calls and the read-back draft as they were."""
    prop, st, rng = ready
    d = prop.propose(3, rand_hiddens(rng, 1, H)[0], 6, 3, st)
    prop.after_verify(0, st)
    before = fingerprint(prop, st)
    with pytest.raises(Exception, match="allows no token"):
        prop.propose(4, rand_hiddens(rng, 1, H)[0], 7, 5, st, grammar_bitmask=np.zeros(10, np.int32))
    assert fingerprint(prop, st) == before
    assert prop.read_deferred_draft_token(st) == d[-1]
    assert prop.backend.to_host(prop.last_drafts_device).tolist() == [d]


def test_grammar_callable_that_raises_rolls_back(ready):
    prop, st, rng = ready
    calls = []

    def grammar(i, drafts):
        calls.append(i)
        if i == 2:
            raise RuntimeError("grammar engine failure")
        return None

    before = fingerprint(prop, st)
    with pytest.raises(RuntimeError, match="grammar engine failure"):
        prop.propose(3, rand_hiddens(rng, 1, H)[0], 6, 3, st, grammar_bitmask=grammar)
    assert calls == [0, 1, 2]
    assert fingerprint(prop, st) == before
    still_usable(prop, st, rng)


def test_after_verify_bad_input(ready):
    prop, st, rng = ready
    with pytest.raises(StateError, match="after_verify without a propose"):
        prop.after_verify(0, st)
    prop.propose(3, rand_hiddens(rng, 1, H)[0], 6, 2, st)
    before = fingerprint(prop, st)
    for bad, exc, msg in [(3, ValueError, "num_accepted: expected in [0, 2], got 3"),
                          (-1, ValueError, "num_accepted: expected in [0, 2], got -1"),
                          (1.0, TypeError, "num_accepted: expected an int")]:
        with pytest.raises(exc, match=msg.replace("[", r"\[").replace("]", r"\]")):
            prop.after_verify(bad, st)
        assert fingerprint(prop, st) == before
    with pytest.raises(StateError, match="a propose awaits after_verify"):
        prop.propose(3, rand_hiddens(rng, 1, H)[0], 6, 2, st)
    prop.after_verify(2, st)
    prop.catchup_drafter(st.last_drafts, rand_hiddens(rng, 2, H), st)
    prop.check_invariants()


def test_prefill_bad_input(make_prop):
    for mode in ("exact", "draft"):
        prop = make_prop(mode)
        rng = np.random.default_rng(2)
        st = prop.alloc_state()
        cases = [
            (([], np.zeros((0, H), np.float32)), ValueError, "prompt_tokens: expected at least 1 token, got 0"),
            (([1, 2, V], rand_hiddens(rng, 3, H)), ValueError, "prompt_tokens[2]: token id 301 is outside"),
            (([1, 2, 3], rand_hiddens(rng, 2, H)), ValueError, "hiddens: expected shape [3, 64], got [2, 64]"),
            (([1.5, 2.0], rand_hiddens(rng, 2, H)), TypeError, "prompt_tokens[0]: expected an int token id, got float"),
            (([[1, 2]], rand_hiddens(rng, 1, H)), ValueError, "prompt_tokens: expected a 1-D sequence"),
        ]
        for (toks, hid), exc, msg in cases:
            before = fingerprint(prop, st)
            with pytest.raises(exc) as e:
                prop.prefill_drafter(toks, hid, st)
            assert msg in str(e.value)
            assert fingerprint(prop, st) == before
        prop.prefill_drafter([1, 2, 3], rand_hiddens(rng, 3, H), st)
        with pytest.raises(StateError, match="prefill_drafter needs a fresh state"):
            prop.prefill_drafter([1, 2, 3], rand_hiddens(rng, 3, H), st)
        prop.check_invariants()


def test_catchup_bad_input(make_prop):
    prop = make_prop("exact")
    rng = np.random.default_rng(3)
    st = prop.alloc_state()
    with pytest.raises(StateError, match="needs prefill_drafter"):
        prop.catchup_drafter([1], rand_hiddens(rng, 1, H), st)
    prop.prefill_drafter([5, 6, 7], rand_hiddens(rng, 3, H), st)
    for empty in (None, [], (), np.zeros(0, np.float32), np.zeros((0, H), np.float32)):
        assert prop.catchup_drafter([], empty, st) == 0      # no tokens: a no-op, whatever says "no rows"
    d = prop.propose(8, rand_hiddens(rng, 1, H)[0], 3, 3, st)
    with pytest.raises(StateError, match="a propose awaits after_verify"):
        prop.catchup_drafter(d[:1], rand_hiddens(rng, 1, H), st)
    prop.after_verify(2, st)
    before = fingerprint(prop, st)
    wrong = (d[0] + 1) % V
    for (toks, hid), exc, msg in [
        (([wrong], rand_hiddens(rng, 1, H)), ValueError, f"tokens[0]: expected {d[0]} (the verified token at position 4), got {wrong}"),
        ((d[:2], rand_hiddens(rng, 1, H)), ValueError, "hiddens: expected shape [2, 64], got [1, 64]"),
        (([V], rand_hiddens(rng, 1, H)), ValueError, "tokens[0]: token id 301"),
    ]:
        with pytest.raises(exc) as e:
            prop.catchup_drafter(toks, hid, st)
        assert msg in str(e.value)
        assert fingerprint(prop, st) == before
    with pytest.raises(StateError, match="need their target hiddens; call catchup_drafter"):
        prop.propose(1, rand_hiddens(rng, 1, H)[0], 6, 1, st)
    assert prop.catchup_drafter([], np.zeros((0, H), np.float32), st) == 0      # no-op
    assert fingerprint(prop, st) == before
    prop.catchup_drafter(d[:2], rand_hiddens(rng, 2, H), st)
    prop.propose(1, rand_hiddens(rng, 1, H)[0], 6, 1, st)
    prop.check_invariants()


def test_draft_mode_catchup_checks_as_exact_mode(make_prop):
    """The same checks as in exact mode (an engine developing in draft mode meets its bad
    calls there too), then module 0's rows, one per token (tests/test_draft_catchup.py)."""
    prop = make_prop("draft")
    rng = np.random.default_rng(4)
    st = prop.alloc_state()
    with pytest.raises(StateError, match="draft kv_mode needs prefill_drafter before catchup_drafter"):
        prop.catchup_drafter([1], rand_hiddens(rng, 1, H), st)
    prop.prefill_drafter([5, 6, 7], rand_hiddens(rng, 3, H), st)
    assert prop.catchup_drafter([1, 2], rand_hiddens(rng, 2, H), st) == 2
    assert st.rows_per_module() == [4, 0, 0] and (st.num_verified, st.num_hiddens) == (5, 4)
    before = fingerprint(prop, st)
    assert prop.catchup_drafter([], None, st) == 0
    assert prop.catchup_drafter([], np.zeros((0, H), np.float32), st) == 0
    assert prop.catchup_drafter([], [], st) == 0 and prop.catchup_drafter([], np.zeros(0, np.float32), st) == 0
    for toks, hid, exc, msg in [
        ([V + 5], rand_hiddens(rng, 1, H), ValueError, "tokens[0]: token id 306 is outside the vocabulary"),
        ([1, 2], rand_hiddens(rng, 3, H), ValueError, "hiddens: expected shape [2, 64], got [3, 64]"),
        ([1], np.zeros((1, H), np.float64), TypeError, "hiddens: expected dtype float32 or bfloat16, got float64"),
        ([], rand_hiddens(rng, 2, H), ValueError, "hiddens: expected no rows (no tokens), got shape [2, 64]"),
    ]:
        with pytest.raises(exc) as e:
            prop.catchup_drafter(toks, hid, st)
        assert msg in str(e.value)
    assert fingerprint(prop, st) == before


@pytest.mark.parametrize("mode", ["exact", "draft"])
def test_non_finite_hiddens_are_refused(make_prop, mode):
    """A NaN or Inf hidden would poison a module's KV for good: refused, naming where."""
    prop = make_prop(mode)
    rng = np.random.default_rng(5)
    st = prop.alloc_state()
    bad = rand_hiddens(rng, 4, H)
    bad[2, 9] = np.inf
    before = fingerprint(prop, st)
    with pytest.raises(ValueError, match=r"hiddens: expected finite values, got inf at row 2, column 9"):
        prop.prefill_drafter([1, 2, 3, 4], bad, st)
    assert fingerprint(prop, st) == before
    prop.prefill_drafter([1, 2, 3, 4], rand_hiddens(rng, 4, H), st)
    d = prop.propose(5, rand_hiddens(rng, 1, H)[0], 4, 2, st)
    prop.after_verify(2, st)
    if mode == "exact":
        before = fingerprint(prop, st)
        with pytest.raises(ValueError, match="hiddens: expected finite values, got nan"):
            prop.catchup_drafter(d, np.full((2, H), np.nan, np.float32), st)
        assert fingerprint(prop, st) == before
    prop.catchup_drafter(d, rand_hiddens(rng, 2, H), st)
    prop.check_invariants()


def test_states_freed_foreign_and_wrong_type(make_prop, tiny_ckpt):
    prop = make_prop("exact")
    other = MultiModuleMtpHead.from_pretrained(tiny_ckpt, backend="numpy", num_blocks=8)
    rng = np.random.default_rng(5)
    st = prop.alloc_state()
    prop.free_state(st)
    h = rand_hiddens(rng, 1, H)[0]
    calls = [
        lambda s: prop.propose(1, h, 1, 1, s),
        lambda s: prop.prefill_drafter([1], h[None], s),
        lambda s: prop.after_verify(0, s),
        lambda s: prop.catchup_drafter([1], h[None], s),
        lambda s: prop.free_state(s),
        lambda s: prop.take_drafter_kv(s),
        lambda s: prop.install_drafter_kv(s, None),
        lambda s: prop.drafter_rows(s),
        lambda s: prop.last_pair_key(s),
        lambda s: prop.read_deferred_draft_token(s),
        lambda s: prop.propose_batch([1], [h], [1], 1, [s]),
        lambda s: prop.catchup_batch([[1]], [h[None]], [s]),
    ]
    for call in calls:
        with pytest.raises(StateError, match="was freed by free_state"):
            call(st)
    foreign = other.alloc_state()
    for call in calls:
        with pytest.raises(StateError, match="belongs to another proposer"):
            call(foreign)
    for call in calls:
        with pytest.raises(TypeError, match="expected an MtpState from alloc_state, got dict"):
            call({})
    prop.check_invariants()
    other.check_invariants()


def test_batch_bad_input(make_prop):
    prop = make_prop("exact")
    rng = np.random.default_rng(6)
    a, b = prop.alloc_state(), prop.alloc_state()
    for s in (a, b):
        prop.prefill_drafter([1, 2, 3], rand_hiddens(rng, 3, H), s)
    hs_ = rand_hiddens(rng, 2, H)
    with pytest.raises(ValueError, match="the same state appears twice"):
        prop.propose_batch([1, 2], hs_, [3, 3], 2, [a, a])
    with pytest.raises(ValueError, match=r"positions: expected 2 entries \(one per state\), got 1"):
        prop.propose_batch([1, 2], hs_, [3], 2, [a, b])
    with pytest.raises(ValueError, match=r"target_hiddens: expected shape \[2, 64\] \(or a list of 2 \[64\] arrays\), got \[3, 64\]"):
        prop.propose_batch([1, 2], rand_hiddens(rng, 3, H), [3, 3], 2, [a, b])
    with pytest.raises(ValueError, match=r"positions\[1\]: expected 3"):
        prop.propose_batch([1, 2], hs_, [3, 4], 2, [a, b])
    with pytest.raises(ValueError, match=r"states: expected 1..64 states"):
        prop.propose_batch([], hs_[:0], [], 2, [])
    with pytest.raises(ValueError, match=r"grammar_bitmasks: expected 2 masks \(or None\) \(one per state\), got 1"):
        prop.propose_batch([1, 2], hs_, [3, 3], 2, [a, b], grammar_bitmasks=[None])
    assert a.rows_per_module() == b.rows_per_module() == [2, 1, 0]
    assert prop.propose_batch([1, 2], hs_, [3, 3], 2, [a, b]) is not None


def test_kv_pool_full_changes_nothing(make_prop):
    prop = make_prop("exact", num_blocks=3)          # 3 blocks of 4 rows per module
    rng = np.random.default_rng(7)
    st = prop.alloc_state()
    with pytest.raises(KvCacheFull, match=r"KV pool of module 0 is full: the call needs 4 more block\(s\), 3 of 3"):
        prop.prefill_drafter(list(range(14)), rand_hiddens(rng, 14, H), st)
    assert prop.kv_blocks_in_use() == [0, 0, 0]
    prop.prefill_drafter(list(range(13)), rand_hiddens(rng, 13, H), st)     # 12 rows: 3 full blocks
    before = fingerprint(prop, st)
    with pytest.raises(KvCacheFull):
        prop.propose(1, rand_hiddens(rng, 1, H)[0], 13, 3, st)
    assert fingerprint(prop, st) == before
    with pytest.raises(KvCacheFull):
        prop.alloc_state_for(100)
    prop.free_state(st)
    prop.check_invariants()
    assert prop.kv_blocks_in_use() == [0, 0, 0]


def test_construction_bad_input(tiny_ckpt, tmp_path):
    with pytest.raises(ValueError, match="kv_mode: expected 'draft' or 'exact', got 'fast'"):
        MultiModuleMtpHead.from_pretrained(tiny_ckpt, backend="numpy", kv_mode="fast")
    with pytest.raises(ValueError, match="chain: expected 'prenorm', 'postnorm' or None \(the family's\), got 'mid'"):
        MultiModuleMtpHead.from_pretrained(tiny_ckpt, backend="numpy", chain="mid")
    with pytest.raises(ValueError, match="backend: expected 'auto', 'numpy', 'cpu', 'cuda' or a Backend, got 'tpu'"):
        MultiModuleMtpHead.from_pretrained(tiny_ckpt, backend="tpu")
    with pytest.raises(ValueError, match="block_size: expected >= 1, got 0"):
        MultiModuleMtpHead.from_pretrained(tiny_ckpt, backend="numpy", block_size=0)
    with pytest.raises(TypeError, match="apply_target_norm: expected a bool"):
        MultiModuleMtpHead.from_pretrained(tiny_ckpt, backend="numpy", apply_target_norm="yes")
    from mtpkern import ConfigError

    with pytest.raises(ConfigError, match="config.json not found"):
        MultiModuleMtpHead.from_pretrained(tmp_path, backend="numpy")


def test_carry_bad_input(make_prop):
    prop = make_prop("exact")
    rng = np.random.default_rng(8)
    st = prop.alloc_state()
    assert prop.take_drafter_kv(st) is None                       # nothing to carry
    prop.prefill_drafter([1, 2, 3, 4], rand_hiddens(rng, 4, H), st)
    kv = prop.take_drafter_kv(st)
    busy = prop.alloc_state()
    prop.prefill_drafter([1, 2], rand_hiddens(rng, 2, H), busy)
    with pytest.raises(StateError, match="install_drafter_kv needs a fresh state"):
        prop.install_drafter_kv(busy, kv)
    with pytest.raises(TypeError, match="carried: expected a DrafterKv"):
        prop.install_drafter_kv(st, [1, 2])
    assert prop.install_drafter_kv(st, kv)
    with pytest.raises(StateError, match="carried: already installed or freed"):
        prop.free_drafter_kv(kv)
    prop.check_invariants()


def test_batch_arguments_of_the_wrong_kind_are_named(make_prop):
    prop = make_prop("exact")
    rng = np.random.default_rng(10)
    a = prop.alloc_state()
    prop.prefill_drafter([1, 2, 3], rand_hiddens(rng, 3, H), a)
    h = rand_hiddens(rng, 1, H)
    cases = [
        (lambda: prop.propose_batch([1], h, [3], 2, [a], grammar_bitmasks=lambda i, d: None),
         TypeError, "grammar_bitmasks: expected a list of masks"),
        (lambda: prop.propose_batch(1, h, [3], 2, [a]), TypeError, "last_tokens: expected a list"),
        (lambda: prop.propose_batch([1], h, 3, 2, [a]), TypeError, "positions: expected a list"),
        (lambda: prop.propose_batch([1], h, [3], 2, None), TypeError, "states: expected a list of states"),
        (lambda: prop.propose_batch([1], h, [3], 2, a), TypeError, "states: expected a list of states, got MtpState"),
        (lambda: prop.catchup_batch([[1]], [h], a), TypeError, "states: expected a list of states"),
        (lambda: prop.catchup_batch([1], [h], [a]), ValueError, "tokens: expected a 1-D sequence of token ids"),
    ]
    before = fingerprint(prop, a)
    for call, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            call()
        assert fingerprint(prop, a) == before


def test_draft_mode_catchup_refuses_non_finite_hiddens(make_prop):
    prop = make_prop("draft")
    rng = np.random.default_rng(11)
    st = prop.alloc_state()
    prop.prefill_drafter([1, 2, 3], rand_hiddens(rng, 3, H), st)
    d = prop.propose(1, rand_hiddens(rng, 1, H)[0], 3, 2, st)
    prop.after_verify(2, st)
    with pytest.raises(ValueError, match="hiddens: expected finite values, got nan"):
        prop.catchup_drafter(d, np.full((2, H), np.nan, np.float32), st)
    assert prop.catchup_drafter(d, rand_hiddens(rng, 2, H), st) == 2


def test_after_close_every_call_says_closed(make_prop):
    prop = make_prop("exact")
    rng = np.random.default_rng(12)
    head = prop.modules[0]
    seq = head.alloc_seq()
    head.forward_one(1, rand_hiddens(rng, 1, H)[0], 1, seq)
    prop.close()
    assert prop.kv_blocks_in_use() == [0, 0, 0]                   # alloc_seq sequences too
    for call in (prop.memory, prop.alloc_state, prop.check_invariants,
                 lambda: head.forward_one(1, rand_hiddens(rng, 1, H)[0], 2, seq), lambda: head.alloc_seq()):
        with pytest.raises(StateError, match="closed"):
            call()
