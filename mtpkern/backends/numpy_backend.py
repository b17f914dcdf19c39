"""The NumPy reference backend: every op is the specification in ``mtpkern.ops``.

Weights are widened to FP32 once at load time (FP8 / FP4 ones dequantized:
``Fp8Weight.dequantize`` / ``Fp4Weight.dequantize``, each code's value times its scale);
clarity before speed.

Like the CUDA backend, every op takes its output(s) as optional keyword-only
buffers (``out=``; ``ids=`` / ``weights=`` for ``moe_router``), so a planned
propose step (``mtpkern.cuda_graph``) runs unchanged here. The reference
computes the result, then copies it into the buffer: the functions in
``mtpkern.ops`` stay as they are. (The CUDA-only workspaces, ``xcat=``,
``act=``, ``part_o=`` ..., have no meaning here and are not accepted.)
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import numpy as np

from ..ops import attention, dsa, gate, hc, linear, lm_head, mla, mlp, moe, norm, rope_kv, sampling
from ..errors import NoAllowedToken
from ..quant import QUANTIZED
from .base import Backend, check_kv_dtype


def _into(name: str, buf: Any, value: np.ndarray) -> np.ndarray:
    """Copy ``value`` into the caller's buffer ``buf`` (checked: NumPy, same shape and dtype)."""
    _check_buf(name, buf, value)
    np.copyto(buf, value)
    return buf


def _check_buf(name: str, buf: Any, value: np.ndarray) -> None:
    """``buf`` can take ``value``: a NumPy array of its shape and dtype."""
    if not isinstance(buf, np.ndarray):
        raise TypeError(f"{name}: expected a NumPy array, got {type(buf).__name__}")
    if buf.shape != value.shape or buf.dtype != value.dtype:
        raise ValueError(f"{name}: expected shape {list(value.shape)} {value.dtype}, "
                         f"got {list(buf.shape)} {buf.dtype}")


def with_out(fn: Callable, *names: str) -> Callable:
    """``fn`` with keyword-only output buffers ``names`` (default ``("out",)``):
    compute, then copy each result into its buffer when one is given."""
    names = names or ("out",)

    @functools.wraps(fn)
    def op(*args, **kwargs):
        bufs = [kwargs.pop(n, None) for n in names]
        res = fn(*args, **kwargs)
        many = isinstance(res, tuple)
        parts = list(res) if many else [res]
        parts = [p if b is None else _into(n, b, np.asarray(p)) for n, b, p in zip(names, bufs, parts)]
        return tuple(parts) if many else parts[0]

    return staticmethod(op)


_argmax = with_out(lm_head.lm_head_argmax).__func__
_argmax_conf = with_out(lm_head.lm_head_argmax_conf, "out", "conf").__func__


class NumpyBackend(Backend):
    """``kv_dtype``: "float32" (default) or "fp8" (E4M3 codes and per-(row, KV head) scales,
    quantized as the KV write stores them, dequantized by the attention: mtpkern.ops.kv_fp8)."""

    name = "numpy"
    kv_dtype = np.float32

    def __init__(self, kv_dtype: str = "float32") -> None:
        self.kv_fp8 = check_kv_dtype(kv_dtype, ("float32", "fp8"), self.name) == "fp8"
        self.kv_dtype = np.uint8 if self.kv_fp8 else np.float32

    def describe(self) -> str:
        return "numpy (kv fp8)" if self.kv_fp8 else "numpy"

    def prepare_weight(self, w):
        if isinstance(w, QUANTIZED):                 # Fp8Weight / Fp4Weight: dequantized once
            return np.ascontiguousarray(w.dequantize())
        return np.ascontiguousarray(w, dtype=np.float32)

    def from_host(self, a):
        return np.ascontiguousarray(a)

    def to_host(self, a):
        return np.asarray(a)

    def empty_kv(self, num_blocks, block_size, num_kv_heads, head_dim):
        return np.zeros((num_blocks, block_size, num_kv_heads, head_dim), self.kv_dtype)

    rmsnorm = with_out(norm.rmsnorm)
    mtp_input = with_out(norm.mtp_input)
    linear = with_out(linear.linear)
    qk_norm_rope_kv_write = with_out(rope_kv.qk_norm_rope_kv_write)
    rope_heads = with_out(rope_kv.rope_heads)
    paged_attention = with_out(attention.paged_attention)
    mla_latent_write = with_out(mla.mla_latent_write)
    mla_attention_absorbed = with_out(mla.mla_attention_absorbed)
    dsa_key_write = with_out(dsa.dsa_key_write)
    dsa_select = with_out(dsa.dsa_select)
    hc_pre = with_out(hc.hc_pre, "u", "post", "comb")
    hc_post = with_out(hc.hc_post)
    hc_head = with_out(hc.hc_head)
    sigmoid_gate = with_out(gate.sigmoid_gate)
    moe_router = with_out(moe.moe_router, "ids", "weights")
    moe_experts = with_out(moe.moe_experts)
    swiglu_mlp = with_out(mlp.swiglu_mlp)
    lm_head_logits = with_out(lm_head.lm_head_logits)
    samples = True

    @staticmethod
    def lm_head_sample(x, w, bitmask=None, *, keys, temperature, top_k, top_p, id_map=None, dist=None):
        """-> (ids [n] int32, probs [n] FP32): the reference (mtpkern.ops.sampling); ``dist``
        an FP32 [n, V] buffer for the whole distribution."""
        if id_map is not None:
            lm_head.check_id_map(id_map, w.shape[0])
        if dist is not None:
            _check_buf("dist", dist, np.empty((np.shape(x)[0], w.shape[0]), np.float32))
        ids, probs, q = sampling.lm_head_sample(x, w, bitmask, keys, temperature, top_k, top_p, id_map,
                                                want_dist=dist is not None)
        if dist is not None:
            np.copyto(dist, q)
        return ids, probs

    @staticmethod
    def lm_head_argmax(x, w, bitmask=None, *, out=None, conf=None, id_map=None, best=None, sum_exp=None):
        """-> ids [n] int32; with ``conf`` (an FP32 [n] buffer) each draft's confidence
        written into it; with ``id_map`` [V] int32 the ids mapped through it (a draft
        vocabulary's rows -> target ids); with ``best`` / ``sum_exp`` (FP32 [n]) a vocabulary
        shard's partial result, rows without a candidate left at -1 (mtpkern.ops.lm_head)."""
        if id_map is not None:
            lm_head.check_id_map(id_map, w.shape[0])
        if best is None and sum_exp is None:
            if id_map is None:
                if conf is None:
                    return _argmax(x, w, bitmask, out=out)
                return _argmax_conf(x, w, bitmask, out=out, conf=conf)[0]
            ids = (_argmax(x, w, bitmask) if conf is None else _argmax_conf(x, w, bitmask, conf=conf)[0])
        else:
            n = np.shape(x)[0]
            if bitmask is not None:
                lm_head.check_bitmask(bitmask, n, w.shape[0])
            ids, bv, sums = lm_head.masked_best(lm_head.lm_head_logits(x, w), bitmask)
            with np.errstate(divide="ignore"):
                cf = np.where(ids >= 0, np.float32(1.0) / sums, np.float32(np.nan)).astype(np.float32)
            mapped = ids if id_map is None else lm_head.map_ids(ids, id_map)
            outs = [(nm, b, v) for nm, b, v in (("best", best, bv), ("sum_exp", sum_exp, sums), ("conf", conf, cf),
                                                 ("out", out, mapped)) if b is not None]
            for nm, b, v in outs:                    # every buffer checked before any is written
                _check_buf(nm, b, v)
            for nm, b, v in outs:
                np.copyto(b, v)
            return mapped if out is None else out
        mapped = ids if id_map is None else lm_head.map_ids(ids, id_map)
        return mapped if out is None else _into("out", out, mapped)

    @staticmethod
    def lm_head_topk(x, w, bitmask=None, k=1, *, id_map=None, out=None, probs=None, logits=None, check=True):
        """-> (ids [n, k] int32, probs [n, k] FP32): each row's k best allowed tokens and
        their probabilities (mtpkern.ops.lm_head.masked_topk), ids through ``id_map``;
        ``out`` / ``probs`` / ``logits``, ``check``: as ``Backend.lm_head_topk``."""
        if id_map is not None:
            lm_head.check_id_map(id_map, w.shape[0])
        lg = lm_head.lm_head_logits(x, w)
        if logits is not None:
            np.copyto(logits, lg)
        if check:
            ids, pr = lm_head.masked_topk(lg, bitmask, k)
        else:                                   # a row without a candidate: -1 / 0, as the kernel leaves it
            ids, pr = np.full((lg.shape[0], k), -1, np.int32), np.zeros((lg.shape[0], k), np.float32)
            for r in range(lg.shape[0]):
                try:
                    ids[r], pr[r] = lm_head.masked_topk(lg[r:r + 1], None if bitmask is None else bitmask[r:r + 1], k)
                except NoAllowedToken:
                    pass
        ids = ids if id_map is None else lm_head.map_id_rows(ids, id_map)
        if out is None:
            return ids, pr
        np.copyto(out, ids)
        np.copyto(probs, pr)
        return out, probs
