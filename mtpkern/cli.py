"""Command line: ``python -m mtpkern demo | info | bench``.

``demo`` writes a built-in synthetic checkpoint (once, under the cache dir)
and runs a speculative loop against a simulated verifier that accepts a
random prefix of each proposal; ``info`` tells what a checkpoint holds;
``bench`` is the benchmark harness (benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from .config import MtpConfig, small_config, tiny_config

DEMO_CONFIGS = {
    "tiny": tiny_config,
    "demo": lambda: tiny_config(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                                vocab_size=8192, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                                topk_group=2, moe_intermediate_size=128),
    "small": small_config,
}


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mtpkern"


def synthetic_checkpoint(name: str, seed: int = 0) -> Path:
    """The built-in synthetic checkpoint ``name`` (written on first use)."""
    from .weights import write_synthetic_checkpoint

    cfg = DEMO_CONFIGS[name]()
    path = cache_dir() / f"synthetic-{name}-{seed}"
    if not (path / "config.json").exists():
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent if path.parent.exists() else None))
        write_synthetic_checkpoint(tmp, cfg, seed=seed)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(tmp, path)
        except OSError:            # another process won the race
            pass
    return path


class Progress:
    """A one-line progress bar on stderr, shown once a run has taken more than a second."""

    def __init__(self, total: int, label: str):
        self.total, self.label = total, label
        self.t0 = time.perf_counter()
        self.last = 0.0
        self.shown = False

    def update(self, done: int) -> None:
        el = time.perf_counter() - self.t0
        if el < 1.0 or (el - self.last < 0.2 and done < self.total):
            return
        self.shown, self.last = True, el
        frac = done / self.total
        bar = "#" * int(30 * frac)
        eta = el / max(frac, 1e-9) - el
        sys.stderr.write(f"\r{self.label} [{bar:<30}] {done}/{self.total}  {el:5.1f}s  eta {eta:5.1f}s")
        sys.stderr.flush()

    def close(self) -> None:
        if self.shown:
            sys.stderr.write("\n")


def run_demo(args: argparse.Namespace) -> dict:
    from .proposer import MultiModuleMtpHead

    ckpt = Path(args.ckpt) if args.ckpt else synthetic_checkpoint(args.config)
    prop = MultiModuleMtpHead.from_pretrained(ckpt, backend=args.backend, kv_mode=args.kv_mode,
                                              chain=args.chain)
    cfg = prop.config
    rng = np.random.default_rng(args.seed)
    H, V, M = cfg.hidden_size, cfg.vocab_size, prop.num_modules
    k = args.num_drafts or M
    print(f"mtpkern demo: {prop!r}")
    print(f"checkpoint: {ckpt}")
    seqs = []
    for _ in range(args.batch):
        st = prop.alloc_state_for(args.prompt_len + args.steps * (M + 1) + 1)
        toks = rng.integers(0, V, args.prompt_len)
        hid = rng.standard_normal((args.prompt_len, H)).astype(np.float32)
        prop.prefill_drafter(toks, hid, st)
        seqs.append([st, args.prompt_len, hid[-1]])
    # warm-up (first calls compile kernels on the cpu and cuda backends)
    t_warm = time.perf_counter()
    for st, P, h in seqs:
        d = prop.propose(int(rng.integers(0, V)), h, P, k, st)
        prop.after_verify(0, st)
    prop.stats.reset()
    for s in seqs:
        s[1] += 1
    warm = time.perf_counter() - t_warm
    lat = []
    drafted = 0
    bar = Progress(args.steps, "demo")
    t0 = time.perf_counter()
    for step in range(args.steps):
        toks = [int(t) for t in rng.integers(0, V, len(seqs))]
        hs = rng.standard_normal((len(seqs), H)).astype(np.float32)
        t1 = time.perf_counter()
        if len(seqs) == 1:
            drafts = [prop.propose(toks[0], hs[0], seqs[0][1], k, seqs[0][0])]
        else:
            drafts = prop.propose_batch(toks, hs, [s[1] for s in seqs], k, [s[0] for s in seqs])
        lat.append(time.perf_counter() - t1)
        drafted += sum(len(d) for d in drafts)
        for s, d in zip(seqs, drafts):
            st = s[0]
            a = int(rng.integers(0, len(d) + 1))           # the simulated verifier accepts a random prefix
            prop.after_verify(a, st)
            prop.catchup_drafter(d[:a], rng.standard_normal((a, H)).astype(np.float32), st)
            s[1] += 1 + a
        bar.update(step + 1)
    bar.close()
    total = time.perf_counter() - t0
    stats = prop.stats
    lat_ms = np.array(lat) * 1e3
    out = {
        "backend": prop.backend.name, "kv_mode": prop.kv_mode, "chain": prop.chain, "batch": len(seqs),
        "num_drafts": k, "steps": args.steps, "warmup_s": round(warm, 3),
        "drafts_per_s": round(drafted / sum(lat), 1),
        "propose_ms_mean": round(float(lat_ms.mean()), 3), "propose_ms_p50": round(float(np.median(lat_ms)), 3),
        "loop_s": round(total, 3),
        "acceptance_per_module": [round(stats.acceptance_rate(m), 3) for m in range(M)],
        "mean_accepted_length": round(stats.mean_accepted_length, 3),
        "kv_blocks_in_use": prop.kv_blocks_in_use(), "kv_blocks_per_module": prop.num_blocks,
    }
    print(f"backend {out['backend']}, kv_mode {out['kv_mode']}, batch {out['batch']}, k={k}, "
          f"{args.steps} steps (warm-up {warm:.2f}s)")
    print(f"  drafts/s            {out['drafts_per_s']:.1f}")
    print(f"  propose latency     mean {out['propose_ms_mean']:.3f} ms, p50 {out['propose_ms_p50']:.3f} ms")
    print("  acceptance/module   " + "  ".join(f"m{m}: {r:.2f}" for m, r in enumerate(out["acceptance_per_module"]))
          + f"   (mean accepted length {out['mean_accepted_length']:.2f})")
    print(f"  KV blocks in use    {out['kv_blocks_in_use']} of {prop.num_blocks} per module")
    for st, _, _ in seqs:
        prop.free_state(st)
    prop.check_invariants()
    print(f"  after free          {prop.kv_blocks_in_use()} blocks in use")
    return out


def run_info(args: argparse.Namespace) -> dict:
    from .weights import CheckpointReader

    path = Path(args.checkpoint)
    cfg = MtpConfig.from_json(path / "config.json")
    rd = CheckpointReader(path)
    print(f"{path}: {cfg.describe()}")
    report = {"config": cfg.describe(), "modules": []}
    for m in range(cfg.num_modules):
        pre = f"model.layers.{cfg.layer_index(m)}."
        keys = sorted(k for k in rd.keys() if k.startswith(pre))
        nbytes, dtypes = 0, set()
        for key in keys:
            shape, dt = rd.info(key)
            dtypes.add(dt)
            nbytes += int(np.prod(shape)) * {"BF16": 2, "F16": 2, "F32": 4}.get(dt, 4)
        own = [s for s in ("embed_tokens.weight", "shared_head.head.weight") if rd.has(pre + s)]
        line = (f"  module {m}: {pre}*  {len(keys)} tensors, {nbytes / 2**20:.1f} MiB, dtypes {sorted(dtypes)}, "
                f"own {', '.join(own) if own else 'no embedding/head (uses the target)'}")
        print(line)
        report["modules"].append({"prefix": pre, "tensors": len(keys), "bytes": nbytes, "dtypes": sorted(dtypes),
                                  "own": own})
    for key in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        if rd.has(key):
            shape, dt = rd.info(key)
            print(f"  target {key}: {list(shape)} {dt}")
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mtpkern", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="speculative loop on a built-in synthetic checkpoint")
    d.add_argument("--backend", default="cpu", choices=["auto", "numpy", "cpu", "cuda"])
    d.add_argument("--kv-mode", default="exact", choices=["exact", "draft"])
    d.add_argument("--chain", default="prenorm", choices=["prenorm", "postnorm"])
    d.add_argument("--config", default="demo", choices=sorted(DEMO_CONFIGS))
    d.add_argument("--ckpt", default=None, help="use this checkpoint instead of the synthetic one")
    d.add_argument("--steps", type=int, default=200)
    d.add_argument("--batch", type=int, default=1)
    d.add_argument("--prompt-len", type=int, default=64)
    d.add_argument("--num-drafts", type=int, default=0, help="0: one per module")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--json", default=None, help="also write the figures to this file")
    i = sub.add_parser("info", help="what a checkpoint holds")
    i.add_argument("checkpoint")
    sub.add_parser("bench", help="benchmark harness: python -m mtpkern bench --help", add_help=False)
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        from .bench import main as bench_main

        return bench_main(argv[1:])
    args = ap.parse_args(argv)
    if args.cmd == "demo":
        if args.steps < 1 or args.batch < 1 or args.prompt_len < 1:
            ap.error("--steps, --batch and --prompt-len must be >= 1")
        out = run_demo(args)
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=2))
    else:
        run_info(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
