// linear.cu -- y[n, N] = x[n, K] @ w[N, K]^T (+ bias[N]) (+ residual[n, N]), FP32 accumulation.
//
// Our own GEMV / small-n GEMM (cuBLAS through cupy.matmul cannot be captured
// in a CUDA graph). Mapping (gemv_groups in common.cuh):
//   block 128 = 4 warps; row group u = output rows (2u, 2u + 1);
//   a group is computed by wpr in {1, 2, 4} warps splitting K, so a block holds
//   4 / wpr groups: grid.x = ceil(ceil(N / 2) / (4 / wpr)).
//   NR (1, 2, 4 or 8, a template parameter: the launcher takes the smallest
//   NR >= min(n, 8)) input rows per pass: every weight vector is loaded once per
//   chunk of NR tokens, so for n <= 8 the weight matrix is streamed exactly once
//   (the bandwidth floor: N * K * sizeof(W) bytes), without L1 allocation. For
//   n > 8 it is re-read once per 8 rows, mostly from L2; prefill-sized n would
//   want a tensor-core GEMM instead.
// Epilogue (lane 0 of the group's first warp): y = acc + bias + residual, in
// the reference's order ((x w^T + bias) + residual).
// NORM (the ops' norm=(norm_w, eps)): x is the input of an RMSNorm fused into the GEMV,
//   y = (x * norm_w) w^T / sqrt(mean(x^2) + eps) + bias + residual: norm_w [K] is applied as
//   x is loaded, the row's sum of squares accumulated beside the dot products (split-K
//   warps add theirs through shared memory), the division in the epilogue (common.cuh
//   gemv_dot_impl). Without NORM norm_w is null and eps unused.
//
// Also used for lm_head_logits (no bias / residual), the router logits of
// moe_router, the eh_proj of mtp_input and the down projection of swiglu_mlp.
//
// W: float, __nv_bfloat16, __nv_fp8_e4m3 or fp4x2_e2m1; for FP8, scale/bn/bk are its scales
// (common.cuh Scales: [ceil(N / bn), ceil(K / bk)], per-channel bn = 1, bk = K), for FP4 its
// E8M0 codes [N, ceil(K / 32)] (bn = 1, bk = 32), and each weight is dequantized in the inner
// loop; dense weights pass scale = null.
//
// Preconditions: blockDim.x == 128; x, y, residual fp32 [n, *] contiguous;
// bias / residual may be null; y may alias residual (each element is read and
// then written by the same thread), not x. The 16-byte path needs
// K % (16 / sizeof(W)) == 0 and 16-byte aligned w and x; otherwise the scalar
// path runs (same results up to summation order). FP8's vector path (8-byte loads)
// also needs bk % 8 == 0 and an 8-byte aligned w; FP4's (4-byte loads of 8 codes) K % 8 == 0
// and a 4-byte aligned w.
#include "common.cuh"

template <typename W, int NR, bool NORM>
__global__ void
linear_kernel(const float* __restrict__ x, const W* __restrict__ w, const mtp::ScaleT<W>* __restrict__ scale, int bn,
              int bk, const float* __restrict__ bias, const float* residual, float* y, int n, int N, int K,
              int wpr, const float* __restrict__ norm_w, float eps) {
  const mtp::LinearEpi epi{bias, residual, y, N};
  mtp::gemv_groups<W, NR, NORM>(x, w, mtp::make_scales<W>(scale, bn, bk, K), n, K, wpr, epi,
                                mtp::RowNorm{norm_w, eps});
}
