// lm_head.cu -- LM-head GEMV with a fused, grammar-masked argmax.
//
//   ids[r] = argmax_j { x[r] . w[j] : token j allowed for row r and the logit not NaN }
//   x [n, H] fp32, w [V, H] in W, bitmask [n, ceil(V / 32)] int32 or null -> ids [n] int32
//   Token j is allowed when bit j & 31 of word j >> 5 is set (xgrammar's layout);
//   bits past V are never looked at (so never allowed). Ties go to the lowest id,
//   NaN never wins, and a row with no candidate gets -1 (the launcher raises
//   NoAllowedToken naming the row). The [n, V] logits are never written.
//   (lm_head_logits, when the logits are wanted, is linear_kernel in linear.cu.)
//
// Two-stage reduction, deterministic (no atomics):
// lm_head_argmax_partial_kernel<W>: grid (P = ceil(V / 64)), block 128 = 4 warps.
//   Block b owns vocab rows [64 b, 64 b + 64): warp w computes row pairs
//   (64 b + 2 (4 it + w), +1) for it = 0..7, each with the GEMV core of
//   common.cuh (one pass over the 64 weight rows for up to 8 input rows at a
//   time), and keeps its best (value, id) per input row in registers. The four
//   warps' bests are combined in shared memory and written to
//   part_v / part_i [n, P].
// argmax_final_kernel: grid (n), block 256: combines a row's P partials (strided
//   per thread, then warp shuffles, then across warps) into ids[r].
// Both stages use mtp::beats, a strict total order on (value, id), so the winner
// does not depend on the combination order.
//
// W and scale/bn/bk: as linear.cu (an FP8 head's scales, null for dense weights).
//
// Preconditions: blockDim as stated; 16-byte path when H % (16 / sizeof(W)) == 0
// and x, w are aligned (FP8: as linear.cu), else scalar loads (same candidates, same tie rule).
#include "common.cuh"

namespace mtp {

constexpr int kLmIter = 8;                                   // row pairs per warp
constexpr int kLmRowsPerBlock = kGemvWarps * 2 * kLmIter;   // 64 vocab rows per block

template <typename W, int NR>
__device__ __forceinline__ void lm_argmax_chunk(const float* x, const W* w, const Scales& sc, const int* bitmask,
                                                float* part_v, int* part_i, int r0, int m, int V,
                                                int H, int P, bool vec,
                                                float (&sv)[kGemvWarps][kMaxRows],
                                                int (&si)[kGemvWarps][kMaxRows]) {
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int words = (V + 31) / 32;
  const float* xr[NR];
#pragma unroll
  for (int r = 0; r < NR; ++r) xr[r] = x + static_cast<long long>(r0 + min(r, m - 1)) * H;
  float bv[NR];
  int bi[NR];
#pragma unroll
  for (int r = 0; r < NR; ++r) { bv[r] = neg_inf(); bi[r] = -1; }

  for (int it = 0; it < kLmIter; ++it) {
    const int a = blockIdx.x * kLmRowsPerBlock + 2 * (it * kGemvWarps + warp);
    if (a >= V) break;  // per warp; no barrier inside the loop
    const int b = min(a + 1, V - 1);
    const W* const wr[2] = {w + static_cast<long long>(a) * H, w + static_cast<long long>(b) * H};
    const float* const sr[2] = {scale_row<W>(sc, a), scale_row<W>(sc, b)};
    float acc[2][NR];
    zero(acc);
    gemv_dot<W, NR, 2>(wr, sr, sc.bk, xr, H, lane, kWarp, vec, acc);
    warp_sum_all(acc);  // every lane holds the same sums: the bests stay uniform
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      if (r >= m) break;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int id = a + j;
        if (id >= V) break;
        const float v = acc[j][r];
        bool ok = !isnan(v);
        if (ok && bitmask) {
          const unsigned word = static_cast<unsigned>(bitmask[static_cast<long long>(r0 + r) * words + (id >> 5)]);
          ok = (word >> (id & 31)) & 1u;
        }
        if (ok && beats(v, id, bv[r], bi[r])) { bv[r] = v; bi[r] = id; }
      }
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < NR; ++r) { sv[warp][r] = bv[r]; si[warp][r] = bi[r]; }
  }
  __syncthreads();
  if (threadIdx.x < m) {
    const int r = threadIdx.x;
    float v = neg_inf();
    int i = -1;
    for (int q = 0; q < kGemvWarps; ++q)
      if (beats(sv[q][r], si[q][r], v, i)) { v = sv[q][r]; i = si[q][r]; }
    const long long at = static_cast<long long>(r0 + r) * P + blockIdx.x;  // [n, P]
    part_v[at] = v;
    part_i[at] = i;
  }
  __syncthreads();  // sv / si are rewritten by the next chunk
}

}  // namespace mtp

template <typename W>
__global__ void __launch_bounds__(mtp::kGemvThreads)
lm_head_argmax_partial_kernel(const float* __restrict__ x, const W* __restrict__ w,
                              const float* __restrict__ scale, int bn, int bk,
                              const int* __restrict__ bitmask, float* __restrict__ part_v,
                              int* __restrict__ part_i, int n, int V, int H, int P) {
  using namespace mtp;
  __shared__ float sv[kGemvWarps][kMaxRows];
  __shared__ int si[kGemvWarps][kMaxRows];
  const Scales sc = make_scales<W>(scale, bn, bk, H);
  const bool vec = gemv_vec_ok(w, x, H, sc);
  for (int r0 = 0; r0 < n; r0 += kMaxRows) {
    const int m = min(kMaxRows, n - r0);
    if (m > 4)       lm_argmax_chunk<W, 8>(x, w, sc, bitmask, part_v, part_i, r0, m, V, H, P, vec, sv, si);
    else if (m > 2)  lm_argmax_chunk<W, 4>(x, w, sc, bitmask, part_v, part_i, r0, m, V, H, P, vec, sv, si);
    else if (m == 2) lm_argmax_chunk<W, 2>(x, w, sc, bitmask, part_v, part_i, r0, m, V, H, P, vec, sv, si);
    else             lm_argmax_chunk<W, 1>(x, w, sc, bitmask, part_v, part_i, r0, m, V, H, P, vec, sv, si);
  }
}

__global__ void __launch_bounds__(256)
argmax_final_kernel(const float* __restrict__ part_v, const int* __restrict__ part_i, int P,
                    int* __restrict__ ids) {
  using namespace mtp;
  __shared__ float sv[32];
  __shared__ int si[32];
  const long long r = blockIdx.x;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  float bv = neg_inf();
  int bi = -1;
  for (int p = threadIdx.x; p < P; p += blockDim.x) {
    const float v = part_v[r * P + p];
    const int i = part_i[r * P + p];
    if (beats(v, i, bv, bi)) { bv = v; bi = i; }
  }
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(kFullMask, bv, o);
    const int oi = __shfl_xor_sync(kFullMask, bi, o);
    if (beats(ov, oi, bv, bi)) { bv = ov; bi = oi; }
  }
  if (lane == 0) { sv[warp] = bv; si[warp] = bi; }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int q = 1; q < static_cast<int>(blockDim.x / kWarp); ++q)
      if (beats(sv[q], si[q], bv, bi)) { bv = sv[q]; bi = si[q]; }
    ids[r] = bi;
  }
}
