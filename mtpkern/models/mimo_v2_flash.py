"""MiMo-V2-Flash (``mimo_v2_flash``): three dense MTP modules of sliding-window attention
with attention sinks, a value head dim of their own and scaled values, in a MoE model.

References: vLLM ``mimo_v2_mtp.py`` / ``mimo_v2.py`` and SGLang ``mimo_v2_flash_nextn.py``
(same math):

- modules at ``model.mtp.layers.{m}.``: ``enorm`` / ``hnorm`` / ``eh_proj`` (over
  ``[embed, hidden]``), ``input_layernorm``, ``pre_mlp_layernorm`` (the post-attention
  norm), ``final_layernorm`` (the norm before the LM head), separate q/k/v/o, a dense
  SwiGLU ``mlp`` of ``intermediate_size``; no q/k norm; the target's embedding and LM head;
- the MTP layers use the sliding-window attention flavour of the target: the ``swa_*``
  head counts and dims (64 query heads, 8 KV heads, head_dim 192, v_head_dim 128),
  ``swa_rope_theta``, the ``sliding_window`` (128), and a learned sink logit per query
  head (``self_attn.attention_sink_bias``, ``add_swa_attention_sink_bias``); RoPE on the
  first ``int(192 * partial_rotary_factor)`` = 64 dims of each head;
- v is multiplied by ``attention_value_scale`` (0.707) before attention: folded into
  ``v_proj`` at load (through the FP32 block scales of an FP8 release);
- plain RMSNorm with ``layernorm_epsilon``;
- FP8 E4M3 block-128 weights for q/k/v and the MLP; ``eh_proj`` and ``o_proj`` are BF16
  (whatever ``ignored_layers`` lists: each tensor's dtype decides);
- the module hands on its post-norm output (``final_layernorm(y)``, what the LM head
  reads: vLLM); ``num_nextn_predict_layers`` is absent from the release: 3.

Which target hidden module 0 reads (pre- or post-final-norm) differs between the
serving stacks; mtpkern reads what the engine hands over (``apply_target_norm`` applies
the target's ``model.norm`` to pre-norm hiddens).
"""

from __future__ import annotations

from ..config_fields import bool_field, int_field, opt, window_field
from ..errors import ConfigError
from .base import Family

#: the target's SWA attention settings, which every MTP module uses -> mtpkern's fields
_SWA = {"swa_num_attention_heads": "num_attention_heads", "swa_num_key_value_heads": "num_key_value_heads",
        "swa_head_dim": "head_dim", "swa_v_head_dim": "v_head_dim", "swa_rope_theta": "rope_theta"}


def normalise(d: dict) -> dict:
    """The SWA flavour of the release -> the MTP block (every module: dense, windowed,
    with sinks). A config in mtpkern's fields (no ``swa_*``) is returned as it is."""
    if not any(k in d for k in _SWA):
        return d
    out = {k: v for k, v in d.items() if k not in _SWA and k not in ("sliding_window_size",
                                                                     "add_swa_attention_sink_bias")}
    for theirs, ours in _SWA.items():
        if d.get(theirs) is None:
            raise ConfigError(f"config.json: field {theirs!r} is missing (the MTP layers' sliding-window attention)")
        out[ours] = d[theirs]
    windows = {k: window_field(k, d[k], "every MiMo-V2-Flash MTP layer is a sliding-window layer")
               for k in ("sliding_window", "sliding_window_size") if d.get(k) is not None}
    if len(set(windows.values())) != 1:
        raise ConfigError(f"config.json: sliding_window and sliding_window_size expected one window, got "
                          f"{sorted(set(windows.values()))} (the MTP layers are sliding-window layers: an integer "
                          f">= 1 in one field, or the same in both)")
    out["sliding_window"] = next(iter(windows.values()))
    out["attn_sinks"] = opt(d, "add_swa_attention_sink_bias", bool_field, False)
    if opt(d, "qk_layernorm", bool_field, False) or opt(d, "use_qk_norm", bool_field, False):
        raise ConfigError("config.json: q/k norms in a MiMo-V2-Flash MTP layer are not in the release; refused")
    M = opt(d, "num_nextn_predict_layers", int_field, 3, 1, 64)     # absent from the release: 3
    out["num_nextn_predict_layers"] = M
    out["mtp_blocks"] = [{"moe": False}] * M                   # dense MTP blocks in a MoE model
    return out


FAMILY = Family(
    model_type="mimo_v2_flash",
    architectures=("MiMoV2FlashForCausalLM",),
    title="MiMo-V2-Flash",
    defaults={"num_nextn_predict_layers": 3, "routed_scaling_factor": 1.0},
    aliases={"layernorm_epsilon": "rms_norm_eps"},
    fixed={"attention_bias": False, "use_qk_norm": False},
    implements=frozenset(set(_SWA) | {"sliding_window", "sliding_window_size", "add_swa_attention_sink_bias",
                                      "hybrid_layer_pattern", "attention_value_scale"}),
    target_only=frozenset({"hybrid_layer_pattern", "hybrid_block_size", "add_full_attention_sink_bias",
                           "attention_chunk_size", "moe_layer_freq", "swa_qk_head_dim"}),
    prefix="model.mtp.layers.{m}.",
    renames={"post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
             "shared_head.norm.weight": "final_layernorm.weight", "self_attn.sinks": "self_attn.attention_sink_bias"},
    chain="postnorm",
    normalise=normalise,
)
