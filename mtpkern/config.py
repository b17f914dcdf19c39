"""Model configuration of an MTP checkpoint, parsed from ``config.json``.

Field names follow Hugging Face ``Glm4MoeConfig`` / ``DeepseekV3Config``.
Letters used throughout the project: ``H`` hidden, ``Hq`` / ``Hkv`` query and
key-value heads, ``D`` head dim, ``V`` vocab, ``E`` routed experts, ``K``
experts per token, ``I`` expert intermediate size, ``M`` modules.

A config.json is read as a whole and refused, with the field's name, when it
asks for something mtpkern would otherwise silently get wrong: a model family
that does not load yet, a field that changes the maths and is not implemented
(``UNIMPLEMENTED_FIELDS``), another family's name for a quantity that disagrees
with ours (``SAME_AS``), a number outside its range (``INT_RANGES``,
``FLOAT_RANGES``). docs/checkpoints.md has the rules and the reasons.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Literal, get_args

from .block import BlockError, BlockSpec, Yarn
from .config_fields import bool_field, opt
from .errors import ConfigError
from .files import CONFIG_JSON_CAP, read_json
from .models import CANONICAL, FAMILIES, Family, by_architecture, by_wrapper, supported

ScoringFunc = Literal["sigmoid", "softmax", "sqrtsoftplus"]

# -- what loads today: the families of mtpkern/models/ (one file each) ---------------
# A config with neither model_type nor architectures (hand-written, or
# MtpConfig.to_dict) is read in the canonical layout (docs/model.md) with MtpConfig's defaults.


def _off(v: Any, d: dict) -> bool:
    return v is None or v is False or v == [] or v == {}


def _only_full_attention(v: Any, d: dict) -> bool:
    return _off(v, d) or (isinstance(v, list) and all(t == "full_attention" for t in v))


def _all_null(v: Any, d: dict) -> bool:
    return _off(v, d) or (isinstance(v, list) and all(x is None for x in v))


def _all_zero(v: Any, d: dict) -> bool:
    return _off(v, d) or (isinstance(v, list) and all(x == 0 and x is not False for x in v))


def _window(d: dict) -> int:
    """Every MTP module's sliding window (0: full attention): ``sliding_window``, unless
    ``use_sliding_window: false`` (Qwen2-style configs carry a size beside it)."""
    use = opt(d, "use_sliding_window", bool_field, None)
    if use is False:
        return 0
    w = _opt(d, "sliding_window", int, 0)
    if use is True and not w:
        raise ConfigError(f"config.json: field 'use_sliding_window' = true needs a sliding_window > 0, got {_show(w)}")
    return w


def _noaux_tc(v: Any, d: dict) -> bool:
    return v is None or v == "noaux_tc"


def _one(v: Any, d: dict) -> bool:
    return v is None or (not isinstance(v, bool) and v == 1)


@dataclass(frozen=True, slots=True)
class Unimplemented:
    """A config.json field that changes the maths and that mtpkern does not implement
    yet: refused unless ``off(value, config)``, i.e. unless the value switches it off."""

    reason: str
    expected: str = "absent or null"
    off: Callable[[Any, dict], bool] = _off


def _group(names: str, reason: str, expected: str = "absent or null",
           off: Callable[[Any, dict], bool] = _off) -> dict[str, Unimplemented]:
    return {n: Unimplemented(reason, expected, off) for n in names.split()}


_SWA = "sliding-window attention (Step-3.5, MiMo)"

#: Field -> why it is refused. Taken from the published config.json files of the
#: families planned next (DeepSeek-V3, Step-3.5, MiMo, Qwen3-Next) and of FP8 releases.
UNIMPLEMENTED_FIELDS: dict[str, Unimplemented] = {
    **_group("sliding_window_size num_sliding_attention_heads attention_other_setting "
             "swa_num_attention_heads swa_num_key_value_heads swa_head_dim swa_v_head_dim swa_rope_theta", _SWA),
    **_group("layer_types mtp_layer_types", "attention other than full (sliding-window, linear)",
             "absent or only 'full_attention'", _only_full_attention),
    **_group("hybrid_layer_pattern", _SWA, "absent or all 0", _all_zero),
    **_group("add_swa_attention_sink_bias add_full_attention_sink_bias use_attention_sink",
             "attention sinks (Step-3.5, MiMo)", "absent, null or false"),
    **_group("swiglu_limits swiglu_limits_shared", "SwiGLU clamping (Step-3.5)", "absent or all null", _all_null),
    **_group("swiglu_limit", "SwiGLU clamping"),
    **_group("attn_output_gate use_head_wise_attn_gate", "gated attention output (Qwen3-Next, Step-3.5)",
             "absent, null or false"),
    **_group("partial_rotary_factors", "per-layer RoPE (Step-3.5)"),
    **_group("linear_num_key_heads linear_num_value_heads linear_key_head_dim linear_value_head_dim "
             "linear_conv_kernel_dim full_attention_interval", "linear attention (Qwen3-Next)"),
    **_group("mlp_bias", "biases in the MLP", "absent, null or false"),
    **_group("topk_method", "routing other than DeepSeek-V3's bias-corrected grouped top-k",
             "absent or 'noaux_tc'", _noaux_tc),
}

#: Name prefixes refused like UNIMPLEMENTED_FIELDS (attention_sink, attention_sinks, ...).
UNIMPLEMENTED_PREFIXES: dict[str, Unimplemented] = {
    "attention_sink": Unimplemented("attention sinks (Step-3.5, MiMo)", "absent, null or false"),
}

#: Other families' names for a quantity MtpConfig reads under its own name (an
#: attribute or property): accepted when they agree, refused when they do not.
SAME_AS: dict[str, str] = {
    "num_experts": "n_routed_experts",                 # Qwen3-MoE / Qwen3-Next
    "num_local_experts": "n_routed_experts",           # Mixtral, MiniMax, MiMo
    "moe_num_experts": "n_routed_experts",             # Step-3.5
    "moe_top_k": "num_experts_per_tok",                # Step-3.5
    "num_shared_experts": "n_shared_experts",          # Kimi, Qwen3.5
    "shared_expert_intermediate_size": "shared_intermediate_size",  # Qwen3-Next
    "share_expert_dim": "shared_intermediate_size",    # Step-3.5
    "moe_router_scaling_factor": "routed_scaling_factor",  # Step-3.5
    "moe_router_activation": "scoring_func",           # Step-3.5
    "num_attention_groups": "num_key_value_heads",     # Step-3.5
    "num_mtp_layers": "num_nextn_predict_layers",      # transformers' attribute name
    "rotary_dim": "rotary_dim",                        # MiniMax-M2, GPT-J: head_dim * partial_rotary_factor
    "query_pre_attn_scalar": "head_dim",               # scores are scaled by head_dim ** -0.5
    "qk_head_dim": "head_dim",                         # MLA (transformers writes qk_nope + qk_rope)
}

#: Inclusive ranges of the int fields. Generous (4-16x the largest published
#: config, in the comment), but finite: no config can make the loader or the
#: proposer loop or allocate without limit.
INT_RANGES: dict[str, tuple[int, int]] = {
    "hidden_size": (1, 1 << 16),               # 16384 (Llama-3.1-405B)
    "num_attention_heads": (1, 1024),          # 128 (DeepSeek-V3)
    "num_key_value_heads": (1, 1024),
    "head_dim": (2, 1024),                     # 256 (Qwen3-Next)
    "vocab_size": (1, 1 << 22),                # 262144 (Gemma 3)
    "num_hidden_layers": (0, 4096),            # 126
    "num_nextn_predict_layers": (1, 64),       # 3 (MiMo, Step-3.5)
    "intermediate_size": (0, 1 << 20),         # 53248
    "moe_intermediate_size": (0, 1 << 20),     # 2048
    "n_routed_experts": (0, 4096),             # 512 (Qwen3-Next)
    "num_experts_per_tok": (0, 4096),          # 10
    "n_shared_experts": (0, 64),               # 2
    "n_group": (1, 4096),                      # 8
    "topk_group": (1, 4096),
    "first_k_dense_replace": (0, 4096),
    "max_position_embeddings": (1, 2**31 - 1),  # kernels index positions in int32
    "v_head_dim": (0, 1024),                   # 128 beside head_dim 192 (MiMo-V2); 0: head_dim
    "sliding_window": (0, 2**31 - 1),          # 128 (MiMo-V2), 512 (Step-3.5); 0: full attention
    "kv_lora_rank": (0, 1 << 14),              # 512 (DeepSeek-V3, GLM-5); 0: not MLA
    "q_lora_rank": (0, 1 << 15),               # 1536 (DeepSeek-V3), 2048 (GLM-5); 0: a plain q_proj
    "qk_rope_head_dim": (0, 1024),             # 64
    "index_topk": (0, 1 << 20),                # 2048 (DeepSeek-V3.2, GLM-5); 0: no DSA indexer
    "index_n_heads": (0, 1024),                # 64 (DeepSeek-V3.2), 32 (GLM-5)
    "index_kpool": (0, 1024),                  # 16 (GLM-5.3's pooled indexer); 0 / 1: a key per row
    "index_head_dim": (0, 1024),               # 128
    "o_groups": (0, 1024),                     # 8 (DeepSeek-V4-Flash), 16 (Pro); 0: a plain o_proj
    "o_lora_rank": (0, 1 << 15),               # 1024
    "hc_mult": (1, 16),                        # 4 (DeepSeek-V4); 1: no hyper-connections
    "hc_sinkhorn_iters": (1, 1000),            # 20
}

#: Ranges (low, high] of the float fields; every one must also be finite.
FLOAT_RANGES: dict[str, tuple[float, float]] = {
    "rms_norm_eps": (0.0, 1.0),
    "rope_theta": (1.0, 1e12),
    "partial_rotary_factor": (0.0, 1.0),
    "routed_scaling_factor": (0.0, 1e3),
    "attention_value_scale": (0.0, 1e3),            # 0.707 (MiMo-V2-Flash)
    "q_a_norm_scale": (0.0, 1e3),                   # sqrt(6144 / 1536) = 2 (LongCat-Flash's mla_scale_q_lora)
    "kv_a_norm_scale": (0.0, 1e3),                  # sqrt(6144 / 512)
    "hc_eps": (0.0, 1.0),                           # 1e-6 (DeepSeek-V4)
}

#: Why each float range is what it is: the error messages and docs/checkpoints.md say it.
FLOAT_RANGE_REASONS: dict[str, str] = {
    "rms_norm_eps": "added to the mean square: 0 divides by zero on a zero hidden, past 1 it outweighs the "
                    "hidden itself (releases: 1e-6 .. 1e-5)",
    "rope_theta": "the RoPE base: at 1 or below the frequencies theta^(-2i/d) no longer fall with the dimension "
                  "(5e-324 made every angle infinite); past 1e12 it is 1e5 times the largest release (1e4 .. 1e7)",
    "partial_rotary_factor": "the share of each head's dimensions rotated: 0 rotates none, past 1 more than the "
                             "head has",
    "routed_scaling_factor": "multiplies the routed experts' weights: 0 drops them, past 1e3 (60 times the "
                             "largest release, 1 .. 16) the FP32 expert sum heads for overflow (1e308 made every "
                             "weight inf)",
    "attention_value_scale": "multiplies v, folded into v_proj's weights: 0 zeroes attention, past 1e3 the "
                             "folded BF16 weights head for overflow",
    "q_a_norm_scale": "sqrt(hidden_size / q_lora_rank), folded into a norm's weight: at most 256 for any size "
                      "allowed here",
    "kv_a_norm_scale": "sqrt(hidden_size / kv_lora_rank), folded into a norm's weight: at most 256 for any size "
                       "allowed here",
    "hc_eps": "added to the hyper-connections' weights and to the comb's row and column sums: 0 may divide by "
              "zero, past 1 it outweighs the weights themselves (sigmoids and softmaxes in [0, 1])",
}

#: the RoPE position of the row whose token embedding ``embed_mask_pos0`` zeroes: vLLM masks its
#: position 0, and vLLM's MTP row (t_{j+1}, h_j) sits at j where mtpkern's sits at j + 1
#: (docs/semantics.md: module m's key j at j + m + 1); only module 0's key 0 is there
EMBED_MASK_POSITION = 1

_BOOL_FIELDS = ("attention_bias", "use_qk_norm", "norm_topk_prob", "tie_word_embeddings", "shared_expert_gate",
                "router_bias", "attn_sinks", "rope_interleave", "indexer_rope_interleave", "shared_kv", "out_rope",
                "embed_mask_pos0", "index_kpool_always_select_tail")
#: Keys of rope_parameters / rope_scaling that the default RoPE reads.
_ROPE_KEYS = ("rope_type", "type", "rope_theta", "partial_rotary_factor")
#: The keys YaRN reads besides them (Hugging Face's names) -> (type, Yarn's field)
_YARN_KEYS: dict[str, tuple[type, str]] = {
    "factor": (float, "factor"), "original_max_position_embeddings": (int, "original_max_position_embeddings"),
    "beta_fast": (float, "beta_fast"), "beta_slow": (float, "beta_slow"), "mscale": (float, "mscale"),
    "mscale_all_dim": (float, "mscale_all_dim"), "attention_factor": (float, "attention_factor_override"),
    "truncate": (bool, "truncate")}
#: rope_type values read (other scalings, llama3 / linear / dynamic / longrope, are refused)
_ROPE_TYPES = ("default", "yarn")
_PREFIX = "config.json: "


def _req(d: dict, name: str, typ: type | tuple[type, ...]) -> Any:
    if name not in d or d[name] is None:
        raise ConfigError(f"config.json: required field {name!r} is missing")
    return _typed(name, d[name], typ)


def _opt(d: dict, name: str, typ: type | tuple[type, ...], default: Any) -> Any:
    if name not in d or d[name] is None:
        return default
    return _typed(name, d[name], typ)


def _typed(name: str, value: Any, typ: type | tuple[type, ...]) -> Any:
    # bool is an int subclass: refuse True where a count is expected.
    if isinstance(value, bool) and typ is not bool:
        raise ConfigError(f"config.json: field {name!r} expected {_tname(typ)}, got bool {value!r}")
    if typ is float and isinstance(value, int):
        return float(value)
    if not isinstance(value, typ):
        raise ConfigError(
            f"config.json: field {name!r} expected {_tname(typ)}, got {type(value).__name__} {_show(value)}"
        )
    return value


def _tname(typ: type | tuple[type, ...]) -> str:
    if isinstance(typ, tuple):
        return " or ".join(t.__name__ for t in typ)
    return typ.__name__


def _show(v: Any, limit: int = 60) -> str:
    """A value for a one-line message, cut at ``limit`` characters."""
    if isinstance(v, dict) and "quant_method" in v:
        return f"{{'quant_method': {v['quant_method']!r}, ...}}"
    text = repr(v)
    return text if len(text) <= limit else text[:limit] + "..."


#: compressed-tensors' ``format`` of each weight format it packs (the names its config writes)
CT_FORMATS = {"fp8": "float-quantized", "mxfp8": "mxfp8-quantized", "mxfp4": "mxfp4-pack-quantized",
              "nvfp4": "nvfp4-pack-quantized"}
#: the 4-bit and MX formats a container may announce (``MtpConfig.quant_formats``)
QUANT_FORMATS = ("mxfp4", "mxfp8", "nvfp4")


def _ct_group(name: str, g: Any, fmt: Any) -> tuple[str, tuple[int, int]]:
    """One compressed-tensors config group -> (format, fp8 block): "fp8" with (bn, bk) or (0, 0)
    (per-channel), "mxfp8", "mxfp4" or "nvfp4"; the group's own ``format`` (mixed-precision) or
    the config's must agree with its weights. Integer weights (AWQ, GPTQ, int4 / int8 groups)
    and any other layout are refused, naming what was found."""
    where = f"quantization_config.config_groups.{name}.weights"
    w = g.get("weights") if isinstance(g, dict) else None
    if isinstance(g, dict) and isinstance(g.get("format"), str):
        fmt = g["format"]
    if not isinstance(w, dict):
        raise ConfigError(f"config.json: {where} expected an object, got {_show(w)}")
    bits, typ, strategy, gs = w.get("num_bits"), w.get("type"), w.get("strategy"), w.get("group_size")
    if typ != "float" or bits not in (4, 8):
        raise ConfigError(f"config.json: {where} expected float weights of 8 bits (FP8 E4M3, MXFP8) or 4 bits "
                          f"(MXFP4, NVFP4), got num_bits {_show(bits)} type {_show(typ)} (integer formats: AWQ, "
                          f"GPTQ, int4 groups, format {_show(fmt)}, are not supported)")
    if bits == 8 and strategy == "channel":
        kind = ("fp8", (0, 0))
    elif bits == 8 and strategy == "block":
        kind = ("fp8", _block(w.get("block_structure"), f"{where}.block_structure"))
    elif bits == 8 and strategy in ("group", "tensor_group"):
        if gs != 32:
            raise ConfigError(f"config.json: {where}.group_size {_show(gs)} is not one MXFP8 allows; expected 32 "
                              f"(an E8M0 scale per 32 weights)")
        kind = ("mxfp8", (1, 32))
    elif bits == 4 and strategy in ("group", "tensor_group"):
        if gs not in (16, 32):
            raise ConfigError(f"config.json: {where}.group_size {_show(gs)} is not one a 4-bit float format "
                              f"allows; expected 16 (NVFP4) or 32 (MXFP4)")
        kind = ("nvfp4" if gs == 16 else "mxfp4", (0, 0))
    else:
        raise ConfigError(f"config.json: {where}.strategy {_show(strategy)} is not supported for {bits}-bit "
                          f"float weights; expected 'channel' or 'block' (FP8), 'group' / 'tensor_group' (MXFP8, "
                          f"MXFP4, NVFP4)")
    if fmt is not None and fmt != "mixed-precision" and fmt != CT_FORMATS[kind[0]]:
        raise ConfigError(f"config.json: {where}: {kind[0]} weights expected format {CT_FORMATS[kind[0]]!r}, "
                          f"got {_show(fmt)}")
    return kind


def _names(v: Any, name: str) -> tuple[str, ...]:
    if v is None:
        return ()
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ConfigError(f"config.json: {name} expected a list of module names, got {_show(v)}")
    return tuple(v)


def _quant(d: dict) -> tuple[str, tuple[int, int], str, tuple[str, ...], tuple[str, ...]]:
    """``quantization_config`` -> (``weight_quant``, ``fp8_block``, ``quant_container``,
    ``quant_formats``, ``quant_ignore``): ("", (0, 0), "", (), ()) for none; ("fp8", (bn, bk)) for
    block scales, ("fp8", (0, 0)) for per-channel scales, ("fp8", (1, 32)) for MXFP8 alone.

    Read: FP8 E4M3 weights as DeepSeek-V3 / GLM FP8 releases store them
    (``quant_method: "fp8"`` with ``weight_block_size``); compressed-tensors containers
    (``format`` "float-quantized", "mxfp8-quantized", "mxfp4-pack-quantized",
    "nvfp4-pack-quantized" or "mixed-precision" with a format per group; ``ignore`` lists the
    modules left unquantized); NVIDIA ModelOpt's NVFP4 (``quant_method: "modelopt"``,
    ``quant_algo: "NVFP4"``, ``exclude_modules``). Activations stay FP32 whatever the config says
    of them (mtpkern dequantizes the weights; it never quantizes activations: docs/fp8.md).
    Anything else is refused, naming it."""
    q = d.get("quantization_config")
    if q is None:
        return "", (0, 0), "", (), ()
    if not isinstance(q, dict):
        raise ConfigError(f"config.json: field 'quantization_config' expected an object, got {_show(q)}")
    method = q.get("quant_method")
    if method == "fp8":
        fmt = q.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ConfigError(f"config.json: quantization_config.fmt {_show(fmt)} is not supported; expected 'e4m3'")
        return "fp8", _block(q.get("weight_block_size"), "quantization_config.weight_block_size"), "", (), ()
    if method == "compressed-tensors":
        groups = q.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise ConfigError("config.json: quantization_config.config_groups expected a non-empty object")
        fmt = q.get("format")
        if fmt is not None and fmt not in (*CT_FORMATS.values(), "mixed-precision"):
            raise ConfigError(f"config.json: quantization_config.format {_show(fmt)} is not supported; expected one "
                              f"of {sorted(CT_FORMATS.values()) + ['mixed-precision']} (integer formats such as "
                              f"'pack-quantized': AWQ, GPTQ, int4 groups, are not)")
        kinds = [_ct_group(name, g, fmt) for name, g in groups.items()]
        fp8 = sorted({b for k, b in kinds if k == "fp8"})
        if len(fp8) > 1:
            raise ConfigError(f"config.json: quantization_config.config_groups mix scale layouts {fp8}")
        formats = tuple(sorted({k for k, _ in kinds if k != "fp8"}))
        ignore = _names(q.get("ignore"), "quantization_config.ignore")
        if not formats:
            return "fp8", fp8[0], "", (), ()
        e4m3 = bool(fp8) or "mxfp8" in formats
        return ("fp8" if e4m3 else "", fp8[0] if fp8 else (1, 32) if e4m3 else (0, 0), "compressed-tensors",
                formats, ignore)
    if method == "modelopt":
        inner = q.get("quantization") if isinstance(q.get("quantization"), dict) else q
        algo, gs = inner.get("quant_algo"), inner.get("group_size", 16)
        if algo != "NVFP4":
            raise ConfigError(f"config.json: quantization_config.quant_algo {_show(algo)} is not supported; "
                              f"expected 'NVFP4' (ModelOpt)")
        if gs != 16:
            raise ConfigError(f"config.json: quantization_config.group_size {_show(gs)} is not one NVFP4 allows; "
                              f"expected 16")
        return "", (0, 0), "modelopt", ("nvfp4",), _names(inner.get("exclude_modules"),
                                                           "quantization_config.exclude_modules")
    raise ConfigError(f"config.json: quantization_config.quant_method {_show(method)} is not supported; "
                      f"expected 'fp8', 'compressed-tensors' (FP8, MXFP8, MXFP4, NVFP4) or 'modelopt' (NVFP4)")


def _expert_quant(d: dict) -> str:
    """DeepSeek-V4's ``expert_dtype`` -> ``expert_quant``: "fp4" (projections stored packed FP4
    with E8M0 scales load as FP4: docs/fp4.md) or "" ("fp8" or absent: as ``quantization_config``
    says). V4 writes it at the top level, V4.1 (and transformers, which moves V4's there) inside
    ``quantization_config``; both are read and must agree."""
    q = d.get("quantization_config")
    found = {}
    if "expert_dtype" in d:
        found["expert_dtype"] = d["expert_dtype"]
    if isinstance(q, dict) and "expert_dtype" in q:
        found["quantization_config.expert_dtype"] = q["expert_dtype"]
    for name, v in found.items():
        if v not in ("fp4", "fp8"):
            raise ConfigError(f"config.json: field {name!r} expected 'fp4' or 'fp8', got {_show(v)}")
    if len(set(found.values())) > 1:
        raise ConfigError(f"config.json: fields 'expert_dtype' ({_show(found['expert_dtype'])}) and "
                          f"'quantization_config.expert_dtype' "
                          f"({_show(found['quantization_config.expert_dtype'])}) disagree")
    return "fp4" if "fp4" in found.values() else ""


def _block(v: Any, name: str) -> tuple[int, int]:
    if (not isinstance(v, list) or len(v) != 2 or not all(isinstance(x, int) and not isinstance(x, bool)
                                                           and 1 <= x <= 4096 for x in v)):
        raise ConfigError(f"config.json: {name} expected [block rows, block columns] in 1 .. 4096, got {_show(v)}")
    return int(v[0]), int(v[1])


def _unwrap(d: dict) -> dict:
    """A wrapper's config (``Family.wrappers``: e.g. transformers' ``Step3p7Config``, a
    vision-language model whose ``text_config`` is a Step-3.5 text model) -> that text
    config, with the family's model_type and the wrapper's ``quantization_config`` (a
    vision tower and a projector have no MTP modules). Any other config as it is."""
    wrappers = by_wrapper()
    mt, archs = d.get("model_type"), d.get("architectures")
    names = ([mt] if isinstance(mt, str) else []) + (
        [a for a in archs if isinstance(a, str)] if isinstance(archs, list) else [])
    fams = {wrappers[n].model_type: wrappers[n] for n in names if n in wrappers}
    if not fams:
        return d
    outer = mt if isinstance(mt, str) else archs[0]
    if len(fams) > 1 or any(n not in wrappers for n in names):
        raise ConfigError(f"config.json: model_type {_show(mt)} and architectures {_show(archs)} name different "
                          f"models; expected one of {sorted(wrappers)}")
    fam = fams.popitem()[1]
    inner = d.get("text_config")
    if not isinstance(inner, dict):
        raise ConfigError(f"config.json: a {outer!r} config holds its text model under 'text_config'; "
                          f"expected an object there, got {_show(inner)}")
    if inner.get("model_type", fam.model_type) not in (fam.model_type, *fam.text_model_types):
        want = " or ".join(repr(t) for t in (fam.model_type, *fam.text_model_types))
        raise ConfigError(f"config.json: text_config.model_type expected {want} (a {outer!r} config), "
                          f"got {_show(inner.get('model_type'))}")
    out = {k: v for k, v in inner.items() if k != "architectures"}
    out["model_type"] = fam.model_type
    if d.get("quantization_config") is not None and out.get("quantization_config") is None:
        out["quantization_config"] = d["quantization_config"]
    return out


def _family(d: dict) -> Family:
    """The family the config names (by model_type and/or its architectures), the
    canonical layout for a config that names neither."""
    mt = d.get("model_type")
    if mt is not None and (not isinstance(mt, str) or mt not in FAMILIES):
        raise ConfigError(f"config.json: model_type {_show(mt)} is not supported; supported: {supported()}")
    archs = d.get("architectures")
    if archs is None or archs == []:
        return CANONICAL if mt is None else FAMILIES[mt]
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ConfigError(f"config.json: field 'architectures' expected a list of names, got {_show(archs)}")
    arch_family = by_architecture()
    for a in archs:
        if a not in arch_family:
            raise ConfigError(f"config.json: architecture {a!r} is not supported; supported: {supported()}")
        if mt is not None and arch_family[a].model_type != mt:
            raise ConfigError(f"config.json: architecture {a!r} is a {arch_family[a].model_type} model, "
                              f"but model_type is {mt!r}")
    return arch_family[archs[0]]


def _with_family(d: dict, fam: Family) -> dict:
    """``d`` with the family's names for our fields read as ours (refused when both
    are given and differ) and the features the family implies (refused when the
    config says otherwise)."""
    if fam.normalise is not None:
        d = fam.normalise(d)
    out = dict(d)
    for theirs, ours in fam.aliases.items():
        if d.get(theirs) is None:
            continue
        if d.get(ours) is not None and not _same(d[ours], d[theirs]):
            raise ConfigError(f"config.json: field {theirs!r} = {_show(d[theirs])} disagrees with {ours!r} = "
                              f"{_show(d[ours])}; a {fam.model_type} config gives one of them")
        out[ours] = d[theirs]
    for name, value in fam.fixed.items():
        if d.get(name) is not None and not _same(d[name], value):
            raise ConfigError(f"config.json: field {name!r} = {_show(d[name])}, but every {fam.title} module "
                              f"has {name} = {_show(value)}")
        out[name] = value
    for name, value in fam.defaults.items():          # the family's config class defaults
        if out.get(name) is None and name not in _ROPE_KEYS:   # (RoPE defaults: _rope reads both places)
            out[name] = value
    return out


def _refuse_unimplemented(d: dict, fam: Family) -> None:
    for name, value in d.items():
        if name in fam.implements or name in fam.target_only or name in fam.aliases:
            continue
        rule = UNIMPLEMENTED_FIELDS.get(name)
        if rule is None:
            rule = next((r for p, r in UNIMPLEMENTED_PREFIXES.items() if name.startswith(p)), None)
        if rule is not None and not rule.off(value, d):
            raise ConfigError(f"config.json: field {name!r} = {_show(value)} is not supported yet "
                              f"({rule.reason}); expected it {rule.expected}")


def _same(a: Any, b: Any) -> bool:
    return isinstance(a, bool) == isinstance(b, bool) and a == b


def _check_same_as(d: dict, cfg: "MtpConfig") -> None:
    for name, ours in SAME_AS.items():
        value = d.get(name)
        if value is not None and not _same(value, getattr(cfg, ours)):
            raise ConfigError(f"config.json: field {name!r} = {_show(value)} disagrees with {ours} = "
                              f"{_show(getattr(cfg, ours))}, which mtpkern reads; expected them equal, or {name!r} absent")


def _rope(d: dict, fam: Family) -> tuple[float, float, Yarn | None]:
    """(rope_theta, partial_rotary_factor, YaRN scaling or None), from rope_parameters /
    rope_scaling or the top level.

    Both objects are read when both are given (transformers 5 writes rope_parameters,
    older releases rope_scaling): their rope types must agree, and where both give a
    value the values must agree. A scaling other than YaRN is refused."""
    objs = []
    for name in ("rope_parameters", "rope_scaling"):
        rope = d.get(name)
        if rope is None:
            continue
        if not isinstance(rope, dict):
            raise ConfigError(f"config.json: field {name!r} expected an object, got {_show(rope)}")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type is None:
            rope_type = "default"
        if not isinstance(rope_type, str) or rope_type not in _ROPE_TYPES:
            raise ConfigError(f"config.json: {name}.rope_type {_show(rope_type)} is not supported; "
                              f"expected one of {list(_ROPE_TYPES)}")
        keys = _ROPE_KEYS + (tuple(_YARN_KEYS) if rope_type == "yarn" else ())
        for key in rope:
            if key not in keys:
                raise ConfigError(f"config.json: {name}.{key} is not supported (rope_type {rope_type!r} reads only "
                                  f"{', '.join(keys)}), got {_show(rope[key])}")
        objs.append((name, rope, rope_type))
    if len(objs) == 2:
        (_, ra, ta), (_, rb, tb) = objs
        if ta != tb:
            raise ConfigError(f"config.json: rope_parameters.rope_type {ta!r} disagrees with rope_scaling.rope_type "
                              f"{tb!r}")
        for key in ("rope_theta", "partial_rotary_factor") + tuple(_YARN_KEYS):
            typ = _YARN_KEYS.get(key, (float,))[0]
            a, b = _opt(ra, key, typ, None), _opt(rb, key, typ, None)
            if a is not None and b is not None and not _same(a, b):
                raise ConfigError(f"config.json: rope_parameters.{key} ({a}) disagrees with rope_scaling.{key} ({b})")
    name, _, rope_type = objs[0] if objs else ("rope_parameters", {}, "default")
    merged = {k: v for _, r, _ in reversed(objs) for k, v in r.items()}
    # Glm4MoeConfig's partial_rotary_factor default is 0.5; DeepseekV3-style configs rotate whole heads.
    prf_default = fam.defaults.get("partial_rotary_factor", 1.0)
    theta = _rope_value(d, merged, name, "rope_theta", fam.defaults.get("rope_theta", 10000.0))
    prf = _rope_value(d, merged, name, "partial_rotary_factor", prf_default)
    return theta, prf, (_yarn(d, merged, name) if rope_type == "yarn" else None)


def _yarn(d: dict, rope: dict, name: str) -> Yarn:
    """YaRN's fields from the RoPE object ``rope`` (Hugging Face's names and defaults;
    ``original_max_position_embeddings`` defaults to ``max_position_embeddings``, as
    transformers before 4.46 did; ``factor`` to their ratio, as transformers does)."""
    got = {}
    for key, (typ, field) in _YARN_KEYS.items():
        if rope.get(key) is not None:
            got[field] = _typed(f"{name}.{key}", rope[key], typ)
    max_pos = _opt(d, "max_position_embeddings", int, 4096)
    got.setdefault("original_max_position_embeddings", max_pos)
    if "factor" not in got:
        if got["original_max_position_embeddings"] == max_pos:
            raise ConfigError(f"config.json: {name}.factor is required by rope_type 'yarn' (or an "
                              f"original_max_position_embeddings below max_position_embeddings = {max_pos})")
        got["factor"] = max_pos / got["original_max_position_embeddings"]
    try:
        return Yarn(**got)
    except BlockError as e:
        raise ConfigError(f"config.json: {name}: {e}") from None


def _rope_value(d: dict, rope: dict, name: str, key: str, default: float) -> float:
    """``key`` from the RoPE object, else from the top level, else ``default``; refused
    when both places give it and they disagree."""
    inner, outer = _opt(rope, key, float, None), _opt(d, key, float, None)
    if inner is not None and outer is not None and inner != outer:
        raise ConfigError(f"config.json: {name}.{key} ({inner}) disagrees with the top-level {key} ({outer})")
    return next((v for v in (inner, outer) if v is not None), default)


def _in_file(e: ConfigError, path: str | os.PathLike) -> str:
    """The message of ``e`` with the file's path in place of the generic 'config.json: '."""
    msg = str(e)
    return f"{os.fspath(path)}: {msg.removeprefix(_PREFIX)}"


def _check_ranges(cfg: "MtpConfig") -> None:
    for name, (lo, hi) in INT_RANGES.items():
        v = getattr(cfg, name)
        if type(v) is not int:
            raise ConfigError(f"config.json: field {name!r} expected int, got {type(v).__name__} {_show(v)}")
        if not lo <= v <= hi:
            raise ConfigError(f"config.json: field {name!r} must be in [{lo}, {hi}], got {v}")
    for name, (lo, hi) in FLOAT_RANGES.items():
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(f"config.json: field {name!r} expected float, got {type(v).__name__} {_show(v)}")
        if not (math.isfinite(v) and lo < v <= hi):
            want = f"finite and > {lo:g}" if hi == math.inf else f"in ({lo:g}, {hi:g}]"
            raise ConfigError(f"config.json: field {name!r} must be {want}, got {v} ({FLOAT_RANGE_REASONS[name]})")
    for name in _BOOL_FIELDS:
        v = getattr(cfg, name)
        if not isinstance(v, bool):
            raise ConfigError(f"config.json: field {name!r} expected bool, got {type(v).__name__} {_show(v)}")


def _normalise_blocks(blocks: Any, M: int) -> tuple:
    """Per-module overrides (a list of dicts, or of (field, value) pairs) -> a tuple of M
    sorted ((field, value), ...) tuples; () when none overrides anything."""
    if blocks is None or (isinstance(blocks, (list, tuple)) and len(blocks) == 0):
        return ()
    if not isinstance(blocks, (list, tuple)) or len(blocks) != M:
        n = len(blocks) if isinstance(blocks, (list, tuple)) else type(blocks).__name__
        raise ConfigError(f"config.json: field 'mtp_blocks' expected a list of {M} objects (one per module), got {n}")
    out = []
    for m, b in enumerate(blocks):
        items = b.items() if isinstance(b, dict) else b
        try:
            pairs = tuple(sorted(((str(k), v) for k, v in items), key=lambda kv: kv[0]))
        except (TypeError, ValueError):
            raise ConfigError(f"config.json: mtp_blocks[{m}] expected an object, got {_show(b)}") from None
        names = [k for k, _ in pairs]
        twice = sorted({k for k in names if names.count(k) > 1})
        if twice:                      # (field, value) pairs: which value holds would be a guess
            raise ConfigError(f"config.json: mtp_blocks[{m}] gives field {twice[0]!r} more than once "
                              f"({[v for k, v in pairs if k == twice[0]]}); expected each field at most once")
        out.append(pairs)
    return tuple(out) if any(out) else ()


@dataclass(frozen=True, slots=True)
class MtpConfig:
    """Everything the drafter needs to know about the checkpoint's shapes.

    ``is_moe`` tells whether the MTP modules use routed experts (else a dense
    SwiGLU MLP of ``intermediate_size``).
    """

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    num_hidden_layers: int
    num_nextn_predict_layers: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 1.0
    attention_bias: bool = False
    use_qk_norm: bool = False
    intermediate_size: int = 0
    n_routed_experts: int = 0
    num_experts_per_tok: int = 0
    n_shared_experts: int = 0
    moe_intermediate_size: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    scoring_func: ScoringFunc = "sigmoid"
    first_k_dense_replace: int = 0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    #: the checkpoint's family (mtpkern/models/: names, folds, block features); "" = the canonical layout
    family: str = ""
    #: "fp8": the modules' projections are FP8 E4M3 with scales (quantization_config);
    #: ``fp8_block`` (rows, columns) of a block scale, (0, 0) for per-channel scales
    weight_quant: str = ""
    fp8_block: tuple[int, int] = (0, 0)
    #: "fp4": projections stored in the packed FP4 form (int8 [N, K / 2], E2M1 codes, with E8M0
    #: scales per 32 weights: DeepSeek-V4's routed experts, ``expert_dtype: "fp4"``) load as
    #: FP4 (docs/fp4.md); the others stay as ``weight_quant`` says. Needs weight_quant "fp8".
    expert_quant: str = ""
    #: the container of 4-bit / MX weights: "compressed-tensors" or "modelopt" ("" none); its
    #: ``quant_formats`` (of ``QUANT_FORMATS``: what its config announces) and ``quant_ignore``
    #: (modules it leaves unquantized: names or "re:" patterns). Each projection loads as its
    #: tensors say (docs/fp4.md, "Containers")
    quant_container: str = ""
    quant_formats: tuple = ()
    quant_ignore: tuple = ()
    # -- block features (a family switches them on; mtpkern/models/) --------------
    #: the attention output gated by sigmoid: "" none; "elementwise": q_proj carries a
    #: gate per query dim (Qwen3-Next), stacked after q|k|v in the fused projection
    attn_gate: str = ""
    #: the shared expert's output scaled by sigmoid(x . w_g) (Qwen3-Next)
    shared_expert_gate: bool = False
    #: the router selects with an e_score_correction_bias (False: none, zeros)
    router_bias: bool = True
    # -- the default block of every module (mtpkern/block.py), and per-module overrides --
    #: the value head dim, 0: head_dim (MiMo-V2: 128 beside 192)
    v_head_dim: int = 0
    #: 0: full attention; W: each row sees the W keys ending at itself
    sliding_window: int = 0
    #: a learned softmax sink per query head (``self_attn.sinks`` [Hq])
    attn_sinks: bool = False
    #: SwiGLU clamps (0: none) of the routed experts, and of the shared expert / dense MLP
    swiglu_clamp: float = 0.0
    swiglu_clamp_shared: float = 0.0
    #: both clamps bound the gate before silu (DeepSeek-V4, GLM-5.3), not silu(gate) (Step-3.5)
    swiglu_clamp_gate: bool = False
    #: RoPE pairs (2i, 2i + 1) instead of neox halves (``rope_interleave``: DeepSeek-V3, GLM-4.7-Flash)
    rope_interleave: bool = False
    #: the MLPs' activation (mtpkern/block.py ``MLP_ACTS``): "swiglu", "relu2" (Nemotron-H's
    #: non-gated ``down(relu(up x) ** 2)``) or "situ" (Kimi K3's SituAndMul)
    mlp_act: str = "swiglu"
    #: SiTU's beta and linear beta (config.json ``activation_situ_beta`` /
    #: ``activation_situ_linear_beta``; mtpkern.ops.mlp.situ_act); 0: not set / no linear beta
    situ_beta: float = 0.0
    situ_linear_beta: float = 0.0
    #: no RoPE in the attention (Nemotron-H)
    nope: bool = False
    #: LatentMoE (Nemotron-3 Super / Ultra): the routed experts run on a latent of this width,
    #: ``fc1_latent_proj`` [latent, H] before them and ``fc2_latent_proj`` [H, latent] after their
    #: weighted sum (the router and the shared expert read the hidden); 0: none
    moe_latent_size: int = 0
    #: LatentMoE with an RMSNorm (``mlp.latent_norm.weight`` [latent], eps ``rms_norm_eps``) of the
    #: routed experts' weighted sum (routed_scaling_factor already in the weights), before
    #: ``fc2_latent_proj`` (Kimi K3); needs moe_latent_size > 0
    moe_latent_norm: bool = False
    #: YaRN scaling (``rope_type: "yarn"`` in rope_parameters / rope_scaling), None: plain RoPE
    rope_scaling: Yarn | None = None
    #: v multiplied by this before attention (MiMo-V2): folded into v_proj at load
    attention_value_scale: float = 1.0
    #: MLA (mtpkern/block.py): kv_lora_rank L > 0; q_lora_rank (0: q_proj); qk_rope_head_dim R,
    #: with head_dim = qk_nope_head_dim + R and v_head_dim the value head dim
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    #: q_a_layernorm's / kv_a_layernorm's output multiplied by this (LongCat-Flash's
    #: mla_scale_q_lora / mla_scale_kv_lora): folded into the norm weights at load
    q_a_norm_scale: float = 1.0
    kv_a_norm_scale: float = 1.0
    #: DSA (mtpkern/block.py, mtpkern.ops.dsa): index_topk T > 0 runs each MLA module's own
    #: indexer of index_n_heads heads of index_head_dim; its RoPE pairs with indexer_rope_interleave
    index_topk: int = 0
    index_n_heads: int = 0
    index_head_dim: int = 0
    indexer_rope_interleave: bool = False
    #: GLM-5.3's pooled indexer (index_kpool > 1: pools of that many rows) and its tail
    index_kpool: int = 0
    index_kpool_always_select_tail: bool = True
    #: hyper-connections (DeepSeek-V4's mHC, mtpkern.ops.hc): hc_mult > 1 streams of hidden_size
    #: per token, the hidden an engine hands over and a module hands on (``stream_size``);
    #: hc_sinkhorn_iters and hc_eps make the streams' mixing matrix
    #: DeepSeek-V4's attention in a GQA block (mtpkern/block.py): K = V, the output's rotary
    #: dims turned back, a grouped low-rank output projection
    shared_kv: bool = False
    out_rope: bool = False
    o_groups: int = 0
    o_lora_rank: int = 0
    hc_mult: int = 1
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    #: vLLM's position-0 mask: the token embedding of the row vLLM numbers position 0 is zeroed
    #: before enorm (its embedding half of eh_proj's input is then zero). vLLM gives an MTP row
    #: its hidden's position; mtpkern's RoPE position is the token's, one more: the row is
    #: module 0's key 0, (t_1, h_0), at RoPE position 1 (``EMBED_MASK_POSITION``, docs/model.md)
    embed_mask_pos0: bool = False
    #: per module, the BlockSpec fields that differ from the default block (a family's
    #: layer_types, per-layer RoPE, dense MTP blocks in a MoE model ...): a tuple of
    #: ((field, value), ...) per module, or () when every module is the default block
    blocks: tuple = ()

    def __post_init__(self) -> None:
        if self.family != "" and self.family not in FAMILIES:
            raise ConfigError(f"config.json: family {self.family!r} is not supported; supported: {supported()}")
        if self.weight_quant not in ("", "fp8"):
            raise ConfigError(f"config.json: weight_quant expected '' or 'fp8', got {self.weight_quant!r}")
        if self.expert_quant not in ("", "fp4"):
            raise ConfigError(f"config.json: expert_quant expected '' or 'fp4', got {self.expert_quant!r}")
        if self.quant_container not in ("", "compressed-tensors", "modelopt"):
            raise ConfigError(f"config.json: quant_container expected '', 'compressed-tensors' or 'modelopt', "
                              f"got {self.quant_container!r}")
        object.__setattr__(self, "quant_formats", tuple(self.quant_formats))
        object.__setattr__(self, "quant_ignore", tuple(self.quant_ignore))
        if (bool(self.quant_container) != bool(self.quant_formats)
                or not set(self.quant_formats) <= set(QUANT_FORMATS)):
            raise ConfigError(f"config.json: quant_formats expected some of {QUANT_FORMATS} with a quant_container, "
                              f"got {self.quant_formats!r} with {self.quant_container!r}")
        if self.expert_quant and self.weight_quant != "fp8":
            raise ConfigError("config.json: expert_dtype 'fp4' needs quantization_config.quant_method 'fp8' "
                              "(DeepSeek-V4's layout), got no FP8 quantization_config")
        _check_ranges(self)
        if isinstance(self.rope_scaling, dict):
            try:
                object.__setattr__(self, "rope_scaling", Yarn.from_mapping(self.rope_scaling))
            except BlockError as e:
                raise ConfigError(f"config.json: {e}") from None
        object.__setattr__(self, "blocks", _normalise_blocks(self.blocks, self.num_nextn_predict_layers))
        specs = [self._checked_block(m) for m in range(self.num_modules)]
        if self.scoring_func not in get_args(ScoringFunc):
            raise ConfigError(f"config.json: field 'scoring_func' expected one of {get_args(ScoringFunc)}, "
                              f"got {self.scoring_func!r}")
        v4 = [b for b in specs if b.shared_kv or (b.q_lora_rank and not b.mla)]
        if self.attention_bias and v4:
            name = "q_lora_rank" if v4[0].q_lora_rank else "shared_kv"
            raise ConfigError(f"config.json: field {name!r} = {getattr(v4[0], name)!r}: a GQA block with q_lora_rank "
                              "or shared_kv has no q/k/v biases (DeepSeek-V4's attention); expected attention_bias "
                              "false, got true")
        if any(b.mla for b in specs) and (self.use_qk_norm or self.attention_bias):
            raise ConfigError(f"config.json: an MLA module has no q/k norms or q/k/v biases; expected use_qk_norm and "
                              f"attention_bias false, got {self.use_qk_norm} and {self.attention_bias}")
        if any(b.moe for b in specs):
            if not self.is_moe:
                raise ConfigError("config.json: an MoE MTP module needs n_routed_experts > 0 (mtp_blocks sets moe)")
            self._check_moe()
        if not all(b.moe for b in specs) and self.intermediate_size <= 0:
            raise ConfigError(
                "config.json: a dense MTP module needs intermediate_size > 0 "
                f"(got {self.intermediate_size}); set n_routed_experts for an MoE module"
            )

    def _checked_block(self, m: int) -> BlockSpec:
        over = dict(self.blocks[m]) if self.blocks else {}
        where = f" (module {m}, mtp_blocks)" if over else ""
        for name, v in over.items():                 # the global fields' ranges bound the overrides too
            lo, hi = INT_RANGES.get(name, (None, None))
            if lo is not None and (type(v) is not int or not lo <= v <= hi):
                raise ConfigError(f"config.json: field {name!r} must be an int in [{lo}, {hi}], got {_show(v)}{where}")
            lo, hi = FLOAT_RANGES.get(name, (None, None))
            if lo is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                                   or not (math.isfinite(v) and lo < v <= hi)):
                raise ConfigError(f"config.json: field {name!r} must be in ({lo:g}, {hi:g}], got {_show(v)}{where} "
                                  f"({FLOAT_RANGE_REASONS[name]})")
        try:
            return self.block(m)
        except BlockError as e:
            raise ConfigError(f"config.json: {e}{where}") from None

    def block(self, m: int) -> BlockSpec:
        """Module ``m``'s block: the default block (the global fields) with its overrides."""
        base = self.block_default()
        over = self.blocks[m] if self.blocks else ()
        return base.with_overrides(dict(over), f"module {m}") if over else base

    def target_block(self, layer: int) -> BlockSpec:
        """Target decoder layer ``layer``'s block (``model.layers.{layer}``, ``layer <
        num_hidden_layers``): the default block, dense (``intermediate_size``) for GLM-4.5's
        first ``first_k_dense_replace`` layers or a config without experts, MoE after
        (``Glm4MoeDecoderLayer``). Per-module overrides (``blocks``) describe MTP modules only."""
        if not 0 <= layer < self.num_hidden_layers:
            raise ValueError(f"layer: expected 0 <= layer < num_hidden_layers = {self.num_hidden_layers}, got {layer}")
        base = self.block_default()
        moe = self.is_moe and layer >= self.first_k_dense_replace
        if not moe and self.intermediate_size <= 0:
            raise ConfigError(f"config.json: field 'intermediate_size' must be > 0 for the dense target layer {layer} "
                              f"(first_k_dense_replace {self.first_k_dense_replace}, n_routed_experts "
                              f"{self.n_routed_experts}), got {self.intermediate_size}")
        return base if base.moe == moe else replace(base, moe=moe)

    def block_default(self) -> BlockSpec:
        """The block the global fields describe (every module's, but for its overrides)."""
        return BlockSpec(
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim, v_head_dim=self.v_head_dim, partial_rotary_factor=self.partial_rotary_factor,
            rope_theta=self.rope_theta, sliding_window=self.sliding_window, attn_sinks=self.attn_sinks,
            attn_gate=self.attn_gate, moe=self.is_moe, swiglu_clamp=self.swiglu_clamp,
            swiglu_clamp_shared=self.swiglu_clamp_shared, swiglu_clamp_gate=self.swiglu_clamp_gate,
            rope_interleave=self.rope_interleave, mlp_act=self.mlp_act, nope=self.nope,
            situ_beta=self.situ_beta, situ_linear_beta=self.situ_linear_beta,
            rope_scaling=self.rope_scaling, kv_lora_rank=self.kv_lora_rank, q_lora_rank=self.q_lora_rank,
            qk_rope_head_dim=self.qk_rope_head_dim, index_topk=self.index_topk,
            index_n_heads=self.index_n_heads if self.index_topk else 0,
            index_head_dim=self.index_head_dim if self.index_topk else 0,
            indexer_rope_interleave=self.indexer_rope_interleave and self.index_topk > 0,
            index_kpool=self.index_kpool if self.index_topk else 0,
            index_kpool_tail=self.index_kpool_always_select_tail,
            shared_kv=self.shared_kv, out_rope=self.out_rope, o_groups=self.o_groups, o_lora_rank=self.o_lora_rank)

    def _check_moe(self) -> None:
        for name in ("num_experts_per_tok", "moe_intermediate_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"config.json: field {name!r} must be > 0 in an MoE module, got {getattr(self, name)}")
        E, G = self.n_routed_experts, self.n_group
        if not 0 <= self.moe_latent_size <= 1 << 20:
            raise ConfigError(f"config.json: field 'moe_latent_size' must be an int in [0, 2^20] (0: none), got "
                              f"{self.moe_latent_size!r}")
        if self.moe_latent_norm and not self.moe_latent_size:
            raise ConfigError("config.json: field 'moe_latent_norm' = true (a norm of the latent experts' sum) needs "
                              "moe_latent_size > 0, got 0")
        if E % G:
            raise ConfigError(f"config.json: n_routed_experts ({E}) must be a multiple of n_group ({G})")
        if self.topk_group > G:
            raise ConfigError(f"config.json: topk_group ({self.topk_group}) must be <= n_group ({G})")
        if self.num_experts_per_tok > self.topk_group * (E // G):
            raise ConfigError(
                f"config.json: num_experts_per_tok ({self.num_experts_per_tok}) exceeds the experts in "
                f"topk_group groups ({self.topk_group} * {E // G})"
            )

    # -- derived shapes ---------------------------------------------------
    @property
    def num_modules(self) -> int:
        return self.num_nextn_predict_layers

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def stream_size(self) -> int:
        """Values of the hidden a target hands over and a module hands on: ``hc_mult`` streams
        of ``hidden_size`` (``hidden_size`` without hyper-connections)."""
        return self.hc_mult * self.hidden_size

    @property
    def is_moe(self) -> bool:
        """MoE iff routed experts are configured. MTP layers always lie past the target's
        dense prefix (``first_k_dense_replace``); Hugging Face builds every MTP layer as
        MoE whatever that prefix is, and so do we."""
        return self.n_routed_experts > 0

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.n_shared_experts

    @property
    def bitmask_words(self) -> int:
        """Width W of an xgrammar bitmask for this vocabulary: ceil(V / 32) int32 words."""
        return (self.vocab_size + 31) // 32

    def layer_index(self, module: int) -> int:
        """Index of module ``module`` under ``model.layers.``."""
        return self.num_hidden_layers + module

    # -- (de)serialisation ------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict) -> "MtpConfig":
        """Parse and validate a config.json body; refuse what would load wrongly (module docstring)."""
        if not isinstance(d, dict):
            raise ConfigError(f"config.json: expected a JSON object, got {type(d).__name__}")
        d = _unwrap(d)
        fam = _family(d)
        _refuse_unimplemented(d, fam)
        quant = _quant(d)
        d = _with_family(d, fam)
        expert_quant = _expert_quant(d)          # (DeepSeek-V4's normalise supplies the release's default)
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"config.json: hidden_act expected 'silu', got {_show(act)}")
        H = _req(d, "hidden_size", int)
        Hq = _req(d, "num_attention_heads", int)
        theta, prf, yarn = _rope(d, fam)
        cfg = cls(
            hidden_size=H,
            num_attention_heads=Hq,
            num_key_value_heads=_opt(d, "num_key_value_heads", int, Hq),
            head_dim=_mla_head_dim(d) or _head_dim(d, H, Hq),
            vocab_size=_req(d, "vocab_size", int),
            num_hidden_layers=_req(d, "num_hidden_layers", int),
            num_nextn_predict_layers=_req(d, "num_nextn_predict_layers", int),
            rms_norm_eps=_opt(d, "rms_norm_eps", float, 1e-5),
            rope_theta=theta,
            partial_rotary_factor=prf,
            rope_interleave=_opt(d, "rope_interleave", bool, False),
            rope_scaling=yarn,
            attention_bias=_opt(d, "attention_bias", bool, False),
            use_qk_norm=_opt(d, "use_qk_norm", bool, False),
            intermediate_size=_opt(d, "intermediate_size", int, 0),
            n_routed_experts=_opt(d, "n_routed_experts", int, 0),
            num_experts_per_tok=_opt(d, "num_experts_per_tok", int, 0),
            n_shared_experts=_opt(d, "n_shared_experts", int, 0),
            moe_intermediate_size=_opt(d, "moe_intermediate_size", int, 0),
            n_group=_opt(d, "n_group", int, 1),
            topk_group=_opt(d, "topk_group", int, 1),
            routed_scaling_factor=_opt(d, "routed_scaling_factor", float, 1.0),
            norm_topk_prob=_opt(d, "norm_topk_prob", bool, True),
            scoring_func=_opt(d, "scoring_func", str, "sigmoid"),
            first_k_dense_replace=_opt(d, "first_k_dense_replace", int, 0),
            tie_word_embeddings=_opt(d, "tie_word_embeddings", bool, False),
            max_position_embeddings=_opt(d, "max_position_embeddings", int, 4096),
            family=fam.model_type,
            weight_quant=quant[0],
            fp8_block=quant[1],
            quant_container=quant[2],
            quant_formats=quant[3],
            quant_ignore=quant[4],
            expert_quant=expert_quant,
            attn_gate=_opt(d, "attn_gate", str, ""),
            shared_expert_gate=_opt(d, "shared_expert_gate", bool, False),
            router_bias=_opt(d, "router_bias", bool, True),
            v_head_dim=_opt(d, "v_head_dim", int, 0),
            sliding_window=_window(d),
            attn_sinks=_opt(d, "attn_sinks", bool, False),
            swiglu_clamp=_opt(d, "swiglu_clamp", float, 0.0),
            swiglu_clamp_shared=_opt(d, "swiglu_clamp_shared", float, 0.0),
            swiglu_clamp_gate=_opt(d, "swiglu_clamp_gate", bool, False),
            mlp_act=_opt(d, "mlp_act", str, "swiglu"),
            nope=_opt(d, "nope", bool, False),
            moe_latent_size=_opt(d, "moe_latent_size", int, 0),
            moe_latent_norm=_opt(d, "moe_latent_norm", bool, False),
            situ_beta=_opt(d, "activation_situ_beta", float, 0.0),
            situ_linear_beta=_opt(d, "activation_situ_linear_beta", float, 0.0),
            blocks=d.get("mtp_blocks") or (),
            attention_value_scale=_opt(d, "attention_value_scale", float, 1.0),
            kv_lora_rank=_opt(d, "kv_lora_rank", int, 0),
            q_lora_rank=_opt(d, "q_lora_rank", int, 0),
            qk_rope_head_dim=_opt(d, "qk_rope_head_dim", int, 0),
            q_a_norm_scale=_opt(d, "q_a_norm_scale", float, 1.0),
            kv_a_norm_scale=_opt(d, "kv_a_norm_scale", float, 1.0),
            index_topk=_opt(d, "index_topk", int, 0),
            index_n_heads=_opt(d, "index_n_heads", int, 0),
            index_head_dim=_opt(d, "index_head_dim", int, 0),
            indexer_rope_interleave=_opt(d, "indexer_rope_interleave", bool, False),
            index_kpool=_opt(d, "index_kpool", int, 0),
            index_kpool_always_select_tail=_opt(d, "index_kpool_always_select_tail", bool, True),
            shared_kv=_opt(d, "shared_kv", bool, False),
            out_rope=_opt(d, "out_rope", bool, False),
            o_groups=_opt(d, "o_groups", int, 0),
            o_lora_rank=_opt(d, "o_lora_rank", int, 0),
            hc_mult=_opt(d, "hc_mult", int, 1),
            hc_sinkhorn_iters=_opt(d, "hc_sinkhorn_iters", int, 20),
            hc_eps=_opt(d, "hc_eps", float, 1e-6),
            embed_mask_pos0=_opt(d, "embed_mask_pos0", bool, False),
        )
        _check_same_as(d, cfg)
        return cfg

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "MtpConfig":
        """Read ``path``: a regular file (or a symlink to one) of at most ``CONFIG_JSON_CAP``
        bytes of UTF-8 JSON. Every error is a ``ConfigError`` naming the file."""
        d = read_json(path, CONFIG_JSON_CAP, ConfigError)
        try:
            return cls.from_dict(d)
        except ConfigError as e:
            raise ConfigError(_in_file(e, path)) from None

    def to_dict(self) -> dict:
        """A config.json body (Hugging Face names) that ``from_dict`` reads back: the
        family's ``model_type`` and first architecture when it has one."""
        d = asdict(self)
        fam = d.pop("family")
        quant, block, experts = d.pop("weight_quant"), d.pop("fp8_block"), d.pop("expert_quant")
        container, formats, ignore = d.pop("quant_container"), d.pop("quant_formats"), d.pop("quant_ignore")
        if container:
            d["quantization_config"] = _container_config(container, formats, ignore, quant, block)
        elif quant == "fp8" and block != (0, 0):
            d["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                        "weight_block_size": list(block)}
            if experts == "fp4":            # DeepSeek-V4.1's form (V4 writes expert_dtype at the top level)
                d["quantization_config"].update(scale_fmt="ue8m0", expert_dtype="fp4")
        elif quant == "fp8":
            d["quantization_config"] = {"quant_method": "compressed-tensors", "format": "float-quantized",
                                        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                                            "num_bits": 8, "type": "float", "strategy": "channel",
                                            "symmetric": True, "dynamic": False}}}}
        for name, off in (("v_head_dim", 0), ("sliding_window", 0), ("attn_sinks", False), ("swiglu_clamp", 0.0),
                          ("swiglu_clamp_shared", 0.0), ("swiglu_clamp_gate", False),
                          ("attention_value_scale", 1.0), ("kv_lora_rank", 0),
                          ("q_lora_rank", 0), ("qk_rope_head_dim", 0), ("q_a_norm_scale", 1.0),
                          ("kv_a_norm_scale", 1.0), ("index_topk", 0), ("index_n_heads", 0), ("index_head_dim", 0),
                          ("indexer_rope_interleave", False), ("hc_mult", 1), ("hc_sinkhorn_iters", 20),
                          ("shared_kv", False), ("out_rope", False), ("o_groups", 0), ("o_lora_rank", 0),
                          ("hc_eps", 1e-6), ("index_kpool", 0), ("index_kpool_always_select_tail", True),
                          ("mlp_act", "swiglu"), ("nope", False), ("moe_latent_size", 0), ("moe_latent_norm", False),
                          ("situ_beta", 0.0), ("situ_linear_beta", 0.0)):
            if d[name] == off:                  # a block feature switched off is not written
                del d[name]
        for name, key in (("situ_beta", "activation_situ_beta"), ("situ_linear_beta", "activation_situ_linear_beta")):
            if name in d:                       # config.json's names (Kimi K3)
                d[key] = d.pop(name)
        if not d["embed_mask_pos0"] and not (fam and FAMILIES[fam].defaults.get("embed_mask_pos0")):
            del d["embed_mask_pos0"]            # written where it is on, or off against the family's default
        if self.kv_lora_rank:                   # MLA: the query / key head dim as its config gives it
            d["qk_nope_head_dim"] = self.head_dim - self.qk_rope_head_dim
            d["qk_rope_head_dim"] = self.qk_rope_head_dim   # written at 0 too (NoPE): MLA needs the field
        blocks = d.pop("blocks")
        if blocks:
            d["mtp_blocks"] = [{k: (v.to_hf() if isinstance(v, Yarn) else v) for k, v in b} for b in self.blocks]
        theta = d.pop("rope_theta")
        d.pop("rope_scaling")
        if not d["rope_interleave"]:
            del d["rope_interleave"]
        if self.rope_scaling is None:
            d["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
        else:
            d["rope_parameters"] = {"rope_type": "yarn", "rope_theta": theta, **self.rope_scaling.to_hf()}
        d["hidden_act"] = "silu"
        if fam:
            d["model_type"] = fam
            d["architectures"] = [FAMILIES[fam].architectures[0]]
        return d

    def describe(self) -> str:
        kind = (f"MoE E={self.n_routed_experts} top-{self.num_experts_per_tok} "
                f"groups {self.topk_group}/{self.n_group} I={self.moe_intermediate_size} "
                f"shared={self.n_shared_experts}"
                + (f" latent={self.moe_latent_size}" if self.moe_latent_size else "")
                + (" latent-norm" if self.moe_latent_norm else "")) if self.is_moe \
            else f"dense I={self.intermediate_size}"
        fam = f"{FAMILIES[self.family].title}: " if self.family else ""
        if self.weight_quant == "fp8":
            b = self.fp8_block
            fam += f"FP8 E4M3 ({f'{b[0]}x{b[1]} block' if b != (0, 0) else 'per-channel'} scales) "
        if self.expert_quant == "fp4":
            fam += "FP4 E2M1 (E8M0 per 32) experts "
        if self.quant_container:
            names = {"mxfp4": "MXFP4 (E2M1, E8M0 per 32)", "mxfp8": "MXFP8 (E4M3, E8M0 per 32)",
                     "nvfp4": "NVFP4 (E2M1, E4M3 per 16, FP32 global)"}
            fam += f"{self.quant_container}: {', '.join(names[f] for f in self.quant_formats)} "
            if self.quant_ignore:
                fam += f"(ignore {len(self.quant_ignore)}) "
        blocks = [self.block(m) for m in range(self.num_modules)]
        if not any(b.moe for b in blocks):
            kind = f"dense I={self.intermediate_size} (MoE target: E={self.n_routed_experts})" if self.is_moe \
                else kind
        hc = f" hyper-connections x{self.hc_mult} (streams of {self.stream_size})" if self.hc_mult > 1 else ""
        hc += " position-0 embedding mask" if self.embed_mask_pos0 else ""
        text = f"{fam}M={self.num_modules} H={self.hidden_size}{hc} V={self.vocab_size} {kind}; "
        if len(set(blocks)) == 1:
            return text + f"block {blocks[0].describe()}"
        return text + ", ".join(f"module {m}: {b.describe()}" for m, b in enumerate(blocks))


def _container_config(container: str, formats: tuple, ignore: tuple, quant: str, block: tuple) -> dict:
    """The ``quantization_config`` of a container (``MtpConfig.to_dict``), one group per format."""
    if container == "modelopt":
        return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": list(ignore)}
    weights = {"mxfp4": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32},
               "nvfp4": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16},
               "mxfp8": {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 32}}
    kinds = list(formats)
    if quant == "fp8" and not (block == (1, 32) and "mxfp8" in formats):
        kinds.append("fp8")
        weights["fp8"] = ({"num_bits": 8, "type": "float", "strategy": "channel"} if block == (0, 0) else
                          {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": list(block)})
    groups = {f"group_{i}": {"targets": ["Linear"], "format": CT_FORMATS[k],
                             "weights": dict(weights[k], symmetric=True, dynamic=False)} for i, k in enumerate(kinds)}
    return {"quant_method": "compressed-tensors",
            "format": CT_FORMATS[kinds[0]] if len(kinds) == 1 else "mixed-precision",
            "config_groups": groups, "ignore": list(ignore)}


def _mla_head_dim(d: dict) -> int:
    """An MLA config's query / key head dim, ``qk_nope_head_dim + qk_rope_head_dim``; 0 when
    the config is not MLA (no ``kv_lora_rank``). Hugging Face's DeepseekV3Config writes
    ``head_dim = qk_rope_head_dim`` (the RoPE's width): accepted, as is ``head_dim`` = P + R;
    the MLA fields without ``kv_lora_rank`` are refused."""
    L = _opt(d, "kv_lora_rank", int, 0)
    P, R = _opt(d, "qk_nope_head_dim", int, None), _opt(d, "qk_rope_head_dim", int, None)
    lo, hi = INT_RANGES["kv_lora_rank"]
    if not L or not lo <= L <= hi:         # out of range: refused by the range check
        if L == 0 and P is not None:
            raise ConfigError(f"config.json: field 'qk_nope_head_dim' = {P} describes multi-head latent attention, "
                              f"which needs kv_lora_rank > 0, got {_show(d.get('kv_lora_rank'))}")
        return 0
    if P is None or R is None:
        missing = "qk_nope_head_dim" if P is None else "qk_rope_head_dim"
        raise ConfigError(f"config.json: field 'kv_lora_rank' = {L} (MLA) needs {missing!r}, which is missing")
    if not (1 <= P <= 1024 and 0 <= R <= 1024):
        raise ConfigError(f"config.json: qk_nope_head_dim must be in [1, 1024] and qk_rope_head_dim in [0, 1024], "
                          f"got {P} and {R}")
    hd = _opt(d, "head_dim", int, None)
    if hd is not None and hd not in (R, P + R):
        raise ConfigError(f"config.json: field 'head_dim' = {hd} disagrees with MLA's qk_nope_head_dim + "
                          f"qk_rope_head_dim = {P} + {R} (or qk_rope_head_dim, as Hugging Face writes it)")
    return P + R


def _head_dim(d: dict, H: int, Hq: int) -> int:
    hd = _opt(d, "head_dim", int, None)
    if hd is not None:
        return hd
    if Hq <= 0:
        return 0  # refused by the range check of num_attention_heads, which comes first
    if H % Hq:
        raise ConfigError(
            f"config.json: head_dim is missing and hidden_size ({H}) is not a multiple of "
            f"num_attention_heads ({Hq})"
        )
    return H // Hq


def tiny_config(**overrides: Any) -> MtpConfig:
    """A small MoE config used by tests and the CI smoke benchmark."""
    base = dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        vocab_size=301, num_hidden_layers=2, num_nextn_predict_layers=3,
        rms_norm_eps=1e-5, rope_theta=10000.0, partial_rotary_factor=0.5,
        attention_bias=True, use_qk_norm=True, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, moe_intermediate_size=32, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=4096,
    )
    base.update(overrides)
    return MtpConfig(**base)


def small_config(**overrides: Any) -> MtpConfig:
    """The ``small`` benchmark shape set (``SHAPES`` in mtpkern/bench.py)."""
    base = dict(
        hidden_size=1024, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
        vocab_size=32768, num_hidden_layers=2, num_nextn_predict_layers=3,
        rms_norm_eps=1e-5, rope_theta=1e6, partial_rotary_factor=0.5,
        attention_bias=True, use_qk_norm=True, n_routed_experts=32, num_experts_per_tok=4,
        n_shared_experts=1, moe_intermediate_size=512, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=8192,
    )
    base.update(overrides)
    return MtpConfig(**base)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)
