"""Grammar masks for drafting, in xgrammar's bitmask layout.

A mask is ``W = ceil(V / 32)`` int32 words: bit ``j & 31`` of word ``j >> 5``
set means token ``j`` may be drafted (uint32 words are accepted and read as
the same bits). ``grammar_bitmask`` given to ``propose`` may be:

- ``None``: no constraint;
- one mask ``[W]`` (or ``[1, W]``, what xgrammar's ``allocate_token_bitmask(1, V)``
  returns): applied to every draft position (like the original design);
- ``[k, W]`` with ``k >= 2``: row ``i`` constrains draft ``i``;
- a callable ``(i, drafts_so_far) -> mask | None``, for grammars that advance
  with each drafted token (``drafts_so_far`` is the list of the ``i`` drafts
  already chosen by this call).

The argmax rules (padding bits past V disallowed, lowest id on ties, NaN never
wins, no allowed token -> ``NoAllowedToken``) live in ``mtpkern.ops.lm_head``.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .backends import dlpack

MaskFn = Callable[[int, list], "np.ndarray | None"]


def _as_words(name: str, mask: Any) -> np.ndarray:
    if hasattr(mask, "__cuda_array_interface__") and not isinstance(mask, np.ndarray):
        mask = mask.get() if hasattr(mask, "get") else mask
    a = dlpack.host_array(name, mask, "grammar masks are read on the host")
    if a.dtype == np.uint32:
        a = a.view(np.int32)
    if a.dtype != np.int32:
        raise TypeError(f"{name}: expected int32 (or uint32) bitmask words, got dtype {a.dtype}")
    return a


def one_mask(name: str, mask: Any, V: int) -> np.ndarray:
    """A single mask -> [W] int32 (a [1, W] array is accepted too)."""
    a = _as_words(name, mask)
    W = (V + 31) // 32
    if a.ndim == 2 and a.shape[0] == 1:
        a = a[0]
    if a.shape != (W,):
        raise ValueError(f"{name}: expected shape [{W}] (ceil(vocab_size {V} / 32) words), got {list(a.shape)}")
    return np.ascontiguousarray(a)


def resolve(name: str, grammar_bitmask: Any, V: int, k: int) -> MaskFn | None:
    """Validate ``grammar_bitmask`` for a propose of ``k`` drafts -> a per-position mask function."""
    if grammar_bitmask is None:
        return None
    if callable(grammar_bitmask):
        fn = grammar_bitmask

        def call(i: int, drafts: list) -> np.ndarray | None:
            m = fn(i, list(drafts))
            return None if m is None else one_mask(f"{name}({i}, ...) result", m, V)

        return call
    a = _as_words(name, grammar_bitmask)
    W = (V + 31) // 32
    if a.ndim == 1:
        m = one_mask(name, a, V)
        return lambda i, drafts: m
    if a.ndim == 2 and a.shape[0] == 1 and a.shape[1] == W:     # xgrammar's allocate_token_bitmask(1, V)
        m = one_mask(name, a[0], V)
        return lambda i, drafts: m
    if a.ndim == 2:
        if a.shape[1] != W or a.shape[0] < k:
            raise ValueError(f"{name}: expected shape [W] or [k, W] with k >= {k} drafts and W = {W}, "
                             f"got {list(a.shape)}")
        rows = np.ascontiguousarray(a)
        return lambda i, drafts: rows[i]
    raise ValueError(f"{name}: expected a [W] mask, a [k, W] array or a callable, got shape {list(a.shape)}")
