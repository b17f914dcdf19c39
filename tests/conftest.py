"""Shared fixtures: a tiny synthetic checkpoint and proposer factories."""

from __future__ import annotations

import os
from collections import Counter

import numpy as np
import pytest
from hypothesis import Phase, settings

from mtpkern import MultiModuleMtpHead, write_synthetic_checkpoint
from mtpkern.backends import cuda_available, get_backend
from mtpkern.config import tiny_config
from mtpkern.weights import load_weights

BACKENDS = ["numpy", "cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


#: ``pytest --hypothesis-profile=device`` (scripts/gpu_check.sh): a failing example is reported
#: as found, not shrunk first. On a lent device the shrinking of one failure (each try a
#: proposer run) outlasted the whole tests step, and the failure was never printed.
settings.register_profile("device", phases=[Phase.explicit, Phase.reuse, Phase.generate], print_blob=True)

#: ``MTPKERN_PRINT_FAILURES=1``: each failure's report is written as soon as its test ends
#: (pytest prints them at the end of the session, which a run cut short at its time limit
#: never reaches)
_PRINT_FAILURES = os.environ.get("MTPKERN_PRINT_FAILURES", "0") not in ("", "0")


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report):
    if _PRINT_FAILURES and report.failed and _CONFIG:
        tr = _CONFIG[0].pluginmanager.getplugin("terminalreporter")
        if tr is not None:
            tr.write_line("")
            tr.write_sep("-", f"failure of {report.nodeid} ({report.when}), printed as it happened")
            tr.write_line(report.longreprtext[-6000:])


_CONFIG: list = []


def pytest_configure(config):
    _CONFIG[:] = [config]


#: Sweeps of which the default run keeps a few cases, the rest marked slow and sweep (the
#: default run stays near 8 min on 2 cores; .ci/run runs ``-m sweep`` after it, so CI still
#: runs every case it ran before; ``-m slow`` runs these and the older long runs).
#: test -> the parameter ids kept in the default run (an empty tuple: the whole test is slow).
#: Chosen from ``pytest --durations=0`` (2 idle cores, 2026-12-05): together ~350 s.
SLOW_SWEEPS: dict[str, tuple[str, ...]] = {
    # NVRTC compiles every kernel for sm_80 and sm_90 under both toolkits: ~170 s
    "test_cuda_compile.py::test_every_instantiation_compiles": (),
    "test_cuda_compile.py::test_no_register_spills": (),
    "test_cuda_compile.py::test_registers_match_recorded": (),
    # the emulated kernels over many rows: the FP32-cache pair keeps the row loop covered
    "test_cuda_emulated.py::test_many_rows": ("kv_float32-float32", "kv_float32-fp8_block"),
    # one state machine per mode and checkpoint kind (numpy / cpu both kept)
    "test_state_machine.py::test_proposer_state_machine": ("cpu-exact-sm_ckpt", "cpu-draft-window_ckpt",
                                                           "numpy-draft-qwen_ckpt", "cpu-draft-dsa_ckpt",
                                                           "numpy-draft-hc_ckpt"),
    # every block in draft mode, and the two mixed ones in exact mode
    "test_cuda_emulated.py::test_blocks_match_numpy_reference_and_replay": (
        "draft-", "exact-mixed", "exact-mla_mixed"),
    "test_cuda_emulated.py::test_windows_release_blocks_on_the_kernels": ("draft",),
    "test_cuda_emulated.py::test_nope_mla_with_dsa_matches_numpy_reference": ("exact-mla_nope_dsa", "draft-"),
    "test_cuda_emulated.py::test_proposer_matches_numpy_reference": ("tiny-",),
    "test_cuda_emulated.py::test_step3p5_matches_numpy_reference_and_replays": ("draft",),
    "test_cuda_emulated.py::test_mimo_v2_flash_on_the_kernels": ("bf16",),
    # attention sweeps on the emulator: every FP32-cache shape, one BF16 shape
    "test_cuda_emulated.py::test_paged_attention_rows_of_one_sequence": (
        "kv_float32", "kv_bfloat16-16-2-48-200-8-interleaved"),
    "test_cuda_emulated.py::test_attention_window_sinks_shapes": ("kv_float32", "kv_bfloat16-132-24-4-128-64-7-33"),
    "test_window_memory.py::test_long_run_holds_the_window_not_the_sequence": (
        "windowed-exact-cpu", "windowed_mla-exact-cpu", "windowed-draft", "windowed_mla-draft"),
    # the newest families' and containers' captured steps on the emulator: exact mode in the default run
    "test_cuda_graph_fake.py::test_container_planned_on_the_kernels": ("exact",),
    "test_cuda_graph_fake.py::test_qwen3_5_planned_on_the_kernels": ("exact",),
    # the value tiles' 144 shapes: the 48 with no leading offset
    "test_cpu_simd.py::test_value_tiles_match_float64": ("0-",),
}


def _slow_sweep(item) -> bool:
    name = item.nodeid.split("/")[-1]
    base, _, params = name.partition("[")
    keep = SLOW_SWEEPS.get(base)
    if keep is None:
        return False
    return not any(params.startswith(k) for k in keep)


@pytest.hookimpl(tryfirst=True)                 # before -m "not slow" deselects
def pytest_collection_modifyitems(config, items):
    for item in items:
        if _slow_sweep(item) and item.get_closest_marker("slow") is None:    # a long run stays one
            item.add_marker(pytest.mark.slow)
            item.add_marker(pytest.mark.sweep)
    if cuda_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    """One line per skip reason, with its count (pytest's ``-rs`` gives one per test
    location: two dozen lines for the same few reasons), and the deselected slow tests."""
    reasons: Counter[str] = Counter()
    for rep in terminalreporter.stats.get("skipped", []):
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        reasons[reason.removeprefix("Skipped: ")] += 1
    deselected = len(terminalreporter.stats.get("deselected", []))
    if not (reasons or deselected):
        return
    terminalreporter.write_sep("-", "skipped and deselected tests, by reason")
    for reason, n in sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0])):
        terminalreporter.write_line(f"{n:5d} skipped: {reason}")
    if deselected:
        terminalreporter.write_line(f"{deselected:5d} deselected: by -m / -k (the default, -m 'not slow', "
                                    f"leaves out the slow tests; pytest -m slow runs them)")


@pytest.fixture(scope="session")
def tiny_cfg():
    return tiny_config()


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory, tiny_cfg):
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("tiny"), tiny_cfg, seed=7)


#: a small DeepSeek-V3-style MLA config (mtpkern/block.py): q_lora_rank, interleaved RoPE,
#: YaRN past a 12-position original context; odd sizes (L 40, P 12, R 8, Dv 12)
MLA_FIELDS = dict(kv_lora_rank=40, q_lora_rank=24, qk_rope_head_dim=8, head_dim=20, v_head_dim=12,
                  num_key_value_heads=4, partial_rotary_factor=1.0, use_qk_norm=False, attention_bias=False,
                  rope_interleave=True, rope_scaling={"factor": 4.0, "original_max_position_embeddings": 12,
                                                      "mscale": 1.0, "mscale_all_dim": 0.8})


@pytest.fixture(scope="session")
def mla_cfg():
    return tiny_config(**MLA_FIELDS)


@pytest.fixture(scope="session")
def mla_ckpt(tmp_path_factory, mla_cfg):
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("mla"), mla_cfg, seed=7)


#: an MLA block with DSA's indexer: 4 keys of 2 heads x 16 (sparse past 4 keys at test sizes)
DSA_FIELDS = dict(MLA_FIELDS, index_topk=4, index_n_heads=2, index_head_dim=16)


@pytest.fixture(scope="session")
def dsa_cfg():
    return tiny_config(**DSA_FIELDS)


@pytest.fixture(scope="session")
def dsa_ckpt(tmp_path_factory, dsa_cfg):
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("dsa"), dsa_cfg, seed=8)


@pytest.fixture(scope="session")
def hc_cfg():
    """The tiny config with hyper-connections: 4 streams of H (DeepSeek-V4's mHC)."""
    return tiny_config(hc_mult=4)


@pytest.fixture(scope="session")
def hc_ckpt(tmp_path_factory, hc_cfg):
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("hc"), hc_cfg, seed=9)


@pytest.fixture(scope="session")
def tiny_ckpt_dense(tmp_path_factory):
    cfg = tiny_config(n_routed_experts=0, intermediate_size=48, attention_bias=False, use_qk_norm=False,
                      partial_rotary_factor=1.0, num_nextn_predict_layers=2)
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("dense"), cfg, seed=3, dtype="float32")


@pytest.fixture(scope="session")
def ref_weights(tiny_ckpt, tiny_cfg):
    """Host FP32 weights of the tiny checkpoint, for the oracle."""
    return load_weights(tiny_ckpt, tiny_cfg, get_backend("numpy"), apply_target_norm=True)


@pytest.fixture
def make_prop(tiny_ckpt):
    def make(kv_mode="exact", backend="numpy", ckpt=None, **kw):
        kw.setdefault("block_size", 4)
        kw.setdefault("num_blocks", 96)
        return MultiModuleMtpHead.from_pretrained(ckpt or tiny_ckpt, backend=backend, kv_mode=kv_mode, **kw)
    return make


def rand_hiddens(rng, n, H):
    return rng.standard_normal((n, H)).astype(np.float32)


def record_margins(prop) -> dict:
    """Wrap each module's argmax on ``prop`` (the reference): ``log[module] = (margin, |top|)``,
    per row of its latest call, the gap between the two best logits among the tokens its
    grammar mask allows (inf where fewer than two are allowed) and the best one's magnitude."""
    log: dict = {}
    for h in prop.modules:
        def argmax(normed_rows, bitmask=None, h=h, orig=h.argmax):
            logits = np.array(h.logits(normed_rows), np.float64)
            if bitmask is not None:
                words = np.asarray(bitmask).reshape(len(logits), -1).view(np.uint32)
                bits = (words[:, :, None] >> np.arange(32, dtype=np.uint32)) & 1
                allowed = bits.reshape(len(logits), -1)[:, :logits.shape[1]].astype(bool)
                logits = np.where(allowed, logits, -np.inf)
            top = np.sort(logits, axis=1)[:, -2:]
            with np.errstate(invalid="ignore"):
                margin = np.where(np.isfinite(top[:, 0]), top[:, 1] - top[:, 0], np.inf)
            log[h.index] = (margin, np.abs(top[:, 1]))
            return orig(normed_rows, bitmask)
        h.argmax = argmax
    return log


def near_tie(margins: dict, m: int, i: int, tol: str) -> bool:
    """Whether module ``m``'s best two logits for row ``i`` (``record_margins``) are within the
    tolerance of ``tol`` (mtpkern.tolerance): a draft another backend may fairly flip."""
    from mtpkern.tolerance import TOLERANCE

    t = TOLERANCE[tol]
    margin, top = margins[m]
    return bool(margin[i] <= t.atol + t.rtol * top[i])


def kv_rows(prop, st, m):
    """Module m's K and V rows of ``st`` in row order, FP32 on the host: [rows, Hkv, D] each
    (MLA: the latent rows [rows, 1, L + R], with DSA the indexer key after them, and an empty V);
    a sliding-window module's from its first live block on (``base * block_size``: the
    rows before were released with their blocks)."""
    pool = prop.modules[m].pool
    seq = st.kv[m]
    be = prop.backend
    k = be.kv_to_host(pool.k, pool.k_scale)          # an FP8 pool's codes dequantized with their scales
    if pool.index_k is not None:  # DSA: each row's indexer key after its latent row
        k = np.concatenate([k, be.kv_to_host(pool.index_k)], axis=2)
    if pool.latent_width:        # MLA: the latent rows as [rows, 1, L + R], an empty V
        k = k[:, :, None, :]
    v = np.zeros(k.shape[:3] + (0,), np.float32) if pool.v is None else be.kv_to_host(pool.v, pool.v_scale)
    r = np.arange(seq.base * pool.block_size, seq.rows)
    blk = np.asarray(seq.blocks, np.int64)[r // pool.block_size - seq.base]
    return k[blk, r % pool.block_size], v[blk, r % pool.block_size]

def record_trace(prop, rng: np.random.Generator, prompt: int, rounds) -> list:
    """A prompt of ``prompt`` random tokens, then ``rounds`` of (k, share accepted) propose /
    verify / catch-up on ``prop``: after every call ("kv" or "propose") the tokens and target
    hiddens so far, the propose's drafts (None after a prefill or catch-up) and every module's
    KV rows (``[rows, width]`` each: the first KV head's). A reference model replays it."""
    M, H, V = prop.config.num_modules, prop.config.hidden_size, prop.config.vocab_size
    st = prop.alloc_state()
    kv = lambda: [kv_rows(prop, st, m)[0][:, 0] for m in range(M)]  # noqa: E731
    tokens = rng.integers(0, V, prompt).tolist()
    hid = rng.standard_normal((prompt, H)).astype(np.float32)
    prop.prefill_drafter(tokens, hid, st)
    hiddens, pending = list(hid[:-1]), hid[-1]
    trace = [("kv", list(tokens), list(hiddens), None, kv())]
    for k, frac in rounds:
        t_P = int(rng.integers(0, V))
        drafts = prop.propose(t_P, pending, len(tokens), k, st)
        tokens.append(t_P)
        hiddens.append(pending)
        trace.append(("propose", list(tokens), list(hiddens), list(drafts), kv()))
        a = int(round(frac * len(drafts)))
        prop.after_verify(a, st)
        acc = rng.standard_normal((a, H)).astype(np.float32)
        prop.catchup_drafter(drafts[:a], acc, st)
        tokens += drafts[:a]
        hiddens += list(acc)
        pending = rng.standard_normal(H).astype(np.float32)
        trace.append(("kv", list(tokens), list(hiddens), None, kv()))
    prop.free_state(st)
    return trace



def verify_tree_off_the_greedy_path(prop, a, b, rng, mode: str, same) -> np.ndarray:
    """Twins ``a`` and ``b`` at one position: ``b`` drafts a wide tree and is verified along a
    path off the greedy one (the last leaf's first two nodes), ``a`` proposes a chain forced
    along that path (a mask allowing only its tokens) and is verified alike; ``same(prop, a, b)``
    checks their KV then, and again after both catch up (exact mode). Returns the hidden of
    the proposes, for the caller's next one."""
    M, H, V, W = prop.num_modules, prop.config.hidden_size, prop.config.vocab_size, prop.config.bitmask_words
    P = a.next_position
    h, t = rng.standard_normal(H).astype(np.float32), int(rng.integers(0, V))
    tree = prop.propose_tree(t, h, P, b, widths=[3, 2, 2][:M])
    path = tree.path(tree.leaves()[-1])[:2]                  # the last leaf: off the rank-0 path
    toks = tree.path_tokens(path[-1])

    def force(i, drafts):
        if i >= len(toks):
            return None
        w = np.zeros(W, np.int32)
        w[toks[i] >> 5] = np.int32(np.uint32(1) << np.uint32(toks[i] & 31))
        return w

    d = prop.propose(t, h, P, M, a, grammar_bitmask=force)
    assert d[:len(toks)] == toks
    prop.after_verify(len(toks), a)
    prop.after_verify_tree(path, b)
    same(prop, a, b)
    if mode == "exact":
        hs = rng.standard_normal((len(toks), H)).astype(np.float32)
        prop.catchup_drafter(toks, hs, a)
        prop.catchup_drafter(toks, hs, b)
        same(prop, a, b)
    return h


def run_rounds(path, backend="numpy", mode="exact", seed=0, rounds=4, n=9, **kw):
    """A proposer on the checkpoint at ``path`` through a prefill of ``n`` tokens and
    ``rounds`` propose / verify / catch-up rounds with random accepts; returns
    ``(proposer, drafts of every propose)``."""
    kw.setdefault("block_size", 4)
    kw.setdefault("num_blocks", 64)
    prop = MultiModuleMtpHead.from_pretrained(path, backend=backend, kv_mode=mode, **kw)
    rng = np.random.default_rng(seed)
    H, V = prop.config.stream_size, prop.config.vocab_size      # (hyper-connections: the streams' width)
    st = prop.alloc_state()
    prop.prefill_drafter(rng.integers(0, V, n).tolist(), rand_hiddens(rng, n, H), st)
    out, P = [], n
    for _ in range(rounds):
        d = prop.propose(int(rng.integers(0, V)), rand_hiddens(rng, 1, H)[0], P, 3, st)
        a = int(rng.integers(0, len(d) + 1))
        prop.after_verify(a, st)
        prop.catchup_drafter(d[:a], rand_hiddens(rng, a, H), st)
        out.append(d)
        P += 1 + a
    return prop, out


def _version(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit())
        out.append(int(digits or 0))
    return tuple(out)


def _import_installed_kernels_package() -> None:
    """transformers (5.25) imports a dependency named ``kernels``; with the checkout's root on
    ``sys.path`` (``python -m pytest`` from there, or ``PYTHONPATH``) the checkout's own
    ``kernels/`` (mtpkern's CUDA sources, installed as ``mtpkern.kernels``) shadows it and
    importing transformers fails. Import the installed one first, with the root left out of
    ``sys.path`` for that import only (nothing when it is not installed)."""
    import importlib.util
    import sys
    from pathlib import Path

    if "kernels" in sys.modules:
        return
    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.find_spec("kernels")
    if spec is None or spec.origin is None or Path(spec.origin).resolve().parent != root / "kernels":
        return
    saved = sys.path[:]
    sys.path[:] = [p for p in saved if Path(p or ".").resolve() != root]
    try:
        importlib.import_module("kernels")
    except ImportError:
        pass
    finally:
        sys.path[:] = saved


def require_hf_mtp(minimum: tuple[int, int] = (5, 24)) -> None:
    """Skip the calling test module unless torch and transformers >= ``minimum`` (MTP
    generation, ``generate(use_mtp=True)``) are importable. Call it at module level,
    before importing ``hf_reference`` (which imports both). Neither is a dependency."""
    pytest.importorskip("torch")
    _import_installed_kernels_package()
    transformers = pytest.importorskip("transformers")
    if _version(transformers.__version__) < minimum:
        pytest.skip(f"needs transformers >= {'.'.join(map(str, minimum))} (generate(use_mtp=True)), found "
                    f"{transformers.__version__}", allow_module_level=True)


@pytest.fixture
def emulator(monkeypatch):
    """The CUDA emulator (tests/cuda_emu; skipped where it cannot be built), with CUDA graphs
    through tests/test_cuda_graph_fake.py's runtime (the planned step captures and replays):
    a family's proposer on the emulated kernels."""
    from cuda_emu import emu_backend
    from test_cuda_graph_fake import FakeRuntime

    from mtpkern import cuda_graph

    for emu in emu_backend.installed_emulator():
        rt = FakeRuntime()
        monkeypatch.setattr(cuda_graph, "_cupy", lambda: rt.cupy)
        monkeypatch.setattr(emu, "capture", lambda: rt.recording)
        yield emu
