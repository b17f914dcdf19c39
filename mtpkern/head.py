"""``MtpHead``: one MTP module's forward over rows of one or many sequences.

One row = (token ``t``, incoming hidden ``g``, RoPE position ``p``), written
into this module's own paged KV at the end of its sequence's rows::

    x  = eh_proj @ concat(enorm(E[t]), hnorm(g))              # [n, H]
    r  = x + o_proj @ attn(input_layernorm(x), p)             # GQA (or MLA) over the module's KV, causal
    y  = r + ffn(post_attention_layernorm(r))                 # MoE (+ shared experts) or dense SwiGLU
    normed = shared_head_norm(y)                              # what the LM head reads
    draft  = argmax(head @ normed, grammar bitmask)

Several rows of one sequence attend causally to each other (prefill,
catch-up, exact-mode propose); rows of different sequences never see each
other. The proposer decides which rows to write; the head only computes.

The module's block (``MtpConfig.block``, mtpkern/block.py) may switch on: a sliding
window (a row sees the last W keys, itself included), attention sinks, a value head
dim of its own, an output gate (``o *= sigmoid(gate)``, head-wise or element-wise,
the gate columns computed by the fused q|k|v projection), a gated shared expert,
SwiGLU clamps, a dense MLP in an MoE checkpoint, the RoPE variants (interleaved
pairs; YaRN's frequencies, its attention factor on cos / sin, its softmax factor on the
scores' scale), and MLA (multi-head latent attention: one latent row per token in the pool,
the absorbed attention of mtpkern.ops.mla). With ``embed_mask_pos0`` (vLLM's position-0 mask,
``MtpConfig``) a row at RoPE position ``EMBED_MASK_POSITION`` (module 0's key 0) reads a zero
embedding: ``x = eh_proj[:, H:] @ hnorm(g)``.

A sliding-window module's pool releases the leading blocks of a sequence that no
later row can see (``kv.WindowRule``): after each successful ``forward`` /
``forward_one`` here, and after each committed call of the proposer.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from .block import BlockSpec
from .checks import check_int, check_positions, check_token, check_tokens, ingest_hidden
from .config import EMBED_MASK_POSITION, MtpConfig
from .errors import StateError
from .kv import BlockPool, SeqKv, WindowRule, check_fp8_kv
from .lm import LmHead, ShardedLmHead
from .ops.dsa import DSA_NORM_EPS
from .ops.moe import RouterSpec
from .shard import Shard
from .vocab import DraftVocab
from .weights import ModuleWeights


@dataclass(slots=True)
class RowJob:
    """Rows to append to one sequence's KV in this module; ``holder``: who holds the
    sequence (a proposer state, or this head for ``alloc_seq`` sequences)."""

    seq: SeqKv
    tokens: np.ndarray     # [c] int32
    first_key: int         # keys first_key .. first_key + c - 1
    key_to_pos: int        # RoPE position = key + key_to_pos (module m: m + 1)
    holder: Any = None

    @property
    def count(self) -> int:
        return int(self.tokens.shape[0])


class HeadStep(NamedTuple):
    """Result of ``MtpHead.forward_one``."""

    draft: int
    hidden: Any    # [1, H] y (pre-norm) on the backend
    normed: Any    # [1, H] shared_head_norm(y) on the backend


class RowIndex(NamedTuple):
    """Host index arrays of one forward (``MtpHead.append_rows``): ``n`` rows, ``S`` jobs."""

    tokens: np.ndarray      # [n] int32
    positions: np.ndarray   # [n] int32 RoPE positions
    slots: np.ndarray       # [n] int32 KV cache slots (block * BS + offset)
    row_seq: np.ndarray     # [n] int32 job of each row
    row_len: np.ndarray     # [n] int32 KV rows each row attends to (causal, itself included)
    tables: np.ndarray      # [S, width] int32 block tables, zero-padded
    row_start: np.ndarray | None = None   # [n] int32 first visible KV row (a sliding window), or None


@dataclass(slots=True)
class RowPick:
    """The rows of a planned step's module that go on past the KV write (``MtpHead.compute``):
    the last row of each sequence, which the plan's segment copies (``cuda_graph.StepPlan``) move
    between ``compute(part="kv")`` and ``compute(part="rest")`` into these buffers of ``B`` rows:
    ``q`` (the attention's queries), ``x`` (o_proj's residual), ``row_seq`` / ``row_len`` (int32),
    ``row_start`` (a sliding window) and ``qkv`` (an attention output gate's projection, read after
    the attention: q|k|v|gate, MLA's kv_a|gate) when the block has them; ``ex``: the per-row extras
    of the KV write that the rest reads, by ``compute``'s names (DSA's ``index_q`` / ``index_w``).
    ``q`` None: no row goes on (the module only writes its K/V)."""

    q: Any = None
    x: Any = None
    row_seq: Any = None
    row_len: Any = None
    row_start: Any = None
    qkv: Any = None
    ex: dict = field(default_factory=dict)


@dataclass(slots=True)
class ForwardBuffers:
    """Preallocated outputs of ``MtpHead.compute`` over ``n`` rows (backend arrays, contiguous): ``x``,
    ``r``, ``y``, ``normed`` [n, H] (the block's RMSNorms are fused into the GEMVs they feed,
    ``norm=``: their rows are never stored); ``qkv`` [n, block.qkv_size] (q | k | v | gate); ``q``
    [n, Hq, D]; ``o`` [n, Hq Dv]; MoE ``expert_ids`` [n, K] int32 / ``expert_weights`` [n, K].
    ``ws``: per op (``mtp_input``, ``attention``, ``router``, ``experts``, ``shared``, ``mlp``), the
    backend's workspace keyword arguments (the CUDA launchers' ``xcat=``, ``part_o=`` ...; empty on
    NumPy). ``y`` may be read by the op that writes it (the shared experts add into it). With a
    gated shared expert (``shared_expert_gate``): ``shared`` [n, H] and ``shared_gate`` [n, 1]. An
    expert-parallel rank of a sharded head: ``local_ids`` [n, K] int32, the router's ids mapped to
    its experts. MLA: ``qkv`` holds the query before its RoPE, ``q`` after; ``kv_a`` [n,
    block.kv_a_size] (the latent row's L + R, then an element-wise gate's Hq Dv columns); with
    ``q_lora_rank``, ``q_c`` [n, q_lora_rank] (before q_a_layernorm, which is fused into q_b_proj).
    DSA's indexer (``block.dsa``): ``index_qr`` [n, Hi Di] (wq_b's output), ``index_q`` [n, Hi, Di]
    (roped), ``index_k`` [n, Di], ``index_w`` [n, Hi], with a pooled indexer ``index_gate`` [n, Di],
    and ``index`` [n, block.index_list_width] int32 (``dsa_select``'s lists; its workspace in
    ``ws["dsa_select"]``). DeepSeek-V4's attention: with a query latent outside MLA, ``q_c``,
    ``q_lat`` [n, Hq D] (q_b_proj's output) and ``kv`` [n, k | v] (w_qkv's), joined into ``qkv``;
    ``out_rope``: ``o_rot`` [n, Hq, Dv]; a grouped output (``o_groups`` g, rank r): ``o_in`` [g, n,
    Hq Dv / g] (each group's columns of ``o``), ``o_part`` [g, n, r] and ``o_a`` [n, g r].
    Hyper-connections (``hc_mult`` m > 1): ``x``, ``y`` and ``streams`` (the streams after the
    attention) are [n, m H]; ``tok_rep`` [n m] int32 (each token m times); ``ffn`` [n, H] (the FFN's
    output, before its streams); ``hc``: the collapses' buffers by name: ``mix_attn`` [n, (2 + m) m],
    ``u_attn`` [n, H], ``post`` [n, m], ``comb`` [n, m, m] (the attention's), ``mix_ffn``, ``u_ffn``,
    ``post_ffn``, ``comb_ffn`` (the FFN's), ``mix_head`` [n, m] and ``head`` [n, H] (``head_input``).
    ``copies``: the static row moves that join or split those (the plan's segment copies:
    ``join_q``, ``o_groups_in``, ``o_groups_out``, ``repeat_tokens``), each a call that runs them.
    LatentMoE (``moe_latent_size`` Lt): ``lat`` [n, Lt] (fc1_latent_proj's output), ``lat_y`` [n, Lt]
    (the routed experts' weighted sum; its norm is fused into fc2_latent_proj), their workspace
    ``ws["latent_experts"]``.
    The block's sizes are the module's own (``MtpConfig.block``). ``pick``: only the rows it
    names go on past the KV write (``compute``); the buffers from ``o`` on, ``index``, ``expert_*``,
    ``shared*`` and ``local_ids`` then hold those rows."""

    x: Any
    qkv: Any
    q: Any
    o: Any
    r: Any
    y: Any
    normed: Any
    expert_ids: Any = None
    expert_weights: Any = None
    ws: dict = field(default_factory=dict)
    shared: Any = None
    shared_gate: Any = None
    kv_a: Any = None
    q_c: Any = None
    local_ids: Any = None
    pick: RowPick | None = None
    index_qr: Any = None
    index_q: Any = None
    index_k: Any = None
    index_w: Any = None
    index_gate: Any = None
    index: Any = None
    q_lat: Any = None
    kv: Any = None
    o_rot: Any = None
    o_in: Any = None
    o_part: Any = None
    o_a: Any = None
    copies: dict = field(default_factory=dict)
    streams: Any = None
    tok_rep: Any = None
    ffn: Any = None
    hc: dict = field(default_factory=dict)
    lat: Any = None
    lat_y: Any = None


#: smallest padded block-table width (blocks): below it a growing sequence would
#: change the width, and so the captured graph, every block_size tokens
MIN_TABLE_WIDTH = 16


def table_width(max_blocks: int) -> int:
    """Padded block-table width for ``max_blocks``: at least ``MIN_TABLE_WIDTH``,
    rounded up to 8 steps per power of two (at most 12.5 % padding: 8192 tokens
    in blocks of 16 -> 512, 520 -> 576). Padding entries are never read (row_len
    bounds every row); the width only selects the attention launch."""
    w = max(int(max_blocks), MIN_TABLE_WIDTH)
    step = 1 << max(0, w.bit_length() - 4)
    return -(-w // step) * step


class MtpHead:
    """Module ``index`` of an MTP checkpoint with its own KV block pool."""

    def __init__(self, index: int, config: MtpConfig, weights: ModuleWeights, backend: Any,
                 num_blocks: int, block_size: int, trim_margin: int = 0, max_forward_rows: int = 1,
                 vocab: Any = None, comm: Any = None, shard: Shard | None = None, block: BlockSpec | None = None):
        """``trim_margin``, ``max_forward_rows``: for a sliding-window block, the rows a
        later call may trim from a sequence and the most rows one forward appends
        (``kv.WindowRule``; the proposer's KV mode sets them; 0 and 1 suit
        ``forward_one`` users, who never trim). ``vocab``: the ``DraftVocab`` whose rows
        ``weights.head`` holds (mtpkern.vocab), or None. ``comm`` / ``shard``: a rank of a
        sharded head (mtpkern.shard; ``weights`` that rank's slice): the partial sums meet in
        ``comm``'s all-reduces, the LM head's bests in ``comm.sharded_argmax``. ``block``: the block
        to run instead of ``config.block(index)`` (a target decoder layer's: ``DecoderLayer``)."""
        self.index = index
        self.config = config
        self.w = weights
        self.comm, self.shard = (None, None) if shard is None or shard.size == 1 else (comm, shard)
        if self.shard is not None:          # the rank's share of the vocabulary's rows (or the draft vocabulary's)
            ids = np.arange(config.vocab_size) if vocab is None else vocab.ids
            lo, hi = self.shard.vocab(ids.shape[0])
            vocab = DraftVocab(ids[lo:hi], config.vocab_size)
            if weights.head.shape[0] != vocab.size:
                raise ValueError(f"weights.head: expected this rank's {vocab.size} vocabulary rows, got "
                                 f"{weights.head.shape[0]}")
        self.backend = backend
        #: the LM head's drafts, confidences and tree candidates (mtpkern.lm): the whole
        #: vocabulary's, a draft vocabulary's, or (sharded) this rank's share met with the others'
        #: (None for a layer without one, ``weights.head`` None: a target decoder layer)
        self.lm = (None if weights.head is None else LmHead(backend, weights.head, vocab, config.vocab_size)
                   if self.comm is None else ShardedLmHead(backend, weights.head, vocab, config.vocab_size, self.comm))
        #: the token subset the LM head reads (None: the whole vocabulary), and the keyword
        #: arguments of the backend's LM-head ops over it (a planned step's launches use both)
        self.vocab, self._lm_kw = (None, {}) if self.lm is None else (self.lm.vocab, self.lm.kw)
        #: this module's block (sizes, attention form, MLP kind: mtpkern/block.py); a sharded
        #: head's rank: its query / KV heads only
        b = config.block(index) if block is None else block
        self.block = b = b if self.shard is None else self.shard.block(b, f" (module {index})")
        #: whether this rank adds the residual of a partial sum (every unsharded head does)
        self._owner = self.shard is None or self.shard.owns_residual
        em = None if self.shard is None or not b.moe else self.shard.expert_map(config.n_routed_experts)
        #: router id -> this rank's expert (-1: another rank's), for an expert-parallel rank
        self._expert_map = None if em is None else backend.from_host(em)
        window = WindowRule(b.sliding_window, trim_margin, max_forward_rows) if b.sliding_window else None
        if getattr(backend, "kv_fp8", False):
            check_fp8_kv(b, index, config.hc_mult, self.shard is not None)
        self.pool = BlockPool(index, num_blocks, block_size, b.num_key_value_heads, b.head_dim, backend,
                              v_head_dim=b.v_dim, window=window, latent_width=b.latent_width,
                              index_width=b.index_width)
        self._inv_freq = backend.from_host(b.inv_freq())          # [R/2]: the default frequencies or YaRN's
        self._router = RouterSpec.from_config(config) if b.moe else None
        self._scale = b.scale
        self._gate_off = b.gate_offset          # the gate's columns of the fused projection (MLA: kv_a | gate)
        #: keyword arguments of the ops this block's features switch on (none: the plain calls)
        self._attn_kw = {"sinks": weights.sinks} if b.attn_sinks else {}
        #: RoPE pairs (2i, 2i + 1); YaRN's attention factor on cos / sin (its softmax factor is in b.scale)
        self._rope_kw = {k: v for k, v, on in (("interleave", True, b.rope_interleave),
                                               ("rope_scale", b.rope_scale, b.rope_scale != 1.0)) if on}
        #: the DSA indexer's RoPE: the MLA's frequencies and factor, its own pair order
        self._index_rope_kw = {k: v for k, v, on in (("interleave", True, b.indexer_rope_interleave),
                                                     ("rope_scale", b.rope_scale, b.rope_scale != 1.0)) if on}
        self._kv_kw = {"v_is_k": True} if b.shared_kv else {}
        #: the SwiGLU clamps; clamp_gate: of the gate before silu (DeepSeek-V4), not after
        gate = {"clamp_gate": True} if b.swiglu_clamp_gate else {}
        self._experts_kw = {"limit": b.swiglu_clamp, **gate} if b.swiglu_clamp else {}
        self._mlp_kw = {"limit": b.swiglu_clamp_shared, **gate} if b.swiglu_clamp_shared else {}
        if b.mlp_act != "swiglu":           # Nemotron-H's non-gated relu2 (w13: the up rows alone), Kimi K3's SiTU
            act = {"activation": b.mlp_act}
            if b.mlp_act == "situ":
                act.update(situ_beta=b.situ_beta, situ_linear_beta=b.situ_linear_beta)
            self._experts_kw = {**self._experts_kw, **act}
            self._mlp_kw = {**self._mlp_kw, **act}
        self._one_lock = threading.Lock()

    # -- the forward ---------------------------------------------------------
    def forward(self, jobs: list[RowJob], g: Any) -> tuple[Any, Any]:
        """Append and compute the rows of ``jobs`` on sequences from this head's
        ``alloc_seq`` (checked: holder, token ids, increasing keys); ``g``: [n, H]
        hidden states (host or backend, FP32/BF16). Returns ``(y, normed)``, both
        [n, H]. On error nothing is appended."""
        cfg = self.config
        self._check_open()
        n = 0
        for i, job in enumerate(jobs):
            if not isinstance(job, RowJob):
                raise TypeError(f"jobs[{i}]: expected a RowJob, got {type(job).__name__}")
            self.pool.check_holder(job.seq, self, name=f"jobs[{i}].seq")
            if job.holder not in (None, self):
                raise StateError(f"jobs[{i}].holder: expected this head (or None), got {type(job.holder).__name__}")
            toks = check_tokens(f"jobs[{i}].tokens", job.tokens, cfg.vocab_size)
            first = check_int(f"jobs[{i}].first_key", job.first_key, 0)
            last = job.seq.last_key
            if last is not None and toks.shape[0] and first <= last:
                raise ValueError(f"jobs[{i}].first_key: expected > {last} (the sequence's last key), got {first}")
            check_positions(f"jobs[{i}]", first + toks.shape[0] - 1 + job.key_to_pos, cfg.max_position_embeddings)
            jobs[i] = RowJob(job.seq, toks, first, job.key_to_pos, self)
            n += toks.shape[0]
        if len({id(j.seq) for j in jobs}) != len(jobs):
            raise ValueError("jobs: one sequence appears in two jobs")
        g = ingest_hidden(self.backend, "g", g, cfg.stream_size, rows=n)
        before = [j.seq.rows for j in jobs]
        try:
            with self._one_lock:
                out = self._forward(jobs, g)
        except BaseException:
            for j, r in zip(jobs, before):
                self.pool.trim(j.seq, j.seq.rows - r, self)
            raise
        for j in jobs:                               # done: rows out of the window go back
            self.pool.release_window(j.seq, self)
        return out

    def _forward(self, jobs: list[RowJob], g: Any, pad_tables: bool = False,
                 out_rows: np.ndarray | None = None) -> tuple[Any, Any]:
        """``forward`` for the proposer: ``jobs`` already checked, ``g`` [n, H] backend FP32.

        Blocks the rows need are taken here when the caller has not taken them ahead
        (``pool.grow_all``: ``KvCacheFull`` before any row is appended); the caller rolls
        the sequences back if this raises. ``pad_tables``: widen the block table to
        ``table_width`` (what a planned propose step uses, so that eager and captured
        steps launch the same shapes). ``out_rows``: the rows whose outputs are read (``compute``).
        """
        rows = self.append_rows(jobs, pad_tables)
        be = self.backend
        return self.compute(be.from_host(rows.tokens), g, be.from_host(rows.positions), be.from_host(rows.slots),
                            be.from_host(rows.tables), be.from_host(rows.row_seq), be.from_host(rows.row_len),
                            row_start=None if rows.row_start is None else be.from_host(rows.row_start),
                            out_rows=out_rows)

    def append_rows(self, jobs: list[RowJob], pad_tables: bool = False) -> "RowIndex":
        """Grow each job's sequence by its rows (keys recorded) and return the host
        index arrays of the forward: one entry per row, sequences in job order."""
        W = self.block.sliding_window
        positions: list[int] = []
        row_seq: list[int] = []
        row_len: list[int] = []
        row_start: list[int] = []                  # a window's first visible row, per row
        slots, tabs = [], []
        for s, job in enumerate(jobs):             # a few rows a job: Python lists, one array each at the end
            c = job.count
            first_row = self.pool.append(job.seq, job.first_key, c, job.holder)
            positions.extend(range(job.first_key + job.key_to_pos, job.first_key + job.key_to_pos + c))
            slots.append(self.pool.slots(job.seq, first_row, c))
            row_seq.extend([s] * c)
            row_len.extend(range(first_row + 1, first_row + c + 1))
            tabs.append(self.pool.table(job.seq))    # released entries as 0: never read (outside the window)
            if W:     # the first row whose key is > key - W (positions are keys + a constant)
                row_start.extend(job.seq._keys.rows_before(job.first_key + i - W + 1) for i in range(c))
        max_blocks = max([1] + [t.shape[0] for t in tabs])
        tables = np.zeros((len(jobs), table_width(max_blocks) if pad_tables else max_blocks), np.int32)
        for s, t in enumerate(tabs):
            tables[s, :t.shape[0]] = t
        i32 = np.int32
        return RowIndex(np.concatenate([j.tokens for j in jobs]).astype(i32, copy=False) if jobs else np.empty(0, i32),
                        np.array(positions, i32), np.concatenate(slots) if slots else np.empty(0, i32),
                        np.array(row_seq, i32), np.array(row_len, i32), tables,
                        np.array(row_start, i32) if W else None)

    def compute(self, tokens: Any, g: Any, positions: Any, slots: Any, tables: Any, row_seq: Any,
                row_len: Any, bufs: "ForwardBuffers | None" = None, row_start: Any = None,
                kv_copy: tuple[Any, Any] | None = None, out_rows: np.ndarray | None = None,
                part: str = "all", zero_embed: Any = None) -> tuple[Any, Any]:
        """The module's ops over rows whose KV slots and tables are known (backend arrays:
        ``tokens`` [n], ``g`` [n, H], ``positions`` / ``slots`` / ``row_seq`` / ``row_len``
        [n], ``tables`` [S, width]; ``row_start`` [n] the first KV row each row sees, for a
        sliding-window block). ``bufs``: every output and workspace preallocated (a planned
        step: nothing is allocated); None allocates as it goes. ``kv_copy``: (src, dst) slot
        arrays: once the rows' K/V are written, the cache rows ``dst`` take rows ``src``'s
        values, before any row attends (a draft tree's copy-on-write blocks, mtpkern.tree); or a
        callable that makes those copies (a planned tree step's segment copies, mtpkern.tree_plan).

        ``out_rows``: host indices of the rows whose outputs the caller reads (None: all).
        Every row's K/V is still written; only these rows then attend and go through o_proj,
        the FFN and the final norm, and ``(y, normed)`` hold them in this order; ``(None,
        None)`` when none is read. Each op computes a row from that row, its KV and the
        weights, so the rows read get a full forward's values, to rounding: NumPy's BLAS sums
        and the cpu attention's score tiles depend on how many rows a call holds
        (tests/test_exact_last_module.py). A planned step with ``bufs.pick`` runs the two
        halves as two launches, its segment copies between them moving the rows read into
        the pick's buffers: ``part="kv"`` up to the KV write (returns ``(None, None)``),
        ``part="rest"`` from the attention on, over those rows.

        ``zero_embed``: with ``embed_mask_pos0``, the rows' flags [n] (bool / int8 / uint8)
        of ``mtp_input`` (a planned step stages them: nothing is allocated; with hyper-connections
        and ``bufs`` [n m], each row's flag once per stream); None computes them,
        ``positions == EMBED_MASK_POSITION``. Without it, unused."""
        be = self.backend
        pick = None if bufs is None else bufs.pick
        if out_rows is not None and bufs is not None:
            raise ValueError("out_rows: not with bufs (a planned step names its rows in bufs.pick)")
        if (part != "all") != (pick is not None) or part not in ("all", "kv", "rest"):
            raise ValueError(f"part: expected 'kv' or 'rest' with bufs.pick, else 'all', got {part!r}")

        def put(op: str, **outs: str) -> dict:
            """Keyword arguments of one op: its output buffers (kwarg -> field of bufs)
            and its workspaces."""
            if bufs is None:
                return {}
            kw = {k: getattr(bufs, f) for k, f in outs.items()}
            kw.update(bufs.ws.get(op, {}))
            return kw

        index, ex = None, {}
        if part == "rest":
            if pick.q is None:
                raise ValueError("part: 'rest' of a module whose rows all stop at their K/V")
            x, q, qkv, ex = pick.x, pick.q, pick.qkv, pick.ex
            row_seq, row_len, row_start = pick.row_seq, pick.row_len, pick.row_start
        else:
            x, q, qkv, ex = self._write_kv(tokens, g, positions, slots, put, kv_copy, bufs, zero_embed)
            if part == "kv" or (out_rows is not None and not len(out_rows)):
                return None, None
            if out_rows is not None:         # the K/V of every row is in: the rows read go on
                sel = be.from_host(np.asarray(out_rows, np.int64))
                x, q, row_seq, row_len = x[sel], q[sel], row_seq[sel], row_len[sel]
                qkv = None if qkv is None else qkv[sel]
                ex = {k: v[sel] for k, v in ex.items()}
                row_start = None if row_start is None else row_start[sel]
        if "index_q" in ex:                  # DSA: each row's keys, picked once every row's key is in
            pools = {} if not self.block.kpool else {"kpool": self.block.kpool, "ape": self.w.idx_ape,
                                                     "tail": self.block.index_kpool_tail}
            index = be.dsa_select(ex["index_q"], ex["index_w"], self.pool.index_k, tables, row_seq, row_len,
                                  self.block.index_topk, self.block.index_scale,
                                  **({} if row_start is None else {"row_start": row_start}), **pools,
                                  **put("dsa_select", out="index"))                              # [n, T]
        return self._after_kv(x, q, qkv, tables, row_seq, row_len, row_start, put, bufs, index, ex)

    def _write_kv(self, tokens: Any, g: Any, positions: Any, slots: Any, put: Any, kv_copy: Any,
                  bufs: "ForwardBuffers | None", zero_embed: Any = None) -> tuple[Any, Any, Any, Any]:
        """mtp_input, input_layernorm and the projections that write the rows' K/V (MLA: the latent rows;
        DSA: the indexer keys too) -> ``(x, q, qkv, extra)``: the rows' o_proj residual [n, H] (with
        hyper-connections: the streams [n, m H]), the attention's queries [n, Hq, D] (RoPE applied), for
        an output gate the projection that carries it (q|k|v|gate, MLA: kv_a|gate; else None), and the
        per-row arrays later ops read (sliced with the rows read): with DSA the indexer's roped queries
        ``index_q`` [n, Hi, Di] and head weights ``index_w`` [n, Hi]; with hyper-connections the
        attention's ``hc_post`` [n, m] and ``hc_comb`` [n, m, m]."""
        be, w, b, cfg, eps = self.backend, self.w, self.block, self.config, self.config.rms_norm_eps
        ex: dict[str, Any] = {}
        m = cfg.hc_mult
        mask: dict[str, Any] = {}
        if cfg.embed_mask_pos0:              # vLLM's position-0 mask: the embedding half zero there
            mask["zero_embed"] = positions == EMBED_MASK_POSITION if zero_embed is None else zero_embed   # [n]
        if m > 1:                            # every stream through eh_proj with the token's embedding
            n = tokens.shape[0]
            if mask and bufs is None:
                mask["zero_embed"] = be.xp.repeat(mask["zero_embed"], m)                          # [n m]
            if bufs is None:
                toks, kw = self._repeat(tokens, m), {}
            else:                            # a planned step: its flags staged [n m], tokens copied m times
                bufs.copies["repeat_tokens"]()
                toks = bufs.tok_rep
                kw = {**put("mtp_input"), "out": bufs.x.reshape(n * m, cfg.hidden_size)}
            x = be.mtp_input(w.embed, toks, g.reshape(n * m, cfg.hidden_size), w.enorm,
                             w.hnorm, w.eh_proj, eps, **mask, **kw).reshape(n, m * cfg.hidden_size)   # [n, m H]
            u, ex["hc_post"], ex["hc_comb"] = self._hc_pre(x, w.hc_attn, bufs, "attn")             # [n, H]
        else:
            u = x = self._layer_input(tokens, g, mask, put)                                      # [n, H]
        xa, a_norm = self._normed_input(u, w.input_layernorm, bufs is not None)  # input_layernorm(u)
        if b.mla:
            q, ix, qkv = self._mla_write(xa, a_norm, positions, slots, put)                     # [n, Hq, P + R]
            if ix is not None:
                ex["index_q"], ex["index_w"] = ix
        else:
            if b.q_lora_rank:                # the query through its latent; w_qkv holds k | v
                kv = be.linear(xa, w.w_qkv, w.b_qkv, norm=a_norm, **put("linear", out="kv"))      # [n, (2Hkv)D]
                qc = be.linear(xa, w.mla_q_a, norm=a_norm, **put("linear", out="q_c"))          # [n, q_lora]
                qf = be.linear(qc, w.q_b, norm=(w.mla_q_a_norm, eps), **put("linear", out="q_lat"))  # [n, Hq D]
                if bufs is None:
                    qkv = be.xp.concatenate([qf, kv], axis=1)
                else:                        # q | k | v rows in the plan's qkv (segment copies)
                    bufs.copies["join_q"]()
                    qkv = bufs.qkv
            else:
                qkv = be.linear(xa, w.w_qkv, w.b_qkv, norm=a_norm, **put("linear", out="qkv"))   # [n, (Hq+2Hkv)D]
            q = be.qk_norm_rope_kv_write(qkv, b.num_attention_heads, b.num_key_value_heads,
                                         w.q_norm, w.k_norm, eps, self._inv_freq, positions,
                                         self.pool.k, self.pool.v, slots, **self._rope_kw, **self._kv_kw,
                                         **self.pool.scale_kw,
                                         **put("rope_kv", out="q"))                               # [n, Hq, D]
            if b.out_rope:
                ex["positions"] = positions
        if callable(kv_copy):
            kv_copy()
        elif kv_copy is not None:
            self.pool.copy_rows(*kv_copy)
        return x, q, (qkv if b.gate_size else None), ex

    def _layer_input(self, tokens: Any, g: Any, mask: dict, put: Any) -> Any:
        """The rows the decoder layer reads [n, H]: an MTP module's ``mtp_input`` (the token's
        embedding and the incoming hidden, each normed, through eh_proj); a target decoder layer
        (``DecoderLayer``) reads its residual stream ``g`` as it is."""
        w = self.w
        return self.backend.mtp_input(w.embed, tokens, g, w.enorm, w.hnorm, w.eh_proj, self.config.rms_norm_eps,
                                      **mask, **put("mtp_input", out="x"))

    def _final_norm(self, y: Any, bufs: "ForwardBuffers | None", put: Any) -> Any:
        """``shared_head_norm`` of the module's output, what its LM head and a postnorm chain read
        (a target decoder layer has none: ``DecoderLayer``)."""
        return self.backend.rmsnorm(self.head_input(y, bufs), self.w.shared_head_norm, self.config.rms_norm_eps,
                                    **put("rmsnorm", out="normed"))                              # [n, H]

    def _repeat(self, tokens: Any, m: int) -> Any:
        """Each token id ``m`` times in a row (a backend array, as ``tokens``)."""
        host = np.repeat(np.asarray(self.backend.to_host(tokens)), m).astype(np.int32)
        return self.backend.from_host(host)

    def _hc_pre(self, X: Any, hc: tuple, bufs: "ForwardBuffers | None" = None,
                which: str = "attn") -> tuple[Any, Any, Any]:
        """Hyper-connections' collapse of the streams ``X`` [n, m H] before a sublayer
        (mtpkern.ops.hc): ``(u [n, H], post [n, m], comb [n, m, m])``; ``bufs``: into its ``hc``
        buffers of the sublayer ``which`` ("attn" or "ffn")."""
        be, cfg = self.backend, self.config
        fn, base, scale = hc
        h = {} if bufs is None else bufs.hc
        mix = be.linear(X, fn, norm=(self.w.hc_ones, cfg.rms_norm_eps), out=h.get(f"mix_{which}"))  # [n, (2 + m) m]
        outs = {} if bufs is None else {"u": h[f"u_{which}"], "post": h["post" if which == "attn" else "post_ffn"],
                                        "comb": h["comb" if which == "attn" else "comb_ffn"]}
        return be.hc_pre(X, mix, base, scale, cfg.hc_eps, cfg.hc_sinkhorn_iters, **outs)

    def head_input(self, y: Any, bufs: "ForwardBuffers | None" = None) -> Any:
        """What the final norm reads of a module's output ``y``: ``y``, or with hyper-connections
        its streams collapsed by the module's ``hc_head_*`` (mtpkern.ops.hc.hc_head); ``bufs``:
        into its ``hc`` buffers ``mix_head`` and ``head``."""
        if self.config.hc_mult == 1:
            return y
        be, cfg = self.backend, self.config
        fn, base, scale = self.w.hc_head
        h = {} if bufs is None else bufs.hc
        mix = be.linear(y, fn, norm=(self.w.hc_ones, cfg.rms_norm_eps), out=h.get("mix_head"))   # [n, m]
        return be.hc_head(y, mix, base, scale, cfg.hc_eps, out=h.get("head"))                     # [n, H]

    def _after_kv(self, x: Any, q: Any, qkv: Any, tables: Any, row_seq: Any, row_len: Any, row_start: Any,
                  put: Any, bufs: "ForwardBuffers | None", index: Any = None,
                  ex: "dict | None" = None) -> tuple[Any, Any]:
        """The attention (and its output gate, or DSA's ``index`` of the rows each row reads), o_proj with the residual ``x``, the FFN and the
        final norm of the rows ``q`` holds -> ``(y, normed)``."""
        be, cfg, w, b = self.backend, self.config, self.w, self.block
        kw = {} if row_start is None else {"row_start": row_start}
        if b.mla:
            if index is not None:            # DSA: the rows the indexer picked (compute)
                kw["index"] = index
            o = be.mla_attention_absorbed(q, w.mla_uk, w.mla_uv, self.pool.k, tables, row_seq, row_len, self._scale,
                                          **kw, **put("mla_attention", out="o"))                # [n, Hq Dv]
        else:
            o = be.paged_attention(q, self.pool.k, self.pool.v, tables, row_seq, row_len, self._scale,
                                   **self._attn_kw, **kw, **self.pool.scale_kw,
                                   **put("attention", out="o"))                                   # [n, Hq Dv]
        if b.gate_size:                      # o * sigmoid(gate): the gate columns after q|k|v (MLA: kv_a)
            o = be.sigmoid_gate(o, qkv[:, self._gate_off:], **put("gate", out="o"))
        if b.out_rope:                       # the rotary dims back to the query's frame (DeepSeek-V4; not MLA)
            n = o.shape[0]
            o = be.rope_heads(o.reshape(n, b.num_attention_heads, b.v_dim), ex["positions"], self._inv_freq,
                              inverse=True, **self._rope_kw, **put("rope_heads", out="o_rot")).reshape(n, b.o_size)
        hc = cfg.hc_mult > 1
        res = None if hc or not self._owner else x
        if b.o_groups:                       # o_a_proj per group of heads, then o_b_proj
            if bufs is None:
                oa = be.linear_grouped(o, w.w_o_a)                                               # [n, g r]
            else:                            # linear_grouped in the plan's buffers
                bufs.copies["o_groups_in"]()                    # o -> o_in [g, n, Hq Dv / g]
                for i, wi in enumerate(w.w_o_a):
                    be.linear(bufs.o_in[i], wi, out=bufs.o_part[i])                              # [n, r]
                bufs.copies["o_groups_out"]()                   # o_part -> o_a [n, g r]
                oa = bufs.o_a
            r = be.linear(oa, w.w_o_b, None, res, **put("linear", out="r"))                     # [n, H]
        else:
            r = be.linear(o, w.w_o, None, res, **put("linear", out="r"))                       # [n, H]
        self._sum(r)                         # a sharded head: the heads' partial products
        if hc:                               # the streams after attention; the FFN's collapse
            r = be.hc_post(r, x, ex["hc_post"], ex["hc_comb"], **put("hc_post", out="streams"))  # [n, m H]
            u, f_post, f_comb = self._hc_pre(r, w.hc_ffn, bufs, "ffn")                           # [n, H]
        else:
            u = r
        f, f_norm = self._normed_input(u, w.post_attention_layernorm, bufs is not None)  # f_in
        res = None if hc or not self._owner else r
        yf = "ffn" if hc else "y"            # the FFN's output: with streams, before hc_post
        if b.moe:
            ids, wts = be.moe_router(f, w.gate_w, w.gate_bias, self._router, norm=f_norm,
                                     **put("router", ids="expert_ids", weights="expert_weights"))  # [n, K]
            if self._expert_map is not None:          # this rank's experts; -1: an empty slot
                ids = be.map_ids(self._expert_map, ids, out=None if bufs is None else bufs.local_ids)
            if w.latent_fc1 is not None:     # LatentMoE: the experts on fc1_latent_proj(f_in), back by fc2
                lat = be.linear(f, w.latent_fc1, norm=f_norm, **put("linear", out="lat"))      # [n, Lt]
                z = be.moe_experts(lat, ids, wts, w.experts_w13, w.experts_w2, **self._experts_kw,
                                   **put("latent_experts", out="lat_y"))                        # [n, Lt]
                z_norm = None
                if w.latent_norm is not None:    # moe_latent_norm (Kimi K3): RMSNorm of the weighted sum, whose
                    # weights carry routed_scaling_factor (the router's): the norm sees the scaled sum
                    self._sum(z)                 # a sharded head: the whole sum (the norm's weight on one rank)
                    z, z_norm = self._normed_input(z, w.latent_norm, bufs is not None)
                y = be.linear(z, w.latent_fc2, None, res, norm=z_norm, **put("linear", out=yf))  # [n, H]
            else:
                y = be.moe_experts(f, ids, wts, w.experts_w13, w.experts_w2, res, norm=f_norm,
                                   **self._experts_kw, **put("experts", out=yf))                # [n, H]
            if w.shared_gate is not None:    # y + sigmoid(f_in . w_g) * shared(f_in), one gate per row
                sh = be.swiglu_mlp(f, w.shared_w13, w.shared_w2, norm=f_norm, **self._mlp_kw,
                                   **put("shared", out="shared"))
                sg = be.linear(f, w.shared_gate, norm=f_norm, **put("linear", out="shared_gate"))  # [n, 1]
                y = be.sigmoid_gate(sh, sg, y, **put("gate", out=yf))
            elif w.shared_w13 is not None:
                y = be.swiglu_mlp(f, w.shared_w13, w.shared_w2, y, norm=f_norm, **self._mlp_kw,
                                  **put("shared", out=yf))
        else:                                # y = r + mlp(post_attention_layernorm(r))
            y = be.swiglu_mlp(f, w.mlp_w13, w.mlp_w2, res, norm=f_norm, **self._mlp_kw, **put("mlp", out=yf))
        self._sum(y)                         # a sharded head: the FFN slices' partial outputs
        if hc:                               # the streams the module hands on
            y = be.hc_post(y, r, f_post, f_comb, **put("hc_post", out="y"))                     # [n, m H]
        return y, self._final_norm(y, bufs, put)

    def _sum(self, buf: Any) -> None:
        """A sharded head's partial sums, ``buf`` in place: every rank's added (sum all-reduce)."""
        if self.comm is not None:
            self.comm.all_reduce(buf, "sum")

    def _normed_input(self, x: Any, g: Any, planned: bool) -> tuple[Any, "tuple[Any, float] | None"]:
        """The rows and ``norm=`` for the GEMVs that read ``rmsnorm(x) * g``: ``(x, (g, eps))``
        where the backend fuses the norm into them (the normalised rows never stored) or in
        a planned step (``ForwardBuffers`` holds no normed rows: each op applies it), else
        ``(rmsnorm(x), None)``, computed once for all its readers."""
        eps = self.config.rms_norm_eps
        if self.backend.fuses_norm or planned:
            return x, (g, eps)
        return self.backend.rmsnorm(x, g, eps), None

    def _mla_write(self, x: Any, a_norm: "tuple[Any, float] | None", positions: Any, slots: Any, put: Any) -> Any:
        """MLA's rows up to the attention, from ``input_layernorm(x)`` (x [n, H] and ``a_norm`` as
        ``_normed_input`` gives them: the norm fused into the GEMVs that read it, or already
        applied): the query through q_a_proj, q_a_layernorm and q_b_proj (or q_proj), the latent
        row from kv_a_proj_with_mqa, written (mtpkern.ops.mla) -> (the roped queries [n, Hq, P + R]
        for the absorbed attention (``_after_kv``), the DSA indexer's (roped queries [n, Hi, Di],
        head weights [n, Hi]) or None, with an element-wise output gate the fused kv_a | g_proj
        output [n, L + R + Hq Dv] whose last columns ``_after_kv`` gates with, else None). The
        indexer (mtpkern.ops.dsa) reads the normed query latent (q_a_layernorm, fused into its
        wq_b as into q_b_proj) and the normed hidden, and writes its key to the pool's indexer
        plane at the same slots."""
        be, w, b, eps = self.backend, self.w, self.block, self.config.rms_norm_eps
        n = x.shape[0]
        kv_ag = be.linear(x, w.mla_kv_a, norm=a_norm, **put("linear", out="kv_a"))               # [n, L + R (+ G)]
        W = b.latent_width
        kv_a = kv_ag[:, :W] if b.gate_size else kv_ag          # the latent row's columns; a gate's after them
        if w.mla_q_a is not None:
            qc = be.linear(x, w.mla_q_a, norm=a_norm, **put("linear", out="q_c"))                 # [n, q_lora]
            qf = be.linear(qc, w.w_qkv, norm=(w.mla_q_a_norm, eps), **put("linear", out="qkv"))   # [n, Hq (P + R)]
        else:
            qf = be.linear(x, w.w_qkv, norm=a_norm, **put("linear", out="qkv"))                   # [n, Hq (P + R)]
        q = be.mla_latent_write(kv_a, w.mla_kv_a_norm, eps, self._inv_freq, positions, self.pool.k, slots,
                                q=qf.reshape(n, b.num_attention_heads, b.head_dim), **self._rope_kw,
                                **put("mla_write", out="q"))                                      # [n, Hq, P + R]
        gated = kv_ag if b.gate_size else None
        if not b.dsa:
            return q, None, gated
        Hi, Di = b.index_n_heads, b.index_head_dim
        iq = be.linear(qc, w.idx_wq_b, norm=(w.mla_q_a_norm, eps), **put("linear", out="index_qr"))  # [n, Hi Di]
        ik = be.linear(x, w.idx_wk, norm=a_norm, **put("linear", out="index_k"))                  # [n, Di]
        iw = be.linear(x, w.idx_weights, norm=a_norm, **put("linear", out="index_w"))             # [n, Hi]
        pooled = {} if not b.kpool else {"gate": be.linear(x, w.idx_gate, norm=a_norm,
                                                           **put("linear", out="index_gate"))}   # [n, Di]
        iq = be.dsa_key_write(ik, w.idx_k_norm_w, w.idx_k_norm_b, DSA_NORM_EPS, self._inv_freq, positions,
                              self.pool.index_k, slots, q=iq.reshape(n, Hi, Di), **self._index_rope_kw, **pooled,
                              **put("dsa_key_write", out="index_q"))                              # [n, Hi, Di]
        return q, (iq, iw), gated

    # -- the LM head (mtpkern.lm) ----------------------------------------------------
    def argmax(self, normed_rows: Any, bitmask: np.ndarray | None = None) -> np.ndarray:
        """Drafts for ``normed_rows`` [n, H] (``LmHead.argmax``)."""
        return self.lm.argmax(normed_rows, bitmask)

    def argmax_conf(self, normed_rows: Any, bitmask: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Drafts and their confidences (``LmHead.argmax_conf``)."""
        return self.lm.argmax_conf(normed_rows, bitmask)

    def sample(self, normed_rows: Any, bitmask: np.ndarray | None, keys: np.ndarray, params: list,
               want_dist: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Sampled drafts, their probabilities, the distributions (``LmHead.sample``)."""
        return self.lm.sample(normed_rows, bitmask, keys, params, want_dist)

    def topk(self, normed_rows: Any, bitmask: np.ndarray | None, k: int) -> tuple[np.ndarray, np.ndarray]:
        """A draft tree's candidates (``LmHead.topk``)."""
        return self.lm.topk(normed_rows, bitmask, k)

    def logits(self, normed_rows: Any) -> np.ndarray:
        """[n, V] FP32 logits on the host (``LmHead.logits``)."""
        return self.lm.logits(normed_rows)

    # -- one row, for engines that drive a single module ------------------------
    def alloc_seq(self) -> SeqKv:
        """A sequence of this module's pool for ``forward_one`` (free it with ``free_seq``)."""
        return self.pool.new_seq(self)

    def free_seq(self, seq: SeqKv) -> None:
        """Return ``seq``'s blocks; ``seq`` must come from this head's ``alloc_seq``."""
        with self._one_lock:
            self.pool.retire(seq, self)

    def _check_open(self) -> None:
        if self.pool.closed:
            raise StateError(f"module {self.index}: closed (its proposer's close() released its pool and weights)")

    def forward_one(self, token: int, hidden: Any, position: int, seq: SeqKv, key: int | None = None,
                    grammar_bitmask: np.ndarray | None = None) -> HeadStep:
        """Append one row (``token``, ``hidden`` [H] or [1, H], RoPE ``position``) to ``seq``
        (from this head's ``alloc_seq``) and draft the next token. ``key`` defaults to
        ``position - 1 - index``. On error nothing is appended. Calls are serialised
        per head (one module's single-row API is not where concurrency pays)."""
        cfg = self.config
        self._check_open()
        self.pool.check_holder(seq, self)
        token = check_token("token", token, cfg.vocab_size)
        position = check_int("position", position, self.index + 1)
        check_positions("position", position, cfg.max_position_embeddings)
        key = position - 1 - self.index if key is None else check_int("key", key, 0)
        if key + self.index + 1 != position:
            raise ValueError(f"key: expected position - 1 - index = {position - 1 - self.index}, got {key}")
        g = ingest_hidden(self.backend, "hidden", hidden, cfg.stream_size, rows=1)
        bm = None
        if grammar_bitmask is not None:
            from .grammar import one_mask

            bm = one_mask("grammar_bitmask", grammar_bitmask, cfg.vocab_size)[None, :]
        with self._one_lock:
            last = seq.last_key
            if last is not None and key <= last:
                raise ValueError(f"key: expected > {last} (the sequence's last key), got {key}")
            before = seq.rows
            self.pool.grow(seq, 1, self)
            try:
                y, normed = self._forward([RowJob(seq, np.array([token], np.int32), key, self.index + 1, self)], g)
                draft = int(self.argmax(normed, bm)[0])
            except BaseException:
                self.pool.trim(seq, seq.rows - before, self)
                raise
            self.pool.release_window(seq, self)
        return HeadStep(draft, y, normed)


class DecoderLayer(MtpHead):
    """A target model's decoder layer with its own KV block pool: an MTP module's block without
    ``enorm`` / ``hnorm`` / ``eh_proj`` (its rows enter as the residual stream ``g`` itself) and
    without ``shared_head`` (``forward`` returns ``(y, None)``: the layer's output, which the next
    layer reads). The attention, the FFN and the KV rows are ``MtpHead``'s, op for op::

        r = g + o_proj @ attn(input_layernorm(g), p)       # over this layer's paged KV, causal
        y = r + ffn(post_attention_layernorm(r))           # dense SwiGLU or MoE (+ shared experts)

    ``weights``: a ``ModuleWeights`` whose ``embed``, ``head``, ``enorm``, ``hnorm``, ``eh_proj`` and
    ``shared_head_norm`` are None (``weights.load_target_weights``); ``block``: the layer's (dense
    for GLM-4.5's first ``first_k_dense_replace`` layers, MoE after). Rows use key = position
    (``RowJob.key_to_pos`` 0). Used by ``mtpkern.target.ReferenceTarget``."""

    def __init__(self, layer: int, config: MtpConfig, weights: ModuleWeights, backend: Any, num_blocks: int,
                 block_size: int, block: BlockSpec):
        if config.hc_mult != 1 or block.mla or config.embed_mask_pos0:
            raise ValueError(f"layer {layer}: a target decoder layer runs a GQA block without hyper-connections or "
                             f"an embedding mask, got mla={block.mla}, hc_mult={config.hc_mult}, "
                             f"embed_mask_pos0={config.embed_mask_pos0}")
        super().__init__(layer, config, weights, backend, num_blocks, block_size, block=block)

    def _layer_input(self, tokens: Any, g: Any, mask: dict, put: Any) -> Any:
        return g

    def forward_one(self, *args: Any, **kwargs: Any) -> HeadStep:
        raise TypeError("forward_one: a target decoder layer has no LM head to draft with; its rows go "
                        "through forward(jobs, g), which returns (y, None)")

    def _final_norm(self, y: Any, bufs: "ForwardBuffers | None", put: Any) -> Any:
        return None
