// dsa.cu -- DSA (DeepSeek Sparse Attention: DeepSeek-V3.2, GLM-5, GLM-5.3's pools): the lightning
// indexer's key write and its top-k selection of the latent rows each query row's MLA attention
// reads.
//
// Letters as mtpkern/ops/dsa.py: Hi indexer heads, Di the indexer head dim, R the rotated dims
// (the FIRST R of a head; half = R / 2 pairs), T = topk, cap = max_blocks * BS (the most rows a
// block table row addresses).
//
// dsa_key_write_kernel<KV, Interleave>: grid (n, 1 + has_q), block 256.
//   blockIdx.y == 0: row r of k [n, Di] fp32 -> cache row slots[r] of index_cache [NB, BS, Di] in
//   KV: y = (k - mean) / sqrt(var + eps) * norm_w + norm_b (mean and biased variance by block_sum,
//   two passes), then its first R dims rotated at positions[r] (pairs (i, i + half), or (2i, 2i + 1)
//   with Interleave; cos and sin times rope_scale: common.cuh's rope_rotate). As mla.cu's latent
//   write, every block first scans all n slots: one outside [0, num_slots) and no block writes (the
//   launcher refuses host slots before launching), a slot a later row also names is left to it.
//   With gate (not null: a pooled indexer's gate scores [n, Di] fp32) the cache rows are 2 Di wide,
//   [key | gate scores]: the key in columns [0, Di), gate[r] stored in KV in [Di, 2 Di).
//   blockIdx.y == 1 (q not null): q_out [n, Hi, Di] fp32 = q with each head's first R dims rotated
//   by the same angles, the rest copied.
//
// dsa_score_kernel<KV>: scores [n, cap] fp32, scores[r, j] = sum_h (weights[r, h] * scale) *
//   max(q[r, h] . k_j, 0) (NaN kept: a NaN dot gives a NaN score) for the rows j the selection
//   ranks: row_start[r] <= j < row_len[r], and only when there are more than T of them (else the
//   selection lists them all and no score is computed or read).
//   grid (ceil(cap / chunk), n), block 256: one block = one query row x `chunk` consecutive visible
//   rows from row_start, walked in tiles of `tile` (64, halved to 32 / 16 while shared memory is
//   over the device's limit); chunk = 4 tiles where the grid fills the device with them, else one
//   (the launcher's dsa.score_plan); blocks past the row's rows exit at once. Per block, once:
//   q[r] [Hi][Dq] fp32 and weights[r] * scale into shared memory (Dq = Di rounded up to 8, zero
//   padded). Per tile:
//     0. the tile's slots from the block table (entries before the window are never read);
//     1. the key rows copied as stored into shared memory, c_s [tile][Dq + 8] (16-byte copies,
//        padded stride: the 16-byte reads of step 2 hit distinct banks);
//     2. thread t takes row t % tile and the heads of group t / tile (256 / tile groups, each a
//        contiguous ceil(Hi / groups) heads), 16 heads' dot products at a time in registers, the
//        row read 8 values at a time from shared memory against q (broadcast reads: a warp's
//        lanes share their heads); its part = sum over its heads in order of w_h * relu(dot);
//     3. the groups' parts added in group order (fixed: deterministic) into scores[r, j].
//   Shared memory (bytes) = 4 * (Hi * Dq + Hi4 + 256 + tile) + tile * (Dq + 8) * sizeof(KV),
//   Hi4 = Hi rounded up to 4 (dsa.score_smem_bytes computes the same sum).
//
// dsa_pool_score_kernel<KV> (GLM-5.3's pooled indexer, P = kpool >= 2 rows a pool, ape [P, Di]
//   fp32): scores [n, cap / P] fp32, scores[r, j] = the score above of pool j's key, for the
//   row_len[r] / P complete pools of row r's sequence (pool j = rows jP .. jP + P - 1; no window),
//   only when there are more than T / P of them. Pool j's key at dim d (dsa_pooled_key) =
//   sum_u softmax_u(gate[u, d] + ape[u, d]) * key[u, d] over its rows u (the cache's [key | gate]
//   rows, 2 Di wide), the softmax max-subtracted, its weights e_u / den, summed in row order
//   (ops/dsa.pooled_keys; a NaN gate or bias gives a NaN key and score).
//   grid (ceil((cap / P) / chunk), n), block 256, the plan of dsa_score_kernel (chunk pools a
//   block, tiles of `tile` pools) with: step 0 gone; step 1 = thread (pool, dim) walking the pool's
//   P rows through the block table three times (the max, the denominator, the weighted keys:
//   coalesced over dims), the pooled keys FP32 into c_s [tile][Dq + 8]; steps 2 and 3 as there
//   (dsa_score_tile: the same dot products and head order). Shared memory (bytes) = 4 * (Hi * Dq
//   + Hi4 + 256) + tile * (Dq + 8) * 4 (dsa.score_smem_bytes(pooled=True)).
//
// dsa_topk_kernel<KPT>: out [n, T] int32: the T best rows of row r (higher score first; of equal
//   scores the earlier row; NaN below every number), in ascending row order; a row that sees at
//   most T rows lists all of them, then -1s. grid (n), block 512: one block per query row.
//   - A score becomes an order-preserving uint32 key (the float's bits with the sign bit flipped
//     for numbers >= 0, all bits flipped below 0; -0 taken as +0; every NaN 0, below -inf's key).
//     Thread t owns the m = row_len - row_start visible rows' contiguous run [t per, (t + 1) per),
//     per = ceil(m / 512), its first KPT keys in registers (KPT 4, 16, 64: up to 2048, 8192, 32768
//     rows; a longer row reads the rest from `scores` at every pass).
//   - The T-th largest key v, bit by bit from the top (a radix select of one bit a pass): v = the
//     largest value with #(key >= v) >= T, each candidate counted by a block-wide sum; a count of
//     exactly T ends the search early (those keys are the T best, whatever v's low bits).
//   - Selected: every key > v, and of the keys == v the earliest T - #(key > v) (a block-wide
//     exclusive scan of the threads' counts of keys == v, in thread = row order); then a scan of
//     the threads' selected counts gives each selected row its output position: ascending rows.
//   Integer counts and scans only (common.cuh's block_sum_int / block_scan_int, xor shuffles):
//   no atomics, the same result in any thread order.
//   - Pools (pool = P > 1, scores of dsa_pool_score_kernel, row_start null): the units ranked are
//     row r's m = min(row_len, cap) / P complete pools (score row stride cap / P) and T is
//     topk / P; the picks' pool numbers, written at out[r, 0 .. T), are then rewritten in place as
//     their P rows (dsa_expand_pools: chunks of 512 from the last, each read before any of its rows
//     is written). out has `width` columns: after the T P picked rows the tail's rows (the
//     incomplete pool's min(row_len, cap) - m P, when width > T P: the tail is on), then -1s. A row
//     with at most T complete pools lists their rows and the tail's. pool = 1: rows, width = topk.
//
// Preconditions: block sizes as above; Hi * Dq * 4 plus the rest of the score block's shared
// memory within the device's opt-in limit (the launcher refuses more); block_tables entries of
// the blocks holding rows row_start .. row_len - 1 valid (the others are never read); slots <
// 2^31; cap <= 2^31 - 1. row_len is clamped to cap and row_start to >= 0; a row with nothing to
// see gets only -1s. Vector copies need Di % 8 == 0 and a 16-byte aligned cache (else scalar
// loads, the same results).
// Cost (scores, FP32 FMAs): Hi * Di per (query row, visible row): 268 M FMAs for one query row
// at 32768 rows with DeepSeek-V3.2's Hi 64, Di 128; the selection ~32 block-wide sums per row.
// Pools: 2 P Di expf and Hi * Di FMAs per (query row, pool): 8 M of each for one query row at
// 32768 rows with GLM-5.3's P 16, Hi 32, Di 128, reading its 16 MiB plane (docs/cuda.md, "DSA
// kernels"). Every query row pools its sequence's keys itself.
#include "common.cuh"

namespace mtp {
constexpr int kDsaWriteThreads = 256;
constexpr int kDsaScoreThreads = 256;
constexpr int kDsaHeadGroup = 16;   // heads whose dot products a score thread holds at a time
constexpr int kDsaTopkThreads = 512;

// LayerNorm of the key row, value k: (x[k] - mean) / denom * w[k] + b[k].
__device__ __forceinline__ float dsa_layernorm(const float* x, const float* w, const float* b, float mean,
                                               float denom, int k) {
  return (x[k] - mean) / denom * w[k] + b[k];
}

// max(x, 0), NaN kept (fmaxf would return 0): np.maximum's rule, so a NaN key scores NaN.
__device__ __forceinline__ float dsa_relu(float x) { return x != x ? x : fmaxf(x, 0.0f); }

// The order-preserving key of a score: key(a) < key(b) iff a < b for numbers; -0 and +0 one key;
// every NaN 0 (below -inf's 0x007fffff).
__device__ __forceinline__ unsigned dsa_key(float s) {
  const unsigned u = __float_as_uint(s);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0u;  // NaN
  if ((u << 1) == 0u) return 0x80000000u;          // +-0
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Step 2 of the score kernels: sum over heads h_lo .. h_hi - 1 in order of w_s[h] * relu(q_h . k)
// for one staged key row k (Dq values, zero padded; as stored or FP32), q_s [Hi][Dq] FP32: 16
// heads' dot products at a time in registers, the row read 8 values at a time.
template <typename CT>
__device__ __forceinline__ float dsa_heads_part(const CT* krow, const float* q_s, const float* w_s, int Dq, int h_lo,
                                                int h_hi) {
  constexpr int HG = kDsaHeadGroup;
  float part = 0.0f;
  for (int h0 = h_lo; h0 < h_hi; h0 += HG) {
    float acc[HG];
#pragma unroll
    for (int u = 0; u < HG; ++u) acc[u] = 0.0f;
    for (int d0 = 0; d0 < Dq; d0 += 8) {
      float kf[8];
      smem8(krow + d0, kf);
#pragma unroll
      for (int u = 0; u < HG; ++u) {
        if (h0 + u < h_hi) {
          const float4* qh = reinterpret_cast<const float4*>(q_s + (h0 + u) * Dq + d0);
          const float4 qa = qh[0], qb = qh[1];
          float a = acc[u];
          a = fmaf(qa.x, kf[0], a); a = fmaf(qa.y, kf[1], a); a = fmaf(qa.z, kf[2], a); a = fmaf(qa.w, kf[3], a);
          a = fmaf(qb.x, kf[4], a); a = fmaf(qb.y, kf[5], a); a = fmaf(qb.z, kf[6], a); a = fmaf(qb.w, kf[7], a);
          acc[u] = a;
        }
      }
    }
#pragma unroll
    for (int u = 0; u < HG; ++u)
      if (h0 + u < h_hi) part = fmaf(w_s[h0 + u], dsa_relu(acc[u]), part);
  }
  return part;
}

// Pool j's key at dim d (rows j0 .. j0 + P - 1 of the sequence whose block table row is bt; the
// plane's rows are [key | gate scores], 2 Di wide): sum_u softmax_u(gate[u, d] + ape[u, d]) *
// key[u, d], the softmax max-subtracted (a NaN gate or bias gives NaN, as numpy's max), its
// weights e_u / den as ops/dsa.pooled_keys, summed in row order.
// Both score kernels' per-block start: q[r] [Hi][Dq] (zero padded past Di) and weights[r] * scale
// into shared memory.
__device__ __forceinline__ void dsa_load_query(float* q_s, float* w_s, const float* q, const float* weights,
                                               long long r, int Hi, int Di, int Dq, float scale) {
  for (int e = threadIdx.x; e < Hi * Dq; e += blockDim.x) {
    const int h = e / Dq, d = e % Dq;
    q_s[e] = d < Di ? q[(r * Hi + h) * Di + d] : 0.0f;
  }
  for (int h = threadIdx.x; h < Hi; h += blockDim.x) w_s[h] = weights[r * Hi + h] * scale;
}

// Both score kernels' steps 2 and 3 over a tile of Lt keys in shared memory (c_s, row stride Dc):
// thread t's part (row i = t % tile, heads [h_lo, h_hi) of its group g = t / tile) into part_s,
// then the groups' parts in group order (fixed: deterministic) into out[0 .. Lt). Ends synced:
// c_s and part_s may be rewritten after it.
template <typename CT>
__device__ __forceinline__ void dsa_score_tile(const CT* c_s, int Dc, const float* q_s, const float* w_s,
                                               float* part_s, int Dq, int tile, int groups, int Lt, int h_lo,
                                               int h_hi, float* out) {
  const int t = threadIdx.x, i = t % tile, g = t / tile;
  part_s[g * tile + i] = i < Lt ? dsa_heads_part(c_s + i * Dc, q_s, w_s, Dq, h_lo, h_hi) : 0.0f;
  __syncthreads();
  if (t < Lt) {
    float s = part_s[t];
    for (int gg = 1; gg < groups; ++gg) s += part_s[gg * tile + t];
    out[t] = s;
  }
  __syncthreads();
}

template <typename KV>
__device__ __forceinline__ float dsa_pooled_key(const KV* cache, const int* bt, int BS, int j0, int P,
                                                const float* ape, int Di, int d) {
  const long long W = 2LL * Di;
  float mx = neg_inf();
  for (int u = 0; u < P; ++u) {
    const long long slot = static_cast<long long>(bt[(j0 + u) / BS]) * BS + (j0 + u) % BS;
    const float g = to_f32(cache[slot * W + Di + d]) + ape[u * Di + d];
    mx = (g != g || g > mx) ? g : mx;  // once NaN, NaN
  }
  float den = 0.0f;
  for (int u = 0; u < P; ++u) {
    const long long slot = static_cast<long long>(bt[(j0 + u) / BS]) * BS + (j0 + u) % BS;
    den += expf(to_f32(cache[slot * W + Di + d]) + ape[u * Di + d] - mx);
  }
  float acc = 0.0f;
  for (int u = 0; u < P; ++u) {
    const long long slot = static_cast<long long>(bt[(j0 + u) / BS]) * BS + (j0 + u) % BS;
    const float e = expf(to_f32(cache[slot * W + Di + d]) + ape[u * Di + d] - mx);
    acc = fmaf(e / den, to_f32(cache[slot * W + d]), acc);
  }
  return acc;
}

// Pool numbers at o[0 .. T) (ascending) -> their rows at o[0 .. T pool), in place: chunks of
// blockDim.x numbers from the last, each read before any of its rows is written (a chunk's rows
// land on its own numbers' places and later ones, never on an earlier chunk's). Uniform.
__device__ __forceinline__ void dsa_expand_pools(int* o, int T, int pool) {
  __syncthreads();  // every pick written
  for (int c0 = (T - 1) / static_cast<int>(blockDim.x) * blockDim.x; c0 >= 0; c0 -= blockDim.x) {
    const int e = c0 + threadIdx.x;
    const int j = e < T ? o[e] : 0;
    __syncthreads();
    if (e < T)
      for (int u = 0; u < pool; ++u) o[e * pool + u] = j * pool + u;
    __syncthreads();
  }
}
}  // namespace mtp

template <typename KV, bool Interleave>
__global__ void __launch_bounds__(mtp::kDsaWriteThreads)
dsa_key_write_kernel(const float* __restrict__ k, const float* __restrict__ norm_w, const float* __restrict__ norm_b,
                     float eps, const float* __restrict__ inv_freq, int half, float rope_scale,
                     const int* __restrict__ positions, const int* __restrict__ slots, int n, long long num_slots,
                     KV* __restrict__ cache, int Di, const float* __restrict__ q, float* __restrict__ q_out,
                     int Hi, const float* __restrict__ gate) {
  __shared__ float red[33];
  const long long r = blockIdx.x;
  const float pos = static_cast<float>(positions[r]);

  if (blockIdx.y == 1) {  // the query: heads [R rotated | Di - R copied]
    const int per = Di - half;  // work items per head: half pairs, then the Di - R copies
    const float* src = q + r * Hi * Di;
    float* dst = q_out + r * Hi * Di;
    for (int e = threadIdx.x; e < Hi * per; e += blockDim.x) {
      const int h = e / per, i = e % per;
      const float* x = src + static_cast<long long>(h) * Di;
      float* y = dst + static_cast<long long>(h) * Di;
      if (i < half) {
        const int a = Interleave ? 2 * i : i, b = Interleave ? 2 * i + 1 : i + half;
        mtp::rope_rotate(pos, inv_freq[i], rope_scale, x[a], x[b], y[a], y[b]);
      } else {
        const int d = i + half;  // R .. Di - 1
        y[d] = x[d];
      }
    }
    return;
  }

  const long long slot = slots[r];
  int skip = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const long long s = slots[i];
    skip |= s < 0 || s >= num_slots || (i > r && s == slot);
  }
  if (__syncthreads_or(skip)) return;  // uniform over the block

  const float* x = k + r * Di;
  float sum = 0.0f;
  for (int d = threadIdx.x; d < Di; d += blockDim.x) sum += x[d];
  const float mean = mtp::block_sum(sum, red) / static_cast<float>(Di);
  float ss = 0.0f;
  for (int d = threadIdx.x; d < Di; d += blockDim.x) {
    const float c = x[d] - mean;
    ss = fmaf(c, c, ss);
  }
  const float denom = sqrtf(mtp::block_sum(ss, red) / static_cast<float>(Di) + eps);
  const int W = gate ? 2 * Di : Di;  // the plane's row: [key] or [key | gate scores]
  KV* row = cache + slot * W;
  if (gate)
    for (int d = threadIdx.x; d < Di; d += blockDim.x) row[Di + d] = mtp::from_f32<KV>(gate[r * Di + d]);
  for (int d = 2 * half + threadIdx.x; d < Di; d += blockDim.x)
    row[d] = mtp::from_f32<KV>(mtp::dsa_layernorm(x, norm_w, norm_b, mean, denom, d));
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    const int a = Interleave ? 2 * i : i, b = Interleave ? 2 * i + 1 : i + half;
    float y1, y2;
    mtp::rope_rotate(pos, inv_freq[i], rope_scale, mtp::dsa_layernorm(x, norm_w, norm_b, mean, denom, a),
                     mtp::dsa_layernorm(x, norm_w, norm_b, mean, denom, b), y1, y2);
    row[a] = mtp::from_f32<KV>(y1);
    row[b] = mtp::from_f32<KV>(y2);
  }
}

template <typename KV>
__global__ void __launch_bounds__(mtp::kDsaScoreThreads, 2)
dsa_score_kernel(const float* __restrict__ q, const float* __restrict__ weights, const KV* __restrict__ cache,
                 const int* __restrict__ block_tables, int max_blocks, const int* __restrict__ row_seq,
                 const int* __restrict__ row_start, const int* __restrict__ row_len, float* __restrict__ scores,
                 int Hi, int Di, int BS, int tile, int chunk, int topk, float scale) {
  using namespace mtp;
  extern __shared__ float4 smem_raw[];
  const int Dq = (Di + 7) & ~7, Dc = Dq + 8, Hi4 = (Hi + 3) & ~3;
  const int cap = max_blocks * BS;
  const long long r = blockIdx.y;
  const int Lr = min(row_len[r], cap);
  const int first = row_start ? max(row_start[r], 0) : 0;
  if (Lr - first <= topk) return;  // uniform: the selection lists every row, no score is read
  const int j0 = first + blockIdx.x * chunk;  // the block's first row
  const int Lc = min(Lr - j0, chunk);         // its rows
  if (Lc <= 0) return;

  const int t = threadIdx.x, groups = kDsaScoreThreads / tile;
  float* q_s = reinterpret_cast<float*>(smem_raw);     // [Hi][Dq]: q[r], zero padded
  float* w_s = q_s + Hi * Dq;                          // [Hi4]: weights[r] * scale
  float* part_s = w_s + Hi4;                           // [groups][tile] = [256]: the groups' parts
  int* slot_s = reinterpret_cast<int*>(part_s + kDsaScoreThreads);  // [tile]
  KV* c_s = reinterpret_cast<KV*>(slot_s + tile);      // [tile][Dc]: the tile's key rows

  const int seq = row_seq[r];
  dsa_load_query(q_s, w_s, q, weights, r, Hi, Di, Dq, scale);

  const bool vec = Di % 8 == 0 && aligned16(cache);
  const int g = t / tile;  // step 2: the thread's head group (its row: t % tile)
  const int hg = (Hi + groups - 1) / groups;
  const int h_lo = min(Hi, g * hg), h_hi = min(Hi, h_lo + hg);
  for (int jt = 0; jt < Lc; jt += tile) {
    const int Lt = min(tile, Lc - jt);
    for (int e = t; e < Lt; e += blockDim.x) {  // 0. slots
      const int jj = j0 + jt + e;
      slot_s[e] = block_tables[static_cast<long long>(seq) * max_blocks + jj / BS] * BS + jj % BS;
    }
    __syncthreads();
    if (vec) {  // 1. the key rows, as stored
      const int nch = Dq / 8;
      for (int e = t; e < Lt * nch; e += blockDim.x) {
        const int ii = e / nch, c = e % nch;
        copy8<KV>(c_s + ii * Dc + 8 * c, cache + static_cast<long long>(slot_s[ii]) * Di + 8 * c);
      }
    } else {
      for (int e = t; e < Lt * Dq; e += blockDim.x) {
        const int ii = e / Dq, d = e % Dq;
        c_s[ii * Dc + d] = d < Di ? cache[static_cast<long long>(slot_s[ii]) * Di + d] : from_f32<KV>(0.0f);
      }
    }
    __syncthreads();
    // 2. sum over this thread's heads of w_h relu(q_h . k_i); 3. the groups' parts in order
    dsa_score_tile(c_s, Dc, q_s, w_s, part_s, Dq, tile, groups, Lt, h_lo, h_hi, scores + r * cap + j0 + jt);
  }
}

template <typename KV>
__global__ void __launch_bounds__(mtp::kDsaScoreThreads, 2)
dsa_pool_score_kernel(const float* __restrict__ q, const float* __restrict__ weights, const KV* __restrict__ cache,
                      const int* __restrict__ block_tables, int max_blocks, const int* __restrict__ row_seq,
                      const int* __restrict__ row_len, const float* __restrict__ ape, int P,
                      float* __restrict__ scores, int Hi, int Di, int BS, int tile, int chunk, int topk,
                      float scale) {
  using namespace mtp;
  extern __shared__ float4 smem_raw[];
  const int Dq = (Di + 7) & ~7, Dc = Dq + 8, Hi4 = (Hi + 3) & ~3;
  const int cap_pools = max_blocks * BS / P;
  const long long r = blockIdx.y;
  const int pools = min(row_len[r], max_blocks * BS) / P;  // the row's complete pools
  if (pools <= topk / P) return;  // uniform: the selection lists every pool, no score is read
  const int j0 = blockIdx.x * chunk;  // the block's first pool
  const int Lc = min(pools - j0, chunk);
  if (Lc <= 0) return;

  const int t = threadIdx.x, groups = kDsaScoreThreads / tile;
  float* q_s = reinterpret_cast<float*>(smem_raw);  // [Hi][Dq]: q[r], zero padded
  float* w_s = q_s + Hi * Dq;                       // [Hi4]: weights[r] * scale
  float* part_s = w_s + Hi4;                        // [groups][tile] = [256]: the groups' parts
  float* c_s = part_s + kDsaScoreThreads;           // [tile][Dc]: the tile's pooled keys, FP32

  const int* bt = block_tables + static_cast<long long>(row_seq[r]) * max_blocks;
  dsa_load_query(q_s, w_s, q, weights, r, Hi, Di, Dq, scale);

  const int g = t / tile;  // step 2: the thread's head group (its pool: t % tile)
  const int hg = (Hi + groups - 1) / groups;
  const int h_lo = min(Hi, g * hg), h_hi = min(Hi, h_lo + hg);
  for (int jt = 0; jt < Lc; jt += tile) {
    const int Lt = min(tile, Lc - jt);
    for (int e = t; e < Lt * Dq; e += blockDim.x) {  // 1. the pooled keys (coalesced over d)
      const int ii = e / Dq, d = e % Dq;
      c_s[ii * Dc + d] = d < Di ? dsa_pooled_key(cache, bt, BS, (j0 + jt + ii) * P, P, ape, Di, d) : 0.0f;
    }
    __syncthreads();
    // 2. sum over this thread's heads of w_h relu(q_h . k_pool); 3. the groups' parts in order
    dsa_score_tile(c_s, Dc, q_s, w_s, part_s, Dq, tile, groups, Lt, h_lo, h_hi, scores + r * cap_pools + j0 + jt);
  }
}

template <int KPT>
__global__ void __launch_bounds__(mtp::kDsaTopkThreads)
dsa_topk_kernel(const float* __restrict__ scores, const int* __restrict__ row_start, const int* __restrict__ row_len,
                int cap, int* __restrict__ out, int topk, int pool, int width) {
  using namespace mtp;
  __shared__ int red[33];
  const long long r = blockIdx.x;
  const int t = threadIdx.x;
  const int Lr = min(row_len[r], cap);
  const int first = row_start ? max(row_start[r], 0) : 0;
  const int m = max(Lr / pool - first, 0);  // visible rows, or complete pools
  const int tail = width > topk * pool ? Lr - m * pool : 0;  // the incomplete pool's rows, listed last
  int* o = out + r * width;
  if (m <= topk) {  // uniform: every visible row (every complete pool's, the tail's), then -1s
    for (int e = t; e < width; e += blockDim.x) o[e] = e < m * pool + tail ? first + e : -1;
    return;
  }
  for (int e = t; e < width - topk * pool; e += blockDim.x)  // after the picked pools' rows: the tail
    o[topk * pool + e] = e < tail ? m * pool + e : -1;
  const int per = (m + blockDim.x - 1) / blockDim.x;
  const int lo = min(t * per, m), cnt = min(lo + per, m) - lo;  // this thread's rows: first + lo ..
  const float* s = scores + r * (cap / pool) + first + lo;
  unsigned key[KPT];
#pragma unroll
  for (int i = 0; i < KPT; ++i) key[i] = i < cnt ? dsa_key(s[i]) : 0u;

  // the T-th largest key: the largest v with #(key >= v) >= T, one bit a pass
  unsigned v = 0u;
  for (int b = 31; b >= 0; --b) {
    const unsigned c = v | (1u << b);  // >= 1: the padding keys (0) never count
    int ge = 0;
#pragma unroll
    for (int i = 0; i < KPT; ++i) ge += key[i] >= c;
    for (int i = KPT; i < cnt; ++i) ge += dsa_key(s[i]) >= c;
    ge = block_sum_int(ge, red);
    if (ge >= topk) {
      v = c;
      if (ge == topk) break;  // uniform: these are the T best
    }
  }

  int gt = 0, eq = 0;  // this thread's keys above v and equal to it
#pragma unroll
  for (int i = 0; i < KPT; ++i) {
    gt += i < cnt && key[i] > v;
    eq += i < cnt && key[i] == v;
  }
  for (int i = KPT; i < cnt; ++i) {
    const unsigned kk = dsa_key(s[i]);
    gt += kk > v;
    eq += kk == v;
  }
  const int need = topk - block_sum_int(gt, red);  // keys == v taken, the earliest rows first
  int eq_seen = block_scan_int(eq, red);          // keys == v in earlier threads' rows
  int sel = 0;
#pragma unroll
  for (int i = 0; i < KPT; ++i) {
    const bool e = i < cnt && key[i] == v;
    sel += (i < cnt && key[i] > v) || (e && eq_seen < need);
    eq_seen += e;
  }
  for (int i = KPT; i < cnt; ++i) {
    const unsigned kk = dsa_key(s[i]);
    sel += kk > v || (kk == v && eq_seen < need);
    eq_seen += kk == v;
  }
  int at = block_scan_int(sel, red);  // this thread's first output position
  eq_seen -= eq;                       // back to the keys == v before this thread's rows
#pragma unroll
  for (int i = 0; i < KPT; ++i) {
    const bool e = i < cnt && key[i] == v;
    if ((i < cnt && key[i] > v) || (e && eq_seen < need)) o[at++] = first + lo + i;
    eq_seen += e;
  }
  for (int i = KPT; i < cnt; ++i) {
    const unsigned kk = dsa_key(s[i]);
    if (kk > v || (kk == v && eq_seen < need)) o[at++] = first + lo + i;
    eq_seen += kk == v;
  }
  if (pool > 1) dsa_expand_pools(o, topk, pool);  // uniform
}
