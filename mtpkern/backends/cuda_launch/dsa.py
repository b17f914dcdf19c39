"""Launchers of kernels/dsa.cu: ``dsa_key_write`` and ``dsa_select`` (spec: mtpkern/ops/dsa.py).

``dsa_key_write(k [n, Di], k_norm_w [Di], k_norm_b [Di], eps, inv_freq [R/2], positions [n] int32,
index_cache [NB, BS, Di], slots [n] int32, *, q [n, Hi, Di] | None, interleave, rope_scale, out, gate)
-> None | q roped [n, Hi, Di]`` FP32: ``dsa_key_write_kernel``, one launch. The index cache
(BF16 bits in uint16, or FP32: the backend's KV dtype, as ``empty_latent_kv`` makes it) is
written in place; with ``gate [n, Di]`` (a pooled indexer's gate scores, FP32 or BF16) its rows
are ``[NB, BS, 2 Di]``: the key in columns ``[0, Di)``, the gate scores in ``[Di, 2 Di)``.
Host slots are checked (``slots_refused``) before the launch; device slots are not read back,
and the kernel then writes no row at all when one is outside ``[0, NB * BS)``.

``dsa_select(q [n, Hi, Di] FP32, weights [n, Hi], index_cache, block_tables [S, max_blocks],
row_seq [n], row_len [n], topk, scale, *, row_start, out, scores, kpool, ape, tail) -> out [n, topk]``
int32: two launches on one stream,

- ``dsa_score_kernel`` into the workspace ``scores [n, cap]`` FP32 (``cap = max_blocks * BS``;
  row ``r``'s visible rows at their row numbers), skipped when ``cap <= topk`` (then every row
  lists all it sees and no score is needed: ``workspace_shapes`` is empty);
- ``dsa_topk_kernel<KPT>`` (the smallest KPT of ``loader.DSA_KPT`` with ``512 KPT >= cap``, from
  the shapes only) writes ``out``.

With ``kpool`` P >= 2 (GLM-5.3's pooled indexer; ``index_cache [NB, BS, 2 Di]``, ``ape [P, Di]``
FP32, ``tail``) ``out`` is ``[n, list_width(topk, P, tail)]`` and the launches are

- ``dsa_pool_score_kernel`` into ``scores [n, cap // P]`` FP32: row ``r``'s score of each of its
  ``row_len // P`` complete pools, each pool's key pooled from its P rows as it is read; skipped
  when ``(cap // P) * P <= topk`` (every row lists every complete pool);
- ``dsa_topk_kernel<KPT>`` over the pools (``topk / P`` of them, KPT from ``cap // P``), each
  pick written as its P rows, then the tail's rows (with ``tail``) and -1s.

Given ``out`` and ``scores`` as contiguous device arrays, nothing allocates (CUDA-graph capture).
Host ``row_len`` / ``row_start`` are checked as the reference checks them (``0 <= row_start <
row_len``); device ones are not read back (a row with nothing to see then gets only -1s).
Not checked (device data, as ``paged_attention``): the block table entries of the blocks
holding rows row_start .. row_len - 1 in ``[0, NB)`` (the others are never read).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...ops._check import expect_dtype
from ...ops.dsa import check_dsa_key_write, check_dsa_select, list_width
from ...ops.mla import slots_refused
from ._util import (NULL, cdiv, ctype, device, expect_disjoint, expect_grid_yz, f32, i32, inplace, is_device_array,
                    opt_in_smem, optional, output, ptr, sm_count, smem_optin)
from .loader import DSA_KPT, get_kernel
from .mla import _as_checked, _f32

#: kDsaWriteThreads / kDsaScoreThreads / kDsaTopkThreads in dsa.cu
WRITE_THREADS = 256
SCORE_THREADS = 256
TOPK_THREADS = 512
#: rows per score tile (halved while shared memory is over); tiles per score block where the grid
#: fills the device with them (else one: a short context or a single query row spreads wider)
TILE = 64
CHUNK_TILES = 4
#: dynamic shared memory a plan stays within without the opt-in attribute
SMEM_LIMIT = 48 * 1024


@dataclass(frozen=True, slots=True)
class ScorePlan:
    tile: int        # key rows per shared-memory tile (64, 32 or 16)
    chunk: int       # rows per score block: CHUNK_TILES tiles, or one
    smem_bytes: int  # dynamic shared memory of a score block


def score_smem_bytes(Hi: int, Di: int, tile: int, kv_itemsize: int, pooled: bool = False) -> int:
    """Dynamic shared memory of a ``dsa_score_kernel`` block: q [Hi][Dq] FP32, the scaled weights
    [Hi rounded up to 4], the head groups' parts [256], slots [tile], key rows [tile][Dq + 8] in
    the cache's element type (``Dq`` = Di rounded up to 8). ``pooled``: a ``dsa_pool_score_kernel``
    block's, the same without the slots and with FP32 pooled keys (``kv_itemsize`` unused)."""
    Dq = cdiv(Di, 8) * 8
    if pooled:
        return 4 * (Hi * Dq + cdiv(Hi, 4) * 4 + SCORE_THREADS) + tile * (Dq + 8) * 4
    return 4 * (Hi * Dq + cdiv(Hi, 4) * 4 + SCORE_THREADS + tile) + tile * (Dq + 8) * kv_itemsize


def score_plan(Hi: int, Di: int, n: int, cap: int, kv_itemsize: int = 2, target_blocks: int = 0,
               smem_max: int = SMEM_LIMIT, pooled: bool = False) -> ScorePlan:
    """The score kernel's tile: 64 rows, halved (to 16 at least) while the block's shared memory
    is over ``max(48 KiB, smem_max)``; past that ValueError (q [Hi, Di] alone too large).
    DeepSeek-V3.2's Hi 64, Di 128: 51 KB with a BF16 cache, 69 KB with FP32 (opt-in). A block
    takes ``CHUNK_TILES`` tiles (q staged once for 256 rows) when ``n * ceil(cap / chunk)`` blocks
    are at least ``target_blocks`` (the launcher: 2 per SM), else one tile: one decode row at
    32768 rows gets 512 blocks of 64 rows, not 128 of 256 (from the shapes only). ``pooled``: the
    pool score kernel's plan, ``cap`` then counting pools (GLM-5.3's Hi 32, Di 128: 52 KB, opt-in)."""
    limit = max(SMEM_LIMIT, smem_max)
    tile = TILE
    while tile > 16 and score_smem_bytes(Hi, Di, tile, kv_itemsize, pooled) > limit:
        tile //= 2
    smem = score_smem_bytes(Hi, Di, tile, kv_itemsize, pooled)
    if smem > limit:
        raise ValueError(f"dsa_select: q of {Hi} heads x {Di} dims needs {smem} B of shared memory on cuda, "
                         f"over this device's {limit}")
    wide = max(1, n) * cdiv(cap, CHUNK_TILES * tile) >= target_blocks
    return ScorePlan(tile, (CHUNK_TILES if wide else 1) * tile, smem)


def topk_kpt(cap: int) -> int:
    """Keys per thread of ``dsa_topk_kernel``: the smallest of ``DSA_KPT`` holding ``cap`` rows in
    registers, else the largest (a longer row reads the rest from ``scores`` at each pass)."""
    return next((k for k in DSA_KPT if TOPK_THREADS * k >= cap), DSA_KPT[-1])


def workspace_shapes(n: int, cap: int, topk: int, kpool: int = 0) -> dict[str, tuple[int, ...]]:
    """The FP32 workspace of ``dsa_select`` (keyword -> shape): ``scores [n, cap]``, none when
    ``cap <= topk`` (no row can see more than ``topk`` rows). With ``kpool`` P: ``scores [n, cap //
    P]`` (a score per complete pool), none when ``(cap // P) * P <= topk``."""
    units = cap // kpool if kpool else cap
    return {"scores": (n, units)} if units * (kpool or 1) > topk else {}


def dsa_key_write(k, k_norm_w, k_norm_b, eps: float, inv_freq, positions, index_cache, slots, *, q=None,
                  interleave: bool = False, rope_scale: float = 1.0, out=None, gate=None):
    """-> None, or q [n, Hi, Di] FP32 with its first R dims rotated (``out``: its buffer)."""
    check_dsa_key_write(k, k_norm_w, k_norm_b, inv_freq, positions, _as_checked(index_cache), slots, interleave,
                        rope_scale, q, gate)
    if q is None and out is not None:
        raise TypeError("out: the roped query's buffer needs q (no q: nothing is returned)")
    cache = inplace(index_cache, "index_cache", "uint16", "float32")
    NB, BS, W = cache.shape
    Di = W if gate is None else W // 2
    if not is_device_array(slots):              # free on the host; a device array is not read back
        err = slots_refused(np.asarray(slots), NB * BS)
        if err is not None:
            raise err
    n, half = k.shape[0], inv_freq.shape[0]
    k = _f32(k, "k")
    norm_w = device(k_norm_w, "k_norm_w", "float32")
    norm_b = device(k_norm_b, "k_norm_b", "float32")
    inv_freq = device(inv_freq, "inv_freq", "float32")
    positions = device(positions, "positions", "int32")
    slots = device(slots, "slots", "int32")
    gate = None if gate is None else _f32(gate, "gate")
    q_out = Hi = None
    if q is not None:
        q = _f32(q, "q")
        Hi = q.shape[1]
        q_out = output(out, "out", tuple(q.shape), np.float32)
        expect_disjoint("out", q_out, "q", q)
    if n == 0:
        return q_out
    il = "true" if interleave else "false"
    kernel = get_kernel("dsa", f"dsa_key_write_kernel<{ctype(cache)}, {il}>")
    kernel((n, 1 if q is None else 2), (WRITE_THREADS,),
           (k, norm_w, norm_b, f32(eps), inv_freq, i32(half), f32(rope_scale), positions, slots, i32(n),
            np.int64(NB * BS), cache, i32(Di), ptr(q), ptr(q_out), i32(Hi or 0), ptr(gate)))
    return q_out


def _check_rows(row_len, row_start) -> None:
    """The reference's refusal of a row with nothing to see, for host arrays only."""
    if is_device_array(row_len) or (row_start is not None and is_device_array(row_start)):
        return
    L = np.asarray(row_len, np.int64)
    start = np.zeros_like(L) if row_start is None else np.asarray(row_start, np.int64)
    bad = np.flatnonzero((L <= 0) | (start < 0) | (start >= L))
    if bad.size:
        r = int(bad[0])
        raise ValueError(f"row_len[{r}] / row_start[{r}]: expected 0 <= row_start < row_len, got {int(start[r])}, "
                         f"{int(L[r])}")


def dsa_select(q, weights, index_cache, block_tables, row_seq, row_len, topk: int, scale: float, *,
               row_start=None, out=None, scores=None, kpool: int = 0, ape=None, tail: bool = True):
    """-> out [n, list_width(topk, kpool, tail)] int32: each row's best ``topk`` visible rows (with
    ``kpool``: the rows of its best ``topk / kpool`` complete pools, then the tail's), ascending,
    -1 padded."""
    check_dsa_select(q, weights, _as_checked(index_cache), block_tables, row_seq, row_len, topk, row_start, kpool,
                     ape, tail)
    expect_dtype("index_cache", index_cache, "uint16", "float32")
    _check_rows(row_len, None if kpool else row_start)
    NB, BS, W = index_cache.shape
    n, Hi, Di = q.shape
    topk, P = int(topk), int(kpool) or 1
    max_blocks = block_tables.shape[1]
    cap = max_blocks * BS
    units = cap // P                                          # rows, or complete pools, a table holds
    kv_itemsize = np.dtype(index_cache.dtype).itemsize
    expect_grid_yz("q rows", n)
    width = list_width(topk, kpool, tail)
    y = output(out, "out", (n, width), np.int32)
    need = units * P > topk                                   # else no row has rows (pools) to rank
    ws = output(scores, "scores", (n, units), np.float32) if need or scores is not None else None
    row_len = device(row_len, "row_len", "int32")
    row_start = None if kpool else optional(row_start, "row_start", "int32")   # pools: no window
    ape = None if not kpool else device(ape, "ape", "float32")
    if n == 0:
        return y
    if need:
        plan = score_plan(Hi, Di, n, units, kv_itemsize, 2 * sm_count(), smem_optin(), pooled=bool(kpool))
        q, weights = _f32(q, "q"), _f32(weights, "weights")
        expect_disjoint("scores", ws, "q", q)
        cache = device(index_cache, "index_cache")
        tables, seqs = device(block_tables, "block_tables"), device(row_seq, "row_seq")
        grid, common = (cdiv(units, plan.chunk), n), (i32(Hi), i32(Di), i32(BS), i32(plan.tile), i32(plan.chunk),
                                                      i32(topk), f32(scale))
        if kpool:
            kernel = get_kernel("dsa", f"dsa_pool_score_kernel<{ctype(cache)}>")
            args = (q, weights, cache, tables, i32(max_blocks), seqs, row_len, ape, i32(P), ws) + common
        else:
            kernel = get_kernel("dsa", f"dsa_score_kernel<{ctype(cache)}>")
            args = (q, weights, cache, tables, i32(max_blocks), seqs, ptr(row_start), row_len, ws) + common
        opt_in_smem(kernel, plan.smem_bytes)
        kernel(grid, (SCORE_THREADS,), args, shared_mem=plan.smem_bytes)
    get_kernel("dsa", f"dsa_topk_kernel<{topk_kpt(units)}>")(
        (n,), (TOPK_THREADS,), (ws if need else NULL, ptr(row_start), row_len, i32(cap), y, i32(topk // P), i32(P),
                                i32(width)))
    return y
