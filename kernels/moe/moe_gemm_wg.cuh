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
//   the CTA's gathered input rows (128-byte swizzle, zero-filled past in_features), its
//   weight atoms (verbatim) and their scales. Every thread
//   copies a share of each stage.
// - Per K tile kt a warpgroup issues the 4 k16 steps x kWgTilesM wgmmas of tile kt from
//   registers dequantized earlier, commits, waits until only that group runs (tile kt - 1
//   done), passes the CTA barrier (tile kt + 1 landed, tile kt - 1's stage free for the next
//   copy), then dequantizes tile kt + 1 (one 16-byte load and one scale word per lane and m64
//   tile, mxfp4::dequant_step) into the other register set while the tensor core works.
// - Route blocks: with kPairBlocks the route runs with blocks of kBlockN / 2 rows and a CTA
//   takes two consecutive blocks of one expert (N = kBlockN) or a lone last one (N =
//   kBlockN / 2), so padding is that of the half-size block.
// - Epilogue: after the last wait, the accumulators are in mma.sync's C order per 8-token
//   slice, so moe_gemm.cuh's Fc1Epilogue / Fc2Epilogue store them unchanged; one CTA owns each
//   output element (no split-K), so results are bitwise deterministic.
// - PDL: as moe_gemm.cuh (kEarlyWeights: weight prologue before griddepcontrol.wait).
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
          bool kPairBlocks_, bool kEarlyWeights_, class Epilogue_>
struct MoeGemmWgTraits {
  static constexpr int kBlockN = kBlockN_;          // tokens per CTA tile = wgmma N
  static constexpr int kWarpGroups = kWarpGroups_;  // warpgroups, each with its own weight rows
  static constexpr int kWgTilesM = kWgTilesM_;      // m64 tiles (64 weight rows) per warpgroup
  static constexpr int kStages = kStages_;          // cp.async ring depth (K tiles of 64)
  static constexpr int kMinBlocksPerSm = kMinBlocksPerSm_;  // occupancy target (register cap)
  // Route blocks of kBlockN / 2 rows; a CTA takes two consecutive blocks of one expert at
  // N = kBlockN, or a lone last block at N = kBlockN / 2 (half the padding of kBlockN blocks).
  static constexpr bool kPairBlocks = kPairBlocks_;
  static constexpr bool kEarlyWeights = kEarlyWeights_;  // weight prologue before PDL wait
  using Epilogue = Epilogue_;  // Fc1Epilogue<Act, bias> or Fc2Epilogue<bf16 out, bias>

  static constexpr int kRouteBlock = kPairBlocks ? kBlockN / 2 : kBlockN;  // route's block size
  static constexpr int kBlockM = 64 * kWarpGroups * kWgTilesM;  // weight rows per CTA
  static constexpr int kBlockK = layout::kAtomK;                // K per stage: one atom column
  static constexpr int kThreads = 128 * kWarpGroups;
  static constexpr int kAtomsM = kBlockM / layout::kAtomRows;
  static constexpr int kInputRowBytes = kBlockK * 2;  // one 128-byte swizzle row per token
  static constexpr int kStageInputBytes = kBlockN * kInputRowBytes;
  static constexpr int kStageWeightBytes = kAtomsM * layout::kAtomBytes;
  static constexpr int kStageScaleBytes = kAtomsM * layout::kAtomScaleBytes;
  // Why rounded to 1024: every stage's input tile must start on a swizzle atom.
  static constexpr int kStageBytes =
      ceil_div(kStageInputBytes + kStageWeightBytes + kStageScaleBytes, 1024) * 1024;
  // + token ids and input rows, + 1024 to align the ring by hand.
  static constexpr int kSmemBytes = kStages * kStageBytes + 2 * kBlockN * 4 + 1024;
  static constexpr int kChunksWeights = (kStageWeightBytes + kStageScaleBytes) / 16;

  static_assert(kBlockN == 64 || kBlockN == 128 || kBlockN == 256,
                "kBlockN must be 64, 128 or 256 (the wgmma shapes wgmma.cuh wraps)");
  static_assert(!kPairBlocks || kBlockN >= 128,
                "kPairBlocks needs kBlockN 128 or 256: a lone block runs at N = kBlockN / 2");
  static_assert(kWarpGroups >= 1 && kThreads <= 1024, "kWarpGroups must be 1..8");
  static_assert(kWgTilesM >= 1 && kWgTilesM <= 2,
                "kWgTilesM must be 1 or 2: each m64 tile holds kBlockN / 2 fp32 registers");
  static_assert(kStages >= 3,
                "kStages must be >= 3: a stage is refilled only after the wgmmas reading it");
  static_assert(kSmemBytes <= 227 * 1024,
                "shared memory over the sm_90 limit (227 KB): lower kStages or kBlockN");
  static_assert(kMinBlocksPerSm >= 1, "kMinBlocksPerSm must be >= 1");

  // Launch geometry (host or device): grid.x = route blocks provisioned, grid.y = M tiles.
  MOEJIT_HD static constexpr i32 m_tiles(i32 m_atoms) { return ceil_div(m_atoms, kAtomsM); }
};

namespace wg_detail {

template <int kV>
struct Int {
  static constexpr int kValue = kV;
};

// One CTA tile: kN tokens (route rows row0 .. row0 + kN - 1) x the CTA's kBlockM weight rows,
// over all of K, then the epilogue.
template <class T, int kN>
__device__ __forceinline__ void gemm_tile(const MoeGemmParams& p, i32 expert, i32 row0,
                                          i32 m_atom0, u32 smem_base, i32* s_ids, i32* s_rows) {
  using Epi = typename T::Epilogue;
  const i32 tid = static_cast<i32>(threadIdx.x);
  const i32 lane = tid & 31;
  const i32 warp = tid >> 5;
  const i32 wg = warp >> 2;  // warpgroup
  const i32 wq = warp & 3;   // warp inside the warpgroup: its 16-row strip of each m64 tile
  const i32 g = lane >> 2;

  for (i32 n = tid; n < kN; n += T::kThreads) {
    const i32 id = p.sorted_rows[row0 + n];
    s_ids[n] = id;
    s_rows[n] = id < 0 ? -1 : (Epi::kGatherTokens ? id / p.top_k : row0 + n);
  }

  const i32 k_tiles = p.k_atoms;
  const layout::Dims dims{p.m_atoms, p.k_atoms};

  // Why no evict-first hint (unlike moe_gemm.cuh): at these T an expert's weights are read
  // again by the CTAs of its other route blocks, so they should stay in L2 a while.
  // Why running pointers: each thread copies the same chunk positions of every K tile, and
  // tiles are fetched in order, so a copy is one pointer bump.
  // Why padding is read, not zero-filled: a padding token's column and a strip past m_atoms
  // only feed accumulators the epilogue never stores (columns and rows of D are independent),
  // so they copy a valid row (token row 0, the expert's strip 0) and need no per-copy size.
  // Only K past in_features must be zeros (0 x Inf would poison real columns): the last tile
  // checks it per copy.
  constexpr i32 kNW = ceil_div(T::kChunksWeights, T::kThreads);
  constexpr i32 kChunksW = T::kStageWeightBytes / 16;
  const u8* w_src[kNW];
  u32 w_step[kNW];
#pragma unroll
  for (i32 i = 0; i < kNW; ++i) {
    const i32 c = tid + i * T::kThreads;
    const bool is_scale = c >= kChunksW;
    const i32 cs = c - kChunksW;
    const i32 ma = m_atom0 + (is_scale ? cs / 2 : c / 32);
    const i64 atom = layout::atom_index(dims, expert, ma < p.m_atoms ? ma : 0, 0);
    w_step[i] = is_scale ? layout::kAtomScaleBytes : layout::kAtomBytes;
    w_src[i] = is_scale ? p.scales + atom * layout::kAtomScaleBytes + (cs % 2) * 16
                        : p.weights + atom * layout::kAtomBytes + (c % 32) * 16;
  }
  // Copies the K tile after the previous call's into `stage`.
  auto load_weights = [&](i32 stage) {
    const u32 dst = smem_base + stage * T::kStageBytes + T::kStageInputBytes;
#pragma unroll
    for (i32 i = 0; i < kNW; ++i) {
      const i32 c = tid + i * T::kThreads;
      if (T::kChunksWeights % T::kThreads == 0 || c < T::kChunksWeights) {
        ptx::cp_async_16(dst + c * 16, w_src[i], 16u);
        w_src[i] += w_step[i];
      }
    }
  };
  constexpr i32 kChunksPerRow = T::kInputRowBytes / 16;
  constexpr i32 kChunksInput = kN * kChunksPerRow;
  constexpr i32 kNI = ceil_div(kChunksInput, T::kThreads);
  const u16* in_src[kNI];
  u32 in_dst[kNI];  // swizzled offset inside a stage
  auto setup_inputs = [&] {
#pragma unroll
    for (i32 i = 0; i < kNI; ++i) {
      const i32 c = tid + i * T::kThreads;
      const i32 n = (c / kChunksPerRow) % kN;
      const i32 j = c % kChunksPerRow;
      const i32 row = s_rows[n];
      in_src[i] = p.input + (row >= 0 ? static_cast<i64>(row) * p.ld_input : 0) + j * 8;
      in_dst[i] = static_cast<u32>(n * T::kInputRowBytes + ((j ^ (n & 7)) * 16));
    }
  };
  // Copies K tile kt (the one after the previous call's) into `stage`.
  auto load_inputs = [&](i32 stage, i32 kt) {
    const u32 dst = smem_base + stage * T::kStageBytes;
    const i32 k_left = p.in_features - kt * T::kBlockK;  // K elements left in this tile
#pragma unroll
    for (i32 i = 0; i < kNI; ++i) {
      const i32 c = tid + i * T::kThreads;
      if (kChunksInput % T::kThreads == 0 || c < kChunksInput) {
        if (k_left >= T::kBlockK) {
          ptx::cp_async_16(dst + in_dst[i], in_src[i], 16u);
        } else {
          const bool ok = (c % kChunksPerRow) * 8 < k_left;
          ptx::cp_async_16(dst + in_dst[i], ok ? in_src[i] : p.input, ok ? 16u : 0u);
        }
        in_src[i] += T::kBlockK;
      }
    }
  };

  // Prologue: weights first (they do not depend on the previous kernel), then inputs.
#pragma unroll
  for (i32 s = 0; s < T::kStages - 1; ++s) {
    if (s < k_tiles) load_weights(s);
  }
  if constexpr (T::kEarlyWeights) {
    ::moejit::kern::ptx::grid_dependency_wait();
    ::moejit::kern::ptx::launch_dependents();
  }
  __syncthreads();  // s_rows visible to every thread
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
  // The A fragments of a whole K tile (4 k16 steps), double-buffered: tile kt + 1 is
  // dequantized while the tensor core runs tile kt.
  u32 a[2][T::kWgTilesM][4][4];
  auto dequant_tile = [&](u32 stage, auto buf) {
    constexpr int kBuf = decltype(buf)::kValue;
#pragma unroll
    for (i32 i = 0; i < T::kWgTilesM; ++i) {
      u32 w[4];
      ptx::lds128(stage + a_lane[i], w);
      const u32 sw = ptx::lds32(stage + s_lane[i]);
      const u32 f0 = mxfp4::scale_factor<0>(sw), f1 = mxfp4::scale_factor<1>(sw);
      const u32 f2 = mxfp4::scale_factor<2>(sw), f3 = mxfp4::scale_factor<3>(sw);
#pragma unroll
      for (i32 s = 0; s < 4; ++s) {  // k16 steps; scale group s / 2
        mxfp4::dequant_step(w[s], s < 2 ? f0 : f1, s < 2 ? f2 : f3, a[kBuf][i][s]);
      }
    }
  };
  auto stage_addr = [&](i32 kt) {
    return smem_base + static_cast<u32>((kt % T::kStages) * T::kStageBytes);
  };
  // Tile kt (fragments in a[kBuf]): issue its wgmmas, then prepare tile kt + 1 while they run.
  auto step = [&](i32 kt, auto buf) {
    constexpr int kBuf = decltype(buf)::kValue;
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
    // Tile kt - 1's wgmmas are done (its stage and a[kBuf ^ 1] are free) once at most this
    // tile's group runs; the barrier makes that true for every warpgroup and lands tile kt + 1.
    wgmma::wait<1>();
    ptx::cp_async_wait<T::kStages - 3>();
    __syncthreads();
    const i32 next = kt + T::kStages - 1;
    if (next < k_tiles) {
      load_weights(next % T::kStages);
      load_inputs(next % T::kStages, next);
    }
    ptx::cp_async_commit();
    // Why: the copies above diverge where a stage's chunk count is not a multiple of the
    // thread count, and every wgmma instruction needs its whole warp converged.
    __syncwarp();
    if (kt + 1 < k_tiles) dequant_tile(stage_addr(kt + 1), Int<kBuf ^ 1>{});
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

  const i32 t = lane & 3;
#pragma unroll
  for (i32 i = 0; i < T::kWgTilesM; ++i) {
    const i32 m_atom = m_atom0 + (wg * T::kWgTilesM + i) * 4 + wq;
    if (m_atom >= p.m_atoms) continue;
#pragma unroll
    for (i32 j = 0; j < kN / 8; ++j) {
      const float c[4] = {acc[i][4 * j], acc[i][4 * j + 1], acc[i][4 * j + 2], acc[i][4 * j + 3]};
#pragma unroll
      for (i32 h = 0; h < 2; ++h) {
        const i32 n = 8 * j + 2 * t + h;
        const i32 id = s_ids[n];
        if (id < 0) continue;
        Epi::store(p, expert, m_atom, g, static_cast<i64>(row0) + n, id, c, h);
      }
    }
  }
}

}  // namespace wg_detail

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, Traits::kMinBlocksPerSm)
    moe_gemm_wg(const MoeGemmParams p) {
  using T = Traits;
  extern __shared__ __align__(1024) u8 smem_raw[];
  const u32 raw_base = ptx::smem_u32(smem_raw);
  const u32 smem_base = (raw_base + 1023u) & ~1023u;
  i32* s_ids =
      reinterpret_cast<i32*>(smem_raw + (smem_base - raw_base) + T::kStages * T::kStageBytes);
  i32* s_rows = s_ids + T::kBlockN;

  if constexpr (!T::kEarlyWeights) {
    ::moejit::kern::ptx::grid_dependency_wait();
    ::moejit::kern::ptx::launch_dependents();
  }
  const i32 block = static_cast<i32>(blockIdx.x);
  const i32 m_atom0 = static_cast<i32>(blockIdx.y) * T::kAtomsM;
  const i32 expert = p.block_expert[block];
  if (expert < 0) return;
  if constexpr (T::kPairBlocks) {
    // The expert's blocks are consecutive: count those just before this one, 32 per round
    // (every warp computes the same answer). Odd: block - 1's CTA covers this block.
    const i32 lane = static_cast<i32>(threadIdx.x) & 31;
    i32 before = 0;
    for (;;) {
      const i32 q = block - 1 - before - lane;
      const u32 same = __ballot_sync(~0u, q >= 0 && p.block_expert[q] == expert);
      if (same != ~0u) {
        before += __ffs(~same) - 1;
        break;
      }
      before += 32;
    }
    if (before & 1) return;
    const bool pair =
        block + 1 < static_cast<i32>(gridDim.x) && p.block_expert[block + 1] == expert;
    if (!pair) {
      wg_detail::gemm_tile<T, T::kBlockN / 2>(p, expert, block * T::kRouteBlock, m_atom0,
                                               smem_base, s_ids, s_rows);
      return;
    }
  }
  wg_detail::gemm_tile<T, T::kBlockN>(p, expert, block * T::kRouteBlock, m_atom0, smem_base,
                                      s_ids, s_rows);
}

}  // namespace moejit::kern::moe
