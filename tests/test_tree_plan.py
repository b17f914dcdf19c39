"""Draft trees in the planned step (mtpkern.tree_plan) against the eager tree path.

A tree of a static shape (fixed widths, or a static ``shape``) without a grammar mask runs as
a plan: the host lays out every module's lines and blocks first, then the launches gather each
row's input and token, copy the lines' partial blocks (copy-on-write, staged segment rows) and
draft each depth's top-c into one output buffer. Run eagerly on NumPy, and captured / replayed
through the fake CUDA runtime of tests/test_cuda_graph_fake.py, it must give the eager path's
trees (tokens, parents, depths, probabilities, scores) and KV bit for bit, after the propose
and after ``after_verify_tree_batch``, in both KV modes, for batches of 1 and 3. Negative
controls: a skipped copy-on-write copy and a stale block table, staged, are caught; a plan
that never ran (the eager path taken) would fail the counts.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import kv_rows
from mtpkern import MultiModuleMtpHead, write_synthetic_checkpoint
from mtpkern import tree_plan
from mtpkern.config import tiny_config
from mtpkern.cuda_graph import SEG_FIELDS, StepRunner
from test_cuda_graph_fake import FakeCudaBackend, fake_cuda  # noqa: F401  (the fixture)

#: widths per round: the chain's (1, 1, 1), then wider trees; (4, 2, 1) twice (a replay)
WIDTHS = [(1, 1, 1), (2, 1, 1), (4, 2, 1), (4, 2, 1), (2, 1, 1)]
SHAPE = [[0], [1], [2], [0, 0], [1, 0], [0, 0, 0], [0, 1]]


def _make(ckpt, mode, backend="numpy", planned=False, **kw):
    prop = MultiModuleMtpHead.from_pretrained(ckpt, backend=backend, kv_mode=mode, block_size=4, num_blocks=240,
                                              **kw)
    if planned and prop.step_runner is None:
        prop.step_runner = StepRunner(prop, capture=False)
    return prop


def _same_tree(x, y, what):
    assert (x.position, x.root_token) == (y.position, y.root_token), what
    for f in ("tokens", "parents", "depths", "probs", "scores"):
        np.testing.assert_array_equal(getattr(x, f), getattr(y, f), err_msg=f"{what}: {f}")


def _same_kv(p0, s0, p1, s1, what):
    for m in range(p0.num_modules):
        k0, v0 = kv_rows(p0, s0, m)
        k1, v1 = kv_rows(p1, s1, m)
        assert np.array_equal(k0, k1) and np.array_equal(v0, v1), f"{what}: module {m}: KV rows differ"
    assert s0.rows_per_module() == s1.rows_per_module(), what


def run_tree_twins(eager, planned, B, seed, rounds, **shape):
    """Rounds of ``propose_tree_batch`` on both proposers (``rounds``: widths per round, or
    None for ``shape``), each verified along another path, then caught up; compared after the
    propose and after the verify. -> the planned runner's counts."""
    cfg = eager.config
    H, V = cfg.stream_size, cfg.vocab_size            # the target's hiddens: hc_mult streams each
    rng = np.random.default_rng(seed)
    s0, s1 = [], []
    for i in range(B):
        n = 5 + 4 * i + int(rng.integers(0, 3))            # lengths that leave partial blocks
        toks, hid = rng.integers(0, V, n).tolist(), rng.standard_normal((n, H)).astype(np.float32)
        for p, out in ((eager, s0), (planned, s1)):
            st = p.alloc_state()
            p.prefill_drafter(toks, hid, st)
            out.append(st)
    for r, ws in enumerate(rounds):
        toks, hs = rng.integers(0, V, B).tolist(), rng.standard_normal((B, H)).astype(np.float32)
        Ps = [st.next_position for st in s0]
        arg = dict(widths=list(ws)) if ws is not None else shape
        before = planned.step_runner.counts["tree_executed"] + planned.step_runner.counts["tree_replayed"]
        t0 = eager.propose_tree_batch(toks, hs, Ps, s0, **arg)
        t1 = planned.propose_tree_batch(toks, hs, Ps, s1, **arg)
        after = planned.step_runner.counts["tree_executed"] + planned.step_runner.counts["tree_replayed"]
        assert after == before + 1, f"round {r}: the planned tree step did not run ({dict(planned.step_runner.counts)})"
        for i, (x, y) in enumerate(zip(t0, t1)):
            _same_tree(x, y, f"round {r}, sequence {i}")
            _same_kv(eager, s0[i], planned, s1[i], f"round {r}, sequence {i}, pending")
        planned.check_invariants()
        paths = []
        for i, t in enumerate(t0):
            leaves = t.leaves()
            paths.append(t.path(leaves[(r + i) % len(leaves)])[: (r + i) % (t.depth + 1)])
        eager.after_verify_tree_batch(paths, s0)
        planned.after_verify_tree_batch(paths, s1)
        for i, (x, y) in enumerate(zip(s0, s1)):
            _same_kv(eager, x, planned, y, f"round {r}, sequence {i}, verified")
        planned.check_invariants()
        for x, y, t, path in zip(s0, s1, t0, paths):
            acc = [int(t.tokens[j]) for j in path]
            hh = rng.standard_normal((len(acc), H)).astype(np.float32)
            if acc:
                eager.catchup_drafter(acc, hh, x)
                planned.catchup_drafter(acc, hh, y)
    return dict(planned.step_runner.counts)


@pytest.fixture(scope="module")
def twins(tiny_ckpt):
    """(eager, planned) NumPy proposers per mode, built once for the module."""
    return {mode: (_make(tiny_ckpt, mode), _make(tiny_ckpt, mode, planned=True)) for mode in ("draft", "exact")}


@pytest.mark.parametrize("mode", ["draft", "exact"])
@pytest.mark.parametrize("B", [1, 3])
def test_planned_trees_equal_eager(twins, mode, B):
    eager, planned = twins[mode]
    counts = run_tree_twins(eager, planned, B, 10 + B, WIDTHS)
    assert counts["tree_executed"] >= len(WIDTHS), counts
    run_tree_twins(eager, planned, B, 20 + B, [None, None], shape=SHAPE)
    # shallower trees: in exact mode the modules past the deepest depth write rows, draft nothing
    run_tree_twins(eager, planned, B, 30 + B, [(2,), (3, 1), (2,)])


def test_a_grammar_mask_takes_the_eager_path(twins):
    """A mask could cut a node's children: the tree is not static, the eager path runs."""
    _, planned = twins["draft"]
    cfg = planned.config
    st = planned.alloc_state()
    planned.prefill_drafter([1, 2, 3, 4, 5], np.ones((5, cfg.hidden_size), np.float32), st)
    before = dict(planned.step_runner.counts)
    mask = np.full((cfg.vocab_size + 31) // 32, -1, np.int32)
    planned.propose_tree(7, np.ones(cfg.hidden_size, np.float32), 5, st, widths=[2, 1], grammar_bitmask=mask)
    counts = planned.step_runner.counts
    assert counts["tree_fallback_mask"] == before.get("tree_fallback_mask", 0) + 1
    assert counts["tree_executed"] == before.get("tree_executed", 0)
    planned.after_verify_tree([], st)
    planned.free_state(st)


def _sabotage(monkeypatch, what):
    """Stage each call's data, then break one part of it: the copy-on-write rows dropped, or
    the block tables left as the plan's first call staged them."""
    stage = tree_plan.TreePlan.stage_tree
    first: dict = {}

    def staged(self, laid, jobs, hid):
        stage(self, laid, jobs, hid)
        T = self.stage.h("seg").reshape(-1, SEG_FIELDS)
        for m in self.run:
            _, f1, f2, _ = self.seg_rows[m]
            if what == "cow":
                T[f1:f2, 2] = 0
            else:
                tab = self.stage.h(f"tab{m}")
                tab[:] = first.setdefault((id(self), m), tab.copy())

    monkeypatch.setattr(tree_plan.TreePlan, "stage_tree", staged)


@pytest.mark.parametrize("what", ["cow", "stale_table"])
def test_sabotaged_staging_is_caught(tiny_ckpt, monkeypatch, what):
    """Negative controls: with the copy-on-write copies skipped, or a block table staged
    stale, the planned trees or KV differ from the eager path's."""
    eager, planned = _make(tiny_ckpt, "draft"), _make(tiny_ckpt, "draft", planned=True)
    _sabotage(monkeypatch, what)
    with pytest.raises(AssertionError, match="differ|Arrays are not equal|mismatch"):
        run_tree_twins(eager, planned, 3, 5, [(4, 2, 1)] * 4)


# -- the fake CUDA runtime: capture once per tree shape, replay after ------------------------

@pytest.mark.parametrize("mode", ["draft", "exact"])
@pytest.mark.parametrize("B", [1, 3])
def test_captured_trees_replay_like_eager(fake_cuda, tiny_ckpt, mode, B):
    eager = _make(tiny_ckpt, mode)
    graph = _make(tiny_ckpt, mode, backend=FakeCudaBackend(fake_cuda))
    assert graph.step_runner is not None and graph.step_runner.capture
    counts = run_tree_twins(eager, graph, B, 30 + B, WIDTHS)
    # one plan and one capture per distinct tree shape (widths and block-table width); a
    # repeated shape replays: (4, 2, 1) and (2, 1, 1) come back
    assert counts["tree_captured"] == counts["tree_plans"] == counts["tree_executed"] <= len(set(WIDTHS)), counts
    assert counts["tree_replayed"] == len(WIDTHS) - counts["tree_executed"] >= 2, counts
    assert fake_cuda.memcpys["h2d"] == fake_cuda.memcpys["d2h"] == len(WIDTHS), fake_cuda.memcpys
    assert "lm topk" in graph.backend.ws_seen
    captured = counts["tree_captured"]
    run_tree_twins(eager, graph, B, 40 + B, [(4, 2, 1)] * 2)     # new data, fresh states: replays
    assert graph.step_runner.counts["tree_captured"] == captured, dict(graph.step_runner.counts)


def test_width_changes_cost_a_capture_each(fake_cuda, tiny_ckpt):
    """Dynamic widths: every distinct tree shape is one more plan and capture, a shape seen
    before replays (docs/cuda.md, "Draft trees in the planned step")."""
    eager = _make(tiny_ckpt, "draft")
    graph = _make(tiny_ckpt, "draft", backend=FakeCudaBackend(fake_cuda))
    rounds = [(1, 1, 1), (2, 1, 1), (3, 1, 1), (4, 2, 1), (1, 1, 1), (2, 1, 1), (3, 1, 1), (4, 2, 1)]
    counts = run_tree_twins(eager, graph, 1, 7, rounds)
    assert counts["tree_captured"] == 4 and counts["tree_replayed"] == 4, counts


@pytest.mark.parametrize("mode", ["draft", "exact"])
def test_captured_mla_trees(fake_cuda, mla_ckpt, mode):
    """MLA modules (one latent plane, copied on write like K and V) in the captured tree step."""
    eager = _make(mla_ckpt, mode)
    graph = _make(mla_ckpt, mode, backend=FakeCudaBackend(fake_cuda))
    counts = run_tree_twins(eager, graph, 3, 50, [(2, 1, 1), (4, 2, 1), (2, 1, 1)])
    assert counts["tree_replayed"] >= 1, counts


@pytest.mark.parametrize("mode", ["draft", "exact"])
def test_captured_trees_with_a_draft_vocabulary(fake_cuda, tiny_ckpt, mode):
    """A draft vocabulary: the top-c maps the subset's rows to target ids in the graph (the next
    depth's rows embed target tokens); widths up to the subset's size are planned."""
    ids = np.random.default_rng(2).permutation(301)[:150]
    eager = _make(tiny_ckpt, mode, draft_vocab=ids)
    graph = _make(tiny_ckpt, mode, backend=FakeCudaBackend(fake_cuda), draft_vocab=ids)
    counts = run_tree_twins(eager, graph, 3, 70, [(2, 1, 1), (4, 2, 1), (2, 1, 1)])
    assert counts["tree_replayed"] == 1, counts


# -- every block kind ----------------------------------------------------------------------

def _kind_config(kind):
    from conftest import DSA_FIELDS
    from test_v4_attention import V4_ATTN

    import test_family_qwen3_next as qwen3_next

    return {"window": tiny_config(sliding_window=5), "dsa": tiny_config(**DSA_FIELDS),
            "hc": tiny_config(hc_mult=4), "pos0": tiny_config(embed_mask_pos0=True),
            "v4": tiny_config(**V4_ATTN, sliding_window=6), "qwen3_next": qwen3_next.QWEN2}[kind]


_KIND_CKPTS: dict = {}


def _kind_ckpt(tmp_path_factory, kind):
    """A checkpoint per block kind, written once per session."""
    if kind not in _KIND_CKPTS:
        d = tmp_path_factory.mktemp(f"tree_{kind}")
        if kind == "qwen3_next":         # the release layout: output gates, gated shared expert, postnorm chain
            import test_family_qwen3_next as qwen3_next

            _KIND_CKPTS[kind] = qwen3_next._ckpt(d, _kind_config(kind), seed=9)
        else:
            _KIND_CKPTS[kind] = write_synthetic_checkpoint(d, _kind_config(kind), seed=9, dtype="float32")
    return _KIND_CKPTS[kind]


def _kind_widths(prop):
    return [w[:prop.num_modules] for w in [(2, 1, 1), (4, 2, 1), (2, 1, 1)]]


@pytest.mark.parametrize("mode", ["draft", "exact"])
@pytest.mark.parametrize("kind", ["window", "dsa", "hc", "pos0", "v4", "qwen3_next"])
def test_planned_trees_every_block_kind(tmp_path_factory, kind, mode):
    """Sliding windows (each row's first visible row staged), DSA, hyper-connections (rows of 4
    streams), the position-0 mask, DeepSeek-V4's windowed attention, Qwen3-Next's gates and
    postnorm chain: the planned trees are the eager ones (NumPy, the plan run eagerly)."""
    ckpt = _kind_ckpt(tmp_path_factory, kind)
    eager, planned = _make(ckpt, mode), _make(ckpt, mode, planned=True)
    counts = run_tree_twins(eager, planned, 3, 60, _kind_widths(planned))
    assert counts["tree_executed"] == 3, counts


@pytest.mark.parametrize("kind", ["window", "dsa", "qwen3_next"])
def test_captured_trees_every_block_kind(fake_cuda, tmp_path_factory, kind):
    """The same kinds captured and replayed through the fake runtime (where its ops record:
    hyper-connections and DeepSeek-V4's attention replay on the emulated kernels,
    tests/test_cuda_emulated.py)."""
    ckpt = _kind_ckpt(tmp_path_factory, kind)
    eager, graph = _make(ckpt, "exact"), _make(ckpt, "exact", backend=FakeCudaBackend(fake_cuda))
    counts = run_tree_twins(eager, graph, 3, 61, _kind_widths(graph))
    assert counts["tree_captured"] == 2 and counts["tree_replayed"] == 1, counts


def test_a_width_above_the_vocabulary_takes_the_eager_path(tiny_ckpt):
    """A node's width above a draft vocabulary of 8 tokens would leave it fewer children than
    its width (a shape the tokens decide): the eager path drafts it, counted."""
    ids = np.arange(8) * 3
    planned = _make(tiny_ckpt, "draft", planned=True, draft_vocab=ids)
    H = planned.config.hidden_size
    st = planned.alloc_state()
    planned.prefill_drafter([1, 2, 3, 4, 5], np.ones((5, H), np.float32), st)
    tree = planned.propose_tree(7, np.ones(H, np.float32), 5, st, widths=[12])
    counts = planned.step_runner.counts
    assert len(tree) == 8 and counts["tree_fallback_width"] == 1 and counts["tree_executed"] == 0, dict(counts)
    planned.after_verify_tree([], st)
    tree = planned.propose_tree(7, np.ones(H, np.float32), 6, st, widths=[8])
    assert len(tree) == 8 and counts["tree_executed"] == 1, dict(counts)
