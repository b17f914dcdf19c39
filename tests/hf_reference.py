"""Helpers of the tests against Hugging Face ``generate(..., use_mtp=True)``
(``test_hf_reference.py``: Glm4Moe; ``test_hf_step3p5.py``: Step-3.5 through
transformers' ``step3p7`` port; ``test_hf_deepseek_v3.py``: DeepSeek-V3, MLA):
build a tiny random checkpoint HF can run, record every MTP drafting step of a
greedy generation, and replay the same calls through ``mtpkern``.

Needs torch and transformers >= 5.24 (not project dependencies); import it only
after ``conftest.require_hf_mtp()``. See docs/hf_reference.md.

Index conventions (docs/semantics.md): the target's hidden at position ``j`` is ``h_j``.
HF drafts from ``MTPCandidateGenerator.get_candidates``; each call we record is a
*step*:

- step 0 (after the prefill forward): ``ids = t_0 .. t_n`` (prompt + the first
  token the target sampled), ``hid = h_0 .. h_{n-1}``;
- step s > 0 (after a verify that accepted ``a`` drafts): ``ids`` ends with the
  accepted drafts and the bonus token, ``hid = h_P .. h_{P+a}`` (the rows of the
  verify forward over ``[t_P, d_0 ..]`` up to the bonus token's predecessor).

``drafts`` are the ``M`` tokens HF drafted, ``logits`` ``[M, V]`` their logits.
Nothing here depends on the family but the checkpoint builders (``build_checkpoint``,
``build_step3p7_checkpoint``, ``build_deepseek_v3_checkpoint``).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from transformers import (DeepseekV3Config, DeepseekV3ForCausalLM, Glm4MoeConfig, Glm4MoeForCausalLM,
                          PreTrainedModel, Step3p7Config, Step3p7ForConditionalGeneration)
from transformers.cache_utils import MtpCache
from transformers.generation.candidate_generator import MTPCandidateGenerator

from mtpkern.testing import oracle

#: shapes of the tiny checkpoint (all float32)
TINY = dict(
    vocab_size=257, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
    n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
    # target layer 0 dense, layer 1 MoE; HF builds every MTP layer as MoE whatever this is
    first_k_dense_replace=1,
    use_qk_norm=True, attention_bias=True, max_position_embeddings=512,
    initializer_range=0.1, rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
)


def _random(seed: int, centre: float = 1.0):
    """Random tensor makers from one generator: ``mat(out, in)`` (unit-gain linear),
    ``norm(n)`` (RMSNorm weights ``centre + 0.2 N(0, 1)``: 1 for plain norms, 0 for
    zero-centred ones, which store ``w`` and apply ``1 + w``), ``vec(n)``."""
    g = torch.Generator().manual_seed(seed)

    def mat(o, i):
        return torch.randn(o, i, generator=g) / i ** 0.5

    def norm(n):
        return centre + 0.2 * torch.randn(n, generator=g)

    def vec(n, s=0.1):
        return s * torch.randn(n, generator=g)

    return mat, norm, vec


def _perturb_norms(model: PreTrainedModel, centre: float) -> None:
    """HF initialises RMSNorm weights to the identity (1, or 0 for zero-centred norms),
    which would make the target's final norm idempotent (and a hidden normed twice
    indistinguishable from one normed once): move them away from it."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(centre + 0.2 * torch.randn(p.shape))


def hf_config(num_mtp: int, **overrides) -> Glm4MoeConfig:
    kw = dict(TINY, num_mtp_layers=num_mtp, dtype="float32")
    kw.update(overrides)
    return Glm4MoeConfig(**kw)


def mtp_tensors(cfg: Glm4MoeConfig, seed: int) -> dict[str, torch.Tensor]:
    """Random MTP modules in the GLM-4.5 checkpoint layout: module m under
    ``model.layers.{num_hidden_layers + m}.``, routed experts one by one (HF merges
    them into ``gate_up_proj`` when loading), final norm as ``shared_head.norm``.
    No per-module ``embed_tokens`` / ``shared_head.head``: both sides use the target's."""
    mat, norm, vec = _random(seed)
    H, L, E, I = cfg.hidden_size, cfg.num_hidden_layers, cfg.n_routed_experts, cfg.moe_intermediate_size
    Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    Is = I * cfg.n_shared_experts

    out = {}
    for m in range(cfg.num_mtp_layers):
        t = {
            "enorm.weight": norm(H), "hnorm.weight": norm(H), "eh_proj.weight": mat(H, 2 * H),
            "input_layernorm.weight": norm(H), "post_attention_layernorm.weight": norm(H),
            "self_attn.q_proj.weight": mat(Hq * D, H), "self_attn.k_proj.weight": mat(Hkv * D, H),
            "self_attn.v_proj.weight": mat(Hkv * D, H), "self_attn.o_proj.weight": mat(H, Hq * D),
            "mlp.gate.weight": mat(E, H),
            # nonzero so that selection (biased) and weights (unbiased) differ
            "mlp.gate.e_score_correction_bias": vec(E),
            "mlp.shared_experts.gate_proj.weight": mat(Is, H), "mlp.shared_experts.up_proj.weight": mat(Is, H),
            "mlp.shared_experts.down_proj.weight": mat(H, Is),
            "shared_head.norm.weight": norm(H),
        }
        if cfg.attention_bias:
            t.update({"self_attn.q_proj.bias": vec(Hq * D), "self_attn.k_proj.bias": vec(Hkv * D),
                      "self_attn.v_proj.bias": vec(Hkv * D)})
        if cfg.use_qk_norm:
            t.update({"self_attn.q_norm.weight": norm(D), "self_attn.k_norm.weight": norm(D)})
        for e in range(E):
            t[f"mlp.experts.{e}.gate_proj.weight"] = mat(I, H)
            t[f"mlp.experts.{e}.up_proj.weight"] = mat(I, H)
            t[f"mlp.experts.{e}.down_proj.weight"] = mat(H, I)
        out.update({f"model.layers.{L + m}.{k}": v.contiguous() for k, v in t.items()})
    return out


def _save_with_mtp(path: Path, model_cls, cfg, centre: float, mtp_tensors_of, seed: int) -> Path:
    """A random ``model_cls(cfg)`` (norms perturbed around ``centre``) saved by
    ``save_pretrained``, with ``mtp_tensors_of(cfg, seed + 1)`` added to its safetensors
    file (``save_pretrained`` writes only the target: the HF classes hold no MTP layers)."""
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    _perturb_norms(model, centre)
    model.save_pretrained(path)
    sd = load_file(path / "model.safetensors")
    sd.update(mtp_tensors_of(cfg, seed + 1))
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    return path


def build_checkpoint(path: str | Path, num_mtp: int, seed: int = 0, **overrides) -> Path:
    """A random tiny Glm4MoeForCausalLM saved by ``save_pretrained`` (config.json +
    model.safetensors), with ``num_mtp`` MTP modules added to the same safetensors file
    (``save_pretrained`` writes only the target: the HF model class holds no MTP layers)."""
    return _save_with_mtp(Path(path), Glm4MoeForCausalLM, hf_config(num_mtp, **overrides), 1.0, mtp_tensors, seed)


def load_hf(path: str | Path) -> Glm4MoeForCausalLM:
    """The target, loaded with ``from_pretrained`` (``MtpModel.from_pretrained`` reads
    the MTP weights from ``config.name_or_path``).

    HF limitation worked around here: ``MtpModel.get_mtp_weights_regex`` finds the MTP
    keys through the class's ``_keys_to_ignore_on_load_unexpected``, which Glm4Moe
    hard-codes to ``model.layers.92.*`` / ``model.layers.46.*`` (GLM-4.5 / 4.5-Air, one
    MTP layer). Any other layer count (and any second MTP layer) is not found and
    ``generate(use_mtp=True)`` raises "MtpModel weights are missing". The instance
    attribute below names this checkpoint's MTP layers instead."""
    model = Glm4MoeForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    c = model.config
    model._keys_to_ignore_on_load_unexpected = [
        rf"model\.layers\.{c.num_hidden_layers + m}\..*" for m in range(c.num_mtp_layers)]
    return model


# -- Step-3.5 through transformers' step3p7 port ----------------------------------------------

#: the text model's shapes (all float32); the per-layer fields are given per case (STEP_CASES)
STEP_TINY = dict(
    vocab_size=257, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_attention_groups=2,
    head_dim=16, moe_num_experts=8, moe_top_k=2, moe_intermediate_size=32, share_expert_dim=32,
    moe_router_scaling_factor=3.0, max_position_embeddings=512, rms_norm_eps=1e-5, initializer_range=0.1,
    tie_word_embeddings=False, pad_token_id=0,
)
#: the smallest vision tower Step3p7Config accepts (the MTP generation never runs it)
STEP_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                   image_size=28, patch_size=14)

_F, _S = "full_attention", "sliding_attention"
#: Per case: the text config's per-layer fields in the release's form (``L + M`` entries,
#: ``attention_other_setting``), which ``Step3p7TextConfig`` converts into its own
#: (``mtp_layer_types``, trimmed lists, ``rope_parameters`` per type,
#: ``num_sliding_attention_heads``) before ``save_pretrained`` writes it.
#:
#: - ``sliding``: 3 target layers, 3 sliding MTP modules, 4 heads everywhere;
#: - ``mixed``: MTP modules sliding / full / sliding with 8 / 4 / 8 query heads (the
#:   sliding layers' count through ``mtp_per_layer_config``, without which transformers
#:   builds every MTP layer with the global 4), and a SwiGLU clamp of 1.0 on module 1
#:   (transformers reads ``swiglu_limits_shared`` at the MTP index: entry 1, a target
#:   layer's; the release's MTP entries, 4 here, are dropped by its config).
#:
#: Every MTP module is dense (as in the release); the sliding window (5) is shorter than
#: the prompts (12).
STEP_CASES = {
    "sliding": dict(layer_types=[_F, _S, _S, _S, _S, _S], sliding_heads=4, mtp_heads=None,
                    swiglu_limits_shared=[0.0] * 6),
    "mixed": dict(layer_types=[_F, _S, _S, _S, _F, _S], sliding_heads=8, mtp_heads={0: 8, 2: 8},
                  swiglu_limits_shared=[0.0, 1.0, 0.0, 0.0, 0.0, 0.0]),
}
STEP_WINDOW = 5
STEP_LAYERS = 3          # target layers (>= M: transformers' MTP layer m reads swiglu_limits_shared[m])


def step3p7_config(case: str, window: int = STEP_WINDOW) -> Step3p7Config:
    """A tiny ``Step3p7Config`` (vision-language, text model ``step3p5``) for ``STEP_CASES[case]``,
    with ``num_nextn_predict_layers = 3``: target layers 0 dense, 1-2 MoE; MTP layers dense."""
    c = STEP_CASES[case]
    types, L = c["layer_types"], STEP_LAYERS
    M = len(types) - L
    text = dict(
        STEP_TINY, num_hidden_layers=L, num_nextn_predict_layers=M, layer_types=types, sliding_window=window,
        attention_other_setting={"attention_type": _S, "num_attention_heads": c["sliding_heads"],
                                 "num_attention_groups": STEP_TINY["num_attention_groups"],
                                 "head_dim": STEP_TINY["head_dim"]},
        rope_theta=[5e6 if t == _F else 1e4 for t in types],
        partial_rotary_factors=[0.5 if t == _F else 1.0 for t in types],
        moe_layers_enum="1,2", swiglu_limits=[0.0] * len(types), swiglu_limits_shared=c["swiglu_limits_shared"],
    )
    if c["mtp_heads"]:
        text["mtp_per_layer_config"] = {m: {"num_attention_heads": h} for m, h in c["mtp_heads"].items()}
    return Step3p7Config(text_config=text, vision_config=STEP_VISION, image_token_id=STEP_TINY["vocab_size"] - 1,
                         dtype="float32")


def step_mtp_tensors(cfg: Step3p7Config, seed: int) -> dict[str, torch.Tensor]:
    """Random dense MTP modules under the names transformers' MTP loader reads: module m
    at ``model.layers.{L + m}.`` (``MtpModel.get_weight_conversions`` moves them to
    ``layers.{m}.mtp_block.``), the canonical block names (docs/model.md) plus ``self_attn.g_proj``,
    zero-centred norms stored as ``w`` (applied as ``1 + w``), and the final norm as
    ``shared_head.norm.weight``, which conversion_mapping.py's "MtpModel" entry renames to
    the layer's ``post_norm``. The release's ``transformer.shared_head.norm.weight`` is not
    renamed there (generate raises "MtpModel weights are missing: layers.*.post_norm.weight"),
    and a module's own ``transformer.shared_head.output`` head is never read by HF (it drafts
    with the target's ``lm_head``): neither is written."""
    mat, norm, _ = _random(seed, centre=0.0)
    t_cfg = cfg.text_config
    mc = cfg.get_mtp_config()
    H, L, I, Hkv, D = t_cfg.hidden_size, t_cfg.num_hidden_layers, t_cfg.intermediate_size, \
        t_cfg.num_key_value_heads, t_cfg.head_dim
    out = {}
    for m in range(t_cfg.num_nextn_predict_layers):
        Hq = mc.per_layer_config[m].num_attention_heads
        t = {
            "enorm.weight": norm(H), "hnorm.weight": norm(H), "eh_proj.weight": mat(H, 2 * H),
            "input_layernorm.weight": norm(H), "post_attention_layernorm.weight": norm(H),
            "self_attn.q_proj.weight": mat(Hq * D, H), "self_attn.k_proj.weight": mat(Hkv * D, H),
            "self_attn.v_proj.weight": mat(Hkv * D, H), "self_attn.o_proj.weight": mat(H, Hq * D),
            "self_attn.g_proj.weight": mat(Hq, H),
            "self_attn.q_norm.weight": norm(D), "self_attn.k_norm.weight": norm(D),
            "mlp.gate_proj.weight": mat(I, H), "mlp.up_proj.weight": mat(I, H), "mlp.down_proj.weight": mat(H, I),
            "shared_head.norm.weight": norm(H),
        }
        out.update({f"model.layers.{L + m}.{k}": v.contiguous() for k, v in t.items()})
    return out


def build_step3p7_checkpoint(path: str | Path, case: str, seed: int = 0) -> Path:
    """A random tiny ``Step3p7ForConditionalGeneration`` saved by ``save_pretrained``
    (config.json in transformers' form, the target's tensors under the release's names:
    ``model.layers.*``, ``model.embed_tokens``, ``model.norm``, ``lm_head``), with the MTP
    modules of ``step_mtp_tensors`` added to the same safetensors file."""
    return _save_with_mtp(Path(path), Step3p7ForConditionalGeneration, step3p7_config(case), 0.0, step_mtp_tensors,
                          seed)


def load_step3p7(path: str | Path) -> Step3p7ForConditionalGeneration:
    """The target, loaded with ``from_pretrained``; no workaround is needed (the text
    model lists its MTP layers in ``_keys_to_ignore_on_load_unexpected`` from
    ``num_nextn_predict_layers``)."""
    return Step3p7ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()


# -- DeepSeek-V3 (MLA) ---------------------------------------------------------------------

#: shapes of the tiny DeepSeek-V3 (all float32); per case ``DS3_CASES`` adds the attention's
#: ranks, the RoPE and the number of MTP modules. rms_norm_eps is 1e-6 because transformers'
#: q_a_layernorm / kv_a_layernorm always use 1e-6 and mtpkern (as vLLM) rms_norm_eps.
DS3_TINY = dict(
    vocab_size=257, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
    n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
    routed_scaling_factor=2.5, norm_topk_prob=True,
    # target layer 0 dense, layer 1 MoE; HF builds every MTP layer as MoE whatever this is
    first_k_dense_replace=1,
    kv_lora_rank=20, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10,
    max_position_embeddings=64, rms_norm_eps=1e-6, initializer_range=0.1,
    tie_word_embeddings=False, pad_token_id=0,
)
#: ``yarn``: q_a_proj / q_b_proj, GPT-J-paired RoPE, YaRN x4 from 16 positions with mscale
#: 1.0 != mscale_all_dim 0.8 (so cos / sin carry an attention factor != 1 and the softmax
#: scale mscale(4, 0.8)^2 != 1) and beta_slow 0.25 (one frequency blended, not only
#: interpolated or extrapolated ones); ``plain``: q_proj, neox-halves RoPE, no scaling.
DS3_CASES = {
    "yarn": dict(num_nextn_predict_layers=3, q_lora_rank=24, rope_interleave=True,
                 rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                      original_max_position_embeddings=16, mscale=1.0, mscale_all_dim=0.8,
                                      beta_fast=32.0, beta_slow=0.25)),
    "plain": dict(num_nextn_predict_layers=2, q_lora_rank=None, rope_interleave=False,
                  rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
}


def deepseek_v3_config(case: str) -> DeepseekV3Config:
    return DeepseekV3Config(**DS3_TINY, **DS3_CASES[case], dtype="float32")


def ds3_mtp_tensors(cfg: DeepseekV3Config, seed: int) -> dict[str, torch.Tensor]:
    """Random MTP modules in DeepSeek-V3's release layout: module m under
    ``model.layers.{num_hidden_layers + m}.`` with MLA attention, a MoE block with the
    routed experts one by one, ``shared_head.norm``; no per-module ``embed_tokens`` /
    ``shared_head.head`` (both sides use the target's). The router's weights are scaled up
    (its logits spread over several units, so no two experts' scores come near a tie) and
    its correction bias is nonzero (selection and weights differ)."""
    mat, norm, vec = _random(seed)
    H, L, E, I = cfg.hidden_size, cfg.num_hidden_layers, cfg.n_routed_experts, cfg.moe_intermediate_size
    Hq, Lk, P, R, Dv = (cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim,
                        cfg.qk_rope_head_dim, cfg.v_head_dim)
    Is = I * cfg.n_shared_experts
    out = {}
    for m in range(cfg.num_mtp_layers):
        t = {
            "enorm.weight": norm(H), "hnorm.weight": norm(H), "eh_proj.weight": mat(H, 2 * H),
            "input_layernorm.weight": norm(H), "post_attention_layernorm.weight": norm(H),
            "self_attn.kv_a_proj_with_mqa.weight": mat(Lk + R, H), "self_attn.kv_a_layernorm.weight": norm(Lk),
            "self_attn.kv_b_proj.weight": mat(Hq * (P + Dv), Lk), "self_attn.o_proj.weight": mat(H, Hq * Dv),
            "mlp.gate.weight": 3.0 * mat(E, H),
            "mlp.gate.e_score_correction_bias": vec(E, 0.3),
            "mlp.shared_experts.gate_proj.weight": mat(Is, H), "mlp.shared_experts.up_proj.weight": mat(Is, H),
            "mlp.shared_experts.down_proj.weight": mat(H, Is),
            "shared_head.norm.weight": norm(H),
        }
        if cfg.q_lora_rank:
            t.update({"self_attn.q_a_proj.weight": mat(cfg.q_lora_rank, H),
                      "self_attn.q_a_layernorm.weight": norm(cfg.q_lora_rank),
                      "self_attn.q_b_proj.weight": mat(Hq * (P + R), cfg.q_lora_rank)})
        else:
            t["self_attn.q_proj.weight"] = mat(Hq * (P + R), H)
        for e in range(E):
            t[f"mlp.experts.{e}.gate_proj.weight"] = mat(I, H)
            t[f"mlp.experts.{e}.up_proj.weight"] = mat(I, H)
            t[f"mlp.experts.{e}.down_proj.weight"] = mat(H, I)
        out.update({f"model.layers.{L + m}.{k}": v.contiguous() for k, v in t.items()})
    return out


def build_deepseek_v3_checkpoint(path: str | Path, case: str, seed: int = 0) -> Path:
    """A random tiny ``DeepseekV3ForCausalLM`` saved by ``save_pretrained`` (config.json as
    transformers writes it: ``head_dim`` = qk_rope_head_dim, ``qk_head_dim``,
    ``rope_parameters``), with the MTP modules of ``ds3_mtp_tensors`` added to the same
    safetensors file (``save_pretrained`` writes only the target)."""
    return _save_with_mtp(Path(path), DeepseekV3ForCausalLM, deepseek_v3_config(case), 1.0, ds3_mtp_tensors, seed)


def load_deepseek_v3(path: str | Path) -> DeepseekV3ForCausalLM:
    """The target, loaded with ``from_pretrained``. Same workaround as ``load_hf``:
    DeepseekV3 hard-codes its unexpected keys to ``model\\.layers\\.61.*`` (the release's one
    MTP layer), so the instance names this checkpoint's MTP layers."""
    model = DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    c = model.config
    model._keys_to_ignore_on_load_unexpected = [
        rf"model\.layers\.{c.num_hidden_layers + m}\..*" for m in range(c.num_mtp_layers)]
    return model


# -- recording and replaying HF's drafting steps (any family) ------------------------------------

@dataclass
class Step:
    ids: list[int]          # the full sequence when drafting (ends with the token drafted after)
    accepted: int           # drafts of the previous step the verify accepted (0 at step 0)
    hid: np.ndarray         # target hiddens handed to the MTP generator this step (see module doc)
    drafts: list[int]       # HF's M drafts
    logits: np.ndarray      # [M, V] HF's draft logits


@contextlib.contextmanager
def recording(steps: list[Step], crops: list[int]):
    """Wrap ``MTPCandidateGenerator.get_candidates`` (the class attribute) to append a
    ``Step`` per drafting call, and ``MtpCache.crop`` to append its argument to ``crops``;
    the originals are restored on exit."""
    orig = MTPCandidateGenerator.get_candidates
    orig_crop = MtpCache.crop

    @functools.wraps(orig_crop)
    def crop(self, max_length):
        crops.append(int(max_length))
        return orig_crop(self, max_length)

    @functools.wraps(orig)
    def get_candidates(self, input_ids, model_kwargs, model_outputs, is_first_iteration, n_last_matches,
                       **kwargs):
        out = orig(self, input_ids, model_kwargs, model_outputs, is_first_iteration, n_last_matches, **kwargs)
        if not is_first_iteration:          # the first call only lets the target prefill
            n = input_ids.shape[1] - 1 if not steps else n_last_matches + 1
            cand, logits = out
            steps.append(Step(
                ids=input_ids[0].tolist(),
                accepted=int(n_last_matches) if steps else 0,
                hid=model_outputs.hidden_states[-1][0, :n].detach().to(torch.float32).numpy().copy(),
                drafts=cand[0, input_ids.shape[1]:].tolist(),
                logits=logits[0].detach().to(torch.float32).numpy().copy(),
            ))
        return out

    MTPCandidateGenerator.get_candidates = get_candidates
    MtpCache.crop = crop
    try:
        yield steps
    finally:
        MTPCandidateGenerator.get_candidates = orig
        MtpCache.crop = orig_crop


@contextlib.contextmanager
def steered(model: PreTrainedModel, schedule: list[int] | None):
    """Make the target's verify accept ``schedule[i % len]`` drafts at verify ``i``.

    Random weights give a target that almost never agrees with its drafter (every
    verify accepts 0), which leaves HF's cache correction after partial acceptance
    untested. This wraps the target's ``forward`` and edits only its output *logits*
    at the candidate positions (the accepted drafts get +1e4, the first rejected one
    -1e4; the bonus token is the target's argmax otherwise). The hidden states, the MTP
    generator and its cache handling are HF's, untouched. ``functools.wraps`` keeps the
    signature: generate only builds ``position_ids`` (which the MTP generator indexes)
    when ``forward`` declares them."""
    if not schedule:
        yield
        return
    fwd = model.forward
    count = [0]

    @functools.wraps(fwd)
    def forward(*args, **kwargs):
        out = fwd(*args, **kwargs)
        logits = out.logits
        if logits.shape[1] > 1:              # a verify: [t_P, d_0 .. d_{k-1}] -> k + 1 rows
            cand = kwargs["input_ids"][0, 1:]
            a = schedule[count[0] % len(schedule)]
            count[0] += 1
            for i in range(min(a, cand.shape[0])):
                logits[0, i, cand[i]] = 1e4
            if a < cand.shape[0]:
                logits[0, a, cand[a]] = -1e4
        return out

    model.forward = forward
    try:
        yield
    finally:
        del model.forward                   # back to the class's method


@dataclass
class HfRun:
    steps: list[Step]
    sequence: list[int]      # generate's output (prompt + new tokens)
    crops: list[int]         # MtpCache.crop arguments, in order


def hf_generate(model: PreTrainedModel, prompt: list[int], max_new_tokens: int,
                schedule: list[int] | None = None) -> HfRun:
    """Greedy ``generate(use_mtp=True)``, recorded (and steered by ``schedule``)."""
    steps: list[Step] = []
    crops: list[int] = []
    ids = torch.tensor([prompt], dtype=torch.long)
    with recording(steps, crops), steered(model, schedule), torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, use_mtp=True, eos_token_id=None, pad_token_id=0)
    return HfRun(steps, out[0].tolist(), crops)


@dataclass
class Replay:
    ours: list[list[int]]              # our drafts, step by step (up to the first mismatch)
    first_mismatch: int | None
    hiddens: np.ndarray                # h_0 .. h_{P-1} of the last replayed step
    tokens_per_step: list[list[int]]   # verified tokens + HF drafts at each step (for the oracle)
    hiddens_per_step: list[int]        # how many of ``hiddens`` each step had consumed (= P)


def replay(prop, steps: list[Step]) -> Replay:
    """The same sequence of calls through ``prop`` (a MultiModuleMtpHead in exact mode):
    prefill_drafter + propose for step 0, then after_verify / catchup_drafter / propose.
    Stops at the first step whose drafts differ from HF's (the next calls would carry
    tokens our state never drafted)."""
    M = prop.num_modules
    st = prop.alloc_state()
    ours, toks, hcount = [], [], []
    hid_all = np.zeros((0, steps[0].hid.shape[1]), np.float32)
    first = None
    try:
        for s, step in enumerate(steps):
            ids, hid = step.ids, step.hid
            if s == 0:
                prop.prefill_drafter(ids[:-1], hid, st)
                g = hid[-1]
                hid_all = hid
            else:
                a = step.accepted
                prev = steps[s - 1].drafts
                if ids[len(ids) - 1 - a:-1] != prev[:a]:
                    raise AssertionError(f"step {s}: HF sequence does not end with the {a} accepted drafts")
                prop.after_verify(a, st)
                prop.catchup_drafter(prev[:a], hid[:a], st)
                g = hid[a]
                hid_all = np.concatenate([hid_all, hid[:a + 1]], axis=0)
            P = len(ids) - 1
            if hid_all.shape[0] != P:
                raise AssertionError(f"step {s}: {hid_all.shape[0]} target hiddens for position {P}")
            d = prop.propose(ids[-1], g, P, M, st)
            ours.append(d)
            toks.append(list(ids) + list(step.drafts))
            hcount.append(P)
            if d != step.drafts:
                first = s
                break
    finally:
        prop.free_state(st)
    return Replay(ours, first, hid_all, toks, hcount)


def describe_mismatch(steps: list[Step], rep: Replay) -> str:
    """The first step whose drafts differ, for an assertion message."""
    s = rep.first_mismatch
    st = steps[s]
    srt = np.sort(st.logits, axis=-1)
    gaps = (srt[:, -1] - srt[:, -2]).round(6).tolist()
    return (f"step {s} (position {len(st.ids) - 1}, after accepting {st.accepted}): HF drafted {st.drafts}, "
            f"mtpkern {rep.ours[s]}; HF top-1/top-2 logit gaps per module {gaps}")


def oracle_logit_gap(prop, steps: list[Step], rep: Replay) -> float:
    """The largest |HF draft logit - the from-scratch oracle's| (``mtpkern.testing.oracle``,
    float64, ``postnorm`` chain) over every step and module of a fully replayed run."""
    cfg, w = prop.config, prop.weights
    worst = 0.0
    for s, st in enumerate(steps):
        P = rep.hiddens_per_step[s]
        rows = oracle.chain_state(cfg, w, rep.tokens_per_step[s], rep.hiddens[:P], "postnorm")
        for m in range(prop.num_modules):
            lg = rows[m].normed[P - 1] @ np.asarray(w.modules[m].head, np.float64).T
            worst = max(worst, float(np.abs(lg - st.logits[m]).max()))
    return worst


class Case:
    """One checkpoint, its HF model and its HF runs (greedy, and steered by ``schedule``),
    each generated once."""

    def __init__(self, M: int, path: Path, model: PreTrainedModel, prompt: list[int], schedule: list[int],
                 max_new_tokens: int = 40):
        self.M, self.path, self.model = M, path, model
        self.prompt, self.schedule, self.max_new_tokens = prompt, schedule, max_new_tokens
        self._runs: dict[bool, HfRun] = {}

    def run(self, steer: bool) -> HfRun:
        if steer not in self._runs:
            self._runs[steer] = hf_generate(self.model, self.prompt, self.max_new_tokens,
                                            self.schedule if steer else None)
        return self._runs[steer]

    def ours(self, path: Path | None = None, **kw):
        """mtpkern on the same directory (or ``path``): numpy, exact mode, postnorm chain."""
        from mtpkern import MultiModuleMtpHead

        opts = dict(backend="numpy", kv_mode="exact", chain="postnorm")
        opts.update(kw)
        return MultiModuleMtpHead.from_pretrained(path or self.path, **opts)
