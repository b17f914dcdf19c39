"""Draft trees (mtpkern.tree): propose_tree / after_verify_tree.

The testing kit's driver checks every tree against the float64 oracle (each expanded
node's children are the top-c along its path, with their probabilities; the state after
the verify equals a chain forced along the accepted path); here: that driver over more
block forms (MLA, sliding windows, a cycled schedule, a draft vocabulary), a width-1
tree against the chain itself, per-node grammar callables, failures that change nothing,
bad input, and the layout's helpers.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import MLA_FIELDS, kv_rows, verify_tree_off_the_greedy_path
from mtpkern import MultiModuleMtpHead
from mtpkern.config import tiny_config
from mtpkern.errors import KvCacheFull, NoAllowedToken, StateError
from mtpkern.testing import reference_weights
from mtpkern.testing.checked import checked
from mtpkern.testing.driver import Call, Driver
from mtpkern.tree import DraftTree
from mtpkern.weights import write_synthetic_checkpoint

CONFIGS = {
    "moe": tiny_config(),
    "mla": tiny_config(**MLA_FIELDS),
    "window": tiny_config(sliding_window=5),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def ckpt(request, tmp_path_factory):
    path = write_synthetic_checkpoint(tmp_path_factory.mktemp(f"tree_{request.param}"), CONFIGS[request.param],
                                      seed=11)
    return request.param, path, reference_weights(path)


def _drive(prop, weights, seed: int, rounds: int = 12) -> dict:
    """Three sequences through rounds of trees (verified at once or by a later verify),
    catch-ups, chains and a free / alloc / prefill, every call checked by the kit; returns
    the steps made."""
    d = Driver(prop, weights, max_states=3)
    rng = np.random.default_rng(seed)
    script = ["tree", "verify", "catchup", "tree", "catchup", "round", "tree", "verify", "catchup"]
    for i in range(3):
        d.run(Call("alloc", seed=i, variant="plain"))
        d.run(Call("prefill", seed=i, size=int(rng.integers(1, 12))))
    for r in range(rounds):
        for kind in script:
            d.run(Call(kind, pick=int(rng.integers(0, 3)), seed=seed * 1000 + r * 10 + len(kind),
                       size=int(rng.integers(1, 4)), frac=float(rng.random()), variant=str(rng.choice(["", "skip"]))))
        if r % 4 == 3:
            d.run(Call("free", pick=int(rng.integers(0, 3))))
            d.run(Call("alloc", seed=r, variant="plain"))
            d.run(Call("prefill", seed=r, size=int(rng.integers(1, 12))))
    d.close()
    return dict(d.steps)


@pytest.mark.parametrize("mode", ["draft", "exact"])
@pytest.mark.parametrize("backend,block_size", [("numpy", 4), ("cpu", 4), ("cpu", 16)])
def test_trees_through_the_kit(ckpt, mode, backend, block_size):
    """Trees driven by the testing kit against its oracle; the cpu backend at blocks of 16
    uses its rows-innermost key cache (a tree's copy-on-write of a partial block goes
    through copy_kv_rows)."""
    name, path, weights = ckpt
    prop = MultiModuleMtpHead.from_pretrained(path, backend=backend, kv_mode=mode, block_size=block_size,
                                              num_blocks=640 // block_size)
    steps = _drive(prop, weights, seed=len(name) + (mode == "exact"))
    assert steps.get("tree", 0) >= 5 and steps.get("verify_tree", 0) >= 3, steps


@pytest.mark.parametrize("mode", ["draft", "exact"])
def test_trees_with_a_schedule_and_a_draft_vocabulary(tmp_path, mode):
    """One module cycled to three steps (how single-module releases draft depth 3), the LM
    heads cut to a token subset: the kit's oracle follows the expanded chain."""
    cfg = tiny_config(num_nextn_predict_layers=1)
    path = write_synthetic_checkpoint(tmp_path, cfg, seed=5)
    vocab = np.sort(np.random.default_rng(0).choice(cfg.vocab_size, 200, replace=False))
    prop = MultiModuleMtpHead.from_pretrained(path, backend="cpu", kv_mode=mode, block_size=4, num_blocks=160,
                                              module_schedule="cycle", max_drafts=3, draft_vocab=vocab)
    weights = reference_weights(path)
    from mtpkern.schedule import expand

    _, weights = expand(cfg, weights, prop.module_schedule)
    steps = _drive(prop, weights, seed=3)
    assert steps.get("tree", 0) >= 5, steps


def _twins(path, mode, backend="cpu", n=14, seed=0, **kw):
    """One proposer, two states with the same prefill."""
    prop = MultiModuleMtpHead.from_pretrained(path, backend=backend, kv_mode=mode, block_size=4, num_blocks=160, **kw)
    cfg = prop.config
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, cfg.vocab_size, n).tolist()
    hid = rng.standard_normal((n, cfg.hidden_size)).astype(np.float32)
    a, b = prop.alloc_state(), prop.alloc_state()
    prop.prefill_drafter(toks, hid, a)
    prop.prefill_drafter(toks, hid, b)
    return prop, a, b, rng


def _same_kv(prop, a, b):
    assert a.rows_per_module() == b.rows_per_module()
    for m in range(prop.num_modules):
        assert a.kv[m].keys == b.kv[m].keys
        for x, y in zip(kv_rows(prop, a, m), kv_rows(prop, b, m)):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
    assert (a.num_verified, a.num_hiddens, a.next_position, a.tail) == \
           (b.num_verified, b.num_hiddens, b.next_position, b.tail)


@pytest.mark.parametrize("mode", ["draft", "exact"])
def test_a_width_one_tree_is_the_chain(tiny_ckpt, mode):
    """widths [1, 1, 1]: the chain's drafts and confidences, and after verifying a prefix the
    state (rows, keys, K/V, counters) of the chain's propose and after_verify."""
    prop, a, b, rng = _twins(tiny_ckpt, mode)
    M, H, V = prop.num_modules, prop.config.hidden_size, prop.config.vocab_size
    P = a.next_position
    for acc in (M, 1, 0):
        h, t = rng.standard_normal(H).astype(np.float32), int(rng.integers(0, V))
        conf: list = []
        chain = prop.propose(t, h, P, M, a, out_conf=conf)
        tree = prop.propose_tree(t, h, P, b, widths=[1] * M)
        assert tree.tokens.tolist() == chain and tree.parents.tolist() == list(range(-1, M - 1))
        # FP32 rounding only: the exact-mode tree runs a module's rows in one forward, the chain
        # in its own groups, and the cpu attention's split of a sequence's rows follows them
        np.testing.assert_allclose(tree.probs, conf, rtol=1e-5)
        _same_kv(prop, a, b)                                 # pending: the chain's rows
        prop.after_verify(acc, a)
        prop.after_verify_tree(list(range(acc)), b)
        _same_kv(prop, a, b)
        prop.check_invariants()
        if mode == "exact" and acc:
            hs = rng.standard_normal((acc, H)).astype(np.float32)
            prop.catchup_drafter(chain[:acc], hs, a)
            prop.catchup_drafter(chain[:acc], hs, b)
        P = a.next_position


@pytest.mark.parametrize("mode", ["draft", "exact"])
def test_the_accepted_path_equals_a_forced_chain(tiny_ckpt, mode):
    """A wide tree verified along a path off the greedy one: the state equals a chain
    propose forced along that path (a mask allowing only its tokens) after its verify, and
    the next chain propose drafts the same."""
    prop, a, b, rng = _twins(tiny_ckpt, mode, seed=4)
    M, H, V = prop.num_modules, prop.config.hidden_size, prop.config.vocab_size
    verify_tree_off_the_greedy_path(prop, a, b, rng, mode, _same_kv)
    h2, t2 = rng.standard_normal(H).astype(np.float32), int(rng.integers(0, V))
    assert prop.propose(t2, h2, a.next_position, M, a) == prop.propose(t2, h2, b.next_position, M, b)
    prop.check_invariants()


def test_grammar_callables_are_asked_per_node(tiny_ckpt):
    """A callable is asked (depth, that node's path tokens) for each node it expands, and
    every child obeys its node's mask."""
    prop, _, st, rng = _twins(tiny_ckpt, "draft", seed=2)
    V, W, H = prop.config.vocab_size, prop.config.bitmask_words, prop.config.hidden_size
    asked = []
    allow = {}

    def mask(depth, path):
        asked.append((depth, tuple(path)))
        ok = rng.random(V) < 0.3
        allow[tuple(path)] = ok
        bits = np.zeros(W * 32, bool)
        bits[:V] = ok
        return np.packbits(bits.reshape(-1, 32)[:, ::-1], axis=1, bitorder="big").view(">u4").astype(np.uint32) \
            .view(np.int32).reshape(-1)

    tree = prop.propose_tree(3, rng.standard_normal(H).astype(np.float32), st.next_position, st, widths=[2, 2, 1],
                             grammar_bitmask=mask)
    expanded = [()] + [tuple(tree.path_tokens(i)) for i in range(len(tree)) if tree.depths[i] < 2]
    assert sorted(asked) == sorted((len(p), p) for p in expanded)
    for i in range(len(tree)):
        parent = () if tree.parents[i] < 0 else tuple(tree.path_tokens(int(tree.parents[i])))
        assert allow[parent][tree.tokens[i]]


@pytest.mark.parametrize("mode", ["draft", "exact"])
def test_a_failed_tree_changes_nothing(tiny_ckpt, mode):
    """A grammar that allows nothing at depth 2, and a pool too small for a wide tree: the
    call raises and every state, pool and counter is as before."""
    prop, _, st, rng = _twins(tiny_ckpt, mode, seed=6)
    H, W = prop.config.hidden_size, prop.config.bitmask_words
    c = checked(prop)
    c.model.alloc(st)
    before = (st.rows_per_module(), [p.num_used for p in prop.pools], st.tail, st.next_position)

    def nothing_at_2(depth, path):
        return np.zeros(W, np.int32) if depth == 2 else None

    with pytest.raises(NoAllowedToken, match="depth 2"):
        prop.propose_tree(1, rng.standard_normal(H).astype(np.float32), st.next_position, st, widths=[2, 2, 2],
                          grammar_bitmask=nothing_at_2)
    assert (st.rows_per_module(), [p.num_used for p in prop.pools], st.tail, st.next_position) == before
    assert st._tree is None and not st.drafted
    prop.check_invariants()
    small = MultiModuleMtpHead.from_pretrained(tiny_ckpt, backend="cpu", kv_mode=mode, block_size=4, num_blocks=6)
    s2 = small.alloc_state()
    small.prefill_drafter([1, 2, 3, 4, 5, 6, 7], rng.standard_normal((7, H)).astype(np.float32), s2)
    used = [p.num_used for p in small.pools]
    with pytest.raises(KvCacheFull):
        small.propose_tree(1, rng.standard_normal(H).astype(np.float32), s2.next_position, s2, widths=[4, 4, 4])
    assert [p.num_used for p in small.pools] == used and not s2.drafted
    small.check_invariants()


def test_bad_tree_input(tiny_ckpt):
    prop, a, st, rng = _twins(tiny_ckpt, "draft", seed=8)
    H, M = prop.config.hidden_size, prop.num_modules
    h = rng.standard_normal(H).astype(np.float32)
    P = st.next_position
    for kw, msg in (({}, "exactly one"), ({"widths": [1], "shape": [[0]]}, "exactly one"),
                    ({"widths": []}, "widths"), ({"widths": [0]}, r"widths\[0\]"), ({"widths": [1] * (M + 1)}, "at most"),
                    ({"widths": [65]}, r"widths\[0\]"), ({"shape": [[1]]}, "elder sibling"),
                    ({"shape": [[0], [0, 1]]}, "elder sibling"), ({"shape": [[0, 0]]}, "without its parent"),
                    ({"shape": [[0], [1], [1, 0]]}, "rank-0 path"), ({"shape": [[0], [0]]}, "twice")):
        with pytest.raises(ValueError, match=msg):
            prop.propose_tree(1, h, P, st, **kw)
    assert not st.drafted
    tree = prop.propose_tree(1, h, P, st, shape=[[0], [1], [0, 0]])
    assert tree.parents.tolist() == [-1, -1, 0] and tree.depth == 2
    with pytest.raises(StateError, match="after_verify_tree"):
        prop.after_verify(0, st)
    with pytest.raises(ValueError, match=r"path\[0\]"):
        prop.after_verify_tree([2], st)
    with pytest.raises(ValueError, match=r"path\[1\]"):
        prop.after_verify_tree([1, 2], st)
    with pytest.raises(ValueError, match=r"path\[0\]"):
        prop.after_verify_tree([3], st)
    with pytest.raises(StateError, match="awaits after_verify"):
        prop.propose_tree(1, h, P, st, widths=[1])
    prop.after_verify_tree([0, 2], st)
    with pytest.raises(StateError, match="without a propose_tree"):
        prop.after_verify_tree([], st)
    prop.propose(1, h, st.next_position, 1, a)
    with pytest.raises(StateError, match="chain"):
        prop.after_verify_tree([], a)
    prop.check_invariants()


def test_freeing_a_state_with_a_pending_tree(tiny_ckpt):
    prop, a, st, rng = _twins(tiny_ckpt, "exact", seed=9)
    used = [p.num_used for p in prop.pools]
    prop.propose_tree(1, rng.standard_normal(prop.config.hidden_size).astype(np.float32), st.next_position, st,
                      widths=[3, 3, 2])
    assert [p.num_used for p in prop.pools] > used
    prop.check_invariants()
    prop.free_state(st)
    prop.free_state(a)
    assert [p.num_used for p in prop.pools] == [0] * prop.num_modules
    prop.check_invariants()


def test_layout_helpers():
    """parents -1 / 0 / 0 / 1: the ancestor mask, paths, leaves, positions."""
    t = DraftTree(10, 7, np.array([5, 6, 8, 9], np.int32), np.array([-1, 0, 0, 1], np.int32),
                  np.array([0, 1, 1, 2], np.int32), np.full(4, 0.5, np.float32), np.zeros(4, np.float32))
    assert t.path(3) == [0, 1, 3] and t.path_tokens(3) == [5, 6, 9] and t.leaves() == [2, 3]
    assert t.children(-1) == [0] and t.children(0) == [1, 2] and t.depth == 3
    assert t.positions().tolist() == [10, 11, 12, 12, 13]
    want = np.array([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 0, 1, 0], [1, 1, 1, 0, 1]], bool)
    np.testing.assert_array_equal(t.ancestor_mask(), want)
