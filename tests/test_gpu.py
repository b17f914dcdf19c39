"""The cuda backend on a device (``pytest -m gpu``; skipped cleanly without one).

- the proposer on ``backend="cuda"`` (CUDA graphs on) against the NumPy reference
  on the same checkpoint, both KV modes, a tiny and a mid-size config, with the
  reference's KV cache in the device's KV dtype (BF16 KV: a NumPy reference that
  rounds its cache to BF16 too; FP32 KV: the plain reference), so that only the
  order of accumulation differs: identical drafts except where the reference's
  own top-2 logit margin is within the BF16 tolerance (then the sequences continue
  from the agreed prefix), K/V rows and exact-mode windows within the tolerance of
  the KV dtype. (Against an FP32-KV reference, BF16 KV moves attention outputs by
  ~1e-2 relative, enough to flip a near-tied MoE route, after which a row's hidden
  differs by O(1): no tolerance can hold that);
- the captured propose step replayed against the eager cuda path: identical
  drafts and bit-identical KV for k = 1..M at batch 1 and 8 (both run the same
  launches on the same shapes), grammar masks and NoAllowedToken included;
- device inputs: CuPy, Numba and (when importable with CUDA) PyTorch arrays are
  used in place; BF16 device tensors are widened on the device;
- DeepSeek-V4's attention (K = V, the output unrotated, sinks, the grouped output) in a
  proposer against the reference, and ``rope_heads`` at V4's shape (64 heads x 512, R 64);
- DSA's kernels (kernels/dsa.cu, the sparse walk of kernels/mla.cu): the checks of
  test_cuda_emulated_dsa.py on the device, DeepSeek-V3.2's indexer shapes among them, and
  test_cuda_emulated_dsa_kpool.py's of GLM-5.3's pooled indexer;
- sampled drafts drawn on the device (kernels/sampling.cu) against the reference on the same
  logits, at the emulator's cases (test_cuda_emulated.py's check_sample_matches_reference) and
  at V = 32768 and 151936; the temperature-only and top_k draws fused into the LM head
  (kernels/lm_head.cu) against the reference (test_cuda_emulated.py's
  check_fused_sample_matches_reference / check_fused_topk_sample_matches_reference, and random
  heads at V = 32768 and 151936);
- the tensor cores' fragment layout (kernels/mma.cu's probe of kernels/mma.cuh) against a
  NumPy matmul, each deliberately wrong layout caught (the emulator runs the same check
  against its emulated mma: test_cuda_emulated.py::test_mma_fragment_layout).

Scripted for the device machine by scripts/gpu_check.sh.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import kv_rows, near_tie, record_margins
from mtpkern import MultiModuleMtpHead, NoAllowedToken, write_synthetic_checkpoint
from mtpkern.config import tiny_config
from mtpkern.tolerance import assert_close

pytestmark = pytest.mark.gpu

#: a mid-size MoE config: D = 128 (GLM's head dim), 4 query heads per KV head, odd vocabulary
MID = dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=2, head_dim=128, vocab_size=4099,
           n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=128, n_group=4, topk_group=2,
           rope_theta=1e6, use_qk_norm=False)


@pytest.fixture(scope="session")
def mid_ckpt(tmp_path_factory):
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("mid"), tiny_config(**MID), seed=11)


@pytest.fixture(params=["tiny", "mid"])
def ckpt_cfg(request, tiny_ckpt, tiny_cfg, mid_ckpt):
    return (tiny_ckpt, tiny_cfg) if request.param == "tiny" else (mid_ckpt, tiny_config(**MID))


def _make(ckpt, backend, mode, **kw):
    kw.setdefault("block_size", 16)
    kw.setdefault("num_blocks", 256)
    return MultiModuleMtpHead.from_pretrained(ckpt, backend=backend, kv_mode=mode, **kw)


def _reference_backend(kv: str):
    """The NumPy reference with its KV cache in ``kv`` (BF16: rounded to nearest even on
    write, as the device's cache; read back widened), everything else in FP32."""
    import ml_dtypes

    from mtpkern.backends.numpy_backend import NumpyBackend

    be = NumpyBackend()
    if kv == "bfloat16":
        be.kv_dtype = ml_dtypes.bfloat16
    return be


def _device_backend(kv: str):
    from mtpkern.backends.cuda import CudaBackend

    return CudaBackend(kv_dtype=kv)


def _same_kv(ref, sr, dev, sd, what, tol="bfloat16"):
    for m in range(ref.num_modules):
        assert sr.rows_per_module() == sd.rows_per_module()
        kr, vr = kv_rows(ref, sr, m)
        kd, vd = kv_rows(dev, sd, m)
        assert_close(kd, kr, tol, f"{what}: module {m} K")
        assert_close(vd, vr, tol, f"{what}: module {m} V")
        if ref.kv_mode == "exact" and sr._win[m] is not None:
            assert sr._win_start[m] == sd._win_start[m]
            assert_close(dev.backend.to_host(sd._win[m]), np.asarray(sr._win[m]), tol,
                         f"{what}: module {m} window (chained hiddens)")


@pytest.mark.parametrize("wd", ["float32", "bfloat16", "fp8_block", "fp8_channel", "fp4"])
@pytest.mark.parametrize("n,V", [(1, 1000), (7, 1000), (8, 4099)])
def test_fused_sample_matches_the_reference_on_the_device(wd, n, V):
    """The temperature-only and top_k draws fused into the LM head (kernels/lm_head.cu) on the
    device: the emulator's checks (exact identity heads: masks, an id_map, NaN / +-inf logits, z
    overflowing),
    then a random BF16 head at V = 32768 and 151936 (H 256): the reference's drafts, probs to
    the FP32 tolerance."""
    import test_cuda_emulated as emu_tests

    from mtpkern.backends.cuda import CudaBackend

    be = CudaBackend()
    emu_tests.check_fused_sample_matches_reference(be, wd, n, V)
    emu_tests.check_fused_topk_sample_matches_reference(be, wd, n, V)
    if wd != "bfloat16" or n == 7:
        return
    rng = np.random.default_rng(V)
    for big in (32768, 151936):
        x, w = emu_tests.rnd(rng, n, 256), emu_tests.rnd(rng, big, 256, scale=2 / 16)
        wq, wf = emu_tests.stored(w, "bf16")
        T = rng.uniform(0.5, 1.5, n)
        ps = [emu_tests.SamplingParams(float(T[r]), 0, 1.0, seed=r) for r in range(n)]
        keys = emu_tests.row_keys(ps, [11] * n, 0)
        want = emu_tests.sampling.lm_head_sample(x, wf, None, keys, T, np.zeros(n, np.int32), np.ones(n))
        ids, probs = emu_tests.fused_sample(be, x, be.prepare_weight(wq), None, keys, T)
        np.testing.assert_array_equal(ids, want[0])
        emu_tests.assert_close(probs, want[1], "float32", f"fused draw V={big}")


@pytest.mark.parametrize("kv", ["bfloat16", "float32"])
@pytest.mark.parametrize("mode", ["exact", "draft"])
def test_cuda_matches_numpy_reference(ckpt_cfg, mode, kv):
    check_cuda_matches_numpy_reference(ckpt_cfg, mode, kv, _device_backend(kv))


def check_cuda_matches_numpy_reference(ckpt_cfg, mode: str, kv: str, device_backend, lens=(5, 19, 40),
                                       fallback: str | None = None, **make_kw) -> None:
    """The body of test_cuda_matches_numpy_reference, for any cuda backend with KV dtype
    ``kv`` (tests/test_cuda_emulated.py runs it on the emulated kernels); ``lens``: the
    prompts' lengths; ``fallback``: the planned step's counter of a config it does not cover
    (every propose then runs eager; None: some must take the planned step); ``make_kw``: the
    proposers' pool and chunk sizes."""
    ckpt, cfg = ckpt_cfg
    ref, dev = _make(ckpt, _reference_backend(kv), mode, **make_kw), _make(ckpt, device_backend, mode, **make_kw)
    tol = kv
    margins = record_margins(ref)
    rng = np.random.default_rng(5)
    H, V = cfg.stream_size, cfg.vocab_size         # hc_mult streams of the hidden per row
    lens = list(lens)
    B = len(lens)
    sr, sd = [ref.alloc_state() for _ in lens], [dev.alloc_state() for _ in lens]
    pending = []
    for i, n in enumerate(lens):
        toks, hid = rng.integers(0, V, n).tolist(), rng.standard_normal((n, H)).astype(np.float32)
        ref.prefill_drafter(toks, hid, sr[i])
        dev.prefill_drafter(toks, hid, sd[i])
        pending.append(hid[-1])
    _same_kv(ref, sr[-1], dev, sd[-1], "after prefill", tol)
    pos, ties, compared = list(lens), 0, 0
    for rnd, (k, frac) in enumerate([(3, 1.0), (1, 1.0), (2, 0.5), (3, 0.0), (3, 1.0), (2, 1.0)]):
        last = rng.integers(0, V, B).tolist()
        want = ref.propose_batch(last, np.stack(pending), pos, k, sr)
        got = dev.propose_batch(last, np.stack(pending), pos, k, sd)
        for i in range(B):
            agree = next((j for j, (a, b) in enumerate(zip(want[i], got[i])) if a != b), len(want[i]))
            compared += agree
            if agree < len(want[i]):
                # A different draft is fine only where the reference itself was nearly tied; later
                # drafts of this sequence are built from it, so only the agreed prefix is accepted.
                assert near_tie(margins, agree, i, "bfloat16"), (
                    f"round {rnd}, sequence {i}, draft {agree}: cuda {got[i]}, numpy {want[i]}, "
                    f"reference margin {margins[agree][0][i]:.4g} is not a near-tie")
                ties += 1
            a = min(int(round(frac * len(want[i]))), agree)
            acc, hid = want[i][:a], rng.standard_normal((a, H)).astype(np.float32)
            for p, ss in ((ref, sr), (dev, sd)):
                p.after_verify(a, ss[i])
                p.catchup_drafter(acc, hid, ss[i])
            pending[i] = rng.standard_normal(H).astype(np.float32)
            pos[i] += 1 + a
        for i in range(B):
            _same_kv(ref, sr[i], dev, sd[i], f"round {rnd}, sequence {i}", tol)
        dev.check_invariants()
    assert compared >= 2 * ties, f"{ties} near-ties in {compared} compared drafts"
    assert dev.step_runner is not None
    planned = dev.step_runner.counts["executed"] + dev.step_runner.counts["replayed"]
    assert (not planned and dev.step_runner.counts[fallback]) if fallback else planned, dict(dev.step_runner.counts)
    return ref, dev


@pytest.mark.parametrize("kv", ["bfloat16", "float32"])
def test_v4_attention_matches_numpy_reference(tmp_path, kv):
    """DeepSeek-V4's attention (tests/test_v4_attention.py's V4_ATTN: K = V through
    qk_norm_rope_kv_write_kernel's VIsK instantiations, the output unrotated by
    rope_heads_kernel, sinks, the grouped low-rank output) in a proposer, against the
    reference; proposes take the planned step."""
    from test_v4_attention import V4_ATTN

    cfg = tiny_config(**V4_ATTN)
    ckpt = write_synthetic_checkpoint(tmp_path, cfg, seed=17, dtype="float32")
    check_cuda_matches_numpy_reference((ckpt, cfg), "draft", kv, _device_backend(kv))


@pytest.mark.parametrize("n", [1, 64])
@pytest.mark.parametrize("interleave", [False, True])
def test_rope_heads_at_deepseek_v4_shape(n, interleave):
    """rope_heads_kernel over 64 heads x 512 with 64 rotary dims, forward and inverse, against
    the NumPy reference; the dims past 64 copied bit for bit, inverse(forward(x)) = x."""
    from mtpkern.backends.numpy_backend import NumpyBackend
    from mtpkern.ops.rope_kv import inv_freq

    be, ref = _device_backend("bfloat16"), NumpyBackend()
    rng = np.random.default_rng(n)
    x = rng.standard_normal((n, 64, 512)).astype(np.float32)
    pos, f = rng.integers(0, 160_000, n).astype(np.int32), inv_freq(64, 1e4)
    for inverse in (False, True):
        got = be.to_host(be.rope_heads(be.from_host(x), pos, f, interleave=interleave, inverse=inverse))
        want = ref.rope_heads(x, pos, f, interleave=interleave, inverse=inverse)
        assert_close(got[..., :64], want[..., :64], "float32", f"inverse={inverse}")
        assert np.array_equal(got[..., 64:], x[..., 64:])
    fwd = be.rope_heads(be.from_host(x), pos, f, interleave=interleave)
    assert_close(be.to_host(be.rope_heads(fwd, pos, f, interleave=interleave, inverse=True)), x, "float32",
                 "inverse of forward")


def _allowed(V, ids):
    m = np.zeros((V + 31) // 32, np.int32)
    for t in ids:
        m[t >> 5] |= np.int32(np.uint32(1 << (t & 31)).view(np.int32))
    return m


@pytest.mark.parametrize("mode", ["exact", "draft"])
@pytest.mark.parametrize("B", [1, 8])
def test_graph_replay_equals_eager(mid_ckpt, mode, B):
    check_graph_replay_equals_eager(mid_ckpt, tiny_config(**MID), "cuda", mode, B)


def check_graph_replay_equals_eager(ckpt, cfg, backend, mode: str, B: int, prompts=None, **make_kw) -> None:
    """The body of test_graph_replay_equals_eager, for any cuda backend (a name or an
    instance; tests/test_cuda_emulated.py runs it on the emulated kernels); ``prompts``:
    (shortest, longest + 1) prompt length (default (M, 60)); ``make_kw``: the proposers'
    pool and chunk sizes."""
    H, V, M = cfg.hidden_size, cfg.vocab_size, cfg.num_modules
    lo, hi = prompts or (M, 60)
    graph, eager = _make(ckpt, backend, mode, **make_kw), _make(ckpt, backend, mode, cuda_graphs=False, **make_kw)
    assert eager.step_runner is None and graph.step_runner is not None
    rng = np.random.default_rng(B)
    sg, se = [graph.alloc_state() for _ in range(B)], [eager.alloc_state() for _ in range(B)]
    pending = []
    for i in range(B):
        n = int(rng.integers(lo, hi))
        toks, hid = rng.integers(0, V, n).tolist(), rng.standard_normal((n, H)).astype(np.float32)
        graph.prefill_drafter(toks, hid, sg[i])
        eager.prefill_drafter(toks, hid, se[i])
        pending.append(hid[-1])
    pos = [s.num_verified for s in sg]
    plan = [(k, r) for r in range(3) for k in range(1, M + 1)]       # each k three times: capture, replays
    for step, (k, r) in enumerate(plan):
        last = rng.integers(0, V, B).tolist()
        masks = None
        if r == 2:
            masks = [_allowed(V, rng.integers(0, V, 40).tolist()) if i % 2 == 0 else None for i in range(B)]
        out = [p.propose_batch(last, np.stack(pending), pos, k, ss, grammar_bitmasks=masks)
               for p, ss in ((graph, sg), (eager, se))]
        assert out[0] == out[1], f"step {step} (k={k}): graph {out[0]}, eager {out[1]}"
        assert graph.backend.to_host(graph.last_drafts_device).tolist() == out[0]
        for i in range(B):
            a = int(rng.integers(0, k + 1))
            hid = rng.standard_normal((a, H)).astype(np.float32)
            for p, ss in ((graph, sg), (eager, se)):
                p.after_verify(a, ss[i])
                p.catchup_drafter(out[0][i][:a], hid, ss[i])
            pending[i] = rng.standard_normal(H).astype(np.float32)
            pos[i] += 1 + a
        for i in range(B):
            for m in range(M):
                kg, vg = kv_rows(graph, sg[i], m)
                ke, ve = kv_rows(eager, se[i], m)
                assert np.array_equal(kg, ke) and np.array_equal(vg, ve), f"step {step}: module {m} KV differs"
    counts = graph.step_runner.counts
    assert counts["captured"] >= M and counts["replayed"] >= M, dict(counts)
    # A grammar that allows nothing: raised after the replay, every state as it was.
    before = [(s.rows_per_module(), list(s.tail), s.num_verified) for s in sg], graph.kv_blocks_in_use()
    with pytest.raises(NoAllowedToken):
        graph.propose_batch([1] * B, np.stack(pending), pos, M, sg,
                            grammar_bitmasks=[np.zeros((V + 31) // 32, np.int32)] * B)
    assert ([(s.rows_per_module(), list(s.tail), s.num_verified) for s in sg], graph.kv_blocks_in_use()) == before
    graph.check_invariants()
    return graph, eager


def test_device_inputs_are_used_in_place(tiny_ckpt, tiny_cfg):
    import cupy as cp
    import ml_dtypes

    from mtpkern.backends.cuda import CudaBackend

    be = CudaBackend()
    assert be.xp is cp
    x = cp.random.standard_normal((3, 64), dtype=cp.float32)
    assert be.ingest_float("h", x).data.ptr == x.data.ptr                       # CuPy FP32: no copy
    strided = x[:, ::2]
    assert cp.array_equal(be.ingest_float("h", strided), cp.ascontiguousarray(strided))
    host_bf16 = x.get().astype(ml_dtypes.bfloat16)
    assert np.array_equal(be.ingest_float("h", host_bf16).get(), host_bf16.astype(np.float32))
    with pytest.raises(TypeError, match="h: expected dtype float32 or bfloat16, got int32"):
        be.ingest_float("h", cp.zeros((3, 64), cp.int32))
    with pytest.raises(TypeError, match="^h: "):
        be.ingest_float("h", "not an array")

    from numba import cuda as ncuda

    nb = ncuda.to_device(x.get())
    got = be.ingest_float("h", nb)
    assert got.data.ptr == nb.__cuda_array_interface__["data"][0]               # Numba: no copy
    assert cp.array_equal(got, x)

    # The proposer takes device hiddens and drafts what it drafts from host ones.
    prop = MultiModuleMtpHead.from_pretrained(tiny_ckpt, backend=be, kv_mode="draft", block_size=16, num_blocks=32)
    a, b = prop.alloc_state(), prop.alloc_state()
    toks = list(range(7))
    prop.prefill_drafter(toks, x.get()[:1].repeat(7, 0), a)
    prop.prefill_drafter(toks, cp.asarray(x.get()[:1].repeat(7, 0)), b)
    assert prop.propose(3, x[1], 7, 3, a) == prop.propose(3, x[1].get(), 7, 3, b)


#: kernels/mma.cu's probe layouts: 0 is mma.cuh's, the others are wrong on purpose
MMA_WRONG_LAYOUTS = {1: "A transposed", 2: "a[1] and a[2] exchanged", 3: "b[0] and b[1] exchanged",
                     4: "D's rows g and g + 8 exchanged"}


def mma_probe_case(seed: int):
    """Inputs of mma_bf16_probe_kernel (BF16 as uint16 bits: a [16, 16], bt = B^T [8, 16],
    b [16, 8], c [16, 8] FP32) and D = A B + C in float64."""
    import ml_dtypes

    rng = np.random.default_rng(seed)
    a = rng.standard_normal((16, 16)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((16, 8)).astype(ml_dtypes.bfloat16)
    c = rng.standard_normal((16, 8)).astype(np.float32)
    want = a.astype(np.float64) @ b.astype(np.float64) + c
    bits = lambda x: np.ascontiguousarray(x).view(np.uint16)
    return (bits(a), bits(b.T), bits(b), c), want


def check_mma_probe(run) -> None:
    """``run(layout, args) -> d [2, 16, 8]`` (host): D within FP32 rounding of a 16-term sum
    (the products of two BF16 are exact; FP32's tolerance) through both B loaders; every
    wrong layout off by O(1) somewhere."""
    for seed in (0, 1, 2):
        args, want = mma_probe_case(seed)
        d = run(0, args)
        for v, how in enumerate(("B^T rows (mma_load_b_nk)", "B rows (mma_load_b_kn)")):
            assert_close(d[v], want, "float32", f"mma D = A B + C, {how}, seed {seed}")
        for layout, what in MMA_WRONG_LAYOUTS.items():
            bad = run(layout, args)
            assert np.abs(bad[0] - want).max() > 0.1, f"probe layout {layout} ({what}) not caught"


def test_mma_fragment_layout_on_the_device():
    import cupy as cp

    from mtpkern.backends.cuda_launch import loader

    probe = loader.get_kernel("mma", "mma_bf16_probe_kernel")

    def run(layout, args):
        d = cp.full((2, 16, 8), cp.nan, cp.float32)
        probe((1,), (32,), (*(cp.asarray(x) for x in args), d, np.int32(layout)))
        return d.get()

    check_mma_probe(run)


def test_torch_device_tensors(tiny_cfg):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    from mtpkern.backends.cuda import CudaBackend

    be = CudaBackend()
    t = torch.randn(4, 64, device="cuda")
    got = be.ingest_float("h", t)
    assert got.data.ptr == t.data_ptr()                                          # FP32 via DLPack: no copy
    tb = t.to(torch.bfloat16)
    wide = be.ingest_float("h", tb)                                              # BF16: widened on the device
    assert np.array_equal(wide.get(), tb.float().cpu().numpy())
    assert np.array_equal(be.ingest_float("h", tb[:, ::2]).get(), tb[:, ::2].float().cpu().numpy())


def test_fp4_checkpoint_drafts_as_its_dequantized_twin(tmp_path):
    """DeepSeek-V4's layout (FP4 routed experts decoded in the GEMVs, FP8 with E8M0 scales
    elsewhere) on the device drafts what its dequantized FP32 twin drafts there, and what the
    NumPy reference drafts (docs/fp4.md; tests/test_fp4_checkpoints.py on the emulator)."""
    from conftest import run_rounds
    from test_fp4_checkpoints import _cfg, dequantized_copy

    from mtpkern.backends.cuda import CudaBackend

    cfg = _cfg("deepseek_v3")
    fp4 = write_synthetic_checkpoint(tmp_path / "fp4", cfg, seed=4)
    plain = dequantized_copy(fp4, tmp_path / "fp32", cfg)
    for mode in ("exact", "draft"):
        ours = run_rounds(fp4, CudaBackend(kv_dtype="float32"), mode)[1]
        assert ours == run_rounds(plain, CudaBackend(kv_dtype="float32"), mode)[1]
        assert ours == run_rounds(fp4, "numpy", mode)[1]


def test_nvfp4_container_drafts_as_its_dequantized_twin(tmp_path):
    """A compressed-tensors NVFP4 checkpoint (E4M3 scales per 16 and a global scale, decoded in
    the GEMVs: CudaNvFp4) on the device drafts what its dequantized FP32 twin drafts there, and
    what the NumPy reference drafts (docs/fp4.md; tests/test_quant_containers.py on the emulator)."""
    from conftest import run_rounds
    from test_quant_containers import CASES, container

    from mtpkern.backends.cuda import CudaBackend

    ct, twin = container(tmp_path, tiny_config(), CASES["nvfp4"][0])
    for mode in ("exact", "draft"):
        ours = run_rounds(ct, CudaBackend(kv_dtype="float32"), mode)[1]
        assert ours == run_rounds(twin, CudaBackend(kv_dtype="float32"), mode)[1]
        assert ours == run_rounds(ct, "numpy", mode)[1]


@pytest.mark.parametrize("n,V", [(1, 1000), (8, 32768), (1, 151936), (8, 151936)])
def test_sample_kernel_matches_the_reference_on_the_device(n, V):
    """kernels/sampling.cu on the device: the drafts the reference draws from the same logits,
    probs and the whole q to FP32 rounding, for temperature / top_k / top_p / both, with masks,
    a draft vocabulary, NaN and infinite logits and ties (the device's FP64 log / exp are within
    an ulp of glibc's: a draft could differ only at a score tie that close, ~1e-15 of calls)."""
    import test_cuda_emulated as emu_tests

    from mtpkern.backends.cuda import CudaBackend

    be = CudaBackend()
    for params in emu_tests.SAMPLE_PARAMS:
        emu_tests.check_sample_matches_reference(be, V, n, params)


@pytest.mark.parametrize("kv", ["bfloat16", "float32"])
def test_dsa_kernels_on_the_device(kv):
    """kernels/dsa.cu and mla.cu's listed walk on the device, the checks
    tests/test_cuda_emulated_dsa.py runs on the emulator: the key write against the reference
    (the cache's tolerance), selections with exact scores over 5000 and 40000 rows (the sort's
    rows bit for bit: ties, NaN, every keys-per-thread kernel and the pass beyond them), all scores
    tied, DeepSeek-V3.2's indexer shapes (Hi 64, Di 128, topk 2048) at 5000 rows against float64
    (near ties allowed), the sparse attention against the reference and a full list against the
    dense attention bit for bit."""
    import test_cuda_emulated_dsa as dsa_checks

    from mtpkern.backends import get_backend
    from mtpkern.backends.cuda import CudaBackend
    from mtpkern.ops.rope_kv import inv_freq

    be = CudaBackend(kv)
    rng = np.random.default_rng(1)
    n, Hi, Di, R, NB, BS = 19, 8, 128, 64, 4, 16
    k, q = rng.standard_normal((n, Di)).astype(np.float32) * 3, rng.standard_normal((n, Hi, Di)).astype(np.float32)
    w, b = rng.standard_normal(Di).astype(np.float32), rng.standard_normal(Di).astype(np.float32)
    pos, slots = rng.integers(0, 9000, n).astype(np.int32), rng.permutation(NB * BS)[:n].astype(np.int32)
    cache = be.empty_latent_kv(NB, BS, Di)
    got_q = be.dsa_key_write(be.from_host(k), w, b, 1e-6, inv_freq(R, 1e4), pos, cache, slots, q=be.from_host(q),
                             interleave=True)
    ref = np.zeros((NB, BS, Di), np.float32)
    want_q = get_backend("numpy").dsa_key_write(k, w, b, 1e-6, inv_freq(R, 1e4), pos, ref, slots, q=q,
                                                interleave=True)
    assert_close(be.kv_to_host(cache), ref, kv, "index cache rows")
    assert_close(be.to_host(got_q), want_q, "float32", "roped query")
    for rows, topk in ((5000, 2048), (5000, 7), (40000, 2048), (1500, 1)):
        dsa_checks.check_select_exact(be, rows, topk)
    dsa_checks.check_select_all_tied(be)
    dsa_checks.check_select_v32(be, 80, (5000, 4100, 2048))
    for Hq in (5, 16):
        dsa_checks.check_sparse_split(be, Hq)
    for window in (False, True):
        dsa_checks.check_full_list_dense(be, window)


@pytest.mark.parametrize("kv", ["bfloat16", "float32"])
def test_dsa_kpool_kernels_on_the_device(kv):
    """GLM-5.3's pooled indexer on the device, the checks tests/test_cuda_emulated_dsa_kpool.py
    runs on the emulator: the key write with its gate scores (FP32 and BF16 gates), the selection
    against the reference and float64 with and without the tail, exact pool scores (ties, NaN,
    +-inf) over 2200 and 700 pools against a sort."""
    import test_cuda_emulated_dsa_kpool as kpool_checks

    from mtpkern.backends.cuda import CudaBackend

    be = CudaBackend(kv)
    for gate_dtype in ("float32", "bfloat16"):
        kpool_checks.check_key_write_gate(be, gate_dtype)
    for tail in (True, False):
        kpool_checks.check_select_kpool(be, tail)
    for pools, P, topk in ((2200, 2, 1200), (700, 4, 64), (3000, 16, 2048)):
        kpool_checks.check_select_exact_pools(be, pools, P, topk)


@pytest.mark.parametrize("n", [1, 64])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hyper_connections_on_the_device(n, dtype):
    """kernels/hc.cu at DeepSeek-V4-Flash's shape (m 4 streams of H 4096, 20 Sinkhorn
    iterations) and at m 16 (hc_post's 16-stream registers) with H off the 4-column vectors,
    X in ``dtype`` (BF16: its bits in uint16), against the NumPy reference on the same values;
    comb doubly stochastic (tests/test_ops_hc.py runs the same kernels on the emulator)."""
    import cupy as cp
    import ml_dtypes

    from mtpkern.backends.cuda import CudaBackend
    from mtpkern.ops import hc

    be = CudaBackend()
    rng = np.random.default_rng(n)
    for m, H in ((4, 4096), (16, 1001)):
        w = (2 + m) * m
        X32 = rng.standard_normal((n, m * H)).astype(np.float32)
        Xh = X32 if dtype == "float32" else X32.astype(ml_dtypes.bfloat16)
        X = cp.asarray(Xh if dtype == "float32" else Xh.view(np.uint16))
        mix = (rng.standard_normal((n, w)) * 2).astype(np.float32)
        base, scale = rng.standard_normal(w).astype(np.float32), (rng.random(3) + 0.5).astype(np.float32)
        f = rng.standard_normal((n, H)).astype(np.float32)
        u, post, comb = (a.get() for a in be.hc_pre(X, cp.asarray(mix), cp.asarray(base), cp.asarray(scale), 1e-6, 20))
        want = hc.hc_pre(Xh, mix, base, scale, 1e-6, 20)
        for k, got, ref in zip(("u", "post", "comb"), (u, post, comb), want):
            assert_close(got, ref, "float32", f"m {m} {dtype}: {k}")
        assert np.allclose(comb.sum(1), 1, atol=1e-4) and np.allclose(comb.sum(2), 1, atol=1e-4)
        y = be.hc_post(cp.asarray(f), X, cp.asarray(post), cp.asarray(comb)).get()
        assert_close(y, hc.hc_post(f, Xh, post, comb), "float32", f"m {m} {dtype}: hc_post")
        h = be.hc_head(X, cp.asarray(mix[:, :m]), cp.asarray(base[:m]), cp.asarray(scale[:1]), 1e-6).get()
        assert_close(h, hc.hc_head(Xh, mix[:, :m].copy(), base[:m], scale[:1], 1e-6), "float32",
                     f"m {m} {dtype}: hc_head")
