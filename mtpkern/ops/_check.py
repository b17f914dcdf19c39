"""Shape and dtype checks shared by every backend's launchers.

Messages name the argument, what was expected and what was given.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np


def shape_of(a: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in a.shape)


def expect_ndim(name: str, a: Any, ndim: int) -> None:
    if a.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {shape_of(a)}")


def expect_shape(name: str, a: Any, shape: Sequence[int | None]) -> None:
    """``None`` in ``shape`` matches any extent."""
    got = shape_of(a)
    if len(got) != len(shape) or any(e is not None and e != g for e, g in zip(shape, got)):
        want = "[" + ", ".join("*" if e is None else str(e) for e in shape) + "]"
        raise ValueError(f"{name}: expected shape {want}, got {list(got)}")


def dtype_name(a: Any) -> str:
    return np.dtype(a.dtype).name


def expect_dtype(name: str, a: Any, *names: str) -> None:
    """``names``: NumPy dtype names, e.g. ``"float32"``, ``"int32"``, ``"bfloat16"``."""
    got = dtype_name(a)
    if got not in names:
        raise TypeError(f"{name}: expected dtype {' or '.join(names)}, got {got}")
