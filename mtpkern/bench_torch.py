"""The PyTorch eager peer of the benchmark (used only when torch is importable).

The same MTP module, written the way a Hugging Face ``MtpModel`` step runs it
eagerly: ``nn.functional`` ops on the checkpoint's weights, a contiguous KV
cache per module, routed experts looped over the selected ones. One row per
module per step (a draft-mode propose). Weights are kept in the checkpoint's
BF16 and, separately, widened to FP32; the faster of the two is the peer.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .config import MtpConfig
from .timing import Timing
from .weights import load_weights


class _TorchWeights:
    """A ``Backend`` stand-in for ``load_weights``: tensors in ``dtype``."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def prepare_weight(self, w):
        return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).to(self.dtype)

    def prepare_vector(self, w):
        return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))


def _rms(x, w, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w).to(x.dtype)


class TorchMtp:
    def __init__(self, ckpt: Path, cfg: MtpConfig, dtype: torch.dtype):
        self.cfg, self.dtype = cfg, dtype
        self.w = load_weights(ckpt, cfg, _TorchWeights(dtype)).modules
        R = cfg.rotary_dim
        self.inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, R, 2, dtype=torch.float32) / R))

    def rope(self, x, pos):
        R = self.cfg.rotary_dim
        f = pos[:, None].float() * self.inv[None]                 # [B, R/2]
        c, s = f.cos()[:, None, :].to(x.dtype), f.sin()[:, None, :].to(x.dtype)
        x1, x2 = x[..., :R // 2], x[..., R // 2:R]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, x[..., R:]], -1)

    @torch.no_grad()
    def module(self, m, tok, g, pos, kc, vc, L):
        """One row per sequence: tok [B], g [B, H], pos [B]; caches [B, cap, Hkv, D], L rows used."""
        cfg, w, dt = self.cfg, self.w[m], self.dtype
        eps = cfg.rms_norm_eps
        Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        B = tok.shape[0]
        x = F.linear(torch.cat([_rms(w.embed[tok], w.enorm, eps), _rms(g, w.hnorm, eps)], -1), w.eh_proj)
        qkv = F.linear(_rms(x, w.input_layernorm, eps), w.w_qkv, None if w.b_qkv is None else w.b_qkv.to(dt))
        q = qkv[:, :Hq * D].view(B, Hq, D)
        k = qkv[:, Hq * D:(Hq + Hkv) * D].view(B, Hkv, D)
        v = qkv[:, (Hq + Hkv) * D:].view(B, Hkv, D)
        if w.q_norm is not None:
            q, k = _rms(q, w.q_norm, eps), _rms(k, w.k_norm, eps)
        q, k = self.rope(q, pos), self.rope(k, pos)
        kc[:, L], vc[:, L] = k, v
        o = F.scaled_dot_product_attention(q[:, :, None, :], kc[:, :L + 1].transpose(1, 2),
                                           vc[:, :L + 1].transpose(1, 2), enable_gqa=True)
        r = x + F.linear(o.reshape(B, Hq * D), w.w_o)
        f = _rms(r, w.post_attention_layernorm, eps)
        if cfg.is_moe:
            s = torch.sigmoid(F.linear(f.float(), w.gate_w.float()))
            c = s + w.gate_bias
            E, G = cfg.n_routed_experts, cfg.n_group
            gs = c.view(B, G, E // G).topk(min(2, E // G), -1).values.sum(-1)
            keep = torch.zeros_like(gs).scatter_(1, gs.topk(cfg.topk_group, -1).indices, 1)
            c = c.masked_fill(~keep.repeat_interleave(E // G, 1).bool(), 0.0)
            ids = c.topk(cfg.num_experts_per_tok, -1).indices
            wts = s.gather(1, ids)
            wts = wts / (wts.sum(-1, keepdim=True) + 1e-20) * cfg.routed_scaling_factor
            y = r.clone()
            I = cfg.moe_intermediate_size
            for e in ids.unique().tolist():                       # each selected expert once
                rows, slot = (ids == e).nonzero(as_tuple=True)
                gu = F.linear(f[rows], w.experts_w13[e])
                y.index_add_(0, rows, (F.linear(F.silu(gu[:, :I]) * gu[:, I:], w.experts_w2[e])
                                       * wts[rows, slot, None].to(dt)))
            if w.shared_w13 is not None:
                gu = F.linear(f, w.shared_w13)
                Is = gu.shape[1] // 2
                y = y + F.linear(F.silu(gu[:, :Is]) * gu[:, Is:], w.shared_w2)
        else:
            gu = F.linear(f, w.mlp_w13)
            Im = gu.shape[1] // 2
            y = r + F.linear(F.silu(gu[:, :Im]) * gu[:, Im:], w.mlp_w2)
        normed = _rms(y, w.shared_head_norm, eps)
        return y, F.linear(normed, w.head).argmax(-1)


def make_timer(ckpt: Path, cfg: MtpConfig):
    peers = {dt: TorchMtp(ckpt, cfg, dt) for dt in (torch.bfloat16, torch.float32)}

    def time_step(k: int, B: int, warmup: int, runs: int, context: int = 512) -> Timing:
        best = None
        for dt, peer in peers.items():
            H, D, Hkv = cfg.hidden_size, cfg.head_dim, cfg.num_key_value_heads
            cap = context + warmup + runs + 2
            caches = [(torch.randn(B, cap, Hkv, D, dtype=dt), torch.randn(B, cap, Hkv, D, dtype=dt))
                      for _ in range(cfg.num_modules)]
            tok = torch.randint(0, cfg.vocab_size, (B,))
            h = torch.randn(B, H, dtype=dt)
            ts = []
            for i in range(warmup + runs):
                L = context + i
                t0 = time.perf_counter()
                t, g = tok, h
                for m in range(k):
                    pos = torch.full((B,), L + 1 + m)
                    g, t = peer.module(m, t, g, pos, *caches[m], L)
                if i >= warmup:
                    ts.append(time.perf_counter() - t0)
            tm = Timing.of(ts)
            if best is None or tm.median_us < best.median_us:
                best = tm
        return best

    return time_step
