"""``ReferenceTarget``: a target model's greedy forward on mtpkern's own ops, and its verify.

For demos, tests and benchmarks of the drafter against a real verifier (never a serving
engine): the target's decoder layers run as ``head.DecoderLayer`` (an MTP module's block
without its MTP input and output, op for op the same code), each with its own paged KV
(``kv.BlockPool``), on any backend. A sequence's rows are its tokens ``t_0 .. t_{n-1}``
at RoPE positions ``0 .. n-1`` (key = position)::

    x_0   = E[t]                                  # [n, H], gathered on the host
    x_l+1 = DecoderLayer_l(x_l)                   # l = 0 .. L-1: attention over layer l's KV, FFN
    h     = rmsnorm(x_L, model.norm)              # [n, H]: what the drafter takes (docs/hf_reference.md)
    next  = argmax(lm_head @ h)                   # greedy, ties to the lowest id

``h_j`` is the hidden at position ``j``, the one ``t_{j+1}`` is predicted from (the indices of
docs/semantics.md). Calls:

- ``prefill(seq, tokens)``: rows for the prompt ``t_0 .. t_{n-1}``; -> ``TargetOut`` with
  ``hiddens`` ``[h_0 .. h_{n-1}]``, the greedy token of every row, and ``next_token`` ``t_n``;
- ``decode(seq, token)``: one more row (plain greedy decoding);
- ``verify(seq, last_token, drafts)``: one forward over ``[t_P, d_0 .. d_{k-1}]`` at positions
  ``P .. P+k``; greedy acceptance ``a`` (the longest prefix of drafts equal to the target's
  argmax), the bonus token (the argmax after the accepted prefix), the hiddens
  ``[h_P .. h_{P+a}]``; the rows of the rejected drafts are trimmed, so the KV holds
  ``t_0 .. t_P, d_0 .. d_{a-1}`` as a prefill of those tokens would.

Only the ``glm4_moe`` family (GLM-4.5's layout) is run; ``from_pretrained`` refuses others
by name (``weights.check_target_config``). Every call checks its arguments first (errors
name the argument, what was expected and what came) and a failed call leaves the sequence
as it was: the rows a call appended in any layer are trimmed again.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from .checks import check_int, check_token, check_tokens
from .config import MtpConfig
from .errors import StateError
from .head import DecoderLayer, RowJob
from .kv import SeqKv
from .lm import LmHead
from .weights import TargetWeights, load_target_weights


class TargetOut(NamedTuple):
    """The target's forward over ``n`` new rows: ``greedy`` [n] int32 (the argmax of each row),
    ``hiddens`` [n, H] FP32 on the host (after the final norm); ``next_token``: the last row's
    greedy token."""

    next_token: int
    hiddens: np.ndarray
    greedy: np.ndarray


class Verdict(NamedTuple):
    """``ReferenceTarget.verify``'s decision over ``k`` drafts: ``num_accepted`` a (0 .. k),
    ``bonus`` (the target's token after the accepted prefix), ``hiddens`` [a + 1, H]
    ``[h_P .. h_{P+a}]`` (the first ``a`` for the drafter's catch-up, the last for its next
    propose), ``greedy`` [k + 1] the target's argmax at every verified row."""

    num_accepted: int
    bonus: int
    hiddens: np.ndarray
    greedy: np.ndarray


@dataclass(slots=True, eq=False)
class TargetSeq:
    """One sequence of a ``ReferenceTarget``: its KV rows in every layer (``kv[l]``) and the
    tokens they hold (``tokens``, ``t_0 .. t_{n-1}``), read-only views. Handed out by
    ``alloc_seq`` only (a copy is refused by every call)."""

    _kv: list[SeqKv]
    _tokens: list[int]
    _freed: bool = False

    @property
    def kv(self) -> tuple[SeqKv, ...]:
        return tuple(self._kv)

    @property
    def tokens(self) -> list[int]:
        """A copy of the tokens in the KV."""
        return list(self._tokens)

    @property
    def length(self) -> int:
        """Tokens in the KV (the next row's position)."""
        return len(self._tokens)

    @property
    def freed(self) -> bool:
        return self._freed


class ReferenceTarget:
    """A ``glm4_moe`` target model's layers on ``backend`` (module docstring)."""

    DEFAULT_KV_TOKENS = 32768

    def __init__(self, config: MtpConfig, weights: TargetWeights, backend: Any, block_size: int = 16,
                 num_blocks: int | None = None):
        block_size = check_int("block_size", block_size, 1, 1 << 16)
        num_blocks = -(-self.DEFAULT_KV_TOKENS // block_size) if num_blocks is None else \
            check_int("num_blocks", num_blocks, 1, (2 ** 31 - 1) // block_size)
        self.config, self.backend = config, backend
        self.block_size, self.num_blocks = block_size, num_blocks
        #: the decoder layers, each with its own pool of ``num_blocks`` blocks
        self.layers = [DecoderLayer(i, config, w, backend, num_blocks, block_size, b)
                       for i, (w, b) in enumerate(zip(weights.layers, weights.blocks))]
        self._embed = weights.embed                  # [V, H] host, as stored
        self._norm = weights.norm
        self.lm = LmHead(backend, weights.head, None, config.vocab_size)
        self._seqs: set[int] = set()
        self._lock = threading.Lock()                # one call at a time: a reference, not an engine

    @classmethod
    def from_pretrained(cls, ckpt_dir: str | os.PathLike, backend: Any = "auto", block_size: int = 16,
                        num_blocks: int | None = None, threads: int | None = None) -> "ReferenceTarget":
        """The target of the checkpoint at ``ckpt_dir`` (``config.json`` with ``model_type``
        ``glm4_moe``; its ``model.layers.{0 .. num_hidden_layers - 1}``, ``model.embed_tokens``,
        ``model.norm``, ``lm_head``). ``backend``: as ``MultiModuleMtpHead.from_pretrained``'s;
        ``block_size`` / ``num_blocks``: every layer's pool (default ``32768 / block_size``
        blocks). Another family raises ``ConfigError`` naming it; a missing or mis-shaped tensor
        ``CheckpointError`` naming the tensor."""
        from .backends import get_backend

        cfg = MtpConfig.from_json(os.path.join(os.fspath(ckpt_dir), "config.json"))
        be = get_backend(backend, threads=threads)
        return cls(cfg, load_target_weights(ckpt_dir, cfg, be), be, block_size, num_blocks)

    def __repr__(self) -> str:
        kinds = "".join("m" if layer.block.moe else "d" for layer in self.layers)
        return (f"ReferenceTarget({len(self.layers)} layers [{kinds}], H={self.config.hidden_size}, "
                f"V={self.config.vocab_size}, backend={self.backend.name}, blocks={self.num_blocks}x{self.block_size})")

    # -- sequences ----------------------------------------------------------------
    def alloc_seq(self) -> TargetSeq:
        """A new, empty sequence (free it with ``free_seq``)."""
        with self._lock:
            seq = TargetSeq([layer.alloc_seq() for layer in self.layers], [])
            self._seqs.add(id(seq))
            return seq

    def free_seq(self, seq: TargetSeq) -> None:
        """Return every block of ``seq``; using it again raises ``StateError``."""
        with self._lock:
            self._check_seq(seq)
            for layer, kv in zip(self.layers, seq._kv):
                layer.free_seq(kv)
            self._seqs.discard(id(seq))
            seq._freed = True

    def kv_blocks_in_use(self) -> list[int]:
        """Blocks in use in each layer's pool."""
        return [layer.pool.num_used for layer in self.layers]

    def _check_seq(self, seq: Any) -> None:
        if not isinstance(seq, TargetSeq):
            raise TypeError(f"seq: expected a TargetSeq from alloc_seq(), got {type(seq).__name__}")
        if seq.freed or id(seq) not in self._seqs:
            raise StateError("seq: expected a live sequence of this target (from its alloc_seq()), got "
                             + ("a freed one" if seq.freed else "another target's or a copy"))

    # -- the calls -------------------------------------------------------------
    def prefill(self, seq: TargetSeq, tokens: Any) -> TargetOut:
        """The prompt ``tokens`` ``t_0 .. t_{n-1}`` (n >= 1) into an empty ``seq``."""
        with self._lock:
            self._check_seq(seq)
            if seq.length:
                raise StateError(f"seq: expected an empty sequence for prefill, got one holding {seq.length} "
                                 f"tokens (decode / verify continue a sequence)")
            toks = self._tokens("tokens", tokens, 1, seq)
            return self._run(seq, toks)

    def decode(self, seq: TargetSeq, token: Any) -> TargetOut:
        """One more token ``t_n`` into ``seq``: ``hiddens`` [1, H] (``h_n``), ``next_token`` ``t_{n+1}``."""
        with self._lock:
            self._check_seq(seq)
            self._need_prefix(seq, "decode")
            tok = check_token("token", token, self.config.vocab_size)
            return self._run(seq, self._tokens("token", [tok], 1, seq))

    def verify(self, seq: TargetSeq, last_token: Any, drafts: Any) -> Verdict:
        """Greedy verification of ``drafts`` ``[d_0 .. d_{k-1}]`` (k >= 0) after ``last_token``
        ``t_P`` (``P = seq.length``): one forward over the k + 1 rows, then the rows of the
        rejected drafts trimmed from every layer (the KV keeps ``t_P, d_0 .. d_{a-1}``)."""
        with self._lock:
            self._check_seq(seq)
            self._need_prefix(seq, "verify")
            tok = check_token("last_token", last_token, self.config.vocab_size)
            d = check_tokens("drafts", drafts, self.config.vocab_size)
            rows = self._tokens("drafts", np.concatenate([np.array([tok], np.int32), d]), 1, seq)
            out = self._run(seq, rows)
            k = d.shape[0]
            # a: the longest prefix with d_j == argmax at row j (row j predicts t_{P+j+1})
            a = int(np.argmin(np.append(out.greedy[:k] == d, False)))
            self._trim(seq, k - a)
            return Verdict(a, int(out.greedy[a]), out.hiddens[:a + 1], out.greedy)

    # -- the forward -----------------------------------------------------------
    def _need_prefix(self, seq: TargetSeq, call: str) -> None:
        if not seq.length:
            raise StateError(f"seq: expected a prefilled sequence for {call}, got an empty one (prefill first)")

    def _tokens(self, name: str, tokens: Any, least: int, seq: TargetSeq) -> np.ndarray:
        toks = check_tokens(name, tokens, self.config.vocab_size)
        if toks.shape[0] < least:
            raise ValueError(f"{name}: expected at least {least} token(s), got {toks.shape[0]}")
        top = seq.length + toks.shape[0] - 1
        if top >= self.config.max_position_embeddings:
            raise ValueError(f"{name}: this call would write a target row at position {top}, past the model's "
                             f"max_position_embeddings ({self.config.max_position_embeddings})")
        return toks

    def _run(self, seq: TargetSeq, toks: np.ndarray) -> TargetOut:
        """Rows for ``toks`` at positions ``seq.length ..`` through every layer; on any error the
        rows already appended are trimmed again (``KvCacheFull`` before any: room is taken in
        every layer's pool first)."""
        be, c, P = self.backend, toks.shape[0], seq.length
        grown = 0
        try:
            for layer, kv in zip(self.layers, seq._kv):          # the blocks of every layer, or none
                layer.pool.grow(kv, c, layer)
                grown += 1
            x = be.from_host(np.ascontiguousarray(self._embed[toks], np.float32))      # [c, H]
            for layer, kv in zip(self.layers, seq._kv):
                x, _ = layer.forward([RowJob(kv, toks, P, 0)], x)                       # [c, H]
            h = be.rmsnorm(x, self._norm, self.config.rms_norm_eps)                    # [c, H]
            greedy = self.lm.argmax(h)                                                 # [c]
            hiddens = np.asarray(be.to_host(h), np.float32)
        except BaseException:
            for layer, kv in zip(self.layers[:grown], seq._kv):
                layer.pool.trim(kv, kv.rows - P, layer)           # rows appended, blocks taken ahead
            raise
        seq._tokens.extend(int(t) for t in toks)
        return TargetOut(int(greedy[-1]), hiddens, greedy)

    def _trim(self, seq: TargetSeq, drop: int) -> None:
        if drop:
            for layer, kv in zip(self.layers, seq._kv):
                layer.pool.trim(kv, drop, layer)
            del seq._tokens[-drop:]
