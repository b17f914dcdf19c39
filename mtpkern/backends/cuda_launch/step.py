"""Launcher of ``copy_segments_kernel`` (kernels/step.cu): the data movement of a
planned propose step (``mtpkern.cuda_graph``).

``copy_segments(seg [S, 3] int64)``: for each row ``(src, dst, words)`` of ``seg``
(device addresses and a count of 32-bit words), ``dst[0:words] = src[0:words]``.
The table itself lives on the device, so a captured graph reads the addresses
staged for the current call.

Preconditions (not checked: the table is device data): addresses of live device
memory, 4-byte aligned, destinations disjoint. ``mtpkern.cuda_graph`` checks its
tables on the host against the buffers they may touch.
"""

from __future__ import annotations

from ...ops._check import expect_shape
from ._util import device
from .loader import get_kernel

#: kStepThreads in step.cu
STEP_THREADS = 256
#: CUDA limit of gridDim.x
MAX_GRID_X = 2**31 - 1


def copy_segments(seg) -> None:
    """Copy every segment of ``seg`` [S, 3] int64 (src address, dst address, words)."""
    expect_shape("seg", seg, (None, 3))
    seg = device(seg, "seg", "int64")
    S = seg.shape[0]
    if S == 0:
        return
    if S > MAX_GRID_X:
        raise ValueError(f"seg: at most {MAX_GRID_X} segments per launch, got {S}")
    get_kernel("step", "copy_segments_kernel")((S,), (STEP_THREADS,), (seg,))
