"""The 4-bit and MX weight formats beside DeepSeek-V4's FP4 (docs/fp4.md, docs/fp8.md):

- MXFP4: E2M1 codes two a byte, an E8M0 scale per 32 weights: ``Fp4Weight`` itself;
- NVFP4: the same codes, an E4M3 scale per 16 weights and an FP32 global scale applied per
  output row: ``Fp4Weight(data, scale, global_scale)``;
- MXFP8: E4M3 codes with an E8M0 scale per 32 along K: ``Fp8Weight`` with block (1, 32).

Each weight against its dequantized twin: bit for bit in the reference and on cpu (it decodes a
chunk into FP32 and runs the same dot), within the float32 tolerance on the cuda kernels run on
the CPU emulator (MXFP8; NVFP4 in tests/test_cuda_emulated.py); the cuda holder of NVFP4 here.
"""

from __future__ import annotations

import zlib

import ml_dtypes
import numpy as np
import pytest

from mtpkern import Fp8Weight
from mtpkern.backends import get_backend
from mtpkern.ops.moe import RouterSpec
from mtpkern.quant import Fp4Weight, e2m1_table, e4m3_table, unpack_e2m1
from mtpkern.tolerance import assert_close

F8 = np.dtype(ml_dtypes.float8_e4m3fn)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)


def rng_for(*key) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def rand_nvfp4(rng, shape, pow2_global: bool = True) -> Fp4Weight:
    """Random codes (all 16) with E4M3 scales near 1 / (6 sqrt(K)) (normal codes, 0x20..0x3F)
    and a row scale per matrix (a power of two unless ``pow2_global`` is False)."""
    *lead, N, K = shape
    data = rng.integers(0, 256, (*lead, N, K // 2), dtype=np.uint8)
    scale = rng.integers(0x20, 0x40, (*lead, N, -(-K // 16)), dtype=np.uint8)
    g = np.float32(2.0 ** -3) if pow2_global else np.float32(0.1234567)
    return Fp4Weight(data, scale, np.full((*lead, N), g, np.float32))


def rand_mxfp8(rng, shape) -> Fp8Weight:
    """Random finite E4M3 codes with E8M0 scales per (1, 32) block (powers of two): exact."""
    *lead, N, K = shape
    mag = rng.integers(0x20, 0x48, (*lead, N, K), dtype=np.uint8)          # 2^-3 .. 2^1.9: normal codes
    data = mag | (rng.integers(0, 2, mag.shape, dtype=np.uint8) << 7)
    scale = rng.integers(122, 125, (*lead, N, -(-K // 32)), dtype=np.uint8).view(E8M0)
    return Fp8Weight(data, scale, (1, 32))


# -- the reference -------------------------------------------------------------------------------

def test_nvfp4_dequantizes_as_its_definition():
    """w[n, k] = (e2m1(code) * e4m3(scale[n, k // 16])) * global[n], low nibble the even column,
    one rounding: equal bit for bit to the formula written out by hand."""
    rng = rng_for("nv-def")
    w = rand_nvfp4(rng, (5, 40), pow2_global=False)
    codes = np.empty((5, 40), np.uint8)
    codes[:, 0::2], codes[:, 1::2] = w.data & 15, w.data >> 4
    want = np.empty((5, 40), np.float32)
    for n in range(5):
        for k in range(40):
            prod = np.float32(e2m1_table()[codes[n, k]] * e4m3_table()[w.scale[n, k // 16]])
            want[n, k] = prod * w.global_scale[n]
    np.testing.assert_array_equal(w.dequantize(), want)
    assert w.fmt == "nvfp4" and w.block == 16 and w.nbytes == 5 * 20 + 5 * 3 + 5 * 4
    # negative controls: the global scale, the nibble order and the block size each change the weight
    assert not np.array_equal(Fp4Weight(w.data, w.scale, np.ones(5, np.float32)).dequantize(), want)
    swapped = ((w.data >> 4) | (w.data << 4)).astype(np.uint8)
    assert not np.array_equal(Fp4Weight(swapped, w.scale, w.global_scale).dequantize(), want)


def test_nvfp4_fields_refused_by_name():
    d = np.zeros((4, 16), np.uint8)                                   # K = 32
    with pytest.raises(ValueError, match=r"scale: expected shape \[4, 2\] \(one per 16 weights along K\)"):
        Fp4Weight(d, np.zeros((4, 1), np.uint8), np.ones(4, np.float32))       # MXFP4's block of 32
    with pytest.raises(ValueError, match=r"scale: expected shape \[4, 1\] \(one per 32 weights along K\)"):
        Fp4Weight(d, np.zeros((4, 2), np.uint8))                               # NVFP4's block of 16 as MXFP4
    with pytest.raises(ValueError, match=r"scale: expected finite E4M3 codes, got 1 NaN code"):
        Fp4Weight(d, np.array([[0x38, 0x7F]] + [[0x38, 0x38]] * 3, np.uint8), np.ones(4, np.float32))
    with pytest.raises(ValueError, match=r"global_scale: expected finite values"):
        Fp4Weight(d, np.zeros((4, 2), np.uint8), np.array([1, 1, np.inf, 1], np.float32))
    with pytest.raises(ValueError, match=r"global_scale: expected shape \[4\]"):
        Fp4Weight(d, np.zeros((4, 2), np.uint8), np.ones(3, np.float32))
    with pytest.raises(TypeError, match=r"scale: expected dtype uint8 or float8_e4m3fn"):
        Fp4Weight(d, np.zeros((4, 2), np.float32), np.ones(4, np.float32))
    one = Fp4Weight(d, np.zeros((4, 2), np.uint8).view(F8), np.array([0.5], np.float32))   # one per tensor
    assert one.global_scale.shape == (4,) and (one.global_scale == 0.5).all()


def test_nvfp4_concat_stack_rows_cols_keep_each_row_scale():
    rng = rng_for("nv-cat")
    a, b = rand_nvfp4(rng, (3, 64)), rand_nvfp4(rng, (5, 64), pow2_global=False)
    c = Fp4Weight.concat([a, b])
    np.testing.assert_array_equal(c.dequantize(), np.concatenate([a.dequantize(), b.dequantize()]))
    s = Fp4Weight.stack([c, c])
    np.testing.assert_array_equal(s.expert(1).dequantize(), c.dequantize())
    np.testing.assert_array_equal(s.rows(2, 6).dequantize(), s.dequantize()[:, 2:6])
    np.testing.assert_array_equal(c.cols(16, 48).dequantize(), c.dequantize()[:, 16:48])
    with pytest.raises(ValueError, match=r"cols: expected a range of whole 16-weight scale blocks"):
        c.cols(8, 64)
    mx = Fp4Weight.quantize(np.ones((2, 64), np.float32))
    with pytest.raises(ValueError, match=r"parts\[1\]: expected nvfp4, got mxfp4"):
        Fp4Weight.concat([a, mx])


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_quantize_round_trips_within_the_format(fmt):
    rng = rng_for("q", fmt)
    w = rng.standard_normal((2, 7, 48)).astype(np.float32)
    q = Fp4Weight.quantize(w, fmt)
    assert q.fmt == fmt and q.shape == (2, 7, 48)
    again = Fp4Weight.quantize(q.dequantize(), fmt)                     # representable values stay exact
    np.testing.assert_array_equal(again.dequantize(), q.dequantize())
    assert np.abs(q.dequantize() - w).max() <= 0.25 * np.abs(w).max()


def test_mxfp8_is_fp8_with_e8m0_scales_per_32():
    rng = rng_for("mx8")
    w = rand_mxfp8(rng, (3, 70))                                        # K = 70: a partial last block
    assert w.block == (1, 32) and w.scale.shape == (3, 3) and w.scale.dtype == np.float32
    codes, s = w.data, w.scale
    want = e4m3_table()[codes] * np.repeat(s, 32, axis=1)[:, :70]
    np.testing.assert_array_equal(w.dequantize(), want)


# -- the backends --------------------------------------------------------------------------------

def _gemv_calls(be, rng, H):
    n, I, E, K, V = 3, 40, 5, 2, 300
    x, g = rng.standard_normal((n, H)).astype(np.float32), rng.standard_normal((n, H)).astype(np.float32)
    ids = np.array([[0, 4], [2, 1], [4, 3]], np.int32)
    wts = rng.random((n, K)).astype(np.float32)
    embed = be.prepare_weight(rng.standard_normal((7, H)).astype(np.float32))
    tokens = np.array([1, 6, 0], np.int32)
    vec, f = be.prepare_vector, be.from_host
    spec = RouterSpec(top_k=3, n_group=2, topk_group=1, routed_scaling_factor=1.5, norm_topk_prob=True)
    bias, res = rng.standard_normal(37).astype(np.float32), rng.standard_normal((n, 37)).astype(np.float32)
    shapes = {"w": (37, H), "eh": (H, 2 * H), "w13": (2 * I, H), "w2": (H, I), "e13": (E, 2 * I, H),
              "e2": (E, H, I), "gate": (16, H), "head": (V, H)}
    calls = {
        "linear": lambda w: be.linear(f(x), w["w"], vec(bias), f(res)),
        "mtp_input": lambda w: be.mtp_input(embed, f(tokens), f(g), vec(np.ones(H)), vec(np.ones(H)), w["eh"], 1e-5),
        "swiglu_mlp": lambda w: be.swiglu_mlp(f(x), w["w13"], w["w2"], f(g)),
        "moe_experts": lambda w: be.moe_experts(f(x), f(ids), f(wts), w["e13"], w["e2"]),
        "moe_router": lambda w: be.moe_router(f(x), w["gate"], vec(np.zeros(16)), spec)[1],
        "lm_head_logits": lambda w: be.lm_head_logits(f(x), w["head"]),
        "lm_head_argmax": lambda w: be.lm_head_argmax(f(x), w["head"]),
    }
    return shapes, calls


@pytest.mark.parametrize("H", [64, 2 * 50])
def test_nvfp4_on_cpu_equals_its_dequantized_fp32_weights(H):
    """Every GEMV family with NVFP4 weights (codes at half a byte, E4M3 scale bytes as stored, the
    row scale folded into the decoded chunk) equals the cpu backend's GEMV of the dequantized FP32
    weight bit for bit, and the reference within the float32 tolerance. H = 100 ends on a partial
    16-column block and mtp_input's second half starts inside one."""
    be = get_backend("cpu")
    rng = rng_for("nv-cpu", H)
    shapes, calls = _gemv_calls(be, rng, H)
    nv = {k: rand_nvfp4(rng, s, pow2_global=(k != "w")) for k, s in shapes.items()}
    as4 = {k: be.prepare_weight(w) for k, w in nv.items()}
    as32 = {k: be.prepare_weight(w.dequantize()) for k, w in nv.items()}
    ref = get_backend("numpy")
    ref_w = {k: ref.prepare_weight(w) for k, w in nv.items()}
    _, ref_calls = _gemv_calls(ref, rng_for("nv-cpu", H), H)
    assert as4["e13"].nbytes == nv["e13"].nbytes < nv["e13"].dequantize().nbytes // 6
    for name, call in calls.items():
        got = be.to_host(call(as4))
        np.testing.assert_array_equal(got, be.to_host(call(as32)), err_msg=f"{name}: NVFP4 vs its FP32 weights")
        want = ref.to_host(ref_calls[name](ref_w))
        if name == "lm_head_argmax":
            np.testing.assert_array_equal(got, want)
        else:
            assert_close(got, want, what=f"{name}: cpu NVFP4 vs the reference")


@pytest.mark.parametrize("k0,K", [(0, 64), (6, 40), (16, 32), (3, 29), (5, 30), (34, 2)])
def test_nvfp4_rows_decode_any_column_range_bit_for_bit(k0, K):
    """The cpu kernels' NVFP4 decode (two vectorised loops for an even start and width, one
    nibble at a time otherwise) equals the dequantized weight bit for bit over a column range
    that starts and ends inside 16-column scale blocks, with subnormal-scale codes, a row
    scale no power of two and every code (the sign of -0 included)."""
    from mtpkern.backends.cpu_kernels.linear import _E4M3_TABLE, nvfp4_rows

    rng = rng_for("nv-rows", k0, K)
    w = rand_nvfp4(rng, (5, 96), pow2_global=False)
    w.scale[0, :] = rng.integers(1, 8, w.scale.shape[1], dtype=np.uint8)      # subnormal E4M3 scales
    w.data[1, :] = np.arange(48, dtype=np.uint8) % 16 * 17                   # every code, -0 among them
    out = np.full((4, K), np.nan, np.float32)
    nvfp4_rows(w.data, w.scale, w.global_scale, _E4M3_TABLE, 0, 4, k0, out)
    want = w.dequantize()[0:4, k0:k0 + K]
    np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32))


def test_nvfp4_row_scale_reaches_the_cpu_kernels():
    """Negative control: the same codes and block scales with another global scale give another
    result on cpu (the row scale is applied, not dropped)."""
    be = get_backend("cpu")
    rng = rng_for("nv-g")
    w = rand_nvfp4(rng, (16, 64))
    x = rng.standard_normal((2, 64)).astype(np.float32)
    a = be.linear(x, be.prepare_weight(w))
    b = be.linear(x, be.prepare_weight(Fp4Weight(w.data, w.scale, w.global_scale * 2)))
    np.testing.assert_array_equal(b, 2 * a)


def test_mxfp8_on_cpu_within_tolerance_of_the_reference():
    be, ref = get_backend("cpu"), get_backend("numpy")
    rng = rng_for("mx8-cpu")
    w = rand_mxfp8(rng, (37, 100))
    x = rng.standard_normal((3, 100)).astype(np.float32)
    assert_close(be.linear(x, be.prepare_weight(w)), ref.linear(x, ref.prepare_weight(w)), what="MXFP8 linear")
    e = Fp8Weight.stack([w, rand_mxfp8(rng, (37, 100))])
    ids, wts = np.array([[0, 1]] * 3, np.int32), np.full((3, 2), 0.5, np.float32)
    e2 = Fp8Weight.stack([rand_mxfp8(rng, (100, 18)), rand_mxfp8(rng, (100, 18))])
    e13 = Fp8Weight.stack([rand_mxfp8(rng, (36, 100)), rand_mxfp8(rng, (36, 100))])
    del e
    assert_close(be.moe_experts(x, ids, wts, be.prepare_weight(e13), be.prepare_weight(e2)),
                 ref.moe_experts(x, ids, wts, ref.prepare_weight(e13), ref.prepare_weight(e2)), what="MXFP8 experts")


def test_cuda_holds_nvfp4_as_row_records():
    """prepare_weight's NVFP4 form on the cuda backend (CudaNvFp4): the codes as stored, and per
    row a record of its FP32 row scale, its E4M3 codes and zero padding to 4 bytes."""
    from mtpkern.backends.cuda_launch._util import CudaFp4, CudaNvFp4, ctype, nvfp4_record_bytes

    w = rand_nvfp4(rng_for("nv-cuda"), (4, 40), pow2_global=False)       # 3 codes a row: padded to 4
    d = CudaFp4.from_weight(w, np.asarray)
    assert type(d) is CudaNvFp4 and (d.bn, d.bk) == (1, 16) and d.shape == (4, 40) and ctype(d) == "nvfp4x2_e2m1"
    assert nvfp4_record_bytes(40) == 8 and d.scale.shape == (4, 8)
    np.testing.assert_array_equal(d.data, w.data)
    np.testing.assert_array_equal(d.row_scale, w.global_scale)
    np.testing.assert_array_equal(d.scale[:, 4:7], w.scale)
    assert not d.scale[:, 7].any()
    e = CudaNvFp4.from_weight(Fp4Weight.stack([w, w]), np.asarray)
    assert e.scale.shape == (2, 4, 8) and e.shape == (2, 4, 40)
    with pytest.raises(TypeError, match=r"expected an NVFP4 weight .* got an MXFP4 weight \[4, 32\]"):
        CudaNvFp4.from_weight(Fp4Weight.quantize(np.ones((4, 32))), np.asarray)
    assert type(CudaFp4.from_weight(Fp4Weight.quantize(np.ones((4, 32))), np.asarray)) is CudaFp4   # MXFP4


@pytest.fixture(scope="module")
def emulator():
    from cuda_emu import emu_backend
    yield from emu_backend.installed_emulator()


def test_mxfp8_and_mxfp4_on_emulated_cuda(emulator):
    """The cuda GEMV with block (1, 32) FP8 scales (E8M0 widened to FP32) and with an MXFP4
    weight, on the CPU emulator, against the reference: within the float32 tolerance."""
    from cuda_emu import emu_backend

    be, ref = emu_backend.backend("float32"), get_backend("numpy")
    rng = rng_for("mx-emu")
    x = rng.standard_normal((2, 64)).astype(np.float32)
    for w in (rand_mxfp8(rng, (9, 64)), Fp4Weight.quantize(rng.standard_normal((9, 64)))):
        got = be.to_host(be.linear(be.from_host(x), be.prepare_weight(w)))
        assert_close(got, ref.linear(x, ref.prepare_weight(w)), what=f"{type(w).__name__} linear on cuda")
