"""MiMo-V2-Flash (mtpkern/models/mimo_v2_flash.py): the release layout loads unchanged
and computes what vLLM's ``mimo_v2_mtp.py`` computes.

Its three MTP modules are dense blocks in a MoE model, with the target's sliding-window
attention flavour (the ``swa_*`` sizes: head_dim 192 beside v_head_dim 128, scaled
down here), a sink logit per query head, values scaled by ``attention_value_scale``
(folded into v_proj at load), and FP8 block-128 q/k/v and MLP weights beside BF16
``eh_proj`` / ``o_proj``.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from conftest import rand_hiddens, run_rounds
from mtpkern import ConfigError, MtpConfig, MultiModuleMtpHead, write_synthetic_checkpoint
from mtpkern.head import RowJob
from mtpkern.quant import Fp8Weight
from mtpkern.weights import read_tensors, synthetic_tensors


def release_config(**over) -> dict:
    """config.json as MiMo-V2-Flash releases it (its fields; tiny sizes: the SWA flavour has
    8 query heads of 24 and 2 KV heads, values of 16, a window of 5)."""
    d = {
        "architectures": ["MiMoV2FlashForCausalLM"], "model_type": "mimo_v2_flash",
        "auto_map": {"AutoConfig": "configuration_mimo_v2_flash.MiMoV2FlashConfig",
                     "AutoModelForCausalLM": "modeling_mimo_v2_flash.MiMoV2FlashForCausalLM"},
        "hidden_size": 64, "intermediate_size": 40, "num_hidden_layers": 2, "vocab_size": 301,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 24, "v_head_dim": 16,
        "swa_num_attention_heads": 8, "swa_num_key_value_heads": 2, "swa_head_dim": 24, "swa_v_head_dim": 16,
        "swa_qk_head_dim": 24, "rope_theta": 5e6, "swa_rope_theta": 1e4, "partial_rotary_factor": 0.334,
        "rope_scaling": None, "sliding_window": 5, "sliding_window_size": 5, "attention_chunk_size": 5,
        "hybrid_layer_pattern": [0, 1], "hybrid_block_size": None, "attention_value_scale": 0.707,
        "add_swa_attention_sink_bias": True, "add_full_attention_sink_bias": False, "attention_bias": False,
        "hidden_act": "silu", "layernorm_epsilon": 1e-5, "n_routed_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "n_group": 1,
        "topk_group": 1, "routed_scaling_factor": None, "norm_topk_prob": True, "n_shared_experts": None,
        "moe_layer_freq": [0, 1], "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    d.update(over)
    return d


FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [16, 16],
       "ignored_layers": ["model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj"]}


def _ckpt(path, d: dict, seed: int = 7, dtype: str = "float32"):
    cfg = MtpConfig.from_dict(d)
    path = write_synthetic_checkpoint(path, cfg, seed=seed, dtype=dtype, pow2_scales=True)
    if cfg.weight_quant == "fp8":          # as released: eh_proj and o_proj of the MTP layers in BF16
        t = read_tensors(path)
        for m in range(cfg.num_modules):
            for name in ("eh_proj", "self_attn.o_proj"):
                k = f"model.mtp.layers.{m}.{name}.weight"
                t[k] = Fp8Weight(t[k], t.pop(k + "_scale_inv"), (16, 16)).dequantize().astype(t["lm_head.weight"].dtype)
        save_file(t, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(d))
    return path


@pytest.fixture(scope="module")
def mimo_ckpt(tmp_path_factory):
    return _ckpt(tmp_path_factory.mktemp("mimo_v2"), release_config())


def test_the_swa_flavour_becomes_the_mtp_block():
    cfg = MtpConfig.from_dict(release_config())
    assert cfg.family == "mimo_v2_flash" and cfg.num_modules == 3 and cfg.attention_value_scale == 0.707
    for m in range(3):
        b = cfg.block(m)
        assert (b.num_attention_heads, b.num_key_value_heads, b.head_dim, b.v_dim) == (8, 2, 24, 16)
        assert (b.rope_theta, b.rotary_dim, b.sliding_window, b.attn_sinks, b.moe) == (1e4, 8, 5, True, False)
    assert cfg.rms_norm_eps == 1e-5 and cfg.routed_scaling_factor == 1.0
    assert MtpConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("edit,match", [
    (dict(sliding_window_size=7), r"sliding_window and sliding_window_size expected one window, got \[5, 7\]"),
    (dict(swa_v_head_dim=None), r"'swa_v_head_dim' is missing"),
    (dict(attention_bias=True), r"every MiMo-V2-Flash module has attention_bias = False"),
    (dict(attention_value_scale=0.0), r"'attention_value_scale' must be in \(0, 1000\]"),
])
def test_release_configs_it_cannot_read_are_refused(edit, match):
    with pytest.raises(ConfigError, match=match):
        MtpConfig.from_dict(release_config(**edit))


def test_release_layout_loads_unchanged(mimo_ckpt):
    keys = set(load_file(str(mimo_ckpt / "model.safetensors")))
    for m in range(3):
        p = f"model.mtp.layers.{m}."
        for k in ("enorm", "hnorm", "eh_proj", "input_layernorm", "pre_mlp_layernorm", "final_layernorm",
                  "self_attn.q_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.down_proj"):
            assert p + k + ".weight" in keys, p + k
        assert p + "self_attn.attention_sink_bias" in keys
    assert not any(".experts." in k or k.startswith("model.layers.") for k in keys)
    prop = MultiModuleMtpHead.from_pretrained(mimo_ckpt, backend="numpy")
    assert prop.chain == "postnorm" and prop.modules[0].pool.v.shape[-1] == 16
    prop.check_invariants()


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
@pytest.mark.parametrize("mode", ["exact", "draft"])
def test_drafts_as_the_same_weights_in_the_canonical_layout(tmp_path, backend, mode):
    """The canonical tensors are the folded ones (v_proj with the value scale in it)."""
    d = release_config()
    rel = _ckpt(tmp_path / "rel", d, seed=3)
    cfg = dataclasses.replace(MtpConfig.from_dict(d), family="", attention_value_scale=1.0)
    canon = tmp_path / "canon"
    canon.mkdir()
    save_file(synthetic_tensors(cfg, seed=3), str(canon / "model.safetensors"))
    (canon / "config.json").write_text(json.dumps(cfg.to_dict()))
    got = run_rounds(rel, backend=backend, mode=mode, n=12, rounds=6)[1]
    assert got == run_rounds(canon, backend=backend, mode=mode, n=12, rounds=6, chain="postnorm")[1]


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_fp8_release_drafts_as_its_weights_dequantized(tmp_path, backend):
    """The FP8 release (q/k/v and MLP in FP8 with power-of-two block scales, eh_proj and
    o_proj in BF16) drafts what the same weights dequantized to FP32 draft; v_proj's value
    scale goes into its FP32 scales, so both fold it with one rounding."""
    rel = _ckpt(tmp_path / "rel", release_config(quantization_config=FP8), seed=4, dtype="bfloat16")
    raw = read_tensors(rel)
    assert raw["model.mtp.layers.0.self_attn.q_proj.weight"].dtype.itemsize == 1
    assert raw["model.mtp.layers.0.self_attn.o_proj.weight"].dtype.itemsize == 2
    assert "model.mtp.layers.0.self_attn.o_proj.weight_scale_inv" not in raw
    dense = {}
    for k, a in raw.items():
        if k.endswith("_scale_inv"):
            continue
        dense[k] = (Fp8Weight(a, raw[k + "_scale_inv"], (16, 16)).dequantize() if k + "_scale_inv" in raw
                    else np.asarray(a, np.float32))
    plain = tmp_path / "dense"
    plain.mkdir()
    save_file(dense, str(plain / "model.safetensors"))
    (plain / "config.json").write_text(json.dumps(release_config()))
    prop = run_rounds(rel, backend=backend)
    assert prop[0].config.weight_quant == "fp8"
    assert prop[1] == run_rounds(plain, backend=backend)[1]


# -- the module's math from the raw release tensors (vLLM's MiMoV2 MTP layer) ------------------

def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * np.asarray(w, np.float64)


def mimo_v2_mtp_rows(raw: dict, d: dict, m: int, toks, g):
    """Module ``m`` over n rows from a fresh KV at positions 1..n (keys 0..n-1), in float64
    from the tensors and config as released -> (y, final_layernorm(y))."""
    W = {k: np.asarray(v, np.float64) for k, v in raw.items()}
    p = f"model.mtp.layers.{m}."
    Hq, Hkv, D, Dv = d["swa_num_attention_heads"], d["swa_num_key_value_heads"], d["swa_head_dim"], d["swa_v_head_dim"]
    R, theta, eps, win = int(D * d["partial_rotary_factor"]), d["swa_rope_theta"], d["layernorm_epsilon"], d["sliding_window"]
    n = len(toks)
    z0 = np.concatenate([_rms(W["model.embed_tokens.weight"][toks], W[p + "enorm.weight"], eps),
                         _rms(np.asarray(g, np.float64), W[p + "hnorm.weight"], eps)], 1) @ W[p + "eh_proj.weight"].T
    a = _rms(z0, W[p + "input_layernorm.weight"], eps)
    q = (a @ W[p + "self_attn.q_proj.weight"].T).reshape(n, Hq, D)
    k = (a @ W[p + "self_attn.k_proj.weight"].T).reshape(n, Hkv, D)
    v = (a @ W[p + "self_attn.v_proj.weight"].T).reshape(n, Hkv, Dv) * d["attention_value_scale"]
    pos = np.arange(1, n + 1, dtype=np.float64)
    inv = 1.0 / theta ** (np.arange(0, R, 2) / R)
    c, s = np.cos(pos[:, None] * inv)[:, None], np.sin(pos[:, None] * inv)[:, None]

    def rope(x):
        x1, x2 = x[..., :R // 2], x[..., R // 2:R]
        return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, x[..., R:]], -1)

    q, k = rope(q), rope(k)
    j = np.arange(n)
    seen = (j[:, None] >= j[None, :]) & (j[:, None] - j[None, :] < win)
    sink = W[p + "self_attn.attention_sink_bias"]
    att = np.zeros((n, Hq, Dv))
    for h in range(Hq):
        sc = np.where(seen, q[:, h] @ k[:, h // (Hq // Hkv)].T / np.sqrt(D), -np.inf)
        mx = np.maximum(sc.max(1, keepdims=True), sink[h])
        e = np.exp(sc - mx)
        att[:, h] = (e / (e.sum(1, keepdims=True) + np.exp(sink[h] - mx))) @ v[:, h // (Hq // Hkv)]
    z1 = z0 + att.reshape(n, Hq * Dv) @ W[p + "self_attn.o_proj.weight"].T
    b = _rms(z1, W[p + "pre_mlp_layernorm.weight"], eps)
    gt, up = b @ W[p + "mlp.gate_proj.weight"].T, b @ W[p + "mlp.up_proj.weight"].T
    y = z1 + (gt / (1 + np.exp(-gt)) * up) @ W[p + "mlp.down_proj.weight"].T
    return y, _rms(y, W[p + "final_layernorm.weight"], eps)


def check_modules(prop, raw, d, rows=9, seed=4, tol=2e-4) -> None:
    rng = np.random.default_rng(seed)
    for m in range(prop.num_modules):
        toks = rng.integers(0, d["vocab_size"], rows).astype(np.int32)
        g = rand_hiddens(rng, rows, d["hidden_size"])
        want_y, want_n = mimo_v2_mtp_rows(raw, d, m, toks, g)
        head = prop.modules[m]
        seq = head.alloc_seq()
        y, normed = head.forward([RowJob(seq, toks, 0, 1)], g)
        np.testing.assert_allclose(prop.backend.to_host(y), want_y, rtol=tol, atol=tol)
        np.testing.assert_allclose(prop.backend.to_host(normed), want_n, rtol=tol, atol=tol)
        head.free_seq(seq)


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_modules_compute_the_reference_forward(mimo_ckpt, backend):
    """9 rows through a window of 5: sinks, Dv = 16 beside D = 24, the value scale, RoPE on
    8 of 24 dims, plain norms, the dense block."""
    check_modules(MultiModuleMtpHead.from_pretrained(mimo_ckpt, backend=backend),
                  load_file(str(mimo_ckpt / "model.safetensors")), release_config())
