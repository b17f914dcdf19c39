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
early stop (``min_confidence``); chains of ``k = M+1 .. K`` under a module schedule
(``module_schedule="last"`` / ``"cycle"``, ``max_drafts=K``); reduced draft vocabularies of the
``N`` most frequent bytes of the training data (the checkpoint's ``byte_counts.json``, never the
held-out text); the drafter's projections in FP8 E4M3 with 128 x 128 block scales (a temporary
copy of the checkpoint, quantized as releases are; the target unchanged); draft mode without
the module-0 catch-up (``speculative_generate(..., catchup=False)``); and the K policy
(``mtpkern.k_policy.choose_k`` each step from the costs measured here and the acceptance
counted so far) against every fixed K, at batch 1 and at batch ``B`` (the prompts cycled,
``speculative_generate_batch``: ``propose_batch`` for the drafts, one K for the batch; the
target verifies each sequence in turn, ``ReferenceTarget`` having no batched verify, so the
verify's cost grows with ``B``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
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


def measure_costs_batch(target: Any, prop: Any, prompts: list[list[int]], k_max: int,
                        runs: int = 3) -> tuple[list, list, list]:
    """``StepCosts`` points at batch ``B = len(prompts)``, from steps of the batched loop
    (``mtpkern.loop.speculative_generate_batch``): ``propose_batch`` of ``k = 1 .. k_max``
    drafts, the ``B`` verifies of ``n = k + 1`` rows one after another (``ReferenceTarget``
    has no batched verify), and ``catchup_batch`` over ``n = 1 .. k_max`` tokens a sequence;
    the median of ``runs`` steps each. Returns the (B, size, seconds) propose, verify and
    catch-up points."""
    B = len(prompts)
    seqs, sts = [target.alloc_seq() for _ in range(B)], [prop.alloc_state() for _ in range(B)]
    try:
        P, t, h = [], [], []
        for seq, st, p in zip(seqs, sts, prompts):
            first = target.prefill(seq, p)
            prop.prefill_drafter(p, first.hiddens, st)
            P.append(len(p))
            t.append(first.next_token)
            h.append(first.hiddens[-1])
        prop_pts, ver_pts, cat_pts = [], [], []
        for n in range(1, k_max + 1):             # catch-up over n decoded tokens a sequence
            tc = []
            for _ in range(runs):
                toks, hs = [[x] for x in t], [[x] for x in h]
                for i in range(B):
                    for _ in range(n - 1):
                        d = target.decode(seqs[i], toks[i][-1])
                        toks[i].append(d.next_token)
                        hs[i].append(d.hiddens[-1])
                t0 = time.perf_counter()
                prop.catchup_batch(toks, [np.stack(x) for x in hs], sts)
                tc.append(time.perf_counter() - t0)
                for i in range(B):
                    d = target.decode(seqs[i], toks[i][-1])
                    P[i], t[i], h[i] = P[i] + n, d.next_token, d.hiddens[-1]
            cat_pts.append((B, n, float(np.median(tc))))
        for k in range(0, k_max + 1):
            tp, tv = [], []
            for _ in range(runs):
                t0 = time.perf_counter()
                drafts = prop.propose_batch(t, np.stack(h), P, k, sts) if k else [[] for _ in range(B)]
                t1 = time.perf_counter()
                vs = [target.verify(seqs[i], t[i], [int(d) for d in drafts[i]]) for i in range(B)]
                t2 = time.perf_counter()
                up = [], [], []
                for i, v in enumerate(vs):
                    a = v.num_accepted
                    if k:
                        prop.after_verify(a, sts[i])
                    caught = [int(d) for d in drafts[i][:a]] if k else [t[i]]
                    if caught:
                        up[0].append(caught)
                        up[1].append(v.hiddens[:a] if k else h[i][None, :])
                        up[2].append(sts[i])
                    P[i], t[i], h[i] = P[i] + a + 1, v.bonus, v.hiddens[a]
                if up[2]:
                    prop.catchup_batch(*up)
                tp.append(t1 - t0)
                tv.append(t2 - t1)
            if k:
                prop_pts.append((B, k, float(np.median(tp))))
            ver_pts.append((B, k + 1, float(np.median(tv))))
        return prop_pts, ver_pts, cat_pts
    finally:
        for st in sts:
            prop.free_state(st)
        for seq in seqs:
            target.free_seq(seq)


# -- other drafters of the same checkpoint ---------------------------------------------------

def frequent_bytes(ckpt: Path, n: int) -> np.ndarray | None:
    """The ``n`` most frequent byte values of ``ckpt``'s training data (its ``byte_counts.json``;
    ties: the lower byte first), sorted, as a draft vocabulary; None without that file."""
    f = Path(ckpt) / "byte_counts.json"
    if not f.is_file():
        return None
    counts = np.asarray(json.loads(f.read_text())["counts"], dtype=np.int64)
    if counts.shape != (256,) or (counts < 0).any():
        raise ValueError(f"{f}: expected 256 non-negative counts, got shape {counts.shape}")
    order = np.lexsort((np.arange(256), -counts))           # by count, descending; then by id
    return np.sort(order[:n]).astype(np.int64)


#: FP8 E4M3 with 128 x 128 block scales, as DeepSeek-V3's and GLM-4.5-FP8's config.json say it
FP8_QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": [128, 128]}


def fp8_copy(ckpt: Path, dst: Path) -> Path:
    """A copy of ``ckpt`` in ``dst`` whose MTP modules' projections are FP8 E4M3 with 128 x 128
    block scales (``quantize_projections``: amax / 448 per block, as releases quantize), the
    rest (target layers, norms, embedding, LM head) as it was, and ``quantization_config`` in
    its ``config.json``. Returns ``dst``."""
    from safetensors.numpy import save_file

    from .config import MtpConfig
    from .weights import quantize_projections, read_tensors

    d = json.loads((Path(ckpt) / "config.json").read_text())
    d["quantization_config"] = dict(FP8_QUANTIZATION)
    cfg = MtpConfig.from_dict(d)
    tensors = read_tensors(ckpt)
    mods = tuple(f"model.layers.{cfg.layer_index(m)}." for m in range(cfg.num_modules))
    quant = quantize_projections(cfg, {k: np.asarray(v, np.float32) for k, v in tensors.items() if k.startswith(mods)})
    quant = {k: v if v.dtype.itemsize == 1 or k.endswith("_scale_inv") else tensors[k] for k, v in quant.items()}
    out = {k: v for k, v in tensors.items() if not k.startswith(mods)} | quant
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(d, indent=2) + "\n")
    save_file({k: np.ascontiguousarray(v) for k, v in out.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    return dst


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
    ap.add_argument("--no-policy", action="store_true", help="skip the K-policy rows (batch 1 and batched)")
    ap.add_argument("--schedules", type=argtypes.choices_list("last", "cycle"), nargs="?", const=[],
                    default="last,cycle", metavar="NAME[,NAME]",
                    help="module schedules of the chains beyond M, exact mode (the option alone: no rows)")
    ap.add_argument("--schedule-drafts", type=argtypes.positive_int, default=5, metavar="K",
                    help="chains of k = M+1 .. K drafts under each module schedule (max_drafts=K)")
    ap.add_argument("--draft-vocabs", type=argtypes.positive_int, nargs="*", default=[32, 64, 128], metavar="N",
                    help="draft-vocabulary rows (k = M, exact mode): the N most frequent bytes of the training "
                         "data (the checkpoint's byte_counts.json) (none: no rows)")
    ap.add_argument("--no-fp8", action="store_true",
                    help="skip the FP8 row (the modules' projections quantized to FP8 E4M3, 128 x 128 blocks)")
    ap.add_argument("--batch", type=argtypes.nonnegative_int, default=8, metavar="B",
                    help="batched rows: B sequences (the prompts cycled), every fixed K and the K policy "
                         "(0: none)")
    ap.add_argument("--json", type=argtypes.output_file, default=None, metavar="PATH",
                    help="write every figure as JSON to PATH (default: not written)")
    ap.add_argument("--plot", type=argtypes.output_file, default=None, metavar="PATH",
                    help="draw acceptance per position of each row as a PNG (needs matplotlib) (default: not drawn)")


def _loader(be: Any, ckpt: Path, chain: str | None) -> Callable[..., Any]:
    from .proposer import MultiModuleMtpHead

    cache: dict[tuple, Any] = {}

    def load(kv_mode: str, src: Path | None = None, **kw: Any) -> Any:
        key = (kv_mode, str(src), tuple(sorted((k, str(v)) for k, v in kw.items())))
        if key not in cache:
            cache[key] = MultiModuleMtpHead.from_pretrained(src or ckpt, backend=be, kv_mode=kv_mode, chain=chain,
                                                            num_blocks=1024, **kw)
        return cache[key]
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
    for n in args.draft_vocabs:
        if not 1 <= n <= 256:
            raise ValueError(f"--draft-vocabs: expected sizes in [1, 256] (byte tokens), got {n}")
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

    def ready(prop: Any) -> Any:
        """``prop`` with its kernels compiled and one untimed short run (the cuda backend's first
        calls compile and capture; an FP8 drafter's kernels are not the BF16 one's), so that no
        row times a compilation."""
        warm_up(be, needs=KernelNeeds.of(prop))
        speculative_generate(target, prop, prompts[0], 2, prop.num_modules)
        return prop

    ready(first)
    greedy_generate(target, prompts[0], 2)
    tree_generate(target, first, prompts[0], 2, [2] * M)

    greedy, t_each = [], []
    for p in prompts:
        g, s = timed(lambda: greedy_generate(target, p, N))
        greedy.append(g.tokens)
        t_each.append(s)
    t_greedy = sum(t_each)
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
    print(f"  {'row':30s} {'acceptance per position':28s} {'drafts/v':>8s} {'tokens/v':>8s} "
          f"{'tokens/s':>9s} {'speedup':>7s}  lossless")
    for mode in args.kv_modes:
        prop = ready(load(mode))
        for k in range(1, M + 1):
            row("chain", mode, lambda p: speculative_generate(target, prop, p, N, k), k=k)
        for w in args.tree_widths:
            row("tree", mode, lambda p: tree_generate(target, prop, p, N, [w] * M), width=w, k=M)
    prop = load("exact")
    for c in args.min_confidence:
        row("early_stop", "exact", lambda p: speculative_generate(target, prop, p, N, M, min_confidence=c),
            k=M, min_confidence=c)
    notes = []
    D = args.schedule_drafts
    if args.schedules and D <= M:
        notes.append(f"schedule rows not run: --schedule-drafts {D} is not above the modules (M = {M})")
    for sched in args.schedules if D > M else []:
        sp = ready(load("exact", module_schedule=sched, max_drafts=D))
        for k in range(M + 1, D + 1):
            row("schedule", "exact", lambda p: speculative_generate(target, sp, p, N, k), k=k, schedule=sched,
                modules=list(sp.module_schedule))
    for n in args.draft_vocabs:
        ids = frequent_bytes(ckpt, n)
        if ids is None:
            notes.append(f"draft-vocabulary rows not run: no byte_counts.json beside {ckpt}")
            break
        vp = ready(load("exact", draft_vocab=ids))
        row("draft_vocab", "exact", lambda p: speculative_generate(target, vp, p, N, M), k=M, vocab=n)
    if not args.no_fp8:
        with tempfile.TemporaryDirectory(prefix="mtpkern-fp8-") as tmp:
            fp = ready(load("exact", src=fp8_copy(ckpt, Path(tmp))))
            row("fp8", "exact", lambda p: speculative_generate(target, fp, p, N, M), k=M)
    if "draft" in args.kv_modes:
        dp = ready(load("draft"))
        row("no_catchup", "draft", lambda p: speculative_generate(target, dp, p, N, M, catchup=False), k=M)
    policy, batched = None, None
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
    if not args.no_policy and args.batch:
        batched = _batched(args.batch, target, prop, prompts, greedy, t_each, N, M, (prop_pts, ver_pts, cat_pts),
                           rows)
    notes += ["tree rows: verified by their paths (one target forward per branch taken), so their tokens/s "
              "is not a tree-masked verify's; their acceptance is exact"]
    if batched:
        notes.append(f"batch {args.batch}: ReferenceTarget has no batched verify, so each sequence is verified in "
                     "turn and the verify's cost grows with B; propose and catch-up are batched")
    for n in notes:
        print(f"  note: {n}")
    out = {"checkpoint": str(ckpt), "chain": chain, "backend": be.describe(), "machine": machine(),
           "date": time.strftime("%Y-%m-%d", time.gmtime()), "prompts": len(prompts), "max_new_tokens": N,
           "num_modules": M, "greedy": base, "rows": rows, "k_policy": policy, "batched": batched, "notes": notes}
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2))
    if args.plot is not None:
        _plot(out, args.plot)
    return out


def _batched(B: int, target: Any, prop: Any, prompts: list, greedy: list, t_each: list, N: int, M: int,
             pts1: tuple, rows: list) -> dict:
    """The batched rows: ``B`` sequences (``prompts`` cycled) by ``speculative_generate_batch``,
    every fixed ``K = 1 .. M`` and the K policy (``choose_k`` with ``batch_size = B`` each step, one
    K for the batch, from costs measured at batch 1 and ``B``); ``K = 0`` is greedy decoding of the
    ``B`` sequences one after another (``ReferenceTarget`` decodes one sequence at a time)."""
    from .k_policy import StepCosts, acceptance_from_counts, choose_k
    from .loop import speculative_generate_batch

    ps = [prompts[i % len(prompts)] for i in range(B)]
    want = [greedy[i % len(prompts)] for i in range(B)]
    t_greedy = sum(t_each[i % len(prompts)] for i in range(B))
    pb, vb, cb = measure_costs_batch(target, prop, ps, M)
    costs = StepCosts.from_points(pts1[0] + pb, pts1[1] + vb, catchup=pts1[2] + cb) if B > 1 else \
        StepCosts.from_points(*pts1[:2], catchup=pts1[2])
    print(f"  batch {B} ({len(prompts)} prompts cycled; the target verifies each sequence in turn): costs at B = {B} "
          "(median of 3 steps): propose " + ", ".join(f"k={k} {s * 1e3:.2f} ms" for _, k, s in pb) + "; verify "
          + ", ".join(f"n={n} {s * 1e3:.2f} ms" for _, n, s in vb) + "; catch-up "
          + ", ".join(f"n={n} {s * 1e3:.2f} ms" for _, n, s in cb))

    def brow(kind: str, k_of: Any, **what: Any) -> dict:
        outs, secs = timed(lambda: speculative_generate_batch(target, prop, ps, N, k_of))
        r = {"kind": kind, "kv_mode": "exact", "batch": B, **what, **figures(merged([o.decisions for o in outs])),
             "lossless": all(o.tokens == w for o, w in zip(outs, want)),
             "tokens_per_s": round(B * N / secs, 1), "seconds": round(secs, 4), "speedup": round(t_greedy / secs, 3)}
        rows.append(r)
        _print_row(r)
        return r

    fixed = {0: round(B * N / t_greedy, 1)}
    for k in range(1, M + 1):
        fixed[k] = brow("batch_chain", k, k=k)["tokens_per_s"]
    runs = []
    for prior, optimism in POLICY_RUNS:
        chosen: list[int] = []

        def pick(dec: Any, prior: tuple = prior, z: float = optimism, chosen: list = chosen) -> int:
            acc, reached = policy_counts(dec, M)
            k = choose_k(acceptance_from_counts(acc, reached, M, prior, z), costs, M, batch_size=B).k
            chosen.append(k)
            return k

        r = brow("batch_k_policy", pick, k=M, prior=list(prior), optimism=optimism)
        counts = {str(k): chosen.count(k) for k in sorted(set(chosen))}
        runs.append({"prior": list(prior), "optimism": optimism, "chosen_k_counts": counts,
                     "tokens_per_s": r["tokens_per_s"]})
        print(f"  K policy at batch {B}, prior {prior}, optimism {optimism:g}: chose k (steps) {counts}; "
              f"{r['tokens_per_s']:.1f} tokens/s against " + ", ".join(f"K={k}: {v:.1f}" for k, v in fixed.items())
              + " (K=0: greedy, one sequence after another)")
    return {"batch": B, "propose_s": [[k, round(s, 6)] for _, k, s in pb],
            "verify_s": [[n, round(s, 6)] for _, n, s in vb], "catchup_s": [[n, round(s, 6)] for _, n, s in cb],
            "fixed_k_tokens_per_s": fixed, "runs": runs}


def _label(r: dict) -> str:
    if r["kind"] == "chain":
        return f"chain k={r['k']} {r['kv_mode']}"
    if r["kind"] == "schedule":
        return f"chain k={r['k']} {r['schedule']}"
    if r["kind"] == "draft_vocab":
        return f"chain k={r['k']} vocab {r['vocab']}"
    if r["kind"] == "fp8":
        return f"chain k={r['k']} FP8"
    if r["kind"] == "no_catchup":
        return f"chain k={r['k']} draft, no catch-up"
    if r["kind"] == "batch_chain":
        return f"batch {r['batch']} K={r['k']}"
    if r["kind"] == "batch_k_policy":
        return f"batch {r['batch']} policy {tuple(r['prior'])} z={r['optimism']:g}"
    if r["kind"] == "tree":
        return f"tree w={r['width']} {r['kv_mode']}"
    if r["kind"] == "early_stop":
        return f"early stop c={r['min_confidence']:g}"
    return f"K policy {tuple(r['prior'])} z={r['optimism']:g}"


def _print_row(r: dict) -> None:
    acc = " ".join(f"{a:.2f}" for a in r["acceptance_per_position"]) or "-"
    print(f"  {_label(r):30s} {acc:28s} {r['drafts_per_verify']:8.2f} {r['tokens_per_verify']:8.2f} "
          f"{r['tokens_per_s']:9.1f} {r['speedup']:7.2f}  {'yes' if r['lossless'] else 'NO'}")


def _plot(out: dict, path: os.PathLike) -> None:
    from .bench import require_matplotlib

    plt = require_matplotlib()
    fig, ax = plt.subplots(figsize=(7, 4))
    longest = max([r["k"] for r in out["rows"] if r["kind"] == "schedule"], default=out["num_modules"])
    for r in out["rows"]:
        if (r["kind"] in ("chain", "tree", "fp8", "no_catchup") and r["k"] == out["num_modules"]) or \
                (r["kind"] == "schedule" and r["k"] == longest):
            acc = r["acceptance_per_position"]
            ax.plot(range(len(acc)), acc, marker="o", label=_label(r))
    ax.set_xticks(range(longest))
    ax.set_xlabel("draft position j")
    ax.set_ylabel("accepted / offered")
    ax.set_title(f"acceptance per position, {out['prompts']} held-out prompts x {out['max_new_tokens']} tokens")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
