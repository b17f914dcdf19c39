"""A ``MultiModuleMtpHead`` as the drafter of Hugging Face transformers' speculative ``generate``.

transformers (5.24+) runs MTP drafting as *assisted generation*: ``generate(..., use_mtp=True)``
selects ``GenerationMode.ASSISTED_GENERATION``, and ``GenerationMixin._assisted_decoding`` asks
``self._get_candidate_generator(...)`` for a ``CandidateGenerator``, which for ``use_mtp`` is
transformers' own ``MTPCandidateGenerator``. ``generate`` (below) runs the same call with the
model's ``_get_candidate_generator`` shadowed, for that call only, by one returning
``MtpCandidateGenerator`` (mtpkern/integrations/_hf_torch.py): the verify, the target's KV cache
crops, the stopping criteria and the output are transformers' own, untouched. There is no public
argument for a custom candidate generator (``assistant_model`` must be a model that generates;
``custom_generate`` replaces the whole decoding loop), so shadowing that one method on the
instance is the least invasive way in.

Greedy decoding only (``do_sample=False``; the drafts are argmaxes and no draft logits are
handed back), batch 1 (as transformers' assisted generation), an unpadded prompt. Anything
else is refused before the target runs, naming the argument.

torch and transformers are imported when ``generate`` or ``candidate_generator`` is called,
never at import: without them the call raises ``ImportError`` naming the ``hf`` extra.
"""

from __future__ import annotations

from typing import Any

#: what a missing framework's ImportError tells to install
INSTALL_HINT = ("pip install 'mtpkern[hf]' (from a source checkout: pip install -e '.[hf]'), "
                "which installs torch and transformers >= 5.24")
MIN_TRANSFORMERS = (5, 24)


def _version(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


def require_hf() -> Any:
    """Import and return ``mtpkern.integrations._hf_torch`` (which imports torch and
    transformers); ``ImportError`` naming the ``hf`` extra if either is missing or
    transformers is older than 5.24 (no MTP generation)."""
    try:
        import torch  # noqa: F401
        import transformers
    except ImportError as e:
        raise ImportError(f"mtpkern.integrations.hf needs torch and transformers ({e.name} is missing): "
                          f"{INSTALL_HINT}") from e
    if _version(transformers.__version__) < MIN_TRANSFORMERS:
        raise ImportError(f"mtpkern.integrations.hf needs transformers >= 5.24 (MTP generation), found "
                          f"{transformers.__version__}: {INSTALL_HINT}")
    from . import _hf_torch

    return _hf_torch


def candidate_generator(proposer: Any, num_drafts: int | None = None) -> Any:
    """A transformers ``CandidateGenerator`` drafting with ``proposer`` (a ``MultiModuleMtpHead``):
    one generation's drafter (it keeps one proposer state; ``close()`` frees it). For an engine
    that drives ``_assisted_decoding`` itself; ``generate`` below builds and closes one per call."""
    return require_hf().MtpCandidateGenerator(proposer, num_drafts)


def generate(model: Any, proposer: Any, input_ids: Any, *, num_drafts: int | None = None,
             attention_mask: Any = None, **generate_kwargs: Any) -> Any:
    """``model.generate(input_ids, ...)`` with ``proposer`` drafting: greedy speculative decoding.

    ``model``: a transformers ``PreTrainedModel`` with ``generate`` (the target; its final
    hidden states, after the model's final norm, are what the drafter reads: build the
    proposer with ``apply_target_norm=False``, and ``chain="postnorm"`` to draft as
    transformers' own MTP generation does). ``proposer``: a ``MultiModuleMtpHead`` on the same
    vocabulary and hidden size. ``input_ids``: a ``[1, n]`` integer tensor (batch 1),
    ``n >= 1``. ``num_drafts``: drafts per step, default ``proposer.num_modules`` (what
    transformers' MTP generation drafts). ``attention_mask``: ``None`` or all ones (no
    padding). The other keyword arguments go to ``generate`` as they are (``max_new_tokens``,
    ``eos_token_id``, ``pad_token_id``, ``return_dict_in_generate``, ...), except those that
    select sampling, beams or another drafter, which are refused.

    Returns what ``generate`` returns. Greedy verification is lossless: the tokens are those
    of ``model.generate(input_ids, do_sample=False)`` without a drafter. The proposer state
    is allocated at the first drafting step and freed when the call ends, whatever happens.
    """
    hf = require_hf()
    return hf.generate(model, proposer, input_ids, num_drafts=num_drafts, attention_mask=attention_mask,
                       **generate_kwargs)
