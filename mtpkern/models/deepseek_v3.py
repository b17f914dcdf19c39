"""DeepSeek-V3 / V3.1 / R1 (``deepseek_v3``): MLA attention and a MoE block per MTP module.

References: transformers 5.24 (``deepseek_v3`` with the generic MTP layer of
``modeling_layers.py``: ``generate(use_mtp=True)``) and vLLM ``deepseek_mtp.py`` /
``deepseek_v2.py``, which agree on what mtpkern computes:

- modules at ``model.layers.{num_hidden_layers + m}.`` (the release: one, layer 61) with the
  canonical names; the attention is MLA (``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj``, or
  ``q_proj`` without ``q_lora_rank``; ``kv_a_proj_with_mqa`` / ``kv_a_layernorm`` /
  ``kv_b_proj``; ``o_proj``: mtpkern.ops.mla), the block MoE with sigmoid routing, the
  grouped top-k with ``e_score_correction_bias``, a shared expert;
- RoPE over the ``qk_rope_head_dim`` dims in GPT-J pairs (``rope_interleave``, true by
  default; vLLM always), YaRN from ``rope_scaling`` with DeepSeek's softmax correction
  ``mscale(factor, mscale_all_dim) ** 2``;
- the module hands on its normed output (``shared_head.norm(y)``, which the LM head reads):
  both references recycle the post-norm hidden, so ``postnorm`` is the default chain;
- the embedding and LM head are the target's (the release's per-module copies are equal).

Where the references differ, mtpkern follows vLLM: ``q_a_layernorm`` / ``kv_a_layernorm``
use ``rms_norm_eps`` (transformers: always 1e-6; equal for the releases, 1e-6). vLLM zeroes
the embedding of the token at position 0 (a module's first row of a sequence); neither
transformers nor mtpkern do (docs/families.md).
"""

from .base import Family

FAMILY = Family(
    model_type="deepseek_v3",
    architectures=("DeepseekV3ForCausalLM",),
    title="DeepSeek-V3 / V3.1 / R1",
    defaults={"rope_interleave": True, "rms_norm_eps": 1e-6, "num_nextn_predict_layers": 1},
    target_only=frozenset({"moe_layer_freq", "ep_size"}),
    chain="postnorm",
)
