"""DeepSeek-V4's attention as features of a GQA block: the query through its own latent
(``q_lora_rank``: q_a_proj, q_a_layernorm, q_b_proj), one projection for key and value
(``shared_kv``: the value is the key as normed and rotated), the output's rotary dims turned
back to the query's frame (``out_rope``), and a grouped low-rank output (``o_groups`` x
``o_lora_rank``: o_a_proj per group of heads, then o_b_proj); with sinks, a window and
hyper-connections as V4's MTP layer has them.

Ops (``qk_norm_rope_kv_write(v_is_k=True)``, ``rope_heads(inverse=True)``,
``linear_grouped``) against float64 written here on every backend; a module's outputs and a
proposer's drafts / KV against the float64 oracle (mtpkern.testing.oracle); negative
controls (each feature dropped from the oracle) must fail.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import test_oracle
from mtpkern import MultiModuleMtpHead, write_synthetic_checkpoint
from mtpkern.config import tiny_config
from mtpkern.head import RowJob
from mtpkern.ops.rope_kv import inv_freq
from mtpkern.testing import oracle, reference_weights
from mtpkern.tolerance import assert_close
from test_ops_mla import BACKENDS, OTHER_BACKENDS, REF, backend, emulator, kv_tol, rng_for, rope64  # noqa: F401

#: V4's MTP attention at test size: one K = V head of 32, 8 rotary dims in pairs, q latent 24,
#: two output groups of rank 16, sinks
V4_ATTN = dict(num_key_value_heads=1, head_dim=32, partial_rotary_factor=0.25, rope_interleave=True,
               q_lora_rank=24, shared_kv=True, out_rope=True, o_groups=2, o_lora_rank=16, attn_sinks=True,
               attention_bias=False)
CASES = {"plain": {}, "window_hc": dict(sliding_window=6, hc_mult=4)}


# -- ops ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("interleave", [True, False])
def test_rope_heads_inverse_undoes_the_rotation(backend, name, interleave):
    be = backend(name)
    rng = rng_for("rope_heads", interleave)
    n, h, D, R = 5, 3, 32, 8
    x = rng.standard_normal((n, h, D)).astype(np.float32)
    pos = rng.integers(0, 5000, n).astype(np.int32)
    f = inv_freq(R, 1e4)
    kw = {"interleave": True} if interleave else {}
    fwd = be.to_host(be.rope_heads(be.from_host(x), pos, f, **kw))
    inv = be.to_host(be.rope_heads(be.from_host(x), pos, f, inverse=True, **kw))
    for i in range(n):
        for j in range(h):
            assert_close(fwd[i, j, :R], rope64(x[i, j, :R].astype(np.float64), pos[i], f, interleave, 1.0),
                         "float32", f"{name}: forward")
            assert_close(inv[i, j, :R], rope64(x[i, j, :R].astype(np.float64), -pos[i], f, interleave, 1.0),
                         "float32", f"{name}: inverse")
    assert np.array_equal(inv[..., R:], x[..., R:]) and np.array_equal(fwd[..., R:], x[..., R:])
    back = be.to_host(be.rope_heads(be.from_host(fwd), pos, f, inverse=True, **kw))
    assert_close(back, x, "float32", f"{name}: inverse of forward")


@pytest.mark.parametrize("name", BACKENDS)
def test_v_is_k_writes_the_written_key_as_the_value(backend, name):
    be = backend(name)
    rng = rng_for("v_is_k")
    n, Hq, Hkv, D, NB, BS = 4, 4, 1, 32, 3, 4
    qkv = rng.standard_normal((n, (Hq + Hkv) * D)).astype(np.float32)
    kc, vc = be.empty_keys(NB, BS, Hkv, D), be.empty_kv(NB, BS, Hkv, D)
    slots = np.array([0, 5, 6, 11], np.int32)
    pos = np.array([3, 9, 10, 40], np.int32)
    qn, kn = np.ones(D, np.float32), (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
    be.qk_norm_rope_kv_write(be.from_host(qkv), Hq, Hkv, be.prepare_vector(qn), be.prepare_vector(kn), 1e-6,
                             inv_freq(8, 1e4), pos, kc, vc, slots, interleave=True, v_is_k=True)
    k, v = be.kv_to_host(kc).reshape(NB * BS, Hkv, D), be.kv_to_host(vc).reshape(NB * BS, Hkv, D)
    assert np.array_equal(k[slots], v[slots]) and np.abs(k[slots]).sum() > 0
    with pytest.raises(ValueError, match="v_is_k"):
        be.qk_norm_rope_kv_write(be.from_host(qkv), Hq, Hkv, None, None, 1e-6, inv_freq(8, 1e4), pos, kc,
                                 be.empty_kv(NB, BS, Hkv, 16), slots, v_is_k=True)


#: (n, heads, D, R): DeepSeek-V4's 64 heads x 512 with 64 rotary dims at one row and at three (the
#: cpu kernel's threads past 2^16 elements); odd heads, dims and pairs; R = D; one pair
ROPE_HEADS_SHAPES = [(1, 64, 512, 64), (3, 64, 512, 64), (19, 3, 7, 6), (4, 5, 80, 80), (2, 1, 33, 2)]


@pytest.mark.parametrize("name", OTHER_BACKENDS)
@pytest.mark.parametrize("n,heads,D,R", ROPE_HEADS_SHAPES)
@pytest.mark.parametrize("interleave,rope_scale,inverse", [(False, 1.0, False), (True, 1.0, True),
                                                           (True, 0.7, False), (False, 1.3, True)])
def test_rope_heads_against_the_reference(backend, name, n, heads, D, R, interleave, rope_scale, inverse):
    be = backend(name)
    rng = rng_for("rope_heads_shapes", n, heads, D, R, interleave, rope_scale, inverse)
    x = rng.standard_normal((n, heads, D)).astype(np.float32) * 3
    pos = rng.integers(0, 200_000, n).astype(np.int32)
    f = inv_freq(R, 1e6)
    kw = dict(interleave=interleave, rope_scale=rope_scale, inverse=inverse)
    xd = be.from_host(x)
    got = be.to_host(be.rope_heads(xd, pos, f, **kw))
    want = REF.rope_heads(x, pos, f, **kw)
    assert got.shape == (n, heads, D) and got.dtype == np.float32
    assert_close(got[..., :R], want[..., :R], "float32", f"{name}: rotated dims")
    assert np.array_equal(got[..., R:], x[..., R:]), f"{name}: dims past R copied"
    assert np.array_equal(be.to_host(xd), x), f"{name}: x left as it was"
    if R > 2 or rope_scale != 1.0:           # negative control: the other rotation is far off
        other = REF.rope_heads(x, pos, f, **{**kw, "inverse": not inverse})
        with pytest.raises(AssertionError):
            assert_close(got[..., :R], other[..., :R], "float32", "the other direction")


@pytest.mark.parametrize("name", OTHER_BACKENDS)
def test_rope_heads_inputs_and_out(backend, name):
    """BF16 x (widened: exact), a strided x, ``out=``: the same bits as the plain FP32 call."""
    import ml_dtypes

    be = backend(name)
    rng = rng_for("rope_heads_inputs")
    n, heads, D, R = 5, 6, 40, 16
    wide = rng.standard_normal((n, 2 * heads, D)).astype(np.float32)
    x = np.ascontiguousarray(wide[:, ::2])
    pos, f = rng.integers(0, 9000, n).astype(np.int32), inv_freq(R, 1e4)
    plain = be.to_host(be.rope_heads(be.from_host(x), pos, f, interleave=True, inverse=True))
    if name == "cpu":                         # host arrays in any layout (the emulated cuda copies its inputs)
        assert np.array_equal(be.to_host(be.rope_heads(wide[:, ::2], pos, f, interleave=True, inverse=True)), plain)
    xb = x.astype(ml_dtypes.bfloat16)
    got = be.to_host(be.rope_heads(xb, pos, f, interleave=True, inverse=True))
    want = be.to_host(be.rope_heads(be.from_host(xb.astype(np.float32)), pos, f, interleave=True, inverse=True))
    assert np.array_equal(got, want), f"{name}: BF16 x"
    out = be.from_host(np.full((n, heads, D), np.nan, np.float32))
    be.rope_heads(be.from_host(x), pos, f, interleave=True, inverse=True, out=out)
    assert np.array_equal(be.to_host(out), plain), f"{name}: out="


@pytest.mark.parametrize("name", BACKENDS)
def test_rope_heads_refuses_bad_input(backend, name):
    be = backend(name)
    x, pos, f = np.zeros((3, 2, 16), np.float32), np.arange(3, dtype=np.int32), inv_freq(8, 1e4)
    for match, args, kw in [
        ("x: expected 3", (x[0], pos, f), {}),
        ("x: expected dtype", (x.astype(np.float16), pos, f), {}),
        ("inv_freq: expected 1..8 entries", (x, pos, inv_freq(18, 1e4)), {}),
        ("positions: expected shape", (x, pos[:2], f), {}),
        ("positions: expected dtype", (x, pos.astype(np.int64), f), {}),
        ("inverse: expected a bool", (x, pos, f), {"inverse": 1}),
        ("rope_scale", (x, pos, f), {"rope_scale": 0.0}),
    ]:
        with pytest.raises((TypeError, ValueError), match=match):
            be.rope_heads(*args, **kw)


@pytest.mark.parametrize("name", OTHER_BACKENDS)
@pytest.mark.parametrize("n,Hq,Hkv,D,R,extra,norms,interleave,BS", [
    (130, 8, 2, 64, 32, 0, True, True, 16),  # the cpu kernel's threads (n * W past 2^16), its key tiles (BS 16)
    (5, 3, 1, 80, 2, 7, True, False, 4),     # columns past q | k ignored
    (7, 4, 4, 24, 24, 0, False, True, 3),    # no norms, R = D
])
def test_v_is_k_against_the_reference(backend, name, n, Hq, Hkv, D, R, extra, norms, interleave, BS):
    be = backend(name)
    rng = rng_for("v_is_k_shapes", n, Hq, Hkv, D, R, extra, norms, interleave)
    NB = -(-n // BS) + 2
    qkv = rng.standard_normal((n, (Hq + Hkv) * D + extra)).astype(np.float32) * 2
    qn, kn = ((1 + 0.2 * rng.standard_normal(D)).astype(np.float32) for _ in range(2))
    norm_w = (qn, kn) if norms else (None, None)
    slots = rng.permutation(NB * BS)[:n].astype(np.int32)
    pos = rng.integers(0, 50_000, n).astype(np.int32)
    f, kw = inv_freq(R, 1e4), dict(interleave=interleave, rope_scale=1.1, v_is_k=True)
    kc, vc = be.empty_keys(NB, BS, Hkv, D), be.empty_kv(NB, BS, Hkv, D)
    q = be.to_host(be.qk_norm_rope_kv_write(be.from_host(qkv), Hq, Hkv,
                                            *(None if w is None else be.prepare_vector(w) for w in norm_w), 1e-6, f,
                                            pos, kc, vc, slots, **kw))
    kr, vr = REF.empty_kv(NB, BS, Hkv, D), REF.empty_kv(NB, BS, Hkv, D)
    qr = REF.qk_norm_rope_kv_write(qkv, Hq, Hkv, *norm_w, 1e-6, f, pos, kr, vr, slots, **kw)
    assert_close(q, qr, "float32", f"{name}: q")
    k, v = (be.kv_to_host(c).reshape(NB * BS, Hkv, D) for c in (kc, vc))
    assert_close(k[slots], kr.reshape(NB * BS, Hkv, D)[slots], kv_tol(be), f"{name}: k")
    assert np.array_equal(k, v), f"{name}: v is k as written (and nothing else written)"
    unused = np.setdiff1d(np.arange(NB * BS), slots)
    assert not np.abs(k[unused]).any()
    with pytest.raises(ValueError, match="qkv: expected"):        # without v_is_k, qkv lacks the value heads
        be.qk_norm_rope_kv_write(be.from_host(qkv[:, :(Hq + Hkv) * D]), Hq, Hkv, None, None, 1e-6, f, pos, kc, vc,
                                 slots)
    with pytest.raises(TypeError, match="v_is_k: expected a bool"):
        be.qk_norm_rope_kv_write(be.from_host(qkv), Hq, Hkv, None, None, 1e-6, f, pos, kc, vc, slots, v_is_k=1)


@pytest.mark.parametrize("name", BACKENDS)
def test_linear_grouped_is_each_group_through_its_weight(backend, name):
    be = backend(name)
    rng = rng_for("grouped")
    n, g, K, r = 3, 4, 24, 16
    x = rng.standard_normal((n, g * K)).astype(np.float32)
    ws = [rng.standard_normal((r, K)).astype(np.float32) for _ in range(g)]
    got = be.to_host(be.linear_grouped(be.from_host(x), [be.prepare_weight(w) for w in ws]))
    want = np.concatenate([x[:, i * K:(i + 1) * K].astype(np.float64) @ ws[i].T.astype(np.float64)
                           for i in range(g)], axis=1)
    assert_close(got, want, "bfloat16" if name != "numpy" else "float32", name)


# -- a module and a proposer ------------------------------------------------------------------

@pytest.fixture(scope="module", params=sorted(CASES))
def v4_ckpt(request, tmp_path_factory):
    cfg = tiny_config(**V4_ATTN, **CASES[request.param])
    path = write_synthetic_checkpoint(tmp_path_factory.mktemp(f"v4a_{request.param}"), cfg, seed=17,
                                      dtype="float32")
    return path, cfg, reference_weights(path)


def module_rows(path, backend, m, toks, g):
    prop = MultiModuleMtpHead.from_pretrained(path, backend=backend, block_size=4, num_blocks=64)
    head = prop.modules[m]
    y, normed = head.forward([RowJob(head.alloc_seq(), np.asarray(toks, np.int32), 0, m + 1, None)], g)
    return prop.backend.to_host(y), prop.backend.to_host(normed)


def _rows(cfg, seed, R=9):
    rng = np.random.default_rng(seed)
    return rng.integers(0, cfg.vocab_size, R), rng.standard_normal((R, cfg.stream_size)).astype(np.float32)


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_module_outputs_equal_the_oracle(v4_ckpt, backend):
    path, cfg, w = v4_ckpt
    toks, g = _rows(cfg, 3)
    for m in range(cfg.num_modules):
        y, normed = module_rows(path, backend, m, toks, g)
        want = oracle.module_forward(cfg, w.modules[m], m, toks, g)
        assert_close(y, want.y, "float32", f"{backend} module {m}: y")
        assert_close(normed, want.normed, "float32", f"{backend} module {m}: normed")


@pytest.mark.parametrize("wrong", ["no_out_rope", "v_before_rope", "groups_swapped", "q_latent_norm_other"])
def test_negative_controls_fail(v4_ckpt, monkeypatch, wrong):
    path, cfg, w = v4_ckpt
    toks, g = _rows(cfg, 4, R=8)
    y, normed = module_rows(path, "numpy", 0, toks, g)
    mw = w.modules[0]
    if wrong == "no_out_rope":
        want = oracle.module_forward(dataclasses.replace(cfg, out_rope=False), mw, 0, toks, g)
    elif wrong == "v_before_rope":
        orig = oracle._rope
        calls = []

        def rope_no_k(x, pos, R, theta, interleave=False, yarn=None):   # k (the 2nd call) left unrotated
            calls.append(1)
            return x if len(calls) == 2 else orig(x, pos, R, theta, interleave, yarn)
        monkeypatch.setattr(oracle, "_rope", rope_no_k)
        want = oracle.module_forward(cfg, mw, 0, toks, g)
    elif wrong == "groups_swapped":
        want = oracle.module_forward(cfg, dataclasses.replace(mw, w_o_a=list(reversed(mw.w_o_a))), 0, toks, g)
    else:
        want = oracle.module_forward(cfg, dataclasses.replace(mw, mla_q_a_norm=np.linspace(
            0.2, 2.0, mw.mla_q_a_norm.shape[0]).astype(np.float32)),
                                     0, toks, g)
    with pytest.raises(AssertionError):
        assert_close(y, want.y, "float32", "y")
        assert_close(normed, want.normed, "float32", "normed")


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_drafts_and_kv_equal_the_oracle(v4_ckpt, backend):
    path, cfg, w = v4_ckpt
    prop = MultiModuleMtpHead.from_pretrained(path, backend=backend, kv_mode="exact", block_size=4, num_blocks=96,
                                              prefill_chunk=5)
    test_oracle.run_scenario(prop, cfg, w, 6, 13, [(3, 1.0), (3, 0.4), (2, 0.0), (3, 1.0)], "prenorm", None,
                             check_kv=not cfg.sliding_window)
