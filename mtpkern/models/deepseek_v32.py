"""DeepSeek-V3.2 (``deepseek_v32``): DeepSeek-V3's MTP layer with its own DSA indexer.

As GLM-5 (mtpkern/models/glm_moe_dsa.py, whose DSA fields this family shares): the MTP
layer runs its own lightning indexer (``self_attn.indexer.*``, 64 heads of 128) and its MLA
attention reads each row's ``index_topk`` best keys (mtpkern.ops.dsa). The indexer's RoPE
rotates halves (``indexer_rope_interleave`` false by default: transformers' DeepSeek-V3.2
indexer and vLLM's default), while the MLA's rotates pairs. The rest is DeepSeek-V3's
(mtpkern/models/deepseek_v3.py), but for the reference and the position-0 mask.

The reference is vLLM (``deepseek_mtp.py``, which serves the layer for V3.2 as sparse MLA with
the layer's own indexer): transformers 5.24's ``deepseek_v32`` holds the model's indexer and
attention but has no MTP drafting. So, unlike ``deepseek_v3``:

- the position-0 mask is on by default (``embed_mask_pos0``: vLLM's MTP layer zeroes the
  token embedding of the row at its position 0, "not needed by MTP"; mtpkern's row
  ``(t_1, h_0)`` at RoPE position 1, docs/model.md); a config may say ``false``;
- the chain stays ``postnorm``: vLLM's ``deepseek_mtp.py`` recycles the post-final-norm hidden
  (``shared_head.norm(y)``) since mid-2026 (vLLM PR 45895; SGLang's ``deepseek_nextn`` too);
  earlier vLLM releases returned the pre-norm ``y`` (``chain="prenorm"`` drafts as they do).
"""

from .base import Family
from .glm_moe_dsa import DSA_FIELDS, DSA_TARGET_FIELDS

FAMILY = Family(
    model_type="deepseek_v32",
    architectures=("DeepseekV32ForCausalLM",),
    title="DeepSeek-V3.2",
    defaults={"rope_interleave": True, "rms_norm_eps": 1e-6, "num_nextn_predict_layers": 1,
              "indexer_rope_interleave": False, "embed_mask_pos0": True},
    implements=DSA_FIELDS,
    target_only=frozenset({"moe_layer_freq", "ep_size", "layer_types"}) | DSA_TARGET_FIELDS,
    chain="postnorm",
)
