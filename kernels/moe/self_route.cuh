// libmoejit kernels/moe: a grouped-GEMM CTA's own route block, from topk_ids (marlin_moe without
// a route launch; MarlinMoeParams::self_route).
//
// What it computes is exactly what route.cuh writes for block size B (route_params.cuh): local
// expert e of an entry i = t * K + s is id - expert_offset where that lies in [0, E); expert e
// owns blocks [start[e], start[e + 1]) with start the exclusive scan of ceil(count[e] / B); row
// j of block b holds the (b - start[e]) * B + j -th entry of e in (token, slot) order, or -1.
// So FC1 and FC2 agree on every padded row without sharing anything but the ids, and the rows
// are bitwise those of the route kernel.
//
// Why: at small and mid T the route launch and the chain after it (the GEMM waits for the
// route's grid, then reads the block map, then the rows, then asks HBM for weights) sat between
// the layer's start and FC1's first weight copy: 2.7-7 us of route on the H200 for layers of
// 15-140 us (tools/PERF_LOG.md). Each CTA here reads the N ids once (one coalesced L2 read) and
// spends a few shared-memory passes over N and E; the planner takes it while N is small
// (moe_plan.cpp, kSelfRouteMaxRows).
//
// How, with kThreads threads and the ring's shared memory as scratch (self_route_scratch_bytes):
//   1. the ids, mapped to local experts (-1: none), into shared memory; counts zeroed;
//   2. counts by shared atomics (sums: order-free, so deterministic);
//   3. a block scan over experts of ceil(count / B): start[0..E];
//   4. the block's expert by binary search in start (the largest e with start[e] <= block);
//   5. thread t owns entries [t P, t P + P): it counts those on e, a block scan gives each its
//      rank, and the ranks in the CTA's window [first, first + kWindow) land in s_ids / s_rows.
// FC2 (kWriteSlotRows) also writes slot_row for combine: CTA (b, 0) the rows of its block b, and
// the entries with no local expert among i = b (mod grid.x).
#pragma once

#include <moejit/kern/moe/params.cuh>
#include <moejit/kern/moe/types.cuh>

namespace moejit::kern::moe {

// The CTA's view of its route block.
struct SelfRouteBlock {
  i32 expert;       // local expert of the block, -1 past the blocks the routing uses
  i32 before;       // blocks of the expert before this one
  i32 blocks_left;  // blocks of the expert from this one on (>= 1 when expert >= 0)
  i32 rows_left;    // entries of the expert from this block's first row on
};

namespace self_route_detail {

// Exclusive prefix of v over the CTA's threads (thread order); `scan` holds kThreads / 32 ints.
// Ends with every thread past a barrier, so `scan` may be reused at once by the next call only
// after another barrier.
template <int kThreads>
__device__ __forceinline__ i32 block_exclusive_scan(i32 v, i32* scan) {
  constexpr int kWarps = kThreads / 32;
  const i32 lane = static_cast<i32>(threadIdx.x) & 31;
  const i32 warp = static_cast<i32>(threadIdx.x) >> 5;
  i32 inclusive = v;
#pragma unroll
  for (i32 d = 1; d < 32; d *= 2) {
    const i32 up = __shfl_up_sync(0xffffffffu, inclusive, d);
    if (lane >= d) inclusive += up;
  }
  if (lane == 31) scan[warp] = inclusive;
  __syncthreads();
  i32 base = 0;
#pragma unroll
  for (i32 w = 0; w < kWarps; ++w) base += w < warp ? scan[w] : 0;
  return base + inclusive - v;
}

}  // namespace self_route_detail

// Routes block `block` (of B = kRouteBlock rows) and fills s_ids[0, kWindow) with the entries of
// the rows from its first row on (-1 past its expert's entries) and s_rows[0, kWindow) with each
// row's input row: the token (kGatherTokens, FC1) or the padded row block * B + n (FC2); -1 for
// padding. kWindow is B, or the consecutive blocks a warpgroup tile takes. Every thread of the
// CTA must call it; it returns the same value to all of them, after a barrier past which the
// scratch is free again.
template <int kThreads, int kRouteBlock, int kWindow, bool kGatherTokens, bool kWriteSlotRows>
__device__ __forceinline__ SelfRouteBlock self_route(const GemmRouteArgs& r, i32 top_k, i32 block,
                                                     u8* scratch, i32* s_ids, i32* s_rows) {
  static_assert(kThreads % 32 == 0 && kThreads >= 32 && kThreads <= 1024,
                "self_route: kThreads must be whole warps, at most 1024");
  static_assert(kWindow >= kRouteBlock && kWindow % kRouteBlock == 0,
                "self_route: the window must be whole route blocks");
  const i32 tid = static_cast<i32>(threadIdx.x);
  const i32 n = r.entries;
  const i32 e_count = r.experts;
  i32* const s_count = reinterpret_cast<i32*>(scratch);  // [E]
  i32* const s_start = s_count + e_count;                 // [E + 1]
  i32* const s_entry = s_start + e_count + 1;             // [N]: local expert or -1
  i32* const s_scan = s_entry + n;                        // [kThreads / 32]

  // 1. Ids to local experts (64-bit difference: any int32 id and offset are safe).
  for (i32 i = tid; i < n; i += kThreads) {
    const i64 e = static_cast<i64>(r.topk_ids[i]) - r.expert_offset;
    s_entry[i] = e >= 0 && e < e_count ? static_cast<i32>(e) : -1;
  }
  for (i32 e = tid; e < e_count; e += kThreads) s_count[e] = 0;
  __syncthreads();
  // 2. Counts.
  for (i32 i = tid; i < n; i += kThreads) {
    const i32 e = s_entry[i];
    if (e >= 0) atomicAdd(&s_count[e], 1);
  }
  __syncthreads();
  // 3. start[e]: thread t owns experts [t Q, t Q + Q).
  const i32 q = (e_count + kThreads - 1) / kThreads;
  i32 blocks = 0;
  for (i32 j = 0; j < q; ++j) {
    const i32 e = tid * q + j;
    if (e < e_count) blocks += (s_count[e] + kRouteBlock - 1) / kRouteBlock;
  }
  i32 run = self_route_detail::block_exclusive_scan<kThreads>(blocks, s_scan);
  for (i32 j = 0; j < q; ++j) {
    const i32 e = tid * q + j;
    if (e < e_count) {
      s_start[e] = run;
      run += (s_count[e] + kRouteBlock - 1) / kRouteBlock;
    }
  }
  if (tid == kThreads - 1) s_start[e_count] = run;  // the last thread's inclusive sum: total
  __syncthreads();
  // 4. The block's expert.
  SelfRouteBlock out{-1, 0, 0, 0};
  if (block < s_start[e_count]) {
    i32 lo = 0, hi = e_count - 1;
    while (lo < hi) {
      const i32 mid = (lo + hi + 1) >> 1;
      if (s_start[mid] <= block) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    out.expert = lo;
    out.before = block - s_start[lo];
    out.blocks_left = s_start[lo + 1] - block;
    out.rows_left = s_count[lo] - out.before * kRouteBlock;
  }
  // 5. The window's rows (block-uniform branch: every thread holds the same out.expert).
  if (out.expert >= 0) {
    const i32 per = (n + kThreads - 1) / kThreads;
    const i32 i0 = tid * per;
    const i32 i1 = i0 + per < n ? i0 + per : n;
    i32 mine = 0;
    for (i32 i = i0; i < i1; ++i) mine += s_entry[i] == out.expert ? 1 : 0;
    const i32 first = out.before * kRouteBlock;
    i32 rank = self_route_detail::block_exclusive_scan<kThreads>(mine, s_scan) - first;
    for (i32 i = i0; i < i1 && rank < kWindow; ++i) {
      if (s_entry[i] != out.expert) continue;
      if (rank >= 0) {
        s_ids[rank] = i;
        s_rows[rank] = kGatherTokens ? i / top_k : block * kRouteBlock + rank;
      }
      ++rank;
    }
    for (i32 j = tid; j < kWindow; j += kThreads) {
      if (j >= out.rows_left) {
        s_ids[j] = -1;
        s_rows[j] = -1;
      }
    }
  }
  __syncthreads();  // s_ids / s_rows complete
  if constexpr (kWriteSlotRows) {
    if (blockIdx.y == 0) {
      if (out.expert >= 0) {
        for (i32 j = tid; j < kRouteBlock && j < out.rows_left; j += kThreads) {
          r.slot_row[s_ids[j]] = block * kRouteBlock + j;
        }
      }
      const i32 stride = static_cast<i32>(gridDim.x);
      for (i64 i = block + static_cast<i64>(tid) * stride; i < n;
           i += static_cast<i64>(kThreads) * stride) {
        if (s_entry[i] < 0) r.slot_row[i] = -1;
      }
    }
    __syncthreads();  // the scratch is read above; the caller's ring copies overwrite it
  }
  return out;
}

}  // namespace moejit::kern::moe
