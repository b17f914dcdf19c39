// mma.cuh -- one warp-wide tensor-core product and the fragment layout of its operands, and
// split_pair: FP32 values as BF16 terms that add up to them (the FP32-level operands of
// gemm_tc.cu's x and attention.cu's q).
//
// mma_m16n8k16_bf16(c, a, b): D[16 x 8] = A[16 x 16] B[16 x 8] + C, A and B BF16, C and D FP32
// (PTX mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32, sm_80+). All 32 lanes of the warp
// call it together (.aligned: the same instruction, no divergence) and each holds a fragment.
// With lane = 4 g + t (g = groupID = lane >> 2, t = threadID_in_group = lane % 4), as the PTX
// ISA's "Matrix Fragments for mma.m16n8k16 with floating point type" gives it:
//
//   A, row-major 16 x 16, 4 registers of two BF16 each (elements a0..a7, low half first):
//     a[0] = A[g    ][2t, 2t + 1]      a[2] = A[g    ][2t + 8, 2t + 9]
//     a[1] = A[g + 8][2t, 2t + 1]      a[3] = A[g + 8][2t + 8, 2t + 9]
//   B, 16 (k) x 8 (n), "col": each register two consecutive k of one column n = g:
//     b[0] = B[2t, 2t + 1][g]          b[1] = B[2t + 8, 2t + 9][g]
//   C / D, 16 x 8 FP32:
//     c[0], c[1] = D[g][2t], D[g][2t + 1]     c[2], c[3] = D[g + 8][2t], D[g + 8][2t + 1]
//
// In a register the lower-indexed element is the low 16 bits (pack_bf16x2). A matrix stored
// with its fragment pairs adjacent (A row-major, B as rows of n with k contiguous) loads
// each register with one 32-bit read (mma_load_a, mma_load_b_nk); B stored k-major takes two
// 16-bit reads per register (mma_load_b_kn). These loaders and mma_c_row / mma_c_col are the
// layout every user of the mma goes through; the emulated body below has its own copy of
// the layout, written from the ISA, so tests/test_cuda_emulated.py's layout test
// (kernels/mma.cu) can tell a loader that disagrees with it.
//
// Without a GPU (tests/cuda_emu, MTPKERN_CUDA_EMU): the 32 lanes' fragments are gathered
// with emu::warp_gather, A and B rebuilt from the layout, and each lane computes its four
// D values as c + sum_k A[row][k] B[k][col], k = 0..15 in order, with fmaf (the products of
// two BF16 are exact in FP32). The hardware's accumulation order is not specified, so a GPU
// agrees within FP32 rounding of a 16-term sum, not bit for bit.
#pragma once

#include <cuda_bf16.h>

namespace mtp {

// Two floats rounded to BF16 (nearest even) in one register: lo in bits 0..15, hi in 16..31.
__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
  return static_cast<unsigned>(__bfloat16_as_ushort(__float2bfloat16_rn(lo))) |
         static_cast<unsigned>(__bfloat16_as_ushort(__float2bfloat16_rn(hi))) << 16;
}
__device__ __forceinline__ unsigned pack_bf16x2(__nv_bfloat16 lo, __nv_bfloat16 hi) {
  return static_cast<unsigned>(__bfloat16_as_ushort(lo)) | static_cast<unsigned>(__bfloat16_as_ushort(hi)) << 16;
}

// Two values of x as TERMS BF16 pairs (pack_bf16x2's packing) that add up to them: part 0 =
// bf16(v), part e = bf16(v - parts 0 .. e - 1) (each difference exact in FP32). An infinite or
// NaN part leaves 0 to the next ones (inf - inf would make a NaN of an infinite x).
template <int TERMS>
__device__ __forceinline__ void split_pair(float v0, float v1, unsigned (&parts)[TERMS]) {
#pragma unroll
  for (int e = 0; e < TERMS; ++e) {
    const __nv_bfloat16 h0 = __float2bfloat16_rn(v0), h1 = __float2bfloat16_rn(v1);
    parts[e] = pack_bf16x2(h0, h1);
    const float f0 = __bfloat162float(h0), f1 = __bfloat162float(h1);
    v0 = fabsf(f0) < __int_as_float(0x7f800000) ? v0 - f0 : 0.0f;
    v1 = fabsf(f1) < __int_as_float(0x7f800000) ? v1 - f1 : 0.0f;
  }
}

// A [16][lda] row-major from shared or global memory (lda even, A 4-byte aligned).
__device__ __forceinline__ void mma_load_a(unsigned (&a)[4], const __nv_bfloat16* A, int lda, int lane) {
  const int g = lane >> 2, t = lane & 3;
  const __nv_bfloat16* p = A + g * lda + 2 * t;
  a[0] = *reinterpret_cast<const unsigned*>(p);
  a[1] = *reinterpret_cast<const unsigned*>(p + 8 * lda);
  a[2] = *reinterpret_cast<const unsigned*>(p + 8);
  a[3] = *reinterpret_cast<const unsigned*>(p + 8 * lda + 8);
}

// B[k][n] stored as Bt [8][ldb], Bt[n][k] = B[k][n] (k contiguous: ldb even, 4-byte aligned).
__device__ __forceinline__ void mma_load_b_nk(unsigned (&b)[2], const __nv_bfloat16* Bt, int ldb, int lane) {
  const int g = lane >> 2, t = lane & 3;
  const __nv_bfloat16* p = Bt + g * ldb + 2 * t;
  b[0] = *reinterpret_cast<const unsigned*>(p);
  b[1] = *reinterpret_cast<const unsigned*>(p + 8);
}

// B[k][n] stored k-major, B [16][ldb] (n contiguous): two 16-bit reads per register.
__device__ __forceinline__ void mma_load_b_kn(unsigned (&b)[2], const __nv_bfloat16* B, int ldb, int lane) {
  const int g = lane >> 2, t = lane & 3;
  const __nv_bfloat16* p = B + (2 * t) * ldb + g;
  b[0] = pack_bf16x2(p[0], p[ldb]);
  b[1] = pack_bf16x2(p[8 * ldb], p[9 * ldb]);
}

// Row and column of D held in c[i] by `lane`.
__device__ __forceinline__ int mma_c_row(int lane, int i) { return (lane >> 2) + (i >= 2 ? 8 : 0); }
__device__ __forceinline__ int mma_c_col(int lane, int i) { return 2 * (lane & 3) + (i & 1); }

__device__ __forceinline__ void mma_m16n8k16_bf16(float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
#if defined(MTPKERN_CUDA_EMU)
  unsigned mine[6] = {a[0], a[1], a[2], a[3], b[0], b[1]};
  unsigned all[32][6];
  emu::warp_gather(mine, 6, &all[0][0]);
  float A[16][16], B[16][8];
  for (int l = 0; l < 32; ++l) {
    const int g = l >> 2, t = l & 3;
    for (int i = 0; i < 8; ++i) {  // element a_i: register i / 2, half i % 2
      const unsigned r = all[l][i / 2];
      const int row = g + ((i & 2) ? 8 : 0);            // a2, a3, a6, a7: groupID + 8
      const int col = 2 * t + (i & 1) + (i >= 4 ? 8 : 0);
      A[row][col] = __uint_as_float((i & 1) ? (r & 0xffff0000u) : (r << 16));
    }
    for (int i = 0; i < 4; ++i) {  // element b_i: register i / 2, half i % 2
      const unsigned r = all[l][4 + i / 2];
      const int k = 2 * t + (i & 1) + (i >= 2 ? 8 : 0);
      B[k][g] = __uint_as_float((i & 1) ? (r & 0xffff0000u) : (r << 16));
    }
  }
  const int lane = static_cast<int>(threadIdx.x) & 31;
  for (int i = 0; i < 4; ++i) {
    const int row = (lane >> 2) + (i >= 2 ? 8 : 0), col = 2 * (lane & 3) + (i & 1);
    float acc = c[i];
    for (int k = 0; k < 16; ++k) acc = fmaf(A[row][k], B[k][col], acc);
    c[i] = acc;
  }
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  // Before sm_80 there is no BF16 mma: the launchers never select a kernel that gets here.
  (void)c; (void)a; (void)b;
  __trap();
#endif
}

}  // namespace mtp
