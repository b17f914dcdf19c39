"""GLM-5 (``glm_moe_dsa``): DeepSeek-V3's MTP layer (MLA, MoE) with its own DSA indexer.

References: vLLM (``deepseek_mtp`` / ``DeepseekV32MTP`` for ``glm_moe_dsa``: it serves the
MTP layer as sparse MLA with the layer's own indexer) and transformers 5.24 ``glm_moe_dsa``
(the model's indexer and attention; it has no MTP drafting). The MTP layer sits at
``model.layers.{num_hidden_layers}.`` (78 in the release) with DeepSeek-V3's names; MLA with
``q_lora_rank`` always set, RoPE in GPT-J pairs always (no ``rope_interleave`` field), the
post-norm hidden recycled (``postnorm``), MoE routing as DeepSeek-V3 (one group), the
embedding of the first row zeroed (``embed_mask_pos0``, below).

**DSA**: the layer's indexer (``self_attn.indexer.wq_b`` / ``wk`` / ``k_norm`` (a LayerNorm
with a bias) / ``weights_proj``) scores every key a row may see and the attention reads the
``index_topk`` best (mtpkern.ops.dsa; docs/families.md, "DSA"). Its RoPE pairs follow
``indexer_rope_interleave``, true by default here (transformers' GLM-5 indexer rotates
pairs; vLLM reads the field, and GLM-5.x configs write it). The fields that pattern the
trunk's indexers (``indexer_types``, ``index_topk_pattern``, ``index_topk_freq``,
``index_skip_topk_offset``: which target layers run an indexer and which reuse the one
before) say nothing of the MTP layer, which always runs its own; they are accepted and not
read, as is ``index_share_for_mtp_iteration`` (docs/families.md says why).

vLLM is the reference (transformers cannot draft with this layer), so mtpkern follows it:
``rms_norm_eps`` (1e-5) for ``q_a_layernorm`` / ``kv_a_layernorm`` (transformers' model uses
1e-6 there); the position-0 mask on by default (``embed_mask_pos0``: ``deepseek_mtp.py``
zeroes the token embedding of the row at its position 0, mtpkern's ``(t_1, h_0)`` at RoPE
position 1, docs/model.md; a config may say ``false``); and the ``postnorm`` chain, which
vLLM's ``deepseek_mtp.py`` recycles since mid-2026 (vLLM PR 45895; earlier releases handed on
the pre-norm ``y``, which ``chain="prenorm"`` reproduces).
"""

from .base import Family

#: the indexer's config fields that mtpkern reads (the DSA block feature, mtpkern/block.py)
DSA_FIELDS = frozenset({"index_topk", "index_n_heads", "index_head_dim", "indexer_rope_interleave"})
#: the fields that pattern the target's indexers, and the engines' sharing switch: not read
DSA_TARGET_FIELDS = frozenset({"indexer_types", "index_topk_pattern", "index_topk_freq", "index_skip_topk_offset",
                               "index_share_for_mtp_iteration"})

FAMILY = Family(
    model_type="glm_moe_dsa",
    architectures=("GlmMoeDsaForCausalLM",),
    title="GLM-5",
    defaults={"rms_norm_eps": 1e-5, "num_nextn_predict_layers": 1, "n_group": 1, "topk_group": 1,
              "indexer_rope_interleave": True, "embed_mask_pos0": True},
    fixed={"rope_interleave": True},
    implements=DSA_FIELDS,
    target_only=frozenset({"mlp_layer_types", "layer_types", "moe_layer_freq", "ep_size"}) | DSA_TARGET_FIELDS,
    chain="postnorm",
)
