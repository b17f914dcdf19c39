"""Qwen3-Next (mtpkern/models/qwen3_next.py): the release layout loads unchanged and
computes what transformers' ``qwen3_next`` / vLLM's ``qwen3_next_mtp.py`` compute.

The features it brings: zero-centred RMSNorm everywhere (``1 + w``), a query
projection that interleaves a sigmoid output gate per head (``[q_h | g_h]``), softmax
routing without a selection bias, and a shared expert scaled by
``sigmoid(x . shared_expert_gate)``; the module hands on its normed output.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from conftest import rand_hiddens, run_rounds
from mtpkern import ConfigError, MtpConfig, MultiModuleMtpHead, write_synthetic_checkpoint
from mtpkern.config import tiny_config
from mtpkern.head import RowJob
from mtpkern.weights import read_tensors, release_layout, synthetic_tensors

#: Qwen3-Next-80B-A3B-shaped, tiny: 16 heads of 256 -> 4 of 16, 512 experts -> 8
QWEN = tiny_config(family="qwen3_next", num_nextn_predict_layers=1, attention_bias=False, partial_rotary_factor=0.25,
                   rope_theta=1e7, rms_norm_eps=1e-6, scoring_func="softmax", n_group=1, topk_group=1,
                   routed_scaling_factor=1.0, attn_gate="elementwise", shared_expert_gate=True, router_bias=False)
QWEN2 = dataclasses.replace(QWEN, num_nextn_predict_layers=2)     # a second module, to chain through


def release_config(cfg: MtpConfig, modules: int | None = None) -> dict:
    """config.json as Qwen3-Next-80B-A3B-Instruct releases it (the published fields; tiny
    sizes). The release has no ``num_nextn_predict_layers``: one module."""
    d = {
        "architectures": ["Qwen3NextForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "full_attention_interval": 4,
        "head_dim": cfg.head_dim, "hidden_act": "silu", "hidden_size": cfg.hidden_size, "initializer_range": 0.02,
        "intermediate_size": 5 * cfg.hidden_size, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_value_head_dim": 128,
        "max_position_embeddings": cfg.max_position_embeddings, "mlp_only_layers": [], "model_type": "qwen3_next",
        "moe_intermediate_size": cfg.moe_intermediate_size, "norm_topk_prob": True,
        "num_attention_heads": cfg.num_attention_heads, "num_experts": cfg.n_routed_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok, "num_hidden_layers": cfg.num_hidden_layers,
        "num_key_value_heads": cfg.num_key_value_heads, "output_router_logits": False,
        "partial_rotary_factor": 0.25, "rms_norm_eps": cfg.rms_norm_eps, "rope_scaling": None,
        "rope_theta": cfg.rope_theta, "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": cfg.moe_intermediate_size, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "transformers_version": "4.57.0.dev0", "use_cache": True,
        "use_sliding_window": False, "vocab_size": cfg.vocab_size,
    }
    if modules is not None:
        d["num_nextn_predict_layers"] = modules
    return d


def _ckpt(path, cfg: MtpConfig, seed: int = 7):
    path = write_synthetic_checkpoint(path, cfg, seed=seed, dtype="float32")
    (path / "config.json").write_text(json.dumps(release_config(cfg, None if cfg.num_modules == 1 else cfg.num_modules)))
    return path


@pytest.fixture(scope="module")
def qwen_ckpt(tmp_path_factory):
    return _ckpt(tmp_path_factory.mktemp("qwen3next"), QWEN)


def test_release_config_reads_the_family_features():
    cfg = MtpConfig.from_dict(release_config(QWEN))
    assert cfg.family == "qwen3_next" and cfg.num_modules == 1
    assert (cfg.attn_gate, cfg.shared_expert_gate, cfg.router_bias) == ("elementwise", True, False)
    assert (cfg.scoring_func, cfg.n_group, cfg.routed_scaling_factor, cfg.n_shared_experts) == ("softmax", 1, 1.0, 1)
    assert cfg.rotary_dim == cfg.head_dim // 4 and cfg.use_qk_norm
    assert cfg.block(0).gate_size == cfg.num_attention_heads * cfg.head_dim
    assert cfg.describe().startswith("Qwen3-Next")


def test_a_shared_expert_of_another_size_is_refused():
    d = release_config(QWEN)
    d["shared_expert_intermediate_size"] = 2 * QWEN.moe_intermediate_size
    with pytest.raises(ConfigError, match="shared_expert_intermediate_size"):
        MtpConfig.from_dict(d)


def test_release_layout_loads_unchanged(qwen_ckpt):
    keys = set(load_file(str(qwen_ckpt / "model.safetensors")))
    for k in ("mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight",
              "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.self_attn.q_norm.weight",
              "mtp.layers.0.mlp.shared_expert_gate.weight", "mtp.layers.0.mlp.shared_expert.up_proj.weight",
              "mtp.layers.0.mlp.experts.7.down_proj.weight", "model.embed_tokens.weight", "lm_head.weight"):
        assert k in keys, k
    assert not any("e_score_correction_bias" in k or k.startswith("model.layers.") for k in keys)
    prop = MultiModuleMtpHead.from_pretrained(qwen_ckpt, backend="numpy")
    assert prop.chain == "postnorm"                       # the family's: vLLM hands on norm(y)
    assert MultiModuleMtpHead.from_pretrained(qwen_ckpt, backend="numpy", chain="prenorm").chain == "prenorm"
    prop.check_invariants()


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
@pytest.mark.parametrize("mode", ["exact", "draft"])
def test_drafts_as_the_same_weights_in_the_canonical_layout(tmp_path, backend, mode):
    """Two modules (the release has one; a second exercises the chain and the names of
    module 1): the release layout drafts what the canonical one does."""
    rel = _ckpt(tmp_path / "rel", QWEN2, seed=3)
    canon = tmp_path / "canon"                 # the same tensors (fc, norms shared by both modules)
    canon.mkdir()
    save_file(synthetic_tensors(QWEN2, seed=3), str(canon / "model.safetensors"))
    (canon / "config.json").write_text(json.dumps(dataclasses.replace(QWEN2, family="").to_dict()))
    got = run_rounds(rel, backend=backend, mode=mode)[1]
    assert got == run_rounds(canon, backend=backend, mode=mode, chain="postnorm")[1]
    assert any(len(d) == 2 for d in got)


def test_modules_share_the_input_projection_and_final_norm():
    """vLLM's predictor has one ``fc``, ``pre_fc_norm_*`` and ``norm`` for every layer."""
    t = synthetic_tensors(QWEN2, seed=2)
    for suffix in ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
        np.testing.assert_array_equal(t[f"model.layers.2.{suffix}"], t[f"model.layers.3.{suffix}"])
    assert not np.array_equal(t["model.layers.2.self_attn.q_proj.weight"], t["model.layers.3.self_attn.q_proj.weight"])
    t["model.layers.3.eh_proj.weight"] = t["model.layers.3.eh_proj.weight"] + 1
    with pytest.raises(ValueError, match="two tensors become 'mtp.fc.weight'"):
        release_layout(QWEN2, t)


def test_release_layout_interleaves_the_gate_per_head():
    t = synthetic_tensors(QWEN, seed=1)
    out = release_layout(QWEN, t)
    D, Hq = QWEN.head_dim, QWEN.num_attention_heads
    q = t["model.layers.2.self_attn.q_proj.weight"]                        # canonical [queries; gates]
    rel = out["mtp.layers.0.self_attn.q_proj.weight"].reshape(Hq, 2 * D, -1)
    np.testing.assert_array_equal(rel[:, :D].reshape(Hq * D, -1), q[:Hq * D])
    np.testing.assert_array_equal(rel[:, D:].reshape(Hq * D, -1), q[Hq * D:])
    np.testing.assert_array_equal(out["mtp.norm.weight"] + 1, t["model.layers.2.shared_head.norm.weight"])


# -- the module's math from the raw release tensors -----------------------------------------

def _rms(x, w, eps):
    """Qwen3NextRMSNorm: x / rms(x) * (1 + w), in float64."""
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * (1.0 + np.asarray(w, np.float64))


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _rope(x, pos, R, theta):
    """neox rotate_half over the first R dims: x [n, h, D], pos [n]."""
    inv = 1.0 / theta ** (np.arange(0, R, 2, dtype=np.float64) / R)
    f = pos[:, None].astype(np.float64) * inv[None]                        # [n, R/2]
    c, s = np.cos(f)[:, None], np.sin(f)[:, None]
    x1, x2 = x[..., :R // 2], x[..., R // 2:R]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, x[..., R:]], -1)


def gated_attention_residual(W: dict, L: str, cfg: MtpConfig, x: np.ndarray) -> np.ndarray:
    """``x`` plus the gated attention of the decoder layer at prefix ``L`` over n causal rows
    from a fresh KV (positions 1..n), float64 from the release tensors ``W``: q_proj's rows per
    head ``[q | gate]`` (torch.chunk(.., 2, -1)), zero-centred q / k norms, partial RoPE in
    halves, the output times sigmoid(gate) before o_proj (Qwen3-Next's and Qwen3.5's layer)."""
    eps, Hq, Hkv, D = cfg.rms_norm_eps, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    n = x.shape[0]
    a = _rms(x, W[L + "input_layernorm.weight"], eps)
    qg = (a @ W[L + "self_attn.q_proj.weight"].T).reshape(n, Hq, 2 * D)
    q, gate = qg[..., :D], qg[..., D:].reshape(n, Hq * D)
    k = (a @ W[L + "self_attn.k_proj.weight"].T).reshape(n, Hkv, D)
    v = (a @ W[L + "self_attn.v_proj.weight"].T).reshape(n, Hkv, D)
    q, k = _rms(q, W[L + "self_attn.q_norm.weight"], eps), _rms(k, W[L + "self_attn.k_norm.weight"], eps)
    pos = np.arange(1, n + 1)
    q, k = _rope(q, pos, cfg.rotary_dim, cfg.rope_theta), _rope(k, pos, cfg.rotary_dim, cfg.rope_theta)
    att = np.zeros((n, Hq, D))
    for hh in range(Hq):
        s = q[:, hh] @ k[:, hh // (Hq // Hkv)].T * D ** -0.5
        s = np.where(np.tril(np.ones((n, n), bool)), s, -np.inf)
        pr = np.exp(s - s.max(1, keepdims=True))
        att[:, hh] = (pr / pr.sum(1, keepdims=True)) @ v[:, hh // (Hq // Hkv)]
    return x + (att.reshape(n, Hq * D) * _sigmoid(gate)) @ W[L + "self_attn.o_proj.weight"].T


def qwen3_next_mtp_rows(raw: dict, cfg: MtpConfig, toks: np.ndarray, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One module over n causal rows from a fresh KV (positions 1..n), as transformers'
    ``Qwen3NextDecoderLayer`` under vLLM's MTP wrapper computes it, in float64 from the
    tensors as released: -> (y, norm(y))."""
    W = {k: np.asarray(v, np.float64) for k, v in raw.items()}
    p, L = "mtp.", "mtp.layers.0."
    eps = cfg.rms_norm_eps
    n = len(toks)
    e = _rms(W["model.embed_tokens.weight"][toks], W[p + "pre_fc_norm_embedding.weight"], eps)
    h = _rms(np.asarray(g, np.float64), W[p + "pre_fc_norm_hidden.weight"], eps)
    x = np.concatenate([e, h], 1) @ W[p + "fc.weight"].T
    r = gated_attention_residual(W, L, cfg, x)
    f = _rms(r, W[L + "post_attention_layernorm.weight"], eps)

    def mlp(pre, x_):
        gt, up = x_ @ W[pre + "gate_proj.weight"].T, x_ @ W[pre + "up_proj.weight"].T
        return (gt * _sigmoid(gt) * up) @ W[pre + "down_proj.weight"].T

    logits = f @ W[L + "mlp.gate.weight"].T
    prob = np.exp(logits - logits.max(1, keepdims=True))
    prob /= prob.sum(1, keepdims=True)                                     # softmax over every expert
    y = r.copy()
    for i in range(n):
        top = np.argsort(-prob[i])[:cfg.num_experts_per_tok]
        wts = prob[i, top] / prob[i, top].sum()                            # norm_topk_prob
        for e_, w_ in zip(top, wts):
            y[i] += w_ * mlp(L + f"mlp.experts.{e_}.", f[i:i + 1])[0]
    y += _sigmoid(f @ W[L + "mlp.shared_expert_gate.weight"].T) * mlp(L + "mlp.shared_expert.", f)
    return y, _rms(y, W[p + "norm.weight"], eps)


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_module_computes_the_reference_forward(qwen_ckpt, backend):
    raw = load_file(str(qwen_ckpt / "model.safetensors"))
    rng = np.random.default_rng(11)
    n = 7
    toks = rng.integers(0, QWEN.vocab_size, n).astype(np.int32)
    g = rand_hiddens(rng, n, QWEN.hidden_size)
    want_y, want_n = qwen3_next_mtp_rows(raw, QWEN, toks, g)
    check_head_forward(MultiModuleMtpHead.from_pretrained(qwen_ckpt, backend=backend), toks, g, want_y, want_n)


def check_head_forward(prop, toks, g, want_y, want_n) -> None:
    """Module 0's ``forward`` over ``toks`` at keys 0.. (positions 1..) equals the reference."""
    head = prop.modules[0]
    seq = head.alloc_seq()
    y, normed = head.forward([RowJob(seq, toks, 0, 1)], g)
    be = prop.backend
    np.testing.assert_allclose(be.to_host(y), want_y, rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(be.to_host(normed), want_n, rtol=2e-4, atol=2e-4)
    head.free_seq(seq)


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_fp8_release_splits_the_gate_rows_with_their_scales(tmp_path, backend):
    """Qwen3-Next-80B-A3B-Instruct-FP8: block-128 scales (16 at these sizes); the gate rows
    of q_proj leave with their scale blocks."""
    cfg = dataclasses.replace(QWEN, weight_quant="fp8", fp8_block=(16, 16))
    rel = write_synthetic_checkpoint(tmp_path / "rel", cfg, seed=4, pow2_scales=True)
    d = release_config(cfg)
    d["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "weight_block_size": [16, 16]}
    (rel / "config.json").write_text(json.dumps(d))
    assert "mtp.layers.0.self_attn.q_proj.weight_scale_inv" in read_tensors(rel)
    canon = write_synthetic_checkpoint(tmp_path / "canon", dataclasses.replace(cfg, family=""), seed=4,
                                       pow2_scales=True)
    got = run_rounds(rel, backend=backend)
    assert got[0].config.weight_quant == "fp8"
    assert got[1] == run_rounds(canon, backend=backend, chain="postnorm")[1]
