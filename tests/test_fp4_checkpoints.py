"""FP4 checkpoints as DeepSeek-V4 releases its routed experts: E2M1 codes two a byte (int8
[N, K / 2], low nibble the even column) with E8M0 scales per 32 weights (``weight_scale_inv``
[N, K / 32]), announced by ``expert_dtype: "fp4"``; the other projections FP8 with E8M0 scales
(``scale_fmt: "ue8m0"``). Loaded at half a byte per expert weight and drafting like the same
weights dequantized (docs/fp4.md)."""

from __future__ import annotations

import dataclasses
import json

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from conftest import run_rounds
from mtpkern import CheckpointError, ConfigError, MtpConfig, MultiModuleMtpHead, write_synthetic_checkpoint
from mtpkern.config import tiny_config
from mtpkern.quant import Fp4Weight, Fp8Weight, unpack_e2m1, pack_e2m1
from mtpkern.weights import check_headers, read_tensors

F8 = np.dtype(ml_dtypes.float8_e4m3fn)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
EXPERT = "model.layers.2.mlp.experts.3.gate_proj.weight"


def _cfg(family: str = "", **kw) -> MtpConfig:
    """tiny_config's MoE modules in DeepSeek-V4's quantized layout, as ``family`` reads its config."""
    cfg = dataclasses.replace(tiny_config(**kw), family=family, weight_quant="fp8", fp8_block=(16, 16),
                              expert_quant="fp4")
    return MtpConfig.from_dict(cfg.to_dict())


def dequantized_copy(src, dst, cfg: MtpConfig, swap_nibbles: bool = False):
    """The checkpoint at ``src`` with every FP4 and FP8 weight dequantized to FP32 (a plain
    checkpoint, its config without quantization). ``swap_nibbles``: FP4 bytes read high nibble
    first, the wrong order (a negative control)."""
    raw = read_tensors(src)
    out = {}
    for k, a in raw.items():
        if k.endswith(("_scale", "_scale_inv")):
            continue
        if a.dtype == np.int8:
            data = a.view(np.uint8)
            if swap_nibbles:
                data = pack_e2m1(unpack_e2m1(data).reshape(*data.shape, 2)[..., ::-1].reshape(*data.shape[:-1], -1))
            a = Fp4Weight(data, raw[k + "_scale_inv"]).dequantize()
        elif a.dtype == F8:
            a = Fp8Weight(a.view(np.uint8), raw[k + "_scale_inv"], cfg.fp8_block).dequantize()
        out[k] = np.ascontiguousarray(a.astype(np.float32))
    dst.mkdir()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    plain = dataclasses.replace(cfg, weight_quant="", fp8_block=(0, 0), expert_quant="")
    (dst / "config.json").write_text(json.dumps(plain.to_dict()))
    return dst


@pytest.mark.parametrize("family", ["", "deepseek_v3"])
def test_release_layout_and_config(tmp_path, family):
    cfg = _cfg(family)
    path = write_synthetic_checkpoint(tmp_path, cfg, seed=3)
    raw = read_tensors(path)
    assert raw[EXPERT].dtype == np.int8 and raw[EXPERT].shape == (32, 32)          # [I, H / 2]
    s = raw[EXPERT + "_scale_inv"]
    assert s.dtype == E8M0 and s.shape == (32, 2)                                      # [I, H / 32]
    down = "model.layers.2.mlp.experts.3.down_proj.weight"
    assert raw[down].shape == (64, 16) and raw[down + "_scale_inv"].shape == (64, 1)
    q = "model.layers.2.self_attn.q_proj.weight"                                       # FP8, E8M0 scales
    assert raw[q].dtype == F8 and raw[q + "_scale_inv"].dtype == E8M0
    shared = "model.layers.2.mlp.shared_experts.gate_proj.weight"                      # not a routed expert
    assert raw[shared].dtype == F8
    d = json.loads((path / "config.json").read_text())
    qc = d["quantization_config"]
    assert (qc["quant_method"], qc["expert_dtype"], qc["scale_fmt"]) == ("fp8", "fp4", "ue8m0")
    assert MtpConfig.from_json(path / "config.json") == cfg
    problems, _ = check_headers(path, cfg)
    assert problems == []


def test_v4_top_level_expert_dtype_is_read_and_checked(tmp_path):
    d = _cfg().to_dict()
    del d["quantization_config"]["expert_dtype"]
    d["expert_dtype"] = "fp4"                                                          # DeepSeek-V4's place
    assert MtpConfig.from_dict(d).expert_quant == "fp4"
    d["expert_dtype"] = "fp8"                                                          # Flash-Base: FP8 experts
    assert MtpConfig.from_dict(d).expert_quant == ""
    d["quantization_config"]["expert_dtype"] = "fp4"
    with pytest.raises(ConfigError, match="'expert_dtype' \\('fp8'\\) and 'quantization_config.expert_dtype' "
                                          "\\('fp4'\\) disagree"):
        MtpConfig.from_dict(d)
    d["expert_dtype"] = "int4"
    with pytest.raises(ConfigError, match="field 'expert_dtype' expected 'fp4' or 'fp8', got 'int4'"):
        MtpConfig.from_dict(d)
    plain = tiny_config().to_dict()
    plain["expert_dtype"] = "fp4"
    with pytest.raises(ConfigError, match="expert_dtype 'fp4' needs quantization_config.quant_method 'fp8'"):
        MtpConfig.from_dict(plain)


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
@pytest.mark.parametrize("family", ["", "deepseek_v3"])
def test_fp4_drafts_as_its_dequantized_weights(tmp_path, backend, family):
    """FP4 weights dequantize exactly (two significant bits times a power of two), and the FP8
    ones have power-of-two scales: both runs compute on the same FP32 weights."""
    cfg = _cfg(family)
    fp4 = write_synthetic_checkpoint(tmp_path / "fp4", cfg, seed=4)
    plain = dequantized_copy(fp4, tmp_path / "fp32", cfg)
    for mode in ("exact", "draft"):
        assert run_rounds(fp4, backend, mode)[1] == run_rounds(plain, backend, mode)[1]


@pytest.fixture(scope="module")
def emulator():
    """The CUDA emulator (tests/cuda_emu) routing the cuda launchers; skipped where it cannot be built."""
    from cuda_emu import emu_backend
    yield from emu_backend.installed_emulator()


@pytest.fixture
def fake_runtime(emulator, monkeypatch):
    """CUDA graphs through tests/test_cuda_graph_fake.py's runtime over the emulated launches
    (as tests/test_cuda_emulated.py's proposer tests)."""
    from mtpkern import cuda_graph
    from test_cuda_graph_fake import FakeRuntime

    rt = FakeRuntime()
    monkeypatch.setattr(cuda_graph, "_cupy", lambda: rt.cupy)
    monkeypatch.setattr(emulator, "capture", lambda: rt.recording)
    return rt


@pytest.mark.parametrize("kv", ["float32", "bfloat16"])
def test_fp4_drafts_as_its_dequantized_weights_on_the_cuda_kernels(tmp_path, fake_runtime, kv):
    """The cuda backend's kernels (on the CPU emulator) keep the FP4 experts packed (``CudaFp4``)
    and decode them in the GEMVs: the proposer drafts what it drafts on the dequantized FP32
    twin (the decode is exact; the GEMVs sum FP4 and FP32 rows in other vector widths, far
    from moving an argmax of these models)."""
    from cuda_emu import emu_backend

    cfg = _cfg("deepseek_v3")
    fp4 = write_synthetic_checkpoint(tmp_path / "fp4", cfg, seed=4)
    plain = dequantized_copy(fp4, tmp_path / "fp32", cfg)
    for mode in ("exact", "draft"):
        prop, ours = run_rounds(fp4, emu_backend.backend(kv), mode)
        assert ours == run_rounds(plain, emu_backend.backend(kv), mode)[1]
        assert ours == run_rounds(fp4, "numpy", mode)[1]
    twin = MultiModuleMtpHead.from_pretrained(plain, backend=emu_backend.backend(kv))
    assert prop.memory().weights < twin.memory().weights    # the experts stay packed on the device
    M, E, I, H = 3, 8, 32, 64
    assert twin.memory().weights - prop.memory().weights >= 0.45 * M * E * 3 * I * H   # vs FP8 elsewhere: >= 3.5 B


def test_swapped_nibbles_draft_otherwise(tmp_path):
    """Negative control: the same bytes read high nibble first are other weights, and draft
    other tokens; so the test above would see a nibble order bug."""
    cfg = _cfg()
    fp4 = write_synthetic_checkpoint(tmp_path / "fp4", cfg, seed=4)
    right = dequantized_copy(fp4, tmp_path / "right", cfg)
    wrong = dequantized_copy(fp4, tmp_path / "wrong", cfg, swap_nibbles=True)
    ours = run_rounds(fp4, "numpy", rounds=6)[1]
    assert ours == run_rounds(right, "numpy", rounds=6)[1]
    assert ours != run_rounds(wrong, "numpy", rounds=6)[1]


def test_fp4_experts_stay_half_a_byte_per_weight(tmp_path):
    cfg = _cfg()
    fp4 = write_synthetic_checkpoint(tmp_path / "fp4", cfg, seed=5)
    fp8 = write_synthetic_checkpoint(tmp_path / "fp8", dataclasses.replace(cfg, expert_quant=""), seed=5)
    for backend in ("numpy", "cpu"):
        head = MultiModuleMtpHead.from_pretrained(fp4, backend=backend)
        assert head.weights.nbytes < MultiModuleMtpHead.from_pretrained(fp8, backend=backend).weights.nbytes
    M, E, I, H = 3, 8, 32, 64
    experts = M * E * 3 * I * H
    w4 = MultiModuleMtpHead.from_pretrained(fp4, backend="cpu").memory().weights
    w8 = MultiModuleMtpHead.from_pretrained(fp8, backend="cpu").memory().weights
    assert w8 - w4 >= 0.45 * experts          # half a byte a routed-expert weight saved, less the E8M0 scales


def _rewrite(path, **changes):
    raw = read_tensors(path)
    raw.update(changes)
    for k in [k for k, v in changes.items() if v is None]:
        del raw[k]
    save_file(raw, str(path / "model.safetensors"))


def test_broken_fp4_checkpoints_are_named(tmp_path):
    cfg = _cfg()
    path = write_synthetic_checkpoint(tmp_path, cfg, seed=7)
    raw = read_tensors(path)
    sk = EXPERT + "_scale_inv"
    _rewrite(path, **{sk: None})
    with pytest.raises(CheckpointError, match=f"'{sk}' is missing.*scales of the FP4 weight '{EXPERT}'"):
        MultiModuleMtpHead.from_pretrained(path, backend="numpy")
    bad = raw[sk].view(np.uint8).copy()
    bad[5, 1] = 0xFF                                                                   # E8M0 NaN
    _rewrite(path, **{sk: bad.view(E8M0)})
    with pytest.raises(CheckpointError, match=rf"tensor '{sk}' .*scale: expected E8M0 codes 0\.\.252, got 1 NaN "
                                              r"code\(s\) 0xFF \(first at \(5, 1\)\)"):
        MultiModuleMtpHead.from_pretrained(path, backend="numpy")
    bad[5, 1] = 254                                                                    # 6 * 2^127 overflows
    _rewrite(path, **{sk: bad.view(E8M0)})
    with pytest.raises(CheckpointError, match=rf"tensor '{sk}' .*got 1 above"):
        MultiModuleMtpHead.from_pretrained(path, backend="numpy")
    _rewrite(path, **{sk: np.ones((32, 3), np.uint8).view(E8M0)})
    with pytest.raises(CheckpointError, match=rf"tensor '{sk}' .*expected shape \[32, 2\], got \[32, 3\]"):
        MultiModuleMtpHead.from_pretrained(path, backend="numpy")
    _rewrite(path, **{sk: raw[sk].view(np.uint8).astype(np.float32)})
    with pytest.raises(CheckpointError, match=rf"tensor '{sk}' .*expected dtype F8_E8M0 or U8, got F32"):
        MultiModuleMtpHead.from_pretrained(path, backend="numpy")
    _rewrite(path, **{sk: raw[sk], EXPERT: np.zeros((32, 64), np.int8)})               # unpacked: K, not K / 2
    with pytest.raises(CheckpointError, match=rf"tensor '{EXPERT}' .*expected shape \[32, 32\] \(FP4: two codes a "
                                              r"byte of a \[32, 64\] weight\), got \[32, 64\]"):
        MultiModuleMtpHead.from_pretrained(path, backend="numpy")
    problems, _ = check_headers(path, cfg)
    assert any("expected shape [32, 32] (FP4: two codes a byte of [32, 64])" in p for p in problems), problems


def test_fp4_without_the_config_saying_so_is_refused(tmp_path):
    cfg = _cfg()
    path = write_synthetic_checkpoint(tmp_path, cfg, seed=8)
    d = json.loads((path / "config.json").read_text())
    del d["quantization_config"]["expert_dtype"]
    (path / "config.json").write_text(json.dumps(d))
    with pytest.raises(CheckpointError, match=r"experts\.0\.down_proj\.weight_scale_inv' .* would not be used: it is a "
                                              r"quantized weight's scale, .* expert_dtype: not fp4"):
        MultiModuleMtpHead.from_pretrained(path, backend="numpy")
    with pytest.raises(CheckpointError, match=r"experts\.0\.gate_proj\.weight' .*expected dtype BF16 or F32, got I8 "
                                              r"\(packed FP4 reads as such only under expert_dtype 'fp4'"):
        MultiModuleMtpHead.from_pretrained(path, backend="numpy", allow_unused_tensors=True)
