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
full-attention MTP layer with a scaled RoPE is refused.

transformers' ``step3p7`` port (5.16+; ``Step3p7TextConfig``, ``model_type`` "step3p5",
inside the vision-language ``Step3p7Config``) writes the same model in its own form,
also read here: the config as its ``save_pretrained`` writes it (``text_config`` of a
``step3p7`` config, ``mtp_layer_types`` / ``mtp_mlp_layer_types``, ``rope_parameters``
per layer type, ``num_sliding_attention_heads``, ``mtp_per_layer_config``: ``_tf_blocks``)
and the MTP norm under the name its MTP loader reads, ``shared_head.norm.weight`` (without
the release's ``transformer.``). Its MTP generation (``generate(use_mtp=True)``) chains the
normed hidden and drafts with the target's LM head: ``chain="postnorm"`` and no
per-module head (docs/hf_reference.md).
"""

from __future__ import annotations

from typing import Any

from ..config_fields import bool_field, float_field, int_field, opt, show, window_field
from ..errors import ConfigError
from .base import Family

#: the per-layer fields read at the MTP layers' indices (and the fields they replace)
_LISTS = ("layer_types", "rope_theta", "partial_rotary_factors", "swiglu_limits", "swiglu_limits_shared")
_TYPES = ("full_attention", "sliding_attention")


def _at(d: dict, name: str, i: int, n: int) -> Any:
    v = d[name]
    if not isinstance(v, list) or len(v) != n:
        got = f"{len(v)} entries" if isinstance(v, list) else show(v)
        raise ConfigError(f"config.json: field {name!r} expected a list of {n} entries (num_hidden_layers + "
                          f"num_nextn_predict_layers, one per layer), got {got}")
    return v[i]


def _limit(name: str, v: Any) -> float:
    """A SwiGLU clamp entry: a number >= 0, or null (0 and null: no clamp)."""
    return 0.0 if v is None else float_field(name, v, 0.0, 1e6)


def _moe_layers(d: dict) -> set[int] | None:
    """``moe_layers_enum``: "1,2,..." (the release) or a list of layer indices."""
    v = d.get("moe_layers_enum")
    if v is None:
        return None
    if isinstance(v, str):
        parts = [x.strip() for x in v.split(",") if x.strip() != ""]
        if not all(x.isdigit() and x.isascii() for x in parts):
            raise ConfigError(f"config.json: field 'moe_layers_enum' expected layer indices ('3,4,...'), "
                              f"got {show(v)}")
        return {int(x) for x in parts}
    if not isinstance(v, list):
        raise ConfigError(f"config.json: field 'moe_layers_enum' expected layer indices ('3,4,...' or a list), "
                          f"got {show(v)}")
    return {int_field(f"moe_layers_enum[{j}]", x, 0) for j, x in enumerate(v)}


def _counts(d: dict) -> tuple[int, int]:
    L, M = d.get("num_hidden_layers"), d.get("num_nextn_predict_layers", d.get("num_mtp_layers"))
    if not isinstance(L, int) or not isinstance(M, int) or isinstance(L, bool) or isinstance(M, bool) \
            or not 0 <= L <= 4096 or not 1 <= M <= 64:
        raise ConfigError(f"config.json: num_hidden_layers and num_nextn_predict_layers must be ints (in [0, 4096] "
                          f"and [1, 64]) to read the per-layer lists, got {L!r} and {M!r}")
    return L, M


def normalise(d: dict) -> dict:
    """The per-layer lists -> the default block (module 0's) and per-module overrides
    (``mtp_blocks``), from either form of the config:

    - the release's (``layer_types`` etc. of ``num_hidden_layers + M`` entries, read at
      ``num_hidden_layers + m``): ``_release_blocks``;
    - transformers' (``Step3p7TextConfig`` as ``save_pretrained`` writes it: the MTP
      layers split off into ``mtp_layer_types`` / ``mtp_mlp_layer_types``): ``_tf_blocks``.

    A config already in mtpkern's fields (no ``layer_types``: ``MtpConfig.to_dict``) is
    returned as it is."""
    tf = "mtp_layer_types" in d or "mtp_mlp_layer_types" in d
    if not tf and not isinstance(d.get("layer_types"), list):
        return d
    if d.get("use_rope_layers"):
        raise ConfigError(f"config.json: field 'use_rope_layers' = {str(d['use_rope_layers'])[:60]} is not supported "
                          f"yet (layers without RoPE); expected it absent or []")
    L, M = _counts(d)
    blocks = _tf_blocks(d, L, M) if tf else _release_blocks(d, L, M)
    drop = _LISTS + _TF_FIELDS + ("attention_other_setting", "use_head_wise_attn_gate", "num_attention_groups",
                                  "num_key_value_heads", "rope_scaling", "sliding_window")
    out = {k: v for k, v in d.items() if k not in drop}
    base = blocks[0]                          # the default block: module 0's; the others differ from it
    out.update({k: v for k, v in base.items() if k != "moe"})
    out["num_attention_groups"] = base["num_key_value_heads"]
    out["mtp_blocks"] = [dict({k: v for k, v in b.items() if k != "moe" and v != base[k]}, moe=b["moe"])
                         for b in blocks]
    return out


def _release_blocks(d: dict, L: int, M: int) -> list[dict]:
    """The release's form: every per-layer list read at ``num_hidden_layers + m``."""
    n = L + M
    for name in _LISTS:                     # every per-layer list: one entry per layer, MTP layers included
        if d.get(name) is not None and (name != "rope_theta" or isinstance(d[name], list)):
            _at(d, name, 0, n)
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
        theta = (float_field(f"rope_theta[{i}]", _at(d, "rope_theta", i, n)) if isinstance(d.get("rope_theta"), list)
                 else d.get("rope_theta", 10000.0))
        prf = (float_field(f"partial_rotary_factors[{i}]", _at(d, "partial_rotary_factors", i, n))
               if d.get("partial_rotary_factors") is not None else d.get("partial_rotary_factor", 1.0))
        limits = [_limit(f"{f}[{i}]", _at(d, f, i, n)) if d.get(f) is not None else 0.0
                  for f in ("swiglu_limits", "swiglu_limits_shared")]
        blocks.append({
            "num_attention_heads": own.get("num_attention_heads", d.get("num_attention_heads")),
            "num_key_value_heads": own.get("num_attention_groups", d.get("num_attention_groups",
                                                                          d.get("num_key_value_heads"))),
            "head_dim": own.get("head_dim", d.get("head_dim")),
            "rope_theta": theta, "partial_rotary_factor": prf,
            "sliding_window": window_field("sliding_window", d.get("sliding_window"),
                                           f"layer_types[{i}] (MTP module {m}) is sliding_attention")
            if kind == "sliding_attention" else 0,
            "attn_gate": "headwise" if opt(d, "use_head_wise_attn_gate", bool_field, False) else "",
            "swiglu_clamp": float(limits[0]), "swiglu_clamp_shared": float(limits[1]),
            "moe": moe is not None and i in moe,
        })
    return blocks


#: transformers' fields of a Step3p7TextConfig that the TF form reads or leaves to the target
_TF_FIELDS = ("mtp_layer_types", "mlp_layer_types", "mtp_mlp_layer_types", "rope_parameters",
              "num_sliding_attention_heads", "per_layer_config", "mtp_per_layer_config")
#: what an mtp_per_layer_config entry may override (transformers' MTP-only per-layer hook)
_TF_OVERRIDES = ("num_attention_heads", "num_key_value_heads")
_MLP_TYPES = ("dense", "sparse")


def _list_of(d: dict, name: str, n: int, what: str) -> list:
    v = d.get(name)
    if not isinstance(v, list) or len(v) != n:
        got = f"{len(v)} entries" if isinstance(v, list) else repr(v)[:60]
        raise ConfigError(f"config.json: field {name!r} expected a list of {n} entries ({what}), got {got}")
    return v


def _tf_overrides(d: dict, M: int) -> dict[int, dict]:
    """``mtp_per_layer_config`` (MTP index -> overrides; JSON keys are strings, zero-padded)."""
    v = d.get("mtp_per_layer_config")
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise ConfigError(f"config.json: field 'mtp_per_layer_config' expected an object, got {str(v)[:60]}")
    out = {}
    for k, over in v.items():
        try:
            m = int(k)
        except (TypeError, ValueError):
            m = -1
        if not 0 <= m < M or not isinstance(over, dict):
            raise ConfigError(f"config.json: mtp_per_layer_config[{k!r}] expected an MTP layer index in [0, {M}) "
                              f"with an object of overrides, got {str(over)[:60]}")
        extra = sorted(set(over) - set(_TF_OVERRIDES))
        if extra:
            raise ConfigError(f"config.json: mtp_per_layer_config[{k!r}] overrides {extra}: not supported; "
                              f"expected only {list(_TF_OVERRIDES)}")
        out[m] = over
    return out


def _tf_rope(d: dict, kind: str, m: int) -> tuple[float, float]:
    """(theta, partial factor) of MTP module ``m``'s layer type from ``rope_parameters``:
    one object per layer type (what Step3p7TextConfig writes), or one for every layer."""
    rp = d.get("rope_parameters")
    if rp is None:
        return (opt(d, "rope_theta", float_field, 10000.0), opt(d, "partial_rotary_factor", float_field, 1.0))
    if not isinstance(rp, dict):
        raise ConfigError(f"config.json: field 'rope_parameters' expected an object, got {str(rp)[:60]}")
    if any(isinstance(v, dict) for v in rp.values()):
        if not isinstance(rp.get(kind), dict):
            raise ConfigError(f"config.json: rope_parameters has no object for {kind!r}, the layer type of MTP "
                              f"module {m} (mtp_layer_types[{m}]); it has {sorted(rp)}")
        rp, where = rp[kind], f"rope_parameters.{kind}"
    else:
        where = "rope_parameters"
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if rope_type not in ("default", None):
        raise ConfigError(f"config.json: MTP module {m} is {kind} with a scaled RoPE ({where}.rope_type "
                          f"{rope_type!r}): not supported yet; the released modules are sliding-window layers "
                          f"with a plain RoPE")
    extra = sorted(set(rp) - {"rope_type", "type", "rope_theta", "partial_rotary_factor"})
    if extra:
        raise ConfigError(f"config.json: {where} has {extra}: not read by the default RoPE; expected only "
                          f"rope_type, rope_theta, partial_rotary_factor")
    return (opt(rp, "rope_theta", lambda n, v: float_field(f"{where}.{n}", v), 10000.0),
            opt(rp, "partial_rotary_factor", lambda n, v: float_field(f"{where}.{n}", v), 1.0))


def _tf_blocks(d: dict, L: int, M: int) -> list[dict]:
    """transformers' form (Step3p7TextConfig, 5.16+), read as transformers builds the MTP
    layers (``PreTrainedConfig.get_mtp_config``; ``Step3p7DecoderLayer`` with the MTP
    config and the MTP index ``m``):

    - ``mtp_layer_types[m]`` / ``mtp_mlp_layer_types[m]``: attention type and dense or MoE;
    - RoPE: ``rope_parameters`` of that layer type; the window ``sliding_window``;
    - heads: ``mtp_per_layer_config[m]`` when given (the MTP layers' only per-layer hook),
      else a sliding layer's ``num_sliding_attention_heads``, as in the release.
      transformers 5.24 builds the MTP layers with the global ``num_attention_heads``
      without that hook (``get_mtp_config`` drops ``per_layer_config``), so it cannot load
      a checkpoint whose sliding MTP layers have more heads; mtpkern reads the heads the
      tensors hold, and a checkpoint with the global count is refused by its shapes;
    - SwiGLU clamps: entry ``m`` of ``swiglu_limits`` / ``swiglu_limits_shared``, which
      hold only the target's layers here: transformers reads the MTP layer at its MTP
      index (a main layer's entry; 0 in Step-3.5/3.7, as the release's MTP entries are);
    - the head-wise gate always (``Step3p7TextConfig.gating`` is a class attribute);
      ``num_key_value_heads`` and ``head_dim`` are global."""
    kinds = _list_of(d, "mtp_layer_types", M, "one per MTP layer: transformers' form")
    if isinstance(d.get("layer_types"), list) and len(d["layer_types"]) != L:
        raise ConfigError(f"config.json: field 'layer_types' expected {L} entries (num_hidden_layers) beside "
                          f"mtp_layer_types, got {len(d['layer_types'])}")
    mlps = _list_of(d, "mtp_mlp_layer_types", M, "one per MTP layer: transformers' form")
    over = _tf_overrides(d, M)
    Hq, Hkv = d.get("num_attention_heads"), d.get("num_key_value_heads", d.get("num_attention_groups"))
    sliding_heads = d.get("num_sliding_attention_heads")
    blocks = []
    for m in range(M):
        kind, mlp = kinds[m], mlps[m]
        if kind not in _TYPES:
            raise ConfigError(f"config.json: mtp_layer_types[{m}] expected one of {_TYPES}, got {kind!r}")
        if mlp not in _MLP_TYPES:
            raise ConfigError(f"config.json: mtp_mlp_layer_types[{m}] expected one of {_MLP_TYPES}, got {mlp!r}")
        theta, prf = _tf_rope(d, kind, m)
        limits = []
        for f in ("swiglu_limits", "swiglu_limits_shared"):
            v = d.get(f)
            if v is not None and (not isinstance(v, list) or len(v) != L or L < M):
                got = f"{len(v)} entries" if isinstance(v, list) else show(v)
                raise ConfigError(f"config.json: field {f!r} expected a list of {L} entries (num_hidden_layers: "
                                  f"transformers' form trims the per-layer lists to the target's layers) and at "
                                  f"least {M} (transformers reads MTP layer m's clamp at entry m), got {got}")
            limits.append(_limit(f"{f}[{m}]", v[m]) if v else 0.0)
        heads = sliding_heads if kind == "sliding_attention" and sliding_heads is not None else Hq
        blocks.append({
            "num_attention_heads": over.get(m, {}).get("num_attention_heads", heads),
            "num_key_value_heads": over.get(m, {}).get("num_key_value_heads", Hkv),
            "head_dim": d.get("head_dim"),
            "rope_theta": theta, "partial_rotary_factor": prf,
            "sliding_window": window_field("sliding_window", d.get("sliding_window"),
                                           f"mtp_layer_types[{m}] is sliding_attention")
            if kind == "sliding_attention" else 0,
            "attn_gate": "headwise",
            "swiglu_clamp": float(limits[0]), "swiglu_clamp_shared": float(limits[1]),
            "moe": mlp == "sparse",
        })
    return blocks


FAMILY = Family(
    model_type="step3p5",
    architectures=("Step3p5ForCausalLM",),
    title="Step-3.5-Flash",
    defaults={"use_qk_norm": True, "n_shared_experts": 1, "norm_topk_prob": True},
    aliases={"num_attention_groups": "num_key_value_heads", "moe_num_experts": "n_routed_experts",
             "moe_top_k": "num_experts_per_tok", "moe_router_scaling_factor": "routed_scaling_factor",
             "moe_router_activation": "scoring_func", "norm_expert_weight": "norm_topk_prob",
             "use_moe_router_bias": "router_bias"},
    fixed={"zero_centered": True, "att_impl_type": "GQA", "sink": False},
    implements=frozenset(_LISTS + _TF_FIELDS + ("attention_other_setting", "use_head_wise_attn_gate",
                                                 "sliding_window")),
    target_only=frozenset({"moe_layers_enum", "use_moe", "moe_every_n_layer", "moe_layer_offset", "need_fp32_gate",
                           "yarn_only_types", "max_seq_len", "use_rope_layers"}),
    renames={"shared_head.norm.weight": "transformer.shared_head.norm.weight",
             "shared_head.head.weight": "transformer.shared_head.output.weight",
             # an MoE MTP layer (moe_layers_enum / mtp_mlp_layer_types "sparse") has the trunk's names:
             # the router, its selection bias, the routed experts packed [E, I, H] / [E, H, I]
             "mlp.gate.weight": "moe.gate.weight", "mlp.gate.e_score_correction_bias": "moe.router_bias",
             "mlp.experts.": "moe.", "mlp.shared_experts.": "share_expert."},
    packed_experts=True,
    # the name transformers' MtpModel loads as the layer's post_norm (conversion_mapping.py:
    # ".shared_head.norm." -> ".post_norm."; it does not strip the release's "transformer.")
    alternatives={"shared_head.norm.weight": ("shared_head.norm.weight",)},
    wrappers={"step3p7": ("Step3p7ForConditionalGeneration",)},
    zero_centred=True,
    normalise=normalise,
)
