"""Propose latency of the cpu backend by thread count, wait policy and a competing process.

    python benchmarks/cpu_threads.py [--threads 2,1] [--runs 500] [--repeat 3] [--shapes small]

For each thread count and GNU OpenMP wait policy (the library's default, and
``OMP_WAIT_POLICY=passive``: libgomp reads it only when it loads, so every
configuration runs in a fresh process), times ``propose_batch`` (draft mode,
k = M, batch 1, the shape set's context) idle, beside one busy process
(``python -c "while True: pass"``) pinned to core 0, and beside one unpinned.
The configurations run round-robin ``--repeat`` times, so that whatever else
the machine runs meanwhile falls on all of them alike; each figure is the median
over the repeats of that configuration's median and p99, beside the range of the
1-minute load average seen (docs/cpu.md, "Threads").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CHILD = r"""
import json, sys
from mtpkern.backends.cpu import CpuBackend
from mtpkern.bench import SHAPES, make_proposer, time_proposes
from mtpkern.synthetic import synthetic_checkpoint
shapes, threads, runs, k, B = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
make_cfg, context = SHAPES[shapes]
be = CpuBackend(threads=threads)
be.warm_up()
prop = make_proposer(synthetic_checkpoint(shapes), be, "draft", B, context, runs + 10)
k = k or prop.num_modules
t = time_proposes(prop, k, B, context, 10, runs)
print(json.dumps({"median_ms": t.median_us / 1e3, "p99_ms": t.p99_us / 1e3, "k": k}))
"""

BUSY = [sys.executable, "-c", "while True: pass"]


def _one(args, policy: str, threads: int, busy: str) -> dict:
    """One configuration in a fresh process: {"median_ms", "p99_ms", "k", "load"}."""
    env = dict(os.environ)
    env.pop("OMP_WAIT_POLICY", None)
    if policy == "passive":
        env["OMP_WAIT_POLICY"] = "passive"
    hog = None
    if busy != "none":
        hog = subprocess.Popen((["taskset", "-c", "0"] if busy.startswith("pinned") else []) + BUSY)
        time.sleep(0.5)
    try:
        out = subprocess.run([sys.executable, "-c", CHILD, args.shapes, str(threads), str(args.runs),
                              str(args.k), str(args.batch)], env=env, check=True,
                             capture_output=True, text=True).stdout
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    return {**json.loads(out.strip().splitlines()[-1]), "load": os.getloadavg()[0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default=None, help="thread counts (default: all cores, cores-1, cores//2, 1)")
    ap.add_argument("--runs", type=int, default=500)
    ap.add_argument("--shapes", default="small")
    ap.add_argument("--k", type=int, default=0, help="drafts per propose (default: M)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    counts = ([int(t) for t in args.threads.split(",")] if args.threads
              else sorted({cores, max(1, cores - 1), max(1, cores // 2), 1}, reverse=True))
    print(f"{cores} cores; {args.shapes}, draft mode, batch {args.batch}, {args.runs} proposes per figure")
    configs = [(policy, threads, busy) for policy in ("default", "passive") for threads in counts
               for busy in ("none", "pinned core 0", "unpinned")]
    seen: dict[tuple, list[dict]] = {c: [] for c in configs}
    for rep in range(args.repeat):
        for policy, threads, busy in configs:
            seen[policy, threads, busy].append(_one(args, policy, threads, busy))
            print(f"repeat {rep + 1}/{args.repeat}: {threads} threads, {policy}, {busy}: "
                  f"{seen[policy, threads, busy][-1]}", file=sys.stderr, flush=True)
    print(f"{'threads':>7} {'wait policy':<12} {'competitor':<16} {'median ms':>10} {'p99 ms':>9} {'load':>9}")
    for (policy, threads, busy), rs in seen.items():
        med = statistics.median(r["median_ms"] for r in rs)
        p99 = statistics.median(r["p99_ms"] for r in rs)
        loads = [r["load"] for r in rs]
        print(f"{threads:>7} {policy:<12} {busy:<16} {med:>10.2f} {p99:>9.2f} {min(loads):>4.1f}-{max(loads):<4.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
