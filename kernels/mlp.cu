// mlp.cu -- gate/up half of the SwiGLU MLP:
//   act[n, I] = silu(x @ w13[0:I]^T) * (x @ w13[I:2I]^T)       x [n, H] fp32, w13 [2I, H] in W
// clamped by `limit` (Step-3.5 / 3.7: min(silu(gate), L)) and `gate_limit` (DeepSeek-V4:
// silu(min(gate, Lg))), up clipped by the smaller (mtp::swiglu; +inf: no clamp, the same bits
// as without).
//
// swiglu_mlp(x, w13, w2, residual) = linear_kernel(act, w2, residual) after
// this kernel (linear.cu): y = residual + act @ w2^T.
//
// Mapping (gemv_groups in common.cuh): row group u = (gate row u, up row I + u),
// so one warp holds both halves of act[:, u] and applies silu(g) * up in its
// epilogue; act never exists unactivated. block 128 = 4 warps, wpr warps per
// group splitting K = H, grid.x = ceil(I / (4 / wpr)). Each weight vector is
// used for NR (1, 2, 4 or 8, the instantiation) tokens per pass (see linear.cu).
//
// W and scale/bn/bk (FP8 scales of w13 [2I, H], null for dense weights): as linear.cu.
// NORM / norm_w / eps: an RMSNorm of x fused in, as linear.cu (both halves see the normed x).
//
// SITU (the last template parameter): Kimi K3's SiTU instead of SwiGLU (mtp::gated_act), limit
// and gate_limit then carrying its beta and linear beta (0: none).
//
// relu2_kernel (Nemotron-H's non-gated MLP, activation="relu2"): act[i] = relu2(act[i]) in
// place over `count` values (mtp::relu2), grid-stride, block 256; the up and down projections
// around it are linear_kernel's (swiglu_mlp's launcher).
//
// Preconditions: blockDim.x == 128; x, act fp32 contiguous. Vector path as
// linear.cu (H % (16 / sizeof(W)) == 0, aligned w13 and x; FP8: as linear.cu), else scalar.
#include "common.cuh"

namespace mtp {

template <bool SITU>
struct SwiGluEpi {
  float* act;  // [n, I]
  int I;
  float limit;       // the SwiGLU clamp of silu(gate), +inf for none (SITU: beta)
  float gate_limit;  // the SwiGLU clamp of the gate before silu, +inf for none (SITU: the linear beta)

  __device__ bool rows(int u, int& a, int& b) const {
    a = u;      // gate row
    b = I + u;  // up row
    return u < I;
  }

  template <int NR>
  __device__ void store(int u, int r0, int m, const float (&acc)[2][NR]) const {
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      if (r >= m) break;
      act[static_cast<long long>(r0 + r) * I + u] = gated_act<SITU>(acc[0][r], acc[1][r], limit, gate_limit);
    }
  }
};

}  // namespace mtp

template <typename W, int NR, bool NORM, bool SITU = false>
__global__ void
swiglu_gate_up_kernel(const float* __restrict__ x, const W* __restrict__ w13, const mtp::ScaleT<W>* __restrict__ scale,
                      int bn, int bk, float* __restrict__ act, int n, int I, int H, int wpr, float limit,
                      float gate_limit, const float* __restrict__ norm_w, float eps) {
  const mtp::SwiGluEpi<SITU> epi{act, I, limit, gate_limit};
  mtp::gemv_groups<W, NR, NORM>(x, w13, mtp::make_scales<W>(scale, bn, bk, H), n, H, wpr, epi,
                                mtp::RowNorm{norm_w, eps});
}

__global__ void __launch_bounds__(256) relu2_kernel(float* __restrict__ act, long long count) {
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    act[i] = mtp::relu2(act[i]);
  }
}
