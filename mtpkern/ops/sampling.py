"""Sampled drafts: each draft drawn from the drafter's distribution, with its probability.

An engine that samples (temperature > 0) verifies drafts by rejection sampling: it accepts a
draft ``d`` with probability ``min(1, p_target(d) / q(d))`` and, on a rejection, resamples from
``max(0, p_target - q)`` normalised. It needs ``d ~ q`` and ``q(d)``; argmax drafts with
``q = 1`` accept rarely (docs/api.md has the loop).

``SamplingParams(temperature, top_k=0, top_p=1.0, seed=0)``, per sequence. The draft
distribution ``q`` of one row (FP32 logits ``l [V]``, allowed set ``A``: the grammar-allowed
tokens whose logit is not NaN, as ``mtpkern.ops.lm_head``), all in FP64:

1. ``z_v = l_v / T`` (one IEEE division).
2. ``K``: ``A`` ordered by logit descending, ties to the lower id; its first ``top_k``
   (all of it when ``top_k == 0``).
3. Weights over ``K``, ``m = max z``: ``w_v = exp(z_v - m)`` when ``m`` is finite (0 at
   ``z_v = -inf``); ``w_v = [z_v = +inf]`` when ``m = +inf``; ``w_v = 1`` when every ``z`` is
   ``-inf``.
4. ``P``: with ``top_p < 1``, the shortest prefix of ``K`` (same order) whose running sum
   of ``w`` (added in that order) reaches ``top_p * sum_K w``; at least one token. Tokens tied
   at the boundary are split by the order: the lower ids are kept. ``P = K`` when
   ``top_p == 1``.
5. ``q_v = w_v / sum_P w`` on ``P``, 0 elsewhere.

The draw is the Gumbel-max trick, exact for this ``q``: ``draft = argmax_{v in P, w_v > 0}
(s_v + g_v)``, ``s_v = z_v`` when ``m`` is finite (else 0), ``g_v = -log(-log(u_v))``, ties to
the lowest id. ``u_v`` in (0, 1) is a counter-based hash (``token_uniform``) of the row's key
and the token id the call returns (the target id under a draft vocabulary's ``id_map``), the
key a hash of ``(seed, position, draft step)`` (``row_key``): 64-bit integer arithmetic that
NumPy, Numba and CUDA compute alike, so every backend draws the same draft for the same call
(the FP64 scores agree to a few ulps: two scores that close could differ, about 1e-15 of
calls), every call with the same key draws the same one, and a token's noise does not depend
on which other tokens a grammar mask or a draft vocabulary keeps. The probability returned is
``q_draft`` (FP32); ``top_k == 1`` gives the greedy draft (``masked_argmax``) with ``q = 1``.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from ..errors import NoAllowedToken, no_token_reason
from ._check import expect_shape
from .lm_head import _candidates, lm_head_logits

#: splitmix64's constants: the golden-ratio increment and the two finaliser multipliers
GOLDEN = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB
_M64 = (1 << 64) - 1


@dataclasses.dataclass(frozen=True, slots=True)
class SamplingParams:
    """One sequence's draft sampling: ``temperature`` > 0 (finite), ``top_k`` >= 0 (0: no
    limit), ``top_p`` in (0, 1], ``seed`` an int in [0, 2^64)."""

    temperature: float
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        t = self.temperature
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, float, np.integer, np.floating)) \
                or not (math.isfinite(float(t)) and float(t) > 0.0):
            raise ValueError(f"temperature: expected a finite number > 0, got {t!r}")
        k = self.top_k
        if isinstance(k, (bool, np.bool_)) or not isinstance(k, (int, np.integer)) or not 0 <= k <= 2**31 - 1:
            raise ValueError(f"top_k: expected an int in [0, 2^31) (0: no limit), got {k!r}")
        p = self.top_p
        if isinstance(p, (bool, np.bool_)) or not isinstance(p, (int, float, np.integer, np.floating)) \
                or not 0.0 < float(p) <= 1.0:
            raise ValueError(f"top_p: expected a number in (0, 1], got {p!r}")
        s = self.seed
        if isinstance(s, (bool, np.bool_)) or not isinstance(s, (int, np.integer)) or not 0 <= s <= _M64:
            raise ValueError(f"seed: expected an int in [0, 2^64), got {s!r}")
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_k", int(k))
        object.__setattr__(self, "top_p", float(p))
        object.__setattr__(self, "seed", int(s))


def mix64(x: int) -> int:
    """splitmix64's finaliser on a Python int (mod 2^64)."""
    x &= _M64
    x = ((x ^ (x >> 30)) * MIX1) & _M64
    x = ((x ^ (x >> 27)) * MIX2) & _M64
    return x ^ (x >> 31)


def row_key(seed: int, position: int, step: int) -> int:
    """The key of draft step ``step`` of a propose at ``position`` (a uint64 as an int)."""
    k = mix64(seed + GOLDEN)
    k = mix64(k + (position + 1) * GOLDEN)
    return mix64(k + (step + 1) * GOLDEN)


def row_keys(params, position, step: int) -> np.ndarray:
    """[n] uint64: ``row_key`` per row (``params``: n ``SamplingParams``, ``position``: n ints)."""
    return np.array([row_key(sp.seed, int(p), step) for sp, p in zip(params, position)], np.uint64)


def token_uniform(keys, ids) -> np.ndarray:
    """[n, V] FP64 in (0, 1): ``u = (mix64(key + (id + 1) * GOLDEN) >> 11 + 0.5) * 2^-53`` for
    ``keys`` [n] uint64 and ``ids`` [V] (the ids the tokens are returned as)."""
    keys = np.asarray(keys, np.uint64)[:, None]
    ids = np.asarray(ids, np.int64).astype(np.uint64)[None, :]
    with np.errstate(over="ignore"):                                     # uint64 arithmetic wraps, as meant
        x = keys + (ids + np.uint64(1)) * np.uint64(GOLDEN)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(MIX1)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(MIX2)
        x = x ^ (x >> np.uint64(31))
    return ((x >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53


def gumbel(keys, ids) -> np.ndarray:
    """[n, V] FP64: ``-log(-log(u))`` of ``token_uniform``."""
    return -np.log(-np.log(token_uniform(keys, ids)))


def check_params(name: str, params, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``params``: n ``SamplingParams`` -> (temperature [n] FP64, top_k [n] int32, top_p [n] FP64)."""
    if len(params) != n or not all(isinstance(sp, SamplingParams) for sp in params):
        raise TypeError(f"{name}: expected {n} SamplingParams, got {params!r}")
    return (np.array([sp.temperature for sp in params], np.float64),
            np.array([sp.top_k for sp in params], np.int32),
            np.array([sp.top_p for sp in params], np.float64))


def check_keys(keys, n: int) -> np.ndarray:
    keys = np.asarray(keys)
    if keys.shape != (n,) or keys.dtype != np.uint64:
        raise ValueError(f"keys: expected [{n}] uint64, got {list(keys.shape)} {keys.dtype}")
    return keys


def row_distribution(l, cand, temperature: float, top_k: int, top_p: float):
    """One row's ``q`` (module docstring): (kept ids [c] ascending by rank, their weights
    ``w`` [c] FP64, their scores ``s`` [c] FP64) for the logits ``l`` [V] FP32 and the
    candidate ids ``cand`` (ascending)."""
    order = cand[np.lexsort((cand, -l[cand].astype(np.float64)))]        # logit desc, ties lower id
    if top_k > 0:
        order = order[:top_k]
    z = l[order].astype(np.float64) / np.float64(temperature)
    m = z.max()
    if np.isfinite(m):
        w, s = np.exp(z - m), z                                          # exp(-inf) = 0
    else:
        w, s = (z == m).astype(np.float64) if m > 0 else np.ones_like(z), np.zeros_like(z)
    if top_p < 1.0:
        run = np.cumsum(w)                                               # added in rank order
        c = int(np.argmax(run >= top_p * run[-1])) + 1                   # the first prefix reaching it
        order, w, s = order[:c], w[:c], s[:c]
    return order, w, s


def masked_sample(logits, bitmask, keys, temperature, top_k, top_p, id_map=None,
                  want_dist: bool = False):
    """(ids [n] int32, probs [n] FP32, dist [n, V] FP32 or None): each row's sampled draft
    (in returned ids: ``id_map[v]`` with a draft vocabulary), its ``q`` and, asked, the whole
    ``q`` (over the head's rows). ``keys`` [n] uint64 (``row_keys``); ``temperature`` /
    ``top_p`` [n] FP64, ``top_k`` [n] int (``check_params``). A row with no candidate raises
    ``NoAllowedToken``."""
    lg, ok = _candidates(logits, bitmask)
    n, V = lg.shape
    keys = check_keys(keys, n)
    for name, a in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p)):
        expect_shape(name, np.asarray(a), (n,))
    noise_ids = np.arange(V) if id_map is None else np.asarray(id_map)
    g = gumbel(keys, noise_ids)                                          # [n, V]
    ids = np.empty(n, np.int32)
    probs = np.empty(n, np.float32)
    dist = np.zeros((n, V), np.float32) if want_dist else None
    for r in range(n):
        cand = np.flatnonzero(ok[r])
        if cand.size == 0:
            raise NoAllowedToken(f"row {r}: {no_token_reason(bitmask is not None, V)}", row=r)
        kept, w, s = row_distribution(lg[r], cand, float(temperature[r]), int(top_k[r]), float(top_p[r]))
        live = w > 0
        score = np.where(live, s + g[r, kept], -np.inf)
        best = score.max()
        j = int(np.flatnonzero(score == best)[np.argmin(kept[score == best])])    # ties: lowest id
        total = np.cumsum(w)[-1]                                         # added in rank order
        ids[r] = kept[j]
        probs[r] = w[j] / total
        if want_dist:
            dist[r, kept] = w / total
    mapped = ids if id_map is None else np.asarray(id_map)[ids].astype(np.int32)
    return mapped, probs, dist


def lm_head_sample(x, w, bitmask, keys, temperature, top_k, top_p, id_map=None, want_dist: bool = False):
    """``masked_sample(lm_head_logits(x, w), ...)``."""
    return masked_sample(lm_head_logits(x, w), bitmask, keys, temperature, top_k, top_p, id_map, want_dist)
