"""Model families (mtpkern/models/): release layouts load unchanged and compute what
their reference computes.

Per family: a synthetic checkpoint written with the release's config fields and
tensor names loads unchanged; the same weights in the canonical layout draft the
same tokens (the name map and the folds are exact); and the family's own math,
computed in float64 from the raw release tensors as its reference implementation
does (vLLM's ``mimo_mtp.py`` for MiMo), equals the backend's.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import rand_hiddens, run_rounds
from mtpkern import ConfigError, MtpConfig, MultiModuleMtpHead, write_synthetic_checkpoint
from mtpkern.config import tiny_config
from mtpkern.models import FAMILIES, family
from mtpkern.weights import release_layout, synthetic_tensors

H, V = 64, 301

#: MiMo-7B-shaped: a dense Qwen2 block with biased q/k/v, one module; vLLM's position-0 mask on,
#: as the family reads its release config (which has no such field)
MIMO = tiny_config(n_routed_experts=0, intermediate_size=48, use_qk_norm=False, partial_rotary_factor=1.0,
                   attention_bias=True, num_nextn_predict_layers=1, rope_theta=640000.0, family="mimo",
                   embed_mask_pos0=True)


def mimo_release_config(cfg: MtpConfig) -> dict:
    """config.json as MiMo-7B releases it (fields of the published file, tiny sizes)."""
    return {
        "architectures": ["MiMoForCausalLM"], "model_type": "mimo", "attention_bias": True,
        "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu",
        "hidden_size": cfg.hidden_size, "initializer_range": 0.02, "intermediate_size": cfg.intermediate_size,
        "max_position_embeddings": cfg.max_position_embeddings, "max_window_layers": 36,
        "num_attention_heads": cfg.num_attention_heads, "num_hidden_layers": cfg.num_hidden_layers,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
        "num_nextn_predict_layers": cfg.num_modules, "rms_norm_eps": cfg.rms_norm_eps, "rope_scaling": None,
        "rope_theta": cfg.rope_theta, "sliding_window": 32768, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "transformers_version": "4.40.1", "use_cache": True,
        "use_sliding_window": False, "vocab_size": cfg.vocab_size,
    }


def _canonical(cfg: MtpConfig) -> MtpConfig:
    """The same config read in the canonical layout."""
    return dataclasses.replace(cfg, family="")


@pytest.fixture(scope="module")
def mimo_ckpt(tmp_path_factory):
    path = write_synthetic_checkpoint(tmp_path_factory.mktemp("mimo"), MIMO, seed=5, dtype="float32")
    (path / "config.json").write_text(json.dumps(mimo_release_config(MIMO)))
    return path


def test_every_family_is_registered_with_its_names():
    assert set(FAMILIES) >= {"glm4_moe", "mimo"}
    assert family("mimo").key(36, 0, "eh_proj.weight") == "model.mtp_layers.0.input_proj.weight"
    assert family("mimo").key(36, 0, "self_attn.q_proj.bias") == "model.mtp_layers.0.self_attn.q_proj.bias"
    assert family("glm4_moe").key(46, 0, "enorm.weight") == "model.layers.46.enorm.weight"
    with pytest.raises(ValueError, match="family: expected one of"):
        family("llama")


def test_mimo_release_layout_loads_unchanged(mimo_ckpt):
    keys = set(load_file(str(mimo_ckpt / "model.safetensors")))
    for name in ("token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm", "input_layernorm",
                 "post_attention_layernorm", "self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj"):
        assert any(k.startswith(f"model.mtp_layers.0.{name}") for k in keys), name
    assert not any(k.startswith("model.layers.") for k in keys)
    cfg = MtpConfig.from_json(mimo_ckpt / "config.json")
    assert cfg.family == "mimo" and cfg.attention_bias and not cfg.is_moe and cfg.rotary_dim == cfg.head_dim
    assert cfg.describe().startswith("MiMo-7B: ")
    MultiModuleMtpHead.from_pretrained(mimo_ckpt, backend="numpy").check_invariants()


@pytest.mark.parametrize("mode", ["exact", "draft"])
def test_mimo_drafts_as_the_same_weights_in_the_canonical_layout(mimo_ckpt, tmp_path, mode):
    canon = write_synthetic_checkpoint(tmp_path, _canonical(MIMO), seed=5, dtype="float32")
    # the canonical layout's chain default is prenorm; MiMo's postnorm (one module: no effect here)
    assert run_rounds(mimo_ckpt, mode=mode)[1] == run_rounds(canon, mode=mode, chain="postnorm")[1]


def test_mimo_takes_vllms_position_0_mask_and_post_norm_chain_by_default(mimo_ckpt):
    """vLLM's mimo_mtp.py (the reference: transformers has no MiMo MTP generation) zeroes the
    embedding at position 0 and returns final_layernorm(y): the release config, which never
    names the mask, reads it on, the proposer chains postnorm, and a config can say false."""
    d = mimo_release_config(MIMO)
    assert "embed_mask_pos0" not in d and MtpConfig.from_dict(d).embed_mask_pos0
    prop = MultiModuleMtpHead.from_pretrained(mimo_ckpt, backend="numpy")
    assert prop.config.embed_mask_pos0 and prop.chain == "postnorm"
    off = MtpConfig.from_dict(dict(d, embed_mask_pos0=False))
    assert not off.embed_mask_pos0 and off.to_dict()["embed_mask_pos0"] is False
    # the canonical layout (no model_type) keeps MtpConfig's defaults: no mask, prenorm
    assert not MtpConfig.from_dict({k: v for k, v in d.items() if k not in ("model_type", "architectures")}
                                   ).embed_mask_pos0 and family("").chain == "prenorm"


def _rms64(x, w, eps):
    x = np.asarray(x, np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * np.asarray(w, np.float64)


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_mimo_input_projection_reads_hidden_then_embedding(mimo_ckpt, backend):
    """vLLM's MiMo: x = input_proj @ concat(hidden_layernorm(h), token_layernorm(E[t])),
    from the raw release tensors in float64, equals the backend's mtp_input."""
    raw = load_file(str(mimo_ckpt / "model.safetensors"))
    pre = "model.mtp_layers.0."
    rng = np.random.default_rng(3)
    toks = rng.integers(0, V, 5).astype(np.int32)
    g = rand_hiddens(rng, 5, H)
    eps = MIMO.rms_norm_eps
    cat = np.concatenate([_rms64(g, raw[pre + "hidden_layernorm.weight"], eps),
                          _rms64(raw["model.embed_tokens.weight"][toks], raw[pre + "token_layernorm.weight"], eps)], 1)
    want = cat @ np.asarray(raw[pre + "input_proj.weight"], np.float64).T
    prop = MultiModuleMtpHead.from_pretrained(mimo_ckpt, backend=backend)
    be, w = prop.backend, prop.modules[0].w
    got = be.to_host(be.mtp_input(w.embed, be.from_host(toks), be.from_host(g), w.enorm, w.hnorm, w.eh_proj, eps))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_a_family_feature_the_config_contradicts_is_refused(mimo_ckpt):
    d = mimo_release_config(MIMO)
    d["attention_bias"] = False
    with pytest.raises(ConfigError, match="attention_bias.* every MiMo-7B module has attention_bias = True"):
        MtpConfig.from_dict(d)


def test_release_layout_round_trips_the_canonical_tensors():
    t = synthetic_tensors(MIMO, seed=1)
    out = release_layout(MIMO, t)
    assert len(out) == len(t)
    pre = "model.layers.2."
    np.testing.assert_array_equal(out["model.mtp_layers.0.input_proj.weight"][:, :H], t[pre + "eh_proj.weight"][:, H:])
    assert release_layout(_canonical(MIMO), t).keys() == t.keys()
