"""Mixture of experts: the router and the routed experts.

``moe_router(x [n, H], gate_w [E, H], bias [E], spec) -> (ids [n, K] int32,
weights [n, K] float32)``, exactly transformers' ``DeepseekV3`` / ``Glm4Moe`` router in FP32
(the -inf of step 3: below):

1. ``s = score(x @ gate_w.T)``: ``sigmoid``, ``softmax`` over the E logits, or
   ``sqrtsoftplus`` (DeepSeek-V4: ``sqrt(softplus(l))`` with torch's softplus, ``l`` where
   ``l > 20``, else ``log1p(exp(l))``; ``router_scores``);
2. ``c = s + bias`` is used for selection only;
3. each of ``n_group`` groups scores the sum of its top-2 ``c``; the best
   ``topk_group`` groups are kept; ``c`` outside them is set to -inf, so an expert
   of a dropped group is never chosen over one of a kept group, even where a kept
   ``c`` is negative (a correction bias below ``-s``: GLM-4.5's go down to about -0.5);
4. the top-``K`` experts by ``c`` are chosen (ties: lowest id first; NaN after
   every number, -inf included); ids are returned in that order;
5. weights are the unbiased ``s`` of the chosen experts, divided by
   ``(sum + 1e-20)`` when ``norm_topk_prob``, then times ``routed_scaling_factor``.

The -inf of step 3 is every grouped family's reference: DeepSeek's inference code
(``Gate.forward``, V3 and V3.2: ``masked_fill_(mask, float("-inf"))``), vLLM's
``grouped_topk``, and transformers' ``DeepseekV3`` router with everything that inherits
it (``Glm4Moe``, ``Glm4MoeLite``, ``GlmMoeDsa``) since transformers fixed it from 0.0 to
-inf (huggingface/transformers#45441; the 0.0 of older releases picks an expert of a
dropped group when the kept ``c`` are negative). No family here routes with a reference
that fills 0.0: Qwen3-Next and Step-3.5 route over one group (nothing is dropped, the fill
is never read), MiMo-V2-Flash and LongCat-Flash draft with dense MTP layers (their
configs' MoE fields describe the target).

``moe_experts(x [n, H], ids [n, K], weights [n, K], w13 [E, 2I, H], w2 [E, H, I],
residual [n, H] | None, *, limit=None, clamp_gate=False) -> [n, H] = residual + sum_k
weights[:, k] * expert_{ids[:, k]}(x)`` with each expert a SwiGLU (``w13[e]`` = gate rows over
up rows). ``limit`` clamps every routed expert's SwiGLU as Hugging Face
``Step3p7Experts._apply_gate`` does (Step-3.5 / Step-3.7 ``swiglu_limits[layer]``):
``min(silu(gate), L) * clip(up, -L, L)``; with ``clamp_gate`` as ``DeepseekV4Experts._apply_gate``
does: ``silu(min(gate, L)) * clip(up, -L, L)``; None or 0 for none, NaN kept
(``mtpkern.ops.mlp``, ``swiglu_limit``).

``activation="relu2"``: each expert is Nemotron-H's non-gated MLP, ``w13[e]`` its up rows
alone [E, I, H] and ``w2[e] relu(w13[e] x) ** 2`` (``mtpkern.ops.mlp``; no clamp).
``activation="situ"`` (Kimi K3): each expert's activation is SiTU (``mtpkern.ops.mlp.situ_act``,
``situ_beta`` / ``situ_linear_beta``), w13 laid out as SwiGLU's.

LatentMoE (Nemotron-3, Kimi K3) calls ``moe_experts`` on the latent rows ``x`` [n, Lt] with
experts of width Lt: nothing here knows about it (mtpkern/head.py wires the projections).

An id of -1 is an empty slot: it adds nothing (its weight is not read into the sum). A
rank of an expert-parallel head (mtpkern.shard) holds experts ``e0 .. e1 - 1`` as its
local ``0 .. e1 - e0 - 1`` and passes the router's ids mapped to them, -1 for the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from ._check import expect_dtype, expect_ndim, expect_shape
from .mlp import activation_name, check_activation, check_clamp_gate, gated_act, gated_rows, swiglu_limit
from .norm import normed


#: the router's score functions; a kernel takes a scoring's index here (``scoring_code``)
SCORINGS = ("sigmoid", "softmax", "sqrtsoftplus")
#: torch.nn.functional.softplus's threshold (beta 1): softplus(l) is l itself above it
SOFTPLUS_THRESHOLD = 20.0


@dataclass(frozen=True, slots=True)
class RouterSpec:
    top_k: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    scoring: Literal["sigmoid", "softmax", "sqrtsoftplus"] = "sigmoid"

    def __post_init__(self) -> None:
        if self.scoring not in SCORINGS:
            raise ValueError(f"scoring: expected one of {SCORINGS}, got {self.scoring!r}")
        if min(self.top_k, self.n_group, self.topk_group) < 1:
            raise ValueError(f"top_k, n_group, topk_group: expected >= 1, got {self}")

    @classmethod
    def from_config(cls, cfg) -> "RouterSpec":
        return cls(cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group,
                   float(cfg.routed_scaling_factor), bool(cfg.norm_topk_prob), cfg.scoring_func)

    @property
    def scoring_code(self) -> int:
        """The kernels' number for ``scoring``: its index in ``SCORINGS``."""
        return SCORINGS.index(self.scoring)


def check_moe_router(x, gate_w, bias, spec: RouterSpec) -> None:
    expect_ndim("x", x, 2)
    expect_shape("gate_w", gate_w, (None, x.shape[1]))
    E = gate_w.shape[0]
    expect_shape("bias", bias, (E,))
    if E % spec.n_group or spec.top_k > spec.topk_group * (E // spec.n_group):
        raise ValueError(f"spec: {spec} does not fit E={E} experts")


def _top(values: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values along the last axis, largest first, lowest index on ties."""
    return np.argsort(-values, axis=-1, kind="stable")[..., :k]


def router_scores(logits: np.ndarray, scoring: str) -> np.ndarray:
    """logits [n, E] FP32 -> the scores s [n, E] FP32 (step 1). A NaN logit scores NaN (a
    softmax row with one: all NaN); sqrtsoftplus scores -inf as 0 and +inf as +inf."""
    if scoring == "sigmoid":
        return np.float32(1.0) / (np.float32(1.0) + np.exp(-logits))
    if scoring == "softmax":
        z = np.exp(logits - logits.max(axis=-1, keepdims=True))
        return z / z.sum(axis=-1, keepdims=True)
    big = logits > np.float32(SOFTPLUS_THRESHOLD)                    # (NaN is not: it goes through log1p)
    soft = np.log1p(np.exp(np.minimum(logits, np.float32(SOFTPLUS_THRESHOLD))))   # exp(<= 20): no overflow
    return np.sqrt(np.where(big, logits, soft))


def moe_router(x, gate_w, bias, spec: RouterSpec, *, norm=None) -> tuple[np.ndarray, np.ndarray]:
    """``norm=(g [H], eps)``: of ``rmsnorm(x, g, eps)`` (mtpkern.ops.norm.normed)."""
    check_moe_router(x, gate_w, bias, spec)
    logits = np.asarray(normed(x, norm), np.float32) @ np.asarray(gate_w, np.float32).T        # [n, E]
    s = router_scores(logits, spec.scoring)                                      # [n, E]
    c = s + np.asarray(bias, np.float32)                                         # [n, E]
    n, E = c.shape
    G = spec.n_group
    grouped = c.reshape(n, G, E // G)                                            # [n, G, E/G]
    per = min(2, E // G)
    group_score = -np.sort(-grouped, axis=-1)[..., :per].sum(axis=-1)            # [n, G]
    keep = _top(group_score, spec.topk_group)                                    # [n, topk_group]
    mask = np.zeros((n, G), bool)
    np.put_along_axis(mask, keep, True, axis=1)
    c = np.where(np.repeat(mask, E // G, axis=1), c, np.float32(-np.inf))   # dropped groups: -inf
    ids = _top(c, spec.top_k)                                                    # [n, K]
    w = np.take_along_axis(s, ids, axis=1)                                       # [n, K]
    if spec.norm_topk_prob:
        w = w / (w.sum(axis=-1, keepdims=True) + np.float32(1e-20))
    w = w * np.float32(spec.routed_scaling_factor)
    return ids.astype(np.int32), w.astype(np.float32)


def check_moe_experts(x, ids, weights, w13, w2, residual, activation="swiglu") -> None:
    expect_ndim("x", x, 2)
    n, H = x.shape
    expect_ndim("ids", ids, 2)
    expect_dtype("ids", ids, "int32")
    expect_shape("weights", weights, tuple(ids.shape))
    if ids.shape[0] != n:
        raise ValueError(f"ids: expected [{n}, K], got {list(ids.shape)}")
    expect_ndim("w13", w13, 3)
    E, I2, H_ = w13.shape
    g = gated_rows(activation_name(activation))
    if H_ != H or I2 % g:
        raise ValueError(f"w13: expected [E, {'2I' if g == 2 else 'I'}, {H}] ({activation}), got {list(w13.shape)}")
    expect_shape("w2", w2, (E, H, I2 // g))
    if residual is not None:
        expect_shape("residual", residual, (n, H))


def moe_experts(x, ids, weights, w13, w2, residual=None, *, limit=None, clamp_gate=False, norm=None,
                activation="swiglu", situ_beta=0.0, situ_linear_beta=0.0) -> np.ndarray:
    """``norm=(g [H], eps)``: the experts of ``rmsnorm(x, g, eps)`` (mtpkern.ops.norm.normed);
    the residual stays as given (it may be x itself). ``activation="relu2"``: w13 is [E, I, H]."""
    check_moe_experts(x, ids, weights, w13, w2, residual, activation)
    check_activation(activation, limit, situ_beta, situ_linear_beta)
    E = w13.shape[0]
    if ids.size and not (-1 <= ids.min() and ids.max() < E):     # the reference indexes with them
        bad = ids[(ids < -1) | (ids >= E)][0]
        raise ValueError(f"ids: expected values in [-1, {E}) (-1: an empty slot), got {int(bad)}")
    L = swiglu_limit(limit)
    clamp_gate = check_clamp_gate(clamp_gate)
    x = np.asarray(normed(x, norm), np.float32)
    n, H = x.shape
    y = np.zeros((n, H), np.float32) if residual is None else np.array(residual, np.float32)
    for r in range(n):
        for k in range(ids.shape[1]):
            e = int(ids[r, k])
            if e < 0:                                                  # an empty slot
                continue
            gu = np.asarray(w13[e], np.float32) @ x[r]                 # [2I] (relu2: [I])
            act = gated_act(gu, activation, L, clamp_gate=clamp_gate, situ_beta=situ_beta,
                            situ_linear_beta=situ_linear_beta)                            # [I]
            y[r] += np.float32(weights[r, k]) * (np.asarray(w2[e], np.float32) @ act)
    return y
