// Device-side vocabulary shared by every kernel family: the element types a template may be
// instantiated with, and the enums codegen names by their qualified spelling.
#pragma once

#include <cuda/std/cstdint>
#include <cuda/std/type_traits>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace moejit::kern {

// How the weight of an appended shared expert is produced (mirrors moejit::SharedGate; codegen
// maps one to the other by name, so the numeric values need not agree).
enum class SharedGate : int {
  kSigmoid,   // sigmoid(float(logit[t, s])) * scale
  kConstant,  // scale
  kGiven,     // fp32 weights[t, s], copied
};

// Expert ids travel as int32 or int64, in and out.
template <class T>
inline constexpr bool kIsIdType =
    cuda::std::is_same_v<T, int> || cuda::std::is_same_v<T, long long>;

// Floating inputs a kernel may read and widen to fp32.
template <class T>
inline constexpr bool kIsFloatInput = cuda::std::is_same_v<T, __nv_bfloat16> ||
                                      cuda::std::is_same_v<T, __half> ||
                                      cuda::std::is_same_v<T, float>;

}  // namespace moejit::kern
