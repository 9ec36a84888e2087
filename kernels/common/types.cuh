// Device-side vocabulary shared by every kernel family: the element types a template may be
// instantiated with, and the enums codegen names by their qualified spelling.
//
// Why no CUDA toolkit header (cuda_bf16.h, cuda_fp16.h, cuda/std/...) anywhere under kernels/:
// NVRTC 13 ships none, so each one would make the toolkit's include directory a run-time
// dependency of every process that compiles or even looks up a kernel (the cache key must cover
// whatever a kernel includes). The kernels need only two 16-bit float types, as bits, and
// convert them with single PTX instructions (convert.cuh).
#pragma once

namespace moejit::kern {

// bf16 and fp16 values in memory: 2 bytes, 2-byte aligned, the IEEE / bfloat16 bit pattern.
struct bf16 {
  unsigned short bits;
};
struct f16 {
  unsigned short bits;
};
static_assert(sizeof(bf16) == 2 && alignof(bf16) == 2 && sizeof(f16) == 2 && alignof(f16) == 2,
              "16-bit floats are read as their bits");

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
    kSameType<T, bf16> || kSameType<T, f16> || kSameType<T, float>;

}  // namespace moejit::kern
