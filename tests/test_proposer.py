"""Proposer semantics: the rows rules, grammar forms, carry, budgets, metrics, trait defaults."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import kv_rows, rand_hiddens
from mtpkern import (DraftProposer, KvCacheFull, MtpHead, MultiModuleMtpHead, NoAllowedToken, StateError,
                     write_synthetic_checkpoint)
from mtpkern.ops.norm import rmsnorm
from mtpkern.tolerance import assert_close

H, V = 64, 301


def prefilled(prop, n, seed=0):
    rng = np.random.default_rng(seed)
    st = prop.alloc_state()
    toks = rng.integers(0, V, n).tolist()
    hid = rand_hiddens(rng, n, H)
    prop.prefill_drafter(toks, hid, st)
    return st, rng, toks, hid


@pytest.mark.parametrize("a,kept", [(0, [1, 0, 0]), (1, [1, 1, 0]), (2, [1, 1, 1]), (3, [1, 1, 1])])
def test_draft_mode_keeps_module_m_iff_m_le_a(make_prop, a, kept):
    prop = make_prop("draft")
    st, rng, _, _ = prefilled(prop, 5)
    assert st.rows_per_module() == [4, 0, 0]                 # prefill fills module 0 only
    prop.propose(7, rand_hiddens(rng, 1, H)[0], 5, 3, st)
    assert st.rows_per_module() == [5, 1, 1]
    prop.after_verify(a, st)
    assert st.rows_per_module() == [4 + kept[0], kept[1], kept[2]]
    assert prop.last_pair_key(st) == 4 and prop.drafter_rows(st) == 5
    # keys are sequence-space: the next propose at P = 5 + a + 1 writes key P - 1 everywhere
    P = 6 + a
    prop.propose(7, rand_hiddens(rng, 1, H)[0], P, 3, st)
    assert st.kv[0].keys.to_list()[-2:] == [4, P - 1]
    assert st.kv[1].keys.to_list() == ([4] if kept[1] else []) + [P - 1]
    prop.check_invariants()


def test_exact_mode_rows_per_module(make_prop):
    prop = make_prop("exact")
    st, rng, _, _ = prefilled(prop, 8)
    assert st.rows_per_module() == [7, 6, 5]                 # keys 0 .. n-2-m
    d = prop.propose(7, rand_hiddens(rng, 1, H)[0], 8, 3, st)
    assert st.rows_per_module() == [8, 8, 8]                 # module m wrote m + 1 rows
    prop.after_verify(1, st)
    assert st.rows_per_module() == [8, 8, 7]                 # drops max(0, m - a) keys
    assert prop.catchup_drafter(d[:1], rand_hiddens(rng, 1, H), st) == 1
    assert st.rows_per_module() == [9, 8, 7]
    d = prop.propose(7, rand_hiddens(rng, 1, H)[0], 10, 1, st)   # k < M: later modules follow the drafts too
    assert st.rows_per_module() == [10, 10, 9]
    prop.after_verify(0, st)
    assert st.rows_per_module() == [10, 9, 8]
    prop.check_invariants()


def test_deferred_token_and_clamp(make_prop):
    prop = make_prop("draft")
    st, rng, _, _ = prefilled(prop, 4)
    d = prop.propose(1, rand_hiddens(rng, 1, H)[0], 4, 2, st)
    assert prop.read_deferred_draft_token() == prop.read_deferred_draft_token(st) == d[1]   # k < M: d_{k-1}
    prop.after_verify(0, st)
    assert prop.clamped_calls == 0
    d = prop.propose(1, rand_hiddens(rng, 1, H)[0], 5, 9, st)
    assert len(d) == 3 and prop.clamped_calls == 1 and prop.read_deferred_draft_token() == d[2]
    with pytest.raises(StateError, match="no propose has produced a draft yet"):
        prop.read_deferred_draft_token(prop.alloc_state())


def allowed_only(tokens):
    m = np.zeros((V + 31) // 32, np.int32)
    for t in tokens:
        m[t >> 5] |= np.int32(np.uint32(1 << (t & 31)).view(np.int32))
    return m


@pytest.mark.parametrize("mode", ["draft", "exact"])
def test_grammar_forms(make_prop, mode):
    prop = make_prop(mode)
    st, rng, _, _ = prefilled(prop, 4)
    h = rand_hiddens(rng, 1, H)[0]
    # one mask for every position
    d = prop.propose(1, h, 4, 3, st, grammar_bitmask=allowed_only([17]))
    assert d == [17, 17, 17]
    prop.after_verify(0, st)
    # one mask per position
    rows = np.stack([allowed_only([5]), allowed_only([6, 300]), allowed_only([299])])
    d = prop.propose(1, h, 5, 3, st, grammar_bitmask=rows)
    assert d[0] == 5 and d[1] in (6, 300) and d[2] == 299
    prop.after_verify(0, st)
    # a grammar that advances with each draft
    seen = []

    def grammar(i, drafts):
        seen.append((i, list(drafts)))
        return allowed_only([100 + i + sum(drafts) % 7])

    d = prop.propose(1, h, 6, 3, st, grammar_bitmask=grammar)
    assert [x for x, _ in seen] == [0, 1, 2] and seen[1][1] == d[:1] and seen[2][1] == d[:2]
    assert d == [100, 101 + d[0] % 7, 102 + (d[0] + d[1]) % 7]
    prop.after_verify(0, st)
    # [1, W] (xgrammar's allocate_token_bitmask(1, V)) is one mask for every position
    d = prop.propose(1, h, 7, 3, st, grammar_bitmask=allowed_only([23, 42])[None])
    assert len(d) == 3 and set(d) <= {23, 42}
    prop.after_verify(0, st)


def test_grammar_in_batch_is_per_sequence(make_prop):
    prop = make_prop("exact")
    a, rng, _, _ = prefilled(prop, 4, seed=1)
    b, _, _, _ = prefilled(prop, 4, seed=2)
    d = prop.propose_batch([1, 2], rand_hiddens(rng, 2, H), [4, 4], 2, [a, b],
                           grammar_bitmasks=[allowed_only([9]), None])
    assert d[0] == [9, 9] and len(d[1]) == 2
    prop.after_verify(0, a)
    prop.after_verify(0, b)
    empty = np.zeros_like(allowed_only([9]))
    with pytest.raises(NoAllowedToken, match=r"draft position 1 of sequence 1 \(states\[1\]\): the grammar "
                                              r"bitmask allows no token") as e:
        prop.propose_batch([1, 2], rand_hiddens(rng, 2, H), [5, 5], 2, [a, b],
                           grammar_bitmasks=[None, lambda i, d: None if i == 0 else empty])
    assert (e.value.row, e.value.draft) == (1, 1)


def test_apply_target_norm_equals_prenormed_hiddens(make_prop, ref_weights):
    """An engine handing pre-norm hiddens with apply_target_norm=True drafts what an
    engine handing the normed hiddens drafts."""
    with_norm = make_prop("exact", apply_target_norm=True)
    plain = make_prop("exact")
    rng = np.random.default_rng(3)
    toks = rng.integers(0, V, 9).tolist()
    hid = rand_hiddens(rng, 10, H)
    tn = ref_weights.target_norm
    normed = rmsnorm(hid, tn, 1e-5).astype(np.float32)
    s1, s2 = with_norm.alloc_state(), plain.alloc_state()
    with_norm.prefill_drafter(toks, hid[:9], s1)
    plain.prefill_drafter(toks, normed[:9], s2)
    assert with_norm.propose(3, hid[9], 9, 3, s1) == plain.propose(3, normed[9], 9, 3, s2)


def test_chain_choice_changes_later_modules(make_prop):
    pre, post = make_prop("draft", chain="prenorm"), make_prop("draft", chain="postnorm")
    s1, rng, _, _ = prefilled(pre, 6)
    s2, _, _, _ = prefilled(post, 6)
    h = rand_hiddens(rng, 1, H)[0]
    d1, d2 = pre.propose(4, h, 6, 3, s1), post.propose(4, h, 6, 3, s2)
    assert d1[0] == d2[0]                       # module 0 does not see the chain
    k1, _ = kv_rows(pre, s1, 1)
    k2, _ = kv_rows(post, s2, 1)
    assert not np.allclose(k1, k2)              # module 1 reads y or norm(y)


@pytest.mark.parametrize("mode", ["exact", "draft"])
def test_carried_state_drafts_like_a_rebuilt_one(make_prop, mode):
    """Turn 1 ends; its drafter KV is carried; turn 2's new tokens are caught up; the
    drafts equal those of a state prefilled over the whole history (exact mode)."""
    prop = make_prop(mode, num_blocks=200)
    rng = np.random.default_rng(9)
    n1, n2 = 7, 5
    toks = rng.integers(0, V, 40).tolist()
    hid = rand_hiddens(rng, 40, H)
    st = prop.alloc_state()
    prop.prefill_drafter(toks[:n1], hid[:n1], st)
    P = n1
    for a in (2, 0, 3):                          # turn 1: three speculative rounds, verifier = history
        d = prop.propose(toks[P], hid[P - 1], P, 3, st)
        d_ok = [min(a, len(d))]
        prop.after_verify(d_ok[0], st)
        accepted = toks[P + 1:P + 1 + d_ok[0]]   # the verified continuation
        if mode == "exact":
            # drafts that were accepted must be the history's tokens; use them as the truth
            accepted = d[:d_ok[0]]
            toks[P + 1:P + 1 + d_ok[0]] = accepted
        prop.catchup_drafter(accepted, hid[P:P + d_ok[0]], st)
        P += 1 + d_ok[0]
    N = P + 1                                    # turn 1 ends after the bonus token t_P
    if mode == "exact":
        prop.catchup_drafter([toks[P]], hid[P - 1:P], st)
    kv = prop.take_drafter_kv(st)
    assert st.rows_per_module() == [0, 0, 0] and kv.rows > 0
    prop.free_state(st)
    nxt = prop.alloc_state()
    assert prop.install_drafter_kv(nxt, kv)
    new = toks[N:N + n2]                         # turn 2's prompt tokens
    prop.catchup_drafter(new, hid[N - 1:N - 1 + n2], nxt)
    Q = N + n2
    if mode == "draft":
        d = prop.propose(toks[Q], hid[Q - 1], Q, 3, nxt)
        assert len(d) == 3 and prop.last_pair_key(nxt) == Q - 1
        return
    fresh = prop.alloc_state()
    prop.prefill_drafter(toks[:Q], hid[:Q], fresh)
    assert nxt.rows_per_module() == fresh.rows_per_module()
    for m in range(3):
        assert_close(kv_rows(prop, nxt, m)[0], kv_rows(prop, fresh, m)[0], what=f"module {m} K")
    assert prop.propose(toks[Q], hid[Q - 1], Q, 3, nxt) == prop.propose(toks[Q], hid[Q - 1], Q, 3, fresh)
    prop.check_invariants()


def test_budget_reservation_protects_a_sequence(make_prop):
    prop = make_prop("exact", num_blocks=10)           # 40 rows per module
    rng = np.random.default_rng(4)
    vip = prop.alloc_state_for(21)                     # 21 tokens + M = 3 lookahead: 6 blocks per module
    assert prop.kv_blocks_in_use() == [0, 0, 0]
    other = prop.alloc_state()
    with pytest.raises(KvCacheFull):                   # only 4 unpromised blocks are left
        prop.prefill_drafter(rng.integers(0, V, 20).tolist(), rand_hiddens(rng, 20, H), other)
    prop.prefill_drafter(rng.integers(0, V, 16).tolist(), rand_hiddens(rng, 16, H), other)
    prop.prefill_drafter(rng.integers(0, V, 20).tolist(), rand_hiddens(rng, 20, H), vip)
    P = 20
    while P < 23:                                      # vip grows to its budget with the pool full
        d = prop.propose(1, rand_hiddens(rng, 1, H)[0], P, 3, vip)
        prop.after_verify(1, vip)
        prop.catchup_drafter(d[:1], rand_hiddens(rng, 1, H), vip)
        P += 2
    prop.check_invariants()
    with pytest.raises(ValueError, match="budget_tokens: expected >= 1, got 0"):
        prop.alloc_state_for(0)
    assert prop.alloc_state_for(None).kv[0].budget == 0


def test_budget_across_take_and_install(make_prop):
    """take_drafter_kv ends the sequence its budget was for: the state is left like a new
    alloc_state() and its unused reservation returns to the pools. install_drafter_kv
    into a budgeted state counts the carried blocks within the budget (history + this
    turn), so the reservation shrinks by them; the promise still holds after."""
    prop = make_prop("exact", num_blocks=10, block_size=4)    # 40 rows per module
    rng = np.random.default_rng(9)
    st = prop.alloc_state_for(13)                              # 13 + M = 16 tokens: 4 blocks per module
    toks, hid = rng.integers(0, V, 40).tolist(), rand_hiddens(rng, 40, H)
    prop.prefill_drafter(toks[:9], hid[:9], st)                # module m: 8 - m rows -> 2 blocks each
    held = [len(s.blocks) for s in st.kv]
    assert held == [2, 2, 2] and [s.reserved for s in st.kv] == [2, 2, 2]
    kv = prop.take_drafter_kv(st)
    assert [(s.budget, s.reserved, len(s.blocks)) for s in st.kv] == [(0, 0, 0)] * 3
    assert [h.pool.reserved for h in prop.modules] == [0, 0, 0]
    prop.check_invariants()
    nxt = prop.alloc_state_for(21)                             # 6 blocks: history (2) + 4 more
    assert [s.reserved for s in nxt.kv] == [6, 6, 6]
    prop.install_drafter_kv(nxt, kv)
    assert [(len(s.blocks), s.reserved) for s in nxt.kv] == [(2, 4), (2, 4), (2, 4)]
    prop.check_invariants()
    hog = prop.alloc_state()                                   # takes every unpromised block
    prop.prefill_drafter(toks[:17], hid[:17], hog)
    with pytest.raises(KvCacheFull):
        prop.catchup_drafter(toks[17:20], hid[17:20], hog)
    P = 9                                                      # nxt grows to 24 tokens in its budget
    while P < 22:
        d = prop.propose(toks[P], hid[P - 1], P, 3, nxt)
        prop.after_verify(1, nxt)
        prop.catchup_drafter(d[:1], rand_hiddens(rng, 1, H), nxt)
        P += 2
        prop.check_invariants()
    prop.free_state(nxt)
    prop.free_state(hog)
    prop.free_state(st)
    assert prop.kv_blocks_in_use() == [0, 0, 0] and [h.pool.reserved for h in prop.modules] == [0, 0, 0]


def test_acceptance_stats(make_prop):
    prop = make_prop("exact")
    st, rng, _, _ = prefilled(prop, 4)
    P = 4
    for a in (3, 1, 0):
        d = prop.propose(1, rand_hiddens(rng, 1, H)[0], P, 3, st)
        prop.after_verify(a, st)
        prop.catchup_drafter(d[:a], rand_hiddens(rng, a, H), st)
        P += 1 + a
    s = prop.stats
    assert s.drafted == [3, 3, 3] and s.accepted == [2, 1, 1] and s.verifies == 3
    assert s.mean_accepted_length == pytest.approx(4 / 3) and s.acceptance_rate(2) == pytest.approx(1 / 3)
    s.reset()
    assert s.drafted == [0, 0, 0] and s.mean_accepted_length == 0.0
    with pytest.raises(ValueError, match=r"module: expected in \[0, 2\], got 5"):
        s.acceptance_rate(5)


def test_reprs_are_short(make_prop):
    """A state and a carried entry print their counts, not the window's hidden arrays."""
    prop = make_prop("exact")
    st, rng, _, _ = prefilled(prop, 6)
    assert repr(st) == ("MtpState(rows per module=[5, 4, 3], verified tokens=6, hiddens=5, next position=6, "
                        "ready)")
    kv = prop.take_drafter_kv(st)
    assert repr(kv).startswith("DrafterKv(rows per module=[5, 4, 3], blocks per module=[2, 1, 1]") and len(repr(kv)) < 200
    prop.free_drafter_kv(kv)


def test_trait_defaults():
    class Minimal(DraftProposer):
        def alloc_state(self):
            return object()

        def propose(self, last_token, target_hidden, position, num_drafts, state, grammar_bitmask=None):
            return [last_token]

        def after_verify(self, num_accepted, state):
            pass

    p = Minimal()
    st = p.alloc_state_for(100)
    assert p.catchup_drafter([1], None, st) == 0 and p.prefill_drafter([1], None, st) == 0
    assert p.propose_batch([1], None, [1], 1, [st]) is None and p.propose_batch_max() == 1
    assert p.take_drafter_kv(st) is None and p.install_drafter_kv(st, None) is False
    assert (p.block_gamma(), p.needs_comm(), p.prefill_uses_shared_buffers()) == (None, False, False)
    assert p.prefill_hidden_rows(4096) == 4096 and p.drafter_rows(st) == 0 and p.last_pair_key(st) is None
    assert p.read_deferred_draft_token() == 0 and p.catchup_batch([[1]], [None], [st]) == 0


def test_multi_module_queries(make_prop):
    prop = make_prop("exact", max_batch=8)
    assert prop.num_modules == 3 and prop.propose_batch_max() == 8 and prop.block_gamma() is None
    small = make_prop("draft", max_batch=8, num_blocks=5)       # each sequence needs a block of module 0
    assert small.propose_batch_max() == 5
    sts = [small.alloc_state() for _ in range(6)]
    with pytest.raises(ValueError, match=r"states: expected 1..5 states \(propose_batch_max\), got 6"):
        small.propose_batch(list(range(6)), np.zeros((6, H), np.float32), [1] * 6, 1, sts)
    assert not prop.needs_comm() and not prop.prefill_uses_shared_buffers()
    assert prop.prefill_hidden_rows(1000) == 1000


def test_mtp_head_forward_one(make_prop):
    prop = make_prop("draft")
    head: MtpHead = prop.modules[0]
    rng = np.random.default_rng(2)
    seq = head.alloc_seq()
    steps = []
    for t, p in [(3, 1), (4, 2), (5, 3)]:
        steps.append(head.forward_one(t, rand_hiddens(rng, 1, H)[0], p, seq))
    assert seq.rows == 3 and seq.keys.to_list() == [0, 1, 2]
    assert all(0 <= s.draft < V for s in steps) and steps[0].hidden.shape == (1, H)
    with pytest.raises(ValueError, match="key: expected > 2"):
        head.forward_one(1, rand_hiddens(rng, 1, H)[0], 3, seq)
    from mtpkern import NoAllowedToken

    with pytest.raises(NoAllowedToken):
        head.forward_one(1, rand_hiddens(rng, 1, H)[0], 4, seq, grammar_bitmask=np.zeros(10, np.int32))
    assert seq.rows == 3
    head.free_seq(seq)
    assert head.pool.num_used == 0


def test_memory_reports_weights_once_and_the_pools(make_prop, tmp_path, tiny_cfg):
    prop = make_prop("exact", num_blocks=20, block_size=4)
    mem = prop.memory()
    cfg = prop.config
    assert mem.kv_block == 2 * 4 * cfg.num_key_value_heads * cfg.head_dim * 4          # K + V, FP32 KV
    assert mem.kv_pools == mem.kv_block * 20 * cfg.num_modules and mem.kv_in_use == 0
    rng = np.random.default_rng(11)
    st = prop.alloc_state()
    prop.prefill_drafter(rng.integers(0, V, 9).tolist(), rand_hiddens(rng, 9, H), st)  # 8, 7, 6 rows
    assert prop.memory().blocks_in_use == (2, 2, 2) and prop.memory().kv_in_use == 6 * mem.kv_block
    # every module's own (identical) embedding and head are held once, as the target's are
    own = write_synthetic_checkpoint(tmp_path / "own", tiny_cfg, seed=7, own_embed=True, own_head=True)
    assert make_prop("exact", ckpt=own).memory().weights == mem.weights
    assert mem.total == mem.weights + mem.kv_pools


def test_close_releases_everything_and_refuses_later_calls(tiny_ckpt):
    rng = np.random.default_rng(12)
    with MultiModuleMtpHead.from_pretrained(tiny_ckpt, backend="numpy", block_size=4, num_blocks=32) as prop:
        st = prop.alloc_state()
        prop.prefill_drafter(rng.integers(0, V, 9).tolist(), rand_hiddens(rng, 9, H), st)
        kv = prop.take_drafter_kv(st)
        busy = prop.alloc_state()
        prop.prefill_drafter([1, 2, 3], rand_hiddens(rng, 3, H), busy)

        def grammar(i, drafts):
            with pytest.raises(StateError, match="in use by propose"):
                prop.close()                              # refused while a call runs: nothing released
            return None

        prop.propose(1, rand_hiddens(rng, 1, H)[0], 3, 1, busy, grammar_bitmask=grammar)
        assert prop.kv_blocks_in_use() != [0, 0, 0] and "closed" not in repr(prop)
    assert prop.kv_blocks_in_use() == [0, 0, 0] and all(p.k is None for p in prop.pools)
    assert busy.freed and st.freed and kv.consumed and "closed" in repr(prop)
    for call in (prop.alloc_state, lambda: prop.propose(1, np.zeros(H, np.float32), 4, 1, busy),
                 lambda: prop.free_drafter_kv(kv)):
        with pytest.raises(StateError, match="closed"):
            call()
    prop.close()                                          # twice: nothing to do
