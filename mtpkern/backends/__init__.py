"""Backends: ``numpy`` (the reference), ``cpu`` (Numba), ``cuda`` (CuPy RawModule).

``get_backend("auto")`` picks cuda when a GPU is usable, else cpu, and logs which
(logger ``mtpkern``, level INFO).
"""

from __future__ import annotations

import logging
from typing import Literal

from ..errors import BackendUnavailable
from .base import Backend

BackendName = Literal["auto", "numpy", "cpu", "cuda"]
_log = logging.getLogger("mtpkern")

#: how to get CuPy (the cuda backend's one extra dependency)
CUDA_EXTRA_HINT = ("install a CUDA extra: pip install 'mtpkern[cuda12]' (CUDA 12) or 'mtpkern[cuda13]' "
                   "(CUDA 13); from a source tree, pip install -e '.[cuda12]'")


def cuda_unavailable_reason() -> str | None:
    """None when CuPy imports and sees at least one CUDA device, else why not (one line)."""
    try:
        import cupy
    except ImportError:
        return f"CuPy is not installed; {CUDA_EXTRA_HINT}"
    except Exception as e:  # a broken install: CUDA libraries missing, ...
        return f"CuPy failed to import ({type(e).__name__}: {' '.join(str(e).split())})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # no driver
        return f"CuPy found no usable CUDA driver ({' '.join(str(e).split())})"
    return None if count > 0 else "CuPy sees no CUDA device"


def cuda_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    return cuda_unavailable_reason() is None


def get_backend(backend: "BackendName | Backend" = "auto", *, threads: int | None = None) -> Backend:
    """The backend named ``backend`` (a ``Backend`` object is returned as it is).

    ``threads``: Numba threads of the cpu backend (``CpuBackend(threads=...)``; None: its
    default, docs/cpu.md). Only the cpu backend has a thread count: with ``"numpy"``,
    ``"cuda"`` or a ``Backend`` object, ``threads`` raises ``ValueError``; with ``"auto"``
    it applies when auto chooses cpu and is ignored (logged) when it chooses cuda, so one
    engine setting serves both kinds of machine. Raises ``BackendUnavailable`` for
    ``"cuda"`` without CuPy or a device, saying which extra to install.
    """
    if isinstance(backend, Backend):
        if threads is not None:
            raise ValueError(f"threads: a {backend.name} Backend object was passed; build it with its thread "
                             f"count (CpuBackend(threads=...)) instead, got threads={threads!r}")
        return backend
    if backend not in ("auto", "numpy", "cpu", "cuda"):
        raise ValueError(f"backend: expected 'auto', 'numpy', 'cpu', 'cuda' or a Backend, got {backend!r}")
    if backend == "auto":
        backend = "cuda" if cuda_available() else "cpu"
        _log.info("mtpkern: backend='auto' chose %r", backend)
        if backend == "cuda" and threads is not None:
            _log.info("mtpkern: threads=%r applies to the cpu backend only; ignored on cuda", threads)
            threads = None
    if threads is not None and backend != "cpu":
        raise ValueError(f"threads: only the cpu backend has a thread count, got threads={threads!r} "
                         f"with backend={backend!r}")
    if backend == "numpy":
        from .numpy_backend import NumpyBackend

        return NumpyBackend()
    if backend == "cpu":
        from .cpu import CpuBackend

        return CpuBackend(threads=threads)
    why = cuda_unavailable_reason()
    if why is not None:
        raise BackendUnavailable(f"backend='cuda': {why}")
    from .cuda import CudaBackend

    return CudaBackend()
