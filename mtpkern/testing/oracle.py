"""From-scratch recomputation of the module chain: dense, no paging, float64, O(n^2).

Written apart from ``mtpkern.head`` / ``mtpkern.ops`` (its own norm, RoPE and
attention); only the MoE router/experts reference is shared, and that is
tested against brute force in the project's tests (test_ops_reference.py).
``weights``: host FP32 weights, e.g. ``mtpkern.testing.reference_weights(ckpt)``.

``chain_state(...)`` gives, for every module, what its KV and outputs must be
after a call in exact mode; ``propose(...)`` gives the drafts an exact-mode
propose must return; ``DraftRows`` follows one sequence in draft mode. Tiny
models only: every call recomputes the whole chain.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mtpkern.ops import sampling as sampling_ops
from mtpkern.ops.moe import RouterSpec, moe_experts, moe_router


def _rms(x, w, eps):
    x = x.astype(np.float64)
    return (x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * np.asarray(w, np.float64))


def _yarn(R, theta, y):
    """YaRN's (frequencies [R/2], cos/sin factor, scores' factor), float64, from the
    formulas of the YaRN paper as Hugging Face and DeepSeek-V3 write them."""
    def m(scale, k=1.0):                          # the magnitude correction
        return 1.0 if scale <= 1 else 0.1 * k * np.log(scale) + 1.0

    base = theta ** (-np.arange(R // 2) * 2.0 / R)
    # dim d turns omax * base_d / (2 pi) times over the original context; solve for d
    turns_dim = lambda t: R * np.log(y.original_max_position_embeddings / (2 * np.pi * t)) / (2 * np.log(theta))  # noqa: E731
    lo, hi = turns_dim(y.beta_fast), turns_dim(y.beta_slow)
    if y.truncate:
        lo, hi = np.floor(lo), np.ceil(hi)
    lo, hi = max(lo, 0), min(hi, R - 1)
    hi = hi + 0.001 if hi == lo else hi
    interp = np.clip((np.arange(R // 2) - lo) / (hi - lo), 0, 1)   # 1: fully interpolated (divided by factor)
    freqs = base * (1 - interp) + base / y.factor * interp
    if y.attention_factor_override:
        att = y.attention_factor_override
    elif y.mscale and y.mscale_all_dim:
        att = m(y.factor, y.mscale) / m(y.factor, y.mscale_all_dim)
    else:
        att = m(y.factor)
    return freqs, att, (m(y.factor, y.mscale_all_dim) ** 2 if y.mscale_all_dim else 1.0)


def _rope(x, pos, R, theta, interleave=False, yarn=None):
    """x [n, h, D]: rotate the pairs of the first R dims, (i, i + R/2) or (2i, 2i + 1) when
    ``interleave``, by angle pos * theta^(-2i/R) (YaRN's frequencies and cos/sin factor
    when ``yarn``)."""
    half = R // 2
    freqs, att = (theta ** (-np.arange(half) * 2.0 / R), 1.0) if yarn is None else _yarn(R, theta, yarn)[:2]
    ang = pos[:, None].astype(np.float64) * freqs[None, :]
    c = np.cos(ang)[:, None, :] * att
    s = np.sin(ang)[:, None, :] * att
    i1, i2 = (np.arange(0, R, 2), np.arange(1, R, 2)) if interleave else (np.arange(half), np.arange(half, R))
    out = x.copy()
    a, b = x[..., i1], x[..., i2]
    out[..., i1] = a * c - b * s
    out[..., i2] = b * c + a * s
    return out


@dataclass
class ModuleRows:
    k: np.ndarray        # [R, Hkv, D]  (rotated); MLA: the latent rows [R, 1, L + R]
    v: np.ndarray        # [R, Hkv, Dv]; MLA: [R, 1, 0]
    y: np.ndarray        # [R, H]
    normed: np.ndarray   # [R, H]


def module_forward(cfg, w, m: int, toks: np.ndarray, g: np.ndarray, pos: np.ndarray | None = None,
                   keys: np.ndarray | None = None) -> ModuleRows:
    """Module ``m`` over rows 0..R-1, causal: tokens ``toks[j]``, hiddens ``g[j]``, RoPE
    positions ``pos[j]`` (default the exact-mode keys 0..R-1: ``pos[j] = j + m + 1``,
    ``toks[j] = t_{j+m+1}``). ``keys[j]``: row j's key (default j), what a sliding window
    counts in: row j sees row i <= j when ``keys[j] - keys[i] < W``."""
    b = cfg.block(m)
    R = len(toks)
    H, D, Dv, Hq, Hkv, eps = (cfg.hidden_size, b.head_dim, b.v_dim, b.num_attention_heads,
                              b.num_key_value_heads, cfg.rms_norm_eps)
    f = lambda a: np.asarray(a, np.float64)  # noqa: E731
    if R == 0:
        z = np.zeros((0, H))
        if b.mla:
            return ModuleRows(np.zeros((0, 1, b.latent_width + b.index_width)), np.zeros((0, 1, 0)), z, z)
        return ModuleRows(np.zeros((0, Hkv, D)), np.zeros((0, Hkv, Dv)), z, z)
    pos = np.arange(R) + m + 1 if pos is None else np.asarray(pos, np.int64)   # signed: out_rope turns by -pos
    keys = np.arange(R) if keys is None else np.asarray(keys)
    emb = f(w.embed)[toks]                                        # [R, H]
    if cfg.embed_mask_pos0:     # vLLM's position-0 mask: its MTP row (t_{j+1}, h_j) sits at j, ours at j + 1
        emb[pos == 1] = 0.0     # zeros before enorm (their norm is zeros)
    e = _rms(emb, w.enorm, eps)
    m_ = cfg.hc_mult
    if m_ > 1:                                # hyper-connections: every stream with the token's embedding
        streams = np.asarray(g, np.float64).reshape(R, m_, H)
        x = np.stack([np.concatenate([e, _rms(streams[:, i], w.hnorm, eps)], 1) @ f(w.eh_proj).T
                      for i in range(m_)], axis=1).reshape(R, m_ * H)
        xin, hc_attn = _hc_pre(cfg, w.hc_attn, x)
    else:
        h = _rms(g, w.hnorm, eps)
        x = np.concatenate([e, h], 1) @ f(w.eh_proj).T
        xin, hc_attn = x, None
    a = _rms(xin, w.input_layernorm, eps)
    if b.mla:
        att, k, v = _mla(b, w, a, pos, keys, eps)
        r = _residual(x, att.reshape(R, Hq * Dv) @ f(w.w_o).T, hc_attn)
        return _ffn(cfg, b, w, x, r, k, v, eps)
    qkv = a @ f(w.w_qkv).T + (0 if w.b_qkv is None else f(w.b_qkv))
    if b.q_lora_rank:                                             # the query through its latent (DeepSeek-V4)
        qkv = np.concatenate([_rms(a @ f(w.mla_q_a).T, w.mla_q_a_norm, eps) @ f(w.q_b).T, qkv], axis=1)
    q = qkv[:, :b.q_size].reshape(R, Hq, D)
    k = qkv[:, b.q_size:b.q_size + b.k_size].reshape(R, Hkv, D)
    v = None if b.shared_kv else qkv[:, b.q_size + b.k_size:b.q_size + b.k_size + b.v_size].reshape(R, Hkv, Dv)
    gate = qkv[:, b.q_size + b.k_size + b.v_size:] if b.attn_gate else None    # after q|k|v
    if w.q_norm is not None:
        q, k = _rms(q, w.q_norm, eps), _rms(k, w.k_norm, eps)
    rope = dict(interleave=b.rope_interleave, yarn=b.rope_scaling)
    Rd = 0 if b.nope else b.rotary_dim                            # NoPE (Nemotron-H): nothing rotated
    q, k = _rope(q, pos, Rd, b.rope_theta, **rope), _rope(k, pos, Rd, b.rope_theta, **rope)
    if b.shared_kv:                                               # the value is the key, normed and rotated
        v = k
    scale = D ** -0.5 * (1.0 if b.rope_scaling is None else _yarn(b.rotary_dim, b.rope_theta, b.rope_scaling)[2])
    grp = Hq // Hkv
    att = np.zeros((R, Hq, Dv))
    seen = keys[:, None] >= keys[None, :]                         # causal
    if b.sliding_window:
        seen &= keys[:, None] - keys[None, :] < b.sliding_window
    for hh in range(Hq):
        s = q[:, hh] @ k[:, hh // grp].T * scale                  # [R, R]
        s = np.where(seen, s, -np.inf)
        mx = s.max(1, keepdims=True)
        if w.sinks is not None:                                   # a logit that joins the softmax, no value
            sk = float(np.asarray(w.sinks, np.float64)[hh])
            mx = np.maximum(mx, sk)
            p = np.exp(s - mx)
            p /= p.sum(1, keepdims=True) + np.exp(sk - mx)
        else:
            p = np.exp(s - mx)
            p /= p.sum(1, keepdims=True)
        att[:, hh] = p @ v[:, hh // grp]
    if gate is not None:                                          # att * sigmoid(gate): per column, or per head
        att = att / (1 + np.exp(-gate.reshape(R, -1, 1 if b.attn_gate == "headwise" else Dv)))
    if b.out_rope:                                                # back to the query's frame: the angle undone
        att = _rope(att, -pos, Rd, b.rope_theta, **rope)
    return _ffn(cfg, b, w, x, _residual(x, _o_proj(b, w, att.reshape(R, Hq * Dv)), hc_attn), k, v, eps)


def _o_proj(b, w, o):
    """The attention output's projection: o_proj, or DeepSeek-V4's grouped o_a_proj (each group
    of heads its own rows) then o_b_proj."""
    f = lambda t: np.asarray(t, np.float64)  # noqa: E731
    if not b.o_groups:
        return o @ f(w.w_o).T
    g = b.o_groups
    k = o.shape[1] // g
    z = np.concatenate([o[:, i * k:(i + 1) * k] @ f(w.w_o_a[i]).T for i in range(g)], axis=1)
    return z @ f(w.w_o_b).T


def _hc_pre(cfg, hc, X):
    """Hyper-connections' collapse (DeepSeek-V4's mHC), float64: (the sublayer's input [R, H],
    (post [R, m], comb [R, m, m])) of the streams X [R, m H]."""
    fn, base, scale = (np.asarray(t, np.float64) for t in hc)
    m, eps = cfg.hc_mult, cfg.hc_eps
    R, H = X.shape[0], X.shape[1] // m
    z = (X / np.sqrt((X * X).mean(1, keepdims=True) + cfg.rms_norm_eps)) @ fn.T
    sig = lambda t: 1.0 / (1.0 + np.exp(-t))  # noqa: E731
    pre = sig(z[:, :m] * scale[0] + base[:m]) + eps
    post = 2.0 * sig(z[:, m:2 * m] * scale[1] + base[m:2 * m])
    c = z[:, 2 * m:].reshape(R, m, m) * scale[2] + base[2 * m:].reshape(m, m)
    c = np.exp(c - c.max(2, keepdims=True))
    c = c / c.sum(2, keepdims=True) + eps
    c = c / (c.sum(1, keepdims=True) + eps)
    for _ in range(cfg.hc_sinkhorn_iters - 1):
        c = c / (c.sum(2, keepdims=True) + eps)
        c = c / (c.sum(1, keepdims=True) + eps)
    return np.einsum("ri,rih->rh", pre, X.reshape(R, m, H)), (post, c)


def _residual(x, out, hc):
    """``x + out``, or with hyper-connections the streams after the sublayer: post[j] out +
    sum_i comb[i, j] x[i]."""
    if hc is None:
        return x + out
    post, c = hc
    R, m = post.shape
    xs = x.reshape(R, m, -1)
    return (post[:, :, None] * out[:, None, :] + np.einsum("rij,rih->rjh", c, xs)).reshape(R, -1)


def _hc_head(cfg, hc, Y):
    """The LM head's collapse of the streams Y [R, m H], float64."""
    fn, base, scale = (np.asarray(t, np.float64) for t in hc)
    m = cfg.hc_mult
    z = (Y / np.sqrt((Y * Y).mean(1, keepdims=True) + cfg.rms_norm_eps)) @ fn.T
    pre = 1.0 / (1.0 + np.exp(-(z * scale[0] + base))) + cfg.hc_eps
    return np.einsum("ri,rih->rh", pre, Y.reshape(Y.shape[0], m, -1))


def _mla(b, w, a, pos, keys, eps):
    """MLA in its naive form (every latent row decompressed per head through kv_b_proj's
    parts, DeepSeek-V3's formulas), float64: (attention [R, Hq, Dv], the latent rows
    [R, 1, L + R] as the KV, an empty V). qk_rope_head_dim 0 (NoPE, GLM-5.3): k_pe and q_pe
    are empty, nothing is rotated (the indexer's first 0 dims neither), the scale stays
    (P + 0)^-0.5 times YaRN's scores' factor. ``nope`` with Rr > 0 (Kimi K3's gated MLA): the
    Rr dims are there, unrotated (q_pe . k_pe as projected). An element-wise gate: g_proj's
    rows after kv_a_proj_with_mqa's in ``mla_kv_a`` (the loader's layout), read from the same
    normed input ``a``; each head's Dv outputs times sigmoid of its own Dv gate values."""
    f = lambda t: np.asarray(t, np.float64)  # noqa: E731
    R_, Hq, L, Rr, P, Dv = len(a), b.num_attention_heads, b.kv_lora_rank, b.qk_rope_head_dim, \
        b.qk_nope_head_dim, b.v_dim
    qc = a if w.mla_q_a is None else _rms(a @ f(w.mla_q_a).T, w.mla_q_a_norm, eps)
    q = (qc @ f(w.w_qkv).T).reshape(R_, Hq, P + Rr)
    kv_a = a @ f(w.mla_kv_a).T                                        # [R, L + Rr (+ Hq Dv)]
    gate = kv_a[:, L + Rr:] if b.attn_gate else None                  # g_proj's outputs [R, Hq Dv]
    c = _rms(kv_a[:, :L], w.mla_kv_a_norm, eps)                       # [R, L]
    rope = dict(interleave=b.rope_interleave, yarn=b.rope_scaling)
    Rd = 0 if b.nope else Rr                                          # the dims rotated
    k_pe = _rope(kv_a[:, None, L:L + Rr], pos, Rd, b.rope_theta, **rope)[:, 0]   # [R, Rr]
    q_pe = _rope(np.ascontiguousarray(q[:, :, P:]), pos, Rd, b.rope_theta, **rope)
    scale = (P + Rr) ** -0.5 * (1.0 if b.rope_scaling is None else _yarn(Rr, b.rope_theta, b.rope_scaling)[2])
    seen = keys[:, None] >= keys[None, :]
    if b.sliding_window:
        seen &= keys[:, None] - keys[None, :] < b.sliding_window
    rows = np.concatenate([c, k_pe], axis=1)[:, None, :]
    if b.dsa:
        seen, ik = _dsa_pick(b, w, a, qc, pos, seen)
        rows = np.concatenate([rows, ik[:, None, :]], axis=2)       # the indexer key after the latent row
    att = np.zeros((R_, Hq, Dv))
    for hh in range(Hq):
        k_nope = c @ f(w.mla_uk[hh]).T                                # [R, P]
        v = c @ f(w.mla_uv[hh]).T                                     # [R, Dv]
        s = (q[:, hh, :P] @ k_nope.T + q_pe[:, hh] @ k_pe.T) * scale
        s = np.where(seen, s, -np.inf)
        p = np.exp(s - s.max(1, keepdims=True))
        att[:, hh] = (p / p.sum(1, keepdims=True)) @ v
    if gate is not None:                                              # after the attention, before o_proj
        att = att / (1 + np.exp(-gate.reshape(R_, Hq, Dv)))
    return att, rows, np.zeros((R_, 1, 0))


def _dsa_pick(b, w, a, qc, pos, seen):
    """DSA's lightning indexer (DeepSeek-V3.2 / GLM-5), float64: each row keeps the
    ``index_topk`` keys it sees with the highest ``sum_h w_h relu(q_h . k_j)`` (ties: the
    earlier key) -> (the narrowed ``seen`` [R, R], the indexer keys [R, Di])."""
    f = lambda t: np.asarray(t, np.float64)  # noqa: E731
    R_, Hi, Di = len(a), b.index_n_heads, b.index_head_dim
    Rr = 0 if b.nope else b.qk_rope_head_dim                         # nope: the indexer rotates none either
    rope = dict(interleave=b.indexer_rope_interleave, yarn=b.rope_scaling)
    iq = (qc @ f(w.idx_wq_b).T).reshape(R_, Hi, Di)
    iq[:, :, :Rr] = _rope(np.ascontiguousarray(iq[:, :, :Rr]), pos, Rr, b.rope_theta, **rope)
    k = a @ f(w.idx_wk).T                                             # [R, Di]: LayerNorm with a bias
    d = k - k.mean(1, keepdims=True)
    k = d / np.sqrt((d * d).mean(1, keepdims=True) + 1e-6) * f(w.idx_k_norm_w) + f(w.idx_k_norm_b)
    k[:, :Rr] = _rope(np.ascontiguousarray(k[:, None, :Rr]), pos, Rr, b.rope_theta, **rope)[:, 0]
    hw = (a @ f(w.idx_weights).T) * (Hi ** -0.5 * Di ** -0.5)         # [R, Hi]
    if b.kpool:
        return _kpool_pick(b, w, a, iq, hw, k, seen)
    score = np.einsum("ih,ihj->ij", hw, np.maximum(np.einsum("ihd,jd->ihj", iq, k), 0.0))
    keep = seen.copy()
    for i in range(R_):
        js = np.flatnonzero(seen[i])
        if js.size > b.index_topk:
            best = sorted(js.tolist(), key=lambda j: (-score[i, j], j))[:b.index_topk]
            keep[i] = False
            keep[i, best] = True
    return keep, k


def _kpool_pick(b, w, a, iq, hw, k, seen):
    """GLM-5.3's pooled indexer, float64: pools of P consecutive rows from the first, each a
    per-dim softmax of ``gate + ape`` over its rows weighing their keys; each row keeps the
    rows of its ``index_topk / P`` best complete pools (ties: the earlier pool) and, with the
    tail, the rows after its last complete pool -> (``seen`` narrowed, the plane's rows [key |
    gate scores])."""
    f = lambda t: np.asarray(t, np.float64)  # noqa: E731
    P, T = b.kpool, b.index_topk
    gate = a @ f(w.idx_gate).T                                        # [R, Di]
    keep = np.zeros_like(seen)
    for i in range(len(a)):
        L = int(seen[i].sum())
        assert seen[i, :L].all(), "a pooled indexer's rows are a sequence's first L"
        n_pools = L // P
        pools = list(range(n_pools))
        if n_pools * P > T:
            g = (gate[:n_pools * P] + np.tile(f(w.idx_ape), (n_pools, 1))).reshape(n_pools, P, -1)
            e = np.exp(g - g.max(1, keepdims=True))
            pk = ((e / e.sum(1, keepdims=True)) * k[:n_pools * P].reshape(n_pools, P, -1)).sum(1)   # [n_pools, Di]
            score = hw[i] @ np.maximum(np.einsum("hd,jd->hj", iq[i], pk), 0.0)
            pools = sorted(pools, key=lambda j: (-score[j], j))[:T // P]
        for j in pools:
            keep[i, j * P:(j + 1) * P] = True
        if b.index_kpool_tail:
            keep[i, n_pools * P:L] = True
    return keep, np.concatenate([k, gate], axis=1)


def _ffn(cfg, b, w, x, r, k, v, eps) -> ModuleRows:
    """The block after attention: post_attention_layernorm, MoE or dense MLP, the head norm."""
    f = lambda t: np.asarray(t, np.float64)  # noqa: E731
    hc = None
    rin = r
    if cfg.hc_mult > 1:
        rin, hc = _hc_pre(cfg, w.hc_ffn, r)
    fin = _rms(rin, w.post_attention_layernorm, eps)
    if b.moe:
        fin32 = fin.astype(np.float32)
        ids, wts = moe_router(fin32, w.gate_w, w.gate_bias, RouterSpec.from_config(cfg))
        xin = fin32 if w.latent_fc1 is None else (fin @ f(w.latent_fc1).T).astype(np.float32)   # LatentMoE
        y = moe_experts(xin, ids, wts, w.experts_w13, w.experts_w2, np.zeros_like(xin),
                        limit=b.swiglu_clamp or None, clamp_gate=b.swiglu_clamp_gate,
                        **_act_kw(b)).astype(np.float64)
        if w.latent_fc2 is not None:
            y = _latent_back(y, w, eps)
        if w.shared_w13 is not None:
            shared = _mlp(b, fin, w.shared_w13, w.shared_w2)
            if w.shared_gate is not None:                            # sigmoid(x . w_g) per row
                shared = shared / (1 + np.exp(-(fin @ f(w.shared_gate).T)))
            y = y + shared
    else:
        y = _mlp(b, fin, w.mlp_w13, w.mlp_w2)
    y = _residual(r, y, hc)
    head_in = y if cfg.hc_mult == 1 else _hc_head(cfg, w.hc_head, y)
    return ModuleRows(k, v, y, _rms(head_in, w.shared_head_norm, eps))


def _latent_back(y, w, eps):
    """LatentMoE: the routed experts' weighted sum y [n, Lt] (routed_scaling_factor already in its
    weights) back to [n, H]: the latent norm (moe_latent_norm: RMSNorm of the scaled sum), then
    fc2_latent_proj (Kimi K3: ``up(norm(experts(down(x))))``)."""
    if w.latent_norm is not None:
        y = _rms(y, w.latent_norm, eps)
    return y @ np.asarray(w.latent_fc2, np.float64).T


def _act_kw(b) -> dict:
    """The routed experts' activation keywords of block ``b`` (mtpkern.ops.moe)."""
    if b.mlp_act == "situ":
        return {"activation": "situ", "situ_beta": b.situ_beta, "situ_linear_beta": b.situ_linear_beta}
    return {"activation": b.mlp_act}


def situ_f64(g, u, beta: float, linear_beta: float = 0.0):
    """Kimi K3's SituAndMul in float64: beta tanh(g / beta) sigmoid(g) up', up' = lb tanh(up / lb)
    for lb > 0, else up (sigmoid as exp(-logaddexp(0, -g)): no overflow for any g)."""
    g, u = np.asarray(g, np.float64), np.asarray(u, np.float64)
    if linear_beta:
        u = linear_beta * np.tanh(u / linear_beta)
    return beta * np.tanh(g / beta) * np.exp(-np.logaddexp(0.0, -g)) * u


def _mlp(b, x, w13, w2):
    """The shared expert's / dense MLP's: SwiGLU, Nemotron-H's relu2 (NemotronHMLP:
    down(relu(up x) ** 2), w13 the up rows alone), or Kimi K3's SiTU (``situ_f64``)."""
    if b.mlp_act == "relu2":
        return np.maximum(x @ np.asarray(w13, np.float64).T, 0.0) ** 2 @ np.asarray(w2, np.float64).T
    if b.mlp_act == "situ":
        gu = x @ np.asarray(w13, np.float64).T
        I = gu.shape[1] // 2
        return situ_f64(gu[:, :I], gu[:, I:], b.situ_beta, b.situ_linear_beta) @ np.asarray(w2, np.float64).T
    return _swiglu(x, w13, w2, b.swiglu_clamp_shared, b.swiglu_clamp_gate)


def _swiglu(x, w13, w2, limit: float = 0.0, clamp_gate: bool = False):
    """``limit``: Step-3.5's clamp (Step3p7MLP: min(silu(gate), L)), or with ``clamp_gate``
    DeepSeek-V4's (DeepseekV4MLP: silu(min(gate, L))); up clipped to [-L, L] by both."""
    gu = x @ np.asarray(w13, np.float64).T
    I = gu.shape[1] // 2
    gate, up = gu[:, :I], gu[:, I:]
    if limit and clamp_gate:
        gate = np.minimum(gate, limit)
    act = gate / (1 + np.exp(-gate))
    if limit:
        up = np.clip(up, -limit, limit)
        if not clamp_gate:
            act = np.minimum(act, limit)
    return (act * up) @ np.asarray(w2, np.float64).T


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


class DraftRows:
    """The draft-mode rows of one sequence, as plain data: per module, the (token, hidden,
    RoPE position) each of its KV rows was built from (docs/semantics.md, ``kv_mode="draft"``).

    ``prefill`` gives module 0 rows for keys ``0 .. n-2``, ``catchup`` one per verified token
    (keys from the hiddens consumed); ``propose`` adds row ``P-1`` to
    modules ``0 .. k'-1`` (module 0 from ``(t_P, h_{P-1})``, module ``m`` from ``d_{m-1}``
    and module ``m-1``'s chained output) and returns the drafts; ``verify(a)`` keeps
    module ``m``'s row of that propose iff ``m <= a``. Every module recomputes all its
    rows from scratch (float64, O(R^2)): tiny models only."""

    def __init__(self, cfg, weights, chain: str, target_norm=None, vocab=None):
        """``vocab``: a draft vocabulary's ids (the LM heads read only those rows), or None;
        ``weights`` hold the whole heads."""
        self.cfg, self.weights, self.chain, self.target_norm, self.vocab = cfg, weights, chain, target_norm, vocab
        self.rows: list[list[tuple[int, np.ndarray, int]]] = [[] for _ in weights.modules]
        self.k = 0

    def _g(self, h):
        g = np.asarray(h, np.float64).reshape(1, -1)
        return g if self.target_norm is None else _rms(g, self.target_norm, self.cfg.rms_norm_eps)

    def prefill(self, tokens, hiddens) -> None:
        toks = [int(t) for t in tokens]
        for j in range(len(toks) - 1):
            self.rows[0].append((toks[j + 1], self._g(hiddens[j])[0], j + 1))

    def catchup(self, tokens, hiddens, first_key: int) -> None:
        """Module 0's rows of verified tokens: key ``first_key + i`` from ``(tokens[i], hiddens[i])``."""
        for i, t in enumerate(tokens):
            self.rows[0].append((int(t), self._g(hiddens[i])[0], first_key + i + 1))

    def propose(self, last_token: int, hidden, P: int, k: int, masks=None, confs: list | None = None,
                sampling=None) -> list[int]:
        """``confs``: a list the drafts' confidences are appended to; ``sampling``: a
        ``SamplingParams`` (the drafts sampled, as ``_draft64``) or None."""
        cfg, w = self.cfg, self.weights
        tok, g, P = int(last_token), self._g(hidden)[0], int(P)   # P may be any integer type (uint32: -P wraps)
        drafts: list[int] = []
        for m in range(min(k, cfg.num_modules)):
            self.rows[m].append((tok, g, P + m))
            toks = np.array([r[0] for r in self.rows[m]], np.int64)
            gs = np.stack([r[1] for r in self.rows[m]])
            pos = np.array([r[2] for r in self.rows[m]])
            out = module_forward(cfg, w.modules[m], m, toks, gs, pos, keys=pos)    # windows count positions
            head = w.modules[m].head if self.vocab is None else np.asarray(w.modules[m].head)[self.vocab]
            tok = _draft64(out.normed[-1], head, None if masks is None else masks(m, drafts), self.vocab, confs,
                           None if sampling is None else (sampling, P, m))
            drafts.append(tok)
            g = (out.normed if self.chain == "postnorm" else out.y)[-1]
        self.k = len(drafts)
        return drafts

    def verify(self, a: int) -> None:
        for m in range(a + 1, self.k):
            self.rows[m].pop()
        self.k = 0

    def share(self, num_tokens: int | None = None) -> "DraftRows":
        """A copy (a forked sequence), or with ``num_tokens`` = L the rows built from
        ``t_0 .. t_{L-1}`` alone (a prefix share): module ``m``'s row at RoPE position
        ``j + m + 1`` was built from ``t_{j+m+1}``, so the rows at positions ``<= L - 1``."""
        new = DraftRows(self.cfg, self.weights, self.chain, self.target_norm, self.vocab)
        new.rows = [[r for r in rows if num_tokens is None or r[2] <= num_tokens - 1] for rows in self.rows]
        new.k = self.k if num_tokens is None else 0
        return new

    def forced_normed(self, last_token: int, hidden, P: int, path: list[int]) -> np.ndarray:
        """Module ``len(path)``'s normed output at its row of a propose at ``P`` forced along
        ``path`` (draft ``m`` = ``path[m]``), float64, nothing recorded: what a draft tree's
        node at the end of ``path`` (the root when empty) is expanded from."""
        cfg, w = self.cfg, self.weights
        tok, g, P = int(last_token), self._g(hidden)[0], int(P)
        for m in range(len(path) + 1):
            rows = self.rows[m] + [(tok, g, P + m)]
            toks = np.array([r[0] for r in rows], np.int64)
            gs = np.stack([r[1] for r in rows])
            pos = np.array([r[2] for r in rows])
            out = module_forward(cfg, w.modules[m], m, toks, gs, pos, keys=pos)
            if m == len(path):
                return out.normed[-1]
            tok, g = int(path[m]), (out.normed if self.chain == "postnorm" else out.y)[-1]
        raise AssertionError("unreachable")


def _allowed64(logits, mask_words=None, vocab=None) -> np.ndarray:
    """Allowed, non-NaN entries of ``logits`` (over target ids, or over ``vocab``'s ids)."""
    ok = ~np.isnan(logits)
    if mask_words is not None:
        words = np.asarray(mask_words).reshape(-1).astype(np.int64) & 0xFFFFFFFF
        j = np.arange(len(logits)) if vocab is None else np.asarray(vocab, np.int64)
        ok &= ((words[j >> 5] >> (j & 31)) & 1).astype(bool)
    return ok


def _draft64(h, head, mask_words, vocab, confs, sampled=None):
    """The draft of normed row ``h`` (float64): the LM head over the whole vocabulary or the
    ids of ``vocab`` (a draft vocabulary), masked; its confidence appended to ``confs``.
    ``sampled``: (SamplingParams, position P, draft step m): the draft drawn from the
    distribution of the logits rounded to FP32 (mtpkern.ops.sampling, the proposer's key), its
    probability appended to ``confs``."""
    w = np.asarray(head, np.float64)
    logits = h @ w.T
    if sampled is not None:
        sp, P, m = sampled
        lg = np.where(_allowed64(logits, mask_words, vocab), logits, np.nan).astype(np.float32)[None]
        ids, probs, _ = sampling_ops.masked_sample(lg, None, sampling_ops.row_keys([sp], [P], m),
                                                   *sampling_ops.check_params("sampling", [sp], 1),
                                                   id_map=None if vocab is None else np.asarray(vocab, np.int32))
        if confs is not None:
            confs.append(float(probs[0]))
        return int(ids[0])
    tok = masked_argmax64(logits, mask_words, vocab)
    if confs is not None:
        confs.append(confidence64(logits, mask_words, vocab))
    return tok if vocab is None else int(np.asarray(vocab)[tok])


def masked_argmax64(logits, mask_words=None, vocab=None) -> int:
    cand = np.flatnonzero(_allowed64(logits, mask_words, vocab))
    return int(cand[np.argmax(logits[cand])])


def confidence64(logits, mask_words=None, vocab=None) -> float:
    """The softmax of the allowed logits at their argmax (a draft's confidence), float64."""
    lg = np.asarray(logits, np.float64)[_allowed64(logits, mask_words, vocab)]
    top = lg.max()
    with np.errstate(invalid="ignore"):
        return float(1.0 / np.where(lg == top, 1.0, np.exp(lg - top)).sum())   # a tie with the best counts 1


def forced_normed(cfg, weights, verified, hiddens, path: list[int], chain: str, target_norm=None) -> np.ndarray:
    """Exact mode: module ``len(path)``'s normed output at key P - 1 (P = len(verified) - 1)
    when the drafts so far are ``path`` (a draft tree's node, the root when empty)."""
    rows = chain_state(cfg, weights, list(verified) + list(path), hiddens, chain, target_norm)
    return rows[len(path)].normed[len(verified) - 2]


def topk64(h, head, k: int, mask_words=None, vocab=None) -> tuple[list[int], list[float]]:
    """The ``k`` best allowed tokens of normed row ``h`` (float64 logits; value descending,
    ties to the lowest id; target ids) and their probabilities (the confidence rule)."""
    logits = h @ np.asarray(head, np.float64).T
    cand = np.flatnonzero(_allowed64(logits, mask_words, vocab))
    order = cand[np.lexsort((cand, -logits[cand]))][:k]
    lg = logits[cand]
    probs = []
    for c in order:
        with np.errstate(invalid="ignore", over="ignore"):
            probs.append(float(1.0 / np.where(lg == logits[c], 1.0, np.exp(lg - logits[c])).sum()))
    ids = [int(c) if vocab is None else int(np.asarray(vocab)[c]) for c in order]
    return ids, probs


def propose(cfg, weights, verified, hiddens, k: int, chain: str, masks=None, target_norm=None,
            confs: list | None = None, vocab=None, sampling=None):
    """Drafts of a propose at P = len(verified) - 1 (``verified`` ends with t_P,
    ``hiddens`` = h_0 .. h_{P-1}). ``masks``: None or a function (i, drafts) -> words;
    ``confs``: a list the drafts' confidences are appended to; ``vocab``: a draft
    vocabulary's ids (the heads' rows read), or None."""
    toks = list(verified)
    drafts = []
    P = len(verified) - 1
    for m in range(min(k, cfg.num_modules)):
        rows = chain_state(cfg, weights, toks, hiddens, chain, target_norm)
        head = weights.modules[m].head if vocab is None else np.asarray(weights.modules[m].head)[vocab]
        d = _draft64(rows[m].normed[P - 1], head, None if masks is None else masks(m, drafts), vocab, confs,
                     None if sampling is None else (sampling, P, m))
        drafts.append(d)
        toks.append(d)
    return drafts
