"""``MultiModuleMtpHead``: the multi-module MTP draft proposer (SPEC sections 2-4).

Vocabulary (SPEC section 2). The target at position ``j`` yields ``h_j``.
Module ``m``'s KV row with **key** ``j`` is built from ``(t_{j+m+1}, g^m_j)``
at RoPE position ``j+m+1``; ``g^0_j = h_j`` and ``g^m_j`` is module ``m-1``'s
chained output at key ``j``.

Per-sequence counters (``MtpState``):

- ``num_tokens`` ``T``: tokens known to the drafter, verified ones then the
  drafts of a propose not yet verified;
- ``num_verified``: of those, how many are verified;
- ``num_hiddens`` ``Hn``: target hiddens consumed, ``h_0 .. h_{Hn-1}``.

**Exact mode**: after every call module ``m`` holds exactly keys
``0 .. rows_m - 1`` with ``rows_m = max(0, min(Hn, T - m - 1))``: every key
whose token and hidden are known. A call raises ``Hn`` and/or ``T`` and each
module computes its missing keys in order ``m = 0, 1, ..``, module ``m`` taking
``g`` from module ``m-1``'s chained outputs, which the state keeps for the
trailing ``M + 1`` keys of every module (a window bounded by ``M``, not by the
sequence). ``after_verify`` lowers ``T`` and trims each module to ``rows_m``.

**Draft mode**: one row per module per propose at key ``P-1``; prefill fills
module 0; ``after_verify(a)`` keeps module ``m``'s row iff ``m <= a``.

Every public call validates first, checks KV room for every module, then
computes; if the compute fails (a grammar that allows nothing, a callable
that raises) every touched state is rolled back: rows truncated, blocks
returned, counters restored.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Literal, Sequence

import numpy as np

from .backends import BackendName, get_backend
from .backends.base import Backend, on_cuda_device
from .config import MtpConfig, ceil_div
from .errors import NoAllowedToken, StateError, no_token_reason, no_token_where
from .grammar import MaskFn, resolve
from .head import MtpHead, RowJob
from .kv import KeyRuns, SeqKv
from .trait import DraftProposer, ProposerState
from .weights import MtpWeights, load_weights

KvMode = Literal["draft", "exact"]
Chain = Literal["prenorm", "postnorm"]
_log = logging.getLogger("mtpkern")


# -- boundary checks ------------------------------------------------------------

def check_int(name: str, v: Any, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(v).__name__} {v!r}")
    v = int(v)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]" if lo is not None else f"<= {hi}"
        raise ValueError(f"{name}: expected {rng}, got {v}")
    return v


def check_token(name: str, v: Any, vocab_size: int) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name}: expected an int token id, got {type(v).__name__} {v!r}")
    if not 0 <= int(v) < vocab_size:
        raise ValueError(f"{name}: token id {int(v)} is outside the vocabulary [0, {vocab_size})")
    return int(v)


def check_tokens(name: str, tokens: Any, vocab_size: int) -> np.ndarray:
    """A sequence of token ids -> [n] int32, each checked against the vocabulary."""
    a = np.asarray(tokens.get() if hasattr(tokens, "get") and not isinstance(tokens, np.ndarray) else tokens)
    if a.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D sequence of token ids, got shape {list(a.shape)}")
    if a.size and a.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected integer token ids, got dtype {a.dtype}")
    bad = np.flatnonzero((a < 0) | (a >= vocab_size)) if a.size else []
    if len(bad):
        i = int(bad[0])
        raise ValueError(f"{name}[{i}]: token id {int(a[i])} is outside the vocabulary [0, {vocab_size})")
    return a.astype(np.int32)


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in getattr(x, "shape", np.shape(x)))


def hidden_shape(name: str, x: Any, H: int, rows: int | None = None, want: str | None = None) -> tuple[int, int]:
    """The ``[n, H]`` shape of hidden states given as ``[H]`` or ``[n, H]`` (checked;
    ``want``: the expected form as the error message should say it)."""
    given = _shape(x)
    shape = (1,) + given if len(given) == 1 else given
    if len(shape) != 2 or shape[1] != H or (rows is not None and shape[0] != rows):
        if want is None:
            want = f"[{H}] or [1, {H}]" if rows == 1 else f"[{'n' if rows is None else rows}, {H}]"
        raise ValueError(f"{name}: expected shape {want}, got {list(given)}")
    return shape


def _expect_finite(name: str, a: np.ndarray) -> None:
    bad = np.flatnonzero(~np.isfinite(a.reshape(-1)))
    if bad.size:
        r, c = divmod(int(bad[0]), a.shape[-1])
        raise ValueError(f"{name}: expected finite values, got {a.reshape(-1)[bad[0]]} at row {r}, "
                         f"column {c} ({bad.size} non-finite)")


def ingest_hidden(backend: Backend, name: str, x: Any, H: int, rows: int | None = None,
                  want: str | None = None) -> Any:
    """Hidden states ``[H]`` or ``[n, H]`` (BF16/FP32, host or backend device) -> backend ``[n, H]`` FP32.

    Host values must be finite (a NaN or Inf would poison the module's KV for good);
    device arrays are not read back to check."""
    shape = hidden_shape(name, x, H, rows, want)
    a = backend.ingest_float(name, x)
    if isinstance(a, np.ndarray):
        _expect_finite(name, a)
    elif not on_cuda_device(x):                          # host input to a device backend
        try:
            host = np.asarray(x)
        except Exception:                                # e.g. a host BF16 tensor NumPy cannot read
            host = None
        if host is not None and host.dtype.name in ("float32", "bfloat16"):
            _expect_finite(name, np.asarray(host, np.float32))
    return a.reshape(shape)


# -- state -------------------------------------------------------------------

@dataclass(slots=True, eq=False)
class MtpState(ProposerState):
    """Per-sequence state of a ``MultiModuleMtpHead`` (see the module docstring)."""

    owner: Any
    kv: list[SeqKv]
    freed: bool = False
    num_verified: int = 0
    num_hiddens: int = 0
    tail: list[int] = field(default_factory=list)   # tokens tail_start .. num_tokens - 1
    tail_start: int = 0
    win: list[Any] = field(default_factory=list)    # per module: chained outputs [w, H] (exact mode)
    win_start: list[int] = field(default_factory=list)
    drafted: bool = False                           # a propose awaits after_verify
    next_position: int = 1                          # the lowest position the next propose may take
    last_position: int = -1
    last_k: int = 0
    last_drafts: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.tail_start + len(self.tail)

    def rows_per_module(self) -> list[int]:
        return [s.rows for s in self.kv]

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the state breaks a rule of its proposer's KV mode."""
        self.owner._check_state(self)

    def __repr__(self) -> str:                           # not the window's hidden arrays
        status = "freed" if self.freed else "awaiting after_verify" if self.drafted else "ready"
        return (f"MtpState(rows per module={self.rows_per_module()}, verified tokens={self.num_verified}, "
                f"hiddens={self.num_hiddens}, next position={self.next_position}, {status})")


@dataclass(slots=True, eq=False)
class DrafterKv:
    """A sequence's drafter KV taken out of its state (``take_drafter_kv``), to be
    installed into a fresh state next turn or released with ``free_drafter_kv``.

    ``blocks[m]`` are module ``m``'s block ids; ``rows`` / ``last_pair_key`` are
    module 0's (the trait's triple), the rest is the exact-mode window.
    """

    owner: Any
    blocks: list[list[int]]
    keys: list[KeyRuns]
    num_verified: int
    num_hiddens: int
    tail: list[int]
    tail_start: int
    win: list[Any]
    win_start: list[int]
    next_position: int
    consumed: bool = False

    @property
    def rows(self) -> int:
        return len(self.keys[0])

    @property
    def last_pair_key(self) -> int | None:
        return self.keys[0].last

    def __repr__(self) -> str:                           # not the window's hidden arrays
        state = "consumed" if self.consumed else "live"
        return (f"DrafterKv(rows per module={[len(k) for k in self.keys]}, "
                f"blocks per module={[len(b) for b in self.blocks]}, verified tokens={self.num_verified}, "
                f"last_pair_key={self.last_pair_key}, {state})")


@dataclass(slots=True)
class AcceptanceStats:
    """Per-module drafted / accepted counters since the last ``reset``."""

    drafted: list[int]
    accepted: list[int]
    verifies: int = 0
    accepted_total: int = 0

    @property
    def mean_accepted_length(self) -> float:
        """Mean accepted drafts per verify (0.0 before any verify)."""
        return self.accepted_total / self.verifies if self.verifies else 0.0

    def acceptance_rate(self, module: int) -> float:
        """Accepted / drafted for drafts made by ``module``."""
        if not (isinstance(module, (int, np.integer)) and 0 <= module < len(self.drafted)):
            raise ValueError(f"module: expected an int in [0, {len(self.drafted)}), got {module!r}")
        d = self.drafted[module]
        return self.accepted[module] / d if d else 0.0

    def reset(self) -> None:
        self.drafted = [0] * len(self.drafted)
        self.accepted = [0] * len(self.accepted)
        self.verifies = self.accepted_total = 0


@dataclass(slots=True)
class _Snapshot:
    rows: list[int]
    fields: tuple


_STATE_FIELDS = ("num_verified", "num_hiddens", "tail_start", "drafted", "next_position",
                 "last_position", "last_k")


def _snapshot(st: MtpState) -> _Snapshot:
    return _Snapshot([s.rows for s in st.kv],
                     (tuple(getattr(st, f) for f in _STATE_FIELDS), list(st.tail), list(st.win),
                      list(st.win_start), list(st.last_drafts)))


# -- the proposer -----------------------------------------------------------------

class MultiModuleMtpHead(DraftProposer):
    """Independent MTP modules, one per draft slot, each with its own weights and paged KV.

    Build with ``from_pretrained``. All methods validate their arguments and
    leave every state unchanged when they raise.
    """

    def __init__(self, config: MtpConfig, weights: MtpWeights, backend: Backend, *,
                 kv_mode: KvMode = "exact", chain: Chain = "prenorm", block_size: int = 16,
                 num_blocks: int | None = None, max_batch: int = 64, prefill_chunk: int = 256,
                 cuda_graphs: bool = True):
        if kv_mode not in ("draft", "exact"):
            raise ValueError(f"kv_mode: expected 'draft' or 'exact', got {kv_mode!r}")
        if chain not in ("prenorm", "postnorm"):
            raise ValueError(f"chain: expected 'prenorm' or 'postnorm', got {chain!r}")
        block_size = check_int("block_size", block_size, 1)
        if num_blocks is None:
            num_blocks = ceil_div(self.DEFAULT_KV_TOKENS, block_size)
        num_blocks = check_int("num_blocks", num_blocks, 1)
        self.max_batch = check_int("max_batch", max_batch, 1)
        self.prefill_chunk = check_int("prefill_chunk", prefill_chunk, 1)
        if not isinstance(cuda_graphs, bool):
            raise TypeError(f"cuda_graphs: expected a bool, got {cuda_graphs!r}")
        if len(weights.modules) != config.num_modules:
            raise ValueError(f"weights: expected {config.num_modules} modules, got {len(weights.modules)}")
        self.config = config
        self.weights = weights
        self.backend = backend
        self.kv_mode: KvMode = kv_mode
        self.chain: Chain = chain
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.modules = [MtpHead(m, config, mw, backend, num_blocks, block_size)
                        for m, mw in enumerate(weights.modules)]
        self.stats = AcceptanceStats([0] * config.num_modules, [0] * config.num_modules)
        self.clamped_calls = 0      # proposes whose num_drafts exceeded num_modules
        self._states: dict[int, MtpState] = {}
        self._carried: dict[int, DrafterKv] = {}
        self._last_drafts: list[int] = []
        #: [B, k'] int32 drafts of the last propose, on the backend (a CuPy array on
        #: cuda; a fresh array per propose), for an engine that verifies on the device
        self.last_drafts_device: Any = None
        #: the planned propose step (mtpkern.cuda_graph): captured and replayed as a
        #: CUDA graph on the cuda backend when ``cuda_graphs``; None runs every step eagerly
        self.step_runner: Any = None
        if cuda_graphs and backend.name == "cuda":
            from .cuda_graph import StepRunner

            self.step_runner = StepRunner(self, capture=True)

    #: default pool size per module, in tokens, when num_blocks is None
    DEFAULT_KV_TOKENS = 32768

    @classmethod
    def from_pretrained(cls, ckpt_dir: str | os.PathLike, backend: "BackendName | Backend" = "auto",
                        kv_mode: KvMode = "exact", chain: Chain = "prenorm",
                        apply_target_norm: bool = False, block_size: int = 16,
                        num_blocks: int | None = None, max_batch: int = 64,
                        prefill_chunk: int = 256, cuda_graphs: bool = True) -> "MultiModuleMtpHead":
        """Load the MTP modules of the checkpoint at ``ckpt_dir`` (``config.json`` + safetensors).

        ``apply_target_norm``: the engine hands pre-norm target hiddens; apply the
        target's ``model.norm.weight`` to them first. ``num_blocks``: blocks per
        module pool (default: ``DEFAULT_KV_TOKENS / block_size``). ``cuda_graphs``: on the
        cuda backend, capture the steady-state propose step once per shape and replay it
        as a CUDA graph (docs/cuda.md); ignored by the other backends.
        """
        if kv_mode not in ("draft", "exact"):
            raise ValueError(f"kv_mode: expected 'draft' or 'exact', got {kv_mode!r}")
        if chain not in ("prenorm", "postnorm"):
            raise ValueError(f"chain: expected 'prenorm' or 'postnorm', got {chain!r}")
        if not isinstance(apply_target_norm, bool):
            raise TypeError(f"apply_target_norm: expected a bool, got {apply_target_norm!r}")
        cfg = MtpConfig.from_json(os.path.join(os.fspath(ckpt_dir), "config.json"))
        be = get_backend(backend)
        weights = load_weights(ckpt_dir, cfg, be, apply_target_norm=apply_target_norm)
        return cls(cfg, weights, be, kv_mode=kv_mode, chain=chain, block_size=block_size,
                   num_blocks=num_blocks, max_batch=max_batch, prefill_chunk=prefill_chunk,
                   cuda_graphs=cuda_graphs)

    def __repr__(self) -> str:
        return (f"MultiModuleMtpHead({self.config.describe()}, backend={self.backend.name}, "
                f"kv_mode={self.kv_mode}, chain={self.chain}, blocks={self.num_blocks}x{self.block_size})")

    # -- queries -------------------------------------------------------------------
    @property
    def num_modules(self) -> int:
        return self.config.num_modules

    @property
    def window(self) -> int:
        """Chained outputs kept per module in exact mode (trailing keys)."""
        return self.num_modules + 1

    def kv_blocks_in_use(self) -> list[int]:
        return [h.pool.num_used for h in self.modules]

    def drafter_rows(self, state: ProposerState) -> int:
        """Module 0's rows (``rows_per_module`` on the state gives every module's)."""
        return self._state(state, allow_drafted=True).kv[0].rows

    def last_pair_key(self, state: ProposerState) -> int | None:
        """Key of module 0's newest row; None when it has none."""
        return self._state(state, allow_drafted=True).kv[0].keys.last

    def propose_batch_max(self) -> int:
        """The widest ``propose_batch``: ``max_batch``, and no more sequences than a
        module's pool has blocks (each sequence of a propose writes a row into module 0,
        so holds at least one block there). Nothing else is sized per batch width: step
        buffers are built per batch shape."""
        return min(self.max_batch, min(h.pool.num_blocks for h in self.modules))

    def prefill_hidden_rows(self, max_seq_len: int) -> int:
        """Every prompt row is used (prefill runs in chunks of ``prefill_chunk``)."""
        return check_int("max_seq_len", max_seq_len, 0)

    def read_deferred_draft_token(self, state: ProposerState | None = None) -> int:
        """The last draft the last propose produced (of ``state``, or of any sequence),
        also when fewer than M modules ran."""
        drafts = self._last_drafts if state is None else self._state(state, allow_drafted=True).last_drafts
        if not drafts:
            raise StateError("read_deferred_draft_token: no propose has produced a draft yet")
        return drafts[-1]

    # -- state lifecycle --------------------------------------------------------------
    def alloc_state(self) -> MtpState:
        st = MtpState(owner=self, kv=[SeqKv() for _ in range(self.num_modules)],
                      win=[None] * self.num_modules, win_start=[0] * self.num_modules)
        self._states[id(st)] = st
        return st

    def alloc_state_for(self, budget_tokens: int | None) -> MtpState:
        """A state whose KV for ``budget_tokens`` tokens (prompt + max new tokens) is
        reserved in every module's pool now, so it cannot meet a full pool while it
        stays within the budget. ``None``: unknown budget, same as ``alloc_state``.
        Raises ``KvCacheFull`` (allocating nothing) when the pools cannot promise it."""
        if budget_tokens is None:
            return self.alloc_state()
        budget_tokens = check_int("budget_tokens", budget_tokens, 1)
        blocks = ceil_div(budget_tokens, self.block_size)
        probe = SeqKv()
        for h in self.modules:
            h.pool.check_room([(probe, budget_tokens)])
        st = self.alloc_state()
        for h, seq in zip(self.modules, st.kv):
            h.pool.reserve(seq, blocks)
        return st

    def free_state(self, state: ProposerState) -> None:
        st = self._state(state, allow_drafted=True)
        for h, seq in zip(self.modules, st.kv):
            h.pool.release_all(seq)
        st.freed = True
        del self._states[id(st)]

    def _state(self, state: Any, allow_drafted: bool = False, name: str = "state") -> MtpState:
        if not isinstance(state, MtpState):
            raise TypeError(f"{name}: expected an MtpState from alloc_state, got {type(state).__name__}")
        if state.owner is not self:
            raise StateError(f"{name}: belongs to another proposer")
        if state.freed:
            raise StateError(f"{name}: was freed by free_state and cannot be used again")
        if state.drafted and not allow_drafted:
            raise StateError(f"{name}: a propose awaits after_verify (call after_verify(num_accepted, state) first)")
        return state

    # -- prefill --------------------------------------------------------------------
    def prefill_drafter(self, prompt_tokens: Sequence[int], hiddens: Any, state: ProposerState) -> int:
        """Fill the drafter KV over the prompt; returns the rows written (all modules).

        ``hiddens`` ``[n, H]``: row ``i`` is the target's ``h_i`` at the position of
        ``prompt_tokens[i]``. Module 0 gets keys ``0 .. n-2`` (``h_{n-1}`` pairs with
        the first sampled token and comes again with the first propose); in exact
        mode module ``m`` gets keys ``0 .. n-2-m``. Runs in chunks of ``prefill_chunk``.
        The state must be fresh (to continue a sequence, use ``catchup_drafter``).
        """
        st = self._state(state)
        V, H = self.config.vocab_size, self.config.hidden_size
        toks = check_tokens("prompt_tokens", prompt_tokens, V)
        n = toks.shape[0]
        if n < 1:
            raise ValueError("prompt_tokens: expected at least 1 token, got 0")
        hid = ingest_hidden(self.backend, "hiddens", hiddens, H, rows=n)
        if st.num_verified or any(s.rows for s in st.kv):
            raise StateError(f"state: prefill_drafter needs a fresh state, this one holds "
                             f"{st.num_verified} tokens; continue a sequence with catchup_drafter")
        hid = self._target_norm(hid[: n - 1])
        if self.kv_mode == "draft":
            def fill() -> int:
                for a in range(0, n - 1, self.prefill_chunk):
                    b = min(n - 1, a + self.prefill_chunk)
                    self.modules[0].forward([RowJob(st.kv[0], toks[a + 1:b + 1], a, 1)], hid[a:b])
                st.num_verified = n
                st.num_hiddens = n - 1
                st.tail_start = n
                st.next_position = n
                return n - 1

            return self._guarded([st], [[n - 1]] + [[0]] * (self.num_modules - 1), fill)

        def fill_exact() -> int:
            st.tail = toks.tolist()
            st.tail_start = 0
            st.num_verified = st.next_position = n
            return self._catch_up([st], [hid])

        return self._guarded([st], [[max(0, n - 1 - m)] for m in range(self.num_modules)], fill_exact)

    def _guarded(self, sts: list[MtpState], new_rows: list[list[int]], body):
        """Run ``body()`` after checking that module ``m`` of ``sts[i]`` has room for
        ``new_rows[m][i]`` more rows; if ``body`` raises, restore every state."""
        for h, rows in zip(self.modules, new_rows):
            h.pool.check_room([(st.kv[h.index], r) for st, r in zip(sts, rows)])
        snaps = [_snapshot(st) for st in sts]
        try:
            return body()
        except BaseException:
            for st, snap in zip(sts, snaps):
                self._restore(st, snap)
            raise

    # -- propose ------------------------------------------------------------------------
    def propose(self, last_token: int, target_hidden: Any, position: int, num_drafts: int,
                state: ProposerState, grammar_bitmask: Any = None) -> list[int]:
        """Draft ``min(num_drafts, M)`` tokens after ``last_token`` = ``t_P`` at ``position`` = ``P``.

        ``target_hidden`` ``[H]``: the target's ``h_{P-1}``. Module 0 takes
        ``(t_P, h_{P-1})``, module ``m`` takes ``(d_{m-1}, module m-1's output)``, all
        at key ``P-1`` and RoPE position ``P+m``. ``grammar_bitmask``: see
        ``mtpkern.grammar``. Returns ``[d_0 .. d_{k'-1}]``.
        """
        return self._propose([last_token], [target_hidden], [position], num_drafts, [state],
                             None if grammar_bitmask is None else [grammar_bitmask], single=True)[0]

    def propose_batch(self, last_tokens: Sequence[int], target_hiddens: Any, positions: Sequence[int],
                      num_drafts: int, states: Sequence[ProposerState],
                      grammar_bitmasks: Sequence[Any] | None = None) -> list[list[int]]:
        """``propose`` for ``B`` sequences at once: one forward per module over all of them.

        ``target_hiddens``: ``[B, H]`` or a list of ``B`` ``[H]`` arrays;
        ``grammar_bitmasks``: None or a list of ``B`` (each None or any form ``propose``
        takes). Returns one list of drafts per sequence, as ``propose`` would.
        """
        return self._propose(last_tokens, target_hiddens, positions, num_drafts, states, grammar_bitmasks,
                             single=False)

    def _propose(self, last_tokens, target_hiddens, positions, num_drafts, states, grammar_bitmasks,
                 single: bool) -> list[list[int]]:
        cfg = self.config

        def name(one: str, many: str, i: int | None = None) -> str:
            return one if single else many if i is None else f"{many}[{i}]"

        states = [states] if isinstance(states, MtpState) else list(states)
        B = len(states)
        most = self.propose_batch_max()
        if B < 1 or B > most:
            raise ValueError(f"states: expected 1..{most} states (propose_batch_max), got {B}")
        sts = [self._state(s, name=name("state", "states", i)) for i, s in enumerate(states)]
        if len({id(s) for s in sts}) != B:
            raise ValueError("states: the same state appears twice in one batch")
        for nm, seq in (("last_tokens", last_tokens), ("positions", positions)):
            if len(seq) != B:
                raise ValueError(f"{nm}: expected {B} entries (one per state), got {len(seq)}")
        toks = [check_token(name("last_token", "last_tokens", i), t, cfg.vocab_size)
                for i, t in enumerate(last_tokens)]
        poss = [check_int(name("position", "positions", i), p, 1) for i, p in enumerate(positions)]
        num_drafts = check_int("num_drafts", num_drafts, 1)
        k = min(num_drafts, self.num_modules)
        hid = self._batch_hiddens(name("target_hidden", "target_hiddens"), target_hiddens, B, single)
        masks: list[MaskFn | None] = [None] * B
        if grammar_bitmasks is not None:
            if len(grammar_bitmasks) != B:
                raise ValueError(f"grammar_bitmasks: expected {B} entries (one per state), got {len(grammar_bitmasks)}")
            masks = [resolve(name("grammar_bitmask", "grammar_bitmasks", i), gm, cfg.vocab_size, k)
                     for i, gm in enumerate(grammar_bitmasks)]
        for i, (st, p) in enumerate(zip(sts, poss)):
            self._check_position(st, p, name("position", "positions", i))
        hid = self._target_norm(hid)
        run = self._propose_exact if self.kv_mode == "exact" else self._propose_draft
        runner = self.step_runner
        # The planned step takes only masks that do not depend on the drafts (callables may).
        static = grammar_bitmasks is None or not any(callable(gm) for gm in grammar_bitmasks)
        if runner is not None and static and runner.applies(sts, poss, k):
            run = runner.propose
        before = self.last_drafts_device
        self.last_drafts_device = None
        try:
            drafts = self._guarded(sts, [[self._propose_rows(st, m, p, k) for st, p in zip(sts, poss)]
                                         for m in range(self.num_modules)],
                                   lambda: run(sts, toks, poss, hid, k, masks))
        except BaseException:
            self.last_drafts_device = before                     # a failed call changes nothing
            raise
        if num_drafts > self.num_modules:                        # counted once the call has succeeded
            if self.clamped_calls == 0:
                _log.warning("mtpkern: num_drafts=%d exceeds the %d MTP modules; drafting %d "
                             "(counted in clamped_calls)", num_drafts, self.num_modules, k)
            self.clamped_calls += 1
        if self.last_drafts_device is None:
            self.last_drafts_device = self.backend.from_host(np.asarray(drafts, np.int32).reshape(B, k))
        for st, p, d in zip(sts, poss, drafts):
            st.drafted = True
            st.last_position = p
            st.last_k = k
            st.last_drafts = d
        self._last_drafts = drafts[-1]
        return drafts

    def _check_position(self, st: MtpState, p: int, name: str) -> None:
        if self.kv_mode == "draft":
            if p < st.next_position:
                raise ValueError(f"{name}: expected >= {st.next_position} (positions never go back), got {p}")
            return
        if st.num_verified == 0:
            raise StateError("state: exact kv_mode needs prefill_drafter before the first propose")
        if p != st.num_verified:
            raise ValueError(f"{name}: expected {st.num_verified} (the next position of this sequence), got {p}")
        if st.num_hiddens != p - 1:
            missing = p - 1 - st.num_hiddens
            raise StateError(f"state: {missing} accepted token(s) still need their target hiddens; "
                             f"call catchup_drafter(accepted_tokens, accepted_hiddens, state) first")

    def _propose_rows(self, st: MtpState, m: int, p: int, k: int) -> int:
        """Rows module ``m`` appends for a propose at ``p`` with ``k`` drafts."""
        if self.kv_mode == "draft":
            return 1 if m < k else 0
        target = p if m < k else max(0, min(p, p + k - m))
        return max(0, target - st.kv[m].rows)

    def _propose_draft(self, sts, toks, poss, hid, k, masks) -> list[list[int]]:
        B = len(sts)
        drafts: list[list[int]] = [[] for _ in range(B)]
        cur_tok = np.asarray(toks, np.int32)
        g = hid
        for m in range(k):
            jobs = [RowJob(st.kv[m], cur_tok[i:i + 1], p - 1, m + 1) for i, (st, p) in enumerate(zip(sts, poss))]
            y, normed = self.modules[m].forward(jobs, g, pad_tables=True)
            ids = self._draft_ids(m, normed, masks, drafts)
            for i in range(B):
                drafts[i].append(int(ids[i]))
            cur_tok = ids.astype(np.int32)
            g = normed if self.chain == "postnorm" else y
        for st, p in zip(sts, poss):
            st.num_hiddens = p
            st.num_verified = p + 1
            st.tail_start = p + 1
        return drafts

    def _propose_exact(self, sts, toks, poss, hid, k, masks) -> list[list[int]]:
        B = len(sts)
        drafts: list[list[int]] = [[] for _ in range(B)]
        for i, (st, p) in enumerate(zip(sts, poss)):
            st.num_hiddens = p
            st.num_verified = p + 1
            st.tail.append(toks[i])
        stage = [(p - 1, hid[i:i + 1]) for i, p in enumerate(poss)]
        for m in range(self.num_modules):
            normed, last_rows = self._run_exact(m, sts, stage, pad_tables=True)
            if m < k:
                idx = self.backend.from_host(np.asarray(last_rows, np.int64))
                ids = self._draft_ids(m, normed[idx], masks, drafts)
                for i, st in enumerate(sts):
                    drafts[i].append(int(ids[i]))
                    st.tail.append(int(ids[i]))
        for st in sts:
            self._trim_windows(st)
            self._trim_tail(st)
        return drafts

    def _draft_ids(self, m: int, normed: Any, masks: list[MaskFn | None], drafts: list[list[int]]) -> np.ndarray:
        """Module ``m``'s drafts for rows ``normed`` [B, H] (row i = sequence i), with a
        ``NoAllowedToken`` that names the sequence and the draft position."""
        rows = self._mask_rows(masks, m, drafts)
        try:
            return self.modules[m].argmax(normed, rows)
        except NoAllowedToken as e:
            i = e.row
            masked = rows is not None and i is not None and not (rows[i] == -1).all()
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

    # -- verify and catch-up ---------------------------------------------------------------
    def after_verify(self, num_accepted: int, state: ProposerState) -> None:
        """The verify accepted the first ``num_accepted`` drafts of the last propose.

        Draft mode: module ``m``'s row of that propose is kept iff ``m <= num_accepted``.
        Exact mode: module ``m`` keeps the keys whose tokens are verified (it drops
        its last ``max(0, m - num_accepted)`` keys of that propose). Emptied blocks
        return to the pools at once.
        """
        st = self._state(state, allow_drafted=True)
        if not st.drafted:
            raise StateError("state: after_verify without a propose to verify")
        a = check_int("num_accepted", num_accepted, 0, st.last_k)
        P, k = st.last_position, st.last_k
        if self.kv_mode == "draft":
            for m in range(a + 1, k):
                self.modules[m].pool.trim(st.kv[m], 1)
        else:
            del st.tail[P + 1 + a - st.tail_start:]
            for m, h in enumerate(self.modules):
                h.pool.trim(st.kv[m], st.kv[m].rows - self._exact_rows(st, m))
            self._trim_windows(st)
        st.num_verified = P + 1 + a
        st.next_position = P + 1 + a
        st.drafted = False
        for m in range(k):
            self.stats.drafted[m] += 1
            self.stats.accepted[m] += m < a
        self.stats.verifies += 1
        self.stats.accepted_total += a

    def catchup_drafter(self, tokens: Sequence[int], hiddens: Any, state: ProposerState) -> int:
        """Exact mode: give the target hiddens of verified tokens; returns rows written (all modules).

        After ``after_verify(a)``: ``tokens = [d_0 .. d_{a-1}]`` (the accepted drafts,
        ``t_{P+1} .. t_{P+a}``) and ``hiddens = [h_P .. h_{P+a-1}]``. Pair ``i`` is
        ``(tokens[i], hiddens[i])`` with ``hiddens[i]`` the hidden at the position just
        before ``tokens[i]``. Tokens past the accepted drafts extend the sequence (a
        decode step without drafting, or the next turn of a carried state).
        No tokens: a no-op. Draft mode: a no-op returning 0.
        """
        return self.catchup_batch([tokens], [hiddens], [state])

    def catchup_batch(self, tokens: Sequence[Sequence[int]], hiddens: Sequence[Any],
                      states: Sequence[ProposerState]) -> int:
        """``catchup_drafter`` for several sequences, one forward per module over all of them."""
        states = list(states)
        if len(tokens) != len(states) or len(hiddens) != len(states):
            raise ValueError(f"tokens, hiddens, states: expected equal lengths, got "
                             f"{len(tokens)}, {len(hiddens)}, {len(states)}")
        sts = [self._state(s, name=f"states[{i}]") for i, s in enumerate(states)]
        if len({id(s) for s in sts}) != len(sts):
            raise ValueError("states: the same state appears twice in one batch")
        V, H = self.config.vocab_size, self.config.hidden_size
        one = len(sts) == 1
        checked = []
        for i, (tk, hd) in enumerate(zip(tokens, hiddens)):
            tk = check_tokens("tokens" if one else f"tokens[{i}]", tk, V)
            if tk.shape[0] == 0 and hd is not None and int(np.prod(_shape(hd))) > 0:
                raise ValueError(f"{'hiddens' if one else f'hiddens[{i}]'}: expected no rows (no tokens), "
                                 f"got shape {list(_shape(hd))}")
            checked.append(tk)
        if self.kv_mode == "draft":                      # checked as in exact mode, then nothing to do
            for i, (tk, hd) in enumerate(zip(checked, hiddens)):
                if tk.shape[0]:
                    nm = "hiddens" if one else f"hiddens[{i}]"
                    hidden_shape(nm, hd, H, rows=tk.shape[0])
                    dt = np.asarray(hd).dtype.name if isinstance(hd, (np.ndarray, list, tuple)) else None
                    if dt is not None and dt not in ("float32", "bfloat16"):
                        raise TypeError(f"{nm}: expected dtype float32 or bfloat16, got {dt}")
            return 0
        todo, hids, news = [], [], []
        for i, (st, tk, hd) in enumerate(zip(sts, checked, hiddens)):
            if tk.shape[0] == 0:
                continue
            if st.num_verified == 0:
                raise StateError(f"states[{i}]: exact kv_mode needs prefill_drafter before catchup_drafter")
            hd = ingest_hidden(self.backend, f"hiddens[{i}]" if len(sts) > 1 else "hiddens", hd, H,
                               rows=tk.shape[0])
            base = st.num_hiddens + 1          # index of tokens[0] in the sequence
            for j, t in enumerate(tk.tolist()):
                idx = base + j
                if idx < st.num_tokens and st.tail[idx - st.tail_start] != t:
                    raise ValueError(f"tokens[{j}]: expected {st.tail[idx - st.tail_start]} (the verified "
                                     f"token at position {idx}), got {t}")
            todo.append(st)
            hids.append(hd)
            news.append(tk[max(0, st.num_tokens - base):].tolist())
        if not todo:
            return 0

        def run() -> int:
            for st, nw in zip(todo, news):
                st.tail.extend(nw)
                st.num_verified = st.next_position = st.num_tokens
            return self._catch_up(todo, [self._target_norm(h) for h in hids])

        return self._guarded(todo, [[self._catchup_rows(st, m, hd.shape[0], len(nw))
                                     for st, hd, nw in zip(todo, hids, news)] for m in range(self.num_modules)],
                             run)

    def _catchup_rows(self, st: MtpState, m: int, c: int, new_tokens: int) -> int:
        hn, T = st.num_hiddens + c, st.num_tokens + new_tokens
        return max(0, max(0, min(hn, T - m - 1)) - st.kv[m].rows)

    # -- the exact-mode engine ------------------------------------------------------------
    def _exact_rows(self, st: MtpState, m: int) -> int:
        return max(0, min(st.num_hiddens, st.num_tokens - m - 1))

    def _catch_up(self, sts: list[MtpState], hids: list[Any]) -> int:
        """Consume hiddens ``hids[i]`` (keys from ``num_hiddens``) and bring every module of
        every state to its exact rows, in chunks of ``prefill_chunk`` hiddens."""
        stage = [(st.num_hiddens, h) for st, h in zip(sts, hids)]
        ends = [st.num_hiddens + h.shape[0] for st, h in zip(sts, hids)]
        before = sum(sum(st.rows_per_module()) for st in sts)
        while any(st.num_hiddens < e for st, e in zip(sts, ends)):
            for st, e in zip(sts, ends):
                st.num_hiddens = min(e, st.num_hiddens + self.prefill_chunk)
            for m in range(self.num_modules):
                self._run_exact(m, sts, stage)
            for st in sts:
                self._trim_windows(st)
        for st in sts:
            self._trim_tail(st)
        return sum(sum(st.rows_per_module()) for st in sts) - before

    @staticmethod
    def _trim_tail(st: MtpState) -> None:
        """Drop tokens no module will read again: module m's next key j reads t_{j+m+1},
        and j + m + 1 > num_hiddens for every module (see the module docstring)."""
        drop = max(0, min(st.num_hiddens + 1, st.num_tokens) - st.tail_start)
        del st.tail[:drop]
        st.tail_start += drop

    def _run_exact(self, m: int, sts: list[MtpState], stage: list[tuple[int, Any]], pad_tables: bool = False):
        """Compute module ``m``'s missing rows for every state. ``stage[i]``: (first key,
        [c, H] hiddens) feeding module 0. Returns ``(normed, last_row_index per state)``.
        ``pad_tables``: padded block tables, as the planned propose step launches them."""
        jobs, gs, last_rows = [], [], []
        at = 0
        for st, (hk, harr) in zip(sts, stage):
            seq = st.kv[m]
            a, b = seq.rows, self._exact_rows(st, m)
            if b <= a:
                last_rows.append(-1)
                continue
            toks = np.asarray(st.tail[a + m + 1 - st.tail_start: b + m + 1 - st.tail_start], np.int32)
            if m == 0:
                g = harr[a - hk: b - hk]
            else:
                ws = st.win_start[m - 1]
                if st.win[m - 1] is None or a < ws or b > ws + st.win[m - 1].shape[0]:
                    raise AssertionError(f"module {m - 1}'s window [{ws}, ..) does not cover keys [{a}, {b})")
                g = st.win[m - 1][a - ws: b - ws]
            jobs.append(RowJob(seq, toks, a, m + 1))
            gs.append(g)
            at += b - a
            last_rows.append(at - 1)
        if not jobs:
            return None, last_rows
        g = gs[0] if len(gs) == 1 else self.backend.xp.concatenate(gs, axis=0)
        y, normed = self.modules[m].forward(jobs, g, pad_tables)
        chain = normed if self.chain == "postnorm" else y
        if m == self.num_modules - 1:
            return normed, last_rows                      # no module reads the last one's outputs
        # Append each state's new chained outputs to its window of module m.
        at = 0
        for st, job in zip([s for s, lr in zip(sts, last_rows) if lr >= 0], jobs):
            c = job.count
            self._append_window(st, m, job.first_key, chain[at: at + c])
            at += c
        return normed, last_rows

    def _append_window(self, st: MtpState, m: int, first_key: int, new: Any) -> None:
        """Module ``m``'s chained outputs ``new`` [c, H] for keys ``first_key ..`` join its window."""
        if st.win[m] is None or st.win[m].shape[0] == 0:
            st.win[m], st.win_start[m] = new, first_key
        else:
            st.win[m] = self.backend.xp.concatenate([st.win[m], new], axis=0)

    def _trim_windows(self, st: MtpState) -> None:
        """Keep module ``m``'s chained outputs for its last ``M + 1`` existing keys."""
        for m in range(self.num_modules):
            w = st.win[m]
            if w is None:
                continue
            end = st.kv[m].rows - st.win_start[m]        # keys past the module's rows are gone
            start = max(0, end - self.window)
            st.win[m] = w[start:max(start, end)]
            st.win_start[m] += start

    # -- multi-turn carry ----------------------------------------------------------------
    def take_drafter_kv(self, state: ProposerState) -> DrafterKv | None:
        """Move the state's drafter KV (and exact-mode window) out; the state is left as
        ``alloc_state()`` leaves one: no KV and no budget (taking ends the sequence the
        budget was for; what was still reserved goes back to the pools). None when the
        state holds nothing (then nothing changes)."""
        st = self._state(state)
        if st.num_verified == 0 and not any(s.rows for s in st.kv):
            return None
        kv = DrafterKv(self, [list(s.blocks) for s in st.kv], [s.keys.copy() for s in st.kv],
                       st.num_verified, st.num_hiddens, list(st.tail), st.tail_start, list(st.win),
                       list(st.win_start), st.next_position)
        for h, s in zip(self.modules, st.kv):
            s.blocks.clear()
            s.keys = KeyRuns()
            h.pool.drop_budget(s)
        self._reset_counters(st)
        self._carried[id(kv)] = kv
        return kv

    def install_drafter_kv(self, state: ProposerState, carried: DrafterKv) -> bool:
        """Install carried KV into a fresh state (the inverse of ``take_drafter_kv``).
        A state from ``alloc_state_for(budget_tokens)`` counts the carried blocks within
        its budget (the budget covers the whole conversation: history + this turn), so
        its reservation shrinks by them and the rest goes back to the pools."""
        st = self._state(state)
        kv = self._carried_kv(carried)
        if st.num_verified or any(s.rows for s in st.kv):
            raise StateError("state: install_drafter_kv needs a fresh state (from alloc_state or "
                             "left by take_drafter_kv)")
        for h, s, blocks, keys in zip(self.modules, st.kv, kv.blocks, kv.keys):
            s.blocks = list(blocks)
            s.keys = keys.copy()
            h.pool.fit_budget(s)
        st.num_verified, st.num_hiddens = kv.num_verified, kv.num_hiddens
        st.tail, st.tail_start = list(kv.tail), kv.tail_start
        st.win, st.win_start = list(kv.win), list(kv.win_start)
        st.next_position = kv.next_position
        kv.consumed = True
        del self._carried[id(kv)]
        return True

    def free_drafter_kv(self, carried: DrafterKv) -> None:
        """Release carried KV that no state owns."""
        kv = self._carried_kv(carried)
        for h, blocks in zip(self.modules, kv.blocks):
            h.pool.release_blocks(blocks)
        kv.consumed = True
        del self._carried[id(kv)]

    def _carried_kv(self, carried: Any) -> DrafterKv:
        if not isinstance(carried, DrafterKv):
            raise TypeError(f"carried: expected a DrafterKv from take_drafter_kv, got {type(carried).__name__}")
        if carried.owner is not self:
            raise StateError("carried: belongs to another proposer")
        if carried.consumed:
            raise StateError("carried: already installed or freed")
        return carried

    def _reset_counters(self, st: MtpState) -> None:
        st.num_verified = st.num_hiddens = st.tail_start = 0
        st.tail = []
        st.win = [None] * self.num_modules
        st.win_start = [0] * self.num_modules
        st.next_position = 1
        st.drafted = False
        st.last_position, st.last_k, st.last_drafts = -1, 0, []

    # -- helpers ---------------------------------------------------------------------------
    def _batch_hiddens(self, name: str, hiddens: Any, B: int, single: bool = False) -> Any:
        H = self.config.hidden_size
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

    def _restore(self, st: MtpState, snap: _Snapshot) -> None:
        for h, seq, rows in zip(self.modules, st.kv, snap.rows):
            h.pool.trim(seq, seq.rows - rows)
        scalars, st.tail, st.win, st.win_start, st.last_drafts = snap.fields
        for f, v in zip(_STATE_FIELDS, scalars):
            setattr(st, f, v)

    # -- invariants --------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Pool accounting over every live state and carried entry, then each state's rules."""
        for m, h in enumerate(self.modules):
            owners = [st.kv[m].blocks for st in self._states.values()]
            owners += [kv.blocks[m] for kv in self._carried.values()]
            reserved = sum(st.kv[m].reserved for st in self._states.values())
            h.pool.check_invariants(owners, reserved)
        for st in self._states.values():
            self._check_state(st)

    def _check_state(self, st: MtpState) -> None:
        if st.freed:
            if any(s.blocks for s in st.kv):
                raise AssertionError("a freed state still holds blocks")
            return
        for m, (h, seq) in enumerate(zip(self.modules, st.kv)):
            h.pool.check_seq(seq)
            keys = seq.keys.to_list()
            if any(b <= a for a, b in zip(keys, keys[1:])):
                raise AssertionError(f"module {m}: keys not increasing: {keys}")
        if st.num_verified and st.num_verified < st.num_hiddens + 1:
            raise AssertionError(f"{st.num_verified} verified tokens but {st.num_hiddens} hiddens consumed")
        if self.kv_mode == "draft":
            return
        for m, seq in enumerate(st.kv):
            want = self._exact_rows(st, m)
            if seq.rows != want or seq.keys.to_list() != list(range(want)):
                raise AssertionError(f"exact mode, module {m}: keys {seq.keys!r}, expected 0..{want - 1} "
                                     f"(num_hiddens {st.num_hiddens}, num_tokens {st.num_tokens})")
            w = st.win[m]
            if want and m < self.num_modules - 1 and (w is None or st.win_start[m] + w.shape[0] != want
                                                      or w.shape[0] > self.window):
                raise AssertionError(f"exact mode, module {m}: window does not end at its last key {want - 1}")
        if st.num_verified and (st.tail_start > st.num_hiddens + 1 or len(st.tail) > self.num_modules):
            raise AssertionError(f"exact mode: token tail [{st.tail_start}, {st.num_tokens}) should start at "
                                 f"num_hiddens + 1 = {st.num_hiddens + 1} and hold at most M tokens")
