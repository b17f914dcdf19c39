// cuda_bf16.h for the CPU emulator of mtpkern's kernels: the kernels include it for
// __nv_bfloat16 and its conversions, which emu_cuda.h defines (with the rest of the
// emulated CUDA subset). See emu_cuda.h for what is and is not emulated.
#pragma once
#include "emu_cuda.h"
