"""The command line: ``mtpkern demo | info | bench | bench-shard`` (also ``python -m mtpkern ...``).

``demo`` writes a built-in synthetic checkpoint (once, under the cache dir) and
runs a speculative loop against a simulated verifier; ``info`` tells what a
checkpoint holds; ``bench`` is the benchmark harness (``mtpkern.bench``); ``bench-shard``
times a sharded head at several world sizes under ``mpirun`` (``mtpkern.bench_shard``).
docs/cli.md describes every option.

Errors: an mtpkern error, a bad value (``ValueError`` / ``TypeError`` from the
argument checks) or an OS error reaching ``main`` is printed as one line,
``mtpkern: error: ...``, and the exit status is 2; ``--debug`` shows the
traceback instead.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Any

import numpy as np

from . import argtypes, bench, bench_shard
from .errors import MtpError, install_hint

DESCRIPTION = """\
mtpkern drafts tokens for LLM speculative decoding with multi-module MTP heads
(DeepSeek-V3, GLM-4.5, MiniMax-M2 style: module m has its own weights and paged KV
cache and drafts token m from module m-1's hidden). An inference engine imports it
as a Python library; these commands try it out and measure it. Backends: numpy (the
reference), cpu (Numba), cuda (CuPy RawModule kernels)."""

EPILOG = """\
examples:
  {prog} demo                       # a speculative loop on a synthetic checkpoint
  {prog} demo --kv-mode draft --batch 8
  {prog} info CHECKPOINT_DIR        # what a checkpoint holds
  {prog} bench --shapes small --contexts 512,4096 --json out.json --plot out.png

Run '{prog} COMMAND --help' for a command's options; docs/cli.md has them all."""

#: the letters of MtpConfig.describe()
LEGEND = ("M modules (one draft each), H hidden size, Hq / Hkv query / key-value heads, D head dim, "
          "rotary: RoPE dims per head, V vocabulary, E routed experts (top-k per token), I expert width")

#: what reaches main() as one line instead of a traceback
FRIENDLY = (MtpError, ValueError, TypeError, OSError)

_log = logging.getLogger("mtpkern")


class UsageError(Exception):
    """A command line argparse refused (the message names the argument)."""


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's default in its help (unless the help already says it)."""

    def _get_help_string(self, action):
        if "(default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class _TopFormatter(_Formatter, argparse.RawDescriptionHelpFormatter):
    """The top-level help: the description and the examples as written."""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors become ``UsageError`` (printed by ``main`` as one line)."""

    def error(self, message: str):
        raise UsageError(f"{message} (see '{self.prog} --help')")


def _common(p: argparse.ArgumentParser, top: bool) -> None:
    # on a command, SUPPRESS keeps a flag given before the command (mtpkern --debug demo)
    default = False if top else argparse.SUPPRESS
    p.add_argument("--debug", action="store_true", default=default,
                   help="on an error, show the Python traceback instead of one line (default: off)")
    p.add_argument("-v", "--verbose", action="store_true", default=default,
                   help="log the mtpkern logger's INFO messages to stderr, e.g. the backend "
                        "'auto' chose (default: off)")


def _harness(sub: Any, name: str, module: Any, help: str, description: str) -> None:
    """A benchmark command: its module's ``add_arguments`` and ``run``."""
    p = sub.add_parser(name, formatter_class=_Formatter, help=help, description=description)
    module.add_arguments(p)
    _common(p, top=False)
    p.set_defaults(run=module.run)


def _backend_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="cpu", choices=["auto", "numpy", "cpu", "cuda"],
                   help=f"numpy: the reference; cpu: Numba kernels; cuda: CuPy ({install_hint('cuda12')}); "
                        "auto: cuda when a GPU is usable, else cpu")
    p.add_argument("--threads", type=argtypes.positive_int, default=None, metavar="N",
                   help="Numba threads of the cpu backend (default: the backend's, half the cores; docs/cpu.md)")


def build_parser(prog: str = "mtpkern") -> argparse.ArgumentParser:
    ap = _Parser(prog=prog, description=DESCRIPTION, epilog=EPILOG.format(prog=prog),
                 formatter_class=_TopFormatter)
    _common(ap, top=True)
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND", parser_class=_Parser)

    d = sub.add_parser("demo", formatter_class=_Formatter, help="a speculative loop on a built-in synthetic checkpoint",
                       description="A speculative decoding loop on a built-in synthetic checkpoint (random "
                                   "weights), against a simulated verifier that accepts a random prefix of "
                                   "each proposal. Prints drafts/s, propose latency, acceptance per module, "
                                   "and the KV blocks in use before and after the sequences are freed.")
    _backend_arguments(d)
    d.add_argument("--kv-mode", default="exact", choices=["exact", "draft"],
                   help="exact: each module's KV equals a recomputation over the verified tokens; "
                        "draft: one row per module per propose (docs/semantics.md)")
    d.add_argument("--chain", default=None, choices=["prenorm", "postnorm"],
                   help="the hidden passed from module m to m+1: y, or shared_head_norm(y) "
                        "(default: the family's, prenorm but for Qwen3-Next)")
    d.add_argument("--config", default="demo", choices=["demo", "small", "tiny"],
                   help="built-in synthetic checkpoint: tiny (H=64, V=301), demo (H=256, V=8192), "
                        "small (H=1024, V=32768)")
    d.add_argument("--ckpt", type=argtypes.checkpoint_dir, default=None, metavar="DIR",
                   help="use this checkpoint directory instead of the synthetic one (default: the synthetic one)")
    d.add_argument("--steps", type=argtypes.positive_int, default=200, help="propose / verify steps")
    d.add_argument("--batch", type=argtypes.positive_int, default=1,
                   help="sequences proposed together (propose_batch when > 1)")
    d.add_argument("--prompt-len", type=argtypes.positive_int, default=64,
                   help="tokens prefilled into each sequence's drafter KV first")
    d.add_argument("--num-drafts", type=argtypes.positive_int, default=None, metavar="K",
                   help="drafts asked per propose; above M (the modules) it is clamped to M "
                        "(default: M, one per module)")
    d.add_argument("--seed", type=argtypes.nonnegative_int, default=0,
                   help="seed of the random tokens, hiddens and verifier")
    d.add_argument("--json", type=argtypes.output_file, default=None, metavar="PATH",
                   help="also write the figures as JSON to PATH (default: not written)")
    _common(d, top=False)
    d.set_defaults(run=run_demo)

    i = sub.add_parser("info", formatter_class=_Formatter, help="what a checkpoint holds",
                       description="The config of a checkpoint, then per MTP module its tensors, MiB and "
                                   "dtypes, and the target tensors it falls back to.")
    i.add_argument("checkpoint", type=argtypes.checkpoint_dir, metavar="CHECKPOINT_DIR",
                   help="a directory with config.json and *.safetensors")
    _common(i, top=False)
    i.set_defaults(run=run_info)

    k = sub.add_parser("kernels", formatter_class=_Formatter, help="build the CUDA (or, --cpu, the Numba) kernels into the on-disk cache",
                       description="Builds every CUDA kernel family (NVRTC, no GPU needed when --arch and "
                                   "--nvrtc are given) into the kernel cache, in parallel worker processes, so "
                                   "that the cuda backend loads them instead of compiling at first use "
                                   "(docs/cuda.md, \"The kernel cache\"). Prints each family's compile time. With --cpu, "
                                   "compiles the cpu backend's Numba kernels into Numba's cache instead.")
    k.add_argument("--arch", default=None, metavar="SM",
                   help="the target, e.g. sm_90 (default: the CuPy device's)")
    k.add_argument("--nvrtc", type=int, default=None, choices=[12, 13], metavar="MAJOR",
                   help="the NVRTC major to build with, 12 or 13 (default: the one CuPy uses)")
    k.add_argument("--jobs", type=argtypes.positive_int, default=None, metavar="N",
                   help="worker processes (default: one per CPU)")
    k.add_argument("--families", default=None, metavar="LIST",
                   help="comma-separated families (default: all)")
    k.add_argument("--cpu", action="store_true",
                   help="instead, compile the cpu backend's Numba kernels into Numba's cache (NUMBA_CACHE_DIR): "
                        "every family and weight kind, or those --ckpt runs (docs/cli.md, \"The first run compiles "
                        "kernels\") (default: the CUDA kernels)")
    k.add_argument("--ckpt", type=argtypes.checkpoint_dir, default=None, metavar="DIR",
                   help="with --cpu: only the kernels this checkpoint runs (it is loaded) (default: all)")
    _common(k, top=False)
    k.set_defaults(run=run_kernels)

    _harness(sub, "bench", bench, "the benchmark harness (benchmarks/README.md)",
             "Times every op and the propose step of a backend on a shape set, beside their memory floors, "
             "and marks figures not to be trusted (runs spread too widely, or a time below its floor). "
             "benchmarks/README.md explains the table.")
    _harness(sub, "bench-shard", bench_shard,
             "the sharded head's per-rank bytes and propose latency at 1, 2, 4 ranks (MPI)",
             "Runs mpirun -n R for each world size: every rank loads its slice of a synthetic checkpoint on "
             "the cpu backend and times propose_batch beside its per-rank floor (benchmarks/README.md, "
             f"\"Figures: the sharded head\"). Needs {install_hint('mpi')}.")
    return ap


def one_line(e: BaseException) -> str:
    """An exception as one line: its message with line breaks folded (its class when it has none)."""
    text = " ".join(str(e).split())
    return text or type(e).__name__


def main(argv: list[str] | None = None, prog: str = "mtpkern") -> int:
    """Run one command; returns the exit status (0, or 2 for an error, printed as one line)."""
    try:
        args = build_parser(prog).parse_args(sys.argv[1:] if argv is None else argv)
    except UsageError as e:
        sys.stderr.write(f"mtpkern: error: {one_line(e)}\n")
        return 2
    except SystemExit as e:               # --help
        return e.code if isinstance(e.code, int) else 0
    if args.verbose:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
        _log.addHandler(handler)
        _log.setLevel(logging.INFO)
    try:
        args.run(args)
    except BrokenPipeError:               # `mtpkern demo | head -1`: the reader left; not an error of ours
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 0
    except FRIENDLY as e:
        if args.debug:
            raise
        sys.stderr.write(f"mtpkern: error: {one_line(e)}\n")
        return 2
    except KeyboardInterrupt:
        if args.debug:
            raise
        sys.stderr.write("mtpkern: interrupted\n")
        return 130
    return 0


# -- demo ----------------------------------------------------------------------------------------

def run_demo(args: argparse.Namespace) -> dict:
    from .backends import get_backend
    from .backends.warm_up import KernelNeeds
    from .progress import Progress, warm_up
    from .proposer import MultiModuleMtpHead
    from .synthetic import synthetic_checkpoint

    be = get_backend(args.backend, threads=args.threads)
    ckpt = args.ckpt if args.ckpt else synthetic_checkpoint(args.config, say=print)
    prop = MultiModuleMtpHead.from_pretrained(ckpt, backend=be, kv_mode=args.kv_mode, chain=args.chain)
    warm_up(be, needs=KernelNeeds.of(prop))          # only the kernels this checkpoint runs
    cfg = prop.config
    rng = np.random.default_rng(args.seed)
    H, V, M = cfg.hidden_size, cfg.vocab_size, prop.num_modules
    k = min(args.num_drafts or M, M)
    print(f"mtpkern demo: {prop!r}")
    print(f"  ({LEGEND})")
    print(f"checkpoint: {ckpt}" + ("" if args.ckpt else " (synthetic: random weights, so the drafts are "
                                                        "random tokens)"))
    if args.num_drafts and args.num_drafts > M:
        print(f"--num-drafts {args.num_drafts} is more than the M={M} modules: a propose drafts at most one "
              f"token per module, so k = {M}")
    print(f"verifier: simulated. Each step it accepts a uniformly random prefix (0..{k} drafts) of each "
          f"sequence's proposal, so the acceptance rates below are set by construction (module m: "
          f"(k - m) / (k + 1)), not measured from the model.")
    seqs = []
    for _ in range(args.batch):
        st = prop.alloc_state_for(args.prompt_len + args.steps * (M + 1) + 1)
        toks = rng.integers(0, V, args.prompt_len)
        hid = rng.standard_normal((args.prompt_len, H)).astype(np.float32)
        prop.prefill_drafter(toks, hid, st)
        seqs.append([st, args.prompt_len, hid[-1]])
    # one untimed step (the cuda backend compiles its kernels and captures its graph here)
    for s in seqs:
        prop.propose(int(rng.integers(0, V)), s[2], s[1], k, s[0])
        prop.after_verify(0, s[0])
        s[1] += 1
    prop.stats.reset()
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
        "backend": be.describe(), "threads": getattr(be, "threads", None), "kv_mode": prop.kv_mode,
        "chain": prop.chain, "batch": len(seqs), "num_drafts": k, "steps": args.steps,
        "drafts_per_s": round(drafted / sum(lat), 1),
        "propose_ms_mean": round(float(lat_ms.mean()), 3), "propose_ms_p50": round(float(np.median(lat_ms)), 3),
        "propose_ms_p99": round(float(np.percentile(lat_ms, 99)), 3),
        "loop_s": round(total, 3),
        "acceptance_per_module": [round(stats.acceptance_rate(m), 3) for m in range(M)],
        "acceptance_by_construction": [round((k - m) / (k + 1), 3) for m in range(k)],
        "mean_accepted_length": round(stats.mean_accepted_length, 3),
        "kv_blocks_in_use": prop.kv_blocks_in_use(), "kv_blocks_per_module": prop.num_blocks,
    }
    print(f"backend {out['backend']}, kv_mode {out['kv_mode']}, batch {out['batch']}, k={k}, {args.steps} steps")
    print(f"  drafts/s            {out['drafts_per_s']:.1f}   (draft tokens returned per second of propose "
          f"time, all sequences together; verify and catch-up not counted)")
    print(f"  propose latency     mean {out['propose_ms_mean']:.3f} ms, p50 {out['propose_ms_p50']:.3f} ms, "
          f"p99 {out['propose_ms_p99']:.3f} ms   (one propose{'_batch' if len(seqs) > 1 else ''} call)")
    print("  acceptance/module   " + "  ".join(f"m{m}: {r:.2f}" for m, r in enumerate(out["acceptance_per_module"]))
          + f"   (mean accepted length {out['mean_accepted_length']:.2f}; by construction "
          + " ".join(f"{r:.2f}" for r in out["acceptance_by_construction"]) + f", {k / 2:.2f})")
    print(f"  KV blocks in use    {out['kv_blocks_in_use']} of {prop.num_blocks} per module")
    for st, _, _ in seqs:
        prop.free_state(st)
    prop.check_invariants()
    print(f"  after free          {prop.kv_blocks_in_use()} blocks in use")
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2))
    return out


# -- info ----------------------------------------------------------------------------------------

#: bytes per element of the safetensors dtypes a checkpoint holds
_DTYPE_BYTES = {"F8_E4M3": 1, "BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I32": 4, "I64": 8}


def run_kernels(args: argparse.Namespace) -> dict:
    from .backends.cuda_launch import kernel_cache, loader

    if args.cpu:
        return _cpu_kernels(args)
    if args.ckpt is not None:
        raise ValueError("--ckpt: expected with --cpu only (the CUDA build covers every family), got "
                         f"{str(args.ckpt)!r} without --cpu")
    families = [f for f in (args.families or "").split(",") if f] or None
    t0 = time.perf_counter()
    built = loader.prebuild(families, arch=args.arch, nvrtc_major=args.nvrtc, jobs=args.jobs)
    for fam, secs in built.items():
        print(f"  {fam:10s} {'cached' if secs == 0 else f'{secs:6.1f} s'}")
    wall = time.perf_counter() - t0
    print(f"{len(built)} families in {kernel_cache.cache_dir()} ({wall:.1f} s wall, "
          f"{sum(built.values()):.1f} s of compiles)")
    return {"families": built, "wall_s": wall, "directory": str(kernel_cache.cache_dir())}


def _cpu_kernels(args: argparse.Namespace) -> dict:
    """``mtpkern kernels --cpu``: the cpu backend's warm-up (all of it, or what --ckpt runs)."""
    import numba

    from .backends import get_backend
    from .backends.warm_up import KernelNeeds
    from .progress import warm_up
    from .proposer import MultiModuleMtpHead

    cuda_only = [f"--{name}" for name in ("arch", "nvrtc", "jobs", "families") if getattr(args, name) is not None]
    if cuda_only:
        raise ValueError("--cpu builds the Numba kernels: expected none of --arch, --nvrtc, --jobs, --families "
                         f"(the CUDA build's options), got {', '.join(cuda_only)}")
    be = get_backend("cpu")
    needs = None
    if args.ckpt is not None:
        needs = KernelNeeds.of(MultiModuleMtpHead.from_pretrained(args.ckpt, backend=be))
    t0 = time.perf_counter()
    compiled = warm_up(be, needs=needs)
    wall = time.perf_counter() - t0
    where = numba.config.CACHE_DIR or "Numba's default cache (beside the sources, else ~/.cache/numba)"
    what = "every kernel family" if needs is None else f"the kernels {args.ckpt} runs ({needs.describe()})"
    print(f"{what}: {compiled} functions compiled, {'nothing' if not compiled else 'written'} "
          f"{'new in' if not compiled else 'to'} {where} ({wall:.1f} s)")
    return {"compiled": compiled, "wall_s": wall, "directory": where,
            "needs": None if needs is None else needs.describe()}


def run_info(args: argparse.Namespace) -> dict:
    from .config import MtpConfig
    from .kv import BlockPool
    from .models import family
    from .errors import CheckpointError
    from .weights import CheckpointReader, check_headers, experts_gate_up, module_key

    path = args.checkpoint
    cfg = MtpConfig.from_json(path / "config.json")
    fam = family(cfg.family)
    rd = CheckpointReader(path)
    print(f"{path}: {cfg.describe()}")
    print(f"  family: {fam.describe() if cfg.family else fam.title}")
    blocks = [cfg.block(m) for m in range(cfg.num_modules)]
    rows = [BlockPool.bytes_per_block(1, b.kv_row_values, 2) for b in blocks]
    kv_row = max(rows)
    windows = [b.sliding_window for b in blocks]
    each = f"{kv_row}" if len(set(rows)) == 1 else "/".join(map(str, rows))
    bound = (f"; windowed modules keep about their window ({'/'.join(str(w or '-') for w in windows)} tokens)"
             if any(windows) else "")
    what = "K and V" if not any(b.mla for b in blocks) else \
        ("one latent row" if all(b.mla for b in blocks) else "K and V, or one latent row (MLA)")
    if any(b.dsa for b in blocks):
        ib = [BlockPool.bytes_per_block(1, b.index_width, 2) for b in blocks]
        idx = f"{ib[0]}" if len(set(ib)) == 1 else "/".join(map(str, ib))
        gates = " and its gate scores" if any(b.kpool for b in blocks if b.dsa) else ""
        what += f", with DSA's indexer key{gates} ({idx} B of them)"
    print(f"  KV per token and module: {each} B ({what}, BF16 on cuda; twice that in FP32 on numpy/cpu){bound}")
    report = {"config": cfg.describe(), "family": cfg.family or "", "features": fam.describe(),
              "kv_bytes_per_token_module_bf16": kv_row,
              "index_bytes_per_token_module_bf16": [BlockPool.bytes_per_block(1, b.index_width, 2) for b in blocks],
              "modules": []}
    for m in range(cfg.num_modules):
        pre = fam.module_prefix(cfg.layer_index(m), m)
        keys = sorted(rd.keys_under(pre))
        nbytes, dtypes = 0, set()
        for key in keys:
            shape, dt = rd.info(key)
            dtypes.add(dt)
            nbytes += int(np.prod(shape)) * _DTYPE_BYTES.get(dt, 4)
        own = [s for s in ("embed_tokens.weight", "shared_head.head.weight")
               if rd.has(module_key(fam, rd, cfg.layer_index(m), m, s))]
        gate_up = experts_gate_up(cfg, rd, m)
        line = (f"  module {m}: {pre}*  {len(keys)} tensors, {nbytes / 2**20:.1f} MiB, dtypes {sorted(dtypes)}, "
                f"own {', '.join(own) if own else 'no embedding/head (uses the target)'}"
                f"{'; routed experts packed (gate_up_proj [E, 2I, H], down_proj [E, H, I])' if gate_up else ''}")
        print(line)
        report["modules"].append({"prefix": pre, "tensors": len(keys), "bytes": nbytes, "dtypes": sorted(dtypes),
                                  "own": own, "experts_gate_up": gate_up})
    for key in (fam.target_embed, fam.target_head, fam.target_norm):
        if rd.has(key):
            shape, dt = rd.info(key)
            print(f"  target {key}: {list(shape)} {dt}")
    # every tensor the loader reads, against the config, from the headers alone (no data read)
    problems, _ = check_headers(path, cfg)
    report["problems"] = problems
    if problems:
        print(f"  {len(problems)} problem(s): the checkpoint would not load")
        for p in problems:
            print(f"    {p}")
        raise CheckpointError(f"{path}: {len(problems)} problem(s) with the checkpoint's tensors "
                              f"(listed above); the first: {problems[0]}")
    print("  tensors: every tensor the modules read is present, with the expected shape and dtype "
          "(headers checked; values are checked at load)")
    return report


if __name__ == "__main__":
    raise SystemExit(main(prog="python -m mtpkern"))
