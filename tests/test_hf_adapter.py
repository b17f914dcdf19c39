"""mtpkern as the drafter of Hugging Face ``generate`` (mtpkern/integrations/hf.py), against
transformers' own generation on the same checkpoint.

The checkpoint is mtpkern's synthetic GLM-4.5 one with its target layers
(``write_synthetic_checkpoint(..., target_layers=True)``, FP32), which transformers'
``Glm4MoeForCausalLM`` loads (``hf_reference.load_hf``: the instance names the checkpoint's MTP
layers, docs/hf_reference.md, "HF limitation"). The target runs in transformers; mtpkern drafts:

- lossless: ``integrations.hf.generate`` == plain greedy ``model.generate``, token for token,
  over several prompts, both KV modes;
- the same drafts as transformers' ``generate(use_mtp=True)`` (its ``MTPCandidateGenerator``)
  at every verify: the candidates are recorded where both runs hand them to the target (the
  inputs of each verify forward), greedy and steered to accept every count 0..M;
- negative controls: a drafter handed the hidden one position early drafts differently (and
  stays lossless), a prenorm chain drafts differently;
- refusals (batch > 1, sampling, beams, padding, another drafter, a mismatched proposer), each
  before the target runs, leaving the model and the proposer as they were.

Skipped unless torch and transformers >= 5.24 are importable (the ``hf`` extra). See
docs/integrations.md.
"""

from __future__ import annotations

import contextlib
import functools
import re
from pathlib import Path

import numpy as np
import pytest

from conftest import require_hf_mtp

require_hf_mtp()

import hf_reference as hr  # noqa: E402  (imports torch / transformers)
import torch  # noqa: E402

from mtpkern import MultiModuleMtpHead, ReferenceTarget, write_synthetic_checkpoint  # noqa: E402
from mtpkern.config import tiny_config  # noqa: E402
from mtpkern.integrations import _hf_torch, hf  # noqa: E402

MAX_NEW = 24
PROMPTS = [[5, 17, 250, 3, 99, 42], [7], [300, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9]]
#: accepted drafts per verify (steered runs): every count 0..M, the partial ones included
SCHEDULES = {2: [2, 1, 0, 2, 0, 1, 1], 3: [3, 0, 1, 2, 0, 3, 1, 2, 2]}


def glm_config(M: int):
    """GLM-4.5-shaped (tests/test_target.py's): layer 0 dense, layer 1 MoE, M MTP modules."""
    return tiny_config(family="glm4_moe", num_hidden_layers=2, first_k_dense_replace=1, intermediate_size=48,
                       num_nextn_predict_layers=M)


@pytest.fixture(scope="module", params=[2, 3], ids=lambda m: f"M{m}")
def case(request, tmp_path_factory):
    M = request.param
    path = write_synthetic_checkpoint(tmp_path_factory.mktemp(f"hf_adapter_m{M}"), glm_config(M), seed=40 + M,
                                      target_layers=True, dtype="float32")
    spread_norms(path, seed=50 + M)
    return M, path, hr.load_hf(path)


def spread_norms(path: Path, seed: int) -> None:
    """Move every RMSNorm weight of the checkpoint further from 1 (``1 + 0.5 N(0, 1)``; the
    synthetic ones are ``1 + 0.1 N(0, 1)``). RMSNorm is scale-invariant, so with weights near 1 a
    hidden normed once or twice (the chain's two conventions) drafts the same tokens nearly
    always, and the negative controls would have nothing to see."""
    from safetensors.numpy import load_file, save_file

    f = path / "model.safetensors"
    t = load_file(str(f))
    rng = np.random.default_rng(seed)
    for k in sorted(t):
        if k.endswith("norm.weight"):
            t[k] = (1.0 + 0.5 * rng.standard_normal(t[k].shape)).astype(t[k].dtype)
    save_file(t, str(f), metadata={"format": "pt"})


def proposer(path: Path, **kw) -> MultiModuleMtpHead:
    opts = dict(backend="numpy", kv_mode="exact", chain="postnorm", block_size=4, num_blocks=64)
    opts.update(kw)
    return MultiModuleMtpHead.from_pretrained(path, **opts)


class Seen(list):
    """The drafts of each verify forward, and ``forwards``: the target's forwards, prefill included."""

    forwards = 0


@contextlib.contextmanager
def observed(model, schedule: list[int] | None = None):
    """Record, at every target forward after the prefill, the drafts it verifies (its input
    ids after the first: ``[]`` for a plain decode step) into the yielded list; with a
    ``schedule``, steer verify ``i`` to accept ``schedule[i % len]`` drafts (hr.steered's
    edit of the output logits only: hiddens, caches and both drafters untouched)."""
    fwd = model.forward
    seen = Seen()

    @functools.wraps(fwd)
    def forward(*args, **kwargs):
        out = fwd(*args, **kwargs)
        seen.forwards += 1
        if seen.forwards == 1:
            return out
        cand = kwargs["input_ids"][0, 1:]
        seen.append(cand.tolist())
        if schedule and cand.shape[0]:
            a = schedule[(len([s for s in seen if s]) - 1) % len(schedule)]
            for i in range(min(a, cand.shape[0])):
                out.logits[0, i, cand[i]] = 1e4
            if a < cand.shape[0]:
                out.logits[0, a, cand[a]] = -1e4
        return out

    model.forward = forward
    try:
        yield seen
    finally:
        del model.forward


def run(model, prompt, how, prop=None, schedule=None, **kw):
    """(tokens after the prompt, the drafts of each verify) of one greedy generation:
    ``how`` = "plain" (no drafter), "hf-mtp" (transformers' own MTP drafter) or "mtpkern"."""
    ids = torch.tensor([prompt], dtype=torch.long)
    args = dict(max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    args.update(kw)
    with observed(model, schedule) as seen, torch.no_grad():
        if how == "mtpkern":
            out = hf.generate(model, prop, ids, **args)
        else:
            out = model.generate(ids, attention_mask=torch.ones_like(ids), use_mtp=how == "hf-mtp", **args)
    return out[0, len(prompt):].tolist(), seen


def test_transformers_reads_the_synthetic_checkpoint_as_mtpkern_does(case):
    """The target's last hidden states (after model.norm) equal mtpkern's reference target's on
    the same directory: both sides read the same model."""
    M, path, model = case
    tgt = ReferenceTarget.from_pretrained(path, backend="numpy", block_size=4, num_blocks=16)
    seq = tgt.alloc_seq()
    ours = tgt.prefill(seq, PROMPTS[2]).hiddens
    with torch.no_grad():
        theirs = model(torch.tensor([PROMPTS[2]]), output_hidden_states=True).hidden_states[-1][0].numpy()
    np.testing.assert_allclose(theirs, ours, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kv_mode", ["exact", "draft"])
def test_lossless_against_plain_greedy_generate(case, kv_mode):
    M, path, model = case
    prop = proposer(path, kv_mode=kv_mode)
    for prompt in PROMPTS:
        plain, decodes = run(model, prompt, "plain")
        ours, verifies = run(model, prompt, "mtpkern", prop)
        assert ours == plain, prompt
        assert len(plain) == MAX_NEW and not any(decodes)           # plain decoding: one token a forward
        assert verifies and all(len(d) == M for d in verifies)      # every step verified M mtpkern drafts
        assert prop.kv_blocks_in_use() == [0] * M                   # the call's state was freed


@pytest.mark.parametrize("steer", [False, True], ids=["greedy", "steered"])
def test_same_drafts_as_transformers_mtp_generate(case, steer):
    """Every verify of the run with the mtpkern drafter checks the drafts transformers'
    ``generate(use_mtp=True)`` checks at the same point, and the outputs are equal. Steered,
    the verifies accept every count 0..M (after a partial one transformers crops and recomputes
    its MTP cache; mtpkern trims exactly and catches up)."""
    M, path, model = case
    schedule = SCHEDULES[M] if steer else None
    for prompt in (PROMPTS[0], PROMPTS[2]):     # not [7]: transformers' own fails on 1-token prompts (M >= 2)
        theirs, their_drafts = run(model, prompt, "hf-mtp", schedule=schedule)
        ours, our_drafts = run(model, prompt, "mtpkern", proposer(path), schedule=schedule)
        assert len(their_drafts) >= 6 and all(len(d) == M for d in their_drafts)
        assert our_drafts == their_drafts, prompt
        assert ours == theirs
    if steer:   # the steering reached every acceptance count: the bonus-only and partial paths ran
        assert len(our_drafts) >= len(SCHEDULES[M])


def _shifted(self, model_outputs):
    """The hidden one position early: h_{j-1} where h_j belongs (the first row repeated)."""
    h = _TARGET_HIDDENS(self, model_outputs)
    return np.concatenate([h[:1], h[:-1]], axis=0)


_TARGET_HIDDENS = _hf_torch.MtpCandidateGenerator.target_hiddens


def test_negative_control_a_shifted_hidden_drafts_differently(case, monkeypatch):
    """Handing the drafter ``h_{j-1}`` for ``h_j`` changes its drafts (so the match above
    depends on the adapter's indexing), and the output stays plain greedy's (lossless)."""
    M, path, model = case
    prompt = PROMPTS[0]
    plain, _ = run(model, prompt, "plain")
    theirs, their_drafts = run(model, prompt, "hf-mtp")
    monkeypatch.setattr(_hf_torch.MtpCandidateGenerator, "target_hiddens", _shifted)
    ours, our_drafts = run(model, prompt, "mtpkern", proposer(path))
    assert our_drafts != their_drafts
    assert ours == plain == theirs


def test_negative_control_prenorm_chain_drafts_differently(case):
    """glm4_moe's default chain (vLLM's, prenorm) is not transformers': its drafts differ."""
    M, path, model = case
    theirs, their_drafts = run(model, PROMPTS[0], "hf-mtp")
    ours, our_drafts = run(model, PROMPTS[0], "mtpkern", proposer(path, chain="prenorm"))
    assert our_drafts != their_drafts and ours == theirs


def test_num_drafts_below_m(case):
    M, path, model = case
    plain, _ = run(model, PROMPTS[0], "plain")
    ours, verifies = run(model, PROMPTS[0], "mtpkern", proposer(path), num_drafts=1)
    assert ours == plain and verifies and all(len(d) == 1 for d in verifies)


@pytest.mark.parametrize("change, match", [
    (dict(ids=[[5, 6], [7, 8]]), r"input_ids: expected shape \[1, n >= 1\] .*got \[2, 2\]"),
    (dict(do_sample=True), r"do_sample: expected False .*got True"),
    (dict(num_beams=2), r"num_beams: expected 1 .*got 2"),
    (dict(num_return_sequences=2), r"num_return_sequences: expected 1 .*got 2"),
    (dict(use_mtp=True), r"use_mtp: not with an mtpkern drafter"),
    (dict(prompt_lookup_num_tokens=3), r"prompt_lookup_num_tokens: not with an mtpkern drafter"),
    (dict(attention_mask=[[0, 1, 1]]), r"attention_mask: expected None or all ones of shape \[1, 3\]"),
    (dict(num_drafts=0), r"num_drafts: expected >= 1, got 0"),
    (dict(sampling_config=True), r"generation_config: expected do_sample=False"),
    (dict(proposer_vocab=True), r"proposer: expected the model's vocab_size = 301, got 257"),
], ids=["batch-2", "sampling", "beams", "return-sequences", "use-mtp", "prompt-lookup", "padding", "no-drafts",
        "sampling-config", "vocab"])
def test_refusals_leave_model_and_proposer_as_they_were(case, tmp_path, change, match):
    M, path, model = case
    from transformers import GenerationConfig

    prop = proposer(path)
    kw = {k: v for k, v in change.items() if k not in ("ids", "attention_mask", "sampling_config", "proposer_vocab")}
    ids = torch.tensor(change.get("ids", [[5, 6, 7]]))
    if "attention_mask" in change:
        kw["attention_mask"] = torch.tensor(change["attention_mask"])
    if "sampling_config" in change:
        kw["generation_config"] = GenerationConfig(do_sample=True, max_new_tokens=4)
    if "proposer_vocab" in change:
        other = write_synthetic_checkpoint(tmp_path, tiny_config(vocab_size=257, num_nextn_predict_layers=M))
        prop = proposer(other)
    with observed(model) as seen:
        with pytest.raises((ValueError, TypeError), match=match):
            hf.generate(model, prop, ids, max_new_tokens=4, pad_token_id=0, **kw)
    assert seen.forwards == 0                                       # refused before the target ran
    assert "_get_candidate_generator" not in vars(model)
    assert prop.kv_blocks_in_use() == [0] * M


def test_a_failing_step_frees_the_state_and_restores_the_model(case, monkeypatch):
    """A drafter call that raises mid-generation ends ``generate`` with that error; the model's
    method is restored and the proposer's state freed."""
    M, path, model = case
    prop = proposer(path)

    def boom(*a, **k):
        raise RuntimeError("catch-up failed")

    monkeypatch.setattr(prop, "catchup_drafter", boom)
    with pytest.raises(RuntimeError, match="catch-up failed"):
        run(model, PROMPTS[0], "mtpkern", prop)
    assert "_get_candidate_generator" not in vars(model)
    assert prop.kv_blocks_in_use() == [0] * M
    monkeypatch.undo()
    plain, _ = run(model, PROMPTS[0], "plain")
    assert run(model, PROMPTS[0], "mtpkern", prop)[0] == plain          # and the next call works


def test_the_docs_example_runs(tmp_path, capsys):
    """docs/integrations.md's example, as written (its checkpoint into tmp_path)."""
    text = (Path(__file__).parents[1] / "docs" / "integrations.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    assert "tempfile.mkdtemp()" in code
    exec(compile(code.replace("tempfile.mkdtemp()", repr(str(tmp_path))), "docs/integrations.md", "exec"), {})
    assert "lossless" in capsys.readouterr().out


def test_a_second_generate_on_the_same_instance_is_refused(case):
    """While the method is shadowed (a generate in progress), another call on that instance is
    refused, and the attribute it found is left in place."""
    M, path, model = case
    prop = proposer(path)

    def theirs(*a, **k):
        raise AssertionError("not to be called")

    model._get_candidate_generator = theirs
    try:
        with pytest.raises(RuntimeError, match="_get_candidate_generator is already replaced on the instance"):
            hf.generate(model, prop, torch.tensor([[5, 6]]), max_new_tokens=4, pad_token_id=0)
        assert vars(model)["_get_candidate_generator"] is theirs
    finally:
        del model._get_candidate_generator


def test_candidate_generator_alone(case):
    """``candidate_generator`` is a transformers CandidateGenerator drafting k' = min(k, M) a step;
    a wrong proposer is a TypeError; ``close`` frees its state and may be called twice."""
    from transformers.generation.candidate_generator import CandidateGenerator

    M, path, model = case
    prop = proposer(path)
    gen = hf.candidate_generator(prop)
    assert isinstance(gen, CandidateGenerator) and gen.requires_model_outputs
    assert gen.num_drafting_tokens == M and hf.candidate_generator(prop, 9).num_drafting_tokens == M
    ids = torch.tensor([PROMPTS[0] + [11]])
    prompt = ids[:, :-1]
    with torch.no_grad():
        out = model(prompt, output_hidden_states=True)
    first = gen.get_candidates(prompt, is_first_iteration=True)          # the target prefills first
    assert first[0] is prompt and first[1] is None and prop.kv_blocks_in_use() == [0] * M
    cand, logits = gen.get_candidates(ids, model_outputs=out, n_last_matches=0)
    assert logits is None and cand.shape == (1, ids.shape[1] + M) and cand[0, :ids.shape[1]].tolist() == ids[0].tolist()
    assert sum(prop.kv_blocks_in_use()) > 0
    gen.close()
    gen.close()
    assert prop.kv_blocks_in_use() == [0] * M
    with pytest.raises(TypeError, match="proposer: expected a MultiModuleMtpHead, got str"):
        hf.candidate_generator("not a proposer")
