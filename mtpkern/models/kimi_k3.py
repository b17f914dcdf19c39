"""Kimi K3 (``kimi_k3``, its text model ``kimi_linear`` under ``text_config``): DeepSeek-V3's
MTP layer with Kimi K3's gated NoPE MLA, SiTU activations and a latent MoE.

References: vLLM ``vllm/models/kimi_k3/nvidia/mtp.py`` (``KimiK3MultiTokenPredictorLayer``,
its ``load_weights`` and ``_rewrite_spec_layer_name``), ``common/mtp.py`` (``fused_mtp_input``),
``nvidia/model.py`` (``KimiDecoderLayer``, ``KimiMoE``, ``KimiMLP``), ``nvidia/mla.py``
(``MultiHeadLatentAttention``) and ``nvidia/latent_moe_runner.py``; transformers
``models/kimi_k3/modular_kimi_k3.py`` (``KimiK3GatedMLA``, ``situ_and_mul``, ``KimiK3MLP``,
``KimiK3MoE``: the model's layers; it has no MTP drafting). vLLM is the reference for the
MTP wiring and the release's names; docs/families.md ("Kimi K3") and docs/hf_reference.md
say where the two differ.

What mtpkern reads (docs/families.md):

- the config: the release's ``kimi_k3`` config holds the text model under ``text_config``,
  whose ``model_type`` is ``kimi_linear`` (vLLM's config class; mtpkern writes and reads it
  back as ``kimi_k3_text``). Its names for our fields: ``num_experts``,
  ``num_experts_per_token``, ``num_shared_experts`` (each of ``moe_intermediate_size``),
  ``num_expert_group``, ``moe_renormalize``, ``moe_router_activation_func``,
  ``routed_expert_hidden_size`` (the latent width), ``latent_moe_use_norm``;
  ``mla_use_output_gate`` switches the attention's output gate, ``hidden_act`` "situ" the
  SiTU activation with ``activation_situ_beta`` (absent: 1, as vLLM) and
  ``activation_situ_linear_beta`` (absent: none); ``use_grouped_topk`` false routes as one
  group. ``mla_use_nope`` must be true (vLLM asserts it) and ``mla_use_rope`` false;
- the MTP layers at ``language_model.model.layers.{num_hidden_layers + k}.`` (the release:
  one), step ``s`` drafting with layer ``s % num_nextn_predict_layers``;
- the module: ``eh_proj([enorm(e) | hnorm(h)])`` with the embedding of the row at vLLM's
  position 0 zeroed (``embed_mask_pos0``, on by default), then the trunk's decoder layer with
  its attention residuals off (vLLM builds the MTP block with ``attn_res_block_size`` None:
  a plain pre-norm residual), ``shared_head.norm`` before the module's own
  ``shared_head.head`` and the un-normed sum handed on (``prenorm``);
- the attention: MLA whose ``qk_rope_head_dim`` dims are kept and not rotated (``nope``),
  scale ``(qk_nope + qk_rope) ** -0.5`` (no YaRN factor: a ``rope_scaling`` is not read, nor
  ``KimiLinearConfig``'s ``head_dim``, the KDA heads'), and an element-wise output gate
  ``sigmoid(g_proj(x))`` on the attention's output before ``o_proj`` (``attn_gate``
  "elementwise", ``self_attn.g_proj.weight`` [Hq * Dv, H]; transformers calls it
  ``output_gate_proj``: read too);
- the MoE (``block_sparse_moe.``): DeepSeek-V3's router (``gate.weight``,
  ``gate.e_score_correction_bias``), the routed experts ``experts.{e}.w1`` (gate) / ``w3``
  (up) / ``w2`` (down) on the latent: ``routed_expert_down_proj`` [Lt, H] in,
  ``routed_expert_norm`` (an RMSNorm over Lt, ``latent_moe_use_norm``) and
  ``routed_expert_up_proj`` [H, Lt] out; the shared experts (``shared_experts.gate_proj`` /
  ``up_proj`` / ``down_proj``) on the full hidden. The releases' routed experts are MXFP4
  in compressed-tensors (``weight_packed``, ``weight_scale``; docs/fp4.md).

The trunk's attention residuals (``self_attention_res_*``, ``mlp_res_*``) that a layer may
carry under the MTP prefix are not read, and said so. The fields that describe only the
trunk (``linear_attn_config``: its KDA layers, ``attn_res_block_size``, ``layer_types``)
are accepted and not read.
"""

from __future__ import annotations

from ..config_fields import bool_field, opt, show
from ..errors import ConfigError
from .base import Family

#: the trunk's fields: its KDA / MLA schedule, its attention residuals, transformers' lists
_TARGET = frozenset({"linear_attn_config", "attn_res_block_size", "layer_types", "mlp_layer_types",
                     "moe_layer_freq", "ep_size"})

#: ``hidden_act`` -> mtpkern's ``mlp_act`` (vLLM's ``KimiMLP`` takes these two)
_ACTS = {"situ": "situ", "silu": "swiglu"}


def _mtp_layers_moe(d: dict) -> list[bool]:
    """Per MTP layer, whether vLLM's ``KimiDecoderLayer`` makes it a MoE layer: experts
    configured, the layer past ``first_k_dense_replace`` and on ``moe_layer_freq``."""
    n, first = d.get("num_nextn_predict_layers"), d.get("num_hidden_layers")
    freq, dense = d.get("moe_layer_freq", 1), d.get("first_k_dense_replace", 0)
    if not (isinstance(n, int) and isinstance(first, int) and isinstance(freq, int) and isinstance(dense, int)) \
            or freq < 1:
        return []                                     # refused by the field checks that follow
    experts = d.get("num_experts", d.get("n_routed_experts"))     # (mtpkern's own config.json: n_routed_experts)
    return [bool(experts) and first + k >= dense and (first + k) % freq == 0 for k in range(n)]


def normalise(d: dict) -> dict:
    """The release's text config -> mtpkern's fields (see the module docstring)."""
    out = dict(d)
    for name, want in (("mla_use_nope", True), ("mla_use_rope", False)):
        v = opt(out, name, bool_field, None)
        out.pop(name, None)
        if v is not None and v != want:
            raise ConfigError(f"config.json: field {name!r} = {show(v)} is not supported: Kimi K3's MTP attention "
                              f"keeps its qk_rope_head_dim dims unrotated (vLLM's KimiDecoderLayer asserts "
                              f"mla_use_nope and builds its MLA without RoPE); expected {show(want)}")
    gate = opt(out, "mla_use_output_gate", bool_field, None)
    out.pop("mla_use_output_gate", None)
    if gate is not None:
        want = "elementwise" if gate else ""
        if out.get("attn_gate") not in (None, want):
            raise ConfigError(f"config.json: field 'mla_use_output_gate' = {show(gate)} disagrees with 'attn_gate' = "
                              f"{show(out['attn_gate'])}")
        out["attn_gate"] = want
    act = out.pop("hidden_act", None)
    if "mlp_act" not in out:                          # (mtpkern's own config.json names mlp_act)
        if act is not None and act not in _ACTS:
            raise ConfigError(f"config.json: field 'hidden_act' = {show(act)} is not supported; expected one of "
                              f"{sorted(_ACTS)} (vLLM's KimiMLP)")
        out["mlp_act"] = _ACTS[act or "silu"]          # KimiLinearConfig's default: silu
    elif act == "situ" and out["mlp_act"] != "situ":
        raise ConfigError(f"config.json: field 'hidden_act' = 'situ' disagrees with 'mlp_act' = {show(out['mlp_act'])}")
    beta, linear = out.pop("activation_situ_beta", None), out.pop("activation_situ_linear_beta", None)
    if out["mlp_act"] == "situ":                      # vLLM: SituAndMul(beta or 1.0, linear_beta or none)
        out["activation_situ_beta"] = beta or 1.0
        out["activation_situ_linear_beta"] = linear or 0.0
    grouped = opt(out, "use_grouped_topk", bool_field, True)
    out.pop("use_grouped_topk", None)
    if not grouped:                                   # one group: the plain bias-corrected top-k
        out["num_expert_group"], out["topk_group"] = 1, 1
    method = out.pop("topk_method", None)
    if method not in (None, "noaux_tc", "quantile_balancing"):     # vLLM's KimiMoE reads neither
        raise ConfigError(f"config.json: field 'topk_method' = {show(method)} is not supported; expected "
                          f"'noaux_tc' or 'quantile_balancing' (a training-time balancing; vLLM's KimiMoE routes "
                          f"by DeepSeek-V3's bias-corrected grouped top-k whatever it says)")
    if out.get("routed_expert_hidden_size") is None:
        out.pop("routed_expert_hidden_size", None)    # no latent projection
        out.pop("latent_moe_use_norm", None)          # (vLLM builds the norm only with one)
    for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if out.get(name) is None:                     # (0 / out of range: refused by the MLA checks)
            raise ConfigError(f"config.json: field {name!r} is missing: Kimi K3's MTP attention is MLA (vLLM's "
                              f"KimiDecoderLayer asserts kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim and "
                              f"v_head_dim); expected an integer")
    if out.get("kv_lora_rank"):                       # the MTP layer's MLA reads neither of these:
        if out.get("head_dim") not in (None, 0):      # KimiLinearConfig's head_dim (the KDA heads')
            hd, P, R = out["head_dim"], out.get("qk_nope_head_dim"), out.get("qk_rope_head_dim")
            if isinstance(P, int) and isinstance(R, int) and hd not in (R, P + R):
                out.pop("head_dim")                   # (P + R or R: MLA's own, checked as DeepSeek-V3's)
        for name in ("rope_scaling", "rope_parameters"):      # no RoPE: no YaRN softmax factor either
            rope = out.get(name)
            if isinstance(rope, dict) and rope.get("rope_type", rope.get("type", "default")) != "default":
                out[name] = {"rope_type": "default", **({"rope_theta": rope["rope_theta"]} if "rope_theta" in rope
                                                        else {})}
    if out.get("num_key_value_heads") is None and out.get("num_attention_heads") is not None:
        out["num_key_value_heads"] = out["num_attention_heads"]    # KimiLinearConfig's default
    moe = _mtp_layers_moe(out)
    if moe and any(moe) and not all(moe):
        raise ConfigError(f"config.json: fields 'first_k_dense_replace' = {show(out.get('first_k_dense_replace'))} "
                          f"and 'moe_layer_freq' = {show(out.get('moe_layer_freq'))} make some MTP layers MoE and "
                          f"others dense (vLLM's KimiDecoderLayer.is_moe_layer); expected every MTP layer of one kind")
    if moe and not any(moe):                          # dense MTP layers: the MoE fields describe the target
        for name in ("num_experts", "num_shared_experts", "routed_expert_hidden_size", "latent_moe_use_norm",
                     "moe_latent_size", "moe_latent_norm"):
            out.pop(name, None)
        out["n_routed_experts"] = 0
    return out


#: canonical suffix -> the release's, under the layer's prefix: the MoE is ``block_sparse_moe``
#: (a dense MLP keeps ``mlp.{gate,up,down}_proj``)
RENAMES = {"mlp.gate.": "block_sparse_moe.gate.", "mlp.experts.": "block_sparse_moe.experts.",
           "mlp.shared_experts.": "block_sparse_moe.shared_experts.",
           "mlp.fc1_latent_proj.weight": "block_sparse_moe.routed_expert_down_proj.weight",
           "mlp.fc2_latent_proj.weight": "block_sparse_moe.routed_expert_up_proj.weight",
           "mlp.latent_norm.weight": "block_sparse_moe.routed_expert_norm.weight"}

_NO_ATTN_RES = "the trunk's attention residuals; vLLM builds the MTP block without them, attn_res_block_size None"

FAMILY = Family(
    model_type="kimi_k3_text",
    architectures=("KimiK3ForCausalLM",),
    title="Kimi K3",
    defaults={"rms_norm_eps": 1e-6, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
              "scoring_func": "sigmoid", "routed_scaling_factor": 1.0, "n_shared_experts": 0,
              "embed_mask_pos0": True},
    aliases={"num_experts": "n_routed_experts", "num_experts_per_token": "num_experts_per_tok",
             "num_shared_experts": "n_shared_experts", "num_expert_group": "n_group",
             "moe_renormalize": "norm_topk_prob", "moe_router_activation_func": "scoring_func",
             "routed_expert_hidden_size": "moe_latent_size", "latent_moe_use_norm": "moe_latent_norm"},
    fixed={"nope": True, "router_bias": True},
    target_only=_TARGET,
    implements=frozenset({"topk_method"}),
    prefix="language_model.model.layers.{layer}.",
    renames=RENAMES,
    expert_parts={"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"},
    alternatives={"self_attn.g_proj.weight": ("self_attn.output_gate_proj.weight",)},
    ignored=(("self_attention_res_", _NO_ATTN_RES), ("mlp_res_", _NO_ATTN_RES)),
    wrappers={"kimi_k3": ("KimiK3ForConditionalGeneration",)},
    text_model_types=("kimi_linear",),
    chain="prenorm",
    normalise=normalise,
    target_embed="language_model.model.embed_tokens.weight",
    target_norm="language_model.model.norm.weight",
    target_head="language_model.lm_head.weight",
)
