"""Typed readers of config.json values: one rule per kind of field, for every family.

JSON gives ``true`` where a count was meant, ``"false"`` where a switch was meant, ``0``
where a window was meant; Python's ``bool("false")`` is True, ``True == 1`` and
``x or default`` turns ``0`` and ``false`` into the default. Every family's config code
(mtpkern/config.py and the ``normalise`` functions of mtpkern/models/) reads a field
through these, so that each kind of field has one rule:

- ``int_field``: a JSON integer (not a bool, a float or a string), in ``[lo, hi]``;
- ``bool_field``: ``true`` or ``false`` (not ``0`` / ``1`` or ``"false"``);
- ``float_field``: a finite JSON number (an integer is read as a float; not a bool or a
  string), in ``[lo, hi]``;
- ``window_field``: a sliding window, an integer >= 1 (0, null or absent would silently
  mean full attention where the config asks for a sliding-window layer).

``opt`` reads an optional field: absent or null gives the default, anything else goes
through the reader. Every refusal is a ``ConfigError`` naming the field, what was
expected and what was given.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from .errors import ConfigError

_PREFIX = "config.json: "


def show(v: Any, limit: int = 60) -> str:
    """A value for a one-line message: its JSON type and ``repr``, cut at ``limit`` characters."""
    kind = {bool: "bool", int: "int", float: "float", str: "string", list: "list", dict: "object",
            type(None): "null"}.get(type(v), type(v).__name__)
    text = repr(v)
    return f"{kind} {text if len(text) <= limit else text[:limit] + '...'}"


def int_field(name: str, v: Any, lo: int | None = None, hi: int | None = None) -> int:
    """``v`` as the integer field ``name``: an int (not a bool), in ``[lo, hi]`` where given."""
    if type(v) is not int:
        rng = "" if lo is None and hi is None else f" in [{lo if lo is not None else '-inf'}, " \
                                                   f"{hi if hi is not None else 'inf'}]"
        raise ConfigError(f"{_PREFIX}field {name!r} expected an integer{rng}, got {show(v)}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ConfigError(f"{_PREFIX}field {name!r} must be an integer in [{lo if lo is not None else '-inf'}, "
                          f"{hi if hi is not None else 'inf'}], got {v}")
    return v


def bool_field(name: str, v: Any) -> bool:
    """``v`` as the switch ``name``: JSON ``true`` or ``false`` only."""
    if not isinstance(v, bool):
        raise ConfigError(f"{_PREFIX}field {name!r} expected true or false, got {show(v)}")
    return v


def float_field(name: str, v: Any, lo: float = -math.inf, hi: float = math.inf) -> float:
    """``v`` as the number ``name``: a finite int or float (not a bool or a string) in ``[lo, hi]``."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ConfigError(f"{_PREFIX}field {name!r} expected a finite number, got {show(v)}")
    if not lo <= v <= hi:
        raise ConfigError(f"{_PREFIX}field {name!r} must be in [{lo:g}, {hi:g}], got {v!r}")
    return float(v)


def window_field(name: str, v: Any, why: str = "") -> int:
    """``v`` as a sliding window: an integer >= 1 (``why``: the layer that needs it, for the message)."""
    if type(v) is not int or not 1 <= v <= 2**31 - 1:
        need = f" ({why})" if why else ""
        raise ConfigError(f"{_PREFIX}field {name!r} expected a sliding window, an integer in [1, 2^31 - 1]{need}, "
                          f"got {show(v)}")
    return v


def opt(d: dict, name: str, reader: Callable[..., Any], default: Any, *args: Any) -> Any:
    """Field ``name`` of ``d`` through ``reader(name, value, *args)``; ``default`` when absent or null."""
    v = d.get(name)
    return default if v is None else reader(name, v, *args)
