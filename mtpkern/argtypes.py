"""Argument types of the command line (``mtpkern demo | info | bench``).

Each turns the text of one option into its value or raises
``argparse.ArgumentTypeError`` with "expected X, got Y", so a bad value is
refused while the arguments are parsed, before anything runs.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Callable


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
