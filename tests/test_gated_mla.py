"""Gated MLA without RoPE (the attention of Kimi K3's MTP layer: transformers' ``KimiK3GatedMLA``,
vLLM's ``vllm/models/kimi_k3/nvidia/mla.py``): DeepSeek-V3's MLA with

- ``nope=True``: the query's last R dims and the shared key's R dims (R = qk_rope_head_dim > 0)
  kept and never rotated (the block's frequencies are zeros: angle 0, each value kept);
- ``attn_gate="elementwise"``: ``attn_out * sigmoid(g_proj(x))`` per element before o_proj,
  ``self_attn.g_proj.weight`` [Hq Dv, H] reading the block's normed input (as q_a_proj and
  kv_a_proj_with_mqa do); its rows are stacked after kv_a_proj_with_mqa's at load (one GEMV).

Config and checkpoint checks; the module's gated attention against a float64 formula written
here (and the formula's wrong variants, each shown to differ: the gate dropped, applied to the
values before the attention, read from the input before its norm, the R dims rotated); drafts
and latent rows against the oracle on NumPy and the cpu backend (with DSA's indexer too);
FP8 and NVFP4 g_proj; 2 ranks against one. The CUDA kernels: tests/test_cuda_emulated.py
(tests/test_blocks.py's ``mla_gated``), the planned step: tests/test_cuda_graph_fake.py.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import test_oracle
from conftest import rand_hiddens, run_rounds
from mtpkern import CheckpointError, ConfigError, MtpConfig, MultiModuleMtpHead, write_synthetic_checkpoint
from mtpkern.backends import get_backend
from mtpkern.config import tiny_config
from mtpkern.head import RowJob
from mtpkern.ops.rope_kv import inv_freq
from mtpkern.testing import reference_weights
from mtpkern.tolerance import assert_close

#: the MLA sizes of tests/test_blocks.py (L 40, P 12, R 8, Dv 12, q_lora 24, 4 heads)
MLA = dict(kv_lora_rank=40, q_lora_rank=24, qk_rope_head_dim=8, head_dim=20, v_head_dim=12, num_key_value_heads=4,
           partial_rotary_factor=1.0, use_qk_norm=False, attention_bias=False)
GATED = dict(MLA, nope=True, attn_gate="elementwise", rope_interleave=True)
#: ... under DSA's indexer (5 keys of 4 heads x 16), which rotates none of its first R dims either
GATED_DSA = dict(GATED, index_topk=5, index_n_heads=4, index_head_dim=16, indexer_rope_interleave=True)
ROUNDS = [(3, 1.0), (3, 0.4), (2, 0.0), (3, 1.0)]
_CKPTS: dict = {}


def ckpt(tmp_path_factory, name: str):
    """(path, host FP32 weights) of a synthetic FP32 checkpoint, written once per session."""
    if name not in _CKPTS:
        cfg = tiny_config(**{"gated": GATED, "gated_dsa": GATED_DSA}[name])
        path = write_synthetic_checkpoint(tmp_path_factory.mktemp(name), cfg, seed=21, dtype="float32")
        _CKPTS[name] = path, reference_weights(path)
    return _CKPTS[name]


# -- the config and the checkpoint --------------------------------------------------------------

def test_block_sizes_describe_and_round_trip():
    cfg = tiny_config(**GATED)
    b = cfg.block(0)
    assert (b.mla, b.nope, b.attn_gate, b.rotary_dim, b.latent_width) == (True, True, "elementwise", 8, 48)
    assert (b.gate_size, b.gate_offset, b.kv_a_size, b.gated_size) == (48, 48, 96, 96) and not b.q_gate
    assert not b.inv_freq().any() and b.inv_freq().shape == (4,)          # angle 0: kept
    assert b.scale == 20 ** -0.5                                         # qk_head_dim P + R, R unrotated
    assert "MLA Hq=4 L=40 P=12 R=8 q_lora=24 Dv=12 NoPE (R=8 unrotated) elementwise gate (g_proj)" in b.describe()
    assert MtpConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    from mtpkern.weights import _module_keys

    keys = _module_keys(cfg, 0)
    assert keys["self_attn.g_proj.weight"] == ((48, 64), True)
    assert keys["self_attn.kv_a_proj_with_mqa.weight"] == ((48, 64), True) and "self_attn.q_proj.weight" not in keys


@pytest.mark.parametrize("edit,match", [
    (dict(MLA, attn_gate="headwise"), r"attn_gate expected '' or 'elementwise' in MLA .*got 'headwise'"),
    (dict(MLA, attn_sinks=True), r"attn_sinks expected False in MLA"),
    (dict(GATED, rope_scaling={"factor": 4.0, "original_max_position_embeddings": 12}),
     r"nope \(no RoPE\) takes no rope_scaling"),
])
def test_bad_configs_are_refused(edit, match):
    with pytest.raises(ConfigError, match=match):
        tiny_config(**edit)


def test_bad_g_proj_tensors_are_refused_by_name(tmp_path_factory, tmp_path):
    """g_proj of the wrong width (a head-wise [Hq, H] one), missing, or present in a checkpoint
    whose config has no gate: each refused naming the tensor."""
    path, _ = ckpt(tmp_path_factory, "gated")
    name = "model.layers.2.self_attn.g_proj.weight"
    t = load_file(str(path / "model.safetensors"))
    cfg_json = (path / "config.json").read_text()

    def variant(sub: str, tensors: dict, config: str = cfg_json):
        d = tmp_path / sub
        d.mkdir()
        save_file(tensors, str(d / "model.safetensors"))
        (d / "config.json").write_text(config)
        return d

    narrow = variant("narrow", dict(t, **{name: t[name][:4]}))
    with pytest.raises(CheckpointError, match=r"self_attn\.g_proj\.weight'.*expected shape \[48, 64\], got \[4, 64\]"):
        MultiModuleMtpHead.from_pretrained(narrow, backend="numpy")
    missing = variant("missing", {k: v for k, v in t.items() if k != name})
    with pytest.raises(CheckpointError, match=r"self_attn\.g_proj\.weight' is missing .*attn_gate = 'elementwise'"):
        MultiModuleMtpHead.from_pretrained(missing, backend="numpy")
    ungated = variant("ungated", t, json.dumps(dict(json.loads(cfg_json), attn_gate="")))
    with pytest.raises(CheckpointError, match=r"self_attn\.g_proj\.weight' .* would not be used"):
        MultiModuleMtpHead.from_pretrained(ungated, backend="numpy")


def test_g_proj_rows_follow_kv_a_proj_with_mqa(tmp_path_factory):
    path, w = ckpt(tmp_path_factory, "gated")
    raw = load_file(str(path / "model.safetensors"))
    pre = "model.layers.2.self_attn."
    want = np.concatenate([raw[pre + "kv_a_proj_with_mqa.weight"], raw[pre + "g_proj.weight"]])
    np.testing.assert_array_equal(w.modules[0].mla_kv_a, want)


# -- the module's gated attention against a float64 formula ---------------------------------------

def _rms64(x, w, eps):
    x = np.asarray(x, np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * np.asarray(w, np.float64)


def gated_attention64(b, w, u, a, pos, eps, variant="ok"):
    """The gated MLA's output [n, Hq Dv] over n causal rows of one sequence, float64: ``u`` the
    rows before input_layernorm, ``a`` after it. Wrong variants: ``no_gate``; ``gate_on_values``
    (each key row's value times its own row's gate, before the attention sums them);
    ``unnormed_input`` (g_proj reading ``u``); ``rotated`` (the R dims turned by RoPE)."""
    f = lambda t: np.asarray(t, np.float64)  # noqa: E731
    n, Hq, L, R, P, Dv = len(a), b.num_attention_heads, b.kv_lora_rank, b.qk_rope_head_dim, b.qk_nope_head_dim, b.v_dim
    kv_w, g_w = f(w.mla_kv_a)[:L + R], f(w.mla_kv_a)[L + R:]                   # the checkpoint's two tensors
    kv = f(a) @ kv_w.T                                                          # [n, L + R]
    c, k_pe = _rms64(kv[:, :L], w.mla_kv_a_norm, eps), kv[:, L:]
    q = (_rms64(f(a) @ f(w.mla_q_a).T, w.mla_q_a_norm, eps) @ f(w.w_qkv).T).reshape(n, Hq, P + R)
    q_nope, q_pe = q[:, :, :P], q[:, :, P:].copy()
    if variant == "rotated":                                                    # pairs (2i, 2i + 1)
        ang = pos[:, None].astype(np.float64) * inv_freq(R, b.rope_theta)[None, :].astype(np.float64)
        cos, sin = np.cos(ang), np.sin(ang)

        def turn(x, cs, sn):
            y = x.copy()
            y[..., 0::2] = x[..., 0::2] * cs - x[..., 1::2] * sn
            y[..., 1::2] = x[..., 1::2] * cs + x[..., 0::2] * sn
            return y
        k_pe = turn(k_pe, cos, sin)
        q_pe = turn(q_pe, cos[:, None, :], sin[:, None, :])
    g = (f(u) if variant == "unnormed_input" else f(a)) @ g_w.T                  # [n, Hq Dv]
    sig = 1.0 / (1.0 + np.exp(-g.reshape(n, Hq, Dv)))
    out = np.zeros((n, Hq, Dv))
    for h in range(Hq):
        k = np.concatenate([c @ f(w.mla_uk[h]).T, k_pe], axis=1)                # [n, P + R]
        v = c @ f(w.mla_uv[h]).T                                                # [n, Dv]
        if variant == "gate_on_values":
            v = v * sig[:, h]
        s = np.concatenate([q_nope[:, h], q_pe[:, h]], axis=1) @ k.T * b.scale
        s = np.where(np.tri(n, dtype=bool), s, -np.inf)                         # causal
        p = np.exp(s - s.max(1, keepdims=True))
        out[:, h] = (p / p.sum(1, keepdims=True)) @ v
    if variant not in ("no_gate", "gate_on_values"):
        out = out * sig
    return out.reshape(n, Hq * Dv)


def test_module_attention_is_the_float64_formula_and_not_its_wrong_variants(tmp_path_factory, monkeypatch):
    """Module 0 over 9 fresh rows on the NumPy reference: the gated attention output that o_proj
    reads (sigmoid_gate's result), its input rows before and after input_layernorm and the
    positions taken from the calls; equal to the formula within FP32's tolerance; each wrong
    variant of the formula is off by far more (so a backend doing that would fail here)."""
    path, _ = ckpt(tmp_path_factory, "gated")
    prop = MultiModuleMtpHead.from_pretrained(path, backend="numpy", block_size=4, num_blocks=16)
    head, be = prop.modules[0], prop.backend
    seen: dict = {}
    real_rms, real_gate, real_write = be.rmsnorm, be.sigmoid_gate, be.mla_latent_write

    def rmsnorm(x, g, eps, **kw):
        if g is head.w.input_layernorm:
            seen["u"] = np.array(x)
        out = real_rms(x, g, eps, **kw)
        if g is head.w.input_layernorm:
            seen["a"] = np.array(out)
        return out

    def sigmoid_gate(x, gate, residual=None, **kw):
        out = real_gate(x, gate, residual, **kw)
        seen["o"] = np.array(out)
        return out

    def mla_latent_write(kv_a, *args, **kw):
        seen["pos"] = np.array(args[3])
        return real_write(kv_a, *args, **kw)

    monkeypatch.setattr(be, "rmsnorm", rmsnorm)
    monkeypatch.setattr(be, "sigmoid_gate", sigmoid_gate)
    monkeypatch.setattr(be, "mla_latent_write", mla_latent_write)
    rng = np.random.default_rng(3)
    n = 9
    seq = head.alloc_seq()
    head.forward([RowJob(seq, rng.integers(0, prop.config.vocab_size, n).astype(np.int32), 0, 1)],
                 rand_hiddens(rng, n, prop.config.hidden_size))
    assert seen["pos"].tolist() == list(range(1, n + 1))
    b, eps = head.block, prop.config.rms_norm_eps
    want = gated_attention64(b, head.w, seen["u"], seen["a"], seen["pos"], eps)
    assert_close(seen["o"], want, what="gated attention")
    for variant in ("no_gate", "gate_on_values", "unnormed_input", "rotated"):
        other = gated_attention64(b, head.w, seen["u"], seen["a"], seen["pos"], eps, variant)
        assert np.abs(other - want).max() > 1e-2, f"{variant}: the formula's variant changed nothing"


# -- drafts and latent rows against the oracle -----------------------------------------------------

@pytest.mark.parametrize("name", ["gated", "gated_dsa"])
@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_drafts_and_latent_rows_agree_with_the_oracle(tmp_path_factory, name, backend):
    """Exact mode: drafts and every module's latent rows (whose last R values are kv_a's, as
    projected) against the float64 oracle after each call."""
    path, weights = ckpt(tmp_path_factory, name)
    prop = MultiModuleMtpHead.from_pretrained(path, backend=backend, kv_mode="exact", block_size=4, num_blocks=96,
                                              prefill_chunk=7)
    pool = prop.modules[0].pool
    assert pool.k.shape[2] == 48 and (pool.index_k.shape[2] == 16 if name == "gated_dsa" else pool.index_k is None)
    test_oracle.run_scenario(prop, prop.config, weights, 5, 20, ROUNDS, prop.chain, None)


@pytest.mark.parametrize("kv_mode", ["exact", "draft"])
def test_cpu_drafts_as_numpy(tmp_path_factory, kv_mode):
    """Both KV modes, prefill then propose / verify / catch-up rounds: the cpu backend's drafts
    are the NumPy reference's (draft mode's rows against the oracle: tests/test_blocks.py's
    random calls on ``mla_gated``)."""
    path, _ = ckpt(tmp_path_factory, "gated")
    assert run_rounds(path, "cpu", kv_mode, rounds=6)[1] == run_rounds(path, "numpy", kv_mode, rounds=6)[1]


@pytest.mark.parametrize("control", ["rotated", "no_gate"])
def test_negative_controls_fail_the_oracle(tmp_path_factory, monkeypatch, control):
    """The oracle test fails when the module rotates the R dims (nope ignored: the frequencies
    of plain RoPE) and when the gate is dropped (sigmoid_gate a no-op)."""
    path, weights = ckpt(tmp_path_factory, "gated")
    cfg = tiny_config(**GATED)
    prop = MultiModuleMtpHead(cfg, weights, get_backend("numpy"), kv_mode="exact", block_size=4, num_blocks=96)
    if control == "rotated":
        for head in prop.modules:
            head._inv_freq = inv_freq(8, cfg.rope_theta)
    else:
        monkeypatch.setattr(prop.backend, "sigmoid_gate", lambda x, gate, residual=None, **kw: x)
    with pytest.raises(AssertionError):
        test_oracle.run_scenario(prop, cfg, weights, 5, 20, ROUNDS, prop.chain, None)


# -- quantized g_proj ------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_fp8_g_proj_drafts_as_its_dequantized_weights(tmp_path, backend):
    """Every projection FP8 with block scales of 16 (g_proj's 48 rows stacked under
    kv_a_proj_with_mqa's 48, the blocks kept whole); power-of-two scales: the same drafts."""
    import test_fp8_checkpoints

    cfg = dataclasses.replace(tiny_config(**GATED), weight_quant="fp8", fp8_block=(16, 16))
    fp8 = write_synthetic_checkpoint(tmp_path / "fp8", cfg, seed=4, pow2_scales=True)
    from mtpkern.weights import read_tensors

    raw = read_tensors(fp8)
    assert raw["model.layers.2.self_attn.g_proj.weight"].dtype.itemsize == 1
    assert raw["model.layers.2.self_attn.g_proj.weight_scale_inv"].shape == (3, 4)
    plain = test_fp8_checkpoints._dequantized_copy(fp8, tmp_path / "fp32", cfg)
    prop, got = run_rounds(fp8, backend, "exact")
    if backend == "cpu":                     # kept FP8 through the stacking (NumPy dequantizes at prepare)
        assert not isinstance(prop.weights.modules[0].mla_kv_a, np.ndarray)
    assert got == run_rounds(plain, backend, "exact")[1]


def test_nvfp4_g_proj_drafts_as_its_dequantized_twin(tmp_path):
    """A compressed-tensors NVFP4 container with every projection (g_proj too) in NVFP4."""
    import test_quant_containers

    ct, twin = test_quant_containers.container(tmp_path, tiny_config(**GATED), {"proj": "nvfp4"})
    from mtpkern.weights import read_tensors

    assert "model.layers.2.self_attn.g_proj.weight_packed" in read_tensors(ct)
    for mode in ("exact", "draft"):
        assert run_rounds(ct, "numpy", mode)[1] == run_rounds(twin, "numpy", mode)[1]


def test_a_dense_kv_a_beside_an_nvfp4_g_proj_joins_in_fp32_with_a_note(tmp_path):
    """A container that leaves kv_a_proj_with_mqa dense (in its ignore list) and g_proj NVFP4:
    the two are joined widened to FP32 (each weight's value kept), the loader says so, and the
    drafts are the dequantized twin's."""
    import test_quant_containers

    cfg = tiny_config(**GATED)
    ignore = [f"model.layers.{cfg.layer_index(m)}.self_attn.kv_a_proj_with_mqa" for m in range(cfg.num_modules)]
    ct, twin = test_quant_containers.container(tmp_path, cfg, {"proj": "nvfp4"}, ignore=ignore)
    prop = MultiModuleMtpHead.from_pretrained(ct, backend="numpy")
    assert any("kv_a_proj_with_mqa (dense) and self_attn.g_proj (FP4)" in n for n in prop.weights.notes), \
        prop.weights.notes
    assert prop.weights.modules[0].mla_kv_a.dtype == np.float32
    assert run_rounds(ct, "numpy", "exact")[1] == run_rounds(twin, "numpy", "exact")[1]


# -- sharded: the gate's rows by the rank's heads ---------------------------------------------------

@pytest.mark.parametrize("name", ["gated", "gated_dsa"])
@pytest.mark.parametrize("kv_mode", ["exact", "draft"])
def test_two_ranks_match_one(tmp_path_factory, name, kv_mode):
    """2 ranks: each holds kv_a_proj_with_mqa whole and g_proj's rows of its 2 heads (its gate
    columns those of its heads' attention output); call for call the single rank's."""
    import test_shard

    path, _ = ckpt(tmp_path_factory, name)
    test_shard.check_world(path, 2, kv_mode, 3)


def test_rank_weights_are_slices_and_the_planned_step_matches_one_rank(tmp_path_factory):
    import test_shard

    path, w = ckpt(tmp_path_factory, "gated")

    def rank_weights(prop, comm):
        kv_a = prop.weights.modules[0].mla_kv_a
        r = comm.rank
        np.testing.assert_array_equal(kv_a[:48], w.modules[0].mla_kv_a[:48])
        np.testing.assert_array_equal(kv_a[48:], w.modules[0].mla_kv_a[48 + 24 * r:48 + 24 * (r + 1)])
        assert prop.modules[0].block.kv_a_size == 48 + 24

    test_shard.check_planned_world(path, "exact", rank_weights)
