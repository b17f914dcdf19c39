"""GLM-4.7-Flash (``glm4_moe_lite``): DeepSeek-V3's MTP layer (MLA, MoE) at GLM's sizes.

References: transformers 5.24 ``glm4_moe_lite`` (the model; no MTP drafting) and vLLM
``glm4_moe_lite_mtp.py``: the MTP layer at ``model.layers.{num_hidden_layers}.`` (47) with
DeepSeek-V3's names, ``rope_interleave`` (true by default), one routing group. vLLM's MTP
layer hands on its pre-norm output (the ``prenorm`` chain, this family's default; SGLang
recycles the post-norm one: pass ``chain="postnorm"`` to draft as SGLang does), uses
``rms_norm_eps`` for ``q_a_layernorm`` / ``kv_a_layernorm`` (transformers: 1e-6), and zeroes
the token embedding of the row at its position 0 ("not needed by MTP"). vLLM is the
reference (transformers cannot draft with this layer), so ``embed_mask_pos0`` is on by
default here (mtpkern's row ``(t_1, h_0)`` at RoPE position 1, docs/model.md; a config may
say ``false``).
"""

from .base import Family

FAMILY = Family(
    model_type="glm4_moe_lite",
    architectures=("Glm4MoeLiteForCausalLM",),
    title="GLM-4.7-Flash",
    defaults={"rope_interleave": True, "rms_norm_eps": 1e-5, "num_nextn_predict_layers": 1, "n_group": 1,
              "topk_group": 1, "embed_mask_pos0": True},
    target_only=frozenset({"mlp_layer_types", "moe_layer_freq", "ep_size"}),
)
