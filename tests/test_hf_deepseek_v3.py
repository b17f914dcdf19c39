"""External standard for DeepSeek-V3 (docs/semantics.md, MLA): with the family's default chain
(``postnorm``), exact mode drafts the same tokens as Hugging Face transformers'
``generate(..., use_mtp=True)`` (5.24+, ``DeepseekV3ForCausalLM`` with the generic
``MtpLayer`` / ``MtpModel`` of ``modeling_layers.py``) on the same checkpoint and target hiddens.

Two tiny random checkpoints (float32, 2 target layers, MoE MTP modules with sigmoid grouped
routing and a nonzero ``e_score_correction_bias``; ``hf_reference.DS3_CASES``):

- ``yarn``: 3 modules, q_a_proj / q_b_proj (q_lora_rank 24), kv_lora_rank 20, qk_nope 12 !=
  v_head_dim 10, qk_rope 8 in GPT-J pairs (``rope_interleave``), YaRN x4 from 16 positions with
  mscale 1.0 / mscale_all_dim 0.8 (cos / sin x 1.025, softmax scale x mscale(4, 0.8)^2 = 1.234);
- ``plain``: 2 modules, a plain q_proj (q_lora_rank None), neox-halves RoPE, no scaling.

Each is written by HF's ``save_pretrained`` (config.json as transformers writes it) plus the
MTP tensors in the release layout (``model.layers.{L+m}.*``, experts one by one); HF generates
greedily (and steered to every acceptance count) from two prompts longer than YaRN's original
context while ``MTPCandidateGenerator.get_candidates`` is recorded; the same calls are replayed
through ``MultiModuleMtpHead.from_pretrained(same dir, backend=numpy | cpu, kv_mode="exact")``
and every step's drafts must be equal. rms_norm_eps is 1e-6, the eps transformers fixes for
q_a_layernorm / kv_a_layernorm (mtpkern uses rms_norm_eps, as vLLM). See docs/hf_reference.md.

Skipped unless torch and transformers >= 5.24 are importable:
``pip install torch "transformers>=5.24"``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import require_hf_mtp

require_hf_mtp()

import hf_reference as hr  # noqa: E402  (imports torch / transformers)

from mtpkern.config import MtpConfig  # noqa: E402
from mtpkern.ops.rope_kv import yarn_inv_freq  # noqa: E402

MAX_NEW = 40
#: both longer than YaRN's original_max_position_embeddings (16): every draft's rope
#: position is past it
PROMPT_LENS = (20, 17)
#: accepted drafts per verify (steered runs): every value 0..M, including the partial
#: ones (< M - 1) after which HF crops and recomputes its MTP cache
SCHEDULES = {2: [2, 1, 0, 2, 0, 1, 1], 3: [3, 0, 1, 2, 0, 3, 1, 2, 2]}


class Ds3Case:
    """One checkpoint, its HF model and, per prompt, its HF runs (greedy and steered)."""

    def __init__(self, name, path, model):
        self.name, self.path, self.model = name, path, model
        self.M = model.config.num_mtp_layers
        V = hr.DS3_TINY["vocab_size"]
        self.cases = [hr.Case(self.M, path, model, np.random.default_rng(400 + i).integers(0, V, n).tolist(),
                              SCHEDULES[self.M], MAX_NEW) for i, n in enumerate(PROMPT_LENS)]

    def ours(self, path=None, **kw):
        """mtpkern on the same directory (or ``path``), exact mode, the family's chain."""
        from mtpkern import MultiModuleMtpHead

        opts = dict(backend="numpy", kv_mode="exact")
        opts.update(kw)
        return MultiModuleMtpHead.from_pretrained(path or self.path, **opts)


@pytest.fixture(scope="module", params=sorted(hr.DS3_CASES))
def case(request, tmp_path_factory):
    name = request.param
    path = hr.build_deepseek_v3_checkpoint(tmp_path_factory.mktemp(f"hf_ds3_{name}"), name, seed=70)
    return Ds3Case(name, path, hr.load_deepseek_v3(path))


def test_config_json_is_read_as_transformers_wrote_it(case):
    """config.json is transformers' form (head_dim = qk_rope_head_dim, qk_head_dim,
    rope_parameters), and what we read from it is what HF's MTP layers compute with:
    the MLA ranks, the RoPE layout, YaRN's frequencies, cos / sin factor and softmax scale."""
    raw = json.loads((case.path / "config.json").read_text())
    c = case.model.config
    assert raw["model_type"] == "deepseek_v3" and raw["num_nextn_predict_layers"] == case.M
    assert raw["head_dim"] == c.qk_rope_head_dim and raw["qk_head_dim"] == c.qk_nope_head_dim + c.qk_rope_head_dim
    assert "rope_parameters" in raw and "rope_scaling" not in raw
    ours = MtpConfig.from_json(case.path / "config.json")
    assert ours.family == "deepseek_v3" and ours.num_modules == case.M
    assert ours.rms_norm_eps == c.rms_norm_eps == 1e-6     # = transformers' fixed q_a / kv_a layernorm eps
    b = ours.block(0)
    assert b.mla and b.moe
    assert (b.kv_lora_rank, b.q_lora_rank, b.qk_rope_head_dim, b.qk_nope_head_dim, b.v_head_dim) == (
        c.kv_lora_rank, c.q_lora_rank or 0, c.qk_rope_head_dim, c.qk_nope_head_dim, c.v_head_dim)
    assert b.head_dim == c.qk_nope_head_dim + c.qk_rope_head_dim and b.v_head_dim != b.qk_nope_head_dim
    assert b.rope_interleave == c.rope_interleave
    rot = case.model.model.rotary_emb
    attn = case.model.model.layers[0].self_attn
    hf_inv = rot.inv_freq.double().numpy()
    if case.name == "yarn":
        y = b.rope_scaling
        assert y is not None and y.factor == 4.0 and y.original_max_position_embeddings == 16
        ours_inv = yarn_inv_freq(b.qk_rope_head_dim, b.rope_theta, y.factor, y.original_max_position_embeddings,
                                 y.beta_fast, y.beta_slow, y.truncate)
        # the case's point: both YaRN factors differ from 1, and one frequency is blended
        assert y.attention_factor == pytest.approx(rot.attention_scaling, rel=1e-12)
        assert abs(y.attention_factor - 1) > 0.02
        assert y.softmax_factor == pytest.approx(attn.scaling * attn.qk_head_dim ** 0.5, rel=1e-12)
        assert abs(y.softmax_factor - 1) > 0.2
        base = b.rope_theta ** (-np.arange(0, b.qk_rope_head_dim, 2) / b.qk_rope_head_dim)
        ratio = hf_inv / base
        assert np.isclose(ratio, 1).any() and np.isclose(ratio, 1 / y.factor).any()
        assert (~np.isclose(ratio, 1) & ~np.isclose(ratio, 1 / y.factor)).any()
    else:
        assert b.rope_scaling is None and rot.attention_scaling == 1.0
        assert attn.scaling == attn.qk_head_dim ** -0.5 and attn.q_proj is not None
        ours_inv = b.rope_theta ** (-np.arange(0, b.qk_rope_head_dim, 2) / b.qk_rope_head_dim)
    np.testing.assert_allclose(ours_inv, hf_inv, rtol=1e-6)


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
@pytest.mark.parametrize("steer", [False, True], ids=["greedy", "steered"])
def test_drafts_match_hf_generate(case, steer, backend):
    M = case.M
    prop = case.ours(backend=backend)
    assert prop.chain == "postnorm"            # the family's default
    total = 0
    for c in case.cases:
        run = c.run(steer)
        steps = run.steps
        assert len(steps) >= 12, f"HF drafted only {len(steps)} times"
        assert all(len(s.drafts) == M for s in steps)
        assert len(steps[0].ids) - 1 > 16      # past YaRN's original context from the first draft
        if steer:
            assert {s.accepted for s in steps[1:]} == set(range(M + 1)), [s.accepted for s in steps]
        assert run.crops == [-M] * sum(s.accepted < M - 1 for s in steps[1:])
        rep = hr.replay(prop, steps)
        assert rep.first_mismatch is None, f"prompt {c.prompt}: " + hr.describe_mismatch(steps, rep)
        assert rep.ours == [s.drafts for s in steps]
        assert run.sequence[:len(steps[-1].ids)] == steps[-1].ids
        total += len(steps)
    assert total >= 30


def test_logits_match_hf_numerically(case):
    """Beyond the argmax: HF's draft logits equal the float64 oracle's (naive MLA, YaRN) over
    the steered runs, module by module, within float32 noise."""
    prop = case.ours()
    for c in case.cases:
        steps = c.run(True).steps
        rep = hr.replay(prop, steps)
        assert rep.first_mismatch is None, hr.describe_mismatch(steps, rep)
        worst = hr.oracle_logit_gap(prop, steps, rep)
        assert worst < 1e-4, f"max |logit difference| {worst}"   # observed ~2e-6


def _edited(case, tmp_path, edit) -> object:
    """The same tensors (a link to the file) with config.json changed by ``edit(dict)``."""
    d = json.loads((case.path / "config.json").read_text())
    edit(d)
    (tmp_path / "config.json").write_text(json.dumps(d))
    (tmp_path / "model.safetensors").symlink_to(case.path / "model.safetensors")
    return tmp_path


def _flip_interleave(d):
    d["rope_interleave"] = not d["rope_interleave"]


def _no_mscale_all_dim(d):
    del d["rope_parameters"]["mscale_all_dim"]


@pytest.mark.parametrize("wrong", ["prenorm-chain", "target-norm-twice", "rope-interleave-flipped",
                                   "no-mscale_all_dim"])
def test_comparison_detects_other_conventions(case, tmp_path, wrong):
    """Negative controls: conventions HF does not use give different drafts, so the match
    above is evidence, not luck: the prenorm chain, the target's final norm applied again,
    the other RoPE pairing (config.json's rope_interleave flipped, same tensors), and (the YaRN
    case) YaRN without mscale_all_dim (cos / sin x mscale(4) and no softmax correction)."""
    if wrong == "no-mscale_all_dim" and case.name != "yarn":
        pytest.skip("this case has no YaRN")
    kw = {"prenorm-chain": lambda: dict(chain="prenorm"),
          "target-norm-twice": lambda: dict(apply_target_norm=True),
          "rope-interleave-flipped": lambda: dict(path=_edited(case, tmp_path, _flip_interleave)),
          "no-mscale_all_dim": lambda: dict(path=_edited(case, tmp_path, _no_mscale_all_dim)),
          }[wrong]()
    prop = case.ours(**kw)
    for c in case.cases:
        for steer in (False, True):
            rep = hr.replay(prop, c.run(steer).steps)
            assert rep.first_mismatch is not None, (c.prompt, steer)
