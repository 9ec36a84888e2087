// libmoejit kernels/moe: gated activations fused into FC1's epilogue. Stateless functors,
// apply(gate, up) -> float, fp32 in and out.
//
// Constants are template parameters so they fold. C++17 allows no float template parameters,
// so each constant is an exact ratio of two ints, kNum / kDen, evaluated as
// float(kNum) / float(kDen): a correctly rounded division, hence the same float as the decimal
// literal (1702 / 1000 == 1.702f). Codegen writes e.g. GptOssSwiGLU<1702, 1000, 7, 1>.
//
// NaN: clamps are written so that a NaN input stays NaN (min/max intrinsics would replace it
// by the limit and hide a broken input).
// Accuracy: every output is rounded to bf16 (2^-9 relative) right after, so the functors keep
// their own error far below that: common/math.cuh's sigmoid_for_bf16 (under 2^-15 relative,
// branch-free), tanhf (2 ulp), and constant divisors as multiplies by their
// rounded reciprocal (1 ulp more). Why not the accurate sigmoid: at 16 rows per expert the
// epilogue is not noise beside the K loop (tools/PERF_LOG.md "The activation without branches").
#pragma once

#include <moejit/kern/common/math.cuh>

namespace moejit::kern::moe::act {

template <int kNum, int kDen>
struct Ratio {
  static_assert(kDen > 0, "a constant is kNum / kDen with kDen > 0");
  static constexpr float kValue = static_cast<float>(kNum) / static_cast<float>(kDen);
};

__device__ __forceinline__ float sigmoid(float x) { return ::moejit::kern::sigmoid_for_bf16(x); }
__device__ __forceinline__ float min_keep_nan(float x, float hi) { return x > hi ? hi : x; }
__device__ __forceinline__ float clamp_keep_nan(float x, float lo, float hi) {
  return x > hi ? hi : (x < lo ? lo : x);
}

// silu(g) * u (Qwen, DeepSeek-V3, Llama-style MoE).
struct SwiGLU {
  __device__ __forceinline__ static float apply(float g, float u) { return g * sigmoid(g) * u; }
};

// DeepSeek-V4: g = min(g, L), u = clamp(u, -L, L), silu(g) * u. L = kLimitNum / kLimitDen.
template <int kLimitNum, int kLimitDen>
struct ClampedSwiGLU {
  static constexpr float kLimit = Ratio<kLimitNum, kLimitDen>::kValue;
  static_assert(kLimit > 0.0f, "the clamp limit must be positive");
  __device__ __forceinline__ static float apply(float g, float u) {
    g = min_keep_nan(g, kLimit);
    u = clamp_keep_nan(u, -kLimit, kLimit);
    return g * sigmoid(g) * u;
  }
};

// gpt-oss: g = min(g, L), u = clamp(u, -L, L), g * sigmoid(alpha * g) * (u + 1).
// gpt-oss uses alpha = 1702 / 1000, L = 7 / 1.
template <int kAlphaNum, int kAlphaDen, int kLimitNum, int kLimitDen>
struct GptOssSwiGLU {
  static constexpr float kAlpha = Ratio<kAlphaNum, kAlphaDen>::kValue;
  static constexpr float kLimit = Ratio<kLimitNum, kLimitDen>::kValue;
  static_assert(kLimit > 0.0f, "the clamp limit must be positive");
  __device__ __forceinline__ static float apply(float g, float u) {
    g = min_keep_nan(g, kLimit);
    u = clamp_keep_nan(u, -kLimit, kLimit);
    return g * sigmoid(kAlpha * g) * (u + 1.0f);
  }
};

// SiTU (Kimi-K3): beta * tanh(g / beta) * sigmoid(g) * lb * tanh(u / lb), beta = kBetaNum /
// kBetaDen, lb (linear_beta) = kLinNum / kLinDen; Kimi-K3 uses 4 and 25.
template <int kBetaNum, int kBetaDen, int kLinNum, int kLinDen>
struct SiTU {
  static constexpr float kBeta = Ratio<kBetaNum, kBetaDen>::kValue;
  static constexpr float kLin = Ratio<kLinNum, kLinDen>::kValue;
  static_assert(kBeta > 0.0f && kLin > 0.0f, "beta and linear_beta must be positive");
  // 1 / beta and 1 / linear_beta, correctly rounded: a multiply instead of an IEEE division.
  static constexpr float kInvBeta = Ratio<kBetaDen, kBetaNum>::kValue;
  static constexpr float kInvLin = Ratio<kLinDen, kLinNum>::kValue;
  __device__ __forceinline__ static float apply(float g, float u) {
    const float gate = kBeta * tanhf(g * kInvBeta) * sigmoid(g);
    return gate * (kLin * tanhf(u * kInvLin));
  }
};

}  // namespace moejit::kern::moe::act
