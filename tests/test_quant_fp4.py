"""``mtpkern.quant.Fp4Weight``: the E2M1 / E8M0 tables against ml_dtypes, the nibble order,
validation (field, expected, got), the reference dequantization, quantize, concat and stack."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from mtpkern.quant import (E8M0_MAX_CODE, FP4_BLOCK, Fp4Weight, Fp8Weight, e2m1_table, e8m0_table, pack_e2m1,
                           unpack_e2m1)


def test_e2m1_table_is_exact_and_matches_ml_dtypes():
    t = e2m1_table()
    np.testing.assert_array_equal(t[:8], [0, 0.5, 1, 1.5, 2, 3, 4, 6])
    np.testing.assert_array_equal(t[8:], -t[:8])
    assert np.signbit(t[8]) and t[8] == 0
    want = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(t, want)


def test_e8m0_table_is_two_to_the_code_minus_127():
    t = e8m0_table()
    want = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    np.testing.assert_array_equal(t[:255], want[:255])
    assert np.isnan(t[255]) and t[127] == 1.0 and t[0] == 2.0**-127 and t[254] == 2.0**127


def test_low_nibble_is_the_even_column():
    codes = np.array([[1, 2, 3, 4]], np.uint8)                 # 0.5, 1, 1.5, 2
    packed = pack_e2m1(codes)
    np.testing.assert_array_equal(packed, [[0x21, 0x43]])
    np.testing.assert_array_equal(unpack_e2m1(packed), codes)
    w = Fp4Weight(packed, np.full((1, 1), 127, np.uint8))
    np.testing.assert_array_equal(w.dequantize(), [[0.5, 1.0, 1.5, 2.0]])


@pytest.mark.parametrize("shape", [(3, 64), (1, 2), (7, 70), (2, 5, 96)])
def test_dequantize_is_code_times_power_of_two(shape):
    rng = np.random.default_rng(len(shape) + shape[-1])
    *lead, N, K = shape
    data = rng.integers(0, 256, (*lead, N, K // 2), dtype=np.uint8)
    scale = rng.integers(100, 140, (*lead, N, -(-K // FP4_BLOCK)), dtype=np.uint8)
    w = Fp4Weight(data, scale)
    got = w.dequantize()
    assert got.dtype == np.float32 and got.shape == shape and w.shape == shape
    codes = unpack_e2m1(data)
    idx = np.indices(shape)
    s = scale[(*idx[:-1], idx[-1] // FP4_BLOCK)]
    want = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float64) * np.exp2(s.astype(np.float64) - 127)
    np.testing.assert_array_equal(got, want.astype(np.float32))
    np.testing.assert_array_equal(got.astype(np.float64), want)          # exact in FP32
    assert w.nbytes == data.nbytes + scale.nbytes


def test_int8_data_and_e8m0_scales_are_viewed_as_bytes():
    data = np.array([[-1, 0x10]], np.int8)                              # 0xFF: -6, -6; 0x10: 0, 0.5
    scale = np.array([[128]], np.uint8).view(ml_dtypes.float8_e8m0fnu)  # 2
    w = Fp4Weight(data, scale)
    assert w.data.dtype == np.uint8 and w.scale.dtype == np.uint8
    np.testing.assert_array_equal(w.dequantize(), [[-12.0, -12.0, 0.0, 1.0]])


@pytest.mark.parametrize("kw,exc,match", [
    (dict(data=np.zeros((4, 8), np.float32)), TypeError, r"data: expected dtype uint8 or int8 .* got float32"),
    (dict(data=[[1, 2]]), TypeError, r"data: expected a NumPy array .* got list"),
    (dict(data=np.zeros(8, np.uint8)), ValueError, r"data: expected \[N, K / 2\] .* got shape \[8\]"),
    (dict(scale=np.ones((4, 2), np.uint8)), ValueError,
     r"scale: expected shape \[4, 1\] \(one per 32 weights along K\) for data \[4, 8\] \(K = 16\), got \[4, 2\]"),
    (dict(scale=np.ones((4, 1), np.float32)), TypeError, r"scale: expected dtype uint8 or float8_e8m0fnu .* got float32"),
    (dict(scale=np.full((4, 1), 0xFF, np.uint8)), ValueError, r"scale: expected E8M0 codes 0\.\.252, got 4 NaN code"),
    (dict(scale=np.full((4, 1), 253, np.uint8)), ValueError, r"scale: expected E8M0 codes 0\.\.252, got 4 above"),
])
def test_bad_fields_say_which_expected_and_got(kw, exc, match):
    args = dict(data=np.zeros((4, 8), np.uint8), scale=np.full((4, 1), 127, np.uint8))
    args.update(kw)
    with pytest.raises(exc, match=match):
        Fp4Weight(**args)


def test_largest_scale_stays_finite():
    w = Fp4Weight(np.full((1, 16), 0x77, np.uint8), np.full((1, 1), E8M0_MAX_CODE, np.uint8))
    assert np.isfinite(w.dequantize()).all() and w.dequantize().max() == 6 * 2.0**125


def test_quantize_rounds_to_nearest_with_power_of_two_scales():
    rng = np.random.default_rng(1)
    w32 = rng.standard_normal((20, 100)).astype(np.float32)
    w32[0, :32] = 0.0                                                     # an all-zero block: scale 2^0
    q = Fp4Weight.quantize(w32)
    assert q.scale[0, 0] == 127
    s = np.repeat(e8m0_table()[q.scale], FP4_BLOCK, axis=-1)[:, :100]
    np.testing.assert_array_equal(unpack_e2m1(q.data), (w32 / s).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 15)
    assert (np.abs(w32 / s) <= 6).all()                                   # amax / scale <= 6: no clipping
    assert (np.abs(q.dequantize() - w32) <= s).all()                      # half a step of at most 2 * scale


def test_concat_stack_rows_cols():
    rng = np.random.default_rng(2)
    a, b = (Fp4Weight.quantize(rng.standard_normal((n, 96)).astype(np.float32)) for n in (5, 3))
    c = Fp4Weight.concat([a, b])
    np.testing.assert_array_equal(c.dequantize(), np.concatenate([a.dequantize(), b.dequantize()]))
    s = Fp4Weight.stack([a, a])
    assert s.shape == (2, 5, 96) and s.scale.shape == (2, 5, 3)
    np.testing.assert_array_equal(s.expert(1).dequantize(), a.dequantize())
    np.testing.assert_array_equal(s.rows(1, 3).dequantize(), s.dequantize()[:, 1:3])
    np.testing.assert_array_equal(a.cols(32, 96).dequantize(), a.dequantize()[:, 32:])
    with pytest.raises(ValueError, match=r"cols: expected a range of whole 32-weight scale blocks of K = 96, got 16:96"):
        a.cols(16, 96)
    with pytest.raises(ValueError, match=r"parts\[1\]: expected \[\*, 96\], got \[3, 64\]"):
        Fp4Weight.concat([a, Fp4Weight.quantize(np.ones((3, 64), np.float32))])
    with pytest.raises(TypeError, match=r"parts\[0\]: expected an Fp4Weight, got Fp8Weight"):
        Fp4Weight.stack([Fp8Weight.quantize(np.ones((3, 64), np.float32))])


def test_fp8_weight_takes_e8m0_scales_exactly():
    codes = np.full((4, 8), 0x38, np.uint8)                              # E4M3 1.0
    s = np.array([[126]], np.uint8).view(ml_dtypes.float8_e8m0fnu)       # 0.5
    w = Fp8Weight(codes, s, (128, 128))
    assert w.scale.dtype == np.float32 and w.scale[0, 0] == 0.5
    with pytest.raises(ValueError, match="scale: expected finite values"):
        Fp8Weight(codes, np.array([[255]], np.uint8).view(ml_dtypes.float8_e8m0fnu), (128, 128))
