"""``TargetTruth``: what a real target says each hidden and token of an engine's calls must be.

``checked(prop, target=...)`` owns one. Per proposer state it keeps the token sequence the
engine has committed (the prompt, each propose's ``last_token``, the accepted drafts, the tokens
a catch-up adds) and runs it through its own ``ReferenceTarget`` sequence, incrementally
(``prefill``, then ``verify`` of the accepted drafts, ``decode`` of tokens a catch-up adds), so
it knows the target's hidden ``h_j`` at every committed position ``j`` and the target's greedy
token after the last one. Then, with the indices of docs/semantics.md:

- ``prefill_drafter(t_0 .. t_{n-1}, hiddens)``: ``hiddens[i]`` is ``h_i``;
- ``propose(t_P, h, P)`` (and ``propose_batch``, trees): ``P`` is the committed length, ``h`` is
  ``h_{P-1}``, ``t_P`` the target's greedy token after position ``P - 1`` (after a verify, its
  bonus token), and the state holds the hiddens of every position before ``P - 1`` (a draft-mode
  proposer takes a propose past a skipped catch-up; the kit does not);
- ``after_verify(a)``: the target accepts the first ``a`` drafts (greedy verification; an
  engine may accept fewer, never more);
- ``catchup_drafter(tokens, hiddens)``: ``hiddens[i]`` is ``h_{Hn+i}``; ``tokens[i]``, at
  position ``Hn + i + 1``, is the committed token there (an accepted draft), or right after a
  verify its bonus token; tokens past those extend the sequence as the engine's (steps decoded
  without drafting, a prompt's later chunks, a new turn) and only their hiddens are checked;
- ``share_prefix(source, prefix_tokens)``: the prefix is the source's committed tokens.

A hidden matches when every element is within ``tolerance.TOLERANCE[tol]`` of the target's
(``|got - want| <= atol + rtol * |want|``): ``"float32"`` for an engine whose target runs in
FP32 on another backend, ``"bfloat16"`` for a BF16 target. A shifted hidden is off by far more
(hiddens of two positions are unrelated). A failure is an ``AssertionError`` naming the call,
the argument, the position, and what was expected and got; a hidden that matches another
position's says which (``it is the target's h_8``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import KvCacheFull
from ..tolerance import TOLERANCE, Tol
from .model import _host


@dataclass(slots=True, eq=False)
class Line:
    """One state's sequence as the target computes it: ``seq`` holds ``t_0 .. t_{L-1}``,
    ``hiddens`` ``h_0 .. h_{L-1}``, ``next_token`` the greedy token after ``t_{L-1}``;
    ``bonus_due``: the last call was a verify, whose bonus ``next_token`` is the next token;
    ``P``, ``last_token``, ``drafts``: the propose awaiting its verify."""

    seq: Any
    hiddens: list[np.ndarray] = field(default_factory=list)
    next_token: int = -1
    bonus_due: bool = False
    P: int = -1
    last_token: int = -1
    drafts: list[int] = field(default_factory=list)

    @property
    def length(self) -> int:
        return len(self.hiddens)


class TargetTruth:
    """The target's view of every state of one checked proposer (module docstring)."""

    def __init__(self, target: Any, prop: Any, tol: str = "float32"):
        for name in ("alloc_seq", "free_seq", "prefill", "decode", "verify"):
            if not callable(getattr(target, name, None)):
                raise TypeError(f"target: expected a ReferenceTarget (with {name}()), got {type(target).__name__}")
        tc, pc = target.config, prop.config
        if (tc.vocab_size, tc.hidden_size) != (pc.vocab_size, pc.stream_size):
            raise ValueError(f"target: expected vocab_size {pc.vocab_size} and hidden size {pc.stream_size} "
                             f"(the proposer's), got {tc.vocab_size} and {tc.hidden_size}")
        if tol not in TOLERANCE:
            raise ValueError(f"tol: expected one of {sorted(TOLERANCE)}, got {tol!r}")
        self.target, self.tol_name = target, tol
        self.tol: Tol = TOLERANCE[tol]
        self.lines: dict[int, Line] = {}             # id(state or carried entry) -> its line

    def run(self, call: str, *args: Any) -> Any:
        """``target.<call>(*args)``; a full pool of the kit's target is the kit's problem, not the
        engine's: a ``RuntimeError`` (never a ``KvCacheFull`` an engine would take for its own)."""
        try:
            return getattr(self.target, call)(*args)
        except KvCacheFull as e:
            raise RuntimeError(f"target: the kit's ReferenceTarget ran out of KV blocks ({e}); give it more "
                               f"num_blocks (its sequences hold every committed token of every state)") from e

    def forward(self, tokens: list[int]) -> Any:
        """The target's prefill of ``tokens`` on a scratch sequence (``TargetOut``), freed again."""
        seq = self.target.alloc_seq()
        try:
            return self.run("prefill", seq, tokens)
        finally:
            self.target.free_seq(seq)

    # -- comparisons -------------------------------------------------------------------
    def _close(self, got: np.ndarray, want: np.ndarray) -> np.ndarray:
        return np.abs(got - want) <= self.tol.atol + self.tol.rtol * np.abs(want)

    def check_hidden(self, line: Line, got: Any, j: int, call: str, arg: str) -> None:
        """``got`` must be ``h_j`` of ``line``."""
        g = _host(got).reshape(-1).astype(np.float64)
        want = line.hiddens[j].astype(np.float64)
        ok = self._close(g, want)
        if ok.all():
            return
        i = int(np.argmin(ok))
        alike = [p for p, h in enumerate(line.hiddens) if p != j and self._close(g, h.astype(np.float64)).all()]
        what = f"; it is the target's h_{alike[0]}" if alike else ""
        raise AssertionError(
            f"{call}: {arg} (position {j}) is not the target's h_{j}: {int((~ok).sum())} of {ok.size} elements "
            f"outside {self.tol_name} tolerance (atol={self.tol.atol}, rtol={self.tol.rtol}), first at {i}: "
            f"got {float(g[i]):.7g}, expected {float(want[i]):.7g}{what}")

    def _extend(self, line: Line, token: int) -> None:
        out = self.run("decode", line.seq, token)
        line.hiddens.append(out.hiddens[0])
        line.next_token = int(out.next_token)

    def _line(self, st: Any, call: str) -> Line:
        line = self.lines.get(id(st))
        assert line is not None, f"{call}: a state the target checks never saw prefilled (prefill_drafter first)"
        return line

    # -- the calls (each after the proposer accepted it) ----------------------------------
    def prefill(self, st: Any, tokens: Any, hiddens: Any) -> None:
        toks = [int(t) for t in np.asarray(tokens).reshape(-1)]
        line = Line(self.target.alloc_seq())
        self.lines[id(st)] = line
        out = self.run("prefill", line.seq, toks)
        line.hiddens, line.next_token = list(out.hiddens), int(out.next_token)
        hid = _host(hiddens).reshape(len(toks), -1)
        for i in range(len(toks)):
            self.check_hidden(line, hid[i], i, "prefill_drafter", f"hiddens[{i}]")

    def propose(self, st: Any, last_token: Any, hidden: Any, P: Any, hn: int, drafts: list[int],
                call: str = "propose", arg: str = "") -> None:
        """``hn``: hiddens the state had consumed before the call; ``drafts``: the chain's (a
        tree's rank-0 path), kept for ``after_verify``. The drafts are recorded first, so a
        failed check leaves the line as a passing call would."""
        line, P = self._line(st, call), int(P)
        bonus_due, line.bonus_due = line.bonus_due, False
        line.P, line.last_token, line.drafts = P, int(last_token), [int(d) for d in drafts]
        L = line.length
        assert P == L, (f"{call}: position{arg} is {P}, expected {L} (the committed sequence holds "
                        f"t_0 .. t_{L - 1})")
        assert hn == P - 1, (
            f"{call} at position {P}: the state holds the target's hiddens of positions 0 .. {hn - 1} only, "
            f"expected 0 .. {P - 2}: the catch-up of positions {hn} .. {P - 2} (tokens "
            f"{[int(t) for t in line.seq.tokens[hn + 1:P]]}) was skipped")
        tok = int(last_token)
        after = "the bonus token of the last verify" if bonus_due else f"its greedy token after position {P - 1}"
        assert tok == line.next_token, (f"{call}: last_token{arg} (position {P}) is {tok}, expected "
                                        f"{line.next_token} (the target's: {after})")
        self.check_hidden(line, hidden, P - 1, call, f"target_hidden{arg}")

    def verify(self, st: Any, accepted: list[int] | int, call: str = "after_verify") -> None:
        """The engine accepted ``accepted``: a tree's path, or a count of the chain's first drafts."""
        line = self._line(st, call)
        if isinstance(accepted, int):
            accepted = line.drafts[:accepted]
        v = self.run("verify", line.seq, line.last_token, accepted)
        a = int(v.num_accepted)
        if a < len(accepted):
            raise AssertionError(
                f"{call}: {len(accepted)} draft(s) accepted, the target accepts {a}: draft {a} (position "
                f"{line.P + a + 1}) is {accepted[a]}, the target's token there is {int(v.greedy[a])}")
        line.hiddens.extend(v.hiddens)                   # h_P .. h_{P+a}
        line.next_token, line.bonus_due = int(v.bonus), True

    def catchup(self, st: Any, tokens: Any, hiddens: Any, hn: int, call: str = "catchup_drafter",
                arg: str = "") -> None:
        toks = [int(t) for t in np.asarray(tokens).reshape(-1)]
        if not toks:
            return
        line = self._line(st, call)
        hid = _host(hiddens).reshape(len(toks), -1)
        for i, tok in enumerate(toks):
            j = hn + i                                    # hiddens[i] is h_j; tokens[i] is t_{j+1}
            self.check_hidden(line, hid[i], j, call, f"hiddens{arg}[{i}]")
            if j + 1 < line.length:
                want = int(line.seq.tokens[j + 1])
                assert tok == want, (f"{call}: tokens{arg}[{i}] (position {j + 1}) is {tok}, expected {want} "
                                     f"(the committed token there: an accepted draft)")
                continue
            if line.bonus_due:
                assert tok == line.next_token, (f"{call}: tokens{arg}[{i}] (position {j + 1}) is {tok}, expected "
                                                f"{line.next_token} (the bonus token of the last verify)")
                line.bonus_due = False
            self._extend(line, tok)

    # -- sequences ---------------------------------------------------------------------------
    def copy(self, src: Any, st: Any, prefix_tokens: Any = None) -> None:
        """``st`` holds ``src``'s sequence (``fork_state``), or its first tokens, which must be
        ``prefix_tokens`` (``share_prefix``: the proposer checks only those it still keeps): a new
        target sequence prefilled with them."""
        old = self.lines.get(id(src))
        if old is None:
            return
        num_tokens = None
        if prefix_tokens is not None:
            given = [int(t) for t in np.asarray(prefix_tokens).reshape(-1)]
            num_tokens = len(given)
            for j, (got, want) in enumerate(zip(given, old.seq.tokens)):
                assert got == want, (f"share_prefix: prefix_tokens[{j}] (position {j}) is {got}, expected {want} "
                                     f"(the source's committed token there)")
        toks = old.seq.tokens[:num_tokens]
        line = Line(self.target.alloc_seq())
        self.lines[id(st)] = line
        out = self.run("prefill", line.seq, toks)
        line.hiddens, line.next_token = list(out.hiddens), int(out.next_token)
        if num_tokens is None:
            line.bonus_due, line.P, line.last_token = old.bonus_due, old.P, old.last_token
            line.drafts = list(old.drafts)
            line.next_token = old.next_token

    def move(self, src: Any, dst: Any) -> None:
        """``take_drafter_kv`` / ``install_drafter_kv``: the line goes with the rows."""
        line = self.lines.pop(id(src), None)
        if line is not None:
            self.lines[id(dst)] = line

    def free(self, st: Any) -> None:
        line = self.lines.pop(id(st), None)
        if line is not None:
            self.target.free_seq(line.seq)
