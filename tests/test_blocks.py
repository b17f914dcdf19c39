"""Per-module blocks (mtpkern/block.py): sliding windows, attention sinks, a value head
dim of its own, head-wise output gates, SwiGLU clamps, and modules that differ from
each other (heads, RoPE, dense or MoE), in the SPEC layout.

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
from mtpkern.block import BlockSpec
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

FEATURES = {
    "window": dict(sliding_window=5),
    "sinks": dict(attn_sinks=True),
    "v_head_dim": dict(v_head_dim=24),
    "headwise_gate": dict(attn_gate="headwise"),
    "clamps": dict(swiglu_clamp=0.4, swiglu_clamp_shared=0.3),
    # MiMo-V2-Flash's MTP block, small: a dense block in a MoE model, a window, sinks, Dv < D
    "window_sinks_dv_dense": dict(sliding_window=4, attn_sinks=True, v_head_dim=8, intermediate_size=40,
                                  blocks=[{"moe": False}] * 3),
    "mixed": dict(intermediate_size=40, blocks=MIXED_BLOCKS),
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
    ([{}, {"moe": False}, {}], r"dense MTP module needs intermediate_size > 0"),
    ([{}, {}], r"'mtp_blocks' expected a list of 3 objects \(one per module\), got 2"),
    ([{}, 5, {}], r"mtp_blocks\[1\] expected an object, got 5"),
])
def test_bad_blocks_are_refused_naming_the_module(blocks, match):
    with pytest.raises(ConfigError, match=match):
        MtpConfig.from_dict(dict(tiny_config().to_dict(), mtp_blocks=blocks))


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
                                      ("clamps", {"swiglu_clamp": 0.0, "swiglu_clamp_shared": 0.0})])
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
        if name == "window":
            np.testing.assert_allclose(on[m][:5], ref[m][:5], rtol=1e-6, atol=1e-6)
        rows = slice(5, None) if name == "window" else slice(None)
        assert np.abs(on[m][rows] - ref[m][rows]).max() > 1e-3, f"module {m}: {name} changed nothing"


# -- the proposer under random calls, checked against the oracle -------------------------------

SETTINGS = settings(max_examples=12, stateful_step_count=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@pytest.mark.parametrize("name", list(FEATURES))
@pytest.mark.parametrize("backend,kv_mode", [("numpy", "exact"), ("cpu", "draft"), ("cpu", "exact")])
def test_random_calls_agree_with_the_oracle(ckpts, name, backend, kv_mode):
    if backend == "numpy" and name not in ("mixed", "window_sinks_dv_dense"):
        pytest.skip("numpy runs the combined configs; cpu runs every feature")
    path, weights = ckpts(name)
    machine = proposer_machine(lambda: MultiModuleMtpHead.from_pretrained(
        path, backend=backend, kv_mode=kv_mode, block_size=4, num_blocks=40, prefill_chunk=5), weights)
    machine.steps.clear()
    machine.TestCase.settings = SETTINGS
    machine.TestCase().runTest()
    assert machine.steps["propose"] + machine.steps["propose_batch"] > 20, dict(machine.steps)
