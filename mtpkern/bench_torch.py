"""The PyTorch eager peer of the benchmarks (used only when torch is importable).

The same MTP module, written the way a Hugging Face ``MtpModel`` step runs it
eagerly: ``nn.functional`` ops on the module's weights, a contiguous KV cache
per module, routed experts looped over the selected ones. One row per module
per step (a draft-mode propose).

Two callers, one implementation:

- ``mtpkern bench`` (the cpu backend): the checkpoint's weights on the CPU
  (:func:`make_timer`), kept in BF16 and, separately, widened to FP32; the
  faster of the two is the peer;
- ``benchmarks/gpu_bench.py`` (the cuda backend): the benchmark's own random
  BF16 device weights, shared with the CuPy arrays through DLPack (no copy),
  on ``device="cuda"`` (:func:`module_weights`, :func:`step_timer`); every
  timed step starts and ends with ``torch.cuda.synchronize()``, so a time is
  the step's wall time with its device work finished, as the mtpkern propose
  it is compared with is timed.
"""

from __future__ import annotations

import time
from dataclasses import fields
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from .config import MtpConfig
from .timing import Timing
from .weights import ModuleWeights, load_weights


def torch_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device``: the CPU, or a CUDA device torch can use."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device: expected 'cpu' or 'cuda[:N]', got {device!r}") from e
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device: expected 'cpu' or 'cuda[:N]', got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: expected a CUDA device torch can use, got {device!r} "
                         f"(torch {torch.__version__}: torch.cuda.is_available() is False)")
    return dev


def as_torch(a: Any) -> torch.Tensor:
    """A backend array (NumPy, CuPy, Numba) as a tensor on the array's own device, sharing
    its memory through DLPack (a read-only NumPy array, which DLPack cannot export, is
    copied). BF16 stored as its uint16 bits (how the cpu and cuda backends hold it) comes
    back as ``torch.bfloat16``: the bits travel as int16, which every torch with DLPack
    knows, and are viewed, not converted."""
    if isinstance(a, np.ndarray) and not a.flags.writeable:
        a = a.copy()
    bf16 = a.dtype == np.uint16
    t = torch.from_dlpack(a.view(np.int16) if bf16 else a)
    return t.view(torch.bfloat16) if bf16 else t


def module_weights(modules: Sequence[ModuleWeights], dtype: torch.dtype,
                   device: str | torch.device = "cpu") -> list[ModuleWeights]:
    """``modules`` (any backend's arrays) as torch tensors on ``device``: matrices in
    ``dtype``, vectors (norms, biases, the router's bias) in FP32, as :class:`_TorchWeights`
    prepares a checkpoint. A tensor already on ``device`` in that dtype is shared, not copied
    (CuPy BF16 weights under ``dtype=torch.bfloat16`` on their own device)."""
    dev = torch_device(device)
    done: dict[int, torch.Tensor] = {}       # id -> tensor: the embedding / LM head shared by modules stay shared
    out = []
    for mw in modules:
        kw = {}
        for f in fields(mw):
            a = getattr(mw, f.name)
            if a is not None and id(a) not in done:
                t = a if isinstance(a, torch.Tensor) else as_torch(a)
                done[id(a)] = t.to(device=dev, dtype=dtype if t.ndim >= 2 else torch.float32)
            kw[f.name] = None if a is None else done[id(a)]
        out.append(ModuleWeights(**kw))
    return out


class _TorchWeights:
    """A ``Backend`` stand-in for ``load_weights``: tensors in ``dtype``."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def prepare_weight(self, w):
        return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).to(self.dtype)

    def prepare_vector(self, w):
        return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))


def rms_norm(x, w, eps):
    """RMSNorm of x in FP32 with the FP32 weight w, back in x's dtype (as Hugging Face computes it)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w).to(x.dtype)


class TorchMtp:
    """The eager module step on ``modules`` (torch tensors on ``device``: :func:`module_weights`)."""

    def __init__(self, cfg: MtpConfig, modules: Sequence[ModuleWeights], dtype: torch.dtype,
                 device: str | torch.device = "cpu"):
        if any(cfg.block(m).mla for m in range(cfg.num_modules)):
            raise ValueError(f"cfg: expected GQA blocks (the eager peer computes no MLA), got {cfg.describe()}")
        if len(modules) != cfg.num_modules:
            raise ValueError(f"modules: expected {cfg.num_modules} (cfg.num_modules), got {len(modules)}")
        self.cfg, self.dtype, self.device = cfg, dtype, torch_device(device)
        self.w = list(modules)
        R = cfg.rotary_dim
        self.inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, R, 2, dtype=torch.float32, device=self.device) / R))

    @classmethod
    def from_checkpoint(cls, ckpt: Path, cfg: MtpConfig, dtype: torch.dtype,
                        device: str | torch.device = "cpu") -> "TorchMtp":
        modules = load_weights(ckpt, cfg, _TorchWeights(dtype)).modules
        return cls(cfg, module_weights(modules, dtype, device), dtype, device)

    def synchronize(self) -> None:
        """Wait for the device's queued work (nothing to wait for on the CPU)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

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
        x = F.linear(torch.cat([rms_norm(w.embed[tok], w.enorm, eps), rms_norm(g, w.hnorm, eps)], -1), w.eh_proj)
        qkv = F.linear(rms_norm(x, w.input_layernorm, eps), w.w_qkv, None if w.b_qkv is None else w.b_qkv.to(dt))
        q = qkv[:, :Hq * D].view(B, Hq, D)
        k = qkv[:, Hq * D:(Hq + Hkv) * D].view(B, Hkv, D)
        v = qkv[:, (Hq + Hkv) * D:].view(B, Hkv, D)
        if w.q_norm is not None:
            q, k = rms_norm(q, w.q_norm, eps), rms_norm(k, w.k_norm, eps)
        q, k = self.rope(q, pos), self.rope(k, pos)
        kc[:, L], vc[:, L] = k, v
        o = F.scaled_dot_product_attention(q[:, :, None, :], kc[:, :L + 1].transpose(1, 2),
                                           vc[:, :L + 1].transpose(1, 2), enable_gqa=True)
        r = x + F.linear(o.reshape(B, Hq * D), w.w_o)
        f = rms_norm(r, w.post_attention_layernorm, eps)
        if cfg.is_moe:
            s = torch.sigmoid(F.linear(f.float(), w.gate_w.float()))
            c = s + w.gate_bias
            E, G = cfg.n_routed_experts, cfg.n_group
            gs = c.view(B, G, E // G).topk(min(2, E // G), -1).values.sum(-1)
            keep = torch.zeros_like(gs).scatter_(1, gs.topk(cfg.topk_group, -1).indices, 1)
            c = c.masked_fill(~keep.repeat_interleave(E // G, 1).bool(), float("-inf"))
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
        normed = rms_norm(y, w.shared_head_norm, eps)
        return y, F.linear(normed, w.head).argmax(-1)


def step_timer(peers: Sequence[TorchMtp], before: Callable[[], None] | None = None
               ) -> Callable[..., Timing]:
    """``time_step(k, B, warmup, runs, context=512) -> Timing``: one draft step of ``k``
    modules at batch ``B`` over ``context`` rows of random KV, timed on every peer (one per
    dtype); the fastest peer's timing. ``before`` runs ahead of each step, untimed (the GPU
    benchmark's L2 flush); each timed step is bracketed by the device's synchronisation."""
    if not peers:
        raise ValueError("peers: expected at least one TorchMtp, got none")

    def time_step(k: int, B: int, warmup: int, runs: int, context: int = 512) -> Timing:
        best = None
        for peer in peers:
            cfg, dt, dev = peer.cfg, peer.dtype, peer.device
            if not 1 <= k <= cfg.num_modules:
                raise ValueError(f"k: expected 1 .. {cfg.num_modules} (the modules), got {k}")
            H, D, Hkv = cfg.hidden_size, cfg.head_dim, cfg.num_key_value_heads
            cap = context + warmup + runs + 2
            caches = [(torch.randn(B, cap, Hkv, D, dtype=dt, device=dev),
                       torch.randn(B, cap, Hkv, D, dtype=dt, device=dev)) for _ in range(k)]
            tok = torch.randint(0, cfg.vocab_size, (B,), device=dev)
            h = torch.randn(B, H, dtype=dt, device=dev)
            ts = []
            for i in range(warmup + runs):
                L = context + i
                if before is not None:
                    before()
                peer.synchronize()
                t0 = time.perf_counter()
                t, g = tok, h
                for m in range(k):
                    pos = torch.full((B,), L + 1 + m, device=dev)
                    g, t = peer.module(m, t, g, pos, *caches[m], L)
                peer.synchronize()
                if i >= warmup:
                    ts.append(time.perf_counter() - t0)
            del caches
            tm = Timing.of(ts)
            if best is None or tm.median_us < best.median_us:
                best = tm
        return best

    return time_step


def make_timer(ckpt: Path, cfg: MtpConfig, device: str | torch.device = "cpu",
               dtypes: Sequence[torch.dtype] = (torch.bfloat16, torch.float32),
               before: Callable[[], None] | None = None) -> Callable[..., Timing]:
    """:func:`step_timer` over the checkpoint's weights on ``device``, one peer per dtype."""
    return step_timer([TorchMtp.from_checkpoint(ckpt, cfg, dt, device) for dt in dtypes], before)
