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
//   rounded up to 8, MW = 8 (DC 2, 4) or 4 (DC 8); the launcher computes the same sum.
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
// ~5x the tile's bytes of shared-memory traffic (each warp reads the whole K and V tile),
// so M = 4 is memory-bound and M = 12 near the SM's share of bandwidth; tensor cores for
// QK / PV would be the next step at M >= 16 (docs/cuda.md, "Paged attention: design and
// model").
#include "common.cuh"

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

// Query vectors per warp: o[MW][DC] = 32 registers (16 for DC 2).
template <int DC>
__host__ __device__ constexpr int attn_mw() { return DC == 8 ? 4 : 8; }
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
                       int num_parts, float scale) {
  using namespace mtp;
  constexpr int MW = attn_mw<DC>();
  constexpr int T = kAttnTile;
  constexpr int E = 16 / static_cast<int>(sizeof(KV));  // elements per 16-byte copy
  extern __shared__ float4 smem_raw[];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int group = Hq / Hkv;
  const int chunks = (group + heads - 1) / heads;
  const int h = blockIdx.x / chunks;
  const int g0 = (blockIdx.x % chunks) * heads;
  const int gc = min(heads, group - g0);  // query heads of this block
  const int p = blockIdx.z;
  const int n = gridDim.y;
  const int r0 = blockIdx.y;
  const int seq = row_seq[r0];

  // -- the run: does row r0 start one, and how many rows has it (every warp computes the
  // same, so the exit is uniform without a barrier)
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
  if ((r0 - begin) % rows != 0) return;
  int nr = 0;  // rows r0 .. r0 + nr - 1
  for (;;) {
    const int i = r0 + nr + lane;
    const unsigned same = __ballot_sync(kFullMask, nr + lane < rows && i < n && row_seq[i] == seq);
    const int c = same == kFullMask ? kWarp : __ffs(~same) - 1;
    nr += c;
    if (c < kWarp) break;
  }
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

  const int cap = max_blocks * BS;
  for (int i = threadIdx.x; i < nr; i += blockDim.x) {
    const int L = min(row_len[r0 + i], cap);
    const int first = row_start ? min(max(row_start[r0 + i], 0), max(L, 0)) : 0;
    const int a = first + p * part_size;
    ra_s[i] = a;
    rb_s[i] = min(L, a + part_size);
  }
  for (int t = threadIdx.x; t < M * Dp; t += blockDim.x) {
    const int m = t / Dp, d = t % Dp;
    const long long hq = static_cast<long long>(r0 + m / gc) * Hq + h * group + g0 + m % gc;
    q_s[t] = d < D ? q[hq * D + d] * scale : 0.0f;
  }
  __syncthreads();
  int lo = 0x7fffffff, hi = -0x7fffffff, amax = -0x7fffffff, bmin = 0x7fffffff;
  for (int i = 0; i < nr; ++i) {
    const int a = ra_s[i], b = rb_s[i];
    if (a < b) { lo = min(lo, a); hi = max(hi, b); amax = max(amax, a); bmin = min(bmin, b); }
  }
  if (lo >= hi) {  // uniform: no row of the run has a KV row in this partition
    if (num_parts == 1)
      for (int t = threadIdx.x; t < M * Dv; t += blockDim.x) {
        const int m = t / Dv;
        out[(static_cast<long long>(r0 + m / gc) * Hq + h * group + g0 + m % gc) * Dv + t % Dv] = 0.0f;
      }
    return;
  }
  const bool contig = amax <= bmin;  // the ranges share a point: every row of [lo, hi) is read
  const bool vec = D % 8 == 0 && Dv % 8 == 0 && aligned16(k_cache) && aligned16(v_cache);
  const int ntiles = (hi - lo + T - 1) / T;

  // warp 0: the slots of tile k (-1: a row no query row of the block sees)
  auto tile_slots = [&](int k) {
    if (warp != 0 || k >= ntiles) return;
    const int pos = lo + k * T + lane;
    bool need = pos < hi;
    if (need && !contig) {
      need = false;
      for (int i = 0; i < nr; ++i) need = need || (ra_s[i] <= pos && pos < rb_s[i]);
    }
    slot_s[(k % stages) * T + lane] =
        need ? block_tables[static_cast<long long>(seq) * max_blocks + pos / BS] * BS + pos % BS : -1;
  };
  // every thread: its share of tile k's K and V rows into ring stage k % stages
  auto issue = [&](int k) {
    if (k < ntiles) {
      KV* kd = k_s + (k % stages) * T * Dks;
      KV* vd = v_s + (k % stages) * T * Dvs;
      const int* sl = slot_s + (k % stages) * T;
      if (vec) {  // a warp per tile row, a lane per 16-byte piece of its K | V
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
        for (int t = warp; t < T; t += kAttnWarps) {
          const int slot = sl[t];
          const long long s = slot >= 0 ? slot : 0;
          const KV* kg = k_cache + (s * Hkv + h) * D;
          const KV* vg = v_cache + (s * Hkv + h) * Dv;
          for (int e = lane; e < Dp; e += kWarp) {
            if (slot >= 0 && e < D) kd[t * Dks + e] = kg[e];
            else set_zero(kd[t * Dks + e]);
          }
          for (int e = lane; e < Dvs; e += kWarp) {
            if (slot >= 0 && e < Dv) vd[t * Dvs + e] = vg[e];
            else set_zero(vd[t * Dvs + e]);
          }
        }
      }
    }
    cp_async_commit();  // an empty group past the last tile keeps the wait count fixed
  };

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
    float acc[MW];
#pragma unroll
    for (int j = 0; j < MW; ++j) acc[j] = 0.0f;
#pragma unroll 1
    for (int d0 = 0; d0 < Dp; d0 += 8) {
      float kf[8];
      lds<8>(kr + d0, kf);
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
      const int nt = min(T, hi - tile0);
#pragma unroll 2
      for (int t = 0; t < nt; ++t) {
        float vf[DC];
        lds<DC>(vt + t * Dvs, vf);
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
      const int hk = h * group + g0 + m % gc;  // query head
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
