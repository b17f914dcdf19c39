"""LongCat-Flash (``longcat_flash``): one MTP layer of MLA attention and a dense MLP.

References: vLLM ``longcat_flash_mtp.py`` (and SGLang ``longcat_flash_nextn.py``, the same
names); transformers 5.24's ``longcat_flash`` has the model but no MTP drafting:

- the layer's tensors under ``model.mtp.``: ``layers.0.enorm.m`` / ``layers.0.hnorm.m``,
  ``layers.0.eh_proj`` (over ``[embed, hidden]``), ``layers.0.input_layernorm`` /
  ``post_attention_layernorm``, DeepSeek-V3's MLA tensors under ``layers.0.self_attn.``, a
  dense SwiGLU MLP under ``layers.0.transformer_layer.mlp.`` of ``ffn_hidden_size``, the
  norm before the LM head at ``model.mtp.norm``, an own embedding at
  ``model.mtp.embed_tokens`` (the target's LM head: no ``shared_head``);
- one MTP layer (vLLM hard-codes it); its MoE fields (``n_routed_experts``, ``moe_topk``,
  ``expert_ffn_hidden_size``, ``zero_expert_num`` ...) describe the target's layers;
- ``mla_scale_q_lora`` / ``mla_scale_kv_lora``: ``q_a_layernorm``'s output times
  ``sqrt(hidden_size / q_lora_rank)``, ``kv_a_layernorm``'s times
  ``sqrt(hidden_size / kv_lora_rank)`` (vLLM folds them into the norm weights at load,
  transformers multiplies at run time: the same), folded at load here too;
- RoPE in GPT-J pairs always, theta 1e7 by default; the post-norm hidden is handed on.
"""

from __future__ import annotations

import math

from ..config_fields import bool_field, int_field, opt
from ..errors import ConfigError
from .base import Family

#: the target's MoE (and layer-count) fields: the MTP layer is dense
_TARGET_MOE = ("n_routed_experts", "num_local_experts", "moe_topk", "num_experts_per_tok", "expert_ffn_hidden_size",
               "moe_intermediate_size", "zero_expert_num", "zero_expert_type", "router_bias", "n_group",
               "topk_group", "routed_scaling_factor", "norm_topk_prob", "scoring_func", "topk_method")


def normalise(d: dict) -> dict:
    """The release's config -> mtpkern's fields: one dense MLA module, the LoRA norm scales."""
    out = {k: v for k, v in d.items() if k not in _TARGET_MOE + ("mla_scale_q_lora", "mla_scale_kv_lora",
                                                                 "ffn_hidden_size", "num_layers")}
    M = opt(d, "num_nextn_predict_layers", int_field, 1)
    if M != 1:
        raise ConfigError(f"config.json: field 'num_nextn_predict_layers' = {M!r}: LongCat-Flash has one MTP layer "
                          f"(model.mtp.layers.0); expected 1")
    out["num_nextn_predict_layers"] = 1
    if d.get("num_hidden_layers") is None and d.get("num_layers") is not None:
        out["num_hidden_layers"] = 2 * int_field("num_layers", d["num_layers"], 0, 2048)   # transformers' count
    if d.get("ffn_hidden_size") is not None:
        ffn = int_field("ffn_hidden_size", d["ffn_hidden_size"])
        if d.get("intermediate_size") not in (None, ffn) or isinstance(d.get("intermediate_size"), bool):
            raise ConfigError(f"config.json: intermediate_size {d['intermediate_size']!r} disagrees with "
                              f"ffn_hidden_size {ffn!r} (the MTP layer's dense MLP)")
        out["intermediate_size"] = ffn
    H = d.get("hidden_size")
    for flag, rank, field in (("mla_scale_q_lora", "q_lora_rank", "q_a_norm_scale"),
                              ("mla_scale_kv_lora", "kv_lora_rank", "kv_a_norm_scale")):
        if opt(d, flag, bool_field, False):
            r = d.get(rank)
            if not (type(H) is int and type(r) is int and H > 0 and r > 0):
                raise ConfigError(f"config.json: {flag} needs hidden_size and {rank} integers > 0, got {H!r} and {r!r}")
            out[field] = math.sqrt(H / r)
    return out


FAMILY = Family(
    model_type="longcat_flash",
    architectures=("LongcatFlashForCausalLM",),
    title="LongCat-Flash",
    defaults={"rope_theta": 1e7, "rms_norm_eps": 1e-5},
    fixed={"rope_interleave": True},
    target_only=frozenset({"attention_method", "zero_expert_type", "disable_quant_module", "ep_size"}),
    normalise=normalise,
    prefix="model.mtp.",
    renames={"enorm.weight": "layers.{m}.enorm.m.weight", "hnorm.weight": "layers.{m}.hnorm.m.weight",
             "eh_proj.weight": "layers.{m}.eh_proj.weight",
             "input_layernorm.weight": "layers.{m}.input_layernorm.weight",
             "post_attention_layernorm.weight": "layers.{m}.post_attention_layernorm.weight",
             "self_attn.": "layers.{m}.self_attn.", "mlp.": "layers.{m}.transformer_layer.mlp.",
             "shared_head.norm.weight": "norm.weight", "embed_tokens.weight": "embed_tokens.weight",
             "shared_head.head.weight": "layers.{m}.shared_head.head.weight"},
    chain="postnorm",
)
