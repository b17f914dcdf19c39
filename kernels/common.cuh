// common.cuh -- building blocks shared by every kernel family of mtpkern.
//
// - element conversion: BF16 storage (__nv_bfloat16, carried by CuPy as uint16
//   bits), FP32 storage, or FP8 E4M3 weights (__nv_fp8_e4m3, uint8 bytes, with FP32
//   scales: Scales), or FP4 E2M1 weights (fp4x2_e2m1: two codes a byte, with E8M0 scale
//   codes per 32 weights; nvfp4x2_e2m1: the same codes, with E4M3 scale codes per 16 and an
//   FP32 scale per row), always widened to FP32 for arithmetic;
// - vector loads: N consecutive elements -> float[N] with the widest aligned
//   access (16 bytes for 8 bf16 or 4 floats);
// - warp / block reductions with a fixed summation order (results do not
//   depend on timing, so runs are bit-reproducible);
// - the GEMV core used by linear, mlp, moe and lm_head: a warp computes the
//   dot products of ROWS weight rows with NR input rows, each weight vector
//   loaded once and used for all NR inputs;
// - the (value, id) argmax rule shared by the LM-head kernels, and the sampled drafts'
//   Gumbel noise shared by sampling.cu and lm_head.cu.
//
// Conventions: every kernel is launched with blockDim.x a multiple of 32;
// element offsets into weights and KV caches are 64-bit (E * 2I * H and
// NB * BS * Hkv * D pass 2^31 on real checkpoints).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

// Two FP4 E2M1 weights in one byte, as DeepSeek-V4 releases its routed experts (docs/fp4.md):
// column 2j of a row in the low nibble of byte j, column 2j + 1 in the high nibble. A row of K
// weights is K / 2 bytes (K even); its E8M0 scales are one code per 32 columns (Scales).
struct fp4x2_e2m1 {
  unsigned char bits;
};
// NVFP4: the same E2M1 codes packed the same way, a row's scales being one record of bytes:
// its FP32 row scale (the per-tensor global scale, folded per row), then one E4M3 code per 16
// columns, padded to a multiple of 4 bytes (nvfp4_record, below; CudaNvFp4 writes it).
struct nvfp4x2_e2m1 {
  unsigned char bits;
};

namespace mtp {

constexpr int kWarp = 32;
constexpr unsigned kFullMask = 0xffffffffu;

// ---------------------------------------------------------------------------
// Element conversion

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
// E4M3 -> FP32 is exact (through FP16: cvt.rn.f16x2.e4m3x2 on sm_89+, cuda_fp8.h's bit
// arithmetic on sm_80); 0x7F / 0xFF give NaN.
__device__ __forceinline__ float to_f32(__nv_fp8_e4m3 v) { return static_cast<float>(v); }

// Storage traits of a weight element type: elements per vector load of the GEMV core
// (16 bytes of BF16 / FP32; 8 bytes of FP8 and 4 of FP4, so that a vector is 8 values as
// for BF16), whether it carries scales, their type (FP32, or E8M0 codes for FP4) and the
// weights per stored element (2 for FP4: a row of K weights is K / per elements); row_scaled:
// the scales are NVFP4's per-row records (E4M3 codes behind an FP32 row scale).
template <typename W>
struct Elem {
  static constexpr int V = 16 / sizeof(W);
  static constexpr bool scaled = false;
  static constexpr int per = 1;
  static constexpr bool row_scaled = false;
  using Scale = float;
};
template <>
struct Elem<__nv_fp8_e4m3> {
  static constexpr int V = 8;
  static constexpr bool scaled = true;
  static constexpr int per = 1;
  static constexpr bool row_scaled = false;
  using Scale = float;
};
template <>
struct Elem<fp4x2_e2m1> {
  static constexpr int V = 8;
  static constexpr bool scaled = true;
  static constexpr int per = 2;
  static constexpr bool row_scaled = false;
  using Scale = unsigned char;  // E8M0: code c is 2^(c - 127)
};
template <>
struct Elem<nvfp4x2_e2m1> {
  static constexpr int V = 8;
  static constexpr bool scaled = true;
  static constexpr int per = 2;
  static constexpr bool row_scaled = true;  // its records hold an FP32 row scale
  using Scale = unsigned char;  // a row's record: FP32 row scale, then E4M3 codes per 16
};
// Whether a KV cache of element type KV holds FP8 E4M3 codes, with one FP32 scale per (row, KV head)
// in a plane beside it (mtpkern.ops.kv_fp8; rope_kv.cu writes them, attention.cu reads them).
template <typename KV>
constexpr bool kv_fp8 = false;
template <>
constexpr bool kv_fp8<__nv_fp8_e4m3> = true;

// The type of W's scales (the kernels' `scale` parameter).
template <typename W>
using ScaleT = typename Elem<W>::Scale;

// Row r of a weight [*, K] of element type W.
template <typename W>
__device__ __forceinline__ const W* weight_row(const W* w, long long r, int K) {
  return w + r * (K / Elem<W>::per);
}

// Dequantization scales of a quantized weight [R, K] (one matrix; Scales::expert selects
// matrix e of [E, R, K]): FP8: w[r][k] = e4m3(q[r][k]) * s[r / bn][k / bk], FP32 scales;
// FP4: w[r][k] = e2m1(q[r][k]) * 2^(s[r][k / 32] - 127), E8M0 codes (bn = 1, bk = 32);
// NVFP4: w[r][k] = e2m1(q[r][k]) * (e4m3(c[r][k / 16]) * g[r]), row r's record of nvfp4_record
// bytes holding g[r] and the codes c[r] (bn = 1, bk = 16, ks the record's bytes).
// ks = ceil(K / bk) scales per block row. Per-channel FP8 scales are bn = 1, bk = K. Unused
// (s null) for BF16 / FP32 weights. `item`: bytes per scale (4, or 1 for E8M0).
struct Scales {
  const void* s;
  int bn, bk, ks, item;

  __device__ __forceinline__ Scales expert(long long e, int R) const {
    return Scales{static_cast<const char*>(s) + e * ((R + bn - 1) / bn) * ks * item, bn, bk, ks, item};
  }
};
// Bytes of an NVFP4 row's scale record (K columns, bk of them per E4M3 code): 4 for the FP32
// row scale, then ceil(K / bk) codes, rounded up to a multiple of 4 so that every row's record
// starts 4-byte aligned (the row scale is one aligned load). mtpkern's nvfp4_record_bytes.
__host__ __device__ constexpr int nvfp4_record(int K, int bk) { return 4 + ((K + bk - 1) / bk + 3) / 4 * 4; }

// The Scales of a weight [*, K] of element type W (for dense W: none, whatever is passed).
// NVFP4: ks is the record's bytes (scale_row steps whole records; expert(e, R) R of them).
template <typename W>
__device__ __forceinline__ Scales make_scales(const ScaleT<W>* s, int bn, int bk, int K) {
  if constexpr (Elem<W>::row_scaled) return Scales{s, 1, bk, nvfp4_record(K, bk), 1};
  else if constexpr (Elem<W>::scaled) return Scales{s, bn, bk, (K + bk - 1) / bk, static_cast<int>(sizeof(ScaleT<W>))};
  else return Scales{nullptr, 1, 1, 0, 0};
}

// An E8M0 scale code -> 2^(c - 127), exact (code 0: 2^-127, an FP32 subnormal). The loader
// refuses the NaN code 0xFF and codes over 252 (mtpkern.quant.Fp4Weight).
__device__ __forceinline__ float e8m0(unsigned char c) {
  return __uint_as_float(c ? static_cast<unsigned>(c) << 23 : 0x00400000u);
}
__device__ __forceinline__ float scale_value(float s) { return s; }
__device__ __forceinline__ float scale_value(unsigned char c) { return e8m0(c); }

// An E4M3 scale code -> its value, exact (the loader refuses the NaN codes 0x7F / 0xFF).
__device__ __forceinline__ float e4m3(unsigned char c) {
  __nv_fp8_e4m3 v;
  v.__x = c;
  return static_cast<float>(v);
}
// Scale b (columns b * bk ..) of a row whose scales start at srow (scale_row). NVFP4: its E4M3
// code times the row's FP32 scale, the row scale folded into the block scale (one multiply per
// 8 weights, not one per weight; the weight is then e2m1 * (e4m3 * g), two roundings where the
// reference rounds (e2m1 * e4m3) * g once: the same value when g is a power of two, else within
// an FP32 rounding of it). The row-scale load does not depend on b: the compiler keeps it.
template <typename W>
__device__ __forceinline__ float block_scale(const ScaleT<W>* srow, int b) {
  if constexpr (Elem<W>::row_scaled)
    return e4m3(srow[4 + b]) * __ldg(reinterpret_cast<const float*>(srow));
  else return scale_value(srow[b]);
}

template <typename T>
__device__ __forceinline__ T from_f32(float v);
template <>
__device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);  // round to nearest even, as ml_dtypes' astype
}

// The FP8 KV cache (mtpkern.ops.kv_fp8): the E4M3 code (float8_e4m3fn) of x / s (s > 0), rounded to
// nearest, ties to even, as the exact quotient rounds once (ml_dtypes' float64 -> float8_e4m3fn of
// the float64 quotient, the cpu backend's e4m3_code): y = x / s in FP32, then to E4M3's 3 mantissa
// bits by rintf; where y lands exactly on an E4M3 midpoint the exact residual fmaf(-y, s, x) says on
// which side the true quotient lies (y = fl(x / s) can equal a midpoint it is not; rounding is
// monotonic, so no other case differs). |y| over 448 is clamped to 448 (a row's write never passes
// 448 (1 + 2^-24)); NaN -> 0x7F. No float64 on the device (its division is a call: register spills).
// Under -ftz a residual or quotient below FP32's normal range reads as 0 (rows of values ~1e-30).
__device__ __forceinline__ unsigned char e4m3_div(float x, float s) {
  const float y = x / s;
  if (y != y) return 0x7F;
  const unsigned sign = (__float_as_uint(x) >> 31) << 7;
  const float a = fminf(fabsf(y), 448.0f);
  const bool normal = a >= 0.015625f;                    // 2^-6, the least normal E4M3 value
  int e = normal ? static_cast<int>((__float_as_uint(a) >> 23) & 0xFF) - 127 : -6;  // a = 1.f 2^e
  const float t = a * __uint_as_float(static_cast<unsigned>(3 - e + 127) << 23);     // steps of 2^(e-3): exact
  float r = rintf(t);
  if (t - truncf(t) == 0.5f && a == fabsf(y)) {          // y on a midpoint: the exact quotient's side
    const float res = fmaf(-y, s, x);                    // x - y s, exact: s (q - y)
    if (res != 0.0f) r = ((res > 0.0f) == (x > 0.0f)) ? ceilf(t) : floorf(t);   // |q| above or below |y|
  }
  unsigned m = static_cast<unsigned>(r);
  if (!normal) return static_cast<unsigned char>(sign | m);   // 0 .. 8 (8: 2^-6, the least normal code)
  if (m == 16u) { m = 8u; ++e; }                              // rounded up into the next binade
  return static_cast<unsigned char>(sign | (static_cast<unsigned>(e + 7) << 3) | (m - 8u));
}

// Two bf16 packed in a 32-bit word (element 0 in the low half: little endian).
__device__ __forceinline__ float bf16_lo(unsigned u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float bf16_hi(unsigned u) { return __uint_as_float(u & 0xffff0000u); }

__device__ __forceinline__ float quiet_nan() { return __int_as_float(0x7fffffff); }
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// ---------------------------------------------------------------------------
// Vector loads. Precondition: p is aligned to N * sizeof(T) bytes (16 at most:
// N * sizeof(T) == 32 is done as two 16-byte loads). Read-only path (__ldg).

template <int N>
__device__ __forceinline__ void load_vec(const float* p, float (&f)[N]) {
  static_assert(N == 1 || N == 2 || N == 4 || N == 8, "N");
  if constexpr (N == 1) {
    f[0] = __ldg(p);
  } else if constexpr (N == 2) {
    const float2 v = __ldg(reinterpret_cast<const float2*>(p));
    f[0] = v.x; f[1] = v.y;
  } else {
#pragma unroll
    for (int h = 0; h < N / 4; ++h) {
      const float4 v = __ldg(reinterpret_cast<const float4*>(p) + h);
      f[4 * h + 0] = v.x; f[4 * h + 1] = v.y; f[4 * h + 2] = v.z; f[4 * h + 3] = v.w;
    }
  }
}

template <int N>
__device__ __forceinline__ void load_vec(const __nv_bfloat16* p, float (&f)[N]) {
  static_assert(N == 1 || N == 2 || N == 4 || N == 8, "N");
  if constexpr (N == 1) {
    f[0] = __bfloat162float(p[0]);
  } else if constexpr (N == 2) {
    const unsigned u = __ldg(reinterpret_cast<const unsigned*>(p));
    f[0] = bf16_lo(u); f[1] = bf16_hi(u);
  } else if constexpr (N == 4) {
    const uint2 u = __ldg(reinterpret_cast<const uint2*>(p));
    f[0] = bf16_lo(u.x); f[1] = bf16_hi(u.x); f[2] = bf16_lo(u.y); f[3] = bf16_hi(u.y);
  } else {
    const uint4 u = __ldg(reinterpret_cast<const uint4*>(p));
    f[0] = bf16_lo(u.x); f[1] = bf16_hi(u.x); f[2] = bf16_lo(u.y); f[3] = bf16_hi(u.y);
    f[4] = bf16_lo(u.z); f[5] = bf16_hi(u.z); f[6] = bf16_lo(u.w); f[7] = bf16_hi(u.w);
  }
}

// 8 E4M3 codes (8-byte aligned) -> their values times `scale`: w32 = e4m3 * scale, each
// product rounded once, as the reference's dequantized weight.
template <int N>
__device__ __forceinline__ void load_vec(const __nv_fp8_e4m3* p, float scale, float (&f)[N]) {
  static_assert(N == 8, "FP8 weights are loaded 8 at a time");
  const uint2 u = __ldg(reinterpret_cast<const uint2*>(p));
  __nv_fp8x4_e4m3 lo, hi;
  lo.__x = u.x;
  hi.__x = u.y;
  const float4 a = static_cast<float4>(lo), b = static_cast<float4>(hi);
  f[0] = a.x * scale; f[1] = a.y * scale; f[2] = a.z * scale; f[3] = a.w * scale;
  f[4] = b.x * scale; f[5] = b.y * scale; f[6] = b.z * scale; f[7] = b.w * scale;
}

// Weight streams: every weight of a GEMV launch is read once, so its loads bypass L1
// allocation (ld.global.nc.L1::no_allocate, through the read-only path) and leave L1 to x,
// which every warp of the block re-reads. The emulator (MTPKERN_CUDA_EMU) has no PTX: a
// plain read-only load, with its alignment check. p: 16-byte (ld_stream16) or 8-byte
// (ld_stream8) aligned.
__device__ __forceinline__ uint4 ld_stream16(const void* p) {
#if defined(MTPKERN_CUDA_EMU)
  return __ldg(reinterpret_cast<const uint4*>(p));
#else
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
#endif
}
__device__ __forceinline__ unsigned ld_stream4(const void* p) {
#if defined(MTPKERN_CUDA_EMU)
  return __ldg(reinterpret_cast<const unsigned*>(p));
#else
  unsigned v;
  asm("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
#endif
}
__device__ __forceinline__ uint2 ld_stream8(const void* p) {
#if defined(MTPKERN_CUDA_EMU)
  return __ldg(reinterpret_cast<const uint2*>(p));
#else
  uint2 v;
  asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
#endif
}

// One weight vector of the GEMV core as loaded (its raw bits), then widened to FP32:
// 16 bytes (4 floats or 8 bf16) or, for FP8, 8 bytes (8 codes, times the block's scale), or
// for FP4 4 bytes (8 codes, times the block's scale).
// The loads of an iteration are all issued before the first is widened, so the raw form
// is what stays in registers while they are in flight (4 or 2 registers per vector).
template <typename W>
struct WVec {
  using Raw = uint4;
  __device__ __forceinline__ static Raw load(const W* p) { return ld_stream16(p); }
};
template <>
struct WVec<__nv_fp8_e4m3> {
  using Raw = uint2;
  __device__ __forceinline__ static Raw load(const __nv_fp8_e4m3* p) { return ld_stream8(p); }
};
template <>
struct WVec<fp4x2_e2m1> {
  using Raw = unsigned;
  __device__ __forceinline__ static Raw load(const fp4x2_e2m1* p) { return ld_stream4(p); }
};
template <>
struct WVec<nvfp4x2_e2m1> {  // the same 8 codes a word as fp4x2_e2m1's: the same widen
  using Raw = unsigned;
  __device__ __forceinline__ static Raw load(const nvfp4x2_e2m1* p) { return ld_stream4(p); }
};

__device__ __forceinline__ void widen(const uint4& u, float /*scale*/, float (&f)[4]) {
  f[0] = __uint_as_float(u.x); f[1] = __uint_as_float(u.y); f[2] = __uint_as_float(u.z); f[3] = __uint_as_float(u.w);
}
__device__ __forceinline__ void widen(const uint4& u, float /*scale*/, float (&f)[8]) {
  f[0] = bf16_lo(u.x); f[1] = bf16_hi(u.x); f[2] = bf16_lo(u.y); f[3] = bf16_hi(u.y);
  f[4] = bf16_lo(u.z); f[5] = bf16_hi(u.z); f[6] = bf16_lo(u.w); f[7] = bf16_hi(u.w);
}
// 8 E4M3 codes -> code * scale, each product rounded once (the reference's FP32 weight).
__device__ __forceinline__ void widen(const uint2& u, float scale, float (&f)[8]) {
  __nv_fp8x4_e4m3 lo, hi;
  lo.__x = u.x;
  hi.__x = u.y;
  const float4 a = static_cast<float4>(lo), b = static_cast<float4>(hi);
  f[0] = a.x * scale; f[1] = a.y * scale; f[2] = a.z * scale; f[3] = a.w * scale;
  f[4] = b.x * scale; f[5] = b.y * scale; f[6] = b.z * scale; f[7] = b.w * scale;
}

// E2M1 decode. |value| of magnitude code m = 0..7 is 0, 0.5, 1, 1.5, 2, 3, 4, 6: 2|value| =
// 0, 1, 2, 3, 4, 6, 8, 12 is one byte of an 8-byte table, looked up for 4 codes at once
// (__byte_perm: prmt, code i of `mag` in bits 4i .. 4i + 2). Byte j of such a lookup put under
// the bits of 2^22 (0x4A800000, whose float spacing is 0.5) reads as 2^22 + |value|, exactly;
// minus 2^22 is |value|, the code's sign bit (bit 3) is ORed in. No subnormal is formed (the
// device flushes them), every step is exact: e2m1(c) * 2^(s - 127) is the dequantized weight.
constexpr unsigned kE2m1Lo = 0x03020100u, kE2m1Hi = 0x0C080604u;  // 2|value| of codes 0..3, 4..7

__device__ __forceinline__ float e2m1_at(unsigned twice, int j, unsigned sign_bit) {
  const float a = __uint_as_float(__byte_perm(twice, 0x4A800000u, 0x7650u | j)) - 4194304.0f;  // 2^22
  return __uint_as_float(__float_as_uint(a) | sign_bit);
}

// 8 E2M1 codes (a 32-bit word of a packed row, code i in bits 4i .. 4i + 3: the low nibble of
// byte j is column 2j) -> e2m1 * scale, each product exact (the reference's FP32 weight).
__device__ __forceinline__ void widen(const unsigned& u, float scale, float (&f)[8]) {
  const unsigned mag = u & 0x77777777u;
  const unsigned t[2] = {__byte_perm(kE2m1Lo, kE2m1Hi, mag), __byte_perm(kE2m1Lo, kE2m1Hi, mag >> 16)};
#pragma unroll
  for (int i = 0; i < 8; ++i) f[i] = e2m1_at(t[i / 4], i % 4, (u << (28 - 4 * i)) & 0x80000000u) * scale;
}

// The scalar path's weight k of a row (with its scales srow).
template <typename W>
__device__ __forceinline__ float weight_at(const W* w, const ScaleT<W>* srow, int k, int bk) {
  if constexpr (Elem<W>::scaled) return to_f32(w[k]) * srow[k / bk];
  else return to_f32(w[k]);
}
__device__ __forceinline__ float weight_at(const fp4x2_e2m1* w, const unsigned char* srow, int k, int bk) {
  const unsigned b = w[k / 2].bits, c = k % 2 ? b >> 4 : b & 15u;
  return e2m1_at(__byte_perm(kE2m1Lo, kE2m1Hi, c & 7u), 0, (c & 8u) << 28) * e8m0(srow[k / bk]);
}
__device__ __forceinline__ float weight_at(const nvfp4x2_e2m1* w, const unsigned char* srow, int k, int bk) {
  const unsigned b = w[k / 2].bits, c = k % 2 ? b >> 4 : b & 15u;
  return e2m1_at(__byte_perm(kE2m1Lo, kE2m1Hi, c & 7u), 0, (c & 8u) << 28) * block_scale<nvfp4x2_e2m1>(srow, k / bk);
}

// Scalar fallback of load_vec: elements at or past `valid` read as 0.
template <int N, typename T>
__device__ __forceinline__ void load_guarded(const T* p, int valid, float (&f)[N]) {
#pragma unroll
  for (int j = 0; j < N; ++j) f[j] = j < valid ? to_f32(p[j]) : 0.0f;
}

// 16-byte store of 4 floats (dst 16-byte aligned).
__device__ __forceinline__ void store4(float* dst, float a, float b, float c, float d) {
  *reinterpret_cast<float4*>(dst) = make_float4(a, b, c, d);
}

__device__ __forceinline__ bool aligned16(const void* p) {
  return (reinterpret_cast<unsigned long long>(p) & 15ull) == 0;
}

// 8 values of a shared-memory row (16-byte aligned) as floats (plain loads: __ldg is global only).
__device__ __forceinline__ void smem8(const float* p, float (&f)[8]) {
  const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
  f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w; f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
}
__device__ __forceinline__ void smem8(const __nv_bfloat16* p, float (&f)[8]) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  f[0] = bf16_lo(u.x); f[1] = bf16_hi(u.x); f[2] = bf16_lo(u.y); f[3] = bf16_hi(u.y);
  f[4] = bf16_lo(u.z); f[5] = bf16_hi(u.z); f[6] = bf16_lo(u.w); f[7] = bf16_hi(u.w);
}

// 8 stored values global -> shared, bit for bit (both 16-byte aligned).
template <typename KV>
__device__ __forceinline__ void copy8(KV* dst, const KV* src) {
  constexpr int N = 8 * sizeof(KV) / 16;  // 16-byte words: 1 for bf16, 2 for fp32
#pragma unroll
  for (int i = 0; i < N; ++i)
    reinterpret_cast<uint4*>(dst)[i] = __ldg(reinterpret_cast<const uint4*>(src) + i);
}

// 8 zero values (16-byte aligned): a staged row that is not read from global memory.
template <typename KV>
__device__ __forceinline__ void zero8(KV* dst) {
  constexpr int N = 8 * sizeof(KV) / 16;
  const uint4 z = {0u, 0u, 0u, 0u};
#pragma unroll
  for (int i = 0; i < N; ++i) reinterpret_cast<uint4*>(dst)[i] = z;
}

// The RoPE rotation of pair i at position pos (rope_kv.cu's formula; mla.cu and dsa.cu):
// (x1, x2) -> (x1 c - x2 s, x2 c + x1 s), c and s of pos * inv_freq times rope_scale.
__device__ __forceinline__ void rope_rotate(float pos, float inv_freq, float rope_scale, float x1, float x2,
                                            float& y1, float& y2) {
  float s, c;
  sincosf(pos * inv_freq, &s, &c);
  c *= rope_scale;
  s *= rope_scale;
  y1 = x1 * c - x2 * s;
  y2 = x2 * c + x1 * s;
}

// ---------------------------------------------------------------------------
// Reductions. warp_*: xor butterfly, every lane ends with the same bits.

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}

// Block-wide sum / max; every thread gets the result. `red` holds >= 33 floats
// of shared memory; the call ends with a barrier, so `red` may be reused.
__device__ __forceinline__ float block_sum(float v, float* red) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int nwarps = blockDim.x / kWarp;
  v = warp_sum(v);
  if (lane == 0) red[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float t = lane < nwarps ? red[lane] : 0.0f;
    t = warp_sum(t);
    if (lane == 0) red[32] = t;
  }
  __syncthreads();
  const float total = red[32];
  __syncthreads();
  return total;
}

__device__ __forceinline__ float block_max(float v, float* red) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int nwarps = blockDim.x / kWarp;
  v = warp_max(v);
  if (lane == 0) red[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float t = lane < nwarps ? red[lane] : neg_inf();
    t = warp_max(t);
    if (lane == 0) red[32] = t;
  }
  __syncthreads();
  const float total = red[32];
  __syncthreads();
  return total;
}

// Integer sums and scans over a warp (xor butterfly: every lane takes part) and a block.
__device__ __forceinline__ int warp_sum_int(int v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

// Inclusive prefix sum over the lanes: at step k a lane holds the total of its aligned group
// of k lanes and adds the lower sibling group's total when it sits in the upper one.
__device__ __forceinline__ int warp_scan_int(int v) {
  const int lane = threadIdx.x % kWarp;
  int sum = v;
#pragma unroll
  for (int k = 1; k < kWarp; k <<= 1) {
    const int other = __shfl_xor_sync(kFullMask, sum, k);
    if (lane & k) v += other;
    sum += other;
  }
  return v;
}

// Block-wide integer sum; every thread gets it. `red` holds >= 33 ints of shared memory;
// the call ends with a barrier, so `red` may be reused.
__device__ __forceinline__ int block_sum_int(int v, int* red) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  v = warp_sum_int(v);
  if (lane == 0) red[warp] = v;
  __syncthreads();
  if (warp == 0) {
    const int t = warp_sum_int(lane < static_cast<int>(blockDim.x / kWarp) ? red[lane] : 0);
    if (lane == 0) red[32] = t;
  }
  __syncthreads();
  const int total = red[32];
  __syncthreads();
  return total;
}

// Block-wide exclusive prefix sum in thread order (the sum of v over threads < threadIdx.x);
// `red` as block_sum_int's, reusable after the call.
__device__ __forceinline__ int block_scan_int(int v, int* red) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int incl = warp_scan_int(v);
  if (lane == kWarp - 1) red[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    const int w = lane < static_cast<int>(blockDim.x / kWarp) ? red[lane] : 0;
    red[lane] = warp_scan_int(w) - w;  // warps before this one
  }
  __syncthreads();
  const int before = red[warp] + incl - v;
  __syncthreads();
  return before;
}

// ---------------------------------------------------------------------------
// GEMV core.
//
// acc[j][r] += dot(w_rows[j][k], x_rows[r][k]) over this thread's share of k:
// thread t of a team of nt threads takes vectors t, t + nt, ... (or, on the scalar
// path, elements t, t + nt, ...). Each weight vector is loaded once and multiplied
// with all NR input rows: for NR = 8 the weight stream is read once for 8 tokens.
//
// NR is a template parameter chosen on the host (the kernels are instantiated per NR),
// so a 1-row launch is compiled for one row and gets the 1-row kernel's registers and
// occupancy. Each iteration issues U = kGemvUnroll<NR> weight vectors per row before
// widening the first: ROWS * U * 16 B per lane in flight, 4 KB per warp for ROWS = 2,
// U = 4 (NR <= 4); 2 KB at NR = 8 (U = 2), whose 16 accumulators and 8 x rows leave no
// room for more. Weights go through ld_stream16 / ld_stream8 (no L1 allocation).
//
// Summation order, fixed (the same bits from the same launch): per thread, vectors in
// ascending k, within a vector its elements in order, one fmaf chain per (j, r). It does
// not depend on NR, so a row's dot product is the same whatever rows share its launch.
//
// FP8 / FP4 weights: s[j] is row j's scales (scale_row), bk the columns per scale; every
// weight is dequantized (code * scale, rounded once: the reference's FP32 weight; exact for
// FP4) before its fmaf. Dense weights ignore s and bk. FP4's w[j] + k / 2 is column k.
//
// vec: the vector path is legal: K % Elem<W>::V == 0, every w/x row start is 16-byte
// aligned (8-byte for FP8, 4-byte for FP4) and, for FP8 / FP4, bk % 8 == 0 (the caller
// checks base pointers, K and bk).
template <int NR>
constexpr int kGemvUnroll = NR >= 4 ? 2 : 4;

// p, through an empty asm the compiler cannot see through: addresses derived from it are
// not loop invariants of an enclosing loop. A GEMV inside a loop over weight rows (the
// LM head's pairs, the experts' pair chunks) passes its x rows through it each time round:
// otherwise the GEMV's per-(row, vector) x addresses are hoisted out of that loop (186
// registers instead of 94 for lm_head_argmax_partial_kernel<bf16, false, 4> on sm_90).
__device__ __forceinline__ const float* opaque(const float* p) {
#if !defined(MTPKERN_CUDA_EMU)
  asm volatile("" : "+l"(p));
#endif
  return p;
}

// One vector step of gemv_dot_impl: the V widened weights wf of each of the ROWS rows at
// column k + off against the V values of each x row there (NORM: times g, their squares into
// ss). The address is (x + k) + off, as the loop wrote it: off a constant multiple of the step,
// so the compiler keeps one pointer per x row (x + (k + off) changed the registers of 130 of
// the kernels' builds).
template <int NR, int ROWS, int V, bool NORM>
__device__ __forceinline__ void gemv_dot_vector(const float (&wf)[ROWS][V], const float* const (&x)[NR], int k,
                                                int off, const float* g, float (&acc)[ROWS][NR], float (&ss)[NR]) {
  float gv[V];
  if constexpr (NORM) load_vec<V>(g + k + off, gv);
#pragma unroll
  for (int r = 0; r < NR; ++r) {
    float xv[V];
    load_vec<V>(x[r] + k + off, xv);
    if constexpr (NORM) {
#pragma unroll
      for (int v = 0; v < V; ++v) { ss[r] = fmaf(xv[v], xv[v], ss[r]); xv[v] *= gv[v]; }
    }
#pragma unroll
    for (int j = 0; j < ROWS; ++j)
#pragma unroll
      for (int v = 0; v < V; ++v) acc[j][r] = fmaf(wf[j][v], xv[v], acc[j][r]);
  }
}

// NORM (gemv_dot_norm): x is the input of an RMSNorm with weight g [K] fused into the GEMV:
// each x element is multiplied by its g as it is loaded, and ss[r] += x^2 over this thread's
// share beside the dot products (x is read anyway: no extra bytes but g's, which L1 holds).
// The caller sums ss over the team and scales the dot products by 1 / sqrt(ss / K + eps).
template <typename W, int NR, int ROWS, bool NORM>
__device__ __forceinline__ void gemv_dot_impl(const W* const (&w)[ROWS], const ScaleT<W>* const (&s)[ROWS], int bk,
                                              const float* const (&x)[NR], int K, int t, int nt, bool vec,
                                              float (&acc)[ROWS][NR], const float* g, float (&ss)[NR]) {
  constexpr int V = Elem<W>::V;  // elements per vector: 8 bf16, 4 fp32 (16 bytes), 8 fp8 (8 bytes) or 8 fp4 (4)
  constexpr int P = Elem<W>::per;  // weights per stored element: column k is at w[j] + k / P
  constexpr int U = kGemvUnroll<NR>;
  using Raw = typename WVec<W>::Raw;
  if (vec) {
    int k = t * V;
    const int step = nt * V;
    // U vectors per row per iteration; then one at a time for the last < U
    for (; k + (U - 1) * step < K; k += U * step) {
      Raw raw[ROWS][U];
#pragma unroll
      for (int j = 0; j < ROWS; ++j) {
        const W* p = w[j] + k / P;  // pointer steps (see below), not w[j] + (k + u * step) / P
#pragma unroll
        for (int u = 0; u < U; ++u, p += step / P) raw[j][u] = WVec<W>::load(p);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        float wf[ROWS][V];
#pragma unroll
        for (int j = 0; j < ROWS; ++j) {
          float sc = 1.0f;
          if constexpr (Elem<W>::scaled) sc = block_scale<W>(s[j], (k + u * step) / bk);
          widen(raw[j][u], sc, wf[j]);
        }
        gemv_dot_vector<NR, ROWS, V, NORM>(wf, x, k, u * step, g, acc, ss);
      }
    }
    for (; k < K; k += step) {
      float wf[ROWS][V];
#pragma unroll
      for (int j = 0; j < ROWS; ++j) {
        float sc = 1.0f;
        if constexpr (Elem<W>::scaled) sc = block_scale<W>(s[j], k / bk);
        widen(WVec<W>::load(w[j] + k / P), sc, wf[j]);
      }
      gemv_dot_vector<NR, ROWS, V, NORM>(wf, x, k, 0, g, acc, ss);
    }
  } else {
    for (int k = t; k < K; k += nt) {
      float wk[ROWS];
#pragma unroll
      for (int j = 0; j < ROWS; ++j) wk[j] = weight_at(w[j], s[j], k, bk);
#pragma unroll
      for (int r = 0; r < NR; ++r) {
        float xk = x[r][k];
        if constexpr (NORM) { ss[r] = fmaf(xk, xk, ss[r]); xk *= g[k]; }
#pragma unroll
        for (int j = 0; j < ROWS; ++j) acc[j][r] = fmaf(wk[j], xk, acc[j][r]);
      }
    }
  }
}

template <typename W, int NR, int ROWS>
__device__ __forceinline__ void gemv_dot(const W* const (&w)[ROWS], const ScaleT<W>* const (&s)[ROWS], int bk,
                                         const float* const (&x)[NR], int K, int t, int nt, bool vec,
                                         float (&acc)[ROWS][NR]) {
  float unused[NR];
  gemv_dot_impl<W, NR, ROWS, false>(w, s, bk, x, K, t, nt, vec, acc, nullptr, unused);
}

// Sum acc over the 32 lanes of the warp; every lane gets the sums.
template <int ROWS, int NR>
__device__ __forceinline__ void warp_sum_all(float (&acc)[ROWS][NR]) {
#pragma unroll
  for (int j = 0; j < ROWS; ++j)
#pragma unroll
    for (int r = 0; r < NR; ++r) acc[j][r] = warp_sum(acc[j][r]);
}

template <int ROWS, int NR>
__device__ __forceinline__ void zero(float (&acc)[ROWS][NR]) {
#pragma unroll
  for (int j = 0; j < ROWS; ++j)
#pragma unroll
    for (int r = 0; r < NR; ++r) acc[j][r] = 0.0f;
}

// The vector path of gemv_dot is legal for weights w [*, K] (scales sc) and inputs x [*, K].
template <typename W>
__device__ __forceinline__ bool gemv_vec_ok(const W* w, const float* x, int K, const Scales& sc) {
  constexpr int V = Elem<W>::V;
  if constexpr (Elem<W>::scaled) {  // 8 (FP8) or 4 (FP4) bytes a vector
    constexpr unsigned long long align = V * sizeof(W) / Elem<W>::per - 1;
    return K % V == 0 && sc.bk % V == 0 && (reinterpret_cast<unsigned long long>(w) & align) == 0 && aligned16(x);
  } else {
    return K % V == 0 && aligned16(w) && aligned16(x);
  }
}

// Row j's scales for gemv_dot (null for dense weights).
template <typename W>
__device__ __forceinline__ const ScaleT<W>* scale_row(const Scales& sc, long long j) {
  if constexpr (Elem<W>::scaled) return static_cast<const ScaleT<W>*>(sc.s) + (j / sc.bn) * sc.ks;
  else return nullptr;
}

// Rows per pass of the GEMV kernels. Each GEMV kernel is instantiated for NR = 1, 2, 4
// and 8, and the launcher takes the smallest NR >= min(n, 8) (its registers set the
// launch's occupancy: a batch-1 launch does not pay for the 8-row path). The kernel
// takes the input rows NR at a time; a last chunk of m <= NR / 2 rows runs the code for
// the smallest power of two >= m (each chunk function hands such a chunk to its NR / 2
// instantiation), rows past m re-reading row m - 1, not stored.
constexpr int kMaxRows = 8;

// ---------------------------------------------------------------------------
// Argmax rule: (v, i) beats (bv, bi) when it is a candidate (i >= 0) and either
// the best is empty, or v is larger, or v is equal and i is lower. NaN values
// are never offered as candidates (callers filter them), so the result does
// not depend on the order in which candidates are combined.
__device__ __forceinline__ bool beats(float v, int i, float bv, int bi) {
  return i >= 0 && (bi < 0 || v > bv || (v == bv && i < bi));
}

// ---------------------------------------------------------------------------
// Sampled drafts' noise (spec: mtpkern/ops/sampling.py; sampling.cu's sample_kernel and
// lm_head.cu's fused draw): g = -log(-log(u)), u in (0, 1) the counter-based hash of the
// row's key and the returned token id, splitmix64's finaliser in wrapping 64-bit integer
// arithmetic, as the reference and the Numba backend compute it.
constexpr unsigned long long kGolden = 0x9E3779B97F4A7C15ull;  // the golden-ratio increment
constexpr unsigned long long kMix1 = 0xBF58476D1CE4E5B9ull;    // the finaliser's multipliers
constexpr unsigned long long kMix2 = 0x94D049BB133111EBull;
constexpr double kTwoPowMinus53 = 1.1102230246251565404236316680908203125e-16;  // 2^-53, exact

__device__ __forceinline__ double token_gumbel(unsigned long long key, int id) {
  unsigned long long x = key + (static_cast<unsigned long long>(static_cast<long long>(id)) + 1ull) * kGolden;
  x = (x ^ (x >> 30)) * kMix1;
  x = (x ^ (x >> 27)) * kMix2;
  x ^= x >> 31;
  const double u = (static_cast<double>(x >> 11) + 0.5) * kTwoPowMinus53;  // in (0, 1)
  return -log(-log(u));
}

// ---------------------------------------------------------------------------
// Row-group GEMV driver (linear.cu, mlp.cu).
//
// Block of kGemvWarps = 4 warps. The output is cut into "row groups" of two
// weight rows each (Epi::rows says which two, e.g. 2u and 2u + 1, or gate row
// u and up row I + u); a block holds 4 / wpr groups and each group is computed
// by wpr warps that split K (wpr in {1, 2, 4}; the launcher raises wpr when
// there are too few groups to fill the GPU). The wpr partial sums of a group
// are added in warp order through shared memory, then Epi::store writes the
// results of the chunk's m input rows.
//
//   group u = blockIdx.x * (4 / wpr) + warp / wpr, K slice = warp % wpr
//
// Epi provides (all __device__ const):
//   bool rows(int u, int& a, int& b)   -> false when group u is past the end
//   template <int NR> void store(int u, int r0, int m, const float (&acc)[2][NR])
//     (called by lane 0 of the group's first warp; acc[j][r] = dot(row j, x[r0 + r]))
constexpr int kGemvWarps = 4;
constexpr int kGemvThreads = kGemvWarps * kWarp;

// The epilogue of a plain GEMV (linear.cu's linear_kernel, moe.cu's router logits):
// y = acc + bias + residual, in the reference's order ((x w^T + bias) + residual).
struct LinearEpi {
  const float* bias;      // [N] or null
  const float* residual;  // [n, N] or null
  float* y;               // [n, N]
  int N;

  __device__ bool rows(int u, int& a, int& b) const {
    a = 2 * u;
    b = min(a + 1, N - 1);  // the last group of an odd N reads row N - 1 twice, stores it once
    return a < N;
  }

  template <int NR>
  __device__ void store(int u, int r0, int m, const float (&acc)[2][NR]) const {
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      if (r >= m) break;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int o = 2 * u + j;
        if (o >= N) break;
        const long long at = static_cast<long long>(r0 + r) * N + o;
        float v = acc[j][r];
        if (bias) v += bias[o];
        if (residual) v += residual[at];
        y[at] = v;
      }
    }
  }
};

// The fused RMSNorm of gemv_groups (NORM): g [K] its weight, eps; rows of x are normalised.
struct RowNorm {
  const float* g;
  float eps;
};

template <typename W, int NR, bool NORM, typename Epi>
__device__ __forceinline__ void gemv_groups_chunk(const float* x, const W* w, const Scales& sc, int r0, int m,
                                                  int K, int wpr, bool vec, const Epi& epi, const RowNorm& nm,
                                                  float (&red)[kGemvWarps][3 * kMaxRows]) {
  if constexpr (NR > 1) {
    if (m <= NR / 2) {  // uniform over the block: the smaller instantiation's barriers match
      gemv_groups_chunk<W, NR / 2, NORM>(x, w, sc, r0, m, K, wpr, vec, epi, nm, red);
      return;
    }
  }
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int u = blockIdx.x * (kGemvWarps / wpr) + warp / wpr;
  const int sub = warp % wpr;
  int a = 0, b = 0;
  const bool active = epi.rows(u, a, b);
  float acc[2][NR], ss[NR];
  zero(acc);
#pragma unroll
  for (int r = 0; r < NR; ++r) ss[r] = 0.0f;
  if (active) {
    const W* const wr[2] = {weight_row(w, a, K), weight_row(w, b, K)};
    const ScaleT<W>* const sr[2] = {scale_row<W>(sc, a), scale_row<W>(sc, b)};
    const float* xr[NR];
#pragma unroll
    for (int r = 0; r < NR; ++r) xr[r] = x + static_cast<long long>(r0 + min(r, m - 1)) * K;
    gemv_dot_impl<W, NR, 2, NORM>(wr, sr, sc.bk, xr, K, sub * kWarp + lane, wpr * kWarp, vec, acc, nm.g, ss);
  }
  warp_sum_all(acc);
  if constexpr (NORM) {
#pragma unroll
    for (int r = 0; r < NR; ++r) ss[r] = warp_sum(ss[r]);
  }
  if (wpr > 1) {  // uniform over the block
    if (lane == 0) {
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int r = 0; r < NR; ++r) red[warp][j * NR + r] = acc[j][r];
      if constexpr (NORM) {
#pragma unroll
        for (int r = 0; r < NR; ++r) red[warp][2 * NR + r] = ss[r];
      }
    }
    __syncthreads();
    if (sub == 0) {
      for (int q = 1; q < wpr; ++q) {
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
          for (int r = 0; r < NR; ++r) acc[j][r] += red[warp + q][j * NR + r];
        if constexpr (NORM) {
#pragma unroll
          for (int r = 0; r < NR; ++r) ss[r] += red[warp + q][2 * NR + r];
        }
      }
    }
    __syncthreads();  // red is rewritten by the next chunk
  }
  if (active && sub == 0 && lane == 0) {
    if constexpr (NORM) {  // y = (W (x * g)) / sqrt(mean(x^2) + eps), as rmsnorm's x / denom * g
#pragma unroll
      for (int r = 0; r < NR; ++r) {
        const float denom = sqrtf(ss[r] / static_cast<float>(K) + nm.eps);
        acc[0][r] /= denom;
        acc[1][r] /= denom;
      }
    }
    epi.template store<NR>(u, r0, m, acc);
  }
}

// The GEMV of all n input rows, NR at a time (NR: the kernel's instantiation); NORM: each
// row of x normalised by the RMSNorm nm on the fly (gemv_dot_impl).
template <typename W, int NR, bool NORM, typename Epi>
__device__ __forceinline__ void gemv_groups(const float* x, const W* w, const Scales& sc, int n, int K, int wpr,
                                            const Epi& epi, const RowNorm& nm) {
  __shared__ float red[kGemvWarps][3 * kMaxRows];
  const bool vec = gemv_vec_ok(w, x, K, sc) && (!NORM || aligned16(nm.g));
  for (int r0 = 0; r0 < n; r0 += NR) {
    const int m = min(NR, n - r0);
    gemv_groups_chunk<W, NR, NORM>(x, w, sc, r0, m, K, wpr, vec, epi, nm, red);
  }
}

__device__ __forceinline__ float silu(float g) { return g / (1.0f + expf(-g)); }

// The SwiGLU activation with its clamps (mtpkern.ops.mlp.swiglu_bounds): L on silu(g), the
// clamp of Step-3.5 / 3.7 (Hugging Face Step3p7MLP), Lg on g before silu, DeepSeek-V4's
// (DeepseekV4MLP), and u clipped by Lu = min(L, Lg), the one of them in use:
// min(silu(min(g, Lg)), L) * min(max(u, -Lu), Lu). A bound of +inf clamps nothing, bit for
// bit, so the kernels take both always (no template, no branch). Comparisons, not fminf /
// fmaxf: those return the other operand for a NaN, and a NaN must stay NaN as in the
// reference (L and Lg are never NaN: fminf is safe for Lu). |u| > Lu ? copysign(Lu, u) : u
// is the same clip of u (-0 and NaN kept); written as u > L ? L : (u < -L ? -L : u) it left
// moe_expert_kernel<float, true> spilling on sm_90.
__device__ __forceinline__ float swiglu(float g, float u, float L, float Lg) {
  const float a = silu(g > Lg ? Lg : g);
  const float Lu = fminf(L, Lg);
  return (a > L ? L : a) * (fabsf(u) > Lu ? copysignf(Lu, u) : u);
}

// Kimi K3's gated SituAndMul (mtpkern.ops.mlp.situ_act): beta tanh(g / beta) sigmoid(g) u', with
// u' = lb tanh(u / lb) for a linear beta lb > 0, else u; sigmoid as silu's 1 / (1 + expf(-g))
// (g < -88: expf overflows to inf, sigmoid 0, as the reference). FP32; a NaN stays NaN.
__device__ __forceinline__ float situ(float g, float u, float beta, float lb) {
  const float up = lb > 0.0f ? lb * tanhf(u / lb) : u;
  return beta * tanhf(g / beta) * (1.0f / (1.0f + expf(-g))) * up;
}

// The gated activation of every gate/up kernel (mlp.cu, moe.cu, gemm_tc.cu): SITU (a template
// parameter of theirs) picks SiTU with (p0, p1) = (beta, linear beta), else SwiGLU with its
// clamps (p0, p1) = (L, Lg) (mtpkern.ops.mlp.act_params gives both pairs).
template <bool SITU>
__device__ __forceinline__ float gated_act(float g, float u, float p0, float p1) {
  if constexpr (SITU) {
    return situ(g, u, p0, p1);
  } else {
    return swiglu(g, u, p0, p1);
  }
}

// Nemotron-H's non-gated activation (mtpkern.ops.mlp.relu2): relu(u)^2, a NaN kept (as
// np.maximum), written as a comparison for the same reason as swiglu's clamps.
__device__ __forceinline__ float relu2(float u) {
  const float r = (u > 0.0f || u != u) ? u : 0.0f;
  return r * r;
}

}  // namespace mtp
