"""DeepSeek-V4 (mtpkern/models/deepseek_v4.py): the release's config.json and its ``mtp.{m}.``
layout load as the same module the canonical layout gives.

The release's config (DeepSeek-V4-Flash's config.json) becomes hyper-connection blocks with
V4's attention; at test size, a checkpoint in the release layout (V4's names, ``e_proj`` /
``h_proj``, no per-head query norm, rotary dims last in each head, ``X.scale`` E8M0 scales,
FP4 experts) drafts what the same weights in the canonical layout draft, bit for bit;
negative controls (the rotary dims left where the release has them, e_proj / h_proj
swapped) change the module's output. The computation itself against an independent float64
model reading the release's names: tests/test_family_deepseek_v4_reference.py.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from conftest import run_rounds
from mtpkern import ConfigError, MtpConfig, MultiModuleMtpHead, models, write_synthetic_checkpoint
from mtpkern.cli import main
from mtpkern.config import tiny_config
from mtpkern.head import RowJob
from mtpkern.quant import Fp4Weight, Fp8Weight
from mtpkern.weights import read_tensors, release_layout, synthetic_tensors

#: DeepSeek-V4-Flash's config.json as released (its sizes)
FLASH = {
    "architectures": ["DeepseekV4ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 0,
    "eos_token_id": 1, "hc_eps": 1e-06, "hc_mult": 4, "hc_sinkhorn_iters": 20, "head_dim": 512,
    "hidden_act": "silu", "hidden_size": 4096, "index_head_dim": 128, "index_n_heads": 64, "index_topk": 512,
    "initializer_range": 0.02, "max_position_embeddings": 1048576, "model_type": "deepseek_v4",
    "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 64, "num_experts_per_tok": 6, "num_hidden_layers": 43, "num_hash_layers": 3,
    "num_key_value_heads": 1, "num_nextn_predict_layers": 1, "o_groups": 8, "o_lora_rank": 1024,
    "q_lora_rank": 1024, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16, "original_max_position_embeddings": 65536,
                     "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus", "sliding_window": 128,
    "swiglu_limit": 10.0, "tie_word_embeddings": False, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "transformers_version": "4.57.1", "use_cache": True, "vocab_size": 129280, "compress_rope_theta": 160000,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
}

#: the release's features at test size: 4 query heads of 32 with 8 rotary dims, one K = V head, a
#: query latent of 24, 2 output groups of rank 16, a window of 6, 4 streams
V4 = dict(family="deepseek_v4", num_key_value_heads=1, head_dim=32, partial_rotary_factor=0.25, rope_interleave=True,
          q_lora_rank=24, shared_kv=True, out_rope=True, o_groups=2, o_lora_rank=16, attn_sinks=True,
          attention_bias=False, sliding_window=6, hc_mult=4, scoring_func="sqrtsoftplus", n_group=1, topk_group=1,
          swiglu_clamp=1.5, swiglu_clamp_shared=1.5, swiglu_clamp_gate=True, rms_norm_eps=1e-6)


def test_the_release_config_reads_as_v4_blocks():
    cfg = MtpConfig.from_dict(FLASH)
    b = cfg.block(0)
    assert cfg.family == "deepseek_v4" and cfg.num_modules == 1 and cfg.layer_index(0) == 43
    assert (b.num_attention_heads, b.num_key_value_heads, b.head_dim, b.rotary_dim) == (64, 1, 512, 64)
    assert (b.q_lora_rank, b.o_groups, b.o_lora_rank, b.sliding_window) == (1024, 8, 1024, 128)
    assert b.shared_kv and b.out_rope and b.attn_sinks and b.rope_interleave and not b.mla and not b.dsa
    assert b.rope_scaling is None and b.rope_theta == 10000                 # no YaRN in the MTP layer
    assert (b.swiglu_clamp, b.swiglu_clamp_shared, b.swiglu_clamp_gate) == (10.0, 10.0, True)
    assert (cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.stream_size) == (4, 20, 1e-6, 4 * 4096)
    assert (cfg.scoring_func, cfg.router_bias, cfg.n_group, cfg.routed_scaling_factor) == ("sqrtsoftplus", True, 1, 1.5)
    assert (cfg.weight_quant, cfg.fp8_block, cfg.expert_quant) == ("fp8", (128, 128), "fp4")
    assert cfg.use_qk_norm and not cfg.attention_bias and cfg.rms_norm_eps == 1e-6
    assert MtpConfig.from_dict(cfg.to_dict()) == cfg
    base = dict(FLASH, quantization_config={**FLASH["quantization_config"], "expert_dtype": "fp8"})
    assert MtpConfig.from_dict(base).expert_quant == ""                   # Flash-Base: FP8 experts
    assert MtpConfig.from_dict({k: v for k, v in FLASH.items() if k != "quantization_config"}).expert_quant == ""


@pytest.mark.parametrize("edit,match", [
    (dict(compress_ratios=[0, 0] + [4, 128] * 20 + [4, 4]), r"compress_ratios' gives the MTP layers \[4\]"),
    (dict(compress_ratios=[0, 4]), r"'compress_ratios' expected a list of num_hidden_layers \(43\)"),
    (dict(num_hash_layers=44), r"'num_hash_layers' = 44 reaches the MTP layers"),
    (dict(qk_rope_head_dim=63), r"'qk_rope_head_dim' = 63 and 'head_dim' = 512: expected an even number"),
    (dict(attention_bias=True), r"every DeepSeek-V4 module has attention_bias = False"),
])
def test_release_configs_it_cannot_read_are_refused(edit, match):
    with pytest.raises(ConfigError, match=match):
        MtpConfig.from_dict({**FLASH, **edit})


@pytest.fixture(scope="module")
def v4_paths(tmp_path_factory):
    """(release layout, the same dense tensors in the canonical layout, config)."""
    cfg = tiny_config(**V4)
    root = tmp_path_factory.mktemp("v4fam")
    rel = write_synthetic_checkpoint(root / "rel", cfg, seed=5, dtype="float32")
    canon = root / "canon"
    canon.mkdir()
    save_file(synthetic_tensors(cfg, seed=5), str(canon / "model.safetensors"))
    (canon / "config.json").write_text(json.dumps(dataclasses.replace(cfg, family="").to_dict()))
    return rel, canon, cfg


def test_the_release_layout_names_its_tensors_as_v4_does(v4_paths):
    rel, _, cfg = v4_paths
    keys = set(read_tensors(rel))
    for m in range(cfg.num_modules):
        p = f"mtp.{m}."
        for k in ("enorm.weight", "hnorm.weight", "e_proj.weight", "h_proj.weight", "attn_norm.weight",
                  "ffn_norm.weight", "norm.weight", "attn.wq_a.weight", "attn.q_norm.weight", "attn.wq_b.weight",
                  "attn.wkv.weight", "attn.kv_norm.weight", "attn.wo_a.weight", "attn.wo_b.weight", "attn.attn_sink",
                  "ffn.gate.weight", "ffn.gate.bias", "ffn.experts.0.w1.weight", "ffn.experts.7.w2.weight",
                  "ffn.experts.3.w3.weight", "ffn.shared_experts.w1.weight", "hc_attn_fn", "hc_ffn_base",
                  "hc_head_scale"):
            assert p + k in keys, p + k
        assert not any(k.startswith(p) and ("eh_proj" in k or "self_attn" in k or "mlp." in k) for k in keys)
    assert {"embed.weight", "head.weight", "norm.weight"} <= keys
    assert not any(k.startswith("model.") for k in keys)
    assert main(["info", str(rel)]) == 0


def test_info_names_the_family_the_block_and_the_kv_bytes(v4_paths, capsys):
    """``mtpkern info`` of the release layout: the family, each module's block (streams, the
    shared-KV windowed attention with sinks, grouped output), each module's tensors under
    ``mtp.{i}.``, the KV bytes per token (K and V rows of one 32-wide head, BF16)."""
    rel, _, cfg = v4_paths
    assert main(["info", str(rel)]) == 0
    out = capsys.readouterr().out
    assert "DeepSeek-V4: M=3" in out and "hyper-connections x4 (streams of 256)" in out
    assert "Hkv=1 D=32" in out and "window=6 sinks" in out and "K=V" in out and "o_proj 2 groups x 16" in out
    assert "KV per token and module: 128 B (K and V, BF16 on cuda" in out
    assert "window (6/6/6 tokens)" in out
    for m in range(cfg.num_modules):
        assert f"module {m}: mtp.{m}.*  53 tensors" in out


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
@pytest.mark.parametrize("mode", ["exact", "draft"])
def test_drafts_as_the_same_weights_in_the_canonical_layout(v4_paths, backend, mode):
    rel, canon, _ = v4_paths
    got = run_rounds(rel, backend=backend, mode=mode, n=12, rounds=6)[1]
    assert got == run_rounds(canon, backend=backend, mode=mode, n=12, rounds=6)[1]


def _module0(path):
    prop = MultiModuleMtpHead.from_pretrained(path, backend="numpy", block_size=4, num_blocks=64)
    rng = np.random.default_rng(9)
    cfg = prop.config
    toks = rng.integers(0, cfg.vocab_size, 9).astype(np.int32)
    g = rng.standard_normal((9, cfg.stream_size)).astype(np.float32)
    head = prop.modules[0]
    y, normed = head.forward([RowJob(head.alloc_seq(), toks, 0, 1, None)], g)
    return prop, np.asarray(y), np.asarray(normed)


def test_the_loaded_module_is_the_canonical_one(v4_paths):
    rel, canon, _ = v4_paths
    a, ya, na = _module0(rel)
    b, yb, nb = _module0(canon)
    for name in ("q_b", "w_qkv", "k_norm", "q_norm", "eh_proj", "w_o_b", "sinks"):
        assert np.array_equal(getattr(a.weights.modules[0], name), getattr(b.weights.modules[0], name)), name
    for i, (wa, wb) in enumerate(zip(a.weights.modules[0].w_o_a, b.weights.modules[0].w_o_a)):
        assert np.array_equal(wa, wb), f"o_a group {i}"
    assert np.array_equal(ya, yb) and np.array_equal(na, nb)


@pytest.mark.parametrize("wrong", ["rotary_dims_left_last", "e_h_swapped"])
def test_negative_controls_change_the_module(v4_paths, tmp_path, monkeypatch, wrong):
    rel, canon, cfg = v4_paths
    _, want, _ = _module0(canon)
    if wrong == "rotary_dims_left_last":
        monkeypatch.setitem(models.FAMILIES, "deepseek_v4",
                            dataclasses.replace(models.FAMILIES["deepseek_v4"], rope_last=False))
        path = rel
    else:
        t = read_tensors(rel)
        for m in range(cfg.num_modules):
            t[f"mtp.{m}.e_proj.weight"], t[f"mtp.{m}.h_proj.weight"] = t[f"mtp.{m}.h_proj.weight"], t[f"mtp.{m}.e_proj.weight"]
        path = tmp_path / "swapped"
        path.mkdir()
        save_file(t, str(path / "model.safetensors"))
        (path / "config.json").write_text((rel / "config.json").read_text())
    _, got, _ = _module0(path)
    assert not np.allclose(got, want, atol=1e-3)


def _dequantized(src, dst, cfg):
    """The FP8 / FP4 release at ``src`` with every weight dequantized (its ``X.scale`` read by
    hand), as a plain checkpoint in the same layout."""
    raw = read_tensors(src)
    out = {}
    for k, a in raw.items():
        if k.endswith(".scale"):
            continue
        sk = k[:-len("weight")] + "scale"
        if a.dtype == np.int8:
            a = Fp4Weight(a.view(np.uint8), raw[sk]).dequantize()
        elif a.dtype.itemsize == 1:
            a = Fp8Weight(a.view(np.uint8), raw[sk], cfg.fp8_block).dequantize()
        out[k] = np.ascontiguousarray(np.asarray(a, np.float32))
    dst.mkdir()
    save_file(out, str(dst / "model.safetensors"))
    plain = dataclasses.replace(cfg, weight_quant="", fp8_block=(0, 0), expert_quant="")
    (dst / "config.json").write_text(json.dumps(plain.to_dict()))
    return dst


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_the_quantized_release_drafts_as_its_weights_dequantized(tmp_path, backend):
    """FP8 projections with E8M0 ``.scale`` blocks of 16 (the rotary reorder refines them to 8
    rows / columns) and FP4 routed experts draft what the same weights in FP32 draft."""
    cfg = tiny_config(**V4, weight_quant="fp8", fp8_block=(16, 16), expert_quant="fp4")
    rel = write_synthetic_checkpoint(tmp_path / "rel", cfg, seed=6)
    raw = read_tensors(rel)
    assert raw["mtp.0.attn.wq_b.weight"].dtype.itemsize == 1 and raw["mtp.0.attn.wq_b.scale"].shape == (8, 2)
    assert raw["mtp.0.ffn.experts.0.w1.weight"].dtype == np.int8 and "mtp.0.e_proj.scale" in raw
    plain = _dequantized(rel, tmp_path / "plain", cfg)
    assert run_rounds(rel, backend=backend, n=10, rounds=5)[1] == run_rounds(plain, backend=backend, n=10, rounds=5)[1]


def test_quantized_tensors_are_reordered_before_quantization():
    cfg = tiny_config(**V4, weight_quant="fp8", fp8_block=(16, 16))
    t = synthetic_tensors(cfg, seed=1)
    t = {k: (Fp8Weight.quantize(v, (16, 16)).data if k.endswith("q_b_proj.weight") else v) for k, v in t.items()}
    with pytest.raises(ValueError, match="reordered before quantization"):
        release_layout(cfg, t)


@pytest.mark.parametrize("block", [(16, 16), (16, 32), None])
@pytest.mark.parametrize("axis", [0, 1])
def test_take_units_keeps_every_weight(block, axis):
    """Fp8Weight.take_units: the reordered weight's values are the dense reorder's, the block
    scales refined to the units (gcd with the block) or per-channel scales moved with their rows."""
    from mtpkern.quant import rope_first_order, take_units
    rng = np.random.default_rng(2)
    w = Fp8Weight.quantize(rng.standard_normal((96, 64)) * np.exp(rng.standard_normal((96, 1))), block)
    order, unit = rope_first_order(3 if axis == 0 else 2, 32, 8)
    got = take_units(w, axis, order, unit)
    assert np.array_equal(got.dequantize(), take_units(w.dequantize(), axis, order, unit))
    if block is not None:
        assert got.block[axis] == 8 and got.block[1 - axis] == block[1 - axis]
    assert np.array_equal(order[:4], [3, 0, 1, 2])                    # a head's last 8 of 32 first
    with pytest.raises(ValueError, match="order: expected a permutation"):
        w.take_units(axis, order[:-1], unit)
