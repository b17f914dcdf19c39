"""From-scratch recomputation of the module chain: dense, no paging, float64, O(n^2).

Written apart from ``mtpkern.head`` / ``mtpkern.ops`` (its own norm, RoPE and
attention); only the MoE router/experts reference is shared, and that is
tested against brute force in the project's tests (test_ops_reference.py).
``weights``: host FP32 weights, e.g. ``mtpkern.testing.reference_weights(ckpt)``.

``chain_state(...)`` gives, for every module, what its KV and outputs must be
after a call in exact mode; ``propose(...)`` gives the drafts an exact-mode
propose must return. Tiny models only: every call recomputes the whole chain.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mtpkern.ops.moe import RouterSpec, moe_experts, moe_router


def _rms(x, w, eps):
    x = x.astype(np.float64)
    return (x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * np.asarray(w, np.float64))


def _rope(x, pos, R, theta):
    """x [n, h, D]: rotate dims (i, i + R/2) of the first R by angle pos * theta^(-2i/R)."""
    half = R // 2
    ang = pos[:, None].astype(np.float64) * theta ** (-np.arange(half) * 2.0 / R)[None, :]
    c = np.cos(ang)[:, None, :]
    s = np.sin(ang)[:, None, :]
    out = x.copy()
    a, b = x[..., :half], x[..., half:R]
    out[..., :half] = a * c - b * s
    out[..., half:R] = b * c + a * s
    return out


@dataclass
class ModuleRows:
    k: np.ndarray        # [R, Hkv, D]  (rotated)
    v: np.ndarray        # [R, Hkv, D]
    y: np.ndarray        # [R, H]
    normed: np.ndarray   # [R, H]


def module_forward(cfg, w, m: int, toks: np.ndarray, g: np.ndarray) -> ModuleRows:
    """Module ``m`` over keys 0..R-1: tokens ``toks[j] = t_{j+m+1}``, hiddens ``g[j]``."""
    R = len(toks)
    H, D, Hq, Hkv, eps = (cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads,
                          cfg.num_key_value_heads, cfg.rms_norm_eps)
    f = lambda a: np.asarray(a, np.float64)  # noqa: E731
    if R == 0:
        z = np.zeros((0, H))
        return ModuleRows(np.zeros((0, Hkv, D)), np.zeros((0, Hkv, D)), z, z)
    pos = np.arange(R) + m + 1
    e = _rms(f(w.embed)[toks], w.enorm, eps)
    h = _rms(g, w.hnorm, eps)
    x = np.concatenate([e, h], 1) @ f(w.eh_proj).T
    a = _rms(x, w.input_layernorm, eps)
    qkv = a @ f(w.w_qkv).T + (0 if w.b_qkv is None else f(w.b_qkv))
    q = qkv[:, :Hq * D].reshape(R, Hq, D)
    k = qkv[:, Hq * D:(Hq + Hkv) * D].reshape(R, Hkv, D)
    v = qkv[:, (Hq + Hkv) * D:].reshape(R, Hkv, D)
    if w.q_norm is not None:
        q, k = _rms(q, w.q_norm, eps), _rms(k, w.k_norm, eps)
    q, k = _rope(q, pos, cfg.rotary_dim, cfg.rope_theta), _rope(k, pos, cfg.rotary_dim, cfg.rope_theta)
    grp = Hq // Hkv
    att = np.zeros((R, Hq, D))
    causal = np.tril(np.ones((R, R), bool))
    for hh in range(Hq):
        s = q[:, hh] @ k[:, hh // grp].T / np.sqrt(D)            # [R, R]
        s = np.where(causal, s, -np.inf)
        p = np.exp(s - s.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        att[:, hh] = p @ v[:, hh // grp]
    r = x + att.reshape(R, Hq * D) @ f(w.w_o).T
    fin = _rms(r, w.post_attention_layernorm, eps)
    if cfg.is_moe:
        fin32 = fin.astype(np.float32)
        ids, wts = moe_router(fin32, w.gate_w, w.gate_bias, RouterSpec.from_config(cfg))
        y = moe_experts(fin32, ids, wts, w.experts_w13, w.experts_w2, r.astype(np.float32)).astype(np.float64)
        if w.shared_w13 is not None:
            y = y + _swiglu(fin, w.shared_w13, w.shared_w2)
    else:
        y = r + _swiglu(fin, w.mlp_w13, w.mlp_w2)
    return ModuleRows(k, v, y, _rms(y, w.shared_head_norm, eps))


def _swiglu(x, w13, w2):
    gu = x @ np.asarray(w13, np.float64).T
    I = gu.shape[1] // 2
    gate = gu[:, :I]
    return (gate / (1 + np.exp(-gate)) * gu[:, I:]) @ np.asarray(w2, np.float64).T


def chain_state(cfg, weights, tokens, hiddens, chain: str, target_norm=None) -> list[ModuleRows]:
    """Every module's exact rows given ``tokens`` (t_0.., verified then drafts) and
    ``hiddens`` (h_0 .. h_{Hn-1}): module m holds keys 0 .. min(Hn, T-m-1) - 1."""
    tokens = np.asarray(tokens, np.int64)
    g = np.asarray(hiddens, np.float64)
    if target_norm is not None and len(g):
        g = _rms(g, target_norm, cfg.rms_norm_eps)
    T, Hn = len(tokens), len(g)
    out = []
    for m, w in enumerate(weights.modules):
        R = max(0, min(Hn, T - m - 1))
        rows = module_forward(cfg, w, m, tokens[m + 1:m + 1 + R], g[:R])
        out.append(rows)
        g = rows.normed if chain == "postnorm" else rows.y
    return out


def masked_argmax64(logits, mask_words=None) -> int:
    ok = ~np.isnan(logits)
    if mask_words is not None:
        words = np.asarray(mask_words).astype(np.int64) & 0xFFFFFFFF
        j = np.arange(len(logits))
        ok &= ((words[j >> 5] >> (j & 31)) & 1).astype(bool)
    cand = np.flatnonzero(ok)
    return int(cand[np.argmax(logits[cand])])


def propose(cfg, weights, verified, hiddens, k: int, chain: str, masks=None, target_norm=None):
    """Drafts of a propose at P = len(verified) - 1 (``verified`` ends with t_P,
    ``hiddens`` = h_0 .. h_{P-1}). ``masks``: None or a function (i, drafts) -> words."""
    toks = list(verified)
    drafts = []
    P = len(verified) - 1
    for m in range(min(k, cfg.num_modules)):
        rows = chain_state(cfg, weights, toks, hiddens, chain, target_norm)
        logits = rows[m].normed[P - 1] @ np.asarray(weights.modules[m].head, np.float64).T
        d = masked_argmax64(logits, None if masks is None else masks(m, drafts))
        drafts.append(d)
        toks.append(d)
    return drafts
