"""Launchers of the LM head: ``lm_head_logits`` (``linear_kernel``) and
``lm_head_argmax`` (kernels/lm_head.cu, GEMV + masked argmax, logits never stored).

``lm_head_logits(x [n, H], w [V, H]) -> [n, V]`` FP32.

``lm_head_argmax(x [n, H], w [V, H], bitmask [n, ceil(V / 32)] int32 | None, *, id_map [V]
int32 | None) -> ids [n] int32`` (through ``id_map`` when given: a draft vocabulary's rows
to target ids, -1 staying -1): ties to the lowest id, NaN never wins, bit ``j & 31`` of
word ``j >> 5`` allows token j, padding bits past V are ignored. Workspaces
``part_v [n, P]`` FP32 / ``part_i [n, P]`` int32 with ``P = num_partials(V, sm_count())``:
the first stage is a persistent grid of one block per resident slot (its instantiation's
registers say how many fit an SM, at most 16 of 128 threads), each block a contiguous
share of the vocabulary, so a launch fills the first ``P' <= P`` columns.

``conf [n]`` FP32 (keyword, optional; written in place): the drafter's probability of
its draft, ``conf[r] = 1 / sum_{j allowed, l_j not NaN} exp(l_j - l_ids[r])``, the
softmax over the row's allowed logits at the winner (NaN for a row without a
candidate). An online log-sum-exp in both stages (the ``CONF`` instantiations), with
one more workspace ``part_s [n, P]`` FP32; without ``conf`` the kernels are the plain
argmax's and ``part_s`` must not be passed.

``lm_head_sample(x, w, bitmask, *, keys, temperature, top_k, top_p, id_map, dist)`` -> (ids [n]
int32, probs [n] FP32): sampled drafts (spec: mtpkern.ops.sampling), everything on the device.
When every row is temperature-only (top_k == 0, top_p == 1) and ``dist`` is not asked, the
draw is fused into the GEMV (``lm_head_sample_fused``: the argmax's two stages with a Gumbel
epilogue, the [n, V] logits never written); when every row has 1 <= top_k <= MAX_TOPK (any
top_p), likewise from per-block top-k partials (``_sample_fused_topk``); otherwise the logits
(``linear_kernel``) then ``sample_kernel`` (kernels/sampling.cu: one block per row, radix
selects for top_k / top_p, which need the whole row's rank order, the Gumbel-max draw);
``dist`` [n, V] FP32 (optional, a device buffer): the whole q.

A row with no allowed, non-NaN token comes back as -1; with ``check=True``
(default) the launcher copies ids to the host (a synchronisation) and raises
``NoAllowedToken`` naming the row. Inside a CUDA-graph capture pass
``check=False`` and call :func:`raise_if_no_allowed` on the ids afterwards.
"""

from __future__ import annotations

import numpy as np

from ...errors import NoAllowedToken, no_token_reason
from ...ops._check import expect_ndim, expect_shape
from ...ops.lm_head import MAX_TOPK, check_bitmask, check_id_map, check_topk
from ...ops.sampling import check_keys
from ._util import (SM_WARPS, cdiv, ctype, device, device_weight, expect_weight, i32, optional, output, ptr,
                    resident_blocks, sm_count, weight_args)
from .linear import GEMV_THREADS, GEMV_WARPS, gemv_rows, launch_linear
from .loader import get_kernel

FINAL_THREADS = 256
#: sample_kernel's block (kernels/sampling.cu kSampleThreads)
SAMPLE_THREADS = 256
#: most blocks of GEMV_THREADS an SM holds (its 64 warps): the partials' width per SM
MAX_BLOCKS_PER_SM = SM_WARPS // GEMV_WARPS


def _blocks_for(V: int) -> int:
    """Blocks with work for a V-row head: one row pair per warp at least."""
    return cdiv(cdiv(V, 2), GEMV_WARPS)


def num_partials(V: int, sms: int) -> int:
    """Columns P of the first stage's workspaces for a V-row head on ``sms`` SMs: the most
    blocks any instantiation launches (16 per SM, or fewer when V is small)."""
    return max(1, min(_blocks_for(V), MAX_BLOCKS_PER_SM * sms))


def _check(x, w) -> None:
    expect_ndim("x", x, 2)
    expect_shape("w", w, (None, x.shape[1]))
    expect_weight("w", w)


def lm_head_logits(x, w, *, out=None):
    """-> logits [n, V] FP32."""
    _check(x, w)
    x, w = device(x, "x", "float32"), device_weight(w, "w")
    y = output(out, "out", (x.shape[0], w.shape[0]), np.float32)
    launch_linear(x, w, None, None, y)
    return y


def lm_head_argmax(x, w, bitmask=None, *, out=None, part_v=None, part_i=None, part_s=None, conf=None,
                   id_map=None, check: bool = True, best=None, sum_exp=None):
    """-> ids [n] int32 (see the module doc for ``check``, ``conf`` and the workspaces; ``best`` /
    ``sum_exp``: FP32 [n] outputs of a vocabulary shard's partial result, mtpkern.ops.lm_head,
    which leave rows without a candidate at -1 unchecked)."""
    _check(x, w)
    n, H = x.shape
    V = w.shape[0]
    if V < 1:
        raise ValueError("w: expected at least one vocabulary row, got 0")
    if bitmask is not None:
        check_bitmask(bitmask, n, V)
    if part_s is not None and conf is None:
        raise ValueError("part_s: the confidence workspace is used only with conf=; got part_s without conf")
    if id_map is not None:
        check_id_map(id_map, V)
    x, w = device(x, "x", "float32"), device_weight(w, "w")
    bitmask = optional(bitmask, "bitmask", "int32")
    id_map = optional(id_map, "id_map", "int32")
    sms = sm_count()
    P = num_partials(V, sms)
    ids = output(out, "out", (n,), np.int32)
    part_v = output(part_v, "part_v", (n, P), np.float32)
    part_i = output(part_i, "part_i", (n, P), np.int32)
    if best is not None or sum_exp is not None:
        check = False                        # a shard may hold none of a row's allowed tokens
        best = None if best is None else output(best, "best", (n,), np.float32)
        sum_exp = None if sum_exp is None else output(sum_exp, "sum_exp", (n,), np.float32)
    want_conf = conf is not None or sum_exp is not None     # the sums are the confidence's pass
    if want_conf:
        conf = output(conf, "conf", (n,), np.float32)
        part_s = output(part_s, "part_s", (n, P), np.float32)
    if n == 0:
        return ids
    c = "true" if want_conf else "false"
    partial = get_kernel("lm_head", f"lm_head_argmax_partial_kernel<{ctype(w)}, {c}, {gemv_rows(n)}>")
    # persistent: one wave of the blocks the SMs hold at once (each an equal share of V)
    used = min(resident_blocks(partial, GEMV_THREADS) * sms, P)
    partial((used,), (GEMV_THREADS,), (x, *weight_args(w), ptr(bitmask), part_v, part_i, ptr(part_s), i32(n),
                                       i32(V), i32(H), i32(used), i32(P)))
    final = get_kernel("lm_head", f"argmax_final_kernel<{c}>")
    final((n,), (FINAL_THREADS,), (part_v, part_i, ptr(part_s), i32(used), i32(P), ids, ptr(conf), ptr(id_map),
                                          ptr(best), ptr(sum_exp)))
    if check:
        raise_if_no_allowed(ids, V, bitmask is not None)
    return ids


def lm_head_topk(x, w, bitmask=None, k=1, *, id_map=None, out=None, probs=None, logits=None, check=True):
    """-> (ids [n, k] int32, probs [n, k] FP32) on the device: the logits (``linear_kernel``),
    then ``masked_topk_kernel`` (kernels/lm_head.cu; spec: mtpkern.ops.lm_head.masked_topk).
    Raises ``NoAllowedToken`` for a row without a candidate (a host read of column 0) when
    ``check``; a captured tree step passes ``out`` / ``probs`` / ``logits`` [n, V] and
    ``check=False`` (no allocation, no read back)."""
    _check(x, w)
    k = check_topk(k)
    n, V = x.shape[0], w.shape[0]
    if V < 1:
        raise ValueError("w: expected at least one vocabulary row, got 0")
    if bitmask is not None:
        check_bitmask(bitmask, n, V)
    if id_map is not None:
        check_id_map(id_map, V)
    logits = lm_head_logits(x, w, out=logits)
    bitmask = optional(bitmask, "bitmask", "int32")
    id_map = optional(id_map, "id_map", "int32")
    ids = output(out, "out", (n, k), np.int32)
    probs = output(probs, "probs", (n, k), np.float32)
    if n == 0:
        return ids, probs
    assert k <= MAX_TOPK <= 64                 # win_v / win_i in the kernel's shared memory
    get_kernel("lm_head", "masked_topk_kernel")((n,), (FINAL_THREADS,), (logits, ptr(bitmask), i32(V), i32(k), ids,
                                                                         probs, ptr(id_map)))
    if check:
        raise_if_no_allowed(ids[:, 0], V, bitmask is not None)
    return ids, probs


def _row_params(n: int, temperature, top_k, top_p) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The per-row sampling parameters, host arrays checked as the kernel assumes them."""
    out = []
    for name, a, dt in (("temperature", temperature, np.float64), ("top_k", top_k, np.int32),
                        ("top_p", top_p, np.float64)):
        a = np.asarray(a.get() if hasattr(a, "get") else a)
        expect_shape(name, a, (n,))
        out.append(np.ascontiguousarray(a, dt))
    T, K, P = out
    if not (np.isfinite(T) & (T > 0)).all():
        raise ValueError(f"temperature: expected finite values > 0, got {T.tolist()}")
    if (K < 0).any():
        raise ValueError(f"top_k: expected values >= 0 (0: no limit), got {K.tolist()}")
    if not ((P > 0) & (P <= 1)).all():
        raise ValueError(f"top_p: expected values in (0, 1], got {P.tolist()}")
    return T, K, P


def lm_head_sample(x, w, bitmask=None, *, keys, temperature, top_k, top_p, id_map=None, dist=None):
    """-> (ids [n] int32, probs [n] FP32) on the device: ``masked_sample(lm_head_logits(x, w), ...)``
    (checked before the logits are computed). A call whose rows are all temperature-only
    (top_k == 0, top_p == 1) without ``dist`` takes :func:`lm_head_sample_fused`, one whose rows
    all have 1 <= top_k <= MAX_TOPK ``_sample_fused_topk`` (the [n, V] logits never written);
    top_p without top_k needs the whole row's rank order, dist is [n, V] anyway: those calls,
    and calls mixing rows of the two fused kinds, take the logits and ``sample_kernel``."""
    _check(x, w)
    n, V = x.shape[0], w.shape[0]
    if V < 1:
        raise ValueError("w: expected at least one vocabulary row, got 0")
    keys, T, K, P = _sample_args(n, V, bitmask, id_map, keys, temperature, top_k, top_p, dist)
    if dist is None and not K.any() and (P == 1.0).all():
        return _sample_fused(x, w, bitmask, keys, T, id_map, True)
    if dist is None and ((K >= 1) & (K <= MAX_TOPK)).all():
        return _sample_fused_topk(x, w, bitmask, keys, T, K, P, id_map)
    return masked_sample(lm_head_logits(x, w), bitmask, keys=keys, temperature=temperature, top_k=top_k,
                         top_p=top_p, id_map=id_map, dist=dist)


def lm_head_sample_fused(x, w, bitmask=None, *, keys, temperature, id_map=None, check: bool = True):
    """-> (ids [n] int32, probs [n] FP32) on the device: temperature-only sampled drafts (top_k = 0,
    top_p = 1; spec: mtpkern.ops.sampling) drawn in the LM head's epilogue, never writing the
    logits: ``lm_head_sample_partial_kernel`` (the argmax's persistent GEMV, each lane keeping
    its row's best Gumbel score and an online FP64 sum of exp(z - max z)) into workspaces
    ``part_d [4, n, P]`` FP64 / ``part_i [n, P]`` int32, then ``sample_final_kernel``.
    Raises ``NoAllowedToken`` for a row without a candidate (a host read of ids) when ``check``;
    with ``check=False`` such a row comes back as -1 (probs 0), nothing read back."""
    _check(x, w)
    n, V = x.shape[0], w.shape[0]
    if V < 1:
        raise ValueError("w: expected at least one vocabulary row, got 0")
    keys, T, _, _ = _sample_args(n, V, bitmask, id_map, keys, temperature, np.zeros(n, np.int32), np.ones(n), None)
    return _sample_fused(x, w, bitmask, keys, T, id_map, check)


def _fused_operands(x, w, bitmask, id_map) -> tuple:
    """A fused draw's device operands (x, w, bitmask, id_map) and its outputs ids [n] int32,
    probs [n] FP32."""
    n = x.shape[0]
    return (device(x, "x", "float32"), device_weight(w, "w"), optional(bitmask, "bitmask", "int32"),
            optional(id_map, "id_map", "int32"), output(None, "ids", (n,), np.int32),
            output(None, "probs", (n,), np.float32))


def _sample_fused(x, w, bitmask, keys: np.ndarray, T: np.ndarray, id_map, check: bool):
    """``lm_head_sample_fused`` after its checks (keys [n] uint64, T [n] FP64 host arrays)."""
    x, w, bitmask, id_map, ids, probs = _fused_operands(x, w, bitmask, id_map)
    (n, H), V = x.shape, w.shape[0]
    if n == 0:
        return ids, probs
    sms = sm_count()
    P = num_partials(V, sms)
    part_d = output(None, "part_d", (4, n, P), np.float64)
    part_i = output(None, "part_i", (n, P), np.int32)
    partial = get_kernel("lm_head", f"lm_head_sample_partial_kernel<{ctype(w)}, {gemv_rows(n)}>")
    used = min(resident_blocks(partial, GEMV_THREADS) * sms, P)   # persistent, as lm_head_argmax
    partial((used,), (GEMV_THREADS,), (x, *weight_args(w), ptr(bitmask), device(keys, "keys", "uint64"),
                                       device(T, "temperature", "float64"), ptr(id_map), part_d, part_i, i32(n),
                                       i32(V), i32(H), i32(used), i32(P)))
    get_kernel("lm_head", "sample_final_kernel")((n,), (FINAL_THREADS,), (part_d, part_i, i32(n), i32(used), i32(P),
                                                                          ptr(id_map), ids, probs))
    if check:
        raise_if_no_allowed(ids, V, bitmask is not None)
    return ids, probs


def _sample_fused_topk(x, w, bitmask, keys: np.ndarray, T: np.ndarray, K: np.ndarray, P: np.ndarray, id_map):
    """Sampled drafts of rows whose top_k are all in [1, MAX_TOPK] (any top_p), checked host arrays:
    ``lm_head_topk_partial_kernel`` (the argmax's persistent GEMV, each block keeping a row's best
    ``k = max top_k`` candidates) into ``part_v`` / ``part_i [n, P, k]``, then
    ``topk_sample_final_kernel`` (a row's top_k of those, top_p and the draw in rank order)."""
    x, w, bitmask, id_map, ids, probs = _fused_operands(x, w, bitmask, id_map)
    (n, H), V = x.shape, w.shape[0]
    if n == 0:
        return ids, probs
    k = int(K.max())
    sms = sm_count()
    cols = num_partials(V, sms)
    part_v = output(None, "part_v", (n, cols, k), np.float32)
    part_i = output(None, "part_i", (n, cols, k), np.int32)
    partial = get_kernel("lm_head", f"lm_head_topk_partial_kernel<{ctype(w)}, {gemv_rows(n)}>")
    used = min(resident_blocks(partial, GEMV_THREADS) * sms, cols)   # persistent, as lm_head_argmax
    partial((used,), (GEMV_THREADS,), (x, *weight_args(w), ptr(bitmask), part_v, part_i, i32(n), i32(V), i32(H),
                                       i32(used), i32(cols), i32(k)))
    args = (part_v, part_i, i32(used), i32(cols), i32(k), device(keys, "keys", "uint64"),
            device(T, "temperature", "float64"), device(K, "top_k", "int32"), device(P, "top_p", "float64"),
            ptr(id_map), ids, probs)
    get_kernel("lm_head", "topk_sample_final_kernel")((n,), (FINAL_THREADS,), args)
    raise_if_no_allowed(ids, V, bitmask is not None)
    return ids, probs


def _sample_args(n: int, V: int, bitmask, id_map, keys, temperature, top_k, top_p, dist):
    """The checked host arrays (keys [n] uint64, temperature [n] FP64, top_k [n] int32, top_p
    [n] FP64) of a sampled draw over [n, V] logits."""
    if bitmask is not None:
        check_bitmask(bitmask, n, V)
    if id_map is not None:
        check_id_map(id_map, V)
    keys = check_keys(keys.get() if hasattr(keys, "get") else keys, n)
    T, K, P = _row_params(n, temperature, top_k, top_p)
    if dist is not None:
        output(dist, "dist", (n, V), np.float32)
    return keys, T, K, P


def masked_sample(logits, bitmask=None, *, keys, temperature, top_k, top_p, id_map=None, dist=None):
    """-> (ids [n] int32, probs [n] FP32) on the device: ``sample_kernel`` over device logits
    [n, V] FP32 (spec: mtpkern.ops.sampling.masked_sample; the rest as ``lm_head_sample``).
    Raises ``NoAllowedToken`` for a row without a candidate (a host read of ids)."""
    expect_ndim("logits", logits, 2)
    n, V = logits.shape
    if V < 1:
        raise ValueError("logits: expected at least one column, got 0")
    keys, T, K, P = _sample_args(n, V, bitmask, id_map, keys, temperature, top_k, top_p, dist)
    logits = device(logits, "logits", "float32")
    dist = None if dist is None else output(dist, "dist", (n, V), np.float32)
    ids = output(None, "ids", (n,), np.int32)
    probs = output(None, "probs", (n,), np.float32)
    if n == 0:
        return ids, probs
    bitmask = optional(bitmask, "bitmask", "int32")
    id_map = optional(id_map, "id_map", "int32")
    args = (logits, ptr(bitmask), i32(V), device(keys, "keys", "uint64"), device(T, "temperature", "float64"),
            device(K, "top_k", "int32"), device(P, "top_p", "float64"), ptr(id_map), ids, probs, ptr(dist))
    get_kernel("sampling", "sample_kernel")((n,), (SAMPLE_THREADS,), args)
    raise_if_no_allowed(ids, V, bitmask is not None)
    return ids, probs


def raise_if_no_allowed(ids, V: int, masked: bool = True) -> None:
    """Raise ``NoAllowedToken`` for the first row whose id is -1 (copies ids to the host)."""
    host = ids.get() if hasattr(ids, "get") else np.asarray(ids)
    bad = np.flatnonzero(host < 0)
    if bad.size:
        raise NoAllowedToken(f"row {int(bad[0])}: {no_token_reason(masked, V)}", row=int(bad[0]))
