"""FP8 E4M3 weights as released checkpoints store them: one byte per weight plus FP32 scales.

DeepSeek-V3 / GLM-4.x FP8 releases (``quantization_config.quant_method == "fp8"``) keep a
projection ``[N, K]`` as ``weight`` in ``float8_e4m3fn`` and a ``weight_scale_inv``; the
compressed-tensors format keeps a per-output-channel ``weight_scale`` instead.
:class:`Fp8Weight` holds either form unchanged; ``Backend.prepare_weight`` takes it and
keeps the bytes (cpu, cuda) or dequantizes it once (numpy, the reference). The layout
and what every backend does with it: docs/fp8.md.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

#: the largest finite E4M3 value (0x7E / 0xFE); 0x7F / 0xFF are NaN, there is no infinity
E4M3_MAX = 448.0

#: weight dims an Fp8Weight may have: [N, K], or stacked experts [E, N, K]
_NDIMS = (2, 3)


@functools.cache
def e4m3_table() -> np.ndarray:
    """[256] float32: the exact value of every E4M3 code (``float8_e4m3fn``; NaN at 0x7F, 0xFF)."""
    import ml_dtypes

    table = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    table.flags.writeable = False
    return table


#: the largest scale an E4M3 code may be multiplied by without the product overflowing FP32
#: (448 * scale <= FLT_MAX): a larger one makes some weight of its block infinite
SCALE_MAX = float(np.finfo(np.float32).max) / E4M3_MAX


def nan_codes(data: np.ndarray, chunk: int = 1 << 24) -> tuple[int, tuple[int, ...] | None]:
    """(how many of the E4M3 codes ``data`` are NaN (0x7F / 0xFF), the index of the first one
    or None): one vectorised pass over the bytes, ``chunk`` at a time (no widened copy)."""
    flat = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    count, first = 0, None
    for i in range(0, flat.size, chunk):
        bad = (flat[i:i + chunk] & 0x7F) == 0x7F
        n = int(np.count_nonzero(bad))
        if n and first is None:
            first = tuple(int(j) for j in np.unravel_index(i + int(np.argmax(bad)), data.shape))
        count += n
    return count, first


def bad_scales(scale: np.ndarray) -> tuple[int, tuple[int, ...] | None]:
    """(how many of ``scale`` are non-finite or above ``SCALE_MAX``, the index of the first one or None)."""
    s = np.asarray(scale, np.float32)
    with np.errstate(invalid="ignore"):
        bad = ~(np.abs(s) <= SCALE_MAX)               # NaN compares False: counted
    n = int(np.count_nonzero(bad))
    return n, (tuple(int(j) for j in np.argwhere(bad)[0]) if n else None)


def _fp8_dtype():
    import ml_dtypes

    return np.dtype(ml_dtypes.float8_e4m3fn)


def _dims(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


@dataclass(frozen=True, slots=True, eq=False)
class Fp8Weight:
    """A weight ``[N, K]`` (or stacked experts ``[E, N, K]``) in FP8 E4M3 with FP32 scales.

    Fields:

    - ``data``: uint8 ``[.., N, K]``, the E4M3 bits (``float8_e4m3fn``: sign, 4 exponent
      bits with bias 7, 3 mantissa bits; 0x7F / 0xFF are NaN, no infinity, 0x7E = 448,
      0x80 = -0, 0x01..0x07 subnormal: m * 2^-9). A ``float8_e4m3fn`` array is accepted
      and viewed as its bits.
    - ``scale``: float32 (BF16 / FP16 scales, and the E8M0 ones of DeepSeek-V4's
      ``scale_fmt: "ue8m0"``, are widened exactly; an E8M0 NaN code becomes NaN and is refused):

      * ``block = (bn, bk)``: ``[.., ceil(N / bn), ceil(K / bk)]``, the checkpoint's
        ``weight_scale_inv``; ``w[n, k] = e4m3(data[n, k]) * scale[n // bn, k // bk]``.
        The last block of a row or column may be partial (N, K need not be multiples).
      * ``block = None`` (per output channel): ``[.., N]`` (``[.., N, 1]`` as
        compressed-tensors stores it is accepted and kept as ``[.., N]``);
        ``w[n, k] = e4m3(data[n, k]) * scale[n]``.

      Scales must be finite and at most ``SCALE_MAX`` in magnitude (448 times a scale must
      stay finite in FP32). NaN codes are not looked for here (a pass over every byte):
      ``nan_codes``, which the loader runs once on every FP8 tensor it reads.
    - ``block``: ``(bn, bk)`` positive ints, or None for per-channel scales.

    The dequantized weight (:meth:`dequantize`, the reference every backend follows) is
    each code's exact value times its scale, rounded once to FP32: exact whenever the
    scale is a power of two (an E4M3 value has 4 significant bits), otherwise within
    half an FP32 ulp.

    Invalid fields raise ``TypeError`` (dtype) or ``ValueError`` (shape, block, values)
    naming the field, what was expected and what was given. Build one from a checkpoint
    with ``Fp8Weight(weight, weight_scale_inv, tuple(weight_block_size))`` or
    ``Fp8Weight(weight, weight_scale, None)``; :meth:`concat` fuses projections along
    N (q/k/v, gate/up), :meth:`stack` stacks experts.
    """

    data: np.ndarray
    scale: np.ndarray
    block: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        data = self.data
        if not isinstance(data, np.ndarray):
            raise TypeError(f"data: expected a NumPy array of E4M3 bits (uint8 or float8_e4m3fn), "
                            f"got {type(data).__name__}")
        if data.dtype == _fp8_dtype():
            data = data.view(np.uint8)
        elif data.dtype != np.uint8:
            raise TypeError(f"data: expected dtype uint8 (E4M3 bits) or float8_e4m3fn, got {data.dtype.name}")
        if data.ndim not in _NDIMS:
            raise ValueError(f"data: expected [N, K] or stacked experts [E, N, K], got shape {_dims(data.shape)}")
        block = self.block
        if block is not None:
            ok = (isinstance(block, (tuple, list)) and len(block) == 2
                  and all(isinstance(b, (int, np.integer)) and not isinstance(b, bool) and b >= 1 for b in block))
            if not ok:
                raise ValueError(f"block: expected (bn, bk) of positive ints or None (per-channel scales), "
                                 f"got {block!r}")
            block = (int(block[0]), int(block[1]))
        scale = self.scale
        if not isinstance(scale, np.ndarray):
            raise TypeError(f"scale: expected a NumPy array, got {type(scale).__name__}")
        if scale.dtype.name not in ("float32", "bfloat16", "float16", "float8_e8m0fnu"):
            raise TypeError(f"scale: expected dtype float32 (bfloat16 / float16 / float8_e8m0fnu widen "
                            f"exactly), got {scale.dtype.name}")
        *lead, N, K = data.shape
        if block is None:
            want = (*lead, N)
            if scale.shape == (*lead, N, 1):
                scale = scale.reshape(want)
            kind = "per-channel scales"
        else:
            want = (*lead, -(-N // block[0]), -(-K // block[1]))
            kind = f"block {block}"
        if scale.shape != want:
            raise ValueError(f"scale: expected shape {_dims(want)} for data {_dims(data.shape)} with {kind}, "
                             f"got {_dims(scale.shape)}")
        scale = np.ascontiguousarray(scale, dtype=np.float32)
        n, at = bad_scales(scale)
        if n:
            raise ValueError(f"scale: expected finite values, got {n} non-finite or above {SCALE_MAX:.4g} in "
                             f"magnitude (448 times a scale must stay finite in FP32; first {float(scale[at])!r} "
                             f"at {at})")
        object.__setattr__(self, "data", data)
        object.__setattr__(self, "scale", scale)
        object.__setattr__(self, "block", block)

    # -- what it is ----------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        """The weight's shape, ``[N, K]`` or ``[E, N, K]``."""
        return tuple(int(s) for s in self.data.shape)

    @property
    def ndim(self) -> int:
        return self.data.ndim

    @property
    def nbytes(self) -> int:
        """Bytes held: one per weight plus 4 per scale."""
        return int(self.data.nbytes + self.scale.nbytes)

    def __repr__(self) -> str:
        kind = "per-channel" if self.block is None else f"block={self.block}"
        return f"Fp8Weight({_dims(self.shape)}, {kind}, {self.nbytes} bytes)"

    def scale_per_element(self) -> np.ndarray:
        """float32 ``[.., N, K]``: the scale each weight is multiplied by."""
        N, K = self.data.shape[-2:]
        if self.block is None:
            return np.broadcast_to(self.scale[..., :, None], self.data.shape)
        bn, bk = self.block
        rows = np.repeat(self.scale, bn, axis=-2)[..., :N, :]
        return np.repeat(rows, bk, axis=-1)[..., :K]

    def scale_at(self, at: tuple[np.ndarray, ...]) -> np.ndarray:
        """float32: the scales of the weights at ``at`` (one index array per dim, as ``np.nonzero``)."""
        *lead, n, k = at
        if self.block is None:
            return self.scale[(*lead, n)]
        return self.scale[(*lead, n // self.block[0], k // self.block[1])]

    def dequantize(self) -> np.ndarray:
        """float32 ``[.., N, K]``: ``e4m3(data) * scale``, each product rounded once (the reference)."""
        return e4m3_table()[self.data] * self.scale_per_element()

    # -- building ------------------------------------------------------------------------
    @classmethod
    def quantize(cls, w, block: tuple[int, int] | None = (128, 128)) -> "Fp8Weight":
        """Quantize float weights ``[.., N, K]`` as the releases do: per block (or per row when
        ``block`` is None) ``scale = amax / 448`` (1.0 for an all-zero block), codes rounded to
        the nearest E4M3 value of ``w / scale`` (ties to even, through ml_dtypes). For tests
        and synthetic checkpoints."""
        w = np.asarray(w, dtype=np.float32)
        if w.ndim not in _NDIMS:
            raise ValueError(f"w: expected [N, K] or [E, N, K], got shape {_dims(w.shape)}")
        if not np.isfinite(w).all():
            raise ValueError("w: expected finite values")
        *lead, N, K = w.shape
        if block is None:
            amax = np.abs(w).max(axis=-1)                                             # [.., N]
        else:
            bn, bk = int(block[0]), int(block[1])
            nb, kb = -(-N // bn), -(-K // bk)
            padded = np.zeros((*lead, nb * bn, kb * bk), np.float32)
            padded[..., :N, :K] = np.abs(w)
            amax = padded.reshape(*lead, nb, bn, kb, bk).max(axis=(-3, -1))            # [.., nb, kb]
        scale = np.where(amax > 0, amax / np.float32(E4M3_MAX), np.float32(1.0)).astype(np.float32)
        q = cls(np.zeros(w.shape, np.uint8), scale, None if block is None else (bn, bk))
        codes = np.clip(w / q.scale_per_element(), -E4M3_MAX, E4M3_MAX).astype(_fp8_dtype())
        return cls(codes.view(np.uint8), scale, q.block)

    @classmethod
    def concat(cls, parts: Sequence["Fp8Weight"]) -> "Fp8Weight":
        """Weights ``[N_i, K]`` (one scale kind, one block) joined along N, as fused projections
        are (q/k/v, gate/up). With block scales, a part whose N is not a multiple of ``bn``
        (but the last) shifts the blocks of the parts after it, so the blocks are refined to
        ``gcd(bn, N_i ...)`` rows, each keeping its scale (the values do not change)."""
        parts = _matrices(parts)
        for i, p in enumerate(parts):
            if p.shape[1] != parts[0].shape[1]:
                raise ValueError(f"parts[{i}]: expected [*, {parts[0].shape[1]}], got {_dims(p.shape)}")
            if p.block != parts[0].block:
                raise ValueError(f"parts[{i}]: expected block {parts[0].block}, got {p.block}")
        block = parts[0].block
        data = np.concatenate([p.data for p in parts], axis=0)
        if block is None:
            return cls(data, np.concatenate([p.scale for p in parts]), None)
        bn = math.gcd(block[0], *[p.shape[0] for p in parts[:-1]])
        scale = np.concatenate([np.repeat(p.scale, block[0] // bn, axis=0)[: -(-p.shape[0] // bn)]
                                for p in parts], axis=0)
        return cls(data, scale, (bn, block[1]))

    def take_units(self, axis: int, order: np.ndarray, unit: int) -> "Fp8Weight":
        """The weight ``[N, K]`` with its rows (``axis`` 0) or columns (1) rearranged in units of
        ``unit``: unit ``i`` of the result is unit ``order[i]`` of this one (the length a
        multiple of ``unit``). Block scales are refined to ``gcd(b, unit)`` along the axis, each
        keeping its scale, so every weight keeps its value; per-channel scales follow their rows."""
        if self.ndim != 2 or axis not in (0, 1):
            raise ValueError(f"take_units: expected an [N, K] weight and axis 0 or 1, got {_dims(self.shape)}, {axis}")
        n = self.shape[axis]
        order = np.asarray(order, np.int64)
        if n % unit or sorted(order.tolist()) != list(range(n // unit)):
            raise ValueError(f"order: expected a permutation of the {n // unit} units of {unit} along axis {axis} "
                             f"(length {n}), got {len(order)} units")
        idx = (order[:, None] * unit + np.arange(unit)).ravel()
        data = np.take(self.data, idx, axis=axis)
        if self.block is None:
            return Fp8Weight(data, self.scale[idx] if axis == 0 else self.scale, None)
        b = self.block[axis]
        g = math.gcd(b, unit)
        fine = np.repeat(self.scale, b // g, axis=axis)
        fine = fine[: -(-n // g)] if axis == 0 else fine[:, : -(-n // g)]
        per = unit // g
        sidx = (order[:, None] * per + np.arange(per)).ravel()
        block = (g, self.block[1]) if axis == 0 else (self.block[0], g)
        return Fp8Weight(data, np.take(fine, sidx, axis=axis), block)

    @classmethod
    def stack(cls, parts: Sequence["Fp8Weight"]) -> "Fp8Weight":
        """Experts ``[N, K]`` of one shape, scale kind and block -> ``[E, N, K]``."""
        parts = _matrices(parts)
        for i, p in enumerate(parts):
            if p.shape != parts[0].shape or p.block != parts[0].block:
                raise ValueError(f"parts[{i}]: expected {_dims(parts[0].shape)} with block {parts[0].block}, "
                                 f"got {_dims(p.shape)} with block {p.block}")
        return cls(np.stack([p.data for p in parts]), np.stack([p.scale for p in parts]), parts[0].block)


def _matrices(parts: Sequence, cls: type | None = None) -> list:
    """``parts`` as a list of at least one 2-D ``cls`` (Fp8Weight unless given; for concat and stack)."""
    cls = cls or Fp8Weight
    parts = list(parts)
    if not parts:
        raise ValueError(f"parts: expected at least one {cls.__name__}, got none")
    for i, p in enumerate(parts):
        if not isinstance(p, cls):
            raise TypeError(f"parts[{i}]: expected an {cls.__name__}, got {type(p).__name__}")
        if p.ndim != 2:
            raise ValueError(f"parts[{i}]: expected a weight [N, K], got {_dims(p.shape)}")
    return parts


# -- FP4 E2M1 weights with E8M0 block scales (DeepSeek-V4's routed experts; docs/fp4.md) -----

#: weights per E8M0 scale, along the input dim K (the OCP microscaling block)
FP4_BLOCK = 32
#: the largest E2M1 value (0x7 / 0xF); E2M1 has no infinity and no NaN
E2M1_MAX = 6.0
#: the E8M0 code that is NaN (``float8_e8m0fnu``: 0xFF); every other code c is 2^(c - 127)
E8M0_NAN = 0xFF
#: the largest E8M0 code whose scale keeps every weight of its block finite in FP32:
#: 6 * 2^(252 - 127) = 1.5 * 2^127 < FLT_MAX, while 6 * 2^126 overflows
E8M0_MAX_CODE = 252
#: weights per E4M3 scale of an NVFP4 weight (NVIDIA's FP4 with a second, per-tensor scale)
NVFP4_BLOCK = 16
#: the largest magnitude of an NVFP4 weight's FP32 row scale: 6 (E2M1) * 448 (E4M3) times it
#: stays finite in FP32
NVFP4_GLOBAL_MAX = float(np.finfo(np.float32).max) / (E2M1_MAX * E4M3_MAX)


@functools.cache
def e2m1_table() -> np.ndarray:
    """[16] float32: the exact value of every E2M1 code (``float4_e2m1fn``: sign bit 3, two
    exponent bits with bias 1, one mantissa bit): 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives
    (0x8 is -0)."""
    mag = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
    table = np.concatenate([mag, -mag]).astype(np.float32)
    table.flags.writeable = False
    return table


@functools.cache
def e8m0_table() -> np.ndarray:
    """[256] float32: 2^(c - 127) for every E8M0 code c (code 0 is 2^-127, an FP32 subnormal,
    exact); NaN at 0xFF."""
    bits = np.arange(256, dtype=np.uint32) << 23               # 2^(c - 127) for c >= 1: the exponent field
    bits[0] = 0x00400000                                         # 2^-127: FP32's subnormal with the top mantissa bit
    bits[E8M0_NAN] = 0x7FC00000
    table = bits.view(np.float32)
    table.flags.writeable = False
    return table


def pack_e2m1(codes: np.ndarray) -> np.ndarray:
    """uint8 codes ``[.., K]`` (each < 16, K even) -> uint8 ``[.., K / 2]``: column 2j in the low
    nibble of byte j, column 2j + 1 in its high nibble (DeepSeek-V4's packing: docs/fp4.md)."""
    codes = np.asarray(codes, np.uint8)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def unpack_e2m1(data: np.ndarray) -> np.ndarray:
    """uint8 ``[.., K / 2]`` packed codes -> uint8 ``[.., K]``, one code per weight (``pack_e2m1``'s inverse)."""
    data = np.asarray(data, np.uint8)
    out = np.empty((*data.shape[:-1], 2 * data.shape[-1]), np.uint8)
    out[..., 0::2] = data & 0x0F
    out[..., 1::2] = data >> 4
    return out


def _fp4_dtypes():
    import ml_dtypes

    return np.dtype(ml_dtypes.float8_e8m0fnu)


def bad_e8m0(scale: np.ndarray) -> tuple[int, int, tuple[int, ...] | None]:
    """(how many E8M0 codes of ``scale`` are NaN (0xFF), how many are above ``E8M0_MAX_CODE``
    but not NaN, the index of the first of either or None)."""
    s = np.asarray(scale).view(np.uint8)
    nan = s == E8M0_NAN
    big = (s > E8M0_MAX_CODE) & ~nan
    bad = nan | big
    n = int(np.count_nonzero(bad))
    return (int(np.count_nonzero(nan)), int(np.count_nonzero(big)),
            tuple(int(j) for j in np.argwhere(bad)[0]) if n else None)


@dataclass(frozen=True, slots=True, eq=False)
class Fp4Weight:
    """A weight ``[N, K]`` (or stacked experts ``[E, N, K]``) in FP4 E2M1, two codes a byte, in
    one of two scale kinds (docs/fp4.md):

    - **MXFP4** (``global_scale`` None): one E8M0 scale per block of 32 weights along K, as
      DeepSeek-V4 releases its routed experts and compressed-tensors' ``mxfp4-pack-quantized``
      stores its weights: ``w[n, k] = e2m1(code[n, k]) * 2^(scale[n, k // 32] - 127)``.
    - **NVFP4** (``global_scale`` given): one E4M3 scale per block of 16 weights along K and an
      FP32 scale per output row (the tensor's global scale, repeated for its rows, so that fused
      projections keep theirs): ``w[n, k] = (e2m1(code[n, k]) * e4m3(scale[n, k // 16])) *
      global_scale[n]``.

    Fields:

    - ``data``: uint8 ``[.., N, K / 2]``: byte j of a row holds column 2j in its low nibble and
      column 2j + 1 in its high nibble. An int8 array (safetensors ``I8``, as released) is
      viewed as its bytes.
    - ``scale``: uint8 ``[.., N, ceil(K / B)]`` (B = 32 or 16), the scale codes unchanged (a
      ``float8_e8m0fnu`` / ``float8_e4m3fn`` array is viewed as its bytes). The last block of a
      row may be partial. MXFP4: code 0xFF (NaN) and codes above ``E8M0_MAX_CODE`` (252: a
      weight of 6 times the scale would overflow FP32) are refused; NVFP4: the NaN codes 0x7F /
      0xFF are refused.
    - ``global_scale``: None (MXFP4), or float32 ``[.., N]`` (NVFP4; a single value, shape
      ``[]`` or ``[1]``, is repeated for every row of a 2-D weight), finite and at most
      ``NVFP4_GLOBAL_MAX`` in magnitude.

    K is even (two codes a byte): ``K = 2 * data.shape[-1]``. The dequantized weight
    (:meth:`dequantize`, the reference every backend follows) is exact in FP32 for MXFP4 (an
    E2M1 value has two significant bits and its scale is a power of two, 2^-128 .. 1.5 * 2^127)
    and, for NVFP4, the exact product ``e2m1 * e4m3`` (at most 6 significant bits) rounded once
    by the row scale: exact when that is a power of two.

    Invalid fields raise ``TypeError`` (dtype) or ``ValueError`` (shape, values) naming the
    field, what was expected and what was given.
    """

    data: np.ndarray
    scale: np.ndarray
    global_scale: np.ndarray | None = None

    def __post_init__(self) -> None:
        data, scale, g = self.data, self.scale, self.global_scale
        if not isinstance(data, np.ndarray):
            raise TypeError(f"data: expected a NumPy array of packed E2M1 codes (uint8 or int8), "
                            f"got {type(data).__name__}")
        if data.dtype == np.int8:
            data = data.view(np.uint8)
        elif data.dtype != np.uint8:
            raise TypeError(f"data: expected dtype uint8 or int8 (two E2M1 codes a byte), got {data.dtype.name}")
        if data.ndim not in _NDIMS:
            raise ValueError(f"data: expected [N, K / 2] or stacked experts [E, N, K / 2], "
                             f"got shape {_dims(data.shape)}")
        nv = g is not None
        code_dtype, codes = (_fp8_dtype(), "E4M3") if nv else (_fp4_dtypes(), "E8M0")
        if not isinstance(scale, np.ndarray):
            raise TypeError(f"scale: expected a NumPy array of {codes} codes, got {type(scale).__name__}")
        if scale.dtype == code_dtype:
            scale = scale.view(np.uint8)
        elif scale.dtype != np.uint8:
            raise TypeError(f"scale: expected dtype uint8 or {code_dtype.name} ({codes} codes), got {scale.dtype.name}")
        *lead, N, half = data.shape
        K = 2 * half
        B = NVFP4_BLOCK if nv else FP4_BLOCK
        want = (*lead, N, -(-K // B))
        if scale.shape != want:
            raise ValueError(f"scale: expected shape {_dims(want)} (one per {B} weights along K) for "
                             f"data {_dims(data.shape)} (K = {K}), got {_dims(scale.shape)}")
        scale = np.ascontiguousarray(scale)
        if nv:
            if not isinstance(g, np.ndarray):
                raise TypeError(f"global_scale: expected a NumPy array (float32 [.., N]) or None, got {type(g).__name__}")
            if g.dtype.name not in ("float32", "bfloat16", "float16"):
                raise TypeError(f"global_scale: expected dtype float32, got {g.dtype.name}")
            if g.size == 1 and not lead and g.ndim <= 1:
                g = np.full((N,), g.reshape(()), np.float32)
            if g.shape != (*lead, N):
                raise ValueError(f"global_scale: expected shape {_dims((*lead, N))} (one per output row; a single "
                                 f"value for a [N, K] weight), got {_dims(g.shape)}")
            g = np.ascontiguousarray(g, dtype=np.float32)
            with np.errstate(invalid="ignore"):
                bad = ~(np.abs(g) <= NVFP4_GLOBAL_MAX)
            if bad.any():
                at = tuple(int(j) for j in np.argwhere(bad)[0])
                raise ValueError(f"global_scale: expected finite values of magnitude at most {NVFP4_GLOBAL_MAX:.4g} "
                                 f"(6 * 448 times it must stay finite in FP32), got {float(g[at])!r} at {at}")
            nan = (scale & 0x7F) == 0x7F
            if nan.any():
                at = tuple(int(j) for j in np.argwhere(nan)[0])
                raise ValueError(f"scale: expected finite E4M3 codes, got {int(np.count_nonzero(nan))} NaN code(s) "
                                 f"0x7F / 0xFF (first at {at})")
        else:
            nan, big, at = bad_e8m0(scale)
            if nan:
                raise ValueError(f"scale: expected E8M0 codes 0..{E8M0_MAX_CODE}, got {nan} NaN code(s) 0xFF "
                                 f"(first at {at})")
            if big:
                raise ValueError(f"scale: expected E8M0 codes 0..{E8M0_MAX_CODE}, got {big} above (6 times "
                                 f"2^(code - 127) must stay finite in FP32; first {int(scale[at])} at {at})")
        object.__setattr__(self, "data", data)
        object.__setattr__(self, "scale", scale)
        object.__setattr__(self, "global_scale", g)

    # -- what it is ----------------------------------------------------------------------
    @property
    def fmt(self) -> str:
        """"mxfp4" (E8M0 per 32) or "nvfp4" (E4M3 per 16 and an FP32 row scale)."""
        return "mxfp4" if self.global_scale is None else "nvfp4"

    @property
    def block(self) -> int:
        """Weights per scale along K: 32 (MXFP4) or 16 (NVFP4)."""
        return FP4_BLOCK if self.global_scale is None else NVFP4_BLOCK

    @property
    def shape(self) -> tuple[int, ...]:
        """The weight's shape, ``[N, K]`` or ``[E, N, K]`` (K = 2 * data.shape[-1])."""
        *lead, N, half = self.data.shape
        return tuple(int(s) for s in lead) + (int(N), 2 * int(half))

    @property
    def ndim(self) -> int:
        return self.data.ndim

    @property
    def nbytes(self) -> int:
        """Bytes held: half a byte per weight plus one per scale block (and 4 per row for NVFP4)."""
        return int(self.data.nbytes + self.scale.nbytes + (0 if self.global_scale is None else self.global_scale.nbytes))

    def __repr__(self) -> str:
        kind = f"E8M0 per {FP4_BLOCK}" if self.global_scale is None else f"NVFP4: E4M3 per {NVFP4_BLOCK}, FP32 per row"
        return f"Fp4Weight({_dims(self.shape)}, {kind}, {self.nbytes} bytes)"

    def scale_values(self) -> np.ndarray:
        """float32 ``[.., N, ceil(K / B)]``: 2^(code - 127) per block (MXFP4), or e4m3(code) (NVFP4)."""
        return (e8m0_table() if self.global_scale is None else e4m3_table())[self.scale]

    def dequantize(self) -> np.ndarray:
        """float32 ``[.., N, K]`` (the reference): MXFP4 ``e2m1(code) * 2^(scale - 127)``, exact;
        NVFP4 ``(e2m1(code) * e4m3(scale)) * global_scale[n]``, the product exact, then one rounding."""
        K = self.shape[-1]
        per = np.repeat(self.scale_values(), self.block, axis=-1)[..., :K]
        w = e2m1_table()[unpack_e2m1(self.data)] * per
        if self.global_scale is not None:
            w = w * self.global_scale[..., None]
        return w

    def _like(self, data: np.ndarray, scale: np.ndarray, g: np.ndarray | None) -> "Fp4Weight":
        return Fp4Weight(data, scale, g if self.global_scale is not None else None)

    # -- building ------------------------------------------------------------------------
    @classmethod
    def quantize(cls, w, fmt: str = "mxfp4") -> "Fp4Weight":
        """Quantize float weights ``[.., N, K]`` (K even), for tests and synthetic checkpoints.
        ``fmt="mxfp4"`` as DeepSeek-V4's are: per block of 32 along K the scale is the power of
        two 2^ceil(log2(amax / 6)) (2^0 for an all-zero block). ``fmt="nvfp4"``: the row scale
        is the matrix's power of two 2^ceil(log2(amax / (6 * 448))) (one per expert), each
        16-weight block's E4M3 scale ``amax / 6`` over it rounded up to an E4M3 value. Codes are
        rounded to the nearest E2M1 value of ``w / scale`` (ties to even, through ml_dtypes)."""
        import ml_dtypes

        if fmt not in ("mxfp4", "nvfp4"):
            raise ValueError(f"fmt: expected 'mxfp4' or 'nvfp4', got {fmt!r}")
        w = np.asarray(w, dtype=np.float32)
        if w.ndim not in _NDIMS:
            raise ValueError(f"w: expected [N, K] or [E, N, K], got shape {_dims(w.shape)}")
        if w.shape[-1] % 2:
            raise ValueError(f"w: expected an even K (two codes a byte), got shape {_dims(w.shape)}")
        if not np.isfinite(w).all():
            raise ValueError("w: expected finite values")
        *lead, N, K = w.shape
        B = FP4_BLOCK if fmt == "mxfp4" else NVFP4_BLOCK
        kb = -(-K // B)
        padded = np.zeros((*lead, N, kb * B), np.float32)
        padded[..., :K] = np.abs(w)
        amax = padded.reshape(*lead, N, kb, B).max(axis=-1)                              # [.., N, kb]
        if fmt == "mxfp4":
            with np.errstate(divide="ignore"):
                e = np.where(amax > 0, np.ceil(np.log2(amax / np.float32(E2M1_MAX))), 0.0)
            code = np.clip(e + 127, 0, E8M0_MAX_CODE).astype(np.uint8)
            g = None
            per = np.repeat(e8m0_table()[code], B, axis=-1)[..., :K]
        else:
            tmax = amax.max(axis=(-2, -1), keepdims=True)                                  # [.., 1, 1]
            with np.errstate(divide="ignore"):
                ge = np.where(tmax > 0, np.ceil(np.log2(tmax / np.float32(E2M1_MAX * E4M3_MAX))), 0.0)
            gv = np.exp2(ge).astype(np.float32)
            sv = np.where(amax > 0, amax / np.float32(E2M1_MAX) / gv, 1.0)
            s = np.clip(sv, 2.0 ** -9, E4M3_MAX).astype(_fp8_dtype())
            code = s.view(np.uint8)
            g = np.broadcast_to(gv[..., 0], (*lead, N)).astype(np.float32)
            per = np.repeat(s.astype(np.float32), B, axis=-1)[..., :K] * gv
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.clip(np.where(per > 0, w / per, 0), -E2M1_MAX, E2M1_MAX)
        q = q.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0x0F
        return cls(pack_e2m1(q), code, g)

    @classmethod
    def concat(cls, parts: Sequence["Fp4Weight"]) -> "Fp4Weight":
        """Weights ``[N_i, K]`` of one scale kind joined along N (gate/up, q/k/v): the scales are
        per row, so rows and scales concatenate as they are."""
        parts = _matrices(parts, cls)
        for i, p in enumerate(parts):
            if p.shape[1] != parts[0].shape[1]:
                raise ValueError(f"parts[{i}]: expected [*, {parts[0].shape[1]}], got {_dims(p.shape)}")
            if p.fmt != parts[0].fmt:
                raise ValueError(f"parts[{i}]: expected {parts[0].fmt}, got {p.fmt}")
        g = None if parts[0].global_scale is None else np.concatenate([p.global_scale for p in parts])
        return cls(np.concatenate([p.data for p in parts]), np.concatenate([p.scale for p in parts]), g)

    @classmethod
    def stack(cls, parts: Sequence["Fp4Weight"]) -> "Fp4Weight":
        """Experts ``[N, K]`` of one shape and scale kind -> ``[E, N, K]``."""
        parts = _matrices(parts, cls)
        for i, p in enumerate(parts):
            if p.shape != parts[0].shape:
                raise ValueError(f"parts[{i}]: expected {_dims(parts[0].shape)}, got {_dims(p.shape)}")
            if p.fmt != parts[0].fmt:
                raise ValueError(f"parts[{i}]: expected {parts[0].fmt}, got {p.fmt}")
        g = None if parts[0].global_scale is None else np.stack([p.global_scale for p in parts])
        return cls(np.stack([p.data for p in parts]), np.stack([p.scale for p in parts]), g)

    def join_rows(self, other: "Fp4Weight") -> "Fp4Weight":
        """Stacked experts ``[E, N1, K]`` and ``[E, N2, K]`` -> ``[E, N1 + N2, K]`` (each expert's
        gate rows over its up rows)."""
        if other.fmt != self.fmt:
            raise ValueError(f"other: expected {self.fmt}, got {other.fmt}")
        g = None if self.global_scale is None else np.concatenate([self.global_scale, other.global_scale], axis=-1)
        return Fp4Weight(np.concatenate([self.data, other.data], axis=-2),
                         np.concatenate([self.scale, other.scale], axis=-2), g)

    def expert(self, e: int) -> "Fp4Weight":
        """Expert ``e`` of a stacked weight ``[E, N, K]`` -> ``[N, K]``."""
        return self._like(self.data[e], self.scale[e], None if self.global_scale is None else self.global_scale[e])

    def rows(self, a: int, b: int) -> "Fp4Weight":
        """Rows ``a:b`` (of each expert, for ``[E, N, K]``); the scales are per row."""
        g = None if self.global_scale is None else self.global_scale[..., a:b]
        return self._like(self.data[..., a:b, :], self.scale[..., a:b, :], g)

    def cols(self, a: int, b: int) -> "Fp4Weight":
        """Columns ``a:b`` of K: whole scale blocks only (a must be a multiple of the block, 32
        or 16, b too unless it is K)."""
        K, B = self.shape[-1], self.block
        if a % B or (b % B and b != K) or not 0 <= a < b <= K:
            raise ValueError(f"cols: expected a range of whole {B}-weight scale blocks of K = {K}, got {a}:{b}")
        return self._like(self.data[..., a // 2: b // 2], self.scale[..., a // B: -(-b // B)], self.global_scale)


def rope_first_order(heads: int, D: int, R: int) -> tuple[np.ndarray, int]:
    """(order, unit) that moves the last ``R`` of each head's ``D`` dims first: the units of
    ``gcd(D, R)`` dims of ``heads`` heads of ``D`` (``take_units``' arguments)."""
    u = math.gcd(D, R)
    n, r = D // u, R // u
    per_head = np.concatenate([np.arange(n - r, n), np.arange(n - r)])
    return (np.arange(heads)[:, None] * n + per_head).ravel(), u


def take_units(w, axis: int, order: np.ndarray, unit: int):
    """``w`` (a dense ``[N, K]`` or ``[N]`` array, or an ``Fp8Weight``) with its rows
    (``axis`` 0) or columns (1) rearranged in units of ``unit`` (``Fp8Weight.take_units``)."""
    if isinstance(w, Fp8Weight):
        return w.take_units(axis, order, unit)
    if isinstance(w, Fp4Weight):
        raise TypeError("take_units: an FP4 weight's dims cannot be reordered at load (its scale blocks of 32 "
                        "hold packed pairs); expected FP8 or dense attention projections")
    idx = (np.asarray(order, np.int64)[:, None] * unit + np.arange(unit)).ravel()
    return np.take(w, idx, axis=axis)


#: the quantized weight types a backend's ``prepare_weight`` takes
QUANTIZED = (Fp8Weight, Fp4Weight)
