"""Launcher of ``paged_attention_kernel`` / ``paged_attention_tc_kernel`` (+ ``paged_attention_merge_kernel``),
kernels/attention.cu.

``paged_attention(q [n, Hq, D], k_cache [NB, BS, Hkv, D], v_cache [NB, BS, Hkv, Dv],
block_tables [S, max_blocks] int32, row_seq [n] int32, row_len [n] int32, scale, *,
row_start [n] int32 | None, sinks [Hq] FP32 | None) -> out [n, Hq * Dv]`` FP32.

``row_start`` (a sliding window's first visible row) and ``sinks`` (a logit per
query head in the softmax denominator) are device arrays the caller stages like
``row_len``; absent, the kernels get null pointers and compute what they computed
before these existed, bit for bit.

One block serves the query heads of one KV head (``heads`` of them, up to
``4 * MW``: 32 for Dv <= 128, 16 for Dv <= 256) for a *run* of up to ``rows``
consecutive rows of one sequence (``rows = 4 * MW // heads``; the kernel finds the
runs on the device from ``row_seq``, so a captured step stays capturable), and
streams the run's KV once through a cp.async ring of ``stages`` tiles of 32 KV rows
(:func:`plan`). Grid ``(Hkv * ceil(group / heads), n, num_parts)``: the blocks of
rows that do not start a run exit at once.

Over a BF16 cache with D % 16 == 0 and Dv % 8 == 0 the kernel is
``paged_attention_tc_kernel`` (:func:`attention_variant`: the scores and P V on tensor
cores, q and P split into BF16 parts so the results keep FP32's accuracy), with the same
grid, runs and partitions; otherwise ``paged_attention_kernel`` (FP32 FMAs).

Split-KV: a row's visible KV rows (from ``row_start``) are cut into partitions of
``part_size`` (512, halved down to 64 while the GPU would be short of blocks; see
:func:`plan`) handled by separate blocks;
``num_parts = ceil(max_blocks * BS / part_size)`` comes from the *shapes* (no
device-to-host read of row_len or row_start, so the launch is graph-capturable),
and blocks past a row's length exit at once (with a window, most of them). With more
than one partition the partials go to the workspaces ``part_o [n, Hq, P, Dv]`` and
``part_ml [n, Hq, P, 2]`` FP32 (``P = plan(...).num_parts``) and a merge kernel
writes ``out`` (adding the sink once); with one partition there is no merge launch.
Without caller workspaces, rows go in groups
whose workspaces fit ``WORKSPACE_BYTES`` (64 MiB): a 256-row prefill chunk at 32K
context with 96 query heads of 128 would otherwise take 0.8 GB; each group is one
kernel + merge launch pair on the same stream.

Preconditions (checked): D <= 256, Dv <= 256, Hq % Hkv == 0, caches of one dtype
(BF16 bits or FP32). Not checked (device data): row_len[r] >= 1 and
0 <= row_start[r] < row_len[r] (a row with nothing to see gets zeros, the reference
raises), block table entries of the blocks holding rows row_start .. row_len - 1
valid (the others are never read).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...ops._check import expect_dtype
from ...ops.attention import check_paged_attention
from ...ops.kv_fp8 import check_scales
from ._util import (MAX_GRID_YZ, NULL, cdiv, ctype, device, expect_disjoint, expect_grid_yz, expect_same_or_disjoint,
                    f32, i32, opt_in_smem, optional, output, ptr, sm_count, smem_optin)
from .loader import ATTENTION_DC, ATTENTION_TC, get_kernel

#: kAttnThreads in attention.cu
ATTN_THREADS = 128
#: kAttnTile in attention.cu: KV rows per pipeline stage
TILE = 32
#: preferred KV rows per partition (per block)
PART_SIZE = 512
#: fewest KV rows per partition (two tiles)
MIN_PART = 2 * TILE
#: dynamic shared memory a plan stays within when it can (more takes the opt-in
#: attribute, up to the device's limit: see ``plan``)
SMEM_LIMIT = 48 * 1024
#: most bytes of split-KV workspace (part_o + part_ml) a launch allocates by itself
WORKSPACE_BYTES = 64 << 20


#: the two kernels: FP32 FMAs on CUDA cores (paged_attention_kernel) or BF16 tensor cores with
#: split operands (paged_attention_tc_kernel)
VARIANTS = ("scalar", "tc")


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    dc: int            # value dims per lane in the PV pass (template parameter DC); the tc kernel's
                       # n-tiles of 8 value dims per warp
    heads: int         # query heads of one KV head per block
    rows: int          # most query rows of one sequence per block (a run)
    stages: int        # KV tiles in the cp.async ring (2 or 3)
    part_size: int     # KV rows per partition (per block)
    num_parts: int     # partitions of the longest possible row
    smem_bytes: int    # dynamic shared memory per block
    variant: str = "scalar"   # which kernel (attention_variant)

    @property
    def mt(self) -> int:
        """The tc kernel's m-tiles of 16 query vectors (template parameter MT)."""
        return cdiv(self.heads * self.rows, 16)


def query_capacity(dc: int) -> int:
    """Query vectors (rows x heads) one block holds: 4 warps x MW (attn_mw<DC> in attention.cu)."""
    return 4 * (4 if dc == 8 else 8)


def attention_variant(D: int, Dv: int, kv_itemsize: int) -> str:
    """``"tc"`` (paged_attention_tc_kernel: scores and P V on BF16 tensor cores, mma.sync m16n8k16,
    q split into three BF16 parts and P into two, so FP32's accuracy is kept) over a BF16 cache
    when D is a multiple of the mma's k-step (16) and Dv of its n-tile (8); else ``"scalar"``
    (FP32 FMAs on CUDA cores; an FP32 cache, or odd head dims)."""
    return "tc" if kv_itemsize == 2 and D % 16 == 0 and Dv % 8 == 0 else "scalar"


def smem_bytes(D: int, Dv: int, dc: int, heads: int, rows: int, stages: int, kv_itemsize: int,
               variant: str = "scalar") -> int:
    """The scalar kernel's layout: K [stages][32][Dp + 16 B], V [stages][32][Dvp] in the cache's
    dtype, then FP32 q [rows * heads][Dp], p [4][32][MW], (max, sum) [4][2][2][MW] and int slots
    [stages][32], a / b [rows]. The tc kernel's (MR = 16 * mt query vectors, mt = ceil(heads *
    rows / 16)): BF16 K [stages][32][D + 8], V [stages][32][Dv + 8], q [3][MR][D + 8], p
    [2][MR][40], then FP32 scores [MR][36], rescale factors [MR], (max, sum) [MR][2], the same
    int slots and a / b."""
    if variant == "tc":
        mr = 16 * cdiv(heads * rows, 16)
        bf16 = stages * TILE * (D + 8 + Dv + 8) + 3 * mr * (D + 8) + 2 * mr * (TILE + 8)
        return 2 * bf16 + 4 * (mr * (TILE + 4) + 3 * mr + stages * TILE + 2 * rows)
    Dp, Dvp = cdiv(D, 8) * 8, cdiv(Dv, 8) * 8
    mw = query_capacity(dc) // 4
    kv = stages * TILE * (Dp + 16 // kv_itemsize + Dvp) * kv_itemsize
    scales = 2 * (stages + 1) * TILE if kv_itemsize == 1 else 0  # an FP8 cache: its tile rows' K and V scales
    return kv + 4 * (rows * heads * Dp + 4 * TILE * mw + 16 * mw + stages * TILE + 2 * rows + scales)


def plan(group: int, D: int, max_len: int, work: int = 1, target_blocks: int = 0,
         smem_max: int = SMEM_LIMIT, *, Dv: int | None = None, kv_itemsize: int = 2,
         rows: int | None = None) -> AttentionPlan:
    """Launch plan for ``group = Hq / Hkv`` query heads per KV head, head dim D
    (value head dim ``Dv``, default D: it chooses DC), rows of at most
    ``max_len = max_blocks * BS`` KV rows, ``work = runs * Hkv`` (run, KV head) pairs (a
    run: the rows of one sequence in one block; the launchers count min(rows, sequences)),
    a cache of ``kv_itemsize`` bytes per element and at most ``rows`` query rows
    per run (default: as many as the block's query capacity allows).

    ``num_parts`` depends only on the shapes, ``work`` and ``target_blocks`` (what a
    planned step sizes its workspaces from): part_size starts at 512 and halves
    (down to 64) while ``work * chunks * num_parts`` is under ``target_blocks`` (2 per
    SM; ``chunks = ceil(group / heads)``): one decode row with Hkv = 8 and 2048
    cached rows gets 256 blocks (part 64), not 32; an exact-mode module with 3 rows
    of one sequence gets the same partitions as one row (its rows share a block).

    Shared memory: 3 stages when they fit ``max(48 KiB, smem_max)`` (the device's
    opt-in limit, ``_util.smem_optin``; over 48 KiB the launcher raises the kernel's
    max-dynamic-shared-size attribute), else 2, else fewer rows per run; beyond
    that, ValueError. The kernel is :func:`attention_variant`'s, or the scalar one
    where the tc kernel's shared memory does not fit in any of those ways (its
    three-part q: a 48 KiB device at D = 128); both take the same heads and
    partitions (so the workspaces do not depend on the variant)."""
    Dv = D if Dv is None else Dv
    for what, d in (("head dim", D), ("value head dim", Dv)):
        if not 1 <= d <= 32 * ATTENTION_DC[-1]:
            raise ValueError(f"{what}: expected 1..{32 * ATTENTION_DC[-1]}, got {d}")
    dc = next(c for c in ATTENTION_DC if Dv <= 32 * c)
    cap_m = query_capacity(dc)
    heads = min(group, cap_m)
    chunks = cdiv(group, heads)
    most_rows = cap_m // heads if rows is None else max(1, min(rows, cap_m // heads))
    part = PART_SIZE
    while part > MIN_PART and work * chunks * cdiv(max_len, part) < target_blocks:
        part //= 2
    limit = max(SMEM_LIMIT, smem_max)
    tries = [(3, most_rows), (2, most_rows)] + [(2, r) for r in range(most_rows - 1, 0, -1)]
    variants = dict.fromkeys((attention_variant(D, Dv, kv_itemsize), "scalar"))
    for variant in variants:
        for stages, r in tries:
            smem = smem_bytes(D, Dv, dc, heads, r, stages, kv_itemsize, variant)
            if smem <= limit:
                return AttentionPlan(dc, heads, r, stages, part, max(1, cdiv(max_len, part)), smem, variant)
    raise ValueError(
        f"paged_attention: {group} query heads per KV head x head dim {D} need {smem} B of "
        f"shared memory, over this device's {limit}"
    )


def _check_plan(p: AttentionPlan, group: int, D: int, Dv: int, cap: int, kv_itemsize: int) -> None:
    """A caller's plan: the kernel trusts it for shared memory and its per-lane arrays."""
    if p.dc not in ATTENTION_DC or Dv > 32 * p.dc:
        raise ValueError(f"attention_plan: expected dc in {ATTENTION_DC} with value head dim {Dv} <= 32 * dc, "
                         f"got dc {p.dc}")
    if not (1 <= p.heads <= group and p.rows >= 1 and p.heads * p.rows <= query_capacity(p.dc)
            and p.stages in (2, 3) and p.part_size >= 1):
        raise ValueError(f"attention_plan: expected 1 <= heads <= {group}, rows >= 1, heads * rows <= "
                         f"{query_capacity(p.dc)}, stages 2 or 3, part_size >= 1; got {p}")
    if p.variant not in VARIANTS:
        raise ValueError(f"attention_plan: expected variant in {VARIANTS}, got {p.variant!r}")
    if p.variant == "tc" and not (attention_variant(D, Dv, kv_itemsize) == "tc" and (p.mt, p.dc) in ATTENTION_TC):
        raise ValueError(f"attention_plan: the tc variant needs a BF16 cache, D % 16 == 0, Dv % 8 == 0 and "
                         f"(m-tiles, dc) in {ATTENTION_TC}; got {kv_itemsize}-byte KV, D {D}, Dv {Dv}, "
                         f"({p.mt}, {p.dc})")
    if p.num_parts != max(1, cdiv(cap, p.part_size)):
        raise ValueError(f"attention_plan: expected num_parts = ceil({cap} / {p.part_size}) = "
                         f"{max(1, cdiv(cap, p.part_size))} to cover the table's rows, got {p.num_parts}")
    need = smem_bytes(D, Dv, p.dc, p.heads, p.rows, p.stages, kv_itemsize, p.variant)
    if p.smem_bytes < need:
        raise ValueError(f"attention_plan: expected smem_bytes >= {need} (these shapes, {kv_itemsize}-byte KV), "
                         f"got {p.smem_bytes}")


def paged_attention(q, k_cache, v_cache, block_tables, row_seq, row_len, scale: float, *,
                    row_start=None, sinks=None, out=None, part_o=None, part_ml=None, attention_plan=None,
                    k_scale=None, v_scale=None):
    """-> out [n, Hq * Dv] FP32; ``part_o`` / ``part_ml``: split-KV workspaces (see module doc).
    ``attention_plan``: an :class:`AttentionPlan` to launch instead of :func:`plan`'s (the
    benchmark's sweep of part sizes and stages); its partitions must cover the table's rows.
    FP8 caches (uint8 E4M3 codes): ``k_scale`` / ``v_scale`` [NB, BS, Hkv] FP32 (mtpkern.ops.kv_fp8),
    the scalar kernel reading one byte per element."""
    check_paged_attention(q, k_cache, v_cache, block_tables, row_seq, row_len, row_start, sinks)
    check_scales("k_scale", k_cache, k_scale)
    check_scales("v_scale", v_cache, v_scale)
    expect_dtype("k_cache", k_cache, "uint16", "float32", "uint8")
    expect_dtype("v_cache", v_cache, k_cache.dtype.name)
    expect_dtype("q", q, "float32")
    NB, BS, Hkv, D = k_cache.shape
    Dv = v_cache.shape[3]
    n, Hq, _ = q.shape
    max_blocks = block_tables.shape[1]
    cap = max_blocks * BS
    # blocks that work: one per run of a sequence's rows (and KV head), so the sequences count,
    # not the rows: block_tables has a row per sequence (a shape, never data read on the host)
    p = attention_plan or plan(Hq // Hkv, D, cap, work=min(n, block_tables.shape[0]) * Hkv,
                               target_blocks=2 * sm_count(), smem_max=smem_optin(), Dv=Dv,
                               kv_itemsize=k_cache.dtype.itemsize, rows=max(1, n))
    if attention_plan is not None:
        _check_plan(p, Hq // Hkv, D, Dv, cap, k_cache.dtype.itemsize)
    expect_grid_yz("KV partitions", p.num_parts)
    q = device(q, "q")
    k_cache, v_cache = device(k_cache, "k_cache"), device(v_cache, "v_cache")
    fp8 = k_cache.dtype.itemsize == 1
    scales = (device(k_scale, "k_scale", "float32"), device(v_scale, "v_scale", "float32")) if fp8 else (NULL, NULL)
    block_tables = device(block_tables, "block_tables")
    row_seq, row_len = device(row_seq, "row_seq"), device(row_len, "row_len")
    row_start, sinks = optional(row_start, "row_start", "int32"), optional(sinks, "sinks", "float32")
    y = output(out, "out", (n, Hq * Dv), np.float32)
    expect_same_or_disjoint("out", y, "q", q)          # a block reads only the q rows it writes
    if n == 0:
        return y
    direct = p.num_parts == 1
    own_ws = part_o is None and part_ml is None
    group = n if not own_ws else min(n, MAX_GRID_YZ)                         # rows per launch pair
    if not direct:
        per_row = Hq * p.num_parts * (Dv + 2) * 4
        if own_ws:
            group = max(1, min(group, WORKSPACE_BYTES // per_row))
        part_o = output(part_o, "part_o", (group, Hq, p.num_parts, Dv), np.float32)
        part_ml = output(part_ml, "part_ml", (group, Hq, p.num_parts, 2), np.float32)
        for nm, a in (("q", q), ("out", y)):
            expect_disjoint("part_o", part_o, nm, a)
            expect_disjoint("part_ml", part_ml, nm, a)
        expect_disjoint("part_o", part_o, "part_ml", part_ml)
    expect_grid_yz("q rows per launch", group)
    kernel = get_kernel("attention", f"paged_attention_tc_kernel<{p.mt}, {p.dc}>" if p.variant == "tc"
                        else f"paged_attention_kernel<{ctype(k_cache)}, {p.dc}>")
    opt_in_smem(kernel, p.smem_bytes)
    merge = None if direct else get_kernel("attention", "paged_attention_merge_kernel")
    sk = ptr(sinks)
    chunks = cdiv(Hq // Hkv, p.heads)
    for r0 in range(0, n, group):
        r1 = min(n, r0 + group)
        qg, sg, fg, lg, yg = ((q, row_seq, row_start, row_len, y) if group == n else
                              (q[r0:r1], row_seq[r0:r1], None if row_start is None else row_start[r0:r1],
                               row_len[r0:r1], y[r0:r1]))
        kernel((Hkv * chunks, r1 - r0, p.num_parts), (ATTN_THREADS,),
               (qg, k_cache, v_cache, block_tables, i32(max_blocks), sg, ptr(fg), lg, sk,
                yg, NULL if direct else part_o, NULL if direct else part_ml,
                i32(Hq), i32(Hkv), i32(D), i32(Dv), i32(BS), i32(p.heads), i32(p.rows), i32(p.stages),
                i32(p.part_size), i32(p.num_parts), f32(scale)) + (() if p.variant == "tc" else scales),
               shared_mem=p.smem_bytes)
        if merge is not None:
            merge((Hq, r1 - r0), (ATTN_THREADS,),
                  (part_o, part_ml, ptr(fg), lg, sk, i32(cap), yg, i32(Hq), i32(Dv), i32(p.part_size),
                   i32(p.num_parts)))
    return y
