"""Paged attention at GLM-4.5-Air's shapes, launched a few times eagerly, for a profiler to look
at (scripts/gpu_check.sh's ``profile`` step runs it under Nsight Compute).

    python3 scripts/gpu_attention_probe.py [--context 8192] [--rows 1] [--launches 4] [--variant scalar]

The first H200 run measured this op at 3-19 % of the read rate with ~11 us a tile of 32 KV
rows per block (benchmarks/README.md, "Figures: cuda backend"); a profile's warp-state and
scheduler sections say what the warps wait on. Prints each launch's wall time after a
synchronise, and the plan.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))                   # run from a checkout without installing


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--rows", type=int, default=1, help="sequences, one decode row each")
    ap.add_argument("--launches", type=int, default=4)
    ap.add_argument("--variant", choices=("launcher", "scalar", "tc"), default="launcher",
                    help="the kernel: the launcher's choice (tensor cores over BF16), or either one")
    args = ap.parse_args(argv)

    import importlib.util

    import cupy as cp

    from mtpkern.backends.cuda_launch import attention as attn_launch
    from mtpkern.backends.cuda_launch._util import sm_count, smem_optin

    spec = importlib.util.spec_from_file_location("gpu_bench", ROOT / "benchmarks" / "gpu_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)                 # its shapes, KV fill and block tables
    cfg = bench.glm45_air()
    Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    BS, n, ctx = 16, args.rows, args.context
    nb, tables, row_seq, row_len = bench.decode_tables(n, ctx, BS)
    kc, vc = bench.bf16_uniform((n * nb, BS, Hkv, D), 3, 1), bench.bf16_uniform((n * nb, BS, Hkv, D), 3, 2)
    q = cp.random.RandomState(0).standard_normal((n, Hq, D), dtype=cp.float32)
    p = attn_launch.plan(Hq // Hkv, D, nb * BS, work=n * Hkv, target_blocks=2 * sm_count(),
                         smem_max=smem_optin(), kv_itemsize=2, rows=n)
    if args.variant != "launcher" and args.variant != p.variant:
        import dataclasses
        p = dataclasses.replace(p, variant=args.variant, smem_bytes=attn_launch.smem_bytes(
            D, D, p.dc, p.heads, p.rows, p.stages, 2, args.variant))
    print(f"plan: {p}; grid ({Hkv * -(-(Hq // Hkv) // p.heads)}, {n}, {p.num_parts}) x 128 threads", flush=True)
    out = cp.empty((n, Hq * D), cp.float32)
    for i in range(args.launches):
        t = time.perf_counter()
        attn_launch.paged_attention(q, kc, vc, tables, row_seq, row_len, D ** -0.5, out=out, attention_plan=p)
        cp.cuda.Device().synchronize()
        print(f"launch {i}: {1e6 * (time.perf_counter() - t):.1f} us wall", flush=True)
    assert bool(cp.isfinite(out).all()), "non-finite attention output"
    return 0


if __name__ == "__main__":
    sys.exit(main())
