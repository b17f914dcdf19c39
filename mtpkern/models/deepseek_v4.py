"""DeepSeek-V4 (``deepseek_v4``, Flash and Pro): an MTP layer with hyper-connections,
DeepSeek-V4's attention and FP4 routed experts.

Reference: vLLM's DeepSeek-V4 MTP model (``deepseek_v4_mtp.py`` around ``deepseek_v4.py``),
the one serving engine with transformers no MTP for this model; SGLang's and TensorRT-LLM's
MTP layers agree but for the position-0 mask below (docs/hf_reference.md, "DeepSeek-V4"):

- modules at ``mtp.{m}.``, in the release's own names (``attn.wq_a``, ``ffn.experts.{e}.w1``,
  ``attn_norm``, ``norm``: ``renames`` / ``parts`` below); FP8 and FP4 scales in ``X.scale``;
- ``enorm`` / ``hnorm``, then ``e_proj(e) + h_proj(X_i)`` for each of the ``hc_mult`` streams:
  ``eh_proj`` over [embed, hidden] in two halves (joined at load);
- the position-0 mask: vLLM zeroes the token embedding of the row at its position 0 before
  ``enorm`` (``(t_1, h_0)``: module 0's key 0, mtpkern's RoPE position 1), so that row's
  ``e_proj`` term is zero and only its streams count; SGLang and TensorRT-LLM do not mask.
  mtpkern follows vLLM, the serving engine: ``embed_mask_pos0`` defaults to true here (a
  default, not a fixed feature: a converted config may say ``false``);
- hyper-connections (``hc_attn_*``, ``hc_ffn_*``, ``hc_head_*``): the hidden an engine hands
  over and a module hands on is the ``hc_mult`` streams before ``hc_head`` (``[n, 4 H]``),
  which the module also chains (docs/architecture.md, "Hyper-connections");
- attention: a query latent (``wq_a``, its norm ``q_norm``, ``wq_b``), then an unweighted
  RMSNorm of each query head (ones), one shared key-value head (``wkv``, its norm
  ``kv_norm``: the value is the key), RoPE in pairs on the LAST ``qk_rope_head_dim`` dims of
  each head with ``rope_theta`` and no YaRN (``rope_scaling`` is the compressed target
  layers'), a sink per head (``attn_sink``), a window of ``sliding_window`` keys, the output's
  rotary dims turned back, and a grouped low-rank output (``wo_a`` per ``o_groups``, ``wo_b``);
  the rotary-last dims are reordered at load to mtpkern's rotary-first (``rope_last``);
- a MoE with ``sqrtsoftplus`` scores, ``ffn.gate.bias`` for selection only, no expert groups,
  weights renormalised and times ``routed_scaling_factor``; SwiGLU clamped as
  ``silu(min(g, L)) * clip(u, -L, L)`` with ``swiglu_limit`` L, routed and shared experts;
- the target's embedding (``embed.weight``) and LM head (``head.weight``).

The release's config.json is read as it is (``normalise``); the target's compressed layers'
fields (``compress_ratios``, whose MTP entries must be 0, ``compress_rope_theta``,
``rope_scaling``, ``index_*``, ``num_hash_layers``) describe only the target.
"""

from __future__ import annotations

from ..config_fields import int_field, opt
from ..errors import ConfigError
from .base import Family

#: fields of the target's compressed-attention / hash-routed layers: no MTP layer reads them
_TARGET = ("compress_ratios", "compress_rope_theta", "rope_scaling", "index_n_heads", "index_head_dim",
           "index_topk", "num_hash_layers")


def normalise(d: dict) -> dict:
    """The release's config.json -> mtpkern's fields. A config already in mtpkern's fields
    (``partial_rotary_factor``, no ``qk_rope_head_dim``) is returned as it is."""
    if not d.get("qk_rope_head_dim") or d.get("kv_lora_rank"):
        return d
    L = opt(d, "num_hidden_layers", int_field, None, 1, 1 << 16)
    M = opt(d, "num_nextn_predict_layers", int_field, 1, 1, 64)
    ratios = d.get("compress_ratios")
    if ratios is not None:
        if not isinstance(ratios, list) or (L is not None and len(ratios) not in (L, L + M)):
            raise ConfigError(f"config.json: field 'compress_ratios' expected a list of num_hidden_layers "
                              f"({L}) or num_hidden_layers + num_nextn_predict_layers ({None if L is None else L + M}) "
                              f"entries, got {ratios!r:.200}")
        if L is not None and len(ratios) == L + M and any(ratios[L:]):
            raise ConfigError(f"config.json: field 'compress_ratios' gives the MTP layers {ratios[L:]}; a "
                              f"compressed-attention MTP layer is not supported (expected 0: sliding-window only)")
    hashed = opt(d, "num_hash_layers", int_field, 0, 0, 1 << 16)
    if L is not None and hashed > L:
        raise ConfigError(f"config.json: field 'num_hash_layers' = {hashed} reaches the MTP layers (from layer {L}); "
                          f"hash routing is not supported (expected <= num_hidden_layers)")
    out = {k: v for k, v in d.items() if k not in _TARGET and k != "qk_rope_head_dim"}
    D = opt(d, "head_dim", int_field, None, 1, 1 << 16)
    R = opt(d, "qk_rope_head_dim", int_field, 0, 0, 1 << 16)
    if D is None or R % 2 or R > D:
        raise ConfigError(f"config.json: fields 'qk_rope_head_dim' = {R} and 'head_dim' = {D}: expected an even "
                          f"number of rotary dims at most head_dim (the last of each head)")
    out["partial_rotary_factor"] = R / D
    limit = d.get("swiglu_limit")
    if limit is not None:
        out.pop("swiglu_limit")
        out["swiglu_clamp"] = out["swiglu_clamp_shared"] = limit
        out["swiglu_clamp_gate"] = True
    q = d.get("quantization_config")
    if isinstance(q, dict) and q.get("quant_method") == "fp8" and "expert_dtype" not in d and "expert_dtype" not in q:
        out["expert_dtype"] = "fp4"          # the release's experts; vLLM's default (Flash-Base says "fp8")
    return out


FAMILY = Family(
    model_type="deepseek_v4",
    architectures=("DeepseekV4ForCausalLM",),
    title="DeepSeek-V4",
    defaults={"rms_norm_eps": 1e-6, "num_nextn_predict_layers": 1, "rope_interleave": True, "embed_mask_pos0": True},
    fixed={"shared_kv": True, "out_rope": True, "attn_sinks": True, "use_qk_norm": True, "attention_bias": False},
    implements=frozenset({"swiglu_limit", "qk_rope_head_dim"}),
    target_only=frozenset(_TARGET),
    prefix="mtp.{m}.",
    renames={"shared_head.norm.weight": "norm.weight", "input_layernorm.weight": "attn_norm.weight",
             "post_attention_layernorm.weight": "ffn_norm.weight",
             "self_attn.q_a_layernorm.weight": "attn.q_norm.weight", "self_attn.k_norm.weight": "attn.kv_norm.weight",
             "self_attn.sinks": "attn.attn_sink", "mlp.gate.e_score_correction_bias": "ffn.gate.bias"},
    parts={"self_attn": "attn", "mlp": "ffn", "q_a_proj": "wq_a", "q_b_proj": "wq_b", "kv_proj": "wkv",
           "o_a_proj": "wo_a", "o_b_proj": "wo_b", "gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"},
    scale_dot_scale=True,
    split_eh_proj=True,
    unit_norms=frozenset({"self_attn.q_norm.weight"}),
    rope_last=True,
    normalise=normalise,
    target_embed="embed.weight",
    target_head="head.weight",
    target_norm="norm.weight",
)
