"""How often FP8 indexer keys pick other keys than FP32 scoring (DSA, docs/architecture.md).

DeepSeek-V3.2's releases store the DSA indexer's key in FP8 (E4M3, one power-of-two scale per
128 values, 132 bytes a token) after a Hadamard rotation of the query and the key, quantize
the query per head the same way, and score the FP8 products. mtpkern keeps the key in the
pool's dtype (BF16 on cuda: 256 bytes a token; FP32 on numpy / cpu) and scores in FP32. This
script measures what that choice changes: for indexer queries, head weights and keys made by
a synthetic DeepSeek-V3.2-shaped indexer (64 heads of 128, random hiddens through random
projections, mtpkern.ops.dsa's LayerNorm and RoPE), the share of the ``index_topk`` keys the
FP8 scoring picks that FP32 scoring also picks, and the same for BF16 keys (the cuda pool's).

    python3 benchmarks/dsa_key_precision.py [--contexts 4096,32768] [--rows 8] [--topk 2048]

Synthetic keys say how FP8's rounding sorts keys of random projections; a release's keys
(correlated, with outliers, which the rotation spreads) may differ.
"""

from __future__ import annotations

import argparse

import ml_dtypes
import numpy as np

from mtpkern.ops.dsa import layernorm
from mtpkern.ops.rope_kv import inv_freq, rope

E4M3_MAX = 448.0


def hadamard(n: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(n)).astype(np.float32)


def fp8_blocks(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [..., 128] -> (E4M3 codes as FP32 values, the power-of-two scale per row)."""
    amax = np.maximum(np.abs(x).max(axis=-1, keepdims=True), 1e-12)
    scale = np.exp2(np.ceil(np.log2(amax / E4M3_MAX))).astype(np.float32)
    q = (x / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return q, scale


def topk(scores: np.ndarray, k: int) -> set:
    return set(np.argsort(-scores, kind="stable")[:k].tolist())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="4096,32768")
    ap.add_argument("--rows", type=int, default=8, help="query rows per context")
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    H, Q, Hi, Di, R = 1024, 384, 64, 128, 64
    rng = np.random.default_rng(a.seed)
    wk = (rng.standard_normal((Di, H)) * H ** -0.5).astype(np.float32)
    wq = (rng.standard_normal((Hi * Di, Q)) * Q ** -0.5).astype(np.float32)
    ww = (rng.standard_normal((Hi, H)) * H ** -0.5).astype(np.float32)
    g, b = (1 + 0.1 * rng.standard_normal(Di)).astype(np.float32), (0.1 * rng.standard_normal(Di)).astype(np.float32)
    f = inv_freq(R, 1e4)
    rot = hadamard(Di)
    scale = Hi ** -0.5 * Di ** -0.5
    print(f"indexer {Hi} heads x {Di}, top {a.topk}, {a.rows} query rows per context; keys from random hiddens")
    print("context   FP8 keys: share of FP32's picks   BF16 keys: share of FP32's picks")
    for ctx in (int(c) for c in a.contexts.split(",")):
        pos = np.arange(ctx, dtype=np.int32)
        x = rng.standard_normal((ctx, H)).astype(np.float32)
        k = rope(layernorm(x @ wk.T, g, b, 1e-6)[:, None, :], pos, f)[:, 0]              # [ctx, Di]
        k8, ks = fp8_blocks(k @ rot.T)
        k16 = k.astype(ml_dtypes.bfloat16).astype(np.float32)
        fp8, bf16 = [], []
        for r in range(a.rows):
            p = ctx - 1 - r
            q = (rng.standard_normal(Q).astype(np.float32) @ wq.T).reshape(Hi, Di)
            q = rope(q[None], np.array([p], np.int32), f)[0]
            w = (rng.standard_normal(H).astype(np.float32) @ ww.T) * scale
            n = p + 1
            ref = topk(w @ np.maximum(q @ k[:n].T, 0), a.topk)
            q8, qs = fp8_blocks(q @ rot.T)
            s8 = (w * qs[:, 0]) @ np.maximum(q8 @ k8[:n].T, 0) * ks[:n, 0]
            s16 = w @ np.maximum(q @ k16[:n].T, 0)
            fp8.append(len(topk(s8, a.topk) & ref) / min(a.topk, n))
            bf16.append(len(topk(s16, a.topk) & ref) / min(a.topk, n))
        print(f"{ctx:7d}   {np.mean(fp8):.4f} (min {min(fp8):.4f})                 "
              f"{np.mean(bf16):.4f} (min {min(bf16):.4f})")
    print("bytes per token and module: FP8 132, BF16 256, FP32 512")


if __name__ == "__main__":
    main()
