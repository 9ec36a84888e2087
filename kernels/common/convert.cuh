// Exact widening of the floating input types to fp32 (every bf16 and fp16 value is an fp32
// value, so none of these round).
#pragma once

#include <moejit/kern/common/types.cuh>

namespace moejit::kern {

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

}  // namespace moejit::kern
