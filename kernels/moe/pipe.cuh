// libmoejit kernels/moe: PTX of the decode pipelines (decode_moe.cuh, decode_pair.cuh): mbarriers,
// bulk and tensor copies, acquire/release accesses. Device-only, NVRTC-clean.
#pragma once

#include <moejit/kern/moe/decode_params.cuh>
#include <moejit/kern/moe/ptx.cuh>
#include <moejit/kern/moe/types.cuh>

namespace moejit::kern::moe::decode {

namespace pipe {

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void fence_mbar_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void arrive(u32 bar, u32 count) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void wait(u32 bar, u32 parity) {
  u32 done = 0;
  while (!done) {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, "
        "p; }"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  }
}
// One bounded wait for the phase of `parity` (the hardware suspends the thread up to a time
// limit): true once it has completed.
__device__ __forceinline__ bool try_wait(u32 bar, u32 parity) {
  u32 done;
  asm volatile(
      "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, "
      "p; }"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}
// The same test without waiting.
__device__ __forceinline__ bool test_wait(u32 bar, u32 parity) {
  u32 done;
  asm volatile(
      "{ .reg .pred p; mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, "
      "p; }"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}
// Bulk copy global -> this CTA's shared memory; completes `bytes` transactions on `bar`.
__device__ __forceinline__ void copy(u32 dst, const void* src, u32 bytes, u32 bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(dst),
      "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}
// The same with an L2 cache policy (weights: evict first).
__device__ __forceinline__ void copy(u32 dst, const void* src, u32 bytes, u32 bar, u64 policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], "
      "[%1], %2, [%3], %4;" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(bar), "l"(policy)
      : "memory");
}
// Bulk tensor copy of the box at element (x, row) of a 2D tensor map (a __grid_constant__
// kernel parameter) into this CTA's shared memory; completes the box's bytes on `bar`.
__device__ __forceinline__ void copy_2d(u32 dst, const TensorMap& map, i32 x, i32 row, u32 bar,
                                        u64 policy) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      ".L2::cache_hint [%0], [%1, {%2, %3}], [%4], %5;" ::"r"(dst),
      "l"(reinterpret_cast<u64>(&map)), "r"(x), "r"(row), "r"(bar), "l"(policy)
      : "memory");
}
__device__ __forceinline__ void prefetch_map(const TensorMap& map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<u64>(&map)) : "memory");
}
// Orders this thread's earlier generic-proxy accesses before its later async-proxy ones (bulk
// copies reading what other CTAs wrote with plain stores, or writing shared memory the routing
// phase used).
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async;" ::: "memory");
}
// The same for shared memory only (this CTA's).
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
// Arrives on `bar` once this thread's earlier cp.async copies have landed; raises the barrier's
// pending count first, so the phase waits for it.
__device__ __forceinline__ void arrive_on_copies(u32 bar) {
  asm volatile("cp.async.mbarrier.arrive.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
// Adds `bytes` to the transactions the current phase waits for (no arrival).
__device__ __forceinline__ void expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void store_release_cta(u32* p, u32 v) {
  asm volatile("st.release.cta.shared.u32 [%0], %1;" ::"r"(ptx::smem_u32(p)), "r"(v) : "memory");
}
__device__ __forceinline__ u32 load_acquire_cta(const u32* p) {
  u32 v;
  asm volatile("ld.acquire.cta.shared.u32 %0, [%1];" : "=r"(v) : "r"(ptx::smem_u32(p)) : "memory");
  return v;
}
__device__ __forceinline__ u32 lanemask_lt() {
  u32 m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}

}  // namespace pipe

}  // namespace moejit::kern::moe::decode
