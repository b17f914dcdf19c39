"""The Numba CPU backend (``backend="cpu"``): the default without a GPU.

Weights stay in their checkpoint precision: ``prepare_weight`` keeps BF16 as
its 16-bit pattern (a contiguous ``uint16`` view, widened to FP32 inside the
kernels), FP32 as FP32, and an ``Fp8Weight`` as its bytes with factors derived
from its scales (``CpuFp8``, ``backends/cpu_fp8.py``), dequantized inside every
GEMV kernel (the ``*_fp8_kernel`` variants; docs/fp8.md). FP8 embedding tables
are refused (``mtp_input``): released checkpoints keep them BF16. On a CPU with AMX the BF16
GEMVs of ``linear``, ``mtp_input`` and the dense MLP, and an LM head asked for confidences, run
on the tiles from a copy of the weight in their layout, made on its first use
(``_weight_tiles``, ``cpu_kernels/amx_linear.py``). Activations are FP32 NumPy arrays, indices int32,
the KV cache FP32. Every launcher validates with the family's ``check_*``
(mtpkern.ops; once per argument signature, ``CpuBackend._check``), checks index
values in one Numba pass (``cpu_kernels/bounds.py``), brings its inputs to
C-contiguous FP32, allocates the outputs
(or takes them, as the other backends do, from keyword-only ``out=`` buffers:
``ids=`` / ``weights=`` for ``moe_router``) and calls one njit kernel from
``cpu_kernels``. Kernels compile on first use (a few seconds to half a minute
each on 2 cores; docs/cpu.md, "Compilation and cache") and are cached on disk;
nothing compiles at import. Numba's cache is keyed per source file: a kernel that inlines the
GEMV core of ``cpu_kernels/linear.py`` keeps its old copy when only that file
changes, so clear ``cpu_kernels/__pycache__/*.nb[ic]`` after editing it.
``warm_up`` compiles (or loads) every family up front, or only those a loaded
checkpoint runs (``needs``).

Threads: ``CpuBackend(threads=n)``; the default is ``default_threads()``
(docs/cpu.md has the measurements behind it). ``numba.set_num_threads`` is
thread-local (it governs the parallel regions launched from the thread that
called it), so every launcher applies the backend's count on the calling
thread: an engine calling from its own worker threads gets it too.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import numba
import numpy as np

from ..errors import NoAllowedToken, no_token_reason
from ..ops._check import dtype_name, expect_ndim, expect_shape
from ..ops.attention import check_paged_attention
from ..ops.kv_fp8 import check_scales, is_fp8
from ..ops.dsa import check_dsa_key_write, check_dsa_select, list_width
from ..ops.gate import check_sigmoid_gate
from ..ops.hc import check_hc_head, check_hc_post, check_hc_pre
from ..ops.linear import check_linear
from ..ops.lm_head import check_bitmask, check_id_map, check_topk, map_id_rows, map_ids
from ..ops.mla import check_index, check_mla_attention, check_mla_latent_write
from ..ops.mlp import act_params, check_swiglu_mlp
from ..ops.moe import RouterSpec, check_moe_experts, check_moe_router
from ..ops.norm import check_mtp_input, check_norm
from ..ops.rope_kv import check_qk_norm_rope_kv_write, check_rope_heads
from ..ops.sampling import check_keys
from ..quant import QUANTIZED, Fp4Weight, Fp8Weight, e4m3_table
from .base import Backend, all_fp8_or_none, check_kv_dtype, fp8_embedding_refused, unprepared_fp8
from .cpu_fp4 import CpuFp4
from .cpu_fp8 import CpuFp8
from .cpu_kernels import amx as amx_k
from .cpu_kernels import amx_linear as amx_linear_k
from .cpu_kernels import attention as attention_k
from .cpu_kernels import bounds as bounds_k
from .cpu_kernels import dsa as dsa_k
from .cpu_kernels import gate as gate_k
from .cpu_kernels import hc as hc_k
from .cpu_kernels import linear as linear_k
from .cpu_kernels import lm_head as lm_head_k
from .cpu_kernels import mla as mla_k
from .cpu_kernels import mlp as mlp_k
from .cpu_kernels import moe as moe_k
from .cpu_kernels import norm as norm_k
from .cpu_kernels import rope_kv as rope_kv_k
from .cpu_kernels import sampling as sampling_k
from .cpu_kernels import simd as simd_k

#: the stored forms of quantized weights: each one's ``kernel_args`` feeds the ``*_fp8_kernel`` variants
_QUANT = (CpuFp8, CpuFp4)
#: the gated kernels' ``act`` code of an activation (relu2 has kernels of its own)
_ACT_CODE = {"swiglu": mlp_k.ACT_SWIGLU, "situ": mlp_k.ACT_SITU, "relu2": -1}
#: mtp_input's flags when no row is flagged (the kernels test the length: one compiled form)
_NO_FLAGS = np.zeros(0, np.uint8)

#: from this many rows, FP32 weights go to OpenBLAS (x @ w.T): with the
#: thread-pool switch counted, [4096, 1024] n=512 took 25 ms against 70 ms, and
#: [4096, 4096] n=256 53 ms against 103 ms (2 cores); at n=128 it is a draw.
_BLAS_MIN_ROWS = 256

#: vocabulary chunks of lm_head_argmax: enough to balance any thread count
#: here; the result does not depend on it.
_ARGMAX_CHUNKS = 64


#: input rows from which a BF16 LM head argmax screens the vocabulary on AMX tiles where the
#: machine has them (``cpu_kernels/amx.py``, docs/cpu.md "The LM head's AMX screen"); below
#: it the FMA tiles alone are as fast (the head streams its weights at 1-3 rows)
AMX_MIN_ROWS = 4

_U16, _F32 = np.dtype(np.uint16), np.dtype(np.float32)

#: at most this many argument signatures are remembered as checked (then forgotten)
_MAX_SIGNATURES = 4096


def _act(a) -> np.ndarray:
    """Activations (any layout, any float dtype) -> C-contiguous FP32."""
    return np.ascontiguousarray(a, dtype=np.float32)


def _opt_vec(a) -> np.ndarray:
    """An optional FP32 vector; None -> empty (the kernels test ``shape[0] > 0``)."""
    return np.empty(0, np.float32) if a is None else _act(a)


def _opt_mat(a) -> np.ndarray:
    return np.empty((0, 0), np.float32) if a is None else _act(a)


#: an absent int32 row array (``row_start``): the kernels test ``shape[0] > 0``
_NO_ROWS = np.empty(0, np.int32)


def _weight(name: str, w) -> np.ndarray:
    """A weight in the stored form: BF16 bits (uint16) or FP32, C-contiguous.

    Raw ``ml_dtypes.bfloat16`` arrays are accepted too and viewed as their bits."""
    if type(w) is np.ndarray and (w.dtype is _U16 or w.dtype is _F32) and w.flags.c_contiguous:
        return w                                                             # the prepared form: no dtype.name
    dt = dtype_name(w)
    if dt == "bfloat16":
        return np.ascontiguousarray(w).view(np.uint16)
    if dt in ("uint16", "float32"):
        return np.ascontiguousarray(w)
    raise TypeError(f"{name}: expected a weight from prepare_weight (uint16 BF16 bits or float32) "
                    f"or bfloat16, got {dt}")


def _any_weight(name: str, w):
    """A stored weight of any kind: ``CpuFp8`` / ``CpuFp4`` as it is, else ``_weight``."""
    if isinstance(w, _QUANT):
        return w
    if isinstance(w, QUANTIZED):
        raise unprepared_fp8(name, w)
    return _weight(name, w)


#: the scales and E4M3 table the attention kernel takes beside FP32 caches (unread)
_NO_SCALES = np.zeros((0, 0, 0), np.float32)
_NO_TABLE = np.zeros(0, np.float32)


def _fp8_caches(k_cache, v_cache, k_scale, v_scale) -> bool:
    """Whether the caches hold FP8 codes (each beside its scale plane, checked: mtpkern.ops.kv_fp8)."""
    check_scales("k_scale", k_cache, k_scale)
    check_scales("v_scale", v_cache, v_scale)
    if is_fp8(k_cache) != is_fp8(v_cache):
        raise TypeError(f"v_cache: expected the key cache's kind ({dtype_name(k_cache)}), got {dtype_name(v_cache)}")
    return is_fp8(k_cache)


def _key_tiles(k_cache) -> np.ndarray | None:
    """The [NB, Hkv, D, BS] array behind a key cache from ``CpuBackend.empty_keys`` (a
    transposed view of it), or None for a C-contiguous [NB, BS, Hkv, D] cache (also when
    BS = 1, where the two layouts are one)."""
    if not isinstance(k_cache, np.ndarray) or k_cache.ndim != 4 or k_cache.flags.c_contiguous:
        return None
    tiles = k_cache.transpose(0, 2, 3, 1)
    return tiles if tiles.flags.c_contiguous and tiles.dtype == np.float32 else None


def _out(name: str, buf, shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
    """The caller's output buffer (checked: C-contiguous NumPy, this shape and dtype), or a new one."""
    if buf is None:
        return np.empty(shape, dtype)
    if not isinstance(buf, np.ndarray):
        raise TypeError(f"{name}: expected a NumPy array, got {type(buf).__name__}")
    if buf.shape != tuple(shape) or buf.dtype != dtype or not buf.flags.c_contiguous:
        raise ValueError(f"{name}: expected shape {list(shape)} {np.dtype(dtype).name} (C-contiguous), "
                         f"got {list(buf.shape)} {buf.dtype.name}")
    return buf


def _apart(a: np.ndarray, out: np.ndarray, same_ok: bool = False) -> np.ndarray:
    """``a``, or a copy of it when it may overlap ``out``: the kernels write ``out``
    while they still read their inputs. ``same_ok``: the kernel reads every element
    of ``a`` before it writes the same element of ``out``, so ``out`` exactly on top
    of ``a`` (same address, shape and strides) is safe; a shifted overlap is not."""
    if a.size == 0 or not np.may_share_memory(a, out):
        return a
    if same_ok and a.shape == out.shape and a.strides == out.strides and a.ctypes.data == out.ctypes.data:
        return a
    return a.copy()


def _in_range(name: str, a: np.ndarray, hi: int, lo: int = 0) -> None:
    """``a``: a C-contiguous integer array."""
    i = bounds_k.first_outside(a, lo, hi)
    if i >= 0:
        raise ValueError(f"{name}: expected values in [{lo}, {hi}), got {int(a.flat[i])}")


def _signature(a):
    if isinstance(a, np.ndarray):
        return a.shape, a.dtype
    if isinstance(a, _QUANT):                      # by shape: a signature must not keep a weight alive
        return type(a), a.shape
    return type(a), a                              # True == 1 and 2.0 == 2: the type keeps them apart


def _row_write_args(name: str, cache: Any, q: Any, out: Any, slots: Any) -> np.ndarray:
    """The checks a paged row write of one row per token shares (MLA's latent write, DSA's key
    write): ``cache`` a C-contiguous FP32 NumPy cache, ``out`` only beside ``q``, ``slots``
    in range -> the slots, contiguous."""
    if not (isinstance(cache, np.ndarray) and cache.dtype == np.float32 and cache.flags.c_contiguous):
        raise TypeError(f"{name}: expected a C-contiguous float32 NumPy cache (from empty_latent_kv), "
                        f"got {type(cache).__name__} {dtype_name(cache)}")
    if q is None and out is not None:
        raise TypeError("out: the roped query's buffer needs q (no q: nothing is returned)")
    slots = np.ascontiguousarray(slots)
    _in_range("slots", slots, cache.shape[0] * cache.shape[1])
    return slots


def default_threads() -> int:
    """The thread count of ``CpuBackend()``: half the cores Numba may use, at least 1.

    With every core, one other busy process made each parallel region wait for a
    descheduled worker: on 2 cores the ``small`` propose went from 7 to 40-50 ms (p99 9 to
    250-290 ms), where 1 thread stayed at 13 ms (p99 21-26 ms; docs/cpu.md, "Threads").
    An engine has threads of its own; one that owns the cores passes ``threads=``."""
    return max(1, numba.config.NUMBA_NUM_THREADS // 2)


def check_threads(threads) -> int:
    """A thread count for the cpu backend: an int in 1 .. NUMBA_NUM_THREADS."""
    limit = numba.config.NUMBA_NUM_THREADS
    if isinstance(threads, bool) or not isinstance(threads, (int, np.integer)):
        raise TypeError(f"threads: expected an int (1 .. {limit}) or None, got {threads!r}")
    if not 1 <= threads <= limit:
        raise ValueError(f"threads: expected 1 .. {limit} (Numba's pool, NUMBA_NUM_THREADS), got {threads}")
    return int(threads)


class CpuBackend(Backend):
    """``threads``: Numba threads per kernel launch (None: ``default_threads()``);
    ``kv_dtype``: "float32" (default) or "fp8" (E4M3 codes, one FP32 scale per row and KV head;
    the attention reads one byte per element: mtpkern.ops.kv_fp8, docs/kv_pool.md)."""

    name = "cpu"
    kv_dtype = np.float32

    def __init__(self, threads: int | None = None, kv_dtype: str = "float32") -> None:
        self.kv_fp8 = check_kv_dtype(kv_dtype, ("float32", "fp8"), self.name) == "fp8"
        self.kv_dtype = np.uint8 if self.kv_fp8 else np.float32
        self.threads = default_threads() if threads is None else check_threads(threads)
        #: argument signatures (shapes, dtypes, other arguments) that passed a family's
        #: check: the checks read nothing else, and NumPy's ``dtype.name`` alone costs
        #: ~5 us a call (the checks of one module's ops took ~100 us at n = 1)
        self._passed: set = set()
        #: the BF16 LM heads' row norms (the AMX screen's and the tiled confidences' bounds) and
        #: the BF16 weights' AMX tile copies (``_tiled_gemv``), each kept while its weight lives
        #: (``_derived``: keyed on the array owning the weight, dropped with it)
        self._norms: dict = {}
        self._tiles: dict = {}

    def _use_threads(self) -> None:
        """Apply ``threads`` to the calling thread (Numba's count is thread-local; ~0.5 us to read)."""
        if numba.get_num_threads() != self.threads:
            numba.set_num_threads(self.threads)

    def warm_up(self, progress: Callable[[int, int, str], None] | None = None, *, fp8: bool = True,
                needs=None) -> int:
        """Compile, or load from Numba's disk cache, the kernels a propose uses, on tiny inputs
        (``backends/warm_up.py``): every family and weight kind (FP8 too unless ``fp8=False``),
        or only what ``needs`` names (a ``KernelNeeds``; ``KernelNeeds.of(proposer)``: what a
        loaded checkpoint runs). ``progress(done, total, name)`` is called before each family
        and once at the end (``done == total``, ``name == ""``). Returns how many functions
        Numba compiled (0: everything came from the cache or was loaded already)."""
        from numba.core import event

        from .warm_up import family_calls

        calls = family_calls(self, fp8=fp8, needs=needs)
        with event.install_recorder("numba:compile") as rec:
            for i, (name, call) in enumerate(calls):
                if progress is not None:
                    progress(i, len(calls), name)
                call()
        if progress is not None:
            progress(len(calls), len(calls), "")
        return sum(1 for _, ev in rec.buffer if ev.is_start)

    def _check(self, check, *args) -> None:
        """``check(*args)``, unless arguments of this signature passed it before."""
        key = (check, *map(_signature, args))
        try:
            if key in self._passed:
                return
        except (TypeError, ValueError):                                      # unhashable: check every time
            check(*args)
            return
        check(*args)
        if len(self._passed) >= _MAX_SIGNATURES:
            self._passed.clear()
        self._passed.add(key)

    # -- memory -------------------------------------------------------------
    def prepare_weight(self, w):
        """BF16 -> its bits as a contiguous uint16 array (still 2 bytes a value);
        FP32 -> contiguous FP32; ``Fp8Weight`` -> ``CpuFp8`` (1 byte a value; raises
        ``ValueError`` for a scale of 2^64 or more); ``Fp4Weight`` -> ``CpuFp4`` (half a byte)."""
        if isinstance(w, Fp8Weight):
            return CpuFp8.from_weight(w)
        if isinstance(w, Fp4Weight):
            return CpuFp4.from_weight(w)
        w = np.asarray(w)
        if dtype_name(w) not in ("bfloat16", "float32"):
            raise TypeError(f"w: expected dtype bfloat16 or float32, got {dtype_name(w)}")
        return _weight("w", w)

    def from_host(self, a):
        return np.ascontiguousarray(a)

    def to_host(self, a):
        return np.asarray(a)

    def empty_kv(self, num_blocks, block_size, num_kv_heads, head_dim):
        return np.zeros((num_blocks, block_size, num_kv_heads, head_dim), self.kv_dtype)

    def empty_latent_kv(self, num_blocks, block_size, row_width):
        """FP32 whatever ``kv_dtype`` is: an FP8 latent cache is not implemented (the pools of
        MLA modules are refused with ``kv_dtype="fp8"``: ``kv.check_fp8_kv``)."""
        return np.zeros((num_blocks, block_size, row_width), np.float32)

    def empty_keys(self, num_blocks, block_size, num_kv_heads, head_dim):
        """Where ``block_size % 16 == 0``: the keys stored ``[NB, Hkv, D, BS]`` (a block's rows
        innermost: the attention's scores of 16 rows are vector FMAs, cpu_kernels/simd.py),
        returned as the ``[NB, BS, Hkv, D]`` view of that array; else ``empty_kv``'s (and for
        an FP8 cache: its codes are decoded a block at a time, cpu_kernels/attention.py)."""
        if block_size % simd_k.VL or self.kv_fp8:
            return self.empty_kv(num_blocks, block_size, num_kv_heads, head_dim)
        return np.zeros((num_blocks, num_kv_heads, head_dim, block_size), np.float32).transpose(0, 3, 1, 2)

    def copy_kv_rows(self, cache, src, dst):
        tiles = _key_tiles(cache)
        if tiles is None:
            return super().copy_kv_rows(cache, src, dst)
        BS = cache.shape[1]
        s, d = (np.asarray(a, np.int64) for a in (src, dst))
        tiles[d // BS, :, :, d % BS] = tiles[s // BS, :, :, s % BS]   # the right side is a copy

    def describe(self) -> str:
        kv = ", kv fp8" if self.kv_fp8 else ""
        return f"cpu (Numba {numba.__version__}, {self.threads} thread{'' if self.threads == 1 else 's'}{kv})"

    # -- norm ---------------------------------------------------------------
    def rmsnorm(self, x, w, eps: float, *, out=None):
        """x [..., H], w [H] -> [..., H] FP32."""
        if x.ndim < 1:
            raise ValueError(f"x: expected at least 1 dimension, got shape {list(x.shape)}")
        H = x.shape[-1]
        if w.shape != (H,):
            expect_shape("w", w, (H,))
        out = _out("out", out, tuple(x.shape))
        o = out.reshape(-1, H)
        self._use_threads()
        norm_k.rmsnorm_kernel(_apart(_act(x).reshape(-1, H), o, same_ok=True), _apart(_act(w), o),
                              np.float32(eps), o)
        return out

    def mtp_input(self, embed, tokens, g, enorm_w, hnorm_w, eh_w, eps: float, *, out=None, zero_embed=None):
        """``zero_embed``: None or [n] bool / int8 / uint8 flags (mtpkern.ops.norm.mtp_input)."""
        self._check(check_mtp_input, embed, tokens, g, enorm_w, hnorm_w, eh_w, zero_embed)
        V, H = embed.shape
        if tokens.dtype.kind not in "iu":
            raise TypeError(f"tokens: expected an integer dtype, got {dtype_name(tokens)}")
        tokens = np.ascontiguousarray(tokens, dtype=np.int64)
        _in_range("tokens", tokens, V)
        n = tokens.shape[0]
        flags = _NO_FLAGS if zero_embed is None else np.ascontiguousarray(zero_embed).view(np.uint8)
        e = np.empty((n, H), np.float32)                                     # scratch: normed embeddings
        h = np.empty((n, H), np.float32)                                     # scratch: normed hidden
        out = _out("out", out, (n, H))
        if isinstance(embed, _QUANT):
            raise fp8_embedding_refused("embed")
        eh_w = _any_weight("eh_w", eh_w)
        wt = self._weight_tiles(eh_w)
        if wt is not None:          # the two norms, then [e | h] @ eh_w.T on the AMX tiles
            self._use_threads()
            norm_k.input_norms(_weight("embed", embed), tokens, _act(g), _act(enorm_w), _act(hnorm_w),
                               np.float32(eps), e, h, flags)
            return self._tiled_gemv(np.concatenate([e, h], axis=1), wt, None, None, out)
        self._use_threads()
        kernel = norm_k.mtp_input_fp8_kernel if isinstance(eh_w, _QUANT) else norm_k.mtp_input_kernel
        kernel(_weight("embed", embed), tokens, _act(g), _act(enorm_w), _act(hnorm_w),
               eh_w.kernel_args() if isinstance(eh_w, _QUANT) else eh_w, np.float32(eps), e, h, out, flags)
        return out

    # -- linear -------------------------------------------------------------
    def linear(self, x, w, bias=None, residual=None, *, out=None, norm=None):
        return self._linear(x, w, bias, residual, out, norm, tiles=True)

    def _linear(self, x, w, bias, residual, out, norm, *, tiles: bool) -> np.ndarray:
        """``linear``; ``tiles``: a BF16 GEMV may run on the AMX tiles (``_tiled_gemv``) where
        they serve, else it runs on the FMA tiles."""
        self._check(check_linear, x, w, bias, residual)
        if norm is not None:        # the definition: the rmsnorm kernel, then the GEMV
            x = self.rmsnorm(x, *check_norm(norm, x.shape[1]))
        w = _any_weight("w", w)
        out = _out("out", out, (x.shape[0], w.shape[0]))
        x = _apart(_act(x), out)                                             # out is written while x is read
        bias = None if bias is None else _apart(_act(bias), out)
        residual = None if residual is None else _apart(_act(residual), out)  # out is written first
        if isinstance(w, _QUANT):
            self._use_threads()
            linear_k.linear_fp8_kernel(x, w.kernel_args(), _opt_vec(bias), _opt_mat(residual), out)
            return out
        if w.dtype == np.float32 and x.shape[0] >= _BLAS_MIN_ROWS:
            np.matmul(x, w.T, out=out)                                       # [n, N], BLAS
            if bias is not None:
                out += bias
            if residual is not None:
                out += residual
            return out
        wt = self._weight_tiles(w) if tiles else None
        if wt is not None:
            return self._tiled_gemv(x, wt, bias, residual, out)
        self._use_threads()
        linear_k.linear_kernel(x, w, _opt_vec(bias), _opt_mat(residual), out)
        return out

    # -- rope + kv write ----------------------------------------------------
    def qk_norm_rope_kv_write(self, qkv, num_q_heads: int, num_kv_heads: int, q_norm_w, k_norm_w,
                              eps: float, inv_freq, positions, k_cache, v_cache, slots, *,
                              interleave: bool = False, rope_scale: float = 1.0, v_is_k: bool = False, out=None,
                              k_scale=None, v_scale=None):
        """FP8 caches (uint8, with ``k_scale`` / ``v_scale``): the rows are computed apart in FP32,
        then quantized into their slots (``fp8_kv_write_kernel``, mtpkern.ops.kv_fp8)."""
        self._check(check_qk_norm_rope_kv_write, qkv, num_q_heads, num_kv_heads, q_norm_w, k_norm_w,
                    inv_freq, positions, k_cache, v_cache, slots, interleave, rope_scale, v_is_k)
        NB, BS, Hkv, D = k_cache.shape
        Dv = v_cache.shape[3]
        fp8 = _fp8_caches(k_cache, v_cache, k_scale, v_scale)
        tiles = None if fp8 else _key_tiles(k_cache)
        want = np.uint8 if fp8 else np.float32
        for name, c in (("k_cache", k_cache if tiles is None else tiles), ("v_cache", v_cache)):
            if not (isinstance(c, np.ndarray) and c.dtype == want and c.flags.c_contiguous):
                raise TypeError(f"{name}: expected a C-contiguous {np.dtype(want).name} NumPy cache (from empty_kv), "
                                f"got {type(c).__name__} {dtype_name(c)}")
        slots = np.ascontiguousarray(slots)
        _in_range("slots", slots, NB * BS)
        n = qkv.shape[0]
        q = _out("out", out, (n, num_q_heads, D))
        if fp8:
            k_rows, v_rows = np.empty((n, Hkv * D), np.float32), np.empty((n, Hkv * Dv), np.float32)
            rows = np.arange(n, dtype=slots.dtype)
        elif tiles is None:
            k_rows, v_rows, rows = k_cache.reshape(NB * BS, Hkv * D), v_cache.reshape(NB * BS, Hkv * Dv), slots
        else:   # transposed keys: the kernel writes the n new rows apart, then they go to their slots
            k_rows, v_rows = np.empty((n, Hkv * D), np.float32), np.empty((n, Hkv * Dv), np.float32)
            rows = np.arange(n, dtype=slots.dtype)
        self._use_threads()
        rope_kv_k.qk_norm_rope_kv_write_kernel(
            _apart(_act(qkv), q), num_q_heads, num_kv_heads, D, Dv, _opt_vec(q_norm_w), _opt_vec(k_norm_w),
            np.float32(eps), _act(inv_freq), np.ascontiguousarray(positions), k_rows, v_rows, rows,
            q.reshape(n, num_q_heads * D), bool(interleave), np.float32(rope_scale), bool(v_is_k))
        if fp8:
            rope_kv_k.fp8_kv_write_kernel(k_rows, Hkv, D, k_cache.reshape(NB * BS, Hkv * D),
                                          k_scale.reshape(NB * BS, Hkv), slots)
            rope_kv_k.fp8_kv_write_kernel(v_rows, Hkv, Dv, v_cache.reshape(NB * BS, Hkv * Dv),
                                          v_scale.reshape(NB * BS, Hkv), slots)
        elif tiles is not None:
            tiles[slots // BS, :, :, slots % BS] = k_rows.reshape(n, Hkv, D)
            v_cache.reshape(NB * BS, Hkv * Dv)[slots] = v_rows
        return q

    def rope_heads(self, x, positions, inv_freq, *, interleave: bool = False, rope_scale: float = 1.0,
                   inverse: bool = False, out=None):
        """-> [n, heads, D] FP32; x FP32 or BF16 (widened first)."""
        self._check(check_rope_heads, x, positions, inv_freq, interleave, rope_scale, inverse)
        n, heads, D = x.shape
        out = _out("out", out, (n, heads, D))
        self._use_threads()
        rope_kv_k.rope_heads_kernel(_apart(_act(x), out).reshape(n, heads * D), heads, D, _act(inv_freq),
                                    np.ascontiguousarray(positions), out.reshape(n, heads * D), bool(interleave),
                                    np.float32(rope_scale), bool(inverse))
        return out

    # -- attention ----------------------------------------------------------
    def _attention_tasks(self) -> int:
        """Tasks a paged attention is cut into: (unit of one sequence's rows, chunk of its KV
        blocks), about 2 per thread (cpu_kernels/attention.py)."""
        return 2 * self.threads

    def paged_attention(self, q, k_cache, v_cache, block_tables, row_seq, row_len, scale: float, *,
                        row_start=None, sinks=None, out=None, k_scale=None, v_scale=None):
        """FP8 caches (uint8 codes, ``k_scale`` / ``v_scale``): one byte read per element, each
        block's visible rows decoded with their scales (cpu_kernels/attention.py, ``kv_block``)."""
        self._check(check_paged_attention, q, k_cache, v_cache, block_tables, row_seq, row_len, row_start, sinks)
        NB, BS, Hkv, D = k_cache.shape
        Dv = v_cache.shape[3]
        n, Hq, _ = q.shape
        fp8 = _fp8_caches(k_cache, v_cache, k_scale, v_scale)
        block_tables, row_seq, row_len, row_start = _checked_rows(block_tables, row_seq, row_len, row_start, BS, NB)
        out = _out("out", out, (n, Hq * Dv))
        self._use_threads()
        tiles = None if fp8 else _key_tiles(k_cache)
        if fp8:
            kc, vc = (np.ascontiguousarray(c) for c in (k_cache, v_cache))
            ks, vs, tab = (np.ascontiguousarray(a, np.float32) for a in (k_scale, v_scale, e4m3_table()))
        else:
            kc, vc = _act(k_cache) if tiles is None else tiles, _act(v_cache)
            ks = vs = _NO_SCALES
            tab = _NO_TABLE
        attention_k.paged_attention_kernel(_act(q), kc, vc, block_tables, row_seq, row_start, row_len,
                                           _opt_vec(sinks), np.float32(scale), self._attention_tasks(),
                                           out.reshape(n, Hq, Dv), tiles is not None, ks, vs, tab)
        return out

    # -- MLA ----------------------------------------------------------------
    def mla_latent_write(self, kv_a, kv_a_norm_w, eps: float, inv_freq, positions, latent_cache, slots, *,
                         q=None, interleave: bool = False, rope_scale: float = 1.0, out=None):
        self._check(check_mla_latent_write, kv_a, kv_a_norm_w, inv_freq, positions, latent_cache, slots,
                    interleave, rope_scale, q)
        NB, BS, W = latent_cache.shape
        slots = _row_write_args("latent_cache", latent_cache, q, out, slots)
        q_in = np.empty((0, 1, 1), np.float32) if q is None else _act(q)
        q_out = None if q is None else _out("out", out, tuple(q.shape))
        self._use_threads()
        mla_k.mla_latent_write_kernel(_act(kv_a), _act(kv_a_norm_w), np.float32(eps), _act(inv_freq),
                                      np.ascontiguousarray(positions), latent_cache.reshape(NB * BS, W), slots,
                                      bool(interleave), np.float32(rope_scale), q_in,
                                      q_in if q_out is None else q_out)
        return q_out

    def mla_attention_absorbed(self, q, w_uk, w_uv, latent_cache, block_tables, row_seq, row_len,
                               scale: float, *, row_start=None, index=None, out=None):
        """``index`` [n, T] int32 (DSA): each row attends to its listed rows only (mtpkern.ops.mla;
        ``cpu_kernels/mla.py``: their rows gathered, or the dense call where every row lists all)."""
        self._check(check_mla_attention, q, w_uk, w_uv, latent_cache, block_tables, row_seq, row_len, row_start)
        NB, BS, W = latent_cache.shape
        n, Hq, _ = q.shape
        Dv = w_uv.shape[1]
        w_uk, w_uv = _weight("w_uk", w_uk), _weight("w_uv", w_uv)
        if w_uk.dtype != w_uv.dtype:
            raise TypeError(f"w_uv: expected the dtype of w_uk ({w_uk.dtype.name}), got {w_uv.dtype.name}")
        starts = row_start
        block_tables, row_seq, row_len, row_start = _checked_rows(block_tables, row_seq, row_len, row_start, BS, NB)
        counts = None
        if index is not None:
            check_index(index, n, row_len, starts)            # its values: every call, not once per signature
            counts = _listed_counts(index, row_len, row_start)
        out = _out("out", out, (n, Hq * Dv))
        L = w_uk.shape[2]
        cache = _act(latent_cache).reshape(NB, BS, 1, W)
        q_full = np.empty((n, Hq, W), np.float32)
        o_lat = np.empty((n, Hq, L), np.float32)
        self._use_threads()
        mla_k.mla_absorb_kernel(_act(q), w_uk, q_full)
        if counts is not None:      # DSA: each row over its listed rows, gathered into a sequence of its own
            cache, block_tables, row_seq, row_start, row_len = _gather_listed(cache, block_tables, row_seq, index,
                                                                              counts)
        # the latent attention is paged attention with one KV head, keys the whole latent
        # rows [c | k_pe] and values their first L columns (c, o_lat's width): each latent
        # row read once per task for every head
        attention_k.paged_attention_kernel(q_full, cache, cache, block_tables, row_seq, row_start,
                                           row_len, np.empty(0, np.float32), np.float32(scale),
                                           self._attention_tasks(), o_lat, False, _NO_SCALES, _NO_SCALES,
                                           _NO_TABLE)
        mla_k.mla_out_kernel(o_lat, w_uv, out.reshape(n, Hq, Dv))
        return out

    # -- DSA ----------------------------------------------------------------
    def dsa_key_write(self, k, k_norm_w, k_norm_b, eps: float, inv_freq, positions, index_cache, slots, *,
                      q=None, interleave: bool = False, rope_scale: float = 1.0, out=None, gate=None):
        self._check(check_dsa_key_write, k, k_norm_w, k_norm_b, inv_freq, positions, index_cache, slots,
                    interleave, rope_scale, q, gate)
        NB, BS, W = index_cache.shape
        Di = k.shape[1]
        slots = _row_write_args("index_cache", index_cache, q, out, slots)
        q_out = None if q is None else _out("out", out, tuple(q.shape))
        q_in = np.empty((0, 1, 1), np.float32) if q is None else _apart(_act(q), q_out, same_ok=True)
        rows = index_cache.reshape(NB * BS, W)
        self._use_threads()
        dsa_k.dsa_key_write_kernel(_act(k), _act(k_norm_w), _act(k_norm_b), np.float32(eps), _act(inv_freq),
                                   np.ascontiguousarray(positions), rows[:, :Di], slots,
                                   bool(interleave), np.float32(rope_scale), q_in, q_in if q_out is None else q_out)
        if gate is not None:             # a pooled indexer's gate scores after the key; a later duplicate wins
            last = len(slots) - 1 - np.unique(slots[::-1], return_index=True)[1]
            rows[slots[last], Di:] = _act(gate)[last].astype(index_cache.dtype)
        return q_out

    def dsa_select(self, q, weights, index_cache, block_tables, row_seq, row_len, topk: int, scale: float, *,
                   row_start=None, out=None, kpool: int = 0, ape=None, tail: bool = True):
        self._check(check_dsa_select, q, weights, index_cache, block_tables, row_seq, row_len, topk, row_start,
                    kpool, ape, tail)
        NB, BS, Di = index_cache.shape
        n = q.shape[0]
        block_tables, row_seq, row_len, row_start = _checked_rows(block_tables, row_seq, row_len, row_start, BS, NB)
        out = _out("out", out, (n, list_width(topk, kpool, tail)), np.int32)
        wts = _act(weights) * np.float32(scale)                              # [n, Hi], as the reference rounds it
        self._use_threads()
        if kpool:                        # pools of kpool rows: their pooled keys, then the best pools
            dsa_k.dsa_select_pools_kernel(_act(q), wts, _act(index_cache), block_tables, row_seq, row_len,
                                          int(topk), _act(ape), bool(tail), out)
            return out
        dsa_k.dsa_select_kernel(_act(q), wts, _act(index_cache), block_tables, row_seq, row_start, row_len,
                                int(topk), out)
        return out

    # -- gate ---------------------------------------------------------------
    def sigmoid_gate(self, x, gate, residual=None, *, out=None):
        self._check(check_sigmoid_gate, x, gate, residual)
        out = _out("out", out, tuple(x.shape))
        # each element of x and residual is read just before the same element of out is
        # written (same_ok); a strided gate (a column slice of a fused projection) is copied:
        # n * G floats
        self._use_threads()
        gate_k.sigmoid_gate_kernel(_apart(_act(x), out, same_ok=True), _apart(_act(gate), out),
                                   _apart(_opt_mat(residual), out, same_ok=True), out)
        return out

    # -- moe ----------------------------------------------------------------
    def moe_router(self, x, gate_w, bias, spec: RouterSpec, *, ids=None, weights=None, norm=None):
        self._check(check_moe_router, x, gate_w, bias, spec)
        if norm is not None:        # the definition: the rmsnorm kernel, then the router
            x = self.rmsnorm(x, *check_norm(norm, x.shape[1]))
        n, E = x.shape[0], gate_w.shape[0]
        logits = np.empty((n, E), np.float32)                                # scratch
        ids = _out("ids", ids, (n, spec.top_k), np.int32)
        weights = _out("weights", weights, (n, spec.top_k))
        gate_w = _any_weight("gate_w", gate_w)
        self._use_threads()
        kernel, gate = ((moe_k.moe_router_fp8_kernel, gate_w.kernel_args()) if isinstance(gate_w, _QUANT)
                        else (moe_k.moe_router_kernel, gate_w))
        kernel(_act(x), gate, _act(bias), spec.n_group, spec.topk_group, spec.scoring_code,
               spec.norm_topk_prob, np.float32(spec.routed_scaling_factor), logits, ids, weights)
        return ids, weights

    def moe_experts(self, x, ids, weights, w13, w2, residual=None, *, out=None, limit=None, clamp_gate=False,
                    norm=None, activation="swiglu", situ_beta=0.0, situ_linear_beta=0.0):
        self._check(check_moe_experts, x, ids, weights, w13, w2, residual, activation)
        L, Lg = act_params(activation, limit, clamp_gate, situ_beta, situ_linear_beta)
        code = _ACT_CODE.get(activation)
        if norm is not None:        # the definition: the rmsnorm kernel, then the experts
            x = self.rmsnorm(x, *check_norm(norm, x.shape[1]))
        ids = np.ascontiguousarray(ids)
        _in_range("ids", ids, w13.shape[0], lo=-1)      # -1: an empty slot (ops.moe)
        out = _out("out", out, tuple(x.shape))
        # x is gathered before out is written; residual and weights are read row by row with it
        w13, w2 = _any_weight("w13", w13), _any_weight("w2", w2)
        fp8 = all_fp8_or_none("w13, w2", isinstance(w13, _QUANT), isinstance(w2, _QUANT))
        if fp8:
            w13, w2 = w13.kernel_args(), w2.kernel_args()
        self._use_threads()
        args = (_act(x), ids, _apart(_act(weights), out), w13, w2, _apart(_opt_mat(residual), out, same_ok=True))
        if activation == "relu2":
            (mlp_k.grouped_relu2_fp8_kernel if fp8 else mlp_k.grouped_relu2_kernel)(*args, out)
        else:
            (mlp_k.grouped_swiglu_fp8_kernel if fp8 else mlp_k.grouped_swiglu_kernel)(*args, code, L, Lg, out)
        return out

    # -- mlp ----------------------------------------------------------------
    def swiglu_mlp(self, x, w13, w2, residual=None, *, out=None, limit=None, clamp_gate=False, norm=None,
                   activation="swiglu", situ_beta=0.0, situ_linear_beta=0.0):
        self._check(check_swiglu_mlp, x, w13, w2, residual, activation)
        L, Lg = act_params(activation, limit, clamp_gate, situ_beta, situ_linear_beta)
        code = _ACT_CODE.get(activation)
        if norm is not None:        # the definition: the rmsnorm kernel, then the MLP
            x = self.rmsnorm(x, *check_norm(norm, x.shape[1]))
        n = x.shape[0]
        out = _out("out", out, tuple(x.shape))
        # the dense MLP is one expert (0) chosen by every row with weight 1.0
        w13, w2 = _any_weight("w13", w13), _any_weight("w2", w2)
        if all_fp8_or_none("w13, w2", isinstance(w13, _QUANT), isinstance(w2, _QUANT)):
            kernel, w13, w2 = mlp_k.grouped_swiglu_fp8_kernel, w13.as_experts(), w2.as_experts()
        elif activation == "relu2":
            kernel, w13, w2 = mlp_k.grouped_swiglu_kernel, w13[None], w2[None]
        elif (t13 := self._weight_tiles(w13)) is not None and (t2 := self._weight_tiles(w2)) is not None:
            gu = self._tiled_gemv(_act(x), t13, None, None, np.empty((n, w13.shape[0]), np.float32))
            act = np.empty((n, w2.shape[1]), np.float32)
            amx_linear_k.swiglu_rows(gu, code, L, Lg, act)
            return self._tiled_gemv(act, t2, None, _apart(_opt_mat(residual), out, same_ok=True), out)
        else:
            kernel, w13, w2 = mlp_k.grouped_swiglu_kernel, w13[None], w2[None]
        self._use_threads()
        args = (_act(x), np.zeros((n, 1), np.int32), np.ones((n, 1), np.float32), w13, w2,
                _apart(_opt_mat(residual), out, same_ok=True))
        if activation == "relu2":       # the dense MLP as one relu2 expert (FP8: the FP8 relu2 kernel)
            kernel = (mlp_k.grouped_relu2_fp8_kernel if kernel is mlp_k.grouped_swiglu_fp8_kernel
                      else mlp_k.grouped_relu2_kernel)
            kernel(*args, out)
        else:
            kernel(*args, code, L, Lg, out)
        return out

    # -- lm head ------------------------------------------------------------
    def lm_head_logits(self, x, w, *, out=None):
        """The logits [n, V], on the FMA tiles: ``lm_head_argmax``'s ids are their argmax, bit
        for bit (the AMX GEMV's logits differ from them by FP32 rounding)."""
        expect_ndim("x", x, 2)
        expect_shape("w", w, (None, x.shape[1]))
        return self._linear(x, w, None, None, out, None, tiles=False)

    def lm_head_argmax(self, x, w, bitmask=None, *, out=None, conf=None, id_map=None, best=None, sum_exp=None):
        """-> ids [n] int32; raises ``NoAllowedToken`` (see ops.lm_head); ``conf``: an FP32 [n]
        buffer for the drafts' confidences; ``id_map`` [V] int32: the ids mapped through it
        (a draft vocabulary's rows -> target ids); ``best`` / ``sum_exp`` (FP32 [n]): a
        vocabulary shard's partial result, rows without a candidate left at -1 (ops.lm_head)."""
        n, V, bitmask = _lm_head_args(x, w, bitmask, id_map)
        chunks = max(1, min(_ARGMAX_CHUNKS, V))
        ids = _out("out", out, (n,), np.int32)
        partial = best is not None or sum_exp is not None
        best = None if best is None else _out("best", best, (n,), np.float32)
        sum_exp = None if sum_exp is None else _out("sum_exp", sum_exp, (n,), np.float32)
        if conf is not None:
            cf = _out("conf", conf, (n,), np.float32)
        else:                                        # the sums ride on the confidence's pass
            cf = np.empty(n if sum_exp is not None else 0, np.float32)
        stats = np.empty((2 if partial else 0, n), np.float32)
        w = _any_weight("w", w)
        self._use_threads()
        if isinstance(w, _QUANT):
            none = lm_head_k.lm_head_argmax_fp8_kernel(_act(x), w.kernel_args(), bitmask, ids, cf, stats)
        else:       # on AMX: the screen for the ids alone, the tiled logits for the rest; else the FMA kernel
            x = _act(x)
            if conf is None and not partial:
                none = self._screened_argmax(x, w, bitmask, chunks, ids)
            else:
                none = self._tiled_argmax(x, w, bitmask, chunks, ids, cf, stats)
            if none is None:
                none = lm_head_k.lm_head_argmax_kernel(x, w, bitmask, chunks, ids, cf, stats)
        if none >= 0 and not partial:                                        # the first row left with -1
            raise NoAllowedToken(f"row {none}: {no_token_reason(bitmask.size > 0, V)}", row=none)
        if best is not None:
            best[:] = stats[0]
        if sum_exp is not None:
            sum_exp[:] = stats[1]
        if id_map is not None:
            ids[:] = map_ids(ids, id_map)
        return ids

    def _screened_argmax(self, x, w, bitmask, chunks: int, ids) -> int | None:
        """``lm_head_argmax_screened_kernel`` where it serves (``_screens``, no grammar mask):
        the first row without a token, or -1; None where it does not (the caller takes the FMA
        kernel). Masked calls take the FMA kernel: it reads only the rows a mask allows (8
        rows of [32768, 1024] with 1 % of the tokens allowed at random: 0.77-0.95 ms against
        0.98-1.08 screened), and at 50 % the two ran within this VM's noise."""
        n, K = x.shape
        if bitmask.size or not _screens(w, n):
            return None
        xb = np.empty((K // 2, n, 2), np.uint16)
        err = np.empty((n, 2), np.float64)
        if not amx_k.pack_bf16(x, xb, err):                 # a value that is not finite
            return None
        return lm_head_k.lm_head_argmax_screened_kernel(x, xb, err, w, self._row_norms(w), chunks,
                                                        amx_k.config(n), ids)

    def _tiled_argmax(self, x, w, bitmask, chunks: int, ids, conf, stats) -> int | None:
        """``lm_head_argmax_tiled_kernel`` for a call with confidences or a shard's sums (the
        screen's logits are too rough for them), without a grammar mask, where the AMX GEMV
        serves (``_weight_tiles``: a tile copy of the head is made on its first such call):
        the head's logits on the tiles at any row count (so a row's confidence does not depend
        on its batch), the ids the FMA kernel's bit for bit. None where it does not serve."""
        if bitmask.size:
            return None
        wt = self._weight_tiles(w)
        if wt is None:
            return None
        n, V = x.shape[0], w.shape[0]
        a = self._tiled_gemv(x, wt, None, None, np.empty((n, V), np.float32))
        err = np.empty((n, 2), np.float64)
        amx_linear_k.logit_bounds(x, err)
        return lm_head_k.lm_head_argmax_tiled_kernel(x, a, err, w, self._row_norms(w), chunks, ids, conf, stats)

    def _row_norms(self, w: np.ndarray) -> np.ndarray:
        """||w[j]||_2 of a BF16 head, computed once per weight array (``_derived``)."""
        def norms(w):
            out = np.empty(w.shape[0], np.float64)
            lm_head_k.row_norms_kernel(w, out)
            return out

        return _derived(self._norms, w, norms)

    def _weight_tiles(self, w) -> np.ndarray | None:
        """The AMX tile copy of a BF16 weight [N, K] (``amx_linear.repack``), made on its first
        GEMV and held while the weight lives (``_derived``); None where the tiles do not
        serve: not BF16 bits, or a machine or process without them (``amx.available``)."""
        if not (isinstance(w, np.ndarray) and w.dtype == _U16 and w.ndim == 2 and amx_k.available()):
            return None

        def tiles(w):
            N, K = w.shape
            wp = np.empty((-(-N // amx_linear_k.COLS), -(-K // amx_linear_k.STEP), 16, 32), np.uint16)
            amx_linear_k.repack(w, wp)
            return wp

        return _derived(self._tiles, w, tiles)

    def _tiled_gemv(self, x: np.ndarray, wt: np.ndarray, bias, residual, out: np.ndarray) -> np.ndarray:
        """out [n, N] = x [n, K] @ w.T (+ bias) (+ residual, which may be ``out`` itself) on the
        AMX tiles, wt = ``_weight_tiles(w)``: every input value split into three BF16 parts
        that sum to it (``amx_linear``), so the dots are FP32-accurate; a row's result depends
        on its own input row and the weights only."""
        n = x.shape[0]
        if n == 0:
            return out
        g = amx_linear_k.groups(n)[1]
        self._use_threads()
        amx_linear_k.amx_linear_kernel(x, g, wt, _opt_vec(bias), _opt_mat(residual), self.threads,
                                       amx_linear_k.config(g), out)
        return out

    def lm_head_topk(self, x, w, bitmask=None, k=1, *, id_map=None, out=None, probs=None, logits=None, check=True):
        """-> (ids [n, k] int32, probs [n, k] FP32): the logits (``lm_head_logits``), then each
        row's k best allowed tokens and their probabilities (ops.lm_head.masked_topk);
        ``out`` / ``probs`` / ``logits``, ``check``: as ``Backend.lm_head_topk``."""
        k = check_topk(k)
        logits = self.lm_head_logits(x, w, out=logits)
        n, V = logits.shape
        if id_map is not None:
            check_id_map(id_map, V)
        bitmask = _bitmask_arg(bitmask, n, V)
        ids = np.empty((n, k), np.int32) if out is None else out
        pr = np.empty((n, k), np.float32) if probs is None else probs
        self._use_threads()
        none = lm_head_k.masked_topk_kernel(logits, bitmask, ids, pr)
        if none >= 0 and check:
            raise NoAllowedToken(f"row {none}: {no_token_reason(bitmask.size > 0, V)}", row=none)
        if id_map is not None:
            ids[...] = map_id_rows(ids, id_map)
        return ids, pr

    samples = True

    def lm_head_sample(self, x, w, bitmask=None, *, keys, temperature, top_k, top_p, id_map=None, dist=None):
        """-> (ids [n] int32, probs [n] FP32): the logits (``lm_head_logits``), then each row's
        sampled draft and its probability (ops.sampling; cpu_kernels/sampling.py); ``dist``: an
        FP32 [n, V] buffer for the whole distribution."""
        n, V, bitmask = _lm_head_args(x, w, bitmask, id_map)
        keys = check_keys(keys, n)
        temperature = np.ascontiguousarray(temperature, np.float64)
        top_k = np.ascontiguousarray(top_k, np.int32)
        top_p = np.ascontiguousarray(top_p, np.float64)
        for nm, a in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p)):
            expect_shape(nm, a, (n,))
        q = np.empty((0, 0), np.float32) if dist is None else _out("dist", dist, (n, V), np.float32)
        logits = self.lm_head_logits(x, w)
        ids = np.empty(n, np.int32)
        probs = np.empty(n, np.float32)
        noise_ids = np.arange(V, dtype=np.int32) if id_map is None else np.ascontiguousarray(id_map)
        self._use_threads()
        none = sampling_k.sample_kernel(logits, bitmask, noise_ids, keys, temperature, top_k, top_p, ids, probs, q)
        if none >= 0:
            raise NoAllowedToken(f"row {none}: {no_token_reason(bitmask.size > 0, V)}", row=none)
        if id_map is not None:
            ids = map_ids(ids, id_map)
        return ids, probs

    # -- hyper-connections (mtpkern.ops.hc; cpu_kernels/hc.py) ----------------
    def hc_pre(self, X, mix, base, scale, hc_eps: float, iters: int, *, u=None, post=None, comb=None):
        """-> (u [n, H], post [n, m], comb [n, m, m]) FP32; X FP32 or BF16 (its bits read in place)."""
        self._check(check_hc_pre, X, mix, base, scale, hc_eps, iters)
        n, w = mix.shape
        m = round((w + 1) ** 0.5) - 1                                        # w = (2 + m) m
        outs = (_out("u", u, (n, X.shape[1] // m)), _out("post", post, (n, m)), _out("comb", comb, (n, m, m)))
        X, mix, base, scale = (_apart_all(a, outs) for a in (_streams(X), _act(mix), _act(base), _act(scale)))
        self._use_threads()
        hc_k.hc_pre_kernel(X, mix, base, scale, np.float32(hc_eps), int(iters), *outs)
        return outs

    def hc_post(self, f, X, post, comb, *, out=None):
        """-> [n, m H] FP32; f and X FP32 or BF16."""
        self._check(check_hc_post, f, X, post, comb)
        out = _out("out", out, tuple(X.shape))
        f, X, post, comb = (_apart_all(a, (out,)) for a in (_streams(f), _streams(X), _act(post), _act(comb)))
        self._use_threads()
        hc_k.hc_post_kernel(f, X, post, comb, out)
        return out

    def hc_head(self, X, mix, base, scale, hc_eps: float, *, out=None):
        """-> [n, H] FP32; X FP32 or BF16."""
        self._check(check_hc_head, X, mix, base, scale, hc_eps)
        n, m = mix.shape
        out = _out("out", out, (n, X.shape[1] // m))
        X, mix, base, scale = (_apart_all(a, (out,)) for a in (_streams(X), _act(mix), _act(base), _act(scale)))
        self._use_threads()
        hc_k.hc_head_kernel(X, mix, base, scale, np.float32(hc_eps), out)
        return out


def _derived(cache: dict, w: np.ndarray, make: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """``make(w)``, computed once per weight and kept in ``cache`` while the array owning w's
    memory lives, then dropped with it (a weak reference's callback: a tile copy is as large as
    its weight). The key is that owner and w's place in it (address, shape, strides), so a
    view made afresh on each call (a raw ``bfloat16`` array viewed as its bits) still hits, and
    slices of one weight get their own entries. A weight rewritten in place keeps what was
    derived from its first values: give the backend a new array for new weights (the
    proposer's never change)."""
    owner = w
    while isinstance(owner.base, np.ndarray):
        owner = owner.base
    key = (id(owner), w.__array_interface__["data"][0], w.shape, w.strides, w.dtype.str)
    hit = cache.get(key)
    if hit is not None and hit[0]() is owner:
        return hit[1]
    value = make(w)

    def drop(ref, key=key):
        if (entry := cache.get(key)) is not None and entry[0] is ref:
            cache.pop(key, None)

    cache[key] = (weakref.ref(owner, drop), value)
    return value


def _screens(w, n: int) -> bool:
    """Whether an LM head argmax of ``n`` input rows goes through the AMX screen
    (``lm_head_argmax_screened_kernel``): ``AMX_MIN_ROWS`` to ``amx.MAX_ROWS`` rows, BF16
    weights whose rows are a whole number of 32-column steps, on a machine and process that
    allow the tiles (``amx.available``; ``MTPKERN_CPU_AMX=0`` says no)."""
    return (AMX_MIN_ROWS <= n <= amx_k.MAX_ROWS and isinstance(w, np.ndarray) and w.dtype == _U16
            and w.shape[1] % amx_k.COLS_PER_STEP == 0 and amx_k.available())


def _lm_head_args(x, w, bitmask, id_map) -> tuple[int, int, np.ndarray]:
    """An LM-head call's checked arguments: x [n, H] against w [V, H], the id map's length,
    the grammar mask as the kernels read it (``_bitmask_arg``) -> (n, V, mask)."""
    expect_ndim("x", x, 2)
    expect_shape("w", w, (None, x.shape[1]))
    n, V = x.shape[0], w.shape[0]
    if id_map is not None:
        check_id_map(id_map, V)
    return n, V, _bitmask_arg(bitmask, n, V)


def _bitmask_arg(bitmask, n: int, V: int) -> np.ndarray:
    """A grammar mask as the LM-head kernels read it: checked [n, ceil(V / 32)] int32, or the
    empty array that allows every token."""
    if bitmask is None:
        return np.empty((0, 0), np.int32)
    check_bitmask(bitmask, n, V)
    return np.ascontiguousarray(bitmask)


def _listed_counts(index: np.ndarray, row_len: np.ndarray, row_start: np.ndarray) -> np.ndarray | None:
    """Each row's entries in a checked DSA ``index`` (before its first -1), int32; None when
    every row lists every row it sees (then the attention is the dense call itself)."""
    counts = np.count_nonzero(index >= 0, axis=1).astype(np.int32)
    seen = row_len if row_start.shape[0] == 0 else row_len - row_start
    return None if np.array_equal(counts, seen) else counts


def _gather_listed(cache: np.ndarray, block_tables, row_seq, index, counts: np.ndarray) -> tuple:
    """The latent rows each row lists, in list order, as a sequence of its own (blocks of
    ``mla_k.LISTED_BS`` rows; ``cpu_kernels/mla.py``): (cache [NBv, BS', 1, W], block_tables
    [n, max blocks], row_seq = arange(n), no row_start, row_len = counts) for the attention."""
    NB, BS, _, W = cache.shape
    n = counts.shape[0]
    VBS = mla_k.LISTED_BS
    nb = (counts + VBS - 1) // VBS                                        # [n] blocks of each row
    vbase = np.zeros(n, np.int32)
    np.cumsum(nb[:-1], out=vbase[1:])
    listed = np.empty((int(nb.sum()), VBS, W), np.float32)
    mla_k.gather_listed_kernel(cache.reshape(NB, BS, W), block_tables, row_seq, np.ascontiguousarray(index),
                               counts, np.repeat(np.arange(n, dtype=np.int32), nb), vbase, listed)
    b = np.arange(int(nb.max()), dtype=np.int32)
    tables = np.where(b < nb[:, None], vbase[:, None] + b, 0).astype(np.int32)   # past a row's blocks: unread
    return listed.reshape(-1, VBS, 1, W), tables, np.arange(n, dtype=np.int32), _NO_ROWS, counts


def _checked_rows(block_tables, row_seq, row_len, row_start, BS: int, NB: int) -> tuple:
    """The row index of a paged attention (dense or latent), contiguous and checked before a
    kernel reads through it: sequences in the table, lengths in [1, its capacity], windows
    inside the rows, every table entry a row will read a block of the cache. ``row_start``
    None -> the empty array the kernels read as "from row 0"."""
    S, max_blocks = block_tables.shape
    row_seq = np.ascontiguousarray(row_seq)
    row_len = np.ascontiguousarray(row_len)
    block_tables = np.ascontiguousarray(block_tables)
    _in_range("row_seq", row_seq, S)
    bad = bounds_k.first_outside(row_len, 1, 1 << 31)
    if bad >= 0:                                                         # the reference's message
        raise ValueError(f"row_len[{bad}]: expected >= 1, got {int(row_len[bad])}")
    _in_range("row_len", row_len, max_blocks * BS + 1, lo=1)
    if row_start is None:
        row_start = _NO_ROWS
    else:
        row_start = np.ascontiguousarray(row_start)
        bad = bounds_k.first_outside_each(row_start, row_len)
        if bad >= 0:                                                     # the reference's message
            raise ValueError(f"row_start[{bad}]: expected 0 <= row_start < row_len[{bad}] = "
                             f"{int(row_len[bad])}, got {int(row_start[bad])}")
    r, b = bounds_k.first_bad_table_entry(block_tables, row_seq, row_start, row_len, BS, NB)
    if r >= 0:                                                           # a block a row will read
        raise ValueError(f"block_tables (entries in use): expected values in [0, {NB}), "
                         f"got {int(block_tables[row_seq[r], b])}")
    return block_tables, row_seq, row_len, row_start


def _streams(a) -> np.ndarray:
    """Hyper-connection streams or a block output: BF16 (``ml_dtypes.bfloat16``) as its bits,
    which the kernels widen as they read them; any other float dtype as C-contiguous FP32."""
    if dtype_name(a) == "bfloat16":
        return np.ascontiguousarray(a).view(np.uint16)
    return _act(a)


def _apart_all(a: np.ndarray, outs: tuple) -> np.ndarray:
    """``a``, or a copy of it when it may overlap any of ``outs`` (``_apart``)."""
    for o in outs:
        a = _apart(a, o)
    return a
