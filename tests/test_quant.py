"""``mtpkern.quant.Fp8Weight``: validation (field, expected, got), the reference
dequantization, quantize, concat (re-blocking) and stack."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from mtpkern import Fp8Weight
from mtpkern.quant import E4M3_MAX, e4m3_table

F8 = ml_dtypes.float8_e4m3fn


def test_table_is_ml_dtypes_e4m3fn():
    t = e4m3_table()
    codes = np.arange(256, dtype=np.uint8)
    want = codes.view(F8).astype(np.float32)
    assert np.array_equal(np.isnan(t), np.isnan(want)) and np.isnan(t[[0x7F, 0xFF]]).all()
    ok = ~np.isnan(want)
    np.testing.assert_array_equal(t[ok], want[ok])
    assert t[0x7E] == E4M3_MAX and t[0xFE] == -E4M3_MAX
    assert t[0x80] == 0 and np.signbit(t[0x80])
    np.testing.assert_array_equal(t[1:8], np.arange(1, 8) * 2.0**-9)       # subnormals
    assert t[0x08] == 2.0**-6


@pytest.mark.parametrize("block", [(128, 128), (16, 32), (1, 1000), None])
@pytest.mark.parametrize("shape", [(300, 1000), (1, 1), (3, 129, 17)])
def test_dequantize_is_code_times_scale(block, shape):
    rng = np.random.default_rng(len(shape))
    data = rng.integers(0, 256, shape, dtype=np.uint8)
    *lead, N, K = shape
    sshape = (*lead, N) if block is None else (*lead, -(-N // block[0]), -(-K // block[1]))
    scale = rng.random(sshape).astype(np.float32) + 0.5
    w = Fp8Weight(data, scale, block)
    got = w.dequantize()
    assert got.dtype == np.float32 and got.shape == shape
    idx = np.indices(shape).reshape(len(shape), -1)
    *li, n, k = idx
    s = scale[(*li, n)] if block is None else scale[(*li, n // block[0], k // block[1])]
    want = (data.reshape(-1).view(F8).astype(np.float32) * s).reshape(shape)
    np.testing.assert_array_equal(got, want)                                   # NaN == NaN here
    assert w.nbytes == data.nbytes + scale.nbytes and w.shape == shape


def test_float8_data_and_per_channel_n_by_1_are_accepted():
    rng = np.random.default_rng(0)
    w32 = rng.standard_normal((5, 7)).astype(np.float32)
    codes = w32.astype(F8)
    s = np.full((5, 1), 0.5, np.float32)                                      # compressed-tensors' layout
    w = Fp8Weight(codes, s, None)
    assert w.data.dtype == np.uint8 and w.scale.shape == (5,)
    np.testing.assert_array_equal(w.dequantize(), codes.astype(np.float32) * 0.5)
    bf = Fp8Weight(codes, s.astype(ml_dtypes.bfloat16), None)                 # BF16 scales widen exactly
    assert bf.scale.dtype == np.float32


@pytest.mark.parametrize("kw,exc,match", [
    (dict(data=np.zeros((4, 8), np.float32)), TypeError, r"data: expected dtype uint8 .* got float32"),
    (dict(data=[[1, 2]]), TypeError, r"data: expected a NumPy array .* got list"),
    (dict(data=np.zeros(8, np.uint8)), ValueError, r"data: expected \[N, K\] or stacked experts \[E, N, K\], got shape \[8\]"),
    (dict(scale=np.ones((2, 1), np.float32)), ValueError,
     r"scale: expected shape \[1, 1\] for data \[4, 8\] with block \(128, 128\), got \[2, 1\]"),
    (dict(scale=np.ones((1, 1), np.float64)), TypeError, r"scale: expected dtype float32 .* got float64"),
    (dict(scale=np.full((1, 1), np.inf, np.float32)), ValueError, r"scale: expected finite values, got 1 non-finite"),
    (dict(block=(0, 128)), ValueError, r"block: expected \(bn, bk\) of positive ints or None .* got \(0, 128\)"),
    (dict(block=(128,)), ValueError, r"block: expected \(bn, bk\)"),
    (dict(block=None), ValueError, r"scale: expected shape \[4\] for data \[4, 8\] with per-channel scales, got \[1, 1\]"),
])
def test_bad_fields_say_which_expected_and_got(kw, exc, match):
    args = dict(data=np.zeros((4, 8), np.uint8), scale=np.ones((1, 1), np.float32), block=(128, 128))
    args.update(kw)
    with pytest.raises(exc, match=match):
        Fp8Weight(**args)


def test_stacked_scales_are_checked_per_expert():
    with pytest.raises(ValueError, match=r"scale: expected shape \[3, 2, 1\] for data \[3, 200, 64\]"):
        Fp8Weight(np.zeros((3, 200, 64), np.uint8), np.ones((2, 2, 1), np.float32), (128, 128))
    w = Fp8Weight(np.zeros((3, 200, 64), np.uint8), np.ones((3, 2, 1), np.float32), (128, 128))
    assert w.shape == (3, 200, 64) and w.ndim == 3


@pytest.mark.parametrize("block", [(128, 128), (8, 16), None])
def test_quantize_rounds_to_nearest_with_amax_scales(block):
    rng = np.random.default_rng(1)
    w32 = rng.standard_normal((200, 300)).astype(np.float32)
    w32[:8] = 0.0                                                            # an all-zero block row
    q = Fp8Weight.quantize(w32, block)
    per = q.scale_per_element()
    np.testing.assert_array_equal(q.data.view(F8), (w32 / per).astype(F8))
    assert np.abs(q.data.view(F8).astype(np.float32)).max() <= E4M3_MAX
    assert (np.abs(q.dequantize() - w32) <= np.abs(w32) * 2.0**-4 + per * 2.0**-9).all()
    if block is None:
        np.testing.assert_array_equal(q.scale[8:], np.abs(w32[8:]).max(axis=1) / np.float32(E4M3_MAX))
    if block != (128, 128):                                                  # rows 0..7 are whole blocks
        assert (q.scale[0] == 1.0).all()


def test_concat_keeps_values_and_refines_shifted_blocks():
    rng = np.random.default_rng(2)
    parts = [Fp8Weight.quantize(rng.standard_normal((n, 200)).astype(np.float32), (128, 128))
             for n in (256, 100, 50)]
    c = Fp8Weight.concat(parts)
    assert c.shape == (406, 200) and c.block == (4, 128)                      # gcd(128, 256, 100)
    np.testing.assert_array_equal(c.dequantize(), np.concatenate([p.dequantize() for p in parts]))
    aligned = Fp8Weight.concat(parts[:1] + parts[2:])
    assert aligned.block == (128, 128) and aligned.scale.shape == (3, 2)
    ch = [Fp8Weight.quantize(rng.standard_normal((n, 20)).astype(np.float32), None) for n in (3, 5)]
    np.testing.assert_array_equal(Fp8Weight.concat(ch).dequantize(), np.concatenate([p.dequantize() for p in ch]))
    with pytest.raises(ValueError, match=r"parts\[1\]: expected block \(128, 128\), got None"):
        Fp8Weight.concat([parts[0], Fp8Weight.quantize(np.ones((3, 200), np.float32), None)])
    with pytest.raises(ValueError, match=r"parts\[1\]: expected \[\*, 200\], got \[3, 20\]"):
        Fp8Weight.concat([parts[0], Fp8Weight.quantize(np.ones((3, 20), np.float32))])


def test_stack_experts():
    rng = np.random.default_rng(3)
    ex = [Fp8Weight.quantize(rng.standard_normal((130, 70)).astype(np.float32)) for _ in range(3)]
    s = Fp8Weight.stack(ex)
    assert s.shape == (3, 130, 70) and s.scale.shape == (3, 2, 1)
    np.testing.assert_array_equal(s.dequantize(), np.stack([e.dequantize() for e in ex]))
    with pytest.raises(ValueError, match=r"parts\[1\]: expected \[130, 70\]"):
        Fp8Weight.stack([ex[0], Fp8Weight.quantize(np.ones((129, 70), np.float32))])
    with pytest.raises(TypeError, match=r"parts\[0\]: expected an Fp8Weight, got ndarray"):
        Fp8Weight.stack([np.zeros((2, 2))])
