"""External standard for Step-3.5 (docs/semantics.md): with ``chain="postnorm"``, exact mode
drafts the same tokens as Hugging Face transformers' ``generate(..., use_mtp=True)``
(5.24+, the ``step3p7`` port: ``Step3p7ForConditionalGeneration``, text model
``Step3p7TextConfig``, ``model_type`` "step3p5") on the same checkpoint and target hiddens.

Two tiny random checkpoints (float32, 3 target layers, 3 dense MTP modules, sliding
window 5 < the 12-token prompts; ``hf_reference.STEP_CASES``) are written by HF's
``save_pretrained`` (config.json in transformers' form) plus the MTP tensors under the
names HF's MTP loader reads; HF generates greedily (and steered to every acceptance
count) while ``MTPCandidateGenerator.get_candidates`` is recorded; the same calls
(prefill_drafter, propose, after_verify, catchup_drafter) are replayed through
``MultiModuleMtpHead.from_pretrained(same dir, backend="numpy", kv_mode="exact",
chain="postnorm")`` and every step's drafts must be equal. See docs/hf_reference.md.

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

MAX_NEW = 40
PROMPT_LEN = 12
W = hr.STEP_WINDOW
#: accepted drafts per verify (steered runs): every value 0..3, including the partial
#: ones (< 2) after which HF crops and recomputes its MTP cache
SCHEDULE = [3, 0, 1, 2, 0, 3, 1, 2, 2]


@pytest.fixture(scope="module", params=sorted(hr.STEP_CASES))
def case(request, tmp_path_factory):
    name = request.param
    path = hr.build_step3p7_checkpoint(tmp_path_factory.mktemp(f"hf_step3p7_{name}"), name, seed=50)
    # the vision tower's image token is never drawn: the prompt is text only
    prompt = np.random.default_rng(200 + len(name)).integers(0, hr.STEP_TINY["vocab_size"] - 1, PROMPT_LEN).tolist()
    c = hr.Case(3, path, hr.load_step3p7(path), prompt, SCHEDULE, MAX_NEW)
    c.name = name
    return c


def test_config_json_is_read_as_transformers_wrote_it(case):
    """config.json is transformers' form (a step3p7 config, the text model's lists trimmed to
    the target's layers, mtp_layer_types beside them), and our blocks are the MTP layers
    transformers builds from it (get_mtp_config: MTP index m)."""
    raw = json.loads((case.path / "config.json").read_text())
    text = raw["text_config"]
    assert raw["model_type"] == "step3p7" and text["model_type"] == "step3p5"
    assert len(text["layer_types"]) == hr.STEP_LAYERS and len(text["mtp_layer_types"]) == case.M
    assert "attention_other_setting" not in text and "num_sliding_attention_heads" in text
    mc = case.model.config.get_mtp_config()
    ours = MtpConfig.from_json(case.path / "config.json")
    assert ours.family == "step3p5" and ours.num_modules == mc.num_hidden_layers == case.M
    for m in range(case.M):
        b, lc = ours.block(m), mc.per_layer_config[m]
        kind = mc.layer_types[m]
        rope = mc.rope_parameters[kind]
        assert (b.num_attention_heads, b.num_key_value_heads, b.head_dim) == (
            lc.num_attention_heads, mc.num_key_value_heads, mc.head_dim)
        assert b.sliding_window == (mc.sliding_window if kind == "sliding_attention" else 0)
        assert (b.rope_theta, b.partial_rotary_factor) == (rope["rope_theta"], rope["partial_rotary_factor"])
        assert b.swiglu_clamp_shared == (mc.swiglu_limits_shared[m] or 0.0)
        assert b.attn_gate == "headwise" and not b.moe and mc.mlp_layer_types[m] == "dense"
    if case.name == "mixed":        # the case's point: heads, RoPE, window and a clamp per module
        assert [ours.block(m).num_attention_heads for m in range(3)] == [8, 4, 8]
        assert [ours.block(m).sliding_window for m in range(3)] == [W, 0, W]
        assert [ours.block(m).swiglu_clamp_shared for m in range(3)] == [0.0, 1.0, 0.0]


@pytest.mark.parametrize("steer", [False, True], ids=["greedy", "steered"])
def test_drafts_match_hf_generate(case, steer):
    M = case.M
    run = case.run(steer)
    steps = run.steps
    assert len(steps) >= 12, f"HF drafted only {len(steps)} times"
    assert all(len(s.drafts) == M for s in steps)
    # the window is crossed from the first draft on, and left far behind
    assert len(steps[0].ids) - 1 > W and len(steps[-1].ids) - 1 >= PROMPT_LEN + MAX_NEW - M - 1 > 8 * W
    if steer:
        assert {s.accepted for s in steps[1:]} == set(range(M + 1)), [s.accepted for s in steps]
    assert run.crops == [-M] * sum(s.accepted < M - 1 for s in steps[1:])
    rep = hr.replay(case.ours(), steps)
    assert rep.first_mismatch is None, hr.describe_mismatch(steps, rep)
    assert rep.ours == [s.drafts for s in steps]
    assert run.sequence[:len(steps[-1].ids)] == steps[-1].ids


def test_logits_match_hf_numerically(case):
    """Beyond the argmax: HF's draft logits equal the float64 oracle's over the whole steered
    run (windows, gates, zero-centred norms, the clamp), module by module."""
    steps = case.run(True).steps
    prop = case.ours()
    rep = hr.replay(prop, steps)
    assert rep.first_mismatch is None, hr.describe_mismatch(steps, rep)
    worst = hr.oracle_logit_gap(prop, steps, rep)
    assert worst < 1e-4, f"max |logit difference| {worst}"


def _edited(case, tmp_path, **text) -> object:
    """The same tensors (a link to the file) with ``text`` set in config.json's text_config."""
    d = json.loads((case.path / "config.json").read_text())
    d["text_config"].update(text)
    (tmp_path / "config.json").write_text(json.dumps(d))
    (tmp_path / "model.safetensors").symlink_to(case.path / "model.safetensors")
    return tmp_path


@pytest.mark.parametrize("wrong", ["prenorm-chain", "target-norm-twice", "no-window", "no-clamp"])
def test_comparison_detects_other_conventions(case, tmp_path, wrong):
    """Negative controls: the conventions HF does not use give different drafts, so the match
    above is evidence, not luck: the prenorm chain (vLLM's), the target's final norm applied
    again, attention over the whole context instead of the window (10**6), and (the mixed
    case) module 1 without its SwiGLU clamp. Each differs from HF's drafts at step 0-5."""
    if wrong == "no-clamp" and not any(hr.STEP_CASES[case.name]["swiglu_limits_shared"]):
        pytest.skip("this case has no SwiGLU clamp")
    kw = {"prenorm-chain": lambda: dict(chain="prenorm"),
          "target-norm-twice": lambda: dict(apply_target_norm=True),
          "no-window": lambda: dict(path=_edited(case, tmp_path, sliding_window=10 ** 6)),
          "no-clamp": lambda: dict(path=_edited(case, tmp_path, swiglu_limits_shared=[0.0] * hr.STEP_LAYERS)),
          }[wrong]()
    for steer in (False, True):
        rep = hr.replay(case.ours(**kw), case.run(steer).steps)
        assert rep.first_mismatch is not None, steer
