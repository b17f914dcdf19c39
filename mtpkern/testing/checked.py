"""``checked(prop)``: the proposer with every call verified against ``ProposerModel``.

Hand the returned object to the code under test (an engine's scheduler) in place
of the proposer: it has the same methods and returns the same objects (real
states, real carried entries). Around every call it

- takes the model's fingerprint; if the call raises, asserts that nothing changed
  (pools, every state, carried entries, counters) and re-raises the error;
- if the call succeeds, moves the model along and runs ``model.check()``:
  the proposer's invariants, every module's rows, and (with ``weights``) the
  exact-mode drafts against the dense oracle.

An ``AssertionError`` therefore points at the first call that broke a rule. The
proxy adds no locking: the thread contract is the proposer's own (check from one
thread, or call ``check()`` once the threads have joined).
"""

from __future__ import annotations

from typing import Any, Callable

from .model import ProposerModel


class CheckedProposer:
    """A ``MultiModuleMtpHead`` whose every call is checked (see the module docstring)."""

    def __init__(self, prop: Any, weights: Any = None):
        self.prop = prop
        self.model = ProposerModel(prop, weights)

    def __getattr__(self, name: str) -> Any:             # queries and attributes pass through
        return getattr(self.prop, name)

    def check(self) -> None:
        self.model.check()

    def _call(self, fn: Callable[[], Any], then: Callable[[Any], None]) -> Any:
        before = self.model.fingerprint()
        try:
            out = fn()
        except BaseException:
            after = self.model.fingerprint()
            assert after == before, "a call that raised changed the proposer's state"
            raise
        then(out)
        self.model.check()
        return out

    # -- lifecycle --------------------------------------------------------------------
    def alloc_state(self) -> Any:
        return self._call(self.prop.alloc_state, lambda st: self.model.alloc(st))

    def alloc_state_for(self, budget_tokens: int | None) -> Any:
        return self._call(lambda: self.prop.alloc_state_for(budget_tokens),
                          lambda st: self.model.alloc(st, budget_tokens))

    def free_state(self, state: Any) -> None:
        return self._call(lambda: self.prop.free_state(state), lambda _: self.model.free(state))

    # -- drafting ---------------------------------------------------------------------
    def prefill_drafter(self, prompt_tokens: Any, hiddens: Any, state: Any) -> int:
        return self._call(lambda: self.prop.prefill_drafter(prompt_tokens, hiddens, state),
                          lambda rows: self.model.prefill(state, prompt_tokens, hiddens, rows))

    def propose(self, last_token: int, target_hidden: Any, position: int, num_drafts: int, state: Any,
                grammar_bitmask: Any = None) -> list[int]:
        return self._call(
            lambda: self.prop.propose(last_token, target_hidden, position, num_drafts, state, grammar_bitmask),
            lambda d: self.model.propose(state, last_token, target_hidden, position, num_drafts, grammar_bitmask, d))

    def propose_batch(self, last_tokens: Any, target_hiddens: Any, positions: Any, num_drafts: int,
                      states: Any, grammar_bitmasks: Any = None) -> list[list[int]]:
        def then(drafts: list[list[int]]) -> None:
            for i, (st, d) in enumerate(zip(states, drafts)):
                gm = None if grammar_bitmasks is None else grammar_bitmasks[i]
                self.model.propose(st, last_tokens[i], target_hiddens[i], positions[i], num_drafts, gm, d)

        return self._call(lambda: self.prop.propose_batch(last_tokens, target_hiddens, positions, num_drafts,
                                                          states, grammar_bitmasks), then)

    def after_verify(self, num_accepted: int, state: Any) -> None:
        return self._call(lambda: self.prop.after_verify(num_accepted, state),
                          lambda _: self.model.verify(state, int(num_accepted)))

    def catchup_drafter(self, tokens: Any, hiddens: Any, state: Any) -> int:
        return self.catchup_batch([tokens], [hiddens], [state], single=True)

    def catchup_batch(self, tokens: Any, hiddens: Any, states: Any, single: bool = False) -> int:
        def then(rows: int) -> None:
            want = sum(self.model.catchup(st, tk, hd) for tk, hd, st in zip(tokens, hiddens, states))
            assert rows == want, f"catch-up wrote {rows} rows, expected {want}"

        if single:
            return self._call(lambda: self.prop.catchup_drafter(tokens[0], hiddens[0], states[0]), then)
        return self._call(lambda: self.prop.catchup_batch(tokens, hiddens, states), then)

    # -- carry ------------------------------------------------------------------------
    def take_drafter_kv(self, state: Any) -> Any:
        return self._call(lambda: self.prop.take_drafter_kv(state), lambda kv: self.model.take(state, kv))

    def install_drafter_kv(self, state: Any, carried: Any) -> bool:
        return self._call(lambda: self.prop.install_drafter_kv(state, carried),
                          lambda _: self.model.install(state, carried))

    def free_drafter_kv(self, carried: Any) -> None:
        return self._call(lambda: self.prop.free_drafter_kv(carried), lambda _: self.model.free_carried(carried))


def checked(prop: Any, weights: Any = None) -> CheckedProposer:
    """``prop`` with every call checked; ``weights``: host FP32 weights for the exact-mode
    oracle (``reference_weights(ckpt_dir)``; tiny models only), or None."""
    return CheckedProposer(prop, weights)
