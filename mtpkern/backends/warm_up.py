"""One tiny call of every kernel family, for ``Backend.warm_up``.

A JIT backend compiles a kernel per argument type (dtype, rank, layout), not per
shape, so a call on inputs of a few elements compiles (or loads from the disk
cache) what a real propose will run. The calls use the types the head and the
proposer pass: FP32 activations, int32 indices (int64 token ids inside
``mtp_input``), BF16 and FP32 weights through ``prepare_weight`` (and FP8 ones
unless ``fp8=False``: on 2 cores they add ~16 s to a cold compile, one kernel per
GEMV family serving both scale kinds), FP32 vectors through ``prepare_vector``,
optional bias / residual / bitmask / window / sinks both given and absent. The embedding table
stays BF16 / FP32 (FP8 ones are refused). Only the ``Backend`` interface is used:
any backend can run them.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ..ops.moe import RouterSpec
from ..ops.rope_kv import inv_freq
from .base import Backend

#: tiny shapes: H hidden, Hq/Hkv heads, D head dim, V vocab, E experts (2 groups), I expert width
H, HQ, HKV, D, V, E, I = 16, 2, 1, 8, 40, 4, 8
#: rows per call and blocks of the paged KV (block size BS)
N, NB, BS = 2, 4, 4
#: the LM head again at NA rows of HA columns: where the cpu backend screens a BF16 head's
#: vocabulary on AMX tiles at that many rows (``backends/cpu.py``, ``AMX_MIN_ROWS``), that kernel
NA, HA = 4, 32


def family_calls(be: Backend, fp8: bool = True) -> list[tuple[str, Callable[[], object]]]:
    """(family name, call) for every kernel family, the cheapest to compile first."""
    import ml_dtypes

    from ..quant import Fp8Weight

    rng = np.random.default_rng(0)
    dtypes = (np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32))

    def dense(*shape):                                     # the same matrix as BF16 and as FP32
        w = rng.standard_normal(shape).astype(np.float32) / np.sqrt(shape[-1])
        return [be.prepare_weight(w.astype(dt)) for dt in dtypes]

    def weights(*shape):                                   # ... and as FP8 (block scales)
        w = dense(*shape)
        if fp8:
            w.append(be.prepare_weight(Fp8Weight.quantize(rng.standard_normal(shape).astype(np.float32),
                                                          (128, 128))))
        return w

    def act(*shape):
        return be.from_host(rng.standard_normal(shape).astype(np.float32))

    def vec(k):
        return be.prepare_vector(np.ones(k, np.float32))

    def idx(a):
        return be.from_host(np.asarray(a, np.int32))

    x = act(N, H)
    qkv_w = weights((HQ + 2 * HKV) * D, H)
    kc, vc = be.empty_keys(NB, BS, HKV, D), be.empty_kv(NB, BS, HKV, D)
    spec = RouterSpec(top_k=2, n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True)
    ids, wts = idx([[0, 1], [2, 3]]), act(N, 2)                # [N, top_k] routing of each row
    bitmask = idx(np.full((N, -(-V // 32)), -1))

    def mtp_input():
        for embed in dense(V, H):                                   # every eh_proj beside either table
            for eh in weights(H, 2 * H):
                be.mtp_input(embed, idx([1, 2]), x, vec(H), vec(H), eh, 1e-5)

    def linear():
        for w in qkv_w:
            be.linear(x, w)
            be.linear(x, w, vec(w.shape[0]), act(N, w.shape[0]))

    def rope_kv():
        be.qk_norm_rope_kv_write(act(N, (HQ + 2 * HKV) * D), HQ, HKV, vec(D), vec(D), 1e-5,
                                 be.from_host(inv_freq(D // 2, 10000.0)), idx([3, 4]), kc, vc, idx([3, 4]))
        be.qk_norm_rope_kv_write(act(N, (HQ + 2 * HKV) * D), HQ, HKV, None, None, 1e-5,
                                 be.from_host(inv_freq(D, 10000.0)), idx([5, 6]), kc, vc, idx([5, 6]))

    def attention():
        tables = idx([[0, 1], [2, 3]])
        be.paged_attention(act(N, HQ, D), kc, vc, tables, idx([0, 1]), idx([5, 7]), D ** -0.5)
        # a sliding window and sinks (gpt-oss / MiMo-V2 / Step-3.5 modules)
        be.paged_attention(act(N, HQ, D), kc, vc, tables, idx([0, 1]), idx([5, 7]), D ** -0.5,
                           row_start=idx([2, 0]), sinks=vec(HQ))

    def mla():
        L, R, P = 16, 8, 8                                         # the latent attention (mtpkern.ops.mla)
        cache = be.empty_latent_kv(NB, BS, L + R)
        for interleave in (False, True):
            q = be.mla_latent_write(act(N, L + R), vec(L), 1e-6, be.from_host(inv_freq(R, 10000.0)), idx([1, 2]),
                                    cache, idx([1, 2]), q=act(N, HQ, P + R), interleave=interleave)
        for uk, uv in zip(dense(HQ, P, L), dense(HQ, 8, L)):
            be.mla_attention_absorbed(q, uk, uv, cache, idx([[0, 1], [2, 3]]), idx([0, 1]), idx([5, 7]), 0.25)
            be.mla_attention_absorbed(q, uk, uv, cache, idx([[0, 1], [2, 3]]), idx([0, 1]), idx([5, 7]), 0.25,
                                      row_start=idx([2, 0]))

    def gate():
        y = act(N, HQ * D)
        be.sigmoid_gate(y, act(N, HQ), y)                          # head-wise, with the residual
        be.sigmoid_gate(y, act(N, HQ * D), out=y)                  # element-wise, in place

    def router():
        for gate in weights(E, H):
            be.moe_router(x, gate, vec(E), spec)

    def experts():
        for w13, w2 in zip(weights(E, 2 * I, H), weights(E, H, I)):
            be.moe_experts(x, ids, wts, w13, w2, x)
            be.moe_experts(x, ids, wts, w13, w2)

    def mlp():
        for w13, w2 in zip(weights(2 * I, H), weights(H, I)):
            be.swiglu_mlp(x, w13, w2, x)

    def lm_head():
        for w in weights(V, H):
            be.lm_head_argmax(x, w)
            be.lm_head_argmax(x, w, bitmask)
            be.lm_head_argmax(x, w, conf=act(N))               # the confidences' own path
            be.lm_head_logits(x, w)
        be.lm_head_argmax(act(NA, HA), dense(V, HA)[0])

    return [("rmsnorm", lambda: be.rmsnorm(x, vec(H), 1e-5)), ("moe_router", router),
            ("qk_norm_rope_kv_write", rope_kv), ("paged_attention", attention), ("mla", mla), ("sigmoid_gate", gate),
            ("linear", linear),
            ("mtp_input", mtp_input), ("swiglu_mlp", mlp), ("moe_experts", experts), ("lm_head", lm_head)]
