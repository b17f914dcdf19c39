"""The rule-based state machine over one proposer (needs ``hypothesis``).

``proposer_machine(make_proposer)`` returns a ``RuleBasedStateMachine`` class
whose rules are the ``Driver``'s steps (one rule per kind, each drawing its
``Call`` from ``mtpkern.testing.strategies``) and whose invariant is the model
check, after every step. Each run starts from ``make_proposer()``; teardown
frees everything and asserts that no block stays in use. Use its ``TestCase``
with pytest or unittest::

    TestMyConfig = proposer_machine(lambda: MultiModuleMtpHead.from_pretrained(ckpt)).TestCase

``Machine.steps`` adds up the proposer calls of every run, by kind; ``Machine.accepted`` the
drafts their verifies accepted. With ``target=`` (a ``ReferenceTarget``) the hiddens and
verified tokens are the target's, and the kit checks them (``checked(..., target=)``).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from .driver import Call, Driver
from .strategies import calls


def proposer_machine(make_proposer: Callable[[], Any], weights: Any = None,
                     max_states: int = 4, target: Any = None) -> type[RuleBasedStateMachine]:
    """A state machine class driving ``make_proposer()``; ``weights``: host FP32 weights
    for the exact-mode oracle (``reference_weights``), or None; ``target``: a
    ``ReferenceTarget`` of the same checkpoint, or None: with one, every hidden and verified
    token the rules hand in is the target's (``Driver``'s ``target``) and the kit checks them
    (``checked(..., target=)``); its sequences are freed at each teardown."""

    def any_in(*phases: str) -> Callable[[Any], bool]:
        return lambda self: any(s.phase in phases for _, s in self.driver.model.seqs.values())

    def step(kind: str, when: Callable[[Any], bool] = lambda self: True):
        @precondition(when)
        @rule(call=calls((kind,)))
        def run(self, call: Call) -> None:
            self.driver.run(call)

        run.__name__ = kind
        return run

    class ProposerMachine(RuleBasedStateMachine):
        steps: Counter = Counter()
        accepted = 0                                     # drafts accepted over every run

        def __init__(self) -> None:
            super().__init__()
            self.driver = Driver(make_proposer(), weights, max_states, target)

        alloc = step("alloc", lambda self: len(self.driver.model.seqs) < max_states)
        prefill = step("prefill", any_in("fresh"))
        propose = step("propose", any_in("ready"))
        propose_batch = step("propose_batch", any_in("ready"))
        verify = step("verify", any_in("drafted"))
        catchup = step("catchup", any_in("catchup", "ready"))
        speculative_round = step("round", any_in("ready"))
        take = step("take", any_in("ready"))
        install = step("install", lambda self: bool(self.driver.carried) and any_in("fresh")(self))
        free_carried = step("free_carried", lambda self: bool(self.driver.carried))
        free = step("free", lambda self: len(self.driver.model.seqs) >= 2)
        fork = step("fork", lambda self: len(self.driver.model.seqs) < max_states
                    and any_in("fresh", "ready", "catchup")(self))
        share = step("share", lambda self: len(self.driver.model.seqs) < max_states and any_in("ready", "catchup")(self))
        bad_input = step("bad_input", any_in("ready", "drafted"))
        reenter = step("reenter", any_in("ready"))
        tree = step("tree", any_in("ready"))

        @invariant()
        def agrees_with_the_model(self) -> None:
            self.driver.model.check()

        def teardown(self) -> None:
            type(self).steps.update(self.driver.steps)
            type(self).accepted += self.driver.accepted
            self.driver.close()

    return ProposerMachine
