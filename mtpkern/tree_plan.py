"""Draft trees in the planned step (docs/cuda.md, "Draft trees in the planned step").

A tree whose node layout does not depend on its tokens (fixed ``widths`` or a static
``shape``, no grammar mask) launches the same kernels on the same shapes every call of
one (trees, batch, KV mode, block-table widths): which rows each module computes, which
parent row feeds each, which lines start where and which blocks they copy follow from the
shape and the sequences' row counts, never from the drafted tokens. ``TreePlan`` is a
``StepPlan`` (mtpkern.cuda_graph: the same staging, segment tables, buffers and
capture / replay) whose rows are a tree's. Per call, ``TreeSteps.propose``:

1. the skeleton (``_skeleton``): the tree's nodes with placeholder tokens, laid out as the
   eager path lays them (``TreeRunner.elems``; each drafting row's top-c children by rank);
2. host bookkeeping, as the eager path does it: every module's lines, blocks, keys and
   copy-on-write slots (``TreeRunner.layout``), all before the first launch;
3. staging: each module's rows (tokens of the root, positions, slots, row lengths, one
   padded block table per row), the addresses of the staged inputs (``h_{P-1}``, exact
   mode's window rows), and the copy-on-write copies as segment-table rows (one per KV plane
   and copied row; a tree's line heads copy at most ``block_size - 1`` rows each, the rest
   of that capacity is zero-word rows); one H2D copy;
4. the launches, per module: a segment launch gathers each row's ``g`` (module m-1's output
   at the row of the node's parent) and each node's token (its parent's top-c output at its
   rank) into the module's buffers; the forward, the copy-on-write segment launch between
   its KV write and its attention (``MtpHead.compute(kv_copy=)``); a segment launch gathers
   the drafting rows' normed outputs and the LM head writes their top-c ids and
   probabilities into one output buffer (``lm_head_topk(out=, probs=, logits=,
   check=False)``);
5. one D2H copy of that buffer (every depth's ids, then their probabilities); the nodes get
   their tokens, probabilities and scores as the eager path's ``TreeJob.add`` gives them,
   exact mode's chained outputs are copied out of the plan's buffers, and the state is left
   as a chain along the main line (``TreeRunner.as_chain``).

A row with fewer than ``c`` candidates would change the tree's shape: the planned step
raises ``NoAllowedToken`` for it (the call rolls back) where the eager path would draft
fewer children; without a grammar mask that needs NaN logits or ``c`` above the vocabulary
(which ``TreeSteps.applies`` sends eagerly).

Every block kind the chain's plan takes is planned (GQA and MLA, DSA, sliding windows and
sinks, output gates, DeepSeek-V4's attention, hyper-connections: ``stream_size``-wide ``g``
rows, each row's position-0 flag once per stream; the windows' first visible rows staged).
``TreeSteps.applies`` sends eagerly (counted in the runner's ``counts``): grammar masks
(``tree_fallback_mask``), a sharded head (``tree_fallback_sharded``), a backend other than
numpy / cuda or an FP8 KV cache (``tree_fallback_backend``), a width above the LM head's
vocabulary (``tree_fallback_width``), KV rows that are no whole 4-byte words
(``tree_fallback_kv_rows``), and exact mode's row-count fallbacks of the chain
(``StepRunner.applies``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import numpy as np

from .config import EMBED_MASK_POSITION
from .cuda_graph import SEG_FIELDS, StepPlan, StepRunner, address, staged_vocab
from .errors import NoAllowedToken, no_token_reason
from .head import table_width
from .tree import DraftTree, PendingTree, TreeJob, TreeRunner


@dataclass(frozen=True, slots=True)
class TreeShape:
    """What fixes the launches of a planned tree step (the plan / graph cache key, beside the
    chain's ``StepShape`` in one cache)."""

    B: int
    k: int                                      # the deepest tree's depth
    trees: tuple[tuple[tuple[int, ...], ...], ...]   # per sequence: its nodes' paths of child ranks, in order
    widths: tuple[int, ...]                     # module m's padded block-table width (0: it does not run)
    masked: bool = False                        # (StepPlan's fields: trees take no mask, no confidences)
    conf: bool = False


@dataclass(slots=True)
class _Skeleton:
    """A batch's trees before their tokens: per module ``m`` (``parts[m]``: (sequence,
    elements) as the forward lays them out) every row's (sequence, element), where its ``g``
    comes from (``g_from``: -1 staged, else a row of module m-1) and its token (``tok_from``:
    None staged, else (module, drafting row, rank) of the LM head output that drafted it),
    the drafting rows (sequence, element, children) in LM-head order, the lines' heads."""

    parts: dict[int, list[tuple[int, list[int]]]]
    rows: dict[int, list[tuple[int, int]]]
    g_from: dict[int, list[int]]
    tok_from: dict[int, list[tuple[int, int, int] | None]]
    draft: dict[int, list[tuple[int, int, int]]]
    heads: dict[int, int]


def _skeleton(trees: TreeRunner, jobs: list[TreeJob]) -> _Skeleton:
    """The jobs' nodes added with placeholder tokens (TreeRunner.propose's order), and the
    rows every module computes."""
    sk = _Skeleton({}, {}, {}, {}, {}, {})
    where: dict[tuple[int, int], tuple[int, int, int]] = {}     # (b, node) -> its token's source
    prev: dict[tuple[int, int], int] = {}
    for m in range(trees.M if trees.exact else max(j.D for j in jobs)):
        parts, rows, g_from, tok_from, heads, index = [], [], [], [], 0, {}
        for b, j in enumerate(jobs):
            if not (trees.exact or m < j.D):
                continue
            elems = trees.elems(m, j.P, j.D, j.depths)
            if not elems:
                continue
            parts.append((b, elems))
            local = {e: i for i, e in enumerate(elems)}
            taken: set = set()
            for e in elems:
                p = None if not trees.exact or e < 0 else local.get(j.parents[e])
                if p in taken:                   # a line head (TreeRunner.layout's rule)
                    heads += 1
                taken.add(p)
                index[(b, e)] = len(rows)
                rows.append((b, e))
                g_from.append(-1 if m == 0 or e < 0 else prev[(b, j.parents[e])])
                tok_from.append(None if e < 0 else where[(b, e)])
        draft = []
        for b, elems in parts:                  # TreeRunner._expand: the rows of depth m - 1 draft
            j = jobs[b]
            for e in elems if m < j.D else ():
                if (j.depths[e] if e >= 0 else -1) == m - 1:
                    c = j.widths[m] if j.widths is not None else j.counts.get(() if e < 0 else j.ranks[e], 0)
                    if c:
                        draft.append((b, e, c))
        for r, (b, e, c) in enumerate(draft):
            j = jobs[b]
            first = len(j.tokens)
            j.add(e, m, np.zeros(c, np.int32), np.ones(c, np.float32))
            for rank in range(c):
                where[(b, first + rank)] = (m, r, rank)
        if parts:
            sk.parts[m], sk.rows[m], sk.g_from[m], sk.tok_from[m] = parts, rows, g_from, tok_from
            sk.draft[m], sk.heads[m] = draft, heads
        prev = index
    return sk


def _plane_row_bytes(c: Any) -> int:
    """Bytes of one slot's row of a KV plane ``[num_blocks, block_size, ...]`` (contiguous)."""
    return c.nbytes // (c.shape[0] * c.shape[1])


class TreePlan(StepPlan):
    """Persistent buffers, staging and launches of one ``TreeShape`` (module docstring)."""

    def __init__(self, prop: Any, shape: TreeShape, sk: _Skeleton, attention_workspace: Any = None):
        self.sk = sk
        self.planes = {m: prop.modules[m].pool.planes() for m in sk.rows}
        super().__init__(prop, shape, attention_workspace)
        for m in self.run:                      # the caches the copy-on-write segments touch
            self._ranges += [(address(c), c.nbytes) for c in self.planes[m]]

    # -- StepPlan's hooks --------------------------------------------------------------------
    def _rows(self) -> tuple[dict[int, int], dict[int, int], bool]:
        self.run = sorted(self.sk.rows)
        n = {m: len(self.sk.rows[m]) for m in self.run}
        self.tab_rows = dict(n)                 # every row its own block table
        return n, dict(n), False

    def _feed_segments(self, n: dict[int, int], nout: dict[int, int], picked: bool) -> int:
        """Per module: [f0, f1) g rows, then the nodes' tokens; [f1, f2) copy-on-write rows;
        [f2, f3) the drafting rows -> the LM head's input (``seg_rows``)."""
        BS = self.prop.block_size
        self.seg_rows = {}
        s = 0
        for m in self.run:
            f0 = s
            s += n[m] + sum(t is not None for t in self.sk.tok_from[m])
            f1 = s
            s += self.sk.heads[m] * (BS - 1) * len(self.planes[m])
            f2 = s
            s += len(self.sk.draft[m])
            self.seg_rows[m] = (f0, f1, f2, s)
        return s

    def _staged_tokens(self, m: int) -> bool:
        return True

    def _tokens(self, m: int) -> Any:
        return self.stage.d(f"tok{m}")

    def _g(self, m: int) -> Any:
        return self.g[m]

    def _lm_buffers(self, buf: Callable[..., Any]) -> None:
        """Every drafting module's top-c ids [n_d, c] and probabilities, views of one int32
        buffer (ids first, then the probabilities' bits: one D2H copy), its input rows and
        logits."""
        H = self.prop.config.hidden_size
        self.sharded, self.conf, self.last = False, None, None
        self.topk = {m: max(c for _, _, c in self.sk.draft[m]) for m in self.run if self.sk.draft[m]}
        sizes = {m: len(self.sk.draft[m]) * c for m, c in self.topk.items()}
        total = sum(sizes.values())
        self.out = buf((2 * total,), np.int32)
        self.tids, self.tprobs, self.lmx = {}, {}, {}
        off = 0
        for m, c in self.topk.items():
            nd = len(self.sk.draft[m])
            self.tids[m] = self.out[off: off + nd * c].reshape(nd, c)
            self.tprobs[m] = self.out[total + off: total + off + nd * c].view(np.float32).reshape(nd, c)
            self.lmx[m] = buf((nd, H))
            off += nd * c
        self.logits = buf((max(len(self.sk.draft[m]) * self.prop.modules[m].w.head.shape[0] for m in self.topk),))

    def _lm_workspace(self, buf: Callable[..., Any], P: int) -> dict[str, Any]:
        return {}

    def _fill_static_segments(self) -> None:
        """The rows whose addresses never change: module m-1's outputs into g, the drafting
        output's ids into the tokens, the drafting rows into the LM head's input; zero-word
        rows where the call's addresses go (staged sources, copy-on-write)."""
        S, H = self.prop.config.stream_size, self.prop.config.hidden_size
        T = self.stage.h("seg").reshape(-1, SEG_FIELDS)
        idle = address(self.stage.dev)
        for m in self.run:
            f0, f1, f2, _ = self.seg_rows[m]
            g, tok = address(self.g[m]), address(self.stage.d(f"tok{m}"))
            s = f0
            for i, src in enumerate(self.sk.g_from[m]):          # -1: the call stages the source
                T[s] = (0 if src < 0 else address(self.chain(m - 1)) + 4 * src * S, g + 4 * i * S, S)
                s += 1
            for i, ts in enumerate(self.sk.tok_from[m]):
                if ts is not None:
                    d, r, rank = ts
                    T[s] = (address(self.tids[d]) + 4 * (r * self.topk[d] + rank), tok + 4 * i, 1)
                    s += 1
            T[f1:f2] = (idle, idle, 0)
            normed = address(self.normed[m])
            row = {e: i for i, e in enumerate(self.sk.rows[m])}
            for r, (b, e, _) in enumerate(self.sk.draft[m]):
                T[f2 + r] = (normed + 4 * row[(b, e)] * H, address(self.lmx[m]) + 4 * r * H, H)
        for m in self.run:
            self._fill_copies(T, m)

    def _launches(self, lm_ws: dict) -> list[Callable[[], Any]]:
        out: list[Callable[[], Any]] = []
        stg = self.stage
        seg = stg.d("seg").reshape(-1, SEG_FIELDS)
        n = {m: len(self.sk.rows[m]) for m in self.run}
        for m in self.run:
            head = self.prop.modules[m]
            f0, f1, f2, f3 = self.seg_rows[m]
            out.append(partial(self._segments, seg[f0:f1]))
            cow = partial(self._segments, seg[f1:f2]) if f2 > f1 else None
            out.append(partial(head.compute, stg.d(f"tok{m}"), self.g[m], stg.d(f"pos{m}"), stg.d(f"slot{m}"),
                               stg.d(f"tab{m}").reshape(n[m], self.shape.widths[m]), stg.d(f"rseq{m}"),
                               stg.d(f"rlen{m}"), self.bufs[m],
                               stg.d(f"rst{m}") if head.block.sliding_window else None, kv_copy=cow,
                               zero_embed=stg.d(f"zero{m}") if head.config.embed_mask_pos0 else None))
            if m in self.topk:
                nd = len(self.sk.draft[m])
                out.append(partial(self._segments, seg[f2:f3]))
                out.append(partial(self.backend.lm_head_topk, self.lmx[m], head.w.head, None, self.topk[m],
                                   out=self.tids[m], probs=self.tprobs[m],
                                   logits=self.logits[:nd * head.w.head.shape[0]].reshape(nd, -1), check=False,
                                   **head._lm_kw))
        return out

    # -- per call ------------------------------------------------------------------------------
    def stage_tree(self, laid: dict[int, list[Any]], jobs: list[TreeJob], hid: Any) -> None:
        """The call's data: each module's rows (``laid[m]``: TreeRunner.layout's, in row order),
        the staged sources' addresses, the copy-on-write copies."""
        stg, sk, BS = self.stage, self.sk, self.prop.block_size
        S = self.prop.config.stream_size
        T = stg.h("seg").reshape(-1, SEG_FIELDS)
        self._call_ranges, self._keep = [], []
        for m in self.run:
            rs = laid[m]

            def cat(f: str) -> np.ndarray:
                return np.concatenate([np.asarray(getattr(r, f), np.int32) for r in rs])

            n, W = len(sk.rows[m]), self.shape.widths[m]
            positions = cat("positions")
            stg.h(f"tok{m}")[:] = cat("toks")           # the root's; the nodes' come from the graph
            stg.h(f"pos{m}")[:] = positions
            stg.h(f"slot{m}")[:] = cat("slots")
            stg.h(f"rseq{m}")[:] = np.arange(n, dtype=np.int32)
            stg.h(f"rlen{m}")[:] = cat("row_len")
            if self.prop.config.embed_mask_pos0:        # each row's flag once per stream (hyper-connections)
                stg.h(f"zero{m}")[:] = np.repeat(positions == EMBED_MASK_POSITION, self.prop.config.hc_mult)
            if self.prop.modules[m].block.sliding_window:
                stg.h(f"rst{m}")[:] = cat("row_start")
            tab = stg.h(f"tab{m}").reshape(n, W)
            tab[:] = 0
            for i, t in enumerate(t for r in rs for t in r.tables):
                tab[i, :len(t)] = t
            f0, f1, f2, _ = self.seg_rows[m]
            for i, ((b, _), src) in enumerate(zip(sk.rows[m], sk.g_from[m])):
                if src >= 0:
                    continue
                if m == 0:
                    a, row = hid, b
                else:                                   # exact mode's root: module m-1's window row
                    st, key = jobs[b].st, jobs[b].P - 1 - m
                    a, row = st._win[m - 1], key - st._win_start[m - 1]
                self.stage_source(T, f0 + i, a, row, S, f"module {m} row {i}")
            src, dst = cat("src"), cat("dst")
            cap = f2 - f1
            rows = [(address(c) + int(a) * _plane_row_bytes(c), address(c) + int(d) * _plane_row_bytes(c),
                     _plane_row_bytes(c) // 4) for c in self.planes[m] for a, d in zip(src.tolist(), dst.tolist())]
            if len(rows) > cap:
                raise AssertionError(f"module {m}: {len(rows)} copy-on-write rows, {cap} planned "
                                     f"({sk.heads[m]} line heads of at most {BS - 1} rows)")
            idle = address(stg.dev)
            T[f1:f2] = (idle, idle, 0)
            if rows:
                T[f1:f1 + len(rows)] = rows

    def read_tree(self) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """{module: ([n_d, c] ids, [n_d, c] probabilities)} on the host: the step's one
        device-to-host copy, then a synchronisation."""
        host = self._to_host("out", self.out)
        if self.cuda:
            from .cuda_graph import _cupy

            _cupy().cuda.get_current_stream().synchronize()
        self._keep = []
        host = np.array(host, copy=True)
        total = host.size // 2
        out, off = {}, 0
        for m, c in self.topk.items():
            nd = len(self.sk.draft[m])
            out[m] = (host[off: off + nd * c].reshape(nd, c),
                      host[total + off: total + off + nd * c].view(np.float32).reshape(nd, c))
            off += nd * c
        return out


class TreeSteps:
    """The planned tree step of a ``StepRunner`` (``tree_steps``): its plans in the runner's
    cache, its counts in ``runner.counts`` prefixed ``tree_``."""

    def __init__(self, runner: StepRunner):
        self.runner = runner
        self.prop = runner.prop

    def applies(self, sts: list, poss: list[int], shapes: list, masked: bool) -> bool:
        """Whether this call can take the planned tree step (module docstring)."""
        prop, counts = self.prop, self.runner.counts
        be = prop.backend
        reason = None
        if masked:
            reason = "mask"
        elif prop.comm is not None:
            reason = "sharded"
        elif be.name not in ("numpy", "cuda") or getattr(be, "kv_fp8", False):
            reason = "backend"
        elif any(c > self._vocab() for ws, counts_, _ in shapes
                 for c in (ws if ws is not None else counts_.values())):
            reason = "width"
        elif any(_plane_row_bytes(c) % 4 for h in prop.modules for c in h.pool.planes()):
            reason = "kv_rows"
        if reason is not None:
            counts[f"tree_fallback_{reason}"] += 1
            return False
        if prop.kv_mode == "exact":
            return self.runner.applies(sts, poss, max(D for _, _, D in shapes))
        return True

    def _vocab(self) -> int:
        vocab = staged_vocab(self.prop)
        return self.prop.config.vocab_size if vocab is None else vocab.size

    def propose(self, jobs: list[TreeJob], hid: Any) -> list[DraftTree]:
        """``TreeRunner.propose`` for trees of static shapes without masks, planned; the same
        trees, state changes and KV. One planned step runs at a time (the runner's lock)."""
        with self.runner._lock:
            return self._propose(jobs, hid)

    def _propose(self, jobs: list[TreeJob], hid: Any) -> list[DraftTree]:
        prop, trees, runner = self.prop, self.prop.trees, self.runner
        B = len(jobs)
        for j in jobs:
            st = j.st
            j.pending = PendingTree(None, [None] * trees.M, list(st._win), list(st._win_start), list(st._tail),
                                    st._tail_start)
        try:
            sk = _skeleton(trees, jobs)
            laid = {m: [trees.layout(jobs[b], m, elems) for b, elems in parts] for m, parts in sk.parts.items()}
            M = trees.M
            widths = tuple(table_width(max(len(t) for r in laid[m] for t in r.tables)) if m in laid else 0
                           for m in range(M))
            shape = TreeShape(B, max(j.D for j in jobs), tuple(tuple(j.ranks) for j in jobs), widths)
            plan = runner.plan_for(shape, lambda: TreePlan(prop, shape, sk, runner.attention_workspace), "tree_")
            hid = prop.backend.xp.ascontiguousarray(hid, dtype=np.float32).reshape(B, prop.config.stream_size)
            plan.wait_staging()
            plan.stage_tree(laid, jobs, hid)
            plan.upload()
            runner.run_plan(plan, "tree_")
            got = plan.read_tree()
            self._nodes(jobs, sk, got)
            for m, parts in sk.parts.items():             # exact mode: the chained outputs the state keeps
                off = 0
                for b, elems in parts:
                    mt = jobs[b].pending.modules[m]
                    mt.outs = plan.chain(m)[off: off + len(elems)].copy() if trees.exact and m < M - 1 else None
                    off += len(elems)
            return trees.finish(jobs)
        except BaseException:
            trees.drop_all(jobs)
            raise

    def _nodes(self, jobs: list[TreeJob], sk: _Skeleton, got: dict) -> None:
        """The nodes again, in the skeleton's order, with the drafted tokens and probabilities."""
        for j in jobs:
            for f in (j.tokens, j.parents, j.depths, j.probs, j.scores, j.ranks):
                f.clear()
        for m, draft in sk.draft.items():
            if not draft:                       # exact mode's modules past the deepest depth draft nothing
                continue
            ids, probs = got[m]
            for r, (b, e, c) in enumerate(draft):
                if (ids[r, :c] < 0).any():
                    raise NoAllowedToken(f"states[{b}], depth {m}: a planned tree needs {c} candidates per node: "
                                         f"{no_token_reason(False, self._vocab())}", row=b, draft=m)
                jobs[b].add(e, m, ids[r, :c], probs[r, :c])


def tree_steps(runner: StepRunner) -> TreeSteps:
    """The runner's planned tree step (made on first use, kept on the runner)."""
    if runner.trees is None:
        runner.trees = TreeSteps(runner)
    return runner.trees
