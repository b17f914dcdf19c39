"""vLLM's position-0 mask (``MtpConfig.embed_mask_pos0``) as a switch any family can turn on.

vLLM's MTP layers (``deepseek_mtp.py``, ``deepseek_v4_mtp.py``) zero the token embedding of
every row at position 0 before ``enorm``; the norm of a zero row is zero, so that row's
``eh_proj`` input is ``[0; hnorm(h)]``. vLLM numbers an MTP row ``(t_{j+1}, h_j)`` by its
hidden's position ``j``, mtpkern by its token's, ``j + 1`` (docs/semantics.md), so the masked
row is module 0's key 0 at RoPE position 1 (``EMBED_MASK_POSITION``, docs/model.md).

- the config field: read, typed, round-tripped; DeepSeek-V4's default (the release's
  config.json reads it on, a converted config may turn it off);
- module outputs against the float64 oracle (mtpkern.testing.oracle, which masks by its own
  code) on numpy, cpu and the emulated cuda kernels (tests/cuda_emu); negative control: the same checkpoint with the mask off differs
  on module 0's first row and gives the later modules (no row at position 1) the same bits;
- exact-mode drafts and KV against the oracle, prompts of one token included (the first
  propose's module-0 row is the masked one), and draft-mode drafts against ``DraftRows``;
- the planned step (mtpkern.cuda_graph) stages the flags: its drafts and KV are the eager
  path's where a planned step holds the masked row, and a captured graph replayed with the
  masked row in another sequence reads that call's flags.
The op itself (``mtp_input``'s ``zero_embed``) on every backend: tests/test_ops_reference.py,
tests/test_ops_backends.py (run on the emulated kernels by tests/test_cuda_emulated.py).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import test_cuda_graph_fake
import test_oracle
import test_planned_step
from conftest import kv_rows, rand_hiddens
from mtpkern import ConfigError, MtpConfig, MultiModuleMtpHead, write_synthetic_checkpoint
from mtpkern.config import EMBED_MASK_POSITION, tiny_config
from mtpkern.cuda_graph import StepRunner
from mtpkern.head import RowJob
from mtpkern.testing import oracle, reference_weights
from mtpkern.tolerance import assert_close
from test_cuda_graph_fake import fake_cuda  # noqa: F401 (the fixture)

CFG = tiny_config(embed_mask_pos0=True)
BACKENDS = ["numpy", "cpu"]


def _on_off(root, cfg):
    """(mask on, the same checkpoint with the mask off, reference weights)."""
    on = write_synthetic_checkpoint(root / "on", cfg, seed=31, dtype="float32")
    off = root / "off"
    shutil.copytree(on, off)
    d = json.loads((on / "config.json").read_text())
    assert d["embed_mask_pos0"] is True
    (off / "config.json").write_text(json.dumps(dict(d, embed_mask_pos0=False)))
    return on, off, reference_weights(on)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return _on_off(tmp_path_factory.mktemp("embed_mask"), CFG)


@pytest.fixture(scope="module")
def ckpts1(tmp_path_factory):
    """One module: an exact-mode planned step at P = 1 (P >= M) writes module 0's key 0."""
    return _on_off(tmp_path_factory.mktemp("embed_mask1"), tiny_config(embed_mask_pos0=True, num_nextn_predict_layers=1))


# -- the config field ---------------------------------------------------------------------------

def test_the_field_reads_round_trips_and_is_typed():
    assert EMBED_MASK_POSITION == 1
    assert not tiny_config().embed_mask_pos0 and "embed_mask_pos0" not in tiny_config().to_dict()
    d = CFG.to_dict()
    assert d["embed_mask_pos0"] is True and MtpConfig.from_dict(d) == CFG
    assert "position-0 embedding mask" in CFG.describe()
    for bad in (1, "true", None):
        if bad is None:                     # null: the default
            assert not MtpConfig.from_dict(dict(d, embed_mask_pos0=None)).embed_mask_pos0
            continue
        with pytest.raises(ConfigError, match=r"field 'embed_mask_pos0' expected (bool|true or false), got"):
            MtpConfig.from_dict(dict(d, embed_mask_pos0=bad))
    with pytest.raises(ConfigError, match="'embed_mask_pos0' expected bool, got int 1"):
        tiny_config(embed_mask_pos0=1)


def test_deepseek_v4_masks_by_default_and_a_config_may_turn_it_off():
    from test_family_deepseek_v4 import FLASH

    cfg = MtpConfig.from_dict(FLASH)
    assert cfg.embed_mask_pos0 and MtpConfig.from_dict(cfg.to_dict()) == cfg
    off = MtpConfig.from_dict(dict(FLASH, embed_mask_pos0=False))
    assert not off.embed_mask_pos0
    assert off.to_dict()["embed_mask_pos0"] is False and MtpConfig.from_dict(off.to_dict()) == off
    v3 = dict(tiny_config(rope_interleave=True).to_dict(), model_type="deepseek_v3",
              architectures=["DeepseekV3ForCausalLM"])
    assert not MtpConfig.from_dict(v3).embed_mask_pos0          # transformers' families: off


# -- module outputs ----------------------------------------------------------------------------

def module_rows(path, backend, m, toks, g):
    """Module m of a fresh proposer over rows 0..R-1 (keys 0.., positions key + m + 1)."""
    prop = MultiModuleMtpHead.from_pretrained(path, backend=backend, block_size=4, num_blocks=64)
    head = prop.modules[m]
    y, normed = head.forward([RowJob(head.alloc_seq(), np.asarray(toks, np.int32), 0, m + 1, None)], g)
    return prop.backend.to_host(y), prop.backend.to_host(normed)


def _rows(R=7, seed=3):
    rng = np.random.default_rng(seed)
    return rng.integers(0, CFG.vocab_size, R), rng.standard_normal((R, CFG.hidden_size)).astype(np.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_module_outputs_equal_the_oracle(ckpts, backend):
    on, _, w = ckpts
    toks, g = _rows()
    for m in range(CFG.num_modules):
        y, normed = module_rows(on, backend, m, toks, g)
        want = oracle.module_forward(CFG, w.modules[m], m, toks, g)
        assert_close(y, want.y, "float32", f"{backend} module {m}: y")
        assert_close(normed, want.normed, "float32", f"{backend} module {m}: normed")
    unmasked = oracle.module_forward(tiny_config(), w.modules[0], 0, toks, g)   # the oracle's own control
    assert not np.allclose(unmasked.y[0], oracle.module_forward(CFG, w.modules[0], 0, toks, g).y[0], atol=1e-3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_mask_off_changes_module_0s_first_row_only(ckpts, backend):
    """The same weights with the mask off: module 0's row at position 1 differs (its later rows
    attend to that row's K/V, so they may differ too); modules 1.. hold no row at position 1
    and keep their bits."""
    on, off, _ = ckpts
    toks, g = _rows()
    for m in range(CFG.num_modules):
        y_on, _ = module_rows(on, backend, m, toks, g)
        y_off, _ = module_rows(off, backend, m, toks, g)
        if m == 0:
            assert not np.allclose(y_on[0], y_off[0], atol=1e-3), "module 0's first row"
        else:
            np.testing.assert_array_equal(y_on, y_off, err_msg=f"module {m}")


# -- the proposer --------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", [1, 2, 6])
def test_exact_mode_drafts_and_kv_equal_the_oracle(ckpts, backend, n):
    """Prompts of 1 token (the first propose writes the masked row), 2 (the prefill writes it
    alone) and 6."""
    on, _, w = ckpts
    prop = MultiModuleMtpHead.from_pretrained(on, backend=backend, kv_mode="exact", block_size=4, num_blocks=96,
                                              prefill_chunk=5)
    test_oracle.run_scenario(prop, CFG, w, 5 + n, n, [(3, 1.0), (3, 0.4), (2, 0.0), (3, 1.0)], prop.chain, None)


@pytest.mark.parametrize("backend", BACKENDS)
def test_draft_mode_drafts_equal_the_oracle(ckpts, backend):
    on, off, w = ckpts
    drafts = {}
    for path in (on, off):
        prop = MultiModuleMtpHead.from_pretrained(path, backend=backend, kv_mode="draft", block_size=4, num_blocks=96)
        ref = oracle.DraftRows(prop.config, w, prop.chain)
        rng = np.random.default_rng(17)
        H, V = CFG.hidden_size, CFG.vocab_size
        st = prop.alloc_state()
        toks, hid = rng.integers(0, V, 4).tolist(), rand_hiddens(rng, 4, H)
        prop.prefill_drafter(toks, hid, st)
        ref.prefill(toks, hid)
        P, pending, got = 4, hid[-1], []
        for k, a in ((3, 2), (3, 0), (2, 2), (3, 3)):
            t = int(rng.integers(0, V))
            d = prop.propose(t, pending, P, k, st)
            assert d == ref.propose(t, pending, P, k), f"P={P}: drafts {d}"
            prop.after_verify(a, st)
            ref.verify(a)
            got.append(d)
            P, pending = P + 1 + a, rand_hiddens(rng, 1, H)[0]
        drafts[path] = got
        k0, _ = kv_rows(prop, st, 0)
        drafts[path, "k"] = k0[0]
    assert not np.allclose(drafts[on, "k"], drafts[off, "k"], atol=1e-4), "module 0's key 0: the mask changed nothing"


@pytest.mark.parametrize("mode", ["draft", "exact"])
def test_the_planned_step_stages_the_flags(ckpts1, mode):
    """One module, prompts of one token: the first propose (planned: P = 1 >= M) writes module
    0's key 0 at position 1; drafts and KV are the eager path's. A planned propose at P = 1 on
    the mask-off checkpoint writes another K row there (the flags reached the planned step)."""
    on, off, _ = ckpts1
    cfg = MtpConfig.from_json(on / "config.json")
    key0 = {}
    for path in (on, off):
        def make(p=path):
            return MultiModuleMtpHead.from_pretrained(p, backend="numpy", kv_mode=mode, block_size=4, num_blocks=160,
                                                      prefill_chunk=6)
        eager, planned = make(), make()
        planned.step_runner = StepRunner(planned, capture=False)
        counts = test_planned_step.run_twins(eager, planned, cfg, 7, [1, 1, 5],
                                             [(1, [1.0, 0.0], [None]), (1, [0.5], [None]), (1, [1.0], [None])])
        assert counts.get("executed", 0) + counts.get("replayed", 0) == 3, counts
        st = planned.alloc_state()
        rng = np.random.default_rng(2)
        before = planned.step_runner.counts["replayed"] + planned.step_runner.counts["executed"]
        planned.prefill_drafter([5], rand_hiddens(rng, 1, cfg.hidden_size), st)
        planned.propose(6, rand_hiddens(rng, 1, cfg.hidden_size)[0], 1, 1, st)
        assert planned.step_runner.counts["replayed"] + planned.step_runner.counts["executed"] == before + 1
        key0[path] = kv_rows(planned, st, 0)[0][0]
    assert not np.allclose(key0[on], key0[off], atol=1e-4)


@pytest.mark.parametrize("mode", ["draft", "exact"])
def test_a_replayed_graph_reads_each_calls_flags(fake_cuda, ckpts1, mode):
    """Through the fake CUDA runtime (tests/test_cuda_graph_fake.py): a step captured with the
    masked row in sequence 0 is replayed with it in sequence 1; the replays give the eager
    path's drafts and KV (the flags are staged per call, not baked into the graph)."""
    on, _, _ = ckpts1
    cfg = MtpConfig.from_json(on / "config.json")
    eager, graph = test_cuda_graph_fake._twins(on, mode, fake_cuda)
    first = test_planned_step.run_twins(eager, graph, cfg, 3, [1, 3], [(1, [1.0], [None])])
    again = test_planned_step.run_twins(eager, graph, cfg, 4, [3, 1], [(1, [0.0], [None])])
    assert first["captured"] == 1 and again["replayed"] == 1 and not again.get("executed"), (first, again)


@pytest.fixture
def emu():
    """The CUDA kernels on the CPU (tests/cuda_emu), routing the cuda launchers for one test."""
    from cuda_emu import emu_backend

    yield from emu_backend.installed_emulator()


def test_module_outputs_on_the_emulated_kernels(ckpts, emu):
    """The cuda backend (FP32 KV, its kernels emulated): every module equals the oracle, and the
    mask off moves module 0's first row."""
    from cuda_emu import emu_backend

    on, off, w = ckpts
    toks, g = _rows(R=5, seed=4)
    ran = sum(c for name, c in emu.launches.items() if name.startswith("mtp_norms_kernel"))
    for m in range(CFG.num_modules):
        y, normed = module_rows(on, emu_backend.backend("float32"), m, toks, g)
        want = oracle.module_forward(CFG, w.modules[m], m, toks, g)
        assert_close(y, want.y, "float32", f"emulated module {m}: y")
        assert_close(normed, want.normed, "float32", f"emulated module {m}: normed")
    assert sum(c for name, c in emu.launches.items() if name.startswith("mtp_norms_kernel")) >= ran + CFG.num_modules
    y_on, _ = module_rows(on, emu_backend.backend("float32"), 0, toks, g)
    y_off, _ = module_rows(off, emu_backend.backend("float32"), 0, toks, g)
    assert not np.allclose(y_on[0], y_off[0], atol=1e-3)
