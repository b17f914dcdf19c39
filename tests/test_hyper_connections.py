"""Hyper-connections (``hc_mult`` > 1, DeepSeek-V4's mHC) as a block feature of any module:
the hidden a target hands over and a module hands on is ``hc_mult`` streams of H; every
stream goes through eh_proj with the token's embedding; the attention and the FFN read the
streams' collapse and write back through ``hc_post``; the LM head reads ``hc_head``'s
collapse (mtpkern.ops.hc, docs/architecture.md "Hyper-connections").

A module's outputs (its streams and the normed hidden the LM head reads) against the float64
oracle (mtpkern.testing.oracle, written from the model's formulas), with negative controls
that must fail (hc_head replaced by the streams' mean, comb read untransposed, the embedding
and hidden halves of eh_proj swapped); drafts and KV of a whole proposer against the oracle
in exact mode, GQA and MLA; bad widths and options refused by name. The state machine,
sharding and schedules run an HC checkpoint too (tests/test_state_machine.py,
tests/test_shard.py).
"""

from __future__ import annotations

import numpy as np
import pytest

import test_oracle
from conftest import MLA_FIELDS
from mtpkern import MultiModuleMtpHead, write_synthetic_checkpoint
from mtpkern.config import tiny_config
from mtpkern.head import RowJob
from mtpkern.testing import oracle, reference_weights
from mtpkern.tolerance import assert_close

#: hyper-connections over the tiny GQA block, and over an MLA one
HC_CFGS = {"gqa": dict(hc_mult=4), "mla": dict(MLA_FIELDS, hc_mult=3, hc_sinkhorn_iters=7)}
BACKENDS = ["numpy", "cpu"]


@pytest.fixture(scope="module", params=sorted(HC_CFGS))
def hc_ckpt(request, tmp_path_factory):
    cfg = tiny_config(**HC_CFGS[request.param])
    path = write_synthetic_checkpoint(tmp_path_factory.mktemp(f"hc_{request.param}"), cfg, seed=13,
                                      dtype="float32")
    return path, cfg, reference_weights(path)


def module_rows(path, backend, m, toks, g):
    """Module m of a fresh proposer over rows 0..R-1 (keys 0.., positions key + m + 1)."""
    prop = MultiModuleMtpHead.from_pretrained(path, backend=backend, block_size=4, num_blocks=64)
    head = prop.modules[m]
    seq = head.alloc_seq()
    y, normed = head.forward([RowJob(seq, np.asarray(toks, np.int32), 0, m + 1, None)], g)
    return prop.backend.to_host(y), prop.backend.to_host(normed)


@pytest.mark.parametrize("backend", BACKENDS)
def test_module_outputs_equal_the_oracle(hc_ckpt, backend):
    path, cfg, w = hc_ckpt
    rng = np.random.default_rng(3)
    R = 9
    toks = rng.integers(0, cfg.vocab_size, R)
    g = rng.standard_normal((R, cfg.stream_size)).astype(np.float32)
    for m in range(cfg.num_modules):
        y, normed = module_rows(path, backend, m, toks, g)
        want = oracle.module_forward(cfg, w.modules[m], m, toks, g)
        assert y.shape == (R, cfg.stream_size) and normed.shape == (R, cfg.hidden_size)
        assert_close(y, want.y, "float32", f"{backend} module {m}: streams")
        assert_close(normed, want.normed, "float32", f"{backend} module {m}: normed")


@pytest.mark.parametrize("wrong", ["head_mean", "comb_untransposed", "eh_swapped"])
def test_negative_controls_fail(hc_ckpt, monkeypatch, wrong):
    """Each wiring slip, put into the oracle, moves the outputs beyond the tolerance the test
    above holds the modules to."""
    path, cfg, w = hc_ckpt
    rng = np.random.default_rng(4)
    R = 7
    toks = rng.integers(0, cfg.vocab_size, R)
    g = rng.standard_normal((R, cfg.stream_size)).astype(np.float32)
    y, normed = module_rows(path, "numpy", 0, toks, g)
    mw = w.modules[0]
    if wrong == "head_mean":
        monkeypatch.setattr(oracle, "_hc_head", lambda c, hc, Y: Y.reshape(Y.shape[0], c.hc_mult, -1).mean(1))
    elif wrong == "comb_untransposed":
        orig = oracle._residual
        monkeypatch.setattr(oracle, "_residual", lambda x, out, hc: orig(
            x, out, None if hc is None else (hc[0], np.swapaxes(hc[1], 1, 2))))
    else:
        H = cfg.hidden_size
        eh = np.asarray(mw.eh_proj)
        mw = type(mw)(**{**{f: getattr(mw, f) for f in mw.__slots__},
                         "eh_proj": np.concatenate([eh[:, H:], eh[:, :H]], axis=1)})
    want = oracle.module_forward(cfg, mw, 0, toks, g)
    with pytest.raises(AssertionError):
        assert_close(y, want.y, "float32", "streams")
        assert_close(normed, want.normed, "float32", "normed")


@pytest.mark.parametrize("backend", BACKENDS)
def test_drafts_and_kv_equal_the_oracle(hc_ckpt, backend):
    path, cfg, w = hc_ckpt
    prop = MultiModuleMtpHead.from_pretrained(path, backend=backend, kv_mode="exact", block_size=4, num_blocks=96,
                                              prefill_chunk=5)
    assert prop.chain == "prenorm"
    test_oracle.run_scenario(prop, cfg, w, 6, 11, [(3, 1.0), (3, 0.4), (2, 0.0), (3, 1.0)], "prenorm", None)


def test_widths_and_options_refused_by_name(hc_ckpt):
    path, cfg, _ = hc_ckpt
    prop = MultiModuleMtpHead.from_pretrained(path, backend="numpy", block_size=4, num_blocks=32)
    st = prop.alloc_state()
    with pytest.raises(ValueError, match=rf"hiddens.*{cfg.stream_size}"):
        prop.prefill_drafter([1, 2, 3], np.zeros((3, cfg.hidden_size), np.float32), st)
    with pytest.raises(ValueError, match="chain: a module with hyper-connections"):
        MultiModuleMtpHead.from_pretrained(path, backend="numpy", chain="postnorm")
    with pytest.raises(ValueError, match="apply_target_norm: the target hands hyper-connection streams"):
        MultiModuleMtpHead.from_pretrained(path, backend="numpy", apply_target_norm=True)
