"""The backend interface: the ops of ``mtpkern.ops`` plus memory movement.

A backend is an object passed to the proposer (or chosen by
``backend="auto"``). Arrays it returns live where the backend computes (NumPy
for ``numpy`` and ``cpu``, CuPy for ``cuda``); the head and proposer never
look inside them except through ``to_host``.

Weights go through ``prepare_weight`` once at load time: the reference widens
them to FP32, the fast backends keep BF16 and widen inside their kernels. FP8
E4M3 weights come as ``mtpkern.quant.Fp8Weight`` (bytes + scales): the reference
dequantizes them to FP32, the fast backends keep one byte per weight and
dequantize inside their GEMV kernels (docs/fp8.md).
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import Any, Callable

import numpy as np

from ..ops.moe import RouterSpec
from ..quant import Fp8Weight


def on_cuda_device(x: Any) -> bool:
    """True for a GPU array: DLPack device CUDA / CUDA managed, or ``__cuda_array_interface__``
    (read guarded: PyTorch raises TypeError, not AttributeError, for a BF16 CUDA tensor's)."""
    from .dlpack import CUDA_DEVICES, device_of

    try:
        dev = device_of(x)
    except Exception:
        dev = None
    if dev is not None:
        return dev[0] in CUDA_DEVICES
    try:
        return getattr(x, "__cuda_array_interface__", None) is not None
    except Exception:
        return True


# -- FP8 weights: what every backend refuses, in the same words (docs/fp8.md) -----------------

def fp8_embedding_refused(name: str = "embed") -> TypeError:
    return TypeError(f"{name}: an FP8 embedding table is not supported (released FP8 checkpoints keep "
                     f"embed_tokens in BF16); load it as BF16 or FP32")


def unprepared_fp8(name: str, w: Any) -> TypeError:
    return TypeError(f"{name}: an {type(w).__name__} must go through prepare_weight first (got {w!r})")


def all_fp8_or_none(names: str, *fp8: bool) -> bool:
    """True when every weight of a pair (w13, w2) is FP8, False when none is; mixed raises."""
    if any(fp8) and not all(fp8):
        raise TypeError(f"{names}: expected all FP8 or none, got " + ", ".join("FP8" if f else "dense" for f in fp8))
    return all(fp8)


#: the ``kv_dtype`` names a backend may take (each backend says which of them it implements)
KV_DTYPES = ("float32", "bfloat16", "fp8")


def check_kv_dtype(kv_dtype: Any, allowed: tuple[str, ...], backend: str) -> str:
    """``kv_dtype`` as one of ``allowed`` (a name of ``KV_DTYPES``), or a ValueError naming the
    argument, what this backend takes and what was given."""
    if not isinstance(kv_dtype, str) or kv_dtype not in allowed:
        raise ValueError(f"kv_dtype: the {backend} backend takes "
                         f"{' or '.join(repr(a) for a in allowed)}, got {kv_dtype!r}")
    return kv_dtype


class Backend(ABC):
    name: str = "?"
    #: dtype of the paged KV cache (uint8 E4M3 codes when ``kv_fp8``)
    kv_dtype: Any = np.float32
    #: whether the KV caches hold FP8 E4M3 codes, one FP32 scale per (row, KV head) in a plane
    #: beside each (``kv_dtype="fp8"``; mtpkern.ops.kv_fp8, docs/kv_pool.md "FP8 KV cache")
    kv_fp8: bool = False
    #: array module of the backend's arrays (concatenate, slicing): numpy or cupy
    xp: Any = np
    #: whether ``norm=`` on linear / swiglu_mlp / moe_router / moe_experts costs nothing
    #: (fused into the kernel); where it does not, the head normalises once and passes the rows
    fuses_norm: bool = False

    # -- memory -------------------------------------------------------------
    @abstractmethod
    def prepare_weight(self, w: "np.ndarray | Fp8Weight") -> Any:
        """Host weight (BF16 or FP32 NumPy, or an ``Fp8Weight``, ``[N, K]`` or stacked
        experts ``[E, N, K]``) -> the backend's stored form."""

    def prepare_vector(self, w: np.ndarray) -> Any:
        """Host 1-D weight (norm weight, bias, router correction bias) -> FP32 backend array.

        Vectors are tiny, so every backend keeps them in FP32."""
        return self.from_host(np.ascontiguousarray(w, dtype=np.float32))

    @abstractmethod
    def from_host(self, a: np.ndarray) -> Any:
        """Host activations / indices -> backend array (same dtype)."""

    def ingest_float(self, name: str, x: Any) -> Any:
        """An engine's hidden states (BF16 or FP32, host or device) -> backend FP32 array.

        Host backends take NumPy arrays and anything NumPy reads through
        ``__array__`` / DLPack (host BF16 DLPack tensors too, e.g. CPU
        ``torch.bfloat16``); an array on a device (DLPack CUDA, ROCm, ...,
        ``__cuda_array_interface__``) is refused with a clear error
        (``dlpack.host_array``).
        """
        was_python = isinstance(x, (list, tuple, float))
        if not isinstance(x, np.ndarray):
            from .dlpack import host_array      # host DLPack (BF16 too); any other device refused

            try:
                x = host_array(name, x, f"the {self.name} backend computes on the host")
            except TypeError:
                raise
            except Exception as e:
                raise TypeError(f"{name}: expected an array of BF16 or FP32 values, got "
                                f"{type(x).__name__} ({e})") from None
        if x.dtype.name not in ("float32", "bfloat16"):
            raise TypeError(f"{name}: expected dtype float32 or bfloat16, got {x.dtype.name}"
                            + (" (NumPy reads Python floats as float64: pass np.asarray(values, np.float32))"
                               if was_python else ""))
        return self.from_host(np.ascontiguousarray(x, dtype=np.float32))

    @abstractmethod
    def to_host(self, a: Any) -> np.ndarray:
        """Backend array -> NumPy."""

    @abstractmethod
    def empty_kv(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> Any:
        """A zeroed ``[num_blocks, block_size, Hkv, D]`` cache in ``kv_dtype``."""

    def empty_keys(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> Any:
        """The key cache of a pool: ``empty_kv``'s, unless the backend keeps its keys in a
        layout of its own behind the same ``[num_blocks, block_size, Hkv, D]`` view (the cpu
        backend's rows-innermost blocks); its own ops, ``copy_kv_rows`` and ``kv_to_host``
        take it like any cache."""
        return self.empty_kv(num_blocks, block_size, num_kv_heads, head_dim)

    def copy_kv_rows(self, cache: Any, src: Any, dst: Any) -> None:
        """``cache`` [NB, BS, ...] (from ``empty_kv`` / ``empty_latent_kv``): the rows at slots
        ``dst`` (block * BS + offset) take the values of the rows at slots ``src`` (all read
        before any is written). ``src`` / ``dst``: host or device integer arrays."""
        xp = self.xp
        flat = cache.reshape((cache.shape[0] * cache.shape[1],) + tuple(cache.shape[2:]))
        if not xp.shares_memory(flat, cache):
            raise ValueError("cache: expected a contiguous KV cache (from empty_kv)")
        # xp.asarray, not np.asarray: CuPy refuses to turn a device array into a host one implicitly
        s, d = (xp.asarray(a).astype(np.int64, copy=False) for a in (src, dst))
        flat[d] = flat[s]

    def map_ids(self, table: Any, ids: Any, out: Any = None) -> Any:
        """``table[ids]`` element by element (int32 ``table`` [E], ``ids`` any shape of indices
        into it), into ``out`` when given: an expert-parallel rank's router ids mapped to its
        own experts (-1 for the others'). On cuda one elementwise kernel on the current stream
        (a captured step records it)."""
        r = self.xp.take(table, ids, out=out)
        return r if out is not None else r.astype(np.int32, copy=False)

    def empty_latent_kv(self, num_blocks: int, block_size: int, row_width: int) -> Any:
        """A zeroed ``[num_blocks, block_size, row_width]`` MLA latent cache in ``kv_dtype``
        (``row_width = kv_lora_rank + qk_rope_head_dim``; mtpkern.ops.mla)."""
        return self.empty_kv(num_blocks, block_size, 1, row_width).reshape(num_blocks, block_size, row_width)

    def empty_kv_scales(self, num_blocks: int, block_size: int, num_kv_heads: int) -> Any:
        """The zeroed FP32 ``[num_blocks, block_size, Hkv]`` scale plane of an FP8 cache (one
        scale per row and KV head); ``copy_kv_rows`` moves its rows like a cache's."""
        return self.from_host(np.zeros((num_blocks, block_size, num_kv_heads), np.float32))

    def kv_row_bytes(self, head_dim: int) -> int:
        """Bytes one row of one KV head takes in a cache of ``head_dim`` values: the values in
        ``kv_dtype``, and with an FP8 cache its FP32 scale (what an attention reads per row)."""
        return head_dim * np.dtype(self.kv_dtype).itemsize + (4 if self.kv_fp8 else 0)

    def kv_to_host(self, cache: Any, scale: Any = None) -> np.ndarray:
        """A KV cache (or a slice of one) -> FP32 NumPy, whatever ``kv_dtype`` is; an FP8 cache's
        codes with ``scale`` (its scale plane, sliced alike) dequantized (mtpkern.ops.kv_fp8)."""
        host = np.asarray(self.to_host(cache))
        if host.dtype == np.uint8:
            if scale is None:
                raise ValueError("scale: an FP8 (uint8) cache reads back with its scale plane, got None")
            from ..ops.kv_fp8 import dequantize

            return dequantize(host, np.asarray(self.to_host(scale), np.float32))
        return np.asarray(host, dtype=np.float32)

    def synchronize(self) -> None:
        """Wait for queued work (a no-op on synchronous backends)."""

    def memory_bytes(self) -> int | None:
        """Total memory where this backend's arrays live (host RAM here; the device's on
        cuda), to refuse a KV pool that could never fit; None when unknown."""
        try:
            return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
        except (ValueError, OSError, AttributeError):
            return None

    def describe(self) -> str:
        return self.name

    def warm_up(self, progress: Callable[[int, int, str], None] | None = None, *, fp8: bool = True,
                needs: Any = None) -> int:
        """Compile (or load from a disk cache) the backend's kernels before the first call
        needs them, calling ``progress(done, total, name)`` per kernel family; returns how
        many functions were compiled. ``fp8=False`` leaves out the FP8 weight kernels;
        ``needs`` (``backends.warm_up.KernelNeeds``, e.g. ``KernelNeeds.of(proposer)``) keeps
        only the families and weight kinds a loaded checkpoint runs. The numpy backend has nothing to compile; the cuda
        backend compiles each family on its first launch (NVRTC, then CuPy's disk cache);
        both return 0 at once. The cpu backend overrides this."""
        return 0

    # -- ops (signatures and meaning: mtpkern.ops.<family>) -----------------
    @abstractmethod
    def rmsnorm(self, x, w, eps: float): ...

    @abstractmethod
    def mtp_input(self, embed, tokens, g, enorm_w, hnorm_w, eh_w, eps: float, *, zero_embed=None):
        """``zero_embed``: None or [n] bool / int8 / uint8 flags; a flagged row's embedding
        half is zero (``mtpkern.ops.norm.mtp_input``)."""

    @abstractmethod
    def linear(self, x, w, bias=None, residual=None, *, norm=None):
        """``norm=(g, eps)``: of ``rmsnorm(x, g, eps)`` (``mtpkern.ops.norm.normed``)."""

    @abstractmethod
    def qk_norm_rope_kv_write(self, qkv, num_q_heads: int, num_kv_heads: int, q_norm_w, k_norm_w,
                              eps: float, inv_freq, positions, k_cache, v_cache, slots, *,
                              interleave: bool = False, rope_scale: float = 1.0, v_is_k: bool = False):
        """``v_is_k``: qkv holds q | k only and the value written is the key as written
        (DeepSeek-V4's shared KV; ``mtpkern.ops.rope_kv``)."""

    @abstractmethod
    def rope_heads(self, x, positions, inv_freq, *, interleave: bool = False, rope_scale: float = 1.0,
                   inverse: bool = False):
        """x [n, heads, D] -> [n, heads, D] FP32, the first R dims of every head rotated
        (``inverse``: by the opposite angle; ``mtpkern.ops.rope_kv``)."""

    @abstractmethod
    def paged_attention(self, q, k_cache, v_cache, block_tables, row_seq, row_len, scale: float, *,
                        row_start=None, sinks=None): ...

    @abstractmethod
    def mla_latent_write(self, kv_a, kv_a_norm_w, eps: float, inv_freq, positions, latent_cache, slots, *,
                         q=None, interleave: bool = False, rope_scale: float = 1.0):
        """-> None, or ``q`` with its rope dims rotated (``out=`` with ``q``); ``kv_a`` may be a column
        slice of a wider output (mtpkern.ops.mla)."""

    @abstractmethod
    def mla_attention_absorbed(self, q, w_uk, w_uv, latent_cache, block_tables, row_seq, row_len,
                               scale: float, *, row_start=None): ...

    def linear_grouped(self, x, ws: list) -> Any:
        """``x`` [n, g K] through ``g`` weights ``ws[i]`` [r, K], each on its own K columns ->
        [n, g r] (DeepSeek-V4's grouped ``o_a_proj``): the backend's ``linear`` per group, on a
        contiguous copy of the group's columns."""
        g = len(ws)
        n, gk = x.shape
        if g < 1 or gk % g:
            raise ValueError(f"ws: expected a number of groups dividing x's {gk} columns, got {g}")
        k = gk // g
        xp = self.xp
        return xp.concatenate([self.linear(xp.ascontiguousarray(x[:, i * k:(i + 1) * k]), w)
                               for i, w in enumerate(ws)], axis=1)

    @abstractmethod
    def sigmoid_gate(self, x, gate, residual=None): ...

    @abstractmethod
    def moe_router(self, x, gate_w, bias, spec: RouterSpec, *, norm=None):
        """``norm=(g, eps)``: of ``rmsnorm(x, g, eps)`` (``mtpkern.ops.norm.normed``)."""

    @abstractmethod
    def moe_experts(self, x, ids, weights, w13, w2, residual=None, *, limit=None, clamp_gate=False, norm=None):
        """``limit``: the SwiGLU clamp (None / 0: none; ``mtpkern.ops.mlp.swiglu_limit``), of the
        gate before silu with ``clamp_gate`` (DeepSeek-V4), else of silu(gate) (Step-3.5);
        ``norm=(g, eps)``: of ``rmsnorm(x, g, eps)`` (``mtpkern.ops.norm.normed``)."""

    @abstractmethod
    def swiglu_mlp(self, x, w13, w2, residual=None, *, limit=None, clamp_gate=False, norm=None):
        """``limit`` / ``clamp_gate``: the SwiGLU clamp, as ``moe_experts``;
        ``norm=(g, eps)``: of ``rmsnorm(x, g, eps)`` (``mtpkern.ops.norm.normed``)."""

    @abstractmethod
    def lm_head_logits(self, x, w): ...

    @abstractmethod
    def lm_head_argmax(self, x, w, bitmask=None):
        """-> ids [n] int32; raises ``NoAllowedToken`` (see ops.lm_head)."""

    #: whether ``lm_head_sample`` is implemented (the proposer refuses ``sampling=`` by name where not)
    samples = False

    def lm_head_sample(self, x, w, bitmask=None, *, keys, temperature, top_k, top_p, id_map=None, dist=None):
        """-> (ids [n] int32, probs [n] FP32) on the backend: each row's draft sampled from its
        distribution ``q`` and ``q(draft)`` (mtpkern.ops.sampling); ``keys`` [n] uint64 (the
        rows' ``row_key``), ``temperature`` / ``top_p`` [n] FP64, ``top_k`` [n] int32; ``dist``:
        an FP32 [n, V] buffer for the whole ``q`` (over the head's rows). Raises
        ``NoAllowedToken`` for a row with no candidate."""
        raise NotImplementedError(f"lm_head_sample: the {self.name} backend does not sample drafts "
                                  f"(the numpy, cpu and cuda backends do)")

    @abstractmethod
    def lm_head_topk(self, x, w, bitmask=None, k=1, *, id_map=None, out=None, probs=None, logits=None,
                     check: bool = True):
        """-> (ids [n, k] int32, probs [n, k] FP32) on the backend: each row's ``k`` best
        allowed tokens (value descending, ties to the lowest id; -1 / 0 past the row's
        candidates) and their probabilities; raises ``NoAllowedToken`` for a row with no
        candidate (mtpkern.ops.lm_head.masked_topk). The logits are written out once
        ([n, V] FP32, far fewer bytes than the head's at H >= 1024: a draft tree's rows).
        A planned tree step (mtpkern.tree_plan) passes every buffer: ``out`` [n, k] int32,
        ``probs`` [n, k] FP32, ``logits`` [n, V] FP32, and ``check=False`` (nothing read back:
        a row without a candidate keeps -1 in column 0, for the caller's read of the ids)."""
