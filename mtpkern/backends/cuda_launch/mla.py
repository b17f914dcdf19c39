"""Launchers of kernels/mla.cu: ``mla_latent_write`` and ``mla_attention_absorbed``.

``mla_latent_write(kv_a [n, L + R], kv_a_norm_w [L], eps, inv_freq [R/2], positions [n] int32,
latent_cache [NB, BS, L + R], slots [n] int32, *, q [n, Hq, P + R] | None, interleave, rope_scale,
out) -> None | q roped [n, Hq, P + R]`` FP32: ``mla_latent_write_kernel``, one launch. ``kv_a``
may be a column slice of a wider device buffer (kv_a_proj_with_mqa | g_proj's output): read in
place, its row stride passed (``device_rows``).
The cache (BF16 bits in uint16, or FP32) is written in place. Host slots are checked
(``slots_refused``) before the launch; device slots are not read back (graph capture),
and the kernel then writes no row at all when one is outside ``[0, NB * BS)``.

``mla_attention_absorbed(q [n, Hq, P + R] FP32, w_uk [Hq, P, L], w_uv [Hq, Dv, L],
latent_cache, block_tables [S, max_blocks], row_seq [n], row_len [n], scale, *, row_start,
out, q_full, o_lat, part_o, part_ml) -> out [n, Hq * Dv]`` FP32: three or four launches
on one stream, through the workspaces

- ``q_full [n, Hq, L + R]`` FP32: ``mla_q_absorb_kernel`` (``w_uk[h]^T q_nope | q_pe``);
- ``o_lat [n, Hq, L]`` FP32: ``mla_attention_kernel`` or ``mla_attention_tc_kernel``
  (:func:`attention_variant`; one partition), or
  ``paged_attention_merge_kernel`` (attention.cu, with ``Dv = L``) over
- ``part_o [n, Hq, num_parts, L]`` / ``part_ml [n, Hq, num_parts, 2]`` FP32 when the
  plan splits the context (``num_parts > 1``; ignored otherwise);

then ``mla_out_kernel`` (``w_uv[h] o_lat``) writes ``out``. Any of them may be None (allocated
here); given all of them (and ``out``) as contiguous device arrays, nothing allocates, as
CUDA-graph capture needs. :func:`plan` + :func:`workspace_shapes` (or
:func:`workspace_floats`) give the sizes for a planned step.

Split-KV: ``num_parts`` comes from the *shapes* (``max_blocks * BS``, ``n``, ``Hq``), never
from row_len, so the launch is graph-capturable. Blocks past a row's length exit at once.

Weights: BF16 bits (uint16) or FP32 from ``prepare_weight``, both of one dtype (FP8 refused).
Not checked (device data, as ``paged_attention``): row_len[r] >= 1, 0 <= row_start[r] <
row_len[r] (a row with nothing to see gets zeros) and the block table entries of the
blocks holding rows row_start .. row_len - 1 in ``[0, NB)`` (the others, e.g. -1 before
a window, are never read).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations
from math import prod
from typing import Literal

import ml_dtypes
import numpy as np

from ...ops._check import dtype_name, expect_dtype, expect_ndim, expect_shape
from ...ops.mla import check_index, check_mla_attention, check_mla_latent_write, slots_refused
from ._util import (NULL, CudaFp8, cdiv, ctype, device, device_rows, expect_disjoint, expect_grid_yz, expect_weight,
                    f32, i32, inplace, is_device_array, opt_in_smem, optional, output, ptr, sm_count, smem_optin)
from .loader import MLA_LPT, get_kernel

#: kMlaWriteThreads / kMlaThreads / the GEMV kernels' 4 warps in mla.cu
WRITE_THREADS = 256
ATTN_THREADS = 256
ABSORB_THREADS = 128
OUT_THREADS = 128
#: kAttnThreads of attention.cu's paged_attention_merge_kernel (reused with Dv = L)
MERGE_THREADS = 128
#: head slots of an attention block (kMlaHeads), floats per row of its p buffer (kMlaPStride)
HEADS = 16
P_STRIDE = 20
#: latent rows per shared-memory tile (halved while the block's shared memory is over the limit)
TILE = 64
#: fewest latent rows a split partition gets (finer splits write more partials than they read)
MIN_PART = 128
#: columns of w_uk per absorb block (kAbsorbSpan), rows of w_uv per out block, query rows per pass
ABSORB_SPAN = 128
OUT_ROWS_PER_BLOCK = 8
ROWS = 8
#: dynamic shared memory a plan stays within without the opt-in attribute
SMEM_LIMIT = 48 * 1024
#: largest P: the absorb kernel keeps 8 rows of q_nope in shared memory (32 KB)
MAX_P = 1024


#: the two attention kernels: FP32 FMAs (mla_attention_kernel) or BF16 tensor cores (mla_attention_tc_kernel)
Variant = Literal["scalar", "tc"]


@dataclass(frozen=True, slots=True)
class MlaPlan:
    heads: int        # query heads per block (a tile of the Hq heads)
    lpt: int          # latent dims per thread in the PV pass (template parameter LPT)
    tile: int         # latent rows per shared-memory tile
    part_size: int    # latent rows per block
    num_parts: int    # partitions of the longest possible row
    smem_bytes: int   # dynamic shared memory of an attention block
    variant: Variant  # which attention kernel (attention_variant)


def attention_variant(heads: int, kv_itemsize: int) -> Variant:
    """``"tc"`` (mla_attention_tc_kernel: scores and P C on BF16 tensor cores, mma.sync m16n8k16,
    sm_80+) when a block's head tile is 16 heads (the mma's M; a last tile of fewer, as Hq 31's
    16 + 15, runs with zero query rows) over a BF16 cache; else ``"scalar"`` (FP32 FMAs): head
    tiles under 16 (Hq < 16, or Hq = 20's tiles of 10) would leave most of the mma's rows empty,
    and an FP32 cache keeps FP32 products (rounding it to BF16 would lose what it is kept for)."""
    return "tc" if heads == HEADS and kv_itemsize == 2 else "scalar"


def smem_bytes(heads: int, W: int, tile: int, kv_itemsize: int, variant: Variant = "scalar") -> int:
    """Dynamic shared memory of an attention block (``W = L + R``). mla_attention_kernel:
    q_s [heads][Wq] FP32, p_s [tile][20], ml_s [3][16], slot_s [tile], c_s [tile][Wq + 8] in the
    cache's element type (``Wq`` = W rounded up to 8). mla_attention_tc_kernel: q_s [16][Ws] BF16,
    the same p_s, ml_s, slot_s, c_s [tile][Ws] BF16 (``Ws`` = W rounded up to 16, + 8)."""
    if variant == "tc":
        Ws = cdiv(W, 16) * 16 + 8
        return 2 * HEADS * Ws + 4 * (tile * P_STRIDE + 3 * HEADS + tile) + tile * Ws * 2
    Wq = cdiv(W, 8) * 8
    return 4 * (heads * Wq + tile * P_STRIDE + 3 * HEADS + tile) + tile * (Wq + 8) * kv_itemsize


def plan(Hq: int, L: int, R: int, max_len: int, n: int = 1, target_blocks: int = 0,
         smem_max: int = SMEM_LIMIT, kv_itemsize: int = 2) -> MlaPlan:
    """Launch plan for ``Hq`` heads, latent rows of ``L + R``, rows of at most ``max_len =
    max_blocks * BS`` latent rows, ``n`` query rows, a cache of ``kv_itemsize`` bytes per value.

    Heads are cut into ceil(Hq / 16) equal tiles (128 -> 8 tiles of 16). The context is
    split only while ``n * tiles`` blocks are under ``target_blocks`` (the launcher: 2 per SM),
    into partitions of at least ``MIN_PART`` rows: one decode row of DeepSeek-V3 (8 head
    tiles) at 4096 rows gets 32 partitions of 128 (256 blocks); a prefill chunk of 33+ rows
    gets none (no partials). The tile is 64 rows, halved (to 16) while shared memory is over
    ``max(48 KiB, smem_max)``; past that, ValueError. The kernel is :func:`attention_variant`'s
    (it changes the shared memory, not the partitions' meaning: the workspaces are the same)."""
    if not 1 <= L <= 256 * MLA_LPT[-1]:
        raise ValueError(f"w_uk: expected L (kv_lora_rank) in 1..{256 * MLA_LPT[-1]} on cuda, got {L}")
    tiles = cdiv(Hq, HEADS)
    heads = cdiv(Hq, tiles)
    lpt = next(c for c in MLA_LPT if L <= 256 * c)
    variant = attention_variant(heads, kv_itemsize)
    limit = max(SMEM_LIMIT, smem_max)
    tile = TILE                     # 64, 32, 16: multiples of the tc kernel's k-step of 16 rows
    while tile > 16 and smem_bytes(heads, L + R, tile, kv_itemsize, variant) > limit:
        tile //= 2
    smem = smem_bytes(heads, L + R, tile, kv_itemsize, variant)
    if smem > limit:
        raise ValueError(f"mla_attention_absorbed: {heads} heads x latent rows of {L + R} need {smem} B of "
                         f"shared memory, over this device's {limit}")
    max_len = max(1, int(max_len))
    work = max(1, n) * tiles
    parts = 1 if work >= target_blocks else max(1, min(cdiv(target_blocks, work), cdiv(max_len, MIN_PART)))
    part_size = cdiv(cdiv(max_len, parts), tile) * tile
    return MlaPlan(heads, lpt, tile, part_size, cdiv(max_len, part_size), smem, variant)


def workspace_shapes(n: int, Hq: int, L: int, R: int, num_parts: int) -> dict[str, tuple[int, ...]]:
    """The FP32 workspaces of ``mla_attention_absorbed`` (keyword -> shape) for ``plan(...).num_parts``:
    q_full and o_lat always, part_o and part_ml when the context is split."""
    ws = {"q_full": (n, Hq, L + R), "o_lat": (n, Hq, L)}
    if num_parts > 1:
        ws["part_o"] = (n, Hq, num_parts, L)
        ws["part_ml"] = (n, Hq, num_parts, 2)
    return ws


def workspace_floats(n: int, Hq: int, L: int, R: int, max_len: int, *, target_blocks: int = 0,
                     smem_max: int = SMEM_LIMIT, kv_itemsize: int = 2) -> int:
    """FP32 values of all workspaces of a launch of these shapes (``plan``'s arguments; the
    launcher plans with ``target_blocks = 2 * sm_count()``, ``smem_max = smem_optin()``)."""
    p = plan(Hq, L, R, max_len, n, target_blocks, smem_max, kv_itemsize)
    return sum(prod(s) for s in workspace_shapes(n, Hq, L, R, p.num_parts).values())


class _Declared:
    """A BF16-bits cache as the shared check sees it (dtype bfloat16, same shape)."""

    __slots__ = ("shape", "ndim", "dtype")

    def __init__(self, a):
        self.shape, self.ndim, self.dtype = tuple(a.shape), a.ndim, np.dtype(ml_dtypes.bfloat16)


def _as_checked(cache):
    return _Declared(cache) if dtype_name(cache) == "uint16" else cache


def _f32(a, name: str):
    """An FP32 input on the device; a host BF16 array (ml_dtypes) is widened first."""
    if isinstance(a, np.ndarray) and a.dtype == ml_dtypes.bfloat16:
        a = a.astype(np.float32)
    return device(a, name, "float32")


def _dense(w, name: str):
    if isinstance(w, CudaFp8):
        raise TypeError(f"{name}: expected BF16 or FP32 weights (prepare_weight), got FP8: MLA on cuda "
                        f"has no FP8 kernels")
    expect_weight(name, w)
    return device(w, name)


def mla_latent_write(kv_a, kv_a_norm_w, eps: float, inv_freq, positions, latent_cache, slots, *, q=None,
                     interleave: bool = False, rope_scale: float = 1.0, out=None):
    """-> None, or q [n, Hq, P + R] FP32 with the rope dims rotated (``out``: its buffer)."""
    check_mla_latent_write(kv_a, kv_a_norm_w, inv_freq, positions, _as_checked(latent_cache), slots,
                           interleave, rope_scale, q)
    if q is None and out is not None:
        raise TypeError("out: the roped query's buffer needs q (no q: nothing is returned)")
    cache = inplace(latent_cache, "latent_cache", "uint16", "float32")
    NB, BS, W = cache.shape
    if not is_device_array(slots):              # free on the host; a device array is not read back
        err = slots_refused(np.asarray(slots), NB * BS)
        if err is not None:
            raise err
    n, half = kv_a.shape[0], inv_freq.shape[0]
    L = W - 2 * half
    if isinstance(kv_a, np.ndarray) and kv_a.dtype == ml_dtypes.bfloat16:
        kv_a = kv_a.astype(np.float32)
    kv_a, ldk = device_rows(kv_a, "kv_a", "float32")    # a column slice of kv_a | g_proj's output: in place
    norm_w = device(kv_a_norm_w, "kv_a_norm_w", "float32")
    inv_freq = device(inv_freq, "inv_freq", "float32")
    positions = device(positions, "positions", "int32")
    slots = device(slots, "slots", "int32")
    q_out = Hq = P = None
    if q is not None:
        q = _f32(q, "q")
        Hq, P = q.shape[1], q.shape[2] - 2 * half
        q_out = output(out, "out", tuple(q.shape), np.float32)
        expect_disjoint("out", q_out, "q", q)
    if n == 0:
        return q_out
    il = "true" if interleave else "false"
    kernel = get_kernel("mla", f"mla_latent_write_kernel<{ctype(cache)}, {il}>")
    kernel((n, 1 if q is None else 2), (WRITE_THREADS,),
           (kv_a, norm_w, f32(eps), inv_freq, i32(half), f32(rope_scale), positions, slots, i32(n),
            np.int64(NB * BS), cache, i32(L), ptr(q), ptr(q_out), i32(Hq or 0), i32(P or 0), i32(ldk)))
    return q_out


def _check_index(index, n: int, row_len, row_start) -> None:
    """``index [n, T]`` int32: its shape and dtype always; its entries (``check_index``: rows the
    row sees, strictly ascending, then -1s) when it, ``row_len`` and ``row_start`` are host arrays
    (device arrays are not read back: the kernels skip an entry outside the row's rows)."""
    expect_ndim("index", index, 2)
    expect_shape("index", index, (n, None))
    expect_dtype("index", index, "int32")
    if index.shape[1] < 1:
        raise ValueError(f"index: expected [{n}, T >= 1], got shape {list(index.shape)}")
    if not any(a is not None and is_device_array(a) for a in (index, row_len, row_start)):
        check_index(index, n, row_len, row_start)


def max_rows(cap: int, index=None) -> int:
    """The most latent rows a query row walks: ``cap = max_blocks * BS``, or with a DSA list
    ``min(cap, T)`` (``plan``'s ``max_len``: the partitions are sized for it)."""
    return cap if index is None else min(cap, int(index.shape[1]))


def mla_attention_absorbed(q, w_uk, w_uv, latent_cache, block_tables, row_seq, row_len, scale: float, *,
                           row_start=None, index=None, out=None, q_full=None, o_lat=None, part_o=None,
                           part_ml=None):
    """-> out [n, Hq * Dv] FP32 (workspaces: see the module doc)."""
    check_mla_attention(q, w_uk, w_uv, latent_cache, block_tables, row_seq, row_len, row_start)
    if index is not None:
        _check_index(index, q.shape[0], row_len, row_start)
    expect_dtype("latent_cache", latent_cache, "uint16", "float32")
    w_uk, w_uv = _dense(w_uk, "w_uk"), _dense(w_uv, "w_uv")
    if w_uk.dtype != w_uv.dtype:
        raise TypeError(f"w_uv: expected the dtype of w_uk ({w_uk.dtype.name}), got {w_uv.dtype.name}")
    NB, BS, W = latent_cache.shape
    Hq, P, L = w_uk.shape
    R, Dv = W - L, w_uv.shape[1]
    n = q.shape[0]
    if P > MAX_P:
        raise ValueError(f"w_uk: expected P (qk_nope_head_dim) <= {MAX_P} on cuda, got {P}")
    max_blocks = block_tables.shape[1]
    cap = max_blocks * BS
    kv_itemsize = np.dtype(latent_cache.dtype).itemsize
    walk = max_rows(cap, index)
    p = plan(Hq, L, R, walk, n, target_blocks=2 * sm_count(), smem_max=smem_optin(), kv_itemsize=kv_itemsize)
    expect_grid_yz("q rows", n)
    expect_grid_yz("latent partitions", p.num_parts)
    expect_grid_yz("query row chunks", cdiv(n, ROWS))
    q = _f32(q, "q")
    cache = device(latent_cache, "latent_cache")
    block_tables = device(block_tables, "block_tables")
    row_seq, row_len = device(row_seq, "row_seq"), device(row_len, "row_len")
    row_start = optional(row_start, "row_start", "int32")
    index = optional(index, "index", "int32")
    T = 0 if index is None else index.shape[1]
    y = output(out, "out", (n, Hq * Dv), np.float32)
    shapes = workspace_shapes(n, Hq, L, R, p.num_parts)
    given = {"q_full": q_full, "o_lat": o_lat, "part_o": part_o, "part_ml": part_ml}
    ws = {k: output(given[k], k, s, np.float32) for k, s in shapes.items()}
    bufs = [("out", y), ("q", q)] + list(ws.items())
    for (na, a), (nb, b) in combinations(bufs, 2):
        expect_disjoint(na, a, nb, b)
    if n == 0:
        return y
    wt = ctype(w_uk)
    absorb = get_kernel("mla", f"mla_q_absorb_kernel<{wt}>")
    absorb((cdiv(L, ABSORB_SPAN), Hq, cdiv(n, ROWS)), (ABSORB_THREADS,),
           (q, w_uk, ws["q_full"], i32(n), i32(Hq), i32(P), i32(R), i32(L)), shared_mem=ROWS * P * 4)
    attn = get_kernel("mla", f"mla_attention_tc_kernel<{p.lpt}>" if p.variant == "tc"
                      else f"mla_attention_kernel<{ctype(cache)}, {p.lpt}>")
    opt_in_smem(attn, p.smem_bytes)
    direct = p.num_parts == 1
    attn((cdiv(Hq, p.heads), n, p.num_parts), (ATTN_THREADS,),
         (ws["q_full"], cache, block_tables, i32(max_blocks), row_seq, ptr(row_start), row_len, ws["o_lat"],
          NULL if direct else ws["part_o"], NULL if direct else ws["part_ml"], i32(Hq), i32(p.heads), i32(L),
          i32(R), i32(BS), i32(p.tile), i32(p.part_size), i32(p.num_parts), f32(scale), ptr(index), i32(T)),
         shared_mem=p.smem_bytes)
    if not direct:
        # a DSA list: the merge takes partitions 0 .. ceil(min(row_len, walk) / part_size) - 1, those
        # past the list's end holding neutral partials (mla.cu's mla_store_empty)
        merge = get_kernel("attention", "paged_attention_merge_kernel")
        merge((Hq, n), (MERGE_THREADS,),
              (ws["part_o"], ws["part_ml"], ptr(row_start) if index is None else NULL, row_len, NULL, i32(walk),
               ws["o_lat"], i32(Hq), i32(L), i32(p.part_size), i32(p.num_parts)))
    get_kernel("mla", f"mla_out_kernel<{wt}>")(
        (cdiv(Dv, OUT_ROWS_PER_BLOCK), Hq, cdiv(n, ROWS)), (OUT_THREADS,),
        (ws["o_lat"], w_uv, y, i32(n), i32(Hq), i32(Dv), i32(L)))
    return y
