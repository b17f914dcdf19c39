"""config.json parsing: GLM-4.5 / DeepSeek-V3 field names, validation with clear errors."""

from __future__ import annotations

import json
import re

import pytest

from mtpkern import ConfigError, MtpConfig
from mtpkern.config import tiny_config

GLM45_AIR = {
    "architectures": ["Glm4MoeForCausalLM"], "hidden_size": 4096, "num_attention_heads": 96,
    "num_key_value_heads": 8, "head_dim": 128, "partial_rotary_factor": 0.5, "rope_theta": 1000000,
    "rms_norm_eps": 1e-05, "attention_bias": True, "use_qk_norm": False, "n_routed_experts": 128,
    "num_experts_per_tok": 8, "n_shared_experts": 1, "moe_intermediate_size": 1408, "n_group": 1,
    "topk_group": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": True, "vocab_size": 151552,
    "num_hidden_layers": 46, "num_nextn_predict_layers": 1, "first_k_dense_replace": 1,
    "intermediate_size": 10944, "hidden_act": "silu", "tie_word_embeddings": False,
    "max_position_embeddings": 131072,
}


def test_glm45_air_config():
    c = MtpConfig.from_dict(GLM45_AIR)
    assert (c.rotary_dim, c.is_moe, c.block(0).q_size, c.block(0).k_size, c.num_modules) == (64, True, 12288, 1024, 1)
    assert c.layer_index(0) == 46 and c.bitmask_words == 4736


def test_rope_parameters_and_defaults():
    d = dict(GLM45_AIR)
    del d["rope_theta"], d["partial_rotary_factor"], d["head_dim"]
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e5, "partial_rotary_factor": 0.25}
    d["num_attention_heads"] = 32
    c = MtpConfig.from_dict(d)
    assert (c.rope_theta, c.partial_rotary_factor, c.head_dim, c.rotary_dim) == (5e5, 0.25, 128, 32)
    d["num_attention_heads"] = 96
    with pytest.raises(ConfigError, match=r"head_dim is missing and hidden_size \(4096\) is not a multiple"):
        MtpConfig.from_dict(d)


def test_round_trip(tmp_path):
    c = tiny_config()
    (tmp_path / "config.json").write_text(json.dumps(c.to_dict()))
    assert MtpConfig.from_json(tmp_path / "config.json") == c


@pytest.mark.parametrize("change,msg", [
    ({"hidden_size": None}, "required field 'hidden_size' is missing"),
    ({"hidden_size": "4096"}, "field 'hidden_size' expected int, got str '4096'"),
    ({"num_key_value_heads": 7}, "num_attention_heads must be a multiple of num_key_value_heads, got 96 and 7"),
    ({"partial_rotary_factor": 1.5}, "field 'partial_rotary_factor' must be in (0, 1], got 1.5"),
    ({"n_group": 3}, "n_routed_experts (128) must be a multiple of n_group (3)"),
    ({"topk_group": 2}, "topk_group (2) must be <= n_group (1)"),
    ({"hidden_act": "gelu"}, "hidden_act expected 'silu', got 'gelu'"),
    ({"rope_parameters": {"rope_type": "llama3"}}, "rope_type 'llama3' is not supported"),
    ({"rope_parameters": {"rope_type": "yarn"}}, "rope_parameters.factor is required by rope_type 'yarn'"),
    ({"num_nextn_predict_layers": 0}, "field 'num_nextn_predict_layers' must be in [1, 64], got 0"),
    ({"scoring_func": "relu"}, "'scoring_func' expected one of ('sigmoid', 'softmax', 'sqrtsoftplus'), got 'relu'"),
    ({"n_routed_experts": 0, "intermediate_size": 0}, "a dense MTP module needs intermediate_size > 0"),
    ({"attention_bias": 1}, "field 'attention_bias' expected bool, got int 1"),
])
def test_config_errors(change, msg):
    d = dict(GLM45_AIR)
    d.update(change)
    d = {k: v for k, v in d.items() if v is not None}
    with pytest.raises(ConfigError) as e:
        MtpConfig.from_dict(d)
    assert msg in str(e.value)


def test_bad_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        MtpConfig.from_json(tmp_path / "config.json")


def test_glm4_moe_partial_rotary_default():
    """Glm4MoeConfig's default (0.5) for a GLM config, MtpConfig's (1.0, whole heads) for a
    hand-written one that names no model_type or architecture."""
    d = dict(GLM45_AIR, model_type="glm4_moe")
    del d["partial_rotary_factor"]
    assert MtpConfig.from_dict(d).partial_rotary_factor == 0.5
    del d["model_type"]
    assert MtpConfig.from_dict(d).partial_rotary_factor == 0.5     # named by its architecture
    del d["architectures"]
    assert MtpConfig.from_dict(d).partial_rotary_factor == 1.0


def test_mtp_layers_are_moe_whatever_the_dense_prefix():
    assert MtpConfig.from_dict(dict(GLM45_AIR, first_k_dense_replace=100)).is_moe


# GLM-4.6 / GLM-4.7 as published (zai-org/GLM-4.6, zai-org/GLM-4.7 config.json: the same
# fields; 4.7 differs only in transformers_version). Recalled field by field, not a copy.
GLM46 = {
    "architectures": ["Glm4MoeForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338], "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 5120, "partial_rotary_factor": 0.5, "initializer_range": 0.02, "intermediate_size": 12288,
    "max_position_embeddings": 202752, "model_type": "glm4_moe", "moe_intermediate_size": 1536,
    "norm_topk_prob": True, "num_attention_heads": 96, "n_group": 1, "topk_group": 1, "n_routed_experts": 160,
    "n_shared_experts": 1, "routed_scaling_factor": 2.5, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
    "num_hidden_layers": 92, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_scaling": None,
    "rope_theta": 1000000, "num_nextn_predict_layers": 1, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.54.0", "use_cache": True, "use_qk_norm": True,
    "vocab_size": 151552,
}
GLM47 = dict(GLM46, transformers_version="4.57.1")

# What transformers 5 writes for a Glm4MoeConfig (save_pretrained): RoPE under rope_parameters,
# num_mtp_layers saved under its config.json name, null token ids, the dtype.
HF5_SAVED = {
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "dtype": "float32",
    "transformers_version": "5.24.0", "vocab_size": 257, "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "hidden_act": "silu", "max_position_embeddings": 512, "initializer_range": 0.1, "rms_norm_eps": 1e-5,
    "use_cache": True, "tie_word_embeddings": False, "attention_bias": True, "attention_dropout": 0.0,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    "moe_intermediate_size": 32, "num_experts_per_tok": 2, "n_shared_experts": 1, "n_routed_experts": 8,
    "routed_scaling_factor": 2.5, "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1,
    "norm_topk_prob": True, "use_qk_norm": True, "bos_token_id": None, "eos_token_id": None,
    "pad_token_id": None, "num_nextn_predict_layers": 2,
}


@pytest.mark.parametrize("d", [GLM45_AIR, GLM46, GLM47, HF5_SAVED], ids=["glm-4.5-air", "glm-4.6", "glm-4.7", "hf5"])
def test_published_glm_configs_load(d, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(d, indent=2))
    c = MtpConfig.from_json(tmp_path / "config.json")
    assert (c.hidden_size, c.n_routed_experts, c.partial_rotary_factor) == (
        d["hidden_size"], d["n_routed_experts"], d.get("partial_rotary_factor", 0.5))


def test_glm46_numbers():
    c = MtpConfig.from_dict(GLM46)
    assert (c.rotary_dim, c.layer_index(0), c.shared_intermediate_size, c.rope_theta) == (64, 92, 1536, 1e6)
    assert c.max_position_embeddings == 202752 and c.use_qk_norm and c.attention_bias


@pytest.mark.parametrize("quant,block", [
    ({"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]},
     (128, 128)),
    ({"config_groups": {"group_0": {"weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                                    "input_activations": {"num_bits": 8, "type": "float", "dynamic": True},
                                    "targets": ["Linear"]}},
      "format": "float-quantized", "quant_method": "compressed-tensors", "ignore": ["lm_head"]}, (0, 0)),
])
def test_fp8_releases_load(quant, block):
    c = MtpConfig.from_dict(dict(GLM46, quantization_config=quant))
    assert (c.weight_quant, c.fp8_block) == ("fp8", block) and "FP8 E4M3" in c.describe()
    assert MtpConfig.from_dict(c.to_dict()) == c


@pytest.mark.parametrize("quant,msg", [
    ({"quant_method": "awq", "bits": 4}, "quant_method 'awq' is not supported"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "fmt 'e5m2' is not supported"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size expected [block rows"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}}},
     "expected float weights of 8 bits (FP8 E4M3, MXFP8) or 4 bits"),
    ({"quant_method": "compressed-tensors",
      "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "tensor"}}}},
     "strategy 'tensor' is not supported"),
])
def test_other_quantizations_are_refused_naming_them(quant, msg):
    with pytest.raises(ConfigError, match=re.escape(msg)):
        MtpConfig.from_dict(dict(GLM46, quantization_config=quant))


def test_errors_from_a_file_name_the_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(GLM46, rms_norm_eps=-1.0)))
    with pytest.raises(ConfigError) as e:
        MtpConfig.from_json(tmp_path / "config.json")
    assert str(e.value).startswith(f"{tmp_path / 'config.json'}: field 'rms_norm_eps' must be in (0, 1], got -1.0")
