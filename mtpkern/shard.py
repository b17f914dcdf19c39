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
  MLA: the query heads likewise (q_b_proj / q_proj rows, kv_b_proj's per-head parts), the
  latent row (kv_a_proj, its norm, the KV pool) replicated.
- routed experts: by expert id (``"ep"``: experts ``e0 .. e1 - 1`` whole, the router's ids
  of the others mapped to -1, an empty slot: mtpkern.ops.moe) or by intermediate slice
  (``"tp"``: every expert's gate / up rows and down columns ``i0 .. i1 - 1``); shared
  experts and the dense MLP by intermediate slice; each module's FFN output meets in one
  all-reduce (sum).
- the LM head by vocabulary rows ``lo .. hi - 1``, whole bitmask words (``lo``, ``hi``
  multiples of 32 but for the last shard's end), so a rank's grammar mask is a slice of the
  words; the per-rank bests meet in ``comm.sharded_argmax`` (and ``sharded_confidence``).
- replicated: the embedding, ``eh_proj``, every norm, q/k norms, the router (so every rank
  selects the same experts from the same, all-reduced, rows).

The residual of a partial sum is added on rank 0 alone, before the all-reduce.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from .block import BlockSpec

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
        if self.experts not in EXPERT_MODES:
            raise ValueError(f"experts: expected one of {', '.join(EXPERT_MODES)}, got {self.experts!r}")

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

    def block(self, b: BlockSpec, where: str = "") -> BlockSpec:
        """The block as this rank computes it: its query and KV heads."""
        h = self.heads(b, where)
        if b.mla:      # the latent row has no KV heads to split (the field only must divide Hq)
            return dataclasses.replace(b, num_attention_heads=h.q, num_key_value_heads=1)
        return dataclasses.replace(b, num_attention_heads=h.q, num_key_value_heads=h.kv)

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
