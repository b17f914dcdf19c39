"""One module's LM head as the drafting calls use it: drafts (the masked argmax), their
confidences, a draft tree's top ``k``, the logits for diagnostics.

``LmHead`` reads the whole vocabulary or a draft vocabulary's rows (mtpkern.vocab: masks in
target ids, ids mapped back); ``ShardedLmHead`` is one rank's share of a vocabulary-parallel
head (mtpkern.shard), its partial results met with the other ranks' in the reductions of
mtpkern.comm, so that every rank returns the single-rank answer (ties to the lowest id, NaN
never wins) and raises ``NoAllowedToken`` alike. The kernels are the backend's
(mtpkern.ops.lm_head); the results come back to the host.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .comm import sharded_argmax, sharded_confidence, sharded_logits, sharded_topk
from .errors import NoAllowedToken, no_token_reason
from .ops.lm_head import bitmask_allowed, check_topk, masked_topk_partial
from .ops.sampling import check_params, masked_sample
from .vocab import DraftVocab


class LmHead:
    """``weight`` [V', H] on ``backend``: the rows of ``vocab`` (a ``DraftVocab``), or of the
    whole vocabulary of ``vocab_size`` tokens when ``vocab`` is None."""

    def __init__(self, backend: Any, weight: Any, vocab: DraftVocab | None, vocab_size: int):
        self.backend, self.w, self.vocab, self.vocab_size = backend, weight, vocab, vocab_size
        #: keyword arguments of the backend's LM-head ops over this head (a subset's ``id_map``)
        self.kw = {} if vocab is None else {"id_map": backend.from_host(vocab.ids)}

    def argmax(self, normed_rows: Any, bitmask: np.ndarray | None = None) -> np.ndarray:
        """Drafts for ``normed_rows`` [n, H]; ``bitmask`` [n, W] int32 or None -> [n] int32 (host).
        With a draft vocabulary: the argmax over its rows, the mask and the ids in target ids."""
        be = self.backend
        ids = be.lm_head_argmax(normed_rows, self.w, self.mask(bitmask), **self.kw)
        return np.asarray(be.to_host(ids), np.int32)

    def argmax_conf(self, normed_rows: Any, bitmask: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``argmax`` and each draft's confidence (the softmax of the allowed logits at the
        draft, mtpkern.ops.lm_head; over the draft vocabulary when there is one):
        ([n] int32, [n] FP32), on the host."""
        be = self.backend
        conf = be.xp.empty(normed_rows.shape[0], np.float32)
        ids = be.lm_head_argmax(normed_rows, self.w, self.mask(bitmask), conf=conf, **self.kw)
        return np.asarray(be.to_host(ids), np.int32), np.asarray(be.to_host(conf), np.float32)

    @property
    def samples(self) -> bool:
        """Whether ``sample`` works here (the backend's ``lm_head_sample``)."""
        return bool(getattr(self.backend, "samples", False))

    def sample(self, normed_rows: Any, bitmask: np.ndarray | None, keys: np.ndarray, params: list,
               want_dist: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Drafts sampled from each row's distribution (mtpkern.ops.sampling; ``params``: one
        ``SamplingParams`` per row, ``keys`` [n] uint64 their ``row_key``), on the host: (ids
        [n] int32 in target ids, each draft's probability [n] FP32, and with ``want_dist`` the
        whole distributions [n, vocab_size] FP32 over target ids, or None)."""
        be = self.backend
        n = normed_rows.shape[0]
        T, K, P = check_params("sampling", params, n)
        dist = be.xp.empty((n, self.w.shape[0]), np.float32) if want_dist else None
        ids, probs = be.lm_head_sample(normed_rows, self.w, self.mask(bitmask), keys=keys, temperature=T,
                                       top_k=K, top_p=P, dist=dist, **self.kw)
        q = None
        if want_dist:
            rows = np.asarray(be.to_host(dist), np.float32)
            if self.vocab is None:
                q = rows
            else:                                            # a draft vocabulary's rows -> target ids
                q = np.zeros((n, self.vocab_size), np.float32)
                q[:, self.vocab.ids] = rows
        return np.asarray(be.to_host(ids), np.int32), np.asarray(be.to_host(probs), np.float32), q

    def topk(self, normed_rows: Any, bitmask: np.ndarray | None, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Each row's ``k`` best allowed tokens and their probabilities (a draft tree's
        children; mtpkern.ops.lm_head.masked_topk), target ids, on the host:
        ([n, k] int32, -1 past the candidates; [n, k] FP32)."""
        be = self.backend
        ids, probs = be.lm_head_topk(normed_rows, self.w, self.mask(bitmask), k, **self.kw)
        return np.asarray(be.to_host(ids), np.int32), np.asarray(be.to_host(probs), np.float32)

    def mask(self, bitmask: np.ndarray | None) -> Any:
        """A host [n, W] mask in target ids -> the backend mask the LM head reads."""
        if bitmask is None:
            return None
        return self.backend.from_host(self.host_mask(bitmask))

    def host_mask(self, bitmask: np.ndarray) -> np.ndarray:
        """A host [n, W] mask in target ids -> this head's rows' bits, on the host."""
        bm = np.ascontiguousarray(bitmask, np.int32)
        return bm if self.vocab is None else self.vocab.sub_mask(bm)

    def logits(self, normed_rows: Any) -> np.ndarray:
        """[n, V] FP32 logits on the host (diagnostics and tests; drafting never writes them);
        with a draft vocabulary [n, V'], column j for target id ``vocab.ids[j]`` (a sharded
        rank: its own rows)."""
        return np.asarray(self.backend.to_host(self.backend.lm_head_logits(normed_rows, self.w)))

    def _no_token(self, ids: np.ndarray, masked: bool) -> None:
        """``NoAllowedToken`` naming the first row whose id is -1 (every rank alike)."""
        none = np.flatnonzero(ids < 0)
        if none.size:
            r = int(none[0])
            raise NoAllowedToken(f"row {r}: {no_token_reason(masked, self.vocab_size)}", row=r)


class ShardedLmHead(LmHead):
    """One rank's share of a vocabulary-parallel LM head (``vocab``: its rows' target ids, a
    share of the vocabulary or of a draft vocabulary), its results met through ``comm``."""

    def __init__(self, backend: Any, weight: Any, vocab: DraftVocab, vocab_size: int, comm: Any):
        super().__init__(backend, weight, vocab, vocab_size)
        self.comm = comm

    def argmax(self, normed_rows: Any, bitmask: np.ndarray | None = None) -> np.ndarray:
        return self._argmax(normed_rows, bitmask, conf=False)[0]

    def argmax_conf(self, normed_rows: Any, bitmask: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        return self._argmax(normed_rows, bitmask, conf=True)

    def _argmax(self, normed_rows: Any, bitmask: np.ndarray | None,
                conf: bool) -> tuple[np.ndarray, np.ndarray | None]:
        """This rank's partial result over its rows (the backend's ``best=`` / ``sum_exp=``),
        then the whole vocabulary's by ``comm.sharded_argmax`` (and ``sharded_confidence``)."""
        be, xp = self.backend, self.backend.xp
        n = normed_rows.shape[0]
        best, sums = xp.empty(n, np.float32), (xp.empty(n, np.float32) if conf else None)
        local = be.lm_head_argmax(normed_rows, self.w, self.mask(bitmask), best=best, sum_exp=sums, **self.kw)
        ids, confs = self.reduce(local, best, sums)
        host = np.asarray(be.to_host(ids), np.int32)
        self._no_token(host, bitmask is not None)
        return host, None if confs is None else np.asarray(be.to_host(confs), np.float32)

    @property
    def samples(self) -> bool:
        """Any backend: the draw runs on the host over the gathered logits."""
        return True

    def sample(self, normed_rows: Any, bitmask: np.ndarray | None, keys: np.ndarray, params: list,
               want_dist: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """This rank's logits (written out, the disallowed ones NaN), gathered with the other
        ranks' into the whole vocabulary's (``comm.sharded_logits``); every rank then draws the
        same drafts from them by the reference (mtpkern.ops.sampling), noise keyed on target
        ids: the single-rank head's drafts."""
        be = self.backend
        n = normed_rows.shape[0]
        T, K, P = check_params("sampling", params, n)
        logits = np.asarray(be.to_host(be.lm_head_logits(normed_rows, self.w)), np.float32)    # [n, V_r]
        if bitmask is not None:
            logits = np.where(bitmask_allowed(self.host_mask(bitmask), logits.shape[1]), logits, np.float32(np.nan))
        full = sharded_logits(logits, np.asarray(self.vocab.ids), self.vocab_size, self.comm, be.from_host,
                              be.to_host)
        ids, probs, q = masked_sample(full, None, keys, T, K, P, want_dist=want_dist)
        return ids, probs, q

    def reduce(self, local: Any, best: Any, sums: Any = None) -> tuple[Any, Any]:
        """This rank's partial result (``local`` ids, ``best`` logits, ``sums`` or None: the
        backend's ``best=`` / ``sum_exp=``) -> the whole vocabulary's ids and, with ``sums``, the
        confidences, on the backend (-1 / NaN where no rank has a candidate); the eager path and
        the planned step (mtpkern.cuda_graph) both reduce through it."""
        xp = self.backend.xp
        ids = sharded_argmax(best, local, self.comm, xp)
        confs = None if sums is None else sharded_confidence(best, sums, local >= 0, ids, self.comm, xp)
        return ids, confs

    def topk(self, normed_rows: Any, bitmask: np.ndarray | None, k: int) -> tuple[np.ndarray, np.ndarray]:
        """This rank's logits (written out, as a single rank's tree does), its top ``k`` and
        softmax statistics, merged with the other ranks' by ``comm.sharded_topk``."""
        be = self.backend
        logits = np.asarray(be.to_host(be.lm_head_logits(normed_rows, self.w)), np.float32)
        mask = None if bitmask is None else self.host_mask(bitmask)
        ids, vals, best, sums = masked_topk_partial(logits, mask, check_topk(k))
        ids = np.where(ids >= 0, self.vocab.ids[np.maximum(ids, 0)], -1).astype(np.int32)    # target ids
        ids, probs = sharded_topk(ids, vals, best, sums, self.comm, be.from_host, be.to_host)
        self._no_token(ids[:, 0], bitmask is not None)
        return ids, probs
