"""Shared by tests/test_comm.py and tests/mpi_worker.py: LM head cases, the single-rank
answer (the NumPy reference), one rank's share of it, and a world of threads."""

from __future__ import annotations

import threading
from typing import Any, Callable

import numpy as np

from mtpkern.backends.numpy_backend import NumpyBackend
from mtpkern.comm import _dtype, _gather_shape, _op, _root
from mtpkern.errors import NoAllowedToken

REF = NumpyBackend()
GRID = np.array([-3.0, -1.0, -0.0, 0.0, 0.5, 2.0, 2.0], np.float32)      # ties, and -0.0 against 0.0


def logit_case(rng: np.random.Generator, V: int | None = None, masked: bool | None = None):
    """(x [n, V], w [V, V], mask [n, ceil(V / 32)] int32 or None): identity weights, so the
    logits are x exactly, with NaN rows of w making NaN tokens; x from a grid of ties."""
    n = int(rng.integers(1, 5))
    V = int(rng.choice([1, 5, 33, 64, 100])) if V is None else V
    x = rng.choice(GRID, (n, V)).astype(np.float32)
    w = np.eye(V, dtype=np.float32)
    w[rng.choice(V, int(rng.integers(0, V // 2 + 1)), replace=False)] = np.nan
    masked = bool(rng.integers(0, 2)) if masked is None else masked
    mask = rng.integers(-2**31, 2**31, (n, (V + 31) // 32), dtype=np.int64).astype(np.int32) if masked else None
    return x, w, mask


def reference(x, w, mask):
    """The single-rank answer row by row: ids (-1: no allowed non-NaN token) and confidences."""
    n = x.shape[0]
    ids, conf = np.full(n, -1, np.int32), np.full(n, np.nan, np.float32)
    for i in range(n):
        c = np.zeros(1, np.float32)
        try:
            with np.errstate(invalid="ignore"):
                ids[i] = REF.lm_head_argmax(x[i:i + 1], w, None if mask is None else mask[i:i + 1], conf=c)[0]
            conf[i] = c[0]
        except NoAllowedToken:
            pass
    return ids, conf


def _allowed(mask, i, j) -> bool:
    return mask is None or bool((int(mask[i, j >> 5]) >> (j & 31)) & 1)


def local_best(x, w, mask, lo: int, hi: int):
    """One rank's share of the vocabulary, tokens lo .. hi - 1: per row its best allowed
    non-NaN logit and that token's global id (the lowest on a tie; -1: none), the sum of
    exp(logit - best) over its allowed non-NaN logits (a logit equal to the best counting 1),
    and whether it had any. Logits as the identity head gives them: x, NaN for NaN rows of w."""
    n = x.shape[0]
    best, ids = np.zeros(n, np.float32), np.full(n, -1, np.int64)
    sums, has = np.zeros(n, np.float32), np.zeros(n, bool)
    for i in range(n):
        vals = [(x[i, j] if not np.isnan(w[j]).any() else np.float32(np.nan), j) for j in range(lo, hi)
                if _allowed(mask, i, j)]
        vals = [(v, j) for v, j in vals if not np.isnan(v)]
        if not vals:
            continue
        b = max(v for v, _ in vals)
        best[i], ids[i], has[i] = b, min(j for v, j in vals if v == b), True
        sums[i] = np.float32(sum(1.0 if v == b else np.exp(np.float64(v) - b) for v, _ in vals))
    return best, ids, sums, has


class ThreadWorld:
    """A world of ``size`` ranks as threads of one process (``run``), each with a
    communicator whose collectives meet at a barrier (a rank left waiting more than
    ``timeout`` seconds raises ``threading.BrokenBarrierError``); sums in rank order."""

    def __init__(self, size: int, timeout: float = 30):
        self.size = size
        self.slots: list[Any] = [None] * size
        self.barrier = threading.Barrier(size, timeout=timeout)

    def run(self, fn: Callable[[Any], Any]) -> list[Any]:
        out, errors = [None] * self.size, []

        def rank(r):
            try:
                out[r] = fn(_ThreadComm(self, r))
            except BaseException as e:          # noqa: BLE001 - reported below
                errors.append(e)
                self.barrier.abort()

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return out


class _ThreadComm:
    def __init__(self, world: ThreadWorld, rank: int):
        self.world, self.rank, self.size = world, rank, world.size

    def _meet(self, value) -> list[Any]:
        w = self.world
        w.slots[self.rank] = value
        w.barrier.wait()
        got = list(w.slots)
        w.barrier.wait()                        # nobody overwrites a slot before all have read
        return got

    def all_reduce(self, buf, op):
        _dtype("buf", buf)
        got = self._meet(buf.copy())
        acc = got[0].copy()
        for g in got[1:]:
            acc = acc + g if _op(op) == "sum" else np.maximum(acc, g)
        buf[...] = acc

    def all_gather(self, send, recv):
        _dtype("send", send)
        _gather_shape(send, recv, self.size)
        recv[...] = np.stack(self._meet(send.copy()))

    def broadcast(self, buf, root):
        _dtype("buf", buf)
        buf[...] = self._meet(buf.copy())[_root(root, self.size)]
