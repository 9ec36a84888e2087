// narrow_ids: int64 topk_ids [T, K] -> int32 [T, K] for route (route.cuh reads int32 ids), so an
// engine that keeps its top-k ids in int64 (torch.topk's dtype) needs no cast kernel of its own.
// An id outside the int32 range becomes -1: every local expert id is below 2^31 (the op checks
// expert_offset + E <= INT_MAX), so such an id routes nowhere either way, and -1 says so.
//
// Launch: one thread per id, block = Traits::kThreads, grid = ceil(T * K / kThreads); no launch
// when T = 0. Waits on the previous grid before reading (programmatic dependent launch).
#pragma once

#include <moejit/kern/common/ptx.cuh>

namespace moejit::kern::moe {

template <int BlockThreads>  // threads per CTA: a multiple of 32 in [32, 1024]
struct NarrowIdsTraits {
  static constexpr int kThreads = BlockThreads;
  static_assert(kThreads % 32 == 0 && kThreads >= 32 && kThreads <= 1024,
                "narrow_ids: BlockThreads must be a multiple of 32 in [32, 1024]");
};

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads)
    narrow_ids_kernel(const long long* ids, int* out, long long count) {
  ::moejit::kern::ptx::grid_dependency_wait();
  ::moejit::kern::ptx::launch_dependents();
  const long long i = static_cast<long long>(blockIdx.x) * Traits::kThreads + threadIdx.x;
  if (i >= count) return;
  const long long id = ids[i];
  // Why unsigned: the shift by 2^31 wraps instead of overflowing, and one compare then covers
  // both ends of the int32 range.
  const bool fits = static_cast<unsigned long long>(id) + 2147483648ULL <= 4294967295ULL;
  out[i] = fits ? static_cast<int>(id) : -1;
}

}  // namespace moejit::kern::moe
