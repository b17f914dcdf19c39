// attention.cu -- GQA attention over a paged KV cache: KV tiles streamed once per sequence
// through a cp.async pipeline, split-KV, a deterministic merge.
//
//   q [n, Hq, D] fp32, k_cache [NB, BS, Hkv, D] / v_cache [NB, BS, Hkv, Dv] in KV,
//   block_tables [S, max_blocks] int32, row_seq [n], row_start [n] | null, row_len [n],
//   sinks [Hq] | null -> out [n, Hq * Dv] fp32
//   Row r attends to KV rows first .. L - 1 of sequence row_seq[r] (L = row_len[r];
//   first = row_start[r], 0 without row_start: a sliding window); KV row i lives at slot
//   block_tables[s, i / BS] * BS + i % BS. Query head hq reads KV head hq / group
//   (group = Hq / Hkv). Decode rows, the causal rows of a prefill chunk, the rows of an
//   exact-mode module (several rows of one sequence with their own lengths) and the ragged
//   rows of a batched propose are all this one shape. A sink s_hq (sinks not null) joins
//   the softmax as a key of logit s_hq and value 0: out = sum_i e^(l_i - M) v_i /
//   (e^(s_hq - M) + sum_i e^(l_i - M)).
//
// paged_attention_kernel<KV, DC>: grid (Hkv * chunks, n, num_parts), block 128 = 4 warps.
//   KV = __nv_fp8_e4m3 (an FP8 KV cache, mtpkern.ops.kv_fp8): the tiles stage the codes, one byte
//   per element (16-byte copies where D % 16 == Dv % 16 == 0), warp 0 stages each tile row's K and
//   V scales of head h beside its slot (k_scale / v_scale [NB, BS, Hkv]; null for other caches),
//   and every element is read as e4m3(code) * scale (the reference's dequantized value) into
//   the same FMAs.
//   The M dimension of a block is (query rows of one sequence) x (query heads of one KV
//   head): a block serves `heads` query heads (chunks = ceil(group / heads)) of KV head h
//   for a *run* of up to `rows` consecutive rows of one sequence, over partition p, so each
//   K/V row is read from memory once per (run, KV head, head chunk), not once per row.
//   Runs are found on the device (row_seq is device data a captured graph stages): the
//   rows of a sequence that are consecutive in row_seq are cut into runs of `rows`, and the
//   block of blockIdx.y = r works only when r starts a run (its offset in the stretch of
//   equal row_seq values before it is a multiple of `rows`; found with warp ballots); the
//   others exit at once. Rows of one sequence that are not consecutive form separate runs
//   (correct, their KV is read once per run).
//   Partition p of run row i is its KV rows [a_i, b_i) = [first_i + p * part_size,
//   min(L_i, first_i + (p + 1) * part_size)) (relative to each row's own first row, as
//   paged_attention_merge_kernel expects); the block streams the union [lo, hi) of its
//   rows' ranges in tiles of 32 KV rows, every row masking the tile to its own range.
//   Per tile:
//     - staging: `stages` (2 or 3) tiles in a ring in shared memory, K [32][Dp + 16 B]
//       (padded: conflict-free 16-byte reads, one row per lane) and V [32][Dvp]; the tile
//       `stages - 1` ahead is issued as 16-byte cp.async (L2 only, .cg) before the current
//       one is computed, so up to stages - 1 tiles are in flight per block; rows outside
//       every row's range (and past hi) are zero-filled, never read (their block-table
//       entries need not be valid). Warp 0 looks up the slots of a tile one ring turn
//       ahead. Without 16-byte alignment (D % 8, Dv % 8, the caches' addresses) the tile
//       is copied with scalar loads instead (same results).
//     - scores + online softmax: warp w owns the query vectors m = w, w + 4, .. (MW of
//       them, m = row * heads + head); lane t owns the tile's row t: s = q_m . k_t over
//       K in shared memory and q (pre-scaled, FP32) read as broadcasts; a score outside
//       its row's range is -inf and weighs exactly nothing (a NaN V there is never
//       touched, as in the reference). Per m: tile max, m' = max(m, tile max), the running
//       o and l rescaled by e^(m - m'), p = e^(s - m') into a warp-private [32][MW] slab.
//     - PV: the same warp, lane l owns value dims [l * DC, l * DC + DC):
//       o[j][:] += p[j][t] v_t[:] for t in tile order.
//   Only two block barriers per tile; no cross-warp reduction (a warp owns its m's).
//   num_parts == 1: out = o / l (sink: / (l + e^(s - m))); a row with nothing to see
//   gets zeros. Otherwise a row's partial o and (max, sum) go to part_o [n, Hq, num_parts,
//   Dv] / part_ml [n, Hq, num_parts, 2] for the partitions that hold any of its rows and
//   paged_attention_merge_kernel combines them.
//   Shared memory (dynamic, bytes) = stages * 32 * (Dp + 16 / sizeof(KV) + Dvp) * sizeof(KV)
//   + 4 * (rows * heads * Dp + 4 * 32 * MW + 16 * MW + stages * 32 + 2 * rows), Dp / Dvp = D / Dv
//   rounded up to 8, MW = 8 (DC 2, 4) or 4 (DC 8), and for FP8 + 4 * 2 * (stages + 1) * 32 (the
//   scales); the launcher computes the same sum.
//
// paged_attention_tc_kernel<MT, DC>: the same outputs and partials from the same arguments and
//   grid over a BF16 cache, the scores and P V on tensor cores (mma.sync m16n8k16) with q in
//   three BF16 parts and P in two (FP32-level results); its comment below has the design.
//
// paged_attention_merge_kernel: grid (Hq, n), block 128 over Dv:
//   out = sum_p e^(m_p - M) o_p / (e^(s - M) + sum_p e^(m_p - M) l_p) over the row's valid
//   partitions p < ceil((L - first) / part_size) (M = max(s, m_p); no sink: no s). The
//   weights e^(m_p - M) are computed once per block into shared memory (256 partitions at
//   a time), the numerators summed in partition order (deterministic, no atomics): the
//   sink counts once, however many partitions there are. Also merges mla.cu's partials.
//
// Preconditions: blockDim.x == 128; gridDim.y == n (the rows of the launch); heads * rows
// <= 4 * MW; D <= 256; Dv <= 32 * DC (merge: Dv <= 512); stages in {2, 3}; part_size > 0;
// block_tables entries of the blocks holding rows first .. L - 1 are valid blocks (the
// others are never read); slots < 2^31. L is clamped to max_blocks * BS and first to
// 0 .. L; a row with first >= L gets zeros.
// Summation order: fixed by the launch (tile order, then rows of a tile in order), so the
// same launch gives the same bits; a different `rows` or `part_size` rounds differently.
// Cost per tile of 32 KV rows and M query vectors: 32 M (D + Dv) FMAs on CUDA cores and
// ~5x the tile's bytes of shared-memory traffic (each warp reads the whole K and V tile).
// paged_attention_tc_kernel<MT, DC> (below) computes the same over a BF16 cache on tensor
// cores, the launcher's choice there (docs/cuda.md, "Paged attention: design and model").
#include "common.cuh"
#include "mma.cuh"

namespace mtp {
constexpr int kAttnWarps = 4;
constexpr int kAttnThreads = kAttnWarps * kWarp;
constexpr int kAttnTile = 32;     // KV rows per tile: one per lane in the scores pass
constexpr int kMergeChunk = 256;  // partitions whose weights the merge holds at a time

// 16 bytes global -> shared without a register stop (cp.async.cg: cached in L2 only);
// !valid: 16 zero bytes (src-size 0: src is not read). Completes at cp_async_wait.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
#if defined(MTPKERN_CUDA_EMU)
  if (valid) std::memcpy(dst, src, 16);
  else std::memset(dst, 0, 16);
#else
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src), "r"(valid ? 16 : 0)
               : "memory");
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if !defined(MTPKERN_CUDA_EMU)
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
// Wait until at most N of this thread's committed groups are still in flight (the
// emulator copies synchronously: nothing is ever in flight).
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if !defined(MTPKERN_CUDA_EMU)
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

__device__ __forceinline__ void set_zero(float& x) { x = 0.0f; }
__device__ __forceinline__ void set_zero(__nv_bfloat16& x) { x = __float2bfloat16_rn(0.0f); }
__device__ __forceinline__ void set_zero(__nv_fp8_e4m3& x) { x.__x = 0; }

// N elements of a shared-memory row as floats (p aligned to N * sizeof(KV), 16 at most
// per read: N * 4 == 32 is two reads).
template <int N>
__device__ __forceinline__ void lds(const float* p, float (&f)[N]) {
  if constexpr (N == 2) {
    const float2 v = *reinterpret_cast<const float2*>(p);
    f[0] = v.x; f[1] = v.y;
  } else {
#pragma unroll
    for (int h = 0; h < N / 4; ++h) {
      const float4 v = reinterpret_cast<const float4*>(p)[h];
      f[4 * h] = v.x; f[4 * h + 1] = v.y; f[4 * h + 2] = v.z; f[4 * h + 3] = v.w;
    }
  }
}
template <int N>
__device__ __forceinline__ void lds(const __nv_bfloat16* p, float (&f)[N]) {
  if constexpr (N == 2) {
    const unsigned u = *reinterpret_cast<const unsigned*>(p);
    f[0] = bf16_lo(u); f[1] = bf16_hi(u);
  } else if constexpr (N == 4) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    f[0] = bf16_lo(u.x); f[1] = bf16_hi(u.x); f[2] = bf16_lo(u.y); f[3] = bf16_hi(u.y);
  } else {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    f[0] = bf16_lo(u.x); f[1] = bf16_hi(u.x); f[2] = bf16_lo(u.y); f[3] = bf16_hi(u.y);
    f[4] = bf16_lo(u.z); f[5] = bf16_hi(u.z); f[6] = bf16_lo(u.w); f[7] = bf16_hi(u.w);
  }
}

// N E4M3 codes of a shared-memory row (p aligned to N bytes) -> their values times the row's
// scale, e4m3(code) * scale: one FP32 rounding, the reference's dequantized value (an FP8 KV
// cache, mtpkern.ops.kv_fp8; e4m3() is the FP8 weights' decode). Other caches: lds, no scale.
template <int N>
__device__ __forceinline__ void lds_kv(const __nv_fp8_e4m3* p, float scale, float (&f)[N]) {
  const unsigned char* c = reinterpret_cast<const unsigned char*>(p);
  unsigned long long u;
  if constexpr (N == 2) u = *reinterpret_cast<const unsigned short*>(c);
  else if constexpr (N == 4) u = *reinterpret_cast<const unsigned*>(c);
  else u = *reinterpret_cast<const unsigned long long*>(c);
#pragma unroll
  for (int i = 0; i < N; ++i) f[i] = e4m3(static_cast<unsigned char>(u >> (8 * i))) * scale;
}
template <int N, typename KV>
__device__ __forceinline__ void lds_kv(const KV* p, float, float (&f)[N]) { lds<N>(p, f); }

// Query vectors per warp: o[MW][DC] = 32 registers (16 for DC 2).
template <int DC>
__host__ __device__ constexpr int attn_mw() { return DC == 8 ? 4 : 8; }

// -- what both attention kernels share: the run, the rows' ranges, the tiles' slots and copies

// The block's place in the grid (Hkv * chunks, n, num_parts), chunks = ceil(group / heads):
// KV head h, its query heads hq0 .. hq0 + gc - 1 (g0 .. g0 + gc - 1 of the group), block row r0
// (of sequence seq) and partition p.
struct AttnBlock {
  int warp, lane, h, gc, hq0, p, r0, seq;
};
__device__ __forceinline__ AttnBlock attn_block(const int* __restrict__ row_seq, int Hq, int Hkv, int heads) {
  AttnBlock b;
  b.warp = threadIdx.x / kWarp;
  b.lane = threadIdx.x % kWarp;
  const int group = Hq / Hkv;
  const int chunks = (group + heads - 1) / heads;
  const int g0 = (blockIdx.x % chunks) * heads;
  b.h = blockIdx.x / chunks;
  b.gc = min(heads, group - g0);
  b.hq0 = b.h * group + g0;
  b.p = blockIdx.z;
  b.r0 = blockIdx.y;
  b.seq = row_seq[b.r0];
  return b;
}

// The run of block row r0 (every lane computes the same, so an exit on it is uniform): its row
// count, or 0 when r0 does not start a run (its offset in the stretch of consecutive rows of
// `seq` that holds it is not a multiple of `rows`).
__device__ __forceinline__ int attn_run(const int* __restrict__ row_seq, int n, int r0, int seq, int rows,
                                        int lane) {
  int begin = r0;  // first row of the stretch of rows of `seq` that holds r0
  while (begin > 0) {
    const int i = begin - 1 - lane;
    const unsigned other = __ballot_sync(kFullMask, i < 0 || row_seq[i] != seq);
    if (other) {
      begin -= __ffs(other) - 1;
      break;
    }
    begin -= kWarp;
  }
  if ((r0 - begin) % rows != 0) return 0;
  int nr = 0;  // rows r0 .. r0 + nr - 1
  for (;;) {
    const int i = r0 + nr + lane;
    const unsigned same = __ballot_sync(kFullMask, nr + lane < rows && i < n && row_seq[i] == seq);
    const int c = same == kFullMask ? kWarp : __ffs(~same) - 1;
    nr += c;
    if (c < kWarp) break;
  }
  return nr;
}

// The KV rows a run streams in partition p, and the ring that stages them.
struct AttnRing {
  const int* ra;  // [nr] shared: a_i, the first KV row of row i in the partition
  const int* rb;  // [nr] shared: b_i, one past its last
  int* slots;     // [stages][T] shared: the slots of the tiles in the ring, -1: not read
  int nr, lo, hi, ntiles, stages;
  bool contig;    // the rows' ranges share a point: every row of [lo, hi) is read
  bool vec;       // 16-byte copies (D % 8, Dv % 8 and the caches aligned)
};

// Partition p's range [a_i, b_i) of each run row into ra / rb (relative to the row's own first
// row, as paged_attention_merge_kernel expects).
__device__ __forceinline__ void attn_ranges(int* ra, int* rb, int nr, int r0, const int* __restrict__ row_start,
                                            const int* __restrict__ row_len, int cap, int p, int part_size) {
  for (int i = threadIdx.x; i < nr; i += blockDim.x) {
    const int L = min(row_len[r0 + i], cap);
    const int first = row_start ? min(max(row_start[r0 + i], 0), max(L, 0)) : 0;
    const int a = first + p * part_size;
    ra[i] = a;
    rb[i] = min(L, a + part_size);
  }
}

// After a barrier past attn_ranges: the union [lo, hi) of the rows' ranges (lo >= hi: none).
__device__ __forceinline__ AttnRing attn_ring(const int* ra, const int* rb, int* slots, int nr, int stages,
                                              bool vec) {
  int lo = 0x7fffffff, hi = -0x7fffffff, amax = -0x7fffffff, bmin = 0x7fffffff;
  for (int i = 0; i < nr; ++i) {
    const int a = ra[i], b = rb[i];
    if (a < b) { lo = min(lo, a); hi = max(hi, b); amax = max(amax, a); bmin = min(bmin, b); }
  }
  const int ntiles = lo < hi ? (hi - lo + kAttnTile - 1) / kAttnTile : 0;
  return AttnRing{ra, rb, slots, nr, lo, hi, ntiles, stages, amax <= bmin, vec};
}

// Warp 0: the slots of tile k into ring stage k % stages (-1: a row no query row of the block sees).
// An FP8 cache (kscale not null): also its rows' scales of KV head h, K's into ks and V's into vs,
// rings of stages + 1 tiles [stages + 1][T] (0 for a row not read): tile k + stages's are written
// while the PV pass of tile k has yet to read tile k's V scales.
__device__ __forceinline__ void attn_tile_slots(const AttnRing& R, int k, const int* __restrict__ block_tables,
                                                int seq, int max_blocks, int BS, int warp, int lane,
                                                const float* __restrict__ kscale = nullptr,
                                                const float* __restrict__ vscale = nullptr, float* ks = nullptr,
                                                float* vs = nullptr, int Hkv = 0, int h = 0) {
  if (warp != 0 || k >= R.ntiles) return;
  const int pos = R.lo + k * kAttnTile + lane;
  bool need = pos < R.hi;
  if (need && !R.contig) {
    need = false;
    for (int i = 0; i < R.nr; ++i) need = need || (R.ra[i] <= pos && pos < R.rb[i]);
  }
  const int slot = need ? block_tables[static_cast<long long>(seq) * max_blocks + pos / BS] * BS + pos % BS : -1;
  const int at = (k % R.stages) * kAttnTile + lane;
  R.slots[at] = slot;
  if (kscale != nullptr) {
    const long long i = static_cast<long long>(slot) * Hkv + h;
    const int sat = (k % (R.stages + 1)) * kAttnTile + lane;
    ks[sat] = slot >= 0 ? kscale[i] : 0.0f;
    vs[sat] = slot >= 0 ? vscale[i] : 0.0f;
  }
}

// Every thread: its share of tile k's K and V rows of KV head h into ring stage k % stages,
// K [T][Dks] and V [T][Dvs] (row strides in elements); rows not read and the columns from D / Dv
// to Dp / Dvp (rounded up to 8) are zeros. One cp.async group per call, an empty one past the
// last tile (so the wait count stays fixed).
template <typename KV>
__device__ __forceinline__ void attn_issue(const AttnRing& R, int k, KV* k_s, KV* v_s, int Dks, int Dvs,
                                           const KV* __restrict__ k_cache, const KV* __restrict__ v_cache,
                                           int Hkv, int h, int D, int Dv, int warp, int lane) {
  constexpr int T = kAttnTile;
  constexpr int E = 16 / static_cast<int>(sizeof(KV));  // elements per 16-byte copy
  if (k < R.ntiles) {
    KV* kd = k_s + (k % R.stages) * T * Dks;
    KV* vd = v_s + (k % R.stages) * T * Dvs;
    const int* sl = R.slots + (k % R.stages) * T;
    if (R.vec) {  // a warp per tile row, a lane per 16-byte piece of its K | V
      const int ck = D / E, per = (D + Dv) / E;
      for (int t = warp; t < T; t += kAttnWarps) {
        const int slot = sl[t];
        const long long s = slot >= 0 ? slot : 0;
        const KV* kg = k_cache + (s * Hkv + h) * D;
        const KV* vg = v_cache + (s * Hkv + h) * Dv - D;  // piece e >= ck: v element e * E - D
        for (int e = lane; e < per; e += kWarp) {
          if (e < ck) cp_async16(kd + t * Dks + e * E, kg + e * E, slot >= 0);
          else cp_async16(vd + t * Dvs + e * E - D, vg + e * E, slot >= 0);
        }
      }
    } else {  // scalar copies, a warp per tile row; zeros past D / Dv and for rows not read
      const int Dp = (D + 7) & ~7, Dvp = (Dv + 7) & ~7;
      for (int t = warp; t < T; t += kAttnWarps) {
        const int slot = sl[t];
        const long long s = slot >= 0 ? slot : 0;
        const KV* kg = k_cache + (s * Hkv + h) * D;
        const KV* vg = v_cache + (s * Hkv + h) * Dv;
        for (int e = lane; e < Dp; e += kWarp) {
          if (slot >= 0 && e < D) kd[t * Dks + e] = kg[e];
          else set_zero(kd[t * Dks + e]);
        }
        for (int e = lane; e < Dvp; e += kWarp) {
          if (slot >= 0 && e < Dv) vd[t * Dvs + e] = vg[e];
          else set_zero(vd[t * Dvs + e]);
        }
      }
    }
  }
  cp_async_commit();
}

// A row of the run with nothing in partition p: zeros into out when there is one partition.
__device__ __forceinline__ void attn_zero_out(float* __restrict__ out, int M, int gc, int r0, int Hq, int hq0,
                                              int Dv) {
  for (int t = threadIdx.x; t < M * Dv; t += blockDim.x) {
    const int m = t / Dv;
    out[(static_cast<long long>(r0 + m / gc) * Hq + hq0 + m % gc) * Dv + t % Dv] = 0.0f;
  }
}

}  // namespace mtp

// At most 128 registers (4 blocks of 128 threads per SM): without the minimum-blocks hint
// ptxas picks 72..96 registers for some instantiations and spills to get there.
template <typename KV, int DC>
__global__ void __launch_bounds__(mtp::kAttnThreads, 4)
paged_attention_kernel(const float* __restrict__ q, const KV* __restrict__ k_cache,
                       const KV* __restrict__ v_cache, const int* __restrict__ block_tables,
                       int max_blocks, const int* __restrict__ row_seq, const int* __restrict__ row_start,
                       const int* __restrict__ row_len, const float* __restrict__ sinks,
                       float* __restrict__ out, float* __restrict__ part_o, float* __restrict__ part_ml,
                       int Hq, int Hkv, int D, int Dv, int BS, int heads, int rows, int stages, int part_size,
                       int num_parts, float scale, const float* __restrict__ k_scale,
                       const float* __restrict__ v_scale) {
  using namespace mtp;
  constexpr int MW = attn_mw<DC>();
  constexpr int T = kAttnTile;
  constexpr int E = 16 / static_cast<int>(sizeof(KV));  // elements per 16-byte copy
  constexpr bool kFp8 = kv_fp8<KV>;                     // E4M3 codes, scales k_scale / v_scale
  extern __shared__ float4 smem_raw[];
  const AttnBlock B = attn_block(row_seq, Hq, Hkv, heads);
  const int warp = B.warp, lane = B.lane, h = B.h, gc = B.gc, hq0 = B.hq0, p = B.p, r0 = B.r0, seq = B.seq;

  const int nr = attn_run(row_seq, gridDim.y, r0, seq, rows, lane);
  if (nr == 0) return;
  const int M = nr * gc;  // query vectors of the block, m = row * gc + head

  const int Dp = (D + 7) & ~7, Dks = Dp + E, Dvs = (Dv + 7) & ~7;
  KV* k_s = reinterpret_cast<KV*>(smem_raw);                       // [stages][T][Dks]
  KV* v_s = k_s + stages * T * Dks;                                // [stages][T][Dvs]
  float* q_s = reinterpret_cast<float*>(v_s + stages * T * Dvs);   // [rows * heads][Dp], q * scale
  float* p_s = q_s + rows * heads * Dp;                            // [warps][T][MW] probabilities
  float* ml_s = p_s + kAttnWarps * T * MW;                         // [warps][2][2][MW] running max, sum
  int* slot_s = reinterpret_cast<int*>(ml_s + kAttnWarps * 4 * MW);  // [stages][T], -1: not read
  int* ra_s = slot_s + stages * T;                                 // [rows] a_i
  int* rb_s = ra_s + rows;                                         // [rows] b_i
  float* ks_s = reinterpret_cast<float*>(rb_s + rows);             // FP8: [stages + 1][T] the rows' K scales,
  float* vs_s = ks_s + (stages + 1) * T;                           // [stages + 1][T] and V scales

  attn_ranges(ra_s, rb_s, nr, r0, row_start, row_len, max_blocks * BS, p, part_size);
  __syncthreads();
  const bool vec = D % 8 == 0 && Dv % 8 == 0 && (!kFp8 || (D % E == 0 && Dv % E == 0)) && aligned16(k_cache) &&
                   aligned16(v_cache);
  const AttnRing R = attn_ring(ra_s, rb_s, slot_s, nr, stages, vec);
  if (R.ntiles == 0) {  // uniform: no row of the run has a KV row in this partition
    if (num_parts == 1) attn_zero_out(out, M, gc, r0, Hq, hq0, Dv);
    return;
  }
  // q only for blocks with work (past a row's length, or outside a window, most blocks exit
  // above); read after the barrier below
  for (int t = threadIdx.x; t < M * Dp; t += blockDim.x) {
    const int m = t / Dp, d = t % Dp;
    const long long hq = static_cast<long long>(r0 + m / gc) * Hq + hq0 + m % gc;
    q_s[t] = d < D ? q[hq * D + d] * scale : 0.0f;
  }
  const int ntiles = R.ntiles, hi = R.hi, lo = R.lo;
  auto tile_slots = [&](int k) {
    if constexpr (kFp8) attn_tile_slots(R, k, block_tables, seq, max_blocks, BS, warp, lane, k_scale, v_scale, ks_s,
                                        vs_s, Hkv, h);
    else attn_tile_slots(R, k, block_tables, seq, max_blocks, BS, warp, lane);
  };
  auto issue = [&](int k) { attn_issue(R, k, k_s, v_s, Dks, Dvs, k_cache, v_cache, Hkv, h, D, Dv, warp, lane); };

  // o in registers; the running max and sum of the warp's query vectors in shared memory,
  // double-buffered by tile parity: every lane reads buffer k & 1 and computes the same new
  // values, lane 0 writes them to the other buffer (no lane can overwrite what another lane
  // of its warp has yet to read; the next tile reads them after two barriers)
  float o[MW][DC];
  float* ml_w = ml_s + warp * 4 * MW;  // [2][max | sum][MW]
#pragma unroll
  for (int j = 0; j < MW; ++j)
#pragma unroll
    for (int c = 0; c < DC; ++c) o[j][c] = 0.0f;
  if (lane < MW) { ml_w[lane] = neg_inf(); ml_w[MW + lane] = 0.0f; }
  for (int k = 0; k < stages - 1; ++k) tile_slots(k);
  __syncthreads();
  for (int k = 0; k < stages - 1; ++k) issue(k);
  tile_slots(stages - 1);
  const int dl = lane * DC;  // this lane's value dims in the PV pass
  float* pw = p_s + warp * T * MW;

  for (int k = 0; k < ntiles; ++k) {
    if (stages == 3) cp_async_wait<1>();
    else cp_async_wait<0>();
    __syncthreads();  // tile k is in shared memory; the slots of tile k + stages - 1 are written
    issue(k + stages - 1);
    const int tile0 = lo + k * T, pos = tile0 + lane;

    // scores of row `lane` of the tile for this warp's query vectors
    const KV* kr = k_s + (k % stages) * T * Dks + lane * Dks;
    const float ksc = kFp8 ? ks_s[(k % (stages + 1)) * T + lane] : 1.0f;  // this lane's row's K scale (FP8)
    float acc[MW];
#pragma unroll
    for (int j = 0; j < MW; ++j) acc[j] = 0.0f;
#pragma unroll 1
    for (int d0 = 0; d0 < Dp; d0 += 8) {
      float kf[8];
      lds_kv<8>(kr + d0, ksc, kf);
#pragma unroll
      for (int j = 0; j < MW; ++j) {
        const int m = warp + kAttnWarps * j;
        if (m < M) {
          const float4* qm = reinterpret_cast<const float4*>(q_s + m * Dp + d0);
          const float4 qa = qm[0], qb = qm[1];
          float a = acc[j];
          a = fmaf(qa.x, kf[0], a); a = fmaf(qa.y, kf[1], a); a = fmaf(qa.z, kf[2], a); a = fmaf(qa.w, kf[3], a);
          a = fmaf(qb.x, kf[4], a); a = fmaf(qb.y, kf[5], a); a = fmaf(qb.z, kf[6], a); a = fmaf(qb.w, kf[7], a);
          acc[j] = a;
        }
      }
    }
    // online softmax per query vector (warp-uniform branches: the reductions are collective)
#pragma unroll
    for (int j = 0; j < MW; ++j) {
      const int m = warp + kAttnWarps * j;
      float e = -1.0f;  // -1: outside the row's range (or no such m), skipped by the PV pass
      if (m < M) {
        const int i = m / gc;
        const bool in = ra_s[i] <= pos && pos < rb_s[i];
        const float s = in ? acc[j] : neg_inf();
        const float* old = ml_w + (k & 1) * 2 * MW;
        const float mold = old[j], lold = old[MW + j];
        const float mn = fmaxf(mold, warp_max(s));
        // a -inf score weighs 0, also while every score so far is -inf (mn = -inf, where
        // e^(-inf - mn) would be NaN); mx itself goes to the merge unchanged
        const float mo = mn == neg_inf() ? 0.0f : mn;
        const float alpha = expf(mold - mo);
        const float pe = in ? expf(s - mo) : 0.0f;
        const float ln = lold * alpha + warp_sum(pe);
        if (lane == 0) { ml_w[(~k & 1) * 2 * MW + j] = mn; ml_w[(~k & 1) * 2 * MW + MW + j] = ln; }
#pragma unroll
        for (int c = 0; c < DC; ++c) o[j][c] *= alpha;
        if (in) e = pe;
      }
      pw[lane * MW + j] = e;
    }
    tile_slots(k + stages);  // ring stage k % stages: its slots (tile k's) are no longer read
    __syncthreads();         // p of the whole tile is written

    // PV: o[j][:] += p[j][t] v_t[:], t in tile order
    if (dl < Dvs) {
      const KV* vt = v_s + (k % stages) * T * Dvs + dl;
      const float* vsc = vs_s + (k % (stages + 1)) * T;  // FP8: the tile rows' V scales
      const int nt = min(T, hi - tile0);
#pragma unroll 2
      for (int t = 0; t < nt; ++t) {
        float vf[DC];
        lds_kv<DC>(vt + t * Dvs, kFp8 ? vsc[t] : 1.0f, vf);
        const float* pt = pw + t * MW;
#pragma unroll
        for (int j4 = 0; j4 < MW; j4 += 4) {
          if (warp + kAttnWarps * j4 >= M) break;  // warp-uniform: no query vector from here on
          const float4 pp = *reinterpret_cast<const float4*>(pt + j4);  // broadcast
          const float pj[4] = {pp.x, pp.y, pp.z, pp.w};
#pragma unroll
          for (int u = 0; u < 4; ++u)
            if (!(pj[u] < 0.0f))  // in range (NaN included: it propagates, as in the reference)
#pragma unroll
              for (int c = 0; c < DC; ++c) o[j4 + u][c] = fmaf(pj[u], vf[c], o[j4 + u][c]);
        }
      }
    }
  }

#pragma unroll
  for (int j = 0; j < MW; ++j) {
    const int m = warp + kAttnWarps * j;
    if (m < M) {
      const int i = m / gc;
      const int hk = hq0 + m % gc;  // query head
      const long long hq = static_cast<long long>(r0 + i) * Hq + hk;
      const bool active = ra_s[i] < rb_s[i];
      const float mxj = ml_w[(ntiles & 1) * 2 * MW + j], lj = ml_w[(ntiles & 1) * 2 * MW + MW + j];
      if (num_parts == 1) {
        // the whole denominator: l + e^(s - m) (m = -inf: inf, so the output is 0)
        const float den = sinks != nullptr ? lj + expf(sinks[hk] - mxj) : lj;
#pragma unroll
        for (int c = 0; c < DC; ++c)
          if (dl + c < Dv) out[hq * Dv + dl + c] = active ? o[j][c] / den : 0.0f;
      } else if (active) {
        const long long at = hq * num_parts + p;  // [n, Hq, num_parts]
#pragma unroll
        for (int c = 0; c < DC; ++c)
          if (dl + c < Dv) part_o[at * Dv + dl + c] = o[j][c];
        if (lane == 0) { part_ml[2 * at] = mxj; part_ml[2 * at + 1] = lj; }
      }
    }
  }
}


// Tensor-core variant over a BF16 cache: the same outputs and partials from the same arguments
// and grid (runs, ranges, ring and tiles as above), with both products on mma.sync m16n8k16.
// The block's M query vectors are the mma's rows, MT tiles of 16 (m >= M: zero rows, weight 0).
// Per tile of 32 KV rows:
//   1. S [16 MT x 32] = (q * scale) K^T: warp w the 8 KV rows 8 w .. 8 w + 7 (one n-tile), D / 16
//      k-steps; q is held as three BF16 terms per value (mma.cuh's split_pair, as gemm_tc's x:
//      24 significant bits, within 2^-26 |q|), so each product with a BF16 key is exact and a
//      score carries FP32 accumulation only; each term has an accumulator of its own (three
//      independent mma chains), S = (lo + mid) + hi into s_s [16 MT][T + 4] FP32.
//   2. online softmax: 128 / (16 MT) threads per query vector (a group of adjacent lanes), each
//      32 / that many of the tile's rows; the group's max and sum by xor shuffles inside it; the
//      running max and sum in the group's registers; p = e^(s - m) (0 outside the vector's range)
//      into p_s as two BF16 parts, p = hi + lo within 2^-16 p; the rescale factor into a_s.
//   3. O [16 MT x Dv] = alpha O + P V: warp w owns the n-tiles of 8 value dims w, w + 4, .. (DC of
//      them: O is 4 DC MT floats a thread), 2 k-steps of 16 KV rows, both parts of P.
// V rows are staged with a 16-byte pad (Dv + 8) so the k-major B fragments hit distinct banks.
// A KV row outside a vector's range still enters its PV product, with weight exactly 0: a
// non-finite V there (a row another row of the run sees) would show in the output, where the
// scalar kernel never touches it; KV rows no row of the run sees are zero-filled as above.
// Preconditions (besides the scalar kernel's): D % 16 == 0, Dv % 8 == 0, Dv <= 32 DC,
// heads * rows <= 16 MT.
template <int MT, int DC>
__global__ void __launch_bounds__(mtp::kAttnThreads, 3)
paged_attention_tc_kernel(const float* __restrict__ q, const __nv_bfloat16* __restrict__ k_cache,
                          const __nv_bfloat16* __restrict__ v_cache, const int* __restrict__ block_tables,
                          int max_blocks, const int* __restrict__ row_seq, const int* __restrict__ row_start,
                          const int* __restrict__ row_len, const float* __restrict__ sinks,
                          float* __restrict__ out, float* __restrict__ part_o, float* __restrict__ part_ml,
                          int Hq, int Hkv, int D, int Dv, int BS, int heads, int rows, int stages, int part_size,
                          int num_parts, float scale) {
  using namespace mtp;
  using bf16 = __nv_bfloat16;
  constexpr int T = kAttnTile;
  constexpr int MR = 16 * MT;             // the mma's rows: query vectors, padded
  constexpr int TPR = kAttnThreads / MR;  // softmax threads per query vector (8 or 4)
  constexpr int KPT = T / TPR;            // tile rows per softmax thread (4 or 8)
  constexpr int SS = T + 4;               // s_s row stride (floats)
  constexpr int PS = T + 8;               // p_s row stride (BF16: 80-byte rows, distinct banks)
  extern __shared__ float4 smem_raw[];
  const AttnBlock B = attn_block(row_seq, Hq, Hkv, heads);
  const int warp = B.warp, lane = B.lane, h = B.h, gc = B.gc, hq0 = B.hq0, p = B.p, r0 = B.r0, seq = B.seq;

  const int nr = attn_run(row_seq, gridDim.y, r0, seq, rows, lane);
  if (nr == 0) return;
  const int M = nr * gc;

  const int Dks = D + 8, Dvs = Dv + 8, Dq = D + 8;
  bf16* k_s = reinterpret_cast<bf16*>(smem_raw);          // [stages][T][Dks]
  bf16* v_s = k_s + stages * T * Dks;                     // [stages][T][Dvs]
  bf16* q_s = v_s + stages * T * Dvs;                     // [3][MR][Dq]: q * scale, hi | mid | lo
  bf16* p_s = q_s + 3 * MR * Dq;                          // [2][MR][PS]: p, hi | lo
  float* s_s = reinterpret_cast<float*>(p_s + 2 * MR * PS);  // [MR][SS] scores
  float* a_s = s_s + MR * SS;                             // [MR] rescale factors of the tile
  float* ml_s = a_s + MR;                                 // [MR][2] final max, sum
  int* slot_s = reinterpret_cast<int*>(ml_s + 2 * MR);    // [stages][T]
  int* ra_s = slot_s + stages * T;                        // [rows]
  int* rb_s = ra_s + rows;                                // [rows]

  attn_ranges(ra_s, rb_s, nr, r0, row_start, row_len, max_blocks * BS, p, part_size);
  __syncthreads();
  const bool vec = aligned16(k_cache) && aligned16(v_cache);
  const AttnRing R = attn_ring(ra_s, rb_s, slot_s, nr, stages, vec);
  if (R.ntiles == 0) {
    if (num_parts == 1) attn_zero_out(out, M, gc, r0, Hq, hq0, Dv);
    return;
  }
  // q's parts only for blocks with work, two values a thread (D even); read after the barrier below
  for (int t = threadIdx.x; t < MR * D / 2; t += blockDim.x) {
    const int m = t / (D / 2), d = 2 * (t % (D / 2));
    float x0 = 0.0f, x1 = 0.0f;
    if (m < M) {
      const float* qr = q + (static_cast<long long>(r0 + m / gc) * Hq + hq0 + m % gc) * D + d;
      x0 = qr[0] * scale;
      x1 = qr[1] * scale;
    }
    unsigned parts[3];
    split_pair<3>(x0, x1, parts);
#pragma unroll
    for (int e = 0; e < 3; ++e) *reinterpret_cast<unsigned*>(q_s + (e * MR + m) * Dq + d) = parts[e];
  }

  // the softmax thread's query vector and its range (m >= M: an empty range)
  const int sm = threadIdx.x / TPR, sc0 = (threadIdx.x % TPR) * KPT;
  const int sa = sm < M ? ra_s[sm / gc] : 0, sb = sm < M ? rb_s[sm / gc] : 0;
  float m_run = neg_inf(), l_run = 0.0f;

  float o[MT][DC][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int j = 0; j < DC; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) o[mt][j][i] = 0.0f;
  const int mts = (M + 15) / 16;  // m-tiles with a query vector (warp-uniform)

  auto tile_slots = [&](int k) { attn_tile_slots(R, k, block_tables, seq, max_blocks, BS, warp, lane); };
  auto issue = [&](int k) { attn_issue(R, k, k_s, v_s, Dks, Dvs, k_cache, v_cache, Hkv, h, D, Dv, warp, lane); };
  for (int k = 0; k < stages - 1; ++k) tile_slots(k);
  __syncthreads();
  for (int k = 0; k < stages - 1; ++k) issue(k);
  tile_slots(stages - 1);

  for (int k = 0; k < R.ntiles; ++k) {
    if (stages == 3) cp_async_wait<1>();
    else cp_async_wait<0>();
    __syncthreads();  // tile k is in shared memory; the slots of tile k + stages - 1 are written
    issue(k + stages - 1);
    const bf16* kt = k_s + (k % stages) * T * Dks;
    const bf16* vt = v_s + (k % stages) * T * Dvs;

    // 1. S = Q K^T, warp w: tile rows 8 w ..; each part of q in an accumulator of its own (three
    // independent mma chains), S = (lo + mid) + hi
    {
      float sc[MT][3][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int part = 0; part < 3; ++part)
#pragma unroll
          for (int i = 0; i < 4; ++i) sc[mt][part][i] = 0.0f;
      for (int d0 = 0; d0 < D; d0 += 16) {
        unsigned b[2];
        mma_load_b_nk(b, kt + 8 * warp * Dks + d0, Dks, lane);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          if (mt < mts) {
#pragma unroll
            for (int part = 0; part < 3; ++part) {
              unsigned a[4];
              mma_load_a(a, q_s + (part * MR + 16 * mt) * Dq + d0, Dq, lane);
              mma_m16n8k16_bf16(sc[mt][part], a, b);
            }
          }
        }
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int i = 0; i < 4; ++i)
          s_s[(16 * mt + mma_c_row(lane, i)) * SS + 8 * warp + mma_c_col(lane, i)] =
              (sc[mt][2][i] + sc[mt][1][i]) + sc[mt][0][i];
    }
    tile_slots(k + stages);  // ring stage k % stages: its slots (tile k's) are no longer read
    __syncthreads();  // S of the whole tile is written

    // 2. online softmax of query vector sm over tile rows sc0 .. sc0 + KPT - 1
    {
      const int pos0 = R.lo + k * T + sc0;
      float s[KPT];
      float tmax = neg_inf();
#pragma unroll
      for (int j = 0; j < KPT; ++j) {
        const bool in = sa <= pos0 + j && pos0 + j < sb;
        s[j] = in ? s_s[sm * SS + sc0 + j] : neg_inf();
        tmax = fmaxf(tmax, s[j]);
      }
#pragma unroll
      for (int o2 = TPR / 2; o2 > 0; o2 >>= 1) tmax = fmaxf(tmax, __shfl_xor_sync(kFullMask, tmax, o2));
      const float mn = fmaxf(m_run, tmax);
      const float mo = mn == neg_inf() ? 0.0f : mn;  // all -inf so far: every weight 0, no NaN
      const float alpha = expf(m_run - mo);
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < KPT; j += 2) {
        const bool in0 = sa <= pos0 + j && pos0 + j < sb, in1 = sa <= pos0 + j + 1 && pos0 + j + 1 < sb;
        const float e0 = in0 ? expf(s[j] - mo) : 0.0f, e1 = in1 ? expf(s[j + 1] - mo) : 0.0f;
        sum += e0;
        sum += e1;
        const float h0 = __bfloat162float(__float2bfloat16_rn(e0)), h1 = __bfloat162float(__float2bfloat16_rn(e1));
        *reinterpret_cast<unsigned*>(p_s + sm * PS + sc0 + j) = pack_bf16x2(h0, h1);
        *reinterpret_cast<unsigned*>(p_s + (MR + sm) * PS + sc0 + j) = pack_bf16x2(e0 - h0, e1 - h1);
      }
#pragma unroll
      for (int o2 = TPR / 2; o2 > 0; o2 >>= 1) sum += __shfl_xor_sync(kFullMask, sum, o2);
      l_run = l_run * alpha + sum;
      m_run = mn;
      if (threadIdx.x % TPR == 0) a_s[sm] = alpha;
    }
    __syncthreads();  // P and the rescale factors of the whole tile are written

    // 3. O = alpha O + P V, warp w: n-tiles w, w + 4, ..
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      if (mt < mts) {
        const float a0 = a_s[16 * mt + mma_c_row(lane, 0)], a1 = a_s[16 * mt + mma_c_row(lane, 2)];
#pragma unroll
        for (int j = 0; j < DC; ++j) { o[mt][j][0] *= a0; o[mt][j][1] *= a0; o[mt][j][2] *= a1; o[mt][j][3] *= a1; }
      }
    }
#pragma unroll
    for (int k0 = 0; k0 < T; k0 += 16) {
      unsigned a[MT][2][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int part = 0; part < 2; ++part)
          if (mt < mts) mma_load_a(a[mt][part], p_s + (part * MR + 16 * mt) * PS + k0, PS, lane);
#pragma unroll
      for (int j = 0; j < DC; ++j) {
        const int nt = warp + kAttnWarps * j;  // n-tile: value dims 8 nt ..
        if (8 * nt < Dv) {
          unsigned b[2];
          mma_load_b_kn(b, vt + k0 * Dvs + 8 * nt, Dvs, lane);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt)
            if (mt < mts) {
              mma_m16n8k16_bf16(o[mt][j], a[mt][0], b);
              mma_m16n8k16_bf16(o[mt][j], a[mt][1], b);
            }
        }
      }
    }
  }

  if (threadIdx.x % TPR == 0) { ml_s[2 * sm] = m_run; ml_s[2 * sm + 1] = l_run; }
  __syncthreads();
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int m = 16 * mt + mma_c_row(lane, 2 * half);
      if (m >= M) continue;
      const int i = m / gc, hk = hq0 + m % gc;
      const long long hq = static_cast<long long>(r0 + i) * Hq + hk;
      const bool active = ra_s[i] < rb_s[i];
      const float mx = ml_s[2 * m], l = ml_s[2 * m + 1];
      const float den = num_parts == 1 && sinks != nullptr ? l + expf(sinks[hk] - mx) : l;
      const long long at = hq * num_parts + p;  // [n, Hq, num_parts]
#pragma unroll
      for (int j = 0; j < DC; ++j) {
        const int dv = 8 * (warp + kAttnWarps * j) + mma_c_col(lane, 0);
        if (dv >= Dv) continue;
        const float v0 = o[mt][j][2 * half], v1 = o[mt][j][2 * half + 1];
        if (num_parts == 1) {
          out[hq * Dv + dv] = active ? v0 / den : 0.0f;
          out[hq * Dv + dv + 1] = active ? v1 / den : 0.0f;
        } else if (active) {
          part_o[at * Dv + dv] = v0;
          part_o[at * Dv + dv + 1] = v1;
        }
      }
      if (num_parts > 1 && active && lane % 4 == 0 && warp == 0) { part_ml[2 * at] = mx; part_ml[2 * at + 1] = l; }
    }
  }
}

__global__ void __launch_bounds__(mtp::kAttnThreads)
paged_attention_merge_kernel(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                             const int* __restrict__ row_start, const int* __restrict__ row_len,
                             const float* __restrict__ sinks, int max_len, float* __restrict__ out,
                             int Hq, int Dv, int part_size, int num_parts) {
  using namespace mtp;
  __shared__ float w_s[kMergeChunk];
  __shared__ float red_s[kWarp + 1];
  const int hq = blockIdx.x;
  const long long r = blockIdx.y;
  const int L = min(row_len[r], max_len);
  const int first = row_start ? max(row_start[r], 0) : 0;
  const int np = L > first ? (L - first + part_size - 1) / part_size : 0;  // partitions that were written
  const long long base = r * Hq + hq;                                      // [n, Hq]
  const float* ml = part_ml + base * num_parts * 2;
  float M = neg_inf();
  for (int p = threadIdx.x; p < np; p += blockDim.x) M = fmaxf(M, ml[2 * p]);
  M = block_max(M, red_s);
  if (sinks != nullptr) M = fmaxf(M, sinks[hq]);
  float den = 0.0f;
  for (int p = threadIdx.x; p < np; p += blockDim.x) den += expf(ml[2 * p] - M) * ml[2 * p + 1];
  den = block_sum(den, red_s);
  if (sinks != nullptr) den += expf(sinks[hq] - M);  // the sink, once: a key of value 0
  const float* po = part_o + base * num_parts * Dv;
  float num[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // dims threadIdx.x + 128 k (Dv <= 512: MLA's L)
  for (int p0 = 0; p0 < np; p0 += kMergeChunk) {
    const int pc = min(kMergeChunk, np - p0);
    for (int p = threadIdx.x; p < pc; p += blockDim.x) w_s[p] = expf(ml[2 * (p0 + p)] - M);
    __syncthreads();
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int d = threadIdx.x + k * kAttnThreads;
      if (d < Dv) {
        float a = num[k];
        for (int p = 0; p < pc; ++p) a += w_s[p] * po[static_cast<long long>(p0 + p) * Dv + d];
        num[k] = a;
      }
    }
    __syncthreads();  // w_s is rewritten by the next chunk
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int d = threadIdx.x + k * kAttnThreads;
    if (d < Dv) out[base * Dv + d] = np > 0 ? num[k] / den : 0.0f;
  }
}
