"""Backends: ``numpy`` (the reference), ``cpu`` (Numba), ``cuda`` (CuPy RawModule).

``get_backend("auto")`` picks cuda when a GPU is usable, else cpu, and says which.
"""

from __future__ import annotations

import logging
from typing import Literal

from .base import Backend

BackendName = Literal["auto", "numpy", "cpu", "cuda"]
_log = logging.getLogger("mtpkern")


def cuda_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    try:
        import cupy  # noqa: F401

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver, or no device
        return False


def get_backend(backend: "BackendName | Backend" = "auto") -> Backend:
    if isinstance(backend, Backend):
        return backend
    if backend == "auto":
        backend = "cuda" if cuda_available() else "cpu"
        _log.info("mtpkern: backend='auto' chose %r", backend)
    if backend == "numpy":
        from .numpy_backend import NumpyBackend

        return NumpyBackend()
    if backend == "cpu":
        from .cpu import CpuBackend

        return CpuBackend()
    if backend == "cuda":
        if not cuda_available():
            raise RuntimeError("backend='cuda': no usable CUDA device (CuPy import or device query failed)")
        from .cuda import CudaBackend

        return CudaBackend()
    raise ValueError(f"backend: expected 'auto', 'numpy', 'cpu', 'cuda' or a Backend, got {backend!r}")
