"""NVIDIA Nemotron-3 (``nemotron_h``): one MTP step of two sublayers, attention then MoE.

References: vLLM ``model_executor/models/nemotron_h_mtp.py`` (``NemotronHMultiTokenPredictor``,
``NemotronHMTPAttentionDecoderLayer`` / ``NemotronHMTPMoEDecoderLayer``) and transformers 5.24
``models/nemotron_h/modeling_nemotron_h.py`` (``NemotronHAttention``, ``NemotronHMoE``,
``NemotronHExperts``, ``NemotronHTopkRouter``, ``NemotronHMLP``, ``NemotronHRMSNorm``).

The MTP step is the sublayers ``mtp_hybrid_override_pattern`` names (``mtp_layers_block_type``
in transformers 5), one tensor group ``mtp.layers.{j}.`` each, each a pre-norm (``norm``) +
mixer + residual. vLLM fuses ``enorm`` / ``hnorm`` / ``eh_proj`` into the first sublayer and
``final_layernorm`` into the last; its residual stream carried between them adds up to
mtpkern's block::

    x = eh_proj([enorm(e) | hnorm(h)])                  # mtp.layers.0.{enorm,hnorm,eh_proj}
    x = x + attn(norm_0(x))                             # "*": mtp.layers.0.{norm, mixer.*}
    y = x + ffn(norm_1(x))                              # "E" / "-": mtp.layers.1.{norm, mixer.*}
    out = final_layernorm(y)                            # mtp.layers.1.final_layernorm

So the patterns "*E" (the releases') and "*-" (a dense MLP) are mtpkern's decoder block, mapped
by renames; any other pattern (two attention sublayers, an FFN first, Mamba "M") is refused by
name. Differences from the canonical layout, otherwise:

- the attention has no RoPE (``position_embedding_type: none`` in Megatron; transformers'
  ``NemotronHAttention`` applies none): ``nope``;
- every MLP is non-gated, ``down(relu(up x) ** 2)`` (``mlp_hidden_act: relu2``): ``mlp_act``,
  no ``gate_proj``; the routed experts ``mixer.experts.{e}.{up,down}_proj``, one shared expert
  ``mixer.shared_experts.{up,down}_proj`` of ``moe_shared_expert_intermediate_size`` (read as
  ``n_shared_experts = moe_shared_expert_intermediate_size / moe_intermediate_size`` shared
  experts stacked into one MLP: the same rows);
- the router is DeepSeek-V3's: sigmoid, ``e_score_correction_bias``, grouped top-k,
  ``norm_topk_prob`` (+1e-20), ``routed_scaling_factor``;
- plain RMSNorms (``w * x``); ``layer_norm_epsilon``;
- the step hands on its normed output (vLLM returns ``final_layernorm(y)`` as the hidden of the
  next draft): the ``postnorm`` chain;
- one step (vLLM asserts ``num_nextn_predict_layers == 1``); more is refused.

- LatentMoE (Nemotron-3 Super / Ultra, ``moe_latent_size``): the routed experts run on
  ``mixer.fc1_latent_proj(f)`` [latent] and their weighted sum goes back through
  ``mixer.fc2_latent_proj`` (``NemotronHMoE.forward``); the router and the shared expert read
  the hidden f itself. numpy and cpu run it; the cuda backend and a sharded head refuse it by
  name (relu2 runs on every backend).

``nemotron_h_puzzle`` (``NemotronHPuzzleForCausalLM``: the Puzzle-compressed Super, whose trunk
layers differ in their MoE sizes) has the same MTP step and tensors; its config gives the step's
sublayers as ``mtp_block_configs`` (``{"block_type": "attention"}``, ``{"block_type": "moe",
"moe_intermediate_size": .., "n_routed_experts": .., "num_experts_per_tok": .., ...}``), read here
into the pattern and the MoE fields (a field given both there and at the top level must agree).

Not implemented, refused by name: MLP biases (``mlp_bias``), more than one MTP step, any other
pattern.
"""

from __future__ import annotations

from ..errors import ConfigError
from .base import Family

#: transformers 5's layer-type names -> the pattern characters (NemotronHConfig._pattern_to_list)
_TYPE_CHAR = {"linear_attention": "M", "mamba": "M", "moe": "E", "full_attention": "*", "attention": "*",
              "mlp": "-"}
#: the MTP patterns mtpkern's block is: the FFN sublayer's character -> its kind
_PATTERNS = {"*E": "moe", "*-": "mlp"}
#: the target's Mamba-2 / hybrid fields: accepted, not read
_TARGET = frozenset({
    "hybrid_override_pattern", "layers_block_type", "ssm_state_size", "mamba_num_heads", "mamba_head_dim",
    "mamba_hidden_act", "n_groups", "mamba_n_groups", "conv_kernel", "mamba_d_conv", "expand", "mamba_expand",
    "time_step_min", "time_step_max", "time_step_limit", "time_step_floor", "mamba_dt_min", "mamba_dt_max",
    "mamba_dt_limit", "mamba_dt_init_floor", "use_conv_bias", "mamba_conv_bias", "chunk_size",
    "mamba_chunk_size", "mamba_proj_bias", "mamba_ssm_cache_dtype", "use_mamba_kernels", "residual_in_fp32",
    "rescale_prenorm_residual", "num_logits_to_keep", "moe_shared_expert_overlap", "output_router_logits",
    "hidden_dropout", "attention_dropout", "initializer_range"})


def _pattern(d: dict) -> str:
    pat = d.get("mtp_hybrid_override_pattern")
    types = d.get("mtp_layers_block_type")
    if types is not None:
        if not isinstance(types, list) or not all(t in _TYPE_CHAR for t in types):
            raise ConfigError(f"config.json: field 'mtp_layers_block_type' expected a list of "
                              f"{sorted(_TYPE_CHAR)}, got {types!r}")
        from_types = "".join(_TYPE_CHAR[t] for t in types)
        if pat is not None and pat != from_types:
            raise ConfigError(f"config.json: field 'mtp_hybrid_override_pattern' = {pat!r} disagrees with "
                              f"'mtp_layers_block_type' = {types!r} ({from_types!r})")
        pat = from_types
    return "*E" if pat is None else pat       # NemotronHConfig's default: ["full_attention", "moe"]


#: mtp_block_configs' block types -> the pattern characters (nemotron_h_puzzle)
_PUZZLE_CHAR = {"attention": "*", "moe": "E", "mlp": "-", "mamba": "M"}


def normalise_puzzle(d: dict) -> dict:
    """``nemotron_h_puzzle``: ``mtp_block_configs`` -> the pattern and the MoE sublayer's fields,
    then as ``nemotron_h``; the trunk's ``block_configs`` accepted, not read."""
    blocks = d.get("mtp_block_configs")
    out = {k: v for k, v in d.items() if k not in ("mtp_block_configs", "block_configs")}
    if blocks is not None:
        if not (isinstance(blocks, list) and all(isinstance(b, dict) and b.get("block_type") in _PUZZLE_CHAR
                                                 for b in blocks)):
            raise ConfigError(f"config.json: field 'mtp_block_configs' expected a list of objects with a block_type "
                              f"in {sorted(_PUZZLE_CHAR)}, got {blocks!r:.200}")
        pat = "".join(_PUZZLE_CHAR[b["block_type"]] for b in blocks)
        if out.get("mtp_hybrid_override_pattern", pat) != pat:
            raise ConfigError(f"config.json: field 'mtp_hybrid_override_pattern' = {out['mtp_hybrid_override_pattern']!r} "
                              f"disagrees with 'mtp_block_configs' ({pat!r})")
        out["mtp_hybrid_override_pattern"] = pat
        for b in blocks:
            for k, v in b.items():
                if k == "block_type":
                    continue
                if k in d and d[k] is not None and d[k] != v:
                    raise ConfigError(f"config.json: field {k!r} = {v!r} of mtp_block_configs disagrees with the "
                                      f"top level's {d[k]!r}; expected them equal, or one absent")
                out[k] = v
    return normalise(out)


def normalise(d: dict) -> dict:
    """The release's config.json -> mtpkern's fields (see the module docstring)."""
    out = {k: v for k, v in d.items() if k not in ("mtp_hybrid_override_pattern", "mtp_layers_block_type")}
    pat = _pattern(d)
    if pat not in _PATTERNS:
        raise ConfigError(f"config.json: field 'mtp_hybrid_override_pattern' = {pat!r} is not supported: mtpkern's "
                          f"block is one attention sublayer then one MLP / MoE sublayer; expected one of "
                          f"{sorted(_PATTERNS)} (several attention sublayers, Mamba 'M' or an FFN first would "
                          f"need a new block feature)")
    act = out.pop("mlp_hidden_act", "relu2")
    if act != "relu2":
        raise ConfigError(f"config.json: field 'mlp_hidden_act' = {act!r} is not supported; expected 'relu2' "
                          f"(Nemotron-H's non-gated MLPs)")
    if out.get("moe_latent_size") is None:
        out.pop("moe_latent_size", None)            # null: no latent projection
    if out.get("num_nextn_predict_layers", 1) != 1:
        raise ConfigError(f"config.json: field 'num_nextn_predict_layers' = {out['num_nextn_predict_layers']!r} is "
                          f"not supported: Nemotron-H's MTP is one step (vLLM's NemotronHMultiTokenPredictor "
                          f"asserts it); expected 1")
    if _PATTERNS[pat] == "mlp":
        out["n_routed_experts"] = 0                    # the MoE fields describe the target then
    shared = out.pop("moe_shared_expert_intermediate_size", None)
    I = out.get("moe_intermediate_size")
    if _PATTERNS[pat] == "moe" and shared is not None and out.get("n_shared_experts", 1):
        if not (isinstance(shared, int) and isinstance(I, int) and I > 0 and shared > 0 and shared % I == 0):
            raise ConfigError(f"config.json: field 'moe_shared_expert_intermediate_size' = {shared!r} expected a "
                              f"multiple of moe_intermediate_size = {I!r} (the shared expert is read as that many "
                              f"experts of moe_intermediate_size stacked)")
        out["n_shared_experts"] = shared // I
    if out.get("num_hidden_layers") is None:       # transformers 5 derives it from the layer pattern
        layers = out.get("layers_block_type") or out.get("hybrid_override_pattern")
        if layers is not None:
            out["num_hidden_layers"] = len(layers)
    return out


#: canonical suffix -> the name under ``mtp.``: the first sublayer (0) holds the fusion and the
#: attention, the second (1) the FFN and the final norm
RENAMES = {"enorm.weight": "layers.0.enorm.weight", "hnorm.weight": "layers.0.hnorm.weight",
           "eh_proj.weight": "layers.0.eh_proj.weight", "input_layernorm.weight": "layers.0.norm.weight",
           "self_attn.": "layers.0.mixer.", "post_attention_layernorm.weight": "layers.1.norm.weight",
           "mlp.": "layers.1.mixer.", "shared_head.norm.weight": "layers.1.final_layernorm.weight"}

FAMILY = Family(
    model_type="nemotron_h",
    architectures=("NemotronHForCausalLM",),
    title="Nemotron-H (Nemotron-3)",
    defaults={"num_nextn_predict_layers": 1, "rms_norm_eps": 1e-5, "n_group": 1, "topk_group": 1,
              "norm_topk_prob": True, "routed_scaling_factor": 1.0, "n_shared_experts": 1,
              "num_key_value_heads": 8, "head_dim": 128},
    aliases={"layer_norm_epsilon": "rms_norm_eps"},
    fixed={"mlp_act": "relu2", "nope": True, "scoring_func": "sigmoid", "router_bias": True},
    target_only=_TARGET,
    prefix="mtp.",
    renames=RENAMES,
    chain="postnorm",
    normalise=normalise,
    target_embed="backbone.embeddings.weight",
    target_norm="backbone.norm_f.weight",
)

#: the Puzzle-compressed release: the same MTP step, its sublayers given by mtp_block_configs
PUZZLE = Family(
    model_type="nemotron_h_puzzle",
    architectures=("NemotronHPuzzleForCausalLM",),
    title="Nemotron-H Puzzle (Nemotron-3)",
    defaults=FAMILY.defaults,
    aliases=FAMILY.aliases,
    fixed=FAMILY.fixed,
    target_only=_TARGET,
    prefix=FAMILY.prefix,
    renames=FAMILY.renames,
    chain=FAMILY.chain,
    normalise=normalise_puzzle,
    target_embed=FAMILY.target_embed,
    target_norm=FAMILY.target_norm,
)
