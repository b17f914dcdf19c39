"""Helpers shared by the launchers.

Arrays: :func:`device` turns any GPU array (CuPy, ``__cuda_array_interface__``,
DLPack) into a CuPy view without copying; a NumPy array is copied to the GPU
(convenient, but not allocation-free, so not for CUDA-graph capture).
:func:`output` returns a caller's preallocated buffer after checking it, or
allocates one. A launch given every ``out`` / workspace buffer as contiguous
device arrays of the right dtype allocates nothing.

Scalars go to the kernels as exact NumPy types (``np.int32``, ``np.float32``,
``np.int64``): CuPy passes them by value with their own size and checks nothing
against the kernel's signature.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ...ops._check import dtype_name, expect_dtype, shape_of
from ...ops.norm import check_norm
from ...quant import FP4_BLOCK, NVFP4_BLOCK, Fp4Weight, Fp8Weight
from ..base import fp8_embedding_refused, unprepared_fp8
from .loader import CTYPE, FP4_CTYPE, NVFP4_CTYPE

#: a null pointer argument (kernels test optional inputs such as bias against nullptr)
NULL = np.uint64(0)
#: CUDA limit of gridDim.y and gridDim.z
MAX_GRID_YZ = 65535
#: dtype names of stored weights: FP32, or BF16 as uint16 bits
WEIGHT_DTYPES = ("float32", "uint16")


def i32(v) -> np.int32:
    v = int(v)
    if not -(2**31) <= v < 2**31:
        raise ValueError(f"{v} does not fit a 32-bit kernel argument")
    return np.int32(v)


def f32(v) -> np.float32:
    return np.float32(v)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _cupy():
    import cupy

    return cupy


def is_device_array(a: Any) -> bool:
    if hasattr(a, "__cuda_array_interface__"):
        return True
    dev = getattr(a, "__dlpack_device__", None)
    # DLPack device types: 2 CUDA, 13 CUDA managed (3, pinned host memory, is host memory)
    return dev is not None and not isinstance(a, np.ndarray) and dev()[0] in (2, 13)


def _as_cupy(a: Any):
    """``a`` as a CuPy array, in any layout: GPU arrays wrapped, host arrays copied."""
    cp = _cupy()
    if isinstance(a, cp.ndarray):
        return a
    if hasattr(a, "__cuda_array_interface__"):
        return cp.asarray(a)
    if is_device_array(a):
        return cp.from_dlpack(a)
    return cp.asarray(np.asarray(a))


def device(a: Any, name: str, *dtypes: str):
    """``a`` as a contiguous CuPy array of one of ``dtypes``.

    GPU arrays are wrapped without a copy (a non-contiguous one is copied to a
    contiguous one); host arrays are copied to the current device."""
    arr = _as_cupy(a)
    if dtypes:
        expect_dtype(name, arr, *dtypes)
    if not arr.flags.c_contiguous:
        arr = _cupy().ascontiguousarray(arr)
    return arr


def row_stride(a: Any) -> int | None:
    """Elements from one row of the 2-D ``a`` to the next when its columns are adjacent and
    its rows do not overlap (a column slice ``buf[:, j:j + G]`` of a wider ``buf``: the
    width of ``buf``); None for any other layout."""
    n, G = shape_of(a)
    s0, s1 = (int(s) for s in a.strides)
    item = a.dtype.itemsize
    if n <= 1 or G == 0:
        return G
    if (s1 == item or G == 1) and s0 > 0 and s0 % item == 0 and s0 // item >= G:
        return s0 // item
    return None


def device_rows(a: Any, name: str, *dtypes: str) -> tuple[Any, int]:
    """``a`` [n, G] as ``(span, ld)``: a contiguous 1-D CuPy array of the ``(n - 1) * ld + G``
    elements from its first to its last, and its row stride ``ld`` (``row_stride``), for a
    kernel that reads row i at ``span + i * ld``. A column slice of a wider device buffer is
    used in place (no copy, as graph capture needs); any other layout is copied (ld = G)."""
    cp = _cupy()
    arr = _as_cupy(a)
    if dtypes:
        expect_dtype(name, arr, *dtypes)
    ld = row_stride(arr)
    if arr.flags.c_contiguous or ld is None:
        return cp.ascontiguousarray(arr).reshape(-1), int(arr.shape[1])
    n, G = shape_of(arr)
    return cp.ndarray(((n - 1) * ld + G,), arr.dtype, arr.data), ld


def optional(a: Any, name: str, *dtypes: str):
    return None if a is None else device(a, name, *dtypes)


def inplace(a: Any, name: str, *dtypes: str):
    """A device array the kernel writes into: no copy may stand in for it."""
    if not is_device_array(a):          # a CuPy array has __cuda_array_interface__ too
        raise TypeError(f"{name}: expected a GPU array (written in place), got {type(a).__name__}")
    cp = _cupy()
    arr = a if isinstance(a, cp.ndarray) else (cp.asarray(a) if hasattr(a, "__cuda_array_interface__") else cp.from_dlpack(a))
    if dtypes:
        expect_dtype(name, arr, *dtypes)
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous array (written in place), got strides {arr.strides}")
    return arr


def output(out: Any, name: str, shape: tuple[int, ...], dtype) -> Any:
    """The caller's buffer ``out`` (checked: shape, dtype, contiguous, on the GPU), or a new one."""
    if out is None:
        return _cupy().empty(shape, dtype)
    arr = inplace(out, name, np.dtype(dtype).name)
    if shape_of(arr) != tuple(shape):
        raise ValueError(f"{name}: expected shape {list(shape)}, got {list(shape_of(arr))}")
    return arr


def zeroed(buf: Any, name: str, shape: tuple[int, ...], dtype) -> Any:
    """A workspace that must hold zeros when a launch starts and that the kernel leaves zero
    (a ticket counter): the caller's (checked as ``output``), or a new zeroed one."""
    if buf is None:
        return _cupy().zeros(shape, dtype)
    return output(buf, name, shape, dtype)


def expect_disjoint(name_a: str, a: Any, name_b: str, b: Any) -> None:
    """Raise when two device arrays share memory (a kernel reading b while writing a)."""
    a0, b0 = a.data.ptr, b.data.ptr
    if a0 < b0 + b.nbytes and b0 < a0 + a.nbytes and a.nbytes and b.nbytes:
        raise ValueError(f"{name_a} must not overlap {name_b}")


def expect_same_or_disjoint(name_a: str, a: Any, name_b: str, b: Any) -> None:
    """Raise when two contiguous device arrays overlap without being the same array
    (a kernel that reads each element of b just before writing the same element of a
    can work in place, but not on a shifted overlap: another block writes first)."""
    if b is None:
        return
    if a.data.ptr == b.data.ptr and a.nbytes == b.nbytes:
        return
    expect_disjoint(name_a, a, name_b, b)


def ptr(a: Any) -> Any:
    """Array argument, or a null pointer for an absent optional input."""
    return NULL if a is None else a


@dataclass(slots=True, eq=False)
class CudaFp8:
    """An FP8 E4M3 weight on the device, as the GEMV kernels read it (common.cuh ``Scales``):
    ``data`` uint8 ``[.., N, K]`` (the checkpoint's codes), ``scale`` float32 ``[.., ceil(N / bn),
    ceil(K / bk)]``; per-channel scales are ``[.., N]`` with ``bn = 1``, ``bk = K``."""

    data: Any
    scale: Any
    bn: int
    bk: int

    @property
    def shape(self) -> tuple[int, ...]:
        return shape_of(self.data)

    @property
    def ndim(self) -> int:
        return len(self.data.shape)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes + self.scale.nbytes)

    @classmethod
    def from_weight(cls, w: Fp8Weight, upload: Callable[[np.ndarray], Any]) -> "CudaFp8":
        """``upload``: host array -> device array (``cupy.asarray``)."""
        bn, bk = w.block if w.block is not None else (1, max(w.shape[-1], 1))
        return cls(upload(np.ascontiguousarray(w.data)), upload(w.scale), int(bn), int(bk))


@dataclass(slots=True, eq=False)
class CudaFp4(CudaFp8):
    """An FP4 weight on the device, as the GEMV kernels read it (common.cuh ``fp4x2_e2m1``):
    ``data`` uint8 ``[.., N, K / 2]``, the E2M1 codes two a byte as the checkpoint packs them
    (column 2j in the low nibble of byte j), ``scale`` uint8 ``[.., N, ceil(K / 32)]``, the
    E8M0 codes (2^(c - 127)); ``bn = 1``, ``bk = 32``. Half a byte a weight plus one per 32.

    A ``CudaFp8`` for the checks that ask only whether a weight is quantized (FP8 / FP4
    pairs, the tensor-core path and the embedding table take dense weights only); ``shape``
    is the weight's ``[.., N, K]``, and ``ctype`` / ``device_weight`` tell the two apart."""

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, half = shape_of(self.data)
        return (*lead, 2 * half)

    @classmethod
    def from_weight(cls, w: Fp4Weight, upload: Callable[[np.ndarray], Any]) -> "CudaFp4":
        """``upload``: host array -> device array (``cupy.asarray``). An NVFP4 weight (E4M3
        scales per 16 and a row scale) gives a ``CudaNvFp4``."""
        if w.global_scale is not None:
            return CudaNvFp4.from_weight(w, upload)
        return cls(upload(np.ascontiguousarray(w.data)), upload(np.ascontiguousarray(w.scale)), 1, FP4_BLOCK)


def nvfp4_record_bytes(K: int, bk: int = NVFP4_BLOCK) -> int:
    """Bytes of one row's scale record of an NVFP4 weight on the device (common.cuh
    ``nvfp4_record``): 4 for the FP32 row scale, then ``ceil(K / bk)`` E4M3 codes, padded to a
    multiple of 4 so that every record (and its row scale) starts 4-byte aligned."""
    return 4 + (-(-K // bk) + 3) // 4 * 4


@dataclass(slots=True, eq=False)
class CudaNvFp4(CudaFp4):
    """An NVFP4 weight on the device, as the GEMV kernels read it (common.cuh ``nvfp4x2_e2m1``):
    ``data`` uint8 ``[.., N, K / 2]``, the E2M1 codes packed as ``CudaFp4``'s; ``scale`` uint8
    ``[.., N, nvfp4_record_bytes(K)]``, one record a row: the row's FP32 scale (its 4 bytes,
    little endian), then its ``ceil(K / 16)`` E4M3 codes as stored, then zero padding to a
    multiple of 4 bytes. ``bn = 1``, ``bk = 16``. Keeping the row scale inside the row's
    record lets every GEMV kernel take it through the ``(w, scale, bn, bk)`` arguments that
    FP8 and MXFP4 use (the kernels fold it into each block's scale: docs/fp4.md); it costs 4
    bytes a row (and up to 3 of padding) beside K / 2 + K / 16."""

    @property
    def row_scale(self) -> Any:
        """The FP32 row scales ``[.., N]`` (a copy, read from the records)."""
        return self.scale[..., :4].copy().view(np.float32)[..., 0]

    @classmethod
    def from_weight(cls, w: Fp4Weight, upload: Callable[[np.ndarray], Any]) -> "CudaNvFp4":
        """``upload``: host array -> device array (``cupy.asarray``); ``w`` NVFP4 only."""
        if w.global_scale is None:
            raise TypeError(f"w: expected an NVFP4 weight (E4M3 scales per 16 and a global scale), got an MXFP4 "
                            f"weight {list(w.shape)} (E8M0 scales per 32: CudaFp4.from_weight)")
        *lead, N, K = w.shape
        ks = w.scale.shape[-1]
        rec = np.zeros((*lead, N, nvfp4_record_bytes(K)), np.uint8)
        rec[..., :4] = np.ascontiguousarray(w.global_scale, dtype="<f4").view(np.uint8).reshape(*lead, N, 4)
        rec[..., 4:4 + ks] = w.scale
        return cls(upload(np.ascontiguousarray(w.data)), upload(rec), 1, NVFP4_BLOCK)


def expect_weight(name: str, w: Any) -> None:
    """A stored weight: FP32, BF16 bits in uint16, ``CudaFp8``, ``CudaFp4`` or ``CudaNvFp4`` (see
    CudaBackend.prepare_weight)."""
    if isinstance(w, CudaFp8):
        return
    if isinstance(w, (Fp8Weight, Fp4Weight)):
        raise unprepared_fp8(name, w)
    if dtype_name(w) not in WEIGHT_DTYPES:
        raise TypeError(
            f"{name}: expected dtype float32 or uint16 (bf16 bits from prepare_weight), got {dtype_name(w)}"
        )


def device_weight(w: Any, name: str) -> Any:
    """A stored weight (checked: ``expect_weight``) with its arrays as contiguous device arrays."""
    expect_weight(name, w)
    if isinstance(w, CudaNvFp4):  # the kernels step whole records of nvfp4_record_bytes(K, bk)
        *lead, N, K = w.shape
        want = (*lead, N, nvfp4_record_bytes(K, w.bk))
        if w.bn != 1 or w.bk % 8 or tuple(shape_of(w.scale)) != want:
            raise ValueError(f"{name}.scale: expected an NVFP4 scale record per row, shape {list(want)} with bn 1 "
                             f"and bk a multiple of 8 (16 as stored), got shape {list(shape_of(w.scale))}, "
                             f"bn {w.bn}, bk {w.bk}")
    if isinstance(w, CudaFp4):  # CudaFp4 or CudaNvFp4: the same arrays, kept as their class
        return type(w)(device(w.data, name, "uint8"), device(w.scale, f"{name}.scale", "uint8"), w.bn, w.bk)
    if isinstance(w, CudaFp8):
        return CudaFp8(device(w.data, name, "uint8"), device(w.scale, f"{name}.scale", "float32"), w.bn, w.bk)
    return device(w, name)


def dense_weight(w: Any, name: str) -> Any:
    """``device_weight`` for a weight that may not be FP8 (the embedding table)."""
    if isinstance(w, CudaFp8):
        raise fp8_embedding_refused(name)
    return device_weight(w, name)


def weight_args(w: Any) -> tuple:
    """The weight's kernel arguments ``(w, scale, bn, bk)``: scale null for dense weights."""
    if isinstance(w, CudaFp8):
        return w.data, w.scale, i32(w.bn), i32(w.bk)
    return w, NULL, i32(1), i32(1)


def ctype(a: Any) -> str:
    """C++ element type of a weight / KV array: 'float', '__nv_bfloat16', (a ``CudaFp8``)
    '__nv_fp8_e4m3', (a ``CudaFp4``) 'fp4x2_e2m1' or (a ``CudaNvFp4``) 'nvfp4x2_e2m1'."""
    if isinstance(a, CudaNvFp4):
        return NVFP4_CTYPE
    if isinstance(a, CudaFp4):
        return FP4_CTYPE
    return CTYPE[dtype_name(a.data if isinstance(a, CudaFp8) else a)]


def expect_grid_yz(name: str, v: int) -> None:
    if v > MAX_GRID_YZ:
        raise ValueError(f"{name}: at most {MAX_GRID_YZ} per launch (a CUDA grid limit), got {v}")


@functools.cache
def _sm_count(device_id: int) -> int:
    return int(_cupy().cuda.Device(device_id).attributes["MultiProcessorCount"])


def sm_count() -> int:
    """Streaming multiprocessors of the current device (132 on H100 SXM / H200)."""
    return _sm_count(_cupy().cuda.Device().id)


#: per-SM limits of sm_80 / sm_90 the occupancy estimate uses: registers, warps, blocks
SM_REGISTERS, SM_WARPS, SM_BLOCKS = 65536, 64, 32


def resident_blocks(kernel: Any, threads: int, fallback: int = 4) -> int:
    """Blocks of ``threads`` threads one SM holds at once, from the kernel's registers per
    thread (``num_regs``: allocated per warp in units of 256) and the SM's warp and block
    limits (shared memory is not counted: the GEMV kernels use under 1 KiB). ``fallback``
    where the kernel does not say (the emulator's kernels)."""
    regs = getattr(kernel, "num_regs", None)
    if not regs:
        return fallback
    warps = cdiv(threads, 32)
    per_warp = cdiv(int(regs) * 32, 256) * 256
    return max(1, min(SM_REGISTERS // (per_warp * warps), SM_WARPS // warps, SM_BLOCKS))


#: dynamic shared memory a block may use without the opt-in attribute
SMEM_DEFAULT = 48 * 1024


@functools.cache
def _smem_optin(device_id: int) -> int:
    return int(_cupy().cuda.Device(device_id).attributes["MaxSharedMemoryPerBlockOptin"])


def smem_optin() -> int:
    """Most shared memory a block of the current device may opt in to (227 KiB on
    H100 / H200, 163 KiB on A100)."""
    return _smem_optin(_cupy().cuda.Device().id)


def opt_in_smem(kernel: Any, nbytes: int) -> None:
    """Let ``kernel`` launch with ``nbytes`` of dynamic shared memory: over 48 KiB that
    takes the kernel's max-dynamic-shared-size attribute (set once, never lowered)."""
    if nbytes > SMEM_DEFAULT and kernel.max_dynamic_shared_size_bytes < nbytes:
        kernel.max_dynamic_shared_size_bytes = nbytes


def device_norm(norm, K: int) -> tuple | None:
    """The ops' ``norm=(weight [K], eps)`` (an RMSNorm of x fused into a GEMV: ``linear``,
    ``swiglu_mlp``, the experts, ``gemm_tc``), checked, with the weight on the device:
    (weight, eps) or None."""
    if norm is None:
        return None
    g, eps = check_norm(norm, K)
    return device(g, "norm weight", "float32"), eps
