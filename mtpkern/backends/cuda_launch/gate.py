"""Launcher of ``sigmoid_gate_kernel<RESIDUAL>`` (kernels/gate.cu).

``sigmoid_gate(x [n, F], gate [n, G], residual [n, F] | None) -> out [n, F]`` FP32, G
dividing F: ``out = residual + x * sigmoid(gate)``, each gate over F / G columns
(mtpkern.ops.gate).

``gate`` may be a column slice of a wider device buffer (the gate part of a fused
projection, rows a stride apart): the kernel reads it in place at that stride
(``_util.device_rows``), so a captured step allocates nothing for it; any other layout
is copied. ``out`` may be ``x`` or ``residual`` (in place); any other overlap with an
input is refused.
"""

from __future__ import annotations

import numpy as np

from ...ops.gate import check_sigmoid_gate
from ._util import (cdiv, device, device_rows, expect_disjoint, expect_grid_yz, expect_same_or_disjoint, i32,
                    optional, output, ptr)
from .loader import get_kernel

#: kGateThreads and kGatePerThread in gate.cu: 256 threads, 4 columns each per block
GATE_THREADS = 256
GATE_COLS = 4 * GATE_THREADS


def sigmoid_gate(x, gate, residual=None, *, out=None):
    """-> out [n, F] FP32 (``out``: the same, preallocated; may be ``x`` or ``residual``)."""
    check_sigmoid_gate(x, gate, residual)
    n, F = x.shape
    G = gate.shape[1]
    expect_grid_yz("x rows", n)
    x = device(x, "x", "float32")
    g, ldg = device_rows(gate, "gate", "float32")
    residual = optional(residual, "residual", "float32")
    y = output(out, "out", (n, F), np.float32)
    expect_same_or_disjoint("out", y, "x", x)
    expect_same_or_disjoint("out", y, "residual", residual)
    expect_disjoint("out", y, "gate", g)
    if n == 0 or F == 0:
        return y
    kernel = get_kernel("gate", f"sigmoid_gate_kernel<{'false' if residual is None else 'true'}>")
    kernel((cdiv(F, GATE_COLS), n), (GATE_THREADS,), (x, g, i32(ldg), ptr(residual), y, i32(F), i32(G)))
    return y
