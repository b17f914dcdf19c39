// gemm_tc.cu -- y[n, N] = x[n, K] W[N, K]^T (+ bias[N]) (+ residual[n, N]) on BF16 tensor cores,
// for the GEMVs of 4 input rows or more (batch 8, exact-mode modules of 16-24 rows), with an
// optional RMSNorm prologue: y = inv_rms(x) * (W (x * g)) (+ bias) (+ residual),
// inv_rms[r] = 1 / sqrt(mean_k(x[r, k]^2) + eps).
//
//   gemm_tc_kernel<NT, NORM>: linear's product (linear.cu's, for BF16 weights and n >= 4).
//   swiglu_tc_kernel<NT, NORM>: mlp.cu's gate/up product, act[n, I] = swiglu(x Wg^T, x Wu^T, L, Lg)
//     (mtp::swiglu, clamps L, Lg; w13 [2I, H]: gate row u, up row I + u), K = H. Its tile is 8
//     units: fragment rows 0..7 are gate rows u0 .. u0 + 7, rows 8..15 the up rows I + u0 ..,
//     so each lane's accumulators hold a gate and its up for the same input row.
//   swiglu_tc_kernel<NT, NORM, true>: the same with Kimi K3's SiTU (mtp::gated_act; L, Lg then
//     its beta and linear beta).
//   Both run one tile driver (gemm_tc_tiles) and differ in their epilogue only.
//
// W BF16 (the mma's A operand: 16 weight rows x 16 k), x / bias / residual / y FP32, FP32
// accumulation (mma.cuh: mma.sync m16n8k16). The input rows are the mma's B operand, 8 per
// n-tile, NT = 1..4 n-tiles per launch (n <= 8 NT); every weight fragment is used for all NT
// n-tiles, so each weight byte is read from memory once per launch (the launcher cuts n > 32
// into launches of 32 rows).
//
// Accuracy: x is split into kTcTerms = 3 BF16 terms, x0 = bf16(x), x1 = bf16(x - x0),
// x2 = bf16(x - x0 - x1) (each difference exact in FP32), and every term is multiplied (W is
// exactly BF16, each product exact in FP32, the smallest term first): x is carried to 24
// significant bits (error <= 2^-26 |x|, under FP32's 2^-24), so the result agrees with the FP32
// reference within FP32 summation rounding (tests/test_cuda_emulated.py measures 3-6e-8 of
// sum |w x|, as linear_kernel; two terms, 16 bits, give 3e-7 .. 2e-6). With the norm, the split
// is of x * g (one FP32 product, the reference's normed row before its scale).
//
// k order inside a 32-wide step: lane (g, t) loads 16 bytes of weight row g and of row g + 8,
// k = 8t .. 8t + 7, and 16 bytes of the staged row g of an n-tile at the same k. Read as two
// mma k-blocks ({w.x, w.y} then {w.z, w.w}), each lane's elements sit at the fragment
// positions of mma.cuh's layout for k' = 2t, 2t + 1, 2t + 8, 2t + 9: a permutation of k,
// the same for A and B, so the sum is the dot product (in another order). One 16-byte load
// per operand and step, no shuffles.
//
// Grid mapping: block 256 = 8 warps = (8 / kw) row warps x kw k-warps (kw in {1, 2, 4, 8},
// chosen by the launcher so that the grid covers the SMs). Row warp rw owns tile
// blockIdx.x * (8 / kw) + rw (16 weight rows: rows 16 tile .. of W, or 8 units of w13), so
// grid.x = ceil(tiles / (8 / kw)), tiles = ceil(N / 16) (ceil(I / 8) for SwiGLU). K is walked in
// chunks of kTcKc = 512: the block stages x[0 .. 8 NT)[chunk] once as its three terms in
// dynamic shared memory (3 x 8 NT rows x 544 BF16: 25.5 KiB per n-tile; rows past n zero;
// the row stride of 1088 B puts the 16-byte fragment reads of a quarter warp on distinct
// banks), then each warp takes the chunk's 32-wide steps ks, ks + kw, .. (8 / kw of them)
// in groups of kTcGroup = 4 (4 KB of weights per warp loaded before their 4 x 6 NT mma).
// The first group of the next chunk is loaded before the chunk's closing barrier, so weight
// loads stay in flight while the block restages x. The kw partial sums of a row warp are added
// in k-warp order through shared memory (fixed order: the same launch gives the same bits).
// Weight loads are 16-byte ld.global.nc.L1::no_allocate (read once: they must not evict the
// staged x rows, read by every block, from L1).
//
// Preconditions: blockDim.x == 256; dynamic shared memory 3 * 8 NT * 544 * 2 bytes (the
// launcher opts in past 48 KiB); n in [1, 8 NT]; K % 8 == 0 (a step's 8-element groups are
// then all in or all out of K; the launcher runs linear_kernel otherwise); x, residual,
// y FP32 [n, *] contiguous, any alignment (x is staged with scalar loads); w [N, K] BF16,
// any 2-byte alignment (16-byte aligned: vector loads, else 8 2-byte loads per 16 bytes);
// bias / residual may be null; y may alias residual (each element read then written by the
// same thread), not x; act must not overlap x. NORM: g [K] FP32; eps > 0 is the caller's.
#include "common.cuh"
#include "mma.cuh"

namespace mtp {

constexpr int kTcWarps = 8;
constexpr int kTcThreads = kTcWarps * kWarp;
constexpr int kTcKc = 512;          // k per staged chunk
constexpr int kTcLd = kTcKc + 32;   // staged row stride in BF16 (1088 B: 64 B mod 128 B)
constexpr int kTcGroup = 4;         // 32-wide steps of weights a warp keeps in flight (4 KB)
constexpr int kTcTerms = 3;         // BF16 terms x is split into (gemm_tc.py TC_TERMS)

// 16 bytes of W, read once: no L1 allocation (PTX ISA ld, .L1::no_allocate, sm_70+); 2-byte
// reads when the row is not 16-byte aligned.
__device__ __forceinline__ uint4 load_w16(const __nv_bfloat16* p, bool vec) {
  if (!vec) {
    uint4 v;
    v.x = pack_bf16x2(p[0], p[1]);
    v.y = pack_bf16x2(p[2], p[3]);
    v.z = pack_bf16x2(p[4], p[5]);
    v.w = pack_bf16x2(p[6], p[7]);
    return v;
  }
  return ld_stream16(p);  // common.cuh: ld.global.nc.L1::no_allocate (a plain load on the emulator)
}

// ---------------------------------------------------------------------------
// Epilogues. rows(tile, gq, a, b): the weight rows of the tile's fragment rows gq and gq + 8
// (clamped into the matrix), false when the tile is past the end; store<NT, NORM>(tile,
// lane, n, acc, inv): acc[j][i] is D[mma_c_row(lane, i)][mma_c_col(lane, i)] of n-tile j,
// inv[r] the row's 1 / rms (NORM).

struct LinearTcEpi {
  const float* bias;      // [N] or null
  const float* residual;  // [n, N] or null
  float* y;               // [n, N]
  int N;

  __device__ int tiles() const { return (N + 15) / 16; }
  __device__ bool rows(int tile, int gq, int& a, int& b) const {
    a = min(tile * 16 + gq, N - 1);
    b = min(tile * 16 + gq + 8, N - 1);
    return tile * 16 < N;
  }
  template <int NT, bool NORM>
  __device__ void store(int tile, int lane, int n, const float (&acc)[NT][4], const float* inv) const {
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int o = tile * 16 + mma_c_row(lane, i), r = 8 * j + mma_c_col(lane, i);
        if (o >= N || r >= n) continue;
        float v = acc[j][i];
        if constexpr (NORM) v *= inv[r];
        if (bias) v += bias[o];  // the reference's order: (x w^T + bias) + residual
        const long long at = static_cast<long long>(r) * N + o;
        if (residual) v += residual[at];
        y[at] = v;
      }
  }
};

// SwiGLU gate/up (mlp.cu's product): a tile is 8 units u0 .. u0 + 7 as fragment rows 0..7 =
// gate rows u, 8..15 = up rows I + u, so a lane holds both halves of act[r][u] (c[h] and
// c[2 + h], h = 0, 1: input row 8 j + 2 t + h) and activates them in place.
template <bool SITU>
struct SwigluTcEpi {
  float* act;  // [n, I]
  int I;
  float limit;       // the SwiGLU clamp of silu(gate), +inf for none
  float gate_limit;  // the SwiGLU clamp of the gate before silu, +inf for none

  __device__ int tiles() const { return (I + 7) / 8; }
  __device__ bool rows(int tile, int gq, int& a, int& b) const {
    a = min(tile * 8 + gq, I - 1);
    b = I + a;
    return tile * 8 < I;
  }
  template <int NT, bool NORM>
  __device__ void store(int tile, int lane, int n, const float (&acc)[NT][4], const float* inv) const {
    const int u = tile * 8 + (lane >> 2);
    if (u >= I) return;
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = 8 * j + 2 * (lane & 3) + h;
        if (r >= n) continue;
        float gate = acc[j][h], up = acc[j][2 + h];
        if constexpr (NORM) {
          gate *= inv[r];
          up *= inv[r];
        }
        act[static_cast<long long>(r) * I + u] = gated_act<SITU>(gate, up, limit, gate_limit);
      }
  }
};

// ---------------------------------------------------------------------------
// The tile driver of both kernels (the header's mapping): row warp rw of block b computes
// tile b * (8 / kw) + rw of epi.
template <int NT, bool NORM, typename Epi>
__device__ __forceinline__ void gemm_tc_tiles(const float* __restrict__ x, const __nv_bfloat16* __restrict__ w,
                                              const float* __restrict__ g, float eps, int n, int K, int kw,
                                              const Epi& epi) {
  constexpr int R = 8 * NT;       // staged input rows
  constexpr int L = kTcLd / 8;    // uint4 per staged row
  // dynamic, kTcTerms * R * kTcLd BF16 (tc_smem_bytes in the launcher): term e of staged row r
  // at xs[(e * R + r) * L ..]; after the K loop the same words hold the k-warps' partial sums
  // (8 warps x NT x 4 x 32 floats, well within)
  extern __shared__ uint4 xs[];
  __shared__ float inv[R];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int gq = lane >> 2, t = lane & 3;
  const int rw = warp / kw, ks = warp % kw;
  const int tile = blockIdx.x * (kTcWarps / kw) + rw;
  int ra = 0, rb = 0;
  const bool live = epi.rows(tile, gq, ra, rb);  // uniform over the warp
  const bool vec = aligned16(w);
  const __nv_bfloat16* wa = w + static_cast<long long>(ra) * K + 8 * t;
  const __nv_bfloat16* wb = w + static_cast<long long>(rb) * K + 8 * t;

  float acc[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[j][i] = 0.0f;
  float ssq[NT];  // NORM: this lane's sum of x^2 over its staged elements of rows warp + 8 j
#pragma unroll
  for (int j = 0; j < NT; ++j) ssq[j] = 0.0f;

  // A ring of this warp's next kTcGroup steps' weights: its steps are ks, ks + kw, .. over all
  // of K (step i at k = 32 (ks + i kw)), a0[0] / a1[0] the next one; zero past K.
  uint4 a0[kTcGroup], a1[kTcGroup];
  auto load_step = [&](int step, uint4& p, uint4& q) {
    const int ko = 32 * (ks + step * kw);
    if (ko + 8 * t < K) {
      p = load_w16(wa + ko, vec);
      q = load_w16(wb + ko, vec);
    } else {
      p = uint4{0u, 0u, 0u, 0u};
      q = uint4{0u, 0u, 0u, 0u};
    }
  };
  if (live) {  // in flight while the first chunk is staged
#pragma unroll
    for (int q = 0; q < kTcGroup; ++q) load_step(q, a0[q], a1[q]);
  }
  int next = 0;  // this warp's next step

  for (int k0 = 0; k0 < K; k0 += kTcKc) {
    // stage: warp stages rows warp + 8 j, lane the pairs 2 lane + 64 c of the chunk
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const int r = warp + 8 * j;
      const float* xr = x + static_cast<long long>(min(r, n - 1)) * K;
#pragma unroll (NT <= 2 ? 8 : (NT == 3 ? 4 : 2))  // NT 3-4: fewer staging loads at once, no spills
      for (int c = 0; c < kTcKc / 64; ++c) {
        const int kk = 2 * lane + 64 * c, k = k0 + kk;
        float v0 = 0.0f, v1 = 0.0f;
        if (r < n && k < K) {  // K even: k + 1 < K too
          v0 = __ldg(xr + k);
          v1 = __ldg(xr + k + 1);
          if constexpr (NORM) {
            ssq[j] = fmaf(v0, v0, fmaf(v1, v1, ssq[j]));
            v0 *= __ldg(g + k);
            v1 *= __ldg(g + k + 1);
          }
        }
        unsigned parts[kTcTerms];
        split_pair<kTcTerms>(v0, v1, parts);
#pragma unroll
        for (int e = 0; e < kTcTerms; ++e) reinterpret_cast<unsigned*>(xs + (e * R + r) * L)[kk / 2] = parts[e];
      }
    }
    __syncthreads();
    if (live) {
      const int kend = min(k0 + kTcKc, K);
      for (; 32 * (ks + next * kw) < kend; ++next) {  // this chunk's steps of the warp (uniform)
        const int s = ks + next * kw - k0 / 32;   // the step within the chunk
        const unsigned A0[4] = {a0[0].x, a1[0].x, a0[0].y, a1[0].y};
        const unsigned A1[4] = {a0[0].z, a1[0].z, a0[0].w, a1[0].w};
#pragma unroll
        for (int q = 0; q + 1 < kTcGroup; ++q) {
          a0[q] = a0[q + 1];
          a1[q] = a1[q + 1];
        }
        load_step(next + kTcGroup, a0[kTcGroup - 1], a1[kTcGroup - 1]);  // kTcGroup steps ahead
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
          for (int e = kTcTerms - 1; e >= 0; --e) {  // smallest term first
            const uint4 b = xs[(e * R + 8 * j + gq) * L + 4 * s + t];
            const unsigned b0[2] = {b.x, b.y}, b1[2] = {b.z, b.w};
            mma_m16n8k16_bf16(acc[j], A0, b0);
            mma_m16n8k16_bf16(acc[j], A1, b1);
          }
      }
    }
    __syncthreads();  // xs is restaged (or reused for the partial sums)
  }

  if constexpr (NORM) {
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const float s = warp_sum(ssq[j]);
      if (lane == 0) inv[warp + 8 * j] = 1.0f / sqrtf(s / static_cast<float>(K) + eps);
    }
  }
  float* red = reinterpret_cast<float*>(xs);  // [8 warps][NT][4][32 lanes]
  if (kw > 1) {  // uniform over the block
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) red[((warp * NT + j) * 4 + i) * kWarp + lane] = acc[j][i];
  }
  __syncthreads();
  if (!live || ks != 0) return;
  for (int s = 1; s < kw; ++s)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[j][i] += red[(((warp + s) * NT + j) * 4 + i) * kWarp + lane];
  epi.template store<NT, NORM>(tile, lane, n, acc, inv);
}

}  // namespace mtp

template <int NT, bool NORM>
__global__ void __launch_bounds__(mtp::kTcThreads, NT <= 2 ? 3 : 2)
gemm_tc_kernel(const float* __restrict__ x, const __nv_bfloat16* __restrict__ w, const float* __restrict__ bias,
               const float* residual, const float* __restrict__ g, float eps, float* y, int n, int N, int K,
               int kw) {
  const mtp::LinearTcEpi epi{bias, residual, y, N};
  mtp::gemm_tc_tiles<NT, NORM>(x, w, g, eps, n, K, kw, epi);
}

template <int NT, bool NORM, bool SITU = false>
__global__ void __launch_bounds__(mtp::kTcThreads, NT <= 2 ? 3 : 2)
swiglu_tc_kernel(const float* __restrict__ x, const __nv_bfloat16* __restrict__ w13, const float* __restrict__ g,
                 float eps, float* __restrict__ act, int n, int I, int H, int kw, float limit, float gate_limit) {
  const mtp::SwigluTcEpi<SITU> epi{act, I, limit, gate_limit};
  mtp::gemm_tc_tiles<NT, NORM>(x, w13, g, eps, n, H, kw, epi);
}
