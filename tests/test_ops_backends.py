"""Every fast backend against the NumPy reference (the specification), op by op.

Shapes are odd on purpose (n in 1, 3, 17; H up to 1000; V = 1, 33, 1000, not
multiples of 32; E in several groups). Weights are BF16, FP32 or FP8 E4M3 (block-128
and per-channel scales, blocks cut short by N and K; every subnormal code, zeros and
+-448 planted) and the reference runs on the same values (BF16-rounded, or FP8
dequantized), so only the order of accumulation differs and the "float32" tolerance
applies to all. Move-only results (argmax ids, router ids, the V cache) are compared
exactly.

One test body serves every backend: inputs go in through ``from_host`` /
``prepare_weight`` / ``prepare_vector`` and come back through ``to_host`` /
``kv_to_host``. The cuda case runs only where a device is usable.
"""

from __future__ import annotations

import zlib

import ml_dtypes
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from mtpkern import Fp8Weight
from mtpkern.quant import Fp4Weight
from mtpkern.backends import cuda_available, get_backend
from mtpkern.errors import NoAllowedToken
from mtpkern.ops.lm_head import bitmask_allowed, masked_best
from mtpkern.ops.moe import SCORINGS, RouterSpec
from mtpkern.ops.rope_kv import inv_freq
from mtpkern.tolerance import TOLERANCE, assert_close

REF = get_backend("numpy")
WDTYPES = ["bfloat16", "float32"]
#: FP8 E4M3 weights: block-128 scales (DeepSeek-V3 / GLM-4.x) and per-channel ones (compressed-tensors)
FP8_KINDS = ["fp8_block", "fp8_channel"]
#: the weights of the GEMV families (linear, mtp_input's eh_proj, MLP, experts, router, LM head)
GEMV_WDTYPES = WDTYPES + FP8_KINDS
#: codes planted in FP8 test weights: +-0, every subnormal (m * 2^-9), the smallest normal, +-448
EDGE_CODES = np.array([0x00, 0x80, *range(0x01, 0x08), *range(0x81, 0x88), 0x08, 0x88, 0x7E, 0xFE], np.uint8)

BACKENDS = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu,
                                pytest.mark.skipif(not cuda_available(), reason="no usable CUDA device")]),
]


@pytest.fixture(scope="module", params=BACKENDS)
def be(request):
    return get_backend(request.param)


def rng_for(*key) -> np.random.Generator:
    """A generator seeded by the test's parameters (stable across runs)."""
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def acts(rng, *shape, scale=1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def weight(rng, shape, wdtype: str):
    """Host weight, scaled by 1/sqrt(fan-in) so that outputs stay O(1): a BF16 / FP32 array,
    or an ``Fp8Weight`` (``FP8_KINDS``) with 2 % of its codes replaced by ``EDGE_CODES``."""
    w = acts(rng, *shape, scale=1.0 / np.sqrt(shape[-1]))
    if wdtype in FP8_KINDS:
        q = Fp8Weight.quantize(w, (128, 128) if wdtype == "fp8_block" else None)
        codes = q.data.copy()
        planted = rng.random(codes.shape) < 0.02
        codes[planted] = rng.choice(EDGE_CODES, int(planted.sum()))
        return Fp8Weight(codes, q.scale, q.block)
    return w.astype(ml_dtypes.bfloat16) if wdtype == "bfloat16" else w


def dense(wdtype: str) -> str:
    """The dtype for a weight that stays BF16 / FP32 beside FP8 ones (the embedding table)."""
    return wdtype if wdtype in WDTYPES else "bfloat16"


def kv_tol(be) -> str:
    return "float32" if np.dtype(be.kv_dtype) == np.float32 else "bfloat16"


# -- norm ---------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 3, 17])
@pytest.mark.parametrize("H", [1, 3, 17, 1000])
def test_rmsnorm(be, n, H):
    rng = rng_for("rmsnorm", n, H)
    x, w = acts(rng, n, H, scale=3.0), acts(rng, H)
    got = be.to_host(be.rmsnorm(be.from_host(x), be.prepare_vector(w), 1e-6))
    assert_close(got, REF.rmsnorm(x, w, 1e-6), what="rmsnorm")


def test_rmsnorm_strided(be):
    rng = rng_for("rmsnorm_strided")
    big, w = acts(rng, 6, 2 * 99), acts(rng, 99)
    got = be.to_host(be.rmsnorm(be.from_host(big)[1::2, ::2], be.prepare_vector(w), 1e-5))
    assert_close(got, REF.rmsnorm(big[1::2, ::2], w, 1e-5), what="rmsnorm (strided x)")


@pytest.mark.parametrize("wdtype", GEMV_WDTYPES)
@pytest.mark.parametrize("n,H", [(1, 64), (3, 17), (17, 200)])
def test_mtp_input(be, wdtype, n, H):
    rng = rng_for("mtp_input", wdtype, n, H)
    V = 50
    embed, eh = weight(rng, (V, H), dense(wdtype)), weight(rng, (H, 2 * H), wdtype)
    tokens = rng.integers(0, V, n).astype(np.int32)
    tokens[0] = V - 1
    g, ew, hw = acts(rng, n, H, scale=2.0), acts(rng, H), acts(rng, H)
    got = be.to_host(be.mtp_input(be.prepare_weight(embed), be.from_host(tokens), be.from_host(g),
                                  be.prepare_vector(ew), be.prepare_vector(hw), be.prepare_weight(eh), 1e-5))
    want = REF.mtp_input(REF.prepare_weight(embed), tokens, g, ew, hw, REF.prepare_weight(eh), 1e-5)
    assert_close(got, want, what="mtp_input")


@pytest.mark.parametrize("wdtype", ["bfloat16", "float32", "fp8_block"])
@pytest.mark.parametrize("n,H,fdtype", [(1, 64, "bool"), (5, 17, "int8"), (17, 200, "uint8"), (3, 64, "bool")])
def test_mtp_input_zero_embed(be, wdtype, n, H, fdtype):
    """Flagged rows (vLLM's position-0 mask) equal float64 with a zero embedding half;
    unflagged rows keep the bits of the call without flags; bad flags are refused by name."""
    rng = rng_for("mtp_input_zero_embed", wdtype, n, H, fdtype)
    V = 50
    embed, eh = weight(rng, (V, H), dense(wdtype)), weight(rng, (H, 2 * H), wdtype)
    tokens = rng.integers(0, V, n).astype(np.int32)
    g, ew, hw = acts(rng, n, H, scale=2.0), acts(rng, H), acts(rng, H)
    flags = rng.random(n) < 0.5
    flags[0] = True                                              # one flagged row, one not (n > 1)
    flags[1:2] = False
    z = (flags * (3 if fdtype == "uint8" else 1)).astype(fdtype)    # any nonzero byte flags
    pe, peh, pew, phw = be.prepare_weight(embed), be.prepare_weight(eh), be.prepare_vector(ew), be.prepare_vector(hw)

    def run(**kw):
        return be.to_host(be.mtp_input(pe, be.from_host(tokens), be.from_host(g), pew, phw, peh, 1e-5, **kw))

    got, plain = run(zero_embed=be.from_host(z)), run()
    np.testing.assert_array_equal(got[~flags], plain[~flags])
    ehf = np.asarray(REF.prepare_weight(eh), np.float64)
    g64 = g.astype(np.float64)
    h = g64 / np.sqrt((g64 * g64).mean(1, keepdims=True) + 1e-5) * hw                # hnorm(g), float64
    assert_close(got[flags], h[flags] @ ehf[:, H:].T, what="mtp_input (flagged rows)")
    assert_close(got, REF.mtp_input(REF.prepare_weight(embed), tokens, g, ew, hw, REF.prepare_weight(eh), 1e-5,
                                    zero_embed=z), what="mtp_input (zero_embed)")
    assert not np.allclose(got[flags], plain[flags], atol=1e-2), "the flags changed nothing"
    f = be.from_host
    for bad, msg in ((np.zeros(n + 1, bool), r"zero_embed: expected shape \[%d\], got \[%d\]" % (n, n + 1)),
                     (np.zeros(n, np.int32), "zero_embed: expected dtype bool or int8 or uint8, got int32")):
        with pytest.raises((TypeError, ValueError), match=msg):
            run(zero_embed=f(bad))


# -- linear -------------------------------------------------------------------

@pytest.mark.parametrize("wdtype", GEMV_WDTYPES)
@pytest.mark.parametrize("n", [1, 3, 17])
@pytest.mark.parametrize("K,N", [(1, 1), (33, 17), (1000, 3), (130, 1001)])
def test_linear(be, wdtype, n, K, N):
    rng = rng_for("linear", wdtype, n, K, N)
    x, w = acts(rng, n, K), weight(rng, (N, K), wdtype)
    bias, res = acts(rng, N), acts(rng, n, N)
    wb = be.prepare_weight(w)
    for b, r in ((None, None), (bias, None), (None, res), (bias, res)):
        got = be.linear(be.from_host(x), wb, None if b is None else be.prepare_vector(b),
                        None if r is None else be.from_host(r))
        assert_close(be.to_host(got), REF.linear(x, REF.prepare_weight(w), b, r),
                     what=f"linear bias={b is not None} residual={r is not None}")


@pytest.mark.parametrize("wdtype", GEMV_WDTYPES)
def test_linear_many_rows(be, wdtype):
    """A prefill-sized n (the cpu backend hands FP32 weights to BLAS from n = 256)."""
    rng = rng_for("linear_many_rows", wdtype)
    n, K, N = 300, 65, 129
    x, w, bias, res = acts(rng, n, K), weight(rng, (N, K), wdtype), acts(rng, N), acts(rng, n, N)
    got = be.linear(be.from_host(x), be.prepare_weight(w), be.prepare_vector(bias), be.from_host(res))
    assert_close(be.to_host(got), REF.linear(x, REF.prepare_weight(w), bias, res), what="linear (n=300)")


def test_linear_strided(be):
    rng = rng_for("linear_strided")
    big, w, res_big = acts(rng, 5, 2 * 40), weight(rng, (7, 40), "bfloat16"), acts(rng, 7, 5)
    x, res = big[:, ::2], res_big.T                                    # column-strided x, transposed residual
    got = be.linear(be.from_host(big)[:, ::2], be.prepare_weight(w), None, be.from_host(res_big).T)
    assert_close(be.to_host(got), REF.linear(x, REF.prepare_weight(w), None, res), what="linear (strided)")


# -- fused RMSNorm (norm=) ------------------------------------------------------

@pytest.mark.parametrize("wdtype", GEMV_WDTYPES)
@pytest.mark.parametrize("n", [1, 3, 9])
@pytest.mark.parametrize("K,N", [(64, 3), (33, 17), (130, 300)])
def test_linear_norm(be, wdtype, n, K, N):
    """linear(x, .., norm=(g, eps)) against its definition, linear(rmsnorm(x, g, eps), ..): the
    vector and scalar paths (K = 33), split-K row groups (N = 3: 4 warps per group), NR = 1, 4,
    and two chunks (n = 9); with bias and residual."""
    rng = rng_for("linear_norm", wdtype, n, K, N)
    x, w, g = acts(rng, n, K) * 3.0, weight(rng, (N, K), wdtype), acts(rng, K)
    bias, res = acts(rng, N), acts(rng, n, N)
    wb, wr = be.prepare_weight(w), REF.prepare_weight(w)
    for b, r in ((None, None), (bias, res)):
        got = be.linear(be.from_host(x), wb, None if b is None else be.prepare_vector(b),
                        None if r is None else be.from_host(r), norm=(be.prepare_vector(g), 1e-5))
        want = REF.linear(REF.rmsnorm(x, g, 1e-5), wr, b, r)
        assert_close(be.to_host(got), want, what=f"linear norm= bias={b is not None}")
    np.testing.assert_array_equal(REF.linear(x, wr, bias, res, norm=(g, 1e-5)),
                                  REF.linear(REF.rmsnorm(x, g, 1e-5), wr, bias, res))    # the definition


@pytest.mark.parametrize("wdtype", GEMV_WDTYPES)
@pytest.mark.parametrize("n", [1, 2, 5])
@pytest.mark.parametrize("H,I", [(64, 37), (33, 20)])
def test_swiglu_mlp_norm(be, wdtype, n, H, I):
    """swiglu_mlp(x, .., x, norm=(g, eps)) = x + mlp(rmsnorm(x)): the residual is the
    un-normed x itself (a block's post-attention half), and without a residual."""
    rng = rng_for("mlp_norm", wdtype, n, H, I)
    x, g = acts(rng, n, H), acts(rng, H)
    w13, w2 = weight(rng, (2 * I, H), wdtype), weight(rng, (H, I), wdtype)
    args = (be.prepare_weight(w13), be.prepare_weight(w2))
    ref_args = (REF.prepare_weight(w13), REF.prepare_weight(w2))
    for with_res in (False, True):
        xd = be.from_host(x)
        got = be.swiglu_mlp(xd, *args, xd if with_res else None, norm=(be.prepare_vector(g), 1e-6))
        want = REF.swiglu_mlp(REF.rmsnorm(x, g, 1e-6), *ref_args, x if with_res else None)
        assert_close(be.to_host(got), want, what=f"swiglu_mlp norm= residual={with_res}")


@pytest.mark.parametrize("bad,error", [((np.ones(5, np.float32), 1e-6), ValueError),
                                       ((np.ones(8, np.float32), -1.0), ValueError),
                                       (np.ones(8, np.float32), TypeError)])
def test_norm_keyword_validated(be, bad, error):
    x, w = np.ones((2, 8), np.float32), be.prepare_weight(np.ones((3, 8), np.float32))
    with pytest.raises(error, match="norm"):
        be.linear(be.from_host(x), w, norm=bad)


# -- rope + kv write ----------------------------------------------------------

@pytest.mark.parametrize("n", [1, 3, 17])
@pytest.mark.parametrize("Hq,Hkv,D,R,norms", [(4, 2, 16, 16, True), (3, 1, 10, 4, False), (1, 1, 8, 2, True)])
def test_qk_norm_rope_kv_write(be, n, Hq, Hkv, D, R, norms):
    rng = rng_for("rope", n, Hq, Hkv, D, R, norms)
    NB, BS = 7, 5
    qkv = acts(rng, n, (Hq + 2 * Hkv) * D, scale=2.0)
    qn, kn = (acts(rng, D), acts(rng, D)) if norms else (None, None)
    invf = inv_freq(R, 10000.0)
    positions = rng.integers(0, 5000, n).astype(np.int32)
    slots = rng.choice(NB * BS, n, replace=False).astype(np.int32)   # block * BS + offset
    k_cache, v_cache = be.empty_kv(NB, BS, Hkv, D), be.empty_kv(NB, BS, Hkv, D)
    k_ref, v_ref = REF.empty_kv(NB, BS, Hkv, D), REF.empty_kv(NB, BS, Hkv, D)
    vec = lambda a: None if a is None else be.prepare_vector(a)      # noqa: E731
    q = be.qk_norm_rope_kv_write(be.from_host(qkv), Hq, Hkv, vec(qn), vec(kn), 1e-6, be.from_host(invf),
                                 be.from_host(positions), k_cache, v_cache, be.from_host(slots))
    q_ref = REF.qk_norm_rope_kv_write(qkv, Hq, Hkv, qn, kn, 1e-6, invf, positions, k_ref, v_ref, slots)
    assert_close(be.to_host(q), q_ref, what="q")
    k_got, v_got = be.kv_to_host(k_cache), be.kv_to_host(v_cache)
    blk, off = slots // BS, slots % BS
    assert_close(k_got[blk, off], k_ref[blk, off], kv_tol(be), what="k cache rows")
    if kv_tol(be) == "float32":
        np.testing.assert_array_equal(v_got[blk, off], v_ref[blk, off])   # a move: exact
    else:
        assert_close(v_got[blk, off], v_ref[blk, off], "bfloat16", what="v cache rows")
    untouched = np.ones((NB, BS), bool)
    untouched[blk, off] = False
    assert not k_got[untouched].any() and not v_got[untouched].any(), "a slot not in `slots` was written"


@pytest.mark.parametrize("n", [1, 19])
@pytest.mark.parametrize("Hq,Hkv,D,R,norms", [(4, 2, 16, 16, True), (3, 1, 10, 4, False), (5, 1, 14, 10, True),
                                             (1, 1, 8, 2, False)])
@pytest.mark.parametrize("interleave,rope_scale", [(True, 1.0), (True, 1.37), (False, 0.83)])
def test_qk_norm_rope_kv_write_interleave_and_scale(be, n, Hq, Hkv, D, R, norms, interleave, rope_scale):
    """The RoPE variants: interleaved pairs (2i, 2i + 1) and cos/sin scaled by YaRN's
    attention factor, odd head dims and partial rotation, on every backend."""
    rng = rng_for("rope_il", n, Hq, Hkv, D, R, norms, interleave, rope_scale)
    NB, BS = 7, 5
    qkv = acts(rng, n, (Hq + 2 * Hkv) * D, scale=2.0)
    qn, kn = (acts(rng, D), acts(rng, D)) if norms else (None, None)
    invf = inv_freq(R, 10000.0)
    positions = rng.integers(0, 5000, n).astype(np.int32)
    slots = rng.choice(NB * BS, n, replace=False).astype(np.int32)
    k_cache, v_cache = be.empty_kv(NB, BS, Hkv, D), be.empty_kv(NB, BS, Hkv, D)
    k_ref, v_ref = REF.empty_kv(NB, BS, Hkv, D), REF.empty_kv(NB, BS, Hkv, D)
    vec = lambda a: None if a is None else be.prepare_vector(a)      # noqa: E731
    q = be.qk_norm_rope_kv_write(be.from_host(qkv), Hq, Hkv, vec(qn), vec(kn), 1e-6, be.from_host(invf),
                                 be.from_host(positions), k_cache, v_cache, be.from_host(slots),
                                 interleave=interleave, rope_scale=rope_scale)
    q_ref = REF.qk_norm_rope_kv_write(qkv, Hq, Hkv, qn, kn, 1e-6, invf, positions, k_ref, v_ref, slots,
                                      interleave=interleave, rope_scale=rope_scale)
    plain = REF.qk_norm_rope_kv_write(qkv, Hq, Hkv, qn, kn, 1e-6, invf, positions, REF.empty_kv(NB, BS, Hkv, D),
                                      REF.empty_kv(NB, BS, Hkv, D), slots)
    if R > 2 or rope_scale != 1.0:                                   # R = 2: one pair, (0, 1) either way
        assert np.abs(q_ref - plain).max() > 1e-2, "the variant changed nothing"
    assert_close(be.to_host(q), q_ref, what="q")
    blk, off = slots // BS, slots % BS
    assert_close(be.kv_to_host(k_cache)[blk, off], k_ref[blk, off], kv_tol(be), what="k cache rows")


def _rope_both(be, rng, qkv, Hq, Hkv, D, Dv, NB, BS):
    """``qkv`` through the backend and the reference with random q/k norms, full RoPE,
    random positions and distinct random slots -> (q, q_ref, k_cache, v_cache, k_ref,
    v_ref, slots), the caches [NB, BS, Hkv, D] / [NB, BS, Hkv, Dv]."""
    n = qkv.shape[0]
    qn, kn, invf = acts(rng, D), acts(rng, D), inv_freq(D, 10000.0)
    positions = rng.integers(0, 5000, n).astype(np.int32)
    slots = rng.choice(NB * BS, n, replace=False).astype(np.int32)
    k_cache, v_cache = be.empty_keys(NB, BS, Hkv, D), be.empty_kv(NB, BS, Hkv, Dv)
    k_ref, v_ref = REF.empty_kv(NB, BS, Hkv, D), REF.empty_kv(NB, BS, Hkv, Dv)
    q = be.qk_norm_rope_kv_write(be.from_host(qkv), Hq, Hkv, be.prepare_vector(qn), be.prepare_vector(kn), 1e-6,
                                 be.from_host(invf), be.from_host(positions), k_cache, v_cache, be.from_host(slots))
    q_ref = REF.qk_norm_rope_kv_write(qkv, Hq, Hkv, qn, kn, 1e-6, invf, positions, k_ref, v_ref, slots)
    return q, q_ref, k_cache, v_cache, k_ref, v_ref, slots


@pytest.mark.parametrize("BS", [4, 16, 32])
def test_key_cache_of_the_backend_reads_and_writes_as_empty_kv(be, BS):
    """``empty_keys`` (the cpu backend's rows-innermost blocks where BS % 16 == 0, else
    ``empty_kv``'s): the KV write, copy_kv_rows and kv_to_host give what they give on an
    ``empty_kv`` cache, bit for bit, and attention over either is the reference's."""
    rng = rng_for("key_layouts", BS)
    NB, Hq, Hkv, D, n = 6, 4, 2, 32, 9
    keys, plain = be.empty_keys(NB, BS, Hkv, D), be.empty_kv(NB, BS, Hkv, D)
    assert keys.shape == plain.shape == (NB, BS, Hkv, D)
    if be.name == "cpu":
        assert keys.flags.c_contiguous == (BS % 16 != 0)
    qkv = acts(rng, n, (Hq + 2 * Hkv) * D)
    slots = rng.choice(NB * BS, n, replace=False).astype(np.int32)
    args = (be.prepare_vector(acts(rng, D)), be.prepare_vector(acts(rng, D)), 1e-6, be.from_host(inv_freq(D, 1e4)),
            be.from_host(rng.integers(0, 99, n).astype(np.int32)))
    outs = []
    for k in (keys, plain):
        v = be.empty_kv(NB, BS, Hkv, D)
        outs.append((be.to_host(be.qk_norm_rope_kv_write(be.from_host(qkv), Hq, Hkv, *args, k, v,
                                                         be.from_host(slots))), k, v))
    (q0, k0, v0), (q1, k1, v1) = outs
    np.testing.assert_array_equal(q0, q1)
    np.testing.assert_array_equal(be.kv_to_host(k0), be.kv_to_host(k1))
    np.testing.assert_array_equal(be.kv_to_host(v0), be.kv_to_host(v1))
    src, dst = slots[:4], np.setdiff1d(np.arange(NB * BS), slots)[:4].astype(np.int32)
    for k in (k0, k1):
        be.copy_kv_rows(k, be.from_host(src), be.from_host(dst))
    got = be.kv_to_host(k0)
    np.testing.assert_array_equal(got, be.kv_to_host(k1))
    np.testing.assert_array_equal(got.reshape(NB * BS, Hkv, D)[dst], got.reshape(NB * BS, Hkv, D)[src])
    tables = be.from_host(rng.permutation(NB).reshape(2, NB // 2).astype(np.int32))
    row_seq, row_len = np.array([0, 1, 1], np.int32), np.array([NB // 2 * BS, 3, BS + 1], np.int32)
    q = acts(rng, 3, Hq, D)
    want = REF.paged_attention(q, got, be.kv_to_host(v0), be.to_host(tables), row_seq, row_len, 0.3)
    for k, v in ((k0, v0), (k1, v1)):
        o = be.paged_attention(be.from_host(q), k, v, tables, be.from_host(row_seq), be.from_host(row_len), 0.3)
        assert_close(be.to_host(o), want, kv_tol(be), what=f"paged_attention, BS {BS}")


# -- attention ----------------------------------------------------------------

def _filled_caches(be, rng, NB, BS, Hkv, D, Dv=None):
    """Caches with random content in every slot (V ``Dv`` wide, default D), written through
    the backend's own KV write (so any kv_dtype works); the reference then reads kv_to_host
    of them."""
    n, Dv = NB * BS, D if Dv is None else Dv
    qkv = acts(rng, n, 2 * Hkv * D + Hkv * Dv)                         # Hkv query heads, unused
    k_cache, v_cache = be.empty_keys(NB, BS, Hkv, D), be.empty_kv(NB, BS, Hkv, Dv)
    be.qk_norm_rope_kv_write(be.from_host(qkv), Hkv, Hkv, None, None, 1e-6, be.from_host(inv_freq(2, 1e4)),
                             be.from_host(np.zeros(n, np.int32)), k_cache, v_cache,
                             be.from_host(np.arange(n, dtype=np.int32)))
    return k_cache, v_cache


@pytest.mark.parametrize("Hq,Hkv,D,BS", [(4, 2, 16, 4), (3, 3, 8, 1), (8, 1, 64, 16)])
def test_paged_attention(be, Hq, Hkv, D, BS):
    rng = rng_for("attention", Hq, Hkv, D, BS)
    NB, max_blocks = 40, 6
    k_cache, v_cache = _filled_caches(be, rng, NB, BS, Hkv, D)
    S = 3
    block_tables = rng.permutation(NB)[: S * max_blocks].reshape(S, max_blocks).astype(np.int32)
    # a decode row, the causal rows of a prefill chunk, a ragged mix; lengths up to the table's end
    row_seq = np.array([0, 1, 1, 1, 2, 2, 0], np.int32)
    row_len = np.minimum([1, 5, 6, 7, max_blocks * BS, 2 * BS + 1, BS], max_blocks * BS).astype(np.int32)
    q = acts(rng, row_seq.shape[0], Hq, D)
    got = be.paged_attention(be.from_host(q), k_cache, v_cache, be.from_host(block_tables),
                             be.from_host(row_seq), be.from_host(row_len), D ** -0.5)
    want = REF.paged_attention(q, be.kv_to_host(k_cache), be.kv_to_host(v_cache), block_tables,
                               row_seq, row_len, D ** -0.5)
    assert_close(be.to_host(got), want, kv_tol(be), what="paged_attention")


@pytest.mark.parametrize("lens", [[1], [37], [64, 3], [17, 18, 19]])
def test_paged_attention_decode_rows(be, lens):
    """A few rows over many blocks: the cpu backend cuts each row's KV blocks into
    chunks (one task each, 4 for a single row on 2 threads) and merges their softmax
    states; a row shorter than the chunk count leaves chunks empty."""
    rng = rng_for("attention_decode", tuple(lens))
    Hq, Hkv, D, BS, NB, max_blocks = 8, 2, 16, 4, 64, 16
    n = len(lens)
    k_cache, v_cache = _filled_caches(be, rng, NB, BS, Hkv, D)
    block_tables = rng.permutation(NB)[: n * max_blocks].reshape(n, max_blocks).astype(np.int32)
    row_seq, row_len = np.arange(n, dtype=np.int32), np.array(lens, np.int32)
    q = acts(rng, n, Hq, D, scale=3.0)
    got = be.paged_attention(be.from_host(q), k_cache, v_cache, be.from_host(block_tables),
                             be.from_host(row_seq), be.from_host(row_len), D ** -0.5)
    want = REF.paged_attention(q, be.kv_to_host(k_cache), be.kv_to_host(v_cache), block_tables,
                               row_seq, row_len, D ** -0.5)
    assert_close(be.to_host(got), want, kv_tol(be), what="paged_attention (decode rows)")


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")   # the reference's -inf - -inf
def test_paged_attention_minus_inf_scores(be):
    """Keys whose scores are -inf weigh 0, also when every key of what one task sees
    (the cpu backend's first block of a chunk, a cuda partition of 64 keys) is -inf:
    the other keys decide, as in the reference."""
    Hq, Hkv, D, BS, NB = 2, 1, 8, 4, 24
    L = NB * BS
    qkv = np.zeros((L, 3 * Hkv * D), np.float32)
    qkv[:, D:2 * D] = 0.5                                                 # k rows
    qkv[:64, D + 4] = -np.inf                                             # keys 0..63 (blocks 0..15): -inf scores
    qkv[70, D + 4] = -np.inf                                              # one key of block 17
    qkv[:, 2 * D:] = np.arange(L, dtype=np.float32)[:, None] / L          # v rows
    k_cache, v_cache = be.empty_kv(NB, BS, Hkv, D), be.empty_kv(NB, BS, Hkv, D)
    be.qk_norm_rope_kv_write(be.from_host(qkv), Hkv, Hkv, None, None, 1e-6, be.from_host(inv_freq(2, 1e4)),
                             be.from_host(np.zeros(L, np.int32)), k_cache, v_cache,
                             be.from_host(np.arange(L, dtype=np.int32)))
    q = np.ones((2, Hq, D), np.float32)
    tables = np.arange(NB, dtype=np.int32).reshape(1, NB)
    row_seq, row_len = np.zeros(2, np.int32), np.array([L, 67], np.int32)
    got = be.to_host(be.paged_attention(be.from_host(q), k_cache, v_cache, be.from_host(tables),
                                        be.from_host(row_seq), be.from_host(row_len), 1.0))
    want = REF.paged_attention(q, be.kv_to_host(k_cache), be.kv_to_host(v_cache), tables, row_seq, row_len, 1.0)
    assert np.isfinite(want).all()
    assert_close(got, want, kv_tol(be), what="paged_attention (-inf scores)")
    # every score of a row -inf: NaN, as the reference (0 / 0), not an error
    row_len = np.array([64, 5], np.int32)
    got = be.to_host(be.paged_attention(be.from_host(q), k_cache, v_cache, be.from_host(tables),
                                        be.from_host(row_seq), be.from_host(row_len), 1.0))
    want = REF.paged_attention(q, be.kv_to_host(k_cache), be.kv_to_host(v_cache), tables, row_seq, row_len, 1.0)
    assert np.isnan(want).all() and np.isnan(got).all()
    # a NaN in V at a -inf key: 0 * NaN stays NaN, as the reference, also when that key's
    # chunk / partition has no finite score
    qkv[3, 2 * D + 1] = np.nan
    be.qk_norm_rope_kv_write(be.from_host(qkv), Hkv, Hkv, None, None, 1e-6, be.from_host(inv_freq(2, 1e4)),
                             be.from_host(np.zeros(L, np.int32)), k_cache, v_cache,
                             be.from_host(np.arange(L, dtype=np.int32)))
    row_len = np.array([L, 67], np.int32)
    got = be.to_host(be.paged_attention(be.from_host(q), k_cache, v_cache, be.from_host(tables),
                                        be.from_host(row_seq), be.from_host(row_len), 1.0))
    want = REF.paged_attention(q, be.kv_to_host(k_cache), be.kv_to_host(v_cache), tables, row_seq, row_len, 1.0)
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.isnan(want).any()
    assert_close(got, want, kv_tol(be), what="paged_attention (NaN in V at -inf keys)")


def host_only(be) -> None:
    """Index values are checked where they live on the host; the cuda launchers do not
    read device data back (see mtpkern/backends/cuda_launch)."""
    if be.name == "cuda":
        pytest.skip("index values in device arrays are not checked on the GPU")


def test_paged_attention_rejects_empty_row(be):
    host_only(be)
    k_cache, v_cache = be.empty_kv(2, 4, 1, 8), be.empty_kv(2, 4, 1, 8)
    with pytest.raises(ValueError, match=r"row_len\[1\]"):
        be.paged_attention(be.from_host(np.zeros((2, 1, 8), np.float32)), k_cache, v_cache,
                           be.from_host(np.array([[0, 1]], np.int32)), be.from_host(np.zeros(2, np.int32)),
                           be.from_host(np.array([3, 0], np.int32)), 1.0)


# -- attention features: sliding window, sinks, a value head dim of its own ----

def dense_attention64(q, K, V, lens, starts, sinks, scale) -> np.ndarray:
    """The float64 brute force: row r against the dense K[r] [T, Hkv, D] / V[r] [T, Hkv, Dv]
    of its sequence, every score computed, those outside ``starts[r] .. lens[r] - 1`` masked
    to -inf (and their values to 0, whatever they hold), the sinks appended as one more logit
    column whose value row is 0, then a plain softmax. -> [n, Hq * Dv]."""
    n, Hq, _ = q.shape
    out = []
    for r in range(n):
        k, v = np.asarray(K[r], np.float64), np.asarray(V[r], np.float64)
        T, Hkv = k.shape[:2]
        kh, vh = np.repeat(k, Hq // Hkv, axis=1), np.repeat(v, Hq // Hkv, axis=1)   # [T, Hq, D | Dv]
        seen = (np.arange(T) >= starts[r]) & (np.arange(T) < lens[r])
        logits = np.einsum("hd,thd->ht", np.asarray(q[r], np.float64), kh) * scale       # [Hq, T]
        logits[:, ~seen] = -np.inf
        vh = np.where(seen[:, None, None], vh, 0.0)
        if sinks is not None:
            logits = np.concatenate([logits, np.asarray(sinks, np.float64)[:, None]], axis=1)
            vh = np.concatenate([vh, np.zeros((1,) + vh.shape[1:])])
        with np.errstate(invalid="ignore"):                                            # every logit -inf
            e = np.exp(logits - logits.max(axis=1, keepdims=True))
            p = e / e.sum(axis=1, keepdims=True)
        out.append(np.einsum("ht,thd->hd", p, vh).reshape(-1))
    return np.stack(out)


def _window_case(be, rng, seqs, lens, BS, max_blocks, Hq, Hkv, D, Dv):
    """Caches, a block table and the dense K / V per row for rows of ``lens`` KV rows in
    sequences ``seqs``; the last block of the caches is the poison block: huge keys, NaN
    values (a row that reads it shows NaN)."""
    S = max(seqs) + 1
    NB = S * max_blocks + 1
    k_cache, v_cache = _filled_caches(be, rng, NB, BS, Hkv, D, Dv)
    poison = NB - 1
    qkv = np.full((BS, 2 * Hkv * D + Hkv * Dv), 1e3, np.float32)
    qkv[:, 2 * Hkv * D:] = np.nan
    be.qk_norm_rope_kv_write(be.from_host(qkv), Hkv, Hkv, None, None, 1e-6, be.from_host(inv_freq(2, 1e4)),
                             be.from_host(np.zeros(BS, np.int32)), k_cache, v_cache,
                             be.from_host(np.arange(poison * BS, NB * BS, dtype=np.int32)))
    tables = rng.permutation(poison)[: S * max_blocks].reshape(S, max_blocks).astype(np.int32)
    kh, vh = be.kv_to_host(k_cache), be.kv_to_host(v_cache)
    i = np.arange(max_blocks * BS)
    K = [kh[tables[s, i // BS], i % BS] for s in seqs]                  # [T, Hkv, D] per row
    V = [vh[tables[s, i // BS], i % BS] for s in seqs]
    q = acts(rng, len(seqs), Hq, D, scale=2.0)
    return k_cache, v_cache, tables, poison, q, K, V


def _poisoned(tables, seqs, lens, starts, BS, poison):
    """``tables`` with every entry no row reads (blocks wholly before the window of all the
    sequence's rows, or past its longest row) replaced: by the poison block, or by -1 for
    sequence 1 (out of range: a bounds check of entries not in use would refuse it)."""
    t = tables.copy()
    for s in range(t.shape[0]):
        mine = [r for r, q in enumerate(seqs) if q == s]
        if not mine:
            continue
        lo = min(starts[r] for r in mine) // BS
        hi = -(-max(lens[r] for r in mine) // BS)
        bad = -1 if s == 1 else poison
        t[s, :lo] = bad
        t[s, hi:] = bad
    return t


def _sinks(rng, kind, Hq):
    """None, or a logit per query head: ``large`` (dominates the scores, which are O(1)),
    ``tiny`` (changes nothing visible), ``mixed`` (both, and 0)."""
    if kind is None:
        return None
    if kind == "large":
        return rng.uniform(4.0, 12.0, Hq).astype(np.float32)
    if kind == "tiny":
        return rng.uniform(-40.0, -20.0, Hq).astype(np.float32)
    return np.resize(np.array([30.0, -30.0, 0.0, 2.5], np.float32), Hq)


def _check_window_case(be, case, seqs, lens, window, sink_kind, rng, scale, BS, what):
    k_cache, v_cache, tables, poison, q, K, V = case
    lens = np.asarray(lens, np.int32)
    starts = np.zeros_like(lens) if window is None else np.maximum(0, lens - window).astype(np.int32)
    sinks = _sinks(rng, sink_kind, q.shape[1])
    t = _poisoned(tables, seqs, lens, starts, BS, poison)
    f = be.from_host
    got = be.paged_attention(f(q), k_cache, v_cache, f(t), f(np.asarray(seqs, np.int32)), f(lens), scale,
                             row_start=None if window is None else f(starts), sinks=None if sinks is None else f(sinks))
    want = dense_attention64(q, K, V, lens, starts, sinks, scale)
    assert_close(be.to_host(got), want, kv_tol(be), what=f"{what} window={window} sinks={sink_kind}")


#: (window, sinks) of each call: windows of 1 and 3 rows, one longer than any context, none
WINDOW_SINKS = [(None, None), (1, "large"), (3, "tiny"), (1000, "mixed"), (3, None), (None, "large")]


@pytest.mark.parametrize("n", [1, 3, 17])
@pytest.mark.parametrize("Hq,Hkv,D,Dv,BS", [(1, 1, 16, 16, 4), (2, 1, 64, 64, 16), (8, 2, 192, 128, 16),
                                           (8, 8, 16, 128, 3), (2, 2, 64, 16, 5)])
def test_paged_attention_window_sinks_value_dim(be, n, Hq, Hkv, D, Dv, BS):
    """Sliding windows (``row_start``), sinks and Dv != D (MiMo-V2: 192 / 128) against the
    float64 brute force, rows of up to ~40 KV rows (one cuda partition) in up to 3
    sequences; the table entries no row reads are poison (huge keys, NaN values) or -1."""
    rng = rng_for("attention_features", n, Hq, Hkv, D, Dv, BS)
    max_blocks = -(-40 // BS)
    seqs = [r % 3 for r in range(n)]
    lens = rng.integers(1, max_blocks * BS + 1, n)
    case = _window_case(be, rng, seqs, lens, BS, max_blocks, Hq, Hkv, D, Dv)
    for window, sinks in WINDOW_SINKS:
        _check_window_case(be, case, seqs, lens, window, sinks, rng, D ** -0.5, BS, "paged_attention")


@pytest.mark.parametrize("Hq,Hkv,D,Dv", [(8, 2, 64, 64), (4, 1, 192, 128)])
def test_paged_attention_window_sinks_long_context(be, Hq, Hkv, D, Dv):
    """Contexts of up to 640 rows: the cuda backend splits them into partitions (from the
    window's first row) and merges them, the sink counted once; the cpu backend cuts a row's
    blocks into chunks (2 for a single row); windows inside one block, across many, across
    partitions, longer than the context; one row per call, then all rows in one call."""
    rng = rng_for("attention_features_long", Hq, Hkv, D, Dv)
    BS, max_blocks = 16, 40
    seqs, lens = [0, 1, 1, 0, 2], [640, 600, 333, 17, 513]
    case = _window_case(be, rng, seqs, lens, BS, max_blocks, Hq, Hkv, D, Dv)
    k_cache, v_cache, tables, poison, q, K, V = case
    for window, sinks in [(1, "mixed"), (5, "large"), (100, None), (513, "tiny"), (1000, "large"), (None, "mixed")]:
        for r in range(len(seqs)):
            one = (k_cache, v_cache, tables, poison, q[r:r + 1], K[r:r + 1], V[r:r + 1])
            _check_window_case(be, one, [seqs[r]], [lens[r]], window, sinks, rng, D ** -0.5, BS,
                               f"paged_attention row {r}")
        _check_window_case(be, case, seqs, lens, window, sinks, rng, D ** -0.5, BS, "paged_attention (all rows)")


def _exact_rows(rng, per_seq, cap, layout):
    """Rows of ``len(per_seq)`` sequences, ``per_seq[s]`` of them for sequence s with causal
    lengths L_s - k + 1 .. L_s (an exact-mode module or a multi-row draft: each row of a
    sequence sees one KV row more than the one before), laid out ``consecutive`` (the
    proposer's layout), ``interleaved`` (round robin over the sequences) or ``shuffled``
    -> (seqs, lens) as lists."""
    rows = []
    for s, k in enumerate(per_seq):
        L = int(rng.integers(k, cap + 1))
        rows += [(s, L - k + 1 + i) for i in range(k)]
    if layout == "interleaved":
        by_seq = [[sr for sr in rows if sr[0] == s] for s in range(len(per_seq))]
        rows = [b[i] for i in range(max(per_seq)) for b in by_seq if i < len(b)]
    elif layout == "shuffled":
        rows = [rows[i] for i in rng.permutation(len(rows))]
    return [s for s, _ in rows], [L for _, L in rows]


@pytest.mark.parametrize("layout", ["consecutive", "interleaved", "shuffled"])
@pytest.mark.parametrize("Hq,Hkv,D,Dv,BS", [(8, 2, 64, 64, 16), (12, 1, 128, 128, 16), (4, 4, 32, 16, 5),
                                           (16, 2, 48, 200, 8)])
def test_paged_attention_rows_of_one_sequence(be, layout, Hq, Hkv, D, Dv, BS):
    """Several rows per sequence with their own causal lengths (1..5 rows, 9 sequences), the
    shape of an exact-mode module: the cuda kernel serves a run of a sequence's rows in one
    block (its KV read once), also when the rows of a sequence are not consecutive, against
    the float64 brute force, with windows and sinks; table entries no row reads are poison."""
    rng = rng_for("attention_rows", layout, Hq, Hkv, D, Dv, BS)
    max_blocks = -(-160 // BS)
    seqs, lens = _exact_rows(rng, [3, 1, 5, 2, 3, 1, 4, 2, 3], max_blocks * BS, layout)
    case = _window_case(be, rng, seqs, lens, BS, max_blocks, Hq, Hkv, D, Dv)
    for window, sinks in [(None, None), (3, "large"), (70, "mixed"), (None, "tiny")]:
        _check_window_case(be, case, seqs, lens, window, sinks, rng, D ** -0.5, BS, f"paged_attention ({layout})")


@pytest.mark.parametrize("Hq,Hkv,D,Dv", [(8, 2, 64, 64), (6, 1, 128, 96)])
def test_paged_attention_rows_of_one_sequence_long_context(be, Hq, Hkv, D, Dv):
    """Exact-mode rows (3 and 2 rows of two sequences, and a decode row) over contexts of
    ~1500 KV rows: split into partitions per row and merged on the cuda backend, windows
    across partitions, sinks counted once."""
    rng = rng_for("attention_rows_long", Hq, Hkv, D, Dv)
    BS, max_blocks = 16, 96
    seqs, lens = [0, 0, 0, 1, 1, 2], [1498, 1499, 1500, 1201, 1202, 700]
    case = _window_case(be, rng, seqs, lens, BS, max_blocks, Hq, Hkv, D, Dv)
    for window, sinks in [(None, None), (600, "mixed"), (40, None), (None, "large")]:
        _check_window_case(be, case, seqs, lens, window, sinks, rng, D ** -0.5, BS, "paged_attention (long, rows)")


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")   # the reference's -inf - -inf
def test_paged_attention_sinks_windows_at_minus_inf(be):
    """Keys of -inf score: every visible score -inf gives NaN without a sink (as before) and 0
    with a finite one, in one partition and in many; a window that starts past the -inf keys
    gives finite results; a NaN in V at a visible -inf key stays NaN with a sink too."""
    Hq, Hkv, D, BS, NB = 2, 1, 8, 4, 24
    L = NB * BS
    qkv = np.zeros((L, 3 * Hkv * D), np.float32)
    qkv[:, D:2 * D] = 0.5                                                 # k rows
    qkv[:64, D + 4] = -np.inf                                             # keys 0..63: -inf scores
    qkv[:, 2 * D:] = np.arange(L, dtype=np.float32)[:, None] / L          # v rows
    qkv[3, 2 * D + 1] = np.nan                                            # V of key 3 (a -inf key): NaN
    k_cache, v_cache = be.empty_kv(NB, BS, Hkv, D), be.empty_kv(NB, BS, Hkv, D)
    be.qk_norm_rope_kv_write(be.from_host(qkv), Hkv, Hkv, None, None, 1e-6, be.from_host(inv_freq(2, 1e4)),
                             be.from_host(np.zeros(L, np.int32)), k_cache, v_cache,
                             be.from_host(np.arange(L, dtype=np.int32)))
    K, V = be.kv_to_host(k_cache).reshape(L, Hkv, D), be.kv_to_host(v_cache).reshape(L, Hkv, D)
    q = np.ones((4, Hq, D), np.float32)
    tables = np.arange(NB, dtype=np.int32).reshape(1, NB)
    row_seq = np.zeros(4, np.int32)
    row_len = np.array([64, 60, L, 70], np.int32)
    sinks = np.array([0.5, -3.0], np.float32)
    f = be.from_host

    def run(starts, sk):
        return be.to_host(be.paged_attention(f(q), k_cache, v_cache, f(tables), f(row_seq), f(row_len), 1.0,
                                             row_start=None if starts is None else f(starts),
                                             sinks=None if sk is None else f(sk)))

    no_key3 = np.array([10, 4, 64, 65], np.int32)                         # windows past key 3
    got = run(no_key3, None)
    want = dense_attention64(q, [K] * 4, [V] * 4, row_len, no_key3, None, 1.0)
    assert np.isnan(got[:2]).all() and np.isnan(want[:2]).all()          # only -inf keys: 0 / 0
    assert np.isfinite(got[2:]).all()
    assert_close(got, want, kv_tol(be), what="paged_attention, windows past the NaN key")
    got = run(no_key3, sinks)
    want = dense_attention64(q, [K] * 4, [V] * 4, row_len, no_key3, sinks, 1.0)
    assert (got[:2] == 0).all() and np.isfinite(got).all()                # the sink takes it all
    assert_close(got, want, kv_tol(be), what="paged_attention, sinks over -inf keys")
    got = run(None, sinks)                                                # key 3 visible: NaN stays
    want = dense_attention64(q, [K] * 4, [V] * 4, row_len, np.zeros(4, np.int32), sinks, 1.0)
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.isnan(want).any()
    assert_close(got, want, kv_tol(be), what="paged_attention, sinks and NaN in V at a -inf key")


def test_paged_attention_features_validate(be):
    """row_start, sinks and v_cache are checked with the argument named."""
    f = be.from_host
    k_cache, v_cache = be.empty_kv(4, 4, 2, 8), be.empty_kv(4, 4, 2, 6)
    q, tables = f(np.zeros((2, 4, 8), np.float32)), f(np.zeros((1, 4), np.int32))
    row_seq, row_len = f(np.zeros(2, np.int32)), f(np.array([3, 5], np.int32))

    def call(**kw):
        return be.paged_attention(q, k_cache, kw.pop("v_cache", v_cache), tables, row_seq, row_len, 1.0, **kw)
    assert call().shape == (2, 4 * 6)
    with pytest.raises(TypeError, match="row_start: expected dtype int32, got int64"):
        call(row_start=f(np.zeros(2, np.int64)))
    with pytest.raises(ValueError, match=r"row_start: expected shape \[2\], got \[3\]"):
        call(row_start=f(np.zeros(3, np.int32)))
    with pytest.raises(ValueError, match=r"sinks: expected shape \[4\], got \[2\]"):
        call(sinks=f(np.zeros(2, np.float32)))
    with pytest.raises(TypeError, match="sinks: expected dtype float32, got float64"):
        call(sinks=f(np.zeros(4, np.float64)))
    with pytest.raises(ValueError, match=r"v_cache: expected shape \[4, 4, 2, \*\], got \[4, 4, 1, 6\]"):
        call(v_cache=be.empty_kv(4, 4, 1, 6))


def test_paged_attention_rejects_row_start_outside_the_row(be):
    host_only(be)
    f = be.from_host
    k_cache, v_cache = be.empty_kv(2, 4, 1, 8), be.empty_kv(2, 4, 1, 8)
    for bad, match in (([0, 5], r"row_start\[1\]: expected 0 <= row_start < row_len\[1\] = 5, got 5"),
                       ([-1, 0], r"row_start\[0\]: expected 0 <= row_start < row_len\[0\] = 3, got -1")):
        with pytest.raises(ValueError, match=match):
            be.paged_attention(f(np.zeros((2, 1, 8), np.float32)), k_cache, v_cache, f(np.array([[0, 1]], np.int32)),
                               f(np.zeros(2, np.int32)), f(np.array([3, 5], np.int32)), 1.0,
                               row_start=f(np.array(bad, np.int32)))


@pytest.mark.parametrize("n", [1, 3, 17])
@pytest.mark.parametrize("Hq,Hkv,D,Dv,extra", [(4, 2, 16, 8, 5), (2, 1, 192, 128, 2), (3, 3, 10, 10, 7),
                                              (1, 1, 8, 16, 0)])
def test_qk_norm_rope_kv_write_value_dim_extra_columns(be, n, Hq, Hkv, D, Dv, extra):
    """V heads of Dv (v_cache's last axis), and qkv rows with columns after q | k | v (a gate
    stacked into the same projection): those are not read (NaN there changes nothing)."""
    rng = rng_for("rope_dv", n, Hq, Hkv, D, Dv, extra)
    NB, BS = 7, 5
    qkv = acts(rng, n, (Hq + Hkv) * D + Hkv * Dv + extra, scale=2.0)
    qkv[:, (Hq + Hkv) * D + Hkv * Dv:] = np.nan
    q, q_ref, k_cache, v_cache, k_ref, v_ref, slots = _rope_both(be, rng, qkv, Hq, Hkv, D, Dv, NB, BS)
    assert np.isfinite(q_ref).all() and np.isfinite(v_ref).all()
    assert_close(be.to_host(q), q_ref, what="q")
    k_got, v_got = be.kv_to_host(k_cache), be.kv_to_host(v_cache)
    blk, off = slots // BS, slots % BS
    assert_close(k_got[blk, off], k_ref[blk, off], kv_tol(be), what="k cache rows")
    want_v = v_ref[blk, off] if kv_tol(be) == "float32" else \
        v_ref[blk, off].astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(v_got[blk, off], want_v)             # a move (BF16: round to nearest even)
    untouched = np.ones((NB, BS), bool)
    untouched[blk, off] = False
    assert not k_got[untouched].any() and not v_got[untouched].any(), "a slot not in `slots` was written"
    narrow = be.from_host(qkv[:, : (Hq + Hkv) * D + Hkv * Dv - 1])
    with pytest.raises(ValueError, match=r"qkv: expected \[n, at least \(Hq \+ Hkv\) \* D \+ Hkv \* Dv"):
        be.qk_norm_rope_kv_write(narrow, Hq, Hkv, None, None, 1e-6, be.from_host(inv_freq(D, 1e4)),
                                 be.from_host(np.zeros(n, np.int32)), k_cache, v_cache, be.from_host(slots))


# -- gate ---------------------------------------------------------------------

def sigmoid_gate64(x, gate, residual) -> np.ndarray:
    """The float64 brute force: element j of row i times sigmoid of gate column j // (F / G)."""
    n, F = x.shape
    c = F // gate.shape[1]
    with np.errstate(over="ignore"):
        s = 1.0 / (1.0 + np.exp(-np.asarray(gate, np.float64)))
    y = np.asarray(x, np.float64) * s[:, np.arange(F) // c]
    return y if residual is None else np.asarray(residual, np.float64) + y


@pytest.mark.parametrize("n", [1, 3, 17])
@pytest.mark.parametrize("F,G", [(48, 1), (48, 6), (48, 48), (1000, 8), (130, 130), (2560, 20), (7, 7)])
def test_sigmoid_gate(be, n, F, G):
    """Head-wise (G heads), element-wise (G = F) and one-per-row (G = 1) gates, with and without
    the residual, the gate a contiguous array or a column slice of a wider fused projection
    (rows a stride apart), saturating and NaN gates; out= x and out= residual in place."""
    rng = rng_for("sigmoid_gate", n, F, G)
    x, res = acts(rng, n, F), acts(rng, n, F)
    fused = acts(rng, n, F + G + 11, scale=4.0)                         # [x-like | gate | more] columns
    gcols = slice(F + 3, F + 3 + G)
    fused[0, F + 3] = 100.0                                            # saturated: sigmoid 1 and 0
    fused[-1, F + 2 + G] = -100.0
    if n > 2:
        fused[1, F + 3] = np.nan
    gate = fused[:, gcols]
    f = be.from_host
    for r in (None, res):
        want = sigmoid_gate64(x, gate, r)
        rb = None if r is None else f(r)
        for name, g in (("contiguous", f(np.ascontiguousarray(gate))), ("column slice", f(fused)[:, gcols])):
            got = be.sigmoid_gate(f(x), g, rb)
            assert_close(be.to_host(got), want, what=f"sigmoid_gate residual={r is not None} gate {name}")
        xb = f(x.copy())                                                 # from_host may not copy
        assert be.sigmoid_gate(xb, f(fused)[:, gcols], rb, out=xb) is xb
        assert_close(be.to_host(xb), want, what="sigmoid_gate out=x")
    rb = f(res.copy())
    assert be.sigmoid_gate(f(x), f(fused)[:, gcols], rb, out=rb) is rb
    assert_close(be.to_host(rb), sigmoid_gate64(x, gate, res), what="sigmoid_gate out=residual")


def test_sigmoid_gate_validates(be):
    f = be.from_host
    x = f(np.zeros((2, 12), np.float32))
    with pytest.raises(ValueError, match=r"gate: expected \[2, G\] with G dividing 12 \(the columns of x\), "
                                         r"got \[2, 5\]"):
        be.sigmoid_gate(x, f(np.zeros((2, 5), np.float32)))
    with pytest.raises(ValueError, match=r"gate: expected \[2, G\]"):
        be.sigmoid_gate(x, f(np.zeros((3, 4), np.float32)))
    with pytest.raises(ValueError, match=r"residual: expected shape \[2, 12\], got \[2, 11\]"):
        be.sigmoid_gate(x, f(np.zeros((2, 4), np.float32)), f(np.zeros((2, 11), np.float32)))
    with pytest.raises(ValueError, match="out: expected shape"):
        be.sigmoid_gate(x, f(np.zeros((2, 4), np.float32)), out=f(np.zeros((2, 11), np.float32)))


# -- moe ----------------------------------------------------------------------

ROUTER_SPECS = [
    (64, RouterSpec(top_k=6, n_group=8, topk_group=3, routed_scaling_factor=2.5, norm_topk_prob=True)),
    (16, RouterSpec(top_k=4, n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False)),
    (8, RouterSpec(top_k=3, n_group=8, topk_group=4, routed_scaling_factor=1.5, norm_topk_prob=True)),  # groups of 1
    (24, RouterSpec(top_k=5, n_group=4, topk_group=2, routed_scaling_factor=1.0, norm_topk_prob=True,
                    scoring="softmax")),
    # DeepSeek-V4: sqrt(softplus) scores over one group
    (32, RouterSpec(top_k=6, n_group=1, topk_group=1, routed_scaling_factor=1.5, norm_topk_prob=True,
                    scoring="sqrtsoftplus")),
]


@pytest.mark.parametrize("wdtype", GEMV_WDTYPES)
@pytest.mark.parametrize("n", [1, 3, 17])
@pytest.mark.parametrize("E,spec", ROUTER_SPECS)
def test_moe_router(be, wdtype, n, E, spec):
    rng = rng_for("router", wdtype, n, E, spec.scoring, spec.n_group)
    H = 96
    x, gate_w, bias = acts(rng, n, H), weight(rng, (E, H), wdtype), acts(rng, E, scale=0.1)
    ids, w = be.moe_router(be.from_host(x), be.prepare_weight(gate_w), be.prepare_vector(bias), spec)
    ids_ref, w_ref = REF.moe_router(x, REF.prepare_weight(gate_w), bias, spec)
    np.testing.assert_array_equal(be.to_host(ids), ids_ref)
    assert_close(be.to_host(w), w_ref, what="router weights")


def _router_ref64(logits, bias, spec):
    """Float64 scores and group scores, with the identity of every compared value,
    to tell exact ties (same inputs: same bits everywhere) from near ties."""
    l64, b64 = logits.astype(np.float64), bias.astype(np.float64)
    if spec.scoring == "sigmoid":
        s = 1.0 / (1.0 + np.exp(-l64))
    elif spec.scoring == "softmax":
        z = np.exp(l64 - l64.max())
        s = z / z.sum()
    else:                                        # sqrt(softplus), the logits here far below 20
        s = np.sqrt(np.log1p(np.exp(l64)))
    c = s + b64
    key = list(zip(logits.tolist(), bias.tolist()))
    return c, key


def _no_near_ties(logits, bias, spec, gap=1e-5) -> bool:
    c, key = _router_ref64(logits, bias, spec)
    E, G = c.shape[0], spec.n_group
    for a in range(E):
        for b in range(a + 1, E):
            if key[a] != key[b] and abs(c[a] - c[b]) < gap:
                return False
    gsz = E // G
    gkeys, gscores = [], []
    for g in range(G):
        order = sorted(range(g * gsz, (g + 1) * gsz), key=lambda e: -c[e])[: min(2, gsz)]
        gkeys.append(sorted(key[e] for e in order))
        gscores.append(sum(c[e] for e in order))
    for a in range(G):
        for b in range(a + 1, G):
            if gkeys[a] != gkeys[b] and abs(gscores[a] - gscores[b]) < 10 * gap:
                return False
    return True


# logits with distinct magnitudes (so no s(l) + s(-l) = s(0) + s(0) coincidences), dyadic biases
_LOGITS = [-3.0, -2.25, -1.5, -0.75, 0.0, 0.5, 1.0, 1.25, 2.0, 2.5]
_BIASES = [-0.5, -0.125, 0.0, 0.25, 0.5]


@st.composite
def router_cases(draw):
    G = draw(st.sampled_from([1, 2, 4]))
    gsz = draw(st.sampled_from([1, 2, 3, 4]))
    E = G * gsz
    topk_group = draw(st.integers(1, G))
    spec = RouterSpec(top_k=draw(st.integers(1, topk_group * gsz)), n_group=G, topk_group=topk_group,
                      routed_scaling_factor=draw(st.sampled_from([1.0, 2.5])),
                      norm_topk_prob=draw(st.booleans()), scoring=draw(st.sampled_from(SCORINGS)))
    n = draw(st.integers(1, 3))
    logits = np.array(draw(st.lists(st.sampled_from(_LOGITS), min_size=n * E, max_size=n * E)),
                      np.float32).reshape(n, E)
    bias = np.array(draw(st.lists(st.sampled_from(_BIASES), min_size=E, max_size=E)), np.float32)
    return spec, logits, bias, draw(st.sampled_from(GEMV_WDTYPES))


def exact_weight(w: np.ndarray, wdtype: str):
    """A weight of small exact values (identity gates and heads, NaN rows) in ``wdtype``: FP8
    with power-of-two scales (1.0, and 0.5 for a per-channel second row), so every code's
    dequantized value is exact."""
    if wdtype in FP8_KINDS:
        N, K = w.shape
        if wdtype == "fp8_block":
            return Fp8Weight(w.astype(ml_dtypes.float8_e4m3fn), np.ones((-(-N // 128), -(-K // 128)), np.float32),
                             (128, 128))
        scale = np.ones(N, np.float32)
        scale[1::2] = 0.5
        return Fp8Weight((w / scale[:, None]).astype(ml_dtypes.float8_e4m3fn), scale, None)
    return w.astype(ml_dtypes.bfloat16) if wdtype == "bfloat16" else w


@settings(max_examples=150, deadline=None)
@given(case=router_cases())
def test_moe_router_property(be, case):
    """Ties broken the reference's way (lowest group, lowest id), negative biases against
    masked groups' -inf: the gate is the identity, so the logits are exact, and cases
    whose ranking hangs on a rounding-size difference are skipped."""
    spec, logits, bias, wdtype = case
    assume(all(_no_near_ties(row, bias, spec) for row in logits))
    n, E = logits.shape
    gate = exact_weight(np.eye(E, dtype=np.float32), wdtype)
    ids, w = be.moe_router(be.from_host(logits), be.prepare_weight(gate), be.prepare_vector(bias), spec)
    ids_ref, w_ref = REF.moe_router(logits, REF.prepare_weight(gate), bias, spec)
    np.testing.assert_array_equal(be.to_host(ids), ids_ref)
    assert_close(be.to_host(w), w_ref, what="router weights")


@pytest.mark.parametrize("wdtype", GEMV_WDTYPES)
@pytest.mark.parametrize("n,E,K", [(1, 8, 2), (3, 6, 3), (17, 16, 4)])
@pytest.mark.parametrize("residual", [False, True])
def test_moe_experts(be, wdtype, n, E, K, residual):
    rng = rng_for("experts", wdtype, n, E, K, residual)
    H, I = 40, 23
    x = acts(rng, n, H)
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(n)]).astype(np.int32)
    weights = rng.random((n, K)).astype(np.float32)
    w13, w2 = weight(rng, (E, 2 * I, H), wdtype), weight(rng, (E, H, I), wdtype)
    res = acts(rng, n, H) if residual else None
    got = be.moe_experts(be.from_host(x), be.from_host(ids), be.from_host(weights), be.prepare_weight(w13),
                         be.prepare_weight(w2), None if res is None else be.from_host(res))
    want = REF.moe_experts(x, ids, weights, REF.prepare_weight(w13), REF.prepare_weight(w2), res)
    assert_close(be.to_host(got), want, what="moe_experts")


@pytest.mark.parametrize("wdtype", GEMV_WDTYPES)
@pytest.mark.parametrize("n", [1, 3, 9])
@pytest.mark.parametrize("by_pair", [True, False])
def test_moe_norm(be, wdtype, n, by_pair):
    """moe_router / moe_experts with norm=(g, eps) against their definition on rmsnorm(x):
    the router's ids and weights, and the experts with x itself as the residual (a MoE
    block's post-attention half), by pair (n K <= E) and by expert."""
    rng = rng_for("moe_norm", wdtype, n, by_pair)
    H, I, K = 40, 23, 2
    E = 2 * n * K if by_pair else 4
    x, g = acts(rng, n, H) * 2.0, acts(rng, H)
    gate_w, bias = weight(rng, (E, H), wdtype), acts(rng, E, scale=0.1)
    spec = RouterSpec(K, 1, 1, 1.0, True)
    ids, wts = be.moe_router(be.from_host(x), be.prepare_weight(gate_w), be.prepare_vector(bias), spec,
                             norm=(be.prepare_vector(g), 1e-6))
    xn = REF.rmsnorm(x, g, 1e-6)
    ids_ref, w_ref = REF.moe_router(xn, REF.prepare_weight(gate_w), bias, spec)
    np.testing.assert_array_equal(be.to_host(ids), ids_ref)
    assert_close(be.to_host(wts), w_ref, what="router weights, norm=")
    w13, w2 = weight(rng, (E, 2 * I, H), wdtype), weight(rng, (E, H, I), wdtype)
    xd = be.from_host(x)
    got = be.moe_experts(xd, be.from_host(ids_ref), be.from_host(w_ref), be.prepare_weight(w13),
                         be.prepare_weight(w2), xd, norm=(be.prepare_vector(g), 1e-6))
    want = REF.moe_experts(xn, ids_ref, w_ref, REF.prepare_weight(w13), REF.prepare_weight(w2), x)
    assert_close(be.to_host(got), want, what="moe_experts, norm=")


# -- mlp ----------------------------------------------------------------------

@pytest.mark.parametrize("wdtype", GEMV_WDTYPES)
@pytest.mark.parametrize("n", [1, 3, 17])
@pytest.mark.parametrize("H,I", [(1, 1), (64, 37), (33, 200)])
def test_swiglu_mlp(be, wdtype, n, H, I):
    rng = rng_for("mlp", wdtype, n, H, I)
    x, res = acts(rng, n, H), acts(rng, n, H)
    w13, w2 = weight(rng, (2 * I, H), wdtype), weight(rng, (H, I), wdtype)
    for r in (None, res):
        got = be.swiglu_mlp(be.from_host(x), be.prepare_weight(w13), be.prepare_weight(w2),
                            None if r is None else be.from_host(r))
        want = REF.swiglu_mlp(x, REF.prepare_weight(w13), REF.prepare_weight(w2), r)
        assert_close(be.to_host(got), want, what=f"swiglu_mlp residual={r is not None}")


# -- SwiGLU clamp (Step-3.5 / 3.7 swiglu_limits) -------------------------------

#: a limit that clips most activations here (gate and up are ~N(0, 1): 1/sqrt(fan-in) weights,
#: N(0, 1) inputs; |up| > 0.2 for ~84 % of them), and one that no activation reaches (the
#: result is then the unclamped one, bit for bit)
CLIPS, NEVER = 0.2, 1e30


def _bits_equal(a, b, what):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32), err_msg=what)


@pytest.mark.parametrize("wdtype", GEMV_WDTYPES)
@pytest.mark.parametrize("n", [1, 3, 17])
@pytest.mark.parametrize("I", [7, 32, 100])
def test_swiglu_mlp_limit(be, wdtype, n, I):
    """``limit`` clamps min(silu(gate), L) and clip(up, -L, L) as the reference does, with and
    without a residual and into ``out=`` the residual itself; None, 0 and a limit nothing
    reaches give the unclamped bits."""
    rng = rng_for("mlp_limit", wdtype, n, I)
    H = 40
    x, res = acts(rng, n, H), acts(rng, n, H)
    w13, w2 = weight(rng, (2 * I, H), wdtype), weight(rng, (H, I), wdtype)
    p13, p2, r13, r2 = be.prepare_weight(w13), be.prepare_weight(w2), REF.prepare_weight(w13), REF.prepare_weight(w2)
    f = be.from_host
    for r in (None, res):
        rb = None if r is None else f(r)
        plain = be.to_host(be.swiglu_mlp(f(x), p13, p2, rb))
        for off in (None, 0, 0.0, NEVER):
            _bits_equal(be.to_host(be.swiglu_mlp(f(x), p13, p2, rb, limit=off)), plain, f"limit={off}")
        want = REF.swiglu_mlp(x, r13, r2, r, limit=CLIPS)
        got = be.to_host(be.swiglu_mlp(f(x), p13, p2, rb, limit=CLIPS))
        assert_close(got, want, what=f"swiglu_mlp limit={CLIPS} residual={r is not None}")
        assert not np.allclose(want, REF.swiglu_mlp(x, r13, r2, r), atol=1e-3), "the limit clipped nothing"
    yb = f(res.copy())
    assert be.swiglu_mlp(f(x), p13, p2, yb, out=yb, limit=CLIPS) is yb
    assert_close(be.to_host(yb), REF.swiglu_mlp(x, r13, r2, res, limit=CLIPS), what="swiglu_mlp limit, out=residual")


#: (n, E, K, I): one row to 17, up to 16 experts, top-1 to top-4, odd and even I
EXPERT_LIMIT_CASES = [(1, 16, 1, 100), (1, 8, 4, 7), (3, 5, 2, 32), (3, 16, 3, 7), (17, 16, 4, 100), (17, 3, 2, 32)]


@pytest.mark.parametrize("wdtype", GEMV_WDTYPES)
@pytest.mark.parametrize("n,E,K,I", EXPERT_LIMIT_CASES)
def test_moe_experts_limit(be, wdtype, n, E, K, I):
    """Every routed expert's SwiGLU clamped by ``limit``, as the reference; None, 0 and a
    limit nothing reaches give the unclamped bits."""
    rng = rng_for("experts_limit", wdtype, n, E, K, I)
    H = 40
    x, res = acts(rng, n, H), acts(rng, n, H)
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(n)]).astype(np.int32)
    wts = rng.random((n, K)).astype(np.float32)
    w13, w2 = weight(rng, (E, 2 * I, H), wdtype), weight(rng, (E, H, I), wdtype)
    p13, p2, r13, r2 = be.prepare_weight(w13), be.prepare_weight(w2), REF.prepare_weight(w13), REF.prepare_weight(w2)
    f = be.from_host

    def run(r, **kw):
        return be.moe_experts(f(x), f(ids), f(wts), p13, p2, None if r is None else f(r), **kw)

    for r in (None, res):
        want = REF.moe_experts(x, ids, wts, r13, r2, r, limit=CLIPS)
        assert_close(be.to_host(run(r, limit=CLIPS)), want, what=f"moe_experts limit={CLIPS} residual={r is not None}")
        assert not np.allclose(want, REF.moe_experts(x, ids, wts, r13, r2, r), atol=1e-3), "the limit clipped nothing"
    plain = be.to_host(run(res))
    for off in (None, 0, NEVER):
        _bits_equal(be.to_host(run(res, limit=off)), plain, f"limit={off}")
    yb = f(res.copy())
    assert be.moe_experts(f(x), f(ids), f(wts), p13, p2, yb, out=yb, limit=CLIPS) is yb
    assert_close(be.to_host(yb), REF.moe_experts(x, ids, wts, r13, r2, res, limit=CLIPS),
                 what="moe_experts limit, out=residual")


@pytest.mark.parametrize("wdtype", GEMV_WDTYPES)
@pytest.mark.parametrize("n", [1, 3, 17])
@pytest.mark.parametrize("I", [7, 100])
def test_swiglu_mlp_clamp_gate(be, wdtype, n, I):
    """DeepSeek-V4's clamp (``clamp_gate``: the gate before silu) as the reference does, with and
    without a residual; it differs from Step-3.5's clamp on these rows (a negative control: a
    backend that ignored ``clamp_gate`` fails); no limit with clamp_gate gives the unclamped bits."""
    rng = rng_for("mlp_clamp_gate", wdtype, n, I)
    H = 40
    x, res = acts(rng, n, H, scale=2.0), acts(rng, n, H)              # gates ~N(0, 4): many pass CLIPS
    w13, w2 = weight(rng, (2 * I, H), wdtype), weight(rng, (H, I), wdtype)
    p13, p2, r13, r2 = be.prepare_weight(w13), be.prepare_weight(w2), REF.prepare_weight(w13), REF.prepare_weight(w2)
    f = be.from_host
    for r in (None, res):
        rb = None if r is None else f(r)
        want = REF.swiglu_mlp(x, r13, r2, r, limit=CLIPS, clamp_gate=True)
        got = be.to_host(be.swiglu_mlp(f(x), p13, p2, rb, limit=CLIPS, clamp_gate=True))
        assert_close(got, want, what=f"swiglu_mlp limit={CLIPS} clamp_gate residual={r is not None}")
        assert not np.allclose(want, REF.swiglu_mlp(x, r13, r2, r, limit=CLIPS), atol=1e-4, rtol=1e-3), \
            "the clamps agree"
    plain = be.to_host(be.swiglu_mlp(f(x), p13, p2, f(res)))
    for off in (None, 0, NEVER):
        _bits_equal(be.to_host(be.swiglu_mlp(f(x), p13, p2, f(res), limit=off, clamp_gate=True)), plain,
                    f"limit={off} clamp_gate")
    yb = f(res.copy())
    assert be.swiglu_mlp(f(x), p13, p2, yb, out=yb, limit=CLIPS, clamp_gate=True) is yb
    assert_close(be.to_host(yb), REF.swiglu_mlp(x, r13, r2, res, limit=CLIPS, clamp_gate=True),
                 what="swiglu_mlp clamp_gate, out=residual")


@pytest.mark.parametrize("wdtype", GEMV_WDTYPES)
@pytest.mark.parametrize("n,E,K,I", EXPERT_LIMIT_CASES)
def test_moe_experts_clamp_gate(be, wdtype, n, E, K, I):
    """Every routed expert's gate clamped before silu (DeepSeek-V4's experts), as the
    reference; other than Step-3.5's clamp here; no limit: the unclamped bits."""
    rng = rng_for("experts_clamp_gate", wdtype, n, E, K, I)
    H = 40
    x, res = acts(rng, n, H, scale=2.0), acts(rng, n, H)
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(n)]).astype(np.int32)
    wts = rng.random((n, K)).astype(np.float32)
    w13, w2 = weight(rng, (E, 2 * I, H), wdtype), weight(rng, (E, H, I), wdtype)
    p13, p2, r13, r2 = be.prepare_weight(w13), be.prepare_weight(w2), REF.prepare_weight(w13), REF.prepare_weight(w2)
    f = be.from_host

    def run(r, **kw):
        return be.moe_experts(f(x), f(ids), f(wts), p13, p2, None if r is None else f(r), **kw)

    for r in (None, res):
        want = REF.moe_experts(x, ids, wts, r13, r2, r, limit=CLIPS, clamp_gate=True)
        assert_close(be.to_host(run(r, limit=CLIPS, clamp_gate=True)), want,
                     what=f"moe_experts limit={CLIPS} clamp_gate residual={r is not None}")
        assert not np.allclose(want, REF.moe_experts(x, ids, wts, r13, r2, r, limit=CLIPS), atol=1e-4,
                               rtol=1e-3), "the clamps agree"
    plain = be.to_host(run(res))
    for off in (None, 0, NEVER):
        _bits_equal(be.to_host(run(res, limit=off, clamp_gate=True)), plain, f"limit={off} clamp_gate")


@pytest.mark.parametrize("bad", [1, 0, "true", None, 1.0])
def test_clamp_gate_validated(be, bad):
    """clamp_gate is a bool (np.bool_ too); anything else is refused, naming it."""
    f = be.from_host
    x = f(np.zeros((2, 8), np.float32))
    w13, w2 = be.prepare_weight(np.zeros((4, 8), np.float32)), be.prepare_weight(np.zeros((8, 2), np.float32))
    e13, e2 = be.prepare_weight(np.zeros((3, 4, 8), np.float32)), be.prepare_weight(np.zeros((3, 8, 2), np.float32))
    with pytest.raises(TypeError, match="clamp_gate: expected a bool"):
        be.swiglu_mlp(x, w13, w2, limit=2.0, clamp_gate=bad)
    with pytest.raises(TypeError, match="clamp_gate: expected a bool"):
        be.moe_experts(x, f(np.zeros((2, 1), np.int32)), f(np.ones((2, 1), np.float32)), e13, e2, limit=2.0,
                       clamp_gate=bad)
    be.swiglu_mlp(x, w13, w2, limit=2.0, clamp_gate=np.bool_(True))


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")   # silu(-1e3) in the reference
@pytest.mark.parametrize("wdtype", GEMV_WDTYPES)
def test_swiglu_limit_keeps_nan_and_bounds_large_values(be, wdtype):
    """A NaN input row stays NaN through the clamp (CUDA's fminf / fmaxf would have made it
    finite), and a row of huge inputs comes out bounded by the clamp, as the reference."""
    rng = rng_for("limit_nan", wdtype)
    n, H, I, E, K = 4, 48, 20, 6, 2
    x = acts(rng, n, H)
    x[1, 5] = np.nan                                                   # every gate and up of row 1: NaN
    x[2] *= 100.0                                                      # row 2: |gate|, |up| ~ 100, clipped
    x[3, :] = np.nan                                                   # row 3: NaN everywhere
    w13, w2 = weight(rng, (2 * I, H), wdtype), weight(rng, (H, I), wdtype)
    e13, e2 = weight(rng, (E, 2 * I, H), wdtype), weight(rng, (E, H, I), wdtype)
    ids = np.array([[0, 5], [3, 1], [2, 4], [5, 0]], np.int32)
    wts = rng.random((n, K)).astype(np.float32)
    f = be.from_host
    for limit, gate in ((None, False), (0.5, False), (7.0, False), (0.5, True), (7.0, True)):
        rows = [0, 1, 3] if limit is None else [0, 1, 2, 3]            # unclamped, row 2 is ~1e4 with cancellations
        limit_kw = dict(limit=limit, clamp_gate=gate)                  # gate: DeepSeek-V4's clamp, before silu
        got = be.to_host(be.swiglu_mlp(f(x), be.prepare_weight(w13), be.prepare_weight(w2), **limit_kw))
        want = REF.swiglu_mlp(x, REF.prepare_weight(w13), REF.prepare_weight(w2), **limit_kw)
        assert np.isnan(want[[1, 3]]).all() and np.isfinite(want[[0, 2]]).all()
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        assert_close(got[rows], want[rows], what=f"swiglu_mlp with NaN and huge rows, limit={limit}")
        got = be.to_host(be.moe_experts(f(x), f(ids), f(wts), be.prepare_weight(e13), be.prepare_weight(e2),
                                        **limit_kw))
        want = REF.moe_experts(x, ids, wts, REF.prepare_weight(e13), REF.prepare_weight(e2), **limit_kw)
        assert np.isnan(want[[1, 3]]).all() and np.isfinite(want[[0, 2]]).all()
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        assert_close(got[rows], want[rows], what=f"moe_experts with NaN and huge rows, limit={limit}")
        if limit is not None:                                          # |act| <= L^2, so |y| <= L^2 sum |w2|
            assert (np.abs(want[2]) <= limit ** 2 * np.abs(REF.prepare_weight(w2)).sum(axis=1) * 1.001).all()


@pytest.mark.parametrize("bad,error", [(-1.0, ValueError), (float("nan"), ValueError), (float("inf"), ValueError),
                                       (1e39, ValueError), (1e-50, ValueError), ("7", TypeError), (True, TypeError)])
def test_swiglu_limit_validated(be, bad, error):
    """Anything but None, 0 or a finite value > 0 (that FP32 holds) is refused, naming ``limit``."""
    f = be.from_host
    x = f(np.zeros((2, 8), np.float32))
    w13, w2 = be.prepare_weight(np.zeros((4, 8), np.float32)), be.prepare_weight(np.zeros((8, 2), np.float32))
    e13, e2 = be.prepare_weight(np.zeros((3, 4, 8), np.float32)), be.prepare_weight(np.zeros((3, 8, 2), np.float32))
    with pytest.raises(error, match="limit"):
        be.swiglu_mlp(x, w13, w2, limit=bad)
    with pytest.raises(error, match="limit"):
        be.moe_experts(x, f(np.zeros((2, 1), np.int32)), f(np.ones((2, 1), np.float32)), e13, e2, limit=bad)
    for ok in (7, np.float32(16.0), np.float64(0.5), 0):               # ints and NumPy scalars are numbers
        be.swiglu_mlp(x, w13, w2, limit=ok)


# -- lm head ------------------------------------------------------------------

def random_bitmask(rng, n, V, density) -> np.ndarray:
    """[n, ceil(V/32)] int32 with random padding bits past V as well."""
    bits = rng.random((n, (V + 31) // 32 * 32)) < density
    words = (bits.reshape(n, -1, 32).astype(np.uint64) << np.arange(32, dtype=np.uint64)).sum(-1)
    return words.astype(np.uint32).view(np.int32)


@pytest.mark.parametrize("wdtype", GEMV_WDTYPES)
@pytest.mark.parametrize("n", [1, 3, 17])
@pytest.mark.parametrize("V", [1, 33, 1000])
def test_lm_head(be, wdtype, n, V):
    rng = rng_for("lm_head", wdtype, n, V)
    H = 48
    x, w = acts(rng, n, H), weight(rng, (V, H), wdtype)
    wb, wr = be.prepare_weight(w), REF.prepare_weight(w)
    logits = REF.lm_head_logits(x, wr)
    assert_close(be.to_host(be.lm_head_logits(be.from_host(x), wb)), logits, what="lm_head_logits")
    for mask in (None, random_bitmask(rng, n, V, 0.3), random_bitmask(rng, n, V, 0.02)):
        ok = np.ones((n, V), bool) if mask is None else bitmask_allowed(mask, V)
        if not ok.any(axis=1).all():
            with pytest.raises(NoAllowedToken, match=f"row {int(np.flatnonzero(~ok.any(axis=1))[0])}"):
                be.lm_head_argmax(be.from_host(x), wb, None if mask is None else be.from_host(mask))
            continue
        got = be.to_host(be.lm_head_argmax(be.from_host(x), wb, None if mask is None else be.from_host(mask)))
        want = REF.lm_head_argmax(x, wr, mask)
        assert got.dtype == np.int32 and got.shape == (n,)
        for r in range(n):                           # exact, unless the top two differ by rounding only
            if got[r] != want[r]:
                assert ok[r, got[r]], f"row {r}: a masked token {got[r]} won"
                tol = TOLERANCE["float32"]
                assert abs(logits[r, got[r]] - logits[r, want[r]]) <= tol.atol + tol.rtol * abs(logits[r, want[r]])


@st.composite
def argmax_cases(draw):
    n = draw(st.integers(1, 4))
    V = draw(st.sampled_from([1, 2, 31, 33, 64, 65, 100]))
    grid = st.sampled_from([-2.0, -0.5, 0.0, 0.5, 1.0, 3.0])          # few values: many ties
    x = np.array(draw(st.lists(grid, min_size=n * V, max_size=n * V)), np.float32).reshape(n, V)
    nan_tokens = draw(st.lists(st.integers(0, V - 1), max_size=V // 2 + 1))
    words = draw(st.one_of(st.none(), st.lists(st.integers(-2**31, 2**31 - 1),
                                                min_size=n * ((V + 31) // 32), max_size=n * ((V + 31) // 32))))
    mask = None if words is None else np.array(words, np.int32).reshape(n, -1)
    return x, nan_tokens, mask, draw(st.sampled_from(GEMV_WDTYPES))


@settings(max_examples=100, deadline=None)
@given(case=argmax_cases(), mapped=st.booleans())
def test_lm_head_shard_partial(be, case, mapped):
    """A vocabulary shard's partial result (``best=`` / ``sum_exp=``): the reference's
    ``masked_best`` checked against its definition in float64 (the first maximum of the allowed
    non-NaN logits, the sum of exp(l - best) with ties counting 1; id -1, -inf, 0 and no raise
    for a row without a candidate), then every backend against it exactly (an identity head:
    logits = x), the ids and confidences as the plain call gives them where a row has one."""
    x, nan_tokens, mask, wdtype = case
    n, V = x.shape
    w = np.eye(V, dtype=np.float32)
    w[nan_tokens] = np.nan
    w = exact_weight(w, wdtype)
    logits = REF.lm_head_logits(x, REF.prepare_weight(w))
    ok = ~np.isnan(logits) & (True if mask is None else bitmask_allowed(mask, V))
    ids, best, sums = masked_best(logits, mask)
    for r in range(n):
        if not ok[r].any():
            assert (ids[r], best[r], sums[r]) == (-1, -np.inf, 0.0)
            continue
        top = logits[r][ok[r]].max()
        assert ids[r] == np.flatnonzero(ok[r] & (logits[r] == top))[0] and best[r] == top
        with np.errstate(invalid="ignore"):
            terms = np.where(logits[r] == top, 1.0, np.exp(logits[r].astype(np.float64) - top))
        assert np.isclose(sums[r], terms[ok[r]].sum(), rtol=1e-6)
    id_map = (np.arange(V, dtype=np.int32) * 3 + 5) if mapped else None
    kw = {} if id_map is None else {"id_map": be.from_host(id_map)}
    f = be.from_host
    bv, sv, cf = (f(np.full(n, 7.0, np.float32)) for _ in range(3))
    got = be.to_host(be.lm_head_argmax(f(x), be.prepare_weight(w), None if mask is None else f(mask),
                                       best=bv, sum_exp=sv, conf=cf, **kw))
    want = ids if id_map is None else np.where(ids >= 0, id_map[np.maximum(ids, 0)], -1)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(be.to_host(bv), best)
    has = ids >= 0
    np.testing.assert_allclose(be.to_host(sv)[has], sums[has], rtol=1e-5)
    assert (be.to_host(sv)[~has] == 0).all() and np.isnan(be.to_host(cf)[~has]).all()
    np.testing.assert_allclose(be.to_host(cf)[has], 1 / sums[has], rtol=1e-5)
    only_best = be.to_host(be.lm_head_argmax(f(x), be.prepare_weight(w), None if mask is None else f(mask),
                                             best=f(np.zeros(n, np.float32)), **kw))
    np.testing.assert_array_equal(only_best, want)                    # best= alone: the same ids, no raise


def test_lm_head_shard_partial_buffers_checked(be):
    """A wrong best= / sum_exp= buffer is refused by name before anything is written."""
    V, H, n = 40, 8, 2
    x, w = be.from_host(np.ones((n, H), np.float32)), be.prepare_weight(np.eye(V, H, dtype=np.float32))
    out = be.from_host(np.full(n, 9, np.int32))
    for name in ("best", "sum_exp"):
        with pytest.raises((ValueError, TypeError), match=name):
            be.lm_head_argmax(x, w, out=out, **{name: be.from_host(np.zeros(n + 1, np.float32))})
    np.testing.assert_array_equal(be.to_host(out), [9, 9])


@pytest.mark.parametrize("wdtype", GEMV_WDTYPES)
@pytest.mark.parametrize("n,E,K", [(1, 8, 2), (3, 6, 3), (17, 16, 4)])
def test_moe_experts_empty_slots(be, wdtype, n, E, K):
    """An id of -1 (an expert-parallel rank's slot for an expert it does not hold) adds
    nothing: the reference equals its definition (the same rows with those slots' weights at
    0 on any valid expert), every backend equals the reference, and a row of empty slots is its
    residual exactly."""
    rng = rng_for("experts-empty", wdtype, n, E, K)
    H, I = 40, 23
    x, res = acts(rng, n, H), acts(rng, n, H)
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(n)]).astype(np.int32)
    empty = rng.random((n, K)) < 0.4
    empty[0] = True                                                    # row 0: every slot empty
    weights = rng.random((n, K)).astype(np.float32)
    w13, w2 = weight(rng, (E, 2 * I, H), wdtype), weight(rng, (E, H, I), wdtype)
    r13, r2 = REF.prepare_weight(w13), REF.prepare_weight(w2)
    local = np.where(empty, -1, ids).astype(np.int32)
    want = REF.moe_experts(x, local, weights, r13, r2, res)
    assert_close(want, REF.moe_experts(x, ids, np.where(empty, 0, weights).astype(np.float32), r13, r2, res),
                 what="empty slots, the definition")
    np.testing.assert_array_equal(want[0], res[0])
    f = be.from_host
    got = be.to_host(be.moe_experts(f(x), f(local), f(weights), be.prepare_weight(w13), be.prepare_weight(w2),
                                    f(res)))
    assert_close(got, want, what="moe_experts with empty slots")
    np.testing.assert_array_equal(got[0], res[0])
    with pytest.raises(ValueError, match="ids"):
        REF.moe_experts(x, np.full((n, K), -2, np.int32), weights, r13, r2, res)


@settings(max_examples=150, deadline=None)
@given(case=argmax_cases())
def test_lm_head_argmax_property(be, case):
    """Exact ids, ties to the lowest id, NaN never wins, padding bits never count:
    the LM head is the identity (logits = x exactly), rows of NaN make NaN tokens."""
    x, nan_tokens, mask, wdtype = case
    n, V = x.shape
    w = np.eye(V, dtype=np.float32)
    w[nan_tokens] = np.nan                                             # FP8: the NaN code 0x7F
    w = exact_weight(w, wdtype)
    args = (be.from_host(x), be.prepare_weight(w), None if mask is None else be.from_host(mask))
    try:
        want = REF.lm_head_argmax(x, REF.prepare_weight(w), mask)
    except NoAllowedToken as e:
        with pytest.raises(NoAllowedToken, match=str(e).split(":")[0] + ":"):
            be.lm_head_argmax(*args)
        return
    np.testing.assert_array_equal(be.to_host(be.lm_head_argmax(*args)), want)


def test_lm_head_argmax_edges(be):
    V, H = 33, 33
    w = be.prepare_weight(np.eye(V, dtype=np.float32).astype(ml_dtypes.bfloat16))
    x = np.zeros((3, H), np.float32)
    x[:, 32] = 5.0                                   # the last real token is the best everywhere
    only_padding = np.array([0, -2], np.int32)       # word 1: bits 1..31 = tokens 33..63, past V
    mask = np.stack([np.array([0, 1], np.int32), np.array([-1, -1], np.int32), only_padding])
    with pytest.raises(NoAllowedToken, match="row 2"):
        be.lm_head_argmax(be.from_host(x), w, be.from_host(mask))
    mask[2] = [1 << 7, -2]                           # token 7 only (and padding)
    got = be.to_host(be.lm_head_argmax(be.from_host(x), w, be.from_host(mask)))
    np.testing.assert_array_equal(got, [32, 32, 7])
    x[1, :] = np.nan                                 # no mask: the message says why there is no token
    with pytest.raises(NoAllowedToken, match="row 1: every logit is NaN") as e:
        be.lm_head_argmax(be.from_host(x), w)
    assert e.value.row == 1


@settings(max_examples=120, deadline=None)
@given(case=argmax_cases(), k=st.integers(1, 6), mapped=st.booleans())
def test_lm_head_topk_property(be, case, k, mapped):
    """A draft tree's candidates: the k best allowed tokens in order (ties to the lowest id,
    NaN never taken, -1 / 0 past the row's candidates) and their probabilities, as the
    reference's over exact logits (an identity head); column 0 is the argmax and its
    confidence; with ``id_map`` the ids are mapped and nothing else changes."""
    x, nan_tokens, mask, wdtype = case
    n, V = x.shape
    w = np.eye(V, dtype=np.float32)
    w[nan_tokens] = np.nan
    w = exact_weight(w, wdtype)
    id_map = (np.arange(V, dtype=np.int32) * 3 + 1) if mapped else None
    kw = {} if id_map is None else {"id_map": be.from_host(id_map)}
    args = (be.from_host(x), be.prepare_weight(w), None if mask is None else be.from_host(mask))
    try:
        want_ids, want_p = REF.lm_head_topk(x, REF.prepare_weight(w), mask, k)
    except NoAllowedToken as e:
        with pytest.raises(NoAllowedToken, match=str(e).split(":")[0] + ":"):
            be.lm_head_topk(*args, k, **kw)
        return
    ids, probs = be.lm_head_topk(*args, k, **kw)
    ids, probs = be.to_host(ids), be.to_host(probs)
    assert ids.dtype == np.int32 and probs.dtype == np.float32 and ids.shape == probs.shape == (n, k)
    np.testing.assert_array_equal(ids, want_ids if id_map is None else np.where(want_ids >= 0, id_map[want_ids], -1))
    assert_close(probs, want_p, what="topk probs")
    conf = np.empty(n, np.float32)
    top = REF.lm_head_argmax(x, REF.prepare_weight(w), mask, conf=conf)
    np.testing.assert_array_equal(want_ids[:, 0], top)
    assert_close(want_p[:, 0], conf, what="topk column 0 vs confidence")


def test_lm_head_topk_into_buffers(be):
    """A planned tree step's call: ``out`` / ``probs`` / ``logits`` given are written in place and
    returned; with ``check=False`` a row without a candidate keeps -1 / 0 instead of raising
    (the default still raises); the other rows are the plain call's."""
    n, V, k = 3, 40, 4
    rng = rng_for("topk_out", n, V, k)
    x = acts(rng, n, V)
    w = be.prepare_weight(exact_weight(np.eye(V, dtype=np.float32), "float32"))
    mask = np.full((n, (V + 31) // 32), -1, np.int32)
    mask[1] = 0                                            # row 1: nothing allowed
    xd, md = be.from_host(x), be.from_host(mask)
    out, probs = be.xp.full((n, k), 7, np.int32), be.xp.full((n, k), 7, np.float32)
    logits = be.xp.zeros((n, V), np.float32)
    got = be.lm_head_topk(xd, w, md, k, out=out, probs=probs, logits=logits, check=False)
    assert got[0] is out and got[1] is probs
    ids, pr = be.to_host(out), be.to_host(probs)
    assert (ids[1] == -1).all() and (pr[1] == 0).all()
    keep = np.array([0, 2])
    want_ids, want_p = REF.lm_head_topk(x[keep], REF.prepare_weight(np.eye(V, dtype=np.float32)), None, k)
    np.testing.assert_array_equal(ids[keep], want_ids)
    assert_close(pr[keep], want_p, what="topk probs into buffers")
    np.testing.assert_array_equal(be.to_host(logits), x)    # an identity head: the logits are x
    with pytest.raises(NoAllowedToken, match="row 1"):
        be.lm_head_topk(xd, w, md, k)


@pytest.mark.parametrize("n,V,k", [(1, 1, 3), (3, 300, 4), (2, 5000, 8)])
def test_lm_head_topk_random(be, n, V, k):
    """Random logits through a real GEMV: the candidates are the reference's up to rounding
    (a swap only between logits within the float32 tolerance), their probabilities sum to
    at most 1 and fall along the order."""
    rng = rng_for("topk", n, V, k)
    H = 40
    x, w = acts(rng, n, H), weight(rng, (V, H), "bfloat16")
    wb, wr = be.prepare_weight(w), REF.prepare_weight(w)
    ids, probs = (be.to_host(a) for a in be.lm_head_topk(be.from_host(x), wb, None, k))
    want_ids, want_p = REF.lm_head_topk(x, wr, None, k)
    logits = REF.lm_head_logits(x, wr)
    tol = TOLERANCE["float32"]
    for r in range(n):
        got_l, want_l = logits[r, ids[r][ids[r] >= 0]], logits[r, want_ids[r][want_ids[r] >= 0]]
        assert np.all(np.abs(got_l - want_l) <= tol.atol + tol.rtol * np.abs(want_l))
    assert_close(probs, want_p, what="topk probs")
    assert (probs.sum(axis=1) <= 1 + 1e-5).all() and (np.diff(probs, axis=1) <= 1e-6).all()


# -- prefill-sized inputs -----------------------------------------------------

@pytest.mark.parametrize("wdtype", WDTYPES + ["fp8_block"])
def test_many_rows(be, wdtype):
    """Inputs past the cpu kernels' ``SMALL`` (65536 elements or multiply-adds), where
    the loops a decode step runs on the calling thread (norms, rope, router, the
    experts' gather and combine, the attention merge) run in parallel."""
    rng = rng_for("many_rows", wdtype)
    n, H, V, E, K, I = 80, 1024, 50, 16, 2, 16                       # n * H = 81920
    x, w = acts(rng, n, H, scale=2.0), acts(rng, H)
    assert_close(be.to_host(be.rmsnorm(be.from_host(x), be.prepare_vector(w), 1e-6)),
                 REF.rmsnorm(x, w, 1e-6), what="rmsnorm (many rows)")
    embed, eh = weight(rng, (V, H), dense(wdtype)), weight(rng, (H, 2 * H), wdtype)
    tokens = rng.integers(0, V, n).astype(np.int32)
    got = be.mtp_input(be.prepare_weight(embed), be.from_host(tokens), be.from_host(x), be.prepare_vector(w),
                       be.prepare_vector(w), be.prepare_weight(eh), 1e-5)
    want = REF.mtp_input(REF.prepare_weight(embed), tokens, x, w, w, REF.prepare_weight(eh), 1e-5)
    assert_close(be.to_host(got), want, what="mtp_input (many rows)")
    spec = RouterSpec(top_k=4, n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True)
    gate_w, bias = weight(rng, (E, H), wdtype), acts(rng, E, scale=0.1)
    ids, wts = be.moe_router(be.from_host(x), be.prepare_weight(gate_w), be.prepare_vector(bias), spec)
    ids_ref, wts_ref = REF.moe_router(x, REF.prepare_weight(gate_w), bias, spec)
    np.testing.assert_array_equal(be.to_host(ids), ids_ref)
    assert_close(be.to_host(wts), wts_ref, what="router weights (many rows)")
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(n)]).astype(np.int32)
    weights = rng.random((n, K)).astype(np.float32)
    w13, w2 = weight(rng, (E, 2 * I, H), wdtype), weight(rng, (E, H, I), wdtype)
    got = be.moe_experts(be.from_host(x), be.from_host(ids), be.from_host(weights), be.prepare_weight(w13),
                         be.prepare_weight(w2), be.from_host(x))
    want = REF.moe_experts(x, ids, weights, REF.prepare_weight(w13), REF.prepare_weight(w2), x)
    assert_close(be.to_host(got), want, what="moe_experts (many rows)")
    # rope + KV write and attention: n * (Hq + 2 Hkv) * D = 600 * 256, n * Hq * D = 600 * 128
    n, Hq, Hkv, D, NB, BS = 600, 8, 4, 16, 80, 8
    qkv = acts(rng, n, (Hq + 2 * Hkv) * D)
    q, q_ref, k_cache, v_cache, k_ref, v_ref, slots = _rope_both(be, rng, qkv, Hq, Hkv, D, D, NB, BS)
    assert_close(be.to_host(q), q_ref, what="rope q (many rows)")
    assert_close(be.kv_to_host(k_cache), k_ref, kv_tol(be), what="rope k cache (many rows)")
    tables = rng.permutation(NB).reshape(2, NB // 2).astype(np.int32)
    row_seq = (np.arange(n) % 2).astype(np.int32)
    row_len = rng.integers(1, NB // 2 * BS + 1, n).astype(np.int32)
    got = be.paged_attention(q, k_cache, v_cache, be.from_host(tables), be.from_host(row_seq),
                             be.from_host(row_len), D ** -0.5)
    want = REF.paged_attention(q_ref, k_ref, v_ref, tables, row_seq, row_len, D ** -0.5)
    assert_close(be.to_host(got), want, kv_tol(be), what="paged_attention (many rows)")


# -- output buffers -----------------------------------------------------------

def test_out_buffers(be):
    """Results land in the caller's buffers (a planned step preallocates them), the
    head's ``y = swiglu_mlp(f, w13, w2, y, out=y)`` (residual and output one array) included."""
    rng = rng_for("out_buffers")
    n, H, N, I, E = 3, 16, 5, 7, 4
    x = acts(rng, n, H)
    w, w13, w2, gate = (weight(rng, s, "bfloat16") for s in ((N, H), (2 * I, H), (H, I), (E, H)))
    xb = be.from_host(x)
    out = be.from_host(np.zeros((n, N), np.float32))
    assert be.linear(xb, be.prepare_weight(w), out=out) is out
    assert_close(be.to_host(out), REF.linear(x, REF.prepare_weight(w)), what="linear out=")
    y = acts(rng, n, H)
    yb = be.from_host(y.copy())
    assert be.swiglu_mlp(xb, be.prepare_weight(w13), be.prepare_weight(w2), yb, out=yb) is yb
    assert_close(be.to_host(yb), REF.swiglu_mlp(x, REF.prepare_weight(w13), REF.prepare_weight(w2), y),
                 what="swiglu_mlp out=residual")
    spec = RouterSpec(top_k=2, n_group=2, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True)
    ids, wts = be.from_host(np.zeros((n, 2), np.int32)), be.from_host(np.zeros((n, 2), np.float32))
    got = be.moe_router(xb, be.prepare_weight(gate), be.prepare_vector(np.zeros(E)), spec, ids=ids, weights=wts)
    assert got[0] is ids and got[1] is wts
    np.testing.assert_array_equal(be.to_host(ids), REF.moe_router(x, REF.prepare_weight(gate), np.zeros(E), spec)[0])
    am = be.from_host(np.zeros(n, np.int32))
    assert be.lm_head_argmax(xb, be.prepare_weight(w), out=am) is am
    with pytest.raises(ValueError, match="out: expected shape"):
        be.linear(xb, be.prepare_weight(w), out=be.from_host(np.zeros((n, N - 1), np.float32)))


def _overlapping(be, run, want, what):
    """An output buffer that overlaps an input without being it: host backends copy the
    input first and give the reference's result; the cuda launchers refuse (a shifted
    overlap is a race between blocks)."""
    if be.name == "cuda":
        with pytest.raises(ValueError, match="must not overlap"):
            run()
    else:
        assert_close(be.to_host(run()), want, what=what)


def test_out_overlapping_inputs(be):
    rng = rng_for("overlap")
    n, H, I, E = 3, 16, 6, 4
    f = be.from_host
    buf = acts(rng, n + 1, H)
    w, w13, w2 = (weight(rng, s, "bfloat16") for s in ((H, H), (2 * I, H), (H, I)))
    pw, p13, p2 = be.prepare_weight(w), be.prepare_weight(w13), be.prepare_weight(w2)
    r13, r2 = REF.prepare_weight(w13), REF.prepare_weight(w2)
    x = acts(rng, n, H)

    def shifted():                                   # input rows 0..n-1, output rows 1..n of one buffer
        b = f(buf.copy())
        return b[:n], b[1:]

    def linear_out_is_x():
        xb = f(buf[:n].copy())
        return be.linear(xb, pw, out=xb)
    _overlapping(be, linear_out_is_x, REF.linear(buf[:n], REF.prepare_weight(w)), "linear out=x")

    def rmsnorm_shifted():
        a, o = shifted()
        return be.rmsnorm(a, be.prepare_vector(np.ones(H)), 1e-6, out=o)
    _overlapping(be, rmsnorm_shifted, REF.rmsnorm(buf[:n], np.ones(H, np.float32), 1e-6), "rmsnorm shifted")

    def linear_residual_shifted():
        a, o = shifted()
        return be.linear(f(x), pw, None, a, out=o)
    _overlapping(be, linear_residual_shifted, REF.linear(x, REF.prepare_weight(w), None, buf[:n]),
                 "linear residual shifted")

    def swiglu_residual_shifted():
        a, o = shifted()
        return be.swiglu_mlp(f(x), p13, p2, a, out=o)
    _overlapping(be, swiglu_residual_shifted, REF.swiglu_mlp(x, r13, r2, buf[:n]), "swiglu_mlp residual shifted")

    ids = np.array([[0, 2], [3, 0], [1, 2]], np.int32)
    wts = rng.random((n, 2)).astype(np.float32)
    e13 = weight(rng, (E, 2 * I, H), "bfloat16")
    e2 = weight(rng, (E, H, I), "bfloat16")

    def experts_residual_shifted():
        a, o = shifted()
        return be.moe_experts(f(x), f(ids), f(wts), be.prepare_weight(e13), be.prepare_weight(e2), a, out=o)
    Hq, Hkv, D, BS, NB = 4, 2, 8, 4, 6
    k_cache, v_cache = _filled_caches(be, rng, NB, BS, Hkv, D)
    tables = np.arange(NB, dtype=np.int32).reshape(1, NB)
    row_seq, row_len = np.zeros(n, np.int32), np.array([3, 10, 24], np.int32)
    qbuf = acts(rng, n + 1, Hq * D)

    def attention_out_shifted_over_q():
        b = f(qbuf.copy())
        return be.paged_attention(b[:n].reshape(n, Hq, D), k_cache, v_cache, f(tables), f(row_seq), f(row_len),
                                  D ** -0.5, out=b[1:])
    _overlapping(be, attention_out_shifted_over_q,
                 REF.paged_attention(qbuf[:n].reshape(n, Hq, D), be.kv_to_host(k_cache), be.kv_to_host(v_cache),
                                     tables, row_seq, row_len, D ** -0.5), "paged_attention out over q")

    _overlapping(be, experts_residual_shifted,
                 REF.moe_experts(x, ids, wts, REF.prepare_weight(e13), REF.prepare_weight(e2), buf[:n]),
                 "moe_experts residual shifted")


# -- validation ---------------------------------------------------------------

def test_launchers_validate(be):
    f = be.from_host
    x = f(np.zeros((2, 8), np.float32))
    w = be.prepare_weight(np.zeros((4, 8), ml_dtypes.bfloat16))
    with pytest.raises(ValueError, match=r"w: expected shape \[\*, 9\]"):
        be.linear(f(np.zeros((2, 9), np.float32)), w)
    with pytest.raises(ValueError, match=r"residual: expected shape \[2, 4\]"):
        be.linear(x, w, None, f(np.zeros((2, 5), np.float32)))
    with pytest.raises(TypeError, match="positions"):
        be.qk_norm_rope_kv_write(f(np.zeros((1, 24), np.float32)), 1, 1, None, None, 1e-6,
                                 f(inv_freq(8, 1e4)), f(np.zeros(1, np.int64)), be.empty_kv(2, 2, 1, 8),
                                 be.empty_kv(2, 2, 1, 8), f(np.zeros(1, np.int32)))
    with pytest.raises(ValueError, match="bitmask"):
        be.lm_head_argmax(x, w, f(np.zeros((2, 2), np.int32)))


def test_launchers_check_index_values(be):
    """Out-of-range tokens, expert ids and slots raise instead of reading or writing
    out of bounds (NumPy would wrap negative ones around)."""
    host_only(be)
    f = be.from_host
    x = f(np.zeros((2, 8), np.float32))
    embed = be.prepare_weight(np.zeros((4, 8), ml_dtypes.bfloat16))
    for bad in (4, -1):
        with pytest.raises(ValueError, match="tokens"):
            be.mtp_input(embed, f(np.array([bad], np.int32)), f(np.zeros((1, 8), np.float32)),
                         be.prepare_vector(np.ones(8)), be.prepare_vector(np.ones(8)),
                         be.prepare_weight(np.zeros((8, 16), np.float32)), 1e-5)
        with pytest.raises(ValueError, match="ids"):
            be.moe_experts(x, f(np.array([[0], [bad - 1]], np.int32)), f(np.ones((2, 1), np.float32)),
                           be.prepare_weight(np.zeros((3, 4, 8), np.float32)),
                           be.prepare_weight(np.zeros((3, 8, 2), np.float32)))
    with pytest.raises(ValueError, match="slots"):
        be.qk_norm_rope_kv_write(f(np.zeros((1, 24), np.float32)), 1, 1, None, None, 1e-6,
                                 f(inv_freq(8, 1e4)), f(np.zeros(1, np.int32)), be.empty_kv(2, 2, 1, 8),
                                 be.empty_kv(2, 2, 1, 8), f(np.array([4], np.int32)))
    with pytest.raises(ValueError, match="slots"):
        be.qk_norm_rope_kv_write(f(np.zeros((1, 24), np.float32)), 1, 1, None, None, 1e-6,
                                 f(inv_freq(8, 1e4)), f(np.zeros(1, np.int32)), be.empty_kv(2, 2, 1, 8),
                                 be.empty_kv(2, 2, 1, 8), f(np.array([-1], np.int32)))


def test_cpu_weights_stay_16_bit():
    cpu = get_backend("cpu")
    w = np.arange(12, dtype=np.float32).reshape(3, 4).astype(ml_dtypes.bfloat16)
    wp = cpu.prepare_weight(w)
    assert wp.dtype == np.uint16 and wp.nbytes == w.nbytes and wp.flags.c_contiguous
    np.testing.assert_array_equal(wp, w.view(np.uint16))
    assert cpu.prepare_weight(w.astype(np.float32)).dtype == np.float32
    with pytest.raises(TypeError, match="bfloat16 or float32"):
        cpu.prepare_weight(np.zeros((2, 2), np.float16))


@pytest.mark.parametrize("others", [[], [5, 40, 300]], ids=["all-equal", "three-others"])
@pytest.mark.parametrize("H", [19, 64, 99])
def test_identical_lm_head_rows_tie_to_the_lowest_id(be, H, others):
    """Equal rows of the LM head give equal logits, so the lowest id wins, in the
    reference (one row or many per call) and in every backend."""
    rng = rng_for("ties", H, others)
    V = 301
    w = np.repeat(weight(rng, (1, H), "float32"), V, axis=0)
    w[others] = weight(rng, (len(others), H), "float32")
    x = acts(rng, 200, H)
    ids = np.array([0] + others)                                       # row 0 stands for every equal row
    want = ids[np.argmax(x.astype(np.float64) @ w[ids].T.astype(np.float64), axis=1)]
    np.testing.assert_array_equal(REF.lm_head_argmax(x, REF.prepare_weight(w)), want)
    for r in range(0, 200, 3):                                         # one row per call: the GEMV path
        assert REF.lm_head_argmax(x[r:r + 1], REF.prepare_weight(w))[0] == want[r]
    np.testing.assert_array_equal(be.to_host(be.lm_head_argmax(be.from_host(x), be.prepare_weight(w))), want)


# -- FP8 E4M3 weights ---------------------------------------------------------

def pow2_fp8(rng, shape, kind: str) -> Fp8Weight:
    """Random codes (every finite one, NaN codes excluded) with power-of-two scales: each
    dequantized weight is exact in FP32, so FP8 and FP32 storage of it give one result."""
    codes = rng.integers(0, 256, shape).astype(np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x7E
    *lead, N, K = shape
    sshape = (*lead, N) if kind == "fp8_channel" else (*lead, -(-N // 128), -(-K // 128))
    fan_in = -round(np.log2(K) / 2)                                    # ~ 1 / sqrt(K), a power of two
    scale = np.exp2(rng.integers(-12, -8, sshape) + fan_in).astype(np.float32)
    return Fp8Weight(codes, scale, None if kind == "fp8_channel" else (128, 128))


@pytest.mark.parametrize("kind", FP8_KINDS)
def test_fp8_power_of_two_scales_equal_fp32_weights(be, kind):
    """Each GEMV family with an FP8 weight gives what the same backend gives with the
    dequantized FP32 weight (exact here), within the float32 tolerance."""
    rng = rng_for("fp8_pow2", kind)
    n, H, I, E, K, V = 3, 136, 40, 5, 2, 300
    x, g = acts(rng, n, H), acts(rng, n, H)
    fp8 = {name: pow2_fp8(rng, shape, kind) for name, shape in
           (("w", (200, H)), ("eh", (H, 2 * H)), ("w13", (2 * I, H)), ("w2", (H, I)), ("e13", (E, 2 * I, H)),
            ("e2", (E, H, I)), ("gate", (16, H)), ("head", (V, H)))}
    as8 = {k: be.prepare_weight(w) for k, w in fp8.items()}
    as32 = {k: be.prepare_weight(w.dequantize()) for k, w in fp8.items()}
    ids = np.array([[0, 4], [2, 1], [4, 3]], np.int32)
    wts = rng.random((n, K)).astype(np.float32)
    embed, tokens = be.prepare_weight(weight(rng, (7, H), "float32")), np.array([1, 6, 0], np.int32)
    vec = be.prepare_vector
    spec = RouterSpec(top_k=3, n_group=2, topk_group=1, routed_scaling_factor=1.5, norm_topk_prob=True)
    f = be.from_host
    calls = {
        "linear": lambda w: be.linear(f(x), w["w"], vec(acts(rng_for(1), 200)), f(acts(rng_for(2), n, 200))),
        "mtp_input": lambda w: be.mtp_input(embed, f(tokens), f(g), vec(np.ones(H)), vec(np.ones(H)), w["eh"], 1e-5),
        "swiglu_mlp": lambda w: be.swiglu_mlp(f(x), w["w13"], w["w2"], f(g)),
        "moe_experts": lambda w: be.moe_experts(f(x), f(ids), f(wts), w["e13"], w["e2"]),
        "moe_router": lambda w: be.moe_router(f(x), w["gate"], vec(np.zeros(16)), spec)[1],
        "lm_head_logits": lambda w: be.lm_head_logits(f(x), w["head"]),
    }
    for name, call in calls.items():
        assert_close(be.to_host(call(as8)), be.to_host(call(as32)), what=f"{name} FP8 vs its FP32 weights")
    got = be.to_host(be.lm_head_argmax(f(x), as8["head"]))
    np.testing.assert_array_equal(got, REF.lm_head_argmax(x, fp8["head"].dequantize()))


# -- FP4 E2M1 weights (E8M0 scales per 32) -----------------------------------------------------

#: the FP4 tests' backends: these and the cuda kernels on the CPU emulator of tests/cuda_emu
#: (BF16 / FP32 KV: the GEMVs are the same kernels), skipped where it cannot be built
FP4_BACKENDS = BACKENDS + ["cuda_emu_bf16", "cuda_emu_f32"]


@pytest.fixture(scope="module")
def emulator():
    """The CUDA emulator routing the cuda launchers for this module (built once, cached)."""
    from cuda_emu import emu_backend
    yield from emu_backend.installed_emulator()


@pytest.fixture(params=FP4_BACKENDS)
def be4(request):
    if request.param.startswith("cuda_emu"):
        from cuda_emu import emu_backend
        request.getfixturevalue("emulator")
        return emu_backend.backend("bfloat16" if request.param.endswith("bf16") else "float32")
    return get_backend(request.param)


def rand_fp4(rng, shape) -> Fp4Weight:
    """Random codes (all 16, every byte) with E8M0 scales near 1 / sqrt(K): each dequantized
    weight is exact in FP32."""
    *lead, N, K = shape
    data = rng.integers(0, 256, (*lead, N, K // 2), dtype=np.uint8)
    fan_in = -round(np.log2(K) / 2) - 2
    scale = (127 + fan_in + rng.integers(-2, 2, (*lead, N, -(-K // 32)))).astype(np.uint8)
    return Fp4Weight(data, scale)


def rand_nvfp4(rng, shape) -> Fp4Weight:
    """NVFP4: random codes (all 16) with E4M3 scales near 1 / (6 sqrt(K)) per 16 columns and a
    row scale that differs row to row and is no power of two (so that its rounding shows)."""
    *lead, N, K = shape
    data = rng.integers(0, 256, (*lead, N, K // 2), dtype=np.uint8)
    scale = rng.integers(0x20, 0x40, (*lead, N, -(-K // 16)), dtype=np.uint8)
    g = (0.1234567 + rng.random((*lead, N)) * 0.05).astype(np.float32)
    return Fp4Weight(data, scale, g)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("H", [64, 136, 2 * 50])
def test_fp4_equals_its_dequantized_fp32_weights(be4, H, fmt):
    """Each GEMV family with an FP4 weight (half a byte each, decoded inside the kernel) gives
    what the same backend gives with the dequantized FP32 weight: bit for bit on cpu (it decodes
    a row chunk into FP32 and runs the same dot), within the float32 tolerance on cuda (its FP32
    path reads other vector widths, so sums in another order). H = 136 and 100 end on a partial
    32-column scale block, and mtp_input's second half starts inside one (the cuda kernels'
    scalar path: H % 8 != 0 for 100; 64 and 136 take the 4-byte vector loads). NVFP4 (E4M3 per
    16, a row scale): the same, cuda folding the row scale into each block's scale."""
    be = be4
    rng = rng_for("fp4", H, fmt)
    rand = rand_fp4 if fmt == "mxfp4" else rand_nvfp4
    n, I, E, K, V = 3, 40, 5, 2, 300
    x, g = acts(rng, n, H), acts(rng, n, H)
    fp4 = {name: rand(rng, shape) for name, shape in
           (("w", (37, H)), ("eh", (H, 2 * H)), ("w13", (2 * I, H)), ("w2", (H, I)), ("e13", (E, 2 * I, H)),
            ("e2", (E, H, I)), ("gate", (16, H)), ("head", (V, H)))}
    as4 = {k: be.prepare_weight(w) for k, w in fp4.items()}
    as32 = {k: be.prepare_weight(w.dequantize()) for k, w in fp4.items()}
    # half a byte a weight, its scales (cuda NVFP4: each row's record padded to 4 bytes)
    assert as4["e13"].nbytes <= fp4["e13"].nbytes + 3 * E * 2 * I
    ids = np.array([[0, 4], [2, 1], [4, 3]], np.int32)
    wts = rng.random((n, K)).astype(np.float32)
    embed, tokens = be.prepare_weight(weight(rng, (7, H), "float32")), np.array([1, 6, 0], np.int32)
    vec = be.prepare_vector
    spec = RouterSpec(top_k=3, n_group=2, topk_group=1, routed_scaling_factor=1.5, norm_topk_prob=True)
    f = be.from_host
    calls = {
        "linear": lambda w: be.linear(f(x), w["w"], vec(acts(rng_for(1), 37)), f(acts(rng_for(2), n, 37))),
        "mtp_input": lambda w: be.mtp_input(embed, f(tokens), f(g), vec(np.ones(H)), vec(np.ones(H)), w["eh"], 1e-5),
        "swiglu_mlp": lambda w: be.swiglu_mlp(f(x), w["w13"], w["w2"], f(g)),
        "moe_experts": lambda w: be.moe_experts(f(x), f(ids), f(wts), w["e13"], w["e2"]),
        "moe_router": lambda w: be.moe_router(f(x), w["gate"], vec(np.zeros(16)), spec)[1],
        "lm_head_logits": lambda w: be.lm_head_logits(f(x), w["head"]),
    }
    for name, call in calls.items():
        got, want = be.to_host(call(as4)), be.to_host(call(as32))
        if be.name == "cpu":
            np.testing.assert_array_equal(got, want, err_msg=f"{name} FP4 vs its FP32 weights")
        else:
            assert_close(got, want, what=f"{name} FP4 vs its FP32 weights")
    got = be.to_host(be.lm_head_argmax(f(x), as4["head"]))
    np.testing.assert_array_equal(got, REF.lm_head_argmax(x, fp4["head"].dequantize()))


def test_fp4_nibble_order_reaches_the_kernels(be4):
    """Negative control: a weight whose bytes have their nibbles swapped is another weight, and
    the kernels see the difference (each column reads its own nibble)."""
    be = be4
    rng = rng_for("fp4-nibbles")
    w = rand_fp4(rng, (16, 64))
    swapped = Fp4Weight(((w.data >> 4) | (w.data << 4)).astype(np.uint8), w.scale)
    x = be.from_host(acts(rng, 2, 64))
    a = be.to_host(be.linear(x, be.prepare_weight(w)))
    b = be.to_host(be.linear(x, be.prepare_weight(swapped)))
    assert_close(a, be.to_host(be.linear(x, be.prepare_weight(w.dequantize()))), what="FP4 linear")
    assert not np.allclose(a, b)


def test_nvfp4_row_scale_reaches_the_kernels(be4):
    """Negative control: NVFP4 codes and scales with the row scale dropped (all ones) are another
    weight, and the kernels see the difference (each row gets its own scale)."""
    be = be4
    rng = rng_for("nvfp4-rows")
    w = rand_nvfp4(rng, (16, 64))
    x = be.from_host(acts(rng, 2, 64))
    a = be.to_host(be.linear(x, be.prepare_weight(w)))
    b = be.to_host(be.linear(x, be.prepare_weight(Fp4Weight(w.data, w.scale, np.ones(16, np.float32)))))
    assert_close(a, be.to_host(be.linear(x, be.prepare_weight(w.dequantize()))), what="NVFP4 linear")
    assert not np.allclose(a, b)


@pytest.mark.parametrize("block", [(128, 128), (16, 8), (3, 12), (1, 5), (4, 128)])
@pytest.mark.parametrize("K", [64, 136, 100])
def test_fp8_block_sizes(be, block, K):
    """Blocks other than 128 (as ``Fp8Weight.concat`` makes them: rows per block down to 1;
    k-blocks of 8 columns, the cuda vector width, and of 12 and 5, which take its scalar
    path) and K cut short of a block: every weight gets its block's scale."""
    rng = rng_for("fp8_blocks", block, K)
    n, N, E, I = 5, 37, 3, 20
    x = acts(rng, n, K)
    q = Fp8Weight.quantize(acts(rng, N, K, scale=K ** -0.5), block)
    got = be.linear(be.from_host(x), be.prepare_weight(q))
    assert_close(be.to_host(got), REF.linear(x, REF.prepare_weight(q)), what="linear FP8")
    ids = np.array([[0], [2], [1], [2], [0]], np.int32)
    w13 = Fp8Weight.quantize(acts(rng, E, 2 * I, K, scale=K ** -0.5), block)
    w2 = Fp8Weight.quantize(acts(rng, E, K, I, scale=I ** -0.5), block)
    ones = np.ones((n, 1), np.float32)
    got = be.moe_experts(be.from_host(x), be.from_host(ids), be.from_host(ones), be.prepare_weight(w13),
                         be.prepare_weight(w2))
    want = REF.moe_experts(x, ids, ones, REF.prepare_weight(w13), REF.prepare_weight(w2))
    assert_close(be.to_host(got), want, what="moe_experts FP8")


@pytest.mark.parametrize("kind", FP8_KINDS)
def test_fp8_edge_codes(be, kind):
    """NaN codes (0x7F, 0xFF) make their row's output NaN, whatever the input, and never win
    the argmax; -0 (0x80), +-448 (0x7E, 0xFE) and the subnormals 0x01..0x07 count their exact
    values (power-of-two scales, so the reference is exact)."""
    rng = rng_for("fp8_edges", kind)
    n, N, K = 3, 150, 140                                              # 2 row blocks, 2 k-blocks, both partial
    w = pow2_fp8(rng, (N, K), kind)
    codes = w.data.copy()
    codes[:, :16] = EDGE_CODES[rng.integers(0, EDGE_CODES.size, (N, 16))]
    codes[:, 16:30] = np.arange(0x01, 0x08).repeat(2)                   # every row has subnormals
    codes[7, 131], codes[140, 0], codes[141, 139] = 0x7F, 0xFF, 0x7F    # NaN rows 7, 140, 141
    w = Fp8Weight(codes, w.scale, w.block)
    x = acts(rng, n, K)
    x[1] = 0.0                                                         # NaN * 0 is NaN too
    got = be.to_host(be.linear(be.from_host(x), be.prepare_weight(w)))
    want = REF.linear(x, REF.prepare_weight(w))
    assert np.isnan(want[:, [7, 140, 141]]).all() and np.isnan(want).sum() == 3 * n
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert_close(got, want, what="linear with edge codes")
    ids = be.to_host(be.lm_head_argmax(be.from_host(x[[0, 2]]), be.prepare_weight(w)))
    np.testing.assert_array_equal(ids, REF.lm_head_argmax(x[[0, 2]], REF.prepare_weight(w)))
    assert not set(ids.tolist()) & {7, 140, 141}


@pytest.mark.parametrize("kind", FP8_KINDS)
def test_fp8_strided_inputs(be, kind):
    """Column-strided x, a transposed residual, strided expert routing weights: the FP8
    paths take views as the BF16 ones do."""
    rng = rng_for("fp8_strided", kind)
    big, res_big = acts(rng, 5, 2 * 140), acts(rng, 9, 5)
    w = weight(rng, (9, 140), kind)
    got = be.linear(be.from_host(big)[:, ::2], be.prepare_weight(w), None, be.from_host(res_big).T)
    assert_close(be.to_host(got), REF.linear(big[:, ::2], REF.prepare_weight(w), None, res_big.T),
                 what="linear FP8 (strided)")
    E, I, n = 4, 24, 5
    w13, w2 = weight(rng, (E, 2 * I, 140), kind), weight(rng, (E, 140, I), kind)
    ids = np.array([[0, 1], [2, 3], [1, 0], [3, 3], [2, 0]], np.int32)[:, :1]
    wts_big = rng.random((n, 3)).astype(np.float32)
    got = be.moe_experts(be.from_host(big)[:, ::2], be.from_host(ids), be.from_host(wts_big)[:, 1:2],
                         be.prepare_weight(w13), be.prepare_weight(w2))
    want = REF.moe_experts(big[:, ::2], ids, wts_big[:, 1:2], REF.prepare_weight(w13), REF.prepare_weight(w2))
    assert_close(be.to_host(got), want, what="moe_experts FP8 (strided)")


@pytest.mark.parametrize("kind", FP8_KINDS)
@pytest.mark.parametrize("shape", [(300, 1000), (4, 130, 70)])
def test_fp8_prepared_keeps_one_byte_per_weight(be, kind, shape):
    """The stored form holds the codes at one byte each plus the scales (and, on the cpu
    backend, a factor per row, row offsets and the few subnormal weights: ``CpuFp8``)."""
    rng = rng_for("fp8_bytes", kind, shape)
    w = weight(rng, shape, kind)
    p = be.prepare_weight(w)
    assert p.shape == shape and p.ndim == len(shape)
    *lead, N, K = shape
    rows = int(np.prod(lead, dtype=np.int64)) * N
    subnormal = int((((w.data & 0x78) == 0) & ((w.data & 0x07) != 0)).sum())
    assert w.data.nbytes <= p.nbytes <= w.data.nbytes + w.scale.nbytes + 8 * rows + 8 * subnormal + 64, \
        (p.nbytes, w.nbytes)


def test_fp8_refusals(be):
    """What an FP8 weight may not be, with the argument named: an embedding table, half of a
    SwiGLU pair, or an Fp8Weight that never went through prepare_weight."""
    rng = rng_for("fp8_refusals")
    f = be.from_host
    H, I = 16, 8
    x = f(acts(rng, 2, H))
    q = weight(rng, (40, H), "fp8_block")
    with pytest.raises(TypeError, match="embed: an FP8 embedding table"):
        be.mtp_input(be.prepare_weight(q), f(np.array([1, 2], np.int32)), x, be.prepare_vector(np.ones(H)),
                     be.prepare_vector(np.ones(H)), be.prepare_weight(weight(rng, (H, 2 * H), "bfloat16")), 1e-5)
    w13, w2 = weight(rng, (2 * I, H), "fp8_block"), weight(rng, (H, I), "bfloat16")
    with pytest.raises(TypeError, match="w13, w2: expected all FP8 or none"):
        be.swiglu_mlp(x, be.prepare_weight(w13), be.prepare_weight(w2))
    with pytest.raises(TypeError, match="w: an Fp8Weight must go through prepare_weight first"):
        be.linear(x, q)
    with pytest.raises(ValueError, match=r"w: expected shape \[\*, 17\]"):
        be.linear(f(acts(rng, 2, 17)), be.prepare_weight(q))


@pytest.mark.parametrize("wd", ["bf16", "f32"])
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_gemv_rows_do_not_depend_on_their_group(wd, n):
    """cpu backend: a weight row's dot comes from the same instructions wherever it falls (a
    full group of 8, the rows past the last group, a matrix of one row, a shard of the rows),
    so its bits do not depend on the grouping; and the masked LM head, which computes rows
    alone where a mask leaves only some of a group, picks the argmax of those same logits."""
    be = get_backend("cpu")
    rng = np.random.default_rng(n)
    N, H = 41, 72
    w = rng.standard_normal((N, H)).astype(np.float32)
    w = w.astype(ml_dtypes.bfloat16) if wd == "bf16" else w
    x = rng.standard_normal((n, H)).astype(np.float32)
    full = be.linear(x, be.prepare_weight(w), None)
    alone = np.concatenate([be.linear(x, be.prepare_weight(w[j:j + 1]), None) for j in range(N)], axis=1)
    shards = np.concatenate([be.linear(x, be.prepare_weight(w[a:b]), None) for a, b in ((0, 17), (17, 30), (30, N))],
                            axis=1)
    np.testing.assert_array_equal(alone, full)
    np.testing.assert_array_equal(shards, full)
    mask = rng.integers(-2**31, 2**31, (n, 2), dtype=np.int64).astype(np.int32) & 0x11111111
    mask[:, 0] |= 1 << 9
    allowed = bitmask_allowed(mask, N)
    want = np.where(allowed, full, -np.inf).argmax(axis=1)     # the first (lowest) id of the max
    np.testing.assert_array_equal(be.lm_head_argmax(x, be.prepare_weight(w), mask), want)
