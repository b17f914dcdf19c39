"""Shared and forked drafter KV (``fork_state``, ``share_prefix``; docs/kv_pool.md).

A fork, and a state that shares a prefix with another and catches up the rest, must draft
and hold KV exactly as an unshared twin built from scratch with the same calls; the state it
shares with must not see any of its later rows (copy-on-write); no block goes back to the
pool while a state still holds it, and the pools end empty.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from conftest import kv_rows
from mtpkern.errors import StateError
from mtpkern.kv import BlockPool


def _hid(H: int, j: int, salt: int = 0) -> np.ndarray:
    """The target hidden at position ``j`` (the same for every state that has that position's
    tokens: ``salt`` tells two requests apart past their common prefix)."""
    return np.random.default_rng(1000 * salt + j).standard_normal(H).astype(np.float32)


class Seq:
    """What the engine knows of one sequence: its tokens (``toks[P]`` is ``t_P``, the next
    propose's last token) and hiddens per position."""

    def __init__(self, toks: list[int], salt_from: int = 10**9, salt: int = 0):
        self.toks = list(toks)
        self.salt_from, self.salt = salt_from, salt

    def hid(self, H: int, j: int) -> np.ndarray:
        return _hid(H, j, self.salt if j >= self.salt_from else 0)

    def hids(self, H: int, lo: int, hi: int) -> np.ndarray:
        return np.stack([self.hid(H, j) for j in range(lo, hi)]) if hi > lo else np.zeros((0, H), np.float32)

    def copy(self) -> "Seq":
        return Seq(self.toks, self.salt_from, self.salt)


def prefill(prop, st, seq: Seq, n: int) -> None:
    prop.prefill_drafter(seq.toks[:n], seq.hids(prop.config.stream_size, 0, n), st)


def steps(prop, st, seq: Seq, P: int, seed: int, count: int) -> tuple[int, list]:
    """``count`` propose / verify (random accepts, a random bonus token) / catch-up rounds
    from position ``P``; returns (the next position, the drafts)."""
    rng = np.random.default_rng(seed)
    H, V = prop.config.stream_size, prop.config.vocab_size
    out = []
    for _ in range(count):
        d = prop.propose(seq.toks[P], seq.hid(H, P - 1), P, 3, st)
        a = int(rng.integers(0, len(d) + 1))
        prop.after_verify(a, st)
        del seq.toks[P + 1:]
        seq.toks += d[:a] + [int(rng.integers(0, V))]
        if prop.kv_mode == "exact":
            prop.catchup_drafter(d[:a], seq.hids(H, P, P + a), st)
        prop.check_invariants()
        out.append(d)
        P += 1 + a
    return P, out


def rows_of(prop, st) -> list:
    """Every module's keys and K / V rows on the host."""
    return [(st.kv[m].keys.to_list(),) + kv_rows(prop, st, m) for m in range(prop.num_modules)]


def assert_same_rows(a: list, b: list, exact: bool = True) -> None:
    for m, ((ka, Ka, Va), (kb, Kb, Vb)) in enumerate(zip(a, b)):
        assert ka == kb, (m, ka, kb)
        if exact:
            np.testing.assert_array_equal(Ka, Kb, err_msg=f"module {m} K")
            np.testing.assert_array_equal(Va, Vb, err_msg=f"module {m} V")
        else:                        # rows computed in other chunks: other GEMM shapes
            np.testing.assert_allclose(Ka, Kb, rtol=1e-5, atol=1e-5, err_msg=f"module {m} K")
            np.testing.assert_allclose(Va, Vb, rtol=1e-5, atol=1e-5, err_msg=f"module {m} V")


def _prompt(prop, n: int, seed: int = 0) -> Seq:
    return Seq(np.random.default_rng(seed).integers(0, prop.config.vocab_size, n + 40).tolist())


def fork_twin(prop) -> None:
    """A state A, its fork F and B, a twin of A built from scratch by the same calls; F and B
    then go on with the same calls (F's first rows copy A's partial blocks), A on its own."""
    n = 10                                         # 9, 8, 7 exact-mode rows: partial blocks of 4
    seqA = _prompt(prop, n)
    A, B = prop.alloc_state(), prop.alloc_state()
    seqB = seqA.copy()
    prefill(prop, A, seqA, n)
    prefill(prop, B, seqB, n)
    PA, _ = steps(prop, A, seqA, n, 1, 2)
    PB, _ = steps(prop, B, seqB, n, 1, 2)
    assert PA == PB
    used = prop.kv_blocks_in_use()
    F = prop.fork_state(A)
    seqF = seqA.copy()
    seqF.toks[PA] = seqB.toks[PB] = (seqA.toks[PA] + 1) % prop.config.vocab_size   # another sample's token
    prop.check_invariants()
    assert prop.kv_blocks_in_use() == used           # a fork copies nothing
    before = rows_of(prop, A)
    assert_same_rows(rows_of(prop, F), before)
    PF, dF = steps(prop, F, seqF, PA, 2, 3)
    PB, dB = steps(prop, B, seqB, PB, 2, 3)
    assert dF == dB and PF == PB
    assert_same_rows(rows_of(prop, F), rows_of(prop, B))
    assert_same_rows(rows_of(prop, A), before)      # F's rows never reached A's blocks
    steps(prop, A, seqA, PA, 3, 2)                  # A goes on alone
    prop.free_state(A)                              # F still reads the blocks it shared with A
    prop.check_invariants()
    for m, p in enumerate(prop.pools):
        assert all(p.refs(b) >= 1 for b in F.kv[m].blocks)
        assert not set(F.kv[m].blocks) & set(p._free)
    _, dF = steps(prop, F, seqF, PF, 4, 2)
    _, dB = steps(prop, B, seqB, PB, 4, 2)
    assert dF == dB
    assert_same_rows(rows_of(prop, F), rows_of(prop, B))   # A's later rows never reached F's blocks
    assert sum(p.cow_copies for p in prop.pools) > 0
    prop.free_state(F)
    prop.free_state(B)
    prop.check_invariants()
    assert prop.kv_blocks_in_use() == [0] * prop.num_modules


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
@pytest.mark.parametrize("mode", ["exact", "draft"])
def test_fork_drafts_as_its_twin(make_prop, mode, backend):
    fork_twin(make_prop(mode, backend))


@pytest.mark.parametrize("mode", ["exact", "draft"])
def test_fork_without_copy_on_write_fails(make_prop, mode, monkeypatch):
    """The negative control: with copy-on-write switched off, the fork writes its rows into
    the blocks it shares with its source, and the twin test sees it."""
    monkeypatch.setattr(BlockPool, "_cow_blocks", lambda self, seq, new_rows: 0)
    with pytest.raises(AssertionError) as failed:
        fork_twin(make_prop(mode))
    line = str(failed.traceback[-1].statement)
    assert "cow_copies" not in line, "the twins agreed: only the copy count told the difference"


def test_fork_on_the_emulated_kernels(make_prop, emulator):
    """Copy-on-write on the CUDA backend: the block copies run on the device."""
    from cuda_emu import emu_backend

    fork_twin(make_prop("exact", emu_backend.backend("float32"), num_blocks=48))


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
@pytest.mark.parametrize("cut", ["all", "near", "far"])
def test_exact_prefix_share_catches_up_as_a_prefill(make_prop, backend, cut):
    """Exact mode: a request whose first L tokens are A's takes A's rows built from them alone
    (A's rows past them were built from A's next tokens, which this request does not have),
    catches up the rest of its prompt, and then holds and drafts what a prefill of its whole
    prompt gives; A never sees its rows."""
    prop = make_prop("exact", backend)
    H, V = prop.config.stream_size, prop.config.vocab_size
    seqA = _prompt(prop, 10)
    A = prop.alloc_state()
    prefill(prop, A, seqA, 10)
    PA, _ = steps(prop, A, seqA, 10, 1, 3)
    L = {"all": PA, "near": PA - 2, "far": 6}[cut]
    n = L + 5
    seqS = Seq(seqA.toks[:L] + np.random.default_rng(9).integers(0, V, 40).tolist(), salt_from=L, salt=1)
    before = rows_of(prop, A)
    used = prop.kv_blocks_in_use()
    S = prop.share_prefix(A, seqS.toks[:L])
    prop.check_invariants()
    assert prop.kv_blocks_in_use() == used           # nothing copied: the rows are shared
    h = S.num_hiddens
    assert S.num_verified == L and h <= L - 1
    M = prop.num_modules
    assert S.rows_per_module() == [max(0, min(h, L - m - 1)) for m in range(M)]
    if cut == "all":
        assert h == L - 1                             # A still keeps the chained outputs it needs
    prop.catchup_drafter(seqS.toks[h + 1:n], seqS.hids(H, h, n - 1), S)
    prop.check_invariants()
    B = prop.alloc_state()
    seqB = seqS.copy()
    prefill(prop, B, seqB, n)
    assert (S.num_verified, S.num_hiddens, S.next_position) == (B.num_verified, B.num_hiddens, B.next_position)
    assert_same_rows(rows_of(prop, S), rows_of(prop, B), exact=False)
    _, dS = steps(prop, S, seqS, n, 5, 3)
    _, dB = steps(prop, B, seqB, n, 5, 3)
    assert dS == dB
    assert_same_rows(rows_of(prop, S), rows_of(prop, B), exact=False)
    assert_same_rows(rows_of(prop, A), before)
    for st in (A, S, B):
        prop.free_state(st)
        prop.check_invariants()
    assert prop.kv_blocks_in_use() == [0] * M


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_draft_prefix_share_is_the_source_at_that_point(make_prop, backend):
    """Draft mode: a share of the L tokens A had verified at some point holds A's rows of that
    point (module m: the keys <= L - 2 - m; A's later rows were built from later tokens), and
    drafts on as A's twin at that point does."""
    prop = make_prop("draft", backend)
    seqA = _prompt(prop, 10)
    A, B = prop.alloc_state(), prop.alloc_state()
    seqB = seqA.copy()
    prefill(prop, A, seqA, 10)
    prefill(prop, B, seqB, 10)
    PA, _ = steps(prop, A, seqA, 10, 1, 3)
    PB, _ = steps(prop, B, seqB, 10, 1, 3)          # B: A's twin, stopped at L = PB
    L = PB
    steps(prop, A, seqA, PA, 2, 3)
    S = prop.share_prefix(A, seqA.toks[:L])
    prop.check_invariants()
    assert all(k <= L - 2 - m for m in range(prop.num_modules) for k in S.kv[m].keys.to_list())
    assert_same_rows(rows_of(prop, S), rows_of(prop, B))
    seqS = Seq(seqA.toks[:L] + seqB.toks[L:])
    _, dS = steps(prop, S, seqS, L, 3, 3)
    _, dB = steps(prop, B, seqB, L, 3, 3)
    assert dS == dB
    assert_same_rows(rows_of(prop, S), rows_of(prop, B))
    inside = prop.share_prefix(A, seqA.toks[:L - 1])   # not a verify boundary: still the prefix's rows
    assert all(k <= L - 3 - m for m in range(prop.num_modules) for k in inside.kv[m].keys.to_list())
    prop.check_invariants()
    for st in (B, A, inside, S):
        prop.free_state(st)
        prop.check_invariants()
    assert prop.kv_blocks_in_use() == [0] * prop.num_modules


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_draft_share_of_a_source_awaiting_its_catch_up(make_prop, backend):
    """Draft mode: a verify accepted drafts whose hiddens A has not been given yet. A share of
    all A's verified tokens takes A's hiddens (not L - 1: it was never given the others) and
    awaits the same catch-up; after it, the share holds what A holds after its own."""
    prop = make_prop("draft", backend)
    H = prop.config.stream_size
    seqA = _prompt(prop, 10)
    A = prop.alloc_state()
    prefill(prop, A, seqA, 10)
    P = 10
    d = prop.propose(seqA.toks[P], seqA.hid(H, P - 1), P, 3, A)
    prop.after_verify(len(d), A)                     # every draft accepted, no catch-up yet
    seqA.toks[P + 1:] = d + [0]
    L = A.num_verified
    assert A.num_hiddens < L - 1
    S = prop.share_prefix(A, seqA.toks[:L])
    prop.check_invariants()
    assert S.num_hiddens == A.num_hiddens and S.num_verified == L
    h = S.num_hiddens
    for st in (A, S):                                # the accepted drafts and their hiddens
        prop.catchup_drafter(seqA.toks[h + 1:L], seqA.hids(H, h, L - 1), st)
    assert S.num_hiddens == A.num_hiddens == L - 1
    assert S.kv[0].keys.to_list() == A.kv[0].keys.to_list() == list(range(L - 1))
    assert_same_rows(rows_of(prop, S)[:1], rows_of(prop, A)[:1])
    for st in (A, S):
        prop.free_state(st)
    prop.check_invariants()
    assert prop.kv_blocks_in_use() == [0] * prop.num_modules


def test_share_and_fork_refusals_change_nothing(make_prop):
    prop = make_prop("exact")
    seq = _prompt(prop, 10)
    A = prop.alloc_state()
    prefill(prop, A, seq, 10)
    used = prop.kv_blocks_in_use()
    n_states = len(prop._states)
    with pytest.raises(ValueError, match="prefix_tokens: expected 1 .. 10 tokens"):
        prop.share_prefix(A, seq.toks[:11])
    d = prop.propose(seq.toks[10], seq.hid(prop.config.stream_size, 9), 10, 3, A)
    with pytest.raises(StateError, match="after_verify"):
        prop.fork_state(A)
    with pytest.raises(StateError, match="after_verify"):
        prop.share_prefix(A, seq.toks[:10])
    prop.after_verify(2, A)                          # t_11, t_12 known, their hiddens not yet
    used = prop.kv_blocks_in_use()
    toks = seq.toks[:11] + d[:2]
    with pytest.raises(ValueError, match=rf"prefix_tokens\[12\]: expected {d[1]}"):
        prop.share_prefix(A, toks[:12] + [(d[1] + 1) % prop.config.vocab_size])
    assert prop.kv_blocks_in_use() == used and len(prop._states) == n_states
    S = prop.share_prefix(A, toks)                  # the tokens A knows past its hiddens: S's tail
    assert S.tail == tuple(toks[S.num_hiddens + 1:])
    prop.free_state(S)
    prop.check_invariants()


def test_a_failed_call_leaves_the_sharing_as_it_was(make_prop):
    """A propose of a fork that fails after its copy-on-write (a grammar callable raising) puts
    the shared block back: the same blocks, the same pool use."""
    prop = make_prop("exact")
    seq = _prompt(prop, 10)
    A = prop.alloc_state()
    prefill(prop, A, seq, 10)
    F = prop.fork_state(A)
    tables = [s.blocks for s in F.kv]
    used = prop.kv_blocks_in_use()

    def boom(*args):
        raise RuntimeError("grammar failed")

    with pytest.raises(RuntimeError, match="grammar failed"):
        prop.propose(seq.toks[10], seq.hid(prop.config.stream_size, 9), 10, 3, F, grammar_bitmask=boom)
    assert [s.blocks for s in F.kv] == tables and prop.kv_blocks_in_use() == used
    prop.check_invariants()


@pytest.mark.parametrize("mode", ["exact", "draft"])
def test_a_batch_of_states_sharing_a_block(make_prop, mode):
    """A source and two forks in one propose_batch: the block the three share is copied twice,
    the last holder writing into the original; each drafts as its twin alone would."""
    prop = make_prop(mode)
    H = prop.config.stream_size
    seq = _prompt(prop, 10)
    A = prop.alloc_state()
    prefill(prop, A, seq, 10)
    F, G = prop.fork_state(A), prop.fork_state(A)
    B = prop.alloc_state()
    prefill(prop, B, seq, 10)
    copies = sum(p.cow_copies for p in prop.pools)
    shared = sum(1 for m, p in enumerate(prop.pools) if A.kv[m].rows % prop.block_size)
    out = prop.propose_batch([seq.toks[10]] * 3, [seq.hid(H, 9)] * 3, [10] * 3, 3, [A, F, G])
    prop.check_invariants()
    assert sum(p.cow_copies for p in prop.pools) - copies == 2 * shared
    want = prop.propose(seq.toks[10], seq.hid(H, 9), 10, 3, B)
    assert out == [want] * 3
    for st in (A, F, G):                            # a batch of 3 against 1: other GEMM shapes
        assert_same_rows(rows_of(prop, st), rows_of(prop, B), exact=False)
    for st in (A, F, G, B):
        prop.after_verify(1, st)
        prop.free_state(st)
        prop.check_invariants()
    assert prop.kv_blocks_in_use() == [0] * prop.num_modules


def test_the_api_example_runs():
    """docs/api.md's example (n > 1 samples by fork, a prefix hit by share + catch-up) as pasted."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()
    section = text[text.index("## Sharing drafter KV"):text.index("## Queries (the trait")]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(compile(code, "docs/api.md", "exec"), {"__name__": "api_example"})


def test_a_budgeted_source_keeps_its_promise(make_prop):
    """A fork shares its budgeted source's last partial block: the source gets one more block
    reserved (it may have to copy that block on write), so its budget still covers it."""
    prop = make_prop("exact", num_blocks=24)
    seq = _prompt(prop, 10)
    A = prop.alloc_state_for(14)
    prefill(prop, A, seq, 10)
    budgets = [q.budget for q in A.kv]
    reserved = [p.reserved for p in prop.pools]
    F = prop.fork_state(A)
    partial = [int(q.rows % prop.block_size != 0) for q in A.kv]
    assert any(partial)
    assert [q.budget for q in A.kv] == [b + x for b, x in zip(budgets, partial)]
    assert [p.reserved for p in prop.pools] == [r + x for r, x in zip(reserved, partial)]
    assert [q.budget for q in F.kv] == [0] * prop.num_modules
    G = prop.fork_state(A)                           # the block is shared already: nothing more
    assert [q.budget for q in A.kv] == [b + x for b, x in zip(budgets, partial)]
    hog = prop.alloc_state()                         # every unreserved block taken by another sequence
    prefill(prop, hog, _prompt(prop, 60, seed=3), 4 * (prop.pools[0].num_free - prop.pools[0].reserved))
    P, _ = steps(prop, A, seq, 10, 1, 1)             # A's copies come out of its reservation
    prop.check_invariants()
    for st in (F, G, hog, A):
        prop.free_state(st)
    prop.check_invariants()
    assert prop.kv_blocks_in_use() == [0] * prop.num_modules and [p.reserved for p in prop.pools] == [0] * 3
