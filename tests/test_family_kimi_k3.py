"""Kimi K3 (mtpkern/models/kimi_k3.py) against an independent float64 model of vLLM's MTP layer.

The checkpoints here are written by this file in the release's form, with no code of
mtpkern's: a ``kimi_k3`` config.json whose ``text_config`` (``model_type`` ``kimi_linear``)
has the release's field names at test sizes, and tensors by the release's names
(``language_model.model.layers.{L}.self_attn.g_proj.weight``,
``...block_sparse_moe.experts.{e}.w1.weight``, ``...routed_expert_norm.weight``, the trunk's
attention-residual tensors, a vision tower's). The release has one MTP layer; the test
checkpoints have two (**synthetic**), so that the per-step layer choice and the chain
between modules show. The model reads those bytes by those names and that config, and
computes, in float64, what these references compute:

- vLLM ``vllm/models/kimi_k3/nvidia/mtp.py``, ``KimiK3MultiTokenPredictorLayer.forward``:
  ``eh_proj(fused_mtp_input(...))`` (``common/mtp.py``: ``[enorm(e) | hnorm(h)]``, the
  embedding zeroed at position 0), the MTP block (``KimiDecoderLayer`` with
  ``attn_res_block_size`` None: ``x + attn(input_layernorm(x))``, then
  ``+ mlp(post_attention_layernorm(.))``), ``shared_head.norm`` fused with the residual:
  the normed sum to the layer's own ``shared_head.head``, the un-normed sum handed on;
  ``KimiK3MultiTokenPredictor.forward``: step ``s`` runs layer ``s % num_nextn_predict_layers``;
- vLLM ``nvidia/mla.py`` ``MultiHeadLatentAttention`` (``use_rope`` False) / transformers
  ``KimiK3GatedMLA.forward``: ``q_b_proj(q_a_layernorm(q_a_proj(x)))``, the latent and the
  shared key dims from ``kv_a_proj_with_mqa`` (not rotated), ``kv_b_proj`` per head
  ``[k_nope | v]``, scale ``(qk_nope + qk_rope) ** -0.5``, ``attn * sigmoid(g_proj(x))``,
  ``o_proj``; ``rms_norm_eps`` for ``q_a`` / ``kv_a_layernorm`` (vLLM's);
- vLLM ``KimiMoE.forward`` / ``latent_moe_runner.py`` / transformers ``KimiK3MoE.forward``:
  DeepSeek-V3's router (sigmoid, the bias for the choice only, groups by their two best,
  renormalised, ``routed_scaling_factor``), the routed experts on
  ``routed_expert_down_proj(x)``, their weighted sum through ``routed_expert_norm`` and
  ``routed_expert_up_proj``, plus the shared experts on ``x``; every MLP
  ``down(situ(gate x) * u')`` with transformers' ``situ_and_mul``: ``beta * tanh(g / beta) *
  sigmoid(g) * linear_beta * tanh(u / linear_beta)``.

mtpkern's proposer (exact KV mode) runs a prompt and multi-draft proposes with partial
acceptances on numpy and cpu (a shorter run on the emulated CUDA kernels); every draft must
be the model's argmax (unless its two best logits lie within float rounding) and every
module's KV rows (the latent ``[c | k_pe]``, ``k_pe`` unrotated) the model's after every
call. Draft mode's first drafts (module 0 complete when nothing is accepted) must be the
model's; three draft steps over the two layers (``module_schedule="cycle"``) too; a dense MTP
layer (``KimiMLP``) too. The release's MXFP4 experts (compressed-tensors) draft as their
dequantized twin on numpy, cpu and the emulated kernels. Negative controls (each must fail
the comparison): the gate off, RoPE on the shared key dims, the post-norm chain, the
position-0 mask off, the latent norm off, the layers in another order.
"""

from __future__ import annotations

import copy
import dataclasses
import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from conftest import record_trace, run_rounds
from mtpkern import ConfigError, MtpConfig, MultiModuleMtpHead, write_synthetic_checkpoint
from mtpkern.tolerance import assert_close
from test_family_deepseek_v4_reference import ReleaseFiles, read_safetensors

# -- config.json as released ------------------------------------------------------------------

#: moonshotai/Kimi-K3's text_config (the fields the MTP layer reads, and the trunk's that every
#: release config carries), with the one MTP layer the release has
K3_TEXT = {
    "model_type": "kimi_linear", "vocab_size": 163840, "hidden_size": 7168, "num_hidden_layers": 93,
    "num_nextn_predict_layers": 1, "num_attention_heads": 96, "num_key_value_heads": 96,
    "intermediate_size": 33792, "hidden_act": "situ", "activation_situ_beta": 4.0,
    "activation_situ_linear_beta": 25.0, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True, "mla_use_output_gate": True,
    "moe_intermediate_size": 3072, "num_experts": 896, "num_experts_per_token": 16, "num_shared_experts": 2,
    "routed_expert_hidden_size": 3584, "latent_moe_use_norm": True, "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid", "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1,
    "topk_method": "noaux_tc", "routed_scaling_factor": 1.0, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "rms_norm_eps": 1e-5, "max_position_embeddings": 1048576, "tie_word_embeddings": False,
    "attn_res_block_size": 12,
    "linear_attn_config": {"kda_layers": [i for i in range(1, 92) if i % 4], "full_attn_layers":
                           [i for i in range(4, 92, 4)] + [92, 93], "head_dim": 128, "num_heads": 96,
                           "short_conv_kernel_size": 4, "use_full_rank_gate": True},
}


def wrapped(text: dict) -> dict:
    """The release's top-level config: the vision-language wrapper around ``text``."""
    return {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
            "text_config": copy.deepcopy(text), "vision_config": {"vt_hidden_size": 32, "vt_num_hidden_layers": 1},
            "media_placeholder_token_id": 163605}


def test_the_release_config_reads_as_the_mtp_block():
    cfg = MtpConfig.from_dict(wrapped(K3_TEXT))
    b = cfg.block(0)
    assert cfg.family == "kimi_k3_text" and cfg.num_modules == 1 and cfg.layer_index(0) == 93
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_shared_experts, cfg.moe_intermediate_size) == \
        (896, 16, 2, 3072)
    assert cfg.shared_intermediate_size == 6144 and cfg.moe_latent_size == 3584 and cfg.moe_latent_norm
    assert (cfg.n_group, cfg.topk_group, cfg.norm_topk_prob, cfg.scoring_func, cfg.router_bias) == \
        (1, 1, True, "sigmoid", True)
    assert (cfg.kv_lora_rank, cfg.q_lora_rank, cfg.qk_rope_head_dim, cfg.head_dim, cfg.v_head_dim) == \
        (512, 1536, 64, 192, 128)
    assert b.mla and b.nope and b.attn_gate == "elementwise" and not np.any(b.inv_freq())
    assert (b.mlp_act, cfg.situ_beta, cfg.situ_linear_beta) == ("situ", 4.0, 25.0)
    assert cfg.embed_mask_pos0 and cfg.rms_norm_eps == 1e-5
    assert MtpConfig.from_dict(cfg.to_dict()) == cfg
    text = MtpConfig.from_dict(dict(copy.deepcopy(K3_TEXT), model_type="kimi_k3_text"))   # no wrapper
    assert text == cfg
    assert "Kimi K3" in cfg.describe()


@pytest.mark.parametrize("change, want", [
    ({}, {}),
    ({"activation_situ_beta": None, "activation_situ_linear_beta": None},     # vLLM: beta or 1.0, no linear
     {"situ_beta": 1.0, "situ_linear_beta": 0.0}),
    ({"hidden_act": "silu"}, {"mlp_act": "swiglu"}),
    ({"mla_use_output_gate": False}, {"attn_gate": ""}),
    ({"use_grouped_topk": False, "num_expert_group": 8, "topk_group": 4}, {"n_group": 1, "topk_group": 1}),
    ({"latent_moe_use_norm": False}, {"moe_latent_norm": False}),
    ({"routed_expert_hidden_size": None}, {"moe_latent_size": 0, "moe_latent_norm": False}),
    ({"topk_method": "quantile_balancing"}, {}),
    ({"moe_layer_freq": 2, "num_hidden_layers": 92}, {}),                    # layer 92: a MoE layer
    ({"moe_layer_freq": 2}, {"n_routed_experts": 0}),                        # layer 93: dense
    ({"head_dim": 128}, {"head_dim": 192}),                                  # KimiLinearConfig's: the KDA heads'
    ({"rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                       "mscale": 1.0, "mscale_all_dim": 1.0}}, {"rope_scaling": None}),   # no RoPE, no YaRN factor
])
def test_release_variants_read_as_vllm_builds_them(change, want):
    text = {k: v for k, v in dict(copy.deepcopy(K3_TEXT), **change).items() if v is not None}
    cfg = MtpConfig.from_dict(wrapped(text))
    for name, value in want.items():
        got = cfg.block(0).mlp_act if name == "mlp_act" else cfg.block(0).attn_gate if name == "attn_gate" \
            else getattr(cfg, name)
        assert got == value, name
    assert MtpConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("change, field", [
    ({"mla_use_nope": False}, "mla_use_nope"),
    ({"mla_use_rope": True}, "mla_use_rope"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"moe_layer_freq": 2, "num_nextn_predict_layers": 2}, "moe_layer_freq"),   # layers 93, 94: dense, MoE
    ({"topk_method": "greedy"}, "topk_method"),
    ({"num_nextn_predict_layers": 0}, "num_nextn_predict_layers"),
    ({"kv_lora_rank": None}, "kv_lora_rank"),                                 # the MTP attention is MLA
    ({"v_head_dim": None}, "v_head_dim"),
])
def test_what_mtpkern_lacks_is_refused_by_name(change, field):
    text = {k: v for k, v in dict(copy.deepcopy(K3_TEXT), **change).items() if v is not None}
    with pytest.raises(ConfigError, match=field):
        MtpConfig.from_dict(wrapped(text))


def test_another_text_model_type_is_refused():
    with pytest.raises(ConfigError, match="text_config.model_type expected 'kimi_k3_text' or 'kimi_linear'"):
        MtpConfig.from_dict(wrapped(dict(copy.deepcopy(K3_TEXT), model_type="deepseek_v3")))


# -- a release-form checkpoint at test size ----------------------------------------------------

#: K3's text config at test size: 3 trunk layers, TWO MTP layers (synthetic: the release has
#: one), 4 heads of MLA (Qr 24, L 32, P 16 + R 8, Dv 12), 8 experts top-2 in 4 groups (top 2 of
#: them) on a latent of 32, 2 shared experts of 32; SiTU betas small enough to saturate
TINY = dict(
    K3_TEXT, vocab_size=301, hidden_size=64, num_hidden_layers=3, num_nextn_predict_layers=2,
    num_attention_heads=4, num_key_value_heads=4, intermediate_size=96, activation_situ_beta=1.5,
    activation_situ_linear_beta=2.0, q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
    v_head_dim=12, moe_intermediate_size=32, num_experts=8, num_experts_per_token=2, num_shared_experts=2,
    routed_expert_hidden_size=32, num_expert_group=4, topk_group=2, routed_scaling_factor=2.5,
    max_position_embeddings=4096, attn_res_block_size=2,
    linear_attn_config={"kda_layers": [1, 2], "full_attn_layers": [3], "head_dim": 16, "num_heads": 4,
                        "short_conv_kernel_size": 4, "use_full_rank_gate": True})

#: the release's compressed-tensors config (in text_config, as released): the routed experts
#: MXFP4, everything the ignore patterns name (and the latent projections, the router) dense
MXFP4_CONFIG = {
    "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {"format": "mxfp4-pack-quantized", "targets": ["Linear"], "weights": {
        "num_bits": 4, "type": "float", "strategy": "group", "group_size": 32, "symmetric": True,
        "dynamic": False, "scale_dtype": "torch.uint8"}}},
    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
               "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
}

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
PRE = "language_model.model."


def _mxfp4(rng, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """An expert weight on the MXFP4 grid: (its FP32 values, the packed codes [rows, cols / 2]
    (column 2j in byte j's low nibble), the E8M0 scale codes [rows, cols / 32] (2^(code - 127)))."""
    codes = rng.integers(0, 16, (rows, cols))
    scale = rng.integers(127 - 5, 127 - 2, (rows, cols // 32))           # 2^-5 .. 2^-3: rms ~ 1 / sqrt(32)
    w = E2M1[codes] * np.repeat(2.0 ** (scale - 127.0), 32, axis=1)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return w.astype(np.float32), packed, scale.astype(np.uint8)


def release_tensors(c: dict, seed: int) -> tuple[dict, dict]:
    """The release's tensors for text config ``c``: (dense FP32 by name, the MXFP4 form of the
    routed experts: ``X.weight_packed`` / ``X.weight_scale`` for each ``X.weight``)."""
    rng = np.random.default_rng(seed)
    H, V, Hq = c["hidden_size"], c["vocab_size"], c["num_attention_heads"]
    Qr, L, P, R, Dv = c["q_lora_rank"], c["kv_lora_rank"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    E, I, Lt = c.get("num_experts"), c["moe_intermediate_size"], c["routed_expert_hidden_size"]
    Is = I * c["num_shared_experts"]
    t, fp4 = {}, {}

    def lin(name, rows, cols):
        t[name] = (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm(name, n):
        t[name] = (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    t[PRE + "embed_tokens.weight"] = rng.standard_normal((V, H)).astype(np.float32)
    norm(PRE + "norm.weight", H)
    lin("language_model.lm_head.weight", V, H)
    lin(PRE + "layers.0.self_attn.q_proj.weight", 16, H)               # a trunk (KDA) layer's: not read
    lin("vision_tower.encoder.blocks.0.wqkv.weight", 8, 8)             # the vision tower's: not read
    for k in range(c["num_nextn_predict_layers"]):
        p = f"{PRE}layers.{c['num_hidden_layers'] + k}."
        for n in ("enorm", "hnorm", "input_layernorm", "post_attention_layernorm", "shared_head.norm",
                  "self_attention_res_norm", "mlp_res_norm"):
            norm(p + n + ".weight", H)
        lin(p + "self_attention_res_proj.weight", 1, H)                 # the trunk's attention residuals
        lin(p + "mlp_res_proj.weight", 1, H)
        lin(p + "eh_proj.weight", H, 2 * H)
        a = p + "self_attn."
        lin(a + "q_a_proj.weight", Qr, H)
        norm(a + "q_a_layernorm.weight", Qr)
        lin(a + "q_b_proj.weight", Hq * (P + R), Qr)
        lin(a + "kv_a_proj_with_mqa.weight", L + R, H)
        norm(a + "kv_a_layernorm.weight", L)
        lin(a + "kv_b_proj.weight", Hq * (P + Dv), L)
        lin(a + "g_proj.weight", Hq * Dv, H)
        lin(a + "o_proj.weight", H, Hq * Dv)
        if not c.get("num_experts"):                                    # a dense MTP layer: KimiMLP
            lin(p + "mlp.gate_proj.weight", c["intermediate_size"], H)
            lin(p + "mlp.up_proj.weight", c["intermediate_size"], H)
            lin(p + "mlp.down_proj.weight", H, c["intermediate_size"])
            lin(p + "shared_head.head.weight", V, H)
            continue
        mo = p + "block_sparse_moe."
        lin(mo + "gate.weight", E, H)
        t[mo + "gate.e_score_correction_bias"] = (0.1 * rng.standard_normal(E)).astype(np.float32)
        for e in range(E):
            for w, (rows, cols) in (("w1", (I, Lt)), ("w3", (I, Lt)), ("w2", (Lt, I))):
                name = f"{mo}experts.{e}.{w}."
                t[name + "weight"], fp4[name + "weight_packed"], fp4[name + "weight_scale"] = _mxfp4(rng, rows, cols)
        lin(mo + "shared_experts.gate_proj.weight", Is, H)
        lin(mo + "shared_experts.up_proj.weight", Is, H)
        lin(mo + "shared_experts.down_proj.weight", H, Is)
        lin(mo + "routed_expert_down_proj.weight", Lt, H)
        lin(mo + "routed_expert_up_proj.weight", H, Lt)
        norm(mo + "routed_expert_norm.weight", Lt)
        lin(p + "shared_head.head.weight", V, H)
    return t, fp4


def write_release(path, c: dict, seed: int = 17, mxfp4: bool = False):
    """A checkpoint in the release's form for text config ``c``: dense FP32, or the routed
    experts in MXFP4 (compressed-tensors, its quantization_config in ``text_config``)."""
    path.mkdir(parents=True, exist_ok=True)
    t, fp4 = release_tensors(c, seed)
    text = copy.deepcopy(c)
    if mxfp4:
        t = {k: v for k, v in t.items() if not (".experts." in k and k.endswith(".weight"))} | fp4
        text["quantization_config"] = copy.deepcopy(MXFP4_CONFIG)
    save_file(t, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(wrapped(text)))
    return path


# -- the model --------------------------------------------------------------------------------

def rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def situ(g, u, beta, linear_beta):
    """transformers' ``situ_and_mul``: beta tanh(g / beta) sigmoid(g) u', u' = lb tanh(u / lb)."""
    if linear_beta:
        u = linear_beta * np.tanh(u / linear_beta)
    return beta * np.tanh(g / beta) * sigmoid(g) * u


def rope_pairs(x, pos, theta=10000.0):
    """x [n, h, R] rotated in pairs (2i, 2i + 1) at pos [n] (the negative control's RoPE)."""
    R = x.shape[-1]
    ang = pos[:, None] * theta ** (-np.arange(0, R, 2) / R)[None, :]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    out = x.copy()
    out[..., 0::2] = x[..., 0::2] * c - x[..., 1::2] * s
    out[..., 1::2] = x[..., 1::2] * c + x[..., 0::2] * s
    return out


#: the model with one thing wrong, for the negative controls
WRONG = ("no_gate", "rope", "postnorm", "no_pos0_mask", "no_latent_norm")


class Release(ReleaseFiles):
    """The checkpoint's tensors (by their names) and its config.json, as released."""

    def layer(self, m: int) -> "Layer":
        """The MTP layer that step ``m`` runs (``spec_step_idx % num_nextn_predict_layers``)."""
        return Layer(self, m % self.text["num_nextn_predict_layers"])


class Layer:
    """MTP layer ``k``: ``language_model.model.layers.{num_hidden_layers + k}.``."""

    def __init__(self, rel: Release, k: int):
        c = rel.text
        p = f"{PRE}layers.{c['num_hidden_layers'] + k}."
        self.c = c
        self.W = lambda name: rel.t[p + name].astype(np.float64)
        self.embed = rel.t[PRE + "embed_tokens.weight"].astype(np.float64)
        self.head = self.W("shared_head.head.weight")

    # MultiHeadLatentAttention (use_rope False) / KimiK3GatedMLA
    def mla(self, a, pos, wrong):
        c, W, n = self.c, self.W, len(a)
        eps, Hq, L = c["rms_norm_eps"], c["num_attention_heads"], c["kv_lora_rank"]
        P, R, Dv = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
        qr = rms(a @ W("self_attn.q_a_proj.weight").T, W("self_attn.q_a_layernorm.weight"), eps)
        q = (qr @ W("self_attn.q_b_proj.weight").T).reshape(n, Hq, P + R)
        kv = a @ W("self_attn.kv_a_proj_with_mqa.weight").T                      # [n, L + R]
        cl = rms(kv[:, :L], W("self_attn.kv_a_layernorm.weight"), eps)            # [n, L]
        k_sh, q_sh = kv[:, L:], q[:, :, P:]                                       # the shared key dims: kept
        if wrong == "rope":
            k_sh, q_sh = rope_pairs(k_sh[:, None], pos)[:, 0], rope_pairs(q_sh, pos)
        kvb = W("self_attn.kv_b_proj.weight").reshape(Hq, P + Dv, L)              # per head [k_nope | v]
        k_nope = np.einsum("jl,hpl->jhp", cl, kvb[:, :P])
        v = np.einsum("jl,hdl->jhd", cl, kvb[:, P:])
        s = (np.einsum("ihp,jhp->hij", q[:, :, :P], k_nope) + np.einsum("ihr,jr->hij", q_sh, k_sh)) * (P + R) ** -0.5
        s = np.where(np.tril(np.ones((n, n), bool))[None], s, -np.inf)
        p = np.exp(s - s.max(axis=2, keepdims=True))
        o = np.einsum("hij,jhd->ihd", p / p.sum(axis=2, keepdims=True), v).reshape(n, Hq * Dv)
        if wrong != "no_gate":
            o = o * sigmoid(a @ W("self_attn.g_proj.weight").T)                  # the output gate
        return o @ W("self_attn.o_proj.weight").T, np.concatenate([cl, kv[:, L:]], axis=1)

    # KimiMoE: DeepSeek-V3's router, the latent routed experts, the shared experts
    def moe(self, b, wrong):
        c, W, eps = self.c, self.W, self.c["rms_norm_eps"]
        beta, lb = c["activation_situ_beta"], c["activation_situ_linear_beta"]

        def mlp(x, gate, up, down):
            return situ(x @ W(gate).T, x @ W(up).T, beta, lb) @ W(down).T

        mo = "block_sparse_moe."
        E, k, G, TG = c["num_experts"], c["num_experts_per_token"], c["num_expert_group"], c["topk_group"]
        s = sigmoid(b @ W(mo + "gate.weight").T)                                  # [n, E]
        choice = s + W(mo + "gate.e_score_correction_bias")
        u = b @ W(mo + "routed_expert_down_proj.weight").T                         # [n, Lt]
        routed = np.zeros_like(u)
        for r in range(len(b)):
            grp = np.sort(choice[r].reshape(G, E // G), axis=1)[:, -2:].sum(axis=1)
            ok = np.repeat(np.isin(np.arange(G), np.argsort(-grp, kind="stable")[:TG]), E // G)
            idx = np.argsort(-np.where(ok, choice[r], -np.inf), kind="stable")[:k]
            wt = s[r, idx] / s[r, idx].sum() * c["routed_scaling_factor"]
            for e, we in zip(idx, wt):
                x = f"{mo}experts.{e}."
                routed[r] += we * mlp(u[r:r + 1], x + "w1.weight", x + "w3.weight", x + "w2.weight")[0]
        if wrong != "no_latent_norm":
            routed = rms(routed, W(mo + "routed_expert_norm.weight"), eps)
        shared = mlp(b, mo + "shared_experts.gate_proj.weight", mo + "shared_experts.up_proj.weight",
                     mo + "shared_experts.down_proj.weight")
        return routed @ W(mo + "routed_expert_up_proj.weight").T + shared

    # KimiK3MultiTokenPredictorLayer.forward around the MTP block
    def forward(self, toks, g, m, wrong=None):
        """Rows ``toks`` [n] of step ``m`` (keys 0.., positions m + 1, ...) with hiddens ``g``
        [n, H] -> (the latent KV rows [n, L + R], y [n, H], shared_head.norm(y) [n, H])."""
        W, eps = self.W, self.c["rms_norm_eps"]
        pos = np.arange(len(toks)) + m + 1
        emb = self.embed[toks]
        if wrong != "no_pos0_mask":
            emb = np.where((pos == 1)[:, None], 0.0, emb)       # vLLM's position 0: step 0's key 0 here
        x = np.concatenate([rms(emb, W("enorm.weight"), eps), rms(g, W("hnorm.weight"), eps)], axis=1)
        x = x @ W("eh_proj.weight").T
        o, rows = self.mla(rms(x, W("input_layernorm.weight"), eps), pos, wrong)
        r = x + o
        f = rms(r, W("post_attention_layernorm.weight"), eps)
        if self.c.get("num_experts"):
            y = r + self.moe(f, wrong)
        else:                                                   # KimiMLP of intermediate_size
            c = self.c
            y = r + situ(f @ W("mlp.gate_proj.weight").T, f @ W("mlp.up_proj.weight").T, c["activation_situ_beta"],
                         c["activation_situ_linear_beta"]) @ W("mlp.down_proj.weight").T
        return rows, y, rms(y, W("shared_head.norm.weight"), eps)


def chain(rel: Release, tokens, hiddens, wrong=None, modules=None):
    """Every module's (KV rows, normed): module m holds keys 0 .. min(#h, #t - m - 1) - 1, row
    j from (t_{j+m+1}, module m-1's y at row j) (``postnorm``: its normed output)."""
    g = np.asarray(hiddens, np.float64)
    out = []
    for m in range(rel.text["num_nextn_predict_layers"] if modules is None else modules):
        n = max(0, min(len(g), len(tokens) - m - 1))
        rows, y, normed = rel.layer(m).forward(np.asarray(tokens[m + 1:m + 1 + n]), g[:n], m, wrong)
        out.append((rows, normed))
        g = normed if wrong == "postnorm" else y
    return out


def argmax_or_tie(logits, d, where) -> bool:
    """Whether draft ``d`` is the argmax of ``logits`` (True), or one of two best logits within
    float rounding (False: the case says nothing); raises AssertionError otherwise."""
    best = np.sort(logits)[-2:]
    if best[1] - best[0] < 1e-4 * max(1.0, abs(best[1])):
        assert logits[d] >= best[0], f"{where}: draft {d} is not one of the two best"
        return False
    assert d == int(np.argmax(logits)), f"{where}: draft {d}, the model's {int(np.argmax(logits))}"
    return True


# -- mtpkern's runs, recorded; the model replays them ------------------------------------------------

def record(path, backend, prompt: int = 11, rounds=((3, 1.0), (3, 0.4), (2, 0.0), (3, 1.0), (3, 0.7), (2, 1.0),
                                                    (3, 0.5)),
           seed: int = 5, **kw) -> list:
    """Exact mode: a prompt, then ``rounds`` of (k, share accepted) propose / verify / catch-up;
    after every call the inputs so far and every module's (draft step's) KV rows, and each
    propose's drafts. ``kw``: more arguments of ``from_pretrained`` (``module_schedule``)."""
    prop = MultiModuleMtpHead.from_pretrained(path, backend=backend, kv_mode="exact", block_size=4, num_blocks=96,
                                              prefill_chunk=5, **kw)
    assert prop.chain == "prenorm"
    return record_trace(prop, np.random.default_rng(seed), prompt, rounds)


def replay(rel: Release, trace: list, wrong=None) -> int:
    """Compares a recorded run with the model (``wrong``: one thing changed); raises
    AssertionError at the first difference. Returns the number of drafts compared."""
    checked = 0
    for kind, tokens, hiddens, drafts, kv in trace:
        P = len(tokens) - 1
        want = chain(rel, tokens + (drafts or []), hiddens, wrong, modules=len(kv))
        for m, (got, (rows, _)) in enumerate(zip(kv, want)):
            assert_close(got, rows, "float32", f"{kind} at {len(tokens)} tokens: module {m}'s KV")
        for m, d in enumerate(drafts or []):
            checked += argmax_or_tie(want[m][1][P - 1] @ rel.layer(m).head.T, d, f"P={P}, module {m}")
    return checked


def test_step_s_runs_layer_s_mod_n(release):
    """vLLM's ``KimiK3MultiTokenPredictor`` runs layer ``spec_step_idx % num_nextn_predict_layers``:
    ``module_schedule="cycle"`` with three drafts from the two layers (0, 1, 0) is the model's."""
    trace = record(release[0], "numpy", rounds=((3, 1.0), (3, 0.4), (3, 0.0), (3, 1.0)), module_schedule="cycle",
                   max_drafts=3)
    assert len(trace[0][4]) == 3 and max(len(d or []) for *_, d, _ in trace) == 3
    assert replay(release[1], trace) >= 9
    last = record(release[0], "numpy", rounds=((3, 1.0), (3, 0.4), (3, 0.0), (3, 1.0)), module_schedule="last",
                  max_drafts=3)                                         # (0, 1, 1): not vLLM's order
    with pytest.raises(AssertionError):
        replay(release[1], last)


def draft_mode_firsts(path, backend, prompt: int = 9, rounds: int = 6, seed: int = 3) -> list:
    """Draft mode with nothing accepted (module 0 then holds every key): per propose, the
    tokens t_0..t_P, the hiddens h_0..h_{P-1} and the first draft."""
    prop = MultiModuleMtpHead.from_pretrained(path, backend=backend, kv_mode="draft", block_size=4, num_blocks=64)
    H, V = prop.config.hidden_size, prop.config.vocab_size
    rng = np.random.default_rng(seed)
    st = prop.alloc_state()
    tokens = rng.integers(0, V, prompt).tolist()
    hid = rng.standard_normal((prompt, H)).astype(np.float32)
    prop.prefill_drafter(tokens, hid, st)
    hiddens, out = list(hid), []
    for _ in range(rounds):
        t_P = int(rng.integers(0, V))
        drafts = prop.propose(t_P, hiddens[-1], len(tokens), 2, st)
        tokens.append(t_P)
        out.append((list(tokens), list(hiddens), drafts[0]))
        prop.after_verify(0, st)
        hiddens.append(rng.standard_normal(H).astype(np.float32))
    prop.free_state(st)
    return out


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """(checkpoint dir, Release) of the dense test checkpoint."""
    path = write_release(tmp_path_factory.mktemp("kimi_k3"), TINY)
    return path, Release.read(path)


@pytest.fixture(scope="module")
def traces(release):
    memo = {}

    def get(backend):
        if backend not in memo:
            memo[backend] = record(release[0], backend)
        return memo[backend]

    return get


def test_the_release_layout_is_read_as_the_test_config(release):
    path, rel = release
    prop = MultiModuleMtpHead.from_pretrained(path, backend="numpy")
    cfg, b = prop.config, prop.config.block(0)
    assert cfg.family == "kimi_k3_text" and cfg.num_modules == 2 and cfg.layer_index(1) == 4
    assert b.mla and b.nope and b.attn_gate == "elementwise" and b.mlp_act == "situ"
    assert (cfg.moe_latent_size, cfg.moe_latent_norm, cfg.situ_beta, cfg.situ_linear_beta) == (32, True, 1.5, 2.0)
    assert prop.chain == "prenorm" and cfg.embed_mask_pos0
    assert "language_model.model.layers.3.block_sparse_moe.experts.7.w2.weight" in rel.t
    assert "language_model.model.layers.4.block_sparse_moe.routed_expert_norm.weight" in rel.t
    notes = " ".join(prop.weights.notes)
    assert "self_attention_res_" in notes and "mlp_res_" in notes         # said, not silently dropped


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_exact_drafts_and_kv_equal_the_float64_release_model(release, traces, backend):
    """Every draft the model's argmax, every module's latent KV rows the model's, after every call."""
    assert replay(release[1], traces(backend)) >= 11          # of 14: two best logits may be within rounding


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_draft_mode_first_drafts_equal_the_model(release, backend):
    _, rel = release
    checked = 0
    for tokens, hiddens, d in draft_mode_firsts(release[0], backend):
        (_, normed), = chain(rel, tokens, hiddens, modules=1)
        checked += argmax_or_tie(normed[len(tokens) - 2] @ rel.layer(0).head.T, d, f"P={len(tokens) - 1}")
    assert checked >= 4


@pytest.mark.parametrize("wrong", WRONG)
def test_negative_controls_fail(release, traces, wrong):
    """The model with one thing wrong disagrees with mtpkern's run (drafts or KV rows)."""
    with pytest.raises(AssertionError):
        replay(release[1], traces("numpy"), wrong)


def test_the_mxfp4_experts_draft_as_their_dequantized_twin(tmp_path, release):
    """The release's form: routed experts MXFP4 in compressed-tensors (``weight_packed`` [I, Lt / 2]
    uint8, ``weight_scale`` [I, Lt / 32] E8M0 codes), the rest dense: the same drafts as the
    dense twin (the same weights, dequantized) in both KV modes, on numpy and cpu; the 4-bit
    experts stay packed."""
    ct = write_release(tmp_path / "ct", TINY, mxfp4=True)
    twin = release[0]
    t = read_safetensors(ct / "model.safetensors")
    w1 = "language_model.model.layers.3.block_sparse_moe.experts.0.w1."
    assert t[w1 + "weight_packed"].shape == (32, 16) and t[w1 + "weight_scale"].shape == (32, 1)
    assert w1 + "weight" not in t
    cfg = MtpConfig.from_json(ct / "config.json")
    assert cfg.quant_container == "compressed-tensors" and cfg.quant_formats == ("mxfp4",)
    for backend in ("numpy", "cpu"):
        for mode in ("exact", "draft"):
            assert run_rounds(ct, backend, mode)[1] == run_rounds(twin, backend, mode)[1], (backend, mode)
    packed = MultiModuleMtpHead.from_pretrained(ct, backend="cpu").memory().weights
    assert packed < MultiModuleMtpHead.from_pretrained(twin, backend="cpu").memory().weights


def test_info_names_the_family_and_the_block(release, capsys):
    from mtpkern.cli import main

    assert main(["info", str(release[0])]) == 0
    out = capsys.readouterr().out
    assert "Kimi K3" in out and "MLA" in out and "latent=32 latent-norm" in out
    assert "NoPE (R=8 unrotated)" in out and "elementwise gate (g_proj)" in out and "situ beta=1.5" in out
    assert "self_attention_res_* not read" in out and "mlp_res_* not read" in out
    assert "every tensor the modules read is present" in out


def test_transformers_gate_name_is_read_too(tmp_path, release):
    """transformers names the gate ``output_gate_proj``: a checkpoint so named drafts the same."""
    src = read_safetensors(release[0] / "model.safetensors")
    t = {k.replace(".self_attn.g_proj.", ".self_attn.output_gate_proj."): v for k, v in src.items()}
    assert any(".output_gate_proj." in k for k in t)
    (tmp_path / "hf").mkdir()
    save_file(t, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "hf" / "config.json").write_text((release[0] / "config.json").read_text())
    assert run_rounds(tmp_path / "hf")[1] == run_rounds(release[0])[1]


def test_cuda_drafts_and_kv_equal_the_model(tmp_path, emulator):
    """The emulated CUDA kernels (an FP32 KV), a short exact-mode run of the one-layer release
    form: the model's drafts and KV."""
    from cuda_emu import emu_backend

    text = dict(TINY, num_nextn_predict_layers=1, num_experts=4, num_expert_group=2, topk_group=1)
    path = write_release(tmp_path / "one", text, seed=23)
    rel = Release.read(path)
    trace = record(path, emu_backend.backend("float32"), prompt=6, rounds=((1, 1.0), (1, 0.0), (1, 1.0), (1, 0.0)))
    assert replay(rel, trace) >= 3


def test_mtpkern_s_own_writer_is_the_release_form(tmp_path):
    """``write_synthetic_checkpoint`` with the family set writes what this file's writer does (the
    model reads it by the release's names and agrees with mtpkern's run), and the same weights
    in the canonical layout draft the same tokens (the name map is exact)."""
    cfg = MtpConfig.from_dict(wrapped(TINY))
    path = write_synthetic_checkpoint(tmp_path / "rel", cfg, seed=31, dtype="float32", own_head=True)
    (path / "config.json").write_text(json.dumps(wrapped(TINY)))
    rel = Release.read(path, wrapped(TINY))
    assert replay(rel, record(path, "numpy", prompt=7, rounds=((3, 1.0), (3, 0.4), (2, 0.0)))) >= 4
    canon = write_synthetic_checkpoint(tmp_path / "canon", dataclasses.replace(cfg, family=""), seed=31,
                                       dtype="float32", own_head=True)
    assert "model.layers.3.mlp.experts.0.gate_proj.weight" in read_safetensors(canon / "model.safetensors")
    for mode in ("exact", "draft"):
        assert run_rounds(canon, mode=mode)[1] == run_rounds(path, mode=mode)[1]


def test_a_dense_mtp_layer_drafts_as_the_model(tmp_path):
    """No experts configured (or MTP layers off ``moe_layer_freq``): vLLM's ``KimiMLP`` of
    ``intermediate_size`` with SiTU, under ``mlp.{gate,up,down}_proj``."""
    text = {k: v for k, v in TINY.items() if k != "num_experts"}
    path = write_release(tmp_path / "dense", text, seed=29)
    rel = Release.read(path)
    cfg = MtpConfig.from_json(path / "config.json")
    assert not cfg.block(0).moe and cfg.intermediate_size == 96 and cfg.block(0).mlp_act == "situ"
    for backend in ("numpy", "cpu"):
        assert replay(rel, record(path, backend, prompt=7, rounds=((3, 1.0), (3, 0.4), (2, 0.0)))) >= 4


def test_both_gate_names_are_refused(tmp_path, release):
    """g_proj and transformers' output_gate_proj both present: which one is meant is unknown."""
    from mtpkern import CheckpointError

    src = read_safetensors(release[0] / "model.safetensors")
    g = "language_model.model.layers.3.self_attn."
    (tmp_path / "both").mkdir()
    save_file(dict(src, **{g + "output_gate_proj.weight": src[g + "g_proj.weight"]}),
              str(tmp_path / "both" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "both" / "config.json").write_text((release[0] / "config.json").read_text())
    with pytest.raises(CheckpointError, match="output_gate_proj"):
        MultiModuleMtpHead.from_pretrained(tmp_path / "both", backend="numpy")


def test_cuda_mxfp4_experts_draft_as_their_dequantized_twin(tmp_path, emulator):
    """The release's MXFP4 routed experts (SiTU, on the latent) on the emulated kernels: the
    drafts of the dense twin, in both KV modes."""
    from cuda_emu import emu_backend

    text = dict(TINY, num_nextn_predict_layers=1, num_experts=4, num_expert_group=2, topk_group=1)
    ct = write_release(tmp_path / "ct", text, seed=41, mxfp4=True)
    twin = write_release(tmp_path / "twin", text, seed=41)
    for mode in ("exact", "draft"):
        got = run_rounds(ct, emu_backend.backend("float32"), mode, rounds=3, n=6)[1]
        assert got == run_rounds(twin, emu_backend.backend("float32"), mode, rounds=3, n=6)[1], mode
        assert got == run_rounds(twin, "numpy", mode, rounds=3, n=6)[1], mode
