// cuda_fp8.h for the CPU emulator of mtpkern's kernels: the E4M3 types the kernels use
// (__nv_fp8_e4m3, __nv_fp8x4_e4m3) and their widening to float / float4. Written from the
// format's definition (sign, 4 exponent bits with bias 7, 3 mantissa bits; exponent 0 is
// subnormal, m * 2^-9; 0x7F / 0xFF are NaN, there is no infinity), not from NVIDIA's
// header, so the kernels are checked against an independent conversion.
#pragma once
#include "emu_cuda.h"

namespace emu {
inline float e4m3_to_float(unsigned char b) {
  const unsigned e = (b >> 3) & 0xFu, m = b & 7u;
  if (e == 0xFu && m == 7u) return std::nanf("");
  const float mag = e == 0 ? std::ldexp(static_cast<float>(m), -9)
                           : std::ldexp(1.0f + static_cast<float>(m) / 8.0f, static_cast<int>(e) - 7);
  return (b & 0x80u) ? -mag : mag;
}
}  // namespace emu

struct __nv_fp8_e4m3 {
  unsigned char __x;
  explicit operator float() const { return emu::e4m3_to_float(__x); }
};

struct __nv_fp8x4_e4m3 {
  unsigned int __x;  // element 0 in the low byte
  explicit operator float4() const {
    return float4{emu::e4m3_to_float(__x & 0xFFu), emu::e4m3_to_float((__x >> 8) & 0xFFu),
                  emu::e4m3_to_float((__x >> 16) & 0xFFu), emu::e4m3_to_float(__x >> 24)};
  }
};
