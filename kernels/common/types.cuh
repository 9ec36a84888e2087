// Device-side vocabulary shared by every kernel family: the element types a template may be
// instantiated with, and the enums codegen names by their qualified spelling.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cuda/std/cstdint>

namespace moejit::kern {

// How the weight of an appended shared expert is produced (mirrors moejit::SharedGate; codegen
// maps one to the other by name, so the numeric values need not agree).
enum class SharedGate : int {
  kSigmoid,   // sigmoid(float(logit[t, s])) * scale
  kConstant,  // scale
  kGiven,     // fp32 weights[t, s], copied
};

// Type identity for static_asserts.
// Why: not <cuda/std/type_traits>, which alone was over 90% of NVRTC's time for a small kernel
// (measured with NVRTC 13.0: about 4 s against 0.3 s without it, on a loaded 2-core builder).
template <class A, class B>
inline constexpr bool kSameType = false;
template <class A>
inline constexpr bool kSameType<A, A> = true;

// Expert ids travel as int32 or int64, in and out.
template <class T>
inline constexpr bool kIsIdType = kSameType<T, int> || kSameType<T, long long>;

// Floating inputs a kernel may read and widen to fp32.
template <class T>
inline constexpr bool kIsFloatInput =
    kSameType<T, __nv_bfloat16> || kSameType<T, __half> || kSameType<T, float>;

}  // namespace moejit::kern
