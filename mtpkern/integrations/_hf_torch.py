"""The torch side of ``mtpkern.integrations.hf`` (imports torch and transformers at import:
reached only through ``hf.require_hf()``, which checks that both are there).

One ``MtpCandidateGenerator`` is one generation's drafter. transformers' assisted-decoding loop
(``GenerationMixin._assisted_decoding``, 5.24) calls, per iteration::

    candidates, logits = gen.get_candidates(input_ids, model_kwargs=..., model_outputs=outputs,
                                            is_first_iteration=..., n_last_matches=a)
    outputs = target(candidates, output_hidden_states=-1)     # gen.model_kwargs_overrides
    ... greedy acceptance of a drafts, the bonus token appended, the target's cache cropped ...
    gen.update_candidate_strategy(input_ids, logits, a)

and get_candidates makes docs/api.md's calls (the indices of docs/semantics.md; ``h_j`` is the
target's last hidden state at position ``j``, after its final norm)::

    first iteration        -> no drafts: the target prefills the prompt t_0 .. t_{n-1}, picks t_n
    second (P = n)         -> prefill_drafter(t_0 .. t_{n-1}, h_0 .. h_{n-1}); propose(t_n, h_{n-1}, n, k)
    later (after a verify over [t_P, d_0 .. d_{k-1}] that accepted a drafts; hiddens h_P .. h_{P+k})
                           -> after_verify(a); catchup_drafter(d_0 .. d_{a-1}, h_P .. h_{P+a-1});
                              propose(t_{P+a+1}, h_{P+a}, P + a + 1, k)

exactly as transformers' own ``MTPCandidateGenerator`` reads them (its ``hidden_states[-1]``,
``n_last_matches``; docs/hf_reference.md).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from transformers.generation.candidate_generator import CandidateGenerator

from ..checks import INT32_MAX, check_int
from ..proposer import MultiModuleMtpHead

#: generate() arguments that select another decoding mode or drafter: refused by name
_OTHER_MODES = ("assistant_model", "use_mtp", "prompt_lookup_num_tokens", "assistant_early_exit",
                "custom_generate", "assistant_tokenizer", "speculation_type", "assistant_ensemble_weight")


class MtpCandidateGenerator(CandidateGenerator):
    """A transformers ``CandidateGenerator`` whose drafts come from a ``MultiModuleMtpHead``.

    Greedy only: ``get_candidates`` returns the candidate ids and no logits (transformers'
    greedy acceptance needs none). One proposer state per generation, allocated at the first
    drafting step; ``close()`` frees it (``generate`` does so when the call ends)."""

    #: transformers hands the target's outputs (for its hidden states) to get_candidates
    requires_model_outputs = True

    def __init__(self, proposer: MultiModuleMtpHead, num_drafts: int | None = None):
        if not isinstance(proposer, MultiModuleMtpHead):
            raise TypeError(f"proposer: expected a MultiModuleMtpHead, got {type(proposer).__name__}")
        self.proposer = proposer
        self.num_drafts = proposer.num_modules if num_drafts is None else check_int("num_drafts", num_drafts, 1,
                                                                                    INT32_MAX)
        # the target's last layer's hidden states only (what transformers' MTP generator asks for)
        self.model_kwargs_overrides = {"output_hidden_states": -1}
        self.state = None
        self.position = 0            # P of the last propose
        self.drafts: list[int] = []  # its drafts, d_0 .. d_{k'-1}
        self.steps = 0               # proposes made

    @property
    def num_drafting_tokens(self) -> int:
        """Drafts per step (transformers keeps this many recurrent states for a crop)."""
        return min(self.num_drafts, self.proposer.num_modules)

    def target_hiddens(self, model_outputs: Any) -> np.ndarray:
        """The target's last hidden states of its latest forward, ``[rows, H]`` FP32 on the host:
        ``hidden_states[-1]``, the output of the model's final norm (as transformers' MTP
        generator reads it)."""
        hs = getattr(model_outputs, "hidden_states", None)
        if not hs:
            raise ValueError("model_outputs: expected the target's hidden_states (output_hidden_states), got none")
        return hs[-1][0].detach().to(torch.float32).cpu().numpy()

    def get_candidates(self, input_ids: torch.LongTensor, model_kwargs: dict | None = None,
                       model_outputs: Any = None, is_first_iteration: bool = False, n_last_matches: int = 0,
                       **kwargs: Any) -> tuple[torch.LongTensor, None]:
        """``input_ids`` ``[1, P + 1]`` (ending with ``t_P``) followed by ``k'`` drafts, and no logits."""
        if is_first_iteration:          # the target has not run yet: let it prefill the prompt
            return input_ids, None
        if input_ids.shape[0] != 1:
            raise ValueError(f"input_ids: expected batch 1, got shape {tuple(input_ids.shape)}")
        ids = input_ids[0].tolist()
        hid = self.target_hiddens(model_outputs)
        prop = self.proposer
        if self.state is None:
            n = len(ids) - 1
            if hid.shape[0] != n:
                raise ValueError(f"model_outputs: expected the prefill's {n} hidden rows, got {hid.shape[0]}")
            st = prop.alloc_state()
            try:
                prop.prefill_drafter(ids[:n], hid, st)
            except BaseException:
                prop.free_state(st)
                raise
            self.state, last_hidden, P = st, hid[n - 1], n
        else:
            a = check_int("n_last_matches", n_last_matches, 0, len(self.drafts))
            P = self.position + a + 1
            if len(ids) != P + 1 or ids[P - a:P] != self.drafts[:a]:
                raise RuntimeError(f"input_ids: expected the {P + 1} tokens that end with the {a} accepted drafts "
                                   f"{self.drafts[:a]} and the bonus token, got {len(ids)} ending {ids[-a - 1:]}")
            if hid.shape[0] < a + 1:
                raise ValueError(f"model_outputs: expected >= {a + 1} hidden rows of the verify, got {hid.shape[0]}")
            prop.after_verify(a, self.state)
            prop.catchup_drafter(self.drafts[:a], hid[:a], self.state)
            last_hidden = hid[a]
        drafts = prop.propose(ids[P], last_hidden, P, self.num_drafts, self.state)
        self.position, self.drafts = P, list(drafts)
        self.steps += 1
        new = torch.tensor([self.drafts], dtype=input_ids.dtype, device=input_ids.device)
        return torch.cat([input_ids, new], dim=-1), None

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int) -> None:
        """Nothing to adapt: the next ``get_candidates`` reads ``n_last_matches`` (with the
        verify's hidden states, which only it receives) and makes the drafter's calls there."""

    def close(self) -> None:
        """Free the proposer state (idempotent)."""
        if self.state is not None:
            st, self.state = self.state, None
            self.proposer.free_state(st)


def _check_generate_args(model: Any, proposer: Any, input_ids: Any, attention_mask: Any,
                         kwargs: dict[str, Any]) -> None:
    if not isinstance(proposer, MultiModuleMtpHead):
        raise TypeError(f"proposer: expected a MultiModuleMtpHead, got {type(proposer).__name__}")
    if not (hasattr(model, "generate") and hasattr(model, "_get_candidate_generator")):
        raise TypeError(f"model: expected a transformers PreTrainedModel with generate(), got {type(model).__name__}")
    if "_get_candidate_generator" in vars(model):
        raise RuntimeError("model: its _get_candidate_generator is already replaced on the instance "
                           "(another mtpkern generate running on this model?)")
    text = model.config.get_text_config()
    for field in ("vocab_size", "hidden_size"):
        ours, theirs = getattr(proposer.config, field), getattr(text, field, None)
        if ours != theirs:
            raise ValueError(f"proposer: expected the model's {field} = {theirs}, got {ours}")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype.is_floating_point:
        raise TypeError(f"input_ids: expected a [1, n] integer tensor, got "
                        f"{getattr(input_ids, 'shape', type(input_ids).__name__)}")
    if input_ids.shape[0] != 1 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids: expected shape [1, n >= 1] (batch 1: transformers' assisted generation), "
                         f"got {list(input_ids.shape)}")
    if attention_mask is not None and (tuple(attention_mask.shape) != tuple(input_ids.shape)
                                       or not bool((attention_mask == 1).all())):
        raise ValueError(f"attention_mask: expected None or all ones of shape {list(input_ids.shape)} "
                         f"(no padding), got shape {list(attention_mask.shape)}")
    for name in _OTHER_MODES:
        if name in kwargs:
            raise ValueError(f"{name}: not with an mtpkern drafter (it selects another drafter), got {kwargs[name]!r}")
    if kwargs.get("do_sample"):
        raise ValueError(f"do_sample: expected False (the mtpkern drafter is greedy only), got {kwargs['do_sample']!r}")
    for name in ("num_beams", "num_return_sequences"):
        if kwargs.get(name) not in (None, 1):
            raise ValueError(f"{name}: expected 1 (greedy speculative decoding), got {kwargs[name]!r}")
    gc = kwargs.get("generation_config")
    if gc is not None:
        _check_generation_config(gc)


def _check_generation_config(gc: Any) -> None:
    if gc.do_sample:
        raise ValueError("generation_config: expected do_sample=False (the mtpkern drafter is greedy only), "
                         f"got do_sample={gc.do_sample!r}")
    for name in ("num_beams", "num_return_sequences"):
        if getattr(gc, name, None) not in (None, 1):
            raise ValueError(f"generation_config: expected {name}=1, got {getattr(gc, name)!r}")


def generate(model: Any, proposer: MultiModuleMtpHead, input_ids: torch.Tensor, *, num_drafts: int | None = None,
             attention_mask: torch.Tensor | None = None, **kwargs: Any) -> Any:
    """``mtpkern.integrations.hf.generate``'s body (its docstring says what it does)."""
    _check_generate_args(model, proposer, input_ids, attention_mask, kwargs)
    gen = MtpCandidateGenerator(proposer, num_drafts)
    used = []

    def get_candidate_generator(generation_config: Any, *args: Any, **kw: Any) -> MtpCandidateGenerator:
        _check_generation_config(generation_config)       # as generate merged it with the model's defaults
        used.append(True)
        return gen

    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    kwargs.setdefault("do_sample", False)       # a model's generation_config.json may default to sampling
    model._get_candidate_generator = get_candidate_generator        # this instance, this call only
    try:
        out = model.generate(input_ids, attention_mask=attention_mask, use_mtp=True, **kwargs)
    finally:
        del model._get_candidate_generator
        gen.close()
    if not used:
        raise RuntimeError("generate did not run assisted decoding, so the mtpkern drafter was never asked "
                           "(a generation_config selecting beams or another mode?)")
    return out
