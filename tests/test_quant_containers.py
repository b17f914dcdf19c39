"""Checkpoints in the containers re-published MTP checkpoints ship in (docs/fp4.md, "Containers"):
compressed-tensors (``mxfp4-pack-quantized``, ``nvfp4-pack-quantized``, ``mxfp8-quantized``,
``mixed-precision``; ``weight_packed`` / ``weight_scale`` / ``weight_global_scale``, ``ignore``)
and NVIDIA ModelOpt's NVFP4 (``weight`` packed, ``weight_scale``, ``weight_scale_2``). Each is
written here from a plain synthetic checkpoint with power-of-two scales, so its dequantized twin
holds the same FP32 weights, and must draft the same tokens; negative controls (nibble order,
global scale, scale block size) must draft otherwise or be refused."""

from __future__ import annotations

import dataclasses
import json

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from conftest import run_rounds
from test_fp4_checkpoints import emulator, fake_runtime  # noqa: F401 (fixtures: the emulator, its CUDA graphs)
from mtpkern import CheckpointError, ConfigError, MtpConfig, MultiModuleMtpHead, write_synthetic_checkpoint
from mtpkern.config import tiny_config
from mtpkern.quant import Fp4Weight, Fp8Weight, e8m0_table
from mtpkern.weights import _is_projection, check_headers, read_tensors

F8 = np.dtype(ml_dtypes.float8_e4m3fn)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
Q_PROJ = "model.layers.2.self_attn.q_proj.weight"


def _module_projection(cfg: MtpConfig, key: str) -> bool:
    first = cfg.num_hidden_layers
    return (key.startswith("model.layers.") and int(key.split(".")[2]) >= first
            and (_is_projection(key) or key.endswith(".mlp.gate.weight"))
            and key.endswith(".weight"))


def _mxfp8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """E4M3 codes and E8M0 scale codes per (1, 32) block: scale 2^ceil(log2(amax / 448))."""
    N, K = w.shape
    kb = -(-K // 32)
    pad = np.zeros((N, kb * 32), np.float32)
    pad[:, :K] = np.abs(w)
    amax = pad.reshape(N, kb, 32).max(-1)
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.ceil(np.log2(amax / 448.0)), 0).astype(np.int64)
    code = (e + 127).astype(np.uint8)
    per = np.repeat(e8m0_table()[code], 32, axis=1)[:, :K]
    return (w / per).astype(F8), code


def container(tmp, cfg: MtpConfig, fmts: dict[str, str], container_name="compressed-tensors", ignore=(),
              swap_nibbles=False, drop_global=False, fp8_block=(1, 32)):
    """(the container checkpoint, its dequantized FP32 twin): each module projection whose name
    contains a key of ``fmts`` stored in that format (others, and those matching ``ignore``,
    dense). The twin's negative controls: ``swap_nibbles`` (high nibble first), ``drop_global``
    (NVFP4's global scale left out)."""
    src = write_synthetic_checkpoint(tmp / "src", cfg, seed=7)
    raw = read_tensors(src)
    out, twin = {}, {}
    for k, a in raw.items():
        fmt = next((f for part, f in fmts.items() if part in k), None) if _module_projection(cfg, k) else None
        if fmt is None or any(k[:-len(".weight")] == i for i in ignore):
            out[k] = twin[k] = a
            continue
        base = k[:-len("weight")]
        if fmt == "mxfp8":
            codes, s = _mxfp8(a.astype(np.float32))
            out[k], out[k + "_scale"] = codes, s
            twin[k] = Fp8Weight(codes.view(np.uint8), s.view(E8M0), (1, 32)).dequantize()
            continue
        q = Fp4Weight.quantize(a, fmt)
        data = q.data
        if swap_nibbles:
            data = ((data >> 4) | (data << 4)).astype(np.uint8)
        g = q.global_scale
        if drop_global:
            g = np.ones_like(g)
        twin[k] = Fp4Weight(data, q.scale, g).dequantize()
        if container_name == "modelopt":
            out[k], out[k + "_scale"] = q.data, q.scale.view(F8)
            out[k + "_scale_2"] = q.global_scale[:1].copy()
            out[base + "input_scale"] = np.ones((1,), np.float32)
        else:
            out[k + "_packed"] = q.data
            out[k + "_scale"] = q.scale.view(F8) if fmt == "nvfp4" else q.scale
            if fmt == "nvfp4":
                out[k + "_global_scale"] = (1.0 / q.global_scale[:1]).astype(np.float32)   # the divisor
                out[base + "input_global_scale"] = np.ones((1,), np.float32)
    formats = tuple(sorted(set(fmts.values())))
    qcfg = dataclasses.replace(cfg, quant_container=container_name, quant_formats=formats, quant_ignore=tuple(ignore),
                               weight_quant="fp8" if "mxfp8" in formats else "",
                               fp8_block=fp8_block if "mxfp8" in formats else (0, 0))
    paths = []
    for name, tensors, c in (("ct", out, qcfg), ("twin", twin, cfg)):
        d = tmp / name
        d.mkdir()
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(d / "model.safetensors"),
                  metadata={"format": "pt"})
        (d / "config.json").write_text(json.dumps(c.to_dict()))
        paths.append(d)
    return paths[0], paths[1]


ALL = {"self_attn": "nvfp4", "mlp.experts": "mxfp4", "shared_experts": "mxfp8", "eh_proj": "nvfp4", "mlp.gate.": "mxfp4"}
CASES = {
    "mxfp4": ({"proj": "mxfp4", "mlp.gate.": "mxfp4"}, "compressed-tensors"),
    "nvfp4": ({"proj": "nvfp4", "mlp.gate.": "nvfp4"}, "compressed-tensors"),
    "mxfp8": ({"proj": "mxfp8"}, "compressed-tensors"),
    "mixed": (ALL, "compressed-tensors"),
    "modelopt": ({"proj": "nvfp4"}, "modelopt"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_config_round_trips_and_names_the_formats(tmp_path, case):
    fmts, name = CASES[case]
    ct, _ = container(tmp_path, tiny_config(), fmts, name, ignore=["model.layers.2.mlp.gate"])
    d = json.loads((ct / "config.json").read_text())["quantization_config"]
    cfg = MtpConfig.from_json(ct / "config.json")
    assert MtpConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.quant_container == name and set(cfg.quant_formats) == set(fmts.values()) - {"fp8"}
    if name == "compressed-tensors":
        assert d["format"] == ("mixed-precision" if case == "mixed" else f"{case}-pack-quantized".replace(
            "mxfp8-pack", "mxfp8"))
    for f in cfg.quant_formats:
        assert f.upper() in cfg.describe()
    stored = {k.rsplit(".", 1)[-1] for k in read_tensors(ct)}
    assert ("weight_packed" in stored) == (name == "compressed-tensors" and case != "mxfp8")
    head = MultiModuleMtpHead.from_pretrained(ct, backend="numpy")
    assert head.weights.nbytes < MultiModuleMtpHead.from_pretrained(_, backend="numpy").weights.nbytes
    problems, _ = check_headers(ct, cfg)
    assert problems == []


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
@pytest.mark.parametrize("case", list(CASES))
def test_container_drafts_as_its_dequantized_twin(tmp_path, backend, case):
    fmts, name = CASES[case]
    ct, twin = container(tmp_path, tiny_config(), fmts, name)
    for mode in ("exact", "draft"):
        assert run_rounds(ct, backend, mode)[1] == run_rounds(twin, backend, mode)[1]
    if backend == "cpu" and case != "mxfp8":       # the 4-bit weights stay packed
        w4 = MultiModuleMtpHead.from_pretrained(ct, backend="cpu").memory().weights
        assert w4 < 0.6 * MultiModuleMtpHead.from_pretrained(twin, backend="cpu").memory().weights


def test_nvfp4_drafts_as_its_dequantized_twin_on_the_cuda_kernels(tmp_path, fake_runtime):
    """The cuda backend (its kernels on the CPU emulator) keeps NVFP4 projections packed
    (``CudaNvFp4``: codes, E4M3 scales per 16, the row scale) and decodes them in the GEMVs: the
    compressed-tensors checkpoint drafts what its dequantized FP32 twin drafts there, and what the
    NumPy reference drafts."""
    from cuda_emu import emu_backend
    from mtpkern.backends.cuda_launch._util import CudaNvFp4

    ct, twin = container(tmp_path, tiny_config(), CASES["nvfp4"][0])
    for mode in ("exact", "draft"):
        prop, ours = run_rounds(ct, emu_backend.backend("float32"), mode)
        assert ours == run_rounds(twin, emu_backend.backend("float32"), mode)[1]
        assert ours == run_rounds(ct, "numpy", mode)[1]
    held = [f.name for m in prop.weights.modules for f in dataclasses.fields(m)
            if isinstance(getattr(m, f.name), CudaNvFp4)]
    assert held, "no projection was kept as NVFP4 on the cuda backend"


@pytest.mark.parametrize("control", ["swap_nibbles", "drop_global"])
def test_negative_controls_draft_otherwise(tmp_path, control):
    """The twin read high nibble first, or NVFP4's global scale ignored: other weights, other drafts
    (so the test above would see either bug)."""
    cfg = tiny_config()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    ct, right = container(tmp_path / "a", cfg, CASES["nvfp4"][0])
    _, wrong = container(tmp_path / "b", cfg, CASES["nvfp4"][0], **{control: True})
    ours = run_rounds(ct, "numpy", rounds=6)[1]
    assert ours == run_rounds(right, "numpy", rounds=6)[1]
    assert ours != run_rounds(wrong, "numpy", rounds=6)[1]


def test_ignored_and_dense_projections_load_dense_with_a_note(tmp_path):
    cfg = tiny_config()
    ct, twin = container(tmp_path, cfg, {"self_attn": "nvfp4"}, ignore=["model.layers.2.self_attn.o_proj"])
    head = MultiModuleMtpHead.from_pretrained(ct, backend="numpy")
    notes = " | ".join(head.weights.notes)
    assert "in its ignore list: model.layers.2.self_attn.o_proj.weight" in notes
    assert "not in its ignore list (no packed or scale tensors): model.layers.2.eh_proj.weight" in notes
    assert run_rounds(ct, "numpy")[1] == run_rounds(twin, "numpy")[1]


def _rewrite(path, fn):
    raw = read_tensors(path)
    fn(raw)
    save_file({k: np.ascontiguousarray(v) for k, v in raw.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})


@pytest.mark.parametrize("what,fn,msg", [
    ("missing scale", lambda r: r.pop(Q_PROJ + "_scale"),
     rf"tensor '{Q_PROJ}_scale' is missing .*: the scales of the weight"),
    ("missing global scale", lambda r: r.pop(Q_PROJ + "_global_scale"),
     rf"tensor '{Q_PROJ}_global_scale' is missing .*NVFP4 global scale"),
    ("scale per 32 for NVFP4", lambda r: r.__setitem__(Q_PROJ + "_scale", r[Q_PROJ + "_scale"][:, ::2].copy()),
     r"expected shape \[\d+, 4\]"),
    ("zero global scale", lambda r: r.__setitem__(Q_PROJ + "_global_scale", np.zeros(1, np.float32)),
     r"expected a finite, non-zero global scale"),
    ("NaN scale code", lambda r: r[Q_PROJ + "_scale"].view(np.uint8).__setitem__((0, 0), 0x7F),
     r"scale: expected finite E4M3 codes, got 1 NaN code"),
])
def test_bad_tensors_are_refused_by_name(tmp_path, what, fn, msg):
    ct, _ = container(tmp_path, tiny_config(), CASES["nvfp4"][0])
    _rewrite(ct, fn)
    with pytest.raises(CheckpointError, match=msg):
        MultiModuleMtpHead.from_pretrained(ct, backend="numpy")


def test_a_format_the_config_does_not_announce_is_refused(tmp_path):
    ct, _ = container(tmp_path, tiny_config(), CASES["mxfp4"][0])
    d = json.loads((ct / "config.json").read_text())
    for g in d["quantization_config"]["config_groups"].values():
        g["weights"]["group_size"], g["weights"]["strategy"], g["format"] = 16, "tensor_group", "nvfp4-pack-quantized"
    d["quantization_config"]["format"] = "nvfp4-pack-quantized"
    (ct / "config.json").write_text(json.dumps(d))
    with pytest.raises(CheckpointError, match=r"stored as MXFP4 \(E8M0 scales\), a format its config does not "
                                              r"announce \(compressed-tensors formats \['nvfp4'\]"):
        MultiModuleMtpHead.from_pretrained(ct, backend="numpy")


CT = {"quant_method": "compressed-tensors"}


@pytest.mark.parametrize("quant,msg", [
    (dict(CT, format="pack-quantized", config_groups={"g": {"weights": {"num_bits": 4, "type": "int", "strategy": "group",
                                                                        "group_size": 128}}}),
     "quantization_config.format 'pack-quantized' is not supported"),
    (dict(CT, config_groups={"g": {"weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}}),
     "got num_bits 4 type 'int' (integer formats: AWQ, GPTQ, int4 groups"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128}, "quant_method 'awq' is not supported"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "quant_method 'gptq' is not supported"),
    (dict(CT, config_groups={"g": {"weights": {"num_bits": 4, "type": "float", "strategy": "group",
                                               "group_size": 64}}}),
     "group_size 64 is not one a 4-bit float format allows; expected 16 (NVFP4) or 32 (MXFP4)"),
    (dict(CT, config_groups={"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "group",
                                               "group_size": 16}}}),
     "group_size 16 is not one MXFP8 allows; expected 32"),
    (dict(CT, format="mxfp4-pack-quantized", config_groups={"g": {"weights": {
        "num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}}}),
     "nvfp4 weights expected format 'nvfp4-pack-quantized', got 'mxfp4-pack-quantized'"),
    ({"quant_method": "modelopt", "quant_algo": "W4A8_AWQ"}, "quant_algo 'W4A8_AWQ' is not supported"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 32}, "group_size 32 is not one NVFP4 allows"),
])
def test_other_formats_are_refused_naming_them(quant, msg):
    d = dict(tiny_config().to_dict(), quantization_config=quant)
    with pytest.raises(ConfigError, match=__import__("re").escape(msg)):
        MtpConfig.from_dict(d)


def test_info_names_the_formats(tmp_path, capsys):
    from mtpkern.cli import main

    ct, _ = container(tmp_path, tiny_config(), ALL)
    assert main(["info", str(ct)]) == 0
    out = capsys.readouterr().out
    assert "compressed-tensors: MXFP4 (E2M1, E8M0 per 32), MXFP8 (E4M3, E8M0 per 32), NVFP4" in out
