// mma.cu -- a probe of kernels/mma.cuh: one tensor-core product through its loaders, for the
// tests (no launcher, no op). tests/test_cuda_emulated.py runs it on the emulator,
// tests/test_gpu.py on a device: the same kernel, checked against a NumPy matmul.
//
// mma_bf16_probe_kernel(a, bt, b_kn, c, d, layout): grid 1, block 32 (one warp).
//   a [16][16] BF16 row-major (A), bt [8][16] BF16 (B transposed: bt[n][k] = B[k][n]),
//   b_kn [16][8] BF16 (the same B, k-major), c [16][8] FP32 ->
//   d [2][16][8] FP32: d[0] = A B + C with B through mma_load_b_nk, d[1] through mma_load_b_kn.
//   layout 0: mma.cuh's loaders and D stored at (mma_c_row, mma_c_col), as the kernels use
//   them. The others are wrong on purpose, each a plausible slip, so that a test can show
//   the comparison catches one: 1 A read transposed, 2 a[1] and a[2] exchanged (rows + 8
//   taken for columns + 8), 3 b[0] and b[1] exchanged, 4 D's rows g and g + 8 exchanged.
#include "common.cuh"
#include "mma.cuh"

__global__ void __launch_bounds__(32)
mma_bf16_probe_kernel(const __nv_bfloat16* __restrict__ a, const __nv_bfloat16* __restrict__ bt,
                      const __nv_bfloat16* __restrict__ b_kn, const float* __restrict__ c, float* __restrict__ d,
                      int layout) {
  using namespace mtp;
  const int lane = threadIdx.x % kWarp, g = lane >> 2, t = lane & 3;
  unsigned af[4];
  if (layout == 1) {  // A^T's fragment: element (row, col) read at [col][row]
    af[0] = pack_bf16x2(a[(2 * t) * 16 + g], a[(2 * t + 1) * 16 + g]);
    af[1] = pack_bf16x2(a[(2 * t) * 16 + g + 8], a[(2 * t + 1) * 16 + g + 8]);
    af[2] = pack_bf16x2(a[(2 * t + 8) * 16 + g], a[(2 * t + 9) * 16 + g]);
    af[3] = pack_bf16x2(a[(2 * t + 8) * 16 + g + 8], a[(2 * t + 9) * 16 + g + 8]);
  } else {
    mma_load_a(af, a, 16, lane);
    if (layout == 2) {
      const unsigned x = af[1];
      af[1] = af[2];
      af[2] = x;
    }
  }
  for (int v = 0; v < 2; ++v) {
    unsigned bf[2];
    if (v == 0) mma_load_b_nk(bf, bt, 16, lane);
    else mma_load_b_kn(bf, b_kn, 8, lane);
    if (layout == 3) {
      const unsigned x = bf[0];
      bf[0] = bf[1];
      bf[1] = x;
    }
    float acc[4];
    for (int i = 0; i < 4; ++i) acc[i] = c[mma_c_row(lane, i) * 8 + mma_c_col(lane, i)];
    mma_m16n8k16_bf16(acc, af, bf);
    for (int i = 0; i < 4; ++i) {
      const int row = layout == 4 ? mma_c_row(lane, i) ^ 8 : mma_c_row(lane, i);
      d[v * 128 + row * 8 + mma_c_col(lane, i)] = acc[i];
    }
  }
}
