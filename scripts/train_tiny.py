"""Train a tiny GLM-4.5-layout (``glm4_moe``) target with 3 MTP modules on the Python standard
library's own sources, and write it as a checkpoint mtpkern loads (docs/trained.md).

    python3 -m venv ~/train-venv          # outside the repository; torch is no dependency of mtpkern
    ~/train-venv/bin/pip install torch==2.13.0 numpy safetensors ml_dtypes
    nice -n 10 ~/train-venv/bin/python scripts/train_tiny.py train --out mtpkern/checkpoints/stdlib-glm-tiny \\
        --steps 3000 --eval-every 50
    ~/train-venv/bin/python scripts/train_tiny.py fixture --ckpt mtpkern/checkpoints/stdlib-glm-tiny \\
        --out tests/data/stdlib-glm-tiny_expect.json

torch is a development tool here: this script imports it, the library never does.

- **Tokenizer**: byte-level, token id = byte value, ``V = 256`` (``bytes(ids).decode()``); nothing to
  build or download.
- **Data**: every top-level ``*.py`` of the running interpreter's standard library
  (``sysconfig.get_paths()["stdlib"]``), sorted by name; ``HELD_OUT`` modules are never trained
  on and give the held-out loss. Training windows are drawn at random (``--seed``) from the
  training files joined by newlines.
- **Model**: ``Glm4MoeForCausalLM``'s maths (transformers ``models/glm4_moe/modeling_glm4_moe.py``),
  exactly as mtpkern computes it (docs/model.md, mtpkern/testing/oracle.py): RMSNorm in FP32,
  q/k/v with bias, per-head q/k RMSNorm before RoPE, partial neox RoPE (rotate-half over the
  first ``head_dim * 0.5`` dims), grouped-query attention scaled by ``head_dim ** -0.5``; layer 0
  a dense SwiGLU (``first_k_dense_replace = 1``), the rest MoE: sigmoid router (FP32), top-2 of
  ``E`` routed experts by ``score + e_score_correction_bias`` (kept at 0), weights renormalised and
  scaled by ``routed_scaling_factor``, plus one shared expert on the same input.
  ``M`` MTP modules at ``model.layers.{L + m}``: ``x = eh_proj(concat(enorm(E[t]), hnorm(g)))``, one
  decoder layer (MoE), ``shared_head.norm``, the target's ``lm_head`` (no per-module embedding
  or head, as GLM-4.5 ships them and Hugging Face reads them).
- **Wiring** (docs/semantics.md, docs/hf_reference.md): module 0's row ``j`` reads the target's
  hidden ``h_j`` *after* ``model.norm`` and token ``t_{j+1}`` at RoPE position ``j + 1`` and predicts
  ``t_{j+2}``; module ``m``'s row ``j`` reads module ``m-1``'s row ``j`` output and ``t_{j+m+1}`` at
  position ``j + m + 1`` and predicts ``t_{j+m+2}``. The hidden handed on is
  ``shared_head.norm(y)`` (``--chain postnorm``, Hugging Face's MTP generation; load with
  ``chain="postnorm"``) or ``y`` (``--chain prenorm``).
- **Objective**: DeepSeek-V3's: ``CE(target) + lambda * mean_m CE(module m)``, trained jointly;
  AdamW, linear warm-up then cosine decay, fixed seed, one thread (``--threads``).

The best checkpoint so far (by held-out loss, target plus lambda times the modules' mean) is
written as it goes, so a run cut short still leaves a model.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import shlex
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

#: standard-library modules never trained on (the held-out set)
HELD_OUT = ("bisect.py", "fractions.py", "heapq.py", "shlex.py", "textwrap.py")

#: the config the checkpoint's config.json holds (Glm4MoeConfig's field names)
CONFIG = dict(
    architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe",
    vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    partial_rotary_factor=0.5, rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=2048,
    attention_bias=True, use_qk_norm=True, hidden_act="silu", tie_word_embeddings=False,
    n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=128,
    n_group=1, topk_group=1, first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5,
    num_nextn_predict_layers=3, torch_dtype="bfloat16",
)


# ----------------------------------------------------------------------------- model

class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x, pos, R: int, theta: float):
    """x [B, h, T, D], pos [T]: rotate dims (i, i + R/2), i < R/2, by pos * theta^(-2i/R) (neox halves
    of the first R dims; the rest pass through)."""
    half = R // 2
    freqs = theta ** (-torch.arange(half, dtype=torch.float64) * 2.0 / R)
    ang = pos.to(torch.float64)[:, None] * freqs[None, :]                 # [T, R/2]
    c, s = torch.cos(ang).to(x.dtype), torch.sin(ang).to(x.dtype)
    a, b, rest = x[..., :half], x[..., half:R], x[..., R:]
    return torch.cat([a * c - b * s, b * c + a * s, rest], dim=-1)


class Attention(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        H, D = c["hidden_size"], c["head_dim"]
        self.Hq, self.Hkv, self.D = c["num_attention_heads"], c["num_key_value_heads"], D
        self.R, self.theta = int(D * c["partial_rotary_factor"]), c["rope_theta"]
        bias = c["attention_bias"]
        self.q_proj = nn.Linear(H, self.Hq * D, bias=bias)
        self.k_proj = nn.Linear(H, self.Hkv * D, bias=bias)
        self.v_proj = nn.Linear(H, self.Hkv * D, bias=bias)
        self.o_proj = nn.Linear(self.Hq * D, H, bias=False)
        self.q_norm = RMSNorm(D, c["rms_norm_eps"])
        self.k_norm = RMSNorm(D, c["rms_norm_eps"])

    def forward(self, x, pos):
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.Hq, self.D)).transpose(1, 2)     # [B, Hq, T, D]
        k = self.k_norm(self.k_proj(x).view(B, T, self.Hkv, self.D)).transpose(1, 2)    # [B, Hkv, T, D]
        v = self.v_proj(x).view(B, T, self.Hkv, self.D).transpose(1, 2)
        q, k = rope(q, pos, self.R, self.theta), rope(k, pos, self.R, self.theta)
        rep = self.Hq // self.Hkv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)                       # scale D^-0.5
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.Hq * self.D))


class Mlp(nn.Module):
    """SwiGLU: down(silu(gate x) * up x)."""

    def __init__(self, H: int, I: int):
        super().__init__()
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    def __init__(self, H: int, E: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(E, H))
        self.register_buffer("e_score_correction_bias", torch.zeros(E))


class Moe(nn.Module):
    """Glm4MoeMoE with n_group = topk_group = 1: every expert is evaluated on every row (4 small
    experts: cheaper on a CPU than gathering rows) and weighted by the router, zero where unchosen."""

    def __init__(self, c: dict):
        super().__init__()
        H, I, E = c["hidden_size"], c["moe_intermediate_size"], c["n_routed_experts"]
        self.k, self.scale, self.norm = c["num_experts_per_tok"], c["routed_scaling_factor"], c["norm_topk_prob"]
        self.gate = Router(H, E)
        self.experts = nn.ModuleList(Mlp(H, I) for _ in range(E))
        self.shared_experts = Mlp(H, I * c["n_shared_experts"])

    def forward(self, x):
        s = torch.sigmoid(x.float() @ self.gate.weight.float().T)                        # [B, T, E]
        _, idx = torch.topk(s + self.gate.e_score_correction_bias, self.k, dim=-1)
        w = s.gather(-1, idx)
        if self.norm:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        dense = torch.zeros_like(s).scatter(-1, idx, w * self.scale)                    # [B, T, E]
        y = sum(dense[..., e:e + 1] * ex(x) for e, ex in enumerate(self.experts))
        return y + self.shared_experts(x)


class Layer(nn.Module):
    def __init__(self, c: dict, moe: bool):
        super().__init__()
        eps = c["rms_norm_eps"]
        self.input_layernorm = RMSNorm(c["hidden_size"], eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], eps)
        self.mlp = Moe(c) if moe else Mlp(c["hidden_size"], c["intermediate_size"])

    def forward(self, x, pos):
        r = x + self.self_attn(self.input_layernorm(x), pos)
        return r + self.mlp(self.post_attention_layernorm(r))


class SharedHead(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])


class MtpLayer(Layer):
    """One MTP module: enorm / hnorm / eh_proj in front of a decoder layer, shared_head.norm after it."""

    def __init__(self, c: dict):
        super().__init__(c, moe=c["n_routed_experts"] > 0)    # GLM's MTP layers are MoE (HF: always)
        H, eps = c["hidden_size"], c["rms_norm_eps"]
        self.enorm, self.hnorm = RMSNorm(H, eps), RMSNorm(H, eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.shared_head = SharedHead(c)

    def forward(self, e, g, pos):
        """e: token embeddings [B, T, H], g: incoming hiddens [B, T, H]; returns (y, shared_head.norm(y))."""
        y = super().forward(self.eh_proj(torch.cat([self.enorm(e), self.hnorm(g)], -1)), pos)
        return y, self.shared_head.norm(y)


class Inner(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        L, M = c["num_hidden_layers"], c["num_nextn_predict_layers"]
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList([Layer(c, moe=i >= c["first_k_dense_replace"] and c["n_routed_experts"] > 0)
                                     for i in range(L)] + [MtpLayer(c) for _ in range(M)])
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])


class TinyGlm(nn.Module):
    """The target (``model.layers.0..L-1``, ``model.norm``, ``lm_head``) and its M MTP modules
    (``model.layers.L..L+M-1``); parameter names are the checkpoint's tensor names."""

    def __init__(self, c: dict, chain: str = "postnorm"):
        super().__init__()
        self.c, self.chain = c, chain
        self.L, self.M = c["num_hidden_layers"], c["num_nextn_predict_layers"]
        self.model = Inner(c)
        self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)

    def target(self, ids):
        """ids [B, T] -> (hiddens after model.norm [B, T, H], logits [B, T, V]); positions 0..T-1."""
        pos = torch.arange(ids.shape[1])
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers[:self.L]:
            x = layer(x, pos)
        h = self.model.norm(x)
        return h, self.lm_head(h)

    def mtp(self, ids, h, T: int):
        """Every module's logits over rows 0..T-1: module m's row j reads t_{j+m+1} (ids[:, j+m+1]),
        the hidden of row j from the target (m = 0) or module m-1, at RoPE position j + m + 1, and
        predicts t_{j+m+2}. ids [B, >= T + M], h [B, T, H] -> list of M logits [B, T, V]."""
        g, out = h, []
        for m in range(self.M):
            mod = self.model.layers[self.L + m]
            y, normed = mod(self.model.embed_tokens(ids[:, m + 1:m + 1 + T]), g, torch.arange(T) + m + 1)
            out.append(self.lm_head(normed))
            g = normed if self.chain == "postnorm" else y
        return out

    def losses(self, ids, T: int):
        """ids [B, T + M + 1]: (target CE, [module m CE]) in nats per byte."""
        h, logits = self.target(ids[:, :T])
        V = logits.shape[-1]
        lt = F.cross_entropy(logits.reshape(-1, V), ids[:, 1:T + 1].reshape(-1))
        lm = [F.cross_entropy(lg.reshape(-1, V), ids[:, m + 2:m + 2 + T].reshape(-1))
              for m, lg in enumerate(self.mtp(ids, h, T))]
        return lt, lm


def init_weights(model: TinyGlm, seed: int) -> None:
    """Normal(0, 0.02) matrices and embedding (output projections scaled down by the depth),
    zero biases, unit norms."""
    g = torch.Generator().manual_seed(seed)
    depth = 2 * (model.L + model.M)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                std = 0.02 / math.sqrt(depth) if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                p.copy_(torch.randn(p.shape, generator=g) * std)


# ----------------------------------------------------------------------------- data

def stdlib_files() -> tuple[Path, list[Path], list[Path]]:
    """(stdlib dir, training files, held-out files): top-level *.py, sorted by name."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    held = [p for p in files if p.name in HELD_OUT]
    if len(held) != len(HELD_OUT):
        raise SystemExit(f"held-out modules: expected {HELD_OUT} under {root}, found {[p.name for p in held]}")
    return root, [p for p in files if p.name not in HELD_OUT], held


def corpus(files: list[Path]) -> np.ndarray:
    return np.frombuffer(b"\n".join(p.read_bytes() for p in files), dtype=np.uint8).astype(np.int64)


def windows(data: np.ndarray, n: int, W: int, rng: np.random.Generator) -> torch.Tensor:
    starts = rng.integers(0, len(data) - W, size=n)
    return torch.from_numpy(np.stack([data[s:s + W] for s in starts]))


# ----------------------------------------------------------------------------- checkpoint

def state_tensors(model: TinyGlm) -> dict[str, torch.Tensor]:
    """Checkpoint tensors (BF16), named as the GLM-4.5 release names them."""
    sd = model.state_dict()
    return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in sorted(sd.items())}


def write_checkpoint(out: Path, model: TinyGlm, record: dict) -> None:
    from safetensors.torch import save_file
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "model.safetensors.tmp"
    save_file(state_tensors(model), os.fspath(tmp), metadata={"format": "pt"})
    os.chmod(tmp, 0o644)                       # package data: readable by everyone once installed
    os.replace(tmp, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(model.c, indent=2) + "\n")
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")


def load_checkpoint(ckpt: Path, chain: str | None = None) -> TinyGlm:
    """The model with the checkpoint's BF16 weights (as FP32: what mtpkern computes with)."""
    from safetensors.torch import load_file
    c = json.loads((ckpt / "config.json").read_text())
    if chain is None:
        chain = json.loads((ckpt / "training.json").read_text())["chain"]
    model = TinyGlm(c, chain)
    sd = {k: v.float() for k, v in load_file(os.fspath(ckpt / "model.safetensors")).items()}
    model.load_state_dict(sd, strict=True)
    return model.eval()


# ----------------------------------------------------------------------------- training

@torch.no_grad()
def evaluate(model: TinyGlm, batches: list[torch.Tensor], T: int) -> list[float]:
    """Mean [target, module 0, .., module M-1] CE over ``batches``."""
    model.eval()
    tot = np.zeros(1 + model.M)
    for b in batches:
        lt, lm = model.losses(b, T)
        tot += [lt.item()] + [x.item() for x in lm]
    model.train()
    return (tot / len(batches)).tolist()


def train(args) -> int:
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    root, train_files, held_files = stdlib_files()
    tr, ho = corpus(train_files), corpus(held_files)
    c = dict(CONFIG)
    model = TinyGlm(c, args.chain)
    init_weights(model, args.seed)
    M, T = model.M, args.seq
    W = T + M + 1
    n_params = sum(p.numel() for p in model.parameters())
    target_params = sum(p.numel() for n, p in model.named_parameters()
                        if not any(n.startswith(f"model.layers.{model.L + m}.") for m in range(M)))
    decay = [p for n, p in model.named_parameters() if p.ndim == 2 and "embed" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim == 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd}, {"params": rest, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))

    budget = args.max_minutes * 60

    def lr_at(step, elapsed):
        """Linear warm-up, then a cosine down to 10 %; its progress is the larger of the steps' and
        the wall-time budget's, so a run the time limit cuts short still ends annealed."""
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        p = max((step - args.warmup) / max(1, args.steps - args.warmup), elapsed / budget)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, p))))

    erng = np.random.default_rng(args.seed + 1)
    held_batches = [windows(ho, args.batch, W, erng) for _ in range(args.eval_batches)]
    train_eval = [windows(tr, args.batch, W, erng) for _ in range(args.eval_batches)]
    out = Path(args.out)
    sha = hashlib.sha256(b"".join(p.read_bytes() for p in train_files)).hexdigest()
    record = {
        "command": " ".join(shlex.quote(a) for a in [sys.executable] + sys.argv),
        "seed": args.seed, "chain": args.chain, "lambda": args.lam,
        "tokenizer": "bytes: token id = byte value, vocab_size 256",
        "python": platform.python_version(), "torch": torch.__version__,
        "stdlib_dir": str(root), "data": "top-level *.py of the standard library, sorted, joined by b'\\n'",
        "train_files": [p.name for p in train_files], "train_bytes": int(len(tr)), "train_sha256": sha,
        "held_out_files": [p.name for p in held_files], "held_out_bytes": int(len(ho)),
        "seq_len": T, "batch": args.batch, "lr": args.lr, "warmup": args.warmup, "weight_decay": args.wd,
        "steps_planned": args.steps, "max_minutes": args.max_minutes, "threads": args.threads,
        "schedule": "linear warm-up, cosine to 10 % over max(steps, wall-time budget) progress",
        "parameters": n_params, "target_parameters": target_params, "mtp_parameters": n_params - target_params,
        "heads": ["target"] + [f"module {m}" for m in range(M)],
    }
    print(f"params {n_params} (target {target_params}, MTP {n_params - target_params}); train {len(tr)} B, "
          f"held-out {len(ho)} B; {args.steps} steps of {args.batch} x {T}", flush=True)
    t0 = time.time()
    best = math.inf
    done = 0                                    # steps run
    for step in range(args.steps):
        elapsed = time.time() - t0
        if elapsed > budget:
            print(f"time limit reached at step {step}", flush=True)
            break
        for gr in opt.param_groups:
            gr["lr"] = lr = lr_at(step, elapsed)
        lt, lm = model.losses(windows(tr, args.batch, W, rng), T)
        loss = lt + args.lam * sum(lm) / M
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        done = step + 1
        if step % args.log_every == 0:
            print(f"step {step:5d} {time.time() - t0:7.1f}s lr {lr:.2e} target {lt.item():.3f} "
                  + " ".join(f"m{m} {x.item():.3f}" for m, x in enumerate(lm)), flush=True)
        last = step + 1 == args.steps
        if (step + 1) % args.eval_every == 0 or last:
            he = evaluate(model, held_batches, T)
            score = he[0] + args.lam * sum(he[1:]) / M
            print(f"eval  {step + 1:5d} held-out " + " ".join(f"{x:.3f}" for x in he) + f" score {score:.4f}",
                  flush=True)
            if score < best:
                best = score
                te = evaluate(model, train_eval, T)
                record.update(steps=step + 1, wall_seconds=round(time.time() - t0, 1),
                              loss_train=dict(zip(record["heads"], [round(x, 4) for x in te])),
                              loss_held_out=dict(zip(record["heads"], [round(x, 4) for x in he])),
                              loss_unit="nats per byte, mean over the windows of eval_batches batches")
                write_checkpoint(out, model, record)
                print(f"saved {out} at step {step + 1}", flush=True)
    record_path = out / "training.json"
    rec = json.loads(record_path.read_text())
    rec["run_wall_seconds"] = round(time.time() - t0, 1)
    rec["steps_run"] = done
    record_path.write_text(json.dumps(rec, indent=2) + "\n")
    print(f"done: {rec['steps_run']} steps in {rec['run_wall_seconds']} s; best at step {rec['steps']}", flush=True)
    return 0


# ----------------------------------------------------------------------------- fixture

@torch.no_grad()
def chain_drafts(model: TinyGlm, verified: list[int], h: torch.Tensor) -> tuple[list[int], list[float], list[float]]:
    """The M drafts of an exact-mode propose at P = len(verified) - 1 (docs/semantics.md): verified
    t_0..t_P, target hiddens h [1, P, H] (h_0..h_{P-1}). Module m holds rows 0..P-1, row j reading
    t_{j+m+1} (the last row's token is draft d_{m-1} for m >= 1) and row j of module m-1 (h_j for
    m = 0); its last row's argmax is d_m. Returns the drafts, each one's top-2 logit margin and its
    confidence (its softmax probability, as ``propose``'s ``out_conf``)."""
    seq, P = list(verified), h.shape[1]
    g, drafts, margins, confs = h, [], [], []
    for m in range(model.M):
        ids = torch.tensor([seq[m + 1:m + 1 + P]])
        y, normed = model.model.layers[model.L + m](model.model.embed_tokens(ids), g, torch.arange(P) + m + 1)
        logits = model.lm_head(normed[:, -1])[0]
        top = logits.topk(2)
        drafts.append(int(top.indices[0]))
        margins.append(float(top.values[0] - top.values[1]))
        confs.append(float(torch.softmax(logits, -1)[drafts[-1]]))
        seq.append(drafts[-1])
        g = normed if model.chain == "postnorm" else y
    return drafts, margins, confs


@torch.no_grad()
def teacher_forced(model: TinyGlm, ids: torch.Tensor, h: torch.Tensor) -> list[list[int]]:
    """Each module's argmax over every row it has on a verified sequence ids [1, n] with target
    hiddens h [1, n, H]: module m's row j (j < n - m - 1) reads the true t_{j+m+1} and predicts
    t_{j+m+2}."""
    n, g, out = ids.shape[1], h, []
    for m in range(model.M):
        R = n - m - 1
        y, normed = model.model.layers[model.L + m](model.model.embed_tokens(ids[:, m + 1:m + 1 + R]), g[:, :R],
                                                    torch.arange(R) + m + 1)
        out.append(model.lm_head(normed)[0].argmax(-1).tolist())
        g = normed if model.chain == "postnorm" else y
    return out


def held_out_prompt(name: str, anchor: str, n: int) -> list[int]:
    """``n`` bytes of held-out module ``name``, from ``anchor`` on."""
    _, _, held = stdlib_files()
    if name not in HELD_OUT:
        raise SystemExit(f"--prompt-file: expected one of the held-out modules {HELD_OUT}, got {name!r}")
    text = (held[0].parent / name).read_bytes()
    start = text.index(anchor.encode())
    return list(text[start:start + n])


@torch.no_grad()
def fixture(args) -> int:
    """tests/data/<name>_expect.json, computed in float64 from the BF16 checkpoint:

    - ``prompt``: ``--prompt-len`` bytes of a held-out module; ``greedy``: the target's greedy
      continuation (``--continue-len`` tokens) and each step's top-2 logit margin;
    - over prompt + greedy: the target's argmax and the first ``HEAD`` values of its hidden
      (after model.norm) at every position, and each module's teacher-forced argmax;
    - over the prompt: the target hiddens in full (FP32), and for every P in 1..n-1 the M drafts
      of an exact-mode propose at P with their margins and confidences (``chain_drafts``),
      computed from those FP32 hiddens."""
    torch.set_num_threads(args.threads)
    ckpt = Path(args.ckpt)
    model = load_checkpoint(ckpt).double()
    prompt = held_out_prompt(args.prompt_file, args.prompt_anchor, args.prompt_len)
    n = len(prompt)
    seq, margins = list(prompt), []
    for _ in range(args.continue_len):                     # greedy, recomputed from scratch (tiny)
        _, lg = model.target(torch.tensor([seq]))
        top = lg[0, -1].topk(2)
        seq.append(int(top.indices[0]))
        margins.append(round(float(top.values[0] - top.values[1]), 6))
    full = torch.tensor([seq])
    hf, lf = model.target(full)
    h = model.target(torch.tensor([prompt]))[0].float().double()   # the stored FP32 hiddens are what the modules read
    proposals = []
    for P in range(1, n):
        d, m, c = chain_drafts(model, prompt[:P + 1], h[:, :P])
        proposals.append({"P": P, "drafts": d, "margins": [round(x, 6) for x in m], "confidences": c})
    rec = json.loads((ckpt / "training.json").read_text())
    HEAD = 8
    out = {
        "checkpoint": ckpt.name, "chain": model.chain, "computed": "torch float64 from the BF16 checkpoint",
        "tokenizer": "bytes: token id = byte value", "held_out_files": rec["held_out_files"],
        "prompt_source": f"{args.prompt_file} (held out), from {args.prompt_anchor!r}",
        "prompt": prompt, "prompt_text": bytes(prompt).decode("utf-8", "replace"),
        "greedy": seq[n:], "greedy_text": bytes(seq[n:]).decode("utf-8", "replace"), "greedy_margins": margins,
        "sequence_target_argmax": lf[0].argmax(-1).tolist(),
        "sequence_hidden_head": [[float(np.float32(x)) for x in row[:HEAD]] for row in hf[0].tolist()],
        "sequence_teacher_forced_argmax": teacher_forced(model, full, hf),
        "prompt_hiddens": [[float(np.float32(x)) for x in row] for row in h[0].tolist()],
        "proposals": proposals,
    }
    Path(args.out).write_text(json.dumps(out) + "\n")
    print(f"wrote {args.out}: prompt {n} tokens {out['prompt_text']!r}, greedy {len(seq) - n}: {out['greedy_text']!r}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("--out", required=True)
    t.add_argument("--seed", type=int, default=1234)
    t.add_argument("--steps", type=int, default=1200)
    t.add_argument("--warmup", type=int, default=30)
    t.add_argument("--seq", type=int, default=256)
    t.add_argument("--batch", type=int, default=8)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--wd", type=float, default=0.1)
    t.add_argument("--lam", type=float, default=0.3, help="weight of the modules' mean CE")
    t.add_argument("--chain", choices=("postnorm", "prenorm"), default="postnorm")
    # one thread: on 2 cores shared with other jobs (load ~6), two torch threads took 62 s for the
    # first step of 8 x 256 (each waits for the other, descheduled), one thread 1.1 s
    t.add_argument("--threads", type=int, default=1)
    t.add_argument("--max-minutes", type=float, default=33.0)
    t.add_argument("--eval-every", type=int, default=100)
    t.add_argument("--eval-batches", type=int, default=4)
    t.add_argument("--log-every", type=int, default=10)
    f = sub.add_parser("fixture")
    f.add_argument("--ckpt", required=True)
    f.add_argument("--out", required=True)
    f.add_argument("--prompt-file", default="textwrap.py")
    f.add_argument("--prompt-anchor", default="    def _split(self, text):")
    f.add_argument("--prompt-len", type=int, default=16)
    f.add_argument("--continue-len", type=int, default=64)
    f.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    return train(args) if args.cmd == "train" else fixture(args)


if __name__ == "__main__":
    sys.exit(main())
