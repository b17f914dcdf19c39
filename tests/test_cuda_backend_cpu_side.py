"""The CUDA backend's host side, without a GPU.

- imports: the backend and launchers import without touching CuPy or a GPU;
- launch planning: GEMV warps-per-group, attention partitions and shared memory;
- validation: launchers reject bad shapes / dtypes before any device work;
- NumPy simulations of the kernels' index maps and reduction schemes, checked
  against the references in ``mtpkern.ops`` (each simulation mirrors the loop
  structure of one kernel, named in its docstring);
- files: every family's source has its header, registers.json lists exactly
  the compiled instantiations.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from mtpkern.backends.base import Backend
from mtpkern.backends.cuda_launch import attention, linear, loader
from mtpkern.errors import NoAllowedToken
from mtpkern.ops import attention as attention_ref
from mtpkern.ops import lm_head as lm_head_ref
from mtpkern.ops import moe as moe_ref
from mtpkern.tolerance import assert_close

F32 = np.float32
RNG = np.random.default_rng(0)


# --------------------------------------------------------------------------
# imports and files


def test_import_touches_no_gpu():
    code = (
        "import sys, mtpkern.backends.cuda, mtpkern.nvrtc_check\n"
        "from mtpkern.backends.cuda_launch import attention, linear, lm_head, loader, mlp, moe, norm, rope_kv\n"
        "assert 'cupy' not in sys.modules, 'cupy imported at import time'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cuda_backend_implements_the_interface():
    from mtpkern.backends.cuda import CudaBackend

    assert issubclass(CudaBackend, Backend)
    assert not CudaBackend.__abstractmethods__


def test_every_family_has_a_source_with_a_header():
    d = loader.kernel_dir()
    assert (d / "common.cuh").is_file()
    for family in loader.FAMILIES:
        text = (d / f"{family}.cu").read_text()
        assert text.startswith(f"// {family}.cu -- "), f"{family}.cu: header comment missing"
        assert '#include "common.cuh"' in text


def test_registers_file_lists_the_instantiations():
    from mtpkern import nvrtc_check

    recorded = json.loads(nvrtc_check.recorded_registers_path().read_text())
    want = {n for names in loader.NAME_EXPRESSIONS.values() for n in names}
    for major in nvrtc_check.TOOLKITS:  # one table per toolkit, each complete
        found = nvrtc_check.recorded_table(major, recorded)
        assert found is not None, f"registers.json: no table for CUDA {major}"
        version, table = found
        for arch in nvrtc_check.ARCHS:
            assert set(table[arch]) == want, f"NVRTC {version} {arch}"


def test_bf16_unpack_matches_ml_dtypes():
    """common.cuh bf16_lo / bf16_hi: element 0 in the low half of a 32-bit word."""
    x = RNG.standard_normal(64).astype(ml_dtypes.bfloat16)
    words = x.view(np.uint16).view(np.uint32)                    # little endian pairs
    lo = (words << 16).view(F32)
    hi = (words & 0xFFFF0000).view(F32)
    got = np.stack([lo, hi], axis=1).reshape(-1)
    np.testing.assert_array_equal(got, x.astype(F32))


# --------------------------------------------------------------------------
# launch planning


@pytest.mark.parametrize("groups", [1, 7, 64, 263, 2048, 75776])
def test_gemv_config(monkeypatch, groups):
    monkeypatch.setattr(linear, "sm_count", lambda: 132)
    (blocks,), wpr = linear.gemv_config(groups)
    assert wpr in (1, 2, 4)
    assert blocks == math.ceil(groups / (4 // wpr))
    if wpr > 1:  # a smaller wpr would have left the GPU short of blocks
        assert math.ceil(groups / (4 // (wpr // 2))) < 2 * 132
    simulate_gemv_groups(2 * groups, wpr, blocks)


def simulate_gemv_groups(N: int, wpr: int, blocks: int) -> None:
    """gemv_groups_chunk + LinearEpi: every output row stored exactly once, by
    the first warp of its group; the wpr warps of a group cover K exactly once."""
    stored = np.zeros(N, int)
    for b in range(blocks):
        for warp in range(4):
            u, sub = b * (4 // wpr) + warp // wpr, warp % wpr
            a = 2 * u
            if a >= N or sub != 0:
                continue
            for j in range(2):
                if a + j < N:
                    stored[a + j] += 1
    assert (stored == 1).all()


@pytest.mark.parametrize("K", [0, 1, 7, 8, 19, 256, 4096, 4104])
@pytest.mark.parametrize("nt", [32, 64, 128])
@pytest.mark.parametrize("V", [4, 8])
def test_gemv_dot_covers_k_once(K, nt, V):
    """gemv_dot: thread t of nt reads vectors t, t + nt, ... (two per iteration,
    then a tail vector), or elements t, t + nt, ... on the scalar path."""
    seen = np.zeros(K, int)
    vec = K % V == 0
    for t in range(nt):
        if vec:
            k, step = t * V, nt * V
            while k + step < K:
                seen[k:k + V] += 1
                seen[k + step:k + step + V] += 1
                k += 2 * step
            if k < K:
                seen[k:k + V] += 1
        else:
            seen[t:K:nt] += 1
    assert (seen == 1).all()


@pytest.mark.parametrize("group", [1, 2, 4, 8, 12, 16, 32, 64])
@pytest.mark.parametrize("D", [1, 19, 64, 80, 128, 192, 256])
@pytest.mark.parametrize("kv_itemsize", [2, 4])
def test_attention_plan(group, D, kv_itemsize):
    """Within an H200's opt-in limit every shape plans: the tc kernel over BF16 with D % 16 == 0,
    3 stages, as many rows as the block's query capacity allows; within 48 KiB, fewer stages and
    rows, the scalar kernel where the tc one fits in none of those, or a ValueError when not
    even one row in 2 stages fits."""
    for smem_max in (227 * 1024, attention.SMEM_LIMIT):
        preferred = attention.attention_variant(D, D, kv_itemsize)
        assert preferred == ("tc" if kv_itemsize == 2 and D % 16 == 0 else "scalar")
        dc = next(c for c in loader.ATTENTION_DC if D <= 32 * c)
        least = {v: attention.smem_bytes(D, D, dc, min(group, 32), 1, 2, kv_itemsize, v) for v in attention.VARIANTS}
        try:
            p = attention.plan(group, D, max_len=40_000, smem_max=smem_max, kv_itemsize=kv_itemsize)
        except ValueError:
            assert smem_max == attention.SMEM_LIMIT and least["scalar"] > smem_max and least[preferred] > smem_max
            continue
        assert p.dc in loader.ATTENTION_DC and D <= 32 * p.dc
        assert p.heads == min(group, attention.query_capacity(p.dc)) and p.heads * p.rows <= attention.query_capacity(p.dc)
        assert p.variant == (preferred if least[preferred] <= smem_max else "scalar")
        assert p.smem_bytes == attention.smem_bytes(D, D, p.dc, p.heads, p.rows, p.stages, kv_itemsize,
                                                    p.variant) <= smem_max
        if smem_max > attention.SMEM_LIMIT:
            assert p.stages == 3 and p.rows == attention.query_capacity(p.dc) // p.heads and p.variant == preferred
        assert p.part_size == attention.PART_SIZE and p.num_parts == math.ceil(40_000 / p.part_size)
        assert f"paged_attention_kernel<__nv_bfloat16, {p.dc}>" in loader.NAME_EXPRESSIONS["attention"]
        if p.variant == "tc":
            assert f"paged_attention_tc_kernel<{p.mt}, {p.dc}>" in loader.NAME_EXPRESSIONS["attention"]


def test_attention_plan_spreads_short_decode_over_the_gpu():
    p = attention.plan(12, 128, max_len=2048, work=1 * 8, target_blocks=2 * 132)
    assert (p.part_size, p.num_parts) == (attention.MIN_PART, 32)        # 256 blocks: as close as 64 rows get
    p = attention.plan(12, 128, max_len=4096, work=1 * 8, target_blocks=2 * 132)
    assert (p.part_size, p.num_parts) == (64, 64)
    p = attention.plan(12, 128, max_len=32768, work=4 * 8, target_blocks=2 * 132)
    assert (p.part_size, p.num_parts) == (512, 64)


def test_attention_partitions_count_sequences_not_rows(recorder):
    """An exact-mode module's rows of one sequence share a block, so its launch gets the
    partitions of one row per sequence (as many working blocks), not a third of them; the
    planned step sizes its workspaces by the same rule (min(rows, sequences))."""
    def grid_z(n, S):
        recorder.launches.clear()
        cache = np.zeros((64, 16, 2, 32), np.uint16)
        attention.paged_attention(np.zeros((n, 8, 32), F32), cache, cache, np.zeros((S, 256), np.int32),
                                  np.zeros(n, np.int32), np.full(n, 4096, np.int32), 0.1)
        (_, name, grid, *_), *_ = recorder.launches
        assert name.startswith(("paged_attention_kernel", "paged_attention_tc_kernel"))
        return grid[2]

    one = grid_z(1, 1)
    assert one == attention.plan(4, 32, 4096, work=2, target_blocks=264).num_parts > 1
    assert grid_z(3, 1) == one                      # 3 rows of one sequence: one run
    assert grid_z(6, 6) < one                       # 6 sequences: 6 runs, fewer partitions each
    assert grid_z(12, 6) == grid_z(6, 6)


def test_attention_plan_rejects_large_head_dim():
    with pytest.raises(ValueError, match="head dim"):
        attention.plan(4, 257, 1024)


# --------------------------------------------------------------------------
# validation before any device work (numpy inputs, no GPU)


def test_launchers_validate_before_device_work():
    from mtpkern.backends.cuda_launch import lm_head, mlp, moe, norm, rope_kv

    x = np.zeros((2, 8), F32)
    with pytest.raises(ValueError, match=r"w: expected shape \[\*, 8\], got \[4, 5\]"):
        linear.linear(x, np.zeros((4, 5), F32))
    with pytest.raises(TypeError, match="w: expected dtype float32 or uint16"):
        linear.linear(x, np.zeros((4, 8), np.float64))
    with pytest.raises(ValueError, match=r"w: expected shape \[8\], got \[9\]"):
        norm.rmsnorm(np.zeros((2, 8), F32), np.zeros(9, F32), 1e-6)
    with pytest.raises(ValueError, match="w13"):
        mlp.swiglu_mlp(x, np.zeros((5, 8), F32), np.zeros((8, 2), F32))
    with pytest.raises(TypeError, match="ids: expected dtype int32"):
        moe.moe_experts(x, np.zeros((2, 2), np.int64), np.zeros((2, 2), F32),
                        np.zeros((4, 6, 8), F32), np.zeros((4, 8, 3), F32))
    with pytest.raises(ValueError, match="bitmask"):
        lm_head.lm_head_argmax(x, np.zeros((40, 8), F32), np.zeros((2, 1), np.int32))
    with pytest.raises(ValueError, match="at most 1024 experts"):
        moe.moe_router(x, np.zeros((2048, 8), F32), np.zeros(2048, F32), moe_ref.RouterSpec(2, 1, 1, 1.0, True))
    cache = np.zeros((2, 4, 1, 8), np.uint16)
    with pytest.raises(TypeError, match="k_cache: expected a GPU array"):
        rope_kv.qk_norm_rope_kv_write(np.zeros((1, 24), F32), 1, 1, None, None, 1e-6, np.ones(2, F32),
                                      np.zeros(1, np.int32), cache, cache, np.zeros(1, np.int32))


def test_raise_if_no_allowed_names_the_row():
    from mtpkern.backends.cuda_launch.lm_head import raise_if_no_allowed

    raise_if_no_allowed(np.array([3, 0], np.int32), 10)
    with pytest.raises(NoAllowedToken, match="row 1"):
        raise_if_no_allowed(np.array([3, -1, -1], np.int32), 10)


# --------------------------------------------------------------------------
# argmax: lm_head_argmax_partial_kernel + argmax_final_kernel


def beats(v, i, bv, bi) -> bool:
    """common.cuh mtp::beats."""
    return i >= 0 and (bi < 0 or v > bv or (v == bv and i < bi))


def simulate_lm_argmax(logits: np.ndarray, bitmask: np.ndarray | None, blocks: int = 4 * 132) -> np.ndarray:
    """The two stages as the kernels run them; ``blocks``: the persistent grid's cap (resident
    blocks per SM times SMs)."""
    n, V = logits.shape
    pairs = -(-V // 2)
    P = min(-(-pairs // 4), blocks)
    part = np.empty((n, P), object)
    for b in range(P):                                     # partial kernel, block b: pairs [lo, hi)
        lo, hi = b * pairs // P, (b + 1) * pairs // P
        for r in range(n):
            warp_best = []
            for warp in range(4):
                bv, bi = -np.inf, -1
                for q in range(lo + warp, hi, 4):
                    a = 2 * q
                    for j in range(2):
                        i = a + j
                        if i >= V:
                            break
                        v = logits[r, i]
                        ok = not np.isnan(v)
                        if ok and bitmask is not None:
                            ok = bool((int(bitmask[r, i >> 5]) & 0xFFFFFFFF) >> (i & 31) & 1)
                        if ok and beats(v, i, bv, bi):
                            bv, bi = v, i
                warp_best.append((bv, bi))
            v, i = -np.inf, -1
            for wv, wi in warp_best:
                if beats(wv, wi, v, i):
                    v, i = wv, wi
            part[r, b] = (v, i)
    ids = np.empty(n, np.int32)
    for r in range(n):                                     # final kernel, 256 threads
        best = [(-np.inf, -1)] * 256
        for t in range(256):
            for p in range(t, P, 256):
                if beats(*part[r, p], *best[t]):
                    best[t] = part[r, p]
        for w in range(8):                                 # xor butterfly in each warp
            lanes = best[32 * w: 32 * w + 32]
            for o in (16, 8, 4, 2, 1):
                lanes = [lanes[l ^ o] if beats(*lanes[l ^ o], *lanes[l]) else lanes[l] for l in range(32)]
            assert len(set(lanes)) == 1                    # every lane holds the warp's best
            best[32 * w] = lanes[0]
        bv, bi = best[0]
        for w in range(1, 8):
            if beats(*best[32 * w], bv, bi):
                bv, bi = best[32 * w]
        ids[r] = bi
    return ids


@pytest.mark.parametrize("V", [1, 19, 63, 64, 65, 600, 16411])
def test_argmax_scheme_matches_reference(V):
    n = 3
    logits = RNG.integers(-4, 5, size=(n, V)).astype(F32)   # many ties
    logits[0, RNG.integers(0, V, size=V // 5)] = np.nan
    logits[1, :: 3] = -np.inf
    words = math.ceil(V / 32)
    bitmask = RNG.integers(-(2**31), 2**31, size=(n, words), dtype=np.int64).astype(np.int32)
    bitmask[:, -1] = -1                                    # padding bits past V set: must be ignored
    for bm in (None, bitmask):
        for blocks in (4 * 132, 7):                        # one pair per warp; 7 blocks striding over V
            np.testing.assert_array_equal(simulate_lm_argmax(logits, bm, blocks), lm_head_ref.masked_argmax(logits, bm))


def test_argmax_scheme_no_candidate_gives_minus_one():
    V = 100
    logits = RNG.standard_normal((2, V)).astype(F32)
    logits[1, :] = np.nan
    bitmask = np.full((2, 4), -1, np.int32)
    bitmask[0, :] = 0
    bitmask[0, 3] = np.int32(-(2**31))                     # bit 31 of word 3 = token 127 > V: ignored
    np.testing.assert_array_equal(simulate_lm_argmax(logits, bitmask), [-1, -1])
    with pytest.raises(NoAllowedToken, match="row 0"):
        lm_head_ref.masked_argmax(logits, bitmask)


def test_argmax_allowed_minus_inf_still_wins():
    logits = np.full((1, 70), -np.inf, F32)
    logits[0, 5] = np.nan
    np.testing.assert_array_equal(simulate_lm_argmax(logits, None), [0])
    np.testing.assert_array_equal(lm_head_ref.masked_argmax(logits), [0])


# --------------------------------------------------------------------------
# router: moe_router_select_kernel


def ranks_before(v, i, w, j) -> bool:
    """moe.cu mtp::ranks_before: larger first, NaN after every number, lower index on ties."""
    vn, wn = bool(np.isnan(v)), bool(np.isnan(w))
    if vn != wn:
        return wn
    return i < j if vn else bool(v > w or (v == w and i < j))


def larger(v, w) -> bool:
    """moe.cu mtp::larger: NaN is the smallest value."""
    return not np.isnan(v) and (bool(np.isnan(w)) or bool(v > w))


def simulate_router_select(logits, bias, spec):
    n, E = logits.shape
    K, G = spec.top_k, spec.n_group
    EG = E // G
    ids = np.full((n, K), -7, np.int32)                    # -7: a slot no thread wrote
    weights = np.empty((n, K), F32)
    for r in range(n):
        l = logits[r]
        with np.errstate(invalid="ignore"):
            if spec.scoring == "softmax":
                z = np.exp(l - np.fmax.reduce(l))          # block_max: fmaxf skips NaN
                s = z / z.sum()
            elif spec.scoring == "sqrtsoftplus":          # as the kernel: l past 20, NaN through log1pf
                s = np.sqrt(np.where(l > F32(20), l, np.log1p(np.exp(np.minimum(l, F32(20))))))
            else:
                s = F32(1) / (F32(1) + np.exp(-l))
        c = s + bias
        gs = np.empty(G, F32)
        for g in range(G):                                 # serial top-2 scan, a >= b, NaN smallest
            a = b = F32(np.nan)
            for v in c[g * EG:(g + 1) * EG]:
                if larger(v, a):
                    a, b = v, a
                elif larger(v, b):
                    b = v
            gs[g] = F32(a) + F32(b) if EG >= 2 else a
        keep = [sum(ranks_before(gs[h], h, gs[g], g) for h in range(G)) < spec.topk_group for g in range(G)]
        cm = np.array([c[e] if keep[e // EG] else F32(-np.inf) for e in range(E)], F32)
        sel = np.empty(K, F32)
        for e in range(E):
            rank = sum(ranks_before(cm[f], f, cm[e], e) for f in range(E))
            if rank < K:
                assert ids[r, rank] == -7, "two experts share a rank"
                ids[r, rank] = e
                sel[rank] = s[e]
        assert (ids[r] >= 0).all(), "an id slot was left unwritten"
        w = sel
        if spec.norm_topk_prob:
            total = F32(0)
            for v in sel:
                total = F32(total + v)
            w = sel / (total + F32(1e-20))
        weights[r] = w * F32(spec.routed_scaling_factor)
    return ids, weights


@pytest.mark.parametrize(
    "E,spec",
    [
        (16, moe_ref.RouterSpec(4, 1, 1, 1.0, True)),
        (64, moe_ref.RouterSpec(8, 8, 4, 2.5, True)),
        (64, moe_ref.RouterSpec(6, 8, 3, 1.0, False)),
        (32, moe_ref.RouterSpec(3, 4, 2, 1.0, True, "softmax")),
        (32, moe_ref.RouterSpec(6, 1, 1, 1.5, True, "sqrtsoftplus")),   # DeepSeek-V4: one group
        (64, moe_ref.RouterSpec(6, 8, 3, 2.5, False, "sqrtsoftplus")),
        (19, moe_ref.RouterSpec(2, 1, 1, 1.0, True)),
        (8, moe_ref.RouterSpec(8, 8, 8, 1.0, True)),               # one expert per group
    ],
)
def test_router_scheme_matches_reference(E, spec):
    n, H = 5, 16
    x = RNG.standard_normal((n, H)).astype(F32)
    gate_w = RNG.standard_normal((E, H)).astype(F32)
    gate_w[: E // 2] = gate_w[0]                              # equal logits: ties by id
    bias = (RNG.integers(-3, 3, size=E) * 0.25).astype(F32)   # negative bias: masked 0.0 can win
    ids_ref, w_ref = moe_ref.moe_router(x, gate_w, bias, spec)
    logits = x @ gate_w.T
    ids, w = simulate_router_select(logits, bias, spec)
    np.testing.assert_array_equal(ids, ids_ref)
    assert_close(w, w_ref, what="router weights")


@pytest.mark.parametrize("scoring", ["sigmoid", "softmax", "sqrtsoftplus"])
@pytest.mark.parametrize("nan_at", [[3], [0, 5, 6, 7], list(range(16))])
def test_router_scheme_nan_rows_fill_every_slot(scoring, nan_at):
    """NaN logits (a NaN hidden row) rank after every number, as the reference's
    argsort puts them: every id slot gets a distinct expert (a plain v > c count gave
    NaN experts rank 0 each, leaving slots unwritten: stale ids in a replayed graph)."""
    E, n, H = 16, 3, 8
    spec = moe_ref.RouterSpec(6, 4, 2, 1.0, True, scoring)
    x = RNG.standard_normal((n, H)).astype(F32)
    x[2] = np.nan                                             # a NaN hidden: every logit NaN
    gate_w = RNG.standard_normal((E, H)).astype(F32)
    gate_w[nan_at] = np.nan                                   # NaN logits of some experts
    bias = (RNG.integers(-3, 3, size=E) * 0.25).astype(F32)
    with np.errstate(invalid="ignore"):
        ids_ref, w_ref = moe_ref.moe_router(x, gate_w, bias, spec)
        ids, w = simulate_router_select(x @ gate_w.T, bias, spec)
    np.testing.assert_array_equal(ids, ids_ref)
    assert all(len(set(row)) == spec.top_k for row in ids.tolist())
    assert_close(w, w_ref, what="router weights")


# --------------------------------------------------------------------------
# experts: moe_expert_kernel's pair gathering + moe_combine_kernel


def simulate_expert_gather(ids_flat: np.ndarray, E: int) -> list[tuple[int, list[int]]]:
    """-> [(expert, pairs of one chunk)] in launch order (slot, then chunk)."""
    nK = ids_flat.size
    by_pair = nK <= E
    chunks = []
    for slot in range(nK if by_pair else E):
        if by_pair:
            e = int(ids_flat[slot])
            if not 0 <= e < E or any(ids_flat[p] == e for p in range(slot)):
                continue
        else:
            e = slot
        cursor = 0
        while True:
            cnt, pairs = 0, [None] * 8
            while cnt < 8 and cursor < nK:
                hit = [cursor + l < nK and ids_flat[cursor + l] == e for l in range(32)]
                before = np.cumsum([0] + hit[:-1])
                total = sum(hit)
                take = min(8 - cnt, total)
                for l in range(32):
                    if hit[l] and before[l] < take:
                        pairs[cnt + before[l]] = cursor + l
                if take < total:
                    cursor += next(l for l in range(32) if hit[l] and before[l] == take)
                else:
                    cursor += 32
                cnt += take
            if cnt == 0:
                break
            chunks.append((e, pairs[:cnt]))
    return chunks


@pytest.mark.parametrize("n,K,E", [(1, 8, 128), (4, 8, 128), (3, 2, 4), (40, 8, 16), (7, 3, 5)])
def test_expert_gather_covers_each_pair_once(n, K, E):
    ids = RNG.integers(0, E, size=(n, K)).astype(np.int32)
    ids[0, 0] = -1                                           # invalid ids: never gathered
    ids[-1, -1] = E
    chunks = simulate_expert_gather(ids.reshape(-1), E)
    seen = [p for _, pairs in chunks for p in pairs]
    valid = [p for p, e in enumerate(ids.reshape(-1)) if 0 <= e < E]
    assert sorted(seen) == valid
    for e, pairs in chunks:
        assert all(ids.reshape(-1)[p] == e for p in pairs)
        assert pairs == sorted(pairs) and 1 <= len(pairs) <= 8
    experts = [e for e, _ in chunks]
    for e in set(experts):                                   # an expert's chunks come from one slot
        first = experts.index(e)
        assert experts[first: first + experts.count(e)] == [e] * experts.count(e)


def test_expert_scheme_matches_reference():
    n, K, E, H, I = 6, 3, 5, 16, 12
    x = RNG.standard_normal((n, H)).astype(F32)
    ids = np.stack([RNG.permutation(E)[:K] for _ in range(n)]).astype(np.int32)
    weights = RNG.random((n, K)).astype(F32)
    w13 = RNG.standard_normal((E, 2 * I, H)).astype(F32)
    w2 = RNG.standard_normal((E, H, I)).astype(F32)
    residual = RNG.standard_normal((n, H)).astype(F32)
    act = np.full((n * K, I), np.nan, F32)
    partial = np.full((n * K, H), np.nan, F32)
    for e, pairs in simulate_expert_gather(ids.reshape(-1), E):   # gate/up launch
        for p in pairs:
            gu = w13[e] @ x[p // K]
            act[p] = gu[:I] / (1 + np.exp(-gu[:I])) * gu[I:]
    for e, pairs in simulate_expert_gather(ids.reshape(-1), E):   # down launch
        for p in pairs:
            partial[p] = w2[e] @ act[p]
    y = residual.copy()                                            # combine, k in order
    for r in range(n):
        for k in range(K):
            y[r] += weights[r, k] * partial[r * K + k]
    assert_close(y, moe_ref.moe_experts(x, ids, weights, w13, w2, residual), what="moe_experts")


# --------------------------------------------------------------------------
# attention: paged_attention_kernel partitions + paged_attention_merge_kernel


def simulate_paged_attention(q, k_cache, v_cache, block_tables, row_seq, row_len, scale, part_size):
    NB, BS, Hkv, D = k_cache.shape
    n, Hq, _ = q.shape
    group = Hq // Hkv
    cap = block_tables.shape[1] * BS
    num_parts = max(1, math.ceil(cap / part_size))
    out = np.zeros((n, Hq, D), F32)
    for r in range(n):
        L = min(int(row_len[r]), cap)
        parts = []
        for p in range(num_parts):
            Lp = min(L - p * part_size, part_size)
            if Lp <= 0:
                continue
            j = p * part_size + np.arange(Lp)
            slot = block_tables[row_seq[r], j // BS] * BS + j % BS
            k = k_cache.reshape(NB * BS, Hkv, D)[slot]            # [Lp, Hkv, D]
            v = v_cache.reshape(NB * BS, Hkv, D)[slot]
            for h in range(Hkv):
                qs = q[r, h * group:(h + 1) * group] * F32(scale)  # [group, D]
                s = qs @ k[:, h].T                                  # [group, Lp]
                m = s.max(axis=1)
                e = np.exp(s - m[:, None])
                parts.append((p, h, m, e.sum(axis=1), e @ v[:, h]))
        for h in range(Hkv):
            mine = [t for t in parts if t[1] == h]
            if not mine:
                continue
            M = np.max([t[2] for t in mine], axis=0)
            den = sum(np.exp(t[2] - M) * t[3] for t in mine)
            num = sum(np.exp(t[2] - M)[:, None] * t[4] for t in mine)
            out[r, h * group:(h + 1) * group] = num / den[:, None]
    return out.reshape(n, Hq * D)


@pytest.mark.parametrize("part_size", [4, 8, 512])
def test_split_kv_scheme_matches_reference(part_size):
    NB, BS, Hkv, D, Hq, S, max_blocks = 12, 4, 2, 19, 6, 3, 5
    k_cache = RNG.standard_normal((NB, BS, Hkv, D)).astype(F32)
    v_cache = RNG.standard_normal((NB, BS, Hkv, D)).astype(F32)
    block_tables = np.stack([RNG.permutation(NB)[:max_blocks] for _ in range(S)]).astype(np.int32)
    row_seq = np.array([0, 1, 1, 2, 0], np.int32)
    row_len = np.array([1, 7, 8, 20, 13], np.int32)
    q = RNG.standard_normal((row_seq.size, Hq, D)).astype(F32)
    scale = D ** -0.5
    ref = attention_ref.paged_attention(q, k_cache, v_cache, block_tables, row_seq, row_len, scale)
    got = simulate_paged_attention(q, k_cache, v_cache, block_tables, row_seq, row_len, scale, part_size)
    assert_close(got, ref, what="paged_attention")


# --------------------------------------------------------------------------
# launch ABI: every launcher's arguments against the kernel's parameter list
# (parsed from its .cu), with fake device arrays and a recording get_kernel.

import itertools  # noqa: E402
import re  # noqa: E402
from types import SimpleNamespace  # noqa: E402

from mtpkern.backends.cuda_launch import _util  # noqa: E402
from mtpkern.ops._check import expect_dtype  # noqa: E402

_KERNEL = re.compile(
    r"(?:template\s*<([^>]*)>\s*)?__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s*)?(\w+)\s*\(([^)]*)\)"
)
_ELEM_DTYPE = {"float": "float32", "__nv_bfloat16": "uint16", "__nv_fp8_e4m3": "uint8", "int": "int32",
               "unsigned char": "uint8",
               "long long": "int64"}
_ADDR = itertools.count(1 << 20, 1 << 20)


def kernel_signatures(family: str) -> dict[str, tuple[list[str], list[tuple[str, bool]]]]:
    """base name -> (template parameter names, [(C type, is pointer)]) from kernels/<family>.cu."""
    text = re.sub(r"//[^\n]*", "", (loader.kernel_dir() / f"{family}.cu").read_text())
    out = {}
    for m in _KERNEL.finditer(text):
        tparams = [p.split()[-1] for p in m.group(1).split(",")] if m.group(1) else []
        params = []
        for p in m.group(3).split(","):
            words = p.replace("*", " * ").replace("__restrict__", "").replace("const", "").split()
            is_ptr = "*" in words
            ctype = " ".join(words[: words.index("*")] if is_ptr else words[:-1])
            params.append((ctype, is_ptr))
        out[m.group(2)] = (tparams, params)
    return out


class FakeDev:
    """Stands in for a contiguous CuPy array."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype = tuple(int(s) for s in shape), np.dtype(dtype)
        self.ndim, self.size = len(self.shape), int(np.prod(self.shape))
        self.nbytes = self.size * self.dtype.itemsize
        self.data = SimpleNamespace(ptr=next(_ADDR))


class Recorder:
    def __init__(self):
        self.launches = []

    def get_kernel(self, family, name):
        assert name in loader.NAME_EXPRESSIONS[family], f"{name} is not compiled for {family}"
        rec = self

        class Kernel:   # as cupy.RawKernel: called to launch, the opt-in attribute settable
            max_dynamic_shared_size_bytes = 48 * 1024

            def __call__(self, grid, block, args, shared_mem=0):
                rec.launches.append((family, name, grid, block, args, shared_mem, self.max_dynamic_shared_size_bytes))

        return Kernel()


@pytest.fixture
def recorder(monkeypatch):
    from mtpkern.backends.cuda_launch import gemm_tc, lm_head, mlp, moe, norm, rope_kv, step

    def device(a, name, *dtypes):
        a = a if isinstance(a, FakeDev) else FakeDev(np.shape(a), np.asarray(a).dtype)
        if dtypes:
            expect_dtype(name, a, *dtypes)
        return a

    def output(out, name, shape, dtype):
        return out if out is not None else FakeDev(shape, dtype)

    rec = Recorder()
    fakes = {
        "device": device, "inplace": device, "output": output, "get_kernel": rec.get_kernel,
        "optional": lambda a, name, *d: None if a is None else device(a, name, *d), "sm_count": lambda: 132,
        "smem_optin": lambda: 227 * 1024,
    }
    for mod in (_util, norm, gemm_tc, linear, rope_kv, attention, mlp, moe, lm_head, step):
        for attr, fake in fakes.items():
            if hasattr(mod, attr):
                monkeypatch.setattr(mod, attr, fake)
    return rec


def check_launch(family, name, grid, block, args, shared_mem, smem_attr):
    base, _, targs = name.partition("<")
    targs = [t.strip() for t in targs.rstrip(">").split(",")] if targs else []
    tparams, params = kernel_signatures(family)[base]
    bind = dict(zip(tparams, targs))
    assert len(args) == len(params), f"{name}: {len(args)} arguments for {len(params)} parameters"
    for i, (arg, (ctype, is_ptr)) in enumerate(zip(args, params)):
        where = f"{name} argument {i} ({ctype}{' *' if is_ptr else ''})"
        if is_ptr:
            if isinstance(arg, np.uint64):
                assert arg == _util.NULL, where
                continue
            assert isinstance(arg, FakeDev), f"{where}: got {type(arg).__name__}"
            if ctype.startswith("mtp::ScaleT<"):      # a weight's scales: FP32 (FP8), E8M0 bytes (FP4)
                w = bind.get(ctype[len("mtp::ScaleT<"):-1], "")
                ctype = "unsigned char" if "fp4" in w else "float"
            assert arg.dtype.name == _ELEM_DTYPE[bind.get(ctype, ctype)], f"{where}: got {arg.dtype}"
        else:
            want = {"int": np.int32, "float": np.float32, "long long": np.int64}[ctype]
            assert type(arg) is want, f"{where}: got {type(arg).__name__}"
    dims = grid + (1,) * (3 - len(grid))
    assert all(d >= 1 for d in dims) and dims[1] <= 65535 and dims[2] <= 65535, f"{name}: grid {grid}"
    assert len(block) == 1 and block[0] % 32 == 0 and 32 <= block[0] <= 1024, f"{name}: block {block}"
    assert 0 <= shared_mem <= max(48 * 1024, smem_attr) <= 227 * 1024, f"{name}: {shared_mem} B of shared memory"


@pytest.mark.parametrize("wdtype", [np.uint16, F32, "fp8"])
def test_launch_abi(recorder, wdtype):
    """Every launch's arguments against the kernel's C++ signature; "fp8": the GEMV weights are
    ``CudaFp8`` (block scales), the KV cache and the embedding table BF16."""
    from mtpkern.backends.cuda_launch import gemm_tc, lm_head, mlp, moe, norm, rope_kv, step

    def f(*shape):
        return np.zeros(shape, F32)

    def wt(*shape):
        if wdtype == "fp8":
            *lead, N, K = shape
            return _util.CudaFp8(FakeDev(shape, np.uint8), FakeDev((*lead, -(-N // 4), -(-K // 8)), F32), 4, 8)
        return np.zeros(shape, wdtype)

    dense = np.uint16 if wdtype == "fp8" else wdtype

    def i(*shape):
        return np.zeros(shape, np.int32)

    n, H = 3, 16
    norm.rmsnorm(f(n, H), f(H), 1e-6)
    norm.mtp_input(np.zeros((50, H), dense), i(n), f(n, H), f(H), f(H), wt(H, 2 * H), 1e-6)
    linear.linear(f(n, H), wt(10, H), f(10), f(n, 10))
    linear.linear(f(n, H), wt(10, H))
    linear.linear(f(8, H), wt(10, H), f(10), f(8, 10))               # BF16: gemm_tc_kernel<1, false>
    gemm_tc.gemm_tc(f(6, H), np.zeros((10, H), np.uint16), f(10), norm=(f(H), 1e-6))          # <1, true>
    mlp.swiglu_mlp(f(8, H), wt(12, H), wt(H, 6), f(8, H))            # BF16: swiglu_tc_kernel<1, false>
    gemm_tc.swiglu_tc(f(6, H), np.zeros((12, H), np.uint16), limit=2.0, norm=(f(H), 1e-6))   # <1, true>
    cache = FakeDev((5, 4, 2, 8), dense)
    rope_kv.qk_norm_rope_kv_write(f(n, 8 * 8), 4, 2, f(8), None, 1e-6, f(2), i(n), cache, cache, i(n))
    tables = i(2, 3)
    attention.paged_attention(f(n, 4, 8), cache, cache, tables, i(n), i(n), 0.3)   # split-KV + merge
    big = FakeDev((64, 128, 8, 128), dense)
    attention.paged_attention(f(1, 96, 128), big, big, i(1, 4), i(1), i(1), 0.1)   # one partition
    mid = FakeDev((64, 16, 8, 64), dense)
    attention.paged_attention(f(2, 32, 64), mid, mid, i(1, 4), i(2), i(2), 0.1)     # BF16: the tc kernel
    moe.moe_router(f(n, H), wt(8, H), f(8), moe_ref.RouterSpec(2, 2, 1, 1.0, True))
    moe.moe_experts(f(n, H), i(n, 2), f(n, 2), wt(4, 12, H), wt(4, H, 6), f(n, H))   # by expert
    moe.moe_experts(f(1, H), i(1, 2), f(1, 2), wt(4, 12, H), wt(4, H, 6))            # by pair
    linear.linear(f(n, H), wt(10, H), None, None, norm=(f(H), 1e-6))                # the NORM kernels
    mlp.swiglu_mlp(f(n, H), wt(12, H), wt(H, 6), f(n, H), norm=(f(H), 1e-6))
    moe.moe_experts(f(n, H), i(n, 2), f(n, 2), wt(4, 12, H), wt(4, H, 6), f(n, H), norm=(f(H), 1e-6))
    mlp.swiglu_mlp(f(n, H), wt(12, H), wt(H, 6), f(n, H))
    lm_head.lm_head_logits(f(n, H), wt(100, H))
    lm_head.lm_head_argmax(f(n, H), wt(100, H), i(n, 4), check=False)
    lm_head.lm_head_argmax(f(n, H), wt(100, H), None, conf=FakeDev((n,), F32), check=False)   # CONF
    step.copy_segments(np.zeros((5, 3), np.int64))

    launched = {name for _, name, *_ in recorder.launches}
    for launch in recorder.launches:
        check_launch(*launch)
    expected = {
        "rmsnorm_kernel", "paged_attention_merge_kernel", "moe_router_select_kernel",
        "moe_combine_kernel", "argmax_final_kernel<false>", "argmax_final_kernel<true>", "copy_segments_kernel",
    }
    assert expected <= launched
    assert {"gemm_tc_kernel<1, true>", "swiglu_tc_kernel<1, true>"} <= launched
    assert ("gemm_tc_kernel<1, false>" in launched) == (wdtype is np.uint16)
    assert ("swiglu_tc_kernel<1, false>" in launched) == (wdtype is np.uint16)
    ct, kv = (loader.CTYPE[np.dtype(t).name] for t in (np.uint8 if wdtype == "fp8" else wdtype, dense))
    assert f"paged_attention_kernel<{kv}, 2>" in launched                      # D = 8: FP32 FMAs
    if kv == "__nv_bfloat16":                                                 # D % 16 == 0: tensor cores
        assert {"paged_attention_tc_kernel<1, 4>", "paged_attention_tc_kernel<1, 2>"} <= launched
    else:
        assert f"paged_attention_kernel<{kv}, 4>" in launched
    assert {f"moe_expert_kernel<{ct}, true, 4, false>", f"moe_expert_kernel<{ct}, false, 4, false>",
            f"linear_kernel<{ct}, 4, false>", f"swiglu_gate_up_kernel<{ct}, 4, false>",
            f"lm_head_argmax_partial_kernel<{ct}, false, 4>", f"lm_head_argmax_partial_kernel<{ct}, true, 4>",
            f"moe_expert_kernel<{ct}, true, 1, false>"} <= launched              # n = 3 (NR = 4); 1
    assert {f"linear_kernel<{ct}, 4, true>", f"swiglu_gate_up_kernel<{ct}, 4, true>",
            f"moe_expert_kernel<{ct}, true, 4, true>"} <= launched               # norm=


def test_a_device_older_than_sm_80_is_refused(monkeypatch):
    """The kernels use BF16 arithmetic and sm_80's tensor cores (the MLA attention): a
    Turing device is refused at construction, naming its compute capability."""
    import types

    import mtpkern.backends.cuda as cuda_mod

    def fake(cc):
        dev = types.SimpleNamespace(id=0, compute_capability=cc)
        return types.SimpleNamespace(cuda=types.SimpleNamespace(
            runtime=types.SimpleNamespace(getDeviceCount=lambda: 1), Device=lambda: dev))

    monkeypatch.setattr(cuda_mod, "_cupy", lambda: fake("75"))
    with pytest.raises(RuntimeError, match=r"compute capability 7\.5; the kernels need 8\.0 or newer"):
        cuda_mod.CudaBackend()
    monkeypatch.setattr(cuda_mod, "_cupy", lambda: fake("90"))
    assert cuda_mod.CudaBackend().device_id == 0
