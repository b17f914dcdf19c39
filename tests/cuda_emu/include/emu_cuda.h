// emu_cuda.h -- the subset of CUDA C++ that mtpkern's kernels (kernels/*.cu) use,
// for running those exact sources on the CPU (compiled by g++, launched from Python
// by tests/cuda_emu/emu_backend.py; scheduler in emu_runtime.cpp).
//
// Emulated:
// - __global__ / __device__ functions, threadIdx / blockIdx / blockDim / gridDim
//   (1-D blocks, 3-D grids). Every thread of a block is a fiber with its own stack;
//   blocks run one after another, in grid order or reversed / shuffled
//   (emu_set_order), and so do the threads between two synchronisation points.
// - __syncthreads / __syncthreads_or / __syncthreads_count: wait for every thread of the block that has
//   not exited. A thread left waiting forever (a barrier some threads skip while
//   others wait at a warp collective) is reported as a deadlock.
// - __shfl_xor_sync / __ballot_sync: all 32 lanes of the warp must reach a
//   collective of the same kind with the full mask; an exited lane, or one waiting
//   at __syncthreads instead, is an error (real hardware would hang or read junk).
// - tensor cores: no PTX runs here. kernels/mma.cuh's mma_m16n8k16_bf16 has an emulated
//   body (under MTPKERN_CUDA_EMU, defined below) that gathers the 32 lanes' fragments
//   with emu::warp_gather, a warp collective of its own (the same all-lanes rule as a
//   shuffle: mma.sync.aligned needs every lane of the warp), and computes the product
//   from the PTX ISA's fragment layout.
// - shared memory: `__shared__` variables and the dynamic `extern __shared__`
//   array read as 0xff bytes (NaN / -1) until written in each block; static plus
//   dynamic shared memory is limited to 48 KiB (no opt-in attribute emulated).
// - __ldg and the 16-byte vector types check their alignment, as the hardware
//   traps on a misaligned vector access (ordinary dereferences of float4* etc. are
//   checked by UBSan's alignment check, always on).
// - BF16 storage (__nv_bfloat16): widening is exact; narrowing rounds to nearest
//   even, NaN stays NaN (as __float2bfloat16_rn and ml_dtypes).
// - FP8 E4M3 weights (__nv_fp8_e4m3, __nv_fp8x4_e4m3 in cuda_fp8.h): widening to
//   float / float4, exact (the only FP8 operations the kernels use). FP4 weights are decoded
//   by common.cuh itself, with __byte_perm (prmt's default mode) emulated below.
//
// Not emulated (what only a GPU run checks):
// - timing, occupancy, register pressure, launch-bounds enforcement, L1/L2 caches,
//   memory bandwidth;
// - the real memory model: threads of a block interleave only at barriers and warp
//   collectives (never between two plain loads / stores), so a race between
//   threads that the hardware would expose may go unnoticed unless the thread
//   order changes the result (run with reversed / shuffled order to shake them);
//   blocks never run concurrently, so an atomic is a plain read-modify-write and
//   __threadfence orders nothing (both below): a kernel that leaves out a fence it needs
//   is not caught here; no async copies (cp.async, TMA), cooperative groups, inline PTX
//   (the one mma is emulated: above), streams or events;
// - independent thread scheduling inside a warp (lanes run one after another
//   between collectives);
// - floating point details of the device: CuPy compiles with -ftz=true (denormals
//   flushed) and the device's expf / sqrtf / sincosf differ from glibc's in the
//   last bits, so results agree with a GPU within tolerance, not bit for bit;
// - NVRTC itself: a kernel that compiles here may not compile for the device
//   (tests/test_cuda_compile.py checks that).
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>

// The kernels' headers test this to swap a body of inline PTX for its emulation (mma.cuh).
#define MTPKERN_CUDA_EMU 1

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict
// Function-scope `__shared__ T name[..];` is rewritten by emu_backend.py into a static
// plus a per-block poisoning call (EMU_SHARED); `extern __shared__ T name[];` into a
// pointer to the block's dynamic shared memory.

struct uint3 { unsigned x, y, z; };
struct dim3 {
  unsigned x, y, z;
  dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
inline float4 make_float4(float a, float b, float c, float d) { return float4{a, b, c, d}; }

struct __nv_bfloat16 { uint16_t bits; };
struct __nv_fp8_e4m3;  // cuda_fp8.h
struct fp4x2_e2m1;     // kernels/common.cuh: two FP4 E2M1 weights a byte
struct nvfp4x2_e2m1;   // kernels/common.cuh: the same, NVFP4's (E4M3 scales, a row scale)

namespace emu {
enum Collective { kShflXor = 1, kBallot = 2, kGather = 3 };
extern uint3 g_block_idx;
extern dim3 g_block_dim, g_grid_dim;
[[noreturn]] void fail(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
const uint3& thread_idx();
uint32_t warp_collective(int kind, uint32_t value, uint32_t arg);
// All-gather across the warp: every lane gives n words (`mine`) and receives the n words of
// every lane, lane-major (`all[32 * n]`: lane l's words at all + l * n). Every lane must
// pass the same n.
void warp_gather(const uint32_t* mine, int n, uint32_t* all);
int block_barrier(int predicate);
void* dynamic_shared();
void shared_declared(void* p, size_t bytes, const char* name);
inline void check_align(const void* p, size_t a, const char* what) {
  if (reinterpret_cast<uintptr_t>(p) % a) fail("misaligned %s at %p (needs %zu-byte alignment)", what, p, a);
}
}  // namespace emu

#define EMU_SHARED(name) emu::shared_declared(&(name), sizeof(name), #name)

#define threadIdx (emu::thread_idx())
#define blockIdx (emu::g_block_idx)
#define blockDim (emu::g_block_dim)
#define gridDim (emu::g_grid_dim)

inline void __syncthreads() { emu::block_barrier(0); }
inline int __syncthreads_or(int p) { return emu::block_barrier(p != 0) != 0; }
inline int __syncthreads_count(int p) { return emu::block_barrier(p != 0); }

template <typename T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask) {
  static_assert(sizeof(T) == 4, "only 32-bit shuffles are emulated");
  if (mask != 0xffffffffu) emu::fail("__shfl_xor_sync with mask %08x (only full warps are emulated)", mask);
  uint32_t u;
  std::memcpy(&u, &v, 4);
  const uint32_t r = emu::warp_collective(emu::kShflXor, u, static_cast<uint32_t>(lane_mask));
  T out;
  std::memcpy(&out, &r, 4);
  return out;
}
inline unsigned __ballot_sync(unsigned mask, int pred) {
  if (mask != 0xffffffffu) emu::fail("__ballot_sync with mask %08x (only full warps are emulated)", mask);
  return emu::warp_collective(emu::kBallot, pred != 0, 0);
}
inline int __popc(unsigned u) { return __builtin_popcount(u); }
inline int __ffs(unsigned u) { return __builtin_ffs(static_cast<int>(u)); }
// prmt's default mode: byte n of the result is byte (s >> 4n) & 7 of the 8 bytes y:x (x's low
// byte is byte 0).
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const unsigned long long b = (static_cast<unsigned long long>(y) << 32) | x;
  unsigned r = 0;
  for (int n = 0; n < 4; ++n) r |= static_cast<unsigned>((b >> (8 * ((s >> (4 * n)) & 7u))) & 0xFFu) << (8 * n);
  return r;
}

// IEEE double multiply, never fused (the kernels use it to keep a product out of an FMA)
inline double __dmul_rn(double a, double b) { return a * b; }

inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned i) { float f; std::memcpy(&f, &i, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned i; std::memcpy(&i, &f, 4); return i; }

inline float __bfloat162float(__nv_bfloat16 b) { return __uint_as_float(static_cast<unsigned>(b.bits) << 16); }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 b) { return b.bits; }
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  unsigned u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return __nv_bfloat16{static_cast<uint16_t>((u >> 16) | 0x40)};  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return __nv_bfloat16{static_cast<uint16_t>(u >> 16)};
}

inline float __ldg(const float* p) { emu::check_align(p, 4, "__ldg(float)"); return *p; }
inline float2 __ldg(const float2* p) { emu::check_align(p, 8, "__ldg(float2)"); return *p; }
inline float4 __ldg(const float4* p) { emu::check_align(p, 16, "__ldg(float4)"); return *p; }
inline unsigned __ldg(const unsigned* p) { emu::check_align(p, 4, "__ldg(unsigned)"); return *p; }
inline uint2 __ldg(const uint2* p) { emu::check_align(p, 8, "__ldg(uint2)"); return *p; }
inline uint4 __ldg(const uint4* p) { emu::check_align(p, 16, "__ldg(uint4)"); return *p; }
// __ldcg (a load cached in L2 only: what another block wrote this launch): a plain load here
inline float __ldcg(const float* p) { emu::check_align(p, 4, "__ldcg(float)"); return *p; }

// Atomics and the fence, for the last-block pattern (each block writes its result, fences,
// takes a ticket; the block with the last ticket combines them): blocks run one after
// another and threads interleave only at barriers and collectives, so each atomic is a
// read-modify-write nothing can interrupt, returning the old value as CUDA's do.
inline int atomicAdd(int* p, int v) { const int old = *p; *p = old + v; return old; }
inline unsigned atomicAdd(unsigned* p, unsigned v) { const unsigned old = *p; *p = old + v; return old; }
inline float atomicAdd(float* p, float v) { const float old = *p; *p = old + v; return old; }
inline unsigned atomicInc(unsigned* p, unsigned limit) {  // old >= limit ? 0 : old + 1, as CUDA's
  const unsigned old = *p;
  *p = old >= limit ? 0u : old + 1u;
  return old;
}
inline int atomicExch(int* p, int v) { const int old = *p; *p = v; return old; }
inline int atomicCAS(int* p, int compare, int v) { const int old = *p; if (old == compare) *p = v; return old; }
inline void __threadfence() {}

// CUDA's integer min / max overloads (the kernels call them unqualified).
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
using std::isnan;

namespace emu {
using Body = void (*)(void* kernel, void** args);
// Runs `body(kernel, args)` as every thread of every block of the grid; 0 on success,
// else the error is in emu_last_error().
int run_grid(const char* name, dim3 grid, dim3 block, size_t dynamic_smem, Body body, void* kernel,
             void** args);

template <typename... A, std::size_t... I>
void call_kernel(void (*k)(A...), void** args, std::index_sequence<I...>) {
  k(*static_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(args[I])...);
}
template <typename... A>
void body(void* kernel, void** args) {
  call_kernel(reinterpret_cast<void (*)(A...)>(kernel), args, std::index_sequence_for<A...>{});
}
// args[i] points at the value of the kernel's i-th parameter (as cuLaunchKernel's kernelParams).
template <typename... A>
int launch(const char* name, void (*k)(A...), dim3 grid, dim3 block, size_t dynamic_smem, void** args) {
  return run_grid(name, grid, block, dynamic_smem, &body<A...>, reinterpret_cast<void*>(k), args);
}

// Parameter types of a kernel, for the launch-argument check of emu_backend.py:
// "int32", "float32", ... and "*float32", "*bfloat16", ... for pointers.
template <typename T>
inline std::string type_code() {
  using U = std::remove_cv_t<T>;
  if constexpr (std::is_pointer_v<U>) return "*" + type_code<std::remove_pointer_t<U>>();
  else if constexpr (std::is_same_v<U, float>) return "float32";
  else if constexpr (std::is_same_v<U, double>) return "float64";
  else if constexpr (std::is_same_v<U, int>) return "int32";
  else if constexpr (std::is_same_v<U, unsigned>) return "uint32";
  else if constexpr (std::is_same_v<U, long long> || std::is_same_v<U, long>) return "int64";
  else if constexpr (std::is_same_v<U, unsigned long long> || std::is_same_v<U, unsigned long>) return "uint64";
  else if constexpr (std::is_same_v<U, __nv_bfloat16>) return "bfloat16";
  else if constexpr (std::is_same_v<U, __nv_fp8_e4m3>) return "fp8e4m3";
  else if constexpr (std::is_same_v<U, fp4x2_e2m1>) return "fp4x2e2m1";
  else if constexpr (std::is_same_v<U, nvfp4x2_e2m1>) return "nvfp4x2e2m1";
  else if constexpr (std::is_same_v<U, unsigned char>) return "uint8";
  else static_assert(sizeof(U) == 0, "a kernel parameter type the emulator does not know");
}
template <typename... A>
const char* signature(void (*)(A...)) {
  static const std::string s = [] {
    std::string out;
    ((out += (out.empty() ? "" : ",") + type_code<A>()), ...);
    return out;
  }();
  return s.c_str();
}
}  // namespace emu
