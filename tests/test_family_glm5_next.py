"""GLM-5.3 (mtpkern/models/glm5_next.py): its config (a vision-language wrapper whose
``text_config`` holds the text model) reads as an MLA block without RoPE with the pooled
DSA indexer, no hyper-connections, clamps of the gate and vLLM's position-0 mask; a small
checkpoint in its layout (``model.language_model.layers.{L}.``) drafts and keeps the KV the
float64 oracle does on numpy, cpu and the CUDA kernels on the emulator (the pooled indexer:
kernels/dsa.cu)."""

from __future__ import annotations

import copy

import pytest

import test_oracle
from conftest import MLA_FIELDS
from mtpkern import ConfigError, MtpConfig, MultiModuleMtpHead, write_synthetic_checkpoint
from mtpkern.config import tiny_config
from mtpkern.testing import reference_weights
from mtpkern.weights import read_tensors

TEXT = {"model_type": "glm5_next_text", "vocab_size": 154880, "hidden_size": 4096, "intermediate_size": 12288,
        "moe_intermediate_size": 2048, "num_hidden_layers": 45, "num_attention_heads": 64, "num_key_value_heads": 64,
        "n_shared_experts": 1, "n_routed_experts": 288, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
        "q_lora_rank": 1536, "qk_rope_head_dim": 0, "v_head_dim": 256, "qk_nope_head_dim": 256, "n_group": 1,
        "topk_group": 1, "num_experts_per_tok": 8, "norm_topk_prob": True, "hidden_act": "silu",
        "max_position_embeddings": 1048576, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "head_dim": 0,
        "attention_bias": False, "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 32,
        "swiglu_limit": 10.0, "linear_head_dim": 128, "linear_num_heads": 64, "linear_conv_kernel_dim": 4,
        "linear_lower_bound": -5.0, "hc_mult": 4, "hc_eps": 1e-6, "hc_sinkhorn_iters": 20, "index_kpool": 16,
        "index_kpool_always_select_tail": True, "layer_types": ["linear_attention"] * 3 + ["indexed_attention"],
        "mlp_layer_types": ["dense"] * 3 + ["sparse"] * 42, "indexer_types": ["full"] * 45,
        "scoring_func": "sigmoid", "topk_method": "noaux_tc", "router_aux_loss_coef": 0.001}
RELEASE = {"architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next", "text_config": TEXT,
           "vision_config": {"depth": 24}, "image_token_id": 154854}


def test_the_release_config_reads_as_the_mtp_block():
    cfg = MtpConfig.from_dict(copy.deepcopy(RELEASE))
    b = cfg.block(0)
    assert cfg.family == "glm5_next_text" and cfg.layer_index(0) == 45 and cfg.hc_mult == 1
    assert b.mla and b.qk_rope_head_dim == 0 and b.head_dim == 256 and b.kv_lora_rank == 512
    assert (b.index_topk, b.index_n_heads, b.index_head_dim, b.kpool, b.index_kpool_tail) == (2048, 32, 128, 16, True)
    assert b.index_width == 256 and b.index_list_width == 2048 + 15
    assert (b.swiglu_clamp, b.swiglu_clamp_shared, b.swiglu_clamp_gate) == (10.0, 10.0, True)
    assert cfg.embed_mask_pos0 and cfg.n_group == 1 and cfg.num_experts_per_tok == 8
    assert "NoPE" in cfg.describe() and "pools of 16 + tail" in cfg.describe()
    assert MtpConfig.from_dict(cfg.to_dict()) == cfg
    d = copy.deepcopy(RELEASE)
    d["text_config"]["num_experts_per_token"] = 7           # vLLM's name, disagreeing with transformers'
    with pytest.raises(ConfigError, match="num_experts_per_token"):
        MtpConfig.from_dict(d)
    d = copy.deepcopy(RELEASE)
    d["text_config"]["index_kpool_always_select_tail"] = False
    with pytest.raises(ConfigError, match="index_kpool_always_select_tail expected true"):
        MtpConfig.from_dict(d)


#: GLM-5.3's block at test size: MLA without RoPE (P 12), 2 indexer heads of 16, 4 keys in pools of 2
G53 = dict(MLA_FIELDS, family="glm5_next_text", qk_rope_head_dim=0, head_dim=12, rope_scaling=None,
           index_topk=4, index_n_heads=2, index_head_dim=16, index_kpool=2, n_group=1, topk_group=1,
           swiglu_clamp=1.5, swiglu_clamp_shared=1.5, swiglu_clamp_gate=True, embed_mask_pos0=True)


@pytest.fixture(scope="module")
def g53_ckpt(tmp_path_factory):
    cfg = tiny_config(**G53)
    path = write_synthetic_checkpoint(tmp_path_factory.mktemp("g53"), cfg, seed=13, dtype="float32")
    return path, cfg, reference_weights(path)


def test_the_layout_is_the_text_tower_s(g53_ckpt):
    path, cfg, _ = g53_ckpt
    keys = set(read_tensors(path))
    p = f"model.language_model.layers.{cfg.layer_index(0)}."
    for k in ("eh_proj.weight", "self_attn.kv_a_proj_with_mqa.weight", "self_attn.indexer.index_kpool_compress_gate",
              "self_attn.indexer.index_kpool_compress_ape", "mlp.experts.0.gate_proj.weight", "shared_head.norm.weight"):
        assert p + k in keys, k
    assert "model.language_model.embed_tokens.weight" in keys and not any(k.startswith("model.layers.") for k in keys)


def test_info_names_the_family_the_block_and_the_cache_bytes(g53_ckpt, capsys):
    """``mtpkern info`` of the release layout: the family, the block (NoPE MLA, the pooled
    indexer with its tail), each module under the text tower's prefix, and the bytes per token:
    the latent row (40 values) and the indexer plane's key and gate scores (2 x 16 values)."""
    from mtpkern.cli import main

    path, cfg, _ = g53_ckpt
    assert main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    assert "GLM-5.3: M=3" in out and "position-0 embedding mask" in out
    assert "MLA Hq=4 L=40 P=12 R=0" in out and "DSA top-4 Hi=2 Di=16 pools of 2 + tail NoPE" in out
    assert "KV per token and module: 144 B (one latent row, with DSA's indexer key and its gate scores (64 B" in out
    for m in range(cfg.num_modules):
        assert f"module {m}: model.language_model.layers.{cfg.layer_index(m)}.*" in out


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_drafts_and_kv_equal_the_oracle(g53_ckpt, backend):
    path, cfg, weights = g53_ckpt
    prop = MultiModuleMtpHead.from_pretrained(path, backend=backend, kv_mode="exact", block_size=4, num_blocks=96,
                                              prefill_chunk=7)
    assert prop.chain == "postnorm"
    test_oracle.run_scenario(prop, cfg, weights, 5, 20, [(3, 1.0), (3, 0.4), (2, 0.0), (3, 1.0)], "postnorm", None)


def test_cuda_drafts_and_kv_equal_the_oracle(g53_ckpt, emulator):
    """The pooled indexer's key write and selection on the kernels (the emulator, an FP32 KV):
    the drafts and KV the float64 oracle has."""
    from cuda_emu import emu_backend
    path, cfg, weights = g53_ckpt
    prop = MultiModuleMtpHead.from_pretrained(path, backend=emu_backend.backend("float32"), kv_mode="exact",
                                              block_size=4, num_blocks=96, prefill_chunk=7)
    assert prop.modules[0].pool.index_k.shape[2] == 2 * 16
    test_oracle.run_scenario(prop, cfg, weights, 5, 20, [(3, 1.0), (3, 0.4), (2, 0.0), (3, 1.0)], "postnorm", None)
    assert prop.step_runner.counts["executed"] + prop.step_runner.counts["replayed"] > 0, dict(prop.step_runner.counts)
