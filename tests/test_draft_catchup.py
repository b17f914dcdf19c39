"""``catchup_drafter`` keeps the drafter current without drafting (docs/api.md, "Steps
without drafting").

Twin tests: a state driven through steps decoded without proposing (K = 0), a prompt
prefilled in chunks (prefill, then catch-ups of the rest) or a new turn after a carry
(``take_drafter_kv`` / ``install_drafter_kv``) holds, in module 0, the rows a state
prefilled at once with the same tokens holds, and drafts what it drafts. In draft mode
that is module 0's catch-up rows (modules ``m >= 1`` keep one row per propose); exact
mode as before. The negative control puts back the draft-mode catch-up that wrote
nothing and sees the twins part.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import kv_rows, rand_hiddens
from mtpkern import MultiModuleMtpHead
from mtpkern.draft import DraftChain
from mtpkern.errors import StateError
from mtpkern.tolerance import assert_close

H = 64                                             # tiny_config's hidden size
MODES = ["draft", "exact"]
BACKENDS = ["numpy", "cpu"]


def _prop(ckpt, mode, backend, **kw):
    kw.setdefault("block_size", 4)
    kw.setdefault("num_blocks", 128)
    kw.setdefault("prefill_chunk", 3)              # catch-ups of more rows than that run in chunks
    return MultiModuleMtpHead.from_pretrained(ckpt, backend=backend, kv_mode=mode, **kw)


def _same_module0(prop, a, b, what):
    assert a.rows_per_module()[0] == b.rows_per_module()[0], f"{what}: module 0 rows"
    assert prop.last_pair_key(a) == prop.last_pair_key(b), f"{what}: module 0 last key"
    tol = "float32" if np.dtype(prop.backend.kv_dtype) == np.float32 else "bfloat16"
    for x, y, name in zip(kv_rows(prop, a, 0), kv_rows(prop, b, 0), "KV"):
        assert_close(x, y, tol, what=f"{what}: module 0 {name}")


def _seq(rng, V, n):
    return rng.integers(0, V, n).tolist(), rand_hiddens(rng, n, H)


def _k0_stretch(prop, toks, hid, n0, steps):
    """Prefill ``toks[:n0]``, then catch-ups of ``steps`` tokens each (a K = 0 stretch when
    every step is 1, the rest of a chunked prefill otherwise) up to ``len(toks)``."""
    st = prop.alloc_state()
    prop.prefill_drafter(toks[:n0], hid[:n0], st)
    j = n0
    for c in steps:
        before = sum(st.rows_per_module())
        # pair i: (t_j, h_{j-1}): the hidden at the position before the token
        rows = prop.catchup_drafter(toks[j:j + c], hid[j - 1:j - 1 + c], st)
        assert rows == sum(st.rows_per_module()) - before
        if prop.kv_mode == "draft":
            assert rows == c and st.rows_per_module()[1:] == [0] * (prop.num_modules - 1)
        j += c
    assert j == len(toks)
    return st


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n0,steps", [(4, [1] * 7), (2, [5, 1, 4]), (1, [9])],
                         ids=["k0-stretch", "chunked-prefill", "prompt-of-one"])
def test_catchup_twin_of_a_prefill(tiny_ckpt, mode, backend, n0, steps):
    prop = _prop(tiny_ckpt, mode, backend)
    rng = np.random.default_rng(1)
    N = n0 + sum(steps)
    toks, hid = _seq(rng, prop.config.vocab_size, N + 1)
    st = _k0_stretch(prop, toks[:N], hid, n0, steps)
    twin = prop.alloc_state()
    prop.prefill_drafter(toks[:N], hid[:N], twin)
    assert st.rows_per_module() == twin.rows_per_module()
    assert (st.num_verified, st.num_hiddens, st.next_position) == (twin.num_verified, twin.num_hiddens,
                                                                   twin.next_position) == (N, N - 1, N)
    _same_module0(prop, st, twin, "before the propose")
    st.check_invariants()
    d = prop.propose(toks[N], hid[N - 1], N, prop.num_modules, st)
    assert d == prop.propose(toks[N], hid[N - 1], N, prop.num_modules, twin)
    for m in range(prop.num_modules):                # no module m >= 1 row before: every module alike
        for x, y in zip(kv_rows(prop, st, m), kv_rows(prop, twin, m)):
            assert_close(x, y, "float32", what=f"after the propose: module {m}")
    prop.check_invariants()


def _drafting_run(prop, rng, toks, hid, n0, plan):
    """Prefill ``toks[:n0]``, then per entry of ``plan`` ``(k, a, extra)``: a propose of ``k``
    drafts at the next position, ``a`` accepted, then a catch-up of the accepted drafts and
    ``extra`` more tokens (decoded without drafting); ``toks`` / ``hid`` are overwritten with
    the drafts accepted, so that they are the sequence's. Returns the state."""
    st = prop.alloc_state()
    prop.prefill_drafter(toks[:n0], hid[:n0], st)
    P = n0
    for k, a, extra in plan:
        d = prop.propose(toks[P], hid[P - 1], P, k, st)
        prop.after_verify(a, st)
        toks[P + 1:P + 1 + a] = d[:a]
        c = a + extra
        rows = prop.catchup_drafter(toks[P + 1:P + 1 + c], hid[P:P + c], st)
        if prop.kv_mode == "draft":
            assert rows == c, f"draft mode: {rows} rows for {c} tokens (module 0's, one each)"
        P += 1 + c
    assert st.next_position == P
    return st, P


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", MODES)
def test_drafting_with_k0_steps_twin(tiny_ckpt, mode, backend):
    """Proposes with accepted drafts, and K = 0 steps between them: module 0 holds the
    prefill's rows, and module 0's draft (num_drafts=1) is the prefilled twin's."""
    prop = _prop(tiny_ckpt, mode, backend)
    rng = np.random.default_rng(2)
    toks, hid = _seq(rng, prop.config.vocab_size, 40)
    st, P = _drafting_run(prop, rng, toks, hid, 5, [(3, 2, 0), (2, 0, 4), (1, 1, 1), (3, 3, 0), (2, 1, 2)])
    twin = prop.alloc_state()
    prop.prefill_drafter(toks[:P], hid[:P], twin)
    _same_module0(prop, st, twin, "after the rounds")
    assert prop.propose(toks[P], hid[P - 1], P, 1, st) == prop.propose(toks[P], hid[P - 1], P, 1, twin)
    prop.check_invariants()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", MODES)
def test_new_turn_after_a_carry_twin(tiny_ckpt, mode, backend):
    """A turn, its KV taken and installed into a new state, the next turn's prompt given to
    ``catchup_drafter`` (in chunks): module 0 as a prefill of the whole conversation."""
    prop = _prop(tiny_ckpt, mode, backend)
    rng = np.random.default_rng(3)
    toks, hid = _seq(rng, prop.config.vocab_size, 40)
    st, P = _drafting_run(prop, rng, toks, hid, 6, [(3, 1, 1), (2, 2, 0)])
    # the turn's last sampled token t_P was decoded: a K = 0 step ends the turn
    assert prop.catchup_drafter(toks[P:P + 1], hid[P - 1:P], st) in ((1,) if mode == "draft" else (1, 2, 3, 4))
    P += 1
    carried = prop.take_drafter_kv(st)
    new = prop.alloc_state()
    prop.install_drafter_kv(new, carried)
    assert new.next_position == P
    with pytest.raises(StateError, match="catchup_drafter"):       # a live state: prefill refuses
        prop.prefill_drafter(toks[P:P + 5], hid[P:P + 5], new)
    for c in (5, 1, 4):                                             # the new turn's prompt
        prop.catchup_drafter(toks[P:P + c], hid[P - 1:P - 1 + c], new)
        P += c
    twin = prop.alloc_state()
    prop.prefill_drafter(toks[:P], hid[:P], twin)
    _same_module0(prop, new, twin, "the new turn")
    assert prop.propose(toks[P], hid[P - 1], P, 1, new) == prop.propose(toks[P], hid[P - 1], P, 1, twin)
    prop.check_invariants()


def test_negative_control_the_old_noop_parts_the_twins(tiny_ckpt, monkeypatch):
    """With the draft-mode catch-up that wrote nothing (and moved no counter), the K = 0
    twins part: module 0 lacks the stretch's rows, and the twin check says so."""
    monkeypatch.setattr(DraftChain, "catch_up", lambda self, sts, toks, hids: 0)
    prop = _prop(tiny_ckpt, "draft", "numpy")
    rng = np.random.default_rng(1)
    toks, hid = _seq(rng, prop.config.vocab_size, 12)
    st = prop.alloc_state()
    prop.prefill_drafter(toks[:4], hid[:4], st)
    for j in range(4, 11):
        assert prop.catchup_drafter(toks[j:j + 1], hid[j - 1:j], st) == 0
    twin = prop.alloc_state()
    prop.prefill_drafter(toks[:11], hid[:11], twin)
    assert st.rows_per_module()[0] == 3 and twin.rows_per_module()[0] == 10
    with pytest.raises(AssertionError, match="module 0 rows"):
        _same_module0(prop, st, twin, "the old no-op")


@pytest.mark.parametrize("mode", MODES)
def test_catchup_batch_equals_one_at_a_time(tiny_ckpt, mode):
    prop = _prop(tiny_ckpt, mode, "numpy")
    rng = np.random.default_rng(4)
    V = prop.config.vocab_size
    seqs = [_seq(rng, V, n) for n in (9, 6, 12)]
    one, many = [], []
    for toks, hid in seqs:
        a, b = prop.alloc_state(), prop.alloc_state()
        prop.prefill_drafter(toks[:3], hid[:3], a)
        prop.prefill_drafter(toks[:3], hid[:3], b)
        prop.catchup_drafter(toks[3:], hid[2:-1], a)
        one.append(a)
        many.append(b)
    got = prop.catchup_batch([t[3:] for t, _ in seqs], [h[2:-1] for _, h in seqs], many)
    if mode == "draft":
        assert got == sum(len(t) - 3 for t, _ in seqs)
    for a, b in zip(one, many):
        _same_module0(prop, a, b, "batch")
        assert a.rows_per_module() == b.rows_per_module()
    prop.check_invariants()


@pytest.mark.parametrize("mode", MODES)
def test_catchup_rules(tiny_ckpt, mode):
    """A fresh state is refused (prefill first); no tokens is a no-op; a call that fails
    (a full pool) changes nothing."""
    from mtpkern.errors import KvCacheFull

    prop = _prop(tiny_ckpt, mode, "numpy", num_blocks=6, prefill_chunk=256)
    rng = np.random.default_rng(5)
    st = prop.alloc_state()
    with pytest.raises(StateError, match=f"{mode} kv_mode needs prefill_drafter before catchup_drafter"):
        prop.catchup_drafter([1], rand_hiddens(rng, 1, H), st)
    assert prop.catchup_drafter([], None, st) == 0
    prop.prefill_drafter([1, 2, 3], rand_hiddens(rng, 3, H), st)
    before = (st.rows_per_module(), [list(q.blocks) for q in st.kv], st.num_verified, st.num_hiddens,
              st.next_position, prop.kv_blocks_in_use())
    with pytest.raises(KvCacheFull):
        prop.catchup_drafter(list(range(40)), rand_hiddens(rng, 40, H), st)
    assert before == (st.rows_per_module(), [list(q.blocks) for q in st.kv], st.num_verified, st.num_hiddens,
                      st.next_position, prop.kv_blocks_in_use())
    prop.check_invariants()


def test_draft_mode_catchup_rolls_back_a_failed_forward(tiny_ckpt, monkeypatch):
    """A forward that raises in the second chunk: every state as before the call."""
    prop = _prop(tiny_ckpt, "draft", "numpy")
    rng = np.random.default_rng(6)
    st = prop.alloc_state()
    prop.prefill_drafter([1, 2, 3], rand_hiddens(rng, 3, H), st)
    before = (st.rows_per_module(), [list(q.blocks) for q in st.kv], st.num_hiddens, st.num_verified,
              prop.kv_blocks_in_use())
    head = prop.modules[0]
    calls = []
    orig = head._forward

    def boom(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return orig(*a, **kw)

    monkeypatch.setattr(head, "_forward", boom)
    with pytest.raises(RuntimeError, match="boom"):
        prop.catchup_drafter(list(range(7)), rand_hiddens(rng, 7, H), st)
    assert before == (st.rows_per_module(), [list(q.blocks) for q in st.kv], st.num_hiddens, st.num_verified,
                      prop.kv_blocks_in_use())
    monkeypatch.undo()
    assert prop.catchup_drafter(list(range(7)), rand_hiddens(rng, 7, H), st) == 7
    prop.check_invariants()


@pytest.mark.parametrize("mode", MODES)
def test_propose_of_no_drafts_is_a_noop(tiny_ckpt, mode):
    prop = _prop(tiny_ckpt, mode, "numpy")
    rng = np.random.default_rng(7)
    a, b = prop.alloc_state(), prop.alloc_state()
    for st in (a, b):
        prop.prefill_drafter([1, 2, 3, 4], rand_hiddens(rng, 4, H), st)

    def snap():
        return [(s.rows_per_module(), s.num_verified, s.num_hiddens, s.next_position, s.drafted,
                 s.last_drafts) for s in (a, b)], prop.stats.verifies, prop.kv_blocks_in_use()

    before = snap()
    conf = [0.5]
    assert prop.propose(5, rand_hiddens(rng, 1, H)[0], 4, 0, a, out_conf=conf) == []
    assert conf == []
    conf = [0.5]
    assert prop.propose_batch([5, 6], rand_hiddens(rng, 2, H), [4, 4], 0, [a, b], out_conf=conf) == [[], []]
    assert conf == [[], []]
    assert snap() == before
    with pytest.raises(StateError, match="after_verify without a propose"):
        prop.after_verify(0, a)
    with pytest.raises(ValueError, match="num_drafts: expected >= 0, got -1"):
        prop.propose(5, rand_hiddens(rng, 1, H)[0], 4, -1, a)
    with pytest.raises(ValueError, match="position"):            # checked as any propose
        prop.propose(5, rand_hiddens(rng, 1, H)[0], 2, 0, a)
    prop.check_invariants()


def test_cuda_emulated_k0_stretch_twin(tiny_ckpt, emulator):
    """One small case on the CUDA kernels (emulated): a K = 0 stretch in draft mode."""
    from cuda_emu import emu_backend

    prop = _prop(tiny_ckpt, "draft", emu_backend.backend("float32"))
    rng = np.random.default_rng(8)
    toks, hid = _seq(rng, prop.config.vocab_size, 8)
    st = _k0_stretch(prop, toks[:7], hid, 3, [1, 3])
    twin = prop.alloc_state()
    prop.prefill_drafter(toks[:7], hid[:7], twin)
    _same_module0(prop, st, twin, "emulated")
    assert prop.propose(toks[7], hid[6], 7, 2, st) == prop.propose(toks[7], hid[6], 7, 2, twin)
    prop.check_invariants()


def test_windowed_module_0_catchup_holds_its_window(tmp_path):
    """A sliding window of 5 keys in every module: a long catch-up (in chunks of 3) holds
    module 0 to its window's blocks, during and after the call, and its live rows are a
    prefill's."""
    from mtpkern.config import tiny_config
    from mtpkern.weights import write_synthetic_checkpoint

    ckpt = write_synthetic_checkpoint(tmp_path, tiny_config(sliding_window=5), seed=9)
    prop = _prop(ckpt, "draft", "numpy", num_blocks=12)           # 59 rows would take 15 blocks
    rng = np.random.default_rng(9)
    toks, hid = _seq(rng, prop.config.vocab_size, 70)
    st = prop.alloc_state()
    prop.prefill_drafter(toks[:3], hid[:3], st)
    assert prop.catchup_drafter(toks[3:60], hid[2:59], st) == 57     # blocks reused between chunks
    most = -(-(5 + 0 + 4 - 2) // 4)                                   # ceil((W + T + BS - 2) / BS), T = 0
    assert len(st.kv[0].blocks) <= most
    twin = prop.alloc_state()
    prop.prefill_drafter(toks[:60], hid[:60], twin)
    assert st.kv[0].rows == twin.kv[0].rows == 59 and st.kv[0].base == twin.kv[0].base
    for x, y in zip(kv_rows(prop, st, 0), kv_rows(prop, twin, 0)):
        assert_close(x, y, "float32", what="windowed module 0")
    assert prop.propose(toks[60], hid[59], 60, 3, st) == prop.propose(toks[60], hid[59], 60, 3, twin)
    prop.check_invariants()
