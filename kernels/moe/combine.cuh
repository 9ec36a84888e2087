// combine: the last step of the routed-expert layer. For token t of T and column h of H:
//   out[t, h] = bf16( sum over slots s = 0, 1, ..., K-1 and, within a slot, over FC2's K splits
//                     q = 0, 1, ..., S-1 of fc2_out[slot_row[t * K + s] + q * split_rows, h] )
// skipping slots whose row is -1 (id -1 or another EP rank's expert). fc2_out is what the grouped
// GEMM's FC2 epilogue wrote per padded row: (W2 a + b2) * topk_weight, fp32 or bf16 (moe_gemm.cuh,
// Fc2Epilogue), in S row sets where FC2 splits its K (S = 1 otherwise). The sum is in fp32 and in
// that order, starting from +0, then rounded once (to nearest even): the same input gives the
// same bits, whatever the launch geometry. (Adding +0 for
// a skipped slot would change nothing: a sum that starts at +0 is never -0 under round to
// nearest, so x + 0 == x bit for bit; the kernel adds it so the loads can be predicated.)
// The shared expert is not summed here.
//
// Launch geometry: one thread per 8 consecutive outputs of a token (one 16-byte bf16 store, one
// 16-byte bf16 or two 16-byte fp32 loads per slot), in row-major order:
//   block = Traits::kThreads, grid = ceil(T * H / 8 / Traits::kThreads)   (no launch when T = 0)
// Why this shape: combine streams K rows of H per token and is bound by memory; consecutive
// threads read consecutive 16-byte pieces of the same rows (coalesced), each thread keeps a batch
// of up to 8 slots' loads in flight before adding, and small T still spreads over several SMs
// (T = 1, H = 3584: 448 threads).
#pragma once

#include <moejit/kern/common/ptx.cuh>
#include <moejit/kern/moe/params.cuh>
#include <moejit/kern/moe/ptx.cuh>
#include <moejit/kern/moe/route_params.cuh>
#include <moejit/kern/moe/types.cuh>

namespace moejit::kern::moe {

// Every compile-time setting of one combine kernel.
template <int Hidden,        // H: output columns per token; a multiple of 8 (16-byte vectors)
          int TopK,          // K: slots per token, summed in order 0..K-1
          bool InBf16,       // fc2_out element type: bf16 (true) or fp32 (false), as the FC2
                             // epilogue's kOutBf16
          int BlockThreads,  // threads per CTA: a multiple of 32 in [32, 1024]
          int KSplits = 1>   // S: FC2's row sets per slot (MoeGemmTraits::kKSplits), in order
struct CombineTraits {
  static constexpr int kHidden = Hidden;
  static constexpr int kTopK = TopK;
  static constexpr bool kInBf16 = InBf16;
  static constexpr int kThreads = BlockThreads;
  static constexpr int kSplits = KSplits;

  // Derived.
  static constexpr int kVec = 8;                      // outputs per thread (one 16-byte store)
  static constexpr int kVecsPerRow = kHidden / kVec;  // threads per token
  static constexpr int kTerms = kTopK * kSplits;      // rows summed per token: (slot, split)
  static constexpr int kBatch = kTerms < 8 ? kTerms : 8;  // rows whose loads are in flight at once

  static_assert(kHidden >= 8 && kHidden % 8 == 0,
                "combine: Hidden must be a positive multiple of 8 (16-byte bf16 vectors); pad "
                "the hidden size or add a scalar tail path");
  static_assert(kTopK >= 1 && kTopK <= 64, "combine: TopK must be in [1, 64]");
  static_assert(kThreads % 32 == 0 && kThreads >= 32 && kThreads <= 1024,
                "combine: BlockThreads must be a multiple of 32 in [32, 1024]");
  static_assert(kSplits >= 1 && kSplits <= kMaxKSplits,
                "combine: KSplits must be in [1, kMaxKSplits]");
  static_assert(kSplits == 1 || !kInBf16, "combine: FC2's split rows are fp32 partial sums");
};

namespace detail {

// 16 bytes moved as one access (LDG.128 / STG.128); no toolkit vector types needed.
struct alignas(16) CombineVec {
  u32 w[4];
};

}  // namespace detail

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads) combine_kernel(const CombineParams p) {
  constexpr int K = Traits::kTopK;
  constexpr int kWords = Traits::kInBf16 ? 1 : 2;  // 16-byte loads per slot
  using Vec = detail::CombineVec;
  const unsigned long long total =
      static_cast<unsigned long long>(p.num_tokens < 0 ? 0 : p.num_tokens) *
      static_cast<unsigned long long>(Traits::kVecsPerRow);
  const unsigned long long i =
      static_cast<unsigned long long>(blockIdx.x) * Traits::kThreads + threadIdx.x;
  if (i >= total) return;
  const long long t = static_cast<long long>(i / static_cast<unsigned>(Traits::kVecsPerRow));
  const long long col =
      static_cast<long long>(i % static_cast<unsigned>(Traits::kVecsPerRow)) * Traits::kVec;

  // Why all K rows first: each data load depends on its row, so the rows must all be in flight
  // together; fetched one by one they would cost K dependent round trips.
  int rows[K];
  if constexpr (K % 4 == 0) {
    // 16-byte loads: slot_row is 16-byte aligned (route_workspace_layout) and K * 4 bytes is a
    // multiple of 16.
    const Vec* src = reinterpret_cast<const Vec*>(p.slot_row + t * K);
#pragma unroll
    for (int q = 0; q < K / 4; ++q) {
      const Vec v = src[q];
#pragma unroll
      for (int j = 0; j < 4; ++j) rows[4 * q + j] = static_cast<int>(v.w[j]);
    }
  } else {
#pragma unroll
    for (int s = 0; s < K; ++s) rows[s] = p.slot_row[t * K + s];
  }
  // Why the rows are read before the wait: slot_row is the route's, and the route finished before
  // this grid launched (FC1 waits for the route before it lets FC2 launch, and FC2 reads the
  // route's block map before it lets this grid launch), so the round trip overlaps FC2's tail
  // instead of following it. fc2_out, FC2's, is read only after the wait.
  ::moejit::kern::ptx::grid_dependency_wait();
  ::moejit::kern::ptx::launch_dependents();

  float acc[Traits::kVec];
#pragma unroll
  for (int j = 0; j < Traits::kVec; ++j) acc[j] = 0.0f;
  // Term i = slot i / S, split i % S: slot order, and a slot's splits in order.
  constexpr int S = Traits::kSplits;
  constexpr int kTerms = Traits::kTerms;
#pragma unroll
  for (int i0 = 0; i0 < kTerms; i0 += Traits::kBatch) {
    // The loads of the whole batch first (a -1 row loads nothing and reads as +0), then the adds
    // in term order.
    Vec raw[Traits::kBatch][kWords];
#pragma unroll
    for (int b = 0; b < Traits::kBatch; ++b) {
      const int i = i0 + b < kTerms ? i0 + b : 0;  // (index kept in range)
      const int slot_row = i0 + b < kTerms ? rows[i / S] : -1;
#pragma unroll
      for (int w = 0; w < kWords; ++w) raw[b][w] = Vec{{0u, 0u, 0u, 0u}};
      if (slot_row >= 0) {
        const long long row = slot_row + static_cast<long long>(i % S) * p.split_rows;
        const Vec* src = Traits::kInBf16
                             ? reinterpret_cast<const Vec*>(static_cast<const u16*>(p.fc2_out) +
                                                            row * p.ld_in + col)
                             : reinterpret_cast<const Vec*>(static_cast<const float*>(p.fc2_out) +
                                                            row * p.ld_in + col);
#pragma unroll
        for (int w = 0; w < kWords; ++w) raw[b][w] = src[w];
      }
    }
#pragma unroll
    for (int b = 0; b < Traits::kBatch; ++b) {
      if (i0 + b >= kTerms) break;
#pragma unroll
      for (int j = 0; j < Traits::kVec; ++j) {
        if constexpr (Traits::kInBf16) {
          const u32 pair = raw[b][0].w[j >> 1];
          acc[j] += (j & 1) ? ptx::bf16_hi(pair) : ptx::bf16_lo(pair);
        } else {
          acc[j] += __uint_as_float(raw[b][j >> 2].w[j & 3]);
        }
      }
    }
  }

  Vec packed;
#pragma unroll
  for (int j = 0; j < 4; ++j) packed.w[j] = ptx::pack_bf16x2(acc[2 * j], acc[2 * j + 1]);
  *reinterpret_cast<Vec*>(p.out + t * p.ld_out + col) = packed;
}

}  // namespace moejit::kern::moe
