// rope_kv.cu -- per-head q/k RMSNorm, partial RoPE (neox or interleaved), paged KV write, in one pass;
// and the rotation alone of every head of an [n, heads, D] array (rope_heads_kernel).
//
// qk_norm_rope_kv_write_kernel<KV, Interleave, VIsK>:
//   qkv [n, ld] fp32, ld >= (Hq + Hkv) * D + Hkv * Dv: Hq query heads and Hkv key heads
//   of D, then Hkv value heads of Dv; columns past them (a gate projection stacked after
//   q | k | v) are not read. VIsK (DeepSeek-V4's shared KV): no value heads, ld >= (Hq + Hkv) * D
//   q_out [n, Hq, D] fp32 = rope(rmsnorm(q, q_norm_w))
//   k_cache[slot, hk, :] = KV(rope(rmsnorm(k, k_norm_w)))     k_cache [NB, BS, Hkv, D] in KV
//   v_cache[slot, hk, :] = KV(v)                               v_cache [NB, BS, Hkv, Dv] in KV
//   KV = __nv_fp8_e4m3 (an FP8 KV cache, mtpkern.ops.kv_fp8; not with VIsK): each K / V row of a
//   head as E4M3 codes of value / scale, scale = amax / 448 of the row into k_scale / v_scale
//   [NB, BS, Hkv] at (slot, hk) (null for the other KV types); the warp takes the row's amax
//   (warp_max), then computes the values again and writes the codes (e4m3_div: the exact quotient
//   rounded once, as the reference's float64 one)
//                          (VIsK: the same KV(rope(rmsnorm(k))) as k_cache, Dv == D)
//                                                              (slot = block * BS + offset)
//
// RoPE (first R = 2 * half dims): pair i is (x1, x2) = (x[i], x[i + half]) (neox halves) or,
// with Interleave, (x[2i], x[2i + 1]) (GPT-J order: DeepSeek-V3 / GLM-4.7-Flash
// rope_interleave); f = float(pos) * inv_freq[i], c = rope_scale * cos f, s = rope_scale * sin f:
// x1' = x1 c - x2 s, x2' = x2 c + x1 s; dims R..D pass through unscaled. rope_scale is YaRN's
// attention factor (1 for the default RoPE). sincosf is the accurate one (no fast math).
//
// Mapping: one warp per (row, head) over all Hq + 2 Hkv heads of the row (VIsK: Hq + Hkv, the
//   key's warp writing both caches).
//   grid (ceil(heads / 4), n), block 128 = 4 warps.
//   Lanes stride over the head's D (value heads: Dv) elements: a warp-sum of squares gives the
//   norm, then lane i rotates pair i, i = lane, lane + 32, ... (Interleave, VIsK: template
//   parameters, so the neox kernel is the one it was)
//   The head (D * 4 B) is re-read from L1 for the second pass.
//
// Preconditions: blockDim.x == 128; 1 <= half <= D / 2; q_norm_w / k_norm_w
// may be null (no norm). A slot outside [0, num_slots) (e.g. -1 padding) skips
// that row's K/V write; q is still produced.
//
// rope_heads_kernel<Interleave, Inverse>:
//   x, out [n, heads, D] fp32 (disjoint): the first R = 2 * half dims of every head rotated as
//   above (Inverse: by the opposite angle, x1' = x1 c + x2 s, x2' = x2 c - x1 s: DeepSeek-V4
//   turns its attention output's rotary dims back to the query's frame), dims R..D copied.
//   Mapping as above: one warp per (row, head), grid (ceil(heads / 4), n), block 128; lane i
//   rotates pair i, i + 32, ...; the copy is coalesced over lanes.
//   Preconditions: blockDim.x == 128; 1 <= half <= D / 2.
#include "common.cuh"

namespace mtp {
constexpr int kRopeWarps = 4;
}

// One warp over a head: lane i rotates pair i, i + 32, .. of the first 2 half dims (neox halves, or
// pairs (2i, 2i + 1) with Interleave) and passes the rest; each value v of dim d goes to put(d, v) once.
template <bool Interleave, typename Normed, typename Put>
__device__ __forceinline__ void rope_head(int lane, int half, int D, float pos, const float* __restrict__ inv_freq,
                                          float rope_scale, Normed normed, Put put) {
  for (int i = lane; i < half; i += mtp::kWarp) {
    const int a = Interleave ? 2 * i : i, b = Interleave ? 2 * i + 1 : i + half;  // the pair's dims
    const float x1 = normed(a), x2 = normed(b);
    float s, c;
    sincosf(pos * inv_freq[i], &s, &c);
    c *= rope_scale;
    s *= rope_scale;
    put(a, x1 * c - x2 * s);
    put(b, x2 * c + x1 * s);
  }
  for (int d = 2 * half + lane; d < D; d += mtp::kWarp) put(d, normed(d));
}

// FP8 KV (mtpkern.ops.kv_fp8): the code of value v under its row's scale (0: the row is all zeros).
__device__ __forceinline__ unsigned char fp8_code(float v, float scale) {
  return scale == 0.0f ? 0 : mtp::e4m3_div(v, scale);
}

// One warp: the n values value(d) of a row into E4M3 codes at dst and their scale amax / 448 at *scale.
template <typename F>
__device__ __forceinline__ void fp8_row(int n, F value, __nv_fp8_e4m3* dst, float* scale, int lane) {
  float amax = 0.0f;
  for (int d = lane; d < n; d += mtp::kWarp) amax = fmaxf(amax, fabsf(value(d)));
  const float s = mtp::warp_max(amax) / 448.0f;
  if (lane == 0) *scale = s;
  for (int d = lane; d < n; d += mtp::kWarp) dst[d].__x = fp8_code(value(d), s);
}

template <typename KV, bool Interleave, bool VIsK>
__global__ void __launch_bounds__(mtp::kRopeWarps * mtp::kWarp)
qk_norm_rope_kv_write_kernel(const float* __restrict__ qkv, int ld, const float* __restrict__ q_norm_w,
                             const float* __restrict__ k_norm_w, float eps,
                             const float* __restrict__ inv_freq, int half, float rope_scale,
                             const int* __restrict__ positions, KV* __restrict__ k_cache,
                             KV* __restrict__ v_cache, const int* __restrict__ slots,
                             long long num_slots, float* __restrict__ q_out, int Hq, int Hkv, int D,
                             int Dv, float* __restrict__ k_scale, float* __restrict__ v_scale) {
  constexpr bool kFp8 = mtp::kv_fp8<KV>;  // codes + a scale per (row, KV head)
  static_assert(!(kFp8 && VIsK), "an FP8 KV cache does not take DeepSeek-V4's shared KV");
  const int warp = threadIdx.x / mtp::kWarp, lane = threadIdx.x % mtp::kWarp;
  const int h = blockIdx.x * mtp::kRopeWarps + warp;  // head of the row: q, then k, then v
  const long long r = blockIdx.y;
  const int heads = Hq + (VIsK ? 1 : 2) * Hkv;
  if (h >= heads) return;  // no barriers in this kernel
  // q and k heads are D wide, the value heads after them Dv
  const float* src = qkv + r * ld + (h < Hq + Hkv ? h * D : (Hq + Hkv) * D + (h - Hq - Hkv) * Dv);

  // destination
  const bool is_q = h < Hq, is_k = !is_q && h < Hq + Hkv;
  float* qdst = nullptr;
  KV* kvdst = nullptr;  // VIsK: the key's value row is at the same offset of v_cache
  if (is_q) {
    qdst = q_out + (r * Hq + h) * D;
  } else {
    const long long slot = slots[r];
    if (slot < 0 || slot >= num_slots) return;
    const int hk = is_k ? h - Hq : h - Hq - Hkv;
    kvdst = is_k ? k_cache + (slot * Hkv + hk) * D : v_cache + (slot * Hkv + hk) * Dv;
  }

  if (!is_q && !is_k) {  // v: convert and store
    if constexpr (kFp8) {
      fp8_row(Dv, [&](int d) { return src[d]; }, kvdst, v_scale + (kvdst - v_cache) / Dv, lane);
    } else {
      for (int d = lane; d < Dv; d += mtp::kWarp) kvdst[d] = mtp::from_f32<KV>(src[d]);
    }
    return;
  }

  // RMSNorm of the head (as the reference: x / sqrt(mean(x^2) + eps) * w)
  const float* nw = is_q ? q_norm_w : k_norm_w;
  float denom = 1.0f;
  if (nw) {
    float ss = 0.0f;
    for (int d = lane; d < D; d += mtp::kWarp) ss = fmaf(src[d], src[d], ss);
    ss = mtp::warp_sum(ss);
    denom = sqrtf(ss / static_cast<float>(D) + eps);
  }
  auto normed = [&](int d) { return nw ? src[d] / denom * nw[d] : src[d]; };
  const float pos = static_cast<float>(positions[r]);
  if constexpr (kFp8) {
    if (!is_q) {  // the key: its amax first, then the codes (the values computed again: the same bits)
      float amax = 0.0f;
      rope_head<Interleave>(lane, half, D, pos, inv_freq, rope_scale, normed,
                            [&](int, float v) { amax = fmaxf(amax, fabsf(v)); });
      const float scale = mtp::warp_max(amax) / 448.0f;
      if (lane == 0) k_scale[(kvdst - k_cache) / D] = scale;
      rope_head<Interleave>(lane, half, D, pos, inv_freq, rope_scale, normed,
                            [&](int d, float v) { kvdst[d].__x = fp8_code(v, scale); });
      return;
    }
  }
  rope_head<Interleave>(lane, half, D, pos, inv_freq, rope_scale, normed, [&](int d, float v) {
    if (is_q) {
      qdst[d] = v;
    } else if constexpr (!kFp8) {
      const KV kv = mtp::from_f32<KV>(v);
      kvdst[d] = kv;
      if (VIsK) v_cache[(kvdst - k_cache) + d] = kv;
    }
  });
}

template <bool Interleave, bool Inverse>
__global__ void __launch_bounds__(mtp::kRopeWarps * mtp::kWarp)
rope_heads_kernel(const float* __restrict__ x, const float* __restrict__ inv_freq, int half, float rope_scale,
                  const int* __restrict__ positions, float* __restrict__ out, int heads, int D) {
  const int warp = threadIdx.x / mtp::kWarp, lane = threadIdx.x % mtp::kWarp;
  const int h = blockIdx.x * mtp::kRopeWarps + warp;
  const long long r = blockIdx.y;
  if (h >= heads) return;  // no barriers in this kernel
  const float* src = x + (r * heads + h) * D;
  float* dst = out + (r * heads + h) * D;
  const float pos = static_cast<float>(positions[r]);
  for (int i = lane; i < half; i += mtp::kWarp) {
    const int a = Interleave ? 2 * i : i, b = Interleave ? 2 * i + 1 : i + half;  // the pair's dims
    const float x1 = src[a], x2 = src[b];
    float s, c;
    sincosf(pos * inv_freq[i], &s, &c);
    c *= rope_scale;
    s *= rope_scale;
    if (Inverse) s = -s;  // x1 c - x2 (-s) == x1 c + x2 s, bit for bit
    dst[a] = x1 * c - x2 * s;
    dst[b] = x2 * c + x1 * s;
  }
  for (int d = 2 * half + lane; d < D; d += mtp::kWarp) dst[d] = src[d];
}
