"""config.json parsing: GLM-4.5 / DeepSeek-V3 field names, validation with clear errors."""

from __future__ import annotations

import json

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
    assert (c.rotary_dim, c.is_moe, c.q_size, c.kv_size, c.num_modules) == (64, True, 12288, 1024, 1)
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
    ({"partial_rotary_factor": 1.5}, "partial_rotary_factor must be in (0, 1], got 1.5"),
    ({"n_group": 3}, "n_routed_experts (128) must be a multiple of n_group (3)"),
    ({"topk_group": 2}, "topk_group (2) must be <= n_group (1)"),
    ({"hidden_act": "gelu"}, "hidden_act expected 'silu', got 'gelu'"),
    ({"rope_parameters": {"rope_type": "yarn"}}, "rope_type 'yarn' is not supported"),
    ({"num_nextn_predict_layers": 0}, "'num_nextn_predict_layers' must be > 0, got 0"),
    ({"scoring_func": "relu"}, "'scoring_func' expected 'sigmoid' or 'softmax', got 'relu'"),
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
    d = dict(GLM45_AIR, model_type="glm4_moe")
    del d["partial_rotary_factor"]
    assert MtpConfig.from_dict(d).partial_rotary_factor == 0.5
    d["model_type"] = "deepseek_v3"
    assert MtpConfig.from_dict(d).partial_rotary_factor == 1.0


def test_mtp_layers_are_moe_whatever_the_dense_prefix():
    assert MtpConfig.from_dict(dict(GLM45_AIR, first_k_dense_replace=100)).is_moe
