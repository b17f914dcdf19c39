"""``Family``: how one released MTP family maps onto mtpkern's config and tensors.

mtpkern computes one block (docs/model.md) from a canonical set of tensors, named
as in the GLM-4.5 / DeepSeek-V3 release (``enorm.weight``, ``eh_proj.weight``,
``self_attn.q_proj.weight``, ``mlp.experts.{e}.gate_proj.weight``, ...), and one
``MtpConfig``. A family says only how it differs, as data:

- **config**: its model types and architectures; the defaults of its Hugging Face
  config class that differ from ``MtpConfig``'s; its names for our fields
  (``aliases``); the block features it switches on (``fixed``); the fields that
  describe only its target's layers (``target_only``: accepted, not read); the
  otherwise refused fields it implements (``implements``); and, where data is not
  enough, a ``normalise`` function (per-layer lists into per-module blocks);
- **tensors**: the prefix of module ``m`` (``{layer}`` = ``num_hidden_layers + m``,
  ``{m}`` = ``m``) and renames of canonical suffixes (an entry ending in ``.``
  renames a prefix of the suffix; values may use ``{m}``), and other names a
  tensor may have in checkpoints of the family written for another reader
  (``alternatives``: e.g. the name transformers loads), one of which is read;
- **ignored tensors**: prefixes (under a module's prefix) of tensors the release holds and
  mtpkern reads not, each with the reason, stated at load (``MtpWeights.notes``) and by
  ``mtpkern info`` (no released family needs it today; tests/test_weights.py exercises it);
- **wrappers**: the model types (and their architectures) whose config holds this
  family's config under ``text_config`` (a vision-language release of the same
  text model), and other model types that text config may carry (``text_model_types``:
  Kimi K3's ``kimi_linear``);
- **folds**, applied once at load so that kernels never see them: the input order
  of ``eh_proj`` (``hidden_embed`` swaps its column halves; ``split_eh_proj``: two
  projections ``e_proj`` / ``h_proj`` joined into one), zero-centred RMSNorm
  weights (stored ``w``, applied as ``1 + w``: 1 is added; the target's final norm
  too), a query projection that interleaves an output gate per head
  (``q_gate_interleaved``: the gate rows move after q|k|v), norms the release has no
  weight for (``unit_norms``: ones), and RoPE on the last dims of each head
  (``rope_last``: each head's dims reordered so that they come first).

A new family is a new file in this package with one ``Family`` in it, registered
in ``mtpkern/models/__init__.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping

Concat = Literal["embed_hidden", "hidden_embed"]

#: the canonical RMSNorm weights of a module (the ones a zero-centred family stores as w)
NORMS = ("enorm.weight", "hnorm.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
         "self_attn.q_norm.weight", "self_attn.k_norm.weight", "shared_head.norm.weight",
         "self_attn.q_a_layernorm.weight", "self_attn.kv_a_layernorm.weight")


@dataclass(frozen=True, slots=True)
class Family:
    """One released MTP family (see the module docstring)."""

    model_type: str
    architectures: tuple[str, ...]
    title: str
    defaults: Mapping[str, Any] = field(default_factory=dict)
    aliases: Mapping[str, str] = field(default_factory=dict)
    fixed: Mapping[str, Any] = field(default_factory=dict)
    target_only: frozenset[str] = frozenset()
    implements: frozenset[str] = frozenset()
    prefix: str = "model.layers.{layer}."
    renames: Mapping[str, str] = field(default_factory=dict)
    #: canonical suffix -> other names (under the module's prefix) the checkpoint may give
    #: the same tensor instead of the release's; exactly one of them must be present
    alternatives: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    #: (suffix prefix under a module's prefix, why it is not read): tensors of the release
    #: that are loaded not, and said so (never silently, never refused)
    ignored: tuple[tuple[str, str], ...] = ()
    #: an outer model_type -> its architectures, whose config.json nests this family's
    #: config under ``text_config`` (read as that text config: mtpkern/config.py)
    wrappers: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    #: other model types a wrapper's ``text_config`` may give for this family's text model
    #: (Kimi K3's release writes ``kimi_linear``, the name of the code it runs on)
    text_model_types: tuple[str, ...] = ()
    #: component renames: after ``renames``, every dotted part of a name found here is
    #: replaced (DeepSeek-V4: ``self_attn`` -> ``attn``, ``gate_proj`` -> ``w1``, ...)
    parts: Mapping[str, str] = field(default_factory=dict)
    #: renames of the projection of one routed expert (the part after ``experts.{e}.``), which
    #: leave the shared experts' alone (Kimi K3: ``gate_proj`` -> ``w1`` in
    #: ``experts.{e}.w1.weight``, ``shared_experts.gate_proj.weight`` as it is)
    expert_parts: Mapping[str, str] = field(default_factory=dict)
    #: an FP8 / FP4 weight ``X.weight``'s scales are ``X.scale`` (DeepSeek-V4) instead of
    #: ``X.weight_scale_inv`` (``X.weight_scale`` for per-channel FP8)
    scale_dot_scale: bool = False
    concat: Concat = "embed_hidden"
    #: ``eh_proj`` released as two [H, H] projections, ``e_proj.weight`` (of the normed
    #: embedding) and ``h_proj.weight`` (of the normed hidden), whose sum is eh_proj over
    #: [embed, hidden]: joined column-wise at load (DeepSeek-V4)
    split_eh_proj: bool = False
    #: canonical RMSNorm weights the release has not (an unweighted norm): applied as ones
    unit_norms: frozenset[str] = frozenset()
    #: RoPE rotates the LAST ``R`` dims of each head in the release (DeepSeek-V4) where
    #: mtpkern rotates the first: each head's dims are reordered at load (the last R first)
    #: in the query and key rows, the q / k norm weights and, where the value is the key
    #: (``shared_kv``), the output projection's columns; scores and outputs are unchanged
    rope_last: bool = False
    zero_centred: bool = False
    #: q_proj rows per head [query (D) | gate (D)] (Qwen3-Next), de-interleaved at load into
    #: the query rows and the gate rows stacked after q|k|v
    q_gate_interleaved: bool = False
    #: routed experts stored packed, one tensor per projection for all experts (Step-3.5's
    #: ``moe.gate_proj.weight`` [E, I, H], ``moe.up_proj.weight`` [E, I, H],
    #: ``moe.down_proj.weight`` [E, H, I]) under the canonical suffixes
    #: ``mlp.experts.{gate,up,down}_proj.weight`` (renamed like any other), instead of one per
    #: expert (``mlp.experts.{e}.gate_proj.weight``)
    packed_experts: bool = False
    #: the hidden a module hands on (to the next module, or to itself for the next draft)
    #: in the reference implementation: "prenorm" (y, DeepSeek-V3 / vLLM) or "postnorm"
    #: (the normed y that the LM head reads: vLLM's Qwen3-Next MTP); the proposer's
    #: ``chain=None`` default
    chain: str = "prenorm"
    #: the release's config.json -> the same config in mtpkern's fields, for what data
    #: cannot say (per-layer lists read at the MTP layers' indices into per-module blocks):
    #: called on the raw dict before aliases, fixed values and defaults; raises ConfigError
    normalise: Callable[[dict], dict] | None = None
    #: the target's norm before the LM head (apply_target_norm)
    target_norm: str = "model.norm.weight"
    #: where a module without its own embedding / LM head finds the target's
    target_embed: str = "model.embed_tokens.weight"
    target_head: str = "lm_head.weight"

    def __post_init__(self) -> None:
        if self.concat not in ("embed_hidden", "hidden_embed"):
            raise ValueError(f"{self.model_type}: concat expected 'embed_hidden' or 'hidden_embed', got {self.concat!r}")

    def module_prefix(self, layer: int, m: int) -> str:
        return self.prefix.format(layer=layer, m=m)

    def key(self, layer: int, m: int, suffix: str) -> str:
        """The checkpoint key of canonical ``suffix`` for module ``m`` (at ``layer``)."""
        new = self.renames.get(suffix)
        if new is None:
            best = max((p for p in self.renames if p.endswith(".") and suffix.startswith(p)), key=len, default=None)
            new = suffix if best is None else self.renames[best] + suffix[len(best):]
        if self.parts:
            new = ".".join(self.parts.get(p, p) for p in new.split("."))
        if self.expert_parts:
            ps = new.split(".")
            for i in range(2, len(ps)):
                if ps[i - 2] == "experts" and ps[i - 1].isdigit():
                    ps[i] = self.expert_parts.get(ps[i], ps[i])
            new = ".".join(ps)
        return self.module_prefix(layer, m) + new.format(m=m)

    def keys(self, layer: int, m: int, suffix: str) -> tuple[str, ...]:
        """Every name the tensor ``suffix`` of module ``m`` may have: the release's
        (``key``) first, then the ``alternatives``."""
        pre = self.module_prefix(layer, m)
        return (self.key(layer, m, suffix),) + tuple(pre + a.format(m=m) for a in self.alternatives.get(suffix, ()))

    def ignored_reason(self, suffix: str) -> str | None:
        """Why the tensor ``suffix`` (under a module's prefix) is not read, if the family says."""
        return next((why for pre, why in self.ignored if suffix.startswith(pre)), None)

    def folds_norm(self, suffix: str) -> bool:
        return self.zero_centred and suffix in NORMS

    def scale_key(self, key: str, block: bool) -> str:
        """The scale tensor of the quantized weight ``key`` (``block``: block scales, else
        per-channel): ``X.scale`` (``scale_dot_scale``), ``X.weight_scale_inv`` or
        ``X.weight_scale``."""
        if self.scale_dot_scale and key.endswith(".weight"):
            return key[:-len("weight")] + "scale"
        return key + ("_scale_inv" if block else "_scale")

    def describe(self) -> str:
        parts = [self.title]
        if self.concat == "hidden_embed":
            parts.append("eh_proj input [hidden, embed] (folded)")
        if self.zero_centred:
            parts.append("zero-centred norms (folded)")
        if self.split_eh_proj:
            parts.append("e_proj | h_proj joined into eh_proj")
        if self.q_gate_interleaved:
            parts.append("q_proj gate rows per head (regrouped)")
        if self.unit_norms:
            parts.append(f"unweighted {', '.join(sorted(self.unit_norms))} (ones)")
        if self.rope_last:
            parts.append("RoPE on each head's last dims (dims reordered)")
        if self.chain != "prenorm":
            parts.append(f"{self.chain} chain")
        for pre, why in self.ignored:
            parts.append(f"{pre}* not read ({why})")
        feats = [f"{k}={v}" for k, v in self.fixed.items()]
        if feats:
            parts.append(", ".join(feats))
        return "; ".join(parts)
