"""The command line: ``mtpkern demo | info | kernels | bench | acceptance | bench-shard`` (also
``python -m mtpkern ...``).

``demo`` runs greedy decoding and the speculative loop on the shipped trained checkpoint
against its reference target (a real verifier) and prints what was measured; ``info`` tells
what a checkpoint holds; ``bench`` is the benchmark harness (``mtpkern.bench``);
``acceptance`` measures acceptance on the trained checkpoint (``mtpkern.bench_acceptance``); ``bench-shard``
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

from . import argtypes, bench, bench_acceptance, bench_shard
from .errors import MtpError, install_hint

DESCRIPTION = """\
mtpkern drafts tokens for LLM speculative decoding with multi-module MTP heads
(DeepSeek-V3, GLM-4.5, MiniMax-M2 style: module m has its own weights and paged KV
cache and drafts token m from module m-1's hidden). An inference engine imports it
as a Python library; these commands try it out and measure it. Backends: numpy (the
reference), cpu (Numba), cuda (CuPy RawModule kernels)."""

EPILOG = """\
examples:
  {prog} demo                       # speculative decoding with the trained checkpoint, real verifier
  {prog} demo --kv-mode draft --num-drafts 2 --prompt "def main():"
  {prog} acceptance --json acc.json # acceptance: chains, trees, early stop, the K policy
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

    d = sub.add_parser("demo", formatter_class=_Formatter,
                       help="speculative decoding with the shipped trained checkpoint, against a real verifier",
                       description="Greedy decoding and the speculative loop on the same held-out prompt, with "
                                   "the shipped trained checkpoint (stdlib-glm-tiny: a tiny GLM-4.5-layout model "
                                   "with 3 MTP modules, byte tokens) as both target and drafter. Checks that both "
                                   "produce the same tokens (greedy verification is lossless), then prints the "
                                   "text, the acceptance per draft position and the tokens per verify (from the "
                                   "verifier's decisions), and tokens/s with and without speculation.")
    _backend_arguments(d)
    d.add_argument("--kv-mode", default="exact", choices=["exact", "draft"],
                   help="exact: each module's KV equals a recomputation over the verified tokens; "
                        "draft: one row per module per propose (docs/semantics.md)")
    d.add_argument("--chain", default=None, choices=["prenorm", "postnorm"],
                   help="the hidden passed from module m to m+1: y, or shared_head_norm(y) "
                        "(default: the checkpoint's training.json's; without one the family's)")
    d.add_argument("--ckpt", type=argtypes.checkpoint_dir, default=None, metavar="DIR",
                   help="a glm4_moe checkpoint with target layers instead of the shipped trained one "
                        "(default: stdlib-glm-tiny)")
    d.add_argument("--prompt", default=None, metavar="TEXT",
                   help="the prompt, as byte tokens (default: the checkpoint's first held-out prompt, "
                        "from its prompts.json)")
    d.add_argument("--max-new-tokens", "--steps", dest="max_new_tokens", type=argtypes.positive_int, default=128,
                   metavar="N", help="tokens generated after the prompt (--steps: its older name)")
    d.add_argument("--num-drafts", type=argtypes.positive_int, default=None, metavar="K",
                   help="drafts asked per propose; above M (the modules) it is clamped to M "
                        "(default: M, one per module)")
    d.add_argument("--repeats", type=argtypes.positive_int, default=3,
                   help="timed runs of each loop; the median is reported")
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
    _harness(sub, "acceptance", bench_acceptance,
             "acceptance and tokens/s against a real verifier on the trained checkpoint (benchmarks/README.md)",
             "Runs the speculative loop against the reference target on the shipped trained checkpoint's "
             "held-out prompts: per-position acceptance and tokens per verify from the verifier's decisions, "
             "for chains k = 1..M in both KV modes, draft trees, early stop and the K policy against every fixed "
             "K, each checked lossless against greedy decoding and timed end to end (benchmarks/README.md, "
             "\"Acceptance on the trained checkpoint\").")
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
    from .bench_acceptance import (checkpoint_chain, checkpoint_prompts, decode, default_checkpoint, encode,
                                   figures, machine)
    from .loop import greedy_generate, speculative_generate
    from .progress import warm_up
    from .proposer import MultiModuleMtpHead
    from .target import ReferenceTarget

    be = get_backend(args.backend, threads=args.threads)
    ckpt = args.ckpt if args.ckpt else default_checkpoint()
    chain = args.chain or checkpoint_chain(ckpt)
    target = ReferenceTarget.from_pretrained(ckpt, backend=be, num_blocks=256)
    prop = MultiModuleMtpHead.from_pretrained(ckpt, backend=be, kv_mode=args.kv_mode, chain=chain, num_blocks=256)
    cfg = prop.config
    if args.prompt is not None:
        text, where = args.prompt, "--prompt"
    else:
        held = checkpoint_prompts(ckpt)
        if not held:
            raise ValueError(f"--prompt: expected a prompt, since {ckpt} has no prompts.json, got none")
        text, where = held[0], "held out: a file the checkpoint was not trained on (its prompts.json)"
    prompt = encode("--prompt", text, cfg.vocab_size)
    N, M = args.max_new_tokens, prop.num_modules
    k = min(args.num_drafts or M, M)
    top = len(prompt) + N + M
    if top > cfg.max_position_embeddings:
        raise ValueError(f"--max-new-tokens: expected prompt ({len(prompt)}) + N + M <= max_position_embeddings "
                         f"({cfg.max_position_embeddings}), got N = {N}")
    warm_up(be, needs=KernelNeeds.of(prop))          # only the kernels this checkpoint runs
    print(f"mtpkern demo: {prop!r}")
    print(f"  ({LEGEND})")
    print(f"checkpoint: {ckpt}" + ("" if args.ckpt else " (shipped, trained on the Python standard library's "
                                                        "sources; byte tokens)"))
    print(f"target: {target!r}: the verifier, greedy (it accepts the drafts that equal its own argmax)")
    print(f"chain: {chain or prop.chain}"
          + (" (the checkpoint's training.json)" if chain and not args.chain else ""))
    if args.num_drafts and args.num_drafts > M:
        print(f"--num-drafts {args.num_drafts} is more than the M={M} modules: a propose drafts at most one "
              f"token per module, so k = {M}")
    print(f"prompt ({len(prompt)} bytes; {where}):")
    print("  | " + decode(prompt).replace("\n", "\n  | "))
    # an untimed round (the cuda backend compiles and captures its graph here), then the timed runs
    greedy_generate(target, prompt, 2)
    speculative_generate(target, prop, prompt, 2, k)
    t_greedy, t_spec = [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        g = greedy_generate(target, prompt, N)
        t1 = time.perf_counter()
        s = speculative_generate(target, prop, prompt, N, k)
        t2 = time.perf_counter()
        t_greedy.append(t1 - t0)
        t_spec.append(t2 - t1)
    lossless = s.tokens == g.tokens
    fig = figures(s.decisions)
    tg, ts = float(np.median(t_greedy)), float(np.median(t_spec))
    out = {
        "checkpoint": str(ckpt), "backend": be.describe(), "threads": getattr(be, "threads", None),
        "machine": machine(), "kv_mode": prop.kv_mode, "chain": prop.chain, "num_drafts": k,
        "prompt": text, "max_new_tokens": N, "tokens": s.tokens, "text": decode(s.tokens),
        "lossless": lossless, **fig,
        "greedy_tokens_per_s": round(N / tg, 1), "speculative_tokens_per_s": round(N / ts, 1),
        "speedup": round(tg / ts, 3), "greedy_s": round(tg, 4), "speculative_s": round(ts, 4),
        "repeats": args.repeats,
    }
    print(f"generated ({N} tokens, bytes decoded with errors='replace'):")
    print("  | " + out["text"].replace("\n", "\n  | "))
    if not lossless:
        raise MtpError(f"the speculative loop's tokens differ from greedy decoding's (first at token "
                       f"{next(i for i, (a, b) in enumerate(zip(s.tokens, g.tokens)) if a != b)}): not lossless")
    print(f"lossless: yes: the speculative loop's {N} tokens equal greedy decoding's, token for token")
    print(f"backend {out['backend']}, kv_mode {out['kv_mode']}, k={k}, {fig['verifies']} verifies; "
          f"measured on {out['machine']}")
    per = fig["acceptance_per_position"]
    print("  acceptance/position " + "  ".join(f"d{j}: {r:.2f}" for j, r in enumerate(per))
          + "   (of the verifies that offered draft j, the share whose verifier accepted it: from the "
            "verifier's decisions)")
    print(f"  tokens per verify   {fig['tokens_per_verify']:.2f}   (accepted drafts + the target's bonus token, "
          f"mean over the {fig['verifies']} verifies: from the verifier's decisions)")
    print(f"  tokens/s greedy     {out['greedy_tokens_per_s']:.1f}   (plain greedy decoding, one target forward "
          f"a token; {N} tokens, median of {args.repeats} runs, prefill included)")
    print(f"  tokens/s speculative {out['speculative_tokens_per_s']:.1f}  (propose + verify + catch-up a step; "
          f"the same tokens, median of {args.repeats} runs)")
    print(f"  speedup             {out['speedup']:.2f}x  (speculative / greedy tokens/s on this machine: a step "
          f"costs a propose and a verify of k + 1 rows, so tokens per verify is a gain where a propose is cheap "
          f"next to the target's forward; on the shipped tiny model the two cost about the same, so the gain is "
          f"small or none)")
    print(f"  KV blocks in use    {prop.kv_blocks_in_use()} (drafter), {target.kv_blocks_in_use()} (target) "
          f"after the runs freed their sequences")
    prop.check_invariants()
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
