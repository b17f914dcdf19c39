"""Checkpoint loading: layouts, fallbacks, single copies of [V, H] matrices, clear errors."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from mtpkern import CheckpointError, write_synthetic_checkpoint
from mtpkern.backends import get_backend
from mtpkern.config import tiny_config
from mtpkern.weights import load_weights, synthetic_tensors

CFG = tiny_config()
NP = get_backend("numpy")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_single_and_sharded_load_the_same(tmp_path, dtype):
    a = write_synthetic_checkpoint(tmp_path / "one", CFG, seed=1, dtype=dtype)
    b = write_synthetic_checkpoint(tmp_path / "three", CFG, seed=1, dtype=dtype, shards=3)
    assert (b / "model.safetensors.index.json").exists() and len(list(b.glob("*.safetensors"))) == 3
    wa, wb = load_weights(a, CFG, NP), load_weights(b, CFG, NP)
    for ma, mb in zip(wa.modules, wb.modules):
        for name in ("eh_proj", "w_qkv", "b_qkv", "experts_w13", "experts_w2", "shared_w13", "gate_bias"):
            np.testing.assert_array_equal(getattr(ma, name), getattr(mb, name))
    assert wa.nbytes == wb.nbytes > 0


def test_stacked_layouts_follow_the_keys(tmp_path):
    path = write_synthetic_checkpoint(tmp_path, CFG, seed=2, dtype="float32")
    t = load_file(str(path / "model.safetensors"))
    w = load_weights(path, CFG, NP).modules[1]
    p = f"model.layers.{CFG.num_hidden_layers + 1}."
    np.testing.assert_array_equal(w.w_qkv, np.concatenate([t[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]))
    np.testing.assert_array_equal(w.experts_w13[5], np.concatenate(
        [t[p + "mlp.experts.5.gate_proj.weight"], t[p + "mlp.experts.5.up_proj.weight"]]))
    np.testing.assert_array_equal(w.experts_w2[5], t[p + "mlp.experts.5.down_proj.weight"])


def test_bf16_weights_load_exactly(tmp_path):
    path = write_synthetic_checkpoint(tmp_path, CFG, seed=3, dtype="bfloat16")
    ref = synthetic_tensors(CFG, seed=3)
    w = load_weights(path, CFG, NP).modules[0]
    want = ref[f"model.layers.{CFG.num_hidden_layers}.eh_proj.weight"].astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(w.eh_proj, want)


def test_vocab_matrices_are_held_once(tmp_path):
    """Fallbacks to the target's matrices, and per-module copies with equal contents, are one array."""
    w = load_weights(write_synthetic_checkpoint(tmp_path / "a", CFG), CFG, NP)
    assert w.distinct_vocab_matrices == 2
    assert all(m.embed is w.modules[0].embed and m.head is w.modules[0].head for m in w.modules)
    w2 = load_weights(write_synthetic_checkpoint(tmp_path / "b", CFG, own_embed=True, own_head=True), CFG, NP)
    assert w2.distinct_vocab_matrices == 2
    assert all(m.embed is w2.modules[0].embed and m.head is w2.modules[0].head for m in w2.modules)


def test_tied_embeddings(tmp_path):
    cfg = tiny_config(tie_word_embeddings=True)
    path = write_synthetic_checkpoint(tmp_path, cfg)
    t = load_file(str(path / "model.safetensors"))
    del t["lm_head.weight"]
    save_file(t, str(path / "model.safetensors"))
    w = load_weights(path, cfg, NP)
    assert w.distinct_vocab_matrices == 1 and w.modules[0].head is w.modules[0].embed


def _rewrite(path, fn):
    t = load_file(str(path / "model.safetensors"))
    fn(t)
    save_file(t, str(path / "model.safetensors"))


P0 = f"model.layers.{CFG.num_hidden_layers}."


@pytest.mark.parametrize("edit,msg", [
    (lambda t: t.pop(P0 + "self_attn.k_proj.weight"), f"tensor '{P0}self_attn.k_proj.weight' is missing"),
    (lambda t: t.update({P0 + "enorm.weight": np.ones(7, np.float32)}), f"tensor '{P0}enorm.weight' in "),
    (lambda t: t.update({P0 + "hnorm.weight": np.ones(64, np.int32)}), "model.safetensors: expected dtype BF16 or F32, got I32"),
    (lambda t: t.update({P0 + "mlp.gate.weight": np.full((8, 64), np.nan, np.float32)}), "holds NaN or infinite values"),
    (lambda t: [t.pop("model.embed_tokens.weight")], "module 0 embedding: none of the tensors"),
])
def test_checkpoint_errors_name_the_tensor(tmp_path, edit, msg):
    path = write_synthetic_checkpoint(tmp_path, CFG, dtype="float32")
    _rewrite(path, edit)
    with pytest.raises(CheckpointError) as e:
        load_weights(path, CFG, NP)
    assert msg in str(e.value)


def test_truncated_and_missing_files(tmp_path):
    path = write_synthetic_checkpoint(tmp_path / "t", CFG)
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_weights(path, CFG, NP)
    sharded = write_synthetic_checkpoint(tmp_path / "s", CFG, shards=2)
    next(iter(sorted(sharded.glob("model-*.safetensors")))).unlink()
    with pytest.raises(CheckpointError, match="does not exist"):
        load_weights(sharded, CFG, NP)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no model.safetensors.index.json and no"):
        load_weights(tmp_path / "empty", CFG, NP)
    bad_index = write_synthetic_checkpoint(tmp_path / "bi", CFG, shards=2)
    (bad_index / "model.safetensors.index.json").write_text(json.dumps({"nope": 1}))
    with pytest.raises(CheckpointError, match="not a valid safetensors index"):
        load_weights(bad_index, CFG, NP)


def test_target_norm_needed_only_when_asked(tmp_path):
    path = write_synthetic_checkpoint(tmp_path, CFG)
    _rewrite(path, lambda t: t.pop("model.norm.weight"))
    assert load_weights(path, CFG, NP).target_norm is None
    with pytest.raises(CheckpointError, match="apply_target_norm=True needs the target's 'model.norm.weight'"):
        load_weights(path, CFG, NP, apply_target_norm=True)
