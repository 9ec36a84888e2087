// Scalar math whose accuracy the kernels' tests argue from. Never the fast intrinsics.
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

}  // namespace moejit::kern
