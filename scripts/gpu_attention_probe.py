"""Paged attention at GLM-4.5-Air's shapes, launched a few times eagerly, for a profiler to look
at (scripts/gpu_check.sh's ``profile`` step runs it under Nsight Compute).

    python3 scripts/gpu_attention_probe.py [--context 8192] [--rows 1] [--launches 4]

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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--rows", type=int, default=1, help="sequences, one decode row each")
    ap.add_argument("--launches", type=int, default=4)
    args = ap.parse_args(argv)

    import cupy as cp

    from mtpkern.backends.cuda_launch import attention as attn_launch
    from mtpkern.backends.cuda_launch._util import sm_count, smem_optin

    Hq, Hkv, D, BS, n, ctx = 96, 8, 128, 16, args.rows, args.context
    nb = -(-ctx // BS)
    rs = cp.random.RandomState(0)
    def bf16(shape):                               # normal values, truncated to BF16 bits
        return (rs.standard_normal(shape, dtype=cp.float32).view(cp.uint32) >> 16).astype(cp.uint16)

    kc, vc = bf16((n * nb, BS, Hkv, D)), bf16((n * nb, BS, Hkv, D))
    tables = cp.arange(n * nb, dtype=cp.int32).reshape(n, nb)
    row_seq, row_len = cp.arange(n, dtype=cp.int32), cp.full(n, ctx, cp.int32)
    q = rs.standard_normal((n, Hq, D), dtype=cp.float32)
    p = attn_launch.plan(Hq // Hkv, D, nb * BS, work=n * Hkv, target_blocks=2 * sm_count(),
                         smem_max=smem_optin(), kv_itemsize=2, rows=n)
    print(f"plan: {p}; grid ({Hkv * -(-(Hq // Hkv) // p.heads)}, {n}, {p.num_parts}) x 128 threads", flush=True)
    out = cp.empty((n, Hq * D), cp.float32)
    for i in range(args.launches):
        t = time.perf_counter()
        attn_launch.paged_attention(q, kc, vc, tables, row_seq, row_len, D ** -0.5, out=out)
        cp.cuda.Device().synchronize()
        print(f"launch {i}: {1e6 * (time.perf_counter() - t):.1f} us wall", flush=True)
    assert bool(cp.isfinite(out).all()), "non-finite attention output"
    return 0


if __name__ == "__main__":
    sys.exit(main())
