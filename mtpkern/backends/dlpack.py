"""Read a DLPack tensor without a framework, for the BF16 hidden states that
NumPy cannot import and CuPy before 14 cannot either (CuPy 13 crashes on a
BF16 ``from_dlpack``; cupy/cupy#8801).

``export(x)`` calls ``x.__dlpack__`` and reads the legacy ``"dltensor"``
capsule's ``DLManagedTensor`` with ctypes (DLPack 0.8 layout, what producers
return when no ``max_version`` is asked for). ``uint16_view(info)`` exposes a
16-bit tensor as uint16 bits through ``__array_interface__`` (host) or
``__cuda_array_interface__`` (device), zero-copy; the view object holds the
capsule, whose destructor calls the producer's deleter once the last array
using the memory is gone. Widening the bits to FP32 is the caller's
(``bits << 16``).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import numpy as np

#: DLDeviceType codes
KDL_CPU, KDL_CUDA, KDL_CUDA_HOST, KDL_CUDA_MANAGED = 1, 2, 3, 13
#: DLDataTypeCode codes
KDL_INT, KDL_UINT, KDL_FLOAT, KDL_BFLOAT = 0, 1, 2, 4
HOST_DEVICES = (KDL_CPU, KDL_CUDA_HOST)
CUDA_DEVICES = (KDL_CUDA, KDL_CUDA_MANAGED)


class _Device(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _Tensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _Device), ("ndim", ctypes.c_int32),
                ("dtype", _DataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _Managed(ctypes.Structure):
    _fields_ = [("dl_tensor", _Tensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


# A private prototype: setting restype / argtypes on ctypes.pythonapi's shared function
# object would change it for every other user in the process.
_get_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """What a DLPack capsule describes (strides in bytes, C-contiguous when None)."""

    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...] | None
    code: int
    bits: int
    lanes: int
    device_type: int
    device_id: int
    capsule: Any             # keeps the producer's tensor alive

    @property
    def is_bfloat16(self) -> bool:
        return self.code == KDL_BFLOAT and self.bits == 16 and self.lanes == 1


def device_of(x: Any) -> tuple[int, int] | None:
    """``x.__dlpack_device__()`` as plain ints, or None when ``x`` has none."""
    fn = getattr(x, "__dlpack_device__", None)
    if fn is None:
        return None
    t, i = fn()
    return int(t), int(i)


def export(x: Any, stream: int | None = None) -> TensorInfo:
    """Ask ``x`` for a DLPack capsule (``stream``: the consumer's CUDA stream, 1 for
    the legacy default stream; None for host tensors) and read its tensor."""
    try:
        capsule = x.__dlpack__(stream=stream)
    except TypeError:                      # a producer without the stream keyword
        capsule = x.__dlpack__()
    addr = _get_pointer(capsule, b"dltensor")
    t = _Managed.from_address(addr).dl_tensor
    nd = int(t.ndim)
    shape = tuple(int(t.shape[i]) for i in range(nd))
    item = (int(t.dtype.bits) * int(t.dtype.lanes) + 7) // 8
    strides = None if not t.strides else tuple(int(t.strides[i]) * item for i in range(nd))
    return TensorInfo(int(t.data or 0) + int(t.byte_offset), shape, strides, int(t.dtype.code),
                      int(t.dtype.bits), int(t.dtype.lanes), int(t.device.device_type),
                      int(t.device.device_id), capsule)


class _View:
    """An array-interface view of a DLPack tensor that keeps its capsule alive."""

    def __init__(self, info: TensorInfo, typestr: str):
        iface = {"shape": info.shape, "typestr": typestr, "data": (info.ptr, False),
                 "strides": info.strides, "version": 3}
        self._capsule = info.capsule
        if info.device_type in CUDA_DEVICES:
            self.__cuda_array_interface__ = dict(iface, stream=None)   # ordered by export(stream=...)
        else:
            self.__array_interface__ = iface


def uint16_view(info: TensorInfo) -> _View:
    """A 16-bit (e.g. BF16) tensor's bits as a uint16 array interface, zero-copy:
    ``np.asarray(view)`` on the host, ``cupy.asarray(view)`` on the GPU."""
    if info.bits * info.lanes != 16:
        raise ValueError(f"expected a 16-bit tensor, got {info.bits} bits x {info.lanes} lanes")
    return _View(info, "<u2")


def host_bfloat16(x: Any) -> np.ndarray | None:
    """``x`` as FP32 NumPy when it is a host BF16 DLPack tensor (e.g. a CPU
    ``torch.bfloat16`` tensor, which ``np.from_dlpack`` refuses); None otherwise."""
    dev = device_of(x) if hasattr(x, "__dlpack__") else None
    if dev is None or dev[0] not in HOST_DEVICES:
        return None
    info = export(x)
    if not info.is_bfloat16:
        return None
    bits = np.asarray(uint16_view(info))
    return (bits.astype(np.uint32) << 16).view(np.float32)
