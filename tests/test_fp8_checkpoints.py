"""FP8 checkpoints as DeepSeek-V3 / GLM FP8 releases store them: projections in FP8 E4M3
with block-128-style ``weight_scale_inv`` or per-channel ``weight_scale``, loaded at one
byte per weight and drafting like the same weights dequantized to FP32."""

from __future__ import annotations

import dataclasses
import json

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from conftest import run_rounds
from mtpkern import CheckpointError, MtpConfig, MultiModuleMtpHead, write_synthetic_checkpoint
from mtpkern.config import tiny_config
from mtpkern.quant import Fp8Weight
from mtpkern.weights import read_tensors

H, V = 64, 301
BASE = tiny_config()
KINDS = {"block": (16, 16), "channel": (0, 0)}


def _cfg(kind: str, **kw) -> MtpConfig:
    return dataclasses.replace(BASE, weight_quant="fp8", fp8_block=KINDS[kind], **kw)


def _dequantized_copy(src, dst, cfg: MtpConfig):
    """The FP8 checkpoint's weights, dequantized to FP32, as a plain checkpoint."""
    raw = read_tensors(src)
    block = cfg.fp8_block if cfg.fp8_block != (0, 0) else None
    out = {}
    for k, a in raw.items():
        if k.endswith(("_scale", "_scale_inv")):
            continue
        if a.dtype == np.dtype(ml_dtypes.float8_e4m3fn):
            sk = k + ("_scale_inv" if block else "_scale")
            a = Fp8Weight(a.view(np.uint8), raw[sk], block).dequantize()
        out[k] = np.ascontiguousarray(a.astype(np.float32))
    dst.mkdir()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    plain = dataclasses.replace(cfg, weight_quant="", fp8_block=(0, 0))
    (dst / "config.json").write_text(json.dumps(plain.to_dict()))
    return dst


@pytest.mark.parametrize("kind", list(KINDS))
def test_release_layout_and_config(tmp_path, kind):
    cfg = _cfg(kind)
    path = write_synthetic_checkpoint(tmp_path, cfg, seed=3)
    raw = read_tensors(path)
    q = "model.layers.2.self_attn.q_proj.weight"
    assert raw[q].dtype == np.dtype(ml_dtypes.float8_e4m3fn)
    assert (q + ("_scale_inv" if kind == "block" else "_scale")) in raw
    for dense in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.2.enorm.weight",
                  "model.layers.2.mlp.gate.e_score_correction_bias"):
        assert raw[dense].dtype != np.dtype(ml_dtypes.float8_e4m3fn), dense
    d = json.loads((path / "config.json").read_text())
    assert d["quantization_config"]["quant_method"] == ("fp8" if kind == "block" else "compressed-tensors")
    assert MtpConfig.from_json(path / "config.json") == cfg


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_fp8_drafts_as_its_dequantized_weights(tmp_path, backend, kind):
    """Power-of-two scales: the dequantized weights are exact in FP32, so the FP8 run
    and the FP32 run compute on the same weights (the cpu kernels in another order)."""
    cfg = _cfg(kind)
    fp8 = write_synthetic_checkpoint(tmp_path / "fp8", cfg, seed=4, pow2_scales=True)
    plain = _dequantized_copy(fp8, tmp_path / "fp32", cfg)
    for mode in ("exact", "draft"):
        assert run_rounds(fp8, backend, mode)[1] == run_rounds(plain, backend, mode)[1]


def test_fp8_stays_one_byte_per_weight_on_the_cpu_backend(tmp_path):
    cfg = _cfg("block")
    fp8 = write_synthetic_checkpoint(tmp_path / "fp8", cfg, seed=5)
    bf16 = write_synthetic_checkpoint(tmp_path / "bf16", BASE, seed=5)
    w8 = MultiModuleMtpHead.from_pretrained(fp8, backend="cpu").memory().weights
    w16 = MultiModuleMtpHead.from_pretrained(bf16, backend="cpu").memory().weights
    M, Hq, Hkv, D, E, I = 3, 4, 2, 16, 8, 32
    proj = M * (H * 2 * H + (Hq + 2 * Hkv) * D * H + H * Hq * D + E * H + E * 3 * I * H + 3 * I * H)
    assert w16 - w8 >= 0.8 * proj                # ~one byte per projection weight saved, less the scales


def test_mimo_layout_in_fp8_swaps_the_halves_with_their_scales(tmp_path):
    mimo = dataclasses.replace(tiny_config(n_routed_experts=0, intermediate_size=48, use_qk_norm=False,
                                           partial_rotary_factor=1.0, num_nextn_predict_layers=1,
                                           family="mimo"), weight_quant="fp8", fp8_block=(16, 16))
    path = write_synthetic_checkpoint(tmp_path / "mimo", mimo, seed=6, pow2_scales=True)
    assert "model.mtp_layers.0.input_proj.weight_scale_inv" in read_tensors(path)
    canon = write_synthetic_checkpoint(tmp_path / "canon", dataclasses.replace(mimo, family=""), seed=6,
                                       pow2_scales=True)
    assert run_rounds(path, "numpy")[1] == run_rounds(canon, "numpy")[1]


def test_broken_fp8_checkpoints_are_named(tmp_path):
    cfg = _cfg("block")
    path = write_synthetic_checkpoint(tmp_path, cfg, seed=7)
    raw = read_tensors(path)
    q = "model.layers.2.self_attn.q_proj.weight"
    missing = {k: v for k, v in raw.items() if k != q + "_scale_inv"}
    save_file(missing, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=f"'{q}_scale_inv' is missing.*scales of the FP8 weight"):
        MultiModuleMtpHead.from_pretrained(path, backend="numpy")
    bad = dict(raw, **{q + "_scale_inv": np.ones((3, 3), np.float32)})
    save_file(bad, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=f"'{q}_scale_inv'.*scale: expected shape"):
        MultiModuleMtpHead.from_pretrained(path, backend="numpy")


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_compressed_tensors_block_scales_under_weight_scale(tmp_path, backend):
    """compressed-tensors' FP8 with ``strategy: "block"`` names each block scale tensor
    ``weight_scale`` (DeepSeek / GLM FP8 releases: ``weight_scale_inv``, the same multiplier):
    the same codes and scales under that name and that config draft as the release form, and
    ``mtpkern info`` passes its headers."""
    from mtpkern.cli import main

    cfg = _cfg("block")
    src = write_synthetic_checkpoint(tmp_path / "release", cfg, seed=6, pow2_scales=True)
    raw = read_tensors(src)
    renamed = {(k[:-len("_inv")] if k.endswith("_scale_inv") else k): np.ascontiguousarray(a) for k, a in raw.items()}
    assert any(k.endswith("weight_scale") for k in renamed) and not any(k.endswith("_scale_inv") for k in renamed)
    dst = tmp_path / "ct"
    dst.mkdir()
    save_file(renamed, str(dst / "model.safetensors"), metadata={"format": "pt"})
    d = json.loads((src / "config.json").read_text())
    d["quantization_config"] = {"quant_method": "compressed-tensors", "format": "float-quantized",
                                "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                                    "num_bits": 8, "type": "float", "strategy": "block",
                                    "block_structure": list(cfg.fp8_block)}}}}
    (dst / "config.json").write_text(json.dumps(d))
    assert main(["info", str(dst)]) == 0
    for mode in ("exact", "draft"):
        assert run_rounds(dst, backend, mode)[1] == run_rounds(src, backend, mode)[1]
