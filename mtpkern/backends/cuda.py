"""The CUDA backend: the ops of ``mtpkern.ops`` as our own kernels (kernels/*.cu)
launched through CuPy ``RawModule`` (no deep-learning framework, no cuBLAS, so
a propose step can be captured in a CUDA graph).

Storage: weights stay BF16 (CuPy has no bfloat16 dtype: a weight is a uint16
array of the BF16 bits), FP32, FP8 E4M3 (``CudaFp8``: uint8 codes and FP32
scales; docs/fp8.md) or FP4 E2M1 (``CudaFp4``: two codes a byte and E8M0 scale codes; NVFP4
``CudaNvFp4``: the same codes, E4M3 scale codes per 16 and an FP32 scale per row;
docs/fp4.md); norm weights, biases and activations are FP32;
indices int32; the paged KV cache is BF16 bits by default (``kv_dtype`` uint16;
``CudaBackend(kv_dtype="float32")`` keeps it FP32, e.g. for exact comparisons; ``"fp8"``: E4M3 codes
with per-row scales, mtpkern.ops.kv_fp8).

Every op takes its outputs and workspaces as optional keyword-only buffers
(``out=``, and e.g. ``act=`` / ``partial=`` for ``moe_experts``; see the
launchers in ``mtpkern.backends.cuda_launch``): given contiguous device arrays
of the right shape and dtype, a launch allocates nothing, as CUDA-graph capture
requires. ``lm_head_argmax(..., check=False)`` also skips its host read.
A family compiles on its first launch (then CuPy's disk cache serves it), so
run every op once before capturing a graph.

Hidden states come in through ``ingest_float``: CuPy arrays and other device
arrays (``__cuda_array_interface__``: Numba, PyTorch; DLPack: PyTorch, JAX)
are used in place when they are FP32 and contiguous, BF16 device tensors are
widened to FP32 on the device, host arrays are uploaded.

Imports without a GPU (nothing touches CuPy or compiles until an op runs);
constructing a ``CudaBackend`` needs a usable device.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np

from ..quant import Fp4Weight, Fp8Weight
from . import dlpack
from .base import Backend, check_kv_dtype
from .cuda_launch import attention, dsa, linear, lm_head, mla, mlp, moe, norm, rope_kv
from .cuda_launch import hc as hc_launch
from .cuda_launch import gate as gate_launch
from .cuda_launch._util import CudaFp4, CudaFp8

KvDtype = Literal["bfloat16", "float32", "fp8"]


def _cupy():
    import cupy

    return cupy


def _bf16():
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


#: the oldest device the kernels run on (compiled and recorded for sm_80 and sm_90)
MIN_COMPUTE_CAPABILITY = 80


class CudaBackend(Backend):
    name = "cuda"
    kv_dtype: Any = np.uint16  # BF16 bits
    fuses_norm = True         # the GEMV and tensor-core kernels normalise their input rows

    def __init__(self, kv_dtype: KvDtype = "bfloat16"):
        """``kv_dtype``: "bfloat16" (default), "float32", or "fp8" (E4M3 codes with one FP32 scale
        per row and KV head, the attention reading one byte per element: mtpkern.ops.kv_fp8; the
        planned step does not take it yet: ``cuda_graphs=False``)."""
        self._set_kv_dtype(kv_dtype)
        cp = _cupy()
        try:
            count = cp.cuda.runtime.getDeviceCount()
        except Exception as e:  # no driver
            raise RuntimeError(f"CudaBackend: no usable CUDA device ({e})") from e
        if count < 1:
            raise RuntimeError("CudaBackend: no CUDA device")
        dev = cp.cuda.Device()
        cc = int(dev.compute_capability)
        if cc < MIN_COMPUTE_CAPABILITY:
            raise RuntimeError(f"CudaBackend: device {dev.id} has compute capability {cc // 10}.{cc % 10}; the "
                               f"kernels need {MIN_COMPUTE_CAPABILITY // 10}.0 or newer (BF16 arithmetic and the "
                               f"BF16 tensor cores of sm_80 / sm_90)")
        self.device_id = dev.id

    def _set_kv_dtype(self, kv_dtype: str) -> None:
        kv_dtype = check_kv_dtype(kv_dtype, ("bfloat16", "float32", "fp8"), "cuda")
        self.kv_fp8 = kv_dtype == "fp8"
        self.kv_dtype = {"bfloat16": np.uint16, "float32": np.float32, "fp8": np.uint8}[kv_dtype]

    @property
    def xp(self):
        """The array module of this backend's arrays: ``cupy`` (resolved on use)."""
        return _cupy()

    # -- memory -------------------------------------------------------------
    def prepare_weight(self, w):
        """BF16 (ml_dtypes) -> uint16 bits on the GPU; uint16 is taken as BF16 bits
        already; any other float -> FP32; an ``Fp8Weight`` -> ``CudaFp8`` (its codes, one
        byte each, and its FP32 scales on the GPU, dequantized inside the GEMV kernels); an
        ``Fp4Weight`` -> ``CudaFp4`` (MXFP4: its packed codes, two a byte, and its E8M0 scale
        codes) or ``CudaNvFp4`` (NVFP4: the codes, and per row a record of its FP32 row scale and
        E4M3 scale codes), decoded inside the GEMV kernels: docs/fp4.md."""
        if isinstance(w, Fp8Weight):
            return CudaFp8.from_weight(w, _cupy().asarray)
        if isinstance(w, Fp4Weight):
            return CudaFp4.from_weight(w, _cupy().asarray)
        w = np.asarray(w)
        if w.dtype == _bf16() or w.dtype == np.uint16:
            host = np.ascontiguousarray(w).view(np.uint16)
        elif np.issubdtype(w.dtype, np.floating):
            host = np.ascontiguousarray(w, dtype=np.float32)
        else:
            raise TypeError(f"prepare_weight: expected a bfloat16 or float array, got {w.dtype}")
        return _cupy().asarray(host)

    def from_host(self, a):
        return _cupy().asarray(np.ascontiguousarray(a))

    def ingest_float(self, name: str, x: Any):
        """An engine's hidden states (BF16 or FP32) -> a C-contiguous FP32 CuPy array.

        - a CuPy FP32 C-contiguous array is returned as it is (no copy);
        - other device arrays, through ``__cuda_array_interface__`` (Numba, PyTorch)
          or DLPack (PyTorch, JAX), are wrapped without a copy, and returned as they
          are when FP32 and C-contiguous (a strided one is made contiguous);
        - BF16 on the device (DLPack; CuPy >= 14 bfloat16 arrays) is widened to FP32
          on the device: a new array, ``bits << 16`` (exact);
        - host arrays (NumPy FP32 / BF16, host DLPack, nested lists) are checked,
          widened on the host and uploaded.

        Raises ``TypeError`` naming ``name`` for any other dtype or object, and
        ``ValueError`` for an array on another GPU than this backend's.
        """
        cp = _cupy()
        if isinstance(x, cp.ndarray):
            return self._device_f32(name, x)
        try:
            dev = dlpack.device_of(x)
        except Exception:
            dev = None
        if dev is not None and dev[0] in dlpack.CUDA_DEVICES:
            if "bfloat16" in str(getattr(x, "dtype", "")):
                info = dlpack.export(x, stream=self._dlpack_stream())
                if not info.is_bfloat16:
                    raise TypeError(f"{name}: expected dtype float32 or bfloat16, got DLPack type code "
                                    f"{info.code} with {info.bits} bits")
                return self._widen_bf16(name, cp.asarray(dlpack.uint16_view(info)))
            try:
                arr = cp.from_dlpack(x)
            except Exception as e:
                raise TypeError(f"{name}: could not import the {type(x).__name__} device array "
                                f"through DLPack ({e})") from None
            return self._device_f32(name, arr)
        if dev is None and not isinstance(x, np.ndarray):
            try:
                has_cai = getattr(x, "__cuda_array_interface__", None) is not None
            except Exception as e:     # a device array that cannot describe itself (e.g. a BF16 tensor)
                raise TypeError(f"{name}: {type(x).__name__} device array without a usable "
                                f"__cuda_array_interface__ or DLPack ({e})") from None
            if has_cai:
                return self._device_f32(name, cp.asarray(x))
        return super().ingest_float(name, x)

    @staticmethod
    def _dlpack_stream() -> int:
        """The consumer stream for ``__dlpack__``: CuPy's current one (1 = legacy default)."""
        ptr = _cupy().cuda.get_current_stream().ptr
        return ptr if ptr else 1

    def _on_this_device(self, name: str, a) -> None:
        if a.device.id != self.device_id:
            raise ValueError(f"{name}: expected an array on GPU {self.device_id} (this backend's), "
                             f"got one on GPU {a.device.id}")

    def _device_f32(self, name: str, a):
        """A CuPy view of the engine's array -> C-contiguous FP32 (no copy when it already is)."""
        self._on_this_device(name, a)
        if a.dtype == np.float32:
            return a if a.flags.c_contiguous else _cupy().ascontiguousarray(a)
        if a.dtype.name == "bfloat16":                     # CuPy >= 14 with ml_dtypes
            return self._widen_bf16(name, a.view(np.uint16))
        raise TypeError(f"{name}: expected dtype float32 or bfloat16, got {a.dtype.name}")

    def _widen_bf16(self, name: str, bits):
        """uint16 BF16 bits (any strides) -> a new C-contiguous FP32 array: ``bits << 16``."""
        cp = _cupy()
        self._on_this_device(name, bits)
        wide = cp.ascontiguousarray(bits).astype(cp.uint32)
        wide <<= 16
        return wide.view(cp.float32)

    def to_host(self, a) -> np.ndarray:
        cp = _cupy()
        return cp.asnumpy(a) if isinstance(a, cp.ndarray) else np.asarray(a)

    def empty_kv(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int):
        return _cupy().zeros((num_blocks, block_size, num_kv_heads, head_dim), self.kv_dtype)

    def kv_to_host(self, cache, scale=None) -> np.ndarray:
        host = self.to_host(cache)
        if host.dtype == np.uint16:
            return host.view(_bf16()).astype(np.float32)
        if host.dtype == np.uint8:                       # FP8 codes: dequantized with their scales
            return super().kv_to_host(host, None if scale is None else self.to_host(scale))
        return host.astype(np.float32, copy=False)

    def synchronize(self) -> None:
        _cupy().cuda.get_current_stream().synchronize()

    def memory_bytes(self) -> int | None:
        try:
            return int(_cupy().cuda.runtime.memGetInfo()[1])
        except Exception:  # no device query: let the allocation decide
            return None

    def describe(self) -> str:
        cp = _cupy()
        props = cp.cuda.runtime.getDeviceProperties(self.device_id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        return f"cuda ({name}, sm_{props['major']}{props['minor']}, kv {self.kv_name()})"

    def kv_name(self) -> str:
        """The KV cache's element type in a description: bf16, fp32 or fp8."""
        return {np.dtype(np.uint16): "bf16", np.dtype(np.float32): "fp32", np.dtype(np.uint8): "fp8"}[
            np.dtype(self.kv_dtype)]

    # -- ops (shapes and meaning: mtpkern.ops.<family>; buffers: the launchers) --
    def rmsnorm(self, x, w, eps: float, *, out=None):
        return norm.rmsnorm(x, w, eps, out=out)

    def mtp_input(self, embed, tokens, g, enorm_w, hnorm_w, eh_w, eps: float, *, out=None, xcat=None,
                  zero_embed=None):
        return norm.mtp_input(embed, tokens, g, enorm_w, hnorm_w, eh_w, eps, out=out, xcat=xcat,
                              zero_embed=zero_embed)

    def linear(self, x, w, bias=None, residual=None, *, out=None, norm=None):
        return linear.linear(x, w, bias, residual, out=out, norm=norm)

    def qk_norm_rope_kv_write(self, qkv, num_q_heads: int, num_kv_heads: int, q_norm_w, k_norm_w,
                              eps: float, inv_freq, positions, k_cache, v_cache, slots, *,
                              interleave: bool = False, rope_scale: float = 1.0, v_is_k: bool = False, out=None,
                              k_scale=None, v_scale=None):
        return rope_kv.qk_norm_rope_kv_write(qkv, num_q_heads, num_kv_heads, q_norm_w, k_norm_w, eps,
                                             inv_freq, positions, k_cache, v_cache, slots,
                                             interleave=interleave, rope_scale=rope_scale, v_is_k=v_is_k, out=out,
                                             k_scale=k_scale, v_scale=v_scale)

    def rope_heads(self, x, positions, inv_freq, *, interleave: bool = False, rope_scale: float = 1.0,
                   inverse: bool = False, out=None):
        return rope_kv.rope_heads(x, positions, inv_freq, interleave=interleave, rope_scale=rope_scale,
                                  inverse=inverse, out=out)

    def paged_attention(self, q, k_cache, v_cache, block_tables, row_seq, row_len, scale: float, *,
                        row_start=None, sinks=None, out=None, part_o=None, part_ml=None, k_scale=None,
                        v_scale=None):
        return attention.paged_attention(q, k_cache, v_cache, block_tables, row_seq, row_len, scale,
                                         row_start=row_start, sinks=sinks, out=out, part_o=part_o,
                                         part_ml=part_ml, k_scale=k_scale, v_scale=v_scale)

    # MLA (mtpkern.ops.mla; kernels/mla.cu)
    def mla_latent_write(self, kv_a, kv_a_norm_w, eps: float, inv_freq, positions, latent_cache, slots, *,
                         q=None, interleave: bool = False, rope_scale: float = 1.0, out=None):
        return mla.mla_latent_write(kv_a, kv_a_norm_w, eps, inv_freq, positions, latent_cache, slots, q=q,
                                    interleave=interleave, rope_scale=rope_scale, out=out)

    def mla_attention_absorbed(self, q, w_uk, w_uv, latent_cache, block_tables, row_seq, row_len,
                               scale: float, *, row_start=None, index=None, out=None, q_full=None, o_lat=None,
                               part_o=None, part_ml=None):
        """Workspaces ``q_full`` / ``o_lat`` / ``part_o`` / ``part_ml``: ``cuda_launch.mla``
        (sizes: ``mla.plan`` over ``mla.max_rows(max_blocks * BS, index)`` + ``mla.workspace_shapes``);
        ``index [n, T]`` int32: DSA's lists (``dsa_select``), each row attending to its listed rows."""
        return mla.mla_attention_absorbed(q, w_uk, w_uv, latent_cache, block_tables, row_seq, row_len, scale,
                                          row_start=row_start, index=index, out=out, q_full=q_full, o_lat=o_lat,
                                          part_o=part_o, part_ml=part_ml)

    # DSA's indexer (mtpkern.ops.dsa; kernels/dsa.cu)
    def dsa_key_write(self, k, k_norm_w, k_norm_b, eps: float, inv_freq, positions, index_cache, slots, *, q=None,
                      interleave: bool = False, rope_scale: float = 1.0, out=None, gate=None):
        return dsa.dsa_key_write(k, k_norm_w, k_norm_b, eps, inv_freq, positions, index_cache, slots, q=q,
                                 interleave=interleave, rope_scale=rope_scale, out=out, gate=gate)

    def dsa_select(self, q, weights, index_cache, block_tables, row_seq, row_len, topk: int, scale: float, *,
                   row_start=None, out=None, scores=None, kpool: int = 0, ape=None, tail: bool = True):
        """Workspace ``scores [n, max_blocks * BS]`` FP32, with ``kpool`` P ``[n, max_blocks * BS // P]``
        (``dsa.workspace_shapes``)."""
        return dsa.dsa_select(q, weights, index_cache, block_tables, row_seq, row_len, topk, scale,
                              row_start=row_start, out=out, scores=scores, kpool=kpool, ape=ape, tail=tail)

    def sigmoid_gate(self, x, gate, residual=None, *, out=None):
        return gate_launch.sigmoid_gate(x, gate, residual, out=out)

    def moe_router(self, x, gate_w, bias, spec, *, ids=None, weights=None, logits=None, ticket=None, norm=None):
        return moe.moe_router(x, gate_w, bias, spec, ids=ids, weights=weights, logits=logits, ticket=ticket,
                              norm=norm)

    def moe_experts(self, x, ids, weights, w13, w2, residual=None, *, out=None, act=None, partial=None,
                    limit=None, clamp_gate=False, norm=None, activation="swiglu", situ_beta=0.0, situ_linear_beta=0.0):
        return moe.moe_experts(x, ids, weights, w13, w2, residual, out=out, act=act, partial=partial, limit=limit,
                               clamp_gate=clamp_gate, norm=norm, activation=activation, situ_beta=situ_beta,
                               situ_linear_beta=situ_linear_beta)

    def swiglu_mlp(self, x, w13, w2, residual=None, *, out=None, act=None, limit=None, clamp_gate=False,
                   norm=None, activation="swiglu", situ_beta=0.0, situ_linear_beta=0.0):
        return mlp.swiglu_mlp(x, w13, w2, residual, out=out, act=act, limit=limit, clamp_gate=clamp_gate,
                              norm=norm, activation=activation, situ_beta=situ_beta,
                              situ_linear_beta=situ_linear_beta)

    def lm_head_logits(self, x, w, *, out=None):
        return lm_head.lm_head_logits(x, w, out=out)

    def lm_head_topk(self, x, w, bitmask=None, k=1, *, id_map=None, out=None, probs=None, logits=None, check=True):
        return lm_head.lm_head_topk(x, w, bitmask, k, id_map=id_map, out=out, probs=probs, logits=logits,
                                    check=check)

    samples = True

    def lm_head_sample(self, x, w, bitmask=None, *, keys, temperature, top_k, top_p, id_map=None, dist=None):
        """-> (ids [n] int32, probs [n] FP32) on the device (spec: mtpkern.ops.sampling, the same
        drafts as every backend given these logits). A call whose rows are all temperature-only
        (top_k 0, top_p 1), or all have 1 <= top_k <= 64, without ``dist`` draws in the LM head's
        epilogue (kernels/lm_head.cu, the logits never written); otherwise the logits (``lm_head_logits``), then each row's
        draft drawn by ``sample_kernel`` (kernels/sampling.cu). ``dist``: a device FP32 [n, V]
        buffer for the whole distribution. Only the ids are read back (to raise
        ``NoAllowedToken`` naming a row without a candidate)."""
        return lm_head.lm_head_sample(x, w, bitmask, keys=keys, temperature=temperature, top_k=top_k, top_p=top_p,
                                      id_map=id_map, dist=dist)

    def lm_head_argmax(self, x, w, bitmask=None, *, out=None, part_v=None, part_i=None, part_s=None, conf=None,
                       id_map=None, check: bool = True, best=None, sum_exp=None):
        """-> ids [n] int32 (through ``id_map`` [V] int32 when given), and the drafter's
        probability of each id into ``conf [n]`` FP32 when given; raises ``NoAllowedToken``
        (when ``check``; see the launcher); ``best`` / ``sum_exp``: a vocabulary shard's
        partial result (mtpkern.ops.lm_head)."""
        return lm_head.lm_head_argmax(x, w, bitmask, out=out, part_v=part_v, part_i=part_i, part_s=part_s,
                                      conf=conf, id_map=id_map, check=check, best=best, sum_exp=sum_exp)

    # hyper-connections (mtpkern.ops.hc; kernels/hc.cu): X / f FP32 or BF16 bits, m <= 16
    def hc_pre(self, X, mix, base, scale, hc_eps: float, iters: int, *, u=None, post=None, comb=None):
        return hc_launch.hc_pre(X, mix, base, scale, hc_eps, iters, u=u, post=post, comb=comb)

    def hc_post(self, f, X, post, comb, *, out=None):
        return hc_launch.hc_post(f, X, post, comb, out=out)

    def hc_head(self, X, mix, base, scale, hc_eps: float, *, out=None):
        return hc_launch.hc_head(X, mix, base, scale, hc_eps, out=out)
