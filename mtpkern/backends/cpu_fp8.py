"""The cpu backend's stored form of an FP8 E4M3 weight: ``CpuFp8`` (docs/fp8.md).

One byte per weight, as in the checkpoint, plus what the GEMV kernels need to dequantize
inside their loops (``cpu_kernels/linear.py``, "FP8 E4M3 weights"): per row chunk and
k-block an input factor, per row an output factor, and the subnormal weights as an exact
sparse list (their codes are stored as zeros: decoded, they would be FP32 denormals, which
this machine's FP units take ~60x longer over, and which a DAZ process reads as 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..quant import Fp8Weight, e4m3_table
from .cpu_kernels.linear import FP8_HALF_BIAS

#: rows per chunk with per-channel scales (any size works; 128 keeps the scaled copy of the
#: inputs per chunk a 1/128 of the chunk's work)
CHUNK_ROWS = 128
#: |scale| * 2^60 must stay far from FP32's 2^128
MAX_SCALE = 2.0 ** 64


def chunk_rows(bn: int) -> int:
    """Rows per chunk for blocks of ``bn`` rows: the largest divisor of bn up to 128 (a chunk
    lies inside one block, so its rows share their scales)."""
    return max(d for d in range(1, min(bn, CHUNK_ROWS) + 1) if bn % d == 0)


@dataclass(slots=True, eq=False)
class CpuFp8:
    """An FP8 weight ``[N, K]`` or ``[E, N, K]`` as the cpu kernels read it.

    ``q`` uint8 ``[.., N, K]`` (the codes, subnormal ones as a zero of their sign); ``xs``
    float32 ``[.., ceil(N / chunk), KB]``; ``post`` float32 ``[.., N]`` (NaN for a row holding
    a NaN code); ``crow`` int32 ``[.., N + 1]``, ``ccol`` int32 / ``cval`` float32 ``[nnz]``
    (the subnormal weights, dequantized); ``chunk`` rows per chunk, ``bk`` columns per k-block.
    """

    q: np.ndarray
    xs: np.ndarray
    post: np.ndarray
    crow: np.ndarray
    ccol: np.ndarray
    cval: np.ndarray
    chunk: int
    bk: int
    _args: tuple | None = field(default=None, repr=False)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(s) for s in self.q.shape)

    @property
    def ndim(self) -> int:
        return self.q.ndim

    @property
    def nbytes(self) -> int:
        return int(sum(a.nbytes for a in (self.q, self.xs, self.post, self.crow, self.ccol, self.cval)))

    def kernel_args(self) -> tuple:
        """The tuple the FP8 kernels take (``cpu_kernels/linear.py``); built once (0.6 us a call)."""
        if self._args is None:
            self._args = (self.q, self.xs, self.post, self.crow, self.ccol, self.cval, np.int64(self.chunk),
                          np.int64(self.bk))
        return self._args

    def as_experts(self) -> tuple:
        """``kernel_args`` of a [N, K] weight as one expert [1, N, K] (the dense MLP's case)."""
        return (self.q[None], self.xs[None], self.post[None], self.crow[None], self.ccol, self.cval,
                np.int64(self.chunk), np.int64(self.bk))

    @classmethod
    def from_weight(cls, w: Fp8Weight) -> "CpuFp8":
        big = np.abs(w.scale) >= MAX_SCALE
        if big.any():
            raise ValueError(f"w.scale: expected |scale| < 2^64 (the cpu backend folds 2^60 into it), "
                             f"got {w.scale[big].flat[0]!r}")
        q = np.array(w.data, dtype=np.uint8, order="C")
        *lead, N, K = q.shape
        if w.block is None:
            chunk, bk = CHUNK_ROWS, max(K, 1)
            xs = np.full((*lead, -(-N // chunk), 1), FP8_HALF_BIAS, np.float32)
            post = (w.scale * np.float32(FP8_HALF_BIAS)).astype(np.float32)
        else:
            bn, bk = w.block
            chunk = chunk_rows(bn)
            xs = np.repeat(w.scale, bn // chunk, axis=-2)[..., : -(-N // chunk), :] * np.float32(FP8_HALF_BIAS)
            post = np.full((*lead, N), FP8_HALF_BIAS, np.float32)
        post[((q & 0x7F) == 0x7F).any(axis=-1)] = np.nan
        sub = ((q & 0x78) == 0) & ((q & 0x07) != 0)                      # subnormal codes
        at = np.nonzero(sub)                                              # row-major: sorted by row
        cval = (e4m3_table()[q[at]] * w.scale_at(at)).astype(np.float32)
        ccol = at[-1].astype(np.int32)
        q[sub] &= 0x80
        rows = np.ravel_multi_index(at[:-1], (*lead, N)) if at[0].size else np.zeros(0, np.int64)
        ends = np.cumsum(np.bincount(rows, minlength=int(np.prod(lead, dtype=np.int64)) * N))
        if ends.size and ends[-1] >= 2**31:
            raise ValueError(f"w: {int(ends[-1])} subnormal codes, more than the cpu backend's int32 "
                             f"offsets hold")
        flat = np.concatenate([[0], ends]).astype(np.int32)              # [E * N + 1]
        if lead:                                                          # [E, N + 1]: expert e's rows
            crow = np.stack([flat[e * N: e * N + N + 1] for e in range(lead[0])])
        else:
            crow = flat
        return cls(q, np.ascontiguousarray(xs, dtype=np.float32), np.ascontiguousarray(post), crow, ccol,
                   cval, int(chunk), int(bk))
