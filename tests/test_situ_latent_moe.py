"""Kimi K3's MLP/MoE block features: the gated SiTU activation (``mlp_act="situ"``,
``situ_beta``, ``situ_linear_beta``) and LatentMoE (``moe_latent_size``) with the latent norm
(``moe_latent_norm``: ``mlp.latent_norm.weight``, an RMSNorm of the routed experts' weighted sum
before ``fc2_latent_proj``).

- the reference's SiTU against an independent float64 formula (with and without a linear beta,
  |g| large enough to saturate tanh and to overflow FP32's exp), with negative controls;
- the config fields and their refusals, the round trip through ``to_dict``;
- cpu == numpy and emulated cuda == numpy for the ops (dense and MoE; FP32, BF16, FP8);
- a module's forward (numpy, cpu, emulated cuda with the planned step on the fake graph
  runtime) against the float64 oracle for SiTU and latent MoE with and without the norm, and
  negative controls: the norm off, the norm after fc2, a wrong beta, the linear beta dropped;
- the planned step == the eager one on the fake CUDA runtime.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import test_oracle
from mtpkern import ConfigError, MtpConfig, MultiModuleMtpHead, write_synthetic_checkpoint
from mtpkern.block import BlockError, BlockSpec
from mtpkern.config import tiny_config
from mtpkern.ops import mlp, moe
from mtpkern.testing import reference_weights
from mtpkern.testing.oracle import situ_f64


def situ64(g, u, beta, lb=0.0):
    """SituAndMul written out in float64, apart from the code under test."""
    g, u = np.asarray(g, np.float64), np.asarray(u, np.float64)
    sig = np.where(g >= 0, 1.0 / (1.0 + np.exp(-np.abs(g))), np.exp(-np.abs(g)) / (1.0 + np.exp(-np.abs(g))))
    up = lb * np.tanh(u / lb) if lb else u
    return beta * np.tanh(g / beta) * sig * up


# -- the activation ------------------------------------------------------------------------------

@pytest.mark.parametrize("lb", [0.0, 3.5])
def test_situ_act_equals_the_float64_formula(lb):
    rng = np.random.default_rng(1)
    g = np.concatenate([rng.standard_normal(200) * 4, [0.0, -0.0, 30.0, -30.0, 95.0, -95.0, 200.0, -200.0, 1e4]])
    u = np.concatenate([rng.standard_normal(200) * 6, [1.0, -2.0, 50.0, -50.0, 3.0, 3.0, -7.0, 7.0, 1.0]])
    beta = 2.5
    gu = np.stack([g, u], 1).astype(np.float32)                       # I = 1 per row: gate | up
    got = mlp.situ_act(gu, beta, lb)[:, 0]
    want = situ64(gu[:, 0], gu[:, 1], beta, lb)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-30)
    np.testing.assert_allclose(situ_f64(gu[:, 0], gu[:, 1], beta, lb), want, rtol=1e-12, atol=1e-300)
    assert np.all(np.abs(got[-7:]) <= beta * (lb or 60.0) + 1e-5)       # saturated: |tanh| = 1, sigmoid 0 or 1
    assert got[-2] == 0.0                                             # g = -200: exp overflows, sigmoid 0
    assert np.isclose(got[-1], beta * (lb * np.tanh(1 / lb) if lb else 1.0), rtol=1e-6)   # g = 1e4: tanh, sigmoid 1
    # negative controls: another beta, the linear beta dropped (or added)
    assert not np.allclose(mlp.situ_act(gu, 1.5 * beta, lb)[:, 0], want, rtol=1e-3)
    assert not np.allclose(mlp.situ_act(gu, beta, 0.0 if lb else 3.5)[:, 0], want, rtol=1e-3)


def test_situ_ops_equal_float64():
    """swiglu_mlp and moe_experts with activation="situ" against the float64 MLP."""
    rng = np.random.default_rng(2)
    n, H, I, E = 3, 19, 13, 4
    x = rng.standard_normal((n, H)).astype(np.float32)
    w13 = (rng.standard_normal((E, 2 * I, H)) * 0.6).astype(np.float32)
    w2 = (rng.standard_normal((E, H, I)) / np.sqrt(I)).astype(np.float32)
    kw = dict(activation="situ", situ_beta=3.0, situ_linear_beta=2.0)
    gu = x.astype(np.float64) @ w13[1].T.astype(np.float64)
    want = x + situ64(gu[:, :I], gu[:, I:], 3.0, 2.0) @ w2[1].T.astype(np.float64)
    np.testing.assert_allclose(mlp.swiglu_mlp(x, w13[1], w2[1], x, **kw), want, rtol=1e-5, atol=1e-5)
    ids = np.array([[1, -1], [0, 3], [1, 2]], np.int32)
    wts = rng.random((n, 2)).astype(np.float32)
    got = moe.moe_experts(x, ids, wts, w13, w2, x, **kw)
    for r in range(n):
        y = x[r].astype(np.float64)
        for k in range(2):
            if ids[r, k] >= 0:
                e = ids[r, k]
                gu = w13[e].astype(np.float64) @ x[r]
                y = y + wts[r, k] * (w2[e].astype(np.float64) @ situ64(gu[:I], gu[I:], 3.0, 2.0))
        np.testing.assert_allclose(got[r], y, rtol=1e-5, atol=1e-5)


def test_situ_bad_input_names_the_argument():
    x, w13, w2 = np.ones((1, 8), np.float32), np.ones((8, 8), np.float32), np.ones((8, 4), np.float32)
    with pytest.raises(ValueError, match="situ_beta: expected a finite value > 0"):
        mlp.swiglu_mlp(x, w13, w2, activation="situ")
    with pytest.raises(ValueError, match="situ_linear_beta: expected a finite value >= 0"):
        mlp.swiglu_mlp(x, w13, w2, activation="situ", situ_beta=1.0, situ_linear_beta=-1.0)
    with pytest.raises(ValueError, match="situ_beta, situ_linear_beta: expected 0 with activation 'swiglu'"):
        mlp.swiglu_mlp(x, w13, w2, situ_beta=1.0)
    with pytest.raises(ValueError, match="limit: the SwiGLU clamp needs activation 'swiglu'"):
        mlp.swiglu_mlp(x, w13, w2, activation="situ", situ_beta=1.0, limit=7.0)
    with pytest.raises(TypeError, match="situ_beta: expected a number"):
        mlp.swiglu_mlp(x, w13, w2, activation="situ", situ_beta="1")


# -- the config ----------------------------------------------------------------------------------

KIMI = tiny_config(mlp_act="situ", situ_beta=2.0, situ_linear_beta=4.0, num_nextn_predict_layers=1,
                   moe_latent_size=24, moe_latent_norm=True, n_shared_experts=1)


def test_config_fields_round_trip_and_refusals():
    d = KIMI.to_dict()
    assert d["activation_situ_beta"] == 2.0 and d["activation_situ_linear_beta"] == 4.0
    assert d["moe_latent_norm"] is True and "situ_beta" not in d
    assert MtpConfig.from_dict(d) == KIMI
    b = KIMI.block(0)
    assert (b.mlp_act, b.situ_beta, b.situ_linear_beta) == ("situ", 2.0, 4.0)
    assert "situ beta=2 linear_beta=4" in KIMI.describe() and "latent=24 latent-norm" in KIMI.describe()
    plain = tiny_config()
    assert not {"activation_situ_beta", "activation_situ_linear_beta", "moe_latent_norm"} & set(plain.to_dict())
    with pytest.raises(ConfigError, match="situ_beta > 0 .config.json 'activation_situ_beta'."):
        MtpConfig.from_dict({k: v for k, v in d.items() if k != "activation_situ_beta"})
    with pytest.raises(ConfigError, match="situ_beta / situ_linear_beta need mlp_act 'situ'"):
        MtpConfig.from_dict(dict(d, mlp_act="swiglu"))
    with pytest.raises(ConfigError, match="'moe_latent_norm' = true .* needs moe_latent_size > 0"):
        MtpConfig.from_dict({k: v for k, v in d.items() if k != "moe_latent_size"})
    with pytest.raises(ConfigError, match="moe_latent_norm"):
        MtpConfig.from_dict(dict(d, moe_latent_norm=1))
    with pytest.raises(BlockError, match="situ_beta expected a number"):
        BlockSpec(4, 2, 16, mlp_act="situ", situ_beta=float("nan"))
    with pytest.raises(BlockError, match="the SwiGLU clamps need mlp_act 'swiglu'"):
        BlockSpec(4, 2, 16, mlp_act="situ", situ_beta=1.0, swiglu_clamp=3.0)


# -- the ops on cpu and on the emulated kernels ----------------------------------------------------

def _ops_case(seed, n, H, I, E, K):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, H)).astype(np.float32)
    w13 = (rng.standard_normal((E, 2 * I, H)) * 2 / np.sqrt(H)).astype(np.float32)   # gates past beta too
    w2 = (rng.standard_normal((E, H, I)) / np.sqrt(I)).astype(np.float32)
    ids = np.stack([rng.permutation(E)[:K] for _ in range(n)]).astype(np.int32)   # distinct per row, as routed
    wts = rng.random((n, K)).astype(np.float32)
    g = (1 + 0.1 * rng.standard_normal(H)).astype(np.float32)
    return x, w13, w2, ids, wts, g


def _stored(w, kind):
    """(the weight a backend prepares, the FP32 values the reference reads)."""
    from mtpkern.quant import Fp4Weight, Fp8Weight
    if kind in ("mxfp4", "nvfp4"):
        q = Fp4Weight.quantize(w, kind)
        return q, q.dequantize()
    if kind == "fp8":
        q = Fp8Weight.quantize(w, (8, 8))
        return q, q.dequantize()
    if kind == "bf16":
        import ml_dtypes
        b = w.astype(ml_dtypes.bfloat16)
        return b, b.astype(np.float32)
    return w, w


@pytest.mark.parametrize("lb", [0.0, 4.0])
@pytest.mark.parametrize("kind", ["f32", "bf16", "fp8", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("n", [1, 5])
def test_situ_ops_on_the_cpu_equal_the_reference(n, kind, lb):
    from mtpkern.backends.cpu import CpuBackend

    x, w13, w2, ids, wts, g = _ops_case(n, n, 24, 16, 6, 2)
    kw = dict(activation="situ", situ_beta=1.5, situ_linear_beta=lb)
    be = CpuBackend()
    (s13, r13), (s2, r2) = _stored(w13, kind), _stored(w2, kind)
    want = moe.moe_experts(x, ids, wts, r13, r2, x, norm=(g, 1e-5), **kw)
    got = be.moe_experts(x, ids, wts, be.prepare_weight(s13), be.prepare_weight(s2), x, norm=(g, 1e-5), **kw)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    (d13, q13), (d2, q2) = _stored(w13[2], kind), _stored(w2[2], kind)
    want = mlp.swiglu_mlp(x, q13, q2, x, **kw)
    np.testing.assert_allclose(be.swiglu_mlp(x, be.prepare_weight(d13), be.prepare_weight(d2), x, **kw), want,
                               rtol=1e-5, atol=1e-5)
    swiglu = mlp.swiglu_mlp(x, q13, q2, x)
    assert not np.allclose(swiglu, want, rtol=1e-3, atol=1e-3)        # the activation is seen


@pytest.mark.parametrize("kind", ["bf16", "fp8", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("n", [1, 3, 6])
def test_cuda_situ_ops_equal_the_reference(emulator, n, kind):
    """moe_expert_kernel's SITU gate/up pass (one row: the fused down-combine; more: by pair and by
    expert), the dense MLP's swiglu_gate_up_kernel<.., true> (and at 6 BF16 rows
    swiglu_tc_kernel<.., true>) against the reference; the norm fused."""
    from cuda_emu import emu_backend

    be = emu_backend.backend("float32")
    x, w13, w2, ids, wts, g = _ops_case(10 + n, n, 40, 24, 5, 2)
    kw = dict(activation="situ", situ_beta=1.5, situ_linear_beta=3.0)
    (s13, r13), (s2, r2) = _stored(w13, kind), _stored(w2, kind)
    want = moe.moe_experts(x, ids, wts, r13, r2, x, norm=(g, 1e-5), **kw)
    got = be.moe_experts(be.from_host(x), be.from_host(ids), be.from_host(wts), be.prepare_weight(s13),
                         be.prepare_weight(s2), be.from_host(x), norm=(be.from_host(g), 1e-5), **kw)
    np.testing.assert_allclose(be.to_host(got), want, rtol=1e-5, atol=1e-5)
    (d13, q13), (d2, q2) = _stored(w13[1], kind), _stored(w2[1], kind)
    want = mlp.swiglu_mlp(x, q13, q2, x, norm=(g, 1e-5), **kw)
    got = be.swiglu_mlp(be.from_host(x), be.prepare_weight(d13), be.prepare_weight(d2), be.from_host(x),
                        norm=(be.from_host(g), 1e-5), **kw)
    np.testing.assert_allclose(be.to_host(got), want, rtol=2e-5, atol=2e-5)


# -- a module's forward against the float64 oracle ---------------------------------------------------

#: SiTU everywhere (routed experts of width Lt = 24, the shared expert on H), the latent norm on
CASES = {
    "situ dense": tiny_config(mlp_act="situ", situ_beta=2.0, situ_linear_beta=4.0, num_nextn_predict_layers=1,
                              n_routed_experts=0, intermediate_size=48),
    "situ latent norm": KIMI,
    "swiglu latent": dataclasses.replace(KIMI, mlp_act="swiglu", situ_beta=0.0, situ_linear_beta=0.0,
                                         moe_latent_norm=False),
    "situ latent": dataclasses.replace(KIMI, moe_latent_norm=False),
}
#: the same module with FP8 weights (block scales of 8: the experts, the latent projections)
CASES["situ latent norm fp8"] = dataclasses.replace(KIMI, weight_quant="fp8", fp8_block=(8, 8))
CASES["swiglu latent fp8"] = dataclasses.replace(CASES["swiglu latent"], weight_quant="fp8", fp8_block=(8, 8))
#: and stored BF16
BF16 = ("situ latent norm bf16", "swiglu latent bf16")
CASES.update({name: CASES[name[:-5]] for name in BF16})
ROUNDS = [(1, 1.0), (1, 0.4), (1, 0.0), (1, 1.0)]


def _ckpt(tmp_path, cfg, dtype="float32"):
    return write_synthetic_checkpoint(tmp_path, cfg, seed=5, dtype=dtype)


def _case_ckpt(tmp_path, case):
    cfg = CASES[case]
    return _ckpt(tmp_path, cfg, "bfloat16" if case in BF16 else "float32"), cfg


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_drafts_and_kv_equal_the_oracle(tmp_path, case, backend):
    path, cfg = _case_ckpt(tmp_path, case)
    prop = MultiModuleMtpHead.from_pretrained(path, backend=backend, kv_mode="exact", block_size=4, num_blocks=64)
    test_oracle.run_scenario(prop, cfg, reference_weights(path), 3, 12, ROUNDS, "postnorm", None)


@pytest.mark.parametrize("case", ["situ latent norm", "swiglu latent", "situ latent norm fp8", "situ latent norm bf16",
                                  "swiglu latent bf16", "situ dense"])
def test_cuda_drafts_and_kv_equal_the_oracle(tmp_path, emulator, case):
    """The emulated kernels, through the planned step on the fake graph runtime: LatentMoE's
    projections on linear_kernel, the experts at width Lt, the norm fused into fc2."""
    from cuda_emu import emu_backend

    path, cfg = _case_ckpt(tmp_path, case)
    prop = MultiModuleMtpHead.from_pretrained(path, backend=emu_backend.backend("float32"), kv_mode="exact",
                                              block_size=4, num_blocks=64, prefill_chunk=7)
    test_oracle.run_scenario(prop, cfg, reference_weights(path), 3, 12, ROUNDS, "postnorm", None)
    assert prop.step_runner.counts["executed"] + prop.step_runner.counts["replayed"] > 0, dict(prop.step_runner.counts)


@pytest.mark.parametrize("wrong", ["norm off", "norm after fc2", "beta", "linear beta dropped"])
def test_negative_controls(tmp_path, monkeypatch, wrong):
    """The oracle changed where the module is not (the latent norm off, the norm after
    fc2_latent_proj, another beta, the linear beta dropped): the numpy proposer no longer
    matches it, so the checks above see each of these."""
    from mtpkern.testing import oracle

    cfg = KIMI
    path = _ckpt(tmp_path, cfg)
    W = reference_weights(path)
    ocfg = cfg
    if wrong == "norm off":
        W.modules[0].latent_norm = None
    elif wrong == "norm after fc2":
        def after(y, w, eps):
            return oracle._rms(y @ np.asarray(w.latent_fc2, np.float64).T, np.ones(cfg.hidden_size), eps)
        monkeypatch.setattr(oracle, "_latent_back", after)
    elif wrong == "beta":
        ocfg = dataclasses.replace(cfg, situ_beta=3.0)
    else:
        ocfg = dataclasses.replace(cfg, situ_linear_beta=0.0)
    prop = MultiModuleMtpHead.from_pretrained(path, backend="numpy", kv_mode="exact", block_size=4, num_blocks=64)
    with pytest.raises(AssertionError):
        test_oracle.run_scenario(prop, ocfg, W, 3, 12, ROUNDS, "postnorm", None)


# -- a sharded head ----------------------------------------------------------------------------

@pytest.mark.parametrize("case, experts, size", [("situ latent", "ep", 2), ("situ latent", "tp", 2),
                                                 ("situ latent norm", "ep", 2), ("situ latent norm", "tp", 4)])
def test_sharded_latent_moe_matches_one_rank(tmp_path, case, experts, size):
    """LatentMoE (SiTU experts) over 2 or 4 ranks: both latent projections whole on each rank, the
    experts split by id or by intermediate slice; fc2 of each rank's partial latent sum meets
    the others' in the FFN's all-reduce. With the latent norm: the latent sum all-reduced first,
    the norm's weight on rank 0 alone."""
    from test_shard import check_world

    path = _ckpt(tmp_path, CASES[case])
    check_world(path, size, "exact", 7, conf=True, experts=experts)


def test_sharded_latent_norm_planned_step_matches_one_rank(tmp_path):
    """The planned step over a sharded head with the latent norm (its extra all-reduce of the
    latent sum inside the module's launches), run eagerly on NumPy: the single rank's results."""
    from test_shard import check_planned_world

    check_planned_world(_ckpt(tmp_path, KIMI), "exact")


def test_sharded_latent_norm_weight_on_one_rank(tmp_path):
    """The norm's weight on rank 0, zeros on rank 1: the negative control is the weight on both
    (the sum would count fc2(norm) twice)."""
    from mtpkern.backends import get_backend
    from mtpkern.shard import Shard
    from mtpkern.weights import load_weights

    path = _ckpt(tmp_path, KIMI)
    be = get_backend("numpy")
    whole = load_weights(path, KIMI, be).modules[0].latent_norm
    r0, r1 = (load_weights(path, KIMI, be, shard=Shard(r, 2)).modules[0].latent_norm for r in (0, 1))
    np.testing.assert_array_equal(r0, whole)
    assert not np.any(r1) and np.any(whole)
