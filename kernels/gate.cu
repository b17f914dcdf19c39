// gate.cu -- sigmoid output gates: out = residual + x * sigmoid(gate), one gate per c columns.
//
//   x [n, F] fp32; gate: n rows of G fp32, row i at gate + i * ldg (ldg >= G: a column
//   slice of a wider fused projection is read in place); residual [n, F] fp32 -> out [n, F]
//   out[i, j] = residual[i, j] + x[i, j] * sigmoid(gate[i * ldg + j / c]),  c = F / G,
//   sigmoid(g) = 1 / (1 + expf(-g)). Head-wise gates have G = Hq (c = head dim),
//   element-wise ones G = F (c = 1), a row gate G = 1 (c = F).
//
// sigmoid_gate_kernel<RESIDUAL>: grid (ceil(F / 1024), n), block 256. Block (b, i) owns
//   columns [1024 b, 1024 b + 1024) of row i; thread t the columns 1024 b + 256 k + t,
//   k < 4 (coalesced loads and stores; the threads of one gate group read its gate value
//   from L1). RESIDUAL = false: no residual (the pointer is not read).
//
// Preconditions: blockDim.x == 256; G >= 1 divides F; out may be x or residual (each
// element is read, then written, by the same thread); no other overlap (the launcher
// checks).
#include "common.cuh"

namespace mtp {
constexpr int kGateThreads = 256;
constexpr int kGatePerThread = 4;
}  // namespace mtp

template <bool RESIDUAL>
__global__ void __launch_bounds__(mtp::kGateThreads)
sigmoid_gate_kernel(const float* x, const float* __restrict__ gate, int ldg, const float* residual,
                    float* out, int F, int G) {
  using namespace mtp;
  const long long i = blockIdx.y;
  const int c = F / G;
  const float* xr = x + i * F;
  const float* gr = gate + i * ldg;
  float* yr = out + i * F;
#pragma unroll
  for (int k = 0; k < kGatePerThread; ++k) {
    const int j = blockIdx.x * (kGatePerThread * kGateThreads) + k * kGateThreads + threadIdx.x;
    if (j < F) {
      const float s = 1.0f / (1.0f + expf(-gr[j / c]));
      const float v = xr[j] * s;
      if constexpr (RESIDUAL) yr[j] = residual[i * F + j] + v;
      else yr[j] = v;
    }
  }
}
