"""Argument types: of the command line (``mtpkern demo | info | bench``), and the integer
rule of every public call (``scalar_int``, ``int_sequence``; the section at the end).

Each command-line type turns the text of one option into its value or raises
``argparse.ArgumentTypeError`` with "expected X, got Y", so a bad value is
refused while the arguments are parsed, before anything runs.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any, Callable

import numpy as np


def _int(text: str, lo: int) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {text!r}") from None
    if v < lo:
        raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {v}")
    return v


def positive_int(text: str) -> int:
    return _int(text, 1)


def nonnegative_int(text: str) -> int:
    return _int(text, 0)


def positive_ints(text: str) -> list[int]:
    """``"1,8"`` -> ``[1, 8]``: a comma-separated list of integers >= 1."""
    parts = [p.strip() for p in text.split(",")]
    try:
        return [positive_int(p) for p in parts]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}") from None


def choices_list(*names: str) -> Callable[[str], list[str]]:
    """A type for a comma-separated list of ``names``."""
    def parse(text: str) -> list[str]:
        got = [p.strip() for p in text.split(",")]
        if not got or any(g not in names for g in got):
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(names)}, got {text!r}")
        return got

    parse.__name__ = "list of " + "/".join(names)
    return parse


def checkpoint_dir(text: str) -> Path:
    """A checkpoint directory: it exists, is a directory, and holds config.json."""
    p = Path(text)
    if not p.exists():
        raise argparse.ArgumentTypeError(f"expected a checkpoint directory, got {text!r}, which does not exist")
    if not p.is_dir():
        raise argparse.ArgumentTypeError(f"expected a checkpoint directory (config.json and *.safetensors), "
                                         f"got {text!r}, which is a file")
    cfg = p / "config.json"
    if not os.path.lexists(cfg):
        raise argparse.ArgumentTypeError(f"expected a checkpoint directory with a config.json, "
                                         f"got {text!r}, which has none")
    if not cfg.is_file():
        kind = ("a symlink to nothing" if not cfg.exists() else "a directory" if cfg.is_dir()
                else "not a regular file (a FIFO, socket or device)")
        raise argparse.ArgumentTypeError(f"expected a checkpoint directory with a config.json file, "
                                         f"got {text!r}, whose config.json is {kind}")
    return p


def output_file(text: str) -> Path:
    """A file to write at the end of a run: refused now, not after the run, when its
    directory does not exist or it names a directory."""
    if not text:
        raise argparse.ArgumentTypeError("expected a file path, got ''")
    p = Path(text)
    if p.is_dir():
        raise argparse.ArgumentTypeError(f"expected a file path, got {text!r}, which is a directory")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"expected a file in an existing directory, got {text!r} "
                                         f"({str(parent)!r} does not exist)")
    if not os.access(parent, os.W_OK):
        raise argparse.ArgumentTypeError(f"expected a file in a writable directory, got {text!r}")
    return p


# -- the integer rule of the public API ---------------------------------------------------------
#
# One rule for every count, position, index and id argument of every public call (the proposer,
# its heads, trees, schedules, draft vocabularies; docs/api.md, "Integers"):
#
# - a scalar is a Python ``int``, a NumPy integer scalar of any width or signedness, or a 0-d
#   integer array; ``bool`` (Python's or NumPy's) is refused (``True`` is an ``int`` to Python,
#   never a count or an id), and so are floats, strings and everything else (``TypeError``);
# - a sequence is a list / tuple / range of such scalars, or a 1-D array of any integer dtype
#   (``TypeError`` for a bool, float or string dtype);
# - values are compared as their true integers, never after a cast: ``np.uint64(2**64 - 1)``
#   is 18446744073709551615 (out of range), never -1;
# - every error names the argument (and, in a sequence, the index), what was expected and what
#   was given.

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def scalar_int(v: Any) -> int | None:
    """``v`` as a Python int when it is an integer scalar under the rule above, else None."""
    if isinstance(v, (bool, np.bool_)):
        return None
    if isinstance(v, (int, np.integer)):
        return int(v)
    if isinstance(v, np.ndarray) and v.ndim == 0 and v.dtype.kind in "iu":
        return int(v)
    return None


def kind(v: Any) -> str:
    """How an error message names the kind of ``v``."""
    if isinstance(v, np.ndarray):
        return f"{v.ndim}-d array of {v.dtype}"
    if isinstance(v, np.bool_):
        return "bool"
    return type(v).__name__


def range_text(lo: int | None, hi: int | None) -> str:
    if lo is not None and hi is not None:
        return f"in [{lo}, {hi}]"
    return f">= {lo}" if lo is not None else f"<= {hi}" if hi is not None else "any integer"


def int_sequence(name: str, v: Any, lo: int | None = None, hi: int | None = None, noun: str = "int",
                 nouns: str = "ints", what: str | None = None,
                 out_of_range: Callable[[int, int], str] | None = None) -> np.ndarray:
    """A 1-D sequence of integers under the rule above -> an int64 NumPy array.

    ``v``: a list / tuple / range of integer scalars (each checked as itself: a huge Python
    int or an ``np.uint64`` keeps its value), or a 1-D NumPy array of any integer dtype
    (compared as its dtype's true values, then cast). Every value must lie in ``[lo, hi]``
    (and in int64). ``noun`` / ``nouns``: what one entry is, for the messages (``"token id"``);
    ``what``: how the whole is named (default ``"a 1-D sequence of <nouns>"``);
    ``out_of_range(i, value)``: the message of entry ``i``'s value out of range. An empty
    sequence is accepted (callers that need entries say so)."""
    what = what or f"a 1-D sequence of {nouns}"
    lo_ = INT64_MIN if lo is None else max(lo, INT64_MIN)
    hi_ = INT64_MAX if hi is None else min(hi, INT64_MAX)

    def refuse(i: int, x: int) -> ValueError:
        if out_of_range is not None:
            return ValueError(out_of_range(i, x))
        return ValueError(f"{name}[{i}]: expected {noun} {range_text(lo, hi if hi is not None else INT64_MAX)}, "
                          f"got {x}")

    if isinstance(v, np.ndarray) and v.dtype != object:
        if v.ndim != 1:
            raise ValueError(f"{name}: expected {what}, got shape {list(v.shape)}")
        if v.size == 0:
            return np.zeros(0, np.int64)
        if v.dtype.kind not in "iu":
            raise TypeError(f"{name}: expected integer {nouns}, got dtype {v.dtype}")
        bad = (v < lo_) | (v > hi_)               # NumPy compares integer dtypes with Python ints exactly
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise refuse(i, int(v[i]))
        return v.astype(np.int64)
    if isinstance(v, np.ndarray):                 # an object array: each entry as itself
        if v.ndim != 1:
            raise ValueError(f"{name}: expected {what}, got shape {list(v.shape)}")
        v = list(v)
    if scalar_int(v) is not None:
        raise ValueError(f"{name}: expected {what}, got a single {kind(v)} {v!r} (shape [])")
    if isinstance(v, (str, bytes, bytearray, dict, set, frozenset)) or not isinstance(v, (list, tuple, range)):
        raise TypeError(f"{name}: expected {what} (a list or a 1-D integer array), got {kind(v)}")
    out = np.empty(len(v), np.int64)
    for i, t in enumerate(v):
        x = scalar_int(t)
        if x is None:
            if isinstance(t, (list, tuple)) or (isinstance(t, np.ndarray) and t.ndim > 0):
                raise ValueError(f"{name}: expected {what}, got a nested sequence at [{i}]")
            raise TypeError(f"{name}[{i}]: expected an int {noun}, got {kind(t)} {t!r}")
        if not lo_ <= x <= hi_:
            raise refuse(i, x)
        out[i] = x
    return out
