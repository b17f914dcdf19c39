"""Communicators: how the ranks of a sharded draft head talk (docs/distributed.md).

A sharded head runs the same propose on every rank, each holding a slice of the
weights (and of the KV where the heads are sliced); the slices' partial results
meet in collectives. mtpkern does not bring a transport of its own: a
communicator is any object with

- ``rank`` and ``size`` (ints: this process's index, 0 .. size - 1, and the world size);
- ``all_reduce(buf, op)``: ``buf`` replaced, in place, by the element-wise ``op`` ("sum" or
  "max") of every rank's ``buf`` (same shape and dtype everywhere);
- ``all_gather(send, recv)``: ``recv[r]`` = rank r's ``send`` (``recv``: ``[size, *send.shape]``);
- ``broadcast(buf, root)``: every rank's ``buf`` replaced, in place, by rank ``root``'s.

Buffers are the backend's arrays: NumPy for the numpy and cpu backends, CuPy for cuda,
where every call is ordered on the current CuPy stream (so a CUDA graph may capture it)
and returns without waiting for it. Every rank makes the same calls in the same order; a
call that raises on one rank raises on all (the checks below depend only on what every
rank agrees on: shapes, dtypes, op names).

Three implementations: ``LocalComm`` (a world of one: every collective is the identity),
``MpiComm`` (``mpi4py``, NumPy buffers; ``pip install 'mtpkern[mpi]'``, from a source checkout
``pip install -e '.[mpi]'``) and ``NcclComm``
(NCCL through ``cupy.cuda.nccl``, CuPy buffers). An engine that has a communicator of its
own wraps it in an object with the four members above.

``sharded_argmax`` and ``sharded_confidence`` are the vocabulary-parallel LM head's
reductions: one collective each, exactly the single-rank answer's rule (ties to the
lowest id, NaN never wins); ``sharded_topk`` merges the shards' candidates of a draft tree.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import numpy as np

from .errors import CheckpointError, ConfigError, KvCacheFull, MtpError, NoAllowedToken, StateError, install_hint

#: the reductions every communicator provides
OPS = ("sum", "max")
#: the dtypes the collectives carry (``sharded_argmax`` packs its keys as uint64)
DTYPES = ("float32", "int32", "int64", "uint64")


@runtime_checkable
class Communicator(Protocol):
    rank: int
    size: int

    def all_reduce(self, buf: Any, op: str) -> None: ...

    def all_gather(self, send: Any, recv: Any) -> None: ...

    def broadcast(self, buf: Any, root: int) -> None: ...


def check_comm(comm: Any, name: str = "comm") -> Any:
    """``comm`` if it is a communicator (module docstring), else an error naming what is wrong:
    a TypeError for a missing member, a collective that is not callable, or a rank / size
    that is not an int (a bool is refused); a ValueError for a size below 1 or a rank
    outside 0 .. size - 1."""
    missing = [m for m in ("rank", "size", "all_reduce", "all_gather", "broadcast") if not hasattr(comm, m)]
    if missing:
        raise TypeError(f"{name}: expected a communicator (rank, size, all_reduce, all_gather, broadcast), "
                        f"got {type(comm).__name__} without {', '.join(missing)}")
    for m in ("all_reduce", "all_gather", "broadcast"):
        f = getattr(comm, m)
        if not callable(f):
            raise TypeError(f"{name}.{m}: expected a callable (the collective), got {type(f).__name__} {f!r:.40}")
    size, rank = comm.size, comm.rank
    for what, v in (("size", size), ("rank", rank)):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"{name}.{what}: expected an int, got {type(v).__name__} {v!r:.40}")
    if size < 1:
        raise ValueError(f"{name}.size: expected an int >= 1, got {size!r}")
    if not 0 <= rank < size:
        raise ValueError(f"{name}.rank: expected an int in 0 .. {size - 1}, got {rank!r}")
    return comm


def _dtype(name: str, buf: Any) -> str:
    dt = np.dtype(buf.dtype).name
    if dt not in DTYPES:
        raise TypeError(f"{name}: expected dtype {' or '.join(DTYPES)}, got {dt}")
    if not buf.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous array, got strides {buf.strides}")
    return dt


def _op(op: str) -> str:
    if op not in OPS:
        raise ValueError(f"op: expected one of {', '.join(OPS)}, got {op!r}")
    return op


def _gather_shape(send: Any, recv: Any, size: int) -> None:
    want = (size, *send.shape)
    if tuple(recv.shape) != want or np.dtype(recv.dtype) != np.dtype(send.dtype):
        raise ValueError(f"recv: expected shape {list(want)} {np.dtype(send.dtype).name}, "
                         f"got {list(recv.shape)} {np.dtype(recv.dtype).name}")


def _root(root: int, size: int) -> int:
    if not (isinstance(root, (int, np.integer)) and 0 <= root < size):
        raise ValueError(f"root: expected an int in 0 .. {size - 1}, got {root!r}")
    return int(root)


class LocalComm:
    """A world of one rank: all_reduce and broadcast leave ``buf`` as it is, all_gather
    copies ``send`` into ``recv[0]``. A sharded head over it is the unsharded head."""

    rank = 0
    size = 1

    def all_reduce(self, buf: Any, op: str) -> None:
        _dtype("buf", buf)
        _op(op)

    def all_gather(self, send: Any, recv: Any) -> None:
        _dtype("send", send)
        _gather_shape(send, recv, 1)
        recv[0] = send

    def broadcast(self, buf: Any, root: int) -> None:
        _dtype("buf", buf)
        _root(root, 1)


class MpiComm:
    """MPI through ``mpi4py`` (NumPy buffers): ``MpiComm()`` is ``MPI.COMM_WORLD``,
    ``MpiComm(c)`` any mpi4py intracommunicator (an engine's own, or a split of it)."""

    def __init__(self, comm: Any = None):
        try:
            from mpi4py import MPI
        except ImportError as e:
            raise ImportError(f"MpiComm needs mpi4py: {install_hint('mpi')}") from e
        self._MPI = MPI
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.rank = int(self.comm.Get_rank())
        self.size = int(self.comm.Get_size())

    def _host(self, name: str, buf: Any) -> np.ndarray:
        if not isinstance(buf, np.ndarray):
            raise TypeError(f"{name}: MpiComm takes NumPy arrays, got {type(buf).__name__}")
        _dtype(name, buf)
        return buf

    def all_reduce(self, buf: Any, op: str) -> None:
        b = self._host("buf", buf)
        mpi_op = self._MPI.SUM if _op(op) == "sum" else self._MPI.MAX
        self.comm.Allreduce(self._MPI.IN_PLACE, b, op=mpi_op)

    def all_gather(self, send: Any, recv: Any) -> None:
        s, r = self._host("send", send), self._host("recv", recv)
        _gather_shape(s, r, self.size)
        self.comm.Allgather(s, r)

    def broadcast(self, buf: Any, root: int) -> None:
        self.comm.Bcast(self._host("buf", buf), root=_root(root, self.size))


class NcclComm:
    """NCCL through ``cupy.cuda.nccl`` (CuPy buffers, ordered on the current stream).

    ``NcclComm(size, rank, unique_id)`` joins a communicator whose id rank 0 made with
    ``NcclComm.unique_id()`` and handed to every rank; ``NcclComm.from_mpi(mpi_comm)`` does
    that hand-over through MPI (one rank per GPU: each rank selects its device first)."""

    _OPS = {"sum": "NCCL_SUM", "max": "NCCL_MAX"}
    _TYPES = {"float32": "NCCL_FLOAT32", "int32": "NCCL_INT32", "int64": "NCCL_INT64", "uint64": "NCCL_UINT64"}

    def __init__(self, size: int, rank: int, unique_id: Any):
        from cupy.cuda import nccl

        self._nccl = nccl
        self.size, self.rank = int(size), int(rank)
        self.comm = nccl.NcclCommunicator(self.size, unique_id, self.rank)

    @staticmethod
    def unique_id() -> Any:
        from cupy.cuda import nccl

        return nccl.get_unique_id()

    @classmethod
    def from_mpi(cls, mpi_comm: Any = None) -> NcclComm:
        m = MpiComm(mpi_comm)
        uid = cls.unique_id() if m.rank == 0 else None
        return cls(m.size, m.rank, m.comm.bcast(uid, root=0))

    def _args(self, name: str, buf: Any) -> tuple:
        import cupy

        if not isinstance(buf, cupy.ndarray):
            raise TypeError(f"{name}: NcclComm takes CuPy arrays, got {type(buf).__name__}")
        dt = _dtype(name, buf)
        return buf.data.ptr, buf.size, getattr(self._nccl, self._TYPES[dt]), cupy.cuda.get_current_stream().ptr

    def all_reduce(self, buf: Any, op: str) -> None:
        ptr, n, dt, stream = self._args("buf", buf)
        self.comm.allReduce(ptr, ptr, n, dt, getattr(self._nccl, self._OPS[_op(op)]), stream)

    def all_gather(self, send: Any, recv: Any) -> None:
        sp, n, dt, stream = self._args("send", send)
        rp, _, _, _ = self._args("recv", recv)
        _gather_shape(send, recv, self.size)
        self.comm.allGather(sp, rp, n, dt, stream)

    def broadcast(self, buf: Any, root: int) -> None:
        ptr, n, dt, stream = self._args("buf", buf)
        self.comm.broadcast(ptr, ptr, n, dt, _root(root, self.size), stream)


# -- the vocabulary-parallel LM head's reductions -------------------------------------------

_NONE = np.uint64(0)
_LOW = np.uint64(0xFFFFFFFF)


def argmax_keys(best_val: Any, best_id: Any, xp: Any = np) -> Any:
    """One uint64 per row that orders the (value, id) candidates as the single-rank argmax
    does: a larger value wins, then a lower id; 0 for a row with no candidate (id -1).
    Value bits map to an unsigned order (negative floats inverted, non-negative ones with
    the top bit set, -0.0 as +0.0: they compare equal, so the id decides); the id's
    complement takes the low 32 bits. ``best_val`` FP32 (never NaN where ``best_id >= 0``),
    ``best_id`` int (global ids below 2^32 - 1)."""
    v = xp.where(best_val == 0, xp.float32(0.0), best_val.astype(xp.float32))   # -0.0 -> +0.0
    bits = v.view(xp.uint32).astype(xp.uint64)
    neg = (bits >> xp.uint64(31)) != 0
    ordered = xp.where(neg, bits ^ _LOW, bits | xp.uint64(0x80000000))
    ids = best_id.astype(xp.int64)
    key = (ordered << xp.uint64(32)) | (_LOW - xp.maximum(ids, 0).astype(xp.uint64))
    return xp.where(ids >= 0, key, _NONE)


def ids_of_keys(keys: Any, xp: Any = np) -> Any:
    """The winning ids (int32; -1 where no rank had a candidate) of reduced ``argmax_keys``."""
    ids = (_LOW - (keys & _LOW)).astype(xp.int64)
    return xp.where(keys == _NONE, -1, ids).astype(xp.int32)


def sharded_argmax(best_val: Any, best_id: Any, comm: Any, xp: Any = np) -> Any:
    """Each rank's per-row best allowed non-NaN logit (value, global id; id -1: none on this
    rank) -> the single-rank argmax of the whole vocabulary on every rank, with one
    all-reduce (max) of packed keys: int32 [n], -1 where no rank had a candidate."""
    keys = xp.ascontiguousarray(argmax_keys(best_val, best_id, xp))
    comm.all_reduce(keys, "max")
    return ids_of_keys(keys, xp)


def sharded_confidence(best_val: Any, sum_exp: Any, has: Any, ids: Any, comm: Any, xp: Any = np) -> Any:
    """The drafts' confidences (the softmax probability of the argmax), as the single-rank
    LM head's chunks combine theirs: each rank's per-row best logit ``best_val``, its
    ``sum_exp`` = sum over its allowed non-NaN logits of exp(logit - best_val) (a logit equal
    to the best counting 1) and ``has`` (whether it had any); the global best by an
    all-reduce (max), then sum_r sum_exp_r * exp(best_r - best) (1 where they are equal) by an
    all-reduce (sum); the confidence is 1 / that sum, NaN where ``ids`` (``sharded_argmax``'s)
    is -1."""
    top = xp.ascontiguousarray(xp.where(has, best_val, -xp.inf).astype(xp.float32))
    comm.all_reduce(top, "max")
    with np.errstate(invalid="ignore", over="ignore"):
        f = xp.where(best_val == top, xp.float32(1.0), xp.exp(best_val - top))
        part = xp.ascontiguousarray(xp.where(has, sum_exp * f, 0.0).astype(xp.float32))
    comm.all_reduce(part, "sum")
    with np.errstate(divide="ignore", invalid="ignore"):
        return xp.where(ids < 0, xp.float32(np.nan), xp.float32(1.0) / part).astype(xp.float32)


def _check_fp32_ids(ids: np.ndarray, what: str) -> None:
    """Token ids travel as FP32 values in a collective: exact below 2^24 only."""
    if ids.size and int(ids.max()) >= 1 << 24:
        raise ValueError(f"ids: a vocabulary of more than 2^24 tokens does not fit the {what}'s FP32 ids, "
                         f"got id {int(ids.max())}")


def sharded_topk(ids: np.ndarray, vals: np.ndarray, best: np.ndarray, sum_exp: np.ndarray, comm: Any,
                 to_comm: Any = None, from_comm: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """A draft tree's candidates over a vocabulary-parallel LM head: each rank's top ``k``
    (global ``ids`` [n, k] int32, -1 past its candidates; their logits ``vals`` [n, k]) and its
    softmax statistics (``best`` [n], ``sum_exp`` [n], mtpkern.ops.lm_head's partial result) ->
    the whole vocabulary's top ``k`` (ids by logit descending, ties to the lowest id, -1 past
    the candidates) and each one's probability by the single-rank rule (``1 / sum_j t_j``,
    ``t_j = 1`` where ``l_j`` equals the candidate's logit, else ``exp(l_j - l_c)``, summed per
    rank as ``sum_exp_r * t(best_r)``; 0 past the candidates), host arrays. One all-gather of
    ``[n, 2k + 2]`` FP32 values per rank (ids as exact integers below 2^24, checked);
    ``to_comm`` / ``from_comm`` move host arrays to the communicator's buffers and back
    (default: the identity, NumPy buffers)."""
    to_comm = to_comm or (lambda a: a)
    from_comm = from_comm or (lambda a: np.asarray(a))
    n, k = ids.shape
    _check_fp32_ids(ids, "merge")
    send = np.concatenate([ids.astype(np.float32), vals.astype(np.float32), best[:, None].astype(np.float32),
                           sum_exp[:, None].astype(np.float32)], axis=1)
    dev = to_comm(np.ascontiguousarray(send))
    recv = to_comm(np.zeros((comm.size, n, 2 * k + 2), np.float32))
    comm.all_gather(dev, recv)
    got = from_comm(recv)                                        # [R, n, 2k + 2]
    all_ids = got[:, :, :k].astype(np.int64).transpose(1, 0, 2).reshape(n, -1)
    all_vals = got[:, :, k:2 * k].transpose(1, 0, 2).reshape(n, -1)
    tops, sums = got[:, :, 2 * k].T, got[:, :, 2 * k + 1].T.astype(np.float64)     # [n, R]
    out_ids = np.full((n, k), -1, np.int32)
    probs = np.zeros((n, k), np.float32)
    for r in range(n):
        have = all_ids[r] >= 0
        c_ids, c_vals = all_ids[r][have], all_vals[r][have]
        order = np.lexsort((c_ids, -c_vals.astype(np.float64)))[:k]
        live = sums[r] > 0
        for j, o in enumerate(order):
            lc = np.float64(c_vals[o])
            with np.errstate(invalid="ignore", over="ignore"):
                t = np.where(tops[r][live] == lc, 1.0, np.exp(tops[r][live].astype(np.float64) - lc))
            out_ids[r, j] = c_ids[o]
            probs[r, j] = 1.0 / (sums[r][live] * t).sum()
    return out_ids, probs


def sharded_logits(local: np.ndarray, ids: np.ndarray, V: int, comm: Any, to_comm: Any = None,
                   from_comm: Any = None) -> np.ndarray:
    """Sampled drafts over a vocabulary-parallel LM head: every rank's logits ``local``
    [n, V_r] FP32 (NaN where it does not allow the token) of its rows' target ids ``ids``
    [V_r] -> the whole vocabulary's [n, V] FP32 on the host, NaN where no rank holds the
    token; every rank then draws the same drafts from the same array (mtpkern.ops.sampling,
    the noise keyed on target ids). Two collectives: an all-reduce max of the ranks' row
    counts, then one all-gather of ``[n + 1, max V_r]`` FP32 per rank (the ids, exact integers
    below 2^24, in the first row; -1 past a rank's rows). This writes the logits out, as a
    draft tree's head does; the packed-key Gumbel argmax (one all-reduce, no [V] rows) would
    serve ``top_k = 0, top_p = 1`` and is not done."""
    to_comm = to_comm or (lambda a: a)
    from_comm = from_comm or (lambda a: np.asarray(a))
    n, Vr = local.shape
    _check_fp32_ids(ids, "gather")
    width = to_comm(np.array([Vr], np.float32))
    comm.all_reduce(width, "max")
    Vmax = int(np.asarray(from_comm(width))[0])
    send = np.full((n + 1, Vmax), np.nan, np.float32)
    send[0] = -1.0
    send[0, :Vr] = ids
    send[1:, :Vr] = local
    recv = to_comm(np.zeros((comm.size, n + 1, Vmax), np.float32))
    comm.all_gather(to_comm(send), recv)
    got = from_comm(recv)                                         # [R, n + 1, Vmax]
    out = np.full((n, V), np.nan, np.float32)
    for r in range(comm.size):
        have = got[r, 0] >= 0
        out[:, got[r, 0, have].astype(np.int64)] = got[r, 1:][:, have]
    return out


# -- agreement: a call refused, failing or different on one rank fails on every rank ---------

#: the argument fields one agreement compares (a call names at most this many)
AGREE_FIELDS = 12
_TEXT_WORDS = 256                       # a failure's text: 1024 UTF-8 bytes, as int32 words


class RankMismatch(MtpError, ValueError):
    """The ranks of a sharded head were given different calls, or arguments that would make
    them run different collectives (docs/distributed.md, "Agreement")."""


#: the error types an agreed failure keeps (the first in a failing error's MRO), most specific first
_ERROR_TYPES: tuple[type, ...] = (RankMismatch, NoAllowedToken, KvCacheFull, StateError, CheckpointError, ConfigError,
                                  MtpError, ValueError, TypeError, IndexError, KeyError, OverflowError,
                                  ArithmeticError, MemoryError, NotImplementedError, RuntimeError, OSError, Exception)


def field_digest(value: Any) -> int:
    """A 62-bit digest of one argument field (arrays by dtype, shape and bytes; anything else
    by its ``repr``), the same on every rank for equal values."""
    h = hashlib.blake2b(digest_size=8)
    if isinstance(value, np.ndarray):
        h.update(f"{value.dtype.str}{value.shape}".encode())
        h.update(np.ascontiguousarray(value).tobytes())
    else:
        h.update(repr(value).encode())
    return int.from_bytes(h.digest(), "little") >> 2


def _error_code(e: BaseException) -> int:
    for cls in type(e).__mro__:
        if cls in _ERROR_TYPES:
            return _ERROR_TYPES.index(cls)
    return len(_ERROR_TYPES)              # not an Exception (an interrupt): RuntimeError on the others


def _make_error(code: int, message: str) -> BaseException:
    cls = _ERROR_TYPES[code] if code < len(_ERROR_TYPES) else RuntimeError
    try:
        return cls(message)
    except TypeError:                     # a constructor of its own (KvCacheFull): the message alone
        e = cls.__new__(cls)
        BaseException.__init__(e, message)
        return e


def _text_words(text: str) -> np.ndarray:
    raw = text.encode("utf-8")[:4 * _TEXT_WORDS]
    return np.frombuffer(raw.ljust(4 * _TEXT_WORDS, b"\0"), np.int32).copy()


def _words_text(words: np.ndarray) -> str:
    return np.ascontiguousarray(words, np.int32).tobytes().rstrip(b"\0").decode("utf-8", "replace")


def _gather_texts(comm: Any, code: int, text: str, to_comm: Callable, from_comm: Callable) -> list[tuple[int, str]]:
    """Every rank's (code, text): one all-gather of ``1 + _TEXT_WORDS`` int32 (only on a failure)."""
    send = np.concatenate([np.int32([code]), _text_words(text)])
    recv = to_comm(np.zeros((comm.size, send.shape[0]), np.int32))
    comm.all_gather(to_comm(send), recv)
    got = np.asarray(from_comm(recv))
    return [(int(row[0]), _words_text(row[1:])) for row in got]


def _short(v: Any) -> str:
    r = f"array {list(v.shape)} {v.dtype}" if isinstance(v, np.ndarray) else repr(v)
    return r if len(r) <= 120 else r[:117] + "..."


def agree(comm: Any, call: str, fields: Sequence[tuple[str, Any]] | None, error: BaseException | None = None,
          to_comm: Callable | None = None, from_comm: Callable | None = None, during: bool = False) -> None:
    """The ranks of a sharded call agree before going on (docs/distributed.md, "Agreement").

    Every rank calls this at the same point of the same call with ``fields`` (the arguments
    that shape the call, ``[(name, value)]``; at most ``AGREE_FIELDS``) or with ``error`` (what
    this rank raised instead). One all-reduce (max) of ``2 + 2 * AGREE_FIELDS`` int64: a failed
    flag, the lowest failing rank, each field's digest and its negation (so that the max of
    both says whether every rank had the same). On success it returns on every rank. If any
    rank failed, every rank raises the error type of the lowest failing rank (``StateError``,
    ``ValueError``, ``NoAllowedToken``, ...; a foreign type as its nearest built-in base) with
    one message naming the rank and its error (the failing rank's chained to the original);
    if the fields differ, every rank raises ``RankMismatch`` naming each differing field with
    each rank's value. Either raise costs one more collective (an all-gather of the texts).
    ``to_comm`` / ``from_comm``: host arrays to the communicator's buffers and back.
    ``during``: the agreement closes a call whose collectives ran (its message says so)."""
    to_comm = to_comm or (lambda a: a)
    from_comm = from_comm or (lambda a: np.asarray(a))
    R, r = comm.size, comm.rank
    fields = list(fields or ())
    if len(fields) > AGREE_FIELDS:
        raise ValueError(f"fields: expected at most {AGREE_FIELDS}, got {len(fields)}")
    buf = np.zeros(2 + 2 * AGREE_FIELDS, np.int64)
    if error is not None:
        buf[0], buf[1] = 1, R - r
    else:
        d = np.array([field_digest(f) for f in fields] + [0] * (AGREE_FIELDS - len(fields)), np.int64)
        buf[2::2], buf[3::2] = d, -d
    dev = to_comm(buf)
    comm.all_reduce(dev, "max")
    got = np.asarray(from_comm(dev))
    if got[0]:
        first = R - int(got[1])
        mine = "" if error is None else f"{type(error).__name__}: {error}"
        texts = _gather_texts(comm, _error_code(error) if error is not None else -1, mine, to_comm, from_comm)
        failed = [q for q, (code, _) in enumerate(texts) if code >= 0]
        code, text = texts[first]
        others = [q for q in failed if q != first]
        also = f"; rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} failed too" if others else ""
        when = "failed during the call" if during else "refused the call"
        out = _make_error(code, f"{call}: rank {first} of {R} {when} ({text}){also}; every rank raised this "
                                f"and left its states unchanged")
        out._mtpkern_agreed = True
        raise out from error
    differ = np.flatnonzero(got[2::2] != -got[3::2]).tolist()
    if differ and differ[0] == 0:          # different calls: their other fields do not compare
        differ, call = [0], "a sharded call"
    if differ:
        mine = "; ".join(f"{fields[i][0]}={_short(fields[i][1])}" if i < len(fields) else f"field {i} absent"
                         for i in differ)
        texts = _gather_texts(comm, -1, mine, to_comm, from_comm)
        names = ", ".join(fields[i][0] if i < len(fields) else f"field {i}" for i in differ)
        each = " | ".join(f"rank {q}: {t}" for q, (_, t) in enumerate(texts))
        out = RankMismatch(f"{call}: the ranks were given different arguments ({names}): {each}; every rank of a "
                           f"sharded head must make the same calls with the same arguments (docs/distributed.md); "
                           f"every rank raised this and left its states unchanged")
        out._mtpkern_agreed = True
        raise out
