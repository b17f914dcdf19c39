"""Sigmoid output gates on the CPU (spec: mtpkern.ops.gate).

One pass per row: each of its G gates is squashed once and multiplies its
c = F / G consecutive columns of x (plus the residual's), so a row reads x, the
residual and its gates once and writes out once. A decode step's few rows
(n * F up to ``linear.SMALL``: 1 row of 16 heads of 128 is 2048) run on the
calling thread; a prefill chunk's rows are split across threads.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .linear import SMALL


@njit(cache=True, fastmath=False)
def _gate_row(x, gate, residual, out, i):
    """out[i] = residual[i] + x[i] * sigmoid(gate[i, j // c]) (no residual: empty)."""
    F, G = x.shape[1], gate.shape[1]
    c = F // G
    for g in range(G):
        s = np.float32(1.0) / (np.float32(1.0) + np.exp(-gate[i, g]))
        if residual.shape[0] > 0:
            for j in range(g * c, (g + 1) * c):
                out[i, j] = residual[i, j] + x[i, j] * s
        else:
            for j in range(g * c, (g + 1) * c):
                out[i, j] = x[i, j] * s


@njit(cache=True, fastmath=False, parallel=True)
def sigmoid_gate_kernel(x, gate, residual, out):
    """x, out [n, F]; gate [n, G], G divides F; residual [n, F] or empty [0, 0] (none).
    out may be x or residual: each element is read before it is written."""
    n, F = x.shape
    if n * F <= SMALL:
        for i in range(n):
            _gate_row(x, gate, residual, out, i)
    else:
        for i in prange(n):
            _gate_row(x, gate, residual, out, i)
