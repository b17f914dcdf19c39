// selftest.cu -- kernels that exercise the CUDA emulator itself (tests/test_cuda_emulated.py,
// test_emulator_*): the collectives and barriers compute what CUDA does, and each check
// the emulator claims (include/emu_cuda.h) fires on a kernel that breaks it. Compiled into
// the emulator library only (never for a GPU); entries emu_selftest_<name>.
#include "common.cuh"
#include "mma.cuh"

using mtp::kFullMask;

// out[t] = warp_sum(t), out[n + t] = ballot(t % 3 == 0) of t's warp, out[2n + t] =
// __syncthreads_or(t == flag), out[3n + t] = the block's linear index.
__global__ void collectives_kernel(int* out, int flag) {
  const int t = threadIdx.x, n = blockDim.x;
  const long long base = 4LL * n * (blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z));
  float v = static_cast<float>(t);
  v = mtp::warp_sum(v);
  out[base + t] = static_cast<int>(v);
  out[base + n + t] = static_cast<int>(__ballot_sync(kFullMask, t % 3 == 0));
  out[base + 2 * n + t] = __syncthreads_or(t == flag);
  out[base + 3 * n + t] = static_cast<int>(blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z));
}

// Unwritten shared memory: out[0] = a static __shared__ float, out[1] = dynamic shared
// memory, both read before any write (the emulator fills them with 0xff bytes: NaN).
__global__ void shared_unwritten_kernel(float* out) {
  __shared__ float s[4];
  extern __shared__ float dyn[];
  if (threadIdx.x == 0) { out[0] = s[1]; out[1] = dyn[0]; }
  __syncthreads();
  s[threadIdx.x % 4] = 1.0f;
}

// Every thread stores its index to out[0] with no synchronisation: the last writer
// wins, so the result depends on the thread order (a race the order options expose).
__global__ void racy_store_kernel(int* out) { out[0] = threadIdx.x; }

// Lanes 0..15 reduce over the warp, lanes 16..31 have exited: a deadlock on a GPU.
__global__ void partial_warp_shuffle_kernel(float* out) {
  if (threadIdx.x % 32 >= 16) return;
  out[threadIdx.x] = mtp::warp_sum(1.0f);
}

// Lanes 0..15 issue a tensor-core mma (mma.sync.aligned: the whole warp), lanes 16..31 have exited.
__global__ void partial_warp_mma_kernel(float* out) {
  if (threadIdx.x % 32 >= 16) return;
  float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  const unsigned a[4] = {0u, 0u, 0u, 0u}, b[2] = {0u, 0u};
  mtp::mma_m16n8k16_bf16(c, a, b);
  out[threadIdx.x] = c[0];
}

// Odd lanes wait at __syncthreads, even lanes at a shuffle.
__global__ void barrier_vs_shuffle_kernel(float* out) {
  float v = 1.0f;
  if (threadIdx.x % 2) __syncthreads();
  else v = __shfl_xor_sync(kFullMask, v, 1);
  out[threadIdx.x] = v;
}

// Even lanes shuffle while odd lanes ballot.
__global__ void mixed_collectives_kernel(int* out) {
  int v = threadIdx.x;
  if (threadIdx.x % 2) v = static_cast<int>(__ballot_sync(kFullMask, 1));
  else v = __shfl_xor_sync(kFullMask, v, 2);
  out[threadIdx.x] = v;
}

// A 16-byte load at `offset` floats past p (misaligned unless offset % 4 == 0).
__global__ void vector_load_kernel(const float* p, int offset, float* out) {
  const float4 v = __ldg(reinterpret_cast<const float4*>(p + offset));
  if (threadIdx.x == 0) out[0] = v.x + v.y + v.z + v.w;
}

// Indexes a 4-element local array at i (out of bounds for i >= 4: UBSan bounds).
__global__ void local_index_kernel(int i, float* out) {
  float a[4] = {1.0f, 2.0f, 3.0f, 4.0f};
  if (threadIdx.x == 0) out[0] = a[i];
}

// A 32-bit product (signed overflow past 2^31: UBSan), as an element offset computed
// in int instead of long long would be.
__global__ void int_product_kernel(int a, int b, long long* out) {
  if (threadIdx.x == 0) out[0] = a * b;
}

// 40 KiB of static shared memory, plus whatever dynamic shared memory the launch asks for.
__global__ void big_shared_kernel(float* out) {
  __shared__ float s[10240];
  s[threadIdx.x] = 1.0f;
  __syncthreads();
  if (threadIdx.x == 0) out[0] = s[1];
}

// out[0] = a[0] * b[0] + c[0] as written (no fmaf): one rounding where the compiler
// contracts it into a fused multiply-add (NVRTC by default; the emulator with
// MTPKERN_CUDA_EMU_CONTRACT=1), two where it does not (the emulator's default build).
__global__ void mul_add_kernel(const float* a, const float* b, const float* c, float* out) {
  if (threadIdx.x == 0) out[0] = a[0] * b[0] + c[0];
}

// The last-block pattern: each block sums its slice of x into partial[block], fences and
// takes a ticket (atomicInc wraps the counter back to 0 for the next launch); the block with
// the last ticket sums the partials in block order into out[0] and names itself in out[1].
__global__ void last_block_kernel(const float* x, int per, float* partial, unsigned* ticket, float* out) {
  __shared__ int s_last;
  if (threadIdx.x == 0) {
    float acc = 0.0f;
    for (int i = 0; i < per; ++i) acc += x[blockIdx.x * per + i];
    partial[blockIdx.x] = acc;
    __threadfence();
    s_last = atomicInc(ticket, gridDim.x - 1) == gridDim.x - 1;
  }
  __syncthreads();
  if (s_last && threadIdx.x == 0) {
    float sum = 0.0f;
    for (unsigned b = 0; b < gridDim.x; ++b) sum += partial[b];
    out[0] = sum;
    out[1] = static_cast<float>(blockIdx.x);
  }
}

#define EMU_SELFTEST(name)                                                                                  \
  extern "C" int emu_selftest_##name(unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned long smem, \
                                     void** args) {                                                          \
    return emu::launch(#name, &name##_kernel, dim3(gx, gy, gz), dim3(bx), smem, args);                      \
  }                                                                                                          \
  extern "C" const char* emu_selftest_##name##_sig() { return emu::signature(&name##_kernel); }

EMU_SELFTEST(collectives)
EMU_SELFTEST(shared_unwritten)
EMU_SELFTEST(racy_store)
EMU_SELFTEST(partial_warp_shuffle)
EMU_SELFTEST(barrier_vs_shuffle)
EMU_SELFTEST(partial_warp_mma)
EMU_SELFTEST(mixed_collectives)
EMU_SELFTEST(vector_load)
EMU_SELFTEST(local_index)
EMU_SELFTEST(int_product)
EMU_SELFTEST(big_shared)
EMU_SELFTEST(mul_add)
EMU_SELFTEST(last_block)
