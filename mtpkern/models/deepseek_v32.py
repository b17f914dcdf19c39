"""DeepSeek-V3.2 (``deepseek_v32``): DeepSeek-V3's MTP layer with a DSA indexer beside it.

As GLM-5 (mtpkern/models/glm_moe_dsa.py, whose DSA decision this family shares): the
indexer (``self_attn.indexer.*``, 64 heads) is not run; the MTP layer attends densely,
exactly the sparse attention while a sequence holds at most ``index_topk`` keys. The rest
is DeepSeek-V3's (mtpkern/models/deepseek_v3.py).
"""

from .base import Family
from .glm_moe_dsa import DSA, DSA_FIELDS

FAMILY = Family(
    model_type="deepseek_v32",
    architectures=("DeepseekV32ForCausalLM",),
    title="DeepSeek-V3.2",
    defaults={"rope_interleave": True, "rms_norm_eps": 1e-6, "num_nextn_predict_layers": 1},
    implements=DSA_FIELDS,
    target_only=frozenset({"moe_layer_freq", "ep_size", "layer_types"}),
    ignored=(DSA,),
    chain="postnorm",
)
