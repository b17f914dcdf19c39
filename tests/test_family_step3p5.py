"""Step-3.5-Flash (mtpkern/models/step3p5.py): the release layout loads unchanged and
computes what vLLM's ``step3p5_mtp.py`` computes.

Its config describes every layer in per-layer lists; the three MTP modules read
theirs at ``num_hidden_layers + m``: sliding-window attention with the other head
count of ``attention_other_setting``, RoPE per layer, SwiGLU clamps per layer, dense
blocks in a MoE model. The block adds a head-wise sigmoid gate (``g_proj``) and
zero-centred norms; each module has its own LM head under ``transformer.shared_head``.

transformers' form of the same model (``Step3p7Config`` / ``Step3p7TextConfig`` as its
``save_pretrained`` writes them, the MTP norm as its MTP loader names it) reads into the
same config; tests/test_hf_step3p5.py runs transformers itself on it.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from conftest import rand_hiddens, run_rounds
from mtpkern import CheckpointError, ConfigError, MtpConfig, MultiModuleMtpHead, write_synthetic_checkpoint
from mtpkern.head import RowJob
from mtpkern.testing import reference_weights
from mtpkern.weights import synthetic_tensors

L, M = 1, 3          # the release: 45 layers; here one, so that layers 1, 2, 3 are the MTP modules (all sliding)


def release_config(layers: int = L, types: list[str] | None = None, **over) -> dict:
    """config.json as Step-3.5-Flash releases it (its fields, tiny sizes): per-layer lists of
    layers + 3 entries, full attention every fourth layer, 8 heads of 16 on sliding layers
    (4 on full ones), 2 KV groups."""
    n = layers + M
    types = types or ["full_attention" if i % 4 == 0 else "sliding_attention" for i in range(n)]
    d = {
        "architectures": ["Step3p5ForCausalLM"], "model_type": "step3p5",
        "auto_map": {"AutoConfig": "configuration_step3p5.Step3p5Config",
                     "AutoModelForCausalLM": "modeling_step3p5.Step3p5ForCausalLM"},
        "hidden_size": 64, "intermediate_size": 40, "num_hidden_layers": layers, "num_nextn_predict_layers": M,
        "num_attention_heads": 4, "num_attention_groups": 2, "head_dim": 16,
        "attention_other_setting": {"attention_type": "sliding_attention", "num_attention_heads": 8,
                                    "num_attention_groups": 2, "head_dim": 16, "true_head_dim": 16},
        "layer_types": types, "sliding_window": 6,
        "rope_theta": [5e6 if t == "full_attention" else 1e4 for t in types],
        "partial_rotary_factors": [0.5 if t == "full_attention" else 1.0 for t in types],
        "rope_scaling": {"rope_type": "llama3", "factor": 2.0, "low_freq_factor": 1.0, "high_freq_factor": 32.0,
                         "original_max_position_embeddings": 2048},
        "yarn_only_types": ["full_attention"],
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "vocab_size": 301,
        "use_head_wise_attn_gate": True, "use_qk_norm": True, "zero_centered": True, "att_impl_type": "GQA",
        "use_moe": True, "moe_layers_enum": ",".join(str(i) for i in range(1, layers)) or "0",
        "moe_num_experts": 8, "moe_top_k": 2, "moe_intermediate_size": 32, "share_expert_dim": 32,
        "moe_router_activation": "sigmoid", "use_moe_router_bias": True, "need_fp32_gate": True,
        "norm_expert_weight": True, "moe_router_scaling_factor": 3.0, "moe_every_n_layer": 1, "moe_layer_offset": 0,
        "swiglu_limits": [0.0] * n, "swiglu_limits_shared": [0.0] * n, "use_rope_layers": [], "sink": False,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": [1, 2],
        "max_seq_len": 4096,
    }
    d.update(over)
    return d


def _ckpt(path, d: dict, seed: int = 7):
    """A synthetic checkpoint in the release layout with config ``d`` (each module its own head)."""
    cfg = MtpConfig.from_dict(d)
    path = write_synthetic_checkpoint(path, cfg, seed=seed, dtype="float32", own_head=True)
    (path / "config.json").write_text(json.dumps(d))
    return path


@pytest.fixture(scope="module")
def step_ckpt(tmp_path_factory):
    return _ckpt(tmp_path_factory.mktemp("step3p5"), release_config())


# -- the config -----------------------------------------------------------------------------

def test_per_layer_lists_become_the_modules_blocks():
    cfg = MtpConfig.from_dict(release_config())
    assert cfg.family == "step3p5" and cfg.num_modules == 3 and cfg.n_routed_experts == 8
    for m in range(3):
        b = cfg.block(m)
        assert (b.num_attention_heads, b.num_key_value_heads, b.head_dim) == (8, 2, 16)
        assert (b.sliding_window, b.rope_theta, b.rotary_dim, b.attn_gate, b.moe) == (6, 1e4, 16, "headwise", False)
    assert cfg.routed_scaling_factor == 3.0 and cfg.describe().startswith("Step-3.5-Flash")
    assert MtpConfig.from_dict(cfg.to_dict()) == cfg


def test_a_full_attention_module_reads_its_own_entries():
    types = ["full_attention", "sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
    d = release_config(layers=2, types=types, swiglu_limits=[0, 0, 0, 7.0, 0], swiglu_limits_shared=[0, 0, 0, 16.0, 0],
                       moe_layers_enum="1,3")
    del d["rope_scaling"]
    cfg = MtpConfig.from_dict(d)
    full, sliding, last = (cfg.block(m) for m in range(3))
    assert (full.num_attention_heads, full.sliding_window, full.rope_theta, full.rotary_dim) == (4, 0, 5e6, 8)
    assert (sliding.num_attention_heads, sliding.sliding_window, sliding.moe) == (8, 6, True)
    assert (sliding.swiglu_clamp, sliding.swiglu_clamp_shared) == (7.0, 16.0)
    assert not full.moe and not last.moe and last.swiglu_clamp == 0.0


@pytest.mark.parametrize("edit,match", [
    (dict(types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]),
     r"MTP module 0 \(layer 1\) is full_attention with a scaled RoPE"),
    (dict(layer_types=["full_attention"] * 3), r"'layer_types' expected a list of 4 entries .* got 3 entries"),
    (dict(types=["full_attention", "linear_attention", "sliding_attention", "sliding_attention"]),
     r"layer_types\[1\] \(MTP module 0\) expected one of"),
    (dict(use_rope_layers=[1]), r"'use_rope_layers' = \[1\] is not supported"),
    (dict(zero_centered=False), r"'zero_centered' = False, but every Step-3.5-Flash module has zero_centered = True"),
    (dict(sink=True), r"'sink' = True, but every Step-3.5-Flash module has sink = False"),
    (dict(moe_layers_enum="3,x"), r"'moe_layers_enum' expected layer indices"),
])
def test_release_configs_it_cannot_read_are_refused(edit, match):
    types = edit.pop("types", None)
    with pytest.raises(ConfigError, match=match):
        MtpConfig.from_dict(release_config(types=types, **edit))


# -- transformers' form of the config (Step3p7TextConfig, 5.16+) ----------------------------------

F, S = "full_attention", "sliding_attention"


def tf_config(wrap: bool = True, **over) -> dict:
    """config.json as transformers 5.24's ``save_pretrained`` writes a ``Step3p7ForConditionalGeneration``
    (field for field as it wrote one, tiny sizes): the text model under ``text_config``, its
    per-layer lists trimmed to the 3 target layers, the MTP layers' types split off into
    ``mtp_layer_types`` / ``mtp_mlp_layer_types``, RoPE per layer type, the sliding heads as
    ``num_sliding_attention_heads`` (``per_layer_config``: the target's layers only). The same
    model as ``release_config(3, RELEASE_TYPES)``. ``wrap=False``: the text config alone."""
    text = {
        "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": [1, 2], "head_dim": 16,
        "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 40,
        "layer_types": [F, S, S], "max_position_embeddings": 4096, "mlp_bias": False,
        "mlp_layer_types": ["dense", "sparse", "sparse"], "model_type": "step3p5", "moe_intermediate_size": 32,
        "moe_router_scaling_factor": 3.0, "mtp_layer_types": [S, S, S], "mtp_mlp_layer_types": ["dense"] * 3,
        "n_routed_experts": 8, "num_attention_heads": 4, "num_experts_per_tok": 2, "num_hidden_layers": 3,
        "num_key_value_heads": 2, "num_nextn_predict_layers": 3, "num_sliding_attention_heads": 8,
        "output_router_logits": False, "pad_token_id": 1,
        "per_layer_config": {"1": {"num_attention_heads": 8}, "2": {"num_attention_heads": 8}},
        "query_pre_attn_scalar": 16, "rms_norm_eps": 1e-05,
        "rope_parameters": {
            F: {"factor": 2.0, "high_freq_factor": 32.0, "low_freq_factor": 1.0,
                "original_max_position_embeddings": 2048, "partial_rotary_factor": 0.5, "rope_theta": 5e6,
                "rope_type": "llama3"},
            S: {"partial_rotary_factor": 1.0, "rope_theta": 1e4, "rope_type": "default"}},
        "share_expert_dim": 32, "sliding_window": 6, "swiglu_limits": [0.0] * 3, "swiglu_limits_shared": [0.0] * 3,
        "tie_word_embeddings": False, "use_cache": True, "vocab_size": 301,
    }
    text.update(over)
    if not wrap:
        return text
    return {"architectures": ["Step3p7ForConditionalGeneration"], "dtype": "bfloat16", "image_token_id": 300,
            "model_type": "step3p7", "projector_bias": False, "text_config": text,
            "transformers_version": "5.24.0",
            "vision_config": {"hidden_size": 32, "image_size": 28, "intermediate_size": 186,
                              "model_type": "step3p5_vision", "num_attention_heads": 2, "num_hidden_layers": 1,
                              "patch_size": 14, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "axial"}}}


RELEASE_TYPES = [F, S, S, S, S, S]


@pytest.mark.parametrize("wrap", [True, False], ids=["step3p7", "text_config"])
def test_transformers_form_reads_as_the_release_form(wrap):
    got = MtpConfig.from_dict(tf_config(wrap))
    assert got == MtpConfig.from_dict(release_config(3, RELEASE_TYPES, moe_layers_enum="1,2"))
    assert got.family == "step3p5" and got.num_modules == 3 and got.num_hidden_layers == 3
    for m in range(3):
        b = got.block(m)
        assert (b.num_attention_heads, b.num_key_value_heads, b.sliding_window, b.rope_theta, b.rotary_dim,
                b.attn_gate, b.moe) == (8, 2, 6, 1e4, 16, "headwise", False)


def test_transformers_form_module_by_module():
    """The MTP layers as transformers builds them: type, MLP and RoPE per MTP index,
    ``mtp_per_layer_config`` heads, clamps read at the MTP index of the trimmed lists."""
    rope = tf_config()["text_config"]["rope_parameters"]
    rope[F] = {"partial_rotary_factor": 0.5, "rope_theta": 5e6, "rope_type": "default"}
    d = tf_config(mtp_layer_types=[S, F, S], mtp_mlp_layer_types=["dense", "sparse", "dense"], rope_parameters=rope,
                  mtp_per_layer_config={"0": {"num_attention_heads": 6}}, swiglu_limits=[0.0, 7.0, 0.0],
                  swiglu_limits_shared=[0.0, 16.0, 0.0])
    cfg = MtpConfig.from_dict(d)
    first, full, last = (cfg.block(m) for m in range(3))
    assert (first.num_attention_heads, first.sliding_window, first.moe) == (6, 6, False)
    assert (full.num_attention_heads, full.sliding_window, full.rope_theta, full.rotary_dim, full.moe) == (
        4, 0, 5e6, 8, True)
    assert (full.swiglu_clamp, full.swiglu_clamp_shared) == (7.0, 16.0)
    assert (last.num_attention_heads, last.swiglu_clamp_shared, last.moe) == (8, 0.0, False)
    assert MtpConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("edit,match", [
    (dict(mtp_layer_types=[S, F, S]), r"MTP module 1 is full_attention with a scaled RoPE "
                                      r"\(rope_parameters.full_attention.rope_type 'llama3'\)"),
    (dict(mtp_layer_types=[S, S]), r"'mtp_layer_types' expected a list of 3 entries .* got 2 entries"),
    (dict(mtp_layer_types=[S, "linear_attention", S]), r"mtp_layer_types\[1\] expected one of"),
    (dict(mtp_mlp_layer_types=["dense", "moe", "dense"]), r"mtp_mlp_layer_types\[1\] expected one of"),
    (dict(mtp_mlp_layer_types=None), r"'mtp_mlp_layer_types' expected a list of 3 entries"),
    (dict(layer_types=[F, S, S, S, S, S]), r"'layer_types' expected 3 entries \(num_hidden_layers\) beside"),
    (dict(rope_parameters={F: {"rope_type": "default", "rope_theta": 5e6}}),
     r"rope_parameters has no object for 'sliding_attention', the layer type of MTP module 0"),
    (dict(rope_parameters={S: {"rope_type": "default", "rope_theta": 1e4, "factor": 2.0}}),
     r"rope_parameters.sliding_attention has \['factor'\]"),
    (dict(mtp_per_layer_config={"3": {"num_attention_heads": 8}}), r"mtp_per_layer_config\['3'\] expected an MTP"),
    (dict(mtp_per_layer_config={"0": {"head_dim": 32}}), r"mtp_per_layer_config\['0'\] overrides \['head_dim'\]"),
    (dict(swiglu_limits_shared=[0.0, 0.0]), r"'swiglu_limits_shared' expected a list of 3 entries .* got 2 entries"),
    (dict(swiglu_limits_shared=[0.0] * 4), r"'swiglu_limits_shared' expected a list of 3 entries .* got 4 entries"),
    (dict(query_pre_attn_scalar=32), r"'query_pre_attn_scalar' = 32 disagrees with head_dim = 16"),
    (dict(mlp_bias=True), r"'mlp_bias' = True is not supported yet"),
    (dict(model_type="qwen3_next"), r"text_config.model_type expected 'step3p5'"),
])
def test_transformers_configs_it_cannot_read_are_refused(edit, match):
    with pytest.raises(ConfigError, match=match):
        MtpConfig.from_dict(tf_config(**edit))


def test_a_wrapper_without_its_text_config_is_refused():
    d = tf_config()
    del d["text_config"]
    with pytest.raises(ConfigError, match=r"a 'step3p7' config holds its text model under 'text_config'"):
        MtpConfig.from_dict(d)
    with pytest.raises(ConfigError, match=r"name different models"):
        MtpConfig.from_dict(dict(tf_config(), architectures=["Step3p5ForCausalLM"]))


def _transformers_names(raw: dict) -> dict:
    """The release's tensors with each module's norm renamed as transformers' MTP loader
    reads it (``shared_head.norm.weight``) and without the modules' own heads (never read
    by transformers, which drafts with ``lm_head``)."""
    out = {}
    for k, v in raw.items():
        if k.endswith("transformer.shared_head.output.weight"):
            continue
        out[k.replace("transformer.shared_head.norm.weight", "shared_head.norm.weight")] = v
    return out


def test_transformers_tensor_names_load_as_the_release_names(tmp_path):
    """The same weights under transformers' names and config (the release's own heads
    dropped: both then draft with lm_head) draft the same tokens as the release layout."""
    d = release_config(3, RELEASE_TYPES, moe_layers_enum="1,2")
    rel = _ckpt(tmp_path / "rel", d, seed=5)
    raw = load_file(str(rel / "model.safetensors"))
    (tmp_path / "rel-lm").mkdir()
    save_file({k: v for k, v in raw.items() if not k.endswith("shared_head.output.weight")},
              str(tmp_path / "rel-lm" / "model.safetensors"))
    (tmp_path / "rel-lm" / "config.json").write_text(json.dumps(d))
    tf = tmp_path / "tf"
    tf.mkdir()
    save_file(_transformers_names(raw), str(tf / "model.safetensors"))
    (tf / "config.json").write_text(json.dumps(tf_config()))
    prop = MultiModuleMtpHead.from_pretrained(tf, backend="numpy")
    for m in range(3):
        np.testing.assert_array_equal(prop.modules[m].w.shared_head_norm,
                                      raw[f"model.layers.{3 + m}.transformer.shared_head.norm.weight"] + 1.0)
    for mode in ("exact", "draft"):
        want = run_rounds(tmp_path / "rel-lm", mode=mode, n=14, rounds=6, chain="postnorm")[1]
        assert run_rounds(tf, mode=mode, n=14, rounds=6, chain="postnorm")[1] == want


def test_both_names_of_the_norm_are_refused(tmp_path):
    rel = _ckpt(tmp_path / "rel", release_config(3, RELEASE_TYPES, moe_layers_enum="1,2"), seed=5)
    raw = load_file(str(rel / "model.safetensors"))
    raw["model.layers.4.shared_head.norm.weight"] = raw["model.layers.4.transformer.shared_head.norm.weight"]
    save_file(raw, str(rel / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"two names for one tensor of module 1 \('shared_head.norm.weight'\)"):
        MultiModuleMtpHead.from_pretrained(rel, backend="numpy")


# -- the release layout -------------------------------------------------------------------------

def test_release_layout_loads_unchanged(step_ckpt):
    keys = set(load_file(str(step_ckpt / "model.safetensors")))
    for m in range(3):
        p = f"model.layers.{L + m}."
        for k in ("enorm.weight", "eh_proj.weight", "self_attn.g_proj.weight", "self_attn.q_norm.weight",
                  "mlp.gate_proj.weight", "transformer.shared_head.norm.weight", "transformer.shared_head.output.weight"):
            assert p + k in keys, p + k
        assert not any(k.startswith(p + "mlp.experts.") or k.startswith(p + "shared_head.") for k in keys)
    prop = MultiModuleMtpHead.from_pretrained(step_ckpt, backend="numpy")
    assert prop.chain == "prenorm"
    raw = load_file(str(step_ckpt / "model.safetensors"))
    for m in range(3):                                    # each module drafts with its own head
        np.testing.assert_array_equal(prop.modules[m].w.head, raw[f"model.layers.{L + m}.transformer.shared_head.output.weight"])
    prop.check_invariants()


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
@pytest.mark.parametrize("mode", ["exact", "draft"])
def test_drafts_as_the_same_weights_in_the_canonical_layout(tmp_path, backend, mode):
    d = release_config()
    rel = _ckpt(tmp_path / "rel", d, seed=3)
    cfg = dataclasses.replace(MtpConfig.from_dict(d), family="")
    canon = tmp_path / "canon"
    canon.mkdir()
    save_file(synthetic_tensors(cfg, seed=3, own_head=True), str(canon / "model.safetensors"))
    (canon / "config.json").write_text(json.dumps(cfg.to_dict()))
    got = run_rounds(rel, backend=backend, mode=mode, n=14, rounds=6)[1]
    assert got == run_rounds(canon, backend=backend, mode=mode, n=14, rounds=6)[1]


# -- the module's math from the raw release tensors (vLLM's Step3p5 MTP layer) ------------------

def _zrms(x, w, eps):
    """GemmaRMSNorm: x / rms(x) * (1 + w), float64."""
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * (1.0 + np.asarray(w, np.float64))


def _rope(x, pos, R, theta):
    inv = 1.0 / theta ** (np.arange(0, R, 2, dtype=np.float64) / R)
    f = pos[:, None] * inv[None]
    c, s = np.cos(f)[:, None], np.sin(f)[:, None]
    x1, x2 = x[..., :R // 2], x[..., R // 2:R]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, x[..., R:]], -1)


def step3p5_mtp_rows(raw: dict, d: dict, m: int, toks, g):
    """Module ``m`` over n rows from a fresh KV at positions 1..n (keys 0..n-1), from the
    tensors and config as released -> (y, shared_head.norm(y))."""
    W = {k: np.asarray(v, np.float64) for k, v in raw.items()}
    i = d["num_hidden_layers"] + m
    p = f"model.layers.{i}."
    sliding = d["layer_types"][i] == "sliding_attention"
    o = d["attention_other_setting"] if sliding else {}
    Hq, Hkv, D = (o.get("num_attention_heads", d["num_attention_heads"]),
                  o.get("num_attention_groups", d["num_attention_groups"]), d["head_dim"])
    R, theta, eps = int(D * d["partial_rotary_factors"][i]), d["rope_theta"][i], d["rms_norm_eps"]
    n = len(toks)
    u = np.concatenate([_zrms(W["model.embed_tokens.weight"][toks], W[p + "enorm.weight"], eps),
                        _zrms(np.asarray(g, np.float64), W[p + "hnorm.weight"], eps)], 1) @ W[p + "eh_proj.weight"].T
    a = _zrms(u, W[p + "input_layernorm.weight"], eps)
    q = _zrms((a @ W[p + "self_attn.q_proj.weight"].T).reshape(n, Hq, D), W[p + "self_attn.q_norm.weight"], eps)
    k = _zrms((a @ W[p + "self_attn.k_proj.weight"].T).reshape(n, Hkv, D), W[p + "self_attn.k_norm.weight"], eps)
    v = (a @ W[p + "self_attn.v_proj.weight"].T).reshape(n, Hkv, D)
    pos = np.arange(1, n + 1, dtype=np.float64)
    q, k = _rope(q, pos, R, theta), _rope(k, pos, R, theta)
    j = np.arange(n)
    seen = (j[:, None] >= j[None, :]) & ((j[:, None] - j[None, :] < d["sliding_window"]) if sliding else True)
    gate = 1.0 / (1.0 + np.exp(-(a @ W[p + "self_attn.g_proj.weight"].T)))          # [n, Hq]
    att = np.zeros((n, Hq, D))
    for h in range(Hq):
        s = np.where(seen, q[:, h] @ k[:, h // (Hq // Hkv)].T * D ** -0.5, -np.inf)
        e = np.exp(s - s.max(1, keepdims=True))
        att[:, h] = gate[:, h:h + 1] * ((e / e.sum(1, keepdims=True)) @ v[:, h // (Hq // Hkv)])
    u2 = u + att.reshape(n, Hq * D) @ W[p + "self_attn.o_proj.weight"].T
    b = _zrms(u2, W[p + "post_attention_layernorm.weight"], eps)
    limits = [(d.get(f) or [0.0] * (i + 1))[i] or 0.0 for f in ("swiglu_limits", "swiglu_limits_shared")]
    if p + "moe.gate.weight" in W:                    # an MoE MTP layer: the trunk's Step3p5MoEMLP + share_expert
        y = u2 + _moe(W, p, b, d, limits[0]) + _swiglu(b, *(W[p + f"share_expert.{x}_proj.weight"]
                                                            for x in ("gate", "up", "down")), limits[1])
    else:
        y = u2 + _swiglu(b, *(W[p + f"mlp.{x}_proj.weight"] for x in ("gate", "up", "down")), limits[1])
    return y, _zrms(y, W[p + "transformer.shared_head.norm.weight"], eps)


def _swiglu(b, wg, wu, wd, limit):
    """Step3p5MLP: down(clamp(silu(gate), max=limit) * clamp(up, -limit, limit)); no clamp for 0."""
    g, u = b @ wg.T, b @ wu.T
    a = g / (1 + np.exp(-g))
    if limit:
        a, u = np.minimum(a, limit), np.clip(u, -limit, limit)
    return (a * u) @ wd.T


def _moe(W, p, b, d, limit):
    """Step3p5MoEMLP with the router bias: sigmoid scores, the top-k of score + router_bias,
    their unbiased scores renormalised times moe_router_scaling_factor; experts packed
    [E, I, H] (gate, up) and [E, H, I] (down)."""
    prob = 1.0 / (1.0 + np.exp(-(b @ W[p + "moe.gate.weight"].T)))          # [n, E]
    k = d["moe_top_k"]
    out = np.zeros_like(b)
    for r in range(b.shape[0]):
        sel = np.argsort(-(prob[r] + W[p + "moe.router_bias"]))[:k]
        wt = prob[r, sel] / prob[r, sel].sum() * d["moe_router_scaling_factor"]
        for e, we in zip(sel, wt):
            out[r] += we * _swiglu(b[r:r + 1], W[p + "moe.gate_proj.weight"][e], W[p + "moe.up_proj.weight"][e],
                                   W[p + "moe.down_proj.weight"][e], limit)[0]
    return out


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_modules_compute_the_reference_forward(step_ckpt, backend):
    """10 rows through a window of 6: the window, the 8 sliding heads, the gate per head."""
    check_modules_against_reference(step_ckpt, release_config(), backend, seed=4)


def check_modules_against_reference(ckpt, d: dict, backend: str, seed: int) -> None:
    """Each module's forward of 10 rows (positions 1..10) equals ``step3p5_mtp_rows``."""
    raw = load_file(str(ckpt / "model.safetensors"))
    prop = MultiModuleMtpHead.from_pretrained(ckpt, backend=backend)
    rng = np.random.default_rng(seed)
    for m in range(3):
        toks = rng.integers(0, 301, 10).astype(np.int32)
        g = rand_hiddens(rng, 10, 64)
        want_y, want_n = step3p5_mtp_rows(raw, d, m, toks, g)
        head = prop.modules[m]
        seq = head.alloc_seq()
        y, normed = head.forward([RowJob(seq, toks, 0, 1)], g)
        np.testing.assert_allclose(prop.backend.to_host(y), want_y, rtol=2e-4, atol=2e-4)
        np.testing.assert_allclose(prop.backend.to_host(normed), want_n, rtol=2e-4, atol=2e-4)
        head.free_seq(seq)


def test_the_oracle_agrees_over_a_long_exact_run(step_ckpt):
    """The checked proposer (oracle drafts after every call) over contexts past the window."""
    from mtpkern.testing import checked

    prop = MultiModuleMtpHead.from_pretrained(step_ckpt, backend="cpu", block_size=4, num_blocks=64)
    p = checked(prop, reference_weights(step_ckpt))
    rng = np.random.default_rng(1)
    st = p.alloc_state()
    p.prefill_drafter(rng.integers(0, 301, 12).tolist(), rand_hiddens(rng, 12, 64), st)
    P = 12
    for _ in range(6):
        dr = p.propose(int(rng.integers(0, 301)), rand_hiddens(rng, 1, 64)[0], P, 3, st)
        a = int(rng.integers(0, 4))
        p.after_verify(a, st)
        p.catchup_drafter(dr[:a], rand_hiddens(rng, a, 64), st)
        P += 1 + a
    p.check()


def test_step3p7_release_wraps_the_release_form_and_is_refused_where_its_text_config_is():
    """Step-3.7-Flash's own config.json: the release-form text config (per-layer lists of
    layers + 3 entries) under text_config; what would be refused at the top level is
    refused inside it too."""
    text = dict(release_config(), model_type="step3p5")
    del text["architectures"]
    outer = {"architectures": ["Step3p7ForConditionalGeneration"], "model_type": "step3p7", "text_config": text,
             "vision_config": {"hidden_size": 32}}
    assert MtpConfig.from_dict(outer) == MtpConfig.from_dict(release_config())
    with pytest.raises(ConfigError, match=r"field 'index_topk' = 2048 \(the DSA indexer\) needs MLA"):
        MtpConfig.from_dict(dict(outer, text_config=dict(text, index_topk=2048)))


# -- MoE MTP layers (moe_layers_enum covering MTP layer indices) --------------------------------

def moe_config(**over) -> dict:
    """Modules 0 and 2 (layers 1 and 3) MoE, module 1 dense; module 2 with SwiGLU clamps that
    bind on the synthetic weights (routed 0.4, shared 0.6)."""
    return release_config(moe_layers_enum="1,3", swiglu_limits=[0.0, 0.0, 0.0, 0.4],
                          swiglu_limits_shared=[0.0, 0.0, 0.0, 0.6], **over)


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    return _ckpt(tmp_path_factory.mktemp("step3p5-moe"), moe_config(), seed=11)


def test_moe_mtp_layers_have_the_trunks_tensor_names(moe_ckpt):
    """The MoE MTP layers as Step3p5MoEMLP names them: router ``moe.gate``, ``moe.router_bias``,
    the experts packed per projection, the shared expert ``share_expert.*``; no ``mlp.*``."""
    cfg = MtpConfig.from_dict(moe_config())
    assert [cfg.block(m).moe for m in range(3)] == [True, False, True]
    assert (cfg.block(2).swiglu_clamp, cfg.block(2).swiglu_clamp_shared) == (0.4, 0.6)
    raw = load_file(str(moe_ckpt / "model.safetensors"))
    E, I, H = 8, 32, 64
    for layer in (1, 3):
        p = f"model.layers.{layer}."
        assert raw[p + "moe.gate.weight"].shape == (E, H) and raw[p + "moe.router_bias"].shape == (E,)
        assert raw[p + "moe.gate_proj.weight"].shape == raw[p + "moe.up_proj.weight"].shape == (E, I, H)
        assert raw[p + "moe.down_proj.weight"].shape == (E, H, I)
        assert raw[p + "share_expert.gate_proj.weight"].shape == (I, H)
        assert not any(k.startswith(p + "mlp.") for k in raw)
    assert "model.layers.2.mlp.gate_proj.weight" in raw and not any(k.startswith("model.layers.2.moe.") for k in raw)


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_moe_mtp_layers_compute_the_reference_forward(moe_ckpt, backend):
    """Each module against a float64 model of Step3p5's decoder layer from the raw packed
    tensors: sigmoid router, top-2 of score + router_bias, renormalised times 3.0, the
    routed and shared clamps of module 2."""
    check_modules_against_reference(moe_ckpt, moe_config(), backend, seed=8)


def test_the_clamps_bind_in_the_moe_reference(moe_ckpt):
    """A negative control: without its clamps module 2's float64 model differs (so the
    forward test above checks them)."""
    raw = load_file(str(moe_ckpt / "model.safetensors"))
    rng = np.random.default_rng(8)
    toks, g = rng.integers(0, 301, 10).astype(np.int32), rand_hiddens(rng, 10, 64)
    clamped = step3p5_mtp_rows(raw, moe_config(), 2, toks, g)[0]
    free = step3p5_mtp_rows(raw, release_config(moe_layers_enum="1,3"), 2, toks, g)[0]
    assert np.abs(clamped - free).max() > 1e-2


@pytest.mark.parametrize("fp8", [False, True], ids=["f32", "fp8"])
@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_moe_mtp_layers_draft_as_the_canonical_layout(tmp_path, backend, fp8):
    """The packed release layout (FP8 codes and block scales packed too) drafts as the same
    weights with one tensor per expert in the canonical layout."""
    q = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 16]}} if fp8 else {}
    d = moe_config(**q)
    rel = _ckpt(tmp_path / "rel", d, seed=3)
    if fp8:
        assert load_file_fp8_keys(rel) >= {"model.layers.1.moe.gate_proj.weight", "model.layers.1.moe.down_proj.weight"}
    cfg = dataclasses.replace(MtpConfig.from_dict(d), family="")
    canon = write_synthetic_checkpoint(tmp_path / "canon", cfg, seed=3, dtype="float32", own_head=True)
    for mode in ("exact", "draft"):
        want = run_rounds(canon, backend=backend, mode=mode, n=14, rounds=6)[1]
        assert run_rounds(rel, backend=backend, mode=mode, n=14, rounds=6)[1] == want


def load_file_fp8_keys(path) -> set[str]:
    """The keys of the FP8 tensors of a checkpoint (from its safetensors header)."""
    with open(path / "model.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return {k for k, v in header.items() if isinstance(v, dict) and v.get("dtype") == "F8_E4M3"}


def test_moe_mtp_layers_without_the_router_bias(tmp_path):
    """``use_moe_router_bias: false``: no ``moe.router_bias`` tensor, selection by the scores alone."""
    d = moe_config(use_moe_router_bias=False)
    cfg = MtpConfig.from_dict(d)
    assert not cfg.router_bias
    path = _ckpt(tmp_path, d, seed=2)
    assert "model.layers.1.moe.router_bias" not in load_file(str(path / "model.safetensors"))
    prop = MultiModuleMtpHead.from_pretrained(path, backend="numpy")
    assert not np.any(prop.modules[0].w.gate_bias)


def test_a_per_expert_tensor_in_a_packed_layer_is_refused(moe_ckpt, tmp_path):
    """A packed layer read as packed: a stray per-expert tensor would not be used (refused by
    name), and a packed tensor of the wrong expert count is refused by its shape."""
    raw = load_file(str(moe_ckpt / "model.safetensors"))
    (tmp_path / "a").mkdir()
    stray = raw["model.layers.1.moe.gate_proj.weight"][0]
    extra = dict(raw, **{"model.layers.1.moe.experts.0.gate_proj.weight": stray})
    save_file(extra, str(tmp_path / "a" / "model.safetensors"))
    (tmp_path / "a" / "config.json").write_text(json.dumps(moe_config()))
    with pytest.raises(CheckpointError, match=r"'model.layers.1.moe.experts.0.gate_proj.weight' .* would not be used"):
        MultiModuleMtpHead.from_pretrained(tmp_path / "a", backend="numpy")
    (tmp_path / "b").mkdir()
    short = dict(raw, **{"model.layers.3.moe.up_proj.weight": raw["model.layers.3.moe.up_proj.weight"][:7].copy()})
    save_file(short, str(tmp_path / "b" / "model.safetensors"))
    (tmp_path / "b" / "config.json").write_text(json.dumps(moe_config()))
    with pytest.raises(CheckpointError, match=r"'model.layers.3.moe.up_proj.weight'.*expected shape \[8, 32, 64\]"):
        MultiModuleMtpHead.from_pretrained(tmp_path / "b", backend="numpy")


@pytest.mark.parametrize("fp8", [False, True], ids=["f32", "fp8"])
@pytest.mark.parametrize("experts", ["ep", "tp"])
def test_packed_experts_shard_as_the_whole(tmp_path, experts, fp8):
    """A sharded head reads its experts' range (ep) or each expert's intermediate slice (tp)
    of the packed tensors: the same values as those parts of the whole module's."""
    from mtpkern.backends import get_backend
    from mtpkern.shard import Shard
    from mtpkern.weights import load_weights

    # 4 x 4 blocks: a rank's 4 g_proj heads and 20 dense MLP columns are whole blocks
    q = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [4, 4]}} if fp8 else {}
    d = moe_config(**q)
    path, cfg, be = _ckpt(tmp_path, d, seed=4), MtpConfig.from_dict(d), get_backend("numpy")
    whole = load_weights(path, cfg, be).modules[2]
    I = cfg.moe_intermediate_size
    for r in range(2):
        part = load_weights(path, cfg, be, shard=Shard(r, 2, experts)).modules[2]
        if experts == "ep":
            e0, e1 = 4 * r, 4 * r + 4
            want13, want2 = whole.experts_w13[e0:e1], whole.experts_w2[e0:e1]
        else:
            i0, i1 = I // 2 * r, I // 2 * (r + 1)
            want13 = np.concatenate([whole.experts_w13[:, i0:i1], whole.experts_w13[:, I + i0:I + i1]], axis=1)
            want2 = whole.experts_w2[:, :, i0:i1]
        np.testing.assert_array_equal(part.experts_w13, want13)
        np.testing.assert_array_equal(part.experts_w2, want2)
