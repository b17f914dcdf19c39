"""Nemotron-3 (mtpkern/models/nemotron_h.py): the release configs read as the MTP block (or are
refused by name where they need what mtpkern lacks), and a tiny checkpoint in the release layout
(``mtp.layers.0.`` the fusion and the attention sublayer, ``mtp.layers.1.`` the MoE sublayer and
``final_layernorm``) computes what vLLM's ``nemotron_h_mtp.py`` wiring of transformers'
``nemotron_h`` blocks computes, and drafts and keeps the KV the float64 oracle does.

The module's forward (``nemotron_mtp_rows``) mirrors, step by step:
``NemotronHMultiTokenPredictor.forward`` (vLLM) over the pattern "*E":
``NemotronHMTPAttentionDecoderLayer`` (start projections: ``eh_proj(cat[enorm(e), hnorm(h)])``,
then the pre-norm ``norm`` and ``NemotronHAttention``: GQA, no RoPE, scale D^-0.5, and the
residual), ``NemotronHMTPMoEDecoderLayer`` (``norm``, ``NemotronHMoE``: ``NemotronHTopkRouter``'s
sigmoid, bias-corrected grouped top-k, renormalised + 1e-20, times routed_scaling_factor;
``NemotronHExperts``' ``down(relu2(up x))``; ``NemotronHMLP`` as the shared expert; the residual,
then ``final_layernorm``).
"""

from __future__ import annotations

import copy
import dataclasses
import json

import numpy as np
import pytest
from safetensors.numpy import load_file

import test_oracle
from conftest import rand_hiddens
from mtpkern import ConfigError, MtpConfig, MultiModuleMtpHead, write_synthetic_checkpoint
from mtpkern.config import tiny_config
from mtpkern.testing import reference_weights
from test_family_qwen3_next import _sigmoid, check_head_forward

#: the Mamba-2 / hybrid fields of the target every release config carries
_TARGET = {"ssm_state_size": 128, "mamba_head_dim": 64, "n_groups": 8, "conv_kernel": 4, "expand": 2,
           "chunk_size": 128, "use_conv_bias": True, "mamba_proj_bias": False, "mamba_hidden_act": "silu",
           "time_step_min": 0.001, "time_step_max": 0.1, "time_step_floor": 0.0001, "time_step_limit": [0.0, 1e9],
           "residual_in_fp32": False, "rescale_prenorm_residual": True, "use_mamba_kernels": True,
           "num_logits_to_keep": 1, "mlp_bias": False, "use_bias": False, "attention_bias": False,
           "attention_dropout": 0.0, "hidden_dropout": 0.0, "initializer_range": 0.02, "tie_word_embeddings": False,
           "mlp_hidden_act": "relu2", "layer_norm_epsilon": 1e-5, "vocab_size": 131072, "num_attention_heads": 32,
           "num_key_value_heads": 2, "head_dim": 128, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
           "n_shared_experts": 1, "num_nextn_predict_layers": 1, "mtp_hybrid_override_pattern": "*E",
           "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h"}
#: Nemotron-3.5 Lightning 30B-A3B (the Nano 30B-A3B shape, with its MTP layer): 52 layers
LIGHTNING = dict(_TARGET, hidden_size=2688, num_hidden_layers=52, mamba_num_heads=64, n_routed_experts=128,
                 num_experts_per_tok=6, moe_intermediate_size=1856, moe_shared_expert_intermediate_size=3712,
                 routed_scaling_factor=2.5, max_position_embeddings=262144,
                 hybrid_override_pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME")
#: Nemotron-3 Super 120B-A12B: LatentMoE (moe_latent_size), 512 experts top-22, 88 layers
SUPER = dict(_TARGET, hidden_size=4096, num_hidden_layers=88, mamba_num_heads=128, n_routed_experts=512,
             num_experts_per_tok=22, moe_intermediate_size=2688, moe_shared_expert_intermediate_size=5376,
             moe_latent_size=1024, routed_scaling_factor=5.0, max_position_embeddings=262144)


def test_the_release_config_reads_as_the_mtp_block():
    cfg = MtpConfig.from_dict(copy.deepcopy(LIGHTNING))
    b = cfg.block(0)
    assert cfg.family == "nemotron_h" and cfg.num_modules == 1 and cfg.layer_index(0) == 52
    assert (cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == \
        (2688, 128, 6, 1856)
    assert cfg.shared_intermediate_size == 3712 and cfg.n_shared_experts == 2      # one MLP of 3712 rows
    assert (cfg.scoring_func, cfg.router_bias, cfg.routed_scaling_factor, cfg.rms_norm_eps) == \
        ("sigmoid", True, 2.5, 1e-5)
    assert (b.num_attention_heads, b.num_key_value_heads, b.head_dim, b.moe) == (32, 2, 128, True)
    assert b.mlp_act == "relu2" and b.nope and not np.any(b.inv_freq())
    assert "NoPE" in cfg.describe() and "relu2" in cfg.describe()
    assert MtpConfig.from_dict(cfg.to_dict()) == cfg
    d = dict(copy.deepcopy(LIGHTNING), mtp_layers_block_type=["full_attention", "moe"])
    del d["mtp_hybrid_override_pattern"]
    assert MtpConfig.from_dict(d) == cfg                  # transformers 5's list, the same block
    dense = MtpConfig.from_dict(dict(copy.deepcopy(LIGHTNING), mtp_hybrid_override_pattern="*-",
                                     intermediate_size=1856))
    assert not dense.block(0).moe and dense.block(0).mlp_act == "relu2"


@pytest.mark.parametrize("change, field", [
    ({"mtp_hybrid_override_pattern": "**E"}, "mtp_hybrid_override_pattern"),      # two attention sublayers
    ({"mtp_hybrid_override_pattern": "E*"}, "mtp_hybrid_override_pattern"),       # the FFN first
    ({"mtp_hybrid_override_pattern": "M*E"}, "mtp_hybrid_override_pattern"),      # a Mamba sublayer
    ({"mtp_layers_block_type": ["full_attention", "full_attention", "moe"]}, "mtp_hybrid_override_pattern"),
    ({"mtp_layers_block_type": ["full_attention", "moe"], "mtp_hybrid_override_pattern": "*-"},
     "disagrees with 'mtp_layers_block_type'"),
    ({"mlp_hidden_act": "silu"}, "mlp_hidden_act"),
    ({"num_nextn_predict_layers": 2}, "num_nextn_predict_layers"),
    ({"moe_shared_expert_intermediate_size": 1000}, "moe_shared_expert_intermediate_size"),
    ({"mlp_bias": True}, "mlp_bias"),
])
def test_what_mtpkern_lacks_is_refused_by_name(change, field):
    with pytest.raises(ConfigError, match=field):
        MtpConfig.from_dict(dict(copy.deepcopy(LIGHTNING), **change))


def test_super_s_config_reads_as_a_latent_moe_block():
    cfg = MtpConfig.from_dict(copy.deepcopy(SUPER))
    assert (cfg.hidden_size, cfg.moe_latent_size, cfg.n_routed_experts, cfg.num_experts_per_tok) == (4096, 1024, 512, 22)
    assert cfg.shared_intermediate_size == 5376 and cfg.routed_scaling_factor == 5.0 and cfg.layer_index(0) == 88
    assert cfg.block(0).mlp_act == "relu2" and cfg.block(0).nope
    assert MtpConfig.from_dict(cfg.to_dict()) == cfg and "latent=1024" in cfg.describe()
    assert MtpConfig.from_dict(dict(copy.deepcopy(SUPER), moe_latent_size=None)).moe_latent_size == 0


#: the Puzzle-compressed Super (nemotron_h_puzzle): per-layer MoE sizes in block_configs, the MTP
#: step's sublayers in mtp_block_configs
PUZZLE = dict({k: v for k, v in SUPER.items() if k not in ("moe_intermediate_size", "num_experts_per_tok",
                                                           "mtp_hybrid_override_pattern", "num_hidden_layers")},
              model_type="nemotron_h_puzzle", architectures=["NemotronHPuzzleForCausalLM"], num_hidden_layers=None,
              layers_block_type=["mamba", "moe", "attention", "moe"],
              block_configs=[{"block_type": "mamba"},
                             {"block_type": "moe", "moe_intermediate_size": 1280, "num_experts_per_tok": 4},
                             {"block_type": "attention"},
                             {"block_type": "moe", "moe_intermediate_size": 2688, "num_experts_per_tok": 22}],
              mtp_block_configs=[{"block_type": "attention"},
                                 {"block_type": "moe", "moe_intermediate_size": 2688, "n_routed_experts": 512,
                                  "num_experts_per_tok": 22, "moe_latent_size": 1024,
                                  "moe_shared_expert_intermediate_size": 5376}])


def test_the_puzzle_config_reads_as_super_s_block():
    cfg = MtpConfig.from_dict(copy.deepcopy(PUZZLE))
    sup = MtpConfig.from_dict(copy.deepcopy(SUPER))
    assert cfg.family == "nemotron_h_puzzle" and cfg.layer_index(0) == 4      # num_hidden_layers from the layers
    assert dataclasses.replace(cfg, family="nemotron_h", num_hidden_layers=88) == sup
    assert MtpConfig.from_dict(cfg.to_dict()) == cfg
    bad = copy.deepcopy(PUZZLE)
    bad["mtp_block_configs"].insert(0, {"block_type": "attention"})
    with pytest.raises(ConfigError, match="mtp_hybrid_override_pattern"):
        MtpConfig.from_dict(bad)
    bad = dict(copy.deepcopy(PUZZLE), num_experts_per_tok=8)                  # the top level disagrees
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        MtpConfig.from_dict(bad)


# -- a tiny checkpoint in the release layout ---------------------------------------------------

#: "*E" at test size: GQA 4/2 heads of 16 without RoPE, 8 relu2 experts in 4 groups (top 2 of them),
#: a shared expert of 2 x 32 rows
NEMO = tiny_config(family="nemotron_h", mlp_act="relu2", nope=True, num_nextn_predict_layers=1, use_qk_norm=False,
                   attention_bias=False, partial_rotary_factor=1.0, n_shared_experts=2)
#: the same with Super's LatentMoE: the experts on a latent of 24 (fc1_latent_proj / fc2_latent_proj)
LATENT = dataclasses.replace(NEMO, moe_latent_size=24)
CONFIGS = {"plain": NEMO, "latent": LATENT}


def release_config(cfg: MtpConfig) -> dict:
    """The config.json a release of ``cfg`` ships (the release's names, no mtpkern fields)."""
    d = {k: v for k, v in cfg.to_dict().items() if k not in ("mlp_act", "nope", "rms_norm_eps", "hidden_act",
                                                               "n_shared_experts", "rope_parameters",
                                                               "attn_gate", "shared_expert_gate", "router_bias",
                                                               "scoring_func", "use_qk_norm", "intermediate_size",
                                                               "first_k_dense_replace", "partial_rotary_factor")}
    d.update(layer_norm_epsilon=cfg.rms_norm_eps, mlp_hidden_act="relu2", mtp_hybrid_override_pattern="*E",
             hybrid_override_pattern="M" * (cfg.num_hidden_layers - 1) + "*",
             moe_shared_expert_intermediate_size=cfg.shared_intermediate_size, n_shared_experts=1,
             **{k: v for k, v in _TARGET.items() if k in ("ssm_state_size", "mamba_head_dim", "n_groups",
                                                          "conv_kernel", "mamba_hidden_act", "use_bias")})
    return d


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def ckpt(tmp_path_factory, request):
    cfg = CONFIGS[request.param]
    path = write_synthetic_checkpoint(tmp_path_factory.mktemp("nemotron"), cfg, seed=13, dtype="float32")
    (path / "config.json").write_text(json.dumps(release_config(cfg)))
    return path, reference_weights(path), cfg


def test_the_release_layout_and_config(ckpt):
    path, _, cfg = ckpt
    raw = load_file(str(path / "model.safetensors"))
    assert MtpConfig.from_json(path / "config.json") == cfg
    for k in ("mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight", "mtp.layers.0.eh_proj.weight",
              "mtp.layers.0.norm.weight", "mtp.layers.0.mixer.q_proj.weight", "mtp.layers.1.norm.weight",
              "mtp.layers.1.mixer.gate.e_score_correction_bias", "mtp.layers.1.mixer.experts.7.up_proj.weight",
              "mtp.layers.1.mixer.shared_experts.up_proj.weight", "mtp.layers.1.final_layernorm.weight",
              "backbone.embeddings.weight", "lm_head.weight"):
        assert k in raw, k
    assert not any("gate_proj" in k for k in raw)                       # non-gated MLPs
    assert raw["mtp.layers.1.mixer.shared_experts.up_proj.weight"].shape == (64, 64)
    width = cfg.moe_latent_size or cfg.hidden_size                      # the experts' input
    assert raw["mtp.layers.1.mixer.experts.0.up_proj.weight"].shape == (32, width)
    assert ("mtp.layers.1.mixer.fc1_latent_proj.weight" in raw) == bool(cfg.moe_latent_size)


# -- the module's math from the raw release tensors --------------------------------------------

def _rms(x, w, eps):
    """NemotronHRMSNorm: w * x / rms(x), in float64."""
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * np.asarray(w, np.float64)


def _router(cfg, W, L, f):
    """NemotronHTopkRouter over f [n, H] -> (ids, weights) per row."""
    s = _sigmoid(f @ W[L + "mixer.gate.weight"].T)                         # [n, E]
    c = s + W[L + "mixer.gate.e_score_correction_bias"]
    E, G = cfg.n_routed_experts, cfg.n_group
    out = []
    for i in range(len(f)):
        grp = np.sort(c[i].reshape(G, E // G), 1)[:, -2:].sum(1)           # top-2 sum per group
        keep = np.argsort(-grp, kind="stable")[:cfg.topk_group]
        masked = np.full(E, -np.inf)
        for g_ in keep:
            masked[g_ * (E // G):(g_ + 1) * (E // G)] = c[i, g_ * (E // G):(g_ + 1) * (E // G)]
        top = np.argsort(-masked, kind="stable")[:cfg.num_experts_per_tok]
        w = s[i, top] / (s[i, top].sum() + 1e-20) * cfg.routed_scaling_factor
        out.append((top, w))
    return out


def nemotron_mtp_rows(raw: dict, cfg: MtpConfig, toks, g, act: str = "relu2", order: str = "*E"):
    """The MTP step over n causal rows from a fresh KV, in float64 from the tensors as released
    -> (y, final_layernorm(y)). Negative controls: ``act="silu"`` (a SiLU where relu2 is),
    ``order="E*"`` (the MoE sublayer before the attention)."""
    W = {k: np.asarray(v, np.float64) for k, v in raw.items()}
    A, M = "mtp.layers.0.", "mtp.layers.1."
    eps, n = cfg.rms_norm_eps, len(toks)
    Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    e = _rms(W["backbone.embeddings.weight"][toks], W[A + "enorm.weight"], eps)
    h = _rms(np.asarray(g, np.float64), W[A + "hnorm.weight"], eps)
    x = np.concatenate([e, h], 1) @ W[A + "eh_proj.weight"].T                # [n, H]

    def mlp(u, up, down):                                                    # NemotronHMLP / one expert
        v = u @ up.T
        return (np.maximum(v, 0.0) ** 2 if act == "relu2" else v * _sigmoid(v)) @ down.T

    def attention(x_):                                                       # NemotronHAttention, no RoPE
        a = _rms(x_, W[A + "norm.weight"], eps)
        q = (a @ W[A + "mixer.q_proj.weight"].T).reshape(n, Hq, D)
        k = (a @ W[A + "mixer.k_proj.weight"].T).reshape(n, Hkv, D)
        v = (a @ W[A + "mixer.v_proj.weight"].T).reshape(n, Hkv, D)
        o = np.zeros((n, Hq, D))
        for i in range(n):
            for hh in range(Hq):
                sc = k[:i + 1, hh // (Hq // Hkv)] @ q[i, hh] * D ** -0.5
                p = np.exp(sc - sc.max())
                o[i, hh] = (p / p.sum()) @ v[:i + 1, hh // (Hq // Hkv)]
        return x_ + o.reshape(n, Hq * D) @ W[A + "mixer.o_proj.weight"].T

    def moe(x_):                                                             # NemotronHMoE
        f = _rms(x_, W[M + "norm.weight"], eps)
        latent = M + "mixer.fc1_latent_proj.weight" in W                    # LatentMoE (Super / Ultra)
        u = f @ W[M + "mixer.fc1_latent_proj.weight"].T if latent else f     # the experts' input
        routed = np.zeros_like(u)
        for i, (top, wts) in enumerate(_router(cfg, W, M, f)):              # the router reads f
            for e_, w_ in zip(top, wts):
                routed[i] += w_ * mlp(u[i:i + 1], W[M + f"mixer.experts.{e_}.up_proj.weight"],
                                      W[M + f"mixer.experts.{e_}.down_proj.weight"])[0]
        if latent:
            routed = routed @ W[M + "mixer.fc2_latent_proj.weight"].T
        shared = mlp(f, W[M + "mixer.shared_experts.up_proj.weight"], W[M + "mixer.shared_experts.down_proj.weight"])
        return x_ + routed + shared

    y = moe(attention(x)) if order == "*E" else attention(moe(x))
    return y, _rms(y, W[M + "final_layernorm.weight"], eps)


def _rows(cfg, seed=11, n=7):
    rng = np.random.default_rng(seed)
    return rng.integers(0, cfg.vocab_size, n).astype(np.int32), rand_hiddens(rng, n, cfg.hidden_size)


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_module_computes_the_reference_forward(ckpt, backend):
    path, _, cfg = ckpt
    raw = load_file(str(path / "model.safetensors"))
    toks, g = _rows(cfg)
    want_y, want_n = nemotron_mtp_rows(raw, cfg, toks, g)
    check_head_forward(MultiModuleMtpHead.from_pretrained(path, backend=backend), toks, g, want_y, want_n)


@pytest.mark.parametrize("change", [{"act": "silu"}, {"order": "E*"}])
def test_negative_controls_are_seen(ckpt, change):
    """A SiLU where relu2 is, or the sublayers swapped: the forward differs, so the reference
    test above would fail had the module computed either."""
    path, _, cfg = ckpt
    raw = load_file(str(path / "model.safetensors"))
    toks, g = _rows(cfg)
    want_y, want_n = nemotron_mtp_rows(raw, cfg, toks, g, **change)
    with pytest.raises(AssertionError):
        check_head_forward(MultiModuleMtpHead.from_pretrained(path, backend="numpy"), toks, g, want_y, want_n)


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_drafts_and_kv_equal_the_oracle(ckpt, backend):
    path, weights, cfg = ckpt
    prop = MultiModuleMtpHead.from_pretrained(path, backend=backend, kv_mode="exact", block_size=4, num_blocks=96,
                                              prefill_chunk=7)
    assert prop.chain == "postnorm"
    test_oracle.run_scenario(prop, cfg, weights, 5, 20, [(3, 1.0), (3, 0.4), (2, 0.0), (3, 1.0)], "postnorm", None)


def test_a_dense_relu2_block_drafts_as_the_oracle(tmp_path):
    """The pattern "*-": the dense MLP is relu2 too (numpy and cpu)."""
    cfg = dataclasses.replace(NEMO, n_routed_experts=0, intermediate_size=48)
    path = write_synthetic_checkpoint(tmp_path, cfg, seed=5, dtype="float32")
    weights = reference_weights(path)
    for backend in ("numpy", "cpu"):
        prop = MultiModuleMtpHead.from_pretrained(path, backend=backend, kv_mode="exact", block_size=4,
                                                  num_blocks=64, prefill_chunk=5)
        test_oracle.run_scenario(prop, cfg, weights, 3, 12, [(3, 1.0), (2, 0.0)], "postnorm", None)


# -- the relu2 ops: cpu against the numpy reference, bad input, the cuda refusal -----------------

@pytest.mark.parametrize("n, H, I, E, K", [(1, 19, 13, 5, 2), (3, 64, 40, 7, 3), (5, 99, 17, 4, 4)])
@pytest.mark.parametrize("fp8", [False, True])
def test_relu2_ops_on_the_cpu_equal_the_reference(n, H, I, E, K, fp8):
    from mtpkern.backends.cpu import CpuBackend
    from mtpkern.ops import mlp, moe
    from mtpkern.quant import Fp8Weight

    rng = np.random.default_rng(n * H + I)
    x = rng.standard_normal((n, H)).astype(np.float32)
    w1 = (rng.standard_normal((E, I, H)) / np.sqrt(H)).astype(np.float32)
    w2 = (rng.standard_normal((E, H, I)) / np.sqrt(I)).astype(np.float32)
    ids = rng.integers(-1, E, (n, K)).astype(np.int32)           # -1: empty slots too
    wts = rng.random((n, K)).astype(np.float32)
    be = CpuBackend()
    if fp8:                                                        # the reference on the dequantized weights
        q1, q2 = Fp8Weight.quantize(w1, (8, 8)), Fp8Weight.quantize(w2, (8, 8))
        w1, w2 = q1.dequantize(), q2.dequantize()
        c1, c2 = be.prepare_weight(q1), be.prepare_weight(q2)
        d1, d2 = be.prepare_weight(Fp8Weight.quantize(w1[0], (8, 8))), be.prepare_weight(Fp8Weight.quantize(w2[0], (8, 8)))
    else:
        c1, c2, d1, d2 = be.prepare_weight(w1), be.prepare_weight(w2), be.prepare_weight(w1[0]), be.prepare_weight(w2[0])
    want = moe.moe_experts(x, ids, wts, w1, w2, x, activation="relu2")
    np.testing.assert_allclose(be.moe_experts(x, ids, wts, c1, c2, x, activation="relu2"), want, rtol=1e-5, atol=1e-5)
    silu = moe.moe_experts(x, ids, wts, np.concatenate([w1, w1], 1), w2, x)    # a SwiGLU of gate = up
    assert not np.allclose(silu, want, rtol=1e-3, atol=1e-3)       # the activation is seen
    want = mlp.swiglu_mlp(x, w1[0], w2[0], x, activation="relu2")
    np.testing.assert_allclose(be.swiglu_mlp(x, d1, d2, x, activation="relu2"), want, rtol=1e-5, atol=1e-5)
    ref = np.maximum(x.astype(np.float64) @ w1[0].T.astype(np.float64), 0) ** 2 @ w2[0].T.astype(np.float64) + x
    np.testing.assert_allclose(want, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_relu2_bad_input_names_the_argument(backend):
    from mtpkern.backends import get_backend

    be = get_backend(backend)
    x = np.ones((2, 8), np.float32)
    w1, w2 = np.ones((4, 8), np.float32), np.ones((8, 4), np.float32)
    with pytest.raises(ValueError, match="activation: expected one of"):
        be.swiglu_mlp(x, w1, w2, activation="gelu")
    with pytest.raises(ValueError, match="limit: the SwiGLU clamp needs activation 'swiglu'"):
        be.swiglu_mlp(x, w1, w2, limit=3.0, activation="relu2")
    with pytest.raises(ValueError, match=r"w2: expected"):
        be.swiglu_mlp(x, w1, np.ones((8, 2), np.float32), activation="relu2")   # relu2: w2 [H, I] with I = 4
    ids, wts = np.zeros((2, 1), np.int32), np.ones((2, 1), np.float32)
    with pytest.raises(ValueError, match=r"w13: expected \[E, I, 8\] \(relu2\)"):
        be.moe_experts(x, ids, wts, np.ones((1, 4, 9), np.float32), np.ones((1, 8, 4), np.float32), activation="relu2")


def test_block_fields_are_checked():
    from mtpkern.block import BlockError, BlockSpec

    with pytest.raises(BlockError, match="mlp_act expected one of"):
        BlockSpec(4, 2, 16, mlp_act="gelu")
    with pytest.raises(BlockError, match="SwiGLU clamps need mlp_act 'swiglu'"):
        BlockSpec(4, 2, 16, mlp_act="relu2", swiglu_clamp=2.0)
    with pytest.raises(BlockError, match="nope"):
        BlockSpec(4, 2, 16, nope=1)


@pytest.mark.parametrize("dense", [False, True, "latent"])
def test_cuda_drafts_and_kv_equal_the_oracle(tmp_path, emulator, dense):
    """relu2 on the kernels (the emulator, an FP32 KV): moe_expert_kernel's relu2 up pass and
    the dense relu2_kernel between two linear_kernel launches, and Super's LatentMoE (the
    experts at width 24 between fc1_latent_proj and fc2_latent_proj); the drafts and KV the
    float64 oracle has."""
    from cuda_emu import emu_backend
    cfg = LATENT if dense == "latent" else NEMO
    dense = dense is True
    cfg = dataclasses.replace(NEMO, n_routed_experts=0, intermediate_size=48) if dense else cfg
    path = write_synthetic_checkpoint(tmp_path, cfg, seed=13, dtype="float32")
    (path / "config.json").write_text(json.dumps(dict(release_config(cfg), **(
        {"mtp_hybrid_override_pattern": "*-", "intermediate_size": 48} if dense else {}))))
    read = MtpConfig.from_json(path / "config.json")    # (dense: the MoE fields describe the target)
    assert read.block(0) == cfg.block(0) and read.intermediate_size == cfg.intermediate_size
    prop = MultiModuleMtpHead.from_pretrained(path, backend=emu_backend.backend("float32"), kv_mode="exact",
                                              block_size=4, num_blocks=96, prefill_chunk=7)
    test_oracle.run_scenario(prop, read, reference_weights(path), 5, 20, [(3, 1.0), (3, 0.4), (2, 0.0), (3, 1.0)],
                             "postnorm", None)
    assert prop.step_runner.counts["executed"] + prop.step_runner.counts["replayed"] > 0, dict(prop.step_runner.counts)


@pytest.mark.parametrize("n", [1, 3, 6])
def test_cuda_relu2_ops_equal_the_reference(emulator, n):
    """The relu2 kernels on the emulator against the numpy reference: moe_experts (one row: the
    fused down-combine; more: by pair and by expert, the norm fused in) and the dense MLP
    (linear_kernel, relu2_kernel, linear_kernel), FP32 and BF16 weights."""
    from cuda_emu import emu_backend
    from mtpkern.ops import mlp, moe

    be = emu_backend.backend("float32")
    rng = np.random.default_rng(n)
    H, I, E, K = 40, 24, 5, 2
    x = rng.standard_normal((n, H)).astype(np.float32)
    g = (1 + 0.1 * rng.standard_normal(H)).astype(np.float32)
    w1 = (rng.standard_normal((E, I, H)) / np.sqrt(H)).astype(np.float32)
    w2 = (rng.standard_normal((E, H, I)) / np.sqrt(I)).astype(np.float32)
    ids = np.stack([rng.permutation(E)[:K] for _ in range(n)]).astype(np.int32)   # distinct per row, as routed
    wts = rng.random((n, K)).astype(np.float32)
    want = moe.moe_experts(x, ids, wts, w1, w2, x, norm=(g, 1e-5), activation="relu2")
    got = be.moe_experts(be.from_host(x), be.from_host(ids), be.from_host(wts), be.prepare_weight(w1),
                         be.prepare_weight(w2), be.from_host(x), norm=(be.from_host(g), 1e-5), activation="relu2")
    np.testing.assert_allclose(be.to_host(got), want, rtol=1e-5, atol=1e-5)
    want = mlp.swiglu_mlp(x, w1[1], w2[1], x, activation="relu2")
    got = be.swiglu_mlp(be.from_host(x), be.prepare_weight(w1[1]), be.prepare_weight(w2[1]), be.from_host(x),
                        activation="relu2")
    np.testing.assert_allclose(be.to_host(got), want, rtol=1e-5, atol=1e-5)
