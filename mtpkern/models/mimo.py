"""MiMo-7B (``mimo``): one MTP module on a Qwen2 block.

Differs from the canonical layout in names and concat order only (the reference is
vLLM's ``mimo_mtp.py``; transformers has no MiMo MTP generation):

- modules at ``model.mtp_layers.{m}.``; ``token_layernorm`` / ``hidden_layernorm``
  are ``enorm`` / ``hnorm``, ``input_proj`` is ``eh_proj``, ``final_layernorm`` the
  norm before the LM head (``shared_head.norm``);
- ``input_proj`` reads ``[hidden, embed]``: its column halves are swapped at load;
- the block is Qwen2's: biased q/k/v, no q/k norm, whole-head RoPE, a dense SwiGLU
  MLP of ``intermediate_size``.

vLLM's MTP layer is the reference, and mtpkern's defaults follow it:

- it zeroes the token embedding of the row at its position 0 ("not needed by MTP"),
  ``(t_1, h_0)``: module 0's key 0, at mtpkern's RoPE position 1 (docs/model.md, "The
  position-0 mask"): ``embed_mask_pos0`` is on by default (a config may say ``false``);
- its forward returns ``final_layernorm(y)``, which the proposer hands on and the LM head
  reads: the ``postnorm`` chain.
"""

from .base import Family

FAMILY = Family(
    model_type="mimo",
    architectures=("MiMoForCausalLM",),
    title="MiMo-7B",
    fixed={"attention_bias": True},                       # Qwen2's q/k/v always carry biases
    target_only=frozenset({"max_window_layers"}),
    prefix="model.mtp_layers.{m}.",
    renames={"enorm.weight": "token_layernorm.weight", "hnorm.weight": "hidden_layernorm.weight",
             "eh_proj.weight": "input_proj.weight", "shared_head.norm.weight": "final_layernorm.weight"},
    concat="hidden_embed",
    defaults={"embed_mask_pos0": True},
    chain="postnorm",
)
