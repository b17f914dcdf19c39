"""``MultiModuleMtpHead``: the multi-module MTP draft proposer (docs/semantics.md, docs/api.md).

The public calls, each in the same four steps:

1. **who**: every state is checked against the proposer's registry (the very
   object ``alloc_state`` returned, live; a copy or a freed one is refused) and
   held for the call (``state.exclusive``: one call per state at a time);
2. **what**: every argument is validated (``mtpkern.checks``), nothing changed yet;
3. **room**: the KV blocks the call needs are taken in every module's pool as one
   step per pool (``txn.guarded``), or ``KvCacheFull`` and nothing changed;
4. **compute**: the modules run; if anything raises, every touched state is
   rolled back (rows truncated, blocks returned, counters restored).

The pieces, each readable alone: ``state.py`` (states, carried entries,
counters, snapshots), ``carry.py`` (the
registry of carried KV), ``txn.py`` (room and rollback), ``kv.py`` (pools and
block ownership), ``head.py`` (one module's forward).

The KV modes' rules and forwards: ``draft.py`` (one row per drafting module
per propose, module 0's rows of the verified tokens a catch-up gives) and
``exact.py`` (every module equal to a recomputation), behind one interface
(``self.mode``).

**Threads** (docs/api.md): calls on distinct states may run concurrently from
any threads; a state used by a second call while one runs gets ``StateError``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Literal, Sequence

import numpy as np

from .backends import BackendName, get_backend
from .backends.base import Backend
from .carry import CarryRegistry
from .comm import check_comm
from .checks import (INT32_MAX, check_bool, check_int, check_list, check_out_conf, check_out_list, check_positions,
                     check_probability, check_sampling, check_token, check_tokens, ingest_hidden, shape_of)
from .config import MtpConfig, ceil_div
from .schedule import expand as expand_schedule
from .schedule import resolve as resolve_schedule
from .ops.sampling import SamplingParams, row_keys
from .vocab import DraftVocab
from .errors import CheckpointError, NoAllowedToken, StateError, no_token_reason, no_token_where
from .draft import DraftChain
from .exact import ExactChain
from .grammar import MaskFn, resolve
from .head import MtpHead
from .kv import BlockPool, check_fp8_kv
from .models import family
from .shard import Shard, agreement, check_experts, sharded_call
from .state import AcceptanceStats, DrafterKv, MtpState, exclusive, is_busy
from .trait import DraftProposer, ProposerState
from .tree import DraftTree, TreeJob, TreeRunner, check_shape, check_shapes
from .txn import fill_list, guarded
from .weights import MtpWeights, load_weights

KvMode = Literal["draft", "exact"]
Chain = Literal["prenorm", "postnorm"]
_log = logging.getLogger("mtpkern")

__all__ = ["AcceptanceStats", "DrafterKv", "MemoryUse", "MtpState", "MultiModuleMtpHead"]


def arg_namer(single: bool) -> Callable[..., str]:
    """A call's argument names in its errors: ``name(one, many, i)`` is the single call's
    ``one`` (``last_token``), or the batch call's ``many`` (``last_tokens``), indexed by ``i``
    when given (``last_tokens[2]``)."""
    def name(one: str, many: str, i: int | None = None) -> str:
        return one if single else many if i is None else f"{many}[{i}]"
    return name


def _check_modes(kv_mode: Any, chain: Any) -> None:
    if kv_mode not in ("draft", "exact"):
        raise ValueError(f"kv_mode: expected 'draft' or 'exact', got {kv_mode!r}")
    if chain is not None and chain not in ("prenorm", "postnorm"):
        raise ValueError(f"chain: expected 'prenorm', 'postnorm' or None (the family's), got {chain!r}")


@dataclass(frozen=True, slots=True)
class MemoryUse:
    """What a proposer holds, in bytes (``MultiModuleMtpHead.memory()``)."""

    weights: int                 # every distinct weight array (a shared [V, H] matrix once)
    kv_pools: int                # K and V caches of every module's pool, allocated up front
    kv_block: int                # one block of module 0: K and V (or MLA latent rows), block_size rows
    kv_in_use: int               # blocks owned by states and carried entries, all modules
    blocks_in_use: tuple[int, ...]
    #: per module, the KV bytes of one token: K and V of every KV head, or one MLA latent
    #: row (kv_lora_rank + qk_rope_head_dim values), in the backend's kv_dtype
    kv_row_bytes: tuple[int, ...] = ()

    @property
    def total(self) -> int:
        return self.weights + self.kv_pools


def _subset_heads(weights: MtpWeights, backend: Backend, vocab: DraftVocab) -> MtpWeights:
    """``weights`` with each module's LM head cut to ``vocab``'s rows (one copy per distinct
    head: modules that share a head share its subset)."""
    idx = backend.from_host(vocab.ids.astype(np.int64))
    cut: dict[int, Any] = {}
    modules = []
    for m, mw in enumerate(weights.modules):
        if not hasattr(mw.head, "shape") or type(mw.head).__name__.endswith("Fp8"):
            raise TypeError(f"draft_vocab: module {m}'s LM head is {type(mw.head).__name__}; a subset of an FP8 "
                            f"head is not supported (releases keep the LM head in BF16)")
        if id(mw.head) not in cut:
            cut[id(mw.head)] = backend.xp.ascontiguousarray(backend.xp.take(mw.head, idx, axis=0))
        modules.append(dataclasses.replace(mw, head=cut[id(mw.head)]))
    return dataclasses.replace(weights, modules=modules)


def _check_shard(weights: MtpWeights, comm: Any) -> Shard | None:
    """The shard ``weights`` were loaded as, checked against ``comm`` (its rank and size):
    a sharded head needs both, alike; a world of one rank is the unsharded head."""
    shard = weights.shard
    if comm is None:
        if shard is not None and shard.size > 1:
            raise ValueError(f"comm: weights are rank {shard.rank} of a {shard.size}-rank shard; expected the "
                             f"communicator they were loaded for, got None")
        return None
    check_comm(comm)
    if comm.size == 1:
        if shard is not None and shard.size > 1:
            raise ValueError(f"comm: a world of one rank, but weights are rank {shard.rank} of {shard.size}")
        return None
    if shard is None or (shard.rank, shard.size) != (comm.rank, comm.size):
        got = "the whole head" if shard is None else f"rank {shard.rank} of {shard.size}"
        raise ValueError(f"weights: expected rank {comm.rank} of {comm.size}'s shard (load_weights(..., shard=)), "
                         f"got {got}")
    return shard


def _check_sharded_vocab(weights: MtpWeights, vocab: DraftVocab | None) -> None:
    """A sharded head's LM head rows are read at load for one vocabulary (the whole, or a
    draft vocabulary's ids: ``load_weights(..., head_ids=)``): ``draft_vocab`` must be it."""
    have = weights.head_ids
    if (vocab is None) != (have is None) or (vocab is not None and not np.array_equal(vocab.ids, have)):
        what = "the whole vocabulary" if have is None else f"a draft vocabulary of {have.shape[0]} tokens"
        got = "none" if vocab is None else f"{vocab.size} tokens"
        raise ValueError(f"draft_vocab: a sharded head's LM heads were read for {what} (load_weights(..., "
                         f"head_ids=), from_pretrained(..., draft_vocab=)); got {got}")


def _copy_counters(src: MtpState, st: MtpState) -> None:
    """A fork's counters: ``src``'s (its lists copied; the exact-mode window's arrays are never
    written in place, so both states may read them)."""
    st._num_verified, st._num_hiddens, st._next_position = src._num_verified, src._num_hiddens, src._next_position
    st._tail, st._tail_start = list(src._tail), src._tail_start
    st._win, st._win_start = list(src._win), list(src._win_start)
    st._last_position, st._last_k, st._last_drafts = src._last_position, src._last_k, list(src._last_drafts)


def _draft_prefix(st: MtpState, L: int, h: int) -> None:
    """Draft mode after a share of ``L`` tokens cut at ``h`` hiddens: as ``prefill_drafter``
    of them leaves a state when ``h = L - 1``; else awaiting the catch-up of ``t_{h+1} ..``."""
    st._num_verified = st._tail_start = st._next_position = L
    st._num_hiddens = h


def _exact_prefix(st: MtpState, toks: np.ndarray, h: int, wins: list) -> None:
    """Exact mode after a share of ``L = len(toks)`` tokens cut at ``h`` hiddens: the tokens
    past ``h`` are the tail the catch-up's first rows read; each module's window holds the
    chained outputs of its keys the next module has not reached."""
    L = int(toks.shape[0])
    st._num_verified = st._next_position = L
    st._num_hiddens = h
    st._tail, st._tail_start = [int(t) for t in toks[h + 1:]], h + 1
    st._win = [w for _, w in wins]
    st._win_start = [ws for ws, _ in wins]


@dataclass(slots=True)
class _Sampled:
    """One propose's sampling: per sequence its ``SamplingParams`` or None (argmax) and its
    position; the per-sequence lists of probabilities / distributions being filled (None
    when not asked)."""

    params: list
    positions: list
    want_dist: bool
    probs: list | None
    dists: list | None

    @staticmethod
    def of(sampling: list | None, positions: list, want_prob: bool, want_dist: bool, B: int) -> _Sampled | None:
        if sampling is None and not want_prob and not want_dist:
            return None
        return _Sampled([None] * B if sampling is None else list(sampling), list(positions), want_dist,
                        [[] for _ in range(B)] if want_prob else None, [[] for _ in range(B)] if want_dist else None)


class MultiModuleMtpHead(DraftProposer):
    """Independent MTP modules, one per draft slot, each with its own weights and paged KV.

    Build with ``from_pretrained``. All methods validate their arguments and
    leave every state unchanged when they raise.
    """

    #: default pool size per module, in tokens, when num_blocks is None
    DEFAULT_KV_TOKENS = 32768

    def __init__(self, config: MtpConfig, weights: MtpWeights, backend: Backend, *,
                 kv_mode: KvMode = "exact", chain: Chain | None = None, block_size: int = 16,
                 num_blocks: int | None = None, max_batch: int = 64, prefill_chunk: int = 256,
                 cuda_graphs: bool = True, draft_vocab: Any = None, module_schedule: Any = None,
                 max_drafts: int | None = None, comm: Any = None):
        """``draft_vocab``: None, or the token subset the LM heads read (an array of target
        ids or a ``.npy`` / text file of them; mtpkern.vocab): drafts and masks stay in
        target ids, a head reads ``V' / V`` of its bytes; ``weights`` is not changed (the
        modules get subset copies of their heads). ``module_schedule`` / ``max_drafts``:
        the module each draft step runs (mtpkern.schedule: None or "clamp", "last" or
        "cycle" with ``max_drafts``, or a list); the proposer's modules are then the steps
        (``num_modules`` = steps, ``config`` the expanded one, ``module_schedule`` the list).
        ``comm``: a communicator (mtpkern.comm) when ``weights`` are one rank's slice of a sharded
        head (``load_weights(..., shard=)``, ``from_pretrained(..., comm=)``): every rank makes
        the same calls with the same arguments, and they meet in its collectives
        (docs/distributed.md)."""
        _check_modes(kv_mode, chain)
        shard = _check_shard(weights, comm)
        block_size = check_int("block_size", block_size, 1)
        if num_blocks is None:
            num_blocks = ceil_div(self.DEFAULT_KV_TOKENS, block_size)
        num_blocks = check_int("num_blocks", num_blocks, 1)
        self.max_batch = check_int("max_batch", max_batch, 1, INT32_MAX)
        self.prefill_chunk = check_int("prefill_chunk", prefill_chunk, 1, INT32_MAX)
        cuda_graphs = check_bool("cuda_graphs", cuda_graphs)
        if len(weights.modules) != config.num_modules:
            raise ValueError(f"weights: expected {config.num_modules} modules, got {len(weights.modules)}")
        #: draft step s runs the weights of module_schedule[s] (mtpkern.schedule)
        self.module_schedule = resolve_schedule(module_schedule, config.num_modules, max_drafts)
        config, weights = expand_schedule(config, weights, self.module_schedule)
        self._check_pool_size(config, backend, num_blocks, block_size, shard)
        if getattr(backend, "kv_fp8", False):       # refused before any pool is allocated
            for m in range(config.num_modules):
                check_fp8_kv(config.block(m), m, config.hc_mult, shard is not None)
            if cuda_graphs and backend.name == "cuda":
                raise ValueError("cuda_graphs: the planned (captured) propose step does not take an FP8 KV cache "
                                 "yet (kv_dtype 'fp8'); expected cuda_graphs=False, got True")
        #: the LM heads' token subset (mtpkern.vocab.DraftVocab), or None: the whole vocabulary
        self.draft_vocab = None if draft_vocab is None else DraftVocab(draft_vocab, config.vocab_size)
        if shard is not None:                       # a sharded head reads its vocabulary's rows at load
            _check_sharded_vocab(weights, self.draft_vocab)
        elif self.draft_vocab is not None:
            weights = _subset_heads(weights, backend, self.draft_vocab)
        self.config = config
        self.weights = weights
        self.backend = backend
        self.kv_mode: KvMode = kv_mode
        #: None: the family's (its reference implementation's; "prenorm" but for Qwen3-Next)
        self.chain: Chain = family(config.family).chain if chain is None else chain
        chain = self.chain
        if config.hc_mult > 1 and chain != "prenorm":
            raise ValueError(f"chain: a module with hyper-connections (hc_mult = {config.hc_mult}) hands on its "
                             f"streams ('prenorm'); its normed output is one collapsed hidden, got {chain!r}")
        if config.hc_mult > 1 and weights.target_norm is not None:
            raise ValueError("apply_target_norm: the target hands hyper-connection streams (hc_mult = "
                             f"{config.hc_mult}), which its final norm never reads; expected False")
        self.block_size = block_size
        self.num_blocks = num_blocks
        # A sliding-window module's pool keeps what its window may read after the trims the
        # KV mode allows (trim_margin), and one forward appends at most a chunk + M rows.
        rules = ExactChain if kv_mode == "exact" else DraftChain
        #: the communicator and this rank's slice of a sharded head (None, None: one rank)
        self.comm, self.shard = (comm, shard) if shard is not None else (None, None)
        #: a sharded head's ranks agree on every call before running it (docs/distributed.md, "Agreement")
        self.agree_calls = True
        self.modules = [MtpHead(m, config, mw, backend, num_blocks, block_size, trim_margin=rules.trim_margin(m),
                                max_forward_rows=self.prefill_chunk + config.num_modules, vocab=self.draft_vocab,
                                comm=self.comm, shard=self.shard)
                        for m, mw in enumerate(weights.modules)]
        self.pools = [h.pool for h in self.modules]
        self.exact = ExactChain(self.modules, backend, chain, self.prefill_chunk)
        #: the KV mode's rules and forwards (mtpkern.exact / mtpkern.draft)
        self.mode: ExactChain | DraftChain = (self.exact if kv_mode == "exact" else
                                              DraftChain(self.modules, chain, self.prefill_chunk))
        self.carry = CarryRegistry(self, self.modules)
        #: draft trees (mtpkern.tree): propose_tree / after_verify_tree
        self.trees = TreeRunner(self.modules, backend, chain, self.exact if kv_mode == "exact" else None)
        self.stats = AcceptanceStats([0] * config.num_modules, [0] * config.num_modules)
        self.clamped_calls = 0      # proposes whose num_drafts exceeded num_modules
        self._states: dict[int, MtpState] = {}
        #: held while the registries change (states, carried entries) and while they are
        #: checked, so check_invariants sees them consistent; also guards the counters
        self._lock = threading.RLock()
        self._closed = False
        self._last_drafts: list[int] = []
        #: [B, k'] int32 drafts of the last propose (on any thread), on the backend (a CuPy
        #: array on cuda; a fresh array per propose), for an engine that verifies on the device
        self.last_drafts_device: Any = None
        #: the planned propose step (mtpkern.cuda_graph): captured and replayed as a
        #: CUDA graph on the cuda backend when ``cuda_graphs``; None runs every step eagerly
        self.step_runner: Any = None
        if cuda_graphs and backend.name == "cuda":
            from .cuda_graph import StepRunner

            self.step_runner = StepRunner(self, capture=True)

    @staticmethod
    def _check_pool_size(cfg: MtpConfig, backend: Backend, num_blocks: int, block_size: int,
                         shard: Shard | None = None) -> None:
        """Refuse pools that cannot fit where the backend allocates them: the K/V caches are
        allocated up front, M modules x num_blocks x block_size rows x Hkv x D (K and V)."""
        if not 1 <= num_blocks <= BlockPool.MAX_BLOCKS or not 1 <= block_size <= BlockPool.MAX_BLOCKS // num_blocks:
            raise ValueError(f"num_blocks, block_size: expected num_blocks * block_size <= "
                             f"{BlockPool.MAX_BLOCKS} (int32 slots), got {num_blocks} * {block_size}")
        item = np.dtype(backend.kv_dtype).itemsize
        blocks = [cfg.block(m) for m in range(cfg.num_modules)]
        if shard is not None:                        # a rank's pools hold its KV heads only
            blocks = [shard.block(b, f" (module {m})") for m, b in enumerate(blocks)]
        # an FP8 cache's scale planes: 4 bytes per row and KV head, of K and of V
        scales = (lambda b: 2 * 4 * b.num_key_value_heads) if getattr(backend, "kv_fp8", False) else (lambda b: 0)
        sizes = [BlockPool.bytes_per_block(block_size, b.kv_row_values, item) + block_size * scales(b)
                 for b in blocks]
        need = num_blocks * sum(sizes)
        have = backend.memory_bytes()
        if have is not None and need > have:
            per = f"{sizes[0]} B" if len(set(sizes)) == 1 else f"{'/'.join(map(str, sizes))} B by module"
            raise ValueError(f"num_blocks: the KV pools would take {need / 2**30:.1f} GiB ({cfg.num_modules} modules x "
                             f"{num_blocks} blocks x {per}: block_size {block_size}, Hkv "
                             f"{cfg.num_key_value_heads}, D {cfg.head_dim}), more than the {have / 2**30:.1f} GiB "
                             f"the {backend.name} backend has; pass a smaller num_blocks")

    @classmethod
    def from_pretrained(cls, ckpt_dir: str | os.PathLike, backend: "BackendName | Backend" = "auto",
                        kv_mode: KvMode = "exact", chain: Chain | None = None,
                        apply_target_norm: bool = False, block_size: int = 16,
                        num_blocks: int | None = None, max_batch: int = 64,
                        prefill_chunk: int = 256, cuda_graphs: bool = True,
                        threads: int | None = None, allow_unused_tensors: bool = False,
                        draft_vocab: Any = None, module_schedule: Any = None,
                        max_drafts: int | None = None, comm: Any = None,
                        experts: str = "ep") -> "MultiModuleMtpHead":
        """Load the MTP modules of the checkpoint at ``ckpt_dir`` (``config.json`` + safetensors).

        ``apply_target_norm``: the engine hands pre-norm target hiddens; apply the
        target's ``model.norm.weight`` to them first. ``num_blocks``: blocks per
        module pool (default: ``DEFAULT_KV_TOKENS / block_size``). ``cuda_graphs``: on the
        cuda backend, capture the steady-state propose step once per shape and replay it
        as a CUDA graph (docs/cuda.md); ignored by the other backends. ``threads``: the cpu
        backend's Numba threads (default: half the cores, so as not to spin against the
        engine's own threads; docs/cpu.md); refused with numpy, cuda or a Backend object,
        ignored when ``"auto"`` picks cuda. ``allow_unused_tensors``: load a checkpoint that
        holds tensors under a module's prefix which the config would not read (refused by
        default, naming the tensor and the config field: docs/checkpoints.md). ``draft_vocab``:
        the LM heads' token subset; ``module_schedule`` / ``max_drafts``: the module each draft
        step runs (see ``__init__``). ``comm``: a communicator of ``size > 1`` ranks
        (mtpkern.comm; every rank calls this alike): each rank reads only its slice of the
        checkpoint (mtpkern.shard: attention heads, ``experts`` "ep" by expert id or "tp" by
        intermediate slice, LM head rows) and the proposer is sharded (``needs_comm()``).
        """
        _check_modes(kv_mode, chain)
        apply_target_norm = check_bool("apply_target_norm", apply_target_norm)
        if not os.path.isdir(ckpt_dir):
            what = "is a file; expected the directory that holds it" if os.path.exists(ckpt_dir) else "not found"
            raise CheckpointError(f"ckpt_dir: {os.fspath(ckpt_dir)!r} {what} (config.json and *.safetensors)")
        cfg = MtpConfig.from_json(os.path.join(os.fspath(ckpt_dir), "config.json"))
        be = get_backend(backend, threads=threads)
        shard = None
        experts = check_experts(experts)
        if comm is not None:
            check_comm(comm)
            shard = Shard.of(comm, experts) if comm.size > 1 else None
        head_ids = None                     # a sharded head reads its draft vocabulary's rows at load
        if shard is not None and draft_vocab is not None:
            draft_vocab = head_ids = DraftVocab(draft_vocab, cfg.vocab_size).ids
        weights = load_weights(ckpt_dir, cfg, be, apply_target_norm=apply_target_norm,
                               allow_unused_tensors=check_bool("allow_unused_tensors", allow_unused_tensors),
                               shard=shard, head_ids=head_ids)
        return cls(cfg, weights, be, kv_mode=kv_mode, chain=chain, block_size=block_size,
                   num_blocks=num_blocks, max_batch=max_batch, prefill_chunk=prefill_chunk,
                   cuda_graphs=cuda_graphs, draft_vocab=draft_vocab, module_schedule=module_schedule,
                   max_drafts=max_drafts, comm=comm)

    def __repr__(self) -> str:
        closed = ", closed" if self._closed else ""
        return (f"MultiModuleMtpHead({self.config.describe()}, backend={self.backend.name}, "
                f"kv_mode={self.kv_mode}, chain={self.chain}, blocks={self.num_blocks}x{self.block_size}{closed})")

    # -- queries -------------------------------------------------------------------
    @property
    def num_modules(self) -> int:
        return self.config.num_modules

    @property
    def window(self) -> int:
        """Chained outputs kept per module in exact mode (trailing keys)."""
        return self.exact.window

    def kv_blocks_in_use(self) -> list[int]:
        return [p.num_used for p in self.pools]

    def memory(self) -> MemoryUse:
        """Bytes held: weights (each distinct array once) and the KV pools (allocated at
        construction: ``num_blocks`` blocks of ``kv_block`` bytes per module)."""
        self._check_open()
        seen: dict[int, int] = {}
        for mw in self.weights.modules:
            for f in mw.__slots__:
                a = getattr(mw, f)
                if a is not None and hasattr(a, "nbytes"):
                    seen[id(a)] = int(a.nbytes)
        tn = self.weights.target_norm
        if tn is not None:
            seen[id(tn)] = int(tn.nbytes)
        used = tuple(self.kv_blocks_in_use())
        blocks = [p.block_bytes() for p in self.pools]     # modules may differ (their own blocks)
        return MemoryUse(sum(seen.values()), sum(blocks) * self.num_blocks, blocks[0],
                         sum(b * u for b, u in zip(blocks, used)), used,
                         tuple(b // self.block_size for b in blocks))

    def drafter_rows(self, state: ProposerState) -> int:
        """Module 0's rows (``rows_per_module`` on the state gives every module's)."""
        return self._idle(state).kv[0].rows

    def last_pair_key(self, state: ProposerState) -> int | None:
        """Key of module 0's newest row; None when it has none."""
        return self._idle(state).kv[0].last_key

    def needs_comm(self) -> bool:
        """True when the head is sharded over a communicator of more than one rank: every
        rank must make the same calls, with the same arguments, in the same order."""
        return self.comm is not None

    def propose_batch_max(self) -> int:
        """The widest ``propose_batch``: ``max_batch``, and no more sequences than a
        module's pool has blocks (each sequence of a propose writes a row into module 0,
        so holds at least one block there). Nothing else is sized per batch width: step
        buffers are built per batch shape."""
        return min(self.max_batch, min(p.num_blocks for p in self.pools))

    def prefill_hidden_rows(self, max_seq_len: int) -> int:
        """Every prompt row is used (prefill runs in chunks of ``prefill_chunk``)."""
        return check_int("max_seq_len", max_seq_len, 0, INT32_MAX)

    def read_deferred_draft_token(self, state: ProposerState | None = None) -> int:
        """The last draft the last propose produced (of ``state``, or of any sequence on
        any thread), also when fewer than M modules ran."""
        drafts = self._last_drafts if state is None else self._idle(state)._last_drafts
        if not drafts:
            raise StateError("read_deferred_draft_token: no propose has produced a draft yet")
        return drafts[-1]

    # -- state lifecycle --------------------------------------------------------------
    def alloc_state(self) -> MtpState:
        st = MtpState(self, self.num_modules)
        with self._lock:                                 # the pools and the registry, as one step
            self._check_open()
            st._kv = tuple(p.new_seq(st) for p in self.pools)
            self._states[id(st)] = st
        return st

    def alloc_state_for(self, budget_tokens: int | None) -> MtpState:
        """A state whose KV for a sequence of ``budget_tokens`` tokens (prompt + max new
        tokens, as the engine counts them) is reserved in every module's pool now, so it
        cannot meet a full pool while it stays within the budget. The reservation also
        covers the draft lookahead: a verify may accept up to M drafts past the budget's
        last token, so each module holds back ``ceil((budget_tokens + M) / block_size)``
        blocks; a sliding-window module no more than its window needs, whatever the
        length (``BlockPool.blocks_for_tokens``, docs/api.md, "Sliding-window modules: memory").
        ``None``: unknown budget, same as ``alloc_state``. Raises ``KvCacheFull``
        (allocating nothing) when the pools cannot promise it."""
        if budget_tokens is None:
            return self.alloc_state()
        budget_tokens = check_int("budget_tokens", budget_tokens, 1, INT32_MAX)
        st = self.alloc_state()
        try:
            for p, seq in zip(self.pools, st._kv):
                p.reserve(seq, p.blocks_for_tokens(budget_tokens + self.num_modules), st)
        except BaseException:
            self.free_state(st)
            raise
        return st

    def free_state(self, state: ProposerState) -> None:
        with self._use([state], "free_state", allow_drafted=True) as (st,):
            with self._lock:
                if st._tree is not None:
                    self.trees.drop(st, st._tree)
                for p, seq in zip(self.pools, st._kv):
                    p.retire(seq, st)
                st._freed = True
                del self._states[id(st)]

    # -- shared and forked states (docs/api.md, "Sharing drafter KV"; docs/kv_pool.md) ----------
    def fork_state(self, state: ProposerState) -> MtpState:
        """A new state that continues ``state``'s sequence: the same counters and, in every
        module's pool, the same blocks (each gains a holder, nothing is copied). Either state
        may then go on alone: the first row either appends into a shared partial block copies
        that block first (copy-on-write), so neither ever sees the other's later rows. For
        ``n > 1`` samples or beam search: fork after the prompt, then propose / verify each
        fork with its own tokens. The fork has no budget (``alloc_state_for``); ``state`` keeps
        its own. Refused while a propose of ``state`` awaits its verify (``StateError``).
        On a sharded head every rank forks its corresponding state (as with ``alloc_state``)."""
        with self._use([state], "fork_state") as (src,), self._lock:
            return self._new_shared(src, [s.rows for s in src._kv], lambda st: _copy_counters(src, st))

    def share_prefix(self, source: ProposerState, prefix_tokens: Sequence[int]) -> MtpState:
        """A new state for another request whose first tokens ``prefix_tokens`` = ``t_0 ..
        t_{L-1}`` are ``source``'s first ``L`` tokens (a prefix-cache hit): it holds, shared
        with ``source``, the rows of ``source`` built from those tokens alone, and the caller
        gives the rest of its prompt with ``catchup_drafter``.

        A row of module ``m`` at key ``j`` is built from ``t_{j+m+1}``, so only the keys
        ``j <= L - 2 - m`` belong to the prefix (a cache keyed on the prefix alone would hand
        out rows built from the source's next tokens). Shared rows, per KV mode:

        - draft mode: module ``m``'s rows with keys ``<= L - 2 - m`` (module 0: the prompt's
          keys ``0 .. L-2``; a later module: the rows a verify kept). The state is then as
          ``prefill_drafter(prefix_tokens)`` leaves one (``num_verified = next_position = L``,
          ``num_hiddens = L - 1``) plus those later modules' rows. The caller gives the rest
          of its prompt ``t_L .. t_{n-1}`` as in exact mode, ``catchup_drafter(t_L .. t_{n-1},
          h_{L-1} .. h_{n-2}, state)`` (which writes what draft mode's catch-up writes), then
          proposes at ``P = n`` with ``t_n`` and ``h_{n-1}``; keys no call wrote stay a gap, as
          positions that skip forward leave one. When ``source`` itself still awaits the
          catch-up of some of the prefix (a verify accepted drafts it has not been given the
          hiddens of), the new state's ``num_hiddens`` is ``source``'s, ``Hn < L - 1``, and its
          catch-up starts at ``t_{Hn+1}``, ``h_{Hn}`` as in exact mode.
        - exact mode: every module up to a cut ``Hn = state.num_hiddens`` (``L - 1`` when
          ``source`` still keeps the chained outputs the cut needs, i.e. ``L`` is within its
          last ``M + 1`` keys; else ``L - M``, every module the same rows, clipped to what
          ``source`` holds): module ``m`` holds keys ``0 .. min(Hn, L-m-1) - 1``, exactly the
          exact-mode rule for ``Hn`` hiddens and ``L`` tokens. The caller then calls
          ``catchup_drafter(tokens, hiddens, state)`` with ``tokens = t_{Hn+1} ..`` (the last
          ``L - 1 - Hn`` of the prefix again, then its own) and ``hiddens = h_{Hn} ..``, one per
          token, as after any ``after_verify`` (``state.num_hiddens`` says where they start).

        ``prefix_tokens`` must be ``source``'s tokens: the ones ``source`` still keeps (exact
        mode: its last ``M`` at most) are checked, the others cannot be. ``L``: 1 .. the
        source's verified tokens. On a sharded head every rank makes the same call."""
        with self._use([source], "share_prefix", ["source"]) as (src,), self._lock:
            toks = check_tokens("prefix_tokens", prefix_tokens, self.config.vocab_size)
            L = int(toks.shape[0])
            if not 1 <= L <= src._num_verified:
                raise ValueError(f"prefix_tokens: expected 1 .. {src._num_verified} tokens (the source's verified "
                                 f"tokens), got {L}")
            for i in range(src._tail_start, min(L, src.num_tokens)):
                if int(toks[i]) != src._tail[i - src._tail_start]:
                    raise ValueError(f"prefix_tokens[{i}]: expected {src._tail[i - src._tail_start]} (the source's "
                                     f"token at position {i}), got {int(toks[i])}")
            if self.kv_mode == "draft":
                rows = [s._keys.rows_before(L - 1 - m) for m, s in enumerate(src._kv)]
                h = min(L - 1, src._num_hiddens)
                return self._new_shared(src, rows, lambda st: _draft_prefix(st, L, h))
            cut = self._exact_cut(src, L)
            if cut is None:
                raise StateError(f"source: its sliding-window modules no longer hold the rows a prefix of {L} "
                                 f"tokens needs (they released them); share a longer prefix")
            h, rows, wins = cut
            return self._new_shared(src, rows, lambda st: _exact_prefix(st, toks, h, wins))

    def _exact_cut(self, src: MtpState, L: int) -> tuple[int, list[int], list] | None:
        """The highest ``Hn`` for an exact-mode share of ``L`` tokens: every module's rows
        ``min(Hn, L-m-1)`` within ``source``'s, its kept tail at most ``M`` tokens, and module
        ``m``'s chained outputs for keys ``rows[m+1] .. rows[m]-1`` in ``source``'s window
        (what module ``m+1``'s next rows read). -> (Hn, rows, windows [(start, array)]) or None."""
        M = self.num_modules
        for h in range(min(L - 1, src._num_hiddens), max(0, L - 1 - M) - 1, -1):
            rows = [max(0, min(h, L - m - 1)) for m in range(M)]
            if any(r > s.rows for r, s in zip(rows, src._kv)):
                continue
            if any(not p.can_share(s, r) for p, s, r in zip(self.pools, src._kv, rows)):
                continue
            wins: list = []
            for m in range(M):
                w, ws = src._win[m], src._win_start[m]
                if m == M - 1 or rows[m] == 0 or w is None:
                    wins.append((0, None))
                    continue
                lo = rows[m + 1]
                if lo == rows[m]:                        # module m+1 is level with it: nothing to read
                    wins.append((lo, w[:0]))
                    continue
                if lo < ws or rows[m] > ws + w.shape[0]:
                    break
                wins.append((lo, w[lo - ws: rows[m] - ws]))
            else:
                return h, rows, wins
        return None

    def _new_shared(self, src: MtpState, rows: list[int], counters: Any) -> MtpState:
        """A registered state holding the first ``rows[m]`` rows of each of ``src``'s
        sequences (shared blocks), its counters set by ``counters(state)``; on any error
        nothing stays registered or shared."""
        self._check_open()
        st = MtpState(self, self.num_modules)
        made, bumped = [], []
        try:
            for p, s, r in zip(self.pools, src._kv, rows):
                bumped.append(p.share_budget_blocks(s, r))
                made.append(p.share_rows(s, src, st, r))
            st._kv = tuple(made)
            counters(st)
        except BaseException:
            for p, s, src_seq, b in zip(self.pools, made, src._kv, bumped):
                p.retire(s, st)
                if b:
                    p.unreserve_share(src_seq, src)
            raise
        self._states[id(st)] = st
        return st

    def _live(self, state: Any, name: str = "state") -> MtpState:
        """``state`` is the very object this proposer's ``alloc_state`` returned, not freed."""
        if not isinstance(state, MtpState):
            raise TypeError(f"{name}: expected an MtpState from alloc_state, got {type(state).__name__}")
        if state.owner is not self:
            raise StateError(f"{name}: belongs to another proposer")
        if state._freed:
            raise StateError(f"{name}: was freed by free_state and cannot be used again")
        if self._states.get(id(state)) is not state:
            raise StateError(f"{name}: not a state this proposer's alloc_state returned (a copy, or built by "
                             f"hand); only the original is honoured")
        if len(state._kv) != self.num_modules:
            raise StateError(f"{name}: holds {len(state._kv)} sequences, expected one per module ({self.num_modules})")
        for m, (p, seq) in enumerate(zip(self.pools, state._kv)):
            p.check_holder(seq, state, name=f"{name}.kv[{m}]")
        return state

    def _idle(self, state: Any, name: str = "state") -> MtpState:
        """A live state that no call is using now (for queries: a value read in the middle
        of a call would be that call's half-done one)."""
        st = self._live(state, name)
        if is_busy(st):
            raise StateError(f"{name}: in use by {st._busy_call or 'another call'}; query it once that call returns")
        return st

    @contextmanager
    def _use(self, states: Sequence[Any], call: str, names: Sequence[str] | None = None,
             allow_drafted: bool = False) -> Iterator[list[MtpState]]:
        """Check ``states`` and hold them for ``call`` (step 1 of every call)."""
        self._check_open()
        names = list(names) if names is not None else ["state"] * len(states)
        sts = [self._live(s, n) for s, n in zip(states, names)]
        if len({id(s) for s in sts}) != len(sts):
            raise ValueError("states: the same state appears twice in one batch")
        with exclusive(sts, call, names):
            for st, n in zip(sts, names):      # again, now that no other call can change them
                self._live(st, n)
                if st._drafted and not allow_drafted:
                    raise StateError(f"{n}: a propose awaits after_verify (call after_verify(num_accepted, "
                                     f"state) first)")
            yield sts

    def _check_open(self) -> None:
        if self._closed:
            raise StateError("proposer: closed (close() released its pools and weights)")

    def close(self) -> None:
        """Release every state, carried entry, ``MtpHead.alloc_seq`` sequence, pool and
        weight this proposer holds; any later call raises ``StateError``. Refused
        (``StateError``, nothing released) while a call is using a state."""
        with self._lock:                         # no state can be allocated, freed or carried meanwhile
            if self._closed:
                return
            sts = list(self._states.values())
            with exclusive(sts, "close", ["state"] * len(sts)):
                self._closed = True
                for st in sts:
                    st._freed = True
                self._states.clear()
                self.carry.claim_all()
                for p in self.pools:
                    p.close()
        self.weights = None
        self.step_runner = None
        self.last_drafts_device = None

    def __enter__(self) -> "MultiModuleMtpHead":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- prefill --------------------------------------------------------------------
    @sharded_call("prefill_drafter")
    def prefill_drafter(self, prompt_tokens: Sequence[int], hiddens: Any, state: ProposerState) -> int:
        """Fill the drafter KV over the prompt; returns the rows written (all modules).

        ``hiddens`` ``[n, H]``: row ``i`` is the target's ``h_i`` at the position of
        ``prompt_tokens[i]``. Module 0 gets keys ``0 .. n-2`` (``h_{n-1}`` pairs with
        the first sampled token and comes again with the first propose); in exact
        mode module ``m`` gets keys ``0 .. n-2-m``. Runs in chunks of ``prefill_chunk``.
        The state must be fresh (to continue a sequence, use ``catchup_drafter``).
        """
        with self._use([state], "prefill_drafter") as (st,):
            V, H = self.config.vocab_size, self.config.stream_size
            toks = check_tokens("prompt_tokens", prompt_tokens, V)
            n = toks.shape[0]
            if n < 1:
                raise ValueError("prompt_tokens: expected at least 1 token, got 0")
            check_positions("prompt_tokens", n - 1, self.config.max_position_embeddings)
            hid = ingest_hidden(self.backend, "hiddens", hiddens, H, rows=n)
            if st._num_verified or any(s.rows for s in st._kv):
                raise StateError(f"state: prefill_drafter needs a fresh state, this one holds "
                                 f"{st._num_verified} tokens; continue a sequence with catchup_drafter")
            hid = self._target_norm(hid[: n - 1])
            rows = self.mode.prefill_rows(n)
            agreement(self, [st], {"prompt_tokens": toks, "rows": rows})
            return guarded(self.pools, [st], rows, lambda: self.mode.prefill(st, toks, hid))

    # -- propose ------------------------------------------------------------------------
    @sharded_call("propose")
    def propose(self, last_token: int, target_hidden: Any, position: int, num_drafts: int,
                state: ProposerState, grammar_bitmask: Any = None, out_conf: list | None = None,
                min_confidence: float | None = None, *, sampling: SamplingParams | None = None,
                out_prob: list | None = None, out_dist: list | None = None) -> list[int]:
        """Draft ``min(num_drafts, M)`` tokens after ``last_token`` = ``t_P`` at ``position`` = ``P``.

        ``target_hidden`` ``[H]``: the target's ``h_{P-1}``. Module 0 takes
        ``(t_P, h_{P-1})``, module ``m`` takes ``(d_{m-1}, module m-1's output)``, all
        at key ``P-1`` and RoPE position ``P+m``. ``grammar_bitmask``: see
        ``mtpkern.grammar``. Returns ``[d_0 .. d_{k'-1}]``. ``out_conf``: a list, replaced
        on success by each draft's confidence (floats: the probability its module gave it,
        the softmax of the grammar-allowed logits; mtpkern.ops.lm_head); untouched on error.
        ``min_confidence``: early stop: drafting ends with the first draft whose confidence is
        below it (that draft is returned; no later module drafts), leaving the state a
        propose of that many drafts leaves (docs/api.md). ``num_drafts=0``: the arguments
        are checked as for any propose, then nothing happens: returns ``[]``, the state is
        unchanged (no ``after_verify`` follows; the step's token goes to ``catchup_drafter``).

        ``sampling``: a ``SamplingParams`` (temperature, top_k, top_p, seed): each draft is
        sampled from its module's distribution (mtpkern.ops.sampling), the same draws for the
        same (seed, position, draft step) on every backend; None (the default): the argmax,
        as without it. ``out_prob``: a list, replaced on success by each draft's probability
        under the distribution it was drawn from (what rejection sampling divides by; 1.0 for
        an argmax draft); ``out_dist``: a list, replaced by one ``[V]`` FP32 array per draft,
        that whole distribution (one-hot for an argmax draft). With ``sampling``, a draft's
        confidence (``out_conf``, ``min_confidence``) is its ``out_prob``.
        """
        return self._propose([last_token], [target_hidden], [position], num_drafts, [state],
                             None if grammar_bitmask is None else [grammar_bitmask], single=True,
                             out_conf=check_out_conf("out_conf", out_conf, out_conf),
                             min_confidence=min_confidence,
                             sampling=None if sampling is None else [check_sampling("sampling", sampling)],
                             out_prob=check_out_list("out_prob", out_prob),
                             out_dist=check_out_list("out_dist", out_dist))[0]

    @sharded_call("propose_batch")
    def propose_batch(self, last_tokens: Sequence[int], target_hiddens: Any, positions: Sequence[int],
                      num_drafts: int, states: Sequence[ProposerState],
                      grammar_bitmasks: Sequence[Any] | None = None,
                      out_conf: list | None = None, min_confidence: float | None = None, *,
                      sampling: Sequence[SamplingParams | None] | None = None, out_prob: list | None = None,
                      out_dist: list | None = None) -> list[list[int]]:
        """``propose`` for ``B`` sequences at once: one forward per module over all of them.

        ``target_hiddens``: ``[B, H]`` or a list of ``B`` ``[H]`` arrays;
        ``grammar_bitmasks``: None or a list of ``B`` (each None or any form ``propose``
        takes). Returns one list of drafts per sequence, as ``propose`` would.
        ``out_conf``: a list, replaced on success by one list of confidences per sequence;
        ``min_confidence``: early stop per sequence (its list of drafts may be shorter).
        ``num_drafts=0``: checked, then a no-op returning ``B`` empty lists (as ``propose``).
        ``sampling``: None, or a list of ``B`` (each a ``SamplingParams`` or None: that sequence's
        argmax); ``out_prob`` / ``out_dist``: lists, replaced by one list per sequence.
        """
        if sampling is not None:
            sampling = check_list("sampling", sampling, what="SamplingParams (or None)")
            sampling = [None if sp is None else check_sampling(f"sampling[{i}]", sp) for i, sp in enumerate(sampling)]
        return self._propose(last_tokens, target_hiddens, positions, num_drafts, states, grammar_bitmasks,
                             single=False, out_conf=check_out_conf("out_conf", out_conf, out_conf),
                             min_confidence=min_confidence, sampling=sampling,
                             out_prob=check_out_list("out_prob", out_prob),
                             out_dist=check_out_list("out_dist", out_dist))

    def _batch_states(self, states: Any) -> list:
        """A batch call's ``states``: a list of 1 .. ``propose_batch_max()`` (each checked later)."""
        states = check_list("states", states, what="states")
        most = self.propose_batch_max()
        if not 1 <= len(states) <= most:
            raise ValueError(f"states: expected 1..{most} states (propose_batch_max), got {len(states)}")
        return states

    def _batch_heads(self, name: Callable, last_tokens: Any, positions: Any, B: int) -> tuple[list, list]:
        """A batch call's ``last_tokens`` and ``positions`` (``B`` each), checked, named by ``name``."""
        last_tokens = check_list(name("last_token", "last_tokens"), last_tokens, B)
        positions = check_list(name("position", "positions"), positions, B)
        toks = [check_token(name("last_token", "last_tokens", i), t, self.config.vocab_size)
                for i, t in enumerate(last_tokens)]
        return toks, [check_int(name("position", "positions", i), p, 1) for i, p in enumerate(positions)]

    def _propose(self, last_tokens, target_hiddens, positions, num_drafts, states, grammar_bitmasks,
                 single: bool, out_conf: list | None = None, min_confidence: float | None = None,
                 sampling: list | None = None, out_prob: list | None = None,
                 out_dist: list | None = None) -> list[list[int]]:
        """``out_conf``: None, or the caller's list: it gets the confidences (``propose``: its
        sequence's list; ``propose_batch``: one list per sequence) inside the guarded section,
        so that a write that raises fails the call and changes nothing (mtpkern.txn); so do
        ``out_prob`` / ``out_dist``. ``sampling``: None (all argmax) or one entry per sequence."""
        cfg = self.config
        if min_confidence is not None:
            min_confidence = check_probability("min_confidence", min_confidence)

        name = arg_namer(single)

        states = self._batch_states(states)
        B = len(states)
        if sampling is not None and len(sampling) != B:
            raise ValueError(f"sampling: expected {B} entries (one per state), got {len(sampling)}")
        if sampling is not None and all(sp is None for sp in sampling):
            sampling = None                                   # all argmax: the path without it
        if sampling is not None and not all(mod.lm.samples for mod in self.modules):
            raise NotImplementedError(f"sampling: the {self.backend.name} backend does not sample drafts (no "
                                      f"lm_head_sample; the numpy, cpu and cuda backends do); expected sampling=None, "
                                      f"got {sampling!r}")
        call = "propose" if single else "propose_batch"
        with self._use(states, call, [name("state", "states", i) for i in range(B)]) as sts:
            toks, poss = self._batch_heads(name, last_tokens, positions, B)
            num_drafts = check_int("num_drafts", num_drafts, 0, INT32_MAX)
            k = min(num_drafts, self.num_modules)
            hid = self._batch_hiddens(name("target_hidden", "target_hiddens"), target_hiddens, B, single)
            masks: list[MaskFn | None] = [None] * B
            if grammar_bitmasks is not None:
                grammar_bitmasks = check_list("grammar_bitmasks", grammar_bitmasks, B, "masks (or None)")
                masks = [resolve(name("grammar_bitmask", "grammar_bitmasks", i), gm, cfg.vocab_size, k)
                         for i, gm in enumerate(grammar_bitmasks)]
            for i, (st, p) in enumerate(zip(sts, poss)):
                self._check_position(st, p, k, name("position", "positions", i))
            if k == 0:                  # a step without drafting: checked as a propose, then nothing
                for out in (out_conf, out_prob, out_dist):
                    if out is not None:
                        fill_list(out, [] if single else [[] for _ in range(B)])
                return [[] for _ in range(B)]
            hid = self._target_norm(hid)
            planned = False
            runner = self.step_runner
            # The planned step takes only masks that do not depend on the drafts (callables may),
            # and runs every module for every sequence: an early stop is applied after it, on the
            # host (the drafts past each stop dropped, with the rows the eager path would not write).
            static = grammar_bitmasks is None or not any(callable(gm) for gm in grammar_bitmasks)
            eager_only = sampling is not None or out_prob is not None or out_dist is not None
            if runner is not None and static and not eager_only and runner.applies(sts, poss, k):
                planned = True
            rows = [[self.mode.propose_rows(st, m, p, k) for st, p in zip(sts, poss)] for m in range(self.num_modules)]
            want_conf = out_conf is not None or min_confidence is not None
            ag = agreement(self, sts, {"last_tokens": toks, "positions": poss, "num_drafts": k, "grammar_bitmasks": [
                "none" if g is None else "callable" if callable(g) else "mask" for g in grammar_bitmasks or [None] * B],
                "out_conf": out_conf is not None, "min_confidence": min_confidence, "rows": rows, "planned": planned,
                "sampling / out_prob / out_dist": (None if sampling is None else [
                    None if sp is None else repr(sp) for sp in sampling], out_prob is not None, out_dist is not None)})
            masks = ag.masks(masks, grammar_bitmasks or [None] * B)

            def outputs(res: tuple) -> tuple:
                """The call's results, written into the caller's objects inside the guarded section."""
                drafts, device, confs, extra = res if len(res) == 4 else (*res, None)
                if confs is not None and not isinstance(confs, list):        # the planned step's [k, B]
                    confs = [[float(c) for c in confs[:, i]] for i in range(B)]
                if device is None:                                            # [B, k], -1 past an early stop
                    padded = np.full((B, k), -1, np.int32)
                    for i, d in enumerate(drafts):
                        padded[i, :len(d)] = d
                    device = self.backend.from_host(padded)
                if out_conf is not None:
                    fill_list(out_conf, confs[0] if single else confs)
                for out, got in ((out_prob, None if extra is None else extra[0]),
                                 (out_dist, None if extra is None else extra[1])):
                    if out is not None:
                        fill_list(out, got[0] if single else got)
                return drafts, device

            if planned:
                drafts, device = guarded(self.pools, sts, rows, lambda: outputs(runner.propose(
                    sts, toks, poss, hid, k, masks, want_conf, min_confidence)))
            else:
                drafts, device = guarded(self.pools, sts, rows, ag.body(lambda: outputs(self._propose_eager(
                    sts, toks, poss, hid, k, masks, want_conf, min_confidence,
                    _Sampled.of(sampling, poss, out_prob is not None, out_dist is not None, B)))))
            for st, p, d in zip(sts, poss, drafts):
                st._drafted = True
                st._last_position = p
                st._last_k = len(d)                               # k, or fewer after an early stop
                st._last_drafts = d
        with self._lock:                                          # counted once the call has succeeded
            if num_drafts > self.num_modules:
                if self.clamped_calls == 0:
                    _log.warning("mtpkern: num_drafts=%d exceeds the %d MTP modules; drafting %d "
                                 "(counted in clamped_calls)", num_drafts, self.num_modules, k)
                self.clamped_calls += 1
            self.last_drafts_device = device
            self._last_drafts = drafts[-1]
        return drafts

    def _check_position(self, st: MtpState, p: int, k: int, name: str) -> None:
        self.mode.check_position(st, p, name)
        check_positions(name, self.mode.highest_position(p, k, self.num_modules),
                        self.config.max_position_embeddings)

    def _propose_eager(self, sts, toks, poss, hid, k, masks, want_conf: bool = False,
                       min_confidence: float | None = None, sampled: _Sampled | None = None) -> tuple:
        """-> (drafts, None, per sequence its drafts' confidences, or None), and with
        ``sampled`` (draws, ``out_prob`` / ``out_dist`` asked) a fourth: (probabilities, distributions)."""
        confs: list[list[float]] | None = [[] for _ in sts] if want_conf else None

        def draft_ids(m, normed, drafts, active):
            if sampled is not None:
                return self._sampled_ids(m, normed, masks, drafts, active, confs, min_confidence, sampled)
            return self._draft_ids(m, normed, masks, drafts, active, confs, min_confidence)

        drafts = self.mode.propose(sts, toks, poss, hid, k, draft_ids)
        if sampled is None:
            return drafts, None, confs
        return drafts, None, confs, (sampled.probs, sampled.dists)

    def _sampled_ids(self, m: int, normed: Any, masks: list[MaskFn | None], drafts: list[list[int]],
                     active: list[int] | None, confs: list | None, min_confidence: float | None,
                     sampled: _Sampled) -> tuple[np.ndarray, np.ndarray | None]:
        """``_draft_ids`` with some sequences sampling: the argmax rows through ``_draft_ids``
        itself (bit for bit the call without ``sampling``), the sampled rows through the LM
        head's ``sample`` (row keys from (seed, position, step ``m``)); their probabilities
        (1.0 for an argmax draft) and distributions appended to ``sampled``."""
        active = list(range(len(masks))) if active is None else active
        n = len(active)
        greedy = [j for j, i in enumerate(active) if sampled.params[i] is None]
        drawn = [j for j, i in enumerate(active) if sampled.params[i] is not None]
        ids = np.empty(n, np.int32)
        stop = np.zeros(n, bool)
        got_conf: dict[int, float] = {}
        if greedy:
            sub_confs = None if confs is None else [[] for _ in masks]
            g_ids, g_stop = self._draft_ids(m, normed[np.asarray(greedy)] if len(greedy) < n else normed, masks,
                                            drafts, [active[j] for j in greedy], sub_confs, min_confidence)
            ids[greedy] = g_ids
            if g_stop is not None:
                stop[greedy] = g_stop
            if sub_confs is not None:
                got_conf.update({j: sub_confs[active[j]][0] for j in greedy})
        d_probs = d_dist = None
        if drawn:
            rows = self._mask_rows([masks[active[j]] for j in drawn], m, [drafts[active[j]] for j in drawn])
            params = [sampled.params[active[j]] for j in drawn]
            keys = row_keys(params, [sampled.positions[active[j]] for j in drawn], m)
            try:
                d_ids, d_probs, d_dist = self.modules[m].sample(
                    normed[np.asarray(drawn)] if len(drawn) < n else normed, rows, keys, params, sampled.want_dist)
            except NoAllowedToken as e:
                i = None if e.row is None else active[drawn[e.row]]
                masked = rows is not None and e.row is not None and not (rows[e.row] == -1).all()
                raise NoAllowedToken(f"{no_token_where(i, len(masks), m)}: "
                                     f"{no_token_reason(masked, self.config.vocab_size)}", row=i, draft=m) from None
            ids[drawn] = d_ids
        for t, j in enumerate(drawn):
            got_conf[j] = float(d_probs[t])
            if min_confidence is not None:
                stop[j] = d_probs[t] < np.float32(min_confidence)
        V = self.config.vocab_size
        for j, i in enumerate(active):
            t = drawn.index(j) if sampled.params[i] is not None else None
            if confs is not None:
                confs[i].append(got_conf[j])
            if sampled.probs is not None:
                sampled.probs[i].append(1.0 if t is None else float(d_probs[t]))
            if sampled.dists is not None:
                if t is None:
                    q = np.zeros(V, np.float32)
                    q[ids[j]] = 1.0
                else:
                    q = d_dist[t]
                sampled.dists[i].append(q)
        return ids, None if min_confidence is None else stop

    def _draft_ids(self, m: int, normed: Any, masks: list[MaskFn | None], drafts: list[list[int]],
                   active: list[int] | None = None, confs: list | None = None,
                   min_confidence: float | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """Module ``m``'s drafts for rows ``normed`` [n, H] (row j = sequence ``active[j]``, all
        by default), with a ``NoAllowedToken`` that names the sequence and the draft position;
        with ``confs`` (a list per sequence), their confidences appended; returns (ids, which
        rows stop: their confidence is below ``min_confidence``, or None)."""
        active = list(range(len(masks))) if active is None else active
        rows = self._mask_rows([masks[i] for i in active], m, [drafts[i] for i in active])
        try:
            if confs is None:
                return self.modules[m].argmax(normed, rows), None
            ids, conf = self.modules[m].argmax_conf(normed, rows)
            for j, i in enumerate(active):
                confs[i].append(float(conf[j]))
            return ids, None if min_confidence is None else conf < np.float32(min_confidence)
        except NoAllowedToken as e:
            j = e.row
            i = None if j is None else active[j]
            masked = rows is not None and j is not None and not (rows[j] == -1).all()
            raise NoAllowedToken(f"{no_token_where(i, len(masks), m)}: "
                                 f"{no_token_reason(masked, self.config.vocab_size)}", row=i, draft=m) from None

    def _mask_rows(self, masks: list[MaskFn | None], m: int, drafts: list[list[int]]) -> np.ndarray | None:
        if all(fn is None for fn in masks):
            return None
        W = self.config.bitmask_words
        rows = np.full((len(masks), W), -1, np.int32)        # all bits set: unconstrained
        for i, fn in enumerate(masks):
            if fn is not None:
                mk = fn(m, drafts[i])
                if mk is not None:
                    rows[i] = mk
        return rows

    # -- draft trees (mtpkern.tree) -----------------------------------------------------------
    @sharded_call("propose_tree")
    def propose_tree(self, last_token: int, target_hidden: Any, position: int, state: ProposerState,
                     widths: Sequence[int] | None = None, shape: Sequence[Sequence[int]] | None = None,
                     grammar_bitmask: Any = None) -> DraftTree:
        """Draft a tree after ``last_token`` = ``t_P`` at ``position`` = ``P`` (``target_hidden``
        ``h_{P-1}``, as ``propose``). ``widths[d]``: each node of depth ``d - 1`` (the root for
        ``d = 0``) gets its ``widths[d]`` best tokens as children; or ``shape``: a static tree,
        the paths of child ranks of its nodes (``[[0], [1], [0, 0]]``: two children of the root,
        one of the first), whose rank-0 path is the deepest. Depths: at most ``num_modules``
        (draft step ``d`` drafts depth ``d``). ``grammar_bitmask``: as ``propose``; a callable
        is asked ``(depth, path tokens so far)`` once per node it expands. Returns the tree
        (mtpkern.tree.DraftTree: tokens, parents, depths, probabilities, path scores). Every
        row of a depth is one forward of its module; the state awaits ``after_verify_tree``."""
        return self._propose_trees([last_token], target_hidden, [position], [state], widths, shape,
                                   None if grammar_bitmask is None else [grammar_bitmask], single=True)[0]

    @sharded_call("propose_tree_batch")
    def propose_tree_batch(self, last_tokens: Sequence[int], target_hiddens: Any, positions: Sequence[int],
                           states: Sequence[ProposerState], widths: Any = None, shape: Any = None,
                           grammar_bitmask: Sequence[Any] | None = None) -> list[DraftTree]:
        """``propose_tree`` for ``B`` sequences at once: at each depth, one forward per module
        over every sequence's nodes. ``target_hiddens``: ``[B, H]`` or a list of ``B`` ``[H]``;
        ``widths`` / ``shape``: one for every sequence, or a list of ``B`` (one each);
        ``grammar_bitmask``: None or a list of ``B`` (each None or any form ``propose_tree``
        takes). Returns one tree per state, each the tree ``propose_tree`` gives that state
        (to FP32 rounding in its probabilities); every state awaits ``after_verify_tree``
        (or ``after_verify_tree_batch``). Cuda with ``cuda_graphs``: a tree of a static shape
        (fixed ``widths`` or ``shape``) without a grammar mask runs as a planned step, captured
        once per tree shape and replayed (mtpkern.tree_plan; docs/cuda.md); other trees eagerly."""
        return self._propose_trees(last_tokens, target_hiddens, positions, states, widths, shape, grammar_bitmask,
                                   single=False)

    def _propose_trees(self, last_tokens, target_hiddens, positions, states, widths, shape, grammar_bitmasks,
                       single: bool) -> list[DraftTree]:
        cfg = self.config

        name = arg_namer(single)

        call = "propose_tree" if single else "propose_tree_batch"
        states = self._batch_states(states)
        B = len(states)
        with self._use(states, call, [name("state", "states", i) for i in range(B)]) as sts:
            toks, poss = self._batch_heads(name, last_tokens, positions, B)
            shapes = [check_shape(widths, shape, self.num_modules)] if single else \
                check_shapes(widths, shape, self.num_modules, B)
            hid = self._batch_hiddens(name("target_hidden", "target_hiddens"), target_hiddens, B, single)
            masks: list[MaskFn | None] = [None] * B
            if grammar_bitmasks is not None:
                grammar_bitmasks = check_list("grammar_bitmask", grammar_bitmasks, B, "masks (or None)")
                masks = [resolve(name("grammar_bitmask", "grammar_bitmask", i), gm, cfg.vocab_size, D)
                         for i, (gm, (_, _, D)) in enumerate(zip(grammar_bitmasks, shapes))]
            for i, (st, p, (_, _, D)) in enumerate(zip(sts, poss, shapes)):
                self._check_position(st, p, D, name("position", "positions", i))
            hid = self._target_norm(hid)
            rows = [[self.mode.propose_rows(st, m, p, D) for st, p, (_, _, D) in zip(sts, poss, shapes)]
                    for m in range(self.num_modules)]
            given = grammar_bitmasks or [None] * B
            kinds = ["none" if g is None else "callable" if callable(g) else "mask" for g in given]
            ag = agreement(self, sts, {name("last_token", "last_tokens"): toks, name("position", "positions"): poss,
                                       "widths / shape": shapes[0] if single else shapes,
                                       name("grammar_bitmask", "grammar_bitmasks"): kinds[0] if single else kinds,
                                       "rows": rows})
            masks = ag.masks(masks, given)
            jobs = [TreeJob(st, t, p, D, ws, counts) for st, t, p, (ws, counts, D) in zip(sts, toks, poss, shapes)]
            planned = None                  # the planned tree step (mtpkern.tree_plan): static shapes, no mask
            if self.step_runner is not None:
                from .tree_plan import tree_steps

                steps = tree_steps(self.step_runner)
                if steps.applies(sts, poss, shapes, any(m is not None for m in masks)):
                    planned = steps

            def mask_rows(m: int, seqs: list[int], paths: list[list[int]]) -> np.ndarray | None:
                return self._mask_rows([masks[b] for b in seqs], m, paths)   # each node's path as its drafts

            def topk(m: int, normed: Any, rows: np.ndarray | None, k: int, seqs: list[int]) -> tuple:
                try:
                    return self.modules[m].topk(normed, rows, k)
                except NoAllowedToken as e:
                    masked = rows is not None and e.row is not None and not (rows[e.row] == -1).all()
                    b = 0 if e.row is None else seqs[e.row]
                    node = None if e.row is None else seqs[:e.row].count(b)
                    where = f"{call}: depth {m}" if single else f"{call}: states[{b}], depth {m}"
                    raise NoAllowedToken(f"{where}, node {node} of the depth before: "
                                         f"{no_token_reason(masked, cfg.vocab_size)}", row=b, draft=m) from None

            def undo() -> None:
                for j in jobs:
                    if j.pending is not None:
                        self.trees.drop(j.st, j.pending)

            trees = guarded(self.pools, sts, rows,
                            ag.body((lambda: planned.propose(jobs, hid)) if planned is not None else
                                    (lambda: self.trees.propose(jobs, hid, mask_rows, topk)), undo=undo))
            for st, p, tree, (_, _, D) in zip(sts, poss, trees, shapes):
                st._drafted = True
                st._last_position, st._last_k = p, D
                st._last_drafts = [int(tree.tokens[i]) for i in tree.greedy_path()]
        with self._lock:
            self._last_drafts = list(sts[-1]._last_drafts)
        return trees

    def after_verify_tree(self, path: Sequence[int], state: ProposerState) -> None:
        """The verify of the last ``propose_tree`` accepted the nodes ``path`` (indices into the
        tree, from depth 0 down, each the child of the one before; empty: none accepted). Keeps
        exactly that path's KV rows (the state a chain propose forced along the path leaves
        after ``after_verify(len(path))``) and frees every other row of the tree at once."""
        self._after_verify_trees([path], [state], single=True)

    def after_verify_tree_batch(self, paths: Sequence[Sequence[int]], states: Sequence[ProposerState]) -> None:
        """``after_verify_tree`` for ``B`` states: ``paths[i]`` the accepted nodes of
        ``states[i]``'s tree. Every path is checked before any state changes."""
        self._after_verify_trees(paths, states, single=False)

    def _after_verify_trees(self, paths: Any, states: Any, single: bool) -> None:
        states = check_list("states", states, what="states")
        B = len(states)
        if not single and B < 1:
            raise ValueError("states: expected at least 1 state, got 0")
        names = ["state"] if single else [f"states[{i}]" for i in range(B)]
        with self._use(states, "after_verify_tree" if single else "after_verify_tree_batch", names,
                       allow_drafted=True) as sts:
            paths = [paths[0]] if single else check_list("paths", paths, B, "paths (lists of node indices)")
            checked = [self._check_tree_path(st, n, path, "path" if single else f"paths[{i}]")
                       for i, (st, n, path) in enumerate(zip(sts, names, paths))]
            done = []
            for st, nodes in zip(sts, checked):
                a = self.trees.after_verify(st, st._tree, nodes)
                for p, seq in zip(self.pools, st._kv):
                    p.release_window(seq, st)
                st._drafted = False
                done.append((st._last_k, a))
        for k, a in done:
            self.stats.record(k, a)

    @staticmethod
    def _check_tree_path(st: MtpState, name: str, path: Any, pname: str) -> list[int]:
        if not st._drafted or st._tree is None:
            raise StateError(f"{name}: after_verify_tree without a propose_tree to verify"
                             + (" (the last propose was a chain: call after_verify)" if st._drafted else ""))
        tree = st._tree.tree
        if isinstance(path, (str, bytes)) or not isinstance(path, (Sequence, np.ndarray)):
            raise TypeError(f"{pname}: expected a list of node indices, got {type(path).__name__}")
        nodes = [check_int(f"{pname}[{j}]", i, 0, len(tree) - 1) for j, i in enumerate(path)]
        for j, i in enumerate(nodes):
            want = -1 if j == 0 else nodes[j - 1]
            if int(tree.parents[i]) != want:
                raise ValueError(f"{pname}[{j}]: expected a child of {'the root' if want < 0 else f'node {want}'}, "
                                 f"got node {i} (its parent: {int(tree.parents[i])})")
        return nodes

    # -- verify and catch-up ---------------------------------------------------------------
    def after_verify(self, num_accepted: int, state: ProposerState) -> None:
        """The verify accepted the first ``num_accepted`` drafts of the last propose.

        Draft mode: module ``m``'s row of that propose is kept iff ``m <= num_accepted``.
        Exact mode: module ``m`` keeps the keys whose tokens are verified (it drops
        its last ``max(0, m - num_accepted)`` keys of that propose). Emptied blocks
        return to the pools at once.
        """
        with self._use([state], "after_verify", allow_drafted=True) as (st,):
            if not st._drafted:
                raise StateError("state: after_verify without a propose to verify")
            if st._tree is not None:
                raise StateError("state: the last propose was propose_tree; call after_verify_tree(path, state)")
            a = check_int("num_accepted", num_accepted, 0, st._last_k)
            P, k = st._last_position, st._last_k
            self.mode.after_verify(st, P, a, k)
            for p, seq in zip(self.pools, st._kv):     # after the trim: rows out of every window go back
                p.release_window(seq, st)
            st._num_verified = st._next_position = P + 1 + a
            st._drafted = False
        self.stats.record(k, a)

    @sharded_call("catchup_drafter")
    def catchup_drafter(self, tokens: Sequence[int], hiddens: Any, state: ProposerState) -> int:
        """Give the target hiddens of verified tokens; returns rows written (all modules).

        After ``after_verify(a)``: ``tokens = [d_0 .. d_{a-1}]`` (the accepted drafts,
        ``t_{P+1} .. t_{P+a}``) and ``hiddens = [h_P .. h_{P+a-1}]``. Pair ``i`` is
        ``(tokens[i], hiddens[i])`` with ``hiddens[i]`` the hidden at the position just
        before ``tokens[i]``. Tokens past the accepted drafts extend the sequence (a
        decode step without drafting, the rest of a prompt prefilled in chunks, or the
        next turn of a carried state). No tokens: a no-op. A fresh state: ``StateError``
        (``prefill_drafter`` first).

        Draft mode writes module 0's rows only, one per token (key ``num_hiddens + i``,
        from ``(tokens[i], hiddens[i])``; no chain to later modules, which keep the rows of
        proposes): after it, module 0 holds what a prefill of the whole sequence would.
        Draft mode keeps no tokens, so it cannot check the accepted drafts as exact mode
        does: give the tokens the verify accepted.
        """
        return self._catchup([tokens], [hiddens], [state], single=True)

    @sharded_call("catchup_batch")
    def catchup_batch(self, tokens: Sequence[Sequence[int]], hiddens: Sequence[Any],
                      states: Sequence[ProposerState]) -> int:
        """``catchup_drafter`` for several sequences, one forward per module over all of them."""
        return self._catchup(tokens, hiddens, states, single=False)

    def _catchup(self, tokens, hiddens, states, single: bool) -> int:
        states = check_list("states", states, what="states")
        tokens = check_list("tokens", tokens, len(states), "token lists")
        hiddens = check_list("hiddens", hiddens, len(states), "hidden arrays")
        one = single or len(states) == 1

        def name(what: str, i: int) -> str:
            return what if one else f"{what}[{i}]"

        call = "catchup_drafter" if single else "catchup_batch"
        with self._use(states, call, ["state" if single else f"states[{i}]" for i in range(len(states))]) as sts:
            V, H = self.config.vocab_size, self.config.stream_size
            checked = []
            for i, (tk, hd) in enumerate(zip(tokens, hiddens)):
                tk = check_tokens(name("tokens", i), tk, V)
                if tk.shape[0] == 0 and hd is not None and int(np.prod(shape_of(hd))) > 0:
                    raise ValueError(f"{name('hiddens', i)}: expected no rows (no tokens), "
                                     f"got shape {list(shape_of(hd))}")
                checked.append(tk)
            todo, hids, news = [], [], []
            for i, (st, tk, hd) in enumerate(zip(sts, checked, hiddens)):
                if tk.shape[0] == 0:
                    continue
                if st._num_verified == 0:
                    raise StateError(f"{'state' if single else f'states[{i}]'}: {self.kv_mode} kv_mode needs "
                                     f"prefill_drafter before catchup_drafter (a fresh state holds no sequence)")
                hd = ingest_hidden(self.backend, name("hiddens", i), hd, H, rows=tk.shape[0])
                base = st._num_hiddens + 1          # index of tokens[0] in the sequence
                if self.kv_mode == "exact":         # draft mode keeps no tokens to check against
                    for j, t in enumerate(tk.tolist()):
                        idx = base + j
                        if idx < st.num_tokens and st._tail[idx - st._tail_start] != t:
                            raise ValueError(f"{name('tokens', i)}[{j}]: expected {st._tail[idx - st._tail_start]} "
                                             f"(the verified token at position {idx}), got {t}")
                check_positions(name("tokens", i), base + tk.shape[0] - 1, self.config.max_position_embeddings)
                todo.append(st)
                hids.append(hd)
                news.append(tk if self.kv_mode == "draft" else tk[max(0, st.num_tokens - base):].tolist())
            if not todo:
                return 0
            if self.kv_mode == "draft":             # module 0's rows of the tokens, no chain
                rows = [[self.mode.catchup_rows(m, tk.shape[0]) for tk in news] for m in range(self.num_modules)]
                agreement(self, todo, {"tokens": [tk.tolist() for tk in checked], "rows": rows})
                return guarded(self.pools, todo, rows,
                               lambda: self.mode.catch_up(todo, news, [self._target_norm(h) for h in hids]))

            def run() -> int:
                for st, nw in zip(todo, news):
                    st._tail.extend(nw)
                    st._num_verified = st._next_position = st.num_tokens
                return self.exact.catch_up(todo, [self._target_norm(h) for h in hids])

            rows = [[ExactChain.catchup_rows(st, m, hd.shape[0], len(nw)) for st, hd, nw in zip(todo, hids, news)]
                    for m in range(self.num_modules)]
            agreement(self, todo, {"tokens": [tk.tolist() for tk in checked], "rows": rows})
            return guarded(self.pools, todo, rows, run)

    # -- multi-turn carry (mtpkern.carry) ---------------------------------------------------
    def take_drafter_kv(self, state: ProposerState) -> DrafterKv | None:
        """Move the state's drafter KV (and exact-mode window) out; the state is left as
        ``alloc_state()`` leaves one: no KV and no budget (taking ends the sequence the
        budget was for; what was still reserved goes back to the pools). None when the
        state holds nothing (then nothing changes)."""
        with self._use([state], "take_drafter_kv") as (st,), self._lock:
            return self.carry.take(st)

    def install_drafter_kv(self, state: ProposerState, carried: DrafterKv) -> bool:
        """Install carried KV into a fresh state (the inverse of ``take_drafter_kv``).
        A state from ``alloc_state_for(budget_tokens)`` counts the carried blocks within
        its budget (the budget covers the whole conversation: history + this turn), so
        its reservation shrinks by them and the rest goes back to the pools. Only the
        entry ``take_drafter_kv`` returned is honoured (a copy gets ``StateError``)."""
        with self._use([state], "install_drafter_kv") as (st,), self._lock:
            self.carry.install(st, carried)
        return True

    def free_drafter_kv(self, carried: DrafterKv) -> None:
        """Release carried KV that no state owns."""
        with self._lock:
            self._check_open()
            self.carry.free(carried)

    # -- helpers ---------------------------------------------------------------------------
    def _batch_hiddens(self, name: str, hiddens: Any, B: int, single: bool = False) -> Any:
        H = self.config.stream_size
        if isinstance(hiddens, (list, tuple)):
            if len(hiddens) != B:
                raise ValueError(f"{name}: expected {B} hiddens (one per state), got {len(hiddens)}")
            parts = [ingest_hidden(self.backend, name if single else f"{name}[{i}]", h, H, rows=1)
                     for i, h in enumerate(hiddens)]
            return parts[0] if B == 1 else self.backend.xp.concatenate(parts, axis=0)
        return ingest_hidden(self.backend, name, hiddens, H, rows=B,
                             want=None if single else f"[{B}, {H}] (or a list of {B} [{H}] arrays)")

    def _target_norm(self, h: Any) -> Any:
        tn = self.weights.target_norm
        return h if tn is None or h.shape[0] == 0 else self.backend.rmsnorm(h, tn, self.config.rms_norm_eps)

    # -- invariants --------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Pool accounting (every block free, or held by as many registered sequences as its
        reference count: a forked or prefix-shared state shares its source's blocks),
        the registries (each live state and carried entry holds one sequence per pool, and
        nothing else does but ``MtpHead.alloc_seq`` users), then each idle state's rules.
        Safe while other threads run calls: the registries are read as one snapshot, and
        a state in use by a running call is checked for its pool accounting only."""
        with self._lock:
            self._check_open()
            sts = list(self._states.values())
            carried = self.carry.live()
            for m, p in enumerate(self.pools):
                p.check_invariants()
                holders = p.holders()               # every sequence but the draft trees' scratch ones
                ours = [h for h in holders if h is not self.modules[m]]
                want = {id(st) for st in sts} | {id(kv) for kv in carried}
                self._check_scratch(m, p, sts)
                if len(ours) != len(want) or {id(h) for h in ours} != want:
                    raise AssertionError(f"module {m}: {len(ours)} sequences held in the pool, expected one for "
                                         f"each of {len(sts)} states and {len(carried)} carried entries")
                for st in sts:
                    if p._seqs.get(st._kv[m]._serial, (None, None))[1] is not st:
                        raise AssertionError(f"module {m}: a state's sequence is not held by it")
                for kv in carried:
                    if p._seqs.get(kv._seqs[m]._serial, (None, None))[1] is not kv:
                        raise AssertionError(f"module {m}: a carried entry's sequence is not held by it")
        for st in sts:
            if not is_busy(st):
                try:
                    self.check_state(st)
                except StateError:            # taken by a call, or freed, since the snapshot
                    pass

    @staticmethod
    def _check_scratch(m: int, pool: BlockPool, sts: list[MtpState]) -> None:
        """A draft tree's scratch sequences (its other lines, mtpkern.tree): each is held by a
        live state, and an idle state's are exactly its pending tree's. A state in use may
        hold scratch its call has not recorded yet (a tree drafted now, seen from its grammar
        callable or another thread); the pool registered them as scratch when it made them."""
        live = {id(st): st for st in sts}
        for sq, holder in pool.scratch_seqs():
            st = live.get(id(holder))
            if st is None:
                raise AssertionError(f"module {m}: a tree's scratch sequence is held by "
                                     f"{type(holder).__name__}, not by a live state")
            mt = None if st._tree is None else st._tree.modules[m]
            if is_busy(st) or (mt is not None and mt.scratch is sq):
                continue
            if pool.is_registered(sq) and not is_busy(st):       # not retired or taken since the snapshot
                raise AssertionError(f"module {m}: a scratch sequence is held by an idle state whose pending "
                                     f"tree does not use it")
        for st in sts:
            mt = None if st._tree is None else st._tree.modules[m]
            if mt is not None and mt.scratch is not None and not is_busy(st):
                try:
                    pool.check_holder(mt.scratch, st)
                except StateError:
                    if st._tree is not None and not is_busy(st):
                        raise AssertionError(f"module {m}: a tree's scratch sequence is not held by its "
                                             f"state") from None

    def _pending_trim(self, st: MtpState, m: int) -> int:
        """Rows of module ``m`` that the pending verify of ``st`` may still trim: none between
        calls; after a propose, the KV mode's count for the modules it ran (``pending_trim``:
        a draft-mode propose of k' drafts leaves modules m >= k' untouched, and their last
        row, verified before, stays); after a draft tree, the mode's margin for the modules
        the tree ran."""
        if not st._drafted:
            return 0
        if st._tree is not None:
            return self.mode.trim_margin(m) if st._tree.modules[m] is not None else 0
        return self.mode.pending_trim(st, m)

    def check_state(self, st: MtpState) -> None:
        """The rules of the KV mode for one state (``AssertionError`` when broken)."""
        if st._freed:
            if any(s.blocks for s in st._kv):
                raise AssertionError("a freed state still holds blocks")
            return
        with exclusive([st], "check_invariants", ["state"]):
            for m, (p, seq) in enumerate(zip(self.pools, st._kv)):
                p.check_seq(seq, margin=self._pending_trim(st, m))
                keys = seq.keys.to_list()
                if any(b <= a for a, b in zip(keys, keys[1:])):
                    raise AssertionError(f"module {m}: keys not increasing: {keys}")
            if st._num_verified and st._num_verified < st._num_hiddens + 1:
                raise AssertionError(f"{st._num_verified} verified tokens but {st._num_hiddens} hiddens consumed")
            self.mode.check(st)

