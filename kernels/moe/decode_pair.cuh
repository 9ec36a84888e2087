// libmoejit kernels/moe: decode_moe's two-launch tile for the smallest T (a handful of tokens):
// decode_pair_fc1 (FC1 with the activation) then decode_pair_fc2 (FC2, top-k weight and top-k
// sum), chained by programmatic dependent launch.
//
// Why a second tile beside the persistent one (decode_moe.cuh; tools/PERF_LOG.md has the numbers):
// at T = 1 the persistent kernel spent 24 us on 20 MB (deepseek-v4-flash-tp4), and a trace of
// it showed where: 2.8 us routing over all E experts, FC1 items of 70 KB taking 8-10 us each,
// and 7-9 us of dependency chain after FC1 (per-expert counters, FC2 activation copies, a
// publisher's fences, the combine of each H slice by the CTA that finished it last). Here:
// - routing is quadratic in the positions (T * K <= 64) instead of linear in E: one pass of
//   broadcast shared-memory reads, no scan over experts;
// - no work queue and no counters: each kernel splits its units (strip x virtual expert)
//   evenly over its grid, so nothing needs a reset kernel and every SM streams from the start;
// - fc2 is launched as fc1's dependent and fc1 lets it start at once, so fc2's CTAs (one per
//   SM beside fc1's) route and, once fc1's bytes could have streamed at the peak DRAM rate, load
//   every FC2 weight they own into shared memory while fc1 runs; only then do they wait for
//   fc1's grid, read the few intermediate rows and multiply;
// - fc2 owns whole 16-row strips of H for every virtual expert, so the top-k sum is done in the
//   CTA, in slot order, with no atomics and no extra pass.
// The math is the persistent tile's: mxfp4::dequant_step into mma.sync m16n8k16, weight rows in
// M, the virtual expert's positions in N (one n8 tile).
#pragma once

#include <moejit/kern/common/ptx.cuh>
#include <moejit/kern/moe/activation.cuh>
#include <moejit/kern/moe/decode_pair_params.cuh>
#include <moejit/kern/moe/decode_params.cuh>
#include <moejit/kern/moe/layout.cuh>
#include <moejit/kern/moe/mxfp4.cuh>
#include <moejit/kern/moe/pipe.cuh>
#include <moejit/kern/moe/ptx.cuh>

namespace moejit::kern::moe::decode {

template <i32 kExperts_, i32 kTopK_, i32 kHidden_, i32 kInter_, i32 kMaxTokens_, class Act_,
          bool kIds64_>
struct PairTraits {
  using Act = Act_;                        // gated activation functor (activation.cuh)
  static constexpr bool kIds64 = kIds64_;  // topk_ids int64 (else int32)
  static constexpr PairGeometry kGeo{kExperts_, kTopK_, kHidden_, kInter_, kMaxTokens_};

  static_assert(kGeo.rule() != PairRule::kExperts, "decode_pair: 1 <= experts <= 4096");
  static_assert(kGeo.rule() != PairRule::kTokens,
                "decode_pair: max_tokens in {1, 2, 4, 8} and max_tokens * top_k <= 64");
  static_assert(kGeo.rule() != PairRule::kHidden,
                "decode_pair: hidden must be a multiple of 512 (K atoms split over 8 warps)");
  static_assert(kGeo.rule() != PairRule::kInter, "decode_pair: inter must be a multiple of 64");
  static_assert(kGeo.rule() != PairRule::kSharedMemory,
                "decode_pair: fc1 needs 2 strips in flight and fc2 8 units within 112 KB");
  static_assert(kGeo.fc1_atoms() / kPairConsumerWarps * layout::kAtomBytes >= 4 * 32 * 4,
                "a warp's atoms of a slot hold its partial sums (4 floats per lane)");
  static_assert(kGeo.rule() == PairRule::kOk, "decode_pair: shape rule broken");
  static_assert(kPairConsumerWarps == 8 && kPairFc1Threads == 544 && kPairFc2Threads == 288,
                "fc1: two groups of eight consumer warps; fc2: eight; each one producer warp");
  static_assert(kGeo.fc1_unit_bytes() % 128 == 0 && kGeo.fc2_unit_bytes() % 16 == 0,
                "bulk copies land on 16-byte aligned shared memory");
  static_assert(kGeo.fc1_ring_bytes() % 16 == 0 && kGeo.fc1_hidden_bytes() % 16 == 0 &&
                    kGeo.fc2_ring_bytes() % 16 == 0 && kGeo.fc2_inter_bytes() % 16 == 0,
                "shared regions stay 16-byte aligned");
};

namespace pair {

// The routing tables both kernels build the same way.
struct Routing {
  i32* expert;    // [P] local expert of each position, -1 if none
  u32* blocks;    // [P] virtual experts led by the position (the first of its expert), else 0
  float* weight;  // [P] top-k weight
  u32* vinfo;     // [P] pack_virtual(expert, count, 8 * v)
  u16* sorted;    // [8P] positions of virtual expert v at 8v .. 8v + count - 1
  u32* total;     // virtual experts

  __device__ __forceinline__ static Routing carve(u8* base) {
    Routing r;
    r.expert = reinterpret_cast<i32*>(base);
    r.blocks = reinterpret_cast<u32*>(base + 4 * kPairMaxPositions);
    r.weight = reinterpret_cast<float*>(base + 8 * kPairMaxPositions);
    r.vinfo = reinterpret_cast<u32*>(base + 12 * kPairMaxPositions);
    r.sorted = reinterpret_cast<u16*>(base + 16 * kPairMaxPositions);
    r.total = reinterpret_cast<u32*>(base + 16 * kPairMaxPositions + 2 * kPairColumns *
                                                                          kPairMaxPositions);
    return r;
  }
};

// Virtual experts of this call, ordered by their expert's first position; inside one, positions
// in (token, slot) order. Every CTA of both kernels computes the same tables. Ends with
// __syncthreads. Why quadratic: P <= 64, and one pass of broadcast reads beats a scan over E.
template <class T>
__device__ __forceinline__ i32 route(const DecodePairParams& p, const Routing& r) {
  constexpr PairGeometry G = T::kGeo;
  const i32 tid = static_cast<i32>(threadIdx.x);
  const i32 positions = p.num_tokens * G.top_k;
  if (tid < positions) {
    const i64 id = T::kIds64 ? static_cast<const i64*>(p.topk_ids)[tid]
                             : static_cast<i64>(static_cast<const i32*>(p.topk_ids)[tid]);
    const i64 e = id - static_cast<i64>(p.expert_offset);
    r.expert[tid] = e >= 0 && e < G.experts ? static_cast<i32>(e) : -1;
    r.weight[tid] = p.topk_weights[tid];
  }
  __syncthreads();
  i32 e = -1;
  i32 first = -1;
  i32 rank = 0;
  i32 count = 0;
  if (tid < positions) {
    e = r.expert[tid];
    if (e >= 0) {
      for (i32 q = 0; q < positions; ++q) {
        const bool same = r.expert[q] == e;
        if (same && first < 0) first = q;
        rank += same && q < tid ? 1 : 0;
        count += same ? 1 : 0;
      }
    }
    r.blocks[tid] = e >= 0 && first == tid ? static_cast<u32>(ceil_div(count, kPairColumns)) : 0u;
  }
  __syncthreads();
  if (e >= 0) {
    u32 base = 0;
    for (i32 q = 0; q < first; ++q) base += r.blocks[q];
    const i32 v = static_cast<i32>(base) + rank / kPairColumns;
    const i32 col = rank % kPairColumns;
    r.sorted[kPairColumns * v + col] = static_cast<u16>(tid);
    if (col == 0) {
      const i32 in_block = count - (rank / kPairColumns) * kPairColumns;
      r.vinfo[v] = pack_virtual(e, in_block < kPairColumns ? in_block : kPairColumns,
                                kPairColumns * v);
    }
  }
  if (tid == 0) {
    u32 n = 0;
    for (i32 q = 0; q < positions; ++q) n += r.blocks[q];
    *r.total = n;
  }
  __syncthreads();
  return static_cast<i32>(*r.total);
}

// Lands kAtoms K atoms of one strip, from atom `atom0` of a weight matrix and its scales, in a
// ring slot at `dst` (weights, then scales), completing on `bar`: two bulk copies.
template <i32 kAtoms>
__device__ __forceinline__ void land_strip(u32 dst, u32 bar, const u8* weights, const u8* scales,
                                           i64 atom0, u64 policy) {
  pipe::expect_tx(bar, static_cast<u32>(kAtoms * (layout::kAtomBytes + layout::kAtomScaleBytes)));
  pipe::copy(dst, weights + atom0 * layout::kAtomBytes, kAtoms * layout::kAtomBytes, bar, policy);
  pipe::copy(dst + kAtoms * layout::kAtomBytes, scales + atom0 * layout::kAtomScaleBytes,
             kAtoms * layout::kAtomScaleBytes, bar, policy);
  pipe::arrive(bar);
}

// Waits until unit `u` (the u-th fill of a ring of kS slots, counted from 0) has landed, for a
// reader that takes only some of the units (fc1's groups every second one, fc2's warps every
// eighth). Why not the full barrier's parity alone: the slot's previous fill (unit u - kS) may be
// another reader's and still landing, since the bulk copies of different slots complete in any
// order, and then the parity of unit u is also that of the phase in progress: the wait would
// pass on the previous unit's bytes. Once unit u - kS is released (its phase of the empty
// barrier, which unit u cannot reach before this reader releases it), the full barrier has
// completed that unit's phase, and the parity names unit u alone.
template <i32 kS>
__device__ __forceinline__ void wait_landed(const u64* full, const u64* empty, i32 u) {
  const i32 slot = u % kS;
  const u32 phase = static_cast<u32>(u / kS);
  if (phase > 0) pipe::wait(ptx::smem_u32(empty + slot), (phase - 1u) & 1u);
  pipe::wait(ptx::smem_u32(full + slot), phase & 1u);
}

// Waits until unit `u` of a kS-slot ring has landed, for the producer that issued it and has not
// yet issued unit u + kS into its slot (so the parity names unit u alone).
template <i32 kS>
__device__ __forceinline__ void wait_full(const u64* full, i32 u) {
  pipe::wait(ptx::smem_u32(full + u % kS), static_cast<u32>((u / kS) & 1));
}

// Named barrier 1 + `group` over one group of eight consumer warps.
__device__ __forceinline__ void consumers_sync(i32 group = 0) {
  asm volatile("bar.sync %0, %1;" ::"r"(1 + group), "n"(kPairConsumerThreads) : "memory");
}

// kAtoms consecutive K atoms, from atom0, of one strip (weights at w_base, scales at s_base)
// times the n8 tile whose ldmatrix row address for this lane is b_lane (row = the lane's
// position, K at 0), into acc.
// Two accumulators: even and odd k16 steps, so consecutive MMAs do not wait for each other.
template <i32 kAtoms>
__device__ __forceinline__ void mma_strip(u32 w_base, u32 s_base, u32 b_lane, i32 atom0,
                                          float (&acc)[2][4]) {
  const i32 lane = static_cast<i32>(threadIdx.x) & 31;
  const i32 g = lane >> 2;
#pragma unroll
  for (i32 i = 0; i < kAtoms; ++i) {
    const i32 j = atom0 + i;
    u32 w[4];
    ptx::lds128(w_base + static_cast<u32>(j * layout::kAtomBytes + lane * 16), w);
    const u32 sw = ptx::lds32(s_base + static_cast<u32>(j * layout::kAtomScaleBytes + g * 4));
    const u32 f[2] = {mxfp4::group_factors<0>(sw), mxfp4::group_factors<1>(sw)};
#pragma unroll
    for (i32 st = 0; st < 4; st += 2) {
      u32 b[4];
      ptx::ldmatrix_x4(b_lane + static_cast<u32>((j * layout::kAtomK + st * 16) * 2), b);
#pragma unroll
      for (i32 h = 0; h < 2; ++h) {
        u32 a[4];
        mxfp4::dequant_step(w[st + h], f[(st + h) >> 1], a);
        ptx::mma_bf16_16816(acc[h], a, b[2 * h], b[2 * h + 1]);
      }
    }
  }
}

}  // namespace pair

// ---- fc1: FC1 strips of every virtual expert, split evenly over the grid ---------------------
// One CTA per SM. The producer warp lands one strip (all of K, weights then scales: two bulk
// copies) per ring slot. Units alternate between two groups of eight consumer warps; in a group
// each warp takes an eighth of the strip's K atoms, stores its partial sums over the atoms it
// has read, and the group's first warp sums the eight in warp order, applies the activation and
// frees the slot (no separate reduction buffer).
template <class T>
__global__ void __maxnreg__(kPairFc1MaxRegisters) decode_pair_fc1(const DecodePairParams p) {
  constexpr PairGeometry G = T::kGeo;
  constexpr i32 kS = G.fc1_stages();
  constexpr i32 kAtoms = G.fc1_atoms();
  constexpr i32 kWarpAtoms = kAtoms / kPairConsumerWarps;
  constexpr i32 kUnit = G.fc1_unit_bytes();
  constexpr i32 kStrips = G.fc1_strips();
  constexpr i32 kRow = G.hidden_row_bytes();
  constexpr i32 kPace = G.fc1_in_flight();
  extern __shared__ __align__(128) u8 smem[];
  u8* const ring = smem;
  u8* const hid = smem + G.fc1_ring_bytes();
  u8* const route_base = hid + G.fc1_hidden_bytes();
  u64* const full = reinterpret_cast<u64*>(route_base + G.route_bytes());
  u64* const empty = full + kPairMaxFc1Stages;
  const pair::Routing r = pair::Routing::carve(route_base);

  const i32 tid = static_cast<i32>(threadIdx.x);
  const i32 lane = tid & 31;
  const i32 warp = tid >> 5;

  // Inputs of earlier grids, and the previous forward's fc2 reading the intermediate rows.
  ::moejit::kern::ptx::grid_dependency_wait();
  // fc2 may start now: until it waits for this grid it reads only what was written before it.
  ::moejit::kern::ptx::launch_dependents();
  if (tid == 0) {
    for (i32 s = 0; s < kS; ++s) {
      pipe::mbar_init(ptx::smem_u32(full + s), 1);
      pipe::mbar_init(ptx::smem_u32(empty + s), 1);
    }
    pipe::fence_mbar_init();
  }
  // The hidden rows, whole, while the routing runs.
  {
    constexpr i32 kPieces = G.hidden / 8;  // 16 bytes each
    const u32 hid_base = ptx::smem_u32(hid);
    for (i32 i = tid; i < p.num_tokens * kPieces; i += kPairFc1Threads) {
      const i32 t = i / kPieces;
      const i32 c = i % kPieces;
      ptx::cp_async_16(hid_base + static_cast<u32>(t * kRow + c * 16),
                       p.hidden + static_cast<i64>(t) * G.hidden + c * 8, 16u);
    }
    ptx::cp_async_commit();
  }
  const i32 nv = pair::route<T>(p, r);
  ptx::cp_async_wait<0>();
  __syncthreads();

  const i32 units = nv * kStrips;
  const i32 begin = static_cast<i32>(static_cast<i64>(blockIdx.x) * units / gridDim.x);
  const i32 end = static_cast<i32>(static_cast<i64>(blockIdx.x + 1) * units / gridDim.x);
  const u32 ring_base = ptx::smem_u32(ring);

  if (warp == kPairFc1Groups * kPairConsumerWarps) {
    // ============================== producer ==============================
    if (lane == 0) {
      const u64 evict_first = ptx::policy_evict_first();
      for (i32 u = begin; u < end; ++u) {
        const i32 i = u - begin;
        const i32 slot = i % kS;
        pipe::wait(ptx::smem_u32(empty + slot), static_cast<u32>((i / kS) & 1) ^ 1u);
        // At most kPace units in flight (kPairFc1InFlightBytes says why).
        if constexpr (kPace < kS) {
          if (i >= kPace) pair::wait_full<kS>(full, i - kPace);
        }
        const i32 e = virtual_expert(r.vinfo[u / kStrips]);
        pair::land_strip<kAtoms>(ring_base + static_cast<u32>(slot * kUnit),
                                 ptx::smem_u32(full + slot), p.w13, p.w13_scales,
                                 (static_cast<i64>(e) * kStrips + u % kStrips) * kAtoms,
                                 evict_first);
      }
    }
    return;
  }

  // ============================== consumers ==============================
  // Group `group` takes units begin + group, + 2, ... (wait_landed: the slot's previous unit may
  // be the other group's).
  const i32 group = warp / kPairConsumerWarps;
  const i32 gw = warp % kPairConsumerWarps;
  const u32 hid_base = ptx::smem_u32(hid);
  const i32 g = lane >> 2;
  const i32 t4 = lane & 3;
  for (i32 u = begin + group; u < end; u += kPairFc1Groups) {
    const i32 i = u - begin;
    const i32 slot = i % kS;
    const i32 v = u / kStrips;
    const i32 strip = u % kStrips;
    const u32 info = r.vinfo[v];
    const i32 count = virtual_count(info);
    const i32 first = virtual_first(info);
    // ldmatrix rows: lanes 8q..8q+7 name column n = lane % 8 (its token's hidden row; columns
    // past the count read the first one and are never stored), K block q.
    const i32 n = lane & 7;
    const i32 token = r.sorted[first + (n < count ? n : 0)] / G.top_k;
    const u32 b_lane = hid_base + static_cast<u32>(token * kRow + (lane >> 3) * 16);
    const u32 w_base = ring_base + static_cast<u32>(slot * kUnit);
    const u32 s_base = w_base + static_cast<u32>(kAtoms * layout::kAtomBytes);

    float acc[2][4] = {};
    pair::wait_landed<kS>(full, empty, i);
    pair::mma_strip<kWarpAtoms>(w_base, s_base, b_lane, gw * kWarpAtoms, acc);
#pragma unroll
    for (i32 q = 0; q < 4; ++q) acc[0][q] += acc[1][q];

    // Fixed-order sum of the eight K slices. Each warp's partial goes over the first atom it
    // read (the warp is past its last read of the slot).
    float* const part = reinterpret_cast<float*>(ring + slot * kUnit);
    constexpr i32 kPartStride = kWarpAtoms * layout::kAtomBytes / 4;  // floats between warps
    __syncwarp();
    if (gw != 0) {
#pragma unroll
      for (i32 q = 0; q < 4; ++q) part[gw * kPartStride + q * 32 + lane] = acc[0][q];
    }
    pair::consumers_sync(group);
    if (gw != 0) continue;
    for (i32 w = 1; w < kPairConsumerWarps; ++w) {
#pragma unroll
      for (i32 q = 0; q < 4; ++q) acc[0][q] += part[w * kPartStride + q * 32 + lane];
    }
    // The slot's next bulk copy (async proxy) comes after these plain stores and loads, all in
    // this CTA's shared memory (the shared::cta fence: the full one is a GPU-wide MEMBAR in SASS,
    // which also waits for the leader's intermediate-row stores of the unit before).
    pipe::fence_proxy_async_shared();
    __syncwarp();
    if (lane == 0) pipe::arrive(ptx::smem_u32(empty + slot));
    // Rows g (gate of pair g) and g + 8 (its up), columns 2 t4 and 2 t4 + 1.
    const i32 pair_index = strip * layout::kGateUpRows + g;
#pragma unroll
    for (i32 h = 0; h < 2; ++h) {
      const i32 col = 2 * t4 + h;
      if (col < count) {
        const i32 pos = r.sorted[first + col];
        const float gate = acc[0][h] * mxfp4::kAccumulatorScale;
        const float up = acc[0][2 + h] * mxfp4::kAccumulatorScale;
        p.inter[static_cast<i64>(pos) * G.inter + pair_index] = ptx::to_bf16(T::Act::apply(gate, up));
      }
    }
  }
}

// ---- fc2: 16-row strips of H for every virtual expert, and the top-k sum ---------------------
// The grid splits H's strips (PairGeometry::fc2_grid); a unit is (strip, virtual expert), all of
// K = I. The producer lands every unit it can before the CTA waits for fc1; consumer warp w takes
// units w, w + 8, ... (wait_landed: the slot's previous unit may be another warp's).
template <class T>
__global__ void __maxnreg__(kPairFc2MaxRegisters) decode_pair_fc2(const DecodePairParams p) {
  constexpr PairGeometry G = T::kGeo;
  constexpr i32 kS = G.fc2_stages();
  constexpr i32 kAtoms = G.fc2_atoms();
  constexpr i32 kUnit = G.fc2_unit_bytes();
  constexpr i32 kHStrips = G.fc2_strips();
  constexpr i32 kRow = G.inter_row_bytes();
  constexpr i32 kP = G.positions();
  extern __shared__ __align__(128) u8 smem[];
  u8* const ring = smem;
  u8* const rows = smem + G.fc2_ring_bytes();
  float* const y = reinterpret_cast<float*>(rows + G.fc2_inter_bytes());
  u8* const route_base = reinterpret_cast<u8*>(y) + G.fc2_rows_bytes();
  u64* const full = reinterpret_cast<u64*>(route_base + G.route_bytes());
  u64* const empty = full + kPairMaxFc2Stages;
  const pair::Routing r = pair::Routing::carve(route_base);

  const i32 tid = static_cast<i32>(threadIdx.x);
  const i32 lane = tid & 31;
  const i32 warp = tid >> 5;

  // The next grid in the stream (the next forward's fc1, say) may be scheduled now: it waits
  // for this whole grid before it reads or writes anything, and it launches only once every CTA
  // of this one has run to here, so it never holds an SM this grid still needs.
  ::moejit::kern::ptx::launch_dependents();
  const u64 entry_ns = ptx::globaltimer();
  if (tid == 0) {
    for (i32 s = 0; s < kS; ++s) {
      pipe::mbar_init(ptx::smem_u32(full + s), 1);
      pipe::mbar_init(ptx::smem_u32(empty + s), 1);
    }
    pipe::fence_mbar_init();
  }
  const i32 strip0 = static_cast<i32>(static_cast<i64>(blockIdx.x) * kHStrips / gridDim.x);
  const i32 strips =
      static_cast<i32>(static_cast<i64>(blockIdx.x + 1) * kHStrips / gridDim.x) - strip0;
  // topk_ids and topk_weights were written before fc1, which let this grid start only after its
  // own grid_dependency_wait: reading them now is safe.
  const i32 nv = pair::route<T>(p, r);
  const i32 units = strips * nv;
  const i32 positions = p.num_tokens * G.top_k;
  const u32 ring_base = ptx::smem_u32(ring);

  if (warp == kPairConsumerWarps) {
    // ============================== producer ==============================
    if (lane == 0) {
      // Why hold the prefetch back: asked for at once, this CTA's weights (a third of the
      // layer's bytes over the grid) queue in DRAM beside fc1's first units, which then land
      // only once about those have too. Held until fc1's bytes could have streamed at the
      // device's peak rate, they still land before fc1 ends: at T <= 2 fc1 streams at well under
      // that rate (ncu, twenty-second session: 11.65 us for 13.4 MB, ~4x the hold).
      // Measured on the H200 (tools/PERF_LOG.md "the pair's fc2 prefetch held for fc1's bytes"):
      // qwen3-30b-a3b -0.8 us at T = 1 and -1.2 at T = 2 (6%), the other shapes within ±0.3 us
      // at T = 1; a hold that ended on fc1's first wave instead was no better anywhere.
      if (p.dram_bytes_per_us != 0) {
        const u64 fc1_bytes = static_cast<u64>(nv) * G.fc1_strips() * G.fc1_unit_bytes();
        const u64 hold_ns = fc1_bytes * 1000u / p.dram_bytes_per_us;
        while (ptx::globaltimer() - entry_ns < hold_ns) ptx::sleep_ns(128);
      }
      const u64 evict_first = ptx::policy_evict_first();
      for (i32 u = 0; u < units; ++u) {
        const i32 slot = u % kS;
        pipe::wait(ptx::smem_u32(empty + slot), static_cast<u32>((u / kS) & 1) ^ 1u);
        const i32 e = virtual_expert(r.vinfo[u % nv]);
        pair::land_strip<kAtoms>(ring_base + static_cast<u32>(slot * kUnit),
                                 ptx::smem_u32(full + slot), p.w2, p.w2_scales,
                                 (static_cast<i64>(e) * kHStrips + strip0 + u / nv) * kAtoms,
                                 evict_first);
      }
    }
    return;
  }

  // ============================== consumers ==============================
  for (i32 i = tid; i < strips * layout::kAtomRows * kP; i += kPairConsumerThreads) y[i] = 0.f;
  // fc1's grid has finished and its intermediate rows are visible.
  ::moejit::kern::ptx::grid_dependency_wait();
  const u32 rows_base = ptx::smem_u32(rows);
  {
    constexpr i32 kPieces = G.inter / 8;  // 16 bytes each
    for (i32 i = tid; i < positions * kPieces; i += kPairConsumerThreads) {
      const i32 pos = i / kPieces;
      const i32 c = i % kPieces;
      if (r.expert[pos] >= 0) {
        ptx::cp_async_16(rows_base + static_cast<u32>(pos * kRow + c * 16),
                         p.inter + static_cast<i64>(pos) * G.inter + c * 8, 16u);
      }
    }
    ptx::cp_async_commit();
    ptx::cp_async_wait<0>();
  }
  pair::consumers_sync();

  const i32 g = lane >> 2;
  const i32 t4 = lane & 3;
  for (i32 u = warp; u < units; u += kPairConsumerWarps) {
    const i32 slot = u % kS;
    const i32 v = u % nv;
    const i32 sl = u / nv;
    const u32 info = r.vinfo[v];
    const i32 count = virtual_count(info);
    const i32 first = virtual_first(info);
    const i32 n = lane & 7;
    const i32 pos_n = r.sorted[first + (n < count ? n : 0)];
    const u32 b_lane = rows_base + static_cast<u32>(pos_n * kRow + (lane >> 3) * 16);
    const u32 w_base = ring_base + static_cast<u32>(slot * kUnit);
    const u32 s_base = w_base + static_cast<u32>(kAtoms * layout::kAtomBytes);

    float acc[2][4] = {};
    pair::wait_landed<kS>(full, empty, u);
    pair::mma_strip<kAtoms>(w_base, s_base, b_lane, 0, acc);
    __syncwarp();
    if (lane == 0) pipe::arrive(ptx::smem_u32(empty + slot));
#pragma unroll
    for (i32 h = 0; h < 2; ++h) {
      const i32 col = 2 * t4 + h;
      if (col < count) {
        const i32 pos = r.sorted[first + col];
        const float w = r.weight[pos] * mxfp4::kAccumulatorScale;
        float* const dst = y + (sl * layout::kAtomRows + g) * kP + pos;
        dst[0] = (acc[0][h] + acc[1][h]) * w;
        dst[8 * kP] = (acc[0][2 + h] + acc[1][2 + h]) * w;
      }
    }
  }
  pair::consumers_sync();

  // out[t][h] = sum over slots in order (positions with no local expert hold 0).
  const i32 cols = strips * layout::kAtomRows;
  for (i32 i = tid; i < p.num_tokens * cols; i += kPairConsumerThreads) {
    const i32 t = i / cols;
    const i32 c = i % cols;
    float sum = 0.f;
    for (i32 s = 0; s < G.top_k; ++s) sum += y[c * kP + t * G.top_k + s];
    p.out[static_cast<i64>(t) * G.hidden + strip0 * layout::kAtomRows + c] = ptx::to_bf16(sum);
  }
}

}  // namespace moejit::kern::moe::decode
