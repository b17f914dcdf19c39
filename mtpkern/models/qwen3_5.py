"""Qwen3.5 / Qwen3.6 (text models ``qwen3_5_text``, dense, and ``qwen3_5_moe_text``, MoE, under
the vision-language wrappers ``qwen3_5`` / ``qwen3_5_moe``): Qwen3-Next's MTP layer
(mtpkern/models/qwen3_next.py), with these differences.

References: transformers 5.24 ``qwen3_5`` / ``qwen3_5_moe`` (the decoder layer, the attention,
the norms, the MoE block and its packed experts; the MTP tensors are skipped there, ``^mtp.*``)
and vLLM's ``qwen3_5_mtp.py`` (``Qwen3_5MultiTokenPredictor``: the MTP wiring). Qwen3.6
releases use the same model types and config classes.

- the config is a vision-language wrapper's: the text model is under ``text_config`` (read as
  that text config: mtpkern/config.py); the target's tensors are under
  ``model.language_model.`` (its embedding and final norm), the LM head is ``lm_head``, the
  MTP tensors under ``mtp.`` as Qwen3-Next names them;
- ``mtp_num_hidden_layers`` counts the MTP layers (1 in every release; 0 or absent-and-refused
  below); ``mtp_use_dedicated_embeddings`` must be false (the target's embedding);
- the dense models' MTP layer has a dense SwiGLU MLP (``mlp.{gate,up,down}_proj``, of
  ``intermediate_size``); the MoE models' is Qwen3-Next's sparse block whose router always
  renormalises its top-k (no ``norm_topk_prob`` field: fixed true);
- routed experts per expert (Qwen3.5: ``mlp.experts.{e}.gate_proj.weight``) or packed as
  transformers holds them (Qwen3.6: ``mlp.experts.gate_up_proj`` [E, 2I, H], gate rows over up
  rows, and ``mlp.experts.down_proj`` [E, H, I]): the loader reads either (mtpkern.weights,
  ``experts_gate_up``);
- ``attn_output_gate`` (true in the releases) switches the element-wise output gate; false
  reads a layer without it;
- RoPE is MRoPE (``mrope_section``, ``mrope_interleaved``) over the first
  ``partial_rotary_factor`` (0.25) of each head: a text token's three position ids are equal,
  and then every frequency turns by that one position, which is plain RoPE. mtpkern drafts
  text positions (docs/hf_reference.md): the MRoPE keys are checked and dropped.

The target's fields (linear attention, ``layer_types``, ``mamba_ssm_dtype``, ...) are accepted
and not read, as Qwen3-Next's.
"""

from __future__ import annotations

from dataclasses import replace

from ..config_fields import bool_field, opt, show
from ..errors import ConfigError
from .qwen3_next import ATTENTION_FIXED, FAMILY as QWEN3_NEXT, MOE_FIXED, TARGET_ONLY

#: the MRoPE keys of rope_parameters / rope_scaling (transformers' ignore_keys_at_rope_validation)
_MROPE = ("mrope_section", "mrope_interleaved")


def normalise(d: dict) -> dict:
    """The release's text config -> mtpkern's fields: ``mtp_num_hidden_layers`` the module count
    (refused when 0), ``attn_output_gate`` the gate, the MRoPE keys checked and dropped,
    ``mtp_use_dedicated_embeddings`` refused when true."""
    out = dict(d)
    n = out.pop("mtp_num_hidden_layers", None)
    if n is not None:
        if type(n) is not int or n < 1:
            raise ConfigError(f"config.json: field 'mtp_num_hidden_layers' expected an integer >= 1 (the MTP "
                              f"layers mtpkern drafts with: a release without them has no MTP head), got {show(n)}")
        if out.get("num_nextn_predict_layers") not in (None, n):
            raise ConfigError(f"config.json: field 'mtp_num_hidden_layers' = {n} disagrees with "
                              f"'num_nextn_predict_layers' = {out['num_nextn_predict_layers']!r}")
        out["num_nextn_predict_layers"] = n
    dedicated = out.pop("mtp_use_dedicated_embeddings", None)
    if dedicated not in (None, False):
        raise ConfigError(f"config.json: field 'mtp_use_dedicated_embeddings' = {dedicated!r} is not supported; "
                          f"expected false (the MTP layers read the target's embedding)")
    gate = opt(out, "attn_output_gate", bool_field, None)
    out.pop("attn_output_gate", None)
    if gate is not None:                                 # the release's switch (mtpkern's own: attn_gate)
        want = "elementwise" if gate else ""
        if out.get("attn_gate") not in (None, want):
            raise ConfigError(f"config.json: field 'attn_output_gate' = {gate} disagrees with 'attn_gate' = "
                              f"{out['attn_gate']!r}")
        out["attn_gate"] = want
    elif out.get("attn_gate") is None:                   # transformers' Qwen3.5 attention: always gated
        out["attn_gate"] = "elementwise"
    for name in ("rope_parameters", "rope_scaling"):
        rope = out.get(name)
        if isinstance(rope, dict) and any(k in rope for k in _MROPE):
            section = rope.get("mrope_section")
            if section is not None and not (isinstance(section, list) and section
                                            and all(type(x) is int and x >= 0 for x in section)):
                raise ConfigError(f"config.json: {name}.mrope_section expected a list of counts of rotary "
                                  f"frequencies, got {show(section)}")
            opt(rope, "mrope_interleaved", bool_field, False)
            out[name] = {k: v for k, v in rope.items() if k not in _MROPE}
    for name in _MROPE:                                  # some exports flatten rope_parameters
        out.pop(name, None)
    return out


_TARGET = TARGET_ONLY | frozenset({"mamba_ssm_dtype"})
_WRAPPED = dict(prefix="mtp.", target_embed="model.language_model.embed_tokens.weight",
                target_norm="model.language_model.norm.weight", target_head="lm_head.weight",
                target_only=_TARGET, implements=frozenset({"attn_output_gate"}), normalise=normalise, aliases={})

#: Qwen3.5 / Qwen3.6 dense (27B, 9B, ...): a dense SwiGLU MLP in the MTP layer
DENSE = replace(
    QWEN3_NEXT,
    model_type="qwen3_5_text",
    architectures=("Qwen3_5ForCausalLM",),
    title="Qwen3.5 (dense)",
    defaults={"num_nextn_predict_layers": 1, "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-6,
              "head_dim": 256},
    fixed={"use_qk_norm": ATTENTION_FIXED["use_qk_norm"]},
    wrappers={"qwen3_5": ("Qwen3_5ForConditionalGeneration",)},
    **_WRAPPED,
)

#: Qwen3.5 / Qwen3.6 MoE (35B-A3B, 122B-A10B, 397B-A17B): Qwen3-Next's sparse MoE block
MOE = replace(
    DENSE,
    model_type="qwen3_5_moe_text",
    architectures=("Qwen3_5MoeForCausalLM",),
    title="Qwen3.5 (MoE)",
    aliases={"num_experts": "n_routed_experts"},
    fixed={"use_qk_norm": ATTENTION_FIXED["use_qk_norm"], **MOE_FIXED, "norm_topk_prob": True},
    wrappers={"qwen3_5_moe": ("Qwen3_5MoeForConditionalGeneration",)},
)
