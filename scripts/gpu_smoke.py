"""The first look at a GPU (run by scripts/gpu_check.sh before the tests): every kernel family
built into the kernel cache in parallel (so that the tests and the benchmark after it load
instead of compiling), each load timed, then a tiny proposer on the cuda backend against the NumPy
reference, phase by phase, under a watchdog.

    python3 scripts/gpu_smoke.py [--watchdog-s 20]

Every ``--watchdog-s`` seconds without the smoke finishing, the stacks of every thread are
written to stderr (``faulthandler``, from a C thread: it fires while the main thread waits in
a CUDA call, where a Python signal handler cannot run), so a hung kernel or a slow compile
shows where it is. Each phase prints its time and synchronises the device before the next.
Exit status 1 when a phase fails (the traceback is printed and the later phases still run).
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing

T0 = time.perf_counter()


def say(msg: str) -> None:
    print(f"[gpu_smoke +{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def build_families() -> None:
    """Build every family into the kernel cache in parallel (``loader.prebuild``: one worker
    per CPU), each family's compile timed; then load every instantiation of each, timed. Where
    the cache cannot build, each family compiles through CuPy at its load (also timed)."""
    from mtpkern.backends.cuda_launch import kernel_cache, loader

    t = time.perf_counter()
    try:
        built = loader.prebuild(jobs=os.cpu_count())
    except Exception as e:  # noqa: BLE001: the loads below still compile, through CuPy
        say(f"prebuild into {kernel_cache.cache_dir()} FAILED ({type(e).__name__}: {str(e)[:300]}): "
            f"each family compiles through CuPy at its load below")
    else:
        say(f"prebuild: {len(built)} families into {kernel_cache.cache_dir()} in {time.perf_counter() - t:.1f} s "
            f"with {os.cpu_count()} workers ({sum(built.values()):.1f} s of compiles: "
            + ", ".join(f"{f} {s:.1f}" for f, s in sorted(built.items(), key=lambda kv: -kv[1])) + ")")
    for fam in loader.FAMILIES:
        t = time.perf_counter()
        for name in loader.NAME_EXPRESSIONS[fam]:
            loader.get_kernel(fam, name)
        say(f"family {fam}: {len(loader.NAME_EXPRESSIONS[fam])} kernels loaded in {time.perf_counter() - t:.1f} s")


def sync(backend: str) -> None:
    if backend == "cuda":
        import cupy as cp

        cp.cuda.Device().synchronize()


def tiny_proposers(mode: str, backend: str = "cuda") -> None:
    """Prefill three sequences and propose three times, numpy and ``backend`` side by side,
    drafts compared."""
    import numpy as np

    from mtpkern import MultiModuleMtpHead, write_synthetic_checkpoint
    from mtpkern.config import tiny_config

    cfg = tiny_config()
    with tempfile.TemporaryDirectory() as d:
        ckpt = write_synthetic_checkpoint(Path(d), cfg, seed=7)
        kw = dict(kv_mode=mode, block_size=4, num_blocks=160)
        ref = MultiModuleMtpHead.from_pretrained(ckpt, backend="numpy", **kw)
        t = time.perf_counter()
        dev = MultiModuleMtpHead.from_pretrained(ckpt, backend=backend, **kw)
        sync(backend)
        say(f"{mode}: {backend} proposer made in {time.perf_counter() - t:.1f} s")
    rng = np.random.default_rng(1)
    H, V = cfg.hidden_size, cfg.vocab_size
    lens = (5, 9, 3)
    sr, sd = [ref.alloc_state() for _ in lens], [dev.alloc_state() for _ in lens]
    for i, n in enumerate(lens):
        toks, hid = rng.integers(0, V, n).tolist(), rng.standard_normal((n, H)).astype(np.float32)
        ref.prefill_drafter(toks, hid, sr[i])
        t = time.perf_counter()
        dev.prefill_drafter(toks, hid, sd[i])
        sync(backend)
        say(f"{mode}: prefill of {n} rows in {1e3 * (time.perf_counter() - t):.1f} ms")
    pos = list(lens)
    for rnd in range(3):
        last = rng.integers(0, V, len(lens)).tolist()
        hid = rng.standard_normal((len(lens), H)).astype(np.float32)
        want = ref.propose_batch(last, hid, pos, 3, sr)
        t = time.perf_counter()
        got = dev.propose_batch(last, hid, pos, 3, sd)
        sync(backend)
        say(f"{mode}: propose {rnd} in {1e3 * (time.perf_counter() - t):.1f} ms: {backend} {got}, numpy {want}"
            f"{'' if got == want else '  (DIFFERENT)'}")
        for i in range(len(lens)):
            a = len(want[i]) if rnd % 2 else 0                 # all accepted, then none
            acc, h = want[i][:a], rng.standard_normal((a, H)).astype(np.float32)
            for p, ss in ((ref, sr), (dev, sd)):
                p.after_verify(a, ss[i])
                p.catchup_drafter(acc, h, ss[i])
            pos[i] += 1 + a
    dev.check_invariants()
    say(f"{mode}: invariants hold")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--watchdog-s", type=float, default=20.0)
    ap.add_argument("--backend", default="cuda", help="cuda; cpu tries the script where there is no GPU")
    args = ap.parse_args(argv)
    faulthandler.dump_traceback_later(args.watchdog_s, repeat=True, file=sys.stderr)
    rc = 0
    phases = [("exact", lambda: tiny_proposers("exact", args.backend)),
              ("draft", lambda: tiny_proposers("draft", args.backend))]
    for name, phase in ([("build", build_families)] if args.backend == "cuda" else []) + phases:
        try:
            phase()
        except Exception:
            rc = 1
            say(f"phase {name} FAILED:")
            traceback.print_exc()
            sys.stdout.flush()
    faulthandler.cancel_dump_traceback_later()
    say("done" + (" (a phase failed)" if rc else ""))
    return rc


if __name__ == "__main__":
    sys.exit(main())
