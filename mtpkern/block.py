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

import numpy as np

from .ops.rope_kv import inv_freq, yarn_inv_freq, yarn_mscale

#: attention output gates: "" none; "elementwise": one gate per attention output
#: column (GQA: Qwen3-Next's, carried by q_proj; MLA: a ``self_attn.g_proj`` [Hq Dv, H] of its
#: own reading the normed input, stacked after kv_a_proj_with_mqa's rows); "headwise": one per
#: query head (Step-3.5's g_proj [Hq, H], GQA only)
ATTN_GATES = ("", "elementwise", "headwise")
#: the MLPs' activation (routed experts, shared expert, dense MLP): "swiglu":
#: ``down(silu(gate x) * up x)`` (w13 = gate rows over up rows); "relu2": non-gated,
#: ``down(relu(up x) ** 2)`` (Nemotron-H; w13 = the up rows only); "situ": gated, Kimi K3's
#: SituAndMul ``down(beta tanh(g / beta) sigmoid(g) * up')`` with ``up' = lb tanh(up / lb)``
#: (``situ_beta``, ``situ_linear_beta`` lb; 0: up' = up), w13 laid out as SwiGLU's
MLP_ACTS = ("swiglu", "relu2", "situ")


class BlockError(ValueError):
    """A block field out of range (raised as the config's ConfigError by MtpConfig)."""


def _number(name: str, v: Any, lo: float, hi: float) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and lo <= v <= hi):
        raise BlockError(f"rope_scaling.{name} expected a number in [{lo:g}, {hi:g}], got {v!r}")
    return float(v)


@dataclass(frozen=True, slots=True)
class Yarn:
    """YaRN RoPE scaling (``rope_type: "yarn"`` in rope_parameters / rope_scaling), with
    Hugging Face's names and defaults (``_compute_yarn_parameters``; DeepSeek-V3, GLM-5).

    Three things follow from it (docs/architecture.md, "Attention features"):
    ``inv_freq`` (the blended frequencies, mtpkern.ops.rope_kv.yarn_inv_freq), the
    ``attention_factor`` that multiplies cos and sin (of q and k both, as HF does), and
    ``softmax_factor``, DeepSeek's ``mscale(factor, mscale_all_dim) ** 2`` on the scores'
    scale when ``mscale_all_dim`` is set."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    #: 0: not given (HF's None). HF reads mscale only beside mscale_all_dim
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    #: 0: derived from factor and mscale / mscale_all_dim (HF's rule); else as given
    attention_factor_override: float = 0.0
    #: HF's ``truncate``: floor / ceil the correction range's ends
    truncate: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "factor", _number("factor", self.factor, 1.0, 1e6))
        o = self.original_max_position_embeddings
        if isinstance(o, bool) or not isinstance(o, int) or not 1 <= o <= 2**31 - 1:
            raise BlockError(f"rope_scaling.original_max_position_embeddings expected an int in [1, 2^31 - 1], "
                             f"got {o!r}")
        for name, lo in (("beta_fast", 1e-3), ("beta_slow", 1e-3), ("mscale", 0.0), ("mscale_all_dim", 0.0),
                         ("attention_factor_override", 0.0)):
            object.__setattr__(self, name, _number(name if name != "attention_factor_override"
                                                   else "attention_factor", getattr(self, name), lo, 1e3))
        if self.beta_slow > self.beta_fast:
            raise BlockError(f"rope_scaling.beta_slow ({self.beta_slow:g}) must be <= beta_fast ({self.beta_fast:g})")
        if not isinstance(self.truncate, bool):
            raise BlockError(f"rope_scaling.truncate expected a bool, got {self.truncate!r}")
        if not 0 < self.attention_factor <= 1e3:        # what the rope op accepts as rope_scale
            raise BlockError(f"rope_scaling: the attention factor {self.attention_factor:g} (from factor, mscale "
                             f"and mscale_all_dim) must be in (0, 1e3]")

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any]) -> "Yarn":
        """From Yarn's fields, or Hugging Face's names (``to_hf``: ``attention_factor``)."""
        d = dict(d)
        if "attention_factor" in d:
            d["attention_factor_override"] = d.pop("attention_factor")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise BlockError(f"rope_scaling: unknown YaRN field(s) {unknown}; expected some of {sorted(names)}")
        return cls(**d)

    def to_hf(self) -> dict:
        """The rope_parameters keys (Hugging Face's names) that ``from_mapping`` reads back."""
        out = {"factor": self.factor, "original_max_position_embeddings": self.original_max_position_embeddings,
               "beta_fast": self.beta_fast, "beta_slow": self.beta_slow}
        for name, key in (("mscale", "mscale"), ("mscale_all_dim", "mscale_all_dim"),
                          ("attention_factor_override", "attention_factor")):
            if getattr(self, name):
                out[key] = getattr(self, name)
        if not self.truncate:
            out["truncate"] = False
        return out

    @property
    def attention_factor(self) -> float:
        """cos and sin are multiplied by this (HF's ``attention_scaling``)."""
        if self.attention_factor_override:
            return self.attention_factor_override
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    @property
    def softmax_factor(self) -> float:
        """The scores' scale is multiplied by this (DeepSeek-V3's ``mscale_all_dim`` correction)."""
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2 if self.mscale_all_dim else 1.0

    def describe(self) -> str:
        return f"yarn x{self.factor:g} of {self.original_max_position_embeddings}"


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
    #: both clamps bound the gate before silu (DeepSeek-V4, GLM-5.3: ``silu(min(g, L))``)
    #: instead of after it (Step-3.5: ``min(silu(g), L)``); up is clipped to [-L, L] either way
    swiglu_clamp_gate: bool = False
    #: RoPE pairs (2i, 2i + 1) (GPT-J order, ``rope_interleave``) instead of neox halves (i, i + R/2)
    rope_interleave: bool = False
    #: YaRN scaling of the RoPE (a mapping of its fields is read as one), None: plain RoPE
    rope_scaling: Yarn | None = None
    #: MLA (multi-head latent attention, DeepSeek-V3 / GLM-5): L = kv_lora_rank > 0 switches
    #: it on. Then ``head_dim`` is the query / key head dim P + R (``qk_nope_head_dim`` +
    #: ``qk_rope_head_dim``), ``v_head_dim`` the value head dim, and the KV is one latent
    #: row of L + R values per token shared by every head (mtpkern.ops.mla)
    kv_lora_rank: int = 0
    #: 0: a plain ``q_proj``; else ``q_a_proj`` [q_lora_rank, H] -> ``q_a_layernorm`` -> ``q_b_proj``
    q_lora_rank: int = 0
    #: R: the rotated dims at the end of each MLA query head, and of the shared key (0: NoPE,
    #: no dim rotated, the latent row L values; the DSA indexer then rotates none either). With
    #: ``nope`` the R dims stay in the latent row and the query, turned by angle 0 (the indexer's too)
    qk_rope_head_dim: int = 0
    #: DSA (DeepSeek-V3.2, GLM-5): T = index_topk > 0 runs the module's own lightning indexer
    #: (``self_attn.indexer.*``, mtpkern.ops.dsa) and the MLA attention reads each row's T
    #: best keys only; it needs MLA with a q_lora_rank (the indexer's query reads the query
    #: latent). ``index_n_heads`` Hi, ``index_head_dim`` Di (the indexer key: Di values per
    #: token in a plane of the KV pool); the indexer's RoPE (the first R of its Di dims) in
    #: pairs (2i, 2i + 1) with ``indexer_rope_interleave`` (GLM-5), else halves (DeepSeek-V3.2)
    index_topk: int = 0
    index_n_heads: int = 0
    index_head_dim: int = 0
    indexer_rope_interleave: bool = False
    #: GLM-5.3's pooled indexer: ``index_kpool`` P > 1 scores pools of P consecutive rows
    #: (each a softmax-weighted key of its rows: ``self_attn.indexer.index_kpool_compress_gate``
    #: and ``_ape``), picks the T / P best complete pools and, with ``index_kpool_tail``, the
    #: rows of the incomplete pool after them (mtpkern.ops.dsa); the pool's plane holds each
    #: row's key and its gate scores (2 Di values). 0 or 1: one key per row
    index_kpool: int = 0
    index_kpool_tail: bool = True
    #: DeepSeek-V4's attention, as features of a GQA block (with q_lora_rank: its query
    #: through q_a_proj / q_a_layernorm / q_b_proj): ``shared_kv``: one projection
    #: (``self_attn.kv_proj``) is both key and value (the value is the key as normed and
    #: rotated); ``out_rope``: the attention output's rotary dims turned back by the query's
    #: angle; ``o_groups`` g > 0: the output through ``o_a_proj`` [g r, Hq Dv / g] per group
    #: of Hq / g heads (r = ``o_lora_rank``), then ``o_b_proj`` [H, g r], instead of o_proj
    shared_kv: bool = False
    out_rope: bool = False
    o_groups: int = 0
    o_lora_rank: int = 0
    #: the MLPs' activation (``MLP_ACTS``); the SwiGLU clamps need "swiglu"
    mlp_act: str = "swiglu"
    #: SiTU's parameters (``mlp_act`` "situ", mtpkern.ops.mlp.situ_act): beta > 0, and the
    #: linear beta of up (0: none); both 0 with another activation
    situ_beta: float = 0.0
    situ_linear_beta: float = 0.0
    #: NoPE: no RoPE in the attention (Nemotron-H's attention layers; in MLA, Kimi K3's gated MLA,
    #: whose R = qk_rope_head_dim > 0 dims of the query and the shared key stay unrotated): the
    #: rotary dims turn by angle 0 (every frequency 0: cos 1, sin 0, each value kept bit for bit)
    nope: bool = False

    def __post_init__(self) -> None:
        for name in ("num_attention_heads", "num_key_value_heads", "head_dim"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise BlockError(f"{name} expected an int >= 1, got {v!r}")
        for name in ("v_head_dim", "sliding_window", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim",
                     "index_topk", "index_n_heads", "index_head_dim", "o_groups", "o_lora_rank", "index_kpool"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise BlockError(f"{name} expected an int >= 0, got {v!r}")
        if self.mla:
            self._check_mla()
        elif self.qk_rope_head_dim:
            name = "qk_rope_head_dim"
            raise BlockError(f"field {name!r} = {getattr(self, name)} describes multi-head latent attention, "
                             f"which needs kv_lora_rank > 0, got {self.kv_lora_rank}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise BlockError(f"num_attention_heads must be a multiple of num_key_value_heads, got "
                             f"{self.num_attention_heads} and {self.num_key_value_heads}")
        rd = self.rotary_dim
        if not self.mla and (rd < 2 or rd % 2 or rd > self.head_dim):   # MLA's R: _check_mla
            raise BlockError(f"head_dim * partial_rotary_factor must be an even number in [2, head_dim], "
                             f"got {self.head_dim} * {self.partial_rotary_factor} = {rd}")
        if not (isinstance(self.rope_theta, (int, float)) and 1.0 < self.rope_theta <= 1e12):
            raise BlockError(f"rope_theta expected a number in (1, 1e12], got {self.rope_theta!r}")
        if self.attn_gate not in ATTN_GATES:
            raise BlockError(f"attn_gate expected one of {ATTN_GATES}, got {self.attn_gate!r}")
        if self.attn_gate == "elementwise" and not self.mla and self.v_dim != self.head_dim:
            raise BlockError(f"an element-wise attention gate (carried by q_proj) needs v_head_dim == head_dim, "
                             f"got {self.v_dim} and {self.head_dim}")
        if self.mlp_act not in MLP_ACTS:
            raise BlockError(f"mlp_act expected one of {MLP_ACTS}, got {self.mlp_act!r}")
        if self.mlp_act != "swiglu" and (self.swiglu_clamp or self.swiglu_clamp_shared):
            raise BlockError(f"the SwiGLU clamps need mlp_act 'swiglu', got mlp_act {self.mlp_act!r} with "
                             f"swiglu_clamp {self.swiglu_clamp!r} / swiglu_clamp_shared {self.swiglu_clamp_shared!r}")
        for name in ("situ_beta", "situ_linear_beta"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and 0 <= v <= 1e6):
                raise BlockError(f"{name} expected a number in [0, 1e6], got {v!r}")
        if self.mlp_act == "situ" and not self.situ_beta > 0:
            raise BlockError(f"mlp_act 'situ' needs situ_beta > 0 (config.json 'activation_situ_beta'), "
                             f"got {self.situ_beta!r}")
        if self.mlp_act != "situ" and (self.situ_beta or self.situ_linear_beta):
            raise BlockError(f"situ_beta / situ_linear_beta need mlp_act 'situ', got mlp_act {self.mlp_act!r} with "
                             f"{self.situ_beta!r} / {self.situ_linear_beta!r}")
        if self.nope and self.rope_scaling is not None:
            raise BlockError(f"nope (no RoPE) takes no rope_scaling, got {self.rope_scaling!r}")
        if not isinstance(self.swiglu_clamp_gate, bool):
            raise BlockError(f"swiglu_clamp_gate expected a bool, got {self.swiglu_clamp_gate!r}")
        for name in ("swiglu_clamp", "swiglu_clamp_shared"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and 0 <= v <= 1e6):
                raise BlockError(f"{name} expected a number in [0, 1e6] (0: no clamp), got {v!r}")
        for name in ("attn_sinks", "moe", "rope_interleave", "indexer_rope_interleave", "shared_kv", "out_rope",
                     "index_kpool_tail", "nope"):
            if not isinstance(getattr(self, name), bool):
                raise BlockError(f"{name} expected a bool, got {getattr(self, name)!r}")
        if self.index_topk:
            self._check_dsa()
        self._check_v4_attention()
        if isinstance(self.rope_scaling, Mapping):
            object.__setattr__(self, "rope_scaling", Yarn.from_mapping(self.rope_scaling))
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, Yarn):
            raise BlockError(f"rope_scaling expected YaRN's fields or None, got {self.rope_scaling!r}")

    def _check_mla(self) -> None:
        R, D = self.qk_rope_head_dim, self.head_dim
        if R % 2 or R >= D:     # R = 0: NoPE (GLM-5.3's MTP layer), no dim rotated
            raise BlockError(f"qk_rope_head_dim expected an even number in [0, head_dim) (head_dim = "
                             f"qk_nope_head_dim + qk_rope_head_dim = {D} in MLA), got {R}")
        if not self.v_head_dim:
            raise BlockError("v_head_dim expected > 0 in MLA (kv_b_proj's value rows per head), got 0")
        if self.partial_rotary_factor != 1.0:
            raise BlockError(f"partial_rotary_factor expected 1 in MLA (qk_rope_head_dim says which dims "
                             f"rotate), got {self.partial_rotary_factor}")
        if self.attn_sinks is not False:
            raise BlockError(f"attn_sinks expected False in MLA (no released MLA block has it), "
                             f"got {self.attn_sinks!r}")
        if self.attn_gate == "headwise":     # "elementwise": the g_proj gate (Kimi K3's gated MLA)
            raise BlockError("attn_gate expected '' or 'elementwise' in MLA (an element-wise g_proj [Hq * "
                             "v_head_dim, hidden_size]), got 'headwise'")

    def _check_dsa(self) -> None:
        if not (self.mla and self.q_lora_rank):
            raise BlockError(f"field 'index_topk' = {self.index_topk} (the DSA indexer) needs MLA with a query latent "
                             f"(kv_lora_rank > 0 and q_lora_rank > 0: the indexer's query reads it), got "
                             f"kv_lora_rank {self.kv_lora_rank} and q_lora_rank {self.q_lora_rank}")
        if self.index_topk > 1 << 20:
            raise BlockError(f"index_topk expected an int in [0, 2^20], got {self.index_topk}")
        if not 1 <= self.index_n_heads <= 1024:
            raise BlockError(f"index_n_heads expected an int in [1, 1024] with index_topk > 0, got {self.index_n_heads}")
        R = self.qk_rope_head_dim
        if not max(R, 1) <= self.index_head_dim <= 1024:
            lo = f"qk_rope_head_dim = {R}" if R else "1"
            raise BlockError(f"index_head_dim expected an int in [{lo}, 1024] with index_topk > 0 "
                             f"(the indexer rotates its first {R} dims), got {self.index_head_dim}")
        P = self.index_kpool
        if P > 1 and (P > 1024 or self.index_topk % P):
            raise BlockError(f"index_kpool expected an int in [2, 1024] dividing index_topk = {self.index_topk} (the "
                             f"pools picked are index_topk / index_kpool), got {P}")
        if P > 1 and not self.index_kpool_tail:
            raise BlockError("index_kpool_always_select_tail expected true with index_kpool > 1 (the releases' value: "
                             "without the tail a row before its first complete pool attends to no row), got false")

    def _check_v4_attention(self) -> None:
        if self.q_lora_rank and not self.mla and self.attn_gate:
            raise BlockError(f"q_lora_rank = {self.q_lora_rank} in a GQA block takes no attention gate, got "
                             f"attn_gate {self.attn_gate!r}")
        if self.shared_kv and self.attn_gate:
            raise BlockError(f"shared_kv takes no attention gate, got attn_gate {self.attn_gate!r}")
        if (self.shared_kv or self.out_rope or self.o_groups) and self.mla:
            raise BlockError("shared_kv, out_rope and o_groups are GQA features (DeepSeek-V4); an MLA block "
                             "(kv_lora_rank > 0) has none of them")
        if self.shared_kv and self.v_dim != self.head_dim:
            raise BlockError(f"shared_kv: the value is the key, so v_head_dim must be head_dim = {self.head_dim}, "
                             f"got {self.v_dim}")
        if bool(self.o_groups) != bool(self.o_lora_rank):
            raise BlockError(f"o_groups and o_lora_rank go together (a grouped output), got {self.o_groups} and "
                             f"{self.o_lora_rank}")
        if self.o_groups and self.num_attention_heads % self.o_groups:
            raise BlockError(f"o_groups = {self.o_groups} must divide num_attention_heads = "
                             f"{self.num_attention_heads}")

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
    def mla(self) -> bool:
        """Multi-head latent attention (``kv_lora_rank > 0``)."""
        return self.kv_lora_rank > 0

    @property
    def qk_nope_head_dim(self) -> int:
        """P: an MLA query head's dims that are not rotated (0 outside MLA)."""
        return self.head_dim - self.qk_rope_head_dim if self.mla else 0

    @property
    def latent_width(self) -> int:
        """L + R: one MLA latent row (0 outside MLA)."""
        return self.kv_lora_rank + self.qk_rope_head_dim if self.mla else 0

    @property
    def dsa(self) -> bool:
        """The DSA indexer runs (``index_topk > 0``)."""
        return self.index_topk > 0

    @property
    def kpool(self) -> int:
        """P: the rows of one pool of the pooled indexer (``index_kpool`` > 1), else 0."""
        return self.index_kpool if self.dsa and self.index_kpool > 1 else 0

    @property
    def index_width(self) -> int:
        """The indexer's values per token, its plane of the KV pool (0 without DSA): the key (Di),
        and with a pooled indexer its gate scores after it (2 Di)."""
        return self.index_head_dim * (2 if self.kpool else 1) if self.dsa else 0

    @property
    def index_list_width(self) -> int:
        """The rows one query row's list holds: T, and with a pooled indexer's tail P - 1 more."""
        return self.index_topk + (self.kpool - 1 if self.kpool and self.index_kpool_tail else 0)

    @property
    def index_scale(self) -> float:
        """The indexer weights' factor ``Hi^-0.5 * Di^-0.5`` (the releases' softmax scale and head mean)."""
        return float(self.index_n_heads) ** -0.5 * float(self.index_head_dim) ** -0.5

    @property
    def kv_row_values(self) -> int:
        """Values one token adds to this module's KV: K and V of every KV head, or one latent
        row (and with DSA the indexer key beside it)."""
        if self.mla:
            return self.latent_width + self.index_width
        return self.num_key_value_heads * (self.head_dim + self.v_dim)

    @property
    def rotary_dim(self) -> int:
        if self.mla:
            return self.qk_rope_head_dim
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
        """Columns of the attention gate stacked after q|k|v in the fused projection (MLA: after
        kv_a_proj_with_mqa's L + R)."""
        return {"": 0, "elementwise": self.o_size, "headwise": self.num_attention_heads}[self.attn_gate]

    @property
    def q_gate(self) -> bool:
        """The element-wise gate that q_proj carries (GQA, Qwen3-Next): its rows after the queries'."""
        return self.attn_gate == "elementwise" and not self.mla

    @property
    def gate_offset(self) -> int:
        """The gate's first column in the output of the projection that carries it: q|k|v's
        width (GQA), or the latent row's L + R (MLA)."""
        return self.latent_width if self.mla else self.q_size + self.k_size + self.v_size

    @property
    def kv_a_size(self) -> int:
        """MLA: rows of the fused ``kv_a_proj_with_mqa | g_proj``, L + R + the gate's Hq Dv (one GEMV
        over the normed input for both, as vLLM's ``fused_qkv_a_g_proj``); 0 outside MLA."""
        return self.latent_width + self.gate_size if self.mla else 0

    @property
    def gated_size(self) -> int:
        """Columns of the projection output whose columns from ``gate_offset`` on are the gate:
        ``qkv_size`` (GQA) or ``kv_a_size`` (MLA)."""
        return self.kv_a_size if self.mla else self.qkv_size

    @property
    def qkv_size(self) -> int:
        """Columns of the fused projection: q | k | v | gate (MLA: the query, q_proj's or q_b_proj's;
        shared_kv: no v)."""
        if self.mla:
            return self.q_size
        return self.q_size + self.k_size + (0 if self.shared_kv else self.v_size) + self.gate_size

    @property
    def scale(self) -> float:
        """The attention scores' scale: ``D ** -0.5``, times YaRN's softmax factor."""
        y = self.rope_scaling
        return float(self.head_dim) ** -0.5 * (1.0 if y is None else y.softmax_factor)

    @property
    def rope_scale(self) -> float:
        """What cos and sin are multiplied by: YaRN's attention factor, else 1."""
        return 1.0 if self.rope_scaling is None else self.rope_scaling.attention_factor

    def inv_freq(self) -> np.ndarray:
        """``[R/2]`` FP32 RoPE frequencies: the default ones, or YaRN's (NoPE: zeros)."""
        y = self.rope_scaling
        if self.nope:
            return np.zeros(self.rotary_dim // 2, np.float32)
        if y is None:
            return inv_freq(self.rotary_dim, self.rope_theta)
        return yarn_inv_freq(self.rotary_dim, self.rope_theta, y.factor, y.original_max_position_embeddings,
                             y.beta_fast, y.beta_slow, y.truncate)

    def describe(self) -> str:
        if self.mla:
            q = f"q_lora={self.q_lora_rank}" if self.q_lora_rank else "q_proj"
            parts = [f"MLA Hq={self.num_attention_heads} L={self.kv_lora_rank} P={self.qk_nope_head_dim} "
                     f"R={self.qk_rope_head_dim} {q}"]
        else:
            parts = [f"Hq={self.num_attention_heads} Hkv={self.num_key_value_heads} D={self.head_dim}"]
        if self.v_head_dim and self.v_head_dim != self.head_dim:
            parts.append(f"Dv={self.v_head_dim}")
        if self.dsa:
            parts.append(f"DSA top-{self.index_topk} Hi={self.index_n_heads} Di={self.index_head_dim}"
                         + (" interleaved" if self.indexer_rope_interleave else "")
                         + (f" pools of {self.kpool}{' + tail' if self.index_kpool_tail else ''}" if self.kpool else ""))
        if (self.mla and not self.qk_rope_head_dim) or self.nope:
            # nothing rotated (YaRN still scales the scores); MLA with R > 0: its R dims kept unrotated
            kept = self.mla and self.qk_rope_head_dim
            parts.append(f"NoPE (R={self.rotary_dim} unrotated)" if kept else "NoPE")
        else:
            parts.append(f"rotary={self.rotary_dim} theta={self.rope_theta:g}")
            if self.rope_interleave:
                parts.append("interleaved")
        if self.rope_scaling is not None:
            parts.append(self.rope_scaling.describe())
        if self.sliding_window:
            parts.append(f"window={self.sliding_window}")
        if self.attn_sinks:
            parts.append("sinks")
        if self.attn_gate:
            parts.append(f"{self.attn_gate} gate" + (" (g_proj)" if self.mla else ""))
        if self.q_lora_rank and not self.mla:
            parts.append(f"q_lora={self.q_lora_rank}")
        if self.shared_kv:
            parts.append("K=V")
        if self.out_rope:
            parts.append("output unrotated")
        if self.o_groups:
            parts.append(f"o_proj {self.o_groups} groups x {self.o_lora_rank}")
        parts.append("MoE" if self.moe else "dense")
        if self.mlp_act == "situ":
            parts.append(f"situ beta={self.situ_beta:g}"
                         + (f" linear_beta={self.situ_linear_beta:g}" if self.situ_linear_beta else ""))
        elif self.mlp_act != "swiglu":
            parts.append(self.mlp_act)
        if self.swiglu_clamp or self.swiglu_clamp_shared:
            parts.append(f"clamp {self.swiglu_clamp:g}/{self.swiglu_clamp_shared:g}"
                         + (" of the gate" if self.swiglu_clamp_gate else ""))
        return " ".join(parts)
