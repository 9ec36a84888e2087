// Exact widening of the floating input types to fp32 (every bf16 and fp16 value is an fp32
// value, so none of these round).
#pragma once

#include <moejit/kern/common/types.cuh>

namespace moejit::kern {

__device__ __forceinline__ float to_float(float x) { return x; }
// A bf16 is the high half of the fp32 with the same value.
__device__ __forceinline__ float to_float(bf16 x) {
  return __uint_as_float(static_cast<unsigned>(x.bits) << 16);
}
__device__ __forceinline__ float to_float(f16 x) {
  float out;
  asm("cvt.f32.f16 %0, %1;" : "=f"(out) : "h"(x.bits));
  return out;
}

}  // namespace moejit::kern
