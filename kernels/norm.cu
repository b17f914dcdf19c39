// norm.cu -- RMSNorm, and the two RMSNorms of the MTP input block.
//
// rmsnorm_kernel:
//   out[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * w          x, out [n, H] fp32, w [H] fp32
//   grid (n), block 256: one block per row. Pass 1 sums squares (16-byte
//   loads when aligned), block_sum gives the mean to every thread, pass 2
//   re-reads the row (L1/L2 hit: 16 KB at H = 4096) and writes it scaled.
//
// mtp_norms_kernel<W>:  the first of the two kernels of mtp_input
//   xcat[r, 0:H]  = rmsnorm(embed[tokens[r], :], enorm_w)          blockIdx.y == 0, embed [V, H] in W
//                   or 0 where zero_embed[r] != 0 (no embedding row read: vLLM's position-0 mask)
//   xcat[r, H:2H] = rmsnorm(g[r, :], hnorm_w)                       blockIdx.y == 1, g [n, H] fp32
//   zero_embed: [n] one byte a flag, or nullptr (no row flagged); tested once per block,
//   before any loop.
//   grid (n, 2), block 256. The second kernel is linear_kernel (linear.cu):
//   x = xcat @ eh_w^T with eh_w [H, 2H]. Writing the concat costs 2 * n * 2H * 4 B
//   (64 KB per token at H = 4096) against 32 MB of bf16 eh_w, so the simpler
//   two-kernel form was kept over a GEMV that normalises on the fly.
//
// Preconditions: blockDim.x == 256; tokens in [0, V) (a token outside gives a
//   NaN row, visible downstream, never an out-of-bounds read). The 16-byte path
//   needs H % (16 / sizeof(T)) == 0 and 16-byte aligned rows; otherwise the
//   kernel takes the scalar path (same results). out may alias x (every element
//   is read, then written, by the same thread). A row of finite |x| >= 2^56 is
//   scaled by a power of two before its squares are summed again (rmsnorm_row: pass 1
//   also finds the row's largest |x|; one block_max more per row).
#include "common.cuh"

namespace mtp {

constexpr int kNormThreads = 256;

// dst[0:H] = src[0:H] / sqrt(mean(src^2) + eps) * w, by the whole block.
template <typename T>
__device__ __forceinline__ void rmsnorm_row(const T* src, const float* w, float* dst, int H,
                                            float eps, float* red) {
  constexpr int V = 16 / sizeof(T);  // 8 bf16 or 4 fp32 per load
  const bool vec = H % V == 0 && aligned16(src) && aligned16(w) && aligned16(dst);
  float ss = 0.0f, m = 0.0f;  // m: the largest finite |x| (NaN and infinities not counted)
  if (vec) {
    for (int k = threadIdx.x * V; k < H; k += blockDim.x * V) {
      float f[V];
      load_vec<V>(src + k, f);
#pragma unroll
      for (int v = 0; v < V; ++v) {
        ss = fmaf(f[v], f[v], ss);
        if (fabsf(f[v]) > m && fabsf(f[v]) <= 3.40282347e+38f) m = fabsf(f[v]);  // FLT_MAX
      }
    }
  } else {
    for (int k = threadIdx.x; k < H; k += blockDim.x) {
      const float f = to_f32(src[k]);
      ss = fmaf(f, f, ss);
      if (fabsf(f) > m && fabsf(f) <= 3.40282347e+38f) m = fabsf(f);
    }
  }
  ss = block_sum(ss, red);
  // A row whose largest finite |x|, m, is >= 2^56 (its sum of squares could overflow) is
  // scaled first by sc = 2^(32 - floor(log2(m))), eps by sc^2: exact, as mtpkern.ops.norm.
  // Uniform over the block (m is the block's); rows below 2^56 keep the plain path.
  float sc = 1.0f;
  {
    m = block_max(m, red);
    if (m >= 72057594037927936.0f) {  // 2^56
      const int e = static_cast<int>((__float_as_uint(m) >> 23) & 0xffu) - 127;  // m normal: in [2^e, 2^(e + 1))
      sc = __int_as_float((127 + 32 - e) << 23);
      ss = 0.0f;
      for (int k = threadIdx.x; k < H; k += blockDim.x) {
        const float f = to_f32(src[k]) * sc;
        ss = fmaf(f, f, ss);
      }
      ss = block_sum(ss, red);
      eps = eps * sc * sc;
    }
  }
  const float denom = sqrtf(ss / static_cast<float>(H) + eps);  // as the reference: x / sqrt(var + eps) * w
  if (sc != 1.0f) {
    for (int k = threadIdx.x; k < H; k += blockDim.x) dst[k] = to_f32(src[k]) * sc / denom * w[k];
  } else if (vec) {
    for (int k = threadIdx.x * V; k < H; k += blockDim.x * V) {
      float f[V], g[V];
      load_vec<V>(src + k, f);
      load_vec<V>(w + k, g);
#pragma unroll
      for (int v = 0; v < V; v += 4)
        store4(dst + k + v, f[v] / denom * g[v], f[v + 1] / denom * g[v + 1],
               f[v + 2] / denom * g[v + 2], f[v + 3] / denom * g[v + 3]);
    }
  } else {
    for (int k = threadIdx.x; k < H; k += blockDim.x) dst[k] = to_f32(src[k]) / denom * w[k];
  }
}

}  // namespace mtp

__global__ void __launch_bounds__(mtp::kNormThreads)
rmsnorm_kernel(const float* x, const float* __restrict__ w, float* out, int H, float eps) {
  __shared__ float red[33];
  const long long row = blockIdx.x;
  mtp::rmsnorm_row<float>(x + row * H, w, out + row * H, H, eps, red);
}

template <typename W>
__global__ void __launch_bounds__(mtp::kNormThreads)
mtp_norms_kernel(const W* __restrict__ embed, const int* __restrict__ tokens,
                 const unsigned char* __restrict__ zero_embed, const float* __restrict__ g,
                 const float* __restrict__ enorm_w, const float* __restrict__ hnorm_w,
                 float* __restrict__ xcat, int V, int H, float eps) {
  __shared__ float red[33];
  const long long r = blockIdx.x;
  float* dst = xcat + r * 2 * H + static_cast<long long>(blockIdx.y) * H;   // [n, 2H]
  if (blockIdx.y == 0) {
    if (zero_embed != nullptr && zero_embed[r] != 0) {   // uniform over the block
      for (int k = threadIdx.x; k < H; k += blockDim.x) dst[k] = 0.0f;
      return;
    }
    const int t = tokens[r];
    if (t < 0 || t >= V) {
      for (int k = threadIdx.x; k < H; k += blockDim.x) dst[k] = mtp::quiet_nan();
      return;
    }
    mtp::rmsnorm_row<W>(embed + static_cast<long long>(t) * H, enorm_w, dst, H, eps, red);
  } else {
    mtp::rmsnorm_row<float>(g + r * H, hnorm_w, dst, H, eps, red);
  }
}
