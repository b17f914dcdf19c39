"""Sliding-window modules hold O(window) KV blocks (mtpkern/kv.py, ``WindowRule``).

- the pool's rule on its own: the first row a later forward may read (exact keys and
  draft-mode gaps), the bounds, ``release_window`` after a call, ``recycle`` between
  the forwards of one call and the rollback of such a call, carry (``move_rows``),
  budgets capped by the window, block tables with released entries;
- long runs (300 tokens, W = 5, blocks of 4) in both KV modes on numpy and cpu, every
  call checked against the oracle (``mtpkern.testing.checked``), in pools of 12 blocks
  a full-attention sequence outgrows: after every call each windowed module holds at
  most its bound; a prefill and a catch-up longer than the pool; a budget the pool
  could not promise without the window; a long catch-up and a prefill that fail
  half-way change nothing and the sequence goes on;
- a config where only module 1 has a window: only module 1 releases blocks.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import MLA_FIELDS, rand_hiddens
from mtpkern import KvCacheFull, MultiModuleMtpHead, StateError, write_synthetic_checkpoint
from mtpkern.backends import get_backend
from mtpkern.config import tiny_config
from mtpkern.kv import HOLE, BlockPool, KeyRuns, WindowRule
from mtpkern.testing import checked, reference_weights

HOLDER = object()
W, BS, NB = 5, 4, 12
WINDOWED = tiny_config(sliding_window=W)
#: only module 1 has a window (dense MLPs keep the forward cheap)
MIXED = tiny_config(intermediate_size=40, blocks=[{}, {"sliding_window": 4}, {}])
#: windowed MLA modules: their latent pools give blocks back the same way
WINDOWED_MLA = tiny_config(**MLA_FIELDS, sliding_window=W)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    made = {}

    def get(name):
        if name not in made:
            cfg = {"windowed": WINDOWED, "mixed": MIXED, "full": tiny_config(), "windowed_mla": WINDOWED_MLA}[name]
            path = write_synthetic_checkpoint(tmp_path_factory.mktemp(name), cfg, seed=17, dtype="float32")
            made[name] = path, reference_weights(path)
        return made[name]
    return get


# -- the pool's rule -----------------------------------------------------------------------

def test_first_visible_row_exact_keys_and_gaps():
    rule = WindowRule(window=5, margin=0)
    keys = KeyRuns([[0, 20]])                      # a row with key 20 next sees keys 16 .. 20
    assert rule.first_visible_row(keys) == 16
    assert WindowRule(5, margin=2).first_visible_row(keys) == 14     # two rows may go first: key 18 next
    gaps = KeyRuns([[0, 10], [20, 1], [30, 1]])    # draft mode: keys 0..9, 20, 30
    assert WindowRule(5, margin=0).first_visible_row(gaps) == 11     # key 31 next sees keys 27 .. 31
    assert WindowRule(5, margin=1).first_visible_row(gaps) == 10     # or key 21 (key 30 trimmed): 17 ..
    assert WindowRule(5, margin=2).first_visible_row(gaps) == 6      # or key 10: keys 6 ..
    assert WindowRule(5, margin=3).first_visible_row(KeyRuns([[0, 3]])) == 0
    assert gaps.key_at(10) == 20 and gaps.key_at(0) == 0 and gaps.key_at(11) == 30
    with pytest.raises(IndexError, match="row: expected 0 .. 11, got 12"):
        gaps.key_at(12)
    assert (rule.idle_blocks(4), WindowRule(5, 2).idle_blocks(4), WindowRule(5, 2, 8).call_blocks(4)) == (2, 3, 5)
    with pytest.raises(ValueError, match="window: expected an int >= 1, got 0"):
        WindowRule(0)
    with pytest.raises(ValueError, match="margin: expected an int >= 0, got -1"):
        WindowRule(5, -1)


def windowed_pool(num_blocks=8, margin=0, chunk=4):
    return BlockPool(0, num_blocks, BS, 2, 8, get_backend("numpy"), window=WindowRule(W, margin, chunk))


def test_release_window_keeps_what_a_later_row_reads():
    pool = windowed_pool(margin=1)
    a = pool.new_seq(HOLDER)
    pool.append(a, 0, 13, HOLDER)                  # rows 0..12: 4 blocks
    first = a.blocks
    assert pool.release_window(a, HOLDER) == 2     # key 12 may go: key 12 next sees 8 ..: blocks 0, 1 go
    assert (a.base, a.blocks, pool.num_used) == (2, first[2:], 2)
    assert pool.window_released == 2
    assert pool.table(a).tolist() == [0, 0, *first[2:]]
    assert pool.slots(a, 8, 2).tolist() == [first[2] * 4, first[2] * 4 + 1]
    with pytest.raises(StateError, match=r"rows 7 .. 7 are not in live blocks"):
        pool.slots(a, 7, 1)
    pool.check_seq(a)
    pool.trim(a, 1, HOLDER)                        # the margin: one row may go, its rows stay readable
    pool.check_seq(a, margin=0)
    with pytest.raises(StateError, match="rows before 8 were released"):
        pool.trim(a, 5, HOLDER)
    assert a.rows == 12
    pool.append(a, 12, 1, HOLDER)
    pool.check_invariants()
    pool.release_all(a, HOLDER)
    assert (a.base, a.blocks, pool.num_used) == (0, (), 0)
    pool.check_invariants()


def test_recycle_reuses_the_calls_own_blocks_and_a_rollback_drops_them():
    pool = windowed_pool(num_blocks=8, chunk=4)
    a = pool.new_seq(HOLDER)
    pool.append(a, 0, 6, HOLDER)                   # rows 0..5 before the call: blocks e0, e1
    pool.release_window(a, HOLDER)
    before = (a.blocks, a.base, pool.num_free)
    r0 = a.rows
    pool.grow_for_call([(a, 30, HOLDER)])          # a 30-row call takes only its window's share
    assert len(a.blocks) - len(before[0]) == WindowRule(W, 0, 4).call_blocks(BS) == 3
    for c in range(0, 28, 4):                      # forwards of 4 rows, recycling in between
        pool.append(a, r0 + c, 4, HOLDER)
        pool.recycle(a, HOLDER, r0)
    assert pool.num_free == before[2] - 3          # nothing more from the free list: the call reused its own
    assert HOLE in a.blocks and a.blocks[:2] == before[0]    # the rows the call began with stay for a rollback
    pool.check_invariants()
    with pytest.raises(AssertionError, match="a hole left in the block table"):
        pool.check_seq(a)
    pool.trim(a, a.rows - r0, HOLDER)              # the rollback
    assert (a.blocks, a.base, pool.num_free) == before
    pool.check_seq(a)
    pool.check_invariants()
    pool.grow_for_call([(a, 30, HOLDER)])          # the same call, committed this time
    for c in range(0, 28, 4):
        pool.append(a, r0 + c, 4, HOLDER)
        pool.recycle(a, HOLDER, r0)
    pool.settle(a, HOLDER)
    assert a.base == (a.rows - W + 1) // BS and len(a.blocks) <= pool.window.idle_blocks(BS)
    pool.check_seq(a)
    pool.check_invariants()


def test_carry_moves_the_released_count_and_budgets_are_capped():
    pool = windowed_pool(num_blocks=10, margin=2, chunk=4)
    assert pool.blocks_for_tokens(1000) == pool.window.max_blocks(BS) == 3 + 4
    assert pool.blocks_for_tokens(9) == 3
    a, b = pool.new_seq(HOLDER), pool.new_seq("carried")
    pool.reserve(a, pool.blocks_for_tokens(1000), HOLDER)
    pool.append(a, 0, 20, HOLDER)
    pool.release_window(a, HOLDER)
    assert (a.base, len(a.blocks), a.reserved) == (3, 2, 5)     # what went back is held for a again
    pool.move_rows(a, HOLDER, b, "carried")
    assert (a.base, a.blocks, b.base, b.rows) == (0, (), 3, 20)
    with pytest.raises(StateError, match="rows can only move into an empty sequence"):
        pool.move_rows(a, HOLDER, b, "carried")
    pool.drop_budget(a, HOLDER)
    pool.move_rows(b, "carried", a, HOLDER)
    pool.check_seq(a)
    pool.check_invariants()


# -- long runs through the proposer ----------------------------------------------------------

def margin(mode: str, m: int) -> int:
    return m if mode == "exact" else min(m, 1)


def bound(cfg, mode: str, m: int) -> int | None:
    """docs/api.md: a windowed module's sequence holds ceil((W + T + BS - 2) / BS) blocks at most."""
    w = cfg.block(m).sliding_window
    return -(-(w + margin(mode, m) + BS - 2) // BS) if w else None


class Bounded:
    """A checked proposer whose windowed modules are held to their bound after every call."""

    def __init__(self, prop, weights):
        self.prop, self.p = prop, checked(prop, weights)
        self.most = [bound(prop.config, prop.kv_mode, m) for m in range(prop.num_modules)]
        self.calls = 0

    def __getattr__(self, name):
        fn = getattr(self.p, name)

        def call(*a, **kw):
            out = fn(*a, **kw)
            self.calls += 1
            used = self.prop.kv_blocks_in_use()
            for m, most in enumerate(self.most):
                if most is not None:
                    assert used[m] <= most, f"call {self.calls} ({name}): module {m} holds {used[m]} > {most} blocks"
            return out
        return call


def run_long(prop, weights, rng, tokens=300, prompt=60, extend=40):
    """Prefill ``prompt`` tokens, then propose / verify / catch-up rounds (one catch-up in
    exact mode extends the sequence by ``extend`` tokens) until ``tokens`` are verified."""
    H, V, M = prop.config.hidden_size, prop.config.vocab_size, prop.num_modules
    p = Bounded(prop, weights)
    st = p.alloc_state()
    p.prefill_drafter(rng.integers(0, V, prompt).tolist(), rand_hiddens(rng, prompt, H), st)
    P, rounds = prompt, 0
    while P < tokens:
        d = p.propose(int(rng.integers(0, V)), rand_hiddens(rng, 1, H)[0], P, M, st)
        a = len(d) if rng.random() < 0.6 else int(rng.integers(0, len(d)))
        p.after_verify(a, st)
        acc = d[:a]
        if prop.kv_mode == "exact" and rounds == 10:
            acc = acc + rng.integers(0, V, extend).tolist()        # the next turn, in one catch-up
        p.catchup_drafter(acc, rand_hiddens(rng, len(acc), H), st)
        P += 1 + len(acc)
        rounds += 1
    p.p.check()
    return st


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
@pytest.mark.parametrize("mode", ["exact", "draft"])
@pytest.mark.parametrize("name", ["windowed", "windowed_mla"])
def test_long_run_holds_the_window_not_the_sequence(ckpts, backend, mode, name):
    path, weights = ckpts(name)
    kw = dict(backend=backend, kv_mode=mode, block_size=BS, num_blocks=NB, prefill_chunk=8)
    full = MultiModuleMtpHead.from_pretrained(ckpts("full")[0], **kw)
    with pytest.raises(KvCacheFull):                # the pool is too small for a sequence that keeps its rows
        run_long(full, None, np.random.default_rng(1))
    prop = MultiModuleMtpHead.from_pretrained(path, **kw)
    st = run_long(prop, weights, np.random.default_rng(1))
    assert st.num_verified >= 300 and prop.kv_blocks_in_use()[0] <= bound(prop.config, mode, 0)
    assert all(s.base > 0 for s in st.kv[: 1 if mode == "draft" else 3])
    assert prop.pools[0].window_released > NB
    prop.free_state(st)
    assert prop.kv_blocks_in_use() == [0, 0, 0]
    prop.check_invariants()


def test_budget_is_capped_by_the_window(ckpts):
    path, weights = ckpts("windowed")
    prop = MultiModuleMtpHead.from_pretrained(path, backend="numpy", kv_mode="exact", block_size=BS,
                                              num_blocks=NB, prefill_chunk=8)
    p = checked(prop, weights)
    st = p.alloc_state_for(400)                   # 101 blocks without the window, 8 with it (module 2)
    assert [s.reserved for s in st.kv] == [pool.window.max_blocks(BS) for pool in prop.pools] == [7, 7, 8]
    rng = np.random.default_rng(3)
    H, V = prop.config.hidden_size, prop.config.vocab_size
    p.prefill_drafter(rng.integers(0, V, 100).tolist(), rand_hiddens(rng, 100, H), st)   # inside the budget
    assert [len(s.blocks) + s.reserved for s in st.kv] == [7, 7, 8]
    with pytest.raises(KvCacheFull):              # what is left cannot hold another such promise
        p.alloc_state_for(400)
    kv = p.take_drafter_kv(st)                    # carry: the released rows stay released
    # exact keys: a row may be read from key rows - T - W + 1 on (T = m)
    assert [s.base for s in kv.seqs] == [(s.rows + 1 - m - W) // BS for m, s in enumerate(kv.seqs)] == [23, 23, 22]
    assert kv.rows == 99
    nxt = p.alloc_state_for(400)
    p.install_drafter_kv(nxt, kv)
    p.catchup_drafter(rng.integers(0, V, 30).tolist(), rand_hiddens(rng, 30, H), nxt)
    p.propose(1, rand_hiddens(rng, 1, H)[0], 130, 3, nxt)
    p.check()


@pytest.mark.parametrize("mode", ["exact", "draft"])
def test_a_long_call_that_fails_half_way_changes_nothing(ckpts, mode):
    """A prefill (draft mode) or a catch-up (exact mode) that recycled blocks between its
    forwards, then raised: every row the sequence had is there again, and it goes on
    with the oracle's drafts."""
    path, weights = ckpts("windowed")
    prop = MultiModuleMtpHead.from_pretrained(path, backend="numpy", kv_mode=mode, block_size=BS, num_blocks=NB,
                                              prefill_chunk=8)
    p = checked(prop, weights)
    rng = np.random.default_rng(4)
    H, V = prop.config.hidden_size, prop.config.vocab_size
    st = p.alloc_state()
    head = prop.modules[0]
    forward, calls = head._forward, []

    def failing(*a, **kw):                        # the fifth forward of module 0 raises
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("injected failure")
        return forward(*a, **kw)

    head._forward = failing
    toks, hid = rng.integers(0, V, 60).tolist(), rand_hiddens(rng, 60, H)
    if mode == "draft":
        with pytest.raises(RuntimeError, match="injected"):
            p.prefill_drafter(toks, hid, st)      # checked: nothing changed
        assert prop.modules[0].pool.num_used == 0
        p.prefill_drafter(toks, hid, st)
    else:
        head._forward = forward
        p.prefill_drafter(toks, hid, st)
        head._forward = failing
        more = rng.integers(0, V, 50).tolist()
        with pytest.raises(RuntimeError, match="injected"):
            p.catchup_drafter(more, rand_hiddens(rng, 50, H), st)
        assert st.rows_per_module() == [59, 58, 57]
        p.catchup_drafter(more, rand_hiddens(rng, 50, H), st)
    head._forward = forward
    P = st.num_verified
    for _ in range(3):                            # the oracle agrees: no row the window reads was lost
        d = p.propose(int(rng.integers(0, V)), rand_hiddens(rng, 1, H)[0], P, 3, st)
        p.after_verify(len(d), st)
        p.catchup_drafter(d, rand_hiddens(rng, len(d), H), st)
        P += 1 + len(d)
    p.check()


def test_only_the_windowed_module_releases(ckpts):
    path, weights = ckpts("mixed")
    prop = MultiModuleMtpHead.from_pretrained(path, backend="cpu", kv_mode="exact", block_size=BS, num_blocks=96,
                                              prefill_chunk=8)
    st = run_long(prop, weights, np.random.default_rng(5), tokens=200)
    rows = st.rows_per_module()
    assert [s.base for s in st.kv][0::2] == [0, 0] and st.kv[1].base > 0
    assert [len(st.kv[m].blocks) for m in (0, 2)] == [-(-rows[m] // BS) for m in (0, 2)]
    assert len(st.kv[1].blocks) <= bound(MIXED, "exact", 1) == 2
    assert [p.window_released > 0 for p in prop.pools] == [False, True, False]
    assert prop.kv_blocks_in_use()[1] == len(st.kv[1].blocks)


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_a_short_propose_leaves_the_other_modules_trim_free(ckpts, backend):
    """Draft mode: a propose of k' drafts runs modules 0 .. k' - 1 only, so its verify can trim
    no row of the others, and the invariants hold them to the rows a later forward reads with
    nothing trimmed first. (Hypothesis found the false alarm: module 1's keys 5 9 11 14 17 19, a
    propose of 3 at 24 let block 0 go (the next key is above 19 once key 23 may go), the verify
    of 0 trimmed key 23, then a propose of 1 left module 1 as it was, and the check read its
    verified key 19 as trimmable: "rows from 3 may still be read, but blocks before row 4".)"""
    path, _ = ckpts("windowed")
    prop = MultiModuleMtpHead.from_pretrained(path, backend=backend, kv_mode="draft", block_size=BS,
                                              num_blocks=NB, prefill_chunk=5)
    rng = np.random.default_rng(5)
    H, V = prop.config.hidden_size, prop.config.vocab_size
    st = prop.alloc_state()
    prop.prefill_drafter(rng.integers(0, V, 6).tolist(), rand_hiddens(rng, 6, H), st)
    for P in (6, 10, 12, 15, 18, 20):               # module 1's keys 5 9 11 14 17 19 (each draft 0 kept)
        prop.propose(int(rng.integers(0, V)), rand_hiddens(rng, 1, H)[0], P, 2, st)
        prop.after_verify(1, st)
    assert st.kv[1].keys.to_list() == [5, 9, 11, 14, 17, 19] and st.kv[1].base == 0
    prop.propose(int(rng.integers(0, V)), rand_hiddens(rng, 1, H)[0], 24, 3, st)
    assert st.kv[1].base == 1                       # rows 0 .. 3 (keys 5 .. 14) went back
    prop.check_invariants()
    prop.after_verify(0, st)                        # key 23 goes; key 19 is verified for good
    prop.propose(int(rng.integers(0, V)), rand_hiddens(rng, 1, H)[0], 25, 1, st)
    assert st.kv[1].keys.to_list() == [5, 9, 11, 14, 17, 19]
    prop.check_invariants()                         # module 1 has nothing to trim: no alarm
    prop.after_verify(1, st)
    prop.free_state(st)
    prop.check_invariants()
