"""Ownership that cannot be bypassed: only the objects the proposer (or a head) handed
out are honoured, checked before any block moves; copies, hand-built objects, another
module's sequences and re-entrant calls from callbacks get a clear error and change
nothing."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from conftest import rand_hiddens
from mtpkern import DrafterKv, MtpState, StateError

H, V = 64, 301


def everything(prop, *states):
    """What a refused call must leave as it was: the pools' owners and free lists, and
    every given state's rows, blocks and counters."""
    pools = tuple((p.num_free, tuple(p._free), p._refs.tobytes(), p.reserved) for p in prop.pools)
    sts = tuple((tuple(s.rows_per_module()), tuple(tuple(q.blocks) for q in s.kv), s.num_verified,
                 s.num_hiddens, tuple(s.tail), s.drafted) for s in states)
    return pools, sts


def prefilled(prop, rng, n=9):
    st = prop.alloc_state()
    prop.prefill_drafter(rng.integers(0, V, n).tolist(), rand_hiddens(rng, n, H), st)
    return st


@pytest.fixture(params=["exact", "draft"])
def mode(request):
    return request.param


def test_a_copy_of_a_carried_entry_is_refused(make_prop, mode):
    """The issue's case: install the original, free the copy. The copy must not return
    the blocks the installed state now owns."""
    prop = make_prop(mode)
    rng = np.random.default_rng(0)
    st = prefilled(prop, rng)
    kv = prop.take_drafter_kv(st)
    cp = copy.copy(kv)
    prop.install_drafter_kv(st, kv)
    before = everything(prop, st)
    with pytest.raises(StateError, match="carried: "):
        prop.free_drafter_kv(cp)
    with pytest.raises(StateError, match="carried: "):
        prop.install_drafter_kv(prop.alloc_state(), cp)
    assert everything(prop, st)[0][:1] == before[0][:1] and everything(prop, st)[1] == before[1]
    prop.check_invariants()
    d = prop.propose(1, rand_hiddens(rng, 1, H)[0], st.next_position, 2, st)
    assert len(d) == 2


@pytest.mark.parametrize("how", ["copy", "deepcopy", "hand-built"])
def test_copied_or_hand_built_entries_are_refused_before_anything_moves(make_prop, mode, how):
    prop = make_prop(mode)
    rng = np.random.default_rng(1)
    st = prefilled(prop, rng)
    kv = prop.take_drafter_kv(st)
    if how == "copy":
        fake = copy.copy(kv)
    elif how == "deepcopy":
        fake = copy.deepcopy(kv)
    else:                                                 # a hostile caller fills in the private fields
        fake = DrafterKv(prop, prop.alloc_state())
        fake._seqs = kv.seqs
    fresh = prop.alloc_state()
    before = everything(prop, st, fresh)
    for call in (lambda: prop.free_drafter_kv(fake), lambda: prop.install_drafter_kv(fresh, fake)):
        with pytest.raises(StateError, match="carried: "):
            call()
        assert everything(prop, st, fresh) == before
    prop.install_drafter_kv(fresh, kv)                    # the original still works
    prop.check_invariants()


@pytest.mark.parametrize("how", ["copy", "deepcopy", "hand-built"])
def test_copied_or_hand_built_states_are_refused(make_prop, mode, how):
    prop = make_prop(mode)
    rng = np.random.default_rng(2)
    st = prefilled(prop, rng)
    if how == "hand-built":                               # a hostile caller fills in the private fields
        fake = MtpState(prop, prop.num_modules)
        fake._kv, fake._num_verified, fake._num_hiddens = st.kv, st.num_verified, st.num_hiddens
        fake._tail, fake._tail_start, fake._next_position = list(st._tail), st._tail_start, st.next_position
    else:
        fake = copy.copy(st) if how == "copy" else copy.deepcopy(st)
    h = rand_hiddens(rng, 1, H)[0]
    P = st.next_position
    calls = [
        lambda s: prop.propose(1, h, P, 2, s),
        lambda s: prop.propose_batch([1], [h], [P], 2, [s]),
        lambda s: prop.after_verify(0, s),
        lambda s: prop.catchup_drafter([1], h[None], s),
        lambda s: prop.catchup_batch([[1]], [h[None]], [s]),
        lambda s: prop.free_state(s),
        lambda s: prop.take_drafter_kv(s),
        lambda s: prop.prefill_drafter([1, 2], rand_hiddens(rng, 2, H), s),
        lambda s: prop.drafter_rows(s),
        lambda s: prop.read_deferred_draft_token(s),
    ]
    before = everything(prop, st)
    for call in calls:
        with pytest.raises(StateError, match="not a state this proposer's alloc_state returned"):
            call(fake)
        assert everything(prop, st) == before
    prop.check_invariants()
    prop.propose(1, h, P, 2, st)


def test_head_sequences_belong_to_their_head(make_prop, mode):
    """MtpHead.free_seq / forward_one take only sequences of that head's alloc_seq: not
    another module's, not a proposer state's, not a copy."""
    prop = make_prop(mode)
    rng = np.random.default_rng(3)
    st = prefilled(prop, rng)
    h0, h1 = prop.modules[0], prop.modules[1]
    mine = h0.alloc_seq()
    h0.forward_one(3, rand_hiddens(rng, 1, H)[0], 1, mine)
    other_module = h1.alloc_seq()
    h1.forward_one(3, rand_hiddens(rng, 1, H)[0], 2, other_module)
    before = everything(prop, st)
    for seq, why in ((other_module, "not a live sequence of module 0"), (st.kv[0], "held by a proposer state"),
                     (copy.copy(mine), "not a live sequence"), (copy.deepcopy(mine), "not a live sequence")):
        with pytest.raises(StateError, match=why):
            h0.free_seq(seq)
        with pytest.raises(StateError, match=why):
            h0.forward_one(3, rand_hiddens(rng, 1, H)[0], 40, seq)
        assert everything(prop, st) == before
    with pytest.raises(TypeError, match="expected a SeqKv"):
        h0.free_seq([0, 1])
    h0.free_seq(mine)
    with pytest.raises(StateError):
        h0.free_seq(mine)                                  # twice
    h1.free_seq(other_module)
    prop.check_invariants()
    assert prop.kv_blocks_in_use() == [len(s.blocks) for s in st.kv]


# -- re-entrancy: a callback that calls back into the proposer --------------------------------

def _reentrant_calls(prop, st, rng):
    h = rand_hiddens(rng, 1, H)[0]
    return {
        "free_state": lambda: prop.free_state(st),
        "take_drafter_kv": lambda: prop.take_drafter_kv(st),
        "propose": lambda: prop.propose(1, h, st.last_position if st.drafted else st.next_position, 1, st),
        "after_verify": lambda: prop.after_verify(0, st),
        "catchup_drafter": lambda: prop.catchup_drafter([1], h[None], st),
        "install_drafter_kv": lambda: prop.install_drafter_kv(st, None),
        "prefill_drafter": lambda: prop.prefill_drafter([1, 2], rand_hiddens(rng, 2, H), st),
    }


@pytest.mark.parametrize("what", ["free_state", "take_drafter_kv", "propose", "after_verify", "catchup_drafter",
                                  "install_drafter_kv", "prefill_drafter"])
def test_a_grammar_callback_cannot_use_the_state_in_use(make_prop, mode, what):
    prop = make_prop(mode)
    rng = np.random.default_rng(4)
    st = prefilled(prop, rng)
    seen = []

    def grammar(i, drafts):
        try:
            _reentrant_calls(prop, st, rng)[what]()
        except StateError as e:
            seen.append(str(e))
            raise
        return None

    before = everything(prop, st)
    with pytest.raises(StateError, match=r"state: in use by propose"):
        prop.propose(1, rand_hiddens(rng, 1, H)[0], st.next_position, 3, st, grammar_bitmask=grammar)
    assert seen and "in use by propose" in seen[0]
    assert everything(prop, st) == before
    prop.check_invariants()
    st.check_invariants()
    d = prop.propose(1, rand_hiddens(rng, 1, H)[0], st.next_position, 3, st)      # still usable
    prop.after_verify(len(d), st)


def test_a_callback_may_use_other_states(make_prop, mode):
    """Only the states of the running call are refused: a callback may draft for another
    sequence, and both calls end consistent."""
    prop = make_prop(mode)
    rng = np.random.default_rng(5)
    a, b = prefilled(prop, rng), prefilled(prop, rng)
    hb = rand_hiddens(rng, 1, H)[0]
    inner = []

    def grammar(i, drafts):
        if i == 1 and not inner:
            inner.append(prop.propose(2, hb, b.next_position, 2, b))
        return None

    outer = prop.propose(1, rand_hiddens(rng, 1, H)[0], a.next_position, 3, a, grammar_bitmask=grammar)
    assert len(outer) == 3 and len(inner[0]) == 2 and a.drafted and b.drafted
    prop.check_invariants()
    prop.after_verify(1, a)
    prop.after_verify(0, b)
    prop.check_invariants()


def test_check_invariants_during_a_call_skips_the_busy_state(make_prop, mode):
    prop = make_prop(mode)
    rng = np.random.default_rng(6)
    st = prefilled(prop, rng)
    checked = []

    def grammar(i, drafts):
        prop.check_invariants()                              # the pools, and every idle state
        with pytest.raises(StateError, match="in use by propose"):
            st.check_invariants()
        checked.append(i)
        return None

    prop.propose(1, rand_hiddens(rng, 1, H)[0], st.next_position, 2, st, grammar_bitmask=grammar)
    assert checked == [0, 1]
    st.check_invariants()


# -- public fields are read-only: nothing an engine holds can redirect the pool -------------

def test_state_and_entry_fields_are_read_only(make_prop, mode):
    prop = make_prop(mode)
    rng = np.random.default_rng(7)
    a, b = prefilled(prop, rng), prefilled(prop, rng)
    before = everything(prop, a, b)
    for obj, name, value in ((a, "kv", b.kv), (a, "num_verified", 2), (a, "num_hiddens", 2), (a, "drafted", True),
                             (a, "next_position", 1), (a, "freed", True), (a.kv[0], "blocks", b.kv[0].blocks),
                             (a.kv[0], "keys", None)):
        with pytest.raises(AttributeError):
            setattr(obj, name, value)
    with pytest.raises(TypeError):
        a.kv[0] = b.kv[0]                                    # a tuple
    with pytest.raises(AttributeError):
        a.kv[0].blocks.append(b.kv[0].blocks[0])             # a tuple: the audit's write into b's block
    a.last_drafts.append(5)                                  # copies: the state does not change
    assert everything(prop, a, b) == before
    kv = prop.take_drafter_kv(a)
    for name in ("num_verified", "next_position", "seqs", "consumed"):
        with pytest.raises(AttributeError):
            setattr(kv, name, 0)
    prop.install_drafter_kv(a, kv)
    prop.check_invariants()


def test_a_state_holding_another_states_sequence_is_refused(make_prop, mode):
    """Even through the private fields (a hostile caller): every call checks that each
    module's sequence is held by the state it is called with."""
    prop = make_prop(mode)
    rng = np.random.default_rng(8)
    a, b = prefilled(prop, rng), prefilled(prop, rng)
    mine = b._kv
    b._kv = (a.kv[0],) + b._kv[1:]
    before = everything(prop, a)
    with pytest.raises(StateError, match=r"state.kv\[0\]: held by a proposer state, not by this caller"):
        prop.propose(3, rand_hiddens(rng, 1, H)[0], b.next_position, 3, b)
    with pytest.raises(StateError, match="held by a proposer state"):
        prop.free_state(b)
    assert everything(prop, a) == before
    b._kv = mine
    prop.free_state(b)
    prop.close()
    assert prop.kv_blocks_in_use() == [0, 0, 0]


def test_head_forward_takes_only_its_own_sequences(make_prop, mode):
    from mtpkern.head import RowJob

    prop = make_prop(mode)
    rng = np.random.default_rng(9)
    st = prefilled(prop, rng)
    kv = prop.take_drafter_kv(prefilled(prop, rng))
    head = prop.modules[0]
    before = everything(prop, st)
    for seq in (st.kv[0], kv.seqs[0], prop.modules[1].alloc_seq()):
        with pytest.raises(StateError, match=r"jobs\[0\].seq"):
            head.forward([RowJob(seq, np.array([1, 2], np.int32), 40, 1)], rand_hiddens(rng, 2, H))
    assert everything(prop, st) == before
    mine = head.alloc_seq()
    for toks, exc in (([400], ValueError), ([-1], ValueError), ([1.5], TypeError)):
        with pytest.raises(exc, match=r"jobs\[0\].tokens"):
            head.forward([RowJob(mine, np.array(toks), 0, 1)], rand_hiddens(rng, 1, H))
    y, normed = head.forward([RowJob(mine, np.array([1, 2], np.int32), 0, 1)], rand_hiddens(rng, 2, H))
    assert y.shape == (2, H) and mine.rows == 2
    with pytest.raises(ValueError, match=r"jobs\[0\].first_key: expected > 1"):
        head.forward([RowJob(mine, np.array([3], np.int32), 1, 1)], rand_hiddens(rng, 1, H))
    head.free_seq(mine)
    prop.check_invariants()
