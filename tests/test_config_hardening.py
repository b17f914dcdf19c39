"""Configs and checkpoints read strictly: every field through one typed rule
(mtpkern/config_fields.py), per-layer lists of exactly one entry per layer, windows that
are windows, FP8 codes and scales that are numbers, per-module overrides given once, and
a module's own LM head all-or-none. Each refusal names the field or tensor, what was
expected and what was given."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from mtpkern import CheckpointError, ConfigError, MtpConfig, MultiModuleMtpHead, write_synthetic_checkpoint
from mtpkern.config import tiny_config
from mtpkern.config_fields import bool_field, float_field, int_field, window_field
from mtpkern.quant import Fp8Weight, bad_scales, nan_codes
from mtpkern.weights import read_tensors

import test_family_mimo_v2_flash as mimo_v2
import test_family_step3p5 as step
from test_family_mla import LONGCAT


# -- the typed readers ---------------------------------------------------------------------------

@pytest.mark.parametrize("reader,value,match", [
    (int_field, True, r"field 'f' expected an integer, got bool True"),
    (int_field, "3", r"field 'f' expected an integer, got string '3'"),
    (int_field, 3.0, r"field 'f' expected an integer, got float 3.0"),
    (bool_field, "false", r"field 'f' expected true or false, got string 'false'"),
    (bool_field, 0, r"field 'f' expected true or false, got int 0"),
    (float_field, "7", r"field 'f' expected a finite number, got string '7'"),
    (float_field, True, r"field 'f' expected a finite number, got bool True"),
    (float_field, [1], r"field 'f' expected a finite number, got list \[1\]"),
    (window_field, 0, r"field 'f' expected a sliding window, an integer in \[1, 2\^31 - 1\], got int 0"),
    (window_field, None, r"field 'f' expected a sliding window, .* got null None"),
])
def test_the_readers_refuse_other_kinds(reader, value, match):
    with pytest.raises(ConfigError, match=match):
        reader("f", value)


def test_the_readers_read_their_kind():
    assert int_field("f", 3, 1, 64) == 3 and bool_field("f", False) is False
    assert float_field("f", 7) == 7.0 and isinstance(float_field("f", 7), float) and window_field("f", 128) == 128
    with pytest.raises(ConfigError, match=r"field 'f' must be an integer in \[1, 64\], got 0"):
        int_field("f", 0, 1, 64)


# -- Step-3.5 ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["layer_types", "rope_theta", "partial_rotary_factors", "swiglu_limits",
                                  "swiglu_limits_shared"])
def test_step_per_layer_lists_longer_than_the_layers_are_refused(name):
    """One entry per layer, MTP layers included (4 here): a fifth entry says the counts and
    the lists disagree, and which entry is an MTP layer's would be a guess."""
    d = step.release_config()
    d[name] = d[name] + [d[name][-1]]
    with pytest.raises(ConfigError, match=rf"field '{name}' expected a list of 4 entries .* got 5 entries"):
        MtpConfig.from_dict(d)


@pytest.mark.parametrize("window", [0, None, "absent", True, "6"])
def test_step_sliding_layers_need_a_window(window):
    d = step.release_config()
    if window == "absent":
        del d["sliding_window"]
    else:
        d["sliding_window"] = window
    with pytest.raises(ConfigError, match=r"field 'sliding_window' expected a sliding window, an integer in \[1, "
                                          r"2\^31 - 1\] \(layer_types\[1\] \(MTP module 0\) is sliding_attention\)"):
        MtpConfig.from_dict(d)


def test_step_transformers_form_sliding_layers_need_a_window():
    with pytest.raises(ConfigError, match=r"'sliding_window' expected a sliding window.*mtp_layer_types\[0\] is "
                                          r"sliding_attention.*got int 0"):
        MtpConfig.from_dict(step.tf_config(sliding_window=0))


def test_step_full_attention_modules_need_no_window():
    types = ["full_attention", "full_attention", "full_attention", "full_attention"]
    d = step.release_config(types=types, sliding_window=None)
    del d["rope_scaling"]
    assert [MtpConfig.from_dict(d).block(m).sliding_window for m in range(3)] == [0, 0, 0]


@pytest.mark.parametrize("entry,got", [("7", r"string '7'"), (True, "bool True"), ("x", "string 'x'"),
                                       ([1], r"list \[1\]"), ({}, r"object \{\}"), (-1.0, None)])
@pytest.mark.parametrize("name", ["swiglu_limits", "swiglu_limits_shared"])
def test_step_swiglu_limit_entries_are_numbers(name, entry, got):
    d = step.release_config()
    d[name] = [0.0, 0.0, entry, 0.0]
    match = (rf"field '{name}\[2\]' expected a finite number, got {got}" if got
             else rf"field '{name}\[2\]' must be in \[0, 1e\+06\], got -1.0")
    with pytest.raises(ConfigError, match=match):
        MtpConfig.from_dict(d)


def test_step_swiglu_limit_entries_null_and_numbers_load():
    d = step.release_config(swiglu_limits=[None, 0, 7, 1.5], swiglu_limits_shared=[0.0, None, 16, None])
    cfg = MtpConfig.from_dict(d)
    assert [(cfg.block(m).swiglu_clamp, cfg.block(m).swiglu_clamp_shared) for m in range(3)] == [
        (0.0, 0.0), (7.0, 16.0), (1.5, 0.0)]


@pytest.mark.parametrize("over,match", [
    (dict(use_head_wise_attn_gate="false"), r"field 'use_head_wise_attn_gate' expected true or false, got string"),
    (dict(moe_layers_enum=[1.5]), r"field 'moe_layers_enum\[0\]' expected an integer .* got float 1.5"),
    (dict(moe_layers_enum=[True]), r"field 'moe_layers_enum\[0\]' expected an integer .* got bool True"),
    (dict(moe_layers_enum="1,-3"), r"field 'moe_layers_enum' expected layer indices"),
    (dict(rope_theta=[1e4, "1e4", 1e4, 1e4]), r"field 'rope_theta\[1\]' expected a finite number, got string"),
    (dict(partial_rotary_factors=[1.0, True, 1.0, 1.0]),
     r"field 'partial_rotary_factors\[1\]' expected a finite number, got bool True"),
    (dict(use_moe_router_bias="true"), r"field 'router_bias' expected bool, got str"),
])
def test_step_other_fields_are_typed(over, match):
    with pytest.raises(ConfigError, match=match):
        MtpConfig.from_dict(step.release_config(**over))


def test_step_a_module_without_its_own_head_beside_siblings_with_theirs_is_refused(tmp_path):
    """The release gives each module its own head; one missing would silently draft with lm_head."""
    path = step._ckpt(tmp_path, step.release_config(), seed=3)
    raw = read_tensors(path)
    del raw["model.layers.2.transformer.shared_head.output.weight"]
    save_file(raw, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"'model.layers.2.transformer.shared_head.output.weight' is missing "
                                              r".*module\(s\) \[0, 2\] have their own LM head and module 1 has none"):
        MultiModuleMtpHead.from_pretrained(path, backend="numpy")


def test_modules_without_own_heads_all_read_the_target_head(tmp_path):
    path = step._ckpt(tmp_path, step.release_config(), seed=3)
    raw = read_tensors(path)
    for m in range(3):
        del raw[f"model.layers.{1 + m}.transformer.shared_head.output.weight"]
    save_file(raw, str(path / "model.safetensors"))
    prop = MultiModuleMtpHead.from_pretrained(path, backend="numpy")
    assert all(np.array_equal(prop.modules[m].w.head, raw["lm_head.weight"]) for m in range(3))


def test_a_module_without_its_own_embedding_beside_siblings_with_theirs_is_refused(tmp_path):
    path = write_synthetic_checkpoint(tmp_path, tiny_config(), seed=1, own_embed=True)
    raw = read_tensors(path)
    del raw["model.layers.4.embed_tokens.weight"]
    save_file(raw, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"'model.layers.4.embed_tokens.weight' is missing .* module 2 has none"):
        MultiModuleMtpHead.from_pretrained(path, backend="numpy")


# -- MiMo-V2-Flash, LongCat-Flash ------------------------------------------------------------------

@pytest.mark.parametrize("over,match", [
    (dict(num_nextn_predict_layers=0), r"field 'num_nextn_predict_layers' must be an integer in \[1, 64\], got 0"),
    (dict(num_nextn_predict_layers=False), r"field 'num_nextn_predict_layers' expected an integer .* got bool False"),
    (dict(num_nextn_predict_layers="3"), r"field 'num_nextn_predict_layers' expected an integer .* got string '3'"),
    (dict(sliding_window=0), r"field 'sliding_window' expected a sliding window, .* got int 0"),
    (dict(sliding_window=None, sliding_window_size=0), r"field 'sliding_window_size' expected a sliding window"),
    (dict(add_swa_attention_sink_bias="false"),
     r"field 'add_swa_attention_sink_bias' expected true or false, got string 'false'"),
    (dict(add_swa_attention_sink_bias=1), r"field 'add_swa_attention_sink_bias' expected true or false, got int 1"),
    (dict(qk_layernorm="false"), r"field 'qk_layernorm' expected true or false"),
])
def test_mimo_v2_fields_are_typed(over, match):
    with pytest.raises(ConfigError, match=match):
        MtpConfig.from_dict(mimo_v2.release_config(**over))


def test_mimo_v2_absent_module_count_is_three_and_sinks_read_as_given():
    d = mimo_v2.release_config(add_swa_attention_sink_bias=False)
    d.pop("num_nextn_predict_layers", None)
    cfg = MtpConfig.from_dict(d)
    assert cfg.num_modules == 3 and not cfg.block(0).attn_sinks


@pytest.mark.parametrize("over,match", [
    (dict(num_nextn_predict_layers=True), r"field 'num_nextn_predict_layers' expected an integer.* got bool True"),
    (dict(num_nextn_predict_layers=1.0), r"field 'num_nextn_predict_layers' expected an integer.* got float 1.0"),
    (dict(mla_scale_q_lora="false"), r"field 'mla_scale_q_lora' expected true or false, got string 'false'"),
    (dict(num_layers=True), r"field 'num_layers' expected an integer"),
    (dict(ffn_hidden_size="12288"), r"field 'ffn_hidden_size' expected an integer"),
])
def test_longcat_fields_are_typed(over, match):
    with pytest.raises(ConfigError, match=match):
        MtpConfig.from_dict(dict(LONGCAT, **over))


def test_use_sliding_window_is_a_switch():
    d = tiny_config().to_dict()
    with pytest.raises(ConfigError, match=r"field 'use_sliding_window' expected true or false, got string 'false'"):
        MtpConfig.from_dict(dict(d, use_sliding_window="false", sliding_window=8))


# -- mtp_blocks given as pairs ---------------------------------------------------------------------

@pytest.mark.parametrize("pairs", [[["sliding_window", 4], ["sliding_window", 8]],
                                   [["sliding_window", 8], ["sliding_window", 4]]])
def test_mtp_blocks_pairs_giving_a_field_twice_are_refused(pairs):
    """Sorted pairs kept the larger value; either order is refused now, naming the field."""
    d = dict(tiny_config().to_dict(), mtp_blocks=[pairs, {}, {}])
    with pytest.raises(ConfigError, match=r"mtp_blocks\[0\] gives field 'sliding_window' more than once"):
        MtpConfig.from_dict(d)
    with pytest.raises(ConfigError, match=r"mtp_blocks\[0\] gives field 'sliding_window' more than once"):
        tiny_config(blocks=[[tuple(p) for p in pairs], (), ()])


def test_mtp_blocks_pairs_once_each_load():
    cfg = tiny_config(blocks=[[("sliding_window", 8), ("rope_theta", 5e5)], (), ()])
    assert cfg.block(0).sliding_window == 8 and cfg.block(0).rope_theta == 5e5 and cfg.block(1).sliding_window == 0


# -- FP8 codes and scales ---------------------------------------------------------------------------

FP8_CFG = tiny_config(weight_quant="fp8", fp8_block=(16, 16))
Q = "model.layers.2.self_attn.q_proj.weight"


@pytest.fixture()
def fp8_ckpt(tmp_path):
    return write_synthetic_checkpoint(tmp_path, FP8_CFG, seed=7)


@pytest.mark.parametrize("code", [0x7F, 0xFF])
def test_fp8_nan_codes_are_refused_at_load(fp8_ckpt, code):
    raw = read_tensors(fp8_ckpt)
    bits = raw[Q].view(np.uint8).copy()
    bits[3, 5] = code
    raw[Q] = bits.view(raw[Q].dtype)
    save_file(raw, str(fp8_ckpt / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"tensor '{Q}' in .*: 1 FP8 E4M3 code\(s\) are NaN \(0x7F / 0xFF; "
                                              r"first at \[3, 5\]\)"):
        MultiModuleMtpHead.from_pretrained(fp8_ckpt, backend="numpy")


@pytest.mark.parametrize("value", [1e38, np.inf, np.nan])
def test_fp8_scales_that_overflow_are_refused_at_load(fp8_ckpt, value):
    raw = read_tensors(fp8_ckpt)
    scale = raw[Q + "_scale_inv"].copy()
    scale[1, 2] = value
    raw[Q + "_scale_inv"] = scale
    save_file(raw, str(fp8_ckpt / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"tensor '{Q}_scale_inv'"):
        MultiModuleMtpHead.from_pretrained(fp8_ckpt, backend="numpy")


def test_the_fp8_scans():
    data = np.zeros((4, 70), np.uint8)
    assert nan_codes(data) == (0, None)
    data[2, 9], data[3, 0] = 0xFF, 0x7F
    assert nan_codes(data, chunk=16) == (2, (2, 9))
    data[2, 9] = 0x7E                                  # 448: the largest finite code
    assert nan_codes(data) == (1, (3, 0))
    assert bad_scales(np.array([[1.0, 7e35], [7.7e35, np.nan]], np.float32)) == (2, (1, 0))
    with pytest.raises(ValueError, match=r"scale: expected finite values, got 1 non-finite or above 7\.596e\+35"):
        Fp8Weight(np.zeros((2, 2), np.uint8), np.array([1.0, 1e38], np.float32), None)
    big = Fp8Weight(np.full((1, 1), 0x7E, np.uint8), np.array([7.5e35], np.float32), None)
    assert np.isfinite(big.dequantize()).all()
