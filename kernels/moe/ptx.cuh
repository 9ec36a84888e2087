// libmoejit kernels/moe: thin PTX wrappers (async copies with cache hints, ldmatrix, mma.sync,
// bf16x2 arithmetic, byte permute). Device-only, NVRTC-clean: no toolkit header is needed, bf16
// values travel as raw 16-bit patterns. Programmatic dependent launch: common/ptx.cuh.
#pragma once

#include <moejit/kern/moe/types.cuh>

namespace moejit::kern::moe::ptx {

__device__ __forceinline__ u32 smem_u32(const void* p) {
  u32 a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}

// L2 policy for data read once per step (weights): evict first, so activations stay in L2.
__device__ __forceinline__ u64 policy_evict_first() {
  u64 p;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
  return p;
}

// 16-byte global -> shared copy that bypasses L1; reads src_bytes (16, or 0: no memory is read)
// and zero-fills the rest. src must be a valid address either way.
// Why .L2::256B: weight runs are >= 512 contiguous bytes, so the prefetch is never wasted.
// MOEJIT_NO_L2_CACHE_HINT (set by the library's compile only where ptxas encoded the hinted copy
// in the form that faults: src/compile/cubin_check.hpp) drops the policy operand.
__device__ __forceinline__ void cp_async_16_stream(u32 dst, const void* src, u32 src_bytes,
                                                   u64 pol) {
#ifdef MOEJIT_NO_L2_CACHE_HINT
  (void)pol;
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
               "r"(src_bytes)
               : "memory");
#else
  asm volatile(
      "cp.async.cg.shared.global.L2::cache_hint.L2::256B [%0], [%1], 16, %2, %3;" ::"r"(dst),
      "l"(src), "r"(src_bytes), "l"(pol)
      : "memory");
#endif
}
// Asks L2 for [src, src + bytes) (src 16-byte aligned, bytes a multiple of 16): one instruction,
// nothing to wait for, no effect on results. sm_90's bulk prefetch; a no-op before sm_90.
__device__ __forceinline__ void prefetch_l2(const void* src, u32 bytes) {
#if __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(bytes) : "memory");
#else
  (void)src;
  (void)bytes;
#endif
}
__device__ __forceinline__ void cp_async_16(u32 dst, const void* src, u32 src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes)
               : "memory");
}
// 4-byte global -> shared copy through L1 (.ca: the only form below 16 bytes); reads src_bytes
// (4, or 0: no memory is read) and zero-fills the rest. src must be a valid address either way.
__device__ __forceinline__ void cp_async_4(u32 dst, const void* src, u32 src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}
// Every cp.async this thread issued, committed to a group or not, has landed.
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_all;" ::: "memory");
}

__device__ __forceinline__ void lds128(u32 addr, u32 (&r)[4]) {
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ u32 lds32(u32 addr) {
  u32 r;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(r) : "r"(addr));
  return r;
}
__device__ __forceinline__ void ldmatrix_x4(u32 addr, u32 (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// d += a * b; m16n8k16, A row-major (4 bf16x2), B column-major (2 bf16x2), fp32 accumulate.
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Byte permute: result byte i = byte sel[i] of the 8-byte value {b, a} (a = bytes 0..3).
__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
  u32 d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// bf16x2 product of a with one half of b (kHalf 0: low, 1: high) in both lanes, round to
// nearest; subnormal inputs are kept (no flush for bf16). Why a half: ptxas folds the broadcast
// into the multiply's operand (HMUL2 ..., R.H0_H0 / R.H1_H1), so one register carries two
// factors and selecting one costs no instruction. (The broadcast is written inside the asm:
// extracted in C++, it cost ~0.4 instructions per 32-bit word of weights in the decode tile.)
template <int kHalf>
__device__ __forceinline__ u32 mul_bf16x2_half(u32 a, u32 b) {
  static_assert(kHalf == 0 || kHalf == 1, "a bf16x2 has two halves");
  u32 d;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (kHalf == 0) {
    asm("{ .reg .b16 l, h; .reg .b32 f; mov.b32 {l, h}, %2; mov.b32 f, {l, l};"
        " mul.rn.bf16x2 %0, %1, f; }"
        : "=r"(d)
        : "r"(a), "r"(b));
  } else {
    asm("{ .reg .b16 l, h; .reg .b32 f; mov.b32 {l, h}, %2; mov.b32 f, {h, h};"
        " mul.rn.bf16x2 %0, %1, f; }"
        : "=r"(d)
        : "r"(a), "r"(b));
  }
#else  // sm_80 has no bf16 mul: an fma with -0 added
  asm("fma.rn.bf16x2 %0, %1, %2, %3;"
      : "=r"(d)
      : "r"(a), "r"(prmt(b, 0u, kHalf == 0 ? 0x1010u : 0x3232u)), "r"(0x80008000u));
#endif
  return d;
}

// Two floats -> bf16x2 (lo in bits 15..0), round to nearest even.
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
  u32 d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}
__device__ __forceinline__ u16 to_bf16(float x) {
  u16 d;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(d) : "f"(x));
  return d;
}
__device__ __forceinline__ float bf16_lo(u32 x) { return __uint_as_float(x << 16); }
__device__ __forceinline__ float bf16_hi(u32 x) { return __uint_as_float(x & 0xFFFF0000u); }

// gpu-scope counters between CTAs (decode_moe's item counters, marlin_moe's per-tile chain).
__device__ __forceinline__ u32 load_acquire(const u32* p) {
  u32 v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ u32 load_relaxed(const u32* p) {
  u32 v;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void fence_acq_rel_gpu() {
  asm volatile("fence.acq_rel.gpu;" ::: "memory");
}
// Adds v with release semantics: this thread's earlier writes, and those of other threads that
// a CTA barrier ordered before it, are visible to whoever acquires the sum.
__device__ __forceinline__ void red_add_release(u32* p, u32 v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void sleep_ns(u32 ns) { asm volatile("nanosleep.u32 %0;" ::"r"(ns)); }
__device__ __forceinline__ u64 globaltimer() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Waits until *counter >= target, then acquires it (what was released before the counts is
// visible after). Call once a first look found it short. Why relaxed polls and one acquire at the
// end: each acquire load also invalidates the SM's L1 (CCTL.IVALL), which the polls need not do.
// Past limit_ns (params.cuh kCounterWaitLimitNs says why the op's limit is what it is) it traps,
// so the launch fails instead of hanging the stream: the stream's next synchronization reports
// it, and the context is unusable after it (a trap's error is sticky). Why no message (printf)
// first: any call in a kernel, vprintf's included, makes ptxas serialize every wgmma of it
// (C7510). Why the elapsed time compared signed: a timer read that steps back must not wrap
// into a wait past its limit.
__device__ __forceinline__ void wait_at_least(const u32* counter, u32 target, u64 limit_ns) {
  const u64 start = globaltimer();
  while (load_relaxed(counter) < target) {
    if (static_cast<i64>(globaltimer() - start) > static_cast<i64>(limit_ns)) __trap();
    sleep_ns(32);
  }
  load_acquire(counter);
}

}  // namespace moejit::kern::moe::ptx
