"""Qwen3-Next (``qwen3_next``): one MTP module, a full-attention layer with gated output.

Differs from the canonical layout (references: transformers ``qwen3_next``, vLLM
``qwen3_next_mtp.py``):

- tensors under ``mtp.``: ``fc`` is ``eh_proj`` (input ``[embed, hidden]``),
  ``pre_fc_norm_embedding`` / ``pre_fc_norm_hidden`` are ``enorm`` / ``hnorm``,
  ``norm`` the norm before the LM head; the block under ``mtp.layers.{m}.``, its shared
  expert under ``mlp.shared_expert.`` (singular) with ``mlp.shared_expert_gate``;
- every RMSNorm is zero-centred (``1 + w``; the target's final norm too): folded;
- ``q_proj`` yields, per head, the query then a gate of the same width; the attention
  output is multiplied by ``sigmoid(gate)`` element-wise before ``o_proj`` (de-interleaved
  at load: the gate rows go after q|k|v in the fused projection);
- q/k RMSNorm per head; softmax routing over all experts (no groups, no correction
  bias, no scaling), ``norm_topk_prob``; one shared expert whose output is scaled by
  ``sigmoid(x . shared_expert_gate)``;
- no ``num_nextn_predict_layers`` in the config: one module;
- the module hands on its normed output (``norm(y)``, what the LM head reads): the
  ``postnorm`` chain is this family's default.

The target's linear-attention layers are described by fields the MTP layer does not
read (``linear_*``, ``full_attention_interval``, ``layer_types``): accepted, not read.
"""

from .base import Family

#: the full-attention layer's features (shared with Qwen3.5: mtpkern/models/qwen3_5.py)
ATTENTION_FIXED = {"use_qk_norm": True, "attn_gate": "elementwise"}
#: the sparse MoE block's: softmax over every expert, one shared expert behind a sigmoid gate
MOE_FIXED = {"n_shared_experts": 1, "scoring_func": "softmax", "n_group": 1, "topk_group": 1,
             "routed_scaling_factor": 1.0, "shared_expert_gate": True, "router_bias": False}
#: the target's linear-attention and layer-pattern fields: accepted, not read
TARGET_ONLY = frozenset({"linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                         "linear_value_head_dim", "linear_conv_kernel_dim", "full_attention_interval",
                         "layer_types", "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef",
                         "output_router_logits"})
#: canonical suffix -> the name under ``mtp.``: one fc / pre_fc norms / final norm for every layer
RENAMES = {"enorm.weight": "pre_fc_norm_embedding.weight", "hnorm.weight": "pre_fc_norm_hidden.weight",
           "eh_proj.weight": "fc.weight", "shared_head.norm.weight": "norm.weight",
           "input_layernorm.": "layers.{m}.input_layernorm.",
           "post_attention_layernorm.": "layers.{m}.post_attention_layernorm.",
           "self_attn.": "layers.{m}.self_attn.", "mlp.shared_experts.": "layers.{m}.mlp.shared_expert.",
           "mlp.": "layers.{m}.mlp."}

FAMILY = Family(
    model_type="qwen3_next",
    architectures=("Qwen3NextForCausalLM",),
    title="Qwen3-Next",
    defaults={"num_nextn_predict_layers": 1, "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-6,
              "norm_topk_prob": True},
    aliases={"num_experts": "n_routed_experts"},
    fixed={**ATTENTION_FIXED, **MOE_FIXED},
    target_only=TARGET_ONLY,
    prefix="mtp.",
    renames=RENAMES,
    zero_centred=True,
    q_gate_interleaved=True,
    chain="postnorm",
)
