"""Boundary checks shared by every public call (``MtpHead`` and the proposer).

Each check names the argument, the expected and the actual value, and raises
``TypeError`` (wrong kind) or ``ValueError`` (wrong value) before anything is
changed. Accepted forms:

- counts and positions: Python ``int`` or a NumPy integer scalar (``np.int32(5)``,
  a 0-d integer array); never ``bool`` (``True`` is an ``int`` to Python, not a count);
- token ids: the same, within ``[0, V)``; a sequence of token ids is a list/tuple of
  such ints or a 1-D integer array (host, or a device array with ``.get()``);
- hidden states: ``[H]`` or ``[n, H]`` FP32 / BF16 (see ``ingest_hidden``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .argtypes import int_sequence, kind, scalar_int
from .backends import dlpack
from .backends.base import on_cuda_device
from .ops.sampling import SamplingParams

#: the kernels index RoPE positions (and KV rows) in int32
INT32_MAX = 2**31 - 1


#: the integer rule of every public call lives in mtpkern.argtypes (one rule, one place)
_scalar_int, _kind = scalar_int, kind


def check_int(name: str, v: Any, lo: int | None = None, hi: int | None = None) -> int:
    """An integer count or position in ``[lo, hi]`` (either bound optional; a count passes
    ``hi=INT32_MAX``, the kernels' index type, a position is bounded by ``check_positions``)."""
    i = _scalar_int(v)
    if i is None:
        raise TypeError(f"{name}: expected an int, got {_kind(v)} {v!r}")
    if (lo is not None and i < lo) or (hi is not None and i > hi):
        ceiling = hi == INT32_MAX and lo is not None and i < lo       # a count below its floor: say the floor
        rng = f">= {lo}" if hi is None or ceiling else f"in [{lo}, {hi}]" if lo is not None else f"<= {hi}"
        raise ValueError(f"{name}: expected {rng}, got {i}")
    return i


def check_list(name: str, v: Any, n: int | None = None, what: str = "entries") -> list:
    """A per-sequence argument of a batch call: a list, tuple or 1-D array (of ``n``)."""
    per = "" if what == "states" else " (one per state)"
    if isinstance(v, (str, bytes, dict)) or not isinstance(v, (list, tuple, np.ndarray)) or \
            (isinstance(v, np.ndarray) and v.ndim != 1):
        raise TypeError(f"{name}: expected a list of {what}{per}, got {_kind(v)}")
    if n is not None and len(v) != n:
        raise ValueError(f"{name}: expected {n} {what}{per}, got {len(v)}")
    return list(v)


def check_out_conf(name: str, v: Any, confs: list | None) -> list | None:
    """``out_conf`` of a propose: None, or a list (filled by the call on success); returns
    ``confs`` (the list the call fills first) when one was given, else None."""
    if v is not None and not isinstance(v, list):
        raise TypeError(f"{name}: expected a list (filled with the drafts' confidences) or None, got {_kind(v)}")
    return None if v is None else confs


def check_out_list(name: str, v: Any) -> list | None:
    """An output list of a propose (``out_prob``, ``out_dist``): None, or a list (filled by the
    call on success)."""
    if v is not None and not isinstance(v, list):
        raise TypeError(f"{name}: expected a list (filled by the call) or None, got {_kind(v)}")
    return v


def check_sampling(name: str, v: Any) -> Any:
    """A sequence's sampling: a ``mtpkern.ops.sampling.SamplingParams``."""
    if not isinstance(v, SamplingParams):
        raise TypeError(f"{name}: expected a SamplingParams (or None: the argmax), got {_kind(v)} {v!r}")
    return v


def check_probability(name: str, v: Any) -> float:
    """A threshold on confidences: a real number in [0, 1]."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)) \
            or not 0.0 <= float(v) <= 1.0:
        raise ValueError(f"{name}: expected a number in [0, 1], got {_kind(v)} {v!r}")
    return float(v)


def check_bool(name: str, v: Any) -> bool:
    if not isinstance(v, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a bool, got {_kind(v)} {v!r}")
    return bool(v)


def check_token(name: str, v: Any, vocab_size: int) -> int:
    i = _scalar_int(v)
    if i is None:
        raise TypeError(f"{name}: expected an int token id, got {_kind(v)} {v!r}")
    if not 0 <= i < vocab_size:
        raise ValueError(f"{name}: token id {i} is outside the vocabulary [0, {vocab_size})")
    return i


def check_tokens(name: str, tokens: Any, vocab_size: int) -> np.ndarray:
    """A sequence of token ids -> [n] int32, each checked against the vocabulary."""
    if hasattr(tokens, "get") and not isinstance(tokens, (np.ndarray, list, tuple, dict)):   # a device array
        tokens = tokens.get()
    if not isinstance(tokens, (list, tuple, range, str, bytes, dict)):   # a list: entry by entry, ints as they are
        tokens = dlpack.host_array(name, tokens, "token ids are read on the host")
    return int_sequence(name, tokens, 0, vocab_size - 1, noun="token id", nouns="token ids",
                        out_of_range=lambda i, t: f"{name}[{i}]: token id {t} is outside the vocabulary "
                                                  f"[0, {vocab_size})").astype(np.int32)


def check_positions(name: str, highest: int, limit: int) -> None:
    """Refuse a call whose rows would sit at RoPE position ``highest >= limit``
    (``max_position_embeddings``): int32 kernels would wrap it, and the model never
    saw such a position."""
    if highest >= limit:
        raise ValueError(f"{name}: this call would write a drafter row at position {highest}, past the "
                         f"model's max_position_embeddings ({limit}; positions 0 .. {limit - 1})")


def shape_of(x: Any) -> tuple[int, ...]:
    """Any array argument's shape, read without a copy (DLPack-only objects too)."""
    return dlpack.shape(x)


def hidden_shape(name: str, x: Any, H: int, rows: int | None = None, want: str | None = None) -> tuple[int, int]:
    """The ``[n, H]`` shape of hidden states given as ``[H]`` or ``[n, H]`` (checked;
    ``want``: the expected form as the error message should say it)."""
    given = shape_of(x)
    shape = (1,) + given if len(given) == 1 else given
    if len(shape) != 2 or shape[1] != H or (rows is not None and shape[0] != rows):
        if want is None:
            want = f"[{H}] or [1, {H}]" if rows == 1 else f"[{'n' if rows is None else rows}, {H}]"
        raise ValueError(f"{name}: expected shape {want}, got {list(given)}")
    return shape


def expect_finite(name: str, a: np.ndarray) -> None:
    bad = np.flatnonzero(~np.isfinite(a.reshape(-1)))
    if bad.size:
        r, c = divmod(int(bad[0]), a.shape[-1])
        raise ValueError(f"{name}: expected finite values, got {a.reshape(-1)[bad[0]]} at row {r}, "
                         f"column {c} ({bad.size} non-finite)")


def ingest_hidden(backend: Any, name: str, x: Any, H: int, rows: int | None = None,
                  want: str | None = None) -> Any:
    """Hidden states ``[H]`` or ``[n, H]`` (BF16/FP32, host or backend device) -> backend ``[n, H]`` FP32.

    Host values must be finite (a NaN or Inf would poison the module's KV for good);
    device arrays are not read back to check."""
    shape = hidden_shape(name, x, H, rows, want)
    a = backend.ingest_float(name, x)
    if isinstance(a, np.ndarray):
        expect_finite(name, a)
    elif not on_cuda_device(x):                          # host input to a device backend
        try:
            host = dlpack.host_array(name, x)
        except Exception:                                # refused by ingest_float already
            host = None
        if host is not None and host.dtype.name in ("float32", "bfloat16"):
            expect_finite(name, np.asarray(host, np.float32))
    return a.reshape(shape)


def check_hidden_dtype(name: str, x: Any) -> None:
    """The dtype rule of ``ingest_hidden`` alone, for calls that read no values."""
    dt = np.asarray(x).dtype.name if isinstance(x, (np.ndarray, list, tuple)) else None
    if dt is not None and dt not in ("float32", "bfloat16"):
        raise TypeError(f"{name}: expected dtype float32 or bfloat16, got {dt}")
