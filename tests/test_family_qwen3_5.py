"""Qwen3.5 / Qwen3.6 (mtpkern/models/qwen3_5.py): the vision-language release configs read as
the MTP block, and a tiny checkpoint in the release layout (dense; MoE with its experts per
expert as Qwen3.5 stores them, and packed as Qwen3.6 does) computes what transformers'
``qwen3_5`` / ``qwen3_5_moe`` decoder layer under vLLM's ``qwen3_5_mtp.py`` wiring computes, and
drafts and keeps the KV the float64 oracle does.

The module's forward (``qwen3_5_mtp_rows``) mirrors, step by step:
``Qwen3_5MultiTokenPredictor.forward`` (vLLM): ``fc(cat[pre_fc_norm_embedding(e),
pre_fc_norm_hidden(h)])``, ``layers[0]``, ``norm``; ``Qwen3_5DecoderLayer`` /
``Qwen3_5MoeDecoderLayer`` (transformers): zero-centred RMSNorm, ``Qwen3NextAttention`` (q_proj
per head ``[q | gate]``, q/k norm, RoPE on the first quarter of each head, ``sigmoid(gate)``
before ``o_proj``), then ``Qwen3_5MLP`` or ``Qwen3_5MoeSparseMoeBlock`` (softmax top-k
renormalised, ``Qwen3_5MoeExperts``' ``gate_up_proj[e]`` chunked gate then up, the shared expert
behind ``sigmoid(shared_expert_gate)``).
"""

from __future__ import annotations

import copy
import dataclasses
import json

import numpy as np
import pytest
from safetensors.numpy import load_file

import test_oracle
from conftest import rand_hiddens, run_rounds
from mtpkern import ConfigError, MtpConfig, MultiModuleMtpHead, write_synthetic_checkpoint
from mtpkern.config import tiny_config
from mtpkern.testing import reference_weights
from mtpkern.weights import read_tensors
from test_family_qwen3_next import _rms, _sigmoid, check_head_forward, gated_attention_residual

_ROPE = {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "rope_type": "default", "rope_theta": 10000000,
         "partial_rotary_factor": 0.25}
_TARGET = {"attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True, "dtype": "bfloat16",
           "eos_token_id": 248044, "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu",
           "initializer_range": 0.02, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
           "linear_num_key_heads": 16, "linear_value_head_dim": 128, "mamba_ssm_dtype": "float32",
           "max_position_embeddings": 262144, "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False,
           "rms_norm_eps": 1e-6, "use_cache": True, "vocab_size": 248320, "rope_parameters": _ROPE}
_VISION = {"deepstack_visual_indexes": [], "depth": 27, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 1152,
           "in_channels": 3, "intermediate_size": 4304, "model_type": "qwen3_5", "num_heads": 16,
           "num_position_embeddings": 2304, "out_hidden_size": 5120, "patch_size": 16, "spatial_merge_size": 2,
           "temporal_patch_size": 2}
_OUTER = {"image_token_id": 248056, "video_token_id": 248057, "vision_start_token_id": 248053,
          "vision_end_token_id": 248054, "tie_word_embeddings": False, "transformers_version": "4.57.0.dev0"}

#: Qwen3.5-27B (Qwen3.6-27B: the same config classes and fields)
TEXT_27B = dict(_TARGET, model_type="qwen3_5_text", hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                num_attention_heads=24, num_key_value_heads=4, linear_num_value_heads=48,
                layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 16)
RELEASE_27B = dict(_OUTER, architectures=["Qwen3_5ForConditionalGeneration"], model_type="qwen3_5",
                   text_config=TEXT_27B, vision_config=_VISION)
#: Qwen3.5-35B-A3B (Qwen3.6-35B-A3B: the same, its MTP experts packed in the checkpoint)
TEXT_35B = dict(_TARGET, model_type="qwen3_5_moe_text", hidden_size=2048, num_hidden_layers=40,
                num_attention_heads=16, num_key_value_heads=2, linear_num_value_heads=32, num_experts=256,
                num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
                router_aux_loss_coef=0.001, output_router_logits=False,
                layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 10)
RELEASE_35B = dict(_OUTER, architectures=["Qwen3_5MoeForConditionalGeneration"], model_type="qwen3_5_moe",
                   text_config=TEXT_35B, vision_config=dict(_VISION, model_type="qwen3_5_moe", out_hidden_size=2048))


def test_the_release_configs_read_as_the_mtp_block():
    dense = MtpConfig.from_dict(copy.deepcopy(RELEASE_27B))
    assert dense.family == "qwen3_5_text" and dense.num_modules == 1 and not dense.is_moe
    assert (dense.hidden_size, dense.intermediate_size, dense.num_attention_heads, dense.num_key_value_heads,
            dense.head_dim) == (5120, 17408, 24, 4, 256)
    moe = MtpConfig.from_dict(copy.deepcopy(RELEASE_35B))
    assert moe.family == "qwen3_5_moe_text" and moe.is_moe and moe.layer_index(0) == 40
    assert (moe.n_routed_experts, moe.num_experts_per_tok, moe.moe_intermediate_size, moe.n_shared_experts,
            moe.shared_intermediate_size) == (256, 8, 512, 1, 512)
    assert (moe.scoring_func, moe.n_group, moe.routed_scaling_factor, moe.norm_topk_prob) == ("softmax", 1, 1.0, True)
    assert moe.shared_expert_gate and not moe.router_bias
    for cfg in (dense, moe):
        assert cfg.attn_gate == "elementwise" and cfg.use_qk_norm and not cfg.attention_bias
        assert cfg.rotary_dim == 64 and cfg.rope_theta == 1e7 and cfg.rope_scaling is None   # MRoPE on text: RoPE
        assert cfg.rms_norm_eps == 1e-6 and cfg.block(0).gate_size == cfg.num_attention_heads * 256
        assert MtpConfig.from_dict(cfg.to_dict()) == cfg
    assert dense.describe().startswith("Qwen3.5 (dense)") and moe.describe().startswith("Qwen3.5 (MoE)")
    text = dict(copy.deepcopy(TEXT_35B), architectures=["Qwen3_5MoeForCausalLM"])    # the text model alone
    assert MtpConfig.from_dict(text) == moe
    flat = dict(copy.deepcopy(TEXT_27B), **_ROPE)               # an export that flattens rope_parameters
    del flat["rope_parameters"]
    assert MtpConfig.from_dict(flat) == dense


def _with(release: dict, **text) -> dict:
    d = copy.deepcopy(release)
    d["text_config"].update(text)
    return d


@pytest.mark.parametrize("text, match", [
    (dict(mtp_num_hidden_layers=0), r"'mtp_num_hidden_layers' expected an integer >= 1 .*no MTP head\), got int 0"),
    (dict(mtp_num_hidden_layers=True), r"'mtp_num_hidden_layers' expected an integer >= 1"),
    (dict(mtp_num_hidden_layers=1, num_nextn_predict_layers=2), r"'mtp_num_hidden_layers' = 1 disagrees"),
    (dict(mtp_use_dedicated_embeddings=True), r"'mtp_use_dedicated_embeddings' = True is not supported"),
    (dict(attn_output_gate="yes"), r"'attn_output_gate' expected true or false, got string 'yes'"),
    (dict(rope_parameters=dict(_ROPE, mrope_section="11,11,10")), r"rope_parameters.mrope_section expected a list"),
    (dict(rope_parameters=dict(_ROPE, rope_type="linear")), r"rope_type 'linear' is not supported"),
    (dict(model_type="qwen3_5_moe_text"), r"text_config.model_type expected 'qwen3_5_text'"),
    (dict(num_experts=8), r"'num_experts'"),
])
def test_what_the_family_refuses_names_the_field(text, match):
    with pytest.raises(ConfigError, match=match):
        MtpConfig.from_dict(_with(RELEASE_27B, **text))


def test_a_moe_release_refuses_what_its_block_fixes():
    with pytest.raises(ConfigError, match="norm_topk_prob"):
        MtpConfig.from_dict(_with(RELEASE_35B, norm_topk_prob=False))
    with pytest.raises(ConfigError, match="shared_expert_intermediate_size"):
        MtpConfig.from_dict(_with(RELEASE_35B, shared_expert_intermediate_size=1024))


def test_attn_output_gate_false_reads_a_layer_without_the_gate():
    cfg = MtpConfig.from_dict(_with(RELEASE_27B, attn_output_gate=False))
    assert cfg.attn_gate == "" and cfg.block(0).gate_size == 0
    assert MtpConfig.from_dict(cfg.to_dict()) == cfg


# -- tiny checkpoints in the release layout -------------------------------------------------

_BLOCK = dict(num_nextn_predict_layers=1, attention_bias=False, partial_rotary_factor=0.25, rope_theta=1e7,
              rms_norm_eps=1e-6, n_group=1, topk_group=1, routed_scaling_factor=1.0, attn_gate="elementwise",
              router_bias=False)
#: Qwen3.5-27B-shaped, tiny: 24 heads of 256 -> 4 of 16, a dense MLP
DENSE = tiny_config(family="qwen3_5_text", **_BLOCK, n_routed_experts=0, num_experts_per_tok=0, n_shared_experts=0,
                    moe_intermediate_size=0, intermediate_size=96)
#: Qwen3.5-35B-A3B-shaped, tiny: 256 experts -> 8, top-2, one gated shared expert
MOE = tiny_config(family="qwen3_5_moe_text", **_BLOCK, scoring_func="softmax", shared_expert_gate=True)
#: synthetic: two MTP layers (every release has one), to chain through layers.0 and layers.1
MOE2 = dataclasses.replace(MOE, num_nextn_predict_layers=2)


def release_config(cfg: MtpConfig) -> dict:
    """The vision-language config.json a release of ``cfg``'s shape would have (tiny sizes)."""
    moe = cfg.is_moe
    text = dict(copy.deepcopy(TEXT_35B if moe else TEXT_27B), hidden_size=cfg.hidden_size,
                num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
                head_dim=cfg.head_dim, vocab_size=cfg.vocab_size, num_hidden_layers=cfg.num_hidden_layers,
                max_position_embeddings=cfg.max_position_embeddings, mtp_num_hidden_layers=cfg.num_modules,
                layer_types=["linear_attention", "full_attention"])
    if moe:
        text.update(num_experts=cfg.n_routed_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                    moe_intermediate_size=cfg.moe_intermediate_size,
                    shared_expert_intermediate_size=cfg.moe_intermediate_size)
    else:
        text.update(intermediate_size=cfg.intermediate_size)
    return copy.deepcopy(RELEASE_35B if moe else RELEASE_27B) | {"text_config": text}


def _ckpt(path, cfg: MtpConfig, packed: bool = False, seed: int = 7):
    path = write_synthetic_checkpoint(path, cfg, seed=seed, dtype="float32", packed_gate_up=packed)
    (path / "config.json").write_text(json.dumps(release_config(cfg)))
    return path


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """name -> (path, config): dense, MoE per expert (Qwen3.5), MoE packed (Qwen3.6), the same seed."""
    root = tmp_path_factory.mktemp("qwen3_5")
    return {"dense": (_ckpt(root / "dense", DENSE), DENSE), "moe": (_ckpt(root / "moe", MOE), MOE),
            "packed": (_ckpt(root / "packed", MOE, packed=True), MOE)}


def test_the_layout_is_the_release_s(ckpts):
    I, E, H = MOE.moe_intermediate_size, MOE.n_routed_experts, MOE.hidden_size
    common = ("mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight",
              "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.self_attn.q_norm.weight",
              "model.language_model.embed_tokens.weight", "lm_head.weight")
    keys = {name: load_file(str(path / "model.safetensors")) for name, (path, _) in ckpts.items()}
    for name, t in keys.items():
        for k in common:
            assert k in t, (name, k)
        assert not any(k.startswith(("model.layers.", "model.embed_tokens")) for k in t), name
    assert "mtp.layers.0.mlp.gate_proj.weight" in keys["dense"] and "mtp.layers.0.mlp.gate.weight" not in keys["dense"]
    assert keys["moe"]["mtp.layers.0.mlp.experts.7.down_proj.weight"].shape == (H, I)
    assert "mtp.layers.0.mlp.shared_expert_gate.weight" in keys["moe"]
    packed = keys["packed"]
    assert packed["mtp.layers.0.mlp.experts.gate_up_proj"].shape == (E, 2 * I, H)
    assert packed["mtp.layers.0.mlp.experts.down_proj"].shape == (E, H, I)
    assert not any(".experts.0." in k for k in packed)
    per = keys["moe"]                                            # the same values, packed
    for e in (0, 5):
        gu = packed["mtp.layers.0.mlp.experts.gate_up_proj"][e]
        np.testing.assert_array_equal(gu[:I], per[f"mtp.layers.0.mlp.experts.{e}.gate_proj.weight"])
        np.testing.assert_array_equal(gu[I:], per[f"mtp.layers.0.mlp.experts.{e}.up_proj.weight"])
        np.testing.assert_array_equal(packed["mtp.layers.0.mlp.experts.down_proj"][e],
                                      per[f"mtp.layers.0.mlp.experts.{e}.down_proj.weight"])


# -- the module's math from the raw release tensors ------------------------------------------

def qwen3_5_mtp_rows(raw: dict, cfg: MtpConfig, toks, g, fc_order: str = "embed_hidden"):
    """One MTP layer over n causal rows from a fresh KV (positions 1..n), in float64 from the
    tensors as released -> (y, norm(y)). ``fc_order`` "hidden_embed" swaps fc's input halves
    (a negative control: vLLM concatenates ``[embedding, hidden]``)."""
    W = {k: np.asarray(v, np.float64) for k, v in raw.items()}
    p, L = "mtp.", "mtp.layers.0."
    eps = cfg.rms_norm_eps
    n = len(toks)
    e = _rms(W["model.language_model.embed_tokens.weight"][toks], W[p + "pre_fc_norm_embedding.weight"], eps)
    h = _rms(np.asarray(g, np.float64), W[p + "pre_fc_norm_hidden.weight"], eps)
    x = np.concatenate([e, h] if fc_order == "embed_hidden" else [h, e], 1) @ W[p + "fc.weight"].T
    r = gated_attention_residual(W, L, cfg, x)     # MRoPE with a text row's three equal ids: RoPE at 1..n
    f = _rms(r, W[L + "post_attention_layernorm.weight"], eps)

    def swiglu(x_, w_gate, w_up, w_down):
        gt, up = x_ @ w_gate.T, x_ @ w_up.T
        return (gt * _sigmoid(gt) * up) @ w_down.T

    def mlp(pre):
        return swiglu(f, W[pre + "gate_proj.weight"], W[pre + "up_proj.weight"], W[pre + "down_proj.weight"])

    if not cfg.is_moe:                                                     # Qwen3_5MLP
        y = r + mlp(L + "mlp.")
        return y, _rms(y, W[p + "norm.weight"], eps)
    I = cfg.moe_intermediate_size
    if L + "mlp.experts.gate_up_proj" in W:                                # Qwen3_5MoeExperts: [E, 2I, H]
        gu, dn = W[L + "mlp.experts.gate_up_proj"], W[L + "mlp.experts.down_proj"]
        expert = [(gu[e_, :I], gu[e_, I:], dn[e_]) for e_ in range(cfg.n_routed_experts)]   # chunk(2): gate, up
    else:
        expert = [tuple(W[L + f"mlp.experts.{e_}.{n_}_proj.weight"] for n_ in ("gate", "up", "down"))
                  for e_ in range(cfg.n_routed_experts)]
    logits = f @ W[L + "mlp.gate.weight"].T
    prob = np.exp(logits - logits.max(1, keepdims=True))
    prob /= prob.sum(1, keepdims=True)                                     # softmax over every expert
    y = r.copy()
    for i in range(n):
        top = np.argsort(-prob[i])[:cfg.num_experts_per_tok]
        for e_, w_ in zip(top, prob[i, top] / prob[i, top].sum()):        # top-k renormalised
            y[i] += w_ * swiglu(f[i:i + 1], *expert[e_])[0]
    y += _sigmoid(f @ W[L + "mlp.shared_expert_gate.weight"].T) * mlp(L + "mlp.shared_expert.")
    return y, _rms(y, W[p + "norm.weight"], eps)


def _rows(cfg, seed=11, n=7):
    rng = np.random.default_rng(seed)
    return rng.integers(0, cfg.vocab_size, n).astype(np.int32), rand_hiddens(rng, n, cfg.hidden_size)


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
@pytest.mark.parametrize("name", ["dense", "moe", "packed"])
def test_module_computes_the_reference_forward(ckpts, name, backend):
    path, cfg = ckpts[name]
    raw = load_file(str(path / "model.safetensors"))
    toks, g = _rows(cfg)
    want_y, want_n = qwen3_5_mtp_rows(raw, cfg, toks, g)
    check_head_forward(MultiModuleMtpHead.from_pretrained(path, backend=backend), toks, g, want_y, want_n)


def test_negative_control_fc_s_input_order_is_seen(ckpts):
    """fc over [hidden, embedding] instead of vLLM's [embedding, hidden]: the forward differs,
    so the reference test above would fail had the loader swapped the halves."""
    path, cfg = ckpts["moe"]
    raw = load_file(str(path / "model.safetensors"))
    toks, g = _rows(cfg)
    want_y, _ = qwen3_5_mtp_rows(raw, cfg, toks, g, fc_order="hidden_embed")
    prop = MultiModuleMtpHead.from_pretrained(path, backend="numpy")
    with pytest.raises(AssertionError):
        check_head_forward(prop, toks, g, want_y, want_y)


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
@pytest.mark.parametrize("mode", ["exact", "draft"])
def test_packed_experts_draft_as_the_per_expert_ones(ckpts, backend, mode):
    got = run_rounds(ckpts["packed"][0], backend=backend, mode=mode)
    assert got[1] == run_rounds(ckpts["moe"][0], backend=backend, mode=mode)[1]
    assert got[0].chain == "postnorm"                  # vLLM hands on the normed hidden


_ROUNDS = [(3, 1.0), (3, 0.4), (2, 0.0), (3, 1.0)]


def _three_steps(path, backend, **kw):
    """Three drafts from the one MTP layer, layer 0 at every step as vLLM's Qwen3_5MTP runs it
    (``module_schedule="last"``), and the oracle's weights over the same three steps."""
    from mtpkern.schedule import expand

    prop = MultiModuleMtpHead.from_pretrained(path, backend=backend, kv_mode="exact", block_size=4, num_blocks=96,
                                              module_schedule="last", max_drafts=3, **kw)
    w = reference_weights(path)
    return prop, expand(w.config, w, prop.module_schedule)[1]


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
@pytest.mark.parametrize("name", ["dense", "packed"])
def test_drafts_and_kv_equal_the_oracle(ckpts, name, backend):
    prop, weights = _three_steps(ckpts[name][0], backend, prefill_chunk=7)
    assert prop.chain == "postnorm" and prop.module_schedule == [0, 0, 0]
    test_oracle.run_scenario(prop, prop.config, weights, 5, 20, _ROUNDS, "postnorm", None)


def test_negative_control_a_prenorm_chain_is_seen(ckpts):
    """The oracle chaining the pre-norm hidden (DeepSeek-V3's way) disagrees with the drafts:
    the postnorm chain is a property the scenario test checks."""
    prop, weights = _three_steps(ckpts["packed"][0], "numpy")
    with pytest.raises(AssertionError):
        test_oracle.run_scenario(prop, prop.config, weights, 5, 20, _ROUNDS, "prenorm", None)


def test_synthetic_two_layer_config_chains_through_both_layers(tmp_path):
    """Synthetic (every release has mtp_num_hidden_layers 1): two MTP layers share fc, the
    pre-fc norms and norm; mtpkern runs layers.m as its module m (vLLM's Qwen3_5MultiTokenPredictor
    indexes layers[spec_step_idx % n]; docs/hf_reference.md)."""
    path = _ckpt(tmp_path / "two", MOE2, packed=True, seed=3)
    keys = set(load_file(str(path / "model.safetensors")))
    assert {"mtp.layers.0.mlp.experts.gate_up_proj", "mtp.layers.1.mlp.experts.gate_up_proj"} <= keys
    assert not any(k.startswith("mtp.layers.2.") for k in keys)
    prop = MultiModuleMtpHead.from_pretrained(path, backend="numpy", kv_mode="exact", block_size=4, num_blocks=96)
    assert prop.config.num_modules == 2
    test_oracle.run_scenario(prop, prop.config, reference_weights(path), 6, 12, _ROUNDS, "postnorm", None)


def test_a_checkpoint_with_both_expert_layouts_is_refused(tmp_path, ckpts):
    """Per-expert tensors beside the packed pair: the per-expert ones would not be read."""
    from safetensors.numpy import save_file

    from mtpkern.errors import CheckpointError
    path = tmp_path / "both"
    path.mkdir()
    t = load_file(str(ckpts["packed"][0] / "model.safetensors"))
    t["mtp.layers.0.mlp.experts.0.gate_proj.weight"] = load_file(
        str(ckpts["moe"][0] / "model.safetensors"))["mtp.layers.0.mlp.experts.0.gate_proj.weight"]
    save_file(t, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(release_config(MOE)))
    with pytest.raises(CheckpointError, match=r"mtp.layers.0.mlp.experts.0.gate_proj.weight.*would not be used"):
        MultiModuleMtpHead.from_pretrained(path, backend="numpy")


def test_a_packed_tensor_of_the_wrong_shape_is_refused(tmp_path, ckpts):
    from safetensors.numpy import save_file

    from mtpkern.errors import CheckpointError
    path = tmp_path / "bad"
    path.mkdir()
    t = load_file(str(ckpts["packed"][0] / "model.safetensors"))
    down = t["mtp.layers.0.mlp.experts.down_proj"]
    t["mtp.layers.0.mlp.experts.down_proj"] = np.ascontiguousarray(down.transpose(0, 2, 1))   # [E, I, H]
    save_file(t, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(release_config(MOE)))
    E, I, H = MOE.n_routed_experts, MOE.moe_intermediate_size, MOE.hidden_size
    with pytest.raises(CheckpointError, match=rf"down_proj.*expected shape \[{E}, {H}, {I}\].*got \[{E}, {I}, {H}\]"):
        MultiModuleMtpHead.from_pretrained(path, backend="numpy")


@pytest.mark.parametrize("experts", ["ep", "tp"])
def test_packed_experts_shard_as_the_whole(ckpts, experts):
    """A sharded head reads its experts' range (ep) or each expert's slice of I (tp: the gate
    rows and the up rows cut out of gate_up_proj) of the packed pair: the whole module's parts."""
    from mtpkern.backends import get_backend
    from mtpkern.shard import Shard
    from mtpkern.weights import load_weights

    path, cfg = ckpts["packed"]
    be = get_backend("numpy")
    whole = load_weights(path, cfg, be).modules[0]
    E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
    for r in range(2):
        part = load_weights(path, cfg, be, shard=Shard(r, 2, experts)).modules[0]
        if experts == "ep":
            e0, e1 = E // 2 * r, E // 2 * (r + 1)
            want13, want2 = whole.experts_w13[e0:e1], whole.experts_w2[e0:e1]
        else:
            i0, i1 = I // 2 * r, I // 2 * (r + 1)
            want13 = np.concatenate([whole.experts_w13[:, i0:i1], whole.experts_w13[:, I + i0:I + i1]], axis=1)
            want2 = whole.experts_w2[:, :, i0:i1]
        np.testing.assert_array_equal(part.experts_w13, want13)
        np.testing.assert_array_equal(part.experts_w2, want2)


def test_info_names_the_family_and_the_layout(ckpts, capsys):
    from mtpkern.cli import main

    for name, title in (("dense", "Qwen3.5 (dense)"), ("packed", "Qwen3.5 (MoE)")):
        path, _ = ckpts[name]
        assert main(["info", str(path)]) == 0
        out = capsys.readouterr().out
        assert title in out and "module 0: mtp.*" in out and "postnorm chain" in out, out
        assert "zero-centred norms (folded)" in out and "q_proj gate rows per head (regrouped)" in out
        if name == "packed":
            assert "routed experts packed (gate_up_proj [E, 2I, H], down_proj [E, H, I])" in out, out


@pytest.fixture
def emulator():
    """The CUDA emulator (tests/cuda_emu); skipped where it cannot be built."""
    from cuda_emu import emu_backend
    yield from emu_backend.installed_emulator()


def test_cuda_drafts_and_kv_equal_the_oracle(ckpts, emulator):
    """The packed MoE checkpoint on the kernels (the emulator, an FP32 KV)."""
    from cuda_emu import emu_backend
    prop, weights = _three_steps(ckpts["packed"][0], emu_backend.backend("float32"), prefill_chunk=7,
                                 cuda_graphs=False)      # the emulator launches kernels; it captures no graphs
    test_oracle.run_scenario(prop, prop.config, weights, 5, 12, _ROUNDS[:2], "postnorm", None)


# -- FP8 packed experts (transformers' fine-grained FP8 names) ---------------------------------

#: Qwen3.6-MoE-shaped with FP8 projections in blocks of 16 x 16
MOE_FP8 = dataclasses.replace(MOE, weight_quant="fp8", fp8_block=(16, 16))


@pytest.fixture(scope="module")
def fp8_ckpts(tmp_path_factory):
    """The same FP8 weights with the routed experts packed (``gate_up_proj`` / ``down_proj`` and
    their ``_scale_inv`` [E, rows / 16, cols / 16]) and one tensor per expert."""
    root = tmp_path_factory.mktemp("qwen3_5_fp8")
    return {p: write_synthetic_checkpoint(root / p, MOE_FP8, seed=5, dtype="float32", pow2_scales=True,
                                          packed_gate_up=p == "packed") for p in ("packed", "per_expert")}


def test_fp8_packed_experts_layout(fp8_ckpts):
    import ml_dtypes

    t = read_tensors(fp8_ckpts["packed"])
    E, I, H = MOE.n_routed_experts, MOE.moe_intermediate_size, MOE.hidden_size
    pre = "mtp.layers.0.mlp.experts."
    assert t[pre + "gate_up_proj"].dtype == np.dtype(ml_dtypes.float8_e4m3fn) and t[pre + "gate_up_proj"].shape == (E, 2 * I, H)
    assert t[pre + "gate_up_proj_scale_inv"].shape == (E, 2 * I // 16, H // 16)
    assert t[pre + "down_proj_scale_inv"].shape == (E, H // 16, I // 16)
    assert not any(k.startswith(pre + "0.") for k in t)


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
@pytest.mark.parametrize("mode", ["exact", "draft"])
def test_fp8_packed_experts_draft_as_the_per_expert_ones(fp8_ckpts, backend, mode):
    """Packed FP8 experts (codes and block scales as stored, gate scale rows over up's) draft as
    the same FP8 weights stored one tensor per expert, read in as many bytes."""
    from mtpkern.backends import get_backend
    from mtpkern.weights import load_weights

    got = run_rounds(fp8_ckpts["packed"], backend=backend, mode=mode)[1]
    assert got == run_rounds(fp8_ckpts["per_expert"], backend=backend, mode=mode)[1]
    if backend == "numpy":               # the bytes read: the FP8 codes and scales, as per expert
        be = get_backend("numpy")
        packed, per = (load_weights(fp8_ckpts[p], MOE_FP8, be) for p in ("packed", "per_expert"))
        assert packed.nbytes == per.nbytes
        assert isinstance(packed.modules[0].experts_w13, np.ndarray)        # (the reference dequantizes)


def test_fp8_packed_experts_without_their_scales_are_refused(tmp_path, fp8_ckpts):
    from safetensors.numpy import save_file

    from mtpkern.errors import CheckpointError

    t = read_tensors(fp8_ckpts["packed"])
    del t["mtp.layers.0.mlp.experts.down_proj_scale_inv"]
    path = tmp_path / "noscale"
    path.mkdir()
    save_file(t, str(path / "model.safetensors"))
    (path / "config.json").write_text((fp8_ckpts["packed"] / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"down_proj_scale_inv.*missing"):
        MultiModuleMtpHead.from_pretrained(path, backend="numpy")


@pytest.mark.parametrize("experts", ["ep", "tp"])
def test_fp8_packed_experts_shard_as_the_whole(fp8_ckpts, experts):
    """A sharded head's packed FP8 experts are its range / slices of the whole, scales with them."""
    from mtpkern.backends import get_backend
    from mtpkern.shard import Shard
    from mtpkern.weights import load_weights

    be = get_backend("numpy")
    whole = load_weights(fp8_ckpts["packed"], MOE_FP8, be).modules[0]
    w13, w2 = whole.experts_w13, whole.experts_w2         # dequantized by the reference backend
    E, I = MOE.n_routed_experts, MOE.moe_intermediate_size
    for r in range(2):
        part = load_weights(fp8_ckpts["packed"], MOE_FP8, be, shard=Shard(r, 2, experts)).modules[0]
        if experts == "ep":
            e0, e1 = E // 2 * r, E // 2 * (r + 1)
            want13, want2 = w13[e0:e1], w2[e0:e1]
        else:
            i0, i1 = I // 2 * r, I // 2 * (r + 1)
            want13 = np.concatenate([w13[:, i0:i1], w13[:, I + i0:I + i1]], axis=1)
            want2 = w2[:, :, i0:i1]
        np.testing.assert_array_equal(part.experts_w13, want13)
        np.testing.assert_array_equal(part.experts_w2, want2)
