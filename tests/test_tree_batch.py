"""Batched draft trees: ``propose_tree_batch`` / ``after_verify_tree_batch`` (mtpkern.tree).

Every tree of a batch, and every state's KV after the batch's verify, equals what the
per-sequence ``propose_tree`` / ``after_verify_tree`` give that state (tokens, parents and
depths exactly; probabilities, scores and K/V to FP32 rounding: a batch's forward holds more
rows), on numpy, cpu and the emulated cuda kernels, in both KV modes; with widths (one for
all, or one per sequence), a static shape and a grammar on one sequence. Negative controls:
the sequences' trees differ (so the equality is not vacuous, and a batch whose rows were
given to the wrong sequence would fail it). Bad input is refused naming the argument, with
every state unchanged; a 2-rank sharded head's batched trees are one rank's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conftest import kv_rows
from mtpkern import MultiModuleMtpHead
from mtpkern.errors import KvCacheFull, NoAllowedToken, StateError
from test_tree import _same_kv

B = 3


def _make(path, backend, mode, num_blocks=240, **kw):
    return MultiModuleMtpHead.from_pretrained(path, backend=backend, kv_mode=mode, block_size=4,
                                              num_blocks=num_blocks, **kw)


def _pairs(prop, rng, B=B):
    """B pairs of twin states (the same prefill within a pair; another length and context
    for each pair): ``(batched, single)`` lists."""
    cfg = prop.config
    xs, ys = [], []
    for i in range(B):
        n = 5 + 4 * i + int(rng.integers(0, 3))
        toks = rng.integers(0, cfg.vocab_size, n).tolist()
        hid = rng.standard_normal((n, cfg.hidden_size)).astype(np.float32)
        for out in (xs, ys):
            st = prop.alloc_state()
            prop.prefill_drafter(toks, hid, st)
            out.append(st)
    return xs, ys


def _same_tree(x, y, what=""):
    assert (x.position, x.root_token) == (y.position, y.root_token), what
    np.testing.assert_array_equal(x.tokens, y.tokens, err_msg=what)
    np.testing.assert_array_equal(x.parents, y.parents, err_msg=what)
    np.testing.assert_array_equal(x.depths, y.depths, err_msg=what)
    np.testing.assert_allclose(x.probs, y.probs, rtol=1e-5, atol=1e-7, err_msg=what)
    np.testing.assert_allclose(x.scores, y.scores, rtol=1e-5, atol=1e-6, err_msg=what)


def _grammar(V):
    """A callable that allows the tokens of one residue class, which moves with the path."""
    W = (V + 31) // 32

    def fn(depth, path):
        ids = np.flatnonzero((np.arange(V) + depth + sum(path)) % 3 == 0)
        words = np.zeros(W, np.uint32)
        np.bitwise_or.at(words, ids >> 5, (np.uint32(1) << (ids & 31).astype(np.uint32)))
        return words.view(np.int32)
    return fn


def _rounds(prop, xs, ys, rng, rounds=3, grammar=None, per=False, **shape):
    """Rounds of one batched tree over ``xs`` against per-sequence trees over ``ys``, each
    verified along another path, then caught up; returns the batched trees. ``shape``:
    ``widths=`` or ``shape=``, one for all (``per``: a list, one per sequence)."""
    cfg, H = prop.config, prop.config.hidden_size
    got = []
    for r in range(rounds):
        toks = rng.integers(0, cfg.vocab_size, len(xs)).tolist()
        hs = rng.standard_normal((len(xs), H)).astype(np.float32)
        Ps = [st.next_position for st in xs]
        gm = None if grammar is None else [grammar if i == 1 else None for i in range(len(xs))]
        trees = prop.propose_tree_batch(toks, hs, Ps, xs, grammar_bitmask=gm, **shape)
        assert len(trees) == len(xs)
        for i, (st, tree) in enumerate(zip(ys, trees)):
            one = {k: v[i] if per else v for k, v in shape.items()}
            want = prop.propose_tree(toks[i], hs[i], Ps[i], st, grammar_bitmask=gm and gm[i], **one)
            _same_tree(tree, want, f"round {r}, sequence {i}")
        for x, y in zip(xs, ys):
            _same_kv(prop, x, y)                      # pending: the main lines
        prop.check_invariants()
        paths = []
        for i, tree in enumerate(trees):
            leaves = tree.leaves()
            paths.append(tree.path(leaves[(r + i) % len(leaves)])[: (r + i) % (tree.depth + 1)])
        prop.after_verify_tree_batch(paths, xs)
        for st, path in zip(ys, paths):
            prop.after_verify_tree(path, st)
        for x, y in zip(xs, ys):
            _same_kv(prop, x, y)
        prop.check_invariants()
        for x, y, tree, path in zip(xs, ys, trees, paths):
            acc = [int(tree.tokens[j]) for j in path]
            hh = rng.standard_normal((len(acc) + 1, H)).astype(np.float32)
            for st in (x, y):
                if acc:
                    prop.catchup_drafter(acc, hh[: len(acc)], st)
        got.append(trees)
    return got


def _distinct(trees):
    """Negative control: the sequences' trees differ, so that matching them per sequence
    says something (a batch that gave one sequence another's rows would fail)."""
    for a in range(len(trees)):
        for b in range(a + 1, len(trees)):
            x, y = trees[a], trees[b]
            assert len(x) != len(y) or not np.array_equal(x.tokens, y.tokens) or \
                not np.allclose(x.probs, y.probs), (a, b)


@pytest.mark.parametrize("mode", ["draft", "exact"])
@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_batched_trees_equal_per_sequence_trees(tiny_ckpt, backend, mode):
    prop = _make(tiny_ckpt, backend, mode)
    M = prop.num_modules
    assert M == 3
    rng = np.random.default_rng(3)
    xs, ys = _pairs(prop, rng)
    for trees in _rounds(prop, xs, ys, rng, widths=[2, 2, 1]):
        _distinct(trees)
    for trees in _rounds(prop, xs, ys, rng, rounds=2, per=True, widths=[[3, 1, 2], [1] * M, [2, 2]]):
        _distinct(trees)
        assert [t.depth for t in trees] == [M, M, 2]
    _rounds(prop, xs, ys, rng, rounds=2, shape=[[0], [1], [0, 0], [1, 0], [0, 0, 0]])
    _rounds(prop, xs, ys, rng, rounds=2, widths=[2, 2, 1], grammar=_grammar(prop.config.vocab_size))
    prop.close()


def test_a_wrong_row_order_is_caught(tiny_ckpt, monkeypatch):
    """Negative control: a batch whose forward gives each sequence another's target hidden
    (the rows of module 0 in the wrong order) fails the per-sequence comparison."""
    from mtpkern.tree import TreeRunner

    forward = TreeRunner._forward
    monkeypatch.setattr(TreeRunner, "_forward", lambda self, m, parts, hid: forward(self, m, parts, hid[::-1]))
    prop = _make(tiny_ckpt, "numpy", "draft")
    rng = np.random.default_rng(3)
    xs, ys = _pairs(prop, rng)
    with pytest.raises(AssertionError, match="sequence 0"):
        _rounds(prop, xs, ys, rng, rounds=1, widths=[2, 2, 1])


def test_batched_trees_with_a_sliding_window_and_per_sequence_shapes(tmp_path):
    from mtpkern.config import tiny_config
    from mtpkern.weights import write_synthetic_checkpoint

    path = write_synthetic_checkpoint(tmp_path, tiny_config(sliding_window=5), seed=11)
    for mode in ("draft", "exact"):
        prop = _make(path, "numpy", mode)
        rng = np.random.default_rng(4)
        xs, ys = _pairs(prop, rng)
        shapes = [[[0], [1], [0, 0], [1, 0], [0, 0, 0]], [[0], [0, 0]], [[0], [1], [2], [0, 0], [0, 1]]]
        _rounds(prop, xs, ys, rng, rounds=3, per=True, shape=shapes)
        prop.close()


def test_the_docs_example_runs():
    """docs/api.md's batched-tree example, as written."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()
    block = text[text.index("**Batched trees**"):]
    code = block[block.index("```python\n") + 10: block.index("```\n", block.index("```python\n") + 10)]
    assert "propose_tree_batch" in code and "after_verify_tree_batch" in code
    exec(compile(code, "docs/api.md", "exec"), {})


def test_a_batch_of_one_is_propose_tree(tiny_ckpt):
    prop = _make(tiny_ckpt, "numpy", "exact")
    rng = np.random.default_rng(5)
    xs, ys = _pairs(prop, rng, B=1)
    _rounds(prop, xs, ys, rng, rounds=3, widths=[2, 1, 2])


@pytest.mark.parametrize("mode", ["draft", "exact"])
def test_batched_trees_on_the_emulated_kernels(emulator, tiny_ckpt, mode):
    """The cuda backend (eager: no planned step for trees) on the emulated kernels: its batched
    trees equal its own per-sequence trees, and the numpy reference's."""
    from cuda_emu import emu_backend

    dev = _make(tiny_ckpt, emu_backend.backend("float32"), mode, num_blocks=160, cuda_graphs=False)
    ref = _make(tiny_ckpt, "numpy", mode, num_blocks=160)
    rng = np.random.default_rng(6)
    xs, ys = _pairs(dev, np.random.default_rng(7), B=2)
    rs, _ = _pairs(ref, np.random.default_rng(7), B=2)
    H, V = dev.config.hidden_size, dev.config.vocab_size
    toks = rng.integers(0, V, 2).tolist()
    hs = rng.standard_normal((2, H)).astype(np.float32)
    Ps = [st.next_position for st in xs]
    trees = dev.propose_tree_batch(toks, hs, Ps, xs, widths=[2, 2])
    want = ref.propose_tree_batch(toks, hs, Ps, rs, widths=[2, 2])
    for i in range(2):
        _same_tree(trees[i], dev.propose_tree(toks[i], hs[i], Ps[i], ys[i], widths=[2, 2]))
        np.testing.assert_array_equal(trees[i].tokens, want[i].tokens)
        np.testing.assert_allclose(trees[i].probs, want[i].probs, rtol=1e-4, atol=1e-6)
    _distinct(trees)
    paths = [trees[0].path(trees[0].leaves()[-1]), [1]]
    dev.after_verify_tree_batch(paths, xs)
    ref.after_verify_tree_batch(paths, rs)
    for i in range(2):
        dev.after_verify_tree(paths[i], ys[i])
        _same_kv(dev, xs[i], ys[i])
        for m in range(dev.num_modules):
            for x, y in zip(kv_rows(dev, xs[i], m), kv_rows(ref, rs[i], m)):
                np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5)
    dev.check_invariants()


# -- refusals ------------------------------------------------------------------------------

def _snapshot(prop, sts):
    return [(st.rows_per_module(), st.drafted, st.next_position, st.num_hiddens,
             [[np.array(x) for x in kv_rows(prop, st, m)] for m in range(prop.num_modules)]) for st in sts]


def _unchanged(prop, sts, before):
    after = _snapshot(prop, sts)
    for (r0, d0, p0, h0, kv0), (r1, d1, p1, h1, kv1) in zip(before, after):
        assert (r0, d0, p0, h0) == (r1, d1, p1, h1)
        for a, b in zip(kv0, kv1):
            for x, y in zip(a, b):
                np.testing.assert_array_equal(x, y)
    prop.check_invariants()


@pytest.mark.parametrize("mode", ["draft", "exact"])
def test_bad_batches_are_refused_and_change_nothing(tiny_ckpt, mode):
    prop = _make(tiny_ckpt, "numpy", mode, num_blocks=40)
    rng = np.random.default_rng(8)
    xs, _ = _pairs(prop, rng)
    H, V, M = prop.config.hidden_size, prop.config.vocab_size, prop.num_modules
    hs = rng.standard_normal((B, H)).astype(np.float32)
    toks = [1, 2, 3]
    Ps = [st.next_position for st in xs]
    used = [p.num_used for p in prop.pools]
    before = _snapshot(prop, xs)
    nothing = np.zeros((V + 31) // 32, np.int32)
    bad = [
        (dict(positions=Ps[:2] + [Ps[2] - 1]), ValueError, r"positions\[2\]"),
        (dict(positions=Ps[:2]), ValueError, r"positions: expected 3"),
        (dict(last_tokens=[1, 2, V]), ValueError, r"last_tokens\[2\]"),
        (dict(last_tokens=[1, 2]), ValueError, r"last_tokens: expected 3"),
        (dict(target_hiddens=hs[:2]), ValueError, r"target_hiddens"),
        (dict(states=[xs[0], xs[1], xs[0]]), ValueError, r"states: the same state appears twice"),
        (dict(states=[]), ValueError, r"states: expected 1\.\."),
        (dict(widths=[[2, 2], [1]]), ValueError, r"widths: expected one for all states or a list of 3"),
        (dict(widths=[[2, 2], [1], [0]]), ValueError, r"widths\[2\]\[0\]"),
        (dict(widths=[1] * (M + 1)), ValueError, r"widths: expected at most"),
        (dict(widths=None, shape=[[[0]], [[0]], [[1]]]), ValueError, r"shape\[2\]: .*elder sibling"),
        (dict(widths=None), ValueError, r"exactly one"),
        (dict(grammar_bitmask=[None, None]), ValueError, r"grammar_bitmask: expected 3"),
        (dict(grammar_bitmask=[None, np.zeros(3, np.int32), None]), ValueError, r"grammar_bitmask\[1\]"),
        (dict(grammar_bitmask=[None, None, nothing]), NoAllowedToken, r"propose_tree_batch: states\[2\], depth 0"),
        (dict(grammar_bitmask=[None, lambda d, p: nothing if d == 1 else None, None]), NoAllowedToken,
         r"states\[1\], depth 1"),
        (dict(widths=[[1] * M, [40, 20], [1] * M]), KvCacheFull, None),
    ]
    for kw, err, msg in bad:
        args = dict(last_tokens=toks, target_hiddens=hs, positions=Ps, states=xs, widths=[2] * M)
        args.update(kw)
        with pytest.raises(err, match=msg):
            prop.propose_tree_batch(**args)
        assert [p.num_used for p in prop.pools] == used, kw
        _unchanged(prop, xs, before)
    trees = prop.propose_tree_batch(toks, hs, Ps, xs, widths=[np.array(2), np.int32(2), 2])   # 0-d arrays are ints
    pending = _snapshot(prop, xs)
    for paths, err, msg in (([[0], [0]], ValueError, r"paths: expected 3"),
                            ([[0], [0], [0, 0]], ValueError, r"paths\[2\]\[1\]: expected a child of node 0"),
                            ([[0], [len(trees[1])], []], ValueError, r"paths\[1\]\[0\]"),
                            ([[0], [0], "0"], TypeError, r"paths\[2\]")):
        with pytest.raises(err, match=msg):
            prop.after_verify_tree_batch(paths, xs)
        _unchanged(prop, xs, pending)
    with pytest.raises(ValueError, match="states: the same state appears twice"):
        prop.after_verify_tree_batch([[0], [0]], [xs[0], xs[0]])
    with pytest.raises(StateError, match=r"states\[0\]: a propose awaits after_verify"):
        prop.propose_tree_batch(toks, hs, Ps, xs, widths=[1])
    prop.after_verify_tree_batch([[0], [], [1]], xs)
    prop.propose_tree(1, hs[1], xs[1].next_position, xs[1], widths=[2])
    with pytest.raises(StateError, match=r"states\[1\]: after_verify_tree without a propose_tree"):
        prop.after_verify_tree_batch([[0], []], [xs[1], xs[0]])
    assert xs[1].drafted
    prop.after_verify_tree_batch([[0]], [xs[1]])
    assert not any(st.drafted for st in xs)
    prop.check_invariants()


# -- a sharded head --------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["draft", "exact"])
def test_a_sharded_head_batches_trees_as_one_rank(tiny_ckpt, mode):
    from comm_cases import ThreadWorld

    def script(prop):
        rng = np.random.default_rng(9)
        xs, _ = _pairs(prop, rng)
        H, V = prop.config.hidden_size, prop.config.vocab_size
        log = []
        for r in range(3):
            toks = rng.integers(0, V, B).tolist()
            hs = rng.standard_normal((B, H)).astype(np.float32)
            gm = [None, _grammar(V), None] if r == 1 else None
            trees = prop.propose_tree_batch(toks, hs, [st.next_position for st in xs], xs, widths=[2, 2, 1],
                                            grammar_bitmask=gm)
            paths = [t.path(t.leaves()[(r + i) % len(t.leaves())])[: 1 + (r + i) % 2] for i, t in enumerate(trees)]
            prop.after_verify_tree_batch(paths, xs)
            log.append(trees)
            for st, t, p in zip(xs, trees, paths):
                acc = [int(t.tokens[j]) for j in p]
                if acc:
                    prop.catchup_drafter(acc, rng.standard_normal((len(acc), H)).astype(np.float32), st)
        with pytest.raises(ValueError, match=r"positions\[1\]"):
            prop.propose_tree_batch([1, 2, 3], hs, [xs[0].next_position, 0, xs[2].next_position], xs,
                                    widths=[1])
        return log

    want = script(_make(tiny_ckpt, "numpy", mode))

    def rank(comm):
        return script(_make(tiny_ckpt, "numpy", mode, comm=comm))

    for log in ThreadWorld(2).run(rank):
        for trees, ref in zip(log, want):
            for x, y in zip(trees, ref):
                np.testing.assert_array_equal(x.tokens, y.tokens)
                np.testing.assert_array_equal(x.parents, y.parents)
                np.testing.assert_allclose(x.probs, y.probs, rtol=1e-4, atol=1e-6)
