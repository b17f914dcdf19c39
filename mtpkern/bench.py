"""Benchmark harness: ``python -m mtpkern bench --backend cpu --shapes small``.

Per op: warm-up, then the median and p20/p80 of N timed runs; the bytes each op
must move are counted explicitly (weights read + activations and KV in/out), and
GB/s is reported beside the bandwidth of a plain NumPy copy of a buffer larger
than the caches, measured in the same run (the memory floor of this machine).

Per propose: latency for k = 1..M at batch 1 and 8 in both KV modes, on a
synthetic checkpoint of the shape set, with ``context`` rows of prefilled KV;
the floor is (bytes a propose must read) / (the read bandwidth of an FP32 BLAS
GEMV over a buffer larger than the caches: what this machine streams when it
only reads, as a propose does).

When ``torch`` is importable (never a dependency), the same propose step is also
timed as a PyTorch eager implementation of the module on the same weights (one
row per module, as a Hugging Face MTP generation step runs), and the ratio is
printed. Results go to a JSON file and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .config import MtpConfig, small_config, tiny_config

#: Named shape sets: the config and the rows of context already in the KV.
SHAPES: dict[str, tuple[Callable[[], MtpConfig], int]] = {
    "tiny": (tiny_config, 64),
    # H=1024, 16 q / 4 kv heads, D=64, E=32 top-4, 4 groups / 2 kept, I=512, 1 shared, V=32768, M=3
    "small": (small_config, 512),
    # GLM-4.5-Air-sized module (GPU benchmarks: benchmarks/gpu_bench.py)
    "glm45air": (lambda: small_config(hidden_size=4096, num_attention_heads=96, num_key_value_heads=8,
                                      head_dim=128, n_routed_experts=128, num_experts_per_tok=8, n_group=1,
                                      topk_group=1, moe_intermediate_size=1408, vocab_size=151552), 512),
}


@dataclass
class Timing:
    median_us: float
    p20_us: float
    p80_us: float
    runs: int


def measure(fn: Callable[[], Any], warmup: int, runs: int, sync: Callable[[], None] = lambda: None) -> Timing:
    for _ in range(warmup):
        fn()
    sync()
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    a = np.array(ts) * 1e6
    return Timing(float(np.median(a)), float(np.percentile(a, 20)), float(np.percentile(a, 80)), runs)


def copy_bandwidth(nbytes: int = 256 << 20, runs: int = 10) -> float:
    """Bytes copied per second by ``np.copyto`` over a buffer larger than the caches, in GB/s
    (the memory moves twice that: a read and a write). An op that moves N bytes in the
    time a plain copy of N bytes takes scores 100 % "of copy"."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    t = measure(lambda: np.copyto(dst, src), 2, runs)
    return nbytes / (t.median_us * 1e-6) / 1e9


def read_bandwidth(nbytes: int = 256 << 20, runs: int = 10) -> float:
    """GB/s at which this machine streams a matrix it only reads: an FP32 BLAS GEMV over
    ``nbytes`` (the memory floor of a propose, which only reads weights)."""
    w = np.ones((nbytes // 4096, 1024), np.float32)
    x = np.ones(1024, np.float32)
    t = measure(lambda: w @ x, 2, runs)
    time.sleep(0.2)             # let BLAS's spinning threads park before Numba's pool runs
    return nbytes / (t.median_us * 1e-6) / 1e9


# -- per-op benchmarks -------------------------------------------------------------------

def op_cases(cfg: MtpConfig, be, context: int, n: int, rng: np.random.Generator) -> list[tuple[str, int, Callable]]:
    """(name, bytes moved, thunk) for every op at decode shape ``n`` rows."""
    import ml_dtypes

    from .ops.moe import RouterSpec
    from .ops.rope_kv import inv_freq

    bf16 = np.dtype(ml_dtypes.bfloat16)
    H, D, Hq, Hkv, V = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size
    E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
    Is = cfg.shared_intermediate_size

    def W(*shape):
        return be.prepare_weight((rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(bf16))

    def act(*shape):
        return be.from_host(rng.standard_normal(shape).astype(np.float32))

    def vec(k):
        return be.prepare_vector(np.ones(k, np.float32))

    x, g = act(n, H), act(n, H)
    embed, head = W(V, H), W(V, H)
    eh, wqkv, wo = W(H, 2 * H), W((Hq + 2 * Hkv) * D, H), W(H, Hq * D)
    gate = W(E, H)
    w13, w2 = W(E, 2 * I, H), W(E, H, I)
    s13, s2 = W(2 * Is, H), W(H, Is)
    bs = 16
    nb = -(-context // bs) + 1
    kc, vc = be.empty_kv(nb * n, bs, Hkv, D), be.empty_kv(nb * n, bs, Hkv, D)
    kvb = np.dtype(be.kv_dtype).itemsize
    tables = be.from_host(np.arange(nb * n, dtype=np.int32).reshape(n, nb))
    row_seq = be.from_host(np.arange(n, dtype=np.int32))
    row_len = be.from_host(np.full(n, context, np.int32))
    tokens = be.from_host(rng.integers(0, V, n).astype(np.int32))
    qkv = act(n, (Hq + 2 * Hkv) * D)
    q = act(n, Hq, D)
    pos = be.from_host(np.full(n, context, np.int32))
    slots = be.from_host((np.arange(n, dtype=np.int32) * nb * bs) + context - 1)
    invf = be.from_host(inv_freq(cfg.rotary_dim, cfg.rope_theta))
    spec = RouterSpec.from_config(cfg)
    ids, wts = be.moe_router(x, gate, vec(E), spec)
    distinct = len(np.unique(be.to_host(ids)))
    f4, b2 = 4, 2
    return [
        ("rmsnorm", 2 * n * H * f4 + H * f4, lambda: be.rmsnorm(x, vec(H), 1e-5)),
        ("mtp_input", 2 * H * H * b2 + n * H * b2 + 2 * n * H * f4, lambda: be.mtp_input(embed, tokens, g, vec(H), vec(H), eh, 1e-5)),
        ("linear_qkv", (Hq + 2 * Hkv) * D * H * b2 + n * (H + (Hq + 2 * Hkv) * D) * f4, lambda: be.linear(x, wqkv)),
        ("linear_o", H * Hq * D * b2 + n * (Hq * D + 2 * H) * f4, lambda: be.linear(act(n, Hq * D), wo, None, x)),
        ("qk_norm_rope_kv_write", n * ((Hq + 2 * Hkv) * D + Hq * D) * f4 + 2 * n * Hkv * D * kvb,
         lambda: be.qk_norm_rope_kv_write(qkv, Hq, Hkv, vec(D), vec(D), 1e-5, invf, pos, kc, vc, slots)),
        (f"paged_attention_ctx{context}", 2 * n * context * Hkv * D * kvb + 2 * n * Hq * D * f4,
         lambda: be.paged_attention(q, kc, vc, tables, row_seq, row_len, D ** -0.5)),
        ("moe_router", E * H * b2 + n * H * f4, lambda: be.moe_router(x, gate, vec(E), spec)),
        ("moe_experts", distinct * 3 * I * H * b2 + 2 * n * H * f4, lambda: be.moe_experts(x, ids, wts, w13, w2, x)),
        ("swiglu_shared", 3 * Is * H * b2 + 2 * n * H * f4, lambda: be.swiglu_mlp(x, s13, s2, x)),
        ("lm_head_argmax", V * H * b2 + n * H * f4, lambda: be.lm_head_argmax(x, head)),
    ]


def bench_ops(cfg, be, context, n, warmup, runs, copy_gbs) -> list[dict]:
    rng = np.random.default_rng(0)
    out = []
    for name, nbytes, fn in op_cases(cfg, be, context, n, rng):
        t = measure(fn, warmup, runs, be.synchronize)
        gbs = nbytes / (t.median_us * 1e-6) / 1e9
        out.append({"op": name, "rows": n, "bytes": nbytes, **asdict(t), "GB/s": gbs,
                    "of_copy": gbs / copy_gbs})
    return out


# -- propose benchmarks ---------------------------------------------------------------------

def propose_bytes(cfg: MtpConfig, k: int, context: int, B: int, kv_itemsize: int) -> int:
    """Weights one propose of k drafts must read (BF16), plus the KV it attends over."""
    H, D, Hq, Hkv, V = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size
    per = 2 * H * H + (Hq + 2 * Hkv) * D * H + H * Hq * D + V * H        # eh, qkv, o, head
    if cfg.is_moe:
        experts = min(cfg.n_routed_experts, B * cfg.num_experts_per_tok)
        per += cfg.n_routed_experts * H + experts * 3 * cfg.moe_intermediate_size * H
        per += 3 * cfg.shared_intermediate_size * H
    else:
        per += 3 * cfg.intermediate_size * H
    kv = 2 * B * context * Hkv * D * kv_itemsize
    return k * (2 * per + kv)


def bench_propose(ckpt: Path, backend: str, kv_mode: str, k: int, B: int, context: int,
                  warmup: int, runs: int) -> Timing:
    from .proposer import MultiModuleMtpHead

    prop = MultiModuleMtpHead.from_pretrained(ckpt, backend=backend, kv_mode=kv_mode,
                                              num_blocks=B * (context + 4 * (warmup + runs) + 64) // 16 + 8)
    return _time_proposes(prop, k, B, context, warmup, runs)


def _time_proposes(prop, k, B, context, warmup, runs) -> Timing:
    rng = np.random.default_rng(1)
    H, V = prop.config.hidden_size, prop.config.vocab_size
    sts = []
    for _ in range(B):
        st = prop.alloc_state()
        prop.prefill_drafter(rng.integers(0, V, context), rng.standard_normal((context, H)).astype(np.float32), st)
        sts.append(st)
    pos = [context]
    hs = rng.standard_normal((B, H)).astype(np.float32)
    toks = rng.integers(0, V, B).tolist()

    def step():
        prop.propose_batch(toks, hs, [pos[0]] * B, k, sts)
        for st in sts:
            prop.after_verify(0, st)
        pos[0] += 1

    # Time only the propose: after_verify(0) is a trim with no compute, but keep it out.
    for _ in range(warmup):
        step()
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        prop.propose_batch(toks, hs, [pos[0]] * B, k, sts)
        prop.backend.synchronize()
        ts.append(time.perf_counter() - t0)
        for st in sts:
            prop.after_verify(0, st)
        pos[0] += 1
    a = np.array(ts) * 1e6
    return Timing(float(np.median(a)), float(np.percentile(a, 20)), float(np.percentile(a, 80)), runs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mtpkern bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="cpu", choices=["numpy", "cpu", "cuda"])
    ap.add_argument("--shapes", default="small", choices=sorted(SHAPES))
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--kv-modes", default="draft,exact")
    ap.add_argument("--no-ops", action="store_true")
    ap.add_argument("--no-propose", action="store_true")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--out", default="bench-results.json")
    args = ap.parse_args(argv)

    from .backends import get_backend
    from .cli import cache_dir
    from .weights import write_synthetic_checkpoint

    make_cfg, context = SHAPES[args.shapes]
    cfg = make_cfg()
    be = get_backend(args.backend)
    batches = [int(b) for b in args.batches.split(",")]
    res: dict[str, Any] = {"shapes": args.shapes, "config": cfg.describe(), "context": context,
                           "backend": be.describe(), "machine": f"{_cpu_model()} ({platform.machine()}), "
                           f"{_cpu_count()} cores", "runs": args.runs, "warmup": args.warmup}
    copy_gbs = copy_bandwidth() if args.backend != "cuda" else _device_copy_bandwidth()
    read_gbs = read_bandwidth() if args.backend != "cuda" else copy_gbs
    res["copy_GB/s"] = copy_gbs
    res["read_GB/s"] = read_gbs
    print(f"mtpkern bench: {cfg.describe()}, context {context}, backend {be.describe()}")
    print(f"machine: {res['machine']}; copy {copy_gbs:.1f} GB/s (bytes copied per second; "
          f"{2 * copy_gbs:.1f} GB/s read + write); read {read_gbs:.1f} GB/s (FP32 BLAS GEMV)")
    if not args.no_ops:
        res["ops"] = []
        for n in batches:
            res["ops"] += bench_ops(cfg, be, context, n, args.warmup, args.runs, copy_gbs)
        print(f"\n{'op':<28}{'rows':>5}{'median us':>12}{'p20':>10}{'p80':>10}{'MB':>9}{'GB/s':>8}{'of copy':>9}")
        for r in res["ops"]:
            print(f"{r['op']:<28}{r['rows']:>5}{r['median_us']:>12.1f}{r['p20_us']:>10.1f}{r['p80_us']:>10.1f}"
                  f"{r['bytes'] / 1e6:>9.2f}{r['GB/s']:>8.2f}{r['of_copy']:>8.0%}")
    if not args.no_propose:
        ckpt = cache_dir() / f"bench-{args.shapes}"
        if not (ckpt / "config.json").exists():
            print(f"\nwriting the synthetic {args.shapes} checkpoint to {ckpt} ...")
            write_synthetic_checkpoint(ckpt, cfg, seed=0)
        torch_peer = None if args.no_torch else _torch_peer(ckpt, cfg, context)
        if torch_peer is None:
            res["torch"] = "not importable" if not args.no_torch else "skipped"
            print("\nPyTorch: " + res["torch"] + " (no eager comparison)")
        res["propose"] = []
        kvb = np.dtype(be.kv_dtype).itemsize
        print(f"\n{'kv_mode':<8}{'k':>3}{'B':>4}{'median us':>12}{'p20':>10}{'p80':>10}{'floor us':>10}"
              f"{'x floor':>9}{'torch us':>10}{'vs torch':>9}")
        for B in batches:
            for k in range(1, cfg.num_modules + 1):
                floor_us = propose_bytes(cfg, k, context, B, kvb) / (read_gbs * 1e9) * 1e6
                tt = torch_peer(k, B, args.warmup, args.runs) if torch_peer else None
                for mode in args.kv_modes.split(","):
                    t = bench_propose(ckpt, args.backend, mode, k, B, context, args.warmup, args.runs)
                    row = {"kv_mode": mode, "k": k, "batch": B, **asdict(t), "floor_us": floor_us,
                           "x_floor": t.median_us / floor_us}
                    if tt is not None:
                        row["torch_median_us"] = tt.median_us
                        row["speedup_vs_torch"] = tt.median_us / t.median_us
                    res["propose"].append(row)
                    print(f"{mode:<8}{k:>3}{B:>4}{t.median_us:>12.0f}{t.p20_us:>10.0f}{t.p80_us:>10.0f}"
                          f"{floor_us:>10.0f}{row['x_floor']:>9.2f}"
                          + (f"{tt.median_us:>10.0f}{row['speedup_vs_torch']:>8.2f}x" if tt else ""))
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(f"\nwrote {args.out}")
    return 0


def _cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what ``platform`` says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _cpu_count() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _device_copy_bandwidth(nbytes: int = 1 << 30) -> float:
    import cupy as cp

    src = cp.ones(nbytes // 4, cp.float32)
    dst = cp.empty_like(src)
    t = measure(lambda: cp.copyto(dst, src), 3, 10, cp.cuda.get_current_stream().synchronize)
    return nbytes / (t.median_us * 1e-6) / 1e9


def _torch_peer(ckpt: Path, cfg: MtpConfig, context: int):
    """A timing function for a PyTorch eager MTP step on the same weights, or None."""
    try:
        from . import bench_torch
    except ImportError:
        return None
    timer = bench_torch.make_timer(ckpt, cfg)
    return lambda k, B, warmup, runs: timer(k, B, warmup, runs, context)


if __name__ == "__main__":
    raise SystemExit(main())
