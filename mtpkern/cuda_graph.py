"""The planned propose step, and its CUDA-graph capture (docs/cuda.md).

In the steady state a propose of ``B`` sequences with ``k`` drafts launches the
same kernels on the same shapes every call; only the data changes (tokens,
hiddens, positions, KV slots, block tables, masks). A *planned step* does the
whole ``M``-module propose with persistent buffers and ``out=`` arguments only,
so on the cuda backend it can be captured once into a CUDA graph and replayed;
the same plan runs eagerly on the NumPy backend, which is how it is tested
without a GPU (tests/test_planned_step.py).

Rows per sequence that module ``m`` writes (``step_rows``): exact mode
``min(m, k) + 1`` (keys ``P-1-m ..``; needs ``P >= M`` so that every module
has its history), draft mode 1 for ``m < k``. Module ``m``'s input rows are,
per sequence::

    exact   g:      [window row of key P-1-m (staged) | module m-1's chained rows 0 .. n_m - 2 (in graph)]
            tokens: [t_P (staged)                     | d_0 .. d_{n_m - 2}                  (in graph)]
    draft   g:      module 0: h_{P-1} (staged); module m: module m-1's chained output (the buffer itself)
            tokens: module 0: t_P (staged);      module m: d_{m-1} (the LM head's output buffer itself)

(module 0's "window row" is the target hidden). The in-graph moves are
``copy_segments_kernel`` launches (kernels/step.cu) driven by a table of
(source address, destination address, words) rows; the addresses of the
staged rows (the engine's hiddens, the state's windows) are written into the
table per call. Per call, ``StepRunner.propose``:

1. host bookkeeping, as the eager path does it: pools grow, keys, counters
   (``MtpHead.append_rows``, with the block tables padded to ``table_width``);
2. staging: every per-call input goes into one host area (pinned on cuda) and
   one H2D copy moves it to the device copy that the launches read;
3. the plan: run eagerly the first time for a shape (this compiles every
   kernel family and is that call's real computation), captured right after
   (on cuda, when ``capture``); later calls of the shape replay the graph;
4. one D2H copy of the drafts (two with their confidences); a -1 (a grammar row that allows no token)
   raises ``NoAllowedToken`` and the proposer's ``txn.guarded`` rolls back;
5. host bookkeeping after: drafts into the token tails, the chained outputs
   copied out of the persistent buffers into the exact-mode windows; with
   ``min_confidence`` the early stop is applied here (``StepRunner._early_stop``: the
   drafts past each stop and the rows the eager early stop would not write are dropped).

Blocks: GQA and MLA attention, DSA's indexer (its rows and lists in plan buffers; in exact
mode the last module's picked rows carry their indexer queries and weights, ``RowPick.ex``),
DeepSeek-V4's attention (the query latent's rows joined with k | v and the grouped output's
column groups moved by static segment copies, ``ForwardBuffers.copies``; the picked rows carry
their positions for the output's inverse RoPE), hyper-connections (rows of ``stream_size`` =
``hc_mult`` H values wherever the table moves a hidden or chained row, each token copied once
per stream, the collapses in plan buffers; the picked rows carry the attention's collapse),
windows, sinks, gates, MoE (LatentMoE too: fc1_latent_proj's rows, the latent experts' sum and
their Lt-wide workspace in plan buffers, the latent norm fused into fc2_latent_proj) and dense
FFNs. ``StepRunner.applies`` falls back only on the row
counts (``fallback_short`` / ``_rows`` / ``_window``).

Draft trees of static shapes run as a ``StepPlan`` too (mtpkern.tree_plan's ``TreePlan``):
it gives its own rows, segment layout, token staging and LM-head buffers through the hooks
``_rows``, ``_feed_segments``, ``_staged_tokens``, ``_lm_buffers`` / ``_lm_workspace``,
``_fill_static_segments`` and ``_launches``; the buffers, staging, capture and replay are
these, and its plans sit in the same ``StepRunner`` cache (``plan_for``, ``run_plan``).

Nothing here imports CuPy or touches a GPU at import time.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass
from functools import partial
from itertools import groupby
from typing import Any, Callable

import numpy as np

from .config import EMBED_MASK_POSITION
from .errors import NoAllowedToken, no_token_reason, no_token_where
from .exact import exact_rows
from .head import ForwardBuffers, RowIndex, RowJob, RowPick

_log = logging.getLogger("mtpkern")

#: words per segment-table row: (source address, destination address, 32-bit words)
SEG_FIELDS = 3
#: staging areas start at multiples of this many bytes (16-byte vector loads)
ALIGN = 16


def _cupy():
    import cupy

    return cupy


class Eager:
    """A step of the plan that runs outside the CUDA graphs (between two captured runs of
    launches, on every replay): a sharded head's LM-head reduction."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[], Any]):
        self.fn = fn

    def __call__(self) -> Any:
        return self.fn()


def staged_vocab(prop: Any) -> Any:
    """The token subset the LM heads' staged masks are in: the draft vocabulary, a sharded
    rank's share of the vocabulary (every module's head holds the same), or None."""
    return prop.draft_vocab if prop.comm is None else prop.modules[0].vocab


@dataclass(frozen=True, slots=True)
class StepShape:
    """What fixes the launches of a propose step (the plan / graph cache key)."""

    B: int
    k: int
    rows: tuple[int, ...]     # rows per sequence module m writes (0: it does not run)
    widths: tuple[int, ...]   # module m's padded block-table width (0: it does not run)
    masked: bool              # static grammar masks are applied
    conf: bool = False        # the drafts' confidences are computed (the LM head's epilogue)


def step_rows(kv_mode: str, M: int, k: int) -> tuple[int, ...]:
    """Rows per sequence that module ``m`` writes in a steady-state propose of ``k`` drafts."""
    if kv_mode == "exact":
        return tuple(min(m, k) + 1 for m in range(M))
    return tuple(1 if m < k else 0 for m in range(M))


def address(a: Any) -> int:
    """Address of an array's first element (NumPy host, or CuPy device)."""
    return int(a.ctypes.data) if isinstance(a, np.ndarray) else int(a.data.ptr)


def host_copy_segments(table: np.ndarray, ranges: list[tuple[int, int]]) -> None:
    """``copy_segments_kernel`` on the host, for the NumPy backend: ``table`` [S, 3]
    int64 rows (source address, destination address, words). Every range must lie
    inside one of ``ranges`` ((address, bytes) of live arrays): a wrong table fails
    here with an AssertionError, never as a stray write."""
    for s, (src, dst, words) in enumerate(np.asarray(table, np.int64).tolist()):
        nbytes = 4 * words
        for a, what in ((src, "source"), (dst, "destination")):
            if not any(lo <= a and a + nbytes <= lo + size for lo, size in ranges):
                raise AssertionError(f"segment {s}: {what} [{a:#x}, +{nbytes}) is outside every buffer of the step")
        if nbytes > 0:
            ctypes.memmove(dst, src, nbytes)


class _Staging:
    """Per-call inputs: named typed areas of one byte buffer, kept on the host (pinned
    on cuda) and on the backend. The host writes, ``upload`` copies the whole area,
    the launches read the backend copy."""

    def __init__(self) -> None:
        self.areas: dict[str, tuple[int, int, np.dtype]] = {}
        self.nbytes = 0

    def add(self, name: str, count: int, dtype) -> None:
        dt = np.dtype(dtype)
        off = -(-self.nbytes // ALIGN) * ALIGN
        self.areas[name] = (off, count, dt)
        self.nbytes = off + count * dt.itemsize

    def allocate(self, cuda: bool) -> None:
        n = max(self.nbytes, ALIGN)
        if cuda:
            cp = _cupy()
            self._pinned = cp.cuda.alloc_pinned_memory(n)
            self.host = np.frombuffer(self._pinned, np.uint8, n)
            self.dev = cp.zeros(n, np.uint8)
        else:
            self.host = np.zeros(n, np.uint8)
            self.dev = np.zeros(n, np.uint8)
        self.host[:] = 0

    def h(self, name: str) -> np.ndarray:
        off, count, dt = self.areas[name]
        return self.host[off: off + count * dt.itemsize].view(dt)

    def d(self, name: str) -> Any:
        off, count, dt = self.areas[name]
        return self.dev[off: off + count * dt.itemsize].view(dt)


class StepPlan:
    """Persistent buffers, staging area and launches of one ``StepShape``.

    ``execute()`` runs the launches on the current stream (or on the host);
    ``capture()`` records them into a ``cupy.cuda.Graph``; ``replay()`` launches it.
    """

    def __init__(self, prop: Any, shape: StepShape, attention_workspace: Any = None):
        """``attention_workspace(floats)``: a shared FP32 scratch array of at least that
        many elements for the split-KV partials (plans run one at a time on one stream,
        so they can share it; a plan keeps a reference to the array its graph uses).
        None: the plan allocates its own."""
        from .backends.cuda_launch import attention as attn_launch
        from .backends.cuda_launch import dsa as dsa_launch
        from .backends.cuda_launch import lm_head as lm_launch
        from .backends.cuda_launch import mla as mla_launch

        be = self.backend = prop.backend
        self.prop, self.shape = prop, shape
        self.cuda = be.name == "cuda"
        self.exact = prop.kv_mode == "exact"
        self.graph: Any = None
        self.capture_failed = False
        self._uploaded: Any = None       # cuda event: the last staging upload
        self._call_ranges: list[tuple[int, int]] = []
        self._keep: list[Any] = []       # this call's source arrays, alive until the step ends
        cfg = prop.config
        B, k, M = shape.B, shape.k, prop.num_modules
        H = cfg.hidden_size
        hc, S = cfg.hc_mult, cfg.stream_size      # hyper-connections: hc streams of H, S = hc H per row
        vocab = staged_vocab(prop)             # the LM heads' token subset: masks staged in its bits
        W = self.mask_words = cfg.bitmask_words if vocab is None else vocab.words
        n, nout, picked = self._rows()
        n_max = max(n.values())
        L = M - 1
        s = self._feed_segments(n, nout, picked)
        # -- the modules' static row moves inside compute (ForwardBuffers.copies): name -> rows
        self.copy_rows: dict[int, dict[str, tuple[int, int]]] = {m: {} for m in self.run}
        for m in self.run:
            b = prop.modules[m].block
            for name, count in (("join_q", 2 * n[m] if b.q_lora_rank and not b.mla else 0),
                                ("repeat_tokens", n[m] * hc if hc > 1 else 0),
                                ("o_groups_in", nout[m] * b.o_groups), ("o_groups_out", nout[m] * b.o_groups)):
                if count:
                    self.copy_rows[m][name] = (s, s + count)
                    s += count
        self.num_segments = s

        # -- staging layout ---------------------------------------------------------------
        stg = self.stage = _Staging()
        stg.add("seg", SEG_FIELDS * s, np.int64)
        for m in self.run:
            if self._staged_tokens(m):
                stg.add(f"tok{m}", n[m], np.int32)
            for f in ("pos", "slot", "rseq", "rlen") + (("rst",) if prop.modules[m].block.sliding_window else ()):
                stg.add(f"{f}{m}", n[m], np.int32)
            if cfg.embed_mask_pos0:                         # the rows' position-0 flags (MtpHead.compute)
                stg.add(f"zero{m}", n[m] * hc, np.uint8)    # (each once per stream)
            stg.add(f"tab{m}", self.tab_rows[m] * shape.widths[m], np.int32)
        if shape.masked:
            stg.add("mask", k * B * W, np.int32)
        stg.allocate(self.cuda)

        # -- persistent buffers -----------------------------------------------------------
        self._own: list[Any] = []
        xp = be.xp

        def buf(shp, dtype=np.float32):
            a = xp.zeros(shp, dtype)
            self._own.append(a)
            return a

        self.g = {m: buf((n[m], S)) for m in self.run if self._staged_tokens(m)}
        self.y = {m: buf((nout[m], S)) for m in self.run}
        self.normed = {m: buf((nout[m], H)) for m in self.run}
        self._lm_buffers(buf)
        x, r = buf((n_max, S)), buf((n_max, H))
        blk = {m: prop.modules[m].block for m in self.run}      # each module's own sizes

        def flat(size_of) -> Any:
            """One buffer for every module's [n_m, size_m] rows (each a contiguous view)."""
            return buf((max(n[m] * size_of(blk[m]) for m in self.run),))

        qkv, q = flat(lambda b: b.qkv_size), flat(lambda b: b.q_size)
        o = buf((max(nout[m] * blk[m].o_size for m in self.run),))
        mla = [m for m in self.run if blk[m].mla]                 # MLA: the latent projection, the q path
        kv_a = flat(lambda b: b.kv_a_size) if mla else None    # [L + R | an output gate's Hq Dv]
        q_c = flat(lambda b: b.q_lora_rank) if any(blk[m].q_lora_rank for m in self.run) else None
        v4q = [m for m in self.run if blk[m].q_lora_rank and not blk[m].mla]     # DeepSeek-V4's query latent
        q_lat = flat(lambda b: b.q_size) if v4q else None
        kv_ = flat(lambda b: b.qkv_size - b.q_size) if v4q else None
        o_rot = (buf((max(nout[m] * blk[m].o_size for m in self.run),))
                 if any(blk[m].out_rope for m in self.run) else None)
        if hc > 1:
            tok_rep = buf((n_max * hc,), np.int32)
            hc_streams, hc_ffn = buf((n_max, S)), buf((n_max, H))
            hc_bufs = {"mix_attn": buf((n_max, (2 + hc) * hc)), "u_attn": buf((n_max, H)), "post": buf((n_max, hc)),
                       "comb": buf((n_max, hc, hc)), "mix_ffn": buf((n_max, (2 + hc) * hc)), "u_ffn": buf((n_max, H)),
                       "post_ffn": buf((n_max, hc)), "comb_ffn": buf((n_max, hc, hc)), "mix_head": buf((n_max, hc)),
                       "head": buf((n_max, H))}
        grouped = [m for m in self.run if blk[m].o_groups]
        if grouped:                          # the grouped output's column groups, parts and joined rows
            o_in = buf((max(nout[m] * blk[m].o_size for m in grouped),))
            o_gr = buf((max(nout[m] * blk[m].o_groups * blk[m].o_lora_rank for m in grouped),))
            o_a = buf((max(nout[m] * blk[m].o_groups * blk[m].o_lora_rank for m in grouped),))
        dsa = [m for m in self.run if blk[m].dsa]               # DSA: the indexer's rows and lists
        if dsa:
            i_qr = flat(lambda b: b.index_n_heads * b.index_head_dim)
            i_q = flat(lambda b: b.index_n_heads * b.index_head_dim)
            i_k = flat(lambda b: b.index_head_dim)
            i_w = flat(lambda b: b.index_n_heads)
            i_gate = flat(lambda b: b.index_head_dim) if any(blk[m].kpool for m in dsa) else None
            i_list = buf((max(nout[m] * blk[m].index_list_width for m in dsa),), np.int32)
        K = cfg.num_experts_per_tok
        moe = any(blk[m].moe for m in self.run)
        eids = buf((n_max, K), np.int32) if moe else None
        # an expert-parallel rank's router ids mapped to its own experts (-1: another rank's)
        lids = buf((n_max, K), np.int32) if moe and any(prop.modules[m]._expert_map is not None
                                                        for m in self.run) else None
        ewts = buf((n_max, K)) if moe else None
        gated = moe and cfg.n_shared_experts and cfg.shared_expert_gate
        shared, sgate = (buf((n_max, H)), buf((n_max, 1))) if gated else (None, None)
        # LatentMoE: fc1_latent_proj's rows and the routed experts' latent sum (Lt wide)
        latent = [m for m in self.run if blk[m].moe and prop.modules[m].w.latent_fc1 is not None]
        Lt = cfg.moe_latent_size
        lat, lat_y = (buf((n_max, Lt)), buf((n_max, Lt))) if latent else (None, None)
        lm_ws: dict[str, Any] = {}
        ws_fixed: dict[str, dict[str, Any]] = {}
        parts: dict[int, int] = {}
        if self.cuda:   # the CUDA launchers' workspaces (see mtpkern.backends.cuda_launch)
            xcat = buf((n_max * hc, 2 * H))
            ws_fixed["mtp_input"] = {"xcat": xcat}
            def inner(name: str, axis: int) -> int:
                """The widest intermediate size of a weight the modules run (a sharded rank's
                slice: its weights' own shapes, not the config's)."""
                return max(getattr(prop.modules[m].w, name).shape[axis] for m in self.run
                           if getattr(prop.modules[m].w, name) is not None)

            if moe:
                ws_fixed["router"] = {"logits": buf((n_max, cfg.n_routed_experts)),
                                      "ticket": buf((1,), np.uint32)}    # zero, and left zero by each launch
                if len(latent) < sum(blk[m].moe for m in self.run):
                    ws_fixed["experts"] = {"act": buf((n_max * K, inner("experts_w2", 2))),
                                           "partial": buf((n_max * K, H))}
                if latent:                      # the experts of width Lt: their partial sums are Lt wide
                    ws_fixed["latent_experts"] = {"act": buf((n_max * K, inner("experts_w2", 2))),
                                                  "partial": buf((n_max * K, Lt))}
                if cfg.n_shared_experts:
                    ws_fixed["shared"] = {"act": buf((n_max, inner("shared_w2", 1)))}
            if not all(blk[m].moe for m in self.run):
                ws_fixed["mlp"] = {"act": buf((n_max, inner("mlp_w2", 1)))}
            from .backends.cuda_launch._util import sm_count, smem_optin

            BS = prop.block_size
            kv_item = np.dtype(be.kv_dtype).itemsize
            mla_ws: dict[int, dict[str, tuple[int, ...]]] = {}    # an MLA module's workspace shapes
            dsa_ws: dict[int, dict[str, tuple[int, ...]]] = {}    # a DSA module's dsa_select workspace
            for m in self.run:
                b = blk[m]
                if not nout[m]:                     # no row attends (only the K/V written)
                    parts[m] = 1
                    continue
                if b.mla:
                    Lr, R = b.kv_lora_rank, b.qk_rope_head_dim
                    cap = shape.widths[m] * BS              # a DSA list: each row walks its listed rows only
                    if b.dsa:
                        dsa_ws[m] = dsa_launch.workspace_shapes(nout[m], cap, b.index_topk, b.kpool)
                    walk = min(cap, b.index_list_width) if b.dsa else cap
                    mp = mla_launch.plan(b.num_attention_heads, Lr, R, walk, nout[m],
                                         target_blocks=2 * sm_count(), smem_max=smem_optin(), kv_itemsize=kv_item)
                    mla_ws[m] = mla_launch.workspace_shapes(nout[m], b.num_attention_heads, Lr, R, mp.num_parts)
                    parts[m] = 1                    # (its split-KV partials are in mla_ws)
                    continue
                work = min(nout[m], self.tab_rows[m]) * b.num_key_value_heads     # the launcher's rule
                parts[m] = attn_launch.plan(b.num_attention_heads // b.num_key_value_heads, b.head_dim,
                                            shape.widths[m] * BS, work=work,
                                            target_blocks=2 * sm_count(), smem_max=smem_optin(),
                                            Dv=b.v_dim).num_parts
            # one flat FP32 buffer per MLA workspace kind, each MLA module a view of its own shape
            mla_flat = {key: buf((max(int(np.prod(ws_[key])) for ws_ in mla_ws.values() if key in ws_),))
                        for key in sorted({k for ws_ in mla_ws.values() for k in ws_})}   # a fixed order
            dsa_flat = {key: buf((max(int(np.prod(ws_[key])) for ws_ in dsa_ws.values() if key in ws_),))
                        for key in sorted({k for ws_ in dsa_ws.values() for k in ws_})}
            split = [m for m in self.run if parts[m] > 1]
            po = max((nout[m] * blk[m].num_attention_heads * parts[m] * blk[m].v_dim for m in split), default=0)
            pml = max((nout[m] * blk[m].num_attention_heads * parts[m] * 2 for m in split), default=0)
            part_o = part_ml = None
            if split:
                floats = po + pml
                self._attn_ws = ws = (attention_workspace(floats) if attention_workspace is not None
                                      else buf((floats,)))
                part_o, part_ml = ws[:po], ws[po:floats]
            lm_ws = self._lm_workspace(buf, lm_launch.num_partials(cfg.vocab_size if vocab is None else vocab.size,
                                                                   sm_count()))

        self.bufs: dict[int, ForwardBuffers] = {}
        for m in self.run:
            c, co, b = n[m], nout[m], blk[m]           # rows written; rows past the KV write
            Hq = b.num_attention_heads
            per_pair = ("experts", "latent_experts")       # workspaces of n * K rows
            ws = {op: {key: a[:(c * hc if op == "mtp_input" else co) * (K if op in per_pair else 1)]
                       for key, a in d.items()} for op, d in ws_fixed.items()}
            if self.cuda and parts[m] > 1:
                p_ = parts[m]
                ws["attention"] = {"part_o": part_o[:co * Hq * p_ * b.v_dim].reshape(co, Hq, p_, b.v_dim),
                                   "part_ml": part_ml[:co * Hq * p_ * 2].reshape(co, Hq, p_, 2)}
            if self.cuda and m in mla_ws:
                ws["mla_attention"] = {key: mla_flat[key][:int(np.prod(shp))].reshape(shp)
                                       for key, shp in mla_ws[m].items()}
            if self.cuda and dsa_ws.get(m):
                ws["dsa_select"] = {key: dsa_flat[key][:int(np.prod(shp))].reshape(shp)
                                    for key, shp in dsa_ws[m].items()}
            self.bufs[m] = ForwardBuffers(x[:c], qkv[:c * b.qkv_size].reshape(c, b.qkv_size),
                                          q[:c * b.q_size].reshape(c, Hq, b.head_dim),
                                          o[:co * b.o_size].reshape(co, b.o_size), r[:co], self.y[m], self.normed[m],
                                          None if eids is None else eids[:co], None if ewts is None else ewts[:co],
                                          ws, None if shared is None else shared[:co],
                                          None if sgate is None else sgate[:co])
            if lids is not None:
                self.bufs[m].local_ids = lids[:co]
            if m in latent:
                self.bufs[m].lat, self.bufs[m].lat_y = lat[:co], lat_y[:co]
            if b.dsa:
                bf, Hi, Di, T = self.bufs[m], b.index_n_heads, b.index_head_dim, b.index_list_width
                bf.index_qr = i_qr[:c * Hi * Di].reshape(c, Hi * Di)
                bf.index_q = i_q[:c * Hi * Di].reshape(c, Hi, Di)
                bf.index_k = i_k[:c * Di].reshape(c, Di)
                bf.index_w = i_w[:c * Hi].reshape(c, Hi)
                bf.index_gate = i_gate[:c * Di].reshape(c, Di) if b.kpool else None
                bf.index = i_list[:co * T].reshape(co, T)
            if b.mla:
                W, Q = b.kv_a_size, b.q_lora_rank
                self.bufs[m].kv_a = kv_a[:c * W].reshape(c, W)
                if Q:
                    self.bufs[m].q_c = q_c[:c * Q].reshape(c, Q)
            bf = self.bufs[m]
            if hc > 1:                               # the streams' buffers (ForwardBuffers)
                bf.tok_rep = tok_rep[:c * hc]
                bf.streams, bf.ffn = hc_streams[:co], hc_ffn[:co]
                bf.hc = {name: a[:c if name in ("mix_attn", "u_attn", "post", "comb") else co]
                         for name, a in hc_bufs.items()}
            if m in v4q:
                Q, KV = b.q_size, b.qkv_size - b.q_size
                bf.q_c = q_c[:c * b.q_lora_rank].reshape(c, b.q_lora_rank)
                bf.q_lat, bf.kv = q_lat[:c * Q].reshape(c, Q), kv_[:c * KV].reshape(c, KV)
            if b.out_rope:
                bf.o_rot = o_rot[:co * b.o_size].reshape(co, Hq, b.v_dim)
            if b.o_groups:
                G, R_ = b.o_groups, b.o_lora_rank
                bf.o_in = o_in[:co * b.o_size].reshape(G, co, b.o_size // G)
                bf.o_part = o_gr[:co * G * R_].reshape(G, co, R_)
                bf.o_a = o_a[:co * G * R_].reshape(co, G * R_)
            if picked and m == L:
                self.bufs[m].pick = RowPick() if not co else RowPick(
                    buf((co, Hq, b.head_dim)), buf((co, S)), buf((co,), np.int32), buf((co,), np.int32),
                    buf((co,), np.int32) if b.sliding_window else None,
                    buf((co, b.gated_size)) if b.gate_size else None,
                    {name: buf((co,) + src.shape[1:], src.dtype)
                     for name, src in self._pick_extras(b, m).items()})

        self._ranges = [(address(a), a.nbytes) for a in self._own] + [(address(stg.dev), stg.dev.nbytes)]
        seg = stg.d("seg").reshape(-1, SEG_FIELDS)
        for m in self.run:
            self.bufs[m].copies = {name: partial(self._segments, seg[a:e])
                                   for name, (a, e) in self.copy_rows[m].items()}
        self._fill_static_segments()
        self.launches = self._launches(lm_ws)

    # -- the chain's layout (TreePlan, mtpkern.tree_plan, gives its own) ----------------------
    def _rows(self) -> tuple[dict[int, int], dict[int, int], bool]:
        """-> (rows each module writes, rows past its KV write, whether the last module picks
        rows); sets ``run`` (the modules that run) and ``tab_rows`` (block tables per module)."""
        shape, M = self.shape, self.prop.num_modules
        B, k = shape.B, shape.k
        self.run = [m for m in range(M) if shape.rows[m]]
        n = {m: B * shape.rows[m] for m in self.run}
        self.tab_rows = {m: B for m in self.run}          # one table per sequence, rows share it
        # exact mode's last module feeds no module: past its KV write only the last row of each
        # sequence goes on, and only when it drafts (MtpHead.compute, RowPick); ``nout``: the
        # rows past the KV write
        L = M - 1
        picked = self.exact and L in self.run and shape.rows[L] > 1
        nout = dict(n)
        if picked:
            nout[L] = B if L < k else 0
        return n, nout, picked

    def _feed_segments(self, n: dict[int, int], nout: dict[int, int], picked: bool) -> int:
        """Segment rows: feed_m = [f0, f1), rows past the KV write [f1, f2), pick_m = [f2, f3)
        (``seg_rows``); -> the count."""
        shape, prop = self.shape, self.prop
        B, k, L = shape.B, shape.k, prop.num_modules - 1
        self.seg_rows: dict[int, tuple[int, int, int, int]] = {}
        s = 0
        for m in self.run:
            f0 = s
            if m == 0 or self.exact:
                s += B                                      # row 0: target hidden / window row
            if self.exact and m >= 1:
                s += B + B * (shape.rows[m] - 1)            # module m-1's rows, the drafts
            f1 = s
            if picked and m == L and nout[m]:          # q, x, row_seq, row_len (, row_start, q|k|v|gate, extras)
                b = prop.modules[m].block
                s += B * (4 + bool(b.sliding_window) + bool(b.gate_size) + len(self._pick_extras(b)))
            f2 = s
            if self.exact and m < k:
                s += B                                      # last row of each sequence -> LM head
            self.seg_rows[m] = (f0, f1, f2, s)
        return s

    def _staged_tokens(self, m: int) -> bool:
        """Whether module ``m``'s tokens and ``g`` rows are staged / gathered into plan buffers
        (else they are module m-1's outputs themselves: draft mode's chain)."""
        return self.exact or m == 0

    def _lm_buffers(self, buf: Callable[..., Any]) -> None:
        """The LM heads' outputs: the drafts ``ids`` [k, B] (and their confidences)."""
        shape, prop = self.shape, self.prop
        B, k, H = shape.B, shape.k, prop.config.hidden_size
        self.ids = buf((k, B), np.int32)
        self.conf = buf((k, B)) if shape.conf else None           # the drafts' confidences
        #: a sharded head: the rank's LM-head partial results (ids, best logits, confidence sums),
        #: which the eager ``_reduce_lm`` between the captured segments turns into ids / conf
        self.sharded = prop.comm is not None
        if self.sharded:
            self.local_ids, self.best = buf((k, B), np.int32), buf((k, B))
            self.sums, self.local_conf = (buf((k, B)), buf((k, B))) if shape.conf else (None, None)
        self.last = buf((B, H)) if self.exact else None

    def _lm_workspace(self, buf: Callable[..., Any], P: int) -> dict[str, Any]:
        """The CUDA argmax's partial results: ``P`` blocks per head row (cuda only)."""
        B = self.shape.B
        lm_ws = {"part_v": buf((B, P)), "part_i": buf((B, P), np.int32), "check": False}
        if self.shape.conf:
            lm_ws["part_s"] = buf((B, P))                        # the blocks' sums of exp
        return lm_ws

    # -- building ---------------------------------------------------------------------------
    def _pick_extras(self, b: Any, m: int | None = None) -> dict[str, Any]:
        """The per-row extras of ``MtpHead.compute``'s KV write that the rows going on read after
        it (``RowPick.ex``), by name -> their source over all of module ``m``'s rows (None: the
        names only): DSA's indexer queries and head weights."""
        bf = None if m is None else self.bufs[m]
        out: dict[str, Any] = {}
        if b.dsa:
            out["index_q"] = bf and bf.index_q
            out["index_w"] = bf and bf.index_w
        if b.out_rope:                       # the rows' RoPE positions (the output's unrotation)
            out["positions"] = None if m is None else self.stage.d(f"pos{m}")
        if self.prop.config.hc_mult > 1:     # the attention's collapse: how its output joins the streams
            out["hc_post"] = bf and bf.hc["post"]
            out["hc_comb"] = bf and bf.hc["comb"]
        return out

    def chain(self, m: int) -> Any:
        """Module ``m``'s chained outputs [B * rows_m, stream_size] (what module m+1 reads)."""
        return self.normed[m] if self.prop.chain == "postnorm" else self.y[m]

    def _tokens(self, m: int) -> Any:
        return self.stage.d(f"tok{m}") if self.exact or m == 0 else self.ids[m - 1]

    def _g(self, m: int) -> Any:
        return self.g[m] if self.exact or m == 0 else self.chain(m - 1)

    def _fill_static_segments(self) -> None:
        """The table rows whose addresses never change (persistent buffer to buffer)."""
        B, k, H = self.shape.B, self.shape.k, self.prop.config.hidden_size
        S = self.prop.config.stream_size                          # a chained row's values (hc_mult H)
        T = self.stage.h("seg").reshape(-1, SEG_FIELDS)
        ids = address(self.ids)
        for m in self.run:
            f0, f1, f2, f3 = self.seg_rows[m]
            nm = self.shape.rows[m]
            s = f0
            if m == 0 or self.exact:
                g = address(self.g[m])
                for i in range(B):                                   # source: per call
                    T[s] = (0, g + 4 * i * nm * S, S)
                    s += 1
            if self.exact and m >= 1:
                prev, nprev = address(self.chain(m - 1)), self.shape.rows[m - 1]
                g, tok = address(self.g[m]), address(self.stage.d(f"tok{m}"))
                for i in range(B):                                   # g rows 1.. <- module m-1's rows 0..
                    T[s] = (prev + 4 * i * nprev * S, g + 4 * (i * nm + 1) * S, (nm - 1) * S)
                    s += 1
                for i in range(B):                                   # token j + 1 <- draft d_j
                    for j in range(nm - 1):
                        T[s] = (ids + 4 * (j * B + i), tok + 4 * (i * nm + j + 1), 1)
                        s += 1
            if s != f1:
                raise AssertionError(f"module {m}: {s - f0} feed segments written, {f1 - f0} planned")
            pick = self.bufs[m].pick
            if pick is not None and pick.q is not None:     # the last row of each sequence goes on
                bf, stg = self.bufs[m], self.stage
                moves = [(bf.q, pick.q), (bf.x, pick.x), (stg.d(f"rseq{m}"), pick.row_seq),
                         (stg.d(f"rlen{m}"), pick.row_len)]
                if pick.row_start is not None:
                    moves.append((stg.d(f"rst{m}"), pick.row_start))
                if pick.qkv is not None:             # the gate's projection: q|k|v|gate, MLA's kv_a|gate
                    moves.append((bf.kv_a if self.prop.modules[m].block.mla else bf.qkv, pick.qkv))
                src_ex = self._pick_extras(self.prop.modules[m].block, m)
                moves.extend((src_ex[name], dst) for name, dst in pick.ex.items())
                for src, dst in moves:
                    words = dst[0].size                      # a row's 4-byte words
                    for i in range(B):
                        T[s] = (address(src) + 4 * (i * nm + nm - 1) * words, address(dst) + 4 * i * words, words)
                        s += 1
            if s != f2:
                raise AssertionError(f"module {m}: {s - f1} row segments written, {f2 - f1} planned")
            if self.exact and m < k:
                src, last = address(self.normed[m]), address(self.last)
                picked = pick is not None                            # normed holds the last rows only
                for i in range(B):                                   # key P-1 of sequence i -> LM head row i
                    T[s] = (src + 4 * (i if picked else i * nm + nm - 1) * H, last + 4 * i * H, H)
                    s += 1
            if s != f3:
                raise AssertionError(f"module {m}: {s - f2} pick segments written, {f3 - f2} planned")
        for m in self.run:
            self._fill_copies(T, m)

    def _fill_copies(self, T: np.ndarray, m: int) -> None:
        """Module ``m``'s static row moves inside ``compute`` (``ForwardBuffers.copies``): DeepSeek-V4's
        query rows joined with their k | v rows, a grouped output's column groups out of ``o``
        and its parts into ``o_a``."""
        bf = self.bufs[m]
        rows: list[tuple[int, int, int]] = []
        for name, (a, e) in self.copy_rows[m].items():
            rows.clear()
            if name == "repeat_tokens":                             # token j -> entries j hc .. j hc + hc - 1
                hc = self.prop.config.hc_mult
                src, dst = address(self._tokens(m)), address(bf.tok_rep)
                rows += [(src + 4 * j, dst + 4 * (j * hc + i), 1) for j in range(bf.tok_rep.shape[0] // hc)
                         for i in range(hc)]
            elif name == "join_q":
                Q, KV, S = bf.q_lat.shape[1], bf.kv.shape[1], bf.qkv.shape[1]
                ql, kv, qkv = address(bf.q_lat), address(bf.kv), address(bf.qkv)
                for j in range(bf.qkv.shape[0]):                    # row j: q | k | v
                    rows += [(ql + 4 * j * Q, qkv + 4 * j * S, Q), (kv + 4 * j * KV, qkv + 4 * (j * S + Q), KV)]
            else:
                G, co, k = bf.o_in.shape
                r_ = bf.o_part.shape[2]
                o = address(bf.o if bf.o_rot is None else bf.o_rot)   # o_a_proj reads the unrotated output
                oi, op, oa = address(bf.o_in), address(bf.o_part), address(bf.o_a)
                for i in range(G):
                    for j in range(co):
                        rows.append((o + 4 * (j * G * k + i * k), oi + 4 * (i * co + j) * k, k) if name == "o_groups_in"
                                    else (op + 4 * (i * co + j) * r_, oa + 4 * (j * G * r_ + i * r_), r_))
            if len(rows) != e - a:
                raise AssertionError(f"module {m}: {len(rows)} {name} segments written, {e - a} planned")
            T[a:e] = rows

    def _launches(self, lm_ws: dict) -> list[Callable[[], Any]]:
        out: list[Callable[[], Any]] = []
        B, k, W = self.shape.B, self.shape.k, self.mask_words
        stg = self.stage
        seg = stg.d("seg").reshape(-1, SEG_FIELDS)
        masks = stg.d("mask").reshape(k, B, W) if self.shape.masked else None
        for m in self.run:
            head = self.prop.modules[m]
            f0, f1, f2, f3 = self.seg_rows[m]
            if f1 > f0:
                out.append(partial(self._segments, seg[f0:f1]))
            compute = partial(head.compute, self._tokens(m), self._g(m), stg.d(f"pos{m}"), stg.d(f"slot{m}"),
                              stg.d(f"tab{m}").reshape(B, self.shape.widths[m]), stg.d(f"rseq{m}"),
                              stg.d(f"rlen{m}"), self.bufs[m], stg.d(f"rst{m}") if head.block.sliding_window else None,
                              zero_embed=stg.d(f"zero{m}") if head.config.embed_mask_pos0 else None)
            pick = self.bufs[m].pick
            if pick is None:
                out.append(compute)
            else:                            # its K/V; the rows that go on; those rows (none: done)
                out.append(partial(compute, part="kv"))
                if pick.q is not None:
                    out.append(partial(self._segments, seg[f1:f2]))
                    out.append(partial(compute, part="rest"))
            if m < k:
                if f3 > f2:
                    out.append(partial(self._segments, seg[f2:f3]))
                src = self.last if self.exact else self.normed[m]
                mask = None if masks is None else masks[m]
                if self.sharded:             # the rank's partial result, then the ranks' reduction (eager)
                    part = {} if self.conf is None else {"conf": self.local_conf[m], "sum_exp": self.sums[m]}
                    out.append(partial(self.backend.lm_head_argmax, src, head.w.head, mask, out=self.local_ids[m],
                                       best=self.best[m], **part, **head._lm_kw, **lm_ws))
                    out.append(Eager(partial(self._reduce_lm, m, head.lm)))
                    continue
                conf = {} if self.conf is None else {"conf": self.conf[m]}
                out.append(partial(self.backend.lm_head_argmax, src, head.w.head, mask, out=self.ids[m], **conf,
                                   **head._lm_kw, **lm_ws))
        return out

    def _reduce_lm(self, m: int, lm: Any) -> None:
        """A sharded head's draft ``m``: the ranks' partial results -> the whole vocabulary's ids
        (and confidences, ``ShardedLmHead.reduce``) in the persistent buffers the next module and
        the read-back use. Runs eagerly between captured segments (its packing allocates)."""
        xp = self.backend.xp
        ids, confs = lm.reduce(self.local_ids[m], self.best[m], None if self.conf is None else self.sums[m])
        xp.copyto(self.ids[m], ids)
        if confs is not None:
            xp.copyto(self.conf[m], confs)

    def _segments(self, table: Any) -> None:
        if self.cuda:
            from .backends.cuda_launch import step

            step.copy_segments(table)
        else:
            host_copy_segments(table, self._ranges + self._call_ranges)

    # -- per call ------------------------------------------------------------------------------
    def wait_staging(self) -> None:
        """The host area may be rewritten once the previous upload has left it."""
        if self._uploaded is not None:
            self._uploaded.synchronize()

    def stage_rows(self, m: int, ri: RowIndex) -> None:
        stg = self.stage
        if self.exact or m == 0:
            stg.h(f"tok{m}")[:] = ri.tokens
        stg.h(f"pos{m}")[:] = ri.positions
        stg.h(f"slot{m}")[:] = ri.slots
        stg.h(f"rseq{m}")[:] = ri.row_seq
        stg.h(f"rlen{m}")[:] = ri.row_len
        if ri.row_start is not None:
            stg.h(f"rst{m}")[:] = ri.row_start
        if self.prop.config.embed_mask_pos0:         # each row's flag once per stream (hyper-connections)
            stg.h(f"zero{m}")[:] = np.repeat(ri.positions == EMBED_MASK_POSITION, self.prop.config.hc_mult)
        stg.h(f"tab{m}")[:] = ri.tables.reshape(-1)

    def stage_masks(self, rows: np.ndarray) -> None:
        """``rows`` [k, B, W] int32 (all bits set where a sequence has no mask)."""
        self.stage.h("mask")[:] = rows.reshape(-1)

    def stage_sources(self, sources: dict[int, list[tuple[Any, int]]]) -> None:
        """``sources[m][i]``: (array, row) whose row feeds row 0 of sequence i in module m
        (the target hidden for m = 0, the window row of key P-1-m otherwise)."""
        T = self.stage.h("seg").reshape(-1, SEG_FIELDS)
        H = self.prop.config.stream_size            # a chained row: hc_mult streams of hidden_size
        self._call_ranges, self._keep = [], []
        for m, srcs in sources.items():
            f0 = self.seg_rows[m][0]
            for i, (a, row) in enumerate(srcs):
                self.stage_source(T, f0 + i, a, row, H, f"module {m} source {i}")

    def stage_source(self, T: np.ndarray, i: int, a: Any, row: int, S: int, what: str) -> None:
        """Segment-table row ``i`` reads row ``row`` of ``a`` (FP32 rows of ``S`` contiguous values):
        its address staged, ``a`` kept alive for the call, its bytes recorded for the host copy."""
        if a.dtype != np.float32 or a.ndim != 2 or a.shape[1] != S or a.strides[1] != 4:
            raise AssertionError(f"{what}: expected FP32 rows of {S} contiguous values, "
                                 f"got {a.dtype} {a.shape} strides {a.strides}")
        T[i, 0] = address(a) + row * a.strides[0]
        self._keep.append(a)
        if not self.cuda:
            self._call_ranges.append((address(a), (a.shape[0] - 1) * a.strides[0] + 4 * S))

    def upload(self) -> None:
        stg = self.stage
        if not self.cuda:
            np.copyto(stg.dev, stg.host)
            return
        cp = _cupy()
        cur = cp.cuda.get_current_stream()
        cp.cuda.runtime.memcpyAsync(address(stg.dev), address(stg.host), stg.host.nbytes,
                                    cp.cuda.runtime.memcpyHostToDevice, cur.ptr)
        if self._uploaded is None:
            self._uploaded = cp.cuda.Event(block=False, disable_timing=True)
        self._uploaded.record(cur)

    def execute(self) -> None:
        for launch in self.launches:
            launch()

    def capture(self) -> None:
        """Record the launches into CUDA graphs (nothing runs): one graph per run of launches
        between ``Eager`` steps (one graph for an unsharded head), the collectives a launch
        makes on the capturing stream inside it. Call after ``execute`` ran once: every kernel
        family is compiled and loaded by then. ``graph`` becomes the program ``replay`` runs:
        graphs and eager steps in order."""
        cp = _cupy()
        stream = cp.cuda.Stream(non_blocking=True)
        program: list[Any] = []
        for eager, run in groupby(self.launches, key=lambda launch: isinstance(launch, Eager)):
            if eager:
                program.extend(run)
            else:
                program.append(self._capture_run(cp, stream, list(run)))
        self.graph = program

    @staticmethod
    def _capture_run(cp: Any, stream: Any, launches: list[Callable[[], Any]]) -> Any:
        err: BaseException | None = None
        graph = None
        with stream:
            stream.begin_capture()
            try:
                for launch in launches:
                    launch()
            except BaseException as e:     # end the capture whatever happened, then re-raise
                err = e
            try:
                graph = stream.end_capture()
            except Exception as e:
                err = err or e
        if err is not None:
            raise err
        graph.upload(stream)
        stream.synchronize()
        return graph

    def replay(self) -> None:
        cur = _cupy().cuda.get_current_stream()
        for part in self.graph:
            if isinstance(part, Eager):
                part()
            else:
                part.launch(cur)

    def read_ids(self) -> tuple[np.ndarray, np.ndarray | None]:
        """([k, B] drafts, [k, B] confidences or None) on the host: the step's device-to-host
        copy (one; two with confidences), then a synchronisation."""
        ids = self._to_host("ids", self.ids)
        conf = None if self.conf is None else self._to_host("conf", self.conf)
        if self.cuda:
            _cupy().cuda.get_current_stream().synchronize()
        self._keep = []
        return ids.copy(), None if conf is None else conf.copy()

    def _to_host(self, name: str, a: Any) -> np.ndarray:
        """``a`` on the host: a copy of the NumPy array, or an async copy into a pinned buffer
        kept for this array (valid after the stream synchronises)."""
        if not self.cuda:
            return a
        cp = _cupy()
        host = getattr(self, f"_{name}_host", None)
        if host is None:
            pinned = cp.cuda.alloc_pinned_memory(a.nbytes)
            host = np.frombuffer(pinned, a.dtype, a.size).reshape(a.shape)
            setattr(self, f"_{name}_pinned", pinned)
            setattr(self, f"_{name}_host", host)
        cp.cuda.runtime.memcpyAsync(address(host), address(a), a.nbytes, cp.cuda.runtime.memcpyDeviceToHost,
                                    cp.cuda.get_current_stream().ptr)
        return host


class StepRunner:
    """The proposer's planned-step hook (``MultiModuleMtpHead.step_runner``).

    ``capture``: record each plan into a CUDA graph after its first (eager) run and
    replay it afterwards (cuda backend only; elsewhere the plan runs eagerly, as the
    tests use it). At most ``max_plans`` shapes are kept (least recently used out).
    ``counts``: how many steps ran eagerly, were captured, were replayed (``early_stop``: how
    many of them applied a ``min_confidence`` after the step).
    """

    def __init__(self, prop: Any, capture: bool = True, max_plans: int = 8):
        self.prop = prop
        self.capture = bool(capture) and prop.backend.name == "cuda"
        self.max_plans = max_plans
        self.plans: OrderedDict[StepShape, StepPlan] = OrderedDict()
        self.counts: Counter = Counter()
        self._attn_ws: Any = None
        self._lock = threading.Lock()
        #: the planned draft-tree step (mtpkern.tree_plan.tree_steps), made on first use
        self.trees: Any = None

    def attention_workspace(self, floats: int) -> Any:
        """The plans' shared split-KV scratch, of at least ``floats`` FP32 elements: one
        array for all plans (a long context at batch 64 needs ~200 MB of it, which eight
        cached plans would otherwise hold eight times). Grown by replacing it; plans
        captured against the old array keep it alive until they are evicted."""
        if self._attn_ws is None or self._attn_ws.size < floats:
            self._attn_ws = self.prop.backend.xp.zeros(floats, np.float32)
        return self._attn_ws

    def applies(self, sts: list, poss: list[int], k: int) -> bool:
        """True when every module's row count is the steady-state one (``step_rows``)."""
        prop = self.prop
        if prop.kv_mode == "draft":
            return True
        M = prop.num_modules
        for st, p in zip(sts, poss):
            if p < M:
                self.counts["fallback_short"] += 1
                return False
            for m in range(M):
                if st._kv[m].rows != p - 1 - m:
                    self.counts["fallback_rows"] += 1
                    return False
            for m in range(1, M):
                w, ws, key = st._win[m - 1], st._win_start[m - 1], p - 1 - m
                if w is None or not ws <= key < ws + w.shape[0]:
                    self.counts["fallback_window"] += 1
                    return False
        return True

    def plan(self, shape: StepShape) -> StepPlan:
        return self.plan_for(shape, lambda: StepPlan(self.prop, shape, self.attention_workspace))

    def plan_for(self, shape: Any, make: Callable[[], StepPlan], prefix: str = "") -> StepPlan:
        """The cached plan of ``shape`` (a ``StepShape``, or a tree step's shape,
        mtpkern.tree_plan), made by ``make()`` on a miss (counted as ``prefix + "plans"``); the
        chain's and the trees' plans share the cache and its ``max_plans``."""
        plan = self.plans.get(shape)
        if plan is None:
            plan = self.plans[shape] = make()
            self.counts[prefix + "plans"] += 1
            while len(self.plans) > self.max_plans:
                self.plans.popitem(last=False)
        self.plans.move_to_end(shape)
        return plan

    def run_plan(self, plan: StepPlan, prefix: str = "") -> None:
        """A staged, uploaded plan's launches: replayed when captured, else run eagerly and
        (with ``capture``) captured right after; counted as ``prefix + "executed"`` /
        ``"captured"`` / ``"replayed"``."""
        if plan.graph is not None:
            plan.replay()
            self.counts[prefix + "replayed"] += 1
            return
        self.counts[prefix + "executed"] += 1
        plan.execute()
        if self.capture and not plan.capture_failed:
            try:
                plan.capture()
                self.counts[prefix + "captured"] += 1
            except Exception as e:     # keep running this shape eagerly, and say why once
                plan.capture_failed = True
                _log.warning("mtpkern: CUDA-graph capture of the propose step %s failed (%s: %s); "
                             "running it eagerly", plan.shape, type(e).__name__, e)

    def propose(self, sts: list, toks: list[int], poss: list[int], hid: Any, k: int,
                masks: list, want_conf: bool = False,
                min_confidence: float | None = None) -> tuple[list[list[int]], Any, Any]:
        """The planned ``_propose_exact`` / ``_propose_draft``: same state changes, same drafts;
        also returns the drafts as a device array, and with ``want_conf`` their [k, B]
        confidences. The plans' buffers are shared, so one planned step runs at a time
        (calls from other threads wait for it).

        ``min_confidence`` (early stop): the step runs every module with confidences, then
        each sequence keeps its drafts up to and including the first below the threshold, and
        the rows the eager early stop would not have written are dropped (``_early_stop``);
        returns (drafts, None, per sequence its drafts' confidences)."""
        with self._lock:
            return self._propose(sts, toks, poss, hid, k, masks, want_conf or min_confidence is not None,
                                 min_confidence)

    @staticmethod
    def stop_lengths(confs: np.ndarray, min_confidence: float) -> list[int]:
        """Per sequence, the drafts an early stop keeps from ``confs`` [k, B]: up to and
        including the first whose confidence is below ``min_confidence`` (the eager test)."""
        k = confs.shape[0]
        below = confs < np.float32(min_confidence)
        return [int(np.argmax(below[:, i])) + 1 if below[:, i].any() else k for i in range(confs.shape[1])]

    def _early_stop(self, sts: list, poss: list[int], k: int, keep: list[int]) -> None:
        """Drop what the step wrote past each sequence's stop, so the state is the eager early
        stop's. Draft mode: module ``m``'s row for ``m >= keep`` (the eager path runs module ``m``
        only for the sequences still drafting). Exact mode: the drafts past the stop leave the
        token tail and every module goes back to its exact rows over the shorter tail (at most
        ``m`` rows of module ``m``: within ``trim_margin``); the windows are trimmed after."""
        prop = self.prop
        for st, p, n in zip(sts, poss, keep):
            if n == k:
                continue
            if prop.kv_mode == "exact":
                del st._tail[p + 1 + n - st._tail_start:]
                for m, mod in enumerate(prop.modules):
                    mod.pool.trim(st._kv[m], st._kv[m].rows - exact_rows(st, m), st)
            else:
                for m in range(n, k):
                    prop.modules[m].pool.trim(st._kv[m], 1, st)

    def _propose(self, sts, toks, poss, hid, k, masks, want_conf=False, min_confidence=None):
        prop = self.prop
        be, cfg = prop.backend, prop.config
        M, B, H = prop.num_modules, len(sts), cfg.stream_size      # the hiddens: hc_mult streams each
        exact = prop.kv_mode == "exact"
        rows = step_rows(prop.kv_mode, M, k)
        if exact:
            for st, p, t in zip(sts, poss, toks):
                st._num_hiddens = p
                st._num_verified = p + 1
                st._tail.append(t)
        index: dict[int, RowIndex] = {}
        sources: dict[int, list[tuple[Any, int]]] = {}
        hid = be.xp.ascontiguousarray(hid, dtype=np.float32).reshape(B, H)
        for m in range(M):
            c = rows[m]
            if not c:
                continue
            jobs = []
            for st, p, t in zip(sts, poss, toks):
                tk = np.zeros(c, np.int32)
                tk[0] = t
                jobs.append(RowJob(st._kv[m], tk, p - 1 - m if exact else p - 1, m + 1, st))
            index[m] = prop.modules[m].append_rows(jobs, pad_tables=True)
            if m == 0:
                sources[0] = [(hid, i) for i in range(B)]
            elif exact:
                sources[m] = [(st._win[m - 1], p - 1 - m - st._win_start[m - 1]) for st, p in zip(sts, poss)]
        masked = any(fn is not None for fn in masks)
        shape = StepShape(B, k, rows, tuple(index[m].tables.shape[1] if rows[m] else 0 for m in range(M)), masked,
                          bool(want_conf))
        plan = self.plan(shape)

        plan.wait_staging()
        for m, ri in index.items():
            plan.stage_rows(m, ri)
        if masked:
            mrows = np.full((k, B, cfg.bitmask_words), -1, np.int32)   # all bits set: unconstrained
            for i, fn in enumerate(masks):
                for m in range(k):
                    mk = None if fn is None else fn(m, [])            # static forms ignore the drafts
                    if mk is not None:
                        mrows[m, i] = mk
            vocab = staged_vocab(prop)
            if vocab is not None:                                      # target ids -> the subset's bits
                mrows = vocab.sub_mask(mrows.reshape(k * B, -1)).reshape(k, B, -1)
            plan.stage_masks(mrows)
        plan.stage_sources(sources)
        plan.upload()
        self.run_plan(plan)
        ids, confs = plan.read_ids()                                # [k, B] each
        keep = [k] * B
        if min_confidence is not None:
            keep = self.stop_lengths(confs, min_confidence)
        # a row past a sequence's stop is one the eager early stop never computes: no error there
        bad = [(int(m), int(i)) for m, i in np.argwhere(ids < 0) if m < keep[i]]
        if bad:
            m, i = bad[0]
            raise NoAllowedToken(f"{no_token_where(i, B, m)}: "
                                 f"{no_token_reason(masks[i] is not None, cfg.vocab_size)}", row=i, draft=m)
        drafts = [ids[:n, i].tolist() for i, n in enumerate(keep)]

        if exact:
            for i, st in enumerate(sts):
                st._tail.extend(ids[:, i].tolist())         # every draft: the rows below were built on them
            for m in range(M - 1):                  # module M-1's outputs feed no module
                c = rows[m]
                new = plan.chain(m).copy()          # out of the persistent buffer: the next step reuses it
                for i, (st, p) in enumerate(zip(sts, poss)):
                    prop.exact.append_window(st, m, p - 1 - m, new[i * c:(i + 1) * c])
            self._early_stop(sts, poss, k, keep)
            for st in sts:
                prop.exact.trim_windows(st)
                prop.exact.trim_tail(st)
        else:
            for st, p in zip(sts, poss):
                st._num_hiddens = p
                st._num_verified = p + 1
                st._tail_start = p + 1
            self._early_stop(sts, poss, k, keep)
        if min_confidence is not None:            # ragged: the proposer pads the device drafts with -1
            self.counts["early_stop"] += 1
            return drafts, None, [confs[:n, i].tolist() for i, n in enumerate(keep)]
        return drafts, plan.ids.T.copy(), confs
