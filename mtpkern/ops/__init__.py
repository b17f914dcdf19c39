"""Kernel families: one module each, holding the backend-neutral signature,
the argument checks every backend shares, and the NumPy reference (the
specification; clarity before speed).

=============  ==========================================================
module         ops
=============  ==========================================================
``norm``       ``rmsnorm``, ``mtp_input`` (embedding + enorm/hnorm + eh_proj)
``linear``     ``linear`` (x @ W.T + bias + residual)
``rope_kv``    ``qk_norm_rope_kv_write`` (per-head q/k norm, partial neox RoPE, paged KV write)
``attention``  ``paged_attention`` (GQA over paged KV, causal rows of many sequences; sliding
               window, attention sinks, a value head dim of its own)
``mla``        ``mla_latent_write``, ``mla_attention_absorbed`` (MLA over a paged latent cache;
               ``mla_attention_naive`` and ``split_kv_b_proj``: reference; not yet in the head)
``gate``       ``sigmoid_gate`` (output gates: head-wise, element-wise, one per row; + residual)
``moe``        ``moe_router``, ``moe_experts``
``mlp``        ``swiglu_mlp``
``lm_head``    ``lm_head_logits``, ``masked_argmax``, ``lm_head_argmax``
=============  ==========================================================
"""
