"""``mtpkern bench-shard``: the sharded head's per-rank bytes and propose latency at 1, 2, 4
CPU ranks (MPI; benchmarks/README.md, "Sharded head").

The command starts ``mpirun -n R`` for each world size R, every rank running this module's
worker: it loads its slice of the built-in synthetic checkpoint (mtpkern.shard) on the cpu
backend, fills ``B`` sequences with ``context`` rows, and times ``propose_batch`` of k drafts,
the ranks meeting at a barrier before every call. A rank's floor is its bytes (``propose_bytes``
with its shard: its heads, KV heads, vocabulary rows and share of the experts) over the read
machine's read bandwidth, measured once before the ranks start: ``floor/rank`` if each rank had
a machine's bandwidth to itself (R GPUs, R hosts: the floor falls with the shard), and
``shared floor`` = R times that, the floor of R ranks sharing this one machine's memory,
against which ``x floor`` is taken. Rank 0 prints one JSON line per figure; the command
prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any

import numpy as np

from . import argtypes
from .bench import SHAPES, _filled_states, propose_bytes, read_bandwidth, stream_bytes, last_level_cache
from .errors import install_hint
from .synthetic import synthetic_checkpoint
from .timing import Timing

TAG = "mtpkern-shard-bench "


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--ranks", type=argtypes.positive_ints, default="1,2,4", metavar="R[,R...]",
                    help="world sizes to run (mpirun -n R each)")
    ap.add_argument("--shapes", default="small", choices=sorted(SHAPES), help="shape set (as mtpkern bench)")
    ap.add_argument("--contexts", type=argtypes.positive_ints, default="4096", metavar="N[,N...]",
                    help="rows of KV in each sequence")
    ap.add_argument("--batches", type=argtypes.positive_ints, default="1,8", metavar="B[,B...]",
                    help="sequences per propose_batch")
    ap.add_argument("--kv-modes", type=argtypes.choices_list("draft", "exact"), default="draft,exact",
                    metavar="MODE[,MODE]", help="KV modes to time")
    ap.add_argument("--experts", default="ep", choices=["ep", "tp"], help="routed experts by id or by slice")
    ap.add_argument("--cores", type=argtypes.positive_int, default=None, metavar="N",
                    help="cores the ranks share (default: all); each rank gets max(1, N // R) Numba threads")
    ap.add_argument("--runs", type=argtypes.positive_int, default=10, help="timed runs per figure")
    ap.add_argument("--warmup", type=argtypes.nonnegative_int, default=2, help="untimed runs before them")
    ap.add_argument("--json", type=argtypes.output_file, default=None, metavar="PATH",
                    help="write every figure as JSON to PATH")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--read-gbs", type=float, default=0.0, help=argparse.SUPPRESS)


def _mpirun() -> str:
    for cand in (os.path.join(os.path.dirname(sys.executable), n) for n in ("mpirun", "mpiexec")):
        if os.path.exists(cand):
            return cand
    found = shutil.which("mpirun") or shutil.which("mpiexec")
    if found is None:
        raise RuntimeError(f"bench-shard needs mpirun (MPICH and mpi4py): {install_hint('mpi')}")
    return found


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.worker:
        worker(args)
        return {}
    cores = args.cores or os.cpu_count() or 1
    forwarded = [f"--shapes={args.shapes}", f"--contexts={','.join(map(str, args.contexts))}",
                 f"--batches={','.join(map(str, args.batches))}", f"--kv-modes={','.join(args.kv_modes)}",
                 f"--experts={args.experts}", f"--cores={cores}", f"--runs={args.runs}", f"--warmup={args.warmup}"]
    synthetic_checkpoint(args.shapes, say=print)           # written once, before the ranks read it
    read_gbs = read_bandwidth(stream_bytes(last_level_cache()))
    print(f"read bandwidth of this machine: {read_gbs:.1f} GB/s")
    rows: list[dict] = []
    print(f"\n{'ranks':>5}{'threads':>8} {'kv_mode':<7}{'k':>3}{'B':>4}{'ctx':>7}{'MB/rank':>9}{'median us':>11}"
          f"{'p20':>9}{'p80':>9}{'floor/rank':>11}{'shared floor':>13}{'x floor':>9}")
    for R in args.ranks:
        cmd = [_mpirun(), "-n", str(R), sys.executable, "-m", "mtpkern", "bench-shard", "--worker",
               f"--read-gbs={read_gbs}", *forwarded]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        for line in proc.stdout:
            if not line.startswith(TAG):
                continue
            row = json.loads(line[len(TAG):])
            rows.append(row)
            print(f"{row['ranks']:>5}{row['threads']:>8} {row['kv_mode']:<7}{row['k']:>3}{row['batch']:>4}"
                  f"{row['context']:>7}{row['bytes_per_rank'] / 1e6:>9.1f}{row['median_us']:>11.0f}"
                  f"{row['p20_us']:>9.0f}{row['p80_us']:>9.0f}{row['floor_us']:>11.0f}"
                  f"{row['shared_floor_us']:>13.0f}{row['x_floor']:>9.2f}",
                  flush=True)
        if proc.wait() != 0:
            raise RuntimeError(f"{' '.join(cmd)}: exit status {proc.returncode}")
    res = {"shapes": args.shapes, "experts": args.experts, "cores": cores, "read_gbs": read_gbs, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    return res


def worker(args: argparse.Namespace) -> None:
    """One rank: its slice and the timed proposes (rank 0 reports)."""
    from .comm import MpiComm
    from .proposer import MultiModuleMtpHead

    comm = MpiComm()
    R = comm.size
    threads = max(1, args.cores // R)
    cfg = SHAPES[args.shapes][0]()
    ckpt = synthetic_checkpoint(args.shapes)
    rows_needed = max(args.contexts) + 2 * (args.warmup + args.runs) + 64
    props = {mode: MultiModuleMtpHead.from_pretrained(
        ckpt, backend="cpu", threads=threads, kv_mode=mode, comm=comm, experts=args.experts,
        num_blocks=max(args.batches) * (-(-rows_needed // 16) + 1) + 8) for mode in args.kv_modes}
    read_gbs = args.read_gbs
    be = next(iter(props.values())).backend
    kvb = np.dtype(be.kv_dtype).itemsize
    for context in args.contexts:
        for B in args.batches:
            for mode, prop in props.items():
                k = cfg.num_modules
                t = _time(prop, comm, k, B, context, args.warmup, args.runs)
                nbytes = propose_bytes(cfg, k, context, B, kvb, mode, shard=prop.shard)
                floor_us = nbytes / (read_gbs * 1e9) * 1e6
                if comm.rank == 0:
                    row = {"ranks": R, "threads": threads, "kv_mode": mode, "k": k, "batch": B, "context": context,
                           "bytes_per_rank": nbytes, "read_gbs": read_gbs, "floor_us": floor_us,
                           "shared_floor_us": R * floor_us, "median_us": t.median_us, "p20_us": t.p20_us,
                           "p80_us": t.p80_us, "x_floor": t.median_us / (R * floor_us)}
                    print(TAG + json.dumps(row), flush=True)


def _time(prop, comm, k: int, B: int, context: int, warmup: int, runs: int) -> Timing:
    """``time_proposes`` with every rank starting each call together (a barrier first); the
    time of the slowest rank is the propose's."""
    sts, toks, hs = _filled_states(prop, B, context)
    ts = []
    try:
        for i in range(warmup + runs):
            comm.comm.Barrier()
            t0 = time.perf_counter_ns()
            prop.propose_batch(toks, hs, [context + i] * B, k, sts)
            worst = np.array([time.perf_counter_ns() - t0], np.int64)
            comm.all_reduce(worst, "max")
            if i >= warmup:
                ts.append(int(worst[0]) * 1e-9)
            for st in sts:
                prop.after_verify(0, st)
    finally:
        for st in sts:
            prop.free_state(st)
    return Timing.of(ts)
