"""The DSA MTP families against an independent float64 model that reads the release.

DeepSeek-V3.2 (``deepseek_v32``), GLM-5 (``glm_moe_dsa``) and GLM-5.3 (``glm5_next``'s
``glm5_next_text``) are otherwise checked against mtpkern's own oracle
(mtpkern.testing.oracle), which reads its weights through mtpkern's loader and its
hyperparameters through mtpkern's config: a misread field or a wrong load-time fold would be
the oracle's too. The model here reads the checkpoint's bytes itself, by the release's own
names (``model.layers.{L}.self_attn.indexer.wq_b`` ..., GLM-5.3's under
``model.language_model.layers.{L}.``), takes its hyperparameters from a release-form
config.json (``qk_rope_head_dim``, ``rope_scaling`` / ``rope_parameters``, ``index_topk``,
``index_n_heads``, ``index_head_dim``, GLM-5.3's nested ``text_config`` with ``index_kpool``
and ``swiglu_limit`` beside the trunk's hyper-connection fields) and computes the MTP layer
in float64 from the formulas, with no code of mtpkern's:

- the MTP wiring of vLLM ``deepseek_mtp.py`` (``DeepSeekMultiTokenPredictorLayer.forward``):
  the embedding zeroed at position 0, ``eh_proj(cat[enorm(e), hnorm(h)])``, one decoder
  layer, ``shared_head.norm`` before the LM head (the target's ``lm_head`` when the module
  has no ``shared_head.head``, as vLLM binds it for GLM-5.3);
- MLA as transformers 5.24 ``DeepseekV32Attention.forward`` / ``Glm5NextTextAttention.forward``:
  the query through ``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj``, the latent ``c`` and the
  shared rotary key from ``kv_a_proj_with_mqa``, ``kv_b_proj`` per head ``[k_nope | v]``,
  RoPE in pairs on the LAST ``qk_rope_head_dim`` dims of each query head, YaRN's
  frequencies, cos / sin factor and softmax factor (``yarn_apply_mscale``); GLM-5.3 without
  RoPE (``qk_rope_head_dim`` 0) and without YaRN;
- the lightning indexer as ``DeepseekV32Indexer.forward`` / ``GlmMoeDsaIndexer.forward``:
  RoPE on the FIRST ``qk_rope_head_dim`` dims of its heads and key (halves for V3.2,
  pairs for GLM-5), the key through ``k_norm`` (a LayerNorm with a bias, eps 1e-6),
  ``score_j = sum_h weights_proj_h * Hi^-0.5 * relu(q_h . k_j) * Di^-0.5``, the
  ``index_topk`` best keys (ties: the earlier key);
- GLM-5.3's pooled indexer as ``Glm5NextTextIndexer.forward`` / ``get_pooled_states`` /
  ``append_visible_tail``: pools of ``index_kpool`` rows from the sequence's first, the
  pooled key per dim a softmax over the pool's rows of ``index_kpool_compress_gate(x) +
  index_kpool_compress_ape`` weighing their keys, the ``index_topk / index_kpool`` best
  complete pools and the incomplete pool's rows;
- the MoE as ``DeepseekV32TopkRouter`` / ``Glm5NextTextTopkRouter`` (sigmoid, the bias for
  the choice only, groups by their two best) and ``Glm5NextTextExperts._apply_gate`` (GLM-5.3:
  ``silu(min(g, L)) * clip(u, -L, L)``, the shared expert too).

Where the references leave a choice, the model takes mtpkern's documented one
(docs/hf_reference.md, "DeepSeek-V3.2 and GLM-5 (DSA)", "GLM-5.3"): rows numbered by their
token (module m's key j at position j + m + 1; vLLM numbers them by their hidden, which RoPE
cannot tell apart, so vLLM's position-0 row is this position 1), the ``postnorm`` chain
(``shared_head.norm(y)`` handed to the next module: vLLM's ``deepseek_mtp.py`` since mid-2026,
GLM-5.3's MTP layer; older vLLM releases handed on ``y``), rotary dims kept in place (transformers'
``apply_rotary_pos_emb_interleave`` writes the rotated evens before the odds; the dot products
are the same), ``rms_norm_eps`` for ``q_a`` / ``kv_a_layernorm`` (vLLM's).

mtpkern's proposer (numpy and cpu, exact KV mode) runs a prompt and several multi-draft
proposes with partial acceptances (contexts up to ~30 rows against ``index_topk`` 4); every
draft must be the model's argmax (unless its two best logits lie within float rounding) and
after every call every module's KV rows (the latent row, the indexer's key, GLM-5.3's gate
scores) must equal the model's at the FP32 tolerance. Negative controls (each must fail,
with the indexer's plane left out of the comparison, so that the selection shows):
the indexer off (dense attention), a larger ``index_topk``, the indexer's RoPE pairs
flipped and equal scores going to the later key (V3.2, GLM-5), pools of 1 (a key per row),
no tail, no ``ape`` (GLM-5.3), the position-0 mask off, the pre-norm chain.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import MLA_FIELDS, record_trace
from mtpkern import MultiModuleMtpHead, write_synthetic_checkpoint
from mtpkern.config import tiny_config
from mtpkern.tolerance import assert_close
from test_family_deepseek_v4_reference import ReleaseFiles

#: YaRN as the V3.2 release has it, at test size (factor 4 over 12 positions: the runs go past 12)
YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 12, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 0.8}

#: the test configs: MLA with L 40, R 8 (0 for GLM-5.3), 4 heads; the indexer's 4 keys (GLM-5.3:
#: 2 pools of 2) of 2 x 16 heads; 3 modules, 8 experts top-2 and a shared one
FAMILIES = {
    "deepseek_v32": dict(MLA_FIELDS, family="deepseek_v32", index_topk=4, index_n_heads=2, index_head_dim=16,
                         indexer_rope_interleave=False, rms_norm_eps=1e-6, embed_mask_pos0=True),
    "glm_moe_dsa": dict(MLA_FIELDS, family="glm_moe_dsa", index_topk=4, index_n_heads=2, index_head_dim=16,
                        indexer_rope_interleave=True, rope_scaling=None, n_group=1, topk_group=1,
                        embed_mask_pos0=True),
    "glm5_next": dict(MLA_FIELDS, family="glm5_next_text", qk_rope_head_dim=0, head_dim=12, rope_scaling=None,
                      index_topk=4, index_n_heads=2, index_head_dim=16, index_kpool=2, n_group=1, topk_group=1,
                      swiglu_clamp=1.5, swiglu_clamp_shared=1.5, swiglu_clamp_gate=True, embed_mask_pos0=True),
}

#: the prompt's length and the proposes (k, fraction accepted): module 0 ends with ~30 rows
PROMPT = 13
ROUNDS = [(3, 1.0), (3, 0.4), (2, 0.0), (3, 1.0), (3, 1.0), (3, 0.7), (3, 1.0)]


# -- config.json as released ------------------------------------------------------------------------

def release_config(cfg) -> dict:
    """The release's config.json for ``cfg`` (its fields, tiny sizes). V3.2: ``rope_scaling``
    (YaRN) and ``rope_theta``, no ``indexer_rope_interleave`` (transformers' V3.2 indexer
    rotates halves); GLM-5: ``rope_parameters``, ``indexer_rope_interleave``; GLM-5.3: the
    vision-language wrapper with the text model in ``text_config``, the trunk's
    hyper-connections, linear attention and layer patterns beside the MTP layer's fields.
    None of them has ``embed_mask_pos0``: the families' default (on) is what the model here
    computes, and ``test_the_release_config_reads_as_the_test_config`` checks it is read so."""
    common = {
        "hidden_size": cfg.hidden_size, "intermediate_size": 96, "moe_intermediate_size": cfg.moe_intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers, "num_nextn_predict_layers": cfg.num_modules,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_attention_heads,
        "n_shared_experts": cfg.n_shared_experts, "n_routed_experts": cfg.n_routed_experts,
        "routed_scaling_factor": cfg.routed_scaling_factor, "kv_lora_rank": cfg.kv_lora_rank,
        "q_lora_rank": cfg.q_lora_rank, "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "qk_nope_head_dim": cfg.block(0).qk_nope_head_dim, "v_head_dim": cfg.v_head_dim, "n_group": cfg.n_group,
        "topk_group": cfg.topk_group, "num_experts_per_tok": cfg.num_experts_per_tok, "first_k_dense_replace": 1,
        "norm_topk_prob": True, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "hidden_act": "silu",
        "max_position_embeddings": 4096, "rms_norm_eps": cfg.rms_norm_eps, "attention_bias": False,
        "index_topk": cfg.index_topk, "index_n_heads": cfg.index_n_heads, "index_head_dim": cfg.index_head_dim,
        "vocab_size": cfg.vocab_size, "tie_word_embeddings": False,
        # no embed_mask_pos0 (mtpkern's switch of vLLM's position-0 mask, absent from every
        # release): each family's default, on (vLLM's deepseek_mtp.py and GLM-5.3's MTP layer mask)
    }
    if cfg.family == "deepseek_v32":
        return dict(common, architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32",
                    rope_theta=cfg.rope_theta, rope_scaling=YARN, moe_layer_freq=1, ep_size=1)
    if cfg.family == "glm_moe_dsa":
        return dict(common, architectures=["GlmMoeDsaForCausalLM"], model_type="glm_moe_dsa",
                    rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
                    indexer_rope_interleave=True, index_topk_freq=4, index_skip_topk_offset=3)
    layers = cfg.num_hidden_layers
    text = dict(common, model_type="glm5_next_text", head_dim=0, swiglu_limit=cfg.swiglu_clamp,
                index_kpool=cfg.index_kpool, index_kpool_always_select_tail=True, hc_mult=4, hc_eps=1e-6,
                hc_sinkhorn_iters=20, linear_head_dim=16, linear_num_heads=4, linear_conv_kernel_dim=4,
                layer_types=["linear_attention"] * (layers - 1) + ["indexed_attention"],
                mlp_layer_types=["dense"] + ["sparse"] * (layers - 1), indexer_types=["full"] * layers)
    return {"architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next", "text_config": text,
            "vision_config": {"depth": 2}, "image_token_id": 300}


# -- the model --------------------------------------------------------------------------------------

class NearTie(RuntimeError):
    """Two candidates of a top-k within float rounding: the case says nothing either way."""


def rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def layernorm(x, w, b, eps):
    d = x - x.mean(axis=-1, keepdims=True)
    return d / np.sqrt(np.mean(d * d, axis=-1, keepdims=True) + eps) * w + b


def silu(x):
    return x / (1 + np.exp(-x))


def yarn(R: int, theta: float, y: dict | None):
    """(inv_freq [R/2], cos / sin factor, softmax factor) of RoPE over R dims: plain, or YaRN as
    transformers' ``_compute_yarn_parameters`` and ``yarn_apply_mscale`` compute it."""
    base = theta ** (-np.arange(0, R, 2) / R)                                       # [R/2]
    if not y or y.get("type", y.get("rope_type")) != "yarn":
        return base, 1.0, 1.0

    def ms(s, m=1.0):
        return 1.0 if s <= 1 else 0.1 * m * np.log(s) + 1.0

    f, omax = y["factor"], y["original_max_position_embeddings"]
    dim = lambda rot: R * np.log(omax / (rot * 2 * np.pi)) / (2 * np.log(theta))  # noqa: E731: dim of `rot` turns
    lo, hi = max(np.floor(dim(y["beta_fast"])), 0), min(np.ceil(dim(y["beta_slow"])), R - 1)
    ramp = np.clip((np.arange(R // 2) - lo) / ((hi + 0.001 if hi == lo else hi) - lo), 0, 1)
    inv = base / f * ramp + base * (1 - ramp)
    m, mall = y.get("mscale", 0), y.get("mscale_all_dim", 0)
    att = ms(f, m) / ms(f, mall) if m and mall else ms(f)
    return inv, att, (ms(f, mall) ** 2 if mall else 1.0)


def rope(x, pos, inv, att, pairs: bool):
    """x [n, h, R] all rotated at pos [n]: pairs (2i, 2i + 1), or halves (i, i + R/2)."""
    R = x.shape[-1]
    if R == 0:
        return x.copy()
    ang = pos[:, None] * inv[None, :]
    c, s = (np.cos(ang) * att)[:, None, :], (np.sin(ang) * att)[:, None, :]
    i1, i2 = (np.arange(0, R, 2), np.arange(1, R, 2)) if pairs else (np.arange(R // 2), np.arange(R // 2, R))
    out = x.copy()
    out[..., i1] = x[..., i1] * c - x[..., i2] * s
    out[..., i2] = x[..., i2] * c + x[..., i1] * s
    return out


def top(scores: np.ndarray, k: int, later: bool = False) -> np.ndarray:
    """The ``k`` best of ``scores`` (ties: the earlier; ``later``: the later), ascending. Equal
    scores are exact ties (an index score is 0 wherever relu cuts every head, which the runs
    here meet at the cut); scores apart by less than float rounding at the cut raise."""
    idx = np.arange(len(scores))
    order = np.lexsort((-idx if later else idx, -scores))
    s = np.sort(scores)[::-1]
    if len(s) > k and 0 < s[k - 1] - s[k] < 1e-6 * max(1.0, abs(s[k - 1])):
        raise NearTie(f"top-{k}: {s[k - 1]} vs {s[k]}")
    return np.sort(order[:k])


#: the reference with one thing wrong, for the negative controls
WRONG = ("dense", "topk_larger", "rope_flipped", "ties_later", "pools_of_1", "no_tail", "no_ape", "no_pos0_mask", "prenorm")


class Release(ReleaseFiles):
    """The checkpoint's tensors (by their names) and its config.json, as released."""

    @property
    def prefix(self) -> str:
        return "model.language_model." if "text_config" in self.c else "model."

    def embed(self):
        return self.t[self.prefix + "embed_tokens.weight"].astype(np.float64)

    def module(self, m: int) -> "Module":
        return Module(self, m)


class Module:
    """MTP module ``m``: the decoder layer at ``num_hidden_layers + m``."""

    def __init__(self, rel: Release, m: int):
        c = rel.text
        p = f"{rel.prefix}layers.{c['num_hidden_layers'] + m}."
        self.c, self.m, self.model_type = c, m, c["model_type"]
        self.W = lambda name: rel.t[p + name].astype(np.float64)
        self.embed = rel.embed()
        self.head = (self.W("shared_head.head.weight") if p + "shared_head.head.weight" in rel.t
                     else rel.t["lm_head.weight"].astype(np.float64))
        self.has = lambda name: p + name in rel.t

    # DeepseekV32Attention / Glm5NextTextAttention, with the indexer's selection
    def mla(self, a, pos, wrong):
        c, W, n = self.c, self.W, len(a)
        eps, Hq, L, R = c["rms_norm_eps"], c["num_attention_heads"], c["kv_lora_rank"], c["qk_rope_head_dim"]
        P, Dv = c["qk_nope_head_dim"], c["v_head_dim"]
        theta = c.get("rope_theta", c.get("rope_parameters", {}).get("rope_theta", 10000.0))
        inv, att, mscale2 = yarn(R, theta, c.get("rope_scaling") or c.get("rope_parameters"))
        qr = rms(a @ W("self_attn.q_a_proj.weight").T, W("self_attn.q_a_layernorm.weight"), eps)   # [n, Qr]
        q = (qr @ W("self_attn.q_b_proj.weight").T).reshape(n, Hq, P + R)
        kv = a @ W("self_attn.kv_a_proj_with_mqa.weight").T                         # [n, L + R]
        cl = rms(kv[:, :L], W("self_attn.kv_a_layernorm.weight"), eps)              # [n, L]
        k_pe = rope(kv[:, None, L:], pos, inv, att, pairs=True)[:, 0]               # [n, R]: the last R dims
        q_pe = rope(q[:, :, P:], pos, inv, att, pairs=True)                         # [n, Hq, R]
        kvb = W("self_attn.kv_b_proj.weight").reshape(Hq, P + Dv, L)                # per head [k_nope | v]
        k_nope = np.einsum("jl,hpl->jhp", cl, kvb[:, :P])                           # [n, Hq, P]
        v = np.einsum("jl,hdl->jhd", cl, kvb[:, P:])                                # [n, Hq, Dv]
        scale = (P + R) ** -0.5 * mscale2
        s = (np.einsum("ihp,jhp->hij", q[:, :, :P], k_nope) + np.einsum("ihr,jr->hij", q_pe, k_pe)) * scale
        seen, index_rows = self.indexer(a, qr, pos, inv, att, wrong)                # [n, n], [n, Di or 2 Di]
        s = np.where(seen[None], s, -np.inf)
        with np.errstate(invalid="ignore"):               # a row that sees nothing (a wrong model's): NaN
            p = np.exp(s - s.max(axis=2, keepdims=True))
            o = np.einsum("hij,jhd->ihd", p / p.sum(axis=2, keepdims=True), v)      # [n, Hq, Dv]
        rows = np.concatenate([cl, k_pe, index_rows], axis=1)                       # the KV: latent row, indexer
        return o.reshape(n, Hq * Dv) @ W("self_attn.o_proj.weight").T, rows

    # DeepseekV32Indexer / GlmMoeDsaIndexer / Glm5NextTextIndexer
    def indexer(self, a, qr, pos, inv, att, wrong):
        c, W, n = self.c, self.W, len(a)
        Hi, Di, R, T = c["index_n_heads"], c["index_head_dim"], c["qk_rope_head_dim"], c["index_topk"]
        if wrong == "topk_larger":
            T += max(2, c.get("index_kpool", 1))
        pairs = c.get("indexer_rope_interleave", self.model_type == "glm_moe_dsa")
        if wrong == "rope_flipped":
            pairs = not pairs
        q = (qr @ W("self_attn.indexer.wq_b.weight").T).reshape(n, Hi, Di)
        k = layernorm(a @ W("self_attn.indexer.wk.weight").T, W("self_attn.indexer.k_norm.weight"),
                      W("self_attn.indexer.k_norm.bias"), 1e-6)                     # [n, Di]
        q[:, :, :R] = rope(q[:, :, :R], pos, inv, att, pairs)                       # the FIRST R dims
        k[:, :R] = rope(k[:, None, :R], pos, inv, att, pairs)[:, 0]
        w = (a @ W("self_attn.indexer.weights_proj.weight").T) * Hi ** -0.5 * Di ** -0.5   # [n, Hi]
        causal = np.tril(np.ones((n, n), bool))
        P = c.get("index_kpool", 0) if c.get("index_kpool", 0) > 1 else 0
        gate = a @ W("self_attn.indexer.index_kpool_compress_gate").T if P else None    # [n, Di]
        rows = k if not P else np.concatenate([k, gate], axis=1)
        if wrong == "dense":
            return causal, rows
        seen = np.zeros((n, n), bool)
        if not P or wrong == "pools_of_1":
            for i in range(n):                              # row i sees keys 0..i
                if i + 1 <= T:
                    seen[i, :i + 1] = True
                    continue
                score = w[i] @ np.maximum(q[i] @ k[:i + 1].T, 0.0)                 # [i + 1]
                seen[i, top(score, T, wrong == "ties_later")] = True
            return seen, rows
        ape = 0.0 if wrong == "no_ape" else W("self_attn.indexer.index_kpool_compress_ape")   # [P, Di]
        for i in range(n):
            pools = (i + 1) // P                            # complete pools row i sees
            keep = np.arange(pools)
            if pools > T // P:
                g = (gate[:pools * P].reshape(pools, P, Di) + ape)
                e = np.exp(g - g.max(axis=1, keepdims=True))
                pk = (e / e.sum(axis=1, keepdims=True) * k[:pools * P].reshape(pools, P, Di)).sum(axis=1)
                keep = top(w[i] @ np.maximum(q[i] @ pk.T, 0.0), T // P)
            for j in keep:
                seen[i, j * P:(j + 1) * P] = True
            if wrong != "no_tail":                          # index_kpool_always_select_tail
                seen[i, pools * P:i + 1] = True
        return seen, rows

    # DeepseekV32MoE / Glm5NextTextMoE
    def moe(self, b):
        c, W = self.c, self.W
        lim = c.get("swiglu_limit") or np.inf

        def swiglu(x, name):
            g, u = x @ W(name + ".gate_proj.weight").T, x @ W(name + ".up_proj.weight").T
            return (silu(np.minimum(g, lim)) * np.clip(u, -lim, lim)) @ W(name + ".down_proj.weight").T

        E, k = c["n_routed_experts"], c.get("num_experts_per_tok", c.get("num_experts_per_token"))
        G, TG = c["n_group"], c["topk_group"]
        s = 1 / (1 + np.exp(-(b @ W("mlp.gate.weight").T)))                         # [n, E]
        choice = s + W("mlp.gate.e_score_correction_bias")
        out = swiglu(b, "mlp.shared_experts")
        for r in range(len(b)):
            grp = np.sort(choice[r].reshape(G, E // G), axis=1)[:, -2:].sum(axis=1)    # [G]
            ok = np.repeat(np.isin(np.arange(G), top(grp, TG)), E // G)
            idx = top(np.where(ok, choice[r], -np.inf), k)
            wt = s[r, idx] / (s[r, idx].sum() if c["norm_topk_prob"] else 1.0) * c["routed_scaling_factor"]
            for e, we in zip(idx, wt):
                out[r] += we * swiglu(b[r:r + 1], f"mlp.experts.{e}")[0]
        return out

    # vLLM DeepSeekMultiTokenPredictorLayer.forward around the decoder layer
    def forward(self, toks, g, wrong=None):
        """Rows ``toks`` [n] of one sequence at positions m + 1, m + 2, ... with hiddens ``g``
        [n, H] -> (the KV rows [n, L + R + Di (+ Di)], y [n, H], shared_head.norm(y) [n, H])."""
        c, W, eps = self.c, self.W, self.c["rms_norm_eps"]
        n = len(toks)
        pos = np.arange(n) + self.m + 1
        emb = self.embed[toks]
        if c.get("embed_mask_pos0", True) and wrong != "no_pos0_mask":
            emb = np.where((pos == 1)[:, None], 0.0, emb)     # vLLM's position 0: module 0's key 0 here
        x = np.concatenate([rms(emb, W("enorm.weight"), eps), rms(g, W("hnorm.weight"), eps)], axis=1)
        x = x @ W("eh_proj.weight").T                                               # [e | h]
        o, rows = self.mla(rms(x, W("input_layernorm.weight"), eps), pos, wrong)
        r = x + o
        y = r + self.moe(rms(r, W("post_attention_layernorm.weight"), eps))
        return rows, y, rms(y, W("shared_head.norm.weight"), eps)


def chain(rel: Release, tokens, hiddens, wrong=None):
    """Every module's (KV rows, normed) given tokens t_0.. and target hiddens h_0..: module m
    holds keys 0 .. min(#h, #t - m - 1) - 1, row j from (t_{j+m+1}, module m-1's row j)."""
    g = np.asarray(hiddens, np.float64)
    out = []
    for m in range(rel.text["num_nextn_predict_layers"]):
        R = max(0, min(len(g), len(tokens) - m - 1))
        rows, y, normed = rel.module(m).forward(np.asarray(tokens[m + 1:m + 1 + R]), g[:R], wrong)
        out.append((rows, normed))
        g = y if wrong == "prenorm" else normed
    return out


# -- mtpkern's run, recorded; the model replays it ------------------------------------------------------

def record(path, backend: str, seed: int = 5) -> list:
    """A prompt, then ``ROUNDS`` of propose / verify / catch-up on mtpkern's proposer; after
    every call the inputs so far and every module's KV rows, and each propose's drafts."""
    prop = MultiModuleMtpHead.from_pretrained(path, backend=backend, kv_mode="exact", block_size=4, num_blocks=96,
                                              prefill_chunk=7)
    return record_trace(prop, np.random.default_rng(seed), PROMPT, ROUNDS)


def replay(rel: Release, trace: list, wrong=None, index_plane: bool = True) -> int:
    """Compares a recorded run with the model (``wrong``: one thing changed); raises
    AssertionError at the first difference. ``index_plane`` False leaves the indexer's keys
    out of the KV comparison. Returns the number of drafts compared."""
    latent = rel.text["kv_lora_rank"] + rel.text["qk_rope_head_dim"]       # the latent row's width
    checked = 0
    for kind, tokens, hiddens, drafts, kv in trace:
        P = len(tokens) - 1
        want = chain(rel, tokens + (drafts or []), hiddens, wrong)
        for m, (got, (rows, normed)) in enumerate(zip(kv, want)):
            w = rows.shape[1] if index_plane else latent
            assert_close(got[:, :w], rows[:, :w], "float32", f"{kind} at {len(tokens)} tokens: module {m}'s KV")
        for m, d in enumerate(drafts or []):
            logits = want[m][1][P - 1] @ rel.module(m).head.T
            best = np.sort(logits)[-2:]
            if best[1] - best[0] < 1e-4 * max(1.0, abs(best[1])):      # within float rounding: either
                assert logits[d] >= best[0], f"P={P}: draft {m} = {d} is not one of the two best"
                continue
            assert d == int(np.argmax(logits)), f"P={P}: draft {m} = {d}, the model's {int(np.argmax(logits))}"
            checked += 1
    return checked


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    """family -> (checkpoint dir, Release)."""
    out = {}
    for fam, fields in FAMILIES.items():
        cfg = tiny_config(**fields)
        path = write_synthetic_checkpoint(tmp_path_factory.mktemp(fam), cfg, seed=17, dtype="float32")
        (path / "config.json").write_text(json.dumps(release_config(cfg)))
        out[fam] = path, Release.read(path)
    return out


@pytest.fixture(scope="module")
def traces(releases):
    memo = {}

    def get(fam, backend):
        if (fam, backend) not in memo:
            memo[fam, backend] = record(releases[fam][0], backend)
        return memo[fam, backend]

    return get


def test_the_release_config_reads_as_the_test_config(releases):
    """mtpkern reads each release-form config.json as the block the checkpoint was written for."""
    for fam, fields in FAMILIES.items():
        path, rel = releases[fam]
        prop = MultiModuleMtpHead.from_pretrained(path, backend="numpy")
        b, want = prop.config.block(0), tiny_config(**fields).block(0)
        assert (b.index_topk, b.index_n_heads, b.index_head_dim, b.kpool, b.qk_rope_head_dim) == \
            (want.index_topk, want.index_n_heads, want.index_head_dim, want.kpool, want.qk_rope_head_dim), fam
        assert b.indexer_rope_interleave == want.indexer_rope_interleave and prop.config.hc_mult == 1, fam
        assert prop.config.embed_mask_pos0 and prop.chain == "postnorm", fam      # the families' defaults
        assert "embed_mask_pos0" not in json.loads((path / "config.json").read_text()), fam
        assert ("shared_head.head.weight" in " ".join(rel.t)) is False     # every module drafts with lm_head


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
@pytest.mark.parametrize("fam", list(FAMILIES))
def test_drafts_and_kv_equal_the_float64_release_model(releases, traces, fam, backend):
    """Every draft the model's argmax, every module's KV rows (the indexer's plane included)
    the model's after every call; the runs are long enough that the selection is sparse."""
    _, rel = releases[fam]
    trace = traces(fam, backend)
    assert max(len(kv[0]) for *_, kv in trace) >= 6 * rel.text["index_topk"]   # module 0's rows
    assert replay(rel, trace) >= 12


@pytest.mark.parametrize("fam, wrong", [
    *[(f, w) for f in ("deepseek_v32", "glm_moe_dsa") for w in ("dense", "topk_larger", "rope_flipped",
                                                                  "ties_later", "no_pos0_mask", "prenorm")],
    *[("glm5_next", w) for w in ("dense", "topk_larger", "pools_of_1", "no_tail", "no_ape", "no_pos0_mask",
                                 "prenorm")],
])
def test_negative_controls_fail(releases, traces, fam, wrong):
    """The model with one thing wrong disagrees with mtpkern's run, on its drafts or on KV
    rows other than the indexer's keys (so the selection, not the keys' storage, shows it)."""
    _, rel = releases[fam]
    with pytest.raises(AssertionError):
        replay(rel, traces(fam, "numpy"), wrong, index_plane=False)
