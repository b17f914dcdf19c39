"""One MTP module's block: the sizes and switches that may differ between modules.

Released multi-module checkpoints do not repeat one block: Step-3.5's MTP layers
alternate sliding-window and full attention, with their own RoPE and head counts,
dense or MoE MLPs; MiMo-V2-Flash's are sliding-window layers with attention sinks and
a value head dim of their own inside a MoE model. ``MtpConfig.block(m)`` gives module
``m``'s ``BlockSpec``: the config's global fields, then the family's per-module
overrides (``MtpConfig.blocks``). Everything a module's weights, KV pool and forward
depend on, beyond the fields every module shares (hidden size, vocabulary, norms'
epsilon, the experts' sizes and routing), is here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Mapping

#: attention output gates: "" none; "elementwise": one gate per attention output
#: column (Qwen3-Next, carried by q_proj); "headwise": one per query head (Step-3.5's g_proj)
ATTN_GATES = ("", "elementwise", "headwise")


class BlockError(ValueError):
    """A block field out of range (raised as the config's ConfigError by MtpConfig)."""


@dataclass(frozen=True, slots=True)
class BlockSpec:
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    #: the value head dim (MiMo-V2: 128 beside a q/k head dim of 192); 0: head_dim
    v_head_dim: int = 0
    partial_rotary_factor: float = 1.0
    rope_theta: float = 10000.0
    #: 0: full attention; W > 0: a row sees the W keys ending at itself (itself included),
    #: as Hugging Face's sliding window (key position > query position - W)
    sliding_window: int = 0
    #: a learned logit per query head joined to every softmax (``self_attn.sinks`` [Hq])
    attn_sinks: bool = False
    attn_gate: str = ""
    #: routed experts (else the dense SwiGLU MLP of ``intermediate_size``)
    moe: bool = True
    #: SwiGLU clamps (``mtpkern.ops.mlp``; 0: none): the routed experts', and the shared
    #: expert's or the dense MLP's
    swiglu_clamp: float = 0.0
    swiglu_clamp_shared: float = 0.0

    def __post_init__(self) -> None:
        for name in ("num_attention_heads", "num_key_value_heads", "head_dim"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise BlockError(f"{name} expected an int >= 1, got {v!r}")
        for name in ("v_head_dim", "sliding_window"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise BlockError(f"{name} expected an int >= 0, got {v!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise BlockError(f"num_attention_heads must be a multiple of num_key_value_heads, got "
                             f"{self.num_attention_heads} and {self.num_key_value_heads}")
        rd = self.rotary_dim
        if rd < 2 or rd % 2 or rd > self.head_dim:
            raise BlockError(f"head_dim * partial_rotary_factor must be an even number in [2, head_dim], "
                             f"got {self.head_dim} * {self.partial_rotary_factor} = {rd}")
        if not (isinstance(self.rope_theta, (int, float)) and 1.0 < self.rope_theta <= 1e12):
            raise BlockError(f"rope_theta expected a number in (1, 1e12], got {self.rope_theta!r}")
        if self.attn_gate not in ATTN_GATES:
            raise BlockError(f"attn_gate expected one of {ATTN_GATES}, got {self.attn_gate!r}")
        if self.attn_gate == "elementwise" and self.v_dim != self.head_dim:
            raise BlockError(f"an element-wise attention gate (carried by q_proj) needs v_head_dim == head_dim, "
                             f"got {self.v_dim} and {self.head_dim}")
        for name in ("swiglu_clamp", "swiglu_clamp_shared"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and 0 <= v <= 1e6):
                raise BlockError(f"{name} expected a number in [0, 1e6] (0: no clamp), got {v!r}")
        for name in ("attn_sinks", "moe"):
            if not isinstance(getattr(self, name), bool):
                raise BlockError(f"{name} expected a bool, got {getattr(self, name)!r}")

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def with_overrides(self, over: Mapping[str, Any], where: str) -> "BlockSpec":
        unknown = sorted(set(over) - set(self.field_names()))
        if unknown:
            raise BlockError(f"{where}: unknown block field(s) {unknown}; expected some of {list(self.field_names())}")
        d = {f: getattr(self, f) for f in self.field_names()}
        d.update(over)
        return BlockSpec(**d)

    # -- derived sizes -------------------------------------------------------------
    @property
    def v_dim(self) -> int:
        """The value head dim (``v_head_dim``, or ``head_dim`` when 0)."""
        return self.v_head_dim or self.head_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def k_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def v_size(self) -> int:
        return self.num_key_value_heads * self.v_dim

    @property
    def o_size(self) -> int:
        """Columns of the attention output (o_proj's input)."""
        return self.num_attention_heads * self.v_dim

    @property
    def gate_size(self) -> int:
        """Columns of the attention gate stacked after q|k|v in the fused projection."""
        return {"": 0, "elementwise": self.o_size, "headwise": self.num_attention_heads}[self.attn_gate]

    @property
    def qkv_size(self) -> int:
        """Columns of the fused projection: q | k | v | gate."""
        return self.q_size + self.k_size + self.v_size + self.gate_size

    @property
    def scale(self) -> float:
        """The attention scores' scale."""
        return float(self.head_dim) ** -0.5

    def describe(self) -> str:
        parts = [f"Hq={self.num_attention_heads} Hkv={self.num_key_value_heads} D={self.head_dim}"]
        if self.v_head_dim and self.v_head_dim != self.head_dim:
            parts.append(f"Dv={self.v_head_dim}")
        parts.append(f"rotary={self.rotary_dim} theta={self.rope_theta:g}")
        if self.sliding_window:
            parts.append(f"window={self.sliding_window}")
        if self.attn_sinks:
            parts.append("sinks")
        if self.attn_gate:
            parts.append(f"{self.attn_gate} gate")
        parts.append("MoE" if self.moe else "dense")
        if self.swiglu_clamp or self.swiglu_clamp_shared:
            parts.append(f"clamp {self.swiglu_clamp:g}/{self.swiglu_clamp_shared:g}")
        return " ".join(parts)
