"""Draft trees (``MultiModuleMtpHead.propose_tree`` / ``after_verify_tree``).

**The tree.** A propose at ``P`` (``t_P`` the root) drafts depth ``d`` with draft step
``d``'s module: each node of depth ``d - 1`` (the root for ``d = 0``) is one row of that
module, and its top-``c`` tokens become its children (``c``: ``widths[d]``, or the static
shape's count for that node). All rows of one depth are one forward of their module.
Module ``m``'s row for a node ``x`` is built from ``(x's token, module m-1's output at the
row of x's parent)``, as a chain builds module ``m``'s row from ``(d_{m-1}, module m-1's
output)``: each root-to-node path is the chain forced along it.

**Layout** (``DraftTree``): ``N`` nodes in breadth-first order (depth by depth; within a
depth by parent, then by rank: probability descending, ties to the lower id), so a
parent always comes before its children and ``parents`` never decreases. ``tokens``
[N] int32, ``parents`` [N] int32 (``-1``: a child of the root ``t_P``), ``depths`` [N],
``probs`` [N] (the probability the node's module gave it, the confidence rule of
mtpkern.ops.lm_head), ``scores`` [N] (the sum of the log-probabilities along its path).
Node ``i`` is a candidate for ``t_{P+1+depths[i]}``; ``ancestor_mask()`` gives the tree
attention mask a verify builds ([N+1, N+1] with the root first).

**KV.** Every row a tree needs is computed once; rows of one module at one key (siblings)
cannot share a slot, so a row's KV context is its own path: the sequence's rows, then its
ancestors' rows in that module, then itself. A row continues the line of its parent (the
first child does) or starts a new *line*: a block of its own that begins at its path's
last block boundary, whose first rows are copies of that partial block (copy-on-write,
written once the forward's rows are, before any row attends: ``MtpHead.compute(kv_copy=)``);
the blocks before it are shared through the row's block table. The main line (the rank-0
path, the greedy chain) lives in the state's own sequence, as a chain propose would write
it; the other lines' blocks belong to one scratch sequence per module, held by the state
until ``after_verify_tree``. That call keeps exactly the accepted path's rows: in every
module the rows a chain propose forced along the path keeps (draft mode: module ``m``'s
row of the path's node ``m - 1`` iff ``m <= a``; exact mode: the exact-mode rule's rows),
copies those off the main line into the sequence, and frees every other row at once.
The state is then the state of a chain propose along the accepted path after its verify.

**Batches** (``propose_tree_batch``): one ``TreeJob`` per sequence; at each depth every
sequence's rows of a module are laid out as above (``layout``: lines, blocks, copy-on-write,
per sequence) and concatenated into one forward, sequence after sequence, each row with its
own block table; one LM-head top-c serves every sequence's drafting rows. A single
``propose_tree`` is a batch of one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .argtypes import int_sequence
from .exact import ExactChain, exact_rows
from .head import MtpHead
from .ops.lm_head import MAX_TOPK
from .state import MtpState

#: the most nodes one tree may hold (every row of a depth is one forward)
MAX_TREE_NODES = 1024


@dataclass(frozen=True)
class DraftTree:
    """A propose_tree's drafts (module docstring, "Layout")."""

    position: int
    root_token: int
    tokens: np.ndarray
    parents: np.ndarray
    depths: np.ndarray
    probs: np.ndarray
    scores: np.ndarray

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def depth(self) -> int:
        """Depths drafted (the longest path's length)."""
        return int(self.depths.max()) + 1 if len(self) else 0

    def path(self, node: int) -> list[int]:
        """Node indices from depth 0 down to ``node``."""
        out = []
        i = int(node)
        while i >= 0:
            out.append(i)
            i = int(self.parents[i])
        return out[::-1]

    def path_tokens(self, node: int) -> list[int]:
        return [int(self.tokens[i]) for i in self.path(node)]

    def children(self, node: int) -> list[int]:
        """The children of ``node`` (-1: of the root), by rank."""
        return [int(i) for i in np.flatnonzero(self.parents == node)]

    def greedy_path(self) -> list[int]:
        """The rank-0 path from depth 0 down (the greedy chain), node indices."""
        out, e = [], -1
        while True:
            kids = self.children(e)
            if not kids:
                return out
            e = kids[0]
            out.append(e)

    def leaves(self) -> list[int]:
        has_child = np.zeros(len(self), bool)
        has_child[self.parents[self.parents >= 0]] = True
        return [int(i) for i in np.flatnonzero(~has_child)]

    def positions(self) -> np.ndarray:
        """[N + 1] int32: the root's position P, then each node's ``P + 1 + depth``."""
        return np.concatenate([[self.position], self.position + 1 + self.depths]).astype(np.int32)

    def ancestor_mask(self) -> np.ndarray:
        """[N + 1, N + 1] bool, the root first: entry ``[i, j]`` is True iff ``j`` is ``i`` or
        an ancestor of ``i`` (what row ``i`` of a tree verify attends to, past the prefix)."""
        N = len(self)
        mask = np.eye(N + 1, dtype=bool)
        mask[:, 0] = True
        for i in range(N):                      # parents come first: their rows are complete
            p = int(self.parents[i])
            mask[i + 1] |= mask[p + 1] if p >= 0 else mask[0]
        return mask


def check_shape(widths: Any, shape: Any, depth_max: int, names: tuple[str, str] = ("widths", "shape")
                ) -> tuple[list[int] | None, dict | None, int]:
    """``widths`` (children per node at each depth) or ``shape`` (a static tree: paths of child
    ranks) -> (widths, children count per node path, depth). ``names``: the arguments' names in
    errors (a batch's ``widths[i]``)."""
    try:
        return _check_shape(widths, shape, depth_max)
    except (TypeError, ValueError) as e:
        msg = str(e)
        for plain, name in zip(("widths", "shape"), names):
            if name != plain and msg.startswith(plain):
                msg = name + msg[len(plain):]
        if msg == str(e):
            raise
        raise type(e)(msg) from None


def check_shapes(widths: Any, shape: Any, depth_max: int, B: int) -> list[tuple[list[int] | None, dict | None, int]]:
    """A batch's ``widths`` / ``shape``: one for every sequence, or a list of ``B`` (one per
    sequence: ``widths`` a list of lists of ints, ``shape`` a list of lists of paths) ->
    ``check_shape``'s result per sequence."""
    def per_sequence(v: Any, depth: int) -> bool:
        """A list whose entries are lists nested ``depth`` deep (one tree's ``widths``: ints)."""
        def nested(x: Any, d: int) -> bool:
            if d == 0:
                return True
            if isinstance(x, np.ndarray):
                return x.ndim >= d and x.size > 0           # a 0-d array is an int (docs/api.md, "Integers")
            return isinstance(x, (list, tuple)) and len(x) > 0 and all(nested(y, d - 1) for y in x)
        return nested(v, depth + 1)

    if (widths is None) == (shape is None):
        raise ValueError("widths, shape: expected exactly one of them (children per depth, or a static tree)")
    name, v, depth = ("widths", widths, 1) if widths is not None else ("shape", shape, 2)
    if not per_sequence(v, depth):
        one = check_shape(widths, shape, depth_max)
        return [one] * B
    if len(v) != B:
        raise ValueError(f"{name}: expected one for all states or a list of {B} (one per state), "
                         f"got a list of {len(v)}")
    return [check_shape(x if name == "widths" else None, x if name == "shape" else None, depth_max,
                        (f"widths[{i}]", f"shape[{i}]")) for i, x in enumerate(v)]


def _check_shape(widths: Any, shape: Any, depth_max: int) -> tuple[list[int] | None, dict | None, int]:
    if (widths is None) == (shape is None):
        raise ValueError("widths, shape: expected exactly one of them (children per depth, or a static tree)")
    if widths is not None:
        what = "a non-empty list of ints (children per node at each depth)"
        ws = [int(w) for w in int_sequence(
            "widths", widths, 1, MAX_TOPK, noun="width", nouns="widths", what=what,
            out_of_range=lambda d, w: f"widths[{d}]: expected an int in [1, {MAX_TOPK}], got {w}")]
        if not ws:
            raise ValueError(f"widths: expected {what}, got none")
        if len(ws) > depth_max:
            raise ValueError(f"widths: expected at most {depth_max} depths (the draft steps: num_modules), "
                             f"got {len(ws)}")
        if sum(math.prod(ws[:d + 1]) for d in range(len(ws))) > MAX_TREE_NODES:
            raise ValueError(f"widths: a tree of {ws} holds more than {MAX_TREE_NODES} nodes")
        return ws, None, len(ws)
    if isinstance(shape, np.ndarray) and shape.ndim == 2:
        shape = list(shape)                     # equal-length paths as the rows of an integer array
    if isinstance(shape, (str, bytes)) or not isinstance(shape, (list, tuple)) or not shape:
        raise (ValueError if isinstance(shape, (list, tuple)) else TypeError)(
            f"shape: expected a non-empty list of paths of child ranks, e.g. [[0], [1], [0, 0]], got {shape!r}")
    paths = set()
    for i, p in enumerate(shape):
        ranks = int_sequence(f"shape[{i}]", p, 0, MAX_TOPK - 1, noun="child rank", nouns="child ranks",
                             what=f"a non-empty list of child ranks in [0, {MAX_TOPK})",
                             out_of_range=lambda j, r, i=i: f"shape[{i}][{j}]: expected a child rank in "
                                                            f"[0, {MAX_TOPK}), got {r}")
        if not ranks.size:
            raise ValueError(f"shape[{i}]: expected a non-empty list of child ranks in [0, {MAX_TOPK}), got none")
        t = tuple(int(r) for r in ranks)
        if t in paths:
            raise ValueError(f"shape[{i}]: {list(t)} appears twice")
        paths.add(t)
    if len(paths) > MAX_TREE_NODES:
        raise ValueError(f"shape: expected at most {MAX_TREE_NODES} nodes, got {len(paths)}")
    for t in sorted(paths):
        if len(t) > 1 and t[:-1] not in paths:
            raise ValueError(f"shape: {list(t)} is listed without its parent {list(t[:-1])}")
        if t[-1] > 0 and t[:-1] + (t[-1] - 1,) not in paths:
            raise ValueError(f"shape: {list(t)} is listed without its elder sibling {list(t[:-1] + (t[-1] - 1,))} "
                             f"(a node's children are its top-c tokens, ranks 0 .. c-1)")
    depth = max(len(t) for t in paths)
    if depth > depth_max:
        raise ValueError(f"shape: expected at most {depth_max} depths (the draft steps: num_modules), got {depth}")
    if (0,) * depth not in paths:
        raise ValueError(f"shape: the rank-0 path {[0] * depth} must reach the deepest depth ({depth}): it is the "
                         f"greedy chain the sequence's own rows hold")
    counts: dict[tuple, int] = {}
    for t in paths:
        counts[t[:-1]] = max(counts.get(t[:-1], 0), t[-1] + 1)
    return None, counts, depth


@dataclass(slots=True)
class _Line:
    """A run of logical rows of one module's tree: ``prefix`` block ids before ``start``
    (logical block index of the line's own first block), ``own`` its block ids."""

    prefix: list[int]
    start: int
    own: list[int] = field(default_factory=list)


@dataclass(slots=True)
class ModuleTree:
    """One module's tree rows: ``elems[i]`` (-1: the root ``t_P``, else a node), ``logical[i]``
    (its row index in its path's sequence), ``slot[i]`` (where it was written), ``main[i]``
    (on the state's own sequence), ``keys[i]``; ``row_of`` elem -> i; ``outs`` the chained
    outputs [n, H]; ``scratch`` the sequence holding the other lines' blocks (or None);
    ``committed`` the sequence's rows before the propose."""

    elems: list[int]
    logical: list[int]
    slot: list[int]
    main: list[bool]
    keys: list[int]
    row_of: dict
    outs: Any
    scratch: Any
    committed: int


@dataclass(slots=True)
class PendingTree:
    """What ``after_verify_tree`` needs of the last ``propose_tree``."""

    tree: DraftTree
    modules: list[ModuleTree | None]
    win: list[Any]
    win_start: list[int]
    tail: list[int]
    tail_start: int


@dataclass(slots=True)
class TreeJob:
    """One sequence of a propose_tree (a batch holds one per state): its arguments and the
    tree as it grows (``ranks``: each node's path of child ranks, for static shapes)."""

    st: MtpState
    tok: int
    P: int
    D: int
    widths: list[int] | None
    counts: dict | None
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    ranks: list[tuple] = field(default_factory=list)
    pending: PendingTree | None = None

    def add(self, e: int, m: int, ids: np.ndarray, probs: np.ndarray) -> None:
        """Children of ``e`` (-1: the root) at depth ``m``: ``ids`` by rank (-1: no more allowed)."""
        base = 0.0 if e < 0 else self.scores[e]
        for r, (t, p) in enumerate(zip(ids, probs)):
            if t < 0:
                break
            self.tokens.append(int(t))
            self.parents.append(e)
            self.depths.append(m)
            self.probs.append(float(p))
            self.scores.append(base + (math.log(p) if p > 0 else -math.inf))
            self.ranks.append((() if e < 0 else self.ranks[e]) + (r,))

    def tree(self) -> DraftTree:
        return DraftTree(self.P, self.tok, np.asarray(self.tokens, np.int32), np.asarray(self.parents, np.int32),
                         np.asarray(self.depths, np.int32), np.asarray(self.probs, np.float32),
                         np.asarray(self.scores, np.float32))


@dataclass(slots=True)
class _Rows:
    """One sequence's rows of one module's forward (``TreeRunner.layout``): host lists, and
    ``g`` its inputs (a backend array, set by the caller); ``src`` / ``dst`` its copy-on-write slots."""

    toks: list
    g: Any
    positions: list
    slots: list
    tables: list
    row_len: list
    row_start: list | None
    src: list
    dst: list


class TreeRunner:
    """Runs draft trees over the modules of a ``MultiModuleMtpHead`` in either KV mode."""

    def __init__(self, modules: list[MtpHead], backend: Any, chain: str, exact: ExactChain | None):
        """``exact``: the proposer's ExactChain in exact mode (its window and tail rules), else None."""
        self.modules = modules
        self.backend = backend
        self.chain = chain
        self.rules = exact
        self.exact = exact is not None
        self.M = len(modules)

    # -- which rows ---------------------------------------------------------------
    def _key(self, m: int, P: int, depth: int) -> int:
        """Key of module m's row for an element of ``depth`` (-1: the root)."""
        return P - 1 if not self.exact else P - 1 - m + (depth + 1)

    def elems(self, m: int, P: int, D: int, depths: list[int]) -> list[int]:
        """The elements module ``m`` computes (in order): draft mode, module m's drafting
        rows (the root for m = 0, the nodes of depth m - 1 after); exact mode, the root and
        every node of depth < min(m, D), those whose key is >= 0."""
        if not self.exact:
            return [-1] if m == 0 else [i for i, d in enumerate(depths) if d == m - 1]
        top = min(m, D)
        out = [-1] if self._key(m, P, -1) >= 0 else []
        return out + [i for i, d in enumerate(depths) if d < top and self._key(m, P, d) >= 0]

    # -- propose ------------------------------------------------------------------
    def propose(self, jobs: list[TreeJob], hid: Any, mask_rows: Any, topk: Any) -> list[DraftTree]:
        """The trees of ``jobs`` (one per sequence; ``hid`` [B, H] their normed ``h_{P-1}``): at
        each depth, every sequence's rows of a module are one forward (each row its own block
        table, the sequences one after another). ``mask_rows(m, seqs, paths) -> [n, W] | None``
        (row j: a node of sequence ``seqs[j]``, ``paths[j]`` its path tokens); ``topk(m, normed,
        mask, k, seqs) -> (ids [n, k], probs [n, k])`` on the host. On error every scratch
        sequence is retired (the caller restores the states' own rows)."""
        for j in jobs:
            st = j.st
            j.pending = PendingTree(None, [None] * self.M, list(st._win), list(st._win_start), list(st._tail),
                                    st._tail_start)
        try:
            for m in range(self.M if self.exact else max(j.D for j in jobs)):
                parts = [(b, j, self.elems(m, j.P, j.D, j.depths)) for b, j in enumerate(jobs)
                         if self.exact or m < j.D]
                parts = [(b, j, elems) for b, j, elems in parts if elems]
                if parts:
                    self._expand(m, parts, self._forward(m, parts, hid), mask_rows, topk)
            return self.finish(jobs)
        except BaseException:
            self.drop_all(jobs)
            raise

    def finish(self, jobs: list[TreeJob]) -> list[DraftTree]:
        """Every job's tree made, its state left as a chain propose along the greedy path leaves
        it, the pending tree kept for ``after_verify``."""
        for j in jobs:
            j.pending.tree = j.tree()
            self.as_chain(j.st, j.pending, j.P)
            j.st._tree = j.pending
        return [j.pending.tree for j in jobs]

    def drop_all(self, jobs: list[TreeJob]) -> None:
        """A failed propose: every job's scratch rows retired."""
        for j in jobs:
            if j.pending is not None:
                self.drop(j.st, j.pending)

    def _expand(self, m: int, parts: list, normed: Any, mask_rows: Any, topk: Any) -> None:
        """Depth ``m``'s nodes: each drafting row's top-c tokens (one LM head call for all)."""
        rows, seqs, paths, want, owners = [], [], [], [], []
        off = 0
        for b, j, elems in parts:
            mt = j.pending.modules[m]
            for e in elems if m < j.D else ():
                if (j.depths[e] if e >= 0 else -1) == m - 1:
                    rows.append(off + mt.row_of[e])
                    seqs.append(b)
                    paths.append([] if e < 0 else [j.tokens[i] for i in self._path(e, j.parents)])
                    want.append(j.widths[m] if j.widths is not None else j.counts.get(() if e < 0 else j.ranks[e], 0))
                    owners.append((j, e))
            off += len(elems)
        k = max(want, default=0)
        if k == 0:
            return
        ids, pr = topk(m, normed[self.backend.from_host(np.asarray(rows, np.int64))], mask_rows(m, seqs, paths), k,
                       seqs)
        for r, ((j, e), c) in enumerate(zip(owners, want)):
            j.add(e, m, ids[r, :c], pr[r, :c])

    @staticmethod
    def _path(e: int, parents: list[int]) -> list[int]:
        out = []
        while e >= 0:
            out.append(e)
            e = parents[e]
        return out[::-1]

    def _forward(self, m: int, parts: list, hid: Any) -> Any:
        """Module m's rows of every sequence in ``parts`` ((b, job, elems)): each laid out
        (``layout``), then one forward; -> their normed outputs [n, H] (for the LM head)."""
        laid = [self.layout(j, m, elems) for b, j, elems in parts]
        for (b, j, elems), r in zip(parts, laid):
            r.g = self._inputs(j.st, m, j.P, hid[b:b + 1], elems, j.parents, j.pending.modules)
        be, head = self.backend, self.modules[m]
        n = sum(len(r.toks) for r in laid)
        width = max(len(t) for r in laid for t in r.tables)
        tables = np.zeros((n, width), np.int32)
        for i, t in enumerate(t for r in laid for t in r.tables):
            tables[i, :len(t)] = t

        def cat(f: str, dtype: Any = np.int32) -> np.ndarray:
            return np.concatenate([np.asarray(getattr(r, f), dtype) for r in laid])

        src, dst = cat("src"), cat("dst")
        row_start = None if laid[0].row_start is None else cat("row_start")
        gs = [r.g for r in laid]
        g = gs[0] if len(gs) == 1 else be.xp.concatenate(gs, axis=0)
        y, normed = head.compute(be.from_host(cat("toks")), g, be.from_host(cat("positions")),
                                 be.from_host(cat("slots")), be.from_host(tables),
                                 be.from_host(np.arange(n, dtype=np.int32)), be.from_host(cat("row_len")),
                                 row_start=None if row_start is None else be.from_host(row_start),
                                 kv_copy=None if not src.size else (src, dst))
        outs = normed if self.chain == "postnorm" else y
        off = 0
        for (_, j, _), r in zip(parts, laid):
            j.pending.modules[m].outs = outs[off: off + len(r.toks)]
            off += len(r.toks)
        return normed

    def layout(self, job: TreeJob, m: int, elems: list[int]) -> _Rows:
        """Module m's rows of one sequence for ``elems``: lines laid out, blocks taken; -> what
        its rows give the forward, but for ``g`` (the caller's: ``_inputs``, or a planned tree
        step's in-graph gathers, mtpkern.tree_plan). Host bookkeeping only: it reads the nodes'
        structure (parents, depths), never their tokens' values but in ``toks``."""
        st, P, tokens, parents, depths, mods = job.st, job.P, job.tokens, job.parents, job.depths, job.pending.modules
        head = self.modules[m]
        pool = head.pool
        BS = pool.block_size
        seq = st._kv[m]
        R = seq.rows
        n = len(elems)
        row_of = {e: i for i, e in enumerate(elems)}
        parent_row: list[int | None] = []
        for e in elems:
            if not self.exact or e < 0:
                parent_row.append(None)
            else:
                parent_row.append(row_of.get(parents[e], None))
        keys = [self._key(m, P, -1 if e < 0 else depths[e]) for e in elems]
        logical = [R if p is None else 0 for p in parent_row]
        for i, p in enumerate(parent_row):
            if p is not None:
                logical[i] = logical[p] + 1
        # lines: the first child continues its parent's line (the committed rows' first: the main one)
        line_of: list[int] = [0] * n
        lines: list[_Line | None] = [None]          # 0: the state's own sequence
        heads: dict[int, int] = {}                  # line -> the row that starts it
        taken: set = set()
        for i, p in enumerate(parent_row):
            if p not in taken:
                taken.add(p)
                line_of[i] = 0 if p is None else line_of[p]
            else:
                line_of[i] = len(lines)
                heads[len(lines)] = i
                lines.append(_Line([], logical[i] // BS))
        main = [line_of[i] == 0 for i in range(n)]
        for i in range(n):                          # the main line's rows: the state's sequence, a chain's
            if main[i]:
                pool.append(seq, keys[i], 1, st)
        mt = ModuleTree(list(elems), logical, [0] * n, main, keys, row_of, None, None, R)
        mods[m] = mt                                # before any block is taken: a failure retires its scratch
        if len(lines) > 1:
            mt.scratch = pool.new_seq(st, scratch=True)
        seq_table = pool.table(seq).tolist()
        scratch, next_key = mt.scratch, [0]

        def new_block() -> int:
            """One more block of the scratch sequence (KvCacheFull here rolls the call back)."""
            pool.append(scratch, next_key[0], BS, st)
            next_key[0] += BS
            return scratch.blocks[-1]

        def table_of(line: int) -> list[int]:
            return seq_table if line == 0 else lines[line].prefix + lines[line].own

        src, dst = [], []
        for i in range(n):                          # parents first: a line's prefix is its parent's table
            ln_id = line_of[i]
            if ln_id == 0:
                mt.slot[i] = int(pool.slots(seq, logical[i], 1)[0])
                continue
            ln = lines[ln_id]
            first = ln.start * BS
            if heads[ln_id] == i:
                p = parent_row[i]
                ln.prefix = table_of(0 if p is None else line_of[p])[:ln.start]
            off = logical[i] - first
            while off // BS >= len(ln.own):
                ln.own.append(new_block())
            mt.slot[i] = ln.own[off // BS] * BS + off % BS
            if heads[ln_id] == i:                   # copy-on-write of the partial block before it
                anc = self._ancestry(i, parent_row)       # ancestor rows, nearest first
                for q in range(first, logical[i]):
                    src.append(int(pool.slots(seq, q, 1)[0]) if q < R else mt.slot[anc[logical[i] - 1 - q]])
                    dst.append(ln.own[(q - first) // BS] * BS + (q - first) % BS)
        # every row its own block table
        tables = [table_of(line_of[i])[: -(-(logical[i] + 1) // BS)] for i in range(n)]
        row_start = None
        W = head.block.sliding_window
        if W:
            row_start = []
            for i in range(n):
                first_key = keys[i] - (logical[i] - R)     # the path's keys run consecutively to keys[i]
                kv = keys[i] - W + 1
                row_start.append(min(seq._keys.rows_before(kv), R) if kv <= first_key else R + kv - first_key)
        toks = [job.tok if e < 0 else tokens[e] for e in elems]
        return _Rows(toks, None, [k + m + 1 for k in keys],
                     list(mt.slot), tables, [lg + 1 for lg in logical], row_start, src, dst)

    @staticmethod
    def _ancestry(i: int, parent_row: list) -> list[int]:
        out = []
        p = parent_row[i]
        while p is not None:
            out.append(p)
            p = parent_row[p]
        return out

    def _inputs(self, st, m, P, hid, elems, parents, mods) -> Any:
        """g for module m's rows: module 0 takes h_{P-1}; module m takes module m-1's output at
        the row of the element's parent (the root's: module m-1's window at its key)."""
        if m == 0:
            return hid
        parts = []
        if elems[0] < 0:                         # the root comes first
            key, ws = self._key(m, P, -1), st._win_start[m - 1]
            parts.append(st._win[m - 1][key - ws: key - ws + 1])
        idx = [mods[m - 1].row_of[parents[e]] for e in elems if e >= 0]
        if idx:
            parts.append(mods[m - 1].outs[self.backend.from_host(np.asarray(idx, np.int64))])
        return parts[0] if len(parts) == 1 else self.backend.xp.concatenate(parts, axis=0)

    def as_chain(self, st: MtpState, pending: PendingTree, P: int) -> None:
        """Counters (and in exact mode the tail and windows) as a chain propose along the
        main line leaves them, so the state's own rows obey its KV mode's rule meanwhile."""
        tree = pending.tree
        st._num_hiddens = P
        st._num_verified = P + 1
        if not self.exact:
            st._tail_start = P + 1
            return
        st._tail.append(int(tree.root_token))
        st._tail.extend(int(tree.tokens[i]) for i in tree.greedy_path())
        for m, mt in enumerate(pending.modules):
            if mt is not None:
                self._extend_window(st, m, mt, [i for i in range(len(mt.elems)) if mt.main[i]])
        ExactChain.trim_tail(st)
        self.rules.trim_windows(st)

    def _extend_window(self, st: MtpState, m: int, mt: ModuleTree, rows: list[int]) -> None:
        """Exact mode: module m's chained outputs of tree ``rows`` (consecutive keys) join its
        window (the last module's are never read)."""
        if rows and m < self.M - 1:
            self.rules.append_window(st, m, mt.keys[rows[0]],
                                     mt.outs[self.backend.from_host(np.asarray(rows, np.int64))])

    # -- verify -------------------------------------------------------------------
    def after_verify(self, st: MtpState, pending: PendingTree, path: list[int]) -> int:
        """Keep the accepted ``path``'s rows (module docstring); returns a = len(path)."""
        tree = pending.tree
        P = tree.position
        a = len(path)
        if self.exact:
            st._tail, st._tail_start = list(pending.tail), pending.tail_start
            st._tail.append(int(tree.root_token))
            st._tail.extend(int(tree.tokens[i]) for i in path)       # exact_rows reads T from the tail
            st._win, st._win_start = list(pending.win), list(pending.win_start)
        for m, mt in enumerate(pending.modules):
            if mt is None:
                continue
            seq = st._kv[m]
            pool = self.modules[m].pool
            if self.exact:
                keep_rows = exact_rows(st, m) - mt.committed
                chain = [-1] + list(path)
                elems = [e for e in chain if e in mt.row_of][:max(0, keep_rows)]
            else:
                e = -1 if m == 0 else (path[m - 1] if m <= a else None)
                elems = [] if e is None else [e]
            rows = [mt.row_of[e] for e in elems]
            r0 = next((j for j, i in enumerate(rows) if not mt.main[i]), len(rows))
            pool.trim(seq, seq.rows - (mt.committed + r0), st)
            src, dst = [], []
            for j in range(r0, len(rows)):
                i = rows[j]
                first = pool.append(seq, mt.keys[i], 1, st)
                src.append(mt.slot[i])
                dst.append(int(pool.slots(seq, first, 1)[0]))
            if src:
                pool.copy_rows(np.asarray(src, np.int32), np.asarray(dst, np.int32))
            if self.exact:
                self._extend_window(st, m, mt, rows)
            if mt.scratch is not None:
                pool.retire(mt.scratch, st)
                mt.scratch = None
        if self.exact:
            self.rules.trim_windows(st)
            ExactChain.trim_tail(st)
        st._num_verified = st._next_position = P + 1 + a
        st._tree = None
        return a

    def drop(self, st: MtpState, pending: PendingTree) -> None:
        """Retire every scratch sequence of ``pending`` (a failed propose, a freed state)."""
        for m, mt in enumerate(pending.modules):
            if mt is not None and mt.scratch is not None:
                self.modules[m].pool.retire(mt.scratch, st)
                mt.scratch = None
        st._tree = None
