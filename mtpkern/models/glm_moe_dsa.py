"""GLM-5 (``glm_moe_dsa``): DeepSeek-V3's MTP layer (MLA, MoE) with a DSA indexer beside it.

References: transformers 5.24 ``glm_moe_dsa`` (the model; it has no MTP drafting) and vLLM
(``deepseek_mtp`` / ``DeepseekV32MTP`` for ``glm_moe_dsa``): the MTP layer at
``model.layers.{num_hidden_layers}.`` (78 in the release) with DeepSeek-V3's names; MLA with
``q_lora_rank`` always set, RoPE in GPT-J pairs always (no ``rope_interleave`` field), the
post-norm hidden recycled (``postnorm``), MoE routing as DeepSeek-V3 (one group).

**DSA (the sparse-attention indexer) is not run**: the MTP layer attends densely to every
key it may see. Its tensors (``self_attn.indexer.wq_b`` / ``wk`` / ``k_norm`` /
``weights_proj``) are not read, and loading says so (``MtpWeights.notes``, ``mtpkern info``);
its config fields (``index_topk``, ``index_n_heads``, ``index_head_dim``, the indexer
pattern fields) are accepted and not read. The indexer picks, per query, the
``index_topk`` (2048) keys with the highest index scores among those it may see; while a
sequence holds at most ``index_topk`` keys it picks all of them, and the dense attention is
exactly the sparse one. Past that, mtpkern's module sees every key (a superset of the
picked ones) and its drafts may differ from vLLM's sparse MTP layer (docs/families.md, DSA).

vLLM uses ``rms_norm_eps`` (1e-5) for ``q_a_layernorm`` / ``kv_a_layernorm``; transformers'
model uses 1e-6 there. mtpkern follows vLLM, the reference that drafts with this layer.
"""

from .base import Family

#: the DSA indexer, not run (see the module docstring)
DSA = ("self_attn.indexer.", "the DSA indexer: dense attention instead, exact while a sequence holds "
                             "<= index_topk keys")
#: the indexer's config fields: accepted, not read
DSA_FIELDS = frozenset({"index_topk", "index_n_heads", "index_head_dim", "indexer_types", "index_topk_pattern",
                        "index_topk_freq", "index_skip_topk_offset", "indexer_rope_interleave",
                        "index_share_for_mtp_iteration"})

FAMILY = Family(
    model_type="glm_moe_dsa",
    architectures=("GlmMoeDsaForCausalLM",),
    title="GLM-5",
    defaults={"rms_norm_eps": 1e-5, "num_nextn_predict_layers": 1, "n_group": 1, "topk_group": 1},
    fixed={"rope_interleave": True},
    implements=DSA_FIELDS,
    target_only=frozenset({"mlp_layer_types", "layer_types", "moe_layer_freq", "ep_size"}),
    ignored=(DSA,),
    chain="postnorm",
)
