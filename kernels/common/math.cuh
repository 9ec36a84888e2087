// Scalar math whose accuracy the kernels' tests argue from: each function states its error.
#pragma once

namespace moejit::kern {

// Logistic sigmoid in fp32, within a few ulp of the exact value for every finite input, with
// sigmoid(-inf) = 0, sigmoid(+inf) = 1 and NaN propagated.
// Why: expf (about 2 ulp), not __expf (whose relative error grows with |x|); and for x < 0 the
// form e / (1 + e) with e = expf(x), because 1 / (1 + expf(-x)) overflows expf to inf below
// x = -88.7 and returns 0 where the true value is still a (subnormal) fp32 number.
__device__ __forceinline__ float sigmoid_accurate(float x) {
  if (x >= 0.f) return 1.f / (1.f + expf(-x));
  const float e = expf(x);
  return e / (1.f + e);
}

// Logistic sigmoid for values the kernel rounds to bf16 before they leave it (the gated
// activations of FC1's epilogues), without branches. With t = e^-|x| in (0, 1] and
// r = 1 / (1 + t), sigmoid(x) = r for x >= 0 and t r for x < 0, so neither side overflows.
// Error: t as __expf computes it (ex2.approx of the rounded product -|x| log2 e) is within
// 2 + 1.2 |x| ulp (CUDA's bound for __expf), the reciprocal of 1 + t in [1, 2] and the product
// add about 1.5 ulp more: under 2^-15 relative for |x| <= 100 (beyond, t and the true value are
// below fp32's smallest normal), against the 2^-9 relative rounding of the bf16 output.
// NaN stays NaN (every step propagates it), sigmoid(+inf) = 1, sigmoid(-inf) = 0; subnormal
// results are kept (ex2.approx.f32 and rcp.approx.f32 without .ftz).
// Why not sigmoid_accurate in the epilogues: its sign branch diverges inside a warp and its IEEE
// division carries a slow-path call; at 16 rows per expert the activation took 12% of the
// warpgroup FC1 tile's warp samples, and this form cut that instance from 10104 to 6832 SASS
// instructions (nvcc 13.0, sm_90a; tools/PERF_LOG.md "The activation without branches").
__device__ __forceinline__ float sigmoid_for_bf16(float x) {
  float t;
  float r;
  asm("ex2.approx.f32 %0, %1;" : "=f"(t) : "f"(fabsf(x) * -1.4426950408889634f));
  asm("rcp.approx.f32 %0, %1;" : "=f"(r) : "f"(1.f + t));
  return x >= 0.f ? r : t * r;
}

}  // namespace moejit::kern
