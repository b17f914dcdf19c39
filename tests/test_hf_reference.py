"""External standard (docs/semantics.md): with ``chain="postnorm"``, exact mode drafts the
same tokens as Hugging Face transformers' ``generate(..., use_mtp=True)`` (5.24+) on the
same checkpoint and target hiddens.

A tiny random Glm4Moe checkpoint (float32, MoE MTP modules, M = 2 and 3) is written by
HF's ``save_pretrained`` plus the MTP tensors in the GLM-4.5 layout; HF generates
greedily while ``MTPCandidateGenerator.get_candidates`` is recorded; the same calls
(prefill_drafter, propose, after_verify, catchup_drafter) are replayed through
``MultiModuleMtpHead.from_pretrained(same dir, backend="numpy", kv_mode="exact",
chain="postnorm")`` and every step's drafts must be equal. See docs/hf_reference.md.

Skipped unless torch and transformers >= 5.24 are importable:
``pip install torch "transformers>=5.24"``.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import require_hf_mtp

require_hf_mtp()

import hf_reference as hr  # noqa: E402  (imports torch / transformers)

from mtpkern.config import MtpConfig  # noqa: E402

MAX_NEW = 40
PROMPT_LEN = 12
#: accepted drafts per verify (steered runs): every value 0..M, including the partial
#: ones (< M - 1) after which HF crops and recomputes its MTP cache
SCHEDULES = {2: [2, 1, 0, 2, 0, 1, 1], 3: [3, 0, 1, 2, 0, 3, 1, 2, 2]}


@pytest.fixture(scope="module", params=[2, 3], ids=lambda m: f"M{m}")
def case(request, tmp_path_factory):
    M = request.param
    path = hr.build_checkpoint(tmp_path_factory.mktemp(f"hf_glm4moe_m{M}"), M, seed=30 + M)
    prompt = np.random.default_rng(100 + M).integers(0, hr.TINY["vocab_size"], PROMPT_LEN).tolist()
    return hr.Case(M, path, hr.load_hf(path), prompt, SCHEDULES[M], MAX_NEW)


def test_config_json_is_read_as_hf_wrote_it(case):
    """HF saves ``num_mtp_layers`` as ``num_nextn_predict_layers`` (attribute_map) and
    the RoPE fields under ``rope_parameters``; our loader reads the same numbers."""
    c = case.model.config
    ours = MtpConfig.from_json(case.path / "config.json")
    assert ours.num_nextn_predict_layers == c.num_mtp_layers == case.M
    assert ours.partial_rotary_factor == c.rope_parameters["partial_rotary_factor"] == 0.5
    assert ours.rope_theta == c.rope_parameters["rope_theta"]
    assert (ours.head_dim, ours.num_attention_heads, ours.num_key_value_heads) == (
        c.head_dim, c.num_attention_heads, c.num_key_value_heads)
    assert ours.is_moe          # HF builds every MTP layer as MoE (get_mtp_config: first_k_dense_replace = 0)
    assert (ours.n_routed_experts, ours.num_experts_per_tok, ours.n_group, ours.topk_group) == (
        c.n_routed_experts, c.num_experts_per_tok, c.n_group, c.topk_group)
    assert ours.routed_scaling_factor == c.routed_scaling_factor and ours.norm_topk_prob == c.norm_topk_prob


@pytest.mark.parametrize("steer", [False, True], ids=["greedy", "steered"])
def test_drafts_match_hf_generate(case, steer):
    M = case.M
    run = case.run(steer)
    steps = run.steps
    assert len(steps) >= 8, f"HF drafted only {len(steps)} times"
    assert all(len(s.drafts) == M for s in steps)
    if steer:
        assert {s.accepted for s in steps[1:]} == set(range(M + 1)), [s.accepted for s in steps]
    # HF re-runs the last M keys of every MTP layer after a verify that accepted < M - 1
    # drafts, and only then (candidate_generator.py); mtpkern trims exactly instead
    assert run.crops == [-M] * sum(s.accepted < M - 1 for s in steps[1:])
    rep = hr.replay(case.ours(), steps)
    assert rep.first_mismatch is None, hr.describe_mismatch(steps, rep)
    assert rep.ours == [s.drafts for s in steps]
    assert run.sequence[:len(steps[-1].ids)] == steps[-1].ids


def test_logits_match_hf_numerically(case):
    """Beyond the argmax: HF's draft logits equal the from-scratch oracle's (mtpkern.testing.oracle,
    float64) over the whole sequence, module by module, within float32 noise."""
    steps = case.run(True).steps
    prop = case.ours()
    rep = hr.replay(prop, steps)
    assert rep.first_mismatch is None, hr.describe_mismatch(steps, rep)
    worst = hr.oracle_logit_gap(prop, steps, rep)
    assert worst < 1e-4, f"max |logit difference| {worst}"   # observed ~2e-6


@pytest.mark.parametrize("wrong", [dict(chain="prenorm"), dict(apply_target_norm=True)],
                         ids=["prenorm-chain", "target-norm-twice"])
def test_comparison_detects_other_conventions(case, wrong):
    """Negative controls: the conventions HF does not use give different drafts, so the
    match above is evidence, not luck. (HF chains shared_head.norm(y) to the next module;
    the target hidden it hands over is already after the target's final norm.)"""
    for steer in (False, True):
        rep = hr.replay(case.ours(**wrong), case.run(steer).steps)
        assert rep.first_mismatch is not None, steer
