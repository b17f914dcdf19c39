"""Per-module blocks (mtpkern/block.py): sliding windows, attention sinks, a value head
dim of its own, head-wise output gates, MLA's element-wise g_proj gate without RoPE, SwiGLU
clamps (of silu(gate), or of the gate before silu as DeepSeek-V4), DeepSeek-V4's sqrtsoftplus
router, the RoPE variants (interleaved pairs, YaRN), and modules that differ from each other
(heads, RoPE, dense or MoE), in the canonical layout.

Each feature runs through the proposer under random call sequences with every call
checked against the float64 oracle (mtpkern.testing: exact mode recomputes the
chain, draft mode replays each module's rows), on the NumPy reference and the Numba
cpu backend; each feature is also shown to change what a module computes (so that a
feature both sides ignored could not pass).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

from conftest import rand_hiddens
from mtpkern import ConfigError, MtpConfig, MultiModuleMtpHead, write_synthetic_checkpoint
from mtpkern.block import BlockSpec, Yarn
from mtpkern.config import tiny_config
from mtpkern.head import RowJob
from mtpkern.testing import reference_weights
from mtpkern.testing.machine import proposer_machine

#: module 1: a sliding window, more query heads, its own RoPE, a dense MLP; module 2:
#: a value head dim of its own, attention sinks, a head-wise gate, SwiGLU clamps
MIXED_BLOCKS = [{}, {"sliding_window": 4, "num_attention_heads": 8, "rope_theta": 5e5, "partial_rotary_factor": 1.0,
                     "moe": False},
                {"v_head_dim": 8, "attn_sinks": True, "attn_gate": "headwise", "swiglu_clamp": 0.4,
                 "swiglu_clamp_shared": 0.3}]

#: YaRN with a tiny original context (12 positions: every run goes past it); mscale beside
#: mscale_all_dim makes both the cos/sin factor (1.025) and the scores' factor (1.23) other than 1
YARN = {"factor": 4.0, "original_max_position_embeddings": 12, "mscale": 1.0, "mscale_all_dim": 0.8}

#: MLA at odd sizes: L 40 (not a multiple of 32), P 12, R 8, Dv 12, q_lora_rank 24
MLA = dict(kv_lora_rank=40, q_lora_rank=24, qk_rope_head_dim=8, head_dim=20, v_head_dim=12, num_key_value_heads=4,
           partial_rotary_factor=1.0, use_qk_norm=False, attention_bias=False)

FEATURES = {
    "window": dict(sliding_window=5),
    "sinks": dict(attn_sinks=True),
    "v_head_dim": dict(v_head_dim=24),
    "headwise_gate": dict(attn_gate="headwise"),
    "clamps": dict(swiglu_clamp=0.4, swiglu_clamp_shared=0.3),
    # DeepSeek-V4's FFN: sqrt(softplus) router scores over one group, both clamps on the gate
    # before silu; module 1 a dense MLP (its clamp is the shared one)
    "v4_ffn": dict(scoring_func="sqrtsoftplus", n_group=1, topk_group=1, swiglu_clamp=0.4,
                   swiglu_clamp_shared=0.3, swiglu_clamp_gate=True, intermediate_size=40,
                   blocks=[{}, {"moe": False}, {}]),
    # MiMo-V2-Flash's MTP block, small: a dense block in a MoE model, a window, sinks, Dv < D
    "window_sinks_dv_dense": dict(sliding_window=4, attn_sinks=True, v_head_dim=8, intermediate_size=40,
                                  blocks=[{"moe": False}] * 3),
    "mixed": dict(intermediate_size=40, blocks=MIXED_BLOCKS),
    "interleave": dict(rope_interleave=True),
    "yarn": dict(rope_scaling=dict(YARN, mscale=0.0, mscale_all_dim=0.0)),    # cos/sin factor 1.139 only
    # DeepSeek-V3 / GLM-5 style: YaRN with both mscales, interleaved pairs, whole heads rotated
    "yarn_interleave": dict(rope_interleave=True, rope_scaling=YARN, partial_rotary_factor=1.0),
    # per module: plain, interleaved, YaRN with partial rotation
    "rope_per_module": dict(blocks=[{}, {"rope_interleave": True}, {"rope_scaling": YARN}]),
    # DeepSeek-V3's MLA (q_lora_rank, interleaved RoPE, YaRN past the original context), small
    "mla": dict(MLA, rope_interleave=True, rope_scaling=YARN),
    # GLM-5.3's MTP attention, small: MLA without RoPE (qk_rope_head_dim 0: latent rows of L alone,
    # scores scaled by P^-0.5 times YaRN's mscale), alone and under DSA's indexer (5 keys), which
    # then rotates nothing either
    "mla_nope": dict(MLA, qk_rope_head_dim=0, head_dim=16, rope_interleave=True, rope_scaling=YARN),
    "mla_nope_dsa": dict(MLA, qk_rope_head_dim=0, head_dim=16, rope_interleave=True, rope_scaling=YARN,
                         index_topk=5, index_n_heads=4, index_head_dim=16, indexer_rope_interleave=True),
    # Kimi K3's gated MLA, small: no RoPE although R = 8 (the query's and the shared key's last 8
    # dims kept, unrotated), an element-wise output gate from its own g_proj [Hq Dv, H]
    "mla_gated": dict(MLA, nope=True, attn_gate="elementwise", rope_interleave=True),
    # MLA with a plain q_proj, a sliding window, neox RoPE; module 1 a GQA block, module 2 dense
    "mla_mixed": dict(MLA, q_lora_rank=0, sliding_window=6, intermediate_size=40,
                      blocks=[{}, {"kv_lora_rank": 0, "qk_rope_head_dim": 0, "head_dim": 16, "v_head_dim": 0,
                               "partial_rotary_factor": 0.5}, {"moe": False, "v_head_dim": 8}]),
}


def feature_config(name: str) -> MtpConfig:
    return tiny_config(**FEATURES[name])


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    made = {}

    def get(name):
        if name not in made:
            path = write_synthetic_checkpoint(tmp_path_factory.mktemp(name), feature_config(name), seed=13,
                                              dtype="float32")
            made[name] = path, reference_weights(path)
        return made[name]
    return get


# -- the config -----------------------------------------------------------------------------

def test_blocks_take_the_global_fields_and_their_overrides():
    cfg = feature_config("mixed")
    b0, b1, b2 = (cfg.block(m) for m in range(3))
    assert b0 == cfg.block_default() and b0.moe and b0.num_attention_heads == 4
    assert (b1.sliding_window, b1.num_attention_heads, b1.rope_theta, b1.rotary_dim, b1.moe) == (4, 8, 5e5, 16, False)
    assert (b2.v_dim, b2.o_size, b2.gate_size, b2.qkv_size) == (8, 32, 4, 64 + 32 + 16 + 4)
    assert "module 1: Hq=8" in cfg.describe() and "window=4" in cfg.describe()


def test_blocks_round_trip_through_config_json():
    for name in FEATURES:
        cfg = feature_config(name)
        back = MtpConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
        assert back == cfg and [back.block(m) for m in range(3)] == [cfg.block(m) for m in range(3)], name
    assert "mtp_blocks" not in tiny_config().to_dict() and "sliding_window" not in tiny_config().to_dict()


@pytest.mark.parametrize("blocks,match", [
    ([{}, {"window": 4}, {}], r"module 1: unknown block field\(s\) \['window'\]"),
    ([{}, {"sliding_window": -1}, {}], r"'sliding_window' must be an int in \[0, .*got -1 \(module 1, mtp_blocks\)"),
    ([{}, {}, {"num_attention_heads": 3}], r"multiple of num_key_value_heads, got 3 and 2 \(module 2"),
    ([{}, {}, {"attn_gate": "per_row"}], r"attn_gate expected one of .*got 'per_row' \(module 2"),
    ([{}, {"rope_theta": 0.5}, {}], r"'rope_theta' must be in \(1, 1e\+12\], got 0.5 \(module 1"),
    ([{}, {"swiglu_clamp": -1.0}, {}], r"swiglu_clamp expected a number in \[0, 1e6\]"),
    ([{}, {"swiglu_clamp_gate": 1}, {}], r"swiglu_clamp_gate expected a bool, got 1 \(module 1"),
    ([{}, {"moe": False}, {}], r"dense MTP module needs intermediate_size > 0"),
    ([{}, {}], r"'mtp_blocks' expected a list of 3 objects \(one per module\), got 2"),
    ([{}, 5, {}], r"mtp_blocks\[1\] expected an object, got 5"),
])
def test_bad_blocks_are_refused_naming_the_module(blocks, match):
    with pytest.raises(ConfigError, match=match):
        MtpConfig.from_dict(dict(tiny_config().to_dict(), mtp_blocks=blocks))


def test_v4_ffn_config_fields():
    """scoring_func 'sqrtsoftplus' and swiglu_clamp_gate read from config.json (canonical
    layout) into the router and every block; gpt-oss's swiglu_limit stays refused (its formula
    differs: up + 1, sigmoid(alpha x))."""
    cfg = feature_config("v4_ffn")
    d = cfg.to_dict()
    assert d["scoring_func"] == "sqrtsoftplus" and d["swiglu_clamp_gate"] is True
    assert all(cfg.block(m).swiglu_clamp_gate for m in range(3)) and "clamp 0.4/0.3 of the gate" in cfg.describe()
    assert "swiglu_clamp_gate" not in tiny_config().to_dict()
    with pytest.raises(ConfigError, match=r"field 'swiglu_clamp_gate' expected bool"):
        MtpConfig.from_dict(dict(d, swiglu_clamp_gate="true"))
    with pytest.raises(ConfigError, match="swiglu_limit"):
        MtpConfig.from_dict(dict(d, swiglu_limit=10.0))


def test_mla_modules_hold_one_latent_row_per_token(ckpts):
    """An MLA module's pool is one [NB, BS, L + R] cache (no V), its bytes per token in
    ``memory()``; a GQA module beside it keeps K and V."""
    path, w = ckpts("mla_mixed")
    prop = MultiModuleMtpHead.from_pretrained(path, backend="numpy", block_size=4, num_blocks=10)
    p0, p1, p2 = (h.pool for h in prop.modules)
    assert p0.k.shape == (10, 4, 48) and p0.v is None and p0.latent_width == 48
    assert p1.k.shape == (10, 4, 4, 16) and p1.v.shape == (10, 4, 4, 16) and p1.latent_width == 0
    mem = prop.memory()
    assert mem.kv_row_bytes == (48 * 4, 4 * 2 * 16 * 4, 48 * 4)
    assert mem.kv_pools == 10 * 4 * sum(mem.kv_row_bytes) and mem.kv_block == 4 * 48 * 4
    assert w.modules[0].mla_q_a is None and w.modules[0].mla_uk.shape == (4, 12, 40)
    assert w.modules[2].mla_uv.shape == (4, 8, 40) and w.modules[1].mla_kv_a is None
    assert "MLA Hq=4 L=40 P=12 R=8 q_proj" in prop.config.describe()


@pytest.mark.parametrize("edit,match", [
    (dict(MLA, qk_rope_head_dim=7), r"qk_rope_head_dim expected an even number in \[0, head_dim\)"),
    (dict(MLA, qk_rope_head_dim=20), r"qk_rope_head_dim expected an even number in \[0, head_dim\) .* = 20 in MLA\), got 20"),
    (dict(MLA, qk_rope_head_dim=0, head_dim=12, index_topk=4, index_n_heads=2, index_head_dim=0),
     r"index_head_dim expected an int in \[1, 1024\]"),
    (dict(MLA, v_head_dim=0), r"v_head_dim expected > 0 in MLA"),
    (dict(MLA, partial_rotary_factor=0.5), r"partial_rotary_factor expected 1 in MLA"),
    (dict(MLA, attn_sinks=True), r"attn_sinks expected False in MLA"),
    (dict(MLA, use_qk_norm=True), r"an MLA module has no q/k norms"),
    (dict(qk_rope_head_dim=8), r"field 'qk_rope_head_dim' = 8 describes multi-head latent attention"),
    (dict(MLA, shared_kv=True), r"shared_kv, out_rope and o_groups are GQA features"),
    (dict(q_lora_rank=24), r"field 'q_lora_rank' = 24: a GQA block with q_lora_rank or shared_kv has no q/k/v biases.*expected attention_bias false"),
    (dict(shared_kv=True, attention_bias=False, v_head_dim=8), r"shared_kv: the value is the key"),
    (dict(o_groups=2, attention_bias=False), r"o_groups and o_lora_rank go together"),
    (dict(o_groups=3, o_lora_rank=8, attention_bias=False), r"o_groups = 3 must divide num_attention_heads = 4"),
])
def test_bad_mla_blocks_are_refused(edit, match):
    with pytest.raises(ConfigError, match=match):
        tiny_config(**edit)


def test_a_dense_module_in_a_moe_checkpoint_needs_no_experts_and_reads_its_mlp(ckpts):
    path, w = ckpts("mixed")
    assert w.modules[1].mlp_w13 is not None and w.modules[1].experts_w13 is None
    assert w.modules[0].experts_w13 is not None and w.modules[2].sinks.shape == (4,)


def test_an_element_wise_gate_needs_equal_value_and_key_head_dims():
    with pytest.raises(ConfigError, match="element-wise attention gate .* needs v_head_dim == head_dim"):
        tiny_config(attn_gate="elementwise", v_head_dim=8)
    with pytest.raises(ValueError, match="head_dim expected an int >= 1"):
        BlockSpec(num_attention_heads=4, num_key_value_heads=2, head_dim=0)


# -- each feature changes what a module computes ---------------------------------------------

def _module_rows(path, backend, cfg_edit=None, n=11, seed=2):
    """Module ``m``'s (y) over ``n`` fresh rows, for every module, optionally with the config
    edited (the same tensors)."""
    prop = MultiModuleMtpHead.from_pretrained(path, backend=backend, block_size=4, num_blocks=64)
    if cfg_edit is not None:
        cfg = dataclasses.replace(prop.config, **cfg_edit)
        prop = MultiModuleMtpHead(cfg, prop.weights, prop.backend, block_size=4, num_blocks=64)
    rng = np.random.default_rng(seed)
    out = []
    for head in prop.modules:
        seq = head.alloc_seq()
        toks = rng.integers(0, prop.config.vocab_size, n).astype(np.int32)
        y, _ = head.forward([RowJob(seq, toks, 0, head.index + 1)], rand_hiddens(rng, n, prop.config.hidden_size))
        out.append(prop.backend.to_host(y))
        head.free_seq(seq)
    return out


@pytest.mark.parametrize("name,off", [("window", {"sliding_window": 0}), ("sinks", {"attn_sinks": False}),
                                      ("v_head_dim", None), ("headwise_gate", {"attn_gate": ""}),
                                      ("clamps", {"swiglu_clamp": 0.0, "swiglu_clamp_shared": 0.0}),
                                      ("v4_ffn", {"swiglu_clamp_gate": False}),
                                      ("v4_ffn", {"scoring_func": "sigmoid"}),
                                      ("interleave", {"rope_interleave": False}), ("yarn", {"rope_scaling": None}),
                                      ("yarn_interleave", {"rope_scaling": None}),
                                      ("yarn_interleave", {"rope_interleave": False}),
                                      ("mla", {"rope_interleave": False}), ("mla", {"rope_scaling": None}),
                                      ("mla_gated", {"nope": False})])
def test_each_feature_changes_the_rows(ckpts, name, off):
    """The same tensors with the feature switched off compute other rows (a window: the
    same rows while they fit in it)."""
    path, _ = ckpts(name)
    on = _module_rows(path, "numpy")
    if off is None:                       # Dv: the value rows are another shape; the output one
        assert all(r.shape == (11, 64) for r in on)
        return
    ref = _module_rows(path, "numpy", off)
    for m in range(3):
        if "scoring_func" in off and not feature_config(name).block(m).moe:
            continue                      # a dense module has no router
        if name == "window":
            np.testing.assert_allclose(on[m][:5], ref[m][:5], rtol=1e-6, atol=1e-6)
        rows = slice(5, None) if name == "window" else slice(None)
        assert np.abs(on[m][rows] - ref[m][rows]).max() > 1e-3, f"module {m}: {name} changed nothing"


def test_each_yarn_factor_changes_the_rows(ckpts):
    """YaRN's frequencies, its cos/sin factor and its scores' factor each change the rows:
    the same tensors with one of them undone (the attention factor forced to 1; the
    scores' factor removed by mscale_all_dim = 0 with the attention factor kept)."""
    path, _ = ckpts("yarn_interleave")
    on = _module_rows(path, "numpy")
    y = Yarn.from_mapping(YARN)
    assert y.attention_factor != 1.0 and y.softmax_factor != 1.0
    edits = {"attention factor": dataclasses.replace(y, attention_factor_override=1.0),
             "scores' factor": dataclasses.replace(y, mscale=0.0, mscale_all_dim=0.0,
                                                   attention_factor_override=y.attention_factor)}
    for what, other in edits.items():
        ref = _module_rows(path, "numpy", {"rope_scaling": other})
        assert max(np.abs(a - b).max() for a, b in zip(on, ref)) > 1e-4, f"YaRN's {what} changed nothing"


def test_yarn_and_interleave_config_fields():
    cfg = feature_config("yarn_interleave")
    b = cfg.block(0)
    assert b.rope_interleave and isinstance(b.rope_scaling, Yarn) and "interleaved yarn x4 of 12" in cfg.describe()
    m = lambda f, k: 0.1 * k * np.log(f) + 1.0                        # noqa: E731
    assert np.isclose(b.rope_scale, m(4.0, 1.0) / m(4.0, 0.8)) and np.isclose(b.scale, 16 ** -0.5 * m(4.0, 0.8) ** 2)
    assert np.isclose(feature_config("yarn").block(0).rope_scale, m(4.0, 1.0))
    assert feature_config("yarn").block(0).scale == 16 ** -0.5
    d = cfg.to_dict()
    assert d["rope_interleave"] is True and d["rope_parameters"]["rope_type"] == "yarn"
    assert d["rope_parameters"]["original_max_position_embeddings"] == 12
    per = feature_config("rope_per_module")
    assert [per.block(m).rope_interleave for m in range(3)] == [False, True, False]
    assert per.block(2).rope_scaling == Yarn.from_mapping(YARN) and per.block(0).rope_scaling is None


def test_yarn_is_read_from_rope_scaling_or_rope_parameters():
    """DeepSeek-V3's rope_scaling (``type``), transformers 5's rope_parameters (``rope_type``),
    or both agreeing; the factor defaults to max_position_embeddings / original."""
    base = tiny_config().to_dict()
    del base["rope_parameters"]
    ds = {"type": "yarn", "factor": 4, "original_max_position_embeddings": 12, "mscale": 1.0,
          "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}
    want = feature_config("yarn_interleave")
    for d in (dict(base, rope_scaling=ds), dict(base, rope_parameters=dict(ds, rope_theta=1e4)),
              dict(base, rope_scaling=ds, rope_parameters=dict(ds, rope_type="yarn", rope_theta=1e4))):
        got = MtpConfig.from_dict(dict(d, rope_interleave=True, partial_rotary_factor=1.0))
        assert got == want
    got = MtpConfig.from_dict(dict(base, max_position_embeddings=48,
                                   rope_scaling={"type": "yarn", "original_max_position_embeddings": 12}))
    assert got.rope_scaling.factor == 4.0


@pytest.mark.parametrize("edit,match", [
    (dict(rope_scaling={"type": "yarn", "original_max_position_embeddings": 12, "factor": 0.5}),
     r"rope_scaling: rope_scaling.factor expected a number in \[1, 1e\+06\], got 0.5"),
    (dict(rope_scaling={"type": "yarn"}), r"rope_scaling.factor is required by rope_type 'yarn'"),
    (dict(rope_scaling={"type": "yarn", "factor": 4, "low_freq_factor": 1.0}),
     r"rope_scaling.low_freq_factor is not supported \(rope_type 'yarn' reads only"),
    (dict(rope_scaling={"type": "yarn", "factor": 4, "beta_fast": 1, "beta_slow": 32}),
     r"beta_slow \(32\) must be <= beta_fast \(1\)"),
    (dict(rope_scaling={"type": "yarn", "factor": "4"}), r"field 'rope_scaling.factor' expected float, got str"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), r"rope_scaling.rope_type 'llama3' is not supported"),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), r"rope_type 'dynamic' is not supported"),
    (dict(rope_scaling={"type": "linear", "factor": 2.0}), r"rope_type 'linear' is not supported"),
    (dict(rope_scaling={"type": "yarn", "factor": 4}, rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
     r"rope_parameters.rope_type 'default' disagrees with rope_scaling.rope_type 'yarn'"),
    (dict(rope_scaling={"type": "yarn", "factor": 4}, rope_parameters={"rope_type": "yarn", "factor": 8}),
     r"rope_parameters.factor \(8.0\) disagrees with rope_scaling.factor \(4.0\)"),
    (dict(rope_interleave=1), r"field 'rope_interleave' expected bool, got int 1"),
    (dict(rope_scaling={"type": "yarn", "factor": 4, "attention_factor": 2e3}),
     r"rope_scaling.attention_factor expected a number in \[0, 1000\], got 2000"),
    (dict(rope_scaling={"type": "yarn", "factor": 1e6, "mscale": 1e3, "mscale_all_dim": 1e-3}),
     r"attention factor 13.* must be in \(0, 1e3\]"),
    (dict(mtp_blocks=[{}, {"rope_interleave": "yes"}, {}]), r"rope_interleave expected a bool, got 'yes' \(module 1"),
    (dict(mtp_blocks=[{}, {}, {"rope_scaling": {"factor": 4, "original_max_position_embeddings": 12, "beta": 3}}]),
     r"unknown YaRN field\(s\) \['beta'\]"),
])
def test_bad_rope_variants_are_refused(edit, match):
    d = tiny_config().to_dict()
    del d["rope_parameters"]
    with pytest.raises(ConfigError, match=match):
        MtpConfig.from_dict(dict(d, **edit))


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_yarn_interleave_past_the_original_context_agrees_with_the_oracle(ckpts, backend):
    """Exact mode over positions 30 .. 50, past YaRN's original 12: drafts and every
    module's K/V rows against the float64 oracle after each call."""
    import test_oracle

    for name in ("yarn_interleave", "rope_per_module", "mla"):   # (windows: test_window_memory)
        path, weights = ckpts(name)
        prop = MultiModuleMtpHead.from_pretrained(path, backend=backend, kv_mode="exact", block_size=4,
                                                  num_blocks=96, prefill_chunk=7)
        test_oracle.run_scenario(prop, prop.config, weights, 5, 30, [(3, 1.0), (3, 0.4), (2, 0.0), (3, 1.0)],
                                 "prenorm", None)


# -- the proposer under random calls, checked against the oracle -------------------------------

SETTINGS = settings(max_examples=12, stateful_step_count=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@pytest.mark.parametrize("name", list(FEATURES))
@pytest.mark.parametrize("backend,kv_mode", [("numpy", "exact"), ("cpu", "draft"), ("cpu", "exact")])
def test_random_calls_agree_with_the_oracle(ckpts, name, backend, kv_mode):
    if backend == "numpy" and name not in ("mixed", "window_sinks_dv_dense", "yarn_interleave", "mla_mixed"):
        pytest.skip("numpy runs the combined configs; cpu runs every feature")
    path, weights = ckpts(name)
    machine = proposer_machine(lambda: MultiModuleMtpHead.from_pretrained(
        path, backend=backend, kv_mode=kv_mode, block_size=4, num_blocks=40, prefill_chunk=5), weights)
    machine.steps.clear()
    machine.TestCase.settings = SETTINGS
    machine.TestCase().runTest()
    assert machine.steps["propose"] + machine.steps["propose_batch"] > 20, dict(machine.steps)
