// Shared by the CUDA C kernels of this folder (mma.cu, stream_gemv.cu), which `#include "common.cuh"`: NVRTC gets
// this file as a named header (nvrtc.compile_cuda's `headers`), so no include path or toolkit is needed.
#pragma once

typedef unsigned int u32;
typedef unsigned short u16;

// (word >> 2j) & LANES: lane j of a code word, byte b = the code u in {0, 1, 2} of input 16w + 4b + j.
#define LANES 0x03030303u

__device__ __forceinline__ float half_to_float(u16 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

// y's element type: OUT 0 float32, 1 bfloat16, 2 float16.
template <int OUT>
__device__ __forceinline__ void store_y(void* y, long i, float v) {
  if (OUT == 0) {
    reinterpret_cast<float*>(y)[i] = v;
  } else if (OUT == 1) {
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
    reinterpret_cast<u16*>(y)[i] = h;
  } else {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    reinterpret_cast<u16*>(y)[i] = h;
  }
}
