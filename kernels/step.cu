// step.cu -- the data movement of a planned (CUDA-graph captured) propose step.
//
// copy_segments_kernel: seg [S, 3] int64 = (source address, destination address, words)
//   dst[0:words] = src[0:words] for every segment, 32-bit words (FP32 rows or int32 ids).
//   grid (S), block 256: block s copies segment s, thread t words t, t + 256, ...
//   (16-byte loads and stores when both ends are 16-byte aligned and words % 4 == 0,
//   which holds for every [H] FP32 row with H % 4 == 0).
//
// mtpkern/cuda_graph.py launches it between the modules of a captured step to feed
// module m: the target hidden or the window row (a chained output of an earlier call)
// and module m-1's chained rows into its g input, the drafts of earlier modules into
// its token column, and each sequence's last row into the LM head's input. The
// addresses are data: the host rewrites the table before every replay (one H2D copy of
// the step's staging area), so one graph serves every call of a shape.
//
// Preconditions: blockDim.x == 256; every range inside a live device allocation and
// 4-byte aligned; the segments of one launch do not overlap each other's destinations
// (the host builds them from disjoint rows). A segment with words <= 0 copies nothing.
#include "common.cuh"

namespace mtp {
constexpr int kStepThreads = 256;
}  // namespace mtp

__global__ void __launch_bounds__(mtp::kStepThreads)
copy_segments_kernel(const long long* __restrict__ seg) {
  const long long* s = seg + 3LL * blockIdx.x;
  const unsigned long long src_addr = static_cast<unsigned long long>(s[0]);
  const unsigned long long dst_addr = static_cast<unsigned long long>(s[1]);
  const long long words = s[2];
  if (words <= 0) return;
  if (((src_addr | dst_addr) & 15ULL) == 0 && (words & 3) == 0) {
    const float4* src = reinterpret_cast<const float4*>(src_addr);
    float4* dst = reinterpret_cast<float4*>(dst_addr);
    for (long long i = threadIdx.x; i < words / 4; i += blockDim.x) dst[i] = src[i];
  } else {
    const unsigned* src = reinterpret_cast<const unsigned*>(src_addr);
    unsigned* dst = reinterpret_cast<unsigned*>(dst_addr);
    for (long long i = threadIdx.x; i < words; i += blockDim.x) dst[i] = src[i];
  }
}
