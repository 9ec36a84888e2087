// libmoejit kernels/moe: decode_moe (family 4), the fused small-T MoE layer: routing, FC1 with
// the activation and FC2 with the top-k weight in one persistent launch, between a tiny counter
// reset and the top-k sum, all three overlapped through programmatic dependent launch.
//
// Why this shape of kernel (tools/PERF_LOG.md, "decode_moe", has the numbers): at T <= 256 the
// layer is bound by reading the touched experts' MXFP4 weights once. So
// - every CTA streams: work is cut into items (decode_params.cuh) claimed from one queue, FC1
//   items of every virtual expert first, then FC2 items; a CTA holds at most the item its
//   consumers compute, the one its producer loads and the next one it claimed;
// - warp roles: eight consumer warps dequantize (mxfp4.cuh) and run mma.sync m16n8k16 with weight
//   rows in M and the virtual expert's positions in N (only the n8 tiles that hold positions);
//   one producer warp streams weights and scales (2D tensor copies, evict-first: one each per
//   chunk, or per 4 atoms of the 8- or 16-atom FC1 chunks of the block_n 8 tiles that serve
//   small T) and activation rows (bulk copies) into a ring of `stages` chunks guarded by
//   mbarriers, across item boundaries, and writes each chunk's header (item, positions, virtual
//   expert, slice, flags) so consumers do no item arithmetic; one publisher warp retires
//   finished items (it sleeps on per-item barriers, then a gpu-scope fence and the counters).
//   Why a publisher: a gpu-scope fence waits for the issuing thread's outstanding memory
//   operations, so in the producer it drained the ring once per item (measured: 2x slower);
// - FC2 needs all of FC1's output for its virtual expert: the producer issues an FC2 item's
//   weight copies first, then waits on that expert's FC1 counter, then copies the activations
//   with 16-byte cp.async (generic proxy: rows other CTAs wrote with plain stores need no proxy
//   fence); FC2 writes bf16 rows per position (as marlin_moe's FC2: half the bytes of fp32 for
//   one more rounding, 2^-9 relative, before the fp32 sum), and decode_moe_combine, the next
//   launch, sums each token's rows in slot order (deterministic, no atomics on data). Why a
//   launch of its own: FC2 items run expert by expert, so every H slice completes in the last
//   items, and when the CTA that completed a slice summed it, the layer ended in one CTA per
//   slice reading T x K rows of it while the rest of the GPU idled (measured on the H200,
//   tools/PERF_LOG.md "how long decode_moe's end-of-FC2 combines take": 32 of qwen3-30b-a3b's
//   166 us at T = 256, 95 of kimi-k3.1-tp8's 713);
// - routing is recomputed by every CTA in shared memory (no inter-CTA step): ranks by
//   (token, slot) order with warp::peers (ballots) per warp, then scans; the rank is the same in
//   every CTA and every run.
// Consumer warp w owns strip w / WK of the item and every WK-th K atom of each chunk (WK = 8 /
// strips per item); the WK partial sums of a strip are added in a fixed order at the item's end.
//
// Where the time goes (ncu on the H200, deepseek-v4-flash-tp4 T = 24): in v4 the producer warp
// was the limit (per-strip bulk copies, ~250 instructions per 8 KB chunk; deeper rings changed
// nothing), hence the tensor copies and 16 KB chunks of v6. Since v7 (0.19 instructions per
// weight byte, DRAM ~60%) the consumers are: the dequant (15 instructions per 32-bit word then,
// 14 since layout.cuh's multiply form) is two thirds of the instructions, and with 16 consumer
// warps per SM no warp is eligible in 37% of cycles, hence three CTAs per SM where the tile
// allows it. Neither freeing issue slots nor more warps per scheduler helps any more (ncu and
// A/B runs, tools/PERF_LOG.md "the publisher's polls"): each consumer warp's own instruction
// stream sets the pace.
#pragma once

#include <moejit/kern/common/ptx.cuh>
#include <moejit/kern/common/warp.cuh>
#include <moejit/kern/moe/activation.cuh>
#include <moejit/kern/moe/decode_params.cuh>
#include <moejit/kern/moe/layout.cuh>
#include <moejit/kern/moe/mxfp4.cuh>
#include <moejit/kern/moe/params.cuh>
#include <moejit/kern/moe/pipe.cuh>
#include <moejit/kern/moe/ptx.cuh>

namespace moejit::kern::moe::decode {

namespace pipe {
// Barrier 1 over the consumer warps only (the producer keeps streaming).
__device__ __forceinline__ void consumers_sync() {
  asm volatile("bar.sync 1, %0;" ::"n"(kConsumerThreads) : "memory");
}
}  // namespace pipe

template <i32 kExperts_, i32 kTopK_, i32 kHidden_, i32 kInter_, i32 kBlockN_, i32 kFc1Strips_,
          i32 kFc2Strips_, i32 kStages_, class Act_, bool kIds64_>
struct DecodeTraits {
  using Act = Act_;                        // gated activation functor (activation.cuh)
  static constexpr bool kIds64 = kIds64_;  // topk_ids int64 (else int32)
  static constexpr Geometry kGeo{kExperts_, kTopK_,      kHidden_,    kInter_,
                                 kBlockN_,  kFc1Strips_, kFc2Strips_, kStages_};

  static_assert(kGeo.rule() != Rule::kExperts, "decode_moe: 1 <= experts <= 4096 (12-bit field)");
  static_assert(kGeo.rule() != Rule::kTopK, "decode_moe: 1 <= top_k <= 64 (positions < 2^14)");
  static_assert(kGeo.rule() != Rule::kHidden,
                "decode_moe: hidden must be a multiple of 256 (whole FC1 chunks of 4 K atoms)");
  static_assert(kGeo.rule() != Rule::kInter,
                "decode_moe: inter must be a multiple of 128 (whole FC2 chunks of 2 K atoms)");
  static_assert(kGeo.rule() != Rule::kBlockN, "decode_moe: block_n must be 8, 16 or 32");
  static_assert(kGeo.rule() != Rule::kFc1Strips,
                "decode_moe: fc1_strips must be 2, 4 or 8 and divide inter / 8");
  static_assert(kGeo.rule() != Rule::kFc2Strips,
                "decode_moe: fc2_strips must be 4 or 8 and divide hidden / 16");
  static_assert(kGeo.rule() != Rule::kStages, "decode_moe: 2 <= stages <= 8");
  static_assert(kGeo.rule() != Rule::kSharedMemory,
                "decode_moe: shared memory over 227 KB (or routing scratch over the ring)");
  static_assert(kGeo.rule() == Rule::kOk, "decode_moe: shape rule broken");
  static_assert(kThreads == 320 && kConsumerWarps == 8,
                "eight consumer warps, one producer warp, one publisher warp");
  static_assert(kGeo.fc1_chunk_k() % kGeo.fc1_warps_k() == 0,
                "FC1 chunk atoms split evenly over the warps of a strip");
  static_assert(kGeo.fc2_chunk_k() % kGeo.fc2_warps_k() == 0,
                "FC2 chunk atoms split evenly over the warps of a strip");
  static_assert(kGeo.block_n <= 32, "one producer lane copies one activation row");
  static_assert(kGeo.slot_bytes() % 128 == 0 && kGeo.slot_weight_bytes() % 128 == 0,
                "tensor copies land on 128-byte aligned shared memory");
  static_assert(fc1_map_shape(kGeo, false).box_inner <= 256 &&
                    fc2_map_shape(kGeo, false).box_inner <= 256 && kGeo.fc1_strips <= 256,
                "a tensor copy's box is at most 256 elements per dimension");

  static constexpr i32 kMinBlocksPerSm = kGeo.blocks_per_sm();
};

// ---- routing, in every CTA's shared memory ----------------------------------------------------

// The routing runs on every warp but the producer's (the last), which meanwhile waits for the
// previous grid and claims the CTA's first item; barrier 2 spans the routing warps only.
inline constexpr i32 kRouteThreads = kThreads - 32;
static_assert(kProducerWarp == kThreads / 32 - 1, "the routing warps are the first ones");
__device__ __forceinline__ void route_sync() {
  asm volatile("bar.sync 2, %0;" ::"n"(kRouteThreads) : "memory");
}

// In-place exclusive scan of data[0, kN) by the kRouteThreads routing threads; returns the total,
// which stays in warp_sums[kRouteThreads / 32].
template <i32 kN>
__device__ __forceinline__ u32 block_exclusive_scan(u32* data, u32* warp_sums) {
  constexpr i32 kPer = (kN + kRouteThreads - 1) / kRouteThreads;
  const i32 tid = static_cast<i32>(threadIdx.x);
  const i32 lane = tid & 31;
  const i32 warp = tid >> 5;
  u32 local[kPer];
  u32 sum = 0;
#pragma unroll
  for (i32 i = 0; i < kPer; ++i) {
    const i32 idx = tid * kPer + i;
    const u32 v = idx < kN ? data[idx] : 0u;
    local[i] = sum;
    sum += v;
  }
  u32 incl = sum;
#pragma unroll
  for (i32 off = 1; off < 32; off <<= 1) {
    const u32 y = __shfl_up_sync(0xffffffffu, incl, off);
    if (lane >= off) incl += y;
  }
  if (lane == 31) warp_sums[warp] = incl;
  route_sync();
  if (tid == 0) {
    u32 run = 0;
    for (i32 w = 0; w < kRouteThreads / 32; ++w) {
      const u32 s = warp_sums[w];
      warp_sums[w] = run;
      run += s;
    }
    warp_sums[kRouteThreads / 32] = run;
  }
  route_sync();
  const u32 base = warp_sums[warp] + incl - sum;
#pragma unroll
  for (i32 i = 0; i < kPer; ++i) {
    const i32 idx = tid * kPer + i;
    if (idx < kN) data[idx] = base + local[i];
  }
  const u32 total = warp_sums[kRouteThreads / 32];
  route_sync();
  return total;
}

// Local expert of position `pos`, or kNoExpert (-1, another rank's id, out of range).
inline constexpr u32 kNoExpert = 0xFFFFFFFFu;
template <class T>
__device__ __forceinline__ u32 local_expert(const DecodeMoeParams& p, i32 pos) {
  if constexpr (T::kIds64) {
    const i64 e = static_cast<const i64*>(p.topk_ids)[pos] - static_cast<i64>(p.expert_offset);
    return e >= 0 && e < T::kGeo.experts ? static_cast<u32>(e) : kNoExpert;
  } else {
    const i64 e = static_cast<i64>(static_cast<const i32*>(p.topk_ids)[pos]) -
                  static_cast<i64>(p.expert_offset);
    return e >= 0 && e < T::kGeo.experts ? static_cast<u32>(e) : kNoExpert;
  }
}

// The lanes holding the same local expert e (or all holding kNoExpert): warp::peers over e, with
// kNoExpert mapped to E so that every value fits bit_width(E) bits.
template <class T>
__device__ __forceinline__ u32 expert_peers(u32 e) {
  constexpr i32 E = T::kGeo.experts;
  namespace w = ::moejit::kern::warp;
  return w::peers<w::bit_width(E)>(e == kNoExpert ? static_cast<u32>(E) : e);
}

// Fills sorted[] (positions by (expert, token, slot)) and vinfo[] (pack_virtual per virtual
// expert), and leaves in warp_sums[kRouteThreads / 32] the number of virtual experts (low 16
// bits). `scratch` is the (still unused) ring. Run by the kRouteThreads routing threads only; the
// caller's barrier after it publishes the tables.
template <class T>
__device__ __forceinline__ void route(const DecodeMoeParams& p, u8* scratch, u16* sorted, u32* vinfo,
                                     u32* warp_sums) {
  constexpr Geometry G = T::kGeo;
  constexpr i32 E = G.experts;
  const i32 tid = static_cast<i32>(threadIdx.x);
  const i32 lane = tid & 31;
  const i32 warp = tid >> 5;
  u16* counts = reinterpret_cast<u16*>(scratch);  // [warp][E]: then the warp's base per expert
  u32* sums = reinterpret_cast<u32*>(scratch + G.route_counts_bytes());
  // The local expert of each position, kNoExpert as 0xFFFF (E <= kMaxExperts < 2^16).
  u16* local = reinterpret_cast<u16*>(scratch + G.route_counts_bytes() + G.route_sums_bytes());
  u16* rank16 = local + G.route_local_bytes() / 2;

  const i32 positions = p.num_tokens * G.top_k;
  // Whole 32-position steps per warp, warps in position order.
  const i32 seg = ceil_div(ceil_div(positions, 32), kConsumerWarps) * 32;
  const i32 begin = warp * seg;
  const i32 end = min(positions, begin + seg);

  for (i32 i = tid; i < kConsumerWarps * E / 2; i += kRouteThreads) {
    reinterpret_cast<u32*>(counts)[i] = 0u;
  }
  if ((kConsumerWarps * E) % 2 != 0 && tid == 0) counts[kConsumerWarps * E - 1] = 0;
  // Past one 32-position step per warp, every id is read once up front, kIdBatch loads in flight
  // per thread before the first store, and both passes read the table. Why: each step of the
  // passes below otherwise waits for its ids' round trip to L2, twice per step (kimi-k3.1-tp8
  // T = 96-256: -4 to -7 us, tools/PERF_LOG.md "routing from ids read once"); with one step per
  // warp the table only adds a round trip and a barrier (+0.2-0.4 us at T = 3-6), so there pass 1
  // reads each id from global memory and writes the table for pass 2.
  const bool staged = positions > kConsumerWarps * 32;
  constexpr i32 kIdBatch = 8;
  for (i32 base = 0; staged && base < positions; base += kIdBatch * kRouteThreads) {
    u32 e[kIdBatch];
#pragma unroll
    for (i32 j = 0; j < kIdBatch; ++j) {
      const i32 pos = base + j * kRouteThreads + tid;
      e[j] = pos < positions ? local_expert<T>(p, pos) : kNoExpert;
    }
#pragma unroll
    for (i32 j = 0; j < kIdBatch; ++j) {
      const i32 pos = base + j * kRouteThreads + tid;
      if (pos < positions) local[pos] = static_cast<u16>(e[j]);
    }
  }
  static_assert(kMaxExperts < 0xFFFF, "a local expert and kNoExpert fit 16 bits");
  const auto from_table = [&](i32 pos) {
    const u32 e = local[pos];
    return e == 0xFFFFu ? kNoExpert : e;
  };
  const auto local_of = [&](i32 pos) { return staged ? from_table(pos) : local_expert<T>(p, pos); };
  route_sync();

  // Pass 1: each warp counts its run per expert, and keeps every position's rank in its run.
  if (warp < kConsumerWarps) {
    u16* mine = counts + warp * E;
    for (i32 base = begin; base < end; base += 32) {
      const i32 pos = base + lane;
      const u32 e = pos < end ? local_of(pos) : kNoExpert;
      // Unstaged, the id was read here once: pass 2 takes it from the table, not from L2 again.
      if (!staged && pos < end) local[pos] = static_cast<u16>(e);
      const u32 peers = expert_peers<T>(e);
      u32 before = 0;
      if (e != kNoExpert) {
        before = mine[e];
        rank16[pos] = static_cast<u16>(before + __popc(peers & pipe::lanemask_lt()));
      }
      __syncwarp();
      if (e != kNoExpert && lane == __ffs(peers) - 1) {
        mine[e] = static_cast<u16>(before + __popc(peers));
      }
      __syncwarp();
    }
  }
  route_sync();
  // Per expert: the warps' exclusive bases, and (total << 16 | virtual experts) to scan.
  for (i32 e = tid; e < E; e += kRouteThreads) {
    u32 run = 0;
#pragma unroll
    for (i32 w = 0; w < kConsumerWarps; ++w) {
      const u32 c = counts[w * E + e];
      counts[w * E + e] = static_cast<u16>(run);
      run += c;
    }
    sums[e] = (run << 16) | static_cast<u32>(ceil_div(static_cast<i32>(run), G.block_n));
  }
  route_sync();
  const u32 grand = block_exclusive_scan<E>(sums, warp_sums);

  // Pass 2: every position goes to its expert's first index + its warp's base + its rank in the
  // warp's run, pass 1's: no second round of ballots. Why: every CTA of the grid routes every
  // position, three to an SM, before its first copy, and from T = 96 the routing outlasts the
  // reset's grid (a trace: 6-14 us at kimi-k3.1-tp8 T = 96). Measured on the H200
  // (tools/PERF_LOG.md "R alone (R0)"), decode us: kimi-k3.1-tp8 T = 256 -5.2 / -12.2 (two id
  // draws), kimi-k3.1-tp4-ep2 T = 256 -5.7 / -4.5, kimi-k3.1-tp8 T = 96 -1.7 / -1.7; T <= 24
  // unchanged.
  if (warp < kConsumerWarps) {
    const u16* mine = counts + warp * E;
    for (i32 pos = begin + lane; pos < end; pos += 32) {
      const u32 e = from_table(pos);
      if (e != kNoExpert) sorted[(sums[e] >> 16) + mine[e] + rank16[pos]] = static_cast<u16>(pos);
    }
  }
  route_sync();
  for (i32 e = tid; e < E; e += kRouteThreads) {
    const u32 here = sums[e];
    const u32 next = e + 1 < E ? sums[e + 1] : grand;
    const i32 first = static_cast<i32>(here >> 16);
    const i32 total = static_cast<i32>(next >> 16) - first;
    const i32 v0 = static_cast<i32>(here & 0xFFFFu);
    const i32 nv = static_cast<i32>(next & 0xFFFFu) - v0;
    for (i32 j = 0; j < nv; ++j) {
      const i32 count = min(G.block_n, total - j * G.block_n);
      vinfo[v0 + j] = pack_virtual(e, count, first + j * G.block_n);
    }
  }
}

// ---- the consumers' math -----------------------------------------------------------------------

// One chunk of one strip: this warp's atoms (every kWK-th of kChunkK, from kslice) into acc.
// kActive n8 tiles of kNT hold positions (warp-uniform, a template argument so the MMAs carry
// no per-tile branch). The chunk holds kStrips strips (slot_atom); activation rows are kActRow
// bytes apart. The three addresses already hold this lane's offsets, which the consumers compute
// once: its 16 bytes of an atom, its scale word, and its ldmatrix row of the activation rows.
template <i32 kStrips, i32 kChunkK, i32 kWK, i32 kActRow, i32 kNT, i32 kActive>
__device__ __forceinline__ void mma_chunk(u32 w_lane, u32 s_lane, u32 a_lane, i32 strip, i32 kslice,
                                          float (&acc)[kNT][4]) {
  static_assert(kActive >= 1 && kActive <= kNT, "active tiles within the accumulator");
#pragma unroll
  for (i32 i = 0; i < kChunkK / kWK; ++i) {
    const i32 j = kslice + i * kWK;  // K atom inside the chunk
    const i32 atom = slot_atom(kStrips, kChunkK, strip, j);
    u32 w[4];
    ptx::lds128(w_lane + static_cast<u32>(atom * layout::kAtomBytes), w);
    const u32 sw = ptx::lds32(s_lane + static_cast<u32>(atom * layout::kAtomScaleBytes));
    const u32 f[2] = {mxfp4::group_factors<0>(sw), mxfp4::group_factors<1>(sw)};
#pragma unroll
    for (i32 st = 0; st < 4; st += 2) {
      u32 b[kActive][4];
#pragma unroll
      for (i32 nt = 0; nt < kActive; ++nt) {
        ptx::ldmatrix_x4(
            a_lane + static_cast<u32>(nt * 8 * kActRow + (j * layout::kAtomK + st * 16) * 2),
            b[nt]);
      }
#pragma unroll
      for (i32 h = 0; h < 2; ++h) {
        u32 a[4];
        mxfp4::dequant_step(w[st + h], f[(st + h) >> 1], a);
#pragma unroll
        for (i32 nt = 0; nt < kActive; ++nt) {
          ptx::mma_bf16_16816(acc[nt], a, b[nt][2 * h], b[nt][2 * h + 1]);
        }
      }
    }
  }
}

template <i32 kNT>
__device__ __forceinline__ void zero(float (&acc)[kNT][4]) {
#pragma unroll
  for (i32 nt = 0; nt < kNT; ++nt) {
#pragma unroll
    for (i32 r = 0; r < 4; ++r) acc[nt][r] = 0.f;
  }
}

// mma_chunk for the chunk's active tile count (1 .. kNT).
template <i32 kStrips, i32 kChunkK, i32 kWK, i32 kActRow, i32 kNT>
__device__ __forceinline__ void mma_chunk_active(u32 w_lane, u32 s_lane, u32 a_lane, i32 strip,
                                                 i32 kslice, i32 n_active, float (&acc)[kNT][4]) {
  static_assert(kNT == 1 || kNT == 2 || kNT == 4, "block_n 8, 16 or 32");
  if (kNT == 1 || n_active == 1) {
    mma_chunk<kStrips, kChunkK, kWK, kActRow, kNT, 1>(w_lane, s_lane, a_lane, strip, kslice, acc);
  } else if (kNT == 2 || n_active == 2) {
    mma_chunk<kStrips, kChunkK, kWK, kActRow, kNT, (kNT > 1 ? 2 : 1)>(w_lane, s_lane, a_lane, strip,
                                                                      kslice, acc);
  } else if (n_active == 3) {
    mma_chunk<kStrips, kChunkK, kWK, kActRow, kNT, (kNT > 2 ? 3 : 1)>(w_lane, s_lane, a_lane, strip,
                                                                      kslice, acc);
  } else {
    mma_chunk<kStrips, kChunkK, kWK, kActRow, kNT, kNT>(w_lane, s_lane, a_lane, strip, kslice, acc);
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads, 1) decode_moe_reset(const DecodeMoeParams p) {
  // Everything before this grid is done (the previous layer's reads of the workspace included)
  // before the main kernel may start: it reads hidden and topk_ids before its own wait.
  ::moejit::kern::ptx::grid_dependency_wait();
  ::moejit::kern::ptx::launch_dependents();
  u32* counters = reinterpret_cast<u32*>(p.workspace + T::kGeo.ws_counters());
  for (i32 i = static_cast<i32>(threadIdx.x); i < T::kGeo.counter_words(); i += kThreads) {
    counters[i] = 0u;
  }
}

// The top-k sum, the launch after the persistent kernel: out[t][c .. c + 7] = the fp32 sum of
// FC2's bf16 rows of token t's local slots, in slot order (0 where it has none), as bf16. A thread
// per token and eight columns, so a warp reads 512 contiguous bytes of each row; all of a batch's
// rows are asked for before the first add. Why the ids before the wait: they were written
// before the reset kernel's wait, which every grid of the forward comes after.
inline constexpr i32 kCombineBatch = 8;  // rows in flight per thread
template <class T>
__global__ void __launch_bounds__(kCombineThreads) decode_moe_combine(const DecodeMoeParams p) {
  constexpr Geometry G = T::kGeo;
  constexpr i32 kThreadsPerToken = G.hidden / kCombineColumns;
  static_assert(kCombineColumns == 8 && G.hidden % kCombineColumns == 0,
                "one 16-byte piece of bf16 columns per thread");
  // The next grid in the stream (the next forward's reset, say) may be scheduled now: it waits
  // for this whole grid before it does anything, and it launches only once every CTA of this one
  // has run to here, so it never holds an SM this grid still needs.
  ::moejit::kern::ptx::launch_dependents();
  const i32 i = static_cast<i32>(blockIdx.x) * kCombineThreads + static_cast<i32>(threadIdx.x);
  const i32 tok = i / kThreadsPerToken;
  const i32 col = (i % kThreadsPerToken) * kCombineColumns;
  const bool live = tok < p.num_tokens;
  const u16* const out2 = reinterpret_cast<const u16*>(p.workspace + G.ws_out2());
  u64 local = 0;  // bit k: slot k of the token is on a local expert
  if (live) {
#pragma unroll
    for (i32 k = 0; k < G.top_k; ++k) {
      local |= static_cast<u64>(local_expert<T>(p, tok * G.top_k + k) != kNoExpert) << k;
    }
  }
  ::moejit::kern::ptx::grid_dependency_wait();
  if (!live) return;
  float sum[kCombineColumns] = {};
#pragma unroll
  for (i32 k0 = 0; k0 < G.top_k; k0 += kCombineBatch) {
    uint4 x[kCombineBatch];
#pragma unroll
    for (i32 j = 0; j < kCombineBatch; ++j) {
      const i32 k = k0 + j;
      if (k < G.top_k && ((local >> k) & 1u)) {
        const i64 row = static_cast<i64>(tok) * G.top_k + k;
        x[j] = __ldcg(reinterpret_cast<const uint4*>(out2 + row * G.hidden + col));
      }
    }
#pragma unroll
    for (i32 j = 0; j < kCombineBatch; ++j) {
      const i32 k = k0 + j;
      if (k < G.top_k && ((local >> k) & 1u)) {
        const u32 w[4] = {x[j].x, x[j].y, x[j].z, x[j].w};
#pragma unroll
        for (i32 c = 0; c < 4; ++c) {
          sum[2 * c] += ptx::bf16_lo(w[c]);
          sum[2 * c + 1] += ptx::bf16_hi(w[c]);
        }
      }
    }
  }
  uint4 packed;
  packed.x = ptx::pack_bf16x2(sum[0], sum[1]);
  packed.y = ptx::pack_bf16x2(sum[2], sum[3]);
  packed.z = ptx::pack_bf16x2(sum[4], sum[5]);
  packed.w = ptx::pack_bf16x2(sum[6], sum[7]);
  *reinterpret_cast<uint4*>(p.out + static_cast<i64>(tok) * G.hidden + col) = packed;
}

// Shared control words (misc[], u32): routing scan sums, the producer's list of items in flight;
// then kInFlight "item done" mbarriers (u64), one per item in flight: every consumer warp arrives
// on its item's barrier, the publisher waits on them.
// Why barriers and not counters the publisher polls: an idle poll costs ~50 issue slots the
// consumer warps of its SM need (ncu, v4-v6: 6-7.5% of the kernel's instructions), a barrier
// wait suspends the warp.
inline constexpr i32 kMiscScan = 0;             // [0, 10): block_exclusive_scan warp sums + total
inline constexpr i32 kMiscRetired = 16;         // items the publisher has retired
inline constexpr i32 kMiscInFlight = 32;        // [32, 64): items issued, not yet retired (ring)
inline constexpr i32 kMiscIssuedFinal = 64;     // items the producer issued, once it is done
inline constexpr i32 kMiscWords = 128;          // then the item barriers
inline constexpr i32 kInFlight = 32;
static_assert(kMiscWords * 4 + kInFlight * 8 <= Geometry::misc_bytes(),
              "control words and item barriers fit the shared memory reserved for them");
// Chunk header word 3: the item's slice, and flags (set by the producer, so the consumers do no
// item arithmetic).
inline constexpr i32 kHeaderFc2 = 1 << 16;
inline constexpr i32 kHeaderLast = 1 << 17;

// decode_moe's shared-memory regions, as the kernel carves them.
struct CtaShared {
  u8* ring;
  u16* sorted;
  u32* vinfo;
  u64* full;
  u64* empty;
  i32* headers;  // [stages][4]: item (>= 0) or -1 = end, positions, virtual expert, slice | flags
  u32* misc;
  u64* item_done;
};

// The end of the routing, for every warp: the routing warps after their tables, the producer
// after its first claim. Why barrier.sync and not bar.sync: the two roles reach this barrier
// from different instructions, and bar.sync is barrier.sync.aligned, which the PTX ISA leaves
// undefined unless every thread executes the same instruction (compute-sanitizer's synccheck
// reported it: tools/PERF_LOG.md "main's kernels under compute-sanitizer").
__device__ __forceinline__ void routing_done() {
  asm volatile("barrier.sync 3, %0;" ::"n"(kThreads) : "memory");
}

// The routing's count of virtual experts (route()'s scan total, low 16 bits), after routing_done().
__device__ __forceinline__ i32 virtual_experts(const u32* misc) {
  return static_cast<i32>(misc[kMiscScan + kRouteThreads / 32] & 0xFFFFu);
}

// One item's copies, derived once per item.
struct Unit {
  i32 item;
  bool fc2;
  i32 v;       // virtual expert
  i32 slice;   // item inside the virtual expert
  i32 count;   // positions
  i32 strips;  // strips per chunk
  i32 chunk_k;
  i32 chunks;
  i32 row0;            // the tensor row of the item's first strip
  u32 act_bytes;       // one activation row of a chunk
  u32 tx;              // bytes the copies of one chunk deliver (FC2 activations come by cp.async)
  const u16* act_src;  // FC1: this lane's activation row (lane < count), else null
};

// The producer warp. Lane 0 keeps the books and issues a chunk's two tensor copies (weights,
// scales); lanes below the virtual expert's count copy its activation rows. It starts beside the
// routing: it initializes the CTA's barriers, asks for the tensor maps' descriptors, waits for the
// previous grid and claims the CTA's first item, then joins routing_done() and streams from the
// routing's tables. Why the descriptors and the claim before the routing's end: after it, each
// was a round trip on the way to the first copy. Measured on the H200 (tools/PERF_LOG.md "the
// first claim during the routing" and "E3"): -0.44 us a layer on average for the claim alone;
// this function on top of it -1.1 to -3.5 us at kimi-k3.1-tp8 T = 6-256, within +-1.7 us
// elsewhere. (Issuing the first chunk from the producer's own routing of the ids, before the
// routing's end, lost 0.3-16 us.)
template <class T>
__device__ __forceinline__ void produce(const DecodeMoeParams& p, const CtaShared& s, i32 lane) {
  constexpr Geometry G = T::kGeo;
  constexpr i32 kS = G.stages;
  constexpr i32 kActRow = G.act_row_bytes();
  constexpr i32 kFc1ChunkK = G.fc1_chunk_k();
  constexpr i32 kFc2ChunkK = G.fc2_chunk_k();
  u32* const counters = reinterpret_cast<u32*>(p.workspace + G.ws_counters());
  u32* const queue = counters;
  u32* const fc1_done = counters + 1;
  const u16* const inter = reinterpret_cast<const u16*>(p.workspace + G.ws_inter());
  i32* const in_flight = reinterpret_cast<i32*>(s.misc + kMiscInFlight);
  const u32 ring_base = ptx::smem_u32(s.ring);

  // The ring's barriers, the item barriers (a lane each) and the publisher's control words. Why
  // here and not in a routing thread: the init and its fence take 1.3-2 us of the thread that
  // runs them (as much with fence.proxy.async.shared::cta in place of the init fence), and the
  // routing's first barrier waited for that thread. Measured on the H200 (tools/PERF_LOG.md "the
  // mbarrier init in the producer warp"): every decode cell from T = 6 0.4-4.8 us faster, most by
  // 1-1.5 us.
  static_assert(kInFlight == 32, "one item barrier per lane");
  if (lane == 0) {
    for (i32 i = 0; i < kS; ++i) {
      pipe::mbar_init(ptx::smem_u32(s.full + i), 1);
      pipe::mbar_init(ptx::smem_u32(s.empty + i), kConsumerWarps);
    }
    s.misc[kMiscRetired] = 0u;
    s.misc[kMiscIssuedFinal] = 0xFFFFFFFFu;
  }
  pipe::mbar_init(ptx::smem_u32(s.item_done + lane), kConsumerWarps);
  pipe::fence_mbar_init();

  const u64 evict_first = ptx::policy_evict_first();
  if (lane == 0) {
    pipe::prefetch_map(p.w13);
    pipe::prefetch_map(p.w13_scales);
    pipe::prefetch_map(p.w2);
    pipe::prefetch_map(p.w2_scales);
  }
  u32 seq = 0;  // ring entries produced (position and phase)
  u32 issued = 0;

  const auto open_entry = [&]() {
    const i32 slot = static_cast<i32>(seq % kS);
    pipe::wait(ptx::smem_u32(s.empty + slot), ((seq / kS) & 1u) ^ 1u);
    ++seq;
    return slot;
  };
  // Lane 0, before it issues item `issued`: at most kInFlight items between the publisher and
  // the producer (the ring of item barriers and in_flight[]); the wait is reached only if the
  // publisher falls far behind.
  const auto wait_for_room = [&]() {
    while (issued - pipe::load_acquire_cta(s.misc + kMiscRetired) >= kInFlight) {
      ptx::sleep_ns(256);
    }
  };
  // Item `item` of a queue whose FC1 items end at fc1_total, from the routing's tables.
  const auto make_unit = [&](i32 item, i32 fc1_total) {
    Unit u;
    u.item = item;
    u.fc2 = item >= fc1_total;
    const i32 local = u.fc2 ? item - fc1_total : item;
    const i32 per_v = u.fc2 ? G.fc2_items() : G.fc1_items();
    u.v = local / per_v;
    u.slice = local % per_v;
    const u32 info = s.vinfo[u.v];
    u.count = virtual_count(info);
    u.strips = u.fc2 ? G.fc2_strips : G.fc1_strips;
    u.chunk_k = u.fc2 ? kFc2ChunkK : kFc1ChunkK;
    u.chunks = u.fc2 ? G.fc2_chunks() : G.fc1_chunks();
    u.row0 =
        virtual_expert(info) * (u.fc2 ? G.fc2_m_atoms() : G.fc1_m_atoms()) + u.slice * u.strips;
    u.act_bytes = static_cast<u32>(u.chunk_k * layout::kAtomK * 2);
    u.tx = static_cast<u32>(u.strips * u.chunk_k * (layout::kAtomBytes + layout::kAtomScaleBytes)) +
           (u.fc2 ? 0u : static_cast<u32>(u.count) * u.act_bytes);
    // FC1: this lane's activation row, the hidden row of its position's token.
    u.act_src =
        !u.fc2 && lane < u.count
            ? p.hidden + static_cast<i64>(s.sorted[virtual_first(info) + lane] / G.top_k) * G.hidden
            : nullptr;
    return u;
  };
  // One tensor copy per group of up to 4 atoms lands the chunk's strips (slot_atom's order), one
  // more its scales.
  const auto issue_weights = [&](const Unit& u, i32 c, i32 slot) {
    if (lane == 0) {
      const TensorMap& wmap = u.fc2 ? p.w2 : p.w13;
      const TensorMap& smap = u.fc2 ? p.w2_scales : p.w13_scales;
      const u32 bar = ptx::smem_u32(s.full + slot);
      const u32 slot_base = ring_base + static_cast<u32>(slot * G.slot_bytes());
      const i32 gw = copy_group_atoms(u.chunk_k);
      for (i32 q = 0; q < u.chunk_k / gw; ++q) {
        const i32 atom0 = c * u.chunk_k + q * gw;  // the group's first K atom
        const u32 first = static_cast<u32>(q * u.strips * gw);
        pipe::copy_2d(slot_base + first * layout::kAtomBytes, wmap,
                      atom0 * (layout::kAtomBytes / kMapElementBytes), u.row0, bar, evict_first);
        pipe::copy_2d(
            slot_base + static_cast<u32>(G.slot_weight_bytes()) + first * layout::kAtomScaleBytes,
            smap, atom0 * (layout::kAtomScaleBytes / kMapElementBytes), u.row0, bar, evict_first);
      }
    }
  };
  // FC1 rows (hidden, written before this grid) come by bulk copy. FC2 rows were written in this
  // grid by other CTAs' plain stores: they come by 16-byte cp.async (generic proxy, so no proxy
  // fence, which would wait for every bulk copy this thread has in flight), each lane's copies
  // tracked by the slot's barrier (pending count +1, arrive when landed).
  const auto issue_act = [&](const Unit& u, i32 c, i32 slot) {
    const u32 dst0 = ring_base + static_cast<u32>(slot * G.slot_bytes() + G.slot_weight_bytes() +
                                                  G.slot_scale_bytes());
    const u32 bar = ptx::smem_u32(s.full + slot);
    if (!u.fc2) {
      if (lane < u.count) {
        pipe::copy(dst0 + static_cast<u32>(lane * kActRow),
                   u.act_src + c * u.chunk_k * layout::kAtomK, u.act_bytes, bar);
      }
      return;
    }
    constexpr i32 kPieces = kFc2ChunkK * layout::kAtomK * 2 / 16;  // 16 or 32 per row
    const u16* const rows =
        inter + static_cast<i64>(u.v) * G.block_n * G.inter + c * kFc2ChunkK * layout::kAtomK;
    for (i32 i = lane; i < u.count * kPieces; i += 32) {
      const i32 n = i / kPieces;
      const i32 piece = i % kPieces;
      ptx::cp_async_16(dst0 + static_cast<u32>(n * kActRow + piece * 16),
                       rows + static_cast<i64>(n) * G.inter + piece * 8, 16u);
    }
    if (lane < u.count * kPieces) pipe::arrive_on_copies(bar);
  };
  // The entry's single counted arrival, after every copy (and every cp.async arrive-on) of the
  // chunk is registered, so the phase cannot complete early.
  const auto close_chunk = [&](i32 slot) {
    __syncwarp();
    if (lane == 0) pipe::arrive(ptx::smem_u32(s.full + slot));
    __syncwarp();
  };
  const auto open_chunk = [&](const Unit& u, i32 c) {
    const i32 slot = open_entry();
    if (lane == 0) {
      s.headers[4 * slot] = u.item;
      s.headers[4 * slot + 1] = u.count;
      s.headers[4 * slot + 2] = u.v;
      s.headers[4 * slot + 3] =
          u.slice | (u.fc2 ? kHeaderFc2 : 0) | (c == u.chunks - 1 ? kHeaderLast : 0);
      pipe::expect_tx(ptx::smem_u32(s.full + slot), u.tx);
    }
    __syncwarp();
    return slot;
  };

  // ---- beside the routing ----
  // Every item, the first included, comes from the queue, FC1 items before FC2 items. Why: an FC2
  // item spins until its expert's FC1 items are counted, and claims in queue order mean each of
  // those was claimed earlier by a CTA that is running, so the grid always makes progress, even
  // when only part of it is resident (a kernel of another stream on some SMs) and whatever order
  // CTAs are dispatched in. Handing CTA b item b saves the first claim's round trip but gives
  // that up (tools/PERF_LOG.md "first-static taken back").
  i32 item = 0;  // lane 0: the CTA's first item
  i32 next = 0;  // lane 0: the item after the current one
  ::moejit::kern::ptx::grid_dependency_wait();
  ::moejit::kern::ptx::launch_dependents();
  if (lane == 0) item = static_cast<i32>(atomicAdd(queue, 1u));
  routing_done();

  // ---- from the routing's tables ----
  const i32 nv = virtual_experts(s.misc);
  if (nv == 0) return;  // no local position: nothing to compute
  const i32 fc1_total = nv * G.fc1_items();
  const i32 total = fc1_total + nv * G.fc2_items();
  // The routing scratch in the ring was written by plain stores; only shared memory is at stake.
  pipe::fence_proxy_async_shared();
  item = __shfl_sync(0xffffffffu, item, 0);
  while (item < total) {
    const Unit u = make_unit(item, fc1_total);
    u32 ready = 0;  // FC1 items of v done, loaded early (an FC2 item waits for all of them)
    if (u.fc2 && lane == 0) ready = ptx::load_relaxed(fc1_done + u.v);
    if (lane == 0) {
      wait_for_room();
      in_flight[issued % kInFlight] = u.item;
    }
    ++issued;
    i32 c = 0;
    if (u.fc2) {
      // Weights of the first chunks before waiting for FC1 of this virtual expert.
      const i32 early = min(u.chunks, kS);
      const u32 seq0 = seq;
      for (; c < early; ++c) {
        issue_weights(u, c, open_chunk(u, c));
        if (c == 0 && lane == 0) next = static_cast<i32>(atomicAdd(queue, 1u));
      }
      if (lane == 0) {
        // Acquired either way: orders the FC1 rows before the copies below.
        if (ready < static_cast<u32>(G.fc1_items())) {
          ptx::wait_at_least(fc1_done + u.v, static_cast<u32>(G.fc1_items()), kCounterWaitLimitNs);
        } else {
          ptx::load_acquire(fc1_done + u.v);
        }
      }
      __syncwarp();
      for (i32 k = 0; k < early; ++k) {
        const i32 slot = static_cast<i32>((seq0 + k) % kS);
        issue_act(u, k, slot);
        close_chunk(slot);
      }
    }
    for (; c < u.chunks; ++c) {
      const i32 slot = open_chunk(u, c);
      issue_weights(u, c, slot);
      issue_act(u, c, slot);
      close_chunk(slot);
      if (c == 0 && lane == 0) next = static_cast<i32>(atomicAdd(queue, 1u));
    }
    item = __shfl_sync(0xffffffffu, next, 0);
  }
  // Queue drained: tell the publisher where the items end, and stop the consumers (their last
  // items still arrive on the item barriers the publisher waits on).
  if (lane == 0) {
    pipe::store_release_cta(s.misc + kMiscIssuedFinal, issued);
    // Wakes the publisher: the barrier of item `issued` (never issued) completes at once.
    wait_for_room();
    pipe::arrive(ptx::smem_u32(s.item_done + issued % kInFlight), kConsumerWarps);
  }
  const i32 slot = open_entry();
  if (lane == 0) {
    s.headers[4 * slot] = -1;
    pipe::arrive(ptx::smem_u32(s.full + slot));
  }
  // Why: the last chunks' activation copies (cp.async, each lane's own) may still be in flight,
  // and nothing says a thread's pending cp.async outlive it; the lanes wait for theirs before
  // they exit (the bulk copies are the barriers' to track). The consumers do not wait on this.
  ptx::cp_async_wait_all();
}

template <class T>
// Why __grid_constant__: the tensor copies name the maps in the parameter space by address.
__global__ void __launch_bounds__(kThreads, T::kMinBlocksPerSm)
    decode_moe(const __grid_constant__ DecodeMoeParams p) {
  constexpr Geometry G = T::kGeo;
  constexpr i32 kNT = G.n_tiles();
  constexpr i32 kS = G.stages;
  constexpr i32 kRedFloats = kConsumerWarps * kNT * 4 * 32;
  extern __shared__ __align__(128) u8 smem[];
  u8* const ring = smem;
  float* const red = reinterpret_cast<float*>(smem + G.ring_bytes());
  u16* const sorted = reinterpret_cast<u16*>(smem + G.ring_bytes() + G.reduce_bytes());
  u32* const vinfo = reinterpret_cast<u32*>(reinterpret_cast<u8*>(sorted) + G.sorted_bytes());
  u64* const full = reinterpret_cast<u64*>(reinterpret_cast<u8*>(vinfo) + G.vinfo_bytes());
  u64* const empty = full + kS;
  // Chunk headers [kS][4]: item (>= 0) or -1 = end; then the virtual expert's positions, the
  // virtual expert, the slice and flags.
  i32* const headers = reinterpret_cast<i32*>(empty + kS);
  u32* const misc = reinterpret_cast<u32*>(headers + 4 * kS);

  const i32 tid = static_cast<i32>(threadIdx.x);
  const i32 lane = tid & 31;
  const i32 warp = tid >> 5;

  u64* const item_done = reinterpret_cast<u64*>(misc + kMiscWords);
  // The producer starts beside the routing and initializes the barriers and control words there;
  // every other warp touches them only after routing_done().
  if (warp == kProducerWarp) {
    produce<T>(p, CtaShared{ring, sorted, vinfo, full, empty, headers, misc, item_done}, lane);
    return;
  }
  route<T>(p, ring, sorted, vinfo, misc + kMiscScan);
  routing_done();
  const i32 nv = virtual_experts(misc);

  ::moejit::kern::ptx::grid_dependency_wait();
  // The combine may be scheduled now: it waits for this whole grid before it reads a row.
  ::moejit::kern::ptx::launch_dependents();
  u32* const fc1_done = reinterpret_cast<u32*>(p.workspace + G.ws_counters()) + 1;
  u16* const out2 = reinterpret_cast<u16*>(p.workspace + G.ws_out2());
  u16* const inter = reinterpret_cast<u16*>(p.workspace + G.ws_inter());

  // No local position at all: nothing to compute, and the combine writes zeros.
  if (nv == 0) return;
  const i32 fc1_total = nv * G.fc1_items();
  const u32 ring_base = ptx::smem_u32(ring);
  constexpr i32 kActRow = G.act_row_bytes();
  constexpr i32 kFc1ChunkK = G.fc1_chunk_k();
  constexpr i32 kFc2ChunkK = G.fc2_chunk_k();

  i32* const in_flight = reinterpret_cast<i32*>(misc + kMiscInFlight);

  if (warp == kPublisherWarp) {
    // ============================== publisher ==============================
    // Lane 0 publishes the FC1 items every consumer warp has finished: it bumps their virtual
    // expert's counter (FC2 items wait on it). Why a warp of its own: a gpu-scope fence waits for
    // the issuing thread's outstanding memory operations, so the producer (with a ring of copies in
    // flight) must never fence, and the consumers should not stall on one per item.
    if (lane != 0) return;
    u32 retired = 0;
    const auto item_finished = [&](u32 n, bool block) {
      const u32 bar = ptx::smem_u32(item_done + n % kInFlight);
      return block ? pipe::try_wait(bar, (n / kInFlight) & 1u)
                   : pipe::test_wait(bar, (n / kInFlight) & 1u);
    };
    for (;;) {
      if (!item_finished(retired, true)) continue;
      // The producer, once it has issued its last item, completes the barrier of the item after
      // it: that phase means "finished", not an item.
      const u32 final_count = pipe::load_acquire_cta(misc + kMiscIssuedFinal);
      if (retired == final_count) break;
      // Why the bounds: the barriers of items not yet issued still show their previous round,
      // and the one after the last item is the producer's. Why the count read again after each
      // barrier, not final_count: the producer may store it and complete its barrier after the
      // read above; a barrier seen complete (an acquire) orders the producer's store (released
      // before its arrive) before the read, so that barrier is never taken for an item.
      u32 done = retired + 1;
      while (done - retired < kInFlight && item_finished(done, false) &&
             done != pipe::load_acquire_cta(misc + kMiscIssuedFinal)) {
        ++done;
      }
      // One fence before the first FC1 counter: it orders every retired item's inter stores.
      // Why none for FC2 items alone: their rows are read by the next grid, which the end of
      // this one orders.
      bool fenced = false;
      for (; retired < done; ++retired) {
        const i32 it = in_flight[retired % kInFlight];
        if (it >= fc1_total) continue;
        if (!fenced) ptx::fence_acq_rel_gpu();
        fenced = true;
        atomicAdd(fc1_done + it / G.fc1_items(), 1u);
      }
      pipe::store_release_cta(misc + kMiscRetired, retired);
    }
    return;
  }

  // ============================== consumers ==============================
  // Zero at the start and after each item's epilogue (not per chunk: no select per chunk).
  float acc[kNT][4];
  zero(acc);
  // Why the ring position as (slot, phase), the barriers' and the lane's shared addresses up
  // front, and the count in the chunk header (no second, dependent shared load after the
  // header's): each warp's own instruction stream sets the loop's pace. Measured on the H200
  // (tools/PERF_LOG.md "fewer instructions a chunk in decode_moe's consumer loop"): ~8
  // instructions and that load off each chunk made every decode cell 1.0-3.5% faster.
  const u32 full_base = ptx::smem_u32(full);
  const u32 empty_base = ptx::smem_u32(empty);
  constexpr u32 kBarrierBytes = sizeof(u64);  // slot s's barrier is at base + s * this
  // This lane's addresses in slot 0: its 16 bytes of an atom, its scale word, and its ldmatrix row
  // (lanes 8q..8q+7 give matrix q = rows 0..7 of K block q, 8 elements).
  const u32 lane_w = ring_base + static_cast<u32>(lane * 16);
  const u32 lane_s = ring_base + static_cast<u32>(G.slot_weight_bytes() + (lane >> 2) * 4);
  const u32 lane_a = ring_base + static_cast<u32>(G.slot_weight_bytes() + G.slot_scale_bytes() +
                                                  (lane & 7) * kActRow + (lane >> 3) * 16);
  i32 slot = 0;
  u32 phase = 0;
  u32 items = 0;    // items finished by this warp
  u32 reduces = 0;  // items that went through the K-split reduction (red buffer parity)
  for (;;) {
    pipe::wait(full_base + static_cast<u32>(slot) * kBarrierBytes, phase);
    const int4 header = *reinterpret_cast<const int4*>(headers + 4 * slot);
    const i32 item = header.x;
    if (item == -1) break;
    const i32 count = header.y;
    const i32 v = header.z;
    const bool fc2 = (header.w & kHeaderFc2) != 0;
    const bool last = (header.w & kHeaderLast) != 0;
    const i32 slice = header.w & 0xFFFF;
    const i32 n_active = (count + 7) >> 3;
    // Why constexpr selects: wk is a power of two known per GEMM, so these are shifts and masks.
    constexpr i32 kWk1 = G.fc1_warps_k();
    constexpr i32 kWk2 = G.fc2_warps_k();
    const i32 wk = fc2 ? kWk2 : kWk1;
    const i32 strip = fc2 ? warp / kWk2 : warp / kWk1;
    const i32 kslice = fc2 ? warp % kWk2 : warp % kWk1;
    const u32 slot_offset = static_cast<u32>(slot * G.slot_bytes());
    const u32 w_lane = lane_w + slot_offset;
    const u32 s_lane = lane_s + slot_offset;
    const u32 a_lane = lane_a + slot_offset;

    if (fc2) {
      mma_chunk_active<G.fc2_strips, kFc2ChunkK, kWk2, kActRow, kNT>(w_lane, s_lane, a_lane, strip,
                                                                     kslice, n_active, acc);
    } else {
      mma_chunk_active<G.fc1_strips, kFc1ChunkK, kWk1, kActRow, kNT>(w_lane, s_lane, a_lane, strip,
                                                                     kslice, n_active, acc);
    }
    __syncwarp();
    if (lane == 0) pipe::arrive(empty_base + static_cast<u32>(slot) * kBarrierBytes);
    if (++slot == kS) {
      slot = 0;
      phase ^= 1u;
    }
    if (!last) continue;

    // ---- the item's last chunk: fixed-order sum of the K split, then the epilogue ----
    if (wk > 1) {
      float* const buf = red + (reduces++ & 1u) * kRedFloats;
      if (kslice != 0) {
#pragma unroll
        for (i32 nt = 0; nt < kNT; ++nt) {
#pragma unroll
          for (i32 r = 0; r < 4; ++r) buf[((warp * kNT + nt) * 4 + r) * 32 + lane] = acc[nt][r];
        }
      }
      pipe::consumers_sync();
      if (kslice == 0) {
        for (i32 k = 1; k < wk; ++k) {
#pragma unroll
          for (i32 nt = 0; nt < kNT; ++nt) {
#pragma unroll
            for (i32 r = 0; r < 4; ++r) {
              acc[nt][r] += buf[(((warp + k) * kNT + nt) * 4 + r) * 32 + lane];
            }
          }
        }
      }
    }
    const i32 g = lane >> 2;
    const i32 t = lane & 3;
    if (kslice == 0) {
      if (!fc2) {
        const i32 pair = (slice * G.fc1_strips + strip) * layout::kGateUpRows + g;
#pragma unroll
        for (i32 nt = 0; nt < kNT; ++nt) {
#pragma unroll
          for (i32 h = 0; h < 2; ++h) {
            const i32 n = nt * 8 + 2 * t + h;
            if (n < count) {
              const float gate = acc[nt][h] * mxfp4::kAccumulatorScale;
              const float up = acc[nt][2 + h] * mxfp4::kAccumulatorScale;
              inter[(static_cast<i64>(v) * G.block_n + n) * G.inter + pair] =
                  ptx::to_bf16(T::Act::apply(gate, up));
            }
          }
        }
      } else {
        const i32 row = (slice * G.fc2_strips + strip) * layout::kAtomRows + g;
        const i32 first = virtual_first(vinfo[v]);
#pragma unroll
        for (i32 nt = 0; nt < kNT; ++nt) {
#pragma unroll
          for (i32 h = 0; h < 2; ++h) {
            const i32 n = nt * 8 + 2 * t + h;
            if (n < count) {
              const i32 pos = sorted[first + n];
              const float weight = p.topk_weights[pos] * mxfp4::kAccumulatorScale;
              u16* const dst = out2 + static_cast<i64>(pos) * G.hidden + row;
              dst[0] = ptx::to_bf16(acc[nt][h] * weight);
              dst[8] = ptx::to_bf16(acc[nt][2 + h] * weight);
            }
          }
        }
      }
    }
    zero(acc);
    // The publisher retires the item once every warp has arrived on its barrier.
    __syncwarp();
    if (lane == 0) pipe::arrive(ptx::smem_u32(item_done + items % kInFlight));
    ++items;
  }
}

}  // namespace moejit::kern::moe::decode
