"""Hypothesis strategies for proposer call sequences (needs ``hypothesis``).

``calls(kinds)`` draws one ``Call``; ``call_sequences()`` draws a list of them
over every kind, for ``Driver(prop).run_all(calls)``. Sizes stay small so that
pools fill, blocks are shared out and freed, and sequences meet every phase.
"""

from __future__ import annotations

from hypothesis import strategies as hs

from .driver import BAD, KINDS, MASKS, REENTER, Call

#: per kind: (sizes, variants)
_SHAPES = {
    "alloc": (hs.integers(1, 60), hs.sampled_from(["plain", "budget"])),
    "prefill": (hs.integers(1, 18), hs.just("")),
    "propose": (hs.integers(1, 5), hs.sampled_from(MASKS + ("skip",))),
    "propose_batch": (hs.integers(1, 4), hs.just("")),
    "verify": (hs.just(1), hs.just("")),
    "catchup": (hs.just(1), hs.sampled_from(["", "extend"])),
    "round": (hs.integers(1, 4), hs.sampled_from(["", "extend"])),
    "take": (hs.just(1), hs.just("")),
    "install": (hs.integers(0, 7), hs.just("")),
    "free_carried": (hs.integers(0, 7), hs.just("")),
    "free": (hs.just(1), hs.just("")),
    "bad_input": (hs.integers(0, 7), hs.sampled_from(BAD)),
    "reenter": (hs.just(1), hs.sampled_from(REENTER)),
    "tree": (hs.just(1), hs.sampled_from(["", "skip"])),
    "fork": (hs.just(1), hs.just("")),
    "share": (hs.just(1), hs.just("")),
}


def calls(kinds: tuple[str, ...] = KINDS) -> hs.SearchStrategy[Call]:
    """One ``Call`` of one of ``kinds``."""
    for k in kinds:
        if k not in _SHAPES:
            raise ValueError(f"kinds: expected names from {KINDS}, got {k!r}")

    @hs.composite
    def one(draw) -> Call:
        kind = draw(hs.sampled_from(kinds))
        size, variant = _SHAPES[kind]
        return Call(kind, pick=draw(hs.integers(0, 7)), seed=draw(hs.integers(0, 2**32 - 1)), size=draw(size),
                    frac=draw(hs.floats(0, 1)), variant=draw(variant))

    return one()


def call_sequences(min_size: int = 1, max_size: int = 40,
                   kinds: tuple[str, ...] = KINDS) -> hs.SearchStrategy[list[Call]]:
    """Lists of ``Call``s; the first allocates, so that most sequences do something."""
    first = hs.builds(Call, hs.just("alloc"))
    return hs.tuples(first, hs.lists(calls(kinds), min_size=max(0, min_size - 1), max_size=max_size - 1)).map(
        lambda t: [t[0], *t[1]])
