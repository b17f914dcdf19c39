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
    - ``scale``: float32 (BF16 / FP16 scales are widened exactly):

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
        if scale.dtype.name not in ("float32", "bfloat16", "float16"):
            raise TypeError(f"scale: expected dtype float32 (bfloat16 / float16 widen exactly), "
                            f"got {scale.dtype.name}")
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

    @classmethod
    def stack(cls, parts: Sequence["Fp8Weight"]) -> "Fp8Weight":
        """Experts ``[N, K]`` of one shape, scale kind and block -> ``[E, N, K]``."""
        parts = _matrices(parts)
        for i, p in enumerate(parts):
            if p.shape != parts[0].shape or p.block != parts[0].block:
                raise ValueError(f"parts[{i}]: expected {_dims(parts[0].shape)} with block {parts[0].block}, "
                                 f"got {_dims(p.shape)} with block {p.block}")
        return cls(np.stack([p.data for p in parts]), np.stack([p.scale for p in parts]), parts[0].block)


def _matrices(parts: Sequence[Fp8Weight]) -> list[Fp8Weight]:
    """``parts`` as a list of at least one 2-D Fp8Weight (for concat and stack)."""
    parts = list(parts)
    if not parts:
        raise ValueError("parts: expected at least one Fp8Weight, got none")
    for i, p in enumerate(parts):
        if not isinstance(p, Fp8Weight):
            raise TypeError(f"parts[{i}]: expected an Fp8Weight, got {type(p).__name__}")
        if p.ndim != 2:
            raise ValueError(f"parts[{i}]: expected a weight [N, K], got {_dims(p.shape)}")
    return parts
