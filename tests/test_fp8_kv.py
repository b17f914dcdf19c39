"""The FP8 KV cache (``kv_dtype="fp8"``: E4M3 codes, one FP32 scale per row and KV head;
mtpkern.ops.kv_fp8, docs/kv_pool.md "FP8 KV cache").

- the quantization against float64 (codes by brute force over E4M3's values, scales), and
  negative controls: reading the codes without their scale, or one scale per tensor, fails;
- the cpu kernels' encoder and KV write bit for bit against the reference's;
- the KV write and the attention of the numpy and cpu backends and of the cuda kernels on the
  emulator (tests/cuda_emu; a gpu-marked twin for a GPU): codes bit for bit from the same FP32
  rows, attention within the FP32 tolerance of the reference over the same caches;
- proposers: the KV rows the backends hold (codes, scales), drafts equal to an FP32-KV
  proposer's except where the reference's two best logits are within ``TOLERANCE["fp8_kv"]``,
  forks / shares / trees / trims keeping the scales with the codes;
- the refusals (MLA, DSA, DeepSeek-V4's attention, hyper-connections, sharding), before any
  pool is allocated.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from conftest import near_tie, record_margins, run_rounds, verify_tree_off_the_greedy_path
from mtpkern import MultiModuleMtpHead
from mtpkern.backends import cuda_available
from mtpkern.backends.cpu import CpuBackend
from mtpkern.backends.numpy_backend import NumpyBackend
from mtpkern.kv import BlockPool, check_fp8_kv
from mtpkern.ops.kv_fp8 import REL_ERROR, SUBNORMAL_ABS, dequantize, quantize_rows
from mtpkern.ops.rope_kv import inv_freq
from mtpkern.quant import e4m3_table
from mtpkern.tolerance import TOLERANCE, assert_close

REF = NumpyBackend()
R8 = NumpyBackend("fp8")


@pytest.fixture(scope="module")
def c8():
    return CpuBackend(kv_dtype="fp8")


def fp8_backend(name: str):
    return NumpyBackend("fp8") if name == "numpy" else CpuBackend(kv_dtype="fp8")


# -- the quantization ------------------------------------------------------------------------

def _brute_codes(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The E4M3 code nearest float64(x) / float64(scale) (ties to the even code), by search over
    every finite E4M3 value: no ml_dtypes, no rounding but float64's exact quotient's."""
    tab = e4m3_table().astype(np.float64)
    codes = np.arange(256)
    ok = np.isfinite(tab)
    tab, codes = tab[ok], codes[ok]
    s = scale.astype(np.float64)[..., None]
    q = np.where(s == 0, 0.0, x.astype(np.float64) / np.where(s == 0, 1.0, s))
    q = np.clip(q, -448.0, 448.0)
    d = np.abs(q[..., None] - tab)                               # [..., D, 254]
    best = d.min(axis=-1, keepdims=True)
    cand = d == best
    # ties: the even code (the last mantissa bit 0); +-0 by the quotient's sign
    even = (codes & 1) == 0
    pick = np.where(cand & even, 1, 0) + np.where(cand, 1, 0)
    out = codes[np.argmax(pick * 2 + (np.signbit(q)[..., None] == (codes >= 128)), axis=-1)]
    return out.astype(np.uint8)


def _rows(rng, shape) -> np.ndarray:
    """FP32 rows of mixed magnitudes per row (1e-6 .. 1e3), with zeros, a zero row, a row of
    equal values, and values on E4M3 ties."""
    x = rng.standard_normal(shape) * 10.0 ** rng.uniform(-6, 3, shape[:-1] + (1,))
    x[0, 0] = 0.0
    x[1, 0, 3] = 0.0
    x[2, 1] = -1.5
    x[3, 0, :] = 448.0 * np.array([1.0, 1.0625, -1.1875, 2.0 ** -7, 3 * 2.0 ** -10] + [0.5] * (shape[-1] - 5))
    return x.astype(np.float32)


def test_quantize_rows_against_float64():
    x = _rows(np.random.default_rng(0), (64, 3, 24))
    codes, scale = quantize_rows(x)
    assert codes.dtype == np.uint8 and codes.shape == x.shape
    assert scale.dtype == np.float32 and scale.shape == x.shape[:2]
    amax = np.abs(x).max(axis=-1)
    np.testing.assert_array_equal(scale, (amax / np.float32(448.0)).astype(np.float32))
    np.testing.assert_array_equal(codes, _brute_codes(x, scale))
    assert (codes[0, 0] == 0).all() and scale[0, 0] == 0           # a zero row: scale 0, codes 0
    assert (codes[2, 1] == 0xFE).all()                               # -448: the largest code
    back = dequantize(codes, scale)
    np.testing.assert_array_equal(back, e4m3_table()[codes] * scale[..., None])
    # the bound: 2^-4 relative for normal codes, 2^-10 amax / 448 absolute below 2^-6 scale
    err = np.abs(back.astype(np.float64) - x)
    normal = np.abs(x) >= 2.0 ** -6 * scale[..., None]
    assert (err[normal] <= REL_ERROR * np.abs(x[normal]) * (1 + 1e-6)).all()
    assert (err[~normal] <= SUBNORMAL_ABS * amax[..., None].repeat(x.shape[-1], -1)[~normal] * (1 + 1e-6)).all()


def test_quantize_ties_round_to_even():
    # amax 448: scale 1; 1.0625 lies halfway between 1 and 1.125 (the even code: 1), 1.1875
    # between 1.125 and 1.25 (the even code: 1.25); a hair above a tie rounds up
    x = np.array([[448.0, 1.0625, 1.1875, -1.0625, np.nextafter(np.float32(1.0625), np.float32(2))]], np.float32)
    codes, scale = quantize_rows(x)
    assert scale[0] == 1.0
    np.testing.assert_array_equal(e4m3_table()[codes[0]], [448.0, 1.0, 1.25, -1.0, 1.125])
    np.testing.assert_array_equal(codes, _brute_codes(x, scale))


def test_negative_controls_fail():
    """Reading the codes without their scale, or quantizing with one scale for the tensor,
    breaks the bound that per-row scales keep."""
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((32, 2, 16)) * 10.0 ** rng.uniform(-4, 2, (32, 2, 1))).astype(np.float32)
    codes, scale = quantize_rows(x)
    good = dequantize(codes, scale)
    assert np.abs(good - x).max() <= REL_ERROR * np.abs(x).max()
    with pytest.raises(AssertionError):
        assert_close(e4m3_table()[codes], x, "bfloat16", "codes without their scale")
    # one scale for the whole tensor (a per-tensor static scale): the small rows lose their bits
    s_t = np.float32(np.abs(x).max() / 448.0)
    codes_t = np.clip(x.astype(np.float64) / s_t, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    per_tensor = e4m3_table()[codes_t] * s_t
    assert not np.array_equal(codes_t, codes)
    small = np.abs(x).max(axis=-1) < np.abs(x).max() * 2.0 ** -12                 # rows far below the top
    assert small.any()
    rel = np.abs(per_tensor - x)[small] / np.maximum(np.abs(x[small]), 1e-30)
    assert rel.max() > 4 * REL_ERROR                                              # far past the per-row bound


def test_cpu_encoder_is_ml_dtypes_rounding():
    """The cpu kernels' E4M3 encoder, every finite code's value, every midpoint and its float64
    neighbours, random values: ml_dtypes' float64 -> float8_e4m3fn, code for code."""
    from mtpkern.backends.cpu_kernels.rope_kv import e4m3_code

    tab = np.sort(np.unique(e4m3_table()[np.isfinite(e4m3_table())].astype(np.float64)))
    mids = (tab[1:] + tab[:-1]) / 2
    rng = np.random.default_rng(2)
    vals = np.concatenate([tab, mids, np.nextafter(mids, np.inf), np.nextafter(mids, -np.inf), [-0.0, 448.0],
                           rng.standard_normal(4000) * 10.0 ** rng.uniform(-4, 2.6, 4000)])
    vals = np.clip(vals, -448, 448)
    want = vals.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    got = np.array([e4m3_code(v) for v in vals], np.uint8)
    np.testing.assert_array_equal(got, want)


def test_cpu_fp8_write_kernel_is_the_reference():
    from mtpkern.backends.cpu_kernels.rope_kv import fp8_kv_write_kernel

    x = _rows(np.random.default_rng(3), (40, 3, 24))
    codes, scale = quantize_rows(x)
    c = np.full((50, 3 * 24), 7, np.uint8)
    s = np.full((50, 3), -1, np.float32)
    slots = np.random.default_rng(4).permutation(50)[:40].astype(np.int32)
    fp8_kv_write_kernel(x.reshape(40, 72), 3, 24, c, s, slots)
    np.testing.assert_array_equal(c[slots].reshape(40, 3, 24), codes)
    np.testing.assert_array_equal(s[slots], scale)
    rest = np.setdiff1d(np.arange(50), slots)
    assert (c[rest] == 7).all() and (s[rest] == -1).all()


# -- the ops -----------------------------------------------------------------------------------

def _write(be, qkv, Hq, Hkv, D, Dv, NB, BS, slots, norms=None):
    k, v = be.empty_keys(NB, BS, Hkv, D), be.empty_kv(NB, BS, Hkv, Dv)
    kw = ({"k_scale": be.empty_kv_scales(NB, BS, Hkv), "v_scale": be.empty_kv_scales(NB, BS, Hkv)}
          if be.kv_fp8 else {})
    n = qkv.shape[0]
    qn, kn = norms if norms is not None else (None, None)
    q = be.qk_norm_rope_kv_write(qkv, Hq, Hkv, qn, kn, 1e-6, inv_freq(D - D % 2, 1e4), np.arange(n, dtype=np.int32) * 7,
                                 k, v, slots, **kw)
    return q, k, v, kw


@pytest.mark.parametrize("Hq,Hkv,D,Dv,BS", [(4, 2, 32, 32, 16), (3, 1, 20, 12, 5)])
def test_kv_write_numpy_and_cpu(c8, Hq, Hkv, D, Dv, BS):
    rng = np.random.default_rng(5)
    NB, n = 7, 23
    qkv = (rng.standard_normal((n, (Hq + Hkv) * D + Hkv * Dv)) * 3).astype(np.float32)
    norms = (rng.standard_normal(D).astype(np.float32), rng.standard_normal(D).astype(np.float32))
    slots = rng.permutation(NB * BS)[:n].astype(np.int32)
    qr, kr, vr, sr = _write(R8, qkv, Hq, Hkv, D, Dv, NB, BS, slots, norms)
    qc, kc, vc, sc = _write(c8, qkv, Hq, Hkv, D, Dv, NB, BS, slots, norms)
    assert kr.dtype == kc.dtype == vr.dtype == np.uint8
    assert_close(qc, qr, what="q")
    # V is a move: codes and scales bit for bit
    np.testing.assert_array_equal(vc, vr)
    np.testing.assert_array_equal(sc["v_scale"], sr["v_scale"])
    # K: the cpu's codes are the reference quantization of the cpu's own FP32 keys
    _, k32, _, _ = _write(CpuBackend(), qkv, Hq, Hkv, D, Dv, NB, BS, slots, norms)
    b, o = slots // BS, slots % BS
    codes, scale = quantize_rows(np.asarray(k32)[b, o])
    np.testing.assert_array_equal(kc[b, o], codes)
    np.testing.assert_array_equal(sc["k_scale"][b, o], scale)
    # and the reference's within the bound of the FP32 reference's keys
    _, kf, vf, _ = _write(REF, qkv, Hq, Hkv, D, Dv, NB, BS, slots, norms)
    K = R8.kv_to_host(kr, sr["k_scale"])
    amax = np.abs(kf).max(axis=-1, keepdims=True)
    assert (np.abs(K - kf) <= REL_ERROR * np.abs(kf) + SUBNORMAL_ABS * amax + 1e-30).all()
    untouched = np.ones((NB, BS), bool)
    untouched[b, o] = False
    assert not kc[untouched].any() and not sc["k_scale"][untouched].any()


def test_kv_to_host_needs_the_scales():
    with pytest.raises(ValueError, match="scale"):
        R8.kv_to_host(R8.empty_kv(2, 4, 1, 8))


def test_ops_refuse_codes_without_scales(c8):
    q = np.zeros((1, 2, 8), np.float32)
    k, v = R8.empty_kv(2, 4, 1, 8), R8.empty_kv(2, 4, 1, 8)
    args = (np.zeros((1, 2), np.int32), np.zeros(1, np.int32), np.ones(1, np.int32), 0.5)
    for be in (R8, c8):
        with pytest.raises(ValueError, match="k_scale"):
            be.paged_attention(q, k, v, *args)
    with pytest.raises(ValueError, match="k_scale"):
        REF.paged_attention(q, REF.empty_kv(2, 4, 1, 8), REF.empty_kv(2, 4, 1, 8), *args,
                            k_scale=np.zeros((2, 4, 1), np.float32))


@pytest.mark.parametrize("Hq,Hkv,D,Dv,BS", [(4, 2, 32, 32, 16), (6, 2, 24, 16, 5)])
@pytest.mark.parametrize("window", [False, True])
def test_attention_matches_the_reference(c8, Hq, Hkv, D, Dv, BS, window):
    rng = np.random.default_rng(6)
    NB, n = 12, 45
    qkv = rng.standard_normal((n, (Hq + Hkv) * D + Hkv * Dv)).astype(np.float32)
    slots = rng.permutation(NB * BS)[:n].astype(np.int32)
    _, k, v, kw = _write(R8, qkv, Hq, Hkv, D, Dv, NB, BS, slots)
    # two sequences over the pool's blocks (every slot a written row or zeros)
    tables = np.stack([np.arange(NB, dtype=np.int32), np.roll(np.arange(NB, dtype=np.int32), 3)])
    nr = 7
    q = rng.standard_normal((nr, Hq, D)).astype(np.float32)
    row_seq = np.array([0, 0, 1, 0, 1, 1, 0], np.int32)
    row_len = np.array([1, 40, 33, 17, 60, 2, BS * NB], np.int32)
    opt = {}
    if window:
        opt = {"row_start": np.maximum(row_len - 9, 0).astype(np.int32),
               "sinks": rng.standard_normal(Hq).astype(np.float32)}
    K, V = R8.kv_to_host(k, kw["k_scale"]), R8.kv_to_host(v, kw["v_scale"])
    want = REF.paged_attention(q, K, V, tables, row_seq, row_len, D ** -0.5, **opt)
    got_r = R8.paged_attention(q, k, v, tables, row_seq, row_len, D ** -0.5, **opt, **kw)
    np.testing.assert_array_equal(got_r, want)                  # the reference: dequantize, then FP32
    got_c = c8.paged_attention(q, k, v, tables, row_seq, row_len, D ** -0.5, **opt, **kw)
    assert_close(got_c, want, "float32", "cpu FP8 attention")


# -- the cuda kernels, on the emulator (tests/cuda_emu) ----------------------------------------------

@pytest.fixture(scope="module")
def emu8():
    """The CUDA emulator (skipped where it cannot be built), routing the cuda launchers."""
    from cuda_emu import emu_backend

    yield from emu_backend.installed_emulator()


@pytest.fixture(scope="module")
def e8(emu8):
    """The emulated cuda backend with an FP8 KV cache."""
    from cuda_emu import emu_backend

    return emu_backend.backend("fp8")


@pytest.fixture
def emu_sm_count(emu8):
    """Set the SM count the emulated launchers plan for (attention partitions)."""
    from cuda_emu import emu_backend

    def set_count(n: int):
        emu8.sm_count = n
    yield set_count
    emu8.sm_count = emu_backend.DEFAULT_SM_COUNT


@pytest.mark.parametrize("Hq,Hkv,D,Dv,BS", [(4, 2, 32, 32, 16), (3, 1, 20, 12, 5), (2, 2, 64, 48, 8)])
def test_emulated_kv_write(e8, Hq, Hkv, D, Dv, BS):
    """The cuda write kernel: V codes and scales bit for bit as the reference's; K's codes the
    reference quantization of the same kernel's FP32 keys (an FP32 cache's write)."""
    from cuda_emu import emu_backend

    rng = np.random.default_rng(8)
    NB, n = 7, 23
    qkv = (rng.standard_normal((n, (Hq + Hkv) * D + Hkv * Dv)) * 3).astype(np.float32)
    qkv[3, (Hq + Hkv) * D:] = 0.0                                      # an all-zero value row: scale 0
    norms = (rng.standard_normal(D).astype(np.float32), rng.standard_normal(D).astype(np.float32))
    slots = rng.permutation(NB * BS)[:n].astype(np.int32)
    _, kr, vr, sr = _write(R8, qkv, Hq, Hkv, D, Dv, NB, BS, slots, norms)
    _, ke, ve, se = _write(e8, qkv, Hq, Hkv, D, Dv, NB, BS, slots, norms)
    assert ke.dtype == ve.dtype == np.uint8
    np.testing.assert_array_equal(ve, vr)
    np.testing.assert_array_equal(se["v_scale"], sr["v_scale"])
    _, k32, _, _ = _write(emu_backend.backend("float32"), qkv, Hq, Hkv, D, Dv, NB, BS, slots, norms)
    b, o = slots // BS, slots % BS
    codes, scale = quantize_rows(np.asarray(k32)[b, o])
    np.testing.assert_array_equal(ke[b, o], codes)
    np.testing.assert_array_equal(se["k_scale"][b, o], scale)
    untouched = np.ones((NB, BS), bool)
    untouched[b, o] = False
    assert not ke[untouched].any() and not se["k_scale"][untouched].any()


def _near_tie_rows(rng, n: int, Dv: int) -> np.ndarray:
    """[n, Dv] FP32 rows whose first value makes the scale s and whose others are the FP32 values
    nearest to E4M3 midpoints times s, and their neighbours: quotients x / s whose FP32 rounding
    lands on a midpoint they are not (or is one)."""
    tab = np.sort(np.unique(e4m3_table()[np.isfinite(e4m3_table())].astype(np.float64)))
    mids = ((tab[1:] + tab[:-1]) / 2)[tab[1:] > 0]
    rows = np.empty((n, Dv), np.float32)
    for i in range(n):
        A = np.float32(rng.uniform(0.5, 2.0) * 2.0 ** rng.integers(-20, 20))
        s = np.float32(A / np.float32(448.0))
        m = rng.choice(mids, (Dv - 1) // 3)
        x = (m * np.float64(s)).astype(np.float32)
        vals = np.concatenate([x, np.nextafter(x, np.float32(np.inf)), np.nextafter(x, np.float32(0))])
        vals *= rng.choice(np.array([-1, 1], np.float32), vals.size)
        rows[i] = np.concatenate([[A], vals, np.zeros(Dv - 1 - vals.size, np.float32)])
    return rows


def test_emulated_write_rounds_near_ties_as_the_reference(e8):
    """Values on and beside E4M3 midpoints (times the row's scale): the cuda encoder's FP32
    quotient with its exact-residual tie check gives the float64 reference's codes."""
    rng = np.random.default_rng(13)
    n, D, Dv, NB, BS = 32, 8, 64, 4, 8
    qkv = np.zeros((n, 2 * D + Dv), np.float32)
    qkv[:, 2 * D:] = _near_tie_rows(rng, n, Dv)
    slots = np.arange(n, dtype=np.int32)
    _, _, vr, sr = _write(R8, qkv, 1, 1, D, Dv, NB, BS, slots)
    _, _, ve, se = _write(e8, qkv, 1, 1, D, Dv, NB, BS, slots)
    np.testing.assert_array_equal(se["v_scale"], sr["v_scale"])
    np.testing.assert_array_equal(ve, vr)


@pytest.mark.parametrize("Hq,Hkv,D,Dv,BS", [(4, 2, 32, 32, 16), (6, 2, 24, 16, 5), (16, 1, 128, 128, 16),
                                            (5, 5, 19, 13, 3)])
@pytest.mark.parametrize("window", [False, True])
@pytest.mark.parametrize("sms", [132, 1])
def test_emulated_attention_matches_the_reference(e8, emu_sm_count, Hq, Hkv, D, Dv, BS, window, sms):
    """The cuda attention over the reference's FP8 caches: 16-byte tile copies (D, Dv % 16 == 0)
    and scalar ones, split partitions merged (132 SMs) or one partition (1 SM), windows, sinks."""
    emu_sm_count(sms)
    rng = np.random.default_rng(D + Dv)
    NB = 40
    n = NB * BS
    qkv = rng.standard_normal((n, (Hq + Hkv) * D + Hkv * Dv)).astype(np.float32)
    slots = np.arange(n, dtype=np.int32)
    _, k, v, kw = _write(R8, qkv, Hq, Hkv, D, Dv, NB, BS, slots)
    S = 2
    mb = NB // S
    tables = rng.permutation(NB)[: S * mb].reshape(S, mb).astype(np.int32)
    cap = mb * BS
    row_seq = np.array([0, 0, 1, 0, 1, 1, 0], np.int32)
    row_len = np.array([1, cap, cap - 1, 17, 33 % cap + 1, 2, cap // 2 + 1], np.int32)
    q = rng.standard_normal((row_seq.size, Hq, D)).astype(np.float32)
    opt = {}
    if window:
        opt = {"row_start": np.maximum(row_len - 40, 0).astype(np.int32),
               "sinks": rng.standard_normal(Hq).astype(np.float32)}
    K, V = R8.kv_to_host(k, kw["k_scale"]), R8.kv_to_host(v, kw["v_scale"])
    want = REF.paged_attention(q, K, V, tables, row_seq, row_len, D ** -0.5, **opt)
    got = e8.paged_attention(q, k, v, tables, row_seq, row_len, D ** -0.5, **opt, **kw)
    assert_close(got, want, "float32", "emulated cuda FP8 attention")
    # the negative control: the codes read without their scales are far off
    ones = {n_: np.ones_like(a) for n_, a in kw.items()}
    bad = e8.paged_attention(q, k, v, tables, row_seq, row_len, D ** -0.5, **opt, **ones)
    with pytest.raises(AssertionError):
        assert_close(bad, want, "bfloat16", "codes without their scales")


@pytest.mark.parametrize("mode", ["exact", "draft"])
def test_emulated_proposer_drafts_as_the_reference(tiny_ckpt, e8, mode):
    """An FP8-KV proposer on the emulated kernels (eager: the planned step refuses FP8) against
    the numpy FP8-KV reference: the same drafts, and the rows alike (K / V within two E4M3 steps,
    nearly every code equal: other GEMV orders move a few roundings)."""
    pe, de = run_rounds(tiny_ckpt, e8, mode, seed=5, cuda_graphs=False)
    pn, dn = run_rounds(tiny_ckpt, NumpyBackend("fp8"), mode, seed=5)
    assert de == dn
    se, sn = (next(iter(p._states.values())) for p in (pe, pn))
    for m in range(pn.num_modules):
        re_, rn = _raw_rows(pe, se, m), _raw_rows(pn, sn, m)
        for c, sc in ((0, 2), (1, 3)):                  # K (codes, scales), then V
            x, y = dequantize(re_[c], re_[sc]), dequantize(rn[c], rn[sc])
            amax = np.abs(y).max(axis=-1, keepdims=True)
            assert (np.abs(x - y) <= 2 * REL_ERROR * np.abs(y) + 2 * SUBNORMAL_ABS * amax + 1e-6).all(), m
            assert (re_[c] == rn[c]).mean() > 0.95


def test_emulated_planned_step_is_refused(tiny_ckpt, e8):
    with pytest.raises(ValueError, match=r"cuda_graphs: the planned .* FP8 KV cache"):
        MultiModuleMtpHead.from_pretrained(tiny_ckpt, backend=e8, block_size=4, num_blocks=16)


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="no usable CUDA device")
@pytest.mark.parametrize("Hq,Hkv,D,Dv,BS", [(32, 8, 128, 128, 16), (6, 2, 24, 16, 5)])
def test_gpu_kv_write_and_attention(Hq, Hkv, D, Dv, BS):
    """On a GPU: the write kernel's V codes and scales as the reference's, K's as the reference
    quantization of the FP32 cache's keys; the attention over the reference's FP8 caches within
    the FP32 tolerance of the reference."""
    from mtpkern.backends.cuda import CudaBackend

    g8, g32 = CudaBackend(kv_dtype="fp8"), CudaBackend(kv_dtype="float32")
    rng = np.random.default_rng(12)
    NB, n = 64, 40
    qkv = (rng.standard_normal((n, (Hq + Hkv) * D + Hkv * Dv)) * 3).astype(np.float32)
    slots = rng.permutation(NB * BS)[:n].astype(np.int32)
    _, kr, vr, sr = _write(R8, qkv, Hq, Hkv, D, Dv, NB, BS, slots)
    _, kg, vg, sg = _write(g8, qkv, Hq, Hkv, D, Dv, NB, BS, slots)
    _, k32, _, _ = _write(g32, qkv, Hq, Hkv, D, Dv, NB, BS, slots)
    np.testing.assert_array_equal(g8.to_host(vg), vr)
    np.testing.assert_array_equal(g8.to_host(sg["v_scale"]), sr["v_scale"])
    b, o = slots // BS, slots % BS
    codes, scale = quantize_rows(g32.to_host(k32)[b, o])
    np.testing.assert_array_equal(g8.to_host(kg)[b, o], codes)
    np.testing.assert_array_equal(g8.to_host(sg["k_scale"])[b, o], scale)
    # the attention over the reference's caches, every slot written
    _, kr, vr, sr = _write(R8, rng.standard_normal((NB * BS, qkv.shape[1])).astype(np.float32), Hq, Hkv, D, Dv,
                           NB, BS, np.arange(NB * BS, dtype=np.int32))
    tables = rng.permutation(NB).reshape(2, NB // 2).astype(np.int32)
    cap = NB // 2 * BS
    row_seq = np.array([0, 1, 1, 0], np.int32)
    row_len = np.array([1, cap, cap // 3 + 1, cap - 5], np.int32)
    q = rng.standard_normal((4, Hq, D)).astype(np.float32)
    want = REF.paged_attention(q, R8.kv_to_host(kr, sr["k_scale"]), R8.kv_to_host(vr, sr["v_scale"]), tables,
                               row_seq, row_len, D ** -0.5)
    up = {k_: g8.from_host(v_) for k_, v_ in sr.items()}
    got = g8.paged_attention(g8.from_host(q), g8.from_host(kr), g8.from_host(vr), g8.from_host(tables),
                             g8.from_host(row_seq), g8.from_host(row_len), D ** -0.5, **up)
    assert_close(g8.to_host(got), want, "float32", "cuda FP8 attention")


@pytest.mark.parametrize("make", [NumpyBackend, CpuBackend])
def test_backends_refuse_unknown_kv_dtypes(make):
    with pytest.raises(ValueError, match=r"kv_dtype: the (numpy|cpu) backend takes 'float32' or 'fp8', got 'e5m2'"):
        make(kv_dtype="e5m2")


def test_cuda_backend_refuses_unknown_kv_dtypes():
    from mtpkern.backends.cuda import CudaBackend

    with pytest.raises(ValueError, match=r"kv_dtype: the cuda backend takes 'bfloat16' or 'float32' or 'fp8', "
                                         r"got 'e5m2'"):
        CudaBackend(kv_dtype="e5m2")


# -- proposers ---------------------------------------------------------------------------------

def _fp8_prop(ckpt, backend: str, mode: str = "exact", **kw):
    kw.setdefault("block_size", 4)
    kw.setdefault("num_blocks", 64)
    return MultiModuleMtpHead.from_pretrained(ckpt, backend=fp8_backend(backend), kv_mode=mode, **kw)


def _raw_rows(prop, st, m):
    """Module m's rows of ``st`` as stored: K / V codes and scales, in row order."""
    pool, seq = prop.modules[m].pool, st.kv[m]
    r = np.arange(seq.base * pool.block_size, seq.rows)
    blk = np.asarray(seq.blocks, np.int64)[r // pool.block_size - seq.base]
    o = r % pool.block_size
    return [np.asarray(a)[blk, o] for a in (pool.k, pool.v, pool.k_scale, pool.v_scale)]


@pytest.mark.parametrize("mode", ["exact", "draft"])
def test_pool_holds_codes_and_scales(tiny_ckpt, mode):
    prop = _fp8_prop(tiny_ckpt, "numpy", mode)
    for p in prop.pools:
        assert p.k.dtype == p.v.dtype == np.uint8
        assert p.k_scale.shape == p.k.shape[:3] and p.k_scale.dtype == np.float32
        assert len(p.planes()) == 4
        Hkv, D = p.k.shape[2:]
        assert p.block_bytes() == p.block_size * Hkv * (2 * D + 2 * 4)       # one byte a value, 4 a scale
    mem = prop.memory()
    assert mem.kv_block == prop.pools[0].block_bytes()


@pytest.mark.parametrize("mode", ["exact", "draft"])
def test_numpy_and_cpu_proposers_hold_the_same_rows(tiny_ckpt, mode):
    """After prefill, proposes and catch-ups: every V row bit for bit (codes and scales), every
    K row's codes within one step of E4M3 where FP32 differences moved a rounding (the keys
    pass a norm and RoPE computed in another order), the drafts equal."""
    pn, dn = run_rounds(tiny_ckpt, fp8_backend("numpy"), mode, seed=3)
    pc, dc = run_rounds(tiny_ckpt, fp8_backend("cpu"), mode, seed=3)
    assert dn == dc
    sn, sc = (next(iter(p._states.values())) for p in (pn, pc))
    for m in range(pn.num_modules):
        kn, vn, ksn, vsn = _raw_rows(pn, sn, m)
        kc, vc, ksc, vsc = _raw_rows(pc, sc, m)
        assert kn.shape == kc.shape and kn.shape[0] > 0
        np.testing.assert_array_equal(ksn != 0, ksc != 0)
        Kn, Kc = dequantize(kn, ksn), dequantize(kc, ksc)
        amax = np.abs(Kn).max(axis=-1, keepdims=True)
        assert (np.abs(Kn - Kc) <= 2 * REL_ERROR * np.abs(Kn) + 2 * SUBNORMAL_ABS * amax + 1e-6).all()
        assert (kn == kc).mean() > 0.97, f"module {m}: {(kn != kc).sum()} K codes differ"
        assert_close(dequantize(vc, vsc), dequantize(vn, vsn), "float32", f"module {m} V")


def _logit_recorder(prop) -> list:
    """Record every module argmax's FP64 logits (per call, in order) on ``prop``."""
    log: list = []
    for h in prop.modules:
        def argmax(normed_rows, bitmask=None, h=h, orig=h.argmax):
            log.append((h.index, np.array(h.logits(normed_rows), np.float64)))
            return orig(normed_rows, bitmask)
        h.argmax = argmax
    return log


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
@pytest.mark.parametrize("mode", ["exact", "draft"])
def test_drafts_equal_fp32_kv_outside_the_bound(tiny_ckpt, backend, mode):
    """An FP8-KV proposer and an FP32-KV one, in lockstep (the same tokens, hiddens and
    accepts): every logit within half of ``atol + rtol |top|`` (TOLERANCE["fp8_kv"], |top| the
    row's largest logit) of the FP32 cache's, so every draft equal except where the reference's
    two best logits are within ``atol + rtol |top|`` (a flip moves both). A draft that flips ends
    the round's accepts there (both). On the synthetic checkpoint the worst logit error is about
    2/3 of the half-bound (random weights: about 8 % of the top logit)."""
    tol = TOLERANCE["fp8_kv"]
    ref = MultiModuleMtpHead.from_pretrained(tiny_ckpt, backend="numpy", kv_mode=mode, block_size=4, num_blocks=64)
    fp8 = _fp8_prop(tiny_ckpt, backend, mode)
    margins = record_margins(ref)
    log_r, log_8 = _logit_recorder(ref), _logit_recorder(fp8)
    rng = np.random.default_rng(11)
    H, V = ref.config.stream_size, ref.config.vocab_size
    sr, s8 = ref.alloc_state(), fp8.alloc_state()
    n = 30
    toks, hid = rng.integers(0, V, n).tolist(), rng.standard_normal((n, H)).astype(np.float32)
    ref.prefill_drafter(toks, hid, sr)
    fp8.prefill_drafter(toks, hid, s8)
    P, flips, compared, worst = n, 0, 0, 0.0
    for _ in range(10):
        t, h = int(rng.integers(0, V)), rng.standard_normal(H).astype(np.float32)
        log_r.clear()
        log_8.clear()
        dr = ref.propose(t, h, P, 3, sr)
        d8 = fp8.propose(t, h, P, 3, s8)
        same = next((i for i in range(len(dr)) if dr[i] != d8[i]), len(dr))
        for i in range(same + (same < len(dr))):     # the steps that saw the same inputs
            (m, lr), (m8, l8) = log_r[i], log_8[i]
            assert m == m8
            err = float(np.abs(l8[-1] - lr[-1]).max())
            half = (tol.atol + tol.rtol * float(np.abs(lr[-1]).max())) / 2      # per logit: half the margin's
            worst = max(worst, err / half)
            assert err <= half, f"module {m}: logit error {err} past {half}"
            compared += 1
        if same < len(dr):
            flips += 1
            assert near_tie(margins, log_r[same][0], -1, "fp8_kv"), \
                f"draft {same} flipped ({dr[same]} vs {d8[same]}) with a margin past the bound"
        a = min(int(rng.integers(0, len(dr) + 1)), same)
        ref.after_verify(a, sr)
        fp8.after_verify(a, s8)
        hs = rng.standard_normal((a, H)).astype(np.float32)
        ref.catchup_drafter(dr[:a], hs, sr)
        fp8.catchup_drafter(dr[:a], hs, s8)
        P += 1 + a
    assert compared >= 10 and worst > 0       # (worst: the measured error's share of the bound)


# -- sharing, forks, trees, trims ----------------------------------------------------------------

@pytest.mark.parametrize("backend", ["numpy", "cpu"])
@pytest.mark.parametrize("mode", ["exact", "draft"])
def test_fork_drafts_as_its_twin(make_prop, backend, mode):
    """test_share_fork's fork / twin walk on FP8 pools: copy-on-write copies codes and scales
    (the rows compared dequantized, codes and scales through them)."""
    from test_share_fork import fork_twin

    fork_twin(make_prop(mode, fp8_backend(backend)))


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_draft_share_is_the_source(make_prop, backend):
    from test_share_fork import test_draft_prefix_share_is_the_source_at_that_point as share

    share(make_prop, fp8_backend(backend))


def test_copy_rows_moves_scales_with_codes():
    pool = BlockPool(0, 4, 4, 2, 8, R8)
    rng = np.random.default_rng(7)
    pool.k[...] = rng.integers(0, 255, pool.k.shape, dtype=np.uint8)
    pool.k_scale[...] = rng.random(pool.k_scale.shape, dtype=np.float32)
    pool.v_scale[...] = rng.random(pool.v_scale.shape, dtype=np.float32)
    src, dst = np.array([1, 2, 5], np.int32), np.array([12, 13, 14], np.int32)
    pool.copy_rows(src, dst)
    for a in (pool.k, pool.v, pool.k_scale, pool.v_scale):
        flat = a.reshape((16,) + a.shape[2:])
        np.testing.assert_array_equal(flat[dst], flat[src])


def _close_rows(prop, a, b):
    """The rows of states a and b alike: the same keys and scales zero alike, K and V within two
    E4M3 steps (rows computed in other forwards: other FP32 roundings, maybe another code) and
    nearly every code equal. A scale left behind by its codes (or moved without them) would put a
    row off by its ratio to another row's scale."""
    assert a.rows_per_module() == b.rows_per_module()
    for m in range(prop.num_modules):
        assert a.kv[m].keys == b.kv[m].keys
        ka, va, ksa, vsa = _raw_rows(prop, a, m)
        kb, vb, ksb, vsb = _raw_rows(prop, b, m)
        for ca, sa, cb, sb in ((ka, ksa, kb, ksb), (va, vsa, vb, vsb)):
            x, y = dequantize(ca, sa), dequantize(cb, sb)
            amax = np.abs(x).max(axis=-1, keepdims=True)
            assert (np.abs(x - y) <= 2 * REL_ERROR * np.abs(x) + 2 * SUBNORMAL_ABS * amax + 1e-6).all(), m
            np.testing.assert_allclose(sa, sb, rtol=1e-5)
            assert (ca == cb).mean() > 0.95


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
@pytest.mark.parametrize("mode", ["draft", "exact"])
def test_tree_path_equals_a_forced_chain(tiny_ckpt, backend, mode):
    """test_tree's accepted path off the greedy one on FP8 pools: the tree's lines copy their rows
    (codes and scales) into the state, which then holds what a chain forced along the path holds;
    a trim (after_verify(0)) drops rows and keeps the others' codes and scales as they were."""
    prop = _fp8_prop(tiny_ckpt, backend, mode, num_blocks=96)
    M, H, V = prop.num_modules, prop.config.hidden_size, prop.config.vocab_size
    rng = np.random.default_rng(4)
    n = 9
    toks0, hid = rng.integers(0, V, n).tolist(), rng.standard_normal((n, H)).astype(np.float32)
    a, b = prop.alloc_state(), prop.alloc_state()
    prop.prefill_drafter(toks0, hid, a)
    prop.prefill_drafter(toks0, hid, b)
    h = verify_tree_off_the_greedy_path(prop, a, b, rng, mode, _close_rows)
    before = [_raw_rows(prop, b, m) for m in range(M)]
    prop.propose(int(rng.integers(0, V)), h, b.next_position, M, b)
    during = [_raw_rows(prop, b, m)[0].shape[0] for m in range(M)]
    prop.after_verify(0, b)                                  # the trim of the drafts' rows
    assert sum(_raw_rows(prop, b, m)[0].shape[0] for m in range(M)) < sum(during)
    for m in range(M):
        for x, y in zip(_raw_rows(prop, b, m), before[m]):       # the rows before the propose: as they were
            assert x.shape[0] >= y.shape[0]
            np.testing.assert_array_equal(x[:y.shape[0]], y)
    prop.check_invariants()


# -- refusals ------------------------------------------------------------------------------------

@pytest.mark.parametrize("ckpt,what", [("mla_ckpt", r"uses MLA \(kv_lora_rank 40\)"),
                                       ("dsa_ckpt", r"uses MLA \(kv_lora_rank 40, with a DSA indexer\)"),
                                       ("hc_ckpt", r"has hyper-connections \(hc_mult 4\)")])
def test_refusals_name_the_module_and_leave_nothing(request, monkeypatch, ckpt, what):
    made = []
    orig = BlockPool.__init__

    def counting(self, *a, **kw):
        made.append(self)
        orig(self, *a, **kw)

    monkeypatch.setattr(BlockPool, "__init__", counting)
    with pytest.raises(ValueError, match=r"kv_dtype: 'fp8' is implemented for GQA attention on one rank; "
                                         r"module 0's block " + what):
        MultiModuleMtpHead.from_pretrained(request.getfixturevalue(ckpt), backend=NumpyBackend("fp8"),
                                           block_size=4, num_blocks=16)
    assert made == []                                   # refused before any pool was allocated


def test_refusals_of_v4_attention_and_shards(tiny_cfg):
    import dataclasses

    b = tiny_cfg.block(0)
    with pytest.raises(ValueError, match=r"module 2's block uses DeepSeek-V4's attention \(shared_kv True"):
        check_fp8_kv(dataclasses.replace(b, shared_kv=True), 2)
    with pytest.raises(ValueError, match=r"module 0's block is one rank's shard of a sharded head"):
        check_fp8_kv(b, 0, sharded=True)
    check_fp8_kv(b, 0)                                  # GQA: taken


def test_pool_refuses_latent_rows():
    with pytest.raises(ValueError, match=r"kv_dtype: 'fp8'.*module 1's pool holds MLA latent rows"):
        BlockPool(1, 4, 4, 1, 8, R8, latent_width=16)
