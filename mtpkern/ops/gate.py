"""Sigmoid output gates: ``sigmoid_gate(x [n, F], gate [n, G], residual [n, F] | None)
-> [n, F]``, with ``F % G == 0`` and ``c = F // G`` columns per gate::

    out[i, j] = residual[i, j] + x[i, j] * sigmoid(gate[i, j // c])     (no residual: 0 +)

in FP32, ``sigmoid(g) = 1 / (1 + exp(-g))``. The gates of the released families:

- head-wise, ``G = Hq`` (Step-3.5's ``g_proj``: one scalar per query head, ``c = Dv``);
- element-wise, ``G = F`` (Qwen3-Next: the gate half of ``q_proj``, de-interleaved
  from the query heads at load time so that it is one column slice);
- one per row, ``G = 1``, with the residual (Qwen3-Next's shared expert:
  ``y + sigmoid(x . w_g) * shared_out``).

``gate`` is usually a column slice of a wider fused projection (its rows a stride
apart, larger than ``G``): backends take such a view as it is. ``out=`` may be
``x`` or ``residual`` (in place); any other overlap is the backends' business
(docs/cuda.md).
"""

from __future__ import annotations

import numpy as np

from ._check import expect_ndim, expect_shape


def check_sigmoid_gate(x, gate, residual) -> None:
    expect_ndim("x", x, 2)
    n, F = x.shape
    expect_ndim("gate", gate, 2)
    G = gate.shape[1]
    if gate.shape[0] != n or G < 1 or F % G:
        raise ValueError(f"gate: expected [{n}, G] with G dividing {F} (the columns of x), "
                         f"got {list(gate.shape)}")
    if residual is not None:
        expect_shape("residual", residual, (n, F))


def sigmoid(g: np.ndarray) -> np.ndarray:
    return np.float32(1.0) / (np.float32(1.0) + np.exp(-np.asarray(g, np.float32)))


def sigmoid_gate(x, gate, residual=None) -> np.ndarray:
    check_sigmoid_gate(x, gate, residual)
    n, F = x.shape
    c = F // gate.shape[1]
    s = np.repeat(sigmoid(gate), c, axis=1)                          # [n, F]: each gate over its c columns
    y = np.asarray(x, np.float32) * s
    if residual is not None:
        y = np.asarray(residual, np.float32) + y
    return y
