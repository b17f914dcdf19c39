"""The cpu backend's stored form of an FP4 weight: ``CpuFp4`` (docs/fp4.md).

Half a byte per weight as in the checkpoint (E2M1 codes two a byte) and the scale codes
unchanged (MXFP4: one E8M0 byte per 32 weights; NVFP4: one E4M3 byte per 16 and an FP32 row
scale): ``cpu_kernels/linear.py`` ("FP4 E2M1 weights") decodes a chunk of rows at a time inside
the GEMV kernels.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..quant import Fp4Weight
from .cpu_kernels.linear import FP4_ROWS


@dataclass(slots=True, eq=False)
class CpuFp4:
    """An FP4 weight ``[N, K]`` or ``[E, N, K]`` as the cpu kernels read it: ``q`` uint8
    ``[.., N, K / 2]`` (the packed codes), ``s`` uint8 ``[.., N, ceil(K / B)]`` (the E8M0 codes
    per 32, or NVFP4's E4M3 codes per 16), ``g`` None (MXFP4) or float32 ``[.., N]`` (NVFP4's
    row scale), all C-contiguous."""

    q: np.ndarray
    s: np.ndarray
    g: np.ndarray | None = None
    _args: tuple | None = field(default=None, repr=False)

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, N, half = self.q.shape
        return tuple(int(v) for v in lead) + (int(N), 2 * int(half))

    @property
    def ndim(self) -> int:
        return self.q.ndim

    @property
    def nbytes(self) -> int:
        return int(self.q.nbytes + self.s.nbytes + (0 if self.g is None else self.g.nbytes))

    def kernel_args(self) -> tuple:
        """The tuple the quantized kernels take (``(q, s, C)``, NVFP4 ``(q, s, C, g)``:
        ``cpu_kernels/linear.py``)."""
        if self._args is None:
            self._args = (self.q, self.s, np.int64(FP4_ROWS)) + (() if self.g is None else (self.g,))
        return self._args

    def as_experts(self) -> tuple:
        """``kernel_args`` of a [N, K] weight as one expert [1, N, K] (the dense MLP's case)."""
        return (self.q[None], self.s[None], np.int64(FP4_ROWS)) + (() if self.g is None else (self.g[None],))

    @classmethod
    def from_weight(cls, w: Fp4Weight) -> "CpuFp4":
        g = None if w.global_scale is None else np.ascontiguousarray(w.global_scale, dtype=np.float32)
        return cls(np.ascontiguousarray(w.data, dtype=np.uint8), np.ascontiguousarray(w.scale, dtype=np.uint8), g)
