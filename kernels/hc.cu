// hc.cu -- hyper-connections (DeepSeek-V4's mHC; spec: mtpkern/ops/hc.py): a row's hidden is
// m <= 16 streams of H, X [n, m H] (stream i at columns i H .. (i + 1) H) in T = float or
// __nv_bfloat16 (BF16 bits, widened on load); coefficients and results FP32.
//
// hc_pre_kernel<T>: grid (n), block 256: one block per row.
//   pre[i]  = sigmoid(mix[i] s0 + base[i]) + eps                      threads i < m (shared)
//   post[i] = 2 sigmoid(mix[m + i] s1 + base[m + i])                   threads m <= i < 2m
//   comb    = softmax over rows of mix[2m:] s2 + base[2m:] (m x m), + eps, then / (column sums
//             + eps), then iters - 1 times / (row sums + eps), / (column sums + eps)
//   u       = sum_i pre[i] X[i]                                        streams in index order
//   The m x m matrix (m^2 <= 256 = blockDim) lives twice in shared memory (cur, nxt): thread
//   t < m^2 owns element (t / m, t % m); each step it sums its row (or column) of cur in
//   index order -- every thread of a row computes the same sum the same way -- and writes
//   its element of nxt, one barrier per step (2 iters + 1 in all; 41 at iters 20). Then the
//   whole block collapses the streams, 4 adjacent columns per thread (16-byte FP32 / 8-byte
//   BF16 loads), a thread's column groups 1024 apart.
//
// hc_post_kernel<TF, TX, MR>: grid (ceil(H / 512), n), block 128. Thread t of block (b, r)
//   owns columns h .. h + 3 of row r, h = 4 (128 b + t): it loads f's and the m <= MR input
//   streams' columns once (registers: MR = 4 or 16, the launcher takes the smaller that
//   holds m), then for every output stream j writes
//     out[r, j H + h] = post[j] f[h] + sum_i comb[i, j] X[i, h]       (comb read transposed)
//   as one 16-byte store; post and comb of the row in shared memory. f in TF, X in TX.
//
// hc_head_kernel<T>: grid (ceil(H / 512), n), block 128: pre[i] = sigmoid(mix[i] s0 + base[i])
//   + eps (threads i < m, shared), then out[h] = sum_i pre[i] X[i, h] over 4 columns per
//   thread as in hc_post.
//
// Sums run in index order, as the reference; NVRTC contracts a * b + c into one FMA where the
// reference rounds twice (FP32 tolerance). The row max of the softmax keeps a NaN (np.max).
//
// Preconditions: 1 <= m <= 16 (the launcher refuses more); blockDim as above; no output
// overlaps an input (the launcher checks). The vector path needs H % 4 == 0 and the arrays
// aligned to 4 elements; otherwise the kernels take the scalar path (same results).
#include "common.cuh"

namespace mtp {

constexpr int kHcMaxStreams = 16;
constexpr int kHcPreThreads = 256;  // m^2 <= 256: a thread per element of comb
constexpr int kHcThreads = 128;     // hc_post / hc_head: 512 columns per block

__device__ __forceinline__ float hc_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

template <typename T>
__device__ __forceinline__ bool hc_aligned4(const T* p) {
  return (reinterpret_cast<unsigned long long>(p) % (4 * sizeof(T))) == 0;
}

// 4 columns from p (valid: how many of them exist, >= 1), vector load when `vec`.
template <typename T>
__device__ __forceinline__ void hc_load4(const T* p, int valid, bool vec, float (&f)[4]) {
  if (vec) load_vec<4>(p, f);
  else load_guarded<4>(p, valid, f);
}

__device__ __forceinline__ void hc_store4(float* p, int valid, bool vec, const float (&f)[4]) {
  if (vec) {
    store4(p, f[0], f[1], f[2], f[3]);
  } else {
#pragma unroll
    for (int v = 0; v < 4; ++v)
      if (v < valid) p[v] = f[v];
  }
}

// out[h .. h + 3] = sum_i w[i] x[i H + h ..], streams in index order (x: one row's streams).
template <typename T>
__device__ __forceinline__ void hc_collapse4(const T* x, const float* w, int m, int H, int h, bool vec,
                                             float* out) {
  const int valid = H - h;
  float acc[4], xv[4];
  hc_load4(x + h, valid, vec, xv);
#pragma unroll
  for (int v = 0; v < 4; ++v) acc[v] = w[0] * xv[v];
#pragma unroll 4
  for (int i = 1; i < m; ++i) {
    hc_load4(x + static_cast<long long>(i) * H + h, valid, vec, xv);
    const float wi = w[i];
#pragma unroll
    for (int v = 0; v < 4; ++v) acc[v] = acc[v] + wi * xv[v];
  }
  hc_store4(out + h, valid, vec, acc);
}

// Sum of row a (columns 0 .. m - 1) / column b (rows 0 .. m - 1) of an m x m matrix, in order.
__device__ __forceinline__ float hc_row_sum(const float* c, int a, int m) {
  float s = 0.0f;
  for (int k = 0; k < m; ++k) s += c[a * m + k];
  return s;
}
__device__ __forceinline__ float hc_col_sum(const float* c, int b, int m) {
  float s = 0.0f;
  for (int k = 0; k < m; ++k) s += c[k * m + b];
  return s;
}

}  // namespace mtp

template <typename T>
__global__ void __launch_bounds__(mtp::kHcPreThreads)
hc_pre_kernel(const T* __restrict__ X, const float* __restrict__ mix, const float* __restrict__ base,
              const float* __restrict__ scale, float eps, int iters, int m, int H, float* __restrict__ u,
              float* __restrict__ post, float* __restrict__ comb) {
  using namespace mtp;
  __shared__ float pre[kHcMaxStreams];
  __shared__ float cur[kHcMaxStreams * kHcMaxStreams], nxt[kHcMaxStreams * kHcMaxStreams];
  const long long r = blockIdx.x;
  const int t = threadIdx.x, mm = m * m;
  const float* z = mix + r * (2 + m) * m;
  if (t < m) pre[t] = hc_sigmoid(z[t] * scale[0] + base[t]) + eps;
  else if (t < 2 * m) post[r * m + t - m] = 2.0f * hc_sigmoid(z[t] * scale[1] + base[t]);
  const int a = t / m, b = t - (t / m) * m;  // this thread's element of comb (t < mm)
  const bool own = t < mm;
  if (own) cur[t] = z[2 * m + t] * scale[2] + base[2 * m + t];
  __syncthreads();
  if (own) {  // softmax over the row: exp(c - row max)
    float mx = cur[a * m];
    for (int k = 1; k < m; ++k) {
      const float v = cur[a * m + k];
      if (v > mx || v != v) mx = v;  // a NaN stays
    }
    nxt[t] = expf(cur[t] - mx);
  }
  __syncthreads();
  if (own) cur[t] = nxt[t] / hc_row_sum(nxt, a, m) + eps;
  __syncthreads();
  if (own) nxt[t] = cur[t] / (hc_col_sum(cur, b, m) + eps);
  for (int it = 1; it < iters; ++it) {  // Sinkhorn's iterations
    __syncthreads();
    if (own) cur[t] = nxt[t] / (hc_row_sum(nxt, a, m) + eps);
    __syncthreads();
    if (own) nxt[t] = cur[t] / (hc_col_sum(cur, b, m) + eps);
  }
  if (own) comb[r * mm + t] = nxt[t];  // its own element: no barrier needed
  // the collapse (pre was written before the first barrier)
  const bool vec = (H & 3) == 0 && hc_aligned4(X) && aligned16(u);
  const T* x = X + r * m * H;
  for (int h = 4 * t; h < H; h += 4 * kHcPreThreads) hc_collapse4(x, pre, m, H, h, vec, u + r * H);
}

template <typename TF, typename TX, int MR>
__global__ void __launch_bounds__(mtp::kHcThreads)
hc_post_kernel(const TF* __restrict__ f, const TX* __restrict__ X, const float* __restrict__ post,
               const float* __restrict__ comb, int m, int H, float* __restrict__ out) {
  using namespace mtp;
  static_assert(MR >= 1 && MR <= kHcMaxStreams, "MR");
  __shared__ float coef[MR + MR * MR];  // post [m], then comb [m][m]
  const long long r = blockIdx.y;
  for (int k = threadIdx.x; k < m + m * m; k += kHcThreads)
    coef[k] = k < m ? post[r * m + k] : comb[r * m * m + (k - m)];
  __syncthreads();
  const int h = 4 * (blockIdx.x * kHcThreads + threadIdx.x);
  if (h >= H) return;
  const int valid = H - h;
  const bool vec = (H & 3) == 0 && hc_aligned4(f) && hc_aligned4(X) && aligned16(out);
  float fv[4], xv[MR][4];
  hc_load4(f + r * H + h, valid, vec, fv);
#pragma unroll
  for (int i = 0; i < MR; ++i)
    if (i < m) hc_load4(X + (r * m + i) * H + h, valid, vec, xv[i]);
  for (int j = 0; j < m; ++j) {
    float acc[4];
    const float p = coef[j];
#pragma unroll
    for (int v = 0; v < 4; ++v) acc[v] = p * fv[v];
#pragma unroll
    for (int i = 0; i < MR; ++i) {
      if (i < m) {
        const float c = coef[m + i * m + j];
#pragma unroll
        for (int v = 0; v < 4; ++v) acc[v] = acc[v] + c * xv[i][v];
      }
    }
    hc_store4(out + (r * m + j) * H + h, valid, vec, acc);
  }
}

template <typename T>
__global__ void __launch_bounds__(mtp::kHcThreads)
hc_head_kernel(const T* __restrict__ X, const float* __restrict__ mix, const float* __restrict__ base,
               const float* __restrict__ scale, float eps, int m, int H, float* __restrict__ out) {
  using namespace mtp;
  __shared__ float pre[kHcMaxStreams];
  const long long r = blockIdx.y;
  const int t = threadIdx.x;
  if (t < m) pre[t] = hc_sigmoid(mix[r * m + t] * scale[0] + base[t]) + eps;
  __syncthreads();
  const int h = 4 * (blockIdx.x * kHcThreads + t);
  if (h >= H) return;
  const bool vec = (H & 3) == 0 && hc_aligned4(X) && aligned16(out);
  hc_collapse4(X + r * m * H, pre, m, H, h, vec, out + r * H);
}
