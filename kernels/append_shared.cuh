// append_shared: the routed top-k of every token copied, then S shared experts appended, in one
// launch. For token t of T, routed slot k < K and shared expert s < S:
//   out_ids[t, k]     = topk_ids[t, k]          out_weights[t, k]     = topk_weights[t, k]
//   out_ids[t, K + s] = shared_base + s         out_weights[t, K + s] = the shared weight:
//     kSigmoid:  sigmoid(float(logits[t, s])) * scale   (logits bf16, fp16 or fp32)
//     kConstant: scale                                  (logits not read)
//     kGiven:    weights[t, s]                           (fp32, passed as the logits pointer)
// All tensors are contiguous, row-major.
//
// Launch geometry: one thread per output element (t, j), j < K + S, in row-major order, so
// consecutive threads write consecutive addresses of both outputs and read nearly consecutive
// addresses of the inputs.
//   block = Traits::kThreads
//   grid  = ceil(T * (K + S) / Traits::kThreads)   (no launch when T = 0)
// Why this shape: the kernel moves a few bytes per token and is bound by launch latency; one
// element per thread needs no loop, no shared memory and no synchronization, and K and S as
// compile-time constants turn the row/column split into a multiply and a shift.
#pragma once

#include <moejit/kern/common/convert.cuh>
#include <moejit/kern/common/math.cuh>
#include <moejit/kern/common/ptx.cuh>
#include <moejit/kern/common/types.cuh>

namespace moejit::kern {

// Every compile-time setting of one append_shared kernel.
template <int TopK,          // K: routed slots per token, copied first (1..64)
          int NumShared,     // S: shared experts appended after them (1..8)
          class IdT,         // expert id type of topk_ids and out_ids: int or long long
          SharedGate Gate,   // how the shared weights are produced
          class LogitT,      // element type read through the logits pointer (kSigmoid: bf16,
                             // fp16 or fp32; kGiven: fp32; kConstant: not read, use float)
          int BlockThreads>  // threads per CTA: a multiple of 32 in [32, 1024]
struct AppendSharedTraits {
  static constexpr int kTopK = TopK;
  static constexpr int kNumShared = NumShared;
  using IdType = IdT;
  static constexpr SharedGate kGate = Gate;
  using LogitType = LogitT;
  static constexpr int kThreads = BlockThreads;

  // Derived.
  static constexpr int kWidth = kTopK + kNumShared;  // K + S: one output row per token

  static_assert(kTopK >= 1 && kTopK <= 64,
                "append_shared: TopK must be in [1, 64]; plan a different top_k or extend the "
                "traits (and supports()) after checking the kernel for larger rows");
  static_assert(kNumShared >= 1 && kNumShared <= 8,
                "append_shared: NumShared must be in [1, 8]; a shape without shared experts "
                "needs no append_shared kernel");
  static_assert(kIsIdType<IdT>,
                "append_shared: IdT must be int (int32 ids) or long long (int64 ids)");
  static_assert(kIsFloatInput<LogitT>,
                "append_shared: LogitT must be bf16, f16 or float");
  static_assert(Gate != SharedGate::kGiven || kSameType<LogitT, float>,
                "append_shared: SharedGate::kGiven copies fp32 weights; instantiate with "
                "LogitT = float");
  static_assert(kThreads % 32 == 0 && kThreads >= 32 && kThreads <= 1024,
                "append_shared: BlockThreads must be a multiple of 32 in [32, 1024]");
};

namespace detail {

// The shared weight of element (t, s); `flat` = t * S + s.
template <class Traits, class Index>
__device__ __forceinline__ float append_shared_weight(const void* __restrict__ shared_logits,
                                                      Index flat, float scale) {
  if constexpr (Traits::kGate == SharedGate::kConstant) {
    return scale;
  } else if constexpr (Traits::kGate == SharedGate::kGiven) {
    return static_cast<const float*>(shared_logits)[flat];
  } else {
    using LogitT = typename Traits::LogitType;
    const float x = to_float(static_cast<const LogitT*>(shared_logits)[flat]);
    return sigmoid_accurate(x) * scale;
  }
}

// Output element i = t * (K + S) + j.
template <class Traits, class Index>
__device__ __forceinline__ void append_shared_element(
    Index i, const typename Traits::IdType* __restrict__ topk_ids,
    const float* __restrict__ topk_weights, const void* __restrict__ shared_logits,
    typename Traits::IdType* __restrict__ out_ids, float* __restrict__ out_weights,
    long long shared_base, float scale) {
  using IdT = typename Traits::IdType;
  constexpr Index kWidth = static_cast<Index>(Traits::kWidth);
  constexpr Index kTopK = static_cast<Index>(Traits::kTopK);
  constexpr Index kNumShared = static_cast<Index>(Traits::kNumShared);
  const Index t = i / kWidth;
  const Index j = i - t * kWidth;
  if (j < kTopK) {
    const Index src = t * kTopK + j;
    out_ids[i] = topk_ids[src];
    out_weights[i] = topk_weights[src];
  } else {
    const Index s = j - kTopK;
    out_ids[i] = static_cast<IdT>(shared_base + static_cast<long long>(s));
    out_weights[i] = append_shared_weight<Traits>(shared_logits, t * kNumShared + s, scale);
  }
}

}  // namespace detail

// Kernel arguments, in launch order: topk_ids [T, K], topk_weights [T, K] fp32, shared_logits
// [T, S] (see the file comment), out_ids [T, K + S], out_weights [T, K + S] fp32, the id of the
// first shared expert, the scale, T.
template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads)
    append_shared_kernel(const typename Traits::IdType* __restrict__ topk_ids,
                         const float* __restrict__ topk_weights,
                         const void* __restrict__ shared_logits,
                         typename Traits::IdType* __restrict__ out_ids,
                         float* __restrict__ out_weights, long long shared_base, float scale,
                         int num_tokens) {
  ptx::grid_dependency_wait();
  ptx::launch_dependents();
  using uint32_t = unsigned int;
  using uint64_t = unsigned long long;
  const uint64_t total = static_cast<uint64_t>(num_tokens < 0 ? 0 : num_tokens) *
                         static_cast<uint64_t>(Traits::kWidth);
  const uint64_t i = static_cast<uint64_t>(blockIdx.x) * Traits::kThreads + threadIdx.x;
  if (i >= total) return;
  // Why: 32-bit index arithmetic (the division by K + S is a multiply-high and a shift) whenever
  // every index fits, which is every real batch; the branch is uniform across the grid.
  if (total <= 0xffffffffull) {
    detail::append_shared_element<Traits, uint32_t>(static_cast<uint32_t>(i), topk_ids,
                                                    topk_weights, shared_logits, out_ids,
                                                    out_weights, shared_base, scale);
  } else {
    detail::append_shared_element<Traits, uint64_t>(i, topk_ids, topk_weights, shared_logits,
                                                    out_ids, out_weights, shared_base, scale);
  }
}

}  // namespace moejit::kern
