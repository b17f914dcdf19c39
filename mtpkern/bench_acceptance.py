"""Acceptance measured against a real verifier: ``mtpkern acceptance`` (benchmarks/README.md,
"Acceptance on the trained checkpoint"), and the pieces ``mtpkern demo`` shares with it.

On a checkpoint with target layers (by default the shipped trained one,
``mtpkern.checkpoints.STDLIB_GLM_TINY``, on its held-out prompts) the target
(``ReferenceTarget``) and the drafter (``MultiModuleMtpHead``) run the real loop
(``mtpkern.loop``), and every acceptance figure comes from the verifier's decisions
(``Decisions``): per draft position ``j``, the share of the verifies offering ``d_j`` that
accepted it, and the tokens each verify adds (accepted drafts + the bonus token). Every run is
checked against plain greedy decoding of the same prompt (lossless), and timed end to end.

Rows: chains of ``k = 1 .. M`` drafts in each KV mode; draft trees of widths ``W`` per depth
(``propose_tree`` + ``after_verify_tree``, verified by ``mtpkern.loop.verify_tree``: greedy
verification by the tree's paths, exact in its decisions; its tokens/s counts one target
forward per branch taken, not a tree-masked verify, so it is not a tree verify's speed);
early stop (``min_confidence``); and the K policy (``mtpkern.k_policy.choose_k`` each step
from the costs measured here and the acceptance counted so far) against every fixed K, at
batch 1. Batch 8 is not run: ``ReferenceTarget`` verifies one sequence at a time. FP8 is not
run: the loader takes FP8 checkpoints as released and does not quantize a BF16 one.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from . import argtypes

#: the K policy's runs: (Beta prior, optimism). The library's default prior (1, 1) reads 0.5
#: before any verify offered a position; with the mean alone (optimism 0) choose_k may pick
#: K = 0 at the first step, after which nothing is offered, so nothing is counted and K stays
#: 0; one posterior standard deviation of optimism reads an uncounted position at 0.79, so the
#: policy drafts first and the counts then decide; a prior of (4, 1) reads 0.8 by itself
POLICY_RUNS = (((1.0, 1.0), 0.0), ((1.0, 1.0), 1.0), ((4.0, 1.0), 0.0))


# -- shared with the demo --------------------------------------------------------------------

def default_checkpoint() -> Path:
    from . import checkpoints

    return checkpoints.path(checkpoints.STDLIB_GLM_TINY)


def checkpoint_chain(ckpt: Path) -> str | None:
    """The chain ``ckpt`` was trained with (its ``training.json``'s ``chain``), or None."""
    rec = Path(ckpt) / "training.json"
    if not rec.is_file():
        return None
    chain = json.loads(rec.read_text()).get("chain")
    return chain if chain in ("prenorm", "postnorm") else None


def checkpoint_prompts(ckpt: Path) -> list[str]:
    """The held-out prompts shipped beside ``ckpt`` (its ``prompts.json``), or []."""
    f = Path(ckpt) / "prompts.json"
    if not f.is_file():
        return []
    return [p["text"] for p in json.loads(f.read_text())["prompts"]]


def encode(name: str, text: str, vocab_size: int) -> list[int]:
    """``text`` as byte tokens (token id = byte value: the shipped checkpoint's tokenizer)."""
    toks = list(text.encode("utf-8"))
    if not toks:
        raise ValueError(f"{name}: expected a non-empty text, got {text!r}")
    if max(toks) >= vocab_size:
        raise ValueError(f"{name}: expected bytes below the checkpoint's vocab_size {vocab_size} "
                         f"(token id = byte value), got a byte {max(toks)}")
    return toks


def decode(tokens: list[int]) -> str:
    return bytes(t % 256 for t in tokens).decode("utf-8", errors="replace")


def merged(runs: list[Any]) -> Any:
    """One ``Decisions`` holding every verify of ``runs`` (``Decisions`` each)."""
    from .loop import Decisions

    out = Decisions()
    for d in runs:
        for k, a in zip(d.offered, d.accepted):
            out.record(k, a)
    return out


def figures(dec: Any) -> dict:
    """The acceptance figures of ``dec`` (a ``Decisions``), from its counts alone."""
    P = len(dec.offered_at)
    return {"verifies": dec.verifies, "offered_at": list(dec.offered_at), "accepted_at": list(dec.accepted_at),
            "acceptance_per_position": [round(dec.acceptance_rate(j), 4) for j in range(P)],
            "drafts_per_verify": round(float(np.mean(dec.offered)), 4) if dec.offered else 0.0,
            "mean_accepted": round(dec.mean_accepted, 4), "tokens_per_verify": round(dec.tokens_per_verify, 4)}


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def machine() -> str:
    from .bench import _cpu_count, _cpu_model

    return f"{_cpu_model()} ({platform.machine()}), {_cpu_count()} cores"


# -- the K policy's inputs -------------------------------------------------------------------

def policy_counts(dec: Any, k_max: int) -> tuple[np.ndarray, np.ndarray]:
    """``acceptance_from_counts``'s ``(accepted, reached)`` [k_max] from the verifier's decisions:
    position ``j`` is reached by a verify that offered ``d_j`` and accepted every draft before it."""
    acc, reached = np.zeros(k_max), np.zeros(k_max)
    for k, a in zip(dec.offered, dec.accepted):
        top = min(k, a + 1, k_max)
        reached[:top] += 1
        acc[:min(a, k_max)] += 1
    return acc, reached


def measure_costs(target: Any, prop: Any, prompt: list[int], k_max: int, runs: int = 5) -> tuple:
    """``StepCosts`` at batch 1, from steps of the real loop on ``prompt``: ``propose`` of
    ``k = 1 .. k_max`` drafts and ``verify`` of ``n = k + 1`` rows (``n = 1``: a decode step),
    the median of ``runs`` steps each. Returns the costs and the (B, size, seconds) points."""
    from .k_policy import StepCosts

    seq, st = target.alloc_seq(), prop.alloc_state()
    try:
        first = target.prefill(seq, prompt)
        prop.prefill_drafter(prompt, first.hiddens, st)
        P, t, h = len(prompt), first.next_token, first.hiddens[-1]
        prop_pts, ver_pts, cat_pts = [], [], []
        for n in range(1, k_max + 1):             # catch-up over n decoded tokens (a K = 0 stretch)
            tc = []
            for _ in range(runs):
                toks, hs = [t], [h]
                for _ in range(n - 1):
                    d = target.decode(seq, toks[-1])
                    toks.append(d.next_token)
                    hs.append(d.hiddens[-1])
                t0 = time.perf_counter()
                prop.catchup_drafter(toks, np.stack(hs), st)
                tc.append(time.perf_counter() - t0)
                d = target.decode(seq, toks[-1])
                P, t, h = P + n, d.next_token, d.hiddens[-1]
            cat_pts.append((1, n, float(np.median(tc))))
        for k in range(0, k_max + 1):
            tp, tv = [], []
            for _ in range(runs):
                t0 = time.perf_counter()
                drafts = [int(d) for d in prop.propose(t, h, P, k, st)] if k else []
                t1 = time.perf_counter()
                v = target.verify(seq, t, drafts)
                t2 = time.perf_counter()
                a = v.num_accepted
                if k:
                    prop.after_verify(a, st)
                    prop.catchup_drafter(drafts[:a], v.hiddens[:a], st)
                else:
                    prop.catchup_drafter([t], h[None, :], st)
                tp.append(t1 - t0)
                tv.append(t2 - t1)
                P, t, h = P + a + 1, v.bonus, v.hiddens[a]
            if k:
                prop_pts.append((1, k, float(np.median(tp))))
            ver_pts.append((1, k + 1, float(np.median(tv))))
        return StepCosts.from_points(prop_pts, ver_pts, catchup=cat_pts), prop_pts, ver_pts, cat_pts
    finally:
        prop.free_state(st)
        target.free_seq(seq)


# -- the benchmark ---------------------------------------------------------------------------

def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The options of ``mtpkern acceptance``."""
    ap.add_argument("--backend", default="cpu", choices=["numpy", "cpu", "cuda"], help="backend of both models")
    ap.add_argument("--threads", type=argtypes.positive_int, default=None, metavar="N",
                    help="Numba threads of the cpu backend (default: the backend's, half the cores)")
    ap.add_argument("--ckpt", type=argtypes.checkpoint_dir, default=None, metavar="DIR",
                    help="a glm4_moe checkpoint with target layers (default: the shipped trained one, "
                         "stdlib-glm-tiny)")
    ap.add_argument("--chain", default=None, choices=["prenorm", "postnorm"],
                    help="module chaining (default: the checkpoint's training.json's, else the family's)")
    ap.add_argument("--prompts", type=argtypes.positive_int, default=None, metavar="N",
                    help="the first N held-out prompts of the checkpoint's prompts.json (default: all)")
    ap.add_argument("--max-new-tokens", type=argtypes.positive_int, default=96, metavar="N",
                    help="tokens generated after each prompt")
    ap.add_argument("--kv-modes", type=argtypes.choices_list("exact", "draft"), default="exact,draft",
                    metavar="MODE[,MODE]", help="KV modes of the chain and tree rows")
    ap.add_argument("--tree-widths", type=argtypes.positive_int, nargs="*", default=[1, 2, 4], metavar="W",
                    help="draft-tree rows: W children per node at every depth (none: no tree rows)")
    ap.add_argument("--min-confidence", type=float, nargs="*", default=[0.3, 0.6, 0.9], metavar="C",
                    help="early-stop rows (k = M, exact mode): drafting stops after a draft of confidence "
                         "below C (none: no rows)")
    ap.add_argument("--no-policy", action="store_true", help="skip the K-policy rows")
    ap.add_argument("--json", type=argtypes.output_file, default=None, metavar="PATH",
                    help="write every figure as JSON to PATH (default: not written)")
    ap.add_argument("--plot", type=argtypes.output_file, default=None, metavar="PATH",
                    help="draw acceptance per position of each row as a PNG (needs matplotlib) (default: not drawn)")


def _loader(be: Any, ckpt: Path, chain: str | None) -> Callable[[str], Any]:
    from .proposer import MultiModuleMtpHead

    cache: dict[str, Any] = {}

    def load(kv_mode: str) -> Any:
        if kv_mode not in cache:
            cache[kv_mode] = MultiModuleMtpHead.from_pretrained(ckpt, backend=be, kv_mode=kv_mode, chain=chain,
                                                                num_blocks=1024)
        return cache[kv_mode]
    return load


def run(args: argparse.Namespace) -> dict[str, Any]:
    """``mtpkern acceptance``: print the table; returns the figures (what ``--json`` writes)."""
    from .backends import get_backend
    from .backends.warm_up import KernelNeeds
    from .k_policy import acceptance_from_counts, choose_k
    from .loop import greedy_generate, speculative_generate, tree_generate
    from .progress import warm_up
    from .target import ReferenceTarget

    for c in args.min_confidence:
        if not 0.0 <= c <= 1.0:
            raise ValueError(f"--min-confidence: expected values in [0, 1], got {c}")
    if args.plot is not None:
        from .bench import require_matplotlib
        require_matplotlib()
    be = get_backend(args.backend, threads=args.threads)
    ckpt = Path(args.ckpt) if args.ckpt else default_checkpoint()
    chain = args.chain or checkpoint_chain(ckpt)
    target = ReferenceTarget.from_pretrained(ckpt, backend=be, num_blocks=512)
    load = _loader(be, ckpt, chain)
    first = load(args.kv_modes[0])
    M = first.num_modules
    V = target.config.vocab_size
    texts = checkpoint_prompts(ckpt)
    if not texts:
        raise ValueError(f"--ckpt: expected a prompts.json of held-out prompts beside the checkpoint, "
                         f"got none in {ckpt}")
    texts = texts[:args.prompts] if args.prompts else texts
    prompts = [encode("prompts.json", t, V) for t in texts]
    N = args.max_new_tokens
    warm_up(be, needs=KernelNeeds.of(first))
    # an untimed round: the cuda backend's first calls compile and capture
    greedy_generate(target, prompts[0], 2)
    speculative_generate(target, first, prompts[0], 2, M)

    greedy, t_greedy = [], 0.0
    for p in prompts:
        g, s = timed(lambda: greedy_generate(target, p, N))
        greedy.append(g.tokens)
        t_greedy += s
    total = N * len(prompts)
    base = {"kind": "greedy", "tokens_per_s": round(total / t_greedy, 1), "seconds": round(t_greedy, 4)}
    rows: list[dict] = []

    def row(kind: str, kv_mode: str, gen: Callable[[list[int]], Any], **what: Any) -> dict:
        decs, secs, lossless = [], 0.0, True
        for p, want in zip(prompts, greedy):
            out, s = timed(lambda: gen(p))
            secs += s
            lossless &= out.tokens == want
            decs.append(out.decisions)
        r = {"kind": kind, "kv_mode": kv_mode, **what, **figures(merged(decs)), "lossless": lossless,
             "tokens_per_s": round(total / secs, 1), "seconds": round(secs, 4),
             "speedup": round(t_greedy / secs, 3)}
        rows.append(r)
        _print_row(r)
        return r

    print(f"mtpkern acceptance: {ckpt} (chain {chain or 'the family default'}), backend {be.describe()}")
    print(f"  {len(prompts)} held-out prompts x {N} new tokens, batch 1; machine {machine()}")
    print(f"  greedy decoding: {base['tokens_per_s']:.1f} tokens/s (one target forward per token)")
    print(f"  {'row':26s} {'acceptance per position':28s} {'drafts/v':>8s} {'tokens/v':>8s} "
          f"{'tokens/s':>9s} {'speedup':>7s}  lossless")
    for mode in args.kv_modes:
        prop = load(mode)
        for k in range(1, M + 1):
            row("chain", mode, lambda p: speculative_generate(target, prop, p, N, k), k=k)
        for w in args.tree_widths:
            row("tree", mode, lambda p: tree_generate(target, prop, p, N, [w] * M), width=w, k=M)
    prop = load("exact")
    for c in args.min_confidence:
        row("early_stop", "exact", lambda p: speculative_generate(target, prop, p, N, M, min_confidence=c),
            k=M, min_confidence=c)
    policy = None
    if not args.no_policy:
        costs, prop_pts, ver_pts, cat_pts = measure_costs(target, prop, prompts[0], M)
        fixed = {0: base["tokens_per_s"]}
        fixed.update({x["k"]: x["tokens_per_s"] for x in rows if x["kind"] == "chain" and x["kv_mode"] == "exact"})
        policy = {"propose_s": [[k, round(s, 6)] for _, k, s in prop_pts],
                  "verify_s": [[n, round(s, 6)] for _, n, s in ver_pts],
                  "catchup_s": [[n, round(s, 6)] for _, n, s in cat_pts], "fixed_k_tokens_per_s": fixed, "runs": []}
        print("  K policy: costs measured at batch 1 (median of 5 loop steps): propose "
              + ", ".join(f"k={k} {s * 1e3:.2f} ms" for _, k, s in prop_pts) + "; verify "
              + ", ".join(f"n={n} {s * 1e3:.2f} ms" for _, n, s in ver_pts) + "; catch-up "
              + ", ".join(f"n={n} {s * 1e3:.2f} ms" for _, n, s in cat_pts))
        for prior, optimism in POLICY_RUNS:
            chosen: list[int] = []

            def pick(dec: Any, prior: tuple = prior, z: float = optimism, chosen: list = chosen) -> int:
                acc, reached = policy_counts(dec, M)
                k = choose_k(acceptance_from_counts(acc, reached, M, prior, z), costs, M).k
                chosen.append(k)
                return k

            r = row("k_policy", "exact", lambda p: speculative_generate(target, prop, p, N, pick), k=M,
                    prior=list(prior), optimism=optimism)
            counts = {str(k): chosen.count(k) for k in sorted(set(chosen))}
            policy["runs"].append({"prior": list(prior), "optimism": optimism, "chosen_k_counts": counts,
                                   "tokens_per_s": r["tokens_per_s"]})
            print(f"  K policy, prior {prior}, optimism {optimism:g}: chose k (steps) {counts}; "
                  f"{r['tokens_per_s']:.1f} tokens/s against "
                  + ", ".join(f"K={k}: {v:.1f}" for k, v in sorted(fixed.items())) + " (K=0: greedy, no drafter)")
    notes = ["batch 8 not run: ReferenceTarget verifies one sequence at a time (no batched verify)",
             "FP8 not run: the loader reads FP8 checkpoints as released and does not quantize the BF16 one",
             "tree rows: verified by their paths (one target forward per branch taken), so their tokens/s "
             "is not a tree-masked verify's; their acceptance is exact"]
    for n in notes:
        print(f"  note: {n}")
    out = {"checkpoint": str(ckpt), "chain": chain, "backend": be.describe(), "machine": machine(),
           "date": time.strftime("%Y-%m-%d", time.gmtime()), "prompts": len(prompts), "max_new_tokens": N,
           "num_modules": M, "greedy": base, "rows": rows, "k_policy": policy, "notes": notes}
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2))
    if args.plot is not None:
        _plot(out, args.plot)
    return out


def _label(r: dict) -> str:
    if r["kind"] == "chain":
        return f"chain k={r['k']} {r['kv_mode']}"
    if r["kind"] == "tree":
        return f"tree w={r['width']} {r['kv_mode']}"
    if r["kind"] == "early_stop":
        return f"early stop c={r['min_confidence']:g}"
    return f"K policy {tuple(r['prior'])} z={r['optimism']:g}"


def _print_row(r: dict) -> None:
    acc = " ".join(f"{a:.2f}" for a in r["acceptance_per_position"]) or "-"
    print(f"  {_label(r):26s} {acc:28s} {r['drafts_per_verify']:8.2f} {r['tokens_per_verify']:8.2f} "
          f"{r['tokens_per_s']:9.1f} {r['speedup']:7.2f}  {'yes' if r['lossless'] else 'NO'}")


def _plot(out: dict, path: os.PathLike) -> None:
    from .bench import require_matplotlib

    plt = require_matplotlib()
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in out["rows"]:
        if r["kind"] in ("chain", "tree") and r["k"] == out["num_modules"]:
            acc = r["acceptance_per_position"]
            ax.plot(range(len(acc)), acc, marker="o", label=_label(r))
    ax.set_xticks(range(out["num_modules"]))
    ax.set_xlabel("draft position j")
    ax.set_ylabel("accepted / offered")
    ax.set_title(f"acceptance per position, {out['prompts']} held-out prompts x {out['max_new_tokens']} tokens")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
