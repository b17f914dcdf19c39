"""DeepSeek-V3.2 (``deepseek_v32``): DeepSeek-V3's MTP layer with its own DSA indexer.

As GLM-5 (mtpkern/models/glm_moe_dsa.py, whose DSA fields this family shares): the MTP
layer runs its own lightning indexer (``self_attn.indexer.*``, 64 heads of 128) and its MLA
attention reads each row's ``index_topk`` best keys (mtpkern.ops.dsa). The indexer's RoPE
rotates halves (``indexer_rope_interleave`` false by default: transformers' DeepSeek-V3.2
indexer and vLLM's default), while the MLA's rotates pairs. The rest is DeepSeek-V3's
(mtpkern/models/deepseek_v3.py).
"""

from .base import Family
from .glm_moe_dsa import DSA_FIELDS, DSA_TARGET_FIELDS

FAMILY = Family(
    model_type="deepseek_v32",
    architectures=("DeepseekV32ForCausalLM",),
    title="DeepSeek-V3.2",
    defaults={"rope_interleave": True, "rms_norm_eps": 1e-6, "num_nextn_predict_layers": 1,
              "indexer_rope_interleave": False},
    implements=DSA_FIELDS,
    target_only=frozenset({"moe_layer_freq", "ep_size", "layer_types"}) | DSA_TARGET_FIELDS,
    chain="postnorm",
)
