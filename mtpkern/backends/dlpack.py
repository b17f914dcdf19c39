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

Every array argument a host reads (hiddens on the numpy and cpu backends, token ids,
grammar masks on any backend) goes through ``host_array``: NumPy arrays as they are,
host DLPack tensors through ``np.from_dlpack`` (zero-copy; host BF16 through the reader
above, widened to FP32), anything else through ``np.asarray``; an array on a device
(DLPack CUDA / ROCm / ..., or ``__cuda_array_interface__``) is refused with a
``TypeError`` that says so, instead of becoming a 0-d object array. ``shape(x)`` reads
the shape of any of them without copying (an object with only ``__dlpack__`` has no
``.shape``).
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
#: DLDeviceType names, for messages
DEVICE_NAMES = {1: "CPU", 2: "CUDA", 3: "CUDA host", 4: "OpenCL", 7: "Vulkan", 8: "Metal", 9: "VPI",
                10: "ROCm", 11: "ROCm host", 12: "ExtDev", 13: "CUDA managed", 14: "oneAPI", 15: "WebGPU",
                16: "Hexagon", 17: "MAIA"}


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


def device_description(x: Any) -> str | None:
    """Where ``x`` lives when that is not host memory NumPy can read: ``"CUDA device 0"``,
    ``"ROCm device 1"``, ``"a CUDA device (__cuda_array_interface__)"``; None for host arrays
    and plain Python objects. Reads only ``__dlpack_device__`` / ``__cuda_array_interface__``
    (guarded: PyTorch raises TypeError, not AttributeError, for a BF16 CUDA tensor's)."""
    if isinstance(x, np.ndarray):
        return None
    try:
        dev = device_of(x)
    except Exception:
        dev = None
    if dev is not None:
        if dev[0] in HOST_DEVICES:
            return None
        return f"{DEVICE_NAMES.get(dev[0], f'DLPack device type {dev[0]}')} device {dev[1]}"
    try:
        cai = getattr(x, "__cuda_array_interface__", None)
    except Exception:
        return "a CUDA device (an unreadable __cuda_array_interface__)"
    return None if cai is None else "a CUDA device (__cuda_array_interface__)"


def host_array(name: str, x: Any, where: str = "mtpkern reads it on the host") -> np.ndarray:
    """``x`` as a NumPy array (module docstring): zero-copy for NumPy and host DLPack
    tensors; a device array raises ``TypeError`` naming ``name``, the device and ``where``
    (why the host is needed)."""
    if isinstance(x, np.ndarray):
        return x
    dev = device_description(x)
    if dev is not None:
        raise TypeError(f"{name}: got a {type(x).__name__} on {dev}, but {where}; "
                        f"copy it to the host first (e.g. .cpu() / .get() / np.asarray)")
    if hasattr(x, "__dlpack__"):
        try:
            return np.from_dlpack(x)
        except Exception as e:
            try:
                widened = host_bfloat16(x)        # a host BF16 tensor NumPy cannot import
            except Exception:
                widened = None
            if widened is None:
                raise TypeError(f"{name}: could not read the {type(x).__name__} host tensor through "
                                f"DLPack ({type(e).__name__}: {e})") from None
            return widened
    return np.asarray(x)


def shape(x: Any) -> tuple[int, ...]:
    """The shape of an array-like without copying it: ``.shape``, else the
    ``__cuda_array_interface__``'s, else the DLPack header's, else ``np.shape``."""
    s = getattr(x, "shape", None)
    if s is None:
        try:
            cai = getattr(x, "__cuda_array_interface__", None)
        except Exception:
            cai = None
        if isinstance(cai, dict) and "shape" in cai:
            s = cai["shape"]
        elif hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
            try:
                s = export(x).shape
            except Exception:
                s = None
        if s is None:
            s = np.shape(x)
    return tuple(int(v) for v in s)
