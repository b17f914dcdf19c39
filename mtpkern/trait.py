"""``DraftProposer`` and ``ProposerState``: the drafting interface, with its defaults.

They mirror the original engine's trait. A proposer implements at least
``alloc_state``, ``propose`` and ``after_verify``; every other method has the
default below, which an engine may rely on (``catchup_drafter`` writes
nothing and returns 0, ``take_drafter_kv`` returns None, and so on).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Sequence


class ProposerState(ABC):  # noqa: B024 (a marker base: states carry no common behaviour)
    """Per-sequence drafter state, created by ``alloc_state`` and released by ``free_state``."""


class DraftProposer(ABC):
    """A draft-token proposer for speculative decoding."""

    @abstractmethod
    def alloc_state(self) -> ProposerState:
        """Allocate per-sequence state."""

    def alloc_state_for(self, budget_tokens: int | None) -> ProposerState:
        """``alloc_state`` given the sequence's token budget (prompt + max new tokens);
        ``None`` means unknown. The default ignores the budget."""
        return self.alloc_state()

    @abstractmethod
    def propose(self, last_token: int, target_hidden: Any, position: int, num_drafts: int,
                state: ProposerState, grammar_bitmask: Any = None, out_conf: list | None = None) -> list[int]:
        """Draft up to ``num_drafts`` tokens after ``last_token`` (at ``position``);
        ``out_conf``: a list that receives each draft's confidence."""

    @abstractmethod
    def after_verify(self, num_accepted: int, state: ProposerState) -> None:
        """Trim the state after a verify that accepted ``num_accepted`` drafts."""

    def free_state(self, state: ProposerState) -> None:
        """Release what ``alloc_state`` allocated. The default frees nothing."""

    def read_deferred_draft_token(self, state: ProposerState | None = None) -> int:
        """The last draft the last propose produced; the default returns 0."""
        return 0

    def prefill_drafter(self, prompt_tokens: Sequence[int], hiddens: Any, state: ProposerState) -> int:
        """Fill the drafter's KV over the prompt; returns rows written (default: none)."""
        return 0

    def catchup_drafter(self, tokens: Sequence[int], hiddens: Any, state: ProposerState) -> int:
        """Append drafter rows for verified tokens; returns rows written (default: none)."""
        return 0

    def propose_batch(self, last_tokens: Sequence[int], target_hiddens: Any, positions: Sequence[int],
                      num_drafts: int, states: Sequence[ProposerState],
                      grammar_bitmasks: Sequence[Any] | None = None,
                      out_conf: list | None = None) -> list[list[int]] | None:
        """Propose for several sequences at once; ``None`` when unsupported (the default)."""
        return None

    def propose_batch_max(self) -> int:
        """The widest batch ``propose_batch`` accepts; 1 means per-sequence only."""
        return 1

    def catchup_batch(self, tokens: Sequence[Sequence[int]], hiddens: Sequence[Any],
                      states: Sequence[ProposerState]) -> int:
        """``catchup_drafter`` for several sequences; returns rows written (default: none)."""
        return 0

    def drafter_rows(self, state: ProposerState) -> int:
        """Drafter KV rows held in the state; 0 when unknown."""
        return 0

    def last_pair_key(self, state: ProposerState) -> int | None:
        """Sequence-space key of the newest drafter row; None when untracked."""
        return None

    def take_drafter_kv(self, state: ProposerState) -> Any | None:
        """Move the drafter KV out of ``state`` (to carry it to the next turn); None when unsupported."""
        return None

    def install_drafter_kv(self, state: ProposerState, carried: Any) -> bool:
        """Install carried KV into a fresh state; False when unsupported (the caller keeps it)."""
        return False

    def free_drafter_kv(self, carried: Any) -> None:
        """Release carried KV that no state owns. The default does nothing."""

    def block_gamma(self) -> int | None:
        """Block size of a block-diffusion drafter; None for other proposers."""
        return None

    def prefill_hidden_rows(self, max_seq_len: int) -> int:
        """Rows of prefill hiddens this proposer can use given the served max length."""
        return max_seq_len

    def needs_comm(self) -> bool:
        """Whether the proposer's forward is sharded across ranks."""
        return False

    def prefill_uses_shared_buffers(self) -> bool:
        """Whether the drafter prefill uses the target's shared forward scratch."""
        return False
