"""GLM-5.3 (``glm5_next``, text model ``glm5_next_text``): an MLA MTP layer without RoPE and
with GLM-5.3's pooled DSA indexer, under the vision-language wrapper's text tower.

Reference: vLLM's GLM-5.3 MTP model (``glm5next/.../mtp.py`` around its decoder layer);
transformers 5.24 ``glm5_next`` holds the main model (the indexer, the attention, the MoE)
and skips the MTP layer's tensors. The MTP layer:

- sits at ``model.language_model.layers.{num_hidden_layers}.`` (45 in GLM-5.3-Flash), with
  DeepSeek-V3's names (``enorm`` / ``hnorm`` / ``eh_proj`` over ``[embed, hidden]``,
  ``shared_head.norm``); the config's text fields are under ``text_config``;
- is an MLA layer (``q_lora_rank`` 1536, ``kv_lora_rank`` 512, ``qk_nope_head_dim`` 256,
  ``v_head_dim`` 256) with no rotary dims (``qk_rope_head_dim`` 0, NoPE) and the pooled
  indexer (``self_attn.indexer.*`` with ``index_kpool_compress_gate`` / ``_ape``: pools of
  ``index_kpool`` 16 rows, the ``index_topk / 16`` best, then the incomplete pool's tail:
  mtpkern.ops.dsa, "Pools");
- has no hyper-connections (the trunk's ``hc_*`` fields are the target's: vLLM builds the
  MTP layer on the plain pre-norm residual path and hands it the target's collapsed, normed
  hidden); its MoE is DeepSeek-V3's with one group, SwiGLU clamped as
  ``silu(min(g, L)) * clip(u, -L, L)`` (``swiglu_limit``);
- recycles its post-norm hidden (``postnorm``) and zeroes the embedding of the first row
  (vLLM's position-0 mask, ``embed_mask_pos0``).

The trunk's fields (linear attention, ``layer_types``, ``mlp_layer_types``, the indexers'
sharing pattern, the hyper-connections) are accepted and not read.
"""

from __future__ import annotations

from .base import Family
from .glm_moe_dsa import DSA_FIELDS, DSA_TARGET_FIELDS

#: the trunk's fields (its KDA linear attention, its hyper-connections, its layer patterns)
_TARGET = frozenset({"linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim", "linear_lower_bound",
                     "linear_attn_config", "hc_mult", "hc_eps", "hc_sinkhorn_iters", "layer_types",
                     "mlp_layer_types", "router_aux_loss_coef", "mhc_tau", "mhc_post_mult_value",
                     "mhc_sinkhorn_iterations"})


def normalise(d: dict) -> dict:
    """The release's text config -> mtpkern's fields: ``swiglu_limit`` both clamps of the gate,
    the trunk's fields dropped (hyper-connections included: the MTP layer has none)."""
    out = {k: v for k, v in d.items() if k not in _TARGET}
    limit = out.pop("swiglu_limit", None)
    if limit:
        out["swiglu_clamp"] = out["swiglu_clamp_shared"] = limit
        out["swiglu_clamp_gate"] = True
    return out


FAMILY = Family(
    model_type="glm5_next_text",
    architectures=("Glm5NextForCausalLM",),
    title="GLM-5.3",
    defaults={"rms_norm_eps": 1e-5, "num_nextn_predict_layers": 1, "n_group": 1, "topk_group": 1,
              "qk_rope_head_dim": 0, "index_topk": 2048, "index_n_heads": 32, "index_head_dim": 128,
              "index_kpool": 16, "index_kpool_always_select_tail": True, "embed_mask_pos0": True},
    aliases={"num_experts_per_token": "num_experts_per_tok"},
    implements=DSA_FIELDS | {"swiglu_limit", "index_kpool", "index_kpool_always_select_tail"},
    target_only=_TARGET | DSA_TARGET_FIELDS | frozenset({"moe_layer_freq", "ep_size"}),
    prefix="model.language_model.layers.{layer}.",
    wrappers={"glm5_next": ("Glm5NextForConditionalGeneration",)},
    target_embed="model.language_model.embed_tokens.weight",
    target_norm="model.language_model.norm.weight",
    chain="postnorm",
    normalise=normalise,
)
