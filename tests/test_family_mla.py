"""The MLA families: DeepSeek-V3 / V3.1 / R1 (``deepseek_v3``), DeepSeek-V3.2
(``deepseek_v32``), GLM-5 (``glm_moe_dsa``) and GLM-4.7-Flash (``glm4_moe_lite``).

Their configs as released are read into MLA blocks (YaRN, interleaved RoPE, the query
path, the family's chain); small synthetic checkpoints in their layouts (BF16, and FP8
block scales as the DeepSeek-V3 release stores them) load unchanged and draft as the
float64 oracle (mtpkern.testing, the naive MLA form) on the NumPy reference and the cpu
backend, in both KV modes; GLM-5's and V3.2's DSA indexer runs (a small ``index_topk``, so
that it picks keys at test sizes) and ``mtpkern info`` counts its key's bytes. Drafts against Hugging Face's DeepSeek-V3 MTP:
tests/test_hf_deepseek_v3.py (optional).
"""

from __future__ import annotations

import dataclasses
import json
import math

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import test_fp8_checkpoints
import test_oracle
from conftest import MLA_FIELDS, run_rounds
from mtpkern import CheckpointError, ConfigError, MtpConfig, MultiModuleMtpHead, write_synthetic_checkpoint
from mtpkern.backends import get_backend
from mtpkern.config import tiny_config
from mtpkern.testing import reference_weights

#: DeepSeek-V3's config.json as released (the fields the MTP layer depends on, and a few it does not)
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_nextn_predict_layers": 1, "num_attention_heads": 128, "num_key_value_heads": 128,
    "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
    "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "moe_layer_freq": 1,
    "first_k_dense_replace": 3, "norm_topk_prob": True, "scoring_func": "sigmoid", "hidden_act": "silu",
    "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000, "attention_bias": False,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "tie_word_embeddings": False, "vocab_size": 129280, "ep_size": 1, "use_cache": True,
}

#: GLM-5's (GlmMoeDsaConfig's fields, the indexer's with them)
GLM5 = {
    "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "hidden_size": 6144,
    "intermediate_size": 12288, "moe_intermediate_size": 2048, "num_hidden_layers": 78,
    "num_nextn_predict_layers": 1, "num_attention_heads": 64, "num_key_value_heads": 64, "n_shared_experts": 1,
    "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 2048,
    "qk_rope_head_dim": 64, "v_head_dim": 256, "qk_nope_head_dim": 192, "n_group": 1, "topk_group": 1,
    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True, "hidden_act": "silu",
    "max_position_embeddings": 202752, "rms_norm_eps": 1e-5, "attention_bias": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000}, "index_topk": 2048,
    "index_head_dim": 128, "index_n_heads": 32, "vocab_size": 154880, "tie_word_embeddings": False,
}


def test_deepseek_v3_release_config():
    cfg = MtpConfig.from_dict(DEEPSEEK_V3)
    b = cfg.block(0)
    assert cfg.family == "deepseek_v3" and cfg.weight_quant == "fp8" and cfg.fp8_block == (128, 128)
    assert (b.mla, b.kv_lora_rank, b.q_lora_rank, b.qk_nope_head_dim, b.qk_rope_head_dim, b.v_dim) == \
        (True, 512, 1536, 128, 64, 128)
    assert b.head_dim == 192 and b.rotary_dim == 64 and b.rope_interleave       # the family's default
    assert b.latent_width == 576 and b.kv_row_values == 576 and b.o_size == 128 * 128
    m = 0.1 * math.log(40) + 1
    assert b.rope_scaling.factor == 40 and b.rope_scale == 1.0 and math.isclose(b.scale, 192 ** -0.5 * m * m)
    assert b.moe and cfg.n_group == 8 and "MLA Hq=128 L=512 P=128 R=64 q_lora=1536" in cfg.describe()
    from mtpkern.models import family
    assert family("deepseek_v3").chain == "postnorm"


def test_transformers_writes_head_dim_as_the_rope_width_and_qk_head_dim():
    """DeepseekV3Config writes head_dim = qk_rope_head_dim and qk_head_dim = P + R: both read."""
    d = dict(DEEPSEEK_V3, head_dim=64, qk_head_dim=192)
    assert MtpConfig.from_dict(d).block(0).head_dim == 192
    with pytest.raises(ConfigError, match=r"field 'head_dim' = 100 disagrees with MLA's qk_nope_head_dim"):
        MtpConfig.from_dict(dict(DEEPSEEK_V3, head_dim=100))
    with pytest.raises(ConfigError, match=r"field 'qk_head_dim' = 128 disagrees with head_dim = 192"):
        MtpConfig.from_dict(dict(DEEPSEEK_V3, qk_head_dim=128))
    with pytest.raises(ConfigError, match=r"field 'kv_lora_rank' = 512 \(MLA\) needs 'qk_nope_head_dim'"):
        MtpConfig.from_dict({k: v for k, v in DEEPSEEK_V3.items() if k != "qk_nope_head_dim"})


def test_glm5_release_config_and_the_dsa_fields():
    cfg = MtpConfig.from_dict(GLM5)
    b = cfg.block(0)
    assert cfg.family == "glm_moe_dsa" and b.rope_interleave and b.rope_scaling is None
    assert (b.head_dim, b.v_dim, b.q_lora_rank, b.rope_theta) == (256, 256, 2048, 1e6)
    with pytest.raises(ConfigError, match=r"rope_interleave.*every GLM-5 module has rope_interleave = True"):
        MtpConfig.from_dict(dict(GLM5, rope_interleave=False))
    assert (b.index_topk, b.index_n_heads, b.index_head_dim, b.indexer_rope_interleave) == (2048, 32, 128, True)
    assert b.kv_row_values == 512 + 64 + 128                                # the indexer key beside the latent row
    v32 = MtpConfig.from_dict(dict(GLM5, model_type="deepseek_v32", architectures=["DeepseekV32ForCausalLM"],
                                   index_n_heads=64))
    assert v32.block(0).dsa and not v32.block(0).indexer_rope_interleave     # V3.2 rotates halves
    assert MtpConfig.from_dict(dict(GLM5, indexer_rope_interleave=False)).block(0).indexer_rope_interleave is False
    with pytest.raises(ConfigError, match=r"field 'index_topk' = 2048 \(the DSA indexer\) needs MLA with a query latent"):
        MtpConfig.from_dict(dict(tiny_config().to_dict(), index_topk=2048))   # not MLA: refused
    with pytest.raises(ConfigError, match=r"index_head_dim expected an int in \[qk_rope_head_dim = 64, 1024\]"):
        MtpConfig.from_dict(dict(GLM5, index_head_dim=32))
    with pytest.raises(ConfigError, match=r"index_n_heads expected an int in \[1, 1024\]"):
        MtpConfig.from_dict(dict(GLM5, index_n_heads=0))
    lite = MtpConfig.from_dict(dict({k: v for k, v in GLM5.items() if not k.startswith("index_")},
                                    model_type="glm4_moe_lite", architectures=["Glm4MoeLiteForCausalLM"]))
    assert lite.block(0).rope_interleave and lite.family == "glm4_moe_lite"


#: GLM-4.7-Flash's (GLM-5's MLA fields without the indexer)
GLM47_FLASH = dict({k: v for k, v in GLM5.items() if not k.startswith("index_")}, model_type="glm4_moe_lite",
                   architectures=["Glm4MoeLiteForCausalLM"])
V32 = dict(GLM5, model_type="deepseek_v32", architectures=["DeepseekV32ForCausalLM"], index_n_heads=64)


@pytest.mark.parametrize("release, family, chain", [(GLM5, "glm_moe_dsa", "postnorm"),
                                                    (V32, "deepseek_v32", "postnorm"),
                                                    (GLM47_FLASH, "glm4_moe_lite", "prenorm")])
def test_vllm_referenced_releases_mask_position_0_by_default(release, family, chain):
    """vLLM's MTP layer is these families' reference (transformers cannot draft them): its
    position-0 mask is on when the release config (which never names it) is read, the chain
    is what vLLM's forward returns, and a config can still switch the mask off, which its
    to_dict writes out (off against the family's default)."""
    from mtpkern.models import family as fam
    assert "embed_mask_pos0" not in release
    cfg = MtpConfig.from_dict(release)
    assert cfg.family == family and cfg.embed_mask_pos0 and fam(family).chain == chain
    off = MtpConfig.from_dict(dict(release, embed_mask_pos0=False))
    assert not off.embed_mask_pos0 and off.to_dict()["embed_mask_pos0"] is False
    assert MtpConfig.from_dict(off.to_dict()).embed_mask_pos0 is False
    assert "embed_mask_pos0" not in cfg.to_dict() or cfg.to_dict()["embed_mask_pos0"] is True
    # negative control: DeepSeek-V3's reference is transformers, which does not mask
    assert not MtpConfig.from_dict(DEEPSEEK_V3).embed_mask_pos0


# -- synthetic checkpoints in the families' layouts ------------------------------------------------

#: the DSA indexer of the test configs: 5 keys of 4 x 16 heads (the releases: 2048 of 64 or 32 x 128)
DSA_TEST = dict(index_topk=5, index_n_heads=4, index_head_dim=16)


def _mla(family: str = "deepseek_v3", **kw) -> MtpConfig:
    fields = dict(MLA_FIELDS, **kw)
    if family == "glm_moe_dsa":
        fields.update(rope_interleave=True, indexer_rope_interleave=True)
    if family in ("glm_moe_dsa", "deepseek_v32"):
        fields = dict(DSA_TEST, **fields)
    return tiny_config(family=family, **fields)


@pytest.mark.parametrize("family", ["deepseek_v3", "glm_moe_dsa", "deepseek_v32", "glm4_moe_lite"])
@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_family_checkpoint_drafts_as_the_oracle(tmp_path, family, backend):
    """Exact mode, the family's chain, positions past YaRN's original 12, every module's
    latent rows against the oracle's after each call."""
    cfg = _mla(family)
    path = write_synthetic_checkpoint(tmp_path, cfg, seed=11, dtype="float32")
    prop = MultiModuleMtpHead.from_pretrained(path, backend=backend, kv_mode="exact", block_size=4,
                                              num_blocks=96, prefill_chunk=7)
    chain = {"glm4_moe_lite": "prenorm"}.get(family, "postnorm")
    assert prop.chain == chain
    weights = reference_weights(path)
    test_oracle.run_scenario(prop, prop.config, weights, 5, 20, [(3, 1.0), (3, 0.4), (2, 0.0), (3, 1.0)], chain, None)


def test_dsa_indexer_is_read_and_info_counts_its_key(tmp_path, capsys):
    from mtpkern.cli import main

    cfg = _mla("glm_moe_dsa")
    path = write_synthetic_checkpoint(tmp_path, cfg, seed=2, dtype="float32")
    prop = MultiModuleMtpHead.from_pretrained(path, backend="numpy")
    assert prop.weights.notes == [] and prop.modules[0].w.idx_k_norm_b.shape == (16,)
    pool = prop.modules[0].pool
    assert pool.index_k.shape[2] == 16 and pool.block_bytes() == pool.block_size * (48 + 16) * 4
    main(["info", str(path)])
    out = capsys.readouterr().out
    assert "DSA top-5 Hi=4 Di=16 interleaved" in out
    assert "KV per token and module: 128 B (one latent row, with DSA's indexer key (32 B of them)" in out
    # another family's checkpoint with the same tensors: refused by name, as any unread tensor
    d = json.loads((path / "config.json").read_text())
    for k in ("index_topk", "index_head_dim", "index_n_heads", "indexer_rope_interleave"):
        d.pop(k)
    d.update(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"])
    (path / "config.json").write_text(json.dumps(d))
    with pytest.raises(CheckpointError, match=r"self_attn\.indexer\.k_norm\.bias' .* would not be used"):
        MultiModuleMtpHead.from_pretrained(path, backend="numpy")


@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
def test_dsa_negative_controls(tmp_path, family):
    """The oracle draft test fails with the indexer off (dense), with its RoPE's pair order
    flipped, and with a larger index_topk: each is another model past 5 keys."""
    cfg = _mla(family)
    path = write_synthetic_checkpoint(tmp_path, cfg, seed=11, dtype="float32")
    weights = reference_weights(path)
    for wrong in (dict(index_topk=0), dict(indexer_rope_interleave=not cfg.indexer_rope_interleave),
                  dict(index_topk=9)):
        other = dataclasses.replace(cfg, **wrong)
        prop = MultiModuleMtpHead(other, weights, get_backend("numpy"), kv_mode="exact", block_size=4,
                                  num_blocks=96)
        with pytest.raises(AssertionError):
            test_oracle.run_scenario(prop, cfg, weights, 5, 20, [(3, 1.0), (3, 0.4), (2, 0.0), (3, 1.0)],
                                     "postnorm", None)


# -- MLA without RoPE (GLM-5.3's MTP layer) ------------------------------------------------------

#: GLM-5.3's MTP attention, small: qk_rope_head_dim 0 (NoPE), so head_dim = P = 16 and the latent row
#: is c alone (L 40); YaRN's fields kept from MLA_FIELDS: the scores' mscale^2 applies with no rotation
NOPE = dict(qk_rope_head_dim=0, head_dim=16)


def _nope_scenario(prop, cfg, weights):
    test_oracle.run_scenario(prop, cfg, weights, 5, 20, [(3, 1.0), (3, 0.4), (2, 0.0), (3, 1.0)], "postnorm", None)


@pytest.mark.parametrize("family", ["deepseek_v3", "glm_moe_dsa"])
@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_nope_mla_drafts_as_the_oracle(tmp_path, family, backend):
    """qk_rope_head_dim 0, without and with DSA's indexer (5 keys, rotating nothing): the
    checkpoint's kv_a_proj_with_mqa has L rows and loads; the config round-trips with its R of 0;
    drafts and every module's latent rows equal the float64 oracle's in exact mode past YaRN's
    original 12 positions."""
    cfg = _mla(family, **NOPE)
    b = cfg.block(0)
    assert (b.qk_nope_head_dim, b.qk_rope_head_dim, b.latent_width, b.rotary_dim) == (16, 0, 40, 0)
    assert b.inv_freq().shape == (0,) and math.isclose(b.scale, 16 ** -0.5 * b.rope_scaling.softmax_factor)
    assert "R=0" in cfg.describe() and "NoPE" in cfg.describe()
    assert MtpConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    path = write_synthetic_checkpoint(tmp_path, cfg, seed=11, dtype="float32")
    raw = load_file(str(path / "model.safetensors"))
    assert raw["model.layers.2.self_attn.kv_a_proj_with_mqa.weight"].shape == (40, 64)
    prop = MultiModuleMtpHead.from_pretrained(path, backend=backend, kv_mode="exact", block_size=4,
                                              num_blocks=96, prefill_chunk=7)
    assert prop.modules[0].pool.k.shape[2] == 40 and prop.modules[0].block.dsa == (family == "glm_moe_dsa")
    _nope_scenario(prop, prop.config, reference_weights(path))


def test_nope_mla_negative_controls(tmp_path):
    """The oracle test fails when the module scales its scores for another head dim (GLM-5's
    P + R = 256 + 64 shape, here (16 + 8)^-0.5) or without YaRN's mscale^2, and with the
    indexer off: each is another model. A kv_a_proj_with_mqa of L + 8 rows (a rotated key's
    values) is refused by name."""
    cfg = _mla("glm_moe_dsa", **NOPE)
    path = write_synthetic_checkpoint(tmp_path, cfg, seed=11, dtype="float32")
    weights = reference_weights(path)
    b = cfg.block(0)
    for wrong in (24 ** -0.5 * b.rope_scaling.softmax_factor, 16 ** -0.5):
        prop = MultiModuleMtpHead(cfg, weights, get_backend("numpy"), kv_mode="exact", block_size=4, num_blocks=96)
        for head in prop.modules:
            head._scale = wrong
        with pytest.raises(AssertionError):
            _nope_scenario(prop, cfg, weights)
    dense = MultiModuleMtpHead(dataclasses.replace(cfg, index_topk=0), weights, get_backend("numpy"),
                               kv_mode="exact", block_size=4, num_blocks=96)
    with pytest.raises(AssertionError):
        _nope_scenario(dense, cfg, weights)
    t = load_file(str(path / "model.safetensors"))
    name = "model.layers.2.self_attn.kv_a_proj_with_mqa.weight"
    t[name] = np.concatenate([t[name], t[name][:8]])
    save_file(t, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"kv_a_proj_with_mqa.*40, 64"):
        MultiModuleMtpHead.from_pretrained(path, backend="numpy")


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_no_q_lora_rank_reads_q_proj(tmp_path, backend):
    cfg = _mla(q_lora_rank=0, rope_interleave=False, rope_scaling=None)
    path = write_synthetic_checkpoint(tmp_path, cfg, seed=12, dtype="float32")
    prop = MultiModuleMtpHead.from_pretrained(path, backend=backend, kv_mode="exact", block_size=4, num_blocks=96)
    assert prop.weights.modules[0].mla_q_a is None
    test_oracle.run_scenario(prop, prop.config, reference_weights(path), 3, 9, [(3, 1.0), (2, 0.5), (3, 0.0)],
                             "postnorm", None)


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_fp8_block_checkpoint_drafts_as_its_dequantized_weights(tmp_path, backend):
    """DeepSeek-V3's FP8 release layout: every MLA projection (q_a, q_b, kv_a_proj_with_mqa,
    kv_b, o) and the experts in FP8 with block scales; power-of-two scales make the
    dequantized weights exact, so the drafts are the same."""
    cfg = dataclasses.replace(_mla(), weight_quant="fp8", fp8_block=(16, 16))
    fp8 = write_synthetic_checkpoint(tmp_path / "fp8", cfg, seed=4, pow2_scales=True)
    from mtpkern.weights import read_tensors

    raw = read_tensors(fp8)
    for name in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
        assert raw[f"model.layers.2.self_attn.{name}.weight"].dtype.itemsize == 1, name
        assert f"model.layers.2.self_attn.{name}.weight_scale_inv" in raw, name
    plain = test_fp8_checkpoints._dequantized_copy(fp8, tmp_path / "fp32", cfg)
    for mode in ("exact", "draft"):
        assert run_rounds(fp8, backend, mode)[1] == run_rounds(plain, backend, mode)[1]


@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa", "glm5_next_text"])
@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_fp8_dsa_checkpoint_drafts_as_its_dequantized_weights(tmp_path, family, backend):
    """The DSA releases' FP8 layout (DeepSeek-V3.2, GLM-5, GLM-5.3): the MLA projections, the
    experts and the indexer's ``wq_b`` / ``wk`` in FP8 with block scales, its
    ``weights_proj`` kept BF16 with no scale (a tensor's own dtype decides, whatever the config
    says); contexts past index_topk (16 prompt tokens, 4-5 keys picked), both KV modes. Power-of-
    two scales make the dequantized weights exact, so the drafts are the same."""
    import test_family_glm5_next

    base = tiny_config(**test_family_glm5_next.G53) if family == "glm5_next_text" else _mla(family)
    cfg = dataclasses.replace(base, weight_quant="fp8", fp8_block=(16, 16))
    fp8 = write_synthetic_checkpoint(tmp_path / "fp8", cfg, seed=4, pow2_scales=True)
    from mtpkern.quant import Fp8Weight
    from mtpkern.weights import read_tensors

    raw = read_tensors(fp8)
    pre = "model.language_model.layers.2." if family == "glm5_next_text" else "model.layers.2."
    for name in ("indexer.wq_b", "indexer.wk", "kv_a_proj_with_mqa", "o_proj"):
        assert raw[f"{pre}self_attn.{name}.weight"].dtype.itemsize == 1, name
    for m in range(cfg.num_modules):                # weights_proj as a BF16 tensor among the FP8 ones
        k = f"{pre.replace('.2.', f'.{cfg.layer_index(m)}.')}self_attn.indexer.weights_proj.weight"
        w = Fp8Weight(raw[k].view(np.uint8), raw.pop(k + "_scale_inv"), (16, 16)).dequantize()
        raw[k] = w.astype(ml_dtypes.bfloat16)
    save_file({k: np.ascontiguousarray(a) for k, a in raw.items()}, str(fp8 / "model.safetensors"))
    plain = test_fp8_checkpoints._dequantized_copy(fp8, tmp_path / "fp32", cfg)
    for mode in ("exact", "draft"):
        got = run_rounds(fp8, backend, mode, n=16, rounds=5)
        assert got[0].modules[0].pool.index_k is not None
        assert got[1] == run_rounds(plain, backend, mode, n=16, rounds=5)[1]


# -- LongCat-Flash ------------------------------------------------------------------------------

LONGCAT = {
    "architectures": ["LongcatFlashForCausalLM"], "model_type": "longcat_flash", "hidden_size": 6144,
    "ffn_hidden_size": 12288, "expert_ffn_hidden_size": 2048, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "num_attention_heads": 64,
    "num_layers": 28, "moe_topk": 12, "n_routed_experts": 512, "zero_expert_num": 256,
    "zero_expert_type": "identity", "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "rope_theta": 10000000.0, "routed_scaling_factor": 6.0, "router_bias": False, "mla_scale_q_lora": True,
    "mla_scale_kv_lora": True, "vocab_size": 131072, "attention_method": "MLA",
}


def test_longcat_release_config():
    cfg = MtpConfig.from_dict(LONGCAT)
    b = cfg.block(0)
    assert cfg.family == "longcat_flash" and cfg.num_modules == 1 and not b.moe and cfg.intermediate_size == 12288
    assert b.mla and b.rope_interleave and b.rope_theta == 1e7 and cfg.num_hidden_layers == 56
    assert math.isclose(cfg.q_a_norm_scale, 2.0) and math.isclose(cfg.kv_a_norm_scale, 12 ** 0.5)
    with pytest.raises(ConfigError, match=r"LongCat-Flash has one MTP layer"):
        MtpConfig.from_dict(dict(LONGCAT, num_nextn_predict_layers=2))
    no_scale = MtpConfig.from_dict({k: v for k, v in LONGCAT.items() if not k.startswith("mla_scale")})
    assert no_scale.q_a_norm_scale == 1.0 and no_scale.kv_a_norm_scale == 1.0


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_longcat_layout_loads_folds_the_lora_norm_scales_and_drafts_as_the_canonical_one(tmp_path, backend):
    from mtpkern.weights import read_tensors

    base = tiny_config(**dict(MLA_FIELDS, rope_scaling=None), n_routed_experts=0, num_experts_per_tok=0,
                       n_shared_experts=0, n_group=1, topk_group=1, intermediate_size=40,
                       num_nextn_predict_layers=1)
    cfg = dataclasses.replace(base, family="longcat_flash", q_a_norm_scale=2.0, kv_a_norm_scale=0.5,
                              rope_theta=1e7)
    path = write_synthetic_checkpoint(tmp_path / "lc", cfg, seed=8, dtype="float32", own_embed=True)
    raw = read_tensors(path)
    for name in ("model.mtp.layers.0.enorm.m.weight", "model.mtp.layers.0.transformer_layer.mlp.gate_proj.weight",
                 "model.mtp.norm.weight", "model.mtp.embed_tokens.weight",
                 "model.mtp.layers.0.self_attn.kv_b_proj.weight"):
        assert name in raw, name
    prop = MultiModuleMtpHead.from_pretrained(path, backend="numpy")
    w = prop.weights.modules[0]
    np.testing.assert_allclose(w.mla_q_a_norm, raw["model.mtp.layers.0.self_attn.q_a_layernorm.weight"] * 2.0,
                               rtol=1e-6)
    np.testing.assert_allclose(w.mla_kv_a_norm, raw["model.mtp.layers.0.self_attn.kv_a_layernorm.weight"] * 0.5,
                               rtol=1e-6)
    assert prop.chain == "postnorm"
    canon = write_synthetic_checkpoint(tmp_path / "canon", dataclasses.replace(cfg, family=""), seed=8,
                                       dtype="float32", own_embed=True)
    for mode in ("exact", "draft"):
        got = run_rounds(path, backend, mode, chain="postnorm")[1]
        assert got == run_rounds(canon, backend, mode, chain="postnorm")[1]
    test_oracle.run_scenario(MultiModuleMtpHead.from_pretrained(path, backend=backend, kv_mode="exact", block_size=4,
                                                                num_blocks=64),
                             cfg, reference_weights(path), 2, 9, [(1, 1.0), (1, 0.0), (1, 1.0)], "postnorm", None)


def test_a_family_s_ignored_tensors_load_unread_and_loading_says_so(tmp_path, monkeypatch, capsys):
    """``Family.ignored`` (no released family needs it today): a family that lists the
    indexer's tensors as not read loads a checkpoint holding them with index_topk 0, one note
    per module, and ``mtpkern info`` prints the reason; without the entry they are refused."""
    from mtpkern.cli import main
    from mtpkern.models import FAMILIES

    cfg = _mla("glm_moe_dsa")
    path = write_synthetic_checkpoint(tmp_path, cfg, seed=2, dtype="float32")
    d = json.loads((path / "config.json").read_text())
    d["index_topk"] = 0
    (path / "config.json").write_text(json.dumps(d))
    with pytest.raises(CheckpointError, match=r"self_attn\.indexer\..*would not be used"):
        MultiModuleMtpHead.from_pretrained(path, backend="numpy")
    fam = dataclasses.replace(FAMILIES["glm_moe_dsa"], ignored=(("self_attn.indexer.", "kept for a test"),))
    monkeypatch.setitem(FAMILIES, "glm_moe_dsa", fam)
    prop = MultiModuleMtpHead.from_pretrained(path, backend="numpy")
    notes = prop.weights.notes
    assert len(notes) == 3 and all("5 tensor(s) not read (kept for a test" in n for n in notes), notes
    main(["info", str(path)])
    assert "self_attn.indexer.* not read (kept for a test)" in capsys.readouterr().out
