"""The NumPy reference backend: every op is the specification in ``mtpkern.ops``.

Weights are widened to FP32 once at load time; clarity before speed.
"""

from __future__ import annotations

import numpy as np

from ..ops import attention, linear, lm_head, mlp, moe, norm, rope_kv
from .base import Backend


class NumpyBackend(Backend):
    name = "numpy"
    kv_dtype = np.float32

    def prepare_weight(self, w):
        return np.ascontiguousarray(w, dtype=np.float32)

    def from_host(self, a):
        return np.ascontiguousarray(a)

    def to_host(self, a):
        return np.asarray(a)

    def empty_kv(self, num_blocks, block_size, num_kv_heads, head_dim):
        return np.zeros((num_blocks, block_size, num_kv_heads, head_dim), self.kv_dtype)

    rmsnorm = staticmethod(norm.rmsnorm)
    mtp_input = staticmethod(norm.mtp_input)
    linear = staticmethod(linear.linear)
    qk_norm_rope_kv_write = staticmethod(rope_kv.qk_norm_rope_kv_write)
    paged_attention = staticmethod(attention.paged_attention)
    moe_router = staticmethod(moe.moe_router)
    moe_experts = staticmethod(moe.moe_experts)
    swiglu_mlp = staticmethod(mlp.swiglu_mlp)
    lm_head_logits = staticmethod(lm_head.lm_head_logits)
    lm_head_argmax = staticmethod(lm_head.lm_head_argmax)
