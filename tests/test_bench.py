"""The benchmark harness: where its output goes, --contexts, --plot, and the checks that
judge a figure (on synthetic timings: speed itself is measured in benchmarks/, not here)."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from mtpkern.bench import (_marks, expected_experts, fast_fill, propose_bytes, propose_fmas, propose_parts,
                           propose_roof_us, stream_bytes)
from mtpkern.config import small_config
from mtpkern.cli import main
from mtpkern.timing import MAX_SPREAD, Timing, floor_error, spread_warning, warnings_of

TINY = ["bench", "--shapes", "tiny", "--runs", "2", "--warmup", "0", "--batches", "1,2", "--no-torch"]


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """An empty working directory, and the synthetic checkpoints under tmp_path/cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return cwd


def test_bench_contexts_writes_json_only_where_asked(workdir, tmp_path, capsys):
    out = tmp_path / "figures" / "bench.json"
    out.parent.mkdir()
    assert main(TINY + ["--threads", "1", "--contexts", "8,40", "--no-ops", "--json", str(out)]) == 0
    assert list(workdir.iterdir()) == []                 # nothing in the working directory
    res = json.loads(out.read_text())
    assert res["contexts"] == [8, 40] and res["threads"] == 1 and "1 thread" in res["backend"]
    rows = res["propose"]
    assert {(r["context"], r["batch"], r["k"], r["kv_mode"]) for r in rows} == {
        (c, b, k, m) for c in (8, 40) for b in (1, 2) for k in (1, 2, 3) for m in ("draft", "exact")} | {
        (c, b, 3, m + t) for c in (8, 40) for b in (1, 2) for m in ("draft", "exact")
        for t in ("+conf", "+stop0.5", "+sample", "+tree1", "+tree4", "+treebatch1", "+treebatch4")}
    # k = M: confidences, an early stop, sampled drafts, trees (a call per sequence, and one propose_tree_batch)
    assert all(r["conf"] == ("+" in r["kv_mode"] and "+sample" not in r["kv_mode"]) for r in rows)
    assert all((r["sampling"] == {"temperature": 0.8, "top_k": 0, "top_p": 0.95, "seed": 1})
               == r["kv_mode"].endswith("+sample") and (r["sampling"] is None) != r["kv_mode"].endswith("+sample")
               for r in rows)
    assert all((r["min_confidence"] == 0.5) == r["kv_mode"].endswith("+stop0.5") for r in rows)
    assert all(r["tree_width"] == (int(r["kv_mode"][-1]) if "+tree" in r["kv_mode"] else None) for r in rows)
    assert not any(r["floor_judged"] for r in rows if r["tree_width"])   # a tree's floor is its chain's
    assert all(r["tree_batched"] == (("+treebatch" in r["kv_mode"]) if r["tree_width"] else None) for r in rows)
    for r in rows:
        assert r["runs"] == 2 and isinstance(r["warnings"], list) and r["floor_us"] > 0
    text = capsys.readouterr().out
    assert "ctx" in text and "wrote" in text


def test_bench_without_json_writes_nothing(workdir, capsys):
    assert main(TINY + ["--backend", "numpy", "--batches", "1", "--kv-modes", "draft", "--contexts", "4"]) == 0
    assert list(workdir.iterdir()) == []
    assert "paged_attention_ctx4" in capsys.readouterr().out


def test_bench_plot(workdir, tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib not installed (pip install 'mtpkern[plot]')")
    png = tmp_path / "bench.png"
    assert main(TINY + ["--backend", "numpy", "--contexts", "4,16", "--no-ops", "--kv-modes", "draft",
                        "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list(workdir.iterdir()) == []



def _bench_result(floor_exact: float = 1.6) -> dict:
    """Propose rows as ``run_bench`` writes them: two batches, three contexts, both modes
    (each mode's floor its own: exact reads more), and +conf rows that the plot leaves out."""
    rows = []
    for c in (64, 512, 4096):
        for b in (1, 4):
            for mode, f in (("draft", 1.0), ("exact", floor_exact)):
                for kv in (mode, mode + "+conf"):
                    med = (120 + c * 0.05 * f) * b ** 0.5 * f
                    rows.append(dict(context=c, batch=b, k=3, kv_mode=kv, median_us=med, p20_us=med * 0.95,
                                     p80_us=med * 1.05, floor_us=(60 + c * 0.02) * f * b ** 0.5))
    return dict(propose=rows, config="M=3 H=64", backend="numpy", machine="a test")


def test_bench_plot_draws_one_floor_per_mode_plain_ticks_legend_off_the_data(tmp_path, monkeypatch):
    """The floor is one line per mode and series, rising with context as the rows say (one
    line through both modes' floors zig-zagged); the log axis labels read as plain numbers
    (not 2x10^1); the legends do not cover the plots."""
    pytest.importorskip("matplotlib", reason="matplotlib not installed (pip install 'mtpkern[plot]')")
    from mtpkern.bench import plot, require_matplotlib

    plt = require_matplotlib()
    figures = []
    real_close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: (figures.append(fig), real_close(fig)))
    res = _bench_result()
    plot(plt, res, tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = figures[-1]
    canvas = FigureCanvasAgg(fig)                    # pyplot let go of the closed figure's own
    canvas.draw()
    renderer = canvas.get_renderer()
    rows = [r for r in res["propose"] if r["kv_mode"] in ("draft", "exact")]
    for ax, x, series in zip(fig.axes, ("context", "batch"), ("batch", "context")):
        floors = {ln.get_label(): ln for ln in ax.get_lines() if "floor" in ln.get_label()}
        want = {f"{m} floor, {series} {s}" for m in ("draft", "exact") for s in sorted({r[series] for r in rows})}
        assert set(floors) == want
        for label, ln in floors.items():
            mode, s = label.split(" floor")[0], int(label.rsplit(" ", 1)[1])
            pts = sorted((r[x], r["floor_us"] / 1e3) for r in rows if r["kv_mode"] == mode and r[series] == s)
            assert list(ln.get_xdata()) == [p for p, _ in pts]
            np.testing.assert_allclose(ln.get_ydata(), [f for _, f in pts])
        labels = [t.get_text() for t in ax.get_yticklabels(minor=False) + ax.get_yticklabels(minor=True)
                  if t.get_text()]
        assert len(labels) >= 2 and all(float(t) > 0 for t in labels), labels       # plain numbers only
        data = ax.get_window_extent(renderer)
        legend = ax.get_legend().get_window_extent(renderer)
        assert not data.overlaps(legend), (data, legend)


def test_bench_plot_without_matplotlib_is_one_line(workdir, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)          # import matplotlib -> ImportError
    rc = main(TINY + ["--backend", "numpy", "--plot", str(tmp_path / "x.png"), "--json", str(tmp_path / "x.json")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("mtpkern: error: ")
    assert "pip install 'mtpkern[plot]'" in err and "Traceback" not in err
    assert not (tmp_path / "x.json").exists()                      # refused before the long part


# -- judging a figure ------------------------------------------------------------------------------

def test_timing_of_runs():
    t = Timing.of([1e-6 * v for v in range(1, 101)])               # 1 .. 100 us
    assert t.runs == 100 and t.median_us == pytest.approx(50.5)
    assert t.p20_us == pytest.approx(20.8) and t.p80_us == pytest.approx(80.2) and t.p99_us > t.p80_us
    with pytest.raises(ValueError, match="at least one run"):
        Timing.of([])


def test_spread_warning():
    steady = Timing(median_us=100, p20_us=95, p80_us=110, p99_us=120, runs=20)
    noisy = Timing(median_us=100, p20_us=60, p80_us=60 * MAX_SPREAD * 1.01, p99_us=400, runs=20)
    assert spread_warning(steady) is None
    assert "p80/p20" in spread_warning(noisy) and "not to be trusted" in spread_warning(noisy)
    assert spread_warning(Timing(1, 0, 1, 1, 3)) is not None       # p20 of 0: no spread to trust


def test_floor_error():
    assert floor_error(120.0, 100.0) is None
    assert floor_error(100.0, 100.0) is None
    assert "measurement error" in floor_error(80.0, 100.0)
    assert floor_error(80.0, 0.0) is None                          # no floor known


def test_warnings_of_and_the_table_mark():
    t = Timing(median_us=50, p20_us=40, p80_us=90, p99_us=95, runs=20)
    found = warnings_of(t, floor_us=100.0)
    assert len(found) == 2
    row = {"median_us": 50, "spread": t.spread, "floor_us": 100.0, "x_floor": 0.5, "floor_judged": True,
           "warnings": found}
    assert _marks(row) == f"  ! spread {t.spread:.1f}, below floor"
    assert warnings_of(Timing(100, 98, 102, 103, 20), floor_us=50.0) == []
    assert _marks({"spread": 1.0, "warnings": []}) == ""


def test_propose_bytes_counts_the_kv_each_mode_reads():
    """Draft mode: only module 0 attends over the context (the later modules hold just the
    row they write); exact mode: every module but the last does, and the last when it drafts
    (its other rows stop after their K/V: ExactChain.run). Weights: every drafting module's,
    and in exact mode the other modules' too, less their LM head, and of a last module that
    does not draft only eh_proj and q|k|v; the routed experts a module's rows reach in
    expectation (exact mode's module m runs min(m, k) + 1 rows a sequence; the last one
    takes one a sequence past its K/V when it drafts)."""
    cfg = small_config()
    assert cfg.num_modules == 3
    H, E, K = cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok
    kv_row = 2 * cfg.num_key_value_heads * cfg.head_dim * 4                  # K and V, FP32
    head = 2 * cfg.vocab_size * H
    kv_only = 2 * (2 * H * H + cfg.block(2).qkv_size * H)                    # eh_proj, q|k|v: BF16

    def routed(rows):                                                        # BF16 gate, up, down
        return 2 * 3 * cfg.moe_intermediate_size * H * expected_experts(E, K, rows)

    base = propose_bytes(cfg, 1, 0, 1, 4, "draft") - routed(1)               # one module, no routed experts
    assert propose_bytes(cfg, 1, 512, 1, 4, "draft") == round(base + routed(1) + 512 * kv_row)
    assert propose_bytes(cfg, 1, 512, 1, 4, "exact") == round(2 * base - head + routed(1) + routed(2) + kv_only
                                                              + 2 * 512 * kv_row)
    assert propose_bytes(cfg, 1, 0, 2, 4, "draft") > propose_bytes(cfg, 1, 0, 1, 4, "draft")   # more experts
    assert propose_bytes(cfg, 3, 512, 2, 4, "draft") == round(3 * (base + routed(2)) + 2 * (512 + 2) * kv_row)
    assert propose_bytes(cfg, 3, 512, 2, 4, "exact") == round(3 * base + routed(2) + routed(4) + routed(2)
                                                              + 2 * 3 * 512 * kv_row)
    assert propose_bytes(cfg, 2, 512, 2, 4, "exact") == round(2 * base + routed(2) + routed(4) + kv_only
                                                              + 2 * 2 * 512 * kv_row)


def test_expected_experts_is_uniform_routing():
    """The experts ``rows`` rows reach, each picking K of E at random: K for one row, E in the
    limit, and the mean of a simulation."""
    assert expected_experts(32, 4, 1) == pytest.approx(4)
    assert expected_experts(32, 4, 0) == 0 and expected_experts(0, 0, 8) == 0
    assert expected_experts(32, 4, 400) == pytest.approx(32)
    rng = np.random.default_rng(0)
    for rows in (2, 8, 24):
        hit = [len({e for _ in range(rows) for e in rng.choice(32, 4, replace=False)}) for _ in range(4000)]
        assert expected_experts(32, 4, rows) == pytest.approx(np.mean(hit), rel=0.01), rows


def test_roof_takes_each_part_at_its_slower_bound():
    """The roofline sums each part's slower bound: above the floor when one part is bound by its
    multiply-adds (batch 8's LM head at 100 GFMA/s), the floor itself without a rate."""
    cfg = small_config()
    parts = propose_parts(cfg, 3, 512, 8, 4, "exact")
    assert [p[0] for p in parts[:4]] == ["m0 proj", "m0 ffn", "m0 attn", "m0 head"]
    assert round(sum(p[1] for p in parts)) == propose_bytes(cfg, 3, 512, 8, 4, "exact")
    assert sum(p[2] for p in parts) == propose_fmas(cfg, 3, 512, 8, "exact")
    floor = sum(p[1] for p in parts) / 30e9 * 1e6
    assert propose_roof_us(parts, 30.0, None) == pytest.approx(floor)
    roof = propose_roof_us(parts, 30.0, 100.0)
    head = [p for p in parts if p[0] == "m0 head"][0]
    assert head[2] / 100e9 > head[1] / 30e9                                   # 8 rows: arithmetic-bound
    assert floor < roof < floor + sum(p[2] for p in parts) / 100e9 * 1e6


def test_stream_read_is_a_rate():
    """The floor's read probe returns a plausible rate and leaves Numba's thread count alone."""
    import numba

    from mtpkern.bench import stream_read

    before = numba.get_num_threads()
    assert 0.1 < stream_read(8 << 20, runs=2) < 10_000
    assert numba.get_num_threads() == before


@pytest.mark.parametrize("kv_mode", ["draft", "exact"])
def test_propose_bytes_counts_the_modules_a_propose_runs(make_prop, kv_mode):
    """The floor's modules are the ones a steady-state propose runs (the bench's loop: a
    propose, then after_verify(0)): draft mode the k drafting ones; exact mode all of them
    (the later ones write the verified token's row), with an LM head for the first k only."""
    prop = make_prop(kv_mode)
    M, H, V = prop.num_modules, prop.config.hidden_size, prop.config.vocab_size
    assert M >= 3
    be = prop.backend
    calls = {"mtp_input": 0, "lm_head_argmax": 0}
    for name in calls:
        def counted(*a, _f=getattr(be, name), _n=name, **kw):
            calls[_n] += 1
            return _f(*a, **kw)
        setattr(be, name, counted)
    rng = np.random.default_rng(0)
    st = prop.alloc_state()
    prop.prefill_drafter(rng.integers(0, V, 9).tolist(), rng.standard_normal((9, H)).astype(np.float32), st)
    p = 9
    for k in (1, 2, 1, M):
        for _ in range(2):                    # the second call is the steady state the bench times
            for c in calls:
                calls[c] = 0
            prop.propose(int(rng.integers(0, V)), rng.standard_normal(H).astype(np.float32), p, k, st)
            prop.after_verify(0, st)
            p += 1
        runs = M if kv_mode == "exact" else k
        assert calls == {"mtp_input": runs, "lm_head_argmax": k}, (k, calls)


def test_stream_bytes_outgrow_the_cache():
    assert stream_bytes(None) == 256 << 20
    assert stream_bytes(32 << 20) == 256 << 20
    assert stream_bytes(480 << 20) == 960 << 20                             # the 2-core VM's L3
    assert stream_bytes(4 << 30) == 1 << 30


def test_fast_fill_keeps_the_kv_write_and_restores_the_ops():
    from mtpkern.backends import get_backend

    be = get_backend("numpy")
    x = np.ones((3, 8), np.float32)
    w = np.ones((5, 8), np.float32)
    with fast_fill(be):
        assert not be.linear(x, w).any() and be.linear(x, w).shape == (3, 5)
        out = np.full((3, 8), 7.0, np.float32)
        assert be.rmsnorm(x, np.ones(8, np.float32), 1e-5, out=out) is out and not out.any()
        assert "qk_norm_rope_kv_write" not in vars(be)             # the KV write is the real one
    assert "linear" not in vars(be)
    assert be.linear(x, w)[0, 0] == pytest.approx(8.0)


def test_op_cases_time_every_gemv_in_fp8_too():
    """Each GEMV op has an ``_fp8`` twin on the same weights, counted at one byte per weight
    plus 4 per block-128 scale, and every case runs."""
    from mtpkern.backends import get_backend
    from mtpkern.bench import SHAPES, fp8_bytes, op_cases

    assert fp8_bytes(300, 1000) == 300 * 1000 + 4 * 3 * 8
    assert fp8_bytes(4, 130, 70) == 4 * (130 * 70 + 4 * 2)
    cfg = SHAPES["tiny"][0]()
    cases = {name: (nbytes, fn) for name, nbytes, fn in op_cases(cfg, get_backend("numpy"), 16, 2,
                                                                 np.random.default_rng(0))}
    gemvs = ["mtp_input", "linear_qkv", "linear_o", "moe_router", "moe_experts", "swiglu_shared", "lm_head_argmax"]
    assert {f"{g}_fp8" for g in gemvs} <= set(cases)
    for g in gemvs:
        assert cases[f"{g}_fp8"][0] < cases[g][0]                      # half the weight bytes, or less
    for _, fn in cases.values():
        fn()


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_op_cases_time_the_swiglus_in_every_format(backend):
    """The routed experts and the shared MLP have a twin on the same weights in each format a
    release is published in: ``_fp4`` (MXFP4: half a byte per weight plus one per 32-weight E8M0
    scale), ``_nvfp4`` (one E4M3 scale per 16 and an FP32 global scale a row) and ``_mxfp8``
    (a byte a weight, a scale per 32), each counted below the BF16 bytes, and each runs and
    computes what the same weights dequantized compute."""
    from mtpkern.backends import get_backend
    from mtpkern.bench import MXFP8_BLOCK, SHAPES, fp4_bytes, fp8_bytes, op_cases

    assert fp4_bytes(300, 1000) == 300 * 500 + 300 * 32
    assert fp4_bytes(4, 130, 70) == 4 * (130 * 35 + 130 * 3)
    assert fp4_bytes(300, 1000, fmt="nvfp4") == 300 * 500 + 300 * 63 + 4 * 300
    assert fp8_bytes(300, 1000, block=MXFP8_BLOCK) == 300 * 1000 + 4 * 300 * 32
    cfg = SHAPES["tiny"][0]()
    be = get_backend(backend)
    cases = {name: (nbytes, fn) for name, nbytes, fn in op_cases(cfg, be, 16, 2, np.random.default_rng(0))}
    for g in ("moe_experts", "swiglu_shared"):
        assert cases[f"{g}_fp4"][0] < cases[f"{g}_nvfp4"][0] < cases[f"{g}_fp8"][0] < cases[g][0]
        assert cases[f"{g}_fp8"][0] < cases[f"{g}_mxfp8"][0] < cases[g][0]
        x = np.asarray(be.to_host(cases[f"{g}_fp4"][1].args[0]))          # the residual each adds
        ref = np.asarray(be.to_host(cases[g][1]())) - x                      # BF16 weights
        for fmt, tol in (("fp4", 0.4), ("nvfp4", 0.4), ("mxfp8", 0.1)):    # the formats' rounding
            got = np.asarray(be.to_host(cases[f"{g}_{fmt}"][1]())) - x
            err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
            assert err < tol, f"{g}_{fmt}: relative error {err:.3f} against the BF16 weights"


@pytest.mark.parametrize("shapes", ["tiny", "mla"])
def test_op_cases_attend_over_written_kv(shapes):
    """The attention cases read a pool whose rows were written: a never-written host pool is
    the kernel's zero page, which reads from the cache (and gives a zero output)."""
    from mtpkern.backends import get_backend
    from mtpkern.bench import SHAPES, op_cases, written

    a = written(np.zeros((4, 16, 2, 8), np.float32), np.random.default_rng(0))
    assert (a != 0).mean() > 0.99
    cfg = SHAPES[shapes][0]()
    be = get_backend("numpy")
    cases = {name: fn for name, _, fn in op_cases(cfg, be, 40, 2, np.random.default_rng(0))}
    att = [name for name in cases if "attention_ctx40" in name]
    assert att
    for name in att:
        assert np.abs(be.to_host(cases[name]())).max() > 0, name


def test_propose_bytes_read_each_modules_block_and_cap_windows():
    """Step-3.5-shaped: a window caps the KV a module reads; the gate rows count; a dense
    block reads its MLP."""
    from mtpkern.synthetic import CONFIGS

    cfg = CONFIGS["step35"]()
    b = cfg.block(0)
    H, V = cfg.hidden_size, cfg.vocab_size
    per = 2 * H * H + b.qkv_size * H + H * b.o_size + V * H + 3 * cfg.intermediate_size * H
    kv_row = b.num_key_value_heads * (b.head_dim + b.v_dim) * 2
    assert b.gate_size == 24 and b.sliding_window == 512
    assert propose_bytes(cfg, 1, 4096, 1, 2, "draft") == 2 * per + 512 * kv_row  # not 4096 rows
    assert propose_bytes(cfg, 3, 4096, 2, 2, "draft") == 3 * 2 * per + 2 * (512 + 1 + 1) * kv_row
    assert propose_bytes(cfg, 1, 100, 1, 2, "draft") == 2 * per + 100 * kv_row


def test_op_cases_of_a_dense_block_have_no_experts():
    from mtpkern.backends import get_backend
    from mtpkern.bench import op_cases
    from mtpkern.config import tiny_config

    cfg = tiny_config(n_routed_experts=0, num_experts_per_tok=0, n_shared_experts=0, n_group=1, topk_group=1,
                      intermediate_size=40)
    cases = op_cases(cfg, get_backend("numpy"), 32, 1, np.random.default_rng(0))
    names = [c[0] for c in cases]
    assert "swiglu_dense" in names and "swiglu_dense_fp8" in names and not any(n.startswith("moe_") for n in names)
    for name, nbytes, fn in cases:
        assert nbytes > 0
        fn()


def test_mla_shapes_read_latent_rows_and_kv_b_proj_and_time_the_mla_ops():
    """An MLA block's floor: q_a / q_b / kv_a_proj_with_mqa / kv_b_proj / o weights and one
    latent row of L + R values per token (not K and V per head); its op cases are the MLA
    ops (and run)."""
    from mtpkern.backends import get_backend
    from mtpkern.bench import op_cases
    from mtpkern.config import tiny_config
    from mtpkern.synthetic import CONFIGS

    cfg = CONFIGS["mla"]()
    b = cfg.block(0)
    H, V, Hq, L, R, P, Dv, Q = (cfg.hidden_size, cfg.vocab_size, 16, 512, 64, 128, 128, 384)
    assert (b.mla, b.num_attention_heads, b.kv_lora_rank, b.qk_rope_head_dim, b.q_lora_rank) == (True, Hq, L, R, Q)
    attn = Q * H + Hq * (P + R) * Q + (L + R) * H + Hq * (P + Dv) * L + H * Hq * Dv
    experts = min(cfg.n_routed_experts, cfg.num_experts_per_tok)
    mlp = cfg.n_routed_experts * H + experts * 3 * cfg.moe_intermediate_size * H + 3 * cfg.shared_intermediate_size * H
    per = 2 * (2 * H * H + V * H + attn + mlp)
    assert propose_bytes(cfg, 1, 4096, 1, 2, "draft") == per + 4096 * (L + R) * 2
    assert propose_bytes(cfg, 2, 4096, 1, 2, "draft") == 2 * per + (4096 + 1) * (L + R) * 2
    small = tiny_config(kv_lora_rank=40, q_lora_rank=0, qk_rope_head_dim=8, head_dim=20, v_head_dim=12,
                        num_key_value_heads=4, partial_rotary_factor=1.0, use_qk_norm=False, attention_bias=False)
    cases = op_cases(small, get_backend("numpy"), 24, 2, np.random.default_rng(0))
    names = [c[0] for c in cases]
    assert "mla_attention_ctx24" in names and "mla_latent_write" in names and "linear_kv_a_fp8" in names
    assert not any(n.startswith(("paged_attention", "qk_norm", "linear_q_a")) for n in names)
    for _, nbytes, fn in cases:
        assert nbytes > 0
        fn()


def test_bench_draft_vocab_rows_read_fewer_head_bytes(workdir, tmp_path):
    out = tmp_path / "b.json"
    assert main(TINY + ["--threads", "1", "--contexts", "8", "--no-ops", "--batches", "1", "--draft-vocab", "100",
                        "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["propose"]
    full = {r["kv_mode"]: r for r in rows if r["k"] == 3 and not r["conf"] and r["draft_vocab"] is None}
    sub = {r["kv_mode"]: r for r in rows if r["draft_vocab"] == 100}
    assert set(sub) == {"draft+vocab100", "exact+vocab100"}
    for mode in ("draft", "exact"):               # the heads read 100 of 301 rows: 201 x 64 x 2 bytes each
        assert full[mode]["bytes"] - sub[mode + "+vocab100"]["bytes"] == 3 * 2 * 201 * 64
    assert main(TINY + ["--no-ops", "--draft-vocab", "302"]) == 2          # one line: expected 1 .. 301


def test_propose_fmas_counts_each_row_once():
    """The compute roofline's multiply-adds: one dense module (k = 1) by hand; exact mode's
    modules write min(m, k) + 1 rows a sequence (more than draft mode's one), and the count
    scales with the batch."""
    from mtpkern.config import tiny_config

    cfg = tiny_config(n_routed_experts=0, intermediate_size=48, num_nextn_predict_layers=1)
    b, H, V, ctx = cfg.block(0), cfg.hidden_size, cfg.vocab_size, 100
    row = 2 * H * H + b.qkv_size * H + H * b.o_size + ctx * b.num_attention_heads * (b.head_dim + b.v_dim) \
        + 3 * 48 * H
    assert propose_fmas(cfg, 1, ctx, 1, "draft") == row + V * H
    assert propose_fmas(cfg, 1, ctx, 3, "exact") == 3 * (row + V * H)
    moe = tiny_config()
    for mode in ("exact", "draft"):
        assert propose_fmas(moe, 3, 64, 8, mode) == 8 * propose_fmas(moe, 3, 64, 1, mode)
    assert propose_fmas(moe, 3, 64, 1, "exact") > propose_fmas(moe, 3, 64, 1, "draft")


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_fp8_kv_rows_count_one_byte_a_value_and_the_scales(backend):
    """``--fp8-kv``: the KV write and the attention on an FP8-KV twin of the backend, beside its
    own rows; their floors count one byte a value and 4 bytes a row and KV head (K and V), the
    twin's own rows the same on an FP8 backend, and the outputs are finite (written codes)."""
    from mtpkern.backends import get_backend
    from mtpkern.bench import SHAPES, kv_twin, op_cases

    cfg = SHAPES["tiny"][0]()
    be = get_backend(backend)
    be8 = kv_twin(be, "fp8")
    assert be8.kv_fp8 and be8.name == be.name and not be.kv_fp8
    n, ctx, Hq, Hkv, D = 2, 40, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    rows = {name: (nbytes, fn) for name, nbytes, fn in op_cases(cfg, be, ctx, n, np.random.default_rng(0), be8)}
    assert rows[f"paged_attention_ctx{ctx}"][0] == 2 * n * ctx * Hkv * D * 4 + 2 * n * Hq * D * 4
    assert rows[f"paged_attention_ctx{ctx}_fp8kv"][0] == 2 * n * ctx * Hkv * (D + 4) + 2 * n * Hq * D * 4
    assert rows["qk_norm_rope_kv_write_fp8kv"][0] == n * ((Hq + 2 * Hkv) * D + Hq * D) * 4 + 2 * n * Hkv * (D + 4)
    for name in ("qk_norm_rope_kv_write_fp8kv", f"paged_attention_ctx{ctx}_fp8kv"):
        assert np.isfinite(be.to_host(rows[name][1]())).all(), name
    own = {name: nbytes for name, nbytes, _ in op_cases(cfg, be8, ctx, n, np.random.default_rng(0))}
    assert own[f"paged_attention_ctx{ctx}"] == rows[f"paged_attention_ctx{ctx}_fp8kv"][0]


def test_propose_parts_count_fp8_scales():
    cfg = small_config()
    b = cfg.block(0)
    plain = dict((p[0], p[1]) for p in propose_parts(cfg, 1, 1000, 2, 1, "draft"))
    fp8 = dict((p[0], p[1]) for p in propose_parts(cfg, 1, 1000, 2, 1, "draft", kv_scale_bytes=4))
    assert fp8["m0 attn"] - plain["m0 attn"] == 2 * 1000 * 2 * b.num_key_value_heads * 4
    assert fp8["m0 proj"] == plain["m0 proj"]
