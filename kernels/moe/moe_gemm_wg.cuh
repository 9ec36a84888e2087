// libmoejit kernels/moe: marlin_moe's prefill main loop on sm_90a. The same grouped GEMM as
// moe_gemm.cuh (same MoeGemmParams, grid, route blocks and epilogues), with warpgroup MMAs:
// D[64 weight rows x kBlockN tokens] += A[64 x 16] x B[16 x kBlockN] per wgmma.
//
// Why wgmma with A in registers: at large T every expert sees 64-256 tokens, so the layer is
// a math problem and mma.sync tops out near 60-70% of the tensor core (tools/PERF_LOG.md:
// 215-224 TFLOP/s). The MXFP4 weights are the A operand: each lane dequantizes exactly its A
// fragment (layout.cuh's atom lane order is wgmma's register-A order), so the bf16 weights
// never touch shared memory; the activations are the B operand, read by the tensor core from
// a 128-byte-swizzled shared tile. One dequantized word now feeds kBlockN tokens (mma.sync: 8
// per n8 tile, with the B fragments loaded by every warp).
//
// Structure:
// - CTA = kWarpGroups warpgroups; warpgroup q owns kWgTilesM m64 tiles (64 weight rows each:
//   four 16-row atom strips, one per warp) of the CTA's kBlockM rows, and all kBlockN tokens.
// - Pipeline: kStages-deep cp.async ring of 64-wide K tiles (one atom column). A stage holds
//   the CTA's gathered input rows (128-byte swizzle, zero-filled for padding rows and past
//   in_features), its weight atoms (verbatim) and their scales. Every thread copies a share
//   of each stage.
// - Per K tile kt a warpgroup issues the 4 k16 steps x kWgTilesM wgmmas of tile kt from
//   registers dequantized earlier, commits, waits until only that group runs (tile kt - 1
//   done), passes the CTA barrier (tile kt + 1 landed, tile kt - 1's stage free for the next
//   copy), then dequantizes tile kt + 1 (one 16-byte load and one scale word per lane and m64
//   tile, mxfp4::dequant_step) into the other register set while the tensor core works.
//   At three CTAs per SM or more there is one register set at widths above kBlockN - 32: the
//   warpgroup waits for tile kt's wgmmas before the barrier and dequantizes tile kt + 1 into the
//   same registers, while the other CTAs' warps keep the SM busy (kABuffers, a_buffers).
// - Route groups: the route runs with blocks of kRouteBlock rows and lists each expert's groups
//   of kBlockN rows (kBlockN / kRouteBlock = 1, 2, 4, 8 or 16 blocks, from the expert's first
//   block; route_params.cuh group_tiles). The grid's y x z runs over the groups provisioned, M
//   tiles in x as moe_gemm.cuh: CTA (m, g) reads group g's first block, expert and real rows in
//   one 8-byte load, and the CTAs past the groups used (the grid's tail) exit at once. Its real
//   rows are a prefix of the group's, and it runs at the narrowest N in {1, 2, 3, 4} x
//   kBlockN / 4 that covers them (one gemm_tile instance per width), so an expert's last tile
//   computes fewer than kBlockN / 4 padding rows, whatever the route block. Why a list: with a
//   CTA per route block, those not first in their group exited after reading the block map
//   (two in three of qwen3-30b-a3b's FC2 CTAs at T = 256, interleaved with the working ones).
// - Epilogue: after the last wait the accumulators are in mma.sync's C order per 8-token
//   slice; moe_gemm.cuh's Fc1Epilogue / Fc2Epilogue turn them into outputs (activation, bias,
//   top-k weight), which go through a staging tile in shared memory so each token's row leaves
//   in whole 16-byte pieces. One CTA owns each output element: results are bitwise
//   deterministic. With K splits (FC2, kKSplits > 1, as moe_gemm.cuh's) each split's CTA owns
//   its own fp32 row set, which combine adds in split order.
// - PDL: as moe_gemm.cuh (kEarlyWeights: weight prologue before the wait for inputs, which is
//   griddepcontrol.wait or, with a MoeGemmChain, FC1's count of the CTA's own group).
#pragma once

#include <moejit/kern/common/ptx.cuh>
#include <moejit/kern/moe/activation.cuh>
#include <moejit/kern/moe/layout.cuh>
#include <moejit/kern/moe/moe_gemm.cuh>
#include <moejit/kern/moe/mxfp4.cuh>
#include <moejit/kern/moe/params.cuh>
#include <moejit/kern/moe/ptx.cuh>
#include <moejit/kern/moe/wgmma.cuh>

namespace moejit::kern::moe {

template <int kBlockN_, int kWarpGroups_, int kWgTilesM_, int kStages_, int kMinBlocksPerSm_,
          int kRouteBlock_, bool kEarlyWeights_, class Epilogue_, int kKSplits_ = 1>
struct MoeGemmWgTraits {
  static constexpr int kBlockN = kBlockN_;          // tokens per CTA tile = wgmma N
  static constexpr int kWarpGroups = kWarpGroups_;  // warpgroups, each with its own weight rows
  static constexpr int kWgTilesM = kWgTilesM_;      // m64 tiles (64 weight rows) per warpgroup
  static constexpr int kStages = kStages_;          // cp.async ring depth (K tiles of 64)
  static constexpr int kMinBlocksPerSm = kMinBlocksPerSm_;  // occupancy target (register cap)
  // Rows per route block: a CTA takes up to kGroupBlocks consecutive blocks of one expert.
  static constexpr int kRouteBlock = kRouteBlock_;
  static constexpr bool kEarlyWeights = kEarlyWeights_;  // weight prologue before input wait
  using Epilogue = Epilogue_;  // Fc1Epilogue<Act, bias> or Fc2Epilogue<bf16 out, bias>
  // CTAs per M tile along K (FC2 only), as moe_gemm.cuh's kKSplits: CTA x = split * m_tiles +
  // m_tile sums the split-th range of K tiles into row set `split` of out2, a set being
  // blocks * kBlockN rows (the groups provisioned x their rows: at least the route's padded rows).
  static constexpr int kKSplits = kKSplits_;

  static constexpr int kGroupBlocks = kBlockN / kRouteBlock;  // route blocks per CTA tile
  static constexpr int kQuarter = kBlockN / 4;  // the step of the CTA's wgmma widths
  static constexpr int kBlockM = 64 * kWarpGroups * kWgTilesM;  // weight rows per CTA
  static constexpr int kBlockK = layout::kAtomK;                // K per stage: one atom column
  static constexpr int kThreads = 128 * kWarpGroups;
  // A-fragment register sets: two (tile kt + 1 dequantized while tile kt's wgmmas run) where
  // registers allow, one at three CTAs per SM or more. Why: with two sets and 64 fp32
  // accumulators the two-warpgroup N = 64 tile needed more than the 80 registers of three CTAs
  // per SM, and ptxas then spilled and serialized every wgmma of the kernel (a wait after each
  // one, its note C7512); one set fit in 74 with neither, and measured 3-5% faster per layer
  // (tools/PERF_LOG.md "one register set for the three-CTA warpgroup tile"). The planner's
  // N = 64 tile now is one warpgroup of two m64 tiles at four CTAs per SM (128 registers, one
  // set); the same tile with two sets at three CTAs per SM (164 registers) measured 5-8% slower
  // (tools/PERF_LOG.md "one warpgroup of two m64 tiles").
  static constexpr int kABuffers = kMinBlocksPerSm >= 3 ? 1 : 2;
  // Register sets at wgmma width n <= kBlockN: also two where the narrower accumulators leave
  // room for the second set within the full width's one-set budget (n / 2 + 2 x 16 <= kBlockN / 2
  // + 16 fp32 and A registers per m64 tile: n <= kBlockN - 32), so at 16-32 rows per tile the
  // dequant of tile kt + 1 overlaps the wgmmas of tile kt in the same warp. On the H200
  // (tools/PERF_LOG.md "Measured: the two branches' changes"): qwen3-30b-a3b T = 256 139.7 ->
  // 136.9 us, gpt-oss-120b T = 384 564.7 -> 554.8, kimi-k3.1-tp8 T = 1024 896.7 -> 877.4.
  MOEJIT_HD static constexpr int a_buffers(int n) {
    return kABuffers == 2 || n <= kBlockN - 32 ? 2 : 1;
  }
  static constexpr int kAtomsM = kBlockM / layout::kAtomRows;
  static constexpr int kInputRowBytes = kBlockK * 2;  // one 128-byte swizzle row per token
  static constexpr int kStageInputBytes = kBlockN * kInputRowBytes;
  static constexpr int kStageWeightBytes = kAtomsM * layout::kAtomBytes;
  static constexpr int kStageScaleBytes = kAtomsM * layout::kAtomScaleBytes;
  // Why rounded to 1024: every stage's input tile must start on a swizzle atom.
  static constexpr int kStageBytes =
      ceil_div(kStageInputBytes + kStageWeightBytes + kStageScaleBytes, 1024) * 1024;
  static constexpr int kRingBytes = kStages * kStageBytes;
  // The epilogue stages the CTA's outputs [kBlockN tokens][kOutFeatures] in the ring, rows
  // padded by 16 bytes (conflict-free stores from the accumulator layout), then writes whole
  // 16-byte pieces of each token's row.
  static constexpr int kOutFeatures = kAtomsM * Epilogue::kOutPerAtom;
  static constexpr int kStagingRowBytes =
      kOutFeatures * static_cast<int>(sizeof(typename Epilogue::Out)) + 16;
  static constexpr int kStagingBytes = kBlockN * kStagingRowBytes;
  // + token ids, input rows and (FC2) top-k weights, + 1024 to align the ring by hand.
  static constexpr int kSmemBytes =
      (kRingBytes > kStagingBytes ? kRingBytes : kStagingBytes) + 3 * kBlockN * 4 + 1024;

  static_assert(kBlockN == 64 || kBlockN == 128 || kBlockN == 256,
                "kBlockN must be 64, 128 or 256 (the wgmma shapes wgmma.cuh wraps)");
  static_assert(kRouteBlock >= 8 && kBlockN % kRouteBlock == 0 && kGroupBlocks <= 16 &&
                    (kGroupBlocks & (kGroupBlocks - 1)) == 0,
                "kRouteBlock must be kBlockN / 1, 2, 4, 8 or 16, and at least 8 (a route block)");
  static_assert(kWarpGroups >= 1 && kThreads <= 1024, "kWarpGroups must be 1..8");
  static_assert(kWgTilesM >= 1 && kWgTilesM <= 2,
                "kWgTilesM must be 1 or 2: each m64 tile holds kBlockN / 2 fp32 registers");
  static_assert(kStages >= 3,
                "kStages must be >= 3: the next tile lands while one is read and one refills");
  static_assert(kSmemBytes <= 227 * 1024,
                "shared memory over the sm_90 limit (227 KB): lower kStages or kBlockN");
  static_assert(kMinBlocksPerSm >= 1, "kMinBlocksPerSm must be >= 1");
  static_assert(kStagingRowBytes % 16 == 0, "a staged output row must be whole 16-byte pieces");
  static_assert(kKSplits >= 1 && kKSplits <= kMaxKSplits, "kKSplits must be in 1..kMaxKSplits");
  static_assert(kKSplits == 1 || (!Epilogue::kGatherTokens && !Epilogue::kOutBf16),
                "K splits are for FC2 with fp32 rows only (moe_gemm.cuh's MoeGemmTraits)");
};

// One CTA's tile of the route's group list (route_params.cuh group_tiles): block < 0 past the
// groups used.
struct GroupTile {
  i32 block;   // first route block
  i32 rows;    // real rows, a prefix of the group's kBlockN
  i32 expert;  // local expert
};
__device__ __forceinline__ GroupTile group_tile(const MoeGemmParams& p, i32 group) {
  const int2 t = *reinterpret_cast<const int2*>(p.group_tiles + 2 * group);
  return {t.x, t.y >> 16, t.y & 0xffff};
}

namespace wg_detail {

template <int kV>
struct Int {
  static constexpr int kValue = kV;
};

// One CTA tile: kN tokens (route rows row0 .. row0 + kN - 1, those from row0 + limit on
// treated as padding: they belong to the next expert) x the CTA's kBlockM weight rows, over all
// of K, then the epilogue.
// With K splits, the CTA's K tiles are kt0 .. kt0 + k_tiles - 1 and its outputs go to row set
// `split` (kKSplits == 1: all of K, set 0).
template <class T, int kN>
__device__ __forceinline__ void gemm_tile(const MoeGemmParams& p, const MoeGemmChain& chain,
                                          i32 expert, i32 row0, i32 limit, i32 m_atom0, i32 split,
                                          i32 kt0, i32 k_tiles, u8* smem, u32 smem_base,
                                          i32* s_ids, i32* s_rows) {
  using Epi = typename T::Epilogue;
  const i32 tid = static_cast<i32>(threadIdx.x);
  const i32 lane = tid & 31;
  const i32 warp = tid >> 5;
  const i32 wg = warp >> 2;  // warpgroup
  const i32 wq = warp & 3;   // warp inside the warpgroup: its 16-row strip of each m64 tile
  const i32 g = lane >> 2;

  BlockRows<kN, T::kThreads> rows;  // to shared memory after the weight prologue
  rows.load(p, tid, row0, limit);

  const layout::Dims dims{p.m_atoms, p.k_atoms};

  // Why no evict-first hint (unlike moe_gemm.cuh): at these T an expert's weights are read
  // again by the CTAs of its other route blocks, so they should stay in L2 a while.
  // Why running pointers: each thread copies the same chunk positions of every K tile, and
  // tiles are fetched in order, so a copy is one pointer bump.
  // A strip past m_atoms only feeds accumulator rows the epilogue never stores (rows and
  // columns of D are independent), so it copies the expert's strip 0 at full size. Padding
  // token rows are zero-filled without a read instead (src-size 0): copying a real row there
  // measured 2x slower at T = 1000 (every padding row of every CTA reading one hot line), and
  // K past in_features must be zeros (0 x Inf would poison real columns).
  constexpr i32 kChunksW = T::kStageWeightBytes / 16;  // then kChunksS scale chunks
  constexpr i32 kChunksS = T::kStageScaleBytes / 16;
  constexpr i32 kNW = ceil_div(kChunksW, T::kThreads);
  constexpr i32 kNS = ceil_div(kChunksS, T::kThreads);
  const u8* w_src[kNW];
  const u8* s_src[kNS];
#pragma unroll
  for (i32 i = 0; i < kNW; ++i) {
    const i32 c = tid + i * T::kThreads;
    const i32 ma = m_atom0 + c / 32;
    w_src[i] = p.weights +
               layout::atom_index(dims, expert, ma < p.m_atoms ? ma : 0, kt0) * layout::kAtomBytes +
               (c % 32) * 16;
  }
#pragma unroll
  for (i32 i = 0; i < kNS; ++i) {
    const i32 c = tid + i * T::kThreads;
    const i32 ma = m_atom0 + c / 2;
    s_src[i] = p.scales +
               layout::atom_index(dims, expert, ma < p.m_atoms ? ma : 0, kt0) *
                   layout::kAtomScaleBytes +
               (c % 2) * 16;
  }
  // Copies the CTA's K tile kt (kt0 + kt of the matrix) into `stage`.
  auto load_weights = [&](i32 stage, i32 kt) {
    const u32 dst = smem_base + stage * T::kStageBytes + T::kStageInputBytes;
#pragma unroll
    for (i32 i = 0; i < kNW; ++i) {
      const i32 c = tid + i * T::kThreads;
      if (kChunksW % T::kThreads == 0 || c < kChunksW) {
        ptx::cp_async_16(dst + c * 16, w_src[i] + kt * layout::kAtomBytes, 16u);
      }
    }
#pragma unroll
    for (i32 i = 0; i < kNS; ++i) {
      const i32 c = tid + i * T::kThreads;
      if (kChunksS % T::kThreads == 0 || c < kChunksS) {
        ptx::cp_async_16(dst + T::kStageWeightBytes + c * 16,
                         s_src[i] + kt * layout::kAtomScaleBytes, 16u);
      }
    }
  };
  // Copy i of a thread is chunk j = tid % 8 of token row n = tid / 8 + i * kThreads / 8; as
  // kThreads / 8 is a multiple of 8, the swizzle (j ^ n % 8) and so the offset inside a stage
  // differ between copies by a constant.
  constexpr i32 kChunksPerRow = T::kInputRowBytes / 16;
  constexpr i32 kChunksInput = kN * kChunksPerRow;
  constexpr i32 kNI = ceil_div(kChunksInput, T::kThreads);
  constexpr i32 kRowsPerCopy = T::kThreads / kChunksPerRow;  // rows between a thread's copies
  static_assert(kChunksPerRow == 8 && kRowsPerCopy % 8 == 0,
                "a thread's input copies must share one swizzle phase");
  static_assert(kNI <= 32, "one bit per input copy of a thread");
  const i32 in_j = tid % kChunksPerRow;
  const u32 in_dst = static_cast<u32>((tid / kChunksPerRow) * T::kInputRowBytes +
                                      ((in_j ^ ((tid / kChunksPerRow) & 7)) * 16));
  // Element offsets of the copies' sources from p.input, + 64 per tile, from the CTA's first K
  // tile kt0. 32 bits: the planner takes this tile only for inputs under 2^32 elements
  // (moe_plan.cpp wgmma_offsets_fit).
  u32 in_off[kNI];
  u32 in_real = 0;  // bit i: copy i is of a real token row (else zero-filled, nothing read)
  auto setup_inputs = [&] {
#pragma unroll
    for (i32 i = 0; i < kNI; ++i) {
      const i32 n = (tid / kChunksPerRow + i * kRowsPerCopy) % kN;
      const i32 row = s_rows[n];
      in_real |= (row >= 0 ? 1u : 0u) << i;
      in_off[i] = static_cast<u32>((row >= 0 ? static_cast<i64>(row) * p.ld_input : 0) + in_j * 8 +
                                   kt0 * T::kBlockK);
    }
  };
  // Copies the CTA's K tile kt (the one after the previous call's) into `stage`.
  auto load_inputs = [&](i32 stage, i32 kt) {
    const u32 dst = smem_base + stage * T::kStageBytes + in_dst;
    // All ones where this thread's chunk lies inside K, else 0: it masks the bytes (zero-filled
    // past K) and the source offset (so no address past a row is formed). Padding rows' offsets
    // stay inside row 0, which always exists.
    const u32 k_mask = in_j * 8 < p.in_features - (kt0 + kt) * T::kBlockK ? ~0u : 0u;
#pragma unroll
    for (i32 i = 0; i < kNI; ++i) {
      const i32 c = tid + i * T::kThreads;
      if (kChunksInput % T::kThreads == 0 || c < kChunksInput) {
        ptx::cp_async_16(dst + i * kRowsPerCopy * T::kInputRowBytes, p.input + (in_off[i] & k_mask),
                         ((in_real >> i) & 1u) * 16u & k_mask);
        in_off[i] += T::kBlockK;
      }
    }
  };

  // Prologue: weights first (they do not depend on the previous kernel), then inputs.
#pragma unroll
  for (i32 s = 0; s < T::kStages - 1; ++s) {
    if (s < k_tiles) load_weights(s, s);
  }
  if constexpr (T::kEarlyWeights) {
    wait_for_inputs<T::kThreads>(chain);
    ::moejit::kern::ptx::launch_dependents();
  }
  rows.template store<Epi::kGatherTokens>(p, tid, row0, s_ids, s_rows);
  __syncthreads();  // s_rows visible to every thread (and FC1's rows, after wait_for_inputs)
  if constexpr (!Epi::kGatherTokens) {
    // FC2: the top-k weight of each row (0 for padding), after s_rows, landing with the first
    // stage, so the epilogue does not wait a round trip for them. Why from s_ids, not `rows`:
    // keeping `rows` live to here made ptxas spill the bias instances.
    static_assert(kN <= T::kThreads, "one top-k weight per thread");
    if (tid < kN) copy_topk_weight(p, s_ids[tid], ptx::smem_u32(s_rows + T::kBlockN + tid));
  }
  setup_inputs();
#pragma unroll
  for (i32 s = 0; s < T::kStages - 1; ++s) {
    if (s < k_tiles) load_inputs(s, s);
    ptx::cp_async_commit();
  }

  float acc[T::kWgTilesM][kN / 2];
#pragma unroll
  for (i32 i = 0; i < T::kWgTilesM; ++i)
#pragma unroll
    for (i32 r = 0; r < kN / 2; ++r) acc[i][r] = 0.0f;

  // Why no skipping of m64 tiles past m_atoms: a branch around wgmma makes ptxas serialize
  // every wgmma of the kernel; such strips copy strip 0 and only cost one partial tile.
  u32 a_lane[T::kWgTilesM];  // this lane's 16 bytes of its strip, inside a stage
  u32 s_lane[T::kWgTilesM];  // this lane's scale word
#pragma unroll
  for (i32 i = 0; i < T::kWgTilesM; ++i) {
    const i32 strip = (wg * T::kWgTilesM + i) * 4 + wq;
    a_lane[i] =
        static_cast<u32>(T::kStageInputBytes + strip * layout::kAtomBytes + lane * 16);
    s_lane[i] = static_cast<u32>(T::kStageInputBytes + T::kStageWeightBytes +
                                 strip * layout::kAtomScaleBytes + g * 4);
  }
  // The A fragments of a whole K tile (4 k16 steps), in kSets register sets: tile kt uses set
  // kt % kSets (with two, tile kt + 1 is dequantized while the tensor core runs tile kt).
  constexpr int kSets = T::a_buffers(kN);
  u32 a[kSets][T::kWgTilesM][4][4];
  auto dequant_tile = [&](u32 stage, auto parity) {
    constexpr int kBuf = decltype(parity)::kValue % kSets;
#pragma unroll
    for (i32 i = 0; i < T::kWgTilesM; ++i) {
      u32 w[4];
      ptx::lds128(stage + a_lane[i], w);
      const u32 sw = ptx::lds32(stage + s_lane[i]);
      const u32 f0 = mxfp4::group_factors<0>(sw), f1 = mxfp4::group_factors<1>(sw);
      // Why <true>: here ptxas moved left shifts to the ALU (mxfp4::shift says why and what it
      // measured).
#pragma unroll
      for (i32 s = 0; s < 4; ++s) {  // k16 steps; scale group s / 2
        mxfp4::dequant_step<true>(w[s], s < 2 ? f0 : f1, a[kBuf][i][s]);
      }
    }
  };
  auto stage_addr = [&](i32 kt) {
    return smem_base + static_cast<u32>((kt % T::kStages) * T::kStageBytes);
  };
  // Tile kt (parity kt % 2, fragments in a[kBuf]): issue its wgmmas, then prepare tile kt + 1
  // while they run.
  auto step = [&](i32 kt, auto parity) {
    constexpr int kParity = decltype(parity)::kValue;
    constexpr int kBuf = kParity % kSets;
    const u64 desc = wgmma::desc_sw128(stage_addr(kt));
    wgmma::fence();
#pragma unroll
    for (i32 s = 0; s < 4; ++s) {
#pragma unroll
      for (i32 i = 0; i < T::kWgTilesM; ++i) {
        // Why + 2 s: the descriptor holds the address >> 4, and a k16 step is 32 bytes.
        wgmma::mma<kN>(acc[i], a[kBuf][i][s], desc + 2 * s);
      }
    }
    wgmma::commit();
    // With two register sets, tile kt - 1's wgmmas are done (its stage and its set are free)
    // once at most this tile's group runs; with one, this tile's must be done too, as tile
    // kt + 1 overwrites its registers. The barrier makes that true for every warpgroup and
    // lands tile kt + 1.
    wgmma::wait<kSets - 1>();
    ptx::cp_async_wait<T::kStages - 3>();
    __syncthreads();
    const i32 next = kt + T::kStages - 1;
    if (next < k_tiles) {
      load_weights(next % T::kStages, next);
      load_inputs(next % T::kStages, next);
    }
    ptx::cp_async_commit();
    // Why: the copies above diverge where a stage's chunk count is not a multiple of the
    // thread count, and every wgmma instruction needs its whole warp converged.
    __syncwarp();
    if (kt + 1 < k_tiles) dequant_tile(stage_addr(kt + 1), Int<kParity ^ 1>{});
  };

  ptx::cp_async_wait<T::kStages - 2>();
  __syncthreads();
  dequant_tile(stage_addr(0), Int<0>{});
  for (i32 kt = 0; kt < k_tiles; kt += 2) {
    step(kt, Int<0>{});
    if (kt + 1 < k_tiles) step(kt + 1, Int<1>{});
  }
  wgmma::wait<0>();
#pragma unroll
  for (i32 i = 0; i < T::kWgTilesM; ++i) wgmma::fence_operands(acc[i]);
  ptx::cp_async_wait<0>();

  // Epilogue: values into the staging tile (the ring, free once every warp is past its last
  // wgmma), then whole 16-byte pieces of each real token's row to the output.
  using Out = typename Epi::Out;
  const float* const s_weights = reinterpret_cast<const float*>(s_rows + T::kBlockN);  // FC2
  __syncthreads();
  // Why re-read: with two m64 tiles a warpgroup (64 fp32 accumulators and 32 A registers a
  // thread) ptxas kept the strip index, the expert and the first row live through the main loop
  // and spilled them; read again here (the CTA's group tile) they are not.
  const i32 e_tid = ::moejit::kern::ptx::thread_index_reread();
  const GroupTile e_group = group_tile(p, cta_tile().block);
  const i32 e_expert = e_group.expert;
  const i32 e_row0 = e_group.block * T::kRouteBlock;
  const i32 e_wg = e_tid >> 7;
  const i32 e_wq = (e_tid >> 5) & 3;
  const i32 e_g = (e_tid & 31) >> 2;
  const i32 t = e_tid & 3;
  // FC2: the top-k weights of this lane's token columns, read before any staging store up to
  // 32 tokens. Why: read beside the stores, each weight's shared load cannot move above the
  // stores before it (both are shared memory), so the multiplies wait on them one by one. Why
  // not at 48-64 tokens: there the 12-16 more live registers made ptxas spill.
  constexpr bool kHoistWeights = !Epi::kGatherTokens && kN <= 32;
  float weights[kHoistWeights ? kN / 4 : 1];
  if constexpr (kHoistWeights) {
#pragma unroll
    for (i32 c = 0; c < kN / 4; ++c) weights[c] = s_weights[8 * (c / 2) + 2 * t + c % 2];
  }
#pragma unroll
  for (i32 i = 0; i < T::kWgTilesM; ++i) {
    const i32 strip = (e_wg * T::kWgTilesM + i) * 4 + e_wq;  // inside the CTA
    const i32 m_atom = m_atom0 + strip;
    if constexpr (Epi::kGatherTokens) {
      // FC1: this lane's output j (gate row g, up row g + 8 of the strip) for 2 tokens per slice.
      const i32 f = strip * layout::kGateUpRows + e_g;
      const i32 j = m_atom * layout::kGateUpRows + e_g;
      // Why clamped, not a conditional load: outputs past out_features are never stored, and
      // ptxas kept the conditional load's 0 in local memory across the main loop.
      const u32 bias = Epi::bias(p, e_expert, j < p.out_features ? j : p.out_features - 1);
#pragma unroll
      for (i32 s8 = 0; s8 < kN / 8; ++s8) {
#pragma unroll
        for (i32 h = 0; h < 2; ++h) {
          const i32 n = 8 * s8 + 2 * t + h;
          reinterpret_cast<Out*>(smem + n * T::kStagingRowBytes)[f] =
              Epi::value(acc[i][4 * s8 + h], acc[i][4 * s8 + 2 + h], bias);
        }
      }
    } else {
      // FC2: this lane's outputs g and g + 8 of the strip for 2 tokens per slice. The bias
      // column is clamped as FC1's (outputs past out_features are never stored): with a
      // conditional load ptxas kept its 0 in local memory in the N = 64 instance.
      float bias[2];
#pragma unroll
      for (i32 r = 0; r < 2; ++r) {
        const i32 col = m_atom * layout::kAtomRows + e_g + 8 * r;
        bias[r] = Epi::bias(p, e_expert, col < p.out_features ? col : p.out_features - 1);
        if constexpr (T::kKSplits > 1) bias[r] = split == 0 ? bias[r] : 0.0f;  // added once a row
      }
#pragma unroll
      for (i32 s8 = 0; s8 < kN / 8; ++s8) {
#pragma unroll
        for (i32 h = 0; h < 2; ++h) {
          const i32 n = 8 * s8 + 2 * t + h;
          float weight;
          if constexpr (kHoistWeights) {
            weight = weights[2 * s8 + h];
          } else {
            weight = s_weights[n];
          }
          Out* row = reinterpret_cast<Out*>(smem + n * T::kStagingRowBytes);
#pragma unroll
          for (i32 r = 0; r < 2; ++r) {
            row[strip * layout::kAtomRows + e_g + 8 * r] =
                Epi::value(acc[i][4 * s8 + 2 * r + h], bias[r], weight);
          }
        }
      }
    }
  }
  __syncthreads();
  constexpr i32 kPerPiece = 16 / static_cast<i32>(sizeof(Out));
  constexpr i32 kPiecesPerRow = T::kOutFeatures / kPerPiece;
  const i32 f_base = m_atom0 * Epi::kOutPerAtom;
  Out* const out = static_cast<Out*>(p.output);
  // Whole pieces need 16-byte aligned rows; otherwise (never for the planner's shapes) the
  // same values go out one element at a time.
  const bool aligned = p.ld_output % kPerPiece == 0 && reinterpret_cast<u64>(out) % 16 == 0;
  for (i32 c = tid; c < kN * kPiecesPerRow; c += T::kThreads) {
    const i32 n = c / kPiecesPerRow;
    const i32 f0 = f_base + (c % kPiecesPerRow) * kPerPiece;
    if (s_ids[n] < 0 || f0 >= p.out_features) continue;
    const u8* src = smem + n * T::kStagingRowBytes + (c % kPiecesPerRow) * 16;
    // Split s's rows follow split s - 1's: blocks * kBlockN rows a set (the host sizes out2).
    const i64 set_row0 =
        T::kKSplits == 1 ? 0 : static_cast<i64>(split) * p.blocks * T::kBlockN;
    Out* dst = out + (set_row0 + e_row0 + n) * p.ld_output + f0;
    if (aligned && f0 + kPerPiece <= p.out_features) {
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
    } else {
      for (i32 e = 0; e < kPerPiece && f0 + e < p.out_features; ++e) {
        dst[e] = reinterpret_cast<const Out*>(src)[e];
      }
    }
  }
}

}  // namespace wg_detail

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, Traits::kMinBlocksPerSm)
    moe_gemm_wg(const MoeGemmParams p, const MoeGemmChain chain) {
  using T = Traits;
  extern __shared__ __align__(1024) u8 smem_raw[];
  const u32 raw_base = ptx::smem_u32(smem_raw);
  const u32 smem_base = (raw_base + 1023u) & ~1023u;
  u8* const smem = smem_raw + (smem_base - raw_base);
  i32* s_ids = reinterpret_cast<i32*>(smem + (T::kSmemBytes - 1024 - 3 * T::kBlockN * 4));
  i32* s_rows = s_ids + T::kBlockN;

  if constexpr (!T::kEarlyWeights) {
    prefetch_first_weights<T::kAtomsM>(p);
    ::moejit::kern::ptx::grid_dependency_wait();
    ::moejit::kern::ptx::launch_dependents();
  }
  const CtaTile cta = cta_tile();
  // With K splits, x = split * m_tiles + m_tile (the host's grid: m_tiles * kKSplits in x), and
  // split s takes the s-th range of ceil(k_atoms / kKSplits) K tiles (one atom column each).
  const i32 m_tiles = ceil_div(p.m_atoms, T::kAtomsM);
  const i32 split = T::kKSplits == 1 ? 0 : cta.m_tile / m_tiles;
  const i32 m_atom0 = (T::kKSplits == 1 ? cta.m_tile : cta.m_tile % m_tiles) * T::kAtomsM;
  const i32 split_tiles = ceil_div(p.k_atoms, T::kKSplits);
  const i32 kt0 = split * split_tiles;
  const i32 k_tiles = T::kKSplits == 1 ? p.k_atoms : max(0, min(p.k_atoms - kt0, split_tiles));
  if (cta.block >= p.blocks) return;  // the y x z rectangle's last groups
  const GroupTile group = group_tile(p, cta.block);
  if (group.block < 0) return;  // past the groups route used: the grid's tail
  const i32 expert = group.expert;
  const i32 row0 = group.block * T::kRouteBlock;
  // Rows from row0 + limit on are padding or the next expert's.
  const i32 limit = group.rows;
  // Real rows are a prefix of the group's (route pads only the end of an expert's last block), so
  // the tile runs at the narrowest wgmma N in quarters of kBlockN that covers them: an expert's
  // last tile multiplies at most kBlockN / 4 - 1 padding rows. Why a ballot, not
  // ceil_div(limit, kQuarter): its count is warp-uniform to ptxas, so the branch to the width
  // instances is too; from the loaded value ptxas spilled 4 bytes in the N = 64 instance's loop.
  const i32 lane = static_cast<i32>(threadIdx.x) & 31;
  const i32 quarters = __popc(__ballot_sync(~0u, lane * T::kQuarter < limit));
  auto tile = [&](auto n) {
    wg_detail::gemm_tile<T, decltype(n)::kValue>(p, chain, expert, row0, limit, m_atom0, split,
                                                 kt0, k_tiles, smem, smem_base, s_ids, s_rows);
  };
  if (quarters == 4) {
    tile(wg_detail::Int<T::kBlockN>{});
  } else if (quarters == 3) {
    tile(wg_detail::Int<3 * T::kQuarter>{});
  } else if (quarters == 2) {
    tile(wg_detail::Int<2 * T::kQuarter>{});
  } else {
    tile(wg_detail::Int<T::kQuarter>{});
  }
  if constexpr (T::Epilogue::kGatherTokens) {
    __syncthreads();  // every thread's FC1 stores
    signal_stored(chain);
  }
}

}  // namespace moejit::kern::moe
