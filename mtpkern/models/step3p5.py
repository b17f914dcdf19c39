"""Step-3.5-Flash (``step3p5``): three MTP modules, sliding-window attention with a
head-wise output gate, dense blocks inside a MoE model, one LM head per module.

The reference is vLLM's ``step3p5_mtp.py`` (StepFun's serving code; SGLang's agrees):

- modules at ``model.layers.{45 + m}.`` with the canonical names, but the norm before
  the LM head and the module's own head under ``transformer.shared_head.`` (``norm``,
  ``output``); no embedding of their own (the target's);
- the config describes every layer, MTP layers included, in per-layer lists of
  ``num_hidden_layers + num_nextn_predict_layers`` entries, read at index
  ``num_hidden_layers + m`` into module ``m``'s block (``normalise``): ``layer_types``
  (``sliding_attention`` takes ``attention_other_setting``'s head counts and the
  ``sliding_window``), ``rope_theta`` and ``partial_rotary_factors`` (RoPE per layer),
  ``swiglu_limits`` / ``swiglu_limits_shared`` (the routed and the shared or dense
  SwiGLU clamps; 0: none) and ``moe_layers_enum`` (the MoE layers; the others dense);
- ``g_proj`` [Hq, H]: each query head's output times ``sigmoid(g_proj . a)`` before
  ``o_proj`` (``use_head_wise_attn_gate``);
- every RMSNorm zero-centred (``1 + w``), q/k norms per head;
- the router: sigmoid scores, a selection-only bias, renormalised, times
  ``moe_router_scaling_factor`` (the MTP layers of the release are dense);
- the module hands on its pre-norm output (``prenorm``).

The llama3 RoPE scaling of the release applies to full-attention layers only
(``yarn_only_types``); the MTP layers are sliding, so their RoPE is plain. A
full-attention MTP layer with a scaled RoPE is refused. transformers' ``step3p7``
port is not the reference: it builds the MTP layers with the full layers' head count.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from .base import Family

#: the per-layer fields read at the MTP layers' indices (and the fields they replace)
_LISTS = ("layer_types", "rope_theta", "partial_rotary_factors", "swiglu_limits", "swiglu_limits_shared")
_TYPES = ("full_attention", "sliding_attention")


def _at(d: dict, name: str, i: int, n: int) -> Any:
    v = d[name]
    if not isinstance(v, list) or len(v) < n:
        got = f"{len(v)} entries" if isinstance(v, list) else repr(v)[:60]
        raise ConfigError(f"config.json: field {name!r} expected a list of {n} entries (num_hidden_layers + "
                          f"num_nextn_predict_layers, one per layer), got {got}")
    return v[i]


def _moe_layers(d: dict) -> set[int] | None:
    v = d.get("moe_layers_enum")
    if v is None:
        return None
    try:
        return {int(x) for x in (v.split(",") if isinstance(v, str) else v) if str(x).strip() != ""}
    except (TypeError, ValueError):
        raise ConfigError(f"config.json: field 'moe_layers_enum' expected layer indices ('3,4,...'), "
                          f"got {str(v)[:60]!r}") from None


def normalise(d: dict) -> dict:
    """The release's per-layer lists -> the default block (module 0's) and per-module
    overrides (``mtp_blocks``). A config already in mtpkern's fields (no ``layer_types``:
    ``MtpConfig.to_dict``) is returned as it is."""
    if not isinstance(d.get("layer_types"), list):
        return d
    if d.get("use_rope_layers"):
        raise ConfigError(f"config.json: field 'use_rope_layers' = {str(d['use_rope_layers'])[:60]} is not supported "
                          f"yet (layers without RoPE); expected it absent or []")
    L, M = d.get("num_hidden_layers"), d.get("num_nextn_predict_layers")
    if not isinstance(L, int) or not isinstance(M, int) or isinstance(L, bool) or isinstance(M, bool) \
            or not 0 <= L <= 4096 or not 1 <= M <= 64:
        raise ConfigError(f"config.json: num_hidden_layers and num_nextn_predict_layers must be ints (in [0, 4096] "
                          f"and [1, 64]) to read the per-layer lists, got {L!r} and {M!r}")
    n = L + M
    other = d.get("attention_other_setting") or {}
    if not isinstance(other, dict):
        raise ConfigError(f"config.json: field 'attention_other_setting' expected an object, got {other!r}"[:200])
    moe = _moe_layers(d)
    yarn_only = d.get("yarn_only_types", ["full_attention"])
    scaled = isinstance(d.get("rope_scaling"), dict) and d["rope_scaling"].get(
        "rope_type", d["rope_scaling"].get("type", "default")) not in ("default", None)
    blocks = []
    for m in range(M):
        i = L + m
        kind = _at(d, "layer_types", i, n)
        if kind not in _TYPES:
            raise ConfigError(f"config.json: layer_types[{i}] (MTP module {m}) expected one of {_TYPES}, got {kind!r}")
        own = other if other.get("attention_type") == kind else {}      # the other type's head counts
        if scaled and kind in yarn_only:
            raise ConfigError(f"config.json: MTP module {m} (layer {i}) is {kind} with a scaled RoPE "
                              f"(rope_scaling {d['rope_scaling'].get('rope_type')!r}): not supported yet; the "
                              f"released modules are sliding-window layers with a plain RoPE")
        theta = _at(d, "rope_theta", i, n) if isinstance(d.get("rope_theta"), list) else d.get("rope_theta", 10000.0)
        prf = (_at(d, "partial_rotary_factors", i, n) if d.get("partial_rotary_factors") is not None
               else d.get("partial_rotary_factor", 1.0))
        limits = [(_at(d, f, i, n) if d.get(f) is not None else None) or 0.0
                  for f in ("swiglu_limits", "swiglu_limits_shared")]
        blocks.append({
            "num_attention_heads": own.get("num_attention_heads", d.get("num_attention_heads")),
            "num_key_value_heads": own.get("num_attention_groups", d.get("num_attention_groups",
                                                                          d.get("num_key_value_heads"))),
            "head_dim": own.get("head_dim", d.get("head_dim")),
            "rope_theta": theta, "partial_rotary_factor": prf,
            "sliding_window": d.get("sliding_window", 0) if kind == "sliding_attention" else 0,
            "attn_gate": "headwise" if d.get("use_head_wise_attn_gate") else "",
            "swiglu_clamp": float(limits[0]), "swiglu_clamp_shared": float(limits[1]),
            "moe": moe is not None and i in moe,
        })
    out = {k: v for k, v in d.items() if k not in _LISTS + ("attention_other_setting", "use_head_wise_attn_gate",
                                                           "num_attention_groups", "rope_scaling", "sliding_window")}
    base = blocks[0]                          # the default block: module 0's; the others differ from it
    out.update({k: v for k, v in base.items() if k != "moe"})
    out["num_attention_groups"] = base["num_key_value_heads"]
    out["mtp_blocks"] = [dict({k: v for k, v in b.items() if k != "moe" and v != base[k]}, moe=b["moe"])
                         for b in blocks]
    return out


FAMILY = Family(
    model_type="step3p5",
    architectures=("Step3p5ForCausalLM",),
    title="Step-3.5-Flash",
    defaults={"use_qk_norm": True, "n_shared_experts": 1, "norm_topk_prob": True},
    aliases={"num_attention_groups": "num_key_value_heads", "moe_num_experts": "n_routed_experts",
             "moe_top_k": "num_experts_per_tok", "moe_router_scaling_factor": "routed_scaling_factor",
             "moe_router_activation": "scoring_func", "norm_expert_weight": "norm_topk_prob"},
    fixed={"zero_centered": True, "att_impl_type": "GQA", "sink": False},
    implements=frozenset(_LISTS + ("attention_other_setting", "use_head_wise_attn_gate", "sliding_window")),
    target_only=frozenset({"moe_layers_enum", "use_moe", "moe_every_n_layer", "moe_layer_offset", "use_moe_router_bias",
                           "need_fp32_gate", "yarn_only_types", "max_seq_len", "use_rope_layers"}),
    renames={"shared_head.norm.weight": "transformer.shared_head.norm.weight",
             "shared_head.head.weight": "transformer.shared_head.output.weight"},
    zero_centred=True,
    normalise=normalise,
)
