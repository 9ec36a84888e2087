// Warp-level building blocks shared by the kernels.
#pragma once

namespace moejit::kern::warp {

// Bits needed to write v >= 0: 0 for 0, 1 for 1, 2 for 2..3, ...
__host__ __device__ constexpr int bit_width(int v) { return v <= 0 ? 0 : 1 + bit_width(v >> 1); }
static_assert(bit_width(0) == 0 && bit_width(1) == 1 && bit_width(127) == 7 &&
                  bit_width(128) == 8 && bit_width(896) == 10 && bit_width(32767) == 15,
              "warp::bit_width(v) must be the bits that the values 0..v need");

// The lanes of the (fully active) warp whose value agrees with this lane's on bits
// [0, kBits): one ballot per bit, each lane keeping the lanes that agree with it. Callers map
// every value they tell apart into [0, 2^kBits). What __match_any_sync gives, cheaper: on the
// H200 the route's rank loop with kBits ballots instead of MATCH.ANY took the one-CTA route from
// 7.1 to 6.0 us at 2048 entries (tools/PERF_LOG.md, "ballots instead of MATCH.ANY").
template <int kBits>
__device__ __forceinline__ unsigned peers(unsigned v) {
  static_assert(kBits >= 1 && kBits <= 32, "warp::peers: kBits must be in [1, 32]");
  unsigned same = 0xffffffffu;
#pragma unroll
  for (int b = 0; b < kBits; ++b) {
    const unsigned bit = (v >> b) & 1u;
    const unsigned set = __ballot_sync(0xffffffffu, bit != 0u);
    same &= bit != 0u ? set : ~set;
  }
  return same;
}

}  // namespace moejit::kern::warp
