"""Which slice of each weight a rank of a sharded draft head holds (docs/distributed.md).

A sharded head runs the same propose on every rank of a communicator (mtpkern.comm); a
``Shard`` says what rank ``rank`` of ``size`` holds, and every piece of the layout is
decided here, so that the loader (mtpkern.weights), the head (mtpkern.head) and the tests
read one rule:

- attention (tensor-parallel by head): query heads ``q0 .. q1 - 1`` (``Hq / size`` each) with
  their q / gate rows, biases and sinks; key / value heads ``kv0 .. kv1 - 1`` (``Hkv / size``
  each), or, where there are fewer KV heads than ranks (``size`` a multiple of ``Hkv``), the
  one KV head the rank's query heads read, held by ``size / Hkv`` ranks alike; ``o_proj``'s
  input columns of the rank's heads, whose partial products meet in an all-reduce (sum).
  MLA: the query heads likewise (q_b_proj / q_proj rows, kv_b_proj's per-head parts, an
  element-wise gate's g_proj rows), the latent row (kv_a_proj, its norm, the KV pool)
  replicated. DeepSeek-V4's attention: the query latent (q_a_proj, its norm) replicated,
  q_b_proj's rows of the rank's heads, kv_proj as the KV heads; a grouped output (``o_groups``
  g) by whole groups: the rank's heads are groups ``g0 .. g1 - 1`` (``g / size`` each; a split
  that cuts a group is refused), with their ``o_lora_rank`` r rows of o_a_proj each and
  o_b_proj's columns ``g0 r .. g1 r - 1``, whose partial products meet in o_proj's all-reduce.
- routed experts: by expert id (``"ep"``: experts ``e0 .. e1 - 1`` whole, the router's ids
  of the others mapped to -1, an empty slot: mtpkern.ops.moe) or by intermediate slice
  (``"tp"``: every expert's gate / up rows and down columns ``i0 .. i1 - 1``); shared
  experts and the dense MLP by intermediate slice; each module's FFN output meets in one
  all-reduce (sum). LatentMoE: ``fc1_latent_proj`` / ``fc2_latent_proj`` replicated, each
  rank lifting its partial latent sum (fc2 is linear); with ``moe_latent_norm`` the latent sum
  is all-reduced first and the norm's weight is rank 0's, zeros elsewhere (mtpkern.weights).
- the LM head by vocabulary rows ``lo .. hi - 1``, whole bitmask words (``lo``, ``hi``
  multiples of 32 but for the last shard's end), so a rank's grammar mask is a slice of the
  words; the per-rank bests meet in ``comm.sharded_argmax`` (and ``sharded_confidence``).
- replicated: the embedding, ``eh_proj``, every norm, q/k norms, the router (so every rank
  selects the same experts from the same, all-reduced, rows).

The residual of a partial sum is added on rank 0 alone, before the all-reduce.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from .block import BlockSpec
from .comm import agree
from .errors import KvCacheFull, NoAllowedToken, StateError

#: how routed experts are split: by expert id, or by intermediate slice of every expert
EXPERT_MODES = ("ep", "tp")


class ShardError(ValueError):
    """A checkpoint's shapes cannot be split over the ranks as asked."""


@dataclass(frozen=True, slots=True)
class HeadSlice:
    """The attention heads rank ``rank`` holds: query heads ``q0 .. q1 - 1``, KV heads
    ``kv0 .. kv1 - 1`` (MLA: the latent, ``kv0, kv1 = 0, 1`` as one replicated row)."""

    q0: int
    q1: int
    kv0: int
    kv1: int

    @property
    def q(self) -> int:
        return self.q1 - self.q0

    @property
    def kv(self) -> int:
        return self.kv1 - self.kv0


@dataclass(frozen=True, slots=True)
class Shard:
    """Rank ``rank`` of ``size``; ``experts``: "ep" or "tp" (module docstring)."""

    rank: int
    size: int
    experts: str = "ep"

    def __post_init__(self) -> None:
        for name, lo in (("size", 1), ("rank", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
                raise ValueError(f"{name}: expected an int >= {lo}, got {v!r}")
        if self.rank >= self.size:
            raise ValueError(f"rank: expected an int in 0 .. {self.size - 1}, got {self.rank}")
        check_experts(self.experts)

    @classmethod
    def of(cls, comm: Any, experts: str = "ep") -> "Shard":
        return cls(int(comm.rank), int(comm.size), experts)

    @property
    def owns_residual(self) -> bool:
        """Whether this rank adds the residual of a partial sum (rank 0 alone)."""
        return self.rank == 0

    def span(self, n: int, what: str) -> tuple[int, int]:
        """This rank's equal share ``lo .. hi - 1`` of ``n`` items; ``n`` must divide evenly."""
        if n % self.size:
            raise ShardError(f"{what}: {n} cannot be split evenly over {self.size} ranks")
        per = n // self.size
        return self.rank * per, (self.rank + 1) * per

    # -- attention -------------------------------------------------------------------------
    def heads(self, b: BlockSpec, where: str = "") -> HeadSlice:
        q0, q1 = self.span(b.num_attention_heads, f"num_attention_heads{where}")
        if b.o_groups and b.o_groups % self.size:    # g / size groups a rank: its heads whole groups
            raise ShardError(f"o_groups{where}: a grouped output's {b.o_groups} groups of "
                             f"{b.num_attention_heads // b.o_groups} query heads cannot be split over {self.size} "
                             f"ranks: a rank's {q1 - q0} query heads would cut a group (expected o_groups a "
                             f"multiple of the world size {self.size}, got {b.o_groups})")
        if b.mla:
            return HeadSlice(q0, q1, 0, 1)
        Hkv = b.num_key_value_heads
        if Hkv % self.size == 0:
            kv0, kv1 = self.span(Hkv, f"num_key_value_heads{where}")
        elif self.size % Hkv == 0:                   # fewer KV heads than ranks: each held by size / Hkv
            kv0 = self.rank // (self.size // Hkv)
            kv1 = kv0 + 1
        else:
            raise ShardError(f"num_key_value_heads{where}: {Hkv} KV heads cannot be split over {self.size} ranks "
                             f"(expected a multiple or a divisor of the world size)")
        return HeadSlice(q0, q1, kv0, kv1)

    def groups(self, b: BlockSpec, where: str = "") -> tuple[int, int]:
        """The output groups ``g0 .. g1 - 1`` of a grouped output (``o_groups``) whose heads
        this rank holds, whole (``heads`` refuses a split that cuts one); (0, 0) without one."""
        h = self.heads(b, where)
        if not b.o_groups:
            return 0, 0
        per = b.num_attention_heads // b.o_groups                # query heads a group
        return h.q0 // per, h.q1 // per

    def block(self, b: BlockSpec, where: str = "") -> BlockSpec:
        """The block as this rank computes it: its query and KV heads (and output groups)."""
        h = self.heads(b, where)
        if b.mla:      # the latent row has no KV heads to split (the field only must divide Hq)
            return dataclasses.replace(b, num_attention_heads=h.q, num_key_value_heads=1)
        return dataclasses.replace(b, num_attention_heads=h.q, num_key_value_heads=h.kv,
                                   o_groups=b.o_groups // self.size)

    # -- FFN and LM head -------------------------------------------------------------------
    def expert_range(self, E: int) -> tuple[int, int]:
        """Experts held whole ("ep"): ``e0 .. e1 - 1``; "tp": all of them."""
        return self.span(E, "n_routed_experts") if self.experts == "ep" else (0, E)

    def expert_map(self, E: int) -> np.ndarray | None:
        """[E] int32: global expert id -> this rank's local one, -1 where another rank holds
        it ("ep"); None when every rank holds every expert ("tp", or one rank)."""
        if self.experts != "ep" or self.size == 1:
            return None
        e0, e1 = self.expert_range(E)
        m = np.full(E, -1, np.int32)
        m[e0:e1] = np.arange(e1 - e0, dtype=np.int32)
        return m

    def routed_slice(self, I: int) -> tuple[int, int]:
        """The intermediate columns of each routed expert this rank holds."""
        return (0, I) if self.experts == "ep" else self.span(I, "moe_intermediate_size")

    def vocab(self, V: int) -> tuple[int, int]:
        """LM head rows ``lo .. hi - 1``: an equal share of the bitmask's ``ceil(V / 32)``
        words (the first ranks one more where they do not divide), so every shard's rows
        are whole words of the grammar mask."""
        W = (V + 31) // 32
        if W < self.size:
            raise ShardError(f"vocab_size: {V} tokens are {W} bitmask words, fewer than the {self.size} ranks "
                             f"(each rank holds whole words of 32 tokens)")
        per, extra = divmod(W, self.size)
        w0 = self.rank * per + min(self.rank, extra)
        w1 = w0 + per + (self.rank < extra)
        return 32 * w0, min(V, 32 * w1)


def check_experts(experts: Any) -> str:
    """``experts``: "ep" or "tp" (checked with or without a communicator)."""
    if not isinstance(experts, str) or experts not in EXPERT_MODES:
        raise ValueError(f"experts: expected one of {', '.join(EXPERT_MODES)}, got {experts!r}")
    return experts


# -- the sharded call's agreement (docs/distributed.md, "Agreement") ------------------------

_CALLS = threading.local()              # the sharded calls running on this thread, innermost last


class _Unsharded:
    """``agreement`` of a proposer that is not sharded (or does not agree): nothing to do."""

    @staticmethod
    def masks(masks: list, given: Any) -> list:
        return masks

    @staticmethod
    def body(fn: Callable[[], Any], undo: Callable[[], Any] | None = None) -> Callable[[], Any]:
        return fn


_UNSHARDED = _Unsharded()


class _Call:
    """One running sharded call: whether its ranks agreed yet, and an error deferred from a
    grammar callable (raised on every rank at the call's closing agreement)."""

    def __init__(self, prop: Any, name: str):
        self.prop, self.name = prop, name
        self.agreed = False
        self.settles = False
        self.deferred: Exception | None = None

    def agree(self, fields: list, error: BaseException | None = None, during: bool = False) -> None:
        be = self.prop.backend
        try:
            agree(self.prop.comm, self.name, fields, error, be.from_host, be.to_host, during=during)
        except BaseException as e:
            if not getattr(e, "_mtpkern_agreed", False):     # the transport failed: the ranks may be out of step
                _broken(self.prop, self.name, e)
            raise

    def masks(self, masks: list, given: Any) -> list:
        """``masks`` (resolved) with the user's callables among ``given`` wrapped: an error
        they raise is kept and the draft goes on unconstrained on this rank, so that it still
        meets the others in every collective; the call's closing agreement raises it on every
        rank (``body``)."""
        out = list(masks)
        for i, (fn, g) in enumerate(zip(masks, given)):
            if fn is not None and callable(g):
                out[i] = self._deferring(fn)
                self.settles = True
        return out

    def _deferring(self, fn: Callable) -> Callable:
        def call(i: int, drafts: list) -> Any:
            if self.deferred is not None:
                return None
            try:
                return fn(i, drafts)
            except Exception as e:                            # noqa: BLE001 - raised at the closing agreement
                self.deferred = e
                return None
        return call

    def body(self, fn: Callable[[], Any], undo: Callable[[], Any] | None = None) -> Callable[[], Any]:
        """``fn`` (a call's guarded body) followed, where a grammar callable may have failed on
        some rank, by the closing agreement (still inside the guarded section: a failure rolls
        every rank back; ``undo`` first undoes what ``fn`` did beyond the guarded section's
        snapshot, e.g. a drafted tree's scratch sequences). A ``NoAllowedToken`` is raised on
        every rank at the same point (after the sharded argmax), so it closes the same way."""
        if not self.settles:
            return fn

        def run() -> Any:
            try:
                out = fn()
            except NoAllowedToken:
                self.agree([], self.deferred, during=True)
                raise
            try:
                self.agree([], self.deferred, during=True)
            except BaseException:
                if undo is not None:
                    undo()
                raise
            return out
        return run


def _broken(prop: Any, call: str, e: BaseException) -> None:
    prop._comm_failure = f"{call}: {type(e).__name__}: {e}"


def agreement(prop: Any, states: Sequence[Any], fields: dict[str, Any]) -> Any:
    """The agreement point of the sharded call running on this thread (before its guarded
    section: nothing computed, no state changed): every rank's ``fields`` (with the call's name,
    its states' KV rows and the pools' free and reserved blocks) must be the same, or every rank
    raises (mtpkern.comm.agree). Returns the call (``masks`` / ``body``); for a proposer that is
    not sharded, an object whose ``masks`` / ``body`` change nothing."""
    stack = getattr(_CALLS, "stack", None)
    call = stack[-1] if stack else None
    if call is None or call.prop is not prop:
        return _UNSHARDED
    kv = [[int(st._num_verified)] + [int(seq.rows) for seq in st._kv] for st in states]
    pools = [(int(p.num_free), int(p.reserved)) for p in prop.pools]
    call.agreed = True                     # tried: a failure here is agreed (or the transport's), not agreed again
    call.agree([("call", call.name), *fields.items(), ("states' KV rows", kv), ("pools' free blocks", pools)])
    return call


def sharded_call(name: str) -> Callable:
    """Decorates a proposer method that runs collectives: on a sharded head (``needs_comm()``,
    ``agree_calls``) the ranks agree once per call (``agreement``, at its agreement point, or at
    its end if it returns or raises before: a refusal on one rank is a refusal on every rank);
    an error that escapes after the agreement and was not agreed (a transport's) marks the
    proposer broken: its later sharded calls raise ``StateError`` at once (not through the
    transport: a peer may still be waiting in a collective of the failed call)."""

    def deco(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def run(prop: Any, *args: Any, **kwargs: Any) -> Any:
            if prop.comm is None or not getattr(prop, "agree_calls", True):
                return fn(prop, *args, **kwargs)
            failed = getattr(prop, "_comm_failure", None)
            if failed is not None:        # not through the transport: a peer may still wait in that call's collective
                raise StateError(f"{name}: the communicator failed in an earlier call ({failed}); the ranks may be "
                                 f"out of step: rebuild the sharded head on every rank")
            call = _Call(prop, name)
            stack = _CALLS.__dict__.setdefault("stack", [])
            stack.append(call)
            try:
                out = fn(prop, *args, **kwargs)
            except BaseException as e:
                stack.pop()
                if not call.agreed:
                    call.agree([], e)                         # raises the agreed error on every rank
                elif not (getattr(e, "_mtpkern_agreed", False) or isinstance(e, (NoAllowedToken, KvCacheFull))):
                    _broken(prop, name, e)
                raise
            stack.pop()
            if not call.agreed:                               # returned before its agreement point
                call.agree([("call", name), ("returned", "before its collectives")])
            return out
        return run
    return deco
