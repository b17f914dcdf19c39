"""The host side of benchmarks/gpu_bench.py, without a GPU: its shortcut to a long
context (``fake_context``) leaves a state the proposer accepts, eager and planned,
its byte counts and report behave, and its rows are on disk as soon as they are
measured (a run killed midway keeps them; SIGTERM also writes the end record)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest

from mtpkern import MultiModuleMtpHead
from mtpkern.cuda_graph import StepRunner

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_bench.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("gpu_bench", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("mode", ["exact", "draft"])
def test_fake_context_is_a_valid_state(bench, tiny_ckpt, tiny_cfg, mode):
    prop = MultiModuleMtpHead.from_pretrained(tiny_ckpt, backend="numpy", kv_mode=mode, block_size=16,
                                              num_blocks=64)
    prop.step_runner = StepRunner(prop, capture=False)
    rng = np.random.default_rng(0)
    sts = [prop.alloc_state() for _ in range(2)]
    for st in sts:
        bench.fake_context(prop, st, 100, rng)
    prop.check_invariants()
    pos = [100, 100]
    for k in (1, 2, 3):
        d = prop.propose_batch([1, 2], rng.standard_normal((2, 64)).astype(np.float32), pos, k, sts)
        assert [len(x) for x in d] == [k, k]
        for st in sts:
            prop.after_verify(0, st)
        pos = [p + 1 for p in pos]
        prop.check_invariants()
    assert prop.step_runner.counts["executed"] == 3          # every propose took the planned step


def test_floor_bytes_and_report(bench):
    cfg = bench.glm45_air()
    assert cfg.hidden_size == 4096 and cfg.vocab_size == 151552 and cfg.num_modules == 3
    b = [bench.propose_floor_bytes(cfg, "exact", k, 1, 512, 2) for k in (1, 2, 3)]
    assert b[0] < b[1] < b[2]
    # k = 1, batch 1: 3 modules' dense weights + one LM head (1.24 GB) at least
    assert b[0] > 151552 * 4096 * 2
    assert bench.propose_floor_bytes(cfg, "draft", 1, 8, 8192, 2) < bench.propose_floor_bytes(cfg, "exact", 1, 8, 8192, 2)
    res = {"device": "X", "config": "c", "copy_GB/s": 4000.0, "elapsed_s": 1.0,
           "kernels": [{"op": "rmsnorm", "rows": 1, "context": 0, "bytes": 1e6, "median_us": 2.0, "p20_us": 1.9,
                        "p80_us": 2.1, "GB/s": 500.0, "of_copy": 0.125, "timed": "graph"}],
           "propose": [{"kv_mode": "exact", "context": 512, "batch": 1, "k": 1, "eager_median_us": 900.0,
                        "graph_median_us": 450.0, "graph_speedup": 2.0, "floor_us": 300.0, "graph_x_floor": 1.5}]}
    text = bench.summary(res)
    assert "| rmsnorm | 1 |" in text and "2.00x" in text
    assert "| 1.50 |  |  |" in text and "| graph |  |  |" in text     # no peer: the torch columns stay empty
    res["kernels"][0].update(torch_median_us=5.0, speedup_vs_torch=2.5)
    assert "| 12% | graph | 5.0 | 2.50x |" in bench.summary(res)
    res["propose"][0].update(torch_median_us=1800.0, speedup_vs_torch=4.0)
    assert "| 1.50 | 1800 | 4.00x |" in bench.summary(res)


def test_the_deepseek_v3_section_has_the_released_shapes(bench):
    cfg = bench.deepseek_v3()
    b = cfg.block(0)
    assert (cfg.hidden_size, b.num_attention_heads, b.kv_lora_rank, b.qk_rope_head_dim, b.q_lora_rank) == \
        (7168, 128, 512, 64, 1536)
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.vocab_size) == \
        (256, 8, 2048, 129280)
    assert b.mla and b.qk_nope_head_dim == 128 and b.v_dim == 128 and cfg.family == "deepseek_v3"
    text = bench.summary({"kernels": [], "mla_config": cfg.describe(), "mla_skipped": "time budget"})
    assert "DeepSeek-V3 rows (`dsv3 ...`)" in text and "mla_skipped: time budget" in text


def _kernel_row(i: int) -> dict:
    return {"op": f"op{i}", "rows": 1, "context": 0, "bytes": 1e6 * (i + 1), "median_us": 10.0 + i, "p20_us": 9.0,
            "p80_us": 11.0 + i, "runs": 20, "GB/s": 100.0, "of_copy": 0.025, "timed": "graph"}


_PROPOSE = {"kv_mode": "draft", "context": 512, "batch": 8, "k": 3, "eager_median_us": 900.0,
            "graph_median_us": 600.0, "graph_speedup": 1.5, "floor_us": 400.0, "graph_x_floor": 1.5,
            "torch_median_us": 3000.0, "speedup_vs_torch": 5.0}


def test_recorder_writes_each_row_as_it_is_measured(bench, tmp_path):
    """Each record is on disk (both files) before the next is made; a table's header comes
    with its first row; at the end the markdown is the summary of what was recorded."""
    rec = bench.Recorder(tmp_path)
    rec.meta(device="H200 (L2 60 MiB)", config="cfg", **{"copy_GB/s": 4000.0})
    md = tmp_path / "gpu_bench.md"
    jl = tmp_path / "gpu_bench.jsonl"
    assert md.read_text() == "" and json.loads(jl.read_text())["kind"] == "meta"
    rows = [("kernel", _kernel_row(0)), ("kernel", _kernel_row(1)),
            ("kernel", {**_kernel_row(2), "op": "dsv3 linear_o"}), ("propose", _PROPOSE)]
    for i, (kind, row) in enumerate(rows):
        rec.row(kind, row)
        lines = [json.loads(x) for x in jl.read_text().splitlines()]
        assert [x["kind"] for x in lines] == ["meta"] + [k for k, _ in rows[:i + 1]]
        assert md.read_text().count("\n| ") == i + 1 + {0: 1, 1: 1, 2: 2, 3: 3}[i]   # rows + table headers
    assert "## DeepSeek-V3's MTP module" in md.read_text() and "| 600 | 1.50x | 400 | 1.50 | 3000 | 5.00x |" \
        in md.read_text()
    rec.note("torch", "torch X eager on cuda:0")
    rec.note("graph_counts_draft", {"captured": np.int64(3), "shape": np.array([1, 8])})    # NumPy values too
    rec.error("kernel op9 rows 8: RuntimeError: boom")
    rec.close(0)
    assert md.read_text() == bench.summary(rec.res)
    text = md.read_text()
    assert "torch: torch X eager on cuda:0" in text and "error: kernel op9 rows 8: RuntimeError: boom" in text
    records = [json.loads(x) for x in jl.read_text().splitlines()]
    assert {"kind": "note", "key": "graph_counts_draft", "value": {"captured": 3, "shape": [1, 8]}} == \
        {k: v for k, v in records[-3].items() if k != "t_s"}
    end = records[-1]
    assert end["kind"] == "end" and end["rc"] == 0 and end["stopped"] is None
    with pytest.raises(ValueError, match="kind: expected 'kernel' or 'propose'"):
        bench.Recorder(tmp_path / "again").row("ops", {})


_WRITER = """
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("gpu_bench", sys.argv[1])
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
rec = bench.Recorder(__import__("pathlib").Path(sys.argv[2]))
rec.meta(device="D", config="C", **{"copy_GB/s": 1000.0})
for i in range(10 ** 6):
    rec.row("kernel", {"op": f"op{i}", "rows": 1, "context": 0, "bytes": 1e6, "median_us": 1.0, "p20_us": 1.0,
                       "p80_us": 1.0, "runs": 1, "GB/s": 1.0, "of_copy": 0.001, "timed": "graph"})
    print(i, flush=True)
    time.sleep(0.05)
"""


def test_rows_survive_a_kill_midway(tmp_path):
    """SIGKILL (no handler, no finally) after a few rows: every row the writer reported
    is in both files, and each JSON line is whole."""
    p = subprocess.Popen([sys.executable, "-c", _WRITER, str(_PATH), str(tmp_path)], stdout=subprocess.PIPE,
                         text=True)
    try:
        done = [p.stdout.readline() for _ in range(4)]
    finally:
        p.kill()
        p.wait(timeout=30)
    assert [int(x) for x in done] == [0, 1, 2, 3]
    lines = [json.loads(x) for x in (tmp_path / "gpu_bench.jsonl").read_text().splitlines()]
    kernels = [x["op"] for x in lines if x["kind"] == "kernel"]
    assert kernels[:4] == ["op0", "op1", "op2", "op3"] and "end" not in {x["kind"] for x in lines}
    md = (tmp_path / "gpu_bench.md").read_text()
    assert all(f"| op{i} | 1 |" in md for i in range(4))


def test_sigterm_ends_the_run_with_its_end_record(bench, tmp_path, monkeypatch, capsys):
    """The check script's time limit sends SIGTERM: main returns 143 through its finally,
    writing the end record (stopped: SIGTERM) and the markdown's notes."""
    monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))

    def terminated():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
        raise AssertionError("SIGTERM did not stop the run")

    monkeypatch.setattr(bench, "Gpu", terminated)
    before = signal.getsignal(signal.SIGTERM)
    assert bench.main(["--out", str(tmp_path), "--no-torch"]) == 143
    assert signal.getsignal(signal.SIGTERM) == before             # the handler is put back
    end = json.loads((tmp_path / "gpu_bench.jsonl").read_text().splitlines()[-1])
    assert end["kind"] == "end" and end["stopped"] == "SIGTERM" and end["rc"] == 143
    assert "stopped by SIGTERM" in (tmp_path / "gpu_bench.md").read_text()
    assert "stopped by SIGTERM" in capsys.readouterr().out


def test_the_torch_peers_run_on_the_benchmarks_weights(bench, tiny_ckpt, tiny_cfg, tmp_path):
    """The GPU benchmark's PyTorch paths on CPU torch (device="cpu"): the propose peer and the
    kernel peers take the backend's BF16 bits as they are (the cpu backend holds them as
    uint16, as CuPy does), the flush hook runs before every step, and the kernel peers
    compute their op (the LM head's argmax, SDPA's output shape) on the same weights."""
    torch = pytest.importorskip("torch")
    from mtpkern.backends import get_backend
    from mtpkern.weights import load_weights

    weights = load_weights(tiny_ckpt, tiny_cfg, get_backend("cpu"))
    flushes = []
    gpu = types.SimpleNamespace(flush=lambda: flushes.append(1))
    rec = bench.Recorder(tmp_path)
    time_step = bench.torch_peer(tiny_cfg, weights, gpu, rec, device="cpu")
    assert time_step is not None and rec.res["torch"].startswith(f"torch {torch.__version__} eager on cpu")
    t = time_step(3, 2, 1, 2, 33)
    assert t.runs == 2 and t.median_us > 0 and len(flushes) == 3
    w = weights.modules[0]
    peers = bench.torch_kernel_peers(tiny_cfg, w, 3, [17, 40], device="cpu")
    assert set(peers) == {("rmsnorm", 0), ("linear_qkv", 0), ("linear_o", 0), ("swiglu_shared", 0),
                          ("lm_head_argmax", 0), ("paged_attention", 17), ("paged_attention", 40)}
    H, Hq, D = tiny_cfg.hidden_size, tiny_cfg.num_attention_heads, tiny_cfg.head_dim
    assert peers["paged_attention", 40]().shape == (3, Hq, 1, D)
    assert peers["linear_qkv", 0]().shape == (3, w.w_qkv.shape[0]) and peers["swiglu_shared", 0]().shape == (3, H)
    ids = peers["lm_head_argmax", 0]()
    assert ids.shape == (3,) and int(ids.max()) < tiny_cfg.vocab_size
    rec.close(0)
    assert "torch: torch" in (tmp_path / "gpu_bench.md").read_text()


def test_a_torch_peer_that_cannot_start_is_a_note(bench, tiny_cfg, tmp_path):
    rec = bench.Recorder(tmp_path)
    assert bench.torch_peer(tiny_cfg, None, types.SimpleNamespace(flush=lambda: None), rec, device="metal") is None
    assert rec.res["torch"].startswith("not run (")


def _calls_on(tree, names: set[str]):
    """(object name, attribute, call node) of every ``name.attr(...)`` call in ``tree``."""
    import ast

    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id in names):
            yield node.func.value.id, node.func.attr, node


def test_the_benchmarks_calls_into_the_package_still_bind():
    """Every call gpu_bench.py makes on a launcher module or on the backend names something that
    exists and binds to its signature (positional count, keyword names). The kernel section runs
    only on a GPU, so without this a renamed launcher constant or argument surfaces first on the
    device machine, as lm_head's ROWS_PER_BLOCK once did."""
    import ast
    import inspect

    from mtpkern.backends.cuda import CudaBackend
    from mtpkern.backends.cuda_launch import attention, dsa, gemm_tc, lm_head, mla

    owners = {"attn_launch": attention, "lm_launch": lm_head, "mla_launch": mla, "tc_launch": gemm_tc,
              "dsa_launch": dsa, "be": CudaBackend}
    tree = ast.parse(_PATH.read_text())
    seen = 0
    for owner, attr, call in _calls_on(tree, set(owners)):
        target = getattr(owners[owner], attr, None)
        assert target is not None, f"gpu_bench.py line {call.lineno}: {owner}.{attr} does not exist"
        if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
            continue
        sig = inspect.signature(target)
        args = ([None] if owner == "be" else []) + [None] * len(call.args)    # self for the backend's methods
        try:
            sig.bind(*args, **{k.arg: None for k in call.keywords})
        except TypeError as e:
            raise AssertionError(f"gpu_bench.py line {call.lineno}: {owner}.{attr}{sig}: {e}") from None
        seen += 1
    for node in ast.walk(tree):       # plain attribute reads (constants) on the launcher modules
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in owners and node.value.id != "be"):
            assert hasattr(owners[node.value.id], node.attr), (
                f"gpu_bench.py line {node.lineno}: {node.value.id}.{node.attr} does not exist")
    assert seen >= 15, f"only {seen} calls checked: the names the benchmark imports the launchers under changed?"


def test_the_ceilings_read_kernel_compiles(bench):
    """The streaming-read kernel of the bandwidth ceiling builds with NVRTC for sm_90 (every
    toolkit installed here), without spills: it runs first on a device, before any row."""
    from mtpkern import nvrtc_check as nc

    toolkits, missing = nc.find_toolkits()
    if not toolkits:
        pytest.skip(f"no CUDA toolkit: {'; '.join(missing.values())}")
    for tk in toolkits.values():
        ok, log, _ = nc._nvrtc(tk).compile(bench.READ_KERNEL, "read.cu", ("-arch=sm_90", "-Xptxas=-v"), ())
        assert ok, log
        info = nc.parse_ptxas_log(log)["read_stream_kernel"]
        assert info.spill_stores == info.spill_loads == 0 and info.registers <= 64, info


def test_the_attention_probe_uses_what_the_benchmark_has(bench):
    """scripts/gpu_attention_probe.py takes its shapes, KV fill and block tables from the
    benchmark module (``bench.X``): each name it reads exists there."""
    import ast

    tree = ast.parse((_PATH.parents[1] / "scripts" / "gpu_attention_probe.py").read_text())
    used = {n.attr for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "bench"}
    assert used >= {"glm45_air", "decode_tables", "bf16_uniform"}, used
    assert all(hasattr(bench, a) for a in used), used - {a for a in used if hasattr(bench, a)}


def test_the_sample_rows_launch_on_the_emulator(bench):
    """The ``sample`` rows' launches (the kernel called directly, not through its launcher) pass
    the emulator's argument check and draw the launcher's drafts: a wrong argument list would
    otherwise surface first on the device machine."""
    from cuda_emu import emu_backend

    from mtpkern.backends.cuda_launch import lm_head as lm_launch
    from mtpkern.ops.sampling import SamplingParams, row_keys

    try:
        lib = emu_backend.build()
    except emu_backend.EmulatorUnavailable as e:
        pytest.skip(f"CUDA emulator unavailable: {e}")
    with emu_backend.Emulator(lib).installed() as em:
        cases = bench.sample_cases(3, vocabs=(257,), xp=np)
        assert [c[0] for c in cases] == [f"sample {c[0]} V=257" for c in bench.SAMPLE_CASES]
        for (_, _, nbytes, fn), (_, T, k, p) in zip(cases, bench.SAMPLE_CASES):
            assert nbytes == 3 * 257 * 4
            fn()
            logits, ids, probs = fn.__defaults__[0][0], fn.__defaults__[0][8], fn.__defaults__[0][9]
            ps = [SamplingParams(T, k, p, seed=i) for i in range(3)]
            want = lm_launch.masked_sample(logits, keys=row_keys(ps, [0, 1, 2], 0), temperature=np.full(3, T),
                                           top_k=np.full(3, k, np.int32), top_p=np.full(3, p))
            np.testing.assert_array_equal(ids, want[0])
            np.testing.assert_array_equal(probs, want[1])
        assert em.launches["sample_kernel"] == 2 * len(cases)


def test_the_fused_sample_rows_launch_on_the_emulator(bench):
    """The ``lm_head fused sample`` rows (and their argmax peers) run on the emulator through the
    fused kernels and draw the reference's drafts from the same head."""
    import ml_dtypes
    from cuda_emu import emu_backend

    from mtpkern.ops import sampling
    from mtpkern.ops.lm_head import lm_head_argmax

    try:
        lib = emu_backend.build()
    except emu_backend.EmulatorUnavailable as e:
        pytest.skip(f"CUDA emulator unavailable: {e}")
    n, V, H = 3, 257, 40
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((V, H)) * 0.3).astype(ml_dtypes.bfloat16)
    with emu_backend.Emulator(lib).installed() as em:
        cases = bench.fused_sample_cases(n, H, vocabs=(V,), xp=np, head=lambda V, H: w.view(np.uint16))
        assert [c[0] for c in cases] == [f"lm_head fused sample T V={V}", f"lm_head argmax V={V}",
                                         f"lm_head fused sample top_k 50 top_p 0.95 V={V}"]
        assert cases[0][2] == V * H * 2 + n * H * 4 + n * 8
        (ids, probs), greedy = cases[0][3](), cases[1][3]()
        x = cases[0][3].__defaults__[0]
        ps = [sampling.SamplingParams(0.8, 0, 1.0, seed=i) for i in range(n)]
        wf = w.astype(np.float32)
        want = sampling.lm_head_sample(x, wf, None, sampling.row_keys(ps, list(range(n)), 0), np.full(n, 0.8),
                                       np.zeros(n, np.int32), np.ones(n))
        np.testing.assert_array_equal(ids, want[0])
        np.testing.assert_allclose(probs, want[1], rtol=1e-5)
        np.testing.assert_array_equal(greedy, lm_head_argmax(x, wf))
        keys = sampling.row_keys(ps, list(range(n)), 0)
        want_k = sampling.lm_head_sample(x, wf, None, keys, np.full(n, 0.8), np.full(n, 50, np.int32),
                                         np.full(n, 0.95))
        np.testing.assert_array_equal(cases[2][3]()[0], want_k[0])
        assert em.launches["topk_sample_final_kernel"] == 1
        assert em.launches["sample_final_kernel"] == 1
        assert not [k for k, c in em.launches.items() if c and k.startswith(("linear_kernel", "sample_kernel"))]
