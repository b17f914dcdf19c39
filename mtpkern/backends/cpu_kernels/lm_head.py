"""Fused LM head + grammar-masked argmax on the CPU (spec: mtpkern.ops.lm_head).

The vocabulary is cut into ``nchunks`` contiguous chunks of an even number of
rows, one task each. A task computes its chunk's logits two weight rows at a
time into a [n, 2] scratch and keeps, per input row, its best allowed non-NaN
(value, id), ids ascending with a strict ``>`` so the lowest id wins a tie.
Weight row pairs that no input row allows are skipped (a tight grammar mask
saves their memory reads). A serial pass then reduces the chunks in order,
again with a strict ``>``; a row left with id -1 had no allowed non-NaN token.
The [n, V] logits are never written out.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .linear import gemv_rows


@njit(cache=True, fastmath=False)
def _allowed(bitmask, i, j):
    """Bit j & 31 of word j >> 5 of row i (xgrammar layout); no mask (empty) allows all."""
    if bitmask.shape[0] == 0:
        return True
    return ((bitmask[i, j >> 5] >> (j & 31)) & 1) != 0


@njit(cache=True, fastmath=False)
def _any_allowed(bitmask, n, j):
    for i in range(n):
        if _allowed(bitmask, i, j):
            return True
    return False


@njit(cache=True, fastmath=False)
def _offer(best_val, best_id, c, i, v, j):
    if v == v and (best_id[c, i] < 0 or v > best_val[c, i]):
        best_val[c, i] = v
        best_id[c, i] = j


@njit(cache=True, fastmath=False, parallel=True)
def lm_head_argmax_kernel(x, w, bitmask, nchunks, best_val, best_id, ids):
    """x [n, H], w [V, H], bitmask [n, ceil(V/32)] int32 or empty; scratch
    best_val, best_id [nchunks, n]; out ids [n] int32 (-1: nothing allowed)."""
    n = x.shape[0]
    V = w.shape[0]
    per = ((V + nchunks - 1) // nchunks + 1) // 2 * 2
    zero, one, no = np.int64(0), np.int64(1), np.bool_(False)    # typed, not literal: see gemv_rows
    for c in prange(nchunks):
        y = np.empty((n, 2), np.float32)
        for i in range(n):
            best_id[c, i] = -1
            best_val[c, i] = 0.0
        end = min(V, (c + 1) * per)
        for j0 in range(c * per, end, 2):
            j1 = j0 + 1
            a0 = _any_allowed(bitmask, n, j0)
            a1 = j1 < end and _any_allowed(bitmask, n, j1)
            if not (a0 or a1):
                continue
            # one call site (each one inlines the whole GEMV core): both rows, or the allowed one
            ja = j0 if a0 else j1
            jb = j1 if a0 and a1 else -1
            ca = 0 if a0 else 1
            gemv_rows(w, ja, jb, zero, x, zero, n, y, ca, one, no)
            for i in range(n):
                if a0 and _allowed(bitmask, i, j0):
                    _offer(best_val, best_id, c, i, y[i, 0], j0)
                if a1 and _allowed(bitmask, i, j1):
                    _offer(best_val, best_id, c, i, y[i, 1], j1)
    for i in range(n):
        bi = -1
        bv = np.float32(0.0)
        for c in range(nchunks):
            if best_id[c, i] >= 0 and (bi < 0 or best_val[c, i] > bv):
                bi = best_id[c, i]
                bv = best_val[c, i]
        ids[i] = bi
