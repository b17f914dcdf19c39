"""MLA ops (mtpkern.ops.mla): the absorbed form against the naive one (the specification)
and against a float64 computation written here, the cpu backend against the NumPy
reference, the latent write against float64 norm + rope, and bad input refused by name
with the cache unchanged.

Shapes are odd on purpose: Hq 1..16, kv_lora_rank L 33..127 (never a multiple of 32 but one),
rope dims R 8..64 and 0 (NoPE: GLM-5.3's MTP layer; no dim rotated, the latent row is c alone),
v_head_dim != qk_nope_head_dim, block sizes 1..16, ragged rows of
several sequences (a decode row, a causal prefill chunk, a window), tables permuted.
Every backend test also runs on the CUDA backend's kernels (kernels/mla.cu) through the
emulator of tests/cuda_emu (``cuda_emu_bf16`` / ``cuda_emu_f32``: BF16 and FP32 latent
caches), skipped where the emulator cannot be built; its split-KV, DeepSeek-V3-sized and
workspace cases are in tests/test_cuda_emulated.py. With 16-head tiles over a BF16 cache the
CUDA launcher takes the tensor-core attention (``mla_attention_tc_kernel``), held to the BF16
tolerance (:func:`attention_tol`); test_attention_tensor_cores sweeps Hq 16..128 there.
"""

from __future__ import annotations

import zlib

import ml_dtypes
import numpy as np
import pytest

from cuda_emu import emu_backend

from mtpkern.backends import get_backend
from mtpkern.backends.base import Backend
from mtpkern.backends.cuda import CudaBackend
from mtpkern.ops import mla
from mtpkern.ops.rope_kv import inv_freq, yarn_inv_freq
from mtpkern.tolerance import assert_close

REF = get_backend("numpy")
HOST_BACKENDS = ["numpy", "cpu"]
#: the CUDA backend's kernels on the emulator, with a BF16 / an FP32 latent cache
EMU_BACKENDS = ["cuda_emu_bf16", "cuda_emu_f32"]
BACKENDS = HOST_BACKENDS + EMU_BACKENDS
#: the backends compared with the reference (numpy is the reference)
OTHER_BACKENDS = ["cpu"] + EMU_BACKENDS


@pytest.fixture(scope="module")
def emulator():
    """The CUDA emulator routing the cuda launchers for this module (built once, cached)."""
    yield from emu_backend.installed_emulator()


@pytest.fixture
def backend(request):
    """``backend(name)`` -> the backend (an emulated cuda one starts the emulator)."""
    def make(name: str):
        if name in EMU_BACKENDS:
            request.getfixturevalue("emulator")
            return emu_backend.backend("bfloat16" if name.endswith("bf16") else "float32")
        return get_backend(name)
    return make


def kv_tol(be) -> str:
    """The tolerance of values that went through the backend's latent cache."""
    return "bfloat16" if np.dtype(be.kv_dtype) == np.uint16 else "float32"


def attention_tol(be, Hq: int, L: int, R: int, max_len: int) -> str:
    """The tolerance of ``be``'s mla_attention_absorbed against the reference run on the values
    its cache holds: FP32 accumulation's ("float32"), except where the CUDA launcher takes the
    tensor-core kernel (mla.attention_variant: 16-head tiles over a BF16 cache). That kernel
    rounds the scaled query and the softmax probabilities P to BF16 before their products (as
    FlashMLA does; the reference rounds nothing): 2^-9 relative per value, so a score moves by
    ~2^-9 of its terms' magnitude and an output by ~1e-3 relative. Measured on these tests'
    data: at most 6.4e-3 absolute here (2.3e-3 of the largest |output|), 1.1e-2 at DeepSeek-V3's
    W = 576 in test_cuda_emulated (6.4e-3 of the largest; a third of the BF16 tolerance at the
    worst element). That is BF16 storage's error, so the BF16 row of the table (2e-2 + 2e-2 |r|);
    a layout or rescale slip is off by O(1)."""
    if isinstance(be, CudaBackend) and np.dtype(be.kv_dtype) == np.uint16:
        from mtpkern.backends.cuda_launch import mla as mla_launch
        if mla_launch.plan(Hq, L, R, max_len).variant == "tc":
            return "bfloat16"
    return "float32"


def filled(be, cache) -> object:
    """A latent cache of ``be`` holding the FP32 ``cache`` (BF16 bits where it stores BF16)."""
    lc = be.empty_latent_kv(*cache.shape)
    lc[...] = cache.astype(ml_dtypes.bfloat16).view(np.uint16) if lc.dtype == np.uint16 else cache
    return lc

#: (Hq, P = qk_nope, R = qk_rope, L = kv_lora, Dv, BS)
SHAPES = [
    (1, 16, 8, 40, 24, 1),
    (3, 24, 16, 72, 20, 3),
    (7, 32, 32, 100, 48, 5),
    (16, 48, 64, 127, 32, 16),
    (2, 8, 8, 33, 12, 7),
    (11, 64, 24, 90, 16, 4),
    (3, 24, 0, 71, 20, 3),        # R = 0 (NoPE, GLM-5.3): latent rows of L alone, W = 71 (scalar staging)
    (16, 32, 0, 64, 24, 4),       # R = 0, 16 heads: the tensor-core kernel over a BF16 cache, W = 64 (16-byte loads)
]


def rng_for(*key) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def rnd(rng, *shape, scale=1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def cat(q_nope, q_pe):
    """The op's query [n, Hq, P + R]: per head the no-rope dims, then the (roped) rope dims."""
    return np.ascontiguousarray(np.concatenate([q_nope, q_pe], axis=2))


# -- float64, independent of the ops ----------------------------------------------------------

def rope64(x, pos, f, interleave, a):
    """x [R] float64 rotated at pos (pairs (2i, 2i+1) or (i, i + R/2)), cos/sin times a."""
    half = f.shape[0]
    i = np.arange(half)
    i1, i2 = (2 * i, 2 * i + 1) if interleave else (i, i + half)
    ang = (np.float32(pos) * f).astype(np.float64)     # the angle in FP32, as the spec (and HF) round it
    c, s = a * np.cos(ang), a * np.sin(ang)
    y = x.copy()
    y[i1] = x[i1] * c - x[i2] * s
    y[i2] = x[i2] * c + x[i1] * s
    return y


def latent_row64(kv_a_row, w, eps, f, pos, interleave, a):
    L = w.shape[0]
    x = kv_a_row.astype(np.float64)
    c = x[:L] / np.sqrt(np.mean(x[:L] ** 2) + eps) * w.astype(np.float64)
    return np.concatenate([c, rope64(x[L:], pos, f, interleave, a)])


def attention64(q_nope, q_pe, kv_b_proj, cache, tables, row_seq, row_len, scale, row_start=None):
    """Decompress per row and head in float64, softmax, weighted values."""
    n, Hq, P = q_nope.shape
    NB, BS, W = cache.shape
    R = q_pe.shape[2]
    L = W - R
    Dv = kv_b_proj.shape[0] // Hq - P
    kvb = kv_b_proj.astype(np.float64).reshape(Hq, P + Dv, L)
    out = np.zeros((n, Hq, Dv))
    for r in range(n):
        lo = 0 if row_start is None else int(row_start[r])
        idx = np.arange(lo, int(row_len[r]))
        rows = cache[tables[row_seq[r], idx // BS], idx % BS].astype(np.float64)   # [L', W]
        for h in range(Hq):
            k = np.concatenate([rows[:, :L] @ kvb[h, :P].T, rows[:, L:]], axis=1)   # [L', P + R]
            v = rows[:, :L] @ kvb[h, P:].T                                          # [L', Dv]
            q = np.concatenate([q_nope[r, h], q_pe[r, h]]).astype(np.float64)
            s = k @ q * scale
            p = np.exp(s - s.max())
            out[r, h] = (p / p.sum()) @ v
    return out.reshape(n, Hq * Dv)


# -- a filled latent cache and the rows that read it -------------------------------------------

def case(key, Hq, P, R, L, Dv, BS, window=False):
    """Latent cache, 3 sequences with permuted tables, the rows (a decode row per sequence,
    a causal 5-row chunk, a row at capacity), queries, kv_b_proj."""
    rng = rng_for(key, Hq, P, R, L, Dv, BS, window)
    S, max_blocks = 3, max(2, -(-40 // BS))
    NB = S * max_blocks + 1
    cache = rnd(rng, NB, BS, L + R)
    tables = rng.permutation(NB)[: S * max_blocks].reshape(S, max_blocks).astype(np.int32)
    cap = max_blocks * BS
    row_seq = np.array([0, 1, 1, 1, 1, 1, 2, 2], np.int32)
    row_len = np.array([1, 13, 14, 15, 16, 17, cap, BS + 1], np.int32)
    row_start = None
    if window:
        row_start = np.minimum(row_len - 1, np.array([0, 5, 6, 7, 8, 9, cap - 7, 2])).astype(np.int32)
        for s in range(S):                  # entries wholly before every row's window: freed (-1)
            first = min(int(row_start[r]) // BS for r in range(row_seq.size) if row_seq[r] == s)
            tables[s, :first] = -1
    n = row_seq.size
    q_nope, q_pe = rnd(rng, n, Hq, P), rnd(rng, n, Hq, R)
    kv_b = rnd(rng, Hq * (P + Dv), L, scale=L ** -0.5)
    return cache, tables, row_seq, row_len, row_start, q_nope, q_pe, kv_b


# -- kv_b_proj split ------------------------------------------------------------------------

def test_split_kv_b_proj_is_deepseeks_per_head_layout():
    Hq, P, Dv, L = 3, 5, 4, 7
    kv_b = np.arange(Hq * (P + Dv) * L, dtype=np.float32).reshape(Hq * (P + Dv), L)
    w_uk, w_uv = mla.split_kv_b_proj(kv_b, Hq, P, Dv)
    assert w_uk.shape == (Hq, P, L) and w_uv.shape == (Hq, Dv, L)
    for h in range(Hq):                                  # per head: P key rows, then Dv value rows
        np.testing.assert_array_equal(w_uk[h], kv_b[h * (P + Dv): h * (P + Dv) + P])
        np.testing.assert_array_equal(w_uv[h], kv_b[h * (P + Dv) + P: (h + 1) * (P + Dv)])
    bf = kv_b.astype(ml_dtypes.bfloat16)
    assert mla.split_kv_b_proj(bf, Hq, P, Dv)[0].dtype == bf.dtype and w_uk.flags.c_contiguous
    with pytest.raises(ValueError, match=r"kv_b_proj: expected shape \[27, \*\], got \[26, 7\]"):
        mla.split_kv_b_proj(kv_b[:-1], Hq, P, Dv)
    with pytest.raises(ValueError, match="v_head_dim"):
        mla.split_kv_b_proj(kv_b, Hq, P, 0)


# -- absorbed == naive == float64 ----------------------------------------------------------------

@pytest.mark.parametrize("window", [False, True])
@pytest.mark.parametrize("Hq,P,R,L,Dv,BS", SHAPES)
def test_absorbed_equals_naive(Hq, P, R, L, Dv, BS, window):
    cache, tables, row_seq, row_len, row_start, q_nope, q_pe, kv_b = case("an", Hq, P, R, L, Dv, BS, window)
    scale = (P + R) ** -0.5
    w_uk, w_uv = mla.split_kv_b_proj(kv_b, Hq, P, Dv)
    got = mla.mla_attention_absorbed(cat(q_nope, q_pe), w_uk, w_uv, cache, tables, row_seq, row_len, scale,
                                     row_start=row_start)
    if not window:                     # the naive form decompresses every block: no freed entries
        want = mla.mla_attention_naive(cat(q_nope, q_pe), kv_b, cache, tables, row_seq, row_len, scale, qk_nope_head_dim=P)
        assert_close(got, want, what="absorbed vs naive")
    else:
        t = tables.copy()
        t[t < 0] = 0                   # entries nothing reads: any block will do for the naive form
        want = mla.mla_attention_naive(cat(q_nope, q_pe), kv_b, cache, t, row_seq, row_len, scale,
                                       row_start=row_start, qk_nope_head_dim=P)
        assert_close(got, want, what="absorbed vs naive (window)")
    ref64 = attention64(q_nope, q_pe, kv_b, cache, tables, row_seq, row_len, scale, row_start)
    assert_close(got, ref64, what="absorbed vs float64")
    assert_close(want, ref64, what="naive vs float64")


def test_window_changes_the_result_and_one_row_is_its_value():
    """row_start really cuts (a row seeing only itself gets w_uv c of that row)."""
    Hq, P, R, L, Dv, BS = 2, 8, 8, 33, 12, 4
    cache, tables, row_seq, row_len, _, q_nope, q_pe, kv_b = case("w1", Hq, P, R, L, Dv, BS)
    w_uk, w_uv = mla.split_kv_b_proj(kv_b, Hq, P, Dv)
    last = (row_len - 1).astype(np.int32)
    got = mla.mla_attention_absorbed(cat(q_nope, q_pe), w_uk, w_uv, cache, tables, row_seq, row_len, 0.3,
                                     row_start=last).reshape(-1, Hq, Dv)
    for r in range(row_seq.size):
        i = int(row_len[r]) - 1
        c = cache[tables[row_seq[r], i // BS], i % BS, :L].astype(np.float64)
        assert_close(got[r], np.einsum("hvl,l->hv", w_uv.astype(np.float64), c))
    full = mla.mla_attention_absorbed(cat(q_nope, q_pe), w_uk, w_uv, cache, tables, row_seq, row_len, 0.3)
    assert not np.allclose(full.reshape(-1, Hq, Dv)[1:], got[1:])


# -- cpu == reference ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", OTHER_BACKENDS)
@pytest.mark.parametrize("wdtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("window", [False, True])
@pytest.mark.parametrize("Hq,P,R,L,Dv,BS", SHAPES)
def test_attention_equals_reference(backend, name, Hq, P, R, L, Dv, BS, window, wdtype):
    """The reference runs on the values the backend's cache holds (BF16-rounded for a BF16
    cache), so every backend is held to FP32 accumulation's tolerance, except the CUDA
    tensor-core kernel (Hq 16 over a BF16 cache) to BF16's (attention_tol)."""
    be = backend(name)
    cache, tables, row_seq, row_len, row_start, q_nope, q_pe, kv_b = case("cpu", Hq, P, R, L, Dv, BS, window)
    if wdtype == "bfloat16":
        kv_b = kv_b.astype(ml_dtypes.bfloat16)
    w_uk, w_uv = mla.split_kv_b_proj(kv_b, Hq, P, Dv)
    scale = (P + R) ** -0.5
    lc = filled(be, cache)
    got = be.mla_attention_absorbed(be.from_host(cat(q_nope, q_pe)), be.prepare_weight(w_uk),
                                    be.prepare_weight(w_uv), lc, tables, row_seq, row_len, scale,
                                    row_start=row_start)
    want = REF.mla_attention_absorbed(cat(q_nope, q_pe), REF.prepare_weight(w_uk), REF.prepare_weight(w_uv),
                                      be.kv_to_host(lc), tables, row_seq, row_len, scale, row_start=row_start)
    tol = attention_tol(be, Hq, L, R, tables.shape[1] * BS)
    assert_close(be.to_host(got), want, tol, f"{name} vs reference ({wdtype} weights, {tol} tolerance)")


#: (Hq, P, R, L, Dv, BS): head counts whose tiles are 16 (Hq 31: 16 + 15), odd L and W
TC_SHAPES = [
    (16, 16, 8, 40, 24, 5),       # W = 48: one k-step past 32
    (32, 24, 16, 100, 20, 16),    # two head tiles, W = 116: scalar staging, k padded to 128
    (31, 16, 8, 72, 16, 3),       # a last tile of 15 heads (zero query rows in the mma)
    (128, 32, 64, 127, 24, 7),    # DeepSeek-V3's head count, W = 191
    (16, 32, 32, 300, 24, 16),    # L > 256: LPT 2 (8 n-tiles per warp)
]


@pytest.mark.parametrize("window", [False, True])
@pytest.mark.parametrize("Hq,P,R,L,Dv,BS", TC_SHAPES)
def test_attention_tensor_cores(backend, emulator, Hq, P, R, L, Dv, BS, window):
    """The launcher takes mla_attention_tc_kernel for 16-head tiles over a BF16 cache (and the
    scalar kernel over an FP32 one, or for tiles under 16), and it matches the reference on the
    cache's values within BF16's tolerance (attention_tol: BF16-rounded q and P)."""
    from mtpkern.backends.cuda_launch import mla as mla_launch
    be = backend("cuda_emu_bf16")
    cache, tables, row_seq, row_len, row_start, q_nope, q_pe, kv_b = case("tc", Hq, P, R, L, Dv, BS, window)
    max_len = tables.shape[1] * BS
    plan = mla_launch.plan(Hq, L, R, max_len, row_seq.size, kv_itemsize=2)
    assert plan.variant == "tc" and plan.heads == 16, plan
    assert mla_launch.plan(Hq, L, R, max_len, row_seq.size, kv_itemsize=4).variant == "scalar"
    assert attention_tol(be, Hq, L, R, max_len) == "bfloat16"
    w_uk, w_uv = mla.split_kv_b_proj(kv_b.astype(ml_dtypes.bfloat16), Hq, P, Dv)
    scale = (P + R) ** -0.5
    lc = filled(be, cache)
    before = emulator.launches.copy()
    got = be.mla_attention_absorbed(cat(q_nope, q_pe), be.prepare_weight(w_uk), be.prepare_weight(w_uv), lc,
                                    tables, row_seq, row_len, scale, row_start=row_start)
    attn = {k: c for k, c in (emulator.launches - before).items() if k.startswith("mla_attention")}
    assert attn == {f"mla_attention_tc_kernel<{plan.lpt}>": 1}, attn
    want = REF.mla_attention_absorbed(cat(q_nope, q_pe), REF.prepare_weight(w_uk), REF.prepare_weight(w_uv),
                                      be.kv_to_host(lc), tables, row_seq, row_len, scale, row_start=row_start)
    assert_close(got, want, "bfloat16", f"tensor-core attention, Hq {Hq}")


@pytest.mark.parametrize("name", BACKENDS)
def test_attention_out_buffer(backend, name):
    be = backend(name)
    Hq, P, R, L, Dv, BS = 3, 24, 16, 72, 20, 3
    cache, tables, row_seq, row_len, _, q_nope, q_pe, kv_b = case("out", Hq, P, R, L, Dv, BS)
    cache = filled(be, cache)
    w_uk, w_uv = (be.prepare_weight(w) for w in mla.split_kv_b_proj(kv_b, Hq, P, Dv))
    out = np.full((row_seq.size, Hq * Dv), np.nan, np.float32)
    got = be.mla_attention_absorbed(cat(q_nope, q_pe), w_uk, w_uv, cache, tables, row_seq, row_len, 0.2, out=out)
    assert got is out
    assert_close(out, be.mla_attention_absorbed(cat(q_nope, q_pe), w_uk, w_uv, cache, tables, row_seq, row_len, 0.2))


# -- latent write -------------------------------------------------------------------------------

@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("L,R,BS,n,yarn", [(33, 8, 1, 5, False), (72, 16, 3, 7, True), (127, 64, 16, 19, True),
                                           (40, 24, 5, 1, False), (90, 32, 4, 30, False), (41, 0, 3, 7, False),
                                           (64, 0, 4, 9, True)])
def test_latent_write_norm_rope_slots(backend, name, interleave, L, R, BS, n, yarn):
    be = backend(name)
    rng = rng_for("lw", L, R, BS, n, yarn)
    NB = -(-n // BS) + 2
    kv_a = rnd(rng, n, L + R, scale=3.0)
    w = rnd(rng, L)
    f = yarn_inv_freq(R, 1e4, 40.0, 64) if yarn else inv_freq(R, 1e4)
    a = 1.3 if yarn else 1.0
    pos = rng.integers(0, 5000, n).astype(np.int32)
    slots = rng.permutation(NB * BS)[:n].astype(np.int32)
    cache = be.empty_latent_kv(NB, BS, L + R)
    assert cache.shape == (NB, BS, L + R) and np.dtype(cache.dtype) == np.dtype(be.kv_dtype)
    assert be.mla_latent_write(kv_a, w, 1e-6, f, pos, cache, slots, interleave=interleave, rope_scale=a) is None
    rows = be.kv_to_host(cache).reshape(NB * BS, L + R)
    for r in range(n):
        assert_close(rows[slots[r]], latent_row64(kv_a[r], w, 1e-6, f, pos[r], interleave, a), kv_tol(be),
                     what=f"row {r}")
    untouched = np.setdiff1d(np.arange(NB * BS), slots)
    assert not rows[untouched].any()


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("Hq,P,L,R,yarn", [(1, 16, 33, 8, False), (3, 24, 72, 16, True), (16, 48, 127, 64, True),
                                          (3, 24, 41, 0, True)])
def test_latent_write_ropes_the_query_as_the_key(backend, name, interleave, Hq, P, L, R, yarn):
    """q's rope dims (last R of each head) turn by the key's angles, its first P pass
    unchanged; the cache gets exactly what it gets without q; out= is filled."""
    be = backend(name)
    rng = rng_for("lwq", Hq, P, L, R, yarn)
    n, NB, BS = 5, 3, 4
    kv_a, w = rnd(rng, n, L + R), rnd(rng, L)
    q = rnd(rng, n, Hq, P + R)
    f = yarn_inv_freq(R, 1e4, 40.0, 64) if yarn else inv_freq(R, 1e4)
    a = 1.3 if yarn else 1.0
    pos = rng.integers(0, 5000, n).astype(np.int32)
    slots = rng.permutation(NB * BS)[:n].astype(np.int32)
    c1, c2 = be.empty_latent_kv(NB, BS, L + R), be.empty_latent_kv(NB, BS, L + R)
    got = be.mla_latent_write(kv_a, w, 1e-6, f, pos, c1, slots, q=q, interleave=interleave, rope_scale=a)
    be.mla_latent_write(kv_a, w, 1e-6, f, pos, c2, slots, interleave=interleave, rope_scale=a)
    np.testing.assert_array_equal(be.kv_to_host(c1), be.kv_to_host(c2))
    got = be.to_host(got)
    assert got.shape == (n, Hq, P + R) and got.dtype == np.float32
    np.testing.assert_array_equal(got[:, :, :P], q[:, :, :P])
    for r in range(n):
        for h in range(Hq):
            assert_close(got[r, h, P:], rope64(q[r, h, P:].astype(np.float64), pos[r], f, interleave, a),
                         what=f"q row {r} head {h}")
    out = np.full((n, Hq, P + R), np.nan, np.float32)
    assert be.mla_latent_write(kv_a, w, 1e-6, f, pos, c2, slots, q=q, interleave=interleave, rope_scale=a,
                               out=out) is out
    np.testing.assert_array_equal(out, got)
    with pytest.raises(ValueError, match=r"q: expected \[5, Hq >= 1, P \+ %d\]" % R):
        be.mla_latent_write(kv_a, w, 1e-6, f, pos, c2, slots, q=q[:, :, :R])


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("interleave", [True, False])
def test_latent_write_without_rope_keeps_the_rope_dims_and_reads_a_column_slice(backend, name, interleave):
    """NoPE with R > 0 (Kimi K3's gated MLA: BlockSpec.inv_freq() all zeros): the key's last R
    values go to the cache as kv_a holds them (the cache dtype's rounding only) and the query's
    last R come back bit for bit, at any position; kv_a read as the first L + R columns of a
    wider [n, L + R + G] output (kv_a_proj_with_mqa | g_proj) gives the bits of a contiguous
    copy. Negative control: plain RoPE frequencies move both."""
    be = backend(name)
    rng = rng_for("nope", interleave)
    L, R, G, Hq, P, n, NB, BS = 40, 8, 24, 3, 12, 6, 3, 4
    wide, w = rnd(rng, n, L + R + G, scale=2.0), rnd(rng, L)
    q = rnd(rng, n, Hq, P + R)
    zero = np.zeros(R // 2, np.float32)
    pos = np.array([0, 1, 7, 300, 4095, 65000], np.int32)
    slots = rng.permutation(NB * BS)[:n].astype(np.int32)
    c1, c2, c3 = (be.empty_latent_kv(NB, BS, L + R) for _ in range(3))
    dev = be.from_host(wide)
    got = be.to_host(be.mla_latent_write(dev[:, :L + R], w, 1e-6, zero, pos, c1, slots, q=q, interleave=interleave))
    be.mla_latent_write(np.ascontiguousarray(wide[:, :L + R]), w, 1e-6, zero, pos, c2, slots, interleave=interleave)
    np.testing.assert_array_equal(be.kv_to_host(c1), be.kv_to_host(c2))
    rows = be.kv_to_host(c1).reshape(NB * BS, L + R)[slots]
    k_pe = wide[:, L:L + R]
    want = k_pe.astype(ml_dtypes.bfloat16).astype(np.float32) if kv_tol(be) == "bfloat16" else k_pe
    np.testing.assert_array_equal(rows[:, L:], want)
    np.testing.assert_array_equal(got, q)
    for r in range(n):
        assert_close(rows[r], latent_row64(wide[r, :L + R], w, 1e-6, zero, pos[r], interleave, 1.0), kv_tol(be),
                     what=f"row {r}")
    roped = be.to_host(be.mla_latent_write(dev[:, :L + R], w, 1e-6, inv_freq(R, 1e4), pos, c3, slots, q=q,
                                           interleave=interleave))
    moved = be.kv_to_host(c3).reshape(NB * BS, L + R)[slots][1:, L:]
    assert np.abs(moved - want[1:]).max() > 1e-2 and np.abs(roped[1:, :, P:] - q[1:, :, P:]).max() > 1e-2


@pytest.mark.parametrize("name", OTHER_BACKENDS)
def test_latent_write_equals_reference_and_later_row_wins(backend, name):
    cpu = backend(name)
    rng = rng_for("dup")
    L, R, NB, BS, n = 50, 16, 3, 4, 6
    kv_a, w, f = rnd(rng, n, L + R), rnd(rng, L), inv_freq(R, 1e4)
    pos = np.arange(n, dtype=np.int32) + 100
    slots = np.array([3, 7, 3, 0, 11, 7], np.int32)                    # 3 and 7 given twice
    c_ref, c_cpu = REF.empty_latent_kv(NB, BS, L + R), cpu.empty_latent_kv(NB, BS, L + R)
    REF.mla_latent_write(kv_a, w, 1e-5, f, pos, c_ref, slots, interleave=True)
    cpu.mla_latent_write(kv_a.astype(ml_dtypes.bfloat16).astype(np.float32), w, 1e-5, f, pos, c_cpu, slots,
                         interleave=True)
    c_ref2 = REF.empty_latent_kv(NB, BS, L + R)
    REF.mla_latent_write(kv_a.astype(ml_dtypes.bfloat16), w, 1e-5, f, pos, c_ref2, slots, interleave=True)
    assert_close(cpu.kv_to_host(c_cpu), c_ref2, kv_tol(cpu), what=f"{name} vs reference")
    rows = c_ref.reshape(-1, L + R)
    assert_close(rows[3], latent_row64(kv_a[2], w, 1e-5, f, pos[2], True, 1.0))
    assert_close(rows[7], latent_row64(kv_a[5], w, 1e-5, f, pos[5], True, 1.0))


@pytest.mark.parametrize("name", OTHER_BACKENDS)
def test_write_then_attend_equals_reference(backend, name):
    """The two ops together, as a module will call them: rows written, then read back."""
    cpu = backend(name)
    Hq, P, R, L, Dv, BS = 5, 24, 16, 72, 20, 3
    rng = rng_for("wa")
    n, NB = 11, 6
    kv_a, w, f = rnd(rng, n, L + R), rnd(rng, L), inv_freq(R, 1e4)
    pos = np.arange(n, dtype=np.int32)
    tables = rng.permutation(NB).reshape(1, NB).astype(np.int32)
    slots = (tables[0, pos // BS] * BS + pos % BS).astype(np.int32)
    kv_b = rnd(rng, Hq * (P + Dv), L, scale=L ** -0.5)
    w_uk, w_uv = mla.split_kv_b_proj(kv_b, Hq, P, Dv)
    q_nope, q_pe = rnd(rng, n, Hq, P), rnd(rng, n, Hq, R)
    row_seq, row_len = np.zeros(n, np.int32), (pos + 1).astype(np.int32)
    res = []
    for be in (REF, cpu):
        c = be.empty_latent_kv(NB, BS, L + R)
        be.mla_latent_write(kv_a, w, 1e-6, f, pos, c, slots, interleave=True)
        res.append(be.to_host(be.mla_attention_absorbed(cat(q_nope, q_pe), be.prepare_weight(w_uk),
                                                        be.prepare_weight(w_uv), c, tables, row_seq, row_len,
                                                        (P + R) ** -0.5)))
    assert_close(res[1], res[0], kv_tol(cpu))
    c = REF.empty_latent_kv(NB, BS, L + R)
    REF.mla_latent_write(kv_a, w, 1e-6, f, pos, c, slots, interleave=True)
    assert_close(res[0], attention64(q_nope, q_pe, kv_b, c, tables, row_seq, row_len, (P + R) ** -0.5))


# -- bad input ----------------------------------------------------------------------------------

L_, R_, NB_, BS_, N_ = 40, 8, 3, 4, 3


def _write_args():
    rng = rng_for("bad")
    return dict(kv_a=rnd(rng, N_, L_ + R_), kv_a_norm_w=rnd(rng, L_), eps=1e-6, inv_freq=inv_freq(R_, 1e4),
                positions=np.arange(N_, dtype=np.int32), slots=np.array([0, 5, 11], np.int32))


WRITE_BAD = [
    ("kv_a", lambda a: a["kv_a"][:, :-1], ValueError, r"kv_a: expected shape \[3, 48\]"),
    ("kv_a", lambda a: a["kv_a"].astype(np.float64), TypeError, "kv_a: expected dtype float32 or bfloat16"),
    ("kv_a_norm_w", lambda a: a["kv_a_norm_w"][:-1], ValueError, r"kv_a_norm_w: expected shape \[40\]"),
    ("inv_freq", lambda a: inv_freq(48, 1e4), ValueError, "inv_freq: expected 0..23 entries"),
    ("positions", lambda a: a["positions"].astype(np.int64), TypeError, "positions: expected dtype int32"),
    ("slots", lambda a: a["slots"][:2], ValueError, r"slots: expected shape \[3\]"),
    ("slots", lambda a: np.array([0, 12, 1], np.int32), ValueError, r"slots: expected values in \[0, 12\), got 12"),
    ("slots", lambda a: np.array([0, 1, -1], np.int32), ValueError, r"slots: expected values in \[0, 12\), got -1"),
    ("interleave", lambda a: 1, TypeError, "interleave: expected a bool"),
    ("rope_scale", lambda a: 0.0, ValueError, "rope_scale: expected a finite number"),
]


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("arg,make,exc,match", WRITE_BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(WRITE_BAD)])
def test_latent_write_refuses_bad_input_and_changes_nothing(backend, name, arg, make, exc, match):
    be = backend(name)
    a = _write_args()
    cache = filled(be, rnd(rng_for("c"), NB_, BS_, L_ + R_))
    before = cache.copy()
    kw = {"interleave": True, "rope_scale": 1.0}
    if arg in kw:
        kw[arg] = make(a)
    else:
        a[arg] = make(a)
    with pytest.raises(exc, match=match):
        be.mla_latent_write(a["kv_a"], a["kv_a_norm_w"], a["eps"], a["inv_freq"], a["positions"], cache,
                            a["slots"], **kw)
    np.testing.assert_array_equal(cache, before)


@pytest.mark.parametrize("name", BACKENDS)
def test_latent_write_refuses_a_bad_cache(backend, name):
    be = backend(name)
    a = _write_args()
    with pytest.raises(ValueError, match="latent_cache: expected 3 dimensions"):
        be.mla_latent_write(a["kv_a"], a["kv_a_norm_w"], 1e-6, a["inv_freq"], a["positions"],
                            np.zeros((NB_, BS_, 1, L_ + R_), np.float32), a["slots"])
    with pytest.raises(TypeError, match="latent_cache: expected dtype float32 or bfloat16"):
        be.mla_latent_write(a["kv_a"], a["kv_a_norm_w"], 1e-6, a["inv_freq"], a["positions"],
                            np.zeros((NB_, BS_, L_ + R_), np.float64), a["slots"])


def _attn_args():
    Hq, P, R, L, Dv, BS = 3, 8, 8, 33, 12, 4
    cache, tables, row_seq, row_len, _, q_nope, q_pe, kv_b = case("badattn", Hq, P, R, L, Dv, BS)
    w_uk, w_uv = mla.split_kv_b_proj(kv_b, Hq, P, Dv)
    return dict(q=cat(q_nope, q_pe), w_uk=w_uk, w_uv=w_uv, latent_cache=cache, block_tables=tables,
                row_seq=row_seq, row_len=row_len)


ATTN_BAD = [
    ("q", lambda a: a["q"][:, :2], ValueError, r"q: expected shape \[8, 3, 16\]"),
    ("q", lambda a: np.zeros((8, 3, 41), np.float32), ValueError, r"q: expected shape \[8, 3, 16\]"),
    ("w_uk", lambda a: np.zeros((3, 8, 42), np.float32), ValueError,
     r"w_uk: expected \[Hq, P, L\] with 1 <= L <= 41"),
    ("w_uk", lambda a: np.zeros((3, 8, 41), np.float32), ValueError, r"q: expected shape \[8, 3, 8\]"),  # L = W: R = 0
    ("w_uk", lambda a: a["w_uk"][0], ValueError, r"w_uk: expected 3 dimensions"),
    ("w_uk", lambda a: a["w_uk"][:, :, :-1], ValueError, r"q: expected shape \[8, 3, 17\]"),   # L sets R = W - L
    ("w_uv", lambda a: a["w_uv"][:2], ValueError, r"w_uv: expected shape \[3, \*, 33\]"),
    ("block_tables", lambda a: a["block_tables"].astype(np.int64), TypeError, "block_tables: expected dtype int32"),
    ("row_len", lambda a: np.where(np.arange(8) == 2, 0, a["row_len"]).astype(np.int32), ValueError,
     r"row_len\[2\]: expected >= 1, got 0"),
    ("row_start", lambda a: a["row_len"].copy(), ValueError, r"row_start\[0\]: expected 0 <= row_start < row_len"),
]


#: index values: checked where they live on the host (numpy, cpu); the cuda launchers do not
#: read device data back (as paged_attention's: a row with nothing to see gets zeros)
DEVICE_DATA = ("row_len", "row_start")


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("arg,make,exc,match", ATTN_BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(ATTN_BAD)])
def test_attention_refuses_bad_input(backend, name, arg, make, exc, match):
    if name in EMU_BACKENDS and arg in DEVICE_DATA:
        pytest.skip("index values in device arrays are not checked on the GPU")
    be = backend(name)
    a = _attn_args()
    kw = {}
    if arg == "row_start":
        kw["row_start"] = make(a)
    else:
        a[arg] = make(a)
    with pytest.raises(exc, match=match):
        be.mla_attention_absorbed(a["q"], a["w_uk"], a["w_uv"], a["latent_cache"],
                                  a["block_tables"], a["row_seq"], a["row_len"], 0.1, **kw)


def test_cpu_attention_refuses_a_table_entry_out_of_range():
    be = get_backend("cpu")
    a = _attn_args()
    a["block_tables"] = a["block_tables"].copy()
    a["block_tables"][1, 0] = 99
    NB = a["latent_cache"].shape[0]
    with pytest.raises(ValueError, match=rf"block_tables \(entries in use\): expected values in \[0, {NB}\), got 99"):
        be.mla_attention_absorbed(a["q"], a["w_uk"], a["w_uv"], a["latent_cache"],
                                  a["block_tables"], a["row_seq"], a["row_len"], 0.1)


# -- cuda ---------------------------------------------------------------------------------------

def test_cuda_backend_has_the_mla_ops(backend):
    """CudaBackend implements both ops (no NotImplementedError left), with the signatures of
    the Backend interface plus its workspaces, and they run (here on the emulator)."""
    import inspect

    assert not CudaBackend.__abstractmethods__
    for op in ("mla_latent_write", "mla_attention_absorbed"):
        assert getattr(CudaBackend, op) is not getattr(Backend, op)
        base, mine = (inspect.signature(getattr(c, op)).parameters for c in (Backend, CudaBackend))
        assert list(mine)[:len(base)] == list(base)
    assert {"q_full", "o_lat", "part_o", "part_ml", "out"} <= set(
        inspect.signature(CudaBackend.mla_attention_absorbed).parameters)
    be = backend("cuda_emu_bf16")
    assert isinstance(be, CudaBackend)
    a = _write_args()
    cache = be.empty_latent_kv(NB_, BS_, L_ + R_)
    be.mla_latent_write(a["kv_a"], a["kv_a_norm_w"], 1e-6, a["inv_freq"], a["positions"], cache, a["slots"])
    assert be.kv_to_host(cache).reshape(-1, L_ + R_)[a["slots"]].any(axis=1).all()
    b = _attn_args()
    got = be.mla_attention_absorbed(b["q"], be.prepare_weight(b["w_uk"]), be.prepare_weight(b["w_uv"]),
                                    filled(be, b["latent_cache"]), b["block_tables"], b["row_seq"], b["row_len"], 0.1)
    assert got.shape == (8, 3 * 12) and np.isfinite(got).all()
