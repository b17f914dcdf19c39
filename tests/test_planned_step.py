"""The planned propose step (mtpkern.cuda_graph) on the NumPy backend, against the
eager proposer path.

The plan is what the cuda backend captures into a CUDA graph: persistent buffers,
``out=`` arguments, a staging area uploaded once per call, and segment copies
driven by an address table. Run eagerly on NumPy it must give the eager path's
drafts, KV rows, windows and bookkeeping bit for bit, in both KV modes, for any
sequence of calls; it must allocate no output and read no per-call temporary
(what a graph replay could not see); and it must fall back to the eager path
where row counts are not the steady-state ones.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

from conftest import kv_rows
from mtpkern import MultiModuleMtpHead, NoAllowedToken
from mtpkern.backends.numpy_backend import NumpyBackend
from mtpkern.cuda_graph import StepRunner, host_copy_segments, step_rows
from mtpkern.head import MIN_TABLE_WIDTH, table_width

_PAIRS: dict = {}


def _pair(ckpt, mode, chain):
    """(eager, planned) proposers on the same checkpoint, built once per session."""
    key = (str(ckpt), mode, chain)
    if key not in _PAIRS:
        make = lambda: MultiModuleMtpHead.from_pretrained(ckpt, backend="numpy", kv_mode=mode, chain=chain,  # noqa: E731
                                                          block_size=4, num_blocks=160, prefill_chunk=6)
        eager, planned = make(), make()
        planned.step_runner = StepRunner(planned, capture=False)
        _PAIRS[key] = (eager, planned)
    return _PAIRS[key]


def _fingerprint(prop, st):
    win = [None if w is None else np.asarray(w).copy() for w in st._win]
    # Block ids are left out: after a rolled-back call the free lists may hand out the same
    # blocks in another order (the planned path grows every module before it computes).
    return (st.rows_per_module(), [s.keys.to_list() for s in st.kv], [len(s.blocks) for s in st.kv],
            st.num_verified, st.num_hiddens, list(st.tail), st._tail_start, list(st._win_start), st.drafted,
            win)


def _same_state(p0, s0, p1, s1, tol: float = 0.0):
    """``tol``: 0 bit for bit; else the windows and KV rows within that (relative and absolute)."""
    f0, f1 = _fingerprint(p0, s0), _fingerprint(p1, s1)
    assert f0[:-1] == f1[:-1]
    same = np.array_equal if not tol else lambda a, b: np.allclose(a, b, rtol=tol, atol=tol)
    for m, (w0, w1) in enumerate(zip(f0[-1], f1[-1])):
        assert (w0 is None) == (w1 is None), f"module {m}: window present in one path only"
        if w0 is not None:
            assert w0.shape == w1.shape and same(w0, w1), f"module {m}: windows differ"
    for m in range(p0.num_modules):
        k0, v0 = kv_rows(p0, s0, m)
        k1, v1 = kv_rows(p1, s1, m)
        assert k0.shape == k1.shape and v0.shape == v1.shape, f"module {m}: KV rows differ in number"
        assert same(k0, k1) and same(v0, v1), f"module {m}: KV rows differ"


def _random_mask(rng, V, kind, k):
    W = (V + 31) // 32
    if kind is None:
        return None
    if kind == "none_allowed":
        return np.zeros(W, np.int32)
    if kind == "one":
        return rng.integers(-2**31, 2**31 - 1, W, dtype=np.int64).astype(np.int32)
    rows = rng.integers(-2**31, 2**31 - 1, (k, W), dtype=np.int64).astype(np.int32)
    if kind == "rows":
        return rows
    return lambda i, drafts: rows[i]          # callable: the planned path must not take it


def _threshold(prop, states, last, hid, pos, k, masks, q: float | tuple[int, int]) -> float:
    """A ``min_confidence`` that splits the confidences the next propose will see: forks of
    ``states`` propose without a stop, and of their distinct confidences (with 0 and 1 as the
    ends) the cuts are the midpoints. ``q`` a float: the cut at that quantile (1 stops every
    sequence after its first draft, 0 none); ``(i, n)``: a cut that stops sequence ``i``
    after ``n`` drafts where one does (else the median cut)."""
    forks = [prop.fork_state(s) for s in states]
    confs: list = []
    try:
        prop.propose_batch(last, hid, pos, k, forks, grammar_bitmasks=masks, out_conf=confs)
    except NoAllowedToken:
        return 0.5
    finally:
        for f in forks:
            prop.free_state(f)
    vals = sorted({0.0, 1.0} | {c for row in confs for c in row})
    cuts = [0.0] + [(a + b) / 2 for a, b in zip(vals, vals[1:])] + [1.0]
    if isinstance(q, tuple):
        i, n = q
        c = np.asarray(confs[i % len(confs)], np.float32)
        for t in cuts:
            below = np.flatnonzero(c < np.float32(t))
            if (below[0] + 1 if below.size else c.size) == n:
                return t
        q = 0.5
    return cuts[int(round(q * (len(cuts) - 1)))]


#: the early stop's tolerance at batches over 1 (see run_twins)
ES_TOL = 1e-5


def run_twins(eager, planned, cfg, seed, lens, rounds, conf: bool = False, plannable: bool = True,
              stops: list | None = None, seen: set | None = None):
    """Drive both proposers through the same calls; compare after every one. ``conf``: every
    propose also asks for the drafts' confidences (out_conf), compared too. ``plannable``:
    in draft mode, every propose without a callable mask must take the planned step.
    ``stops``: per round (cycled), None or a quantile for ``_threshold``: that propose has an
    early stop (``min_confidence``); ``seen`` collects (k, the drafts of each sequence) of them.
    With early stops at a batch over 1, the confidences, windows and KV rows are compared within
    ``ES_TOL``: the eager path runs a module past a stop on the sequences still drafting only,
    the planned step on all of them, and BLAS rounds a product of 2 rows and of 3 apart."""
    rng = np.random.default_rng(seed)
    H, V, B = cfg.stream_size, cfg.vocab_size, len(lens)
    exact = eager.kv_mode == "exact"
    s0 = [eager.alloc_state() for _ in range(B)]
    s1 = [planned.alloc_state() for _ in range(B)]
    pending = []
    for i, n in enumerate(lens):
        toks = rng.integers(0, V, n).tolist()
        hid = rng.standard_normal((n, H)).astype(np.float32)
        eager.prefill_drafter(toks, hid, s0[i])
        planned.prefill_drafter(toks, hid, s1[i])
        pending.append(hid[-1])
    pos = list(lens)
    before = dict(planned.step_runner.counts)
    planned_calls = 0
    try:
        for r, (k, fracs, kinds) in enumerate(rounds):
            last = rng.integers(0, V, B).tolist()
            masks = [_random_mask(rng, V, kinds[i % len(kinds)], min(k, cfg.num_modules)) for i in range(B)]
            masks_arg = None if all(m is None for m in masks) else masks
            q = None if not stops else stops[r % len(stops)]
            thr = None if q is None else _threshold(eager, s0, last, np.stack(pending), pos, k, masks_arg, q)
            runs = sum(planned.step_runner.counts[c] for c in ("executed", "replayed"))
            outs = []
            confs: list = [[] if conf else None, [] if conf else None]
            for (p, ss), conf in zip(((eager, s0), (planned, s1)), confs):
                try:
                    outs.append(p.propose_batch(last, np.stack(pending), pos, k, ss, grammar_bitmasks=masks_arg,
                                                out_conf=conf, min_confidence=thr))
                except NoAllowedToken:
                    outs.append(NoAllowedToken)
            assert outs[0] == outs[1]
            tol = ES_TOL if stops and B > 1 else 0.0
            if seen is not None and thr is not None and outs[0] is not NoAllowedToken:
                seen.add((min(k, cfg.num_modules), tuple(len(d) for d in outs[0])))
            if tol and outs[0] is not NoAllowedToken and confs[0] is not None:
                assert [len(c) for c in confs[0]] == [len(c) for c in confs[1]]
                assert all(np.allclose(a, b, rtol=tol, atol=tol) for a, b in zip(*confs)), confs
            else:
                assert confs[0] == confs[1], "the planned step's confidences differ from the eager path's"
            took_plan = sum(planned.step_runner.counts[c] for c in ("executed", "replayed")) > runs
            planned_calls += took_plan
            if took_plan:
                assert not any(callable(m) for m in masks)
            for a, b in zip(s0, s1):
                _same_state(eager, a, planned, b, tol)
            if outs[0] is NoAllowedToken:
                continue
            assert np.array_equal(np.asarray(eager.last_drafts_device), np.asarray(planned.last_drafts_device))
            assert planned.read_deferred_draft_token() == eager.read_deferred_draft_token()
            for i in range(B):
                a = int(round(fracs[i % len(fracs)] * len(outs[0][i])))
                acc = outs[0][i][:a]
                hid = rng.standard_normal((a, H)).astype(np.float32)
                for p, ss in ((eager, s0), (planned, s1)):
                    p.after_verify(a, ss[i])
                    p.catchup_drafter(acc, hid, ss[i])
                pending[i] = rng.standard_normal(H).astype(np.float32)
                pos[i] += 1 + a
            for a, b in zip(s0, s1):
                _same_state(eager, a, planned, b, tol)
            planned.check_invariants()
        if not exact and plannable:         # draft mode: every propose without a callable is planned
            static = sum(1 for _, _, kinds in rounds if "callable" not in kinds[:B])
            assert planned_calls >= static - sum(1 for _, _, kinds in rounds if "none_allowed" in kinds[:B])
    finally:
        for p, ss in ((eager, s0), (planned, s1)):
            for s in ss:
                p.free_state(s)
        eager.check_invariants()
        planned.check_invariants()
    return {c: planned.step_runner.counts[c] - before.get(c, 0) for c in planned.step_runner.counts}


kinds = hs.sampled_from([None, None, "one", "rows", "callable", "none_allowed"])
scenario = dict(
    seed=hs.integers(0, 2**31 - 1),
    lens=hs.lists(hs.integers(1, 12), min_size=1, max_size=3),
    rounds=hs.lists(hs.tuples(hs.integers(1, 4), hs.lists(hs.floats(0, 1), min_size=1, max_size=3),
                              hs.lists(kinds, min_size=1, max_size=3)), min_size=1, max_size=6),
)


@pytest.mark.parametrize("mode", ["exact", "draft"])
@pytest.mark.parametrize("chain", ["prenorm", "postnorm"])
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(**scenario)
def test_planned_step_equals_eager(tiny_ckpt, tiny_cfg, mode, chain, seed, lens, rounds):
    eager, planned = _pair(tiny_ckpt, mode, chain)
    run_twins(eager, planned, tiny_cfg, seed, lens, rounds)


#: k = 3 proposes whose thresholds cut the confidences at these quantiles (every sequence stopped
#: after its first draft at 1.0, none at 0.0) or stop sequence i after n drafts ((i, n))
#: (stopping after 2 needs a second confidence below the first, which this checkpoint rarely gives:
#: hence the many tries)
EARLY_STOPS = [1.0, (0, 2), 0.5, (1, 1), (2, 2), 0.0, (0, 3), (1, 2), 0.25, (2, 2), (0, 2), 0.75, (1, 2), (2, 1),
               (0, 2), (1, 3), (2, 2), (0, 2)]


def early_stop_run(eager, planned, cfg, B: int, seed: int = 3, masks: str | None = None) -> set:
    """Eight k = 3 rounds with early stops (``EARLY_STOPS``), after each a verify of a varied
    share of the drafts and their catch-up, the two proposers compared call for call; returns
    the stops seen and checks they cover 1, 2 and 3 drafts (and at batch 3 sequences stopping
    apart), every propose planned."""
    seen: set = set()
    rounds = [(3, [1.0, 0.0, 0.5][r % 3:] + [1.0, 0.0, 0.5][:r % 3], [masks]) for r in range(len(EARLY_STOPS))]
    counts = run_twins(eager, planned, cfg, seed, [9, 14, 6][:B], rounds, conf=True, stops=EARLY_STOPS, seen=seen)
    _planned_only(counts)
    assert counts.get("early_stop", 0) == len(EARLY_STOPS), counts
    lengths = {n for _, ns in seen for n in ns}
    assert lengths == {1, 2, 3}, seen
    if B > 1:
        assert any(len(set(ns)) > 1 for _, ns in seen), seen
    return seen


@pytest.mark.parametrize("mode", ["exact", "draft"])
@pytest.mark.parametrize("B", [1, 3])
def test_planned_early_stop_equals_eager(tiny_ckpt, tiny_cfg, mode, B):
    """A propose with min_confidence takes the planned step (every module runs, the stop is
    applied after it): the eager early stop's drafts, confidences, KV rows of every module,
    windows and counters, and the same states after verifies of 0 .. all the drafts."""
    eager, planned = _pair(tiny_ckpt, mode, "prenorm")
    early_stop_run(eager, planned, tiny_cfg, B)


@pytest.mark.parametrize("mode", ["exact", "draft"])
def test_planned_early_stop_with_masks(tiny_ckpt, tiny_cfg, mode):
    """Static grammar rows with an early stop: the rows past a stop are masked too (and a
    sequence whose grammar allows nothing raises, the state unchanged, in both paths)."""
    eager, planned = _pair(tiny_ckpt, mode, "postnorm")
    early_stop_run(eager, planned, tiny_cfg, 3, seed=8, masks="rows")


@pytest.mark.parametrize("mode", ["exact", "draft"])
def test_planned_early_stop_without_the_trim_differs(tiny_ckpt, tiny_cfg, mode, monkeypatch):
    """Negative control: with the rows past each stop left in place, the state comparison fails."""
    eager, planned = _pair(tiny_ckpt, mode, "prenorm")
    monkeypatch.setattr(StepRunner, "_early_stop", lambda self, sts, poss, k, keep: None)
    with pytest.raises(AssertionError):
        early_stop_run(eager, planned, tiny_cfg, 3)


@pytest.mark.parametrize("mode", ["exact", "draft"])
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(**scenario, stops=hs.lists(hs.one_of(hs.none(), hs.floats(0, 1)), min_size=1, max_size=4))
def test_planned_early_stop_random(tiny_ckpt, tiny_cfg, mode, seed, lens, rounds, stops):
    """Random call sequences (any k, masks, verifies) with early stops drawn per round."""
    eager, planned = _pair(tiny_ckpt, mode, "prenorm")
    run_twins(eager, planned, tiny_cfg, seed, lens, rounds, conf=True, stops=stops)


@pytest.mark.parametrize("mode", ["exact", "draft"])
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(**scenario)
def test_planned_step_equals_eager_mla(mla_ckpt, mla_cfg, mode, seed, lens, rounds):
    """MLA modules (latent pools, the q_lora path, the latent write and absorbed attention
    with out= buffers) in the planned step."""
    eager, planned = _pair(mla_ckpt, mode, "postnorm")
    run_twins(eager, planned, mla_cfg, seed, lens, rounds)


@pytest.fixture(scope="module")
def v4_ffn_ckpt(tmp_path_factory):
    """DeepSeek-V4's FFN in the tiny config: sqrtsoftplus routing over one group, both SwiGLU
    clamps on the gate before silu, module 1 a dense MLP."""
    from mtpkern import write_synthetic_checkpoint
    from mtpkern.config import tiny_config

    cfg = tiny_config(scoring_func="sqrtsoftplus", n_group=1, topk_group=1, swiglu_clamp=0.4, swiglu_clamp_shared=0.3,
                      swiglu_clamp_gate=True, intermediate_size=40, blocks=[{}, {"moe": False}, {}])
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("v4ffn"), cfg, seed=12), cfg


@pytest.mark.parametrize("mode", ["exact", "draft"])
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(**scenario)
def test_planned_step_equals_eager_v4_ffn(v4_ffn_ckpt, mode, seed, lens, rounds):
    """The router's sqrtsoftplus scores and the clamps of the gate (the ops' clamp_gate keyword)
    in the planned step: its drafts and state are the eager path's."""
    ckpt, cfg = v4_ffn_ckpt
    eager, planned = _pair(ckpt, mode, "prenorm")
    assert planned.modules[0]._experts_kw == {"limit": 0.4, "clamp_gate": True}
    assert planned.modules[1]._mlp_kw == {"limit": 0.3, "clamp_gate": True}
    run_twins(eager, planned, cfg, seed, lens, rounds)


def _planned_only(counts: dict) -> None:
    """Every propose of a steady-state run took the planned step: plans ran, nothing fell back."""
    assert counts.get("executed", 0) > 0, counts
    assert not {c for c, v in counts.items() if v and c.startswith("fallback")}, counts


@pytest.mark.parametrize("mode", ["exact", "draft"])
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(**scenario)
def test_planned_step_equals_eager_dsa(dsa_ckpt, dsa_cfg, mode, seed, lens, rounds):
    """DSA's indexer in the planned step (its projections, key write and lists with out= buffers;
    in exact mode the last module's rows that go on carry their indexer queries and weights):
    the eager path's drafts and state. index_topk 4 at contexts of 2..40 rows: the lists are
    sparse for most rows."""
    eager, planned = _pair(dsa_ckpt, mode, "postnorm")
    assert planned.modules[0].block.index_topk == 4
    run_twins(eager, planned, dsa_cfg, seed, lens, rounds)


@pytest.fixture(scope="module")
def kpool_ckpt(tmp_path_factory):
    """GLM-5.3's pooled indexer: pools of 2 rows, 4 keys (2 pools) and the tail: lists of 5."""
    from mtpkern import write_synthetic_checkpoint
    from mtpkern.config import tiny_config
    from test_dsa_kpool import KPOOL_FIELDS

    cfg = tiny_config(**KPOOL_FIELDS)
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("kpool"), cfg, seed=14), cfg


@pytest.mark.parametrize("mode", ["exact", "draft"])
def test_planned_step_equals_eager_pooled_dsa(kpool_ckpt, mode):
    """The pooled indexer in the planned step: its plane's key and gate scores (index_gate), lists
    of index_topk + P - 1 columns (index_list_width), at contexts past the pools picked."""
    ckpt, cfg = kpool_ckpt
    eager, planned = _pair(ckpt, mode, "postnorm")
    assert planned.modules[0].block.index_list_width == 5
    counts = run_twins(eager, planned, cfg, 12, [17, 6, 25],
                       [(3, [1.0], [None]), (2, [0.5], ["rows"]), (3, [0.0], [None]), (1, [1.0], [None])])
    _planned_only(counts)


_CKPTS: dict = {}


def _v4_attn(tmp_path_factory, window: int):
    """DeepSeek-V4's attention (tests/test_v4_attention.py's V4_ATTN: the query's latent, K = V,
    sinks, the output unrotated, a grouped low-rank output) with a window of ``window`` keys
    (0: none): (checkpoint, config), written once per session."""
    if window not in _CKPTS:
        from mtpkern import write_synthetic_checkpoint
        from mtpkern.config import tiny_config
        from test_v4_attention import V4_ATTN

        cfg = tiny_config(**V4_ATTN, sliding_window=window)
        _CKPTS[window] = write_synthetic_checkpoint(tmp_path_factory.mktemp(f"v4attn{window}"), cfg, seed=17), cfg
    return _CKPTS[window]


@pytest.fixture(scope="module", params=[0, 6])
def v4_attn_ckpt(tmp_path_factory, request):
    return _v4_attn(tmp_path_factory, request.param)


@pytest.fixture(scope="module")
def v4_window_ckpt(tmp_path_factory):
    return _v4_attn(tmp_path_factory, 6)[0]


@pytest.mark.parametrize("mode", ["exact", "draft"])
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(**scenario)
def test_planned_step_equals_eager_v4_attention(v4_attn_ckpt, mode, seed, lens, rounds):
    """DeepSeek-V4's attention in the planned step: the query latent's rows joined with k | v by
    segment copies, the output's inverse RoPE into its buffer (in exact mode the picked rows carry
    their positions), the grouped o_a_proj over column groups copied out of o: the eager path's
    drafts and state, and no fallback."""
    ckpt, cfg = v4_attn_ckpt
    eager, planned = _pair(ckpt, mode, "prenorm")
    run_twins(eager, planned, cfg, seed, lens, rounds)


@pytest.mark.parametrize("mode", ["exact", "draft"])
def test_v4_attention_takes_the_planned_step(v4_attn_ckpt, mode):
    """Every propose of a steady-state run planned (none falls back), contexts past the window."""
    ckpt, cfg = v4_attn_ckpt
    eager, planned = _pair(ckpt, mode, "prenorm")
    counts = run_twins(eager, planned, cfg, 13, [9, 21], [(3, [1.0], [None]), (2, [0.5], ["one"]),
                                                           (3, [0.0], [None]), (1, [1.0], [None])])
    _planned_only(counts)
    assert counts["executed"] + counts.get("replayed", 0) == 4, counts


@pytest.mark.parametrize("mode", ["exact", "draft"])
def test_dsa_planned_step_selects_sparsely(dsa_ckpt, dsa_cfg, mode):
    """Contexts far past index_topk (the lists pick 4 of 20..40 rows), every propose planned and
    none falling back; the plan's lists are sparse (as many entries as index_topk, with rows
    skipped), so the sparse attention is what the comparison covers."""
    eager, planned = _pair(dsa_ckpt, mode, "postnorm")
    counts = run_twins(eager, planned, dsa_cfg, 11, [20, 33, 27],
                       [(3, [1.0], [None]), (2, [0.5], ["one"]), (3, [0.0], [None]), (1, [1.0], [None])])
    _planned_only(counts)
    assert counts["executed"] + counts.get("replayed", 0) == 4
    plan = next(reversed(planned.step_runner.plans.values()))
    lists = np.concatenate([np.asarray(plan.bufs[m].index) for m in plan.run if plan.bufs[m].index.size])
    T = dsa_cfg.block(0).index_topk
    assert lists.shape[1] == T and (lists >= 0).all()
    assert (lists[:, -1] - lists[:, 0] >= T).all(), "expected lists that skip rows (a sparse selection)"


@pytest.mark.parametrize("mode", ["exact", "draft"])
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(**scenario)
def test_planned_step_equals_eager_hyper_connections(hc_ckpt, hc_cfg, mode, seed, lens, rounds):
    """Hyper-connections in the planned step: chained rows, windows and the engine's hiddens of
    hc_mult streams (the segment copies move stream_size values), each token copied once per
    stream, the collapses and hc_post into plan buffers, hc_head before the final norm; in exact
    mode the picked rows carry the attention's collapse (post, comb): the eager path's drafts
    and state."""
    eager, planned = _pair(hc_ckpt, mode, "prenorm")
    run_twins(eager, planned, hc_cfg, seed, lens, rounds)


@pytest.mark.parametrize("mode", ["exact", "draft"])
def test_hyper_connections_take_the_planned_step(hc_ckpt, hc_cfg, mode):
    """Every propose of a steady-state run planned, none falling back."""
    eager, planned = _pair(hc_ckpt, mode, "prenorm")
    counts = run_twins(eager, planned, hc_cfg, 21, [7, 12], [(3, [1.0], [None]), (2, [0.5], ["rows"]),
                                                              (3, [0.0], [None]), (1, [1.0], [None])])
    _planned_only(counts)
    assert counts["executed"] + counts.get("replayed", 0) == 4, counts


@pytest.mark.parametrize("mode", ["exact", "draft"])
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(**scenario)
def test_planned_step_with_confidences_equals_eager(tiny_ckpt, tiny_cfg, mode, seed, lens, rounds):
    """Every propose asking for out_conf: the planned step's conf buffers and their copy to
    the host give the eager path's confidences exactly."""
    eager, planned = _pair(tiny_ckpt, mode, "prenorm")
    run_twins(eager, planned, tiny_cfg, seed, lens, rounds, conf=True)


@pytest.mark.parametrize("mode", ["exact", "draft"])
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(**scenario)
def test_planned_step_with_a_draft_vocabulary_equals_eager(tiny_ckpt, tiny_cfg, mode, seed, lens, rounds):
    """The LM heads over a token subset in the planned step (id_map in the argmax, masks in
    the subset's bits) give the eager path's drafts, confidences and state."""
    key = (str(tiny_ckpt), mode, "vocab")
    if key not in _PAIRS:
        ids = np.random.default_rng(8).permutation(301)[:120]
        make = lambda: MultiModuleMtpHead.from_pretrained(tiny_ckpt, backend="numpy", kv_mode=mode,  # noqa: E731
                                                          block_size=4, num_blocks=160, prefill_chunk=6,
                                                          draft_vocab=ids)
        eager, planned = make(), make()
        planned.step_runner = StepRunner(planned, capture=False)
        _PAIRS[key] = (eager, planned)
    eager, planned = _PAIRS[key]
    run_twins(eager, planned, tiny_cfg, seed, lens, rounds, conf=True)


@pytest.mark.parametrize("mode", ["exact", "draft"])
def test_planned_step_dense_checkpoint(tiny_ckpt_dense, mode):
    from mtpkern.config import MtpConfig

    cfg = MtpConfig.from_json(tiny_ckpt_dense / "config.json")
    eager, planned = _pair(tiny_ckpt_dense, mode, "prenorm")
    counts = run_twins(eager, planned, cfg, 5, [9, 3, 14],
                       [(2, [1.0], [None]), (1, [0.0, 0.5], ["one"]), (2, [0.5], [None]), (3, [1.0], ["rows"])])
    assert counts["executed"] >= 3


@pytest.mark.parametrize("mode", ["exact", "draft"])
def test_planned_path_is_taken_and_plans_are_reused(tiny_ckpt, tiny_cfg, mode):
    eager, planned = _pair(tiny_ckpt, mode, "prenorm")
    before = planned.step_runner.counts["plans"]
    counts = run_twins(eager, planned, tiny_cfg, 1, [6, 9],
                       [(3, [0.0], [None])] * 4 + [(2, [1.0], [None])] * 3)
    assert counts["executed"] == 7                  # every propose planned (P >= M from the start)
    assert planned.step_runner.counts["plans"] - before <= 2   # one shape per k (the widths stay at 16)


def test_short_history_and_callables_fall_back(tiny_ckpt, tiny_cfg):
    eager, planned = _pair(tiny_ckpt, "exact", "prenorm")
    counts = run_twins(eager, planned, tiny_cfg, 2, [1],                 # P = 1 < M: modules lack history
                       [(3, [1.0], [None]), (3, [1.0], [None]), (2, [0.0], ["callable"]), (3, [0.0], [None])])
    assert counts.get("fallback_short", 0) >= 1
    assert counts.get("executed", 0) == 2           # P = 1, then P = 5 (planned), callable (eager), planned


def test_no_allowed_token_rolls_back(tiny_ckpt, tiny_cfg):
    _, planned = _pair(tiny_ckpt, "exact", "prenorm")
    rng = np.random.default_rng(0)
    st = planned.alloc_state()
    planned.prefill_drafter(rng.integers(0, 301, 8).tolist(), rng.standard_normal((8, 64)).astype(np.float32), st)
    before = (_fingerprint(planned, st)[:-1], planned.kv_blocks_in_use())
    runs = planned.step_runner.counts["executed"]
    with pytest.raises(NoAllowedToken):
        planned.propose(3, rng.standard_normal(64).astype(np.float32), 8, 3, st,
                        grammar_bitmask=np.zeros((301 + 31) // 32, np.int32))
    assert planned.step_runner.counts["executed"] == runs + 1
    assert (_fingerprint(planned, st)[:-1], planned.kv_blocks_in_use()) == before
    planned.check_invariants()
    planned.free_state(st)


@pytest.fixture(scope="module")
def nemo_ckpt(tmp_path_factory):
    """Nemotron-3's release step (tests/test_family_nemotron_h.py: NoPE, relu2 experts and shared expert)."""
    import json

    import test_family_nemotron_h
    from mtpkern import write_synthetic_checkpoint

    cfg = test_family_nemotron_h.NEMO
    path = write_synthetic_checkpoint(tmp_path_factory.mktemp("nemo"), cfg, seed=13, dtype="float32")
    (path / "config.json").write_text(json.dumps(test_family_nemotron_h.release_config(cfg)))
    return path


@pytest.mark.parametrize("mode", ["exact", "draft"])
@pytest.mark.parametrize("ckpt", ["tiny_ckpt", "mla_ckpt", "dsa_ckpt", "v4_window_ckpt", "hc_ckpt", "nemo_ckpt"])
def test_plan_writes_only_its_buffers_and_reads_no_temporaries(ckpt, mode, request):
    """What capture needs: every op of the plan gets its output buffer(s), and every
    array an op reads or writes is persistent (plan buffers, the staging area, the
    weights, the KV pools): a replay reads the addresses the capture saw."""
    prop = MultiModuleMtpHead.from_pretrained(request.getfixturevalue(ckpt), backend="numpy", kv_mode=mode,
                                              block_size=4, num_blocks=64)
    runner = prop.step_runner = StepRunner(prop, capture=False)
    rng = np.random.default_rng(3)
    sts = [prop.alloc_state() for _ in range(2)]
    S = prop.config.stream_size
    for st in sts:
        prop.prefill_drafter(rng.integers(0, 301, 7).tolist(), rng.standard_normal((7, S)).astype(np.float32), st)
    be = prop.backend
    outputs = {"moe_router": ("ids", "weights"), "hc_pre": ("u", "post", "comb")}
    calls = []
    persistent: list = []

    def persistent_arrays():
        if not persistent:
            for plan in runner.plans.values():
                persistent.extend(plan._own + [plan.stage.dev])
            for h in prop.modules:
                persistent.extend(a for a in (h.pool.k, h.pool.v, h.pool.index_k, h._inv_freq) if a is not None)
                for v in (getattr(h.w, f) for f in h.w.__slots__):       # arrays, and lists of them (o_a_proj's)
                    persistent.extend(a for a in (v if isinstance(v, (list, tuple)) else [v])
                                      if isinstance(a, np.ndarray))
        return persistent

    def checked(name, fn):
        def op(*args, **kw):
            outs = outputs.get(name, ("out",))
            assert all(kw.get(o) is not None for o in outs), f"{name}: no preallocated {outs}"
            arrays = [a for a in list(args) + list(kw.values()) if isinstance(a, np.ndarray)]
            for a in arrays:
                assert any(np.may_share_memory(a, p) for p in persistent_arrays()), \
                    f"{name}: an argument of shape {a.shape} is not a persistent buffer"
            calls.append(name)
            return fn(*args, **kw)
        return op

    orig = runner.propose

    def propose(*a, **kw):   # check the ops only while the plan runs
        names = ("rmsnorm", "mtp_input", "linear", "qk_norm_rope_kv_write", "paged_attention", "moe_router",
                 "moe_experts", "swiglu_mlp", "lm_head_argmax", "mla_latent_write", "mla_attention_absorbed",
                 "dsa_key_write", "dsa_select", "rope_heads", "hc_pre", "hc_post", "hc_head")
        for n in names:
            setattr(be, n, checked(n, getattr(NumpyBackend, n)))
        try:
            return orig(*a, **kw)
        finally:
            for n in names:
                delattr(be, n)

    runner.propose = propose
    prop.propose_batch([1, 2], rng.standard_normal((2, S)).astype(np.float32), [7, 7], 3, sts)
    attention = "mla_attention_absorbed" if prop.modules[0].block.mla else "paged_attention"
    assert calls.count("lm_head_argmax") == min(3, prop.num_modules) and attention in calls
    if prop.modules[0].block.dsa:        # every module's indexer: its key write and its lists
        assert calls.count("dsa_key_write") == prop.num_modules and "dsa_select" in calls, calls


def test_host_copy_segments_checks_bounds():
    a = np.arange(8, dtype=np.float32)
    b = np.zeros(8, np.float32)
    ranges = [(a.ctypes.data, a.nbytes), (b.ctypes.data, b.nbytes)]
    host_copy_segments(np.array([[a.ctypes.data + 8, b.ctypes.data, 3]], np.int64), ranges)
    assert b[:3].tolist() == [2.0, 3.0, 4.0] and b[3] == 0
    with pytest.raises(AssertionError, match="outside every buffer"):
        host_copy_segments(np.array([[a.ctypes.data + 8, b.ctypes.data, 8]], np.int64), ranges)


def test_step_rows_rule():
    assert step_rows("exact", 3, 3) == (1, 2, 3)
    assert step_rows("exact", 3, 1) == (1, 2, 2)       # later modules: k + 1 rows
    assert step_rows("draft", 3, 2) == (1, 1, 0)


@given(hs.integers(1, 5000))
def test_table_width(blocks):
    w = table_width(blocks)
    assert w >= max(blocks, MIN_TABLE_WIDTH)
    if blocks > MIN_TABLE_WIDTH:
        assert w <= blocks * 1.125
    assert table_width(w) == w and table_width(blocks + 1) >= w


def test_numpy_out_buffers():
    be = NumpyBackend()
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    w = np.ones(8, np.float32)
    out = np.empty_like(x)
    assert be.rmsnorm(x, w, 1e-5, out=out) is out
    assert np.array_equal(out, be.rmsnorm(x, w, 1e-5))
    with pytest.raises(ValueError, match="out: expected shape"):
        be.rmsnorm(x, w, 1e-5, out=np.empty((2, 8), np.float32))
    with pytest.raises(TypeError):
        be.rmsnorm(x, w, 1e-5, xcat=out)              # CUDA workspaces are not accepted here


def test_import_touches_no_gpu():
    import subprocess
    import sys

    code = ("import sys, mtpkern.cuda_graph, mtpkern.backends.dlpack, mtpkern.backends.cuda_launch.step\n"
            "assert 'cupy' not in sys.modules, 'cupy imported at import time'\n")
    subprocess.run([sys.executable, "-c", code], check=True)
