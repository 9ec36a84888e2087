// libmoejit kernels/moe: kernel arguments of the marlin_moe family (repack and grouped GEMM).
// Plain POD structs passed by value; this header compiles under NVRTC, nvcc and a host C++
// compiler alike, so the ops layer fills exactly the struct the kernel reads.
#pragma once

#include <moejit/kern/moe/types.cuh>

namespace moejit::kern::moe {

// One MXFP4 source matrix in a checkpoint: row-major nibble bytes (low nibble = even K element)
// and one E8M0 byte per 32 K elements. Strides are in bytes and let one struct describe
// gpt-oss's interleaved w13 (gate = rows 2j, up = rows 2j+1: base + row_stride / 2 for up, row
// stride doubled) as well as DeepSeek's separate w1 / w3 / w2.
struct Mxfp4Source {
  const u8* blocks;          // nibble bytes of expert 0, row 0
  const u8* scales;          // scale bytes of expert 0, row 0
  i64 blocks_row_stride;     // bytes from one row to the next
  i64 blocks_expert_stride;  // bytes from one expert to the next
  i64 scales_row_stride;     // bytes
  i64 scales_expert_stride;  // bytes
};

// repack_mxfp4: checkpoint matrices -> kernel layout (layout.cuh), padding written.
struct RepackParams {
  Mxfp4Source src[2];  // FC1: [0] gate rows, [1] up rows (j = 0..inter-1); FC2: [0] = W2
  u8* weights;         // kernel layout nibbles, [experts][m_atoms][k_atoms][512]
  u8* scales;          // kernel layout scales, [experts][m_atoms][k_atoms][32]
  i32 rows;            // source rows per matrix: FC1 inter, FC2 hidden
  i32 k;               // source K (multiple of 32): FC1 hidden, FC2 inter
  i32 m_atoms;         // layout::fc1_dims / fc2_dims of (inter, hidden)
  i32 k_atoms;
  i32 num_experts;    // experts in this call (source experts 0..num_experts-1)
  i32 expert_offset;  // destination expert of source expert 0 (per-expert checkpoints)
  i32* bad_scales;    // optional: += count of scale bytes outside [kScaleMin, kScaleMax]
};

// marlin_moe grouped GEMM, used twice: FC1 (W13 x hidden -> activation -> inter) and FC2
// (W2 x inter -> + bias, * top-k weight -> out2). Rows come from route (route.cuh /
// route_params.cuh) run with block size = the GEMM's kBlockN (the warpgroup tile: its route
// block): sorted_rows holds token * top_k + slot or -1 (padding), block_expert the local expert
// of each block and -1 for every provisioned block past the last one used (those CTAs exit at
// once), and for the warpgroup tile group_tiles its CTA tiles (route GroupRows = its kBlockN).
// Why a new field needs a register check: 32 more bytes here made ptxas spill 8-12 bytes in the
// 128-register warpgroup tiles (moe_gemm_wg.cuh), whether they read the fields or not
// (tools/PERF_LOG.md "The GEMMs route themselves"); a second kernel argument did not.
// The GEMMs' grids hold M tiles in x and route blocks in y and z, at most this many in y (the
// limit of grid.y): block = z * kGridBlocksY + y (moe_gemm.cuh's cta_tile).
inline constexpr i32 kGridBlocksY = 65535;

// The most CTAs an FC2 M tile may split its K over (MoeGemmTraits::kKSplits; the planner's
// MarlinMoeParams::k_splits).
inline constexpr i32 kMaxKSplits = 8;

struct MoeGemmParams {
  const u8* weights;          // kernel layout nibbles of all local experts
  const u8* scales;           // kernel layout scales
  const u16* bias;            // optional bf16 bits; FC1 [E][inter][2] (gate, up: gpt-oss's
                              // [E, 2I] as stored), FC2 [E][hidden]; nullptr when absent
  const u16* input;           // bf16 bits; FC1: hidden [T][ld_input] gathered by token,
                              // FC2: inter [padded rows][ld_input]
  void* output;               // FC1: inter bf16 [padded rows][ld_output];
                              // FC2: out2 [padded rows][ld_output] fp32 or bf16
  const i32* sorted_rows;     // [blocks * BlockN] token * top_k + slot, or -1
  const i32* block_expert;    // [blocks] local expert of each block of BlockN rows, or -1
  const i32* group_tiles;     // warpgroup tile: [2 * blocks] route group_tiles (else unused)
  const float* topk_weights;  // FC2: [T * top_k] router weight of (token, slot)
  i64 ld_input;               // elements between input rows (>= in_features, multiple of 8)
  i64 ld_output;              // elements between output rows
  i32 out_features;           // FC1: inter (gate/up pairs), FC2: hidden
  i32 in_features;            // real K: FC1 hidden, FC2 inter (multiple of 32)
  i32 m_atoms;                // kernel layout dims of this matrix
  i32 k_atoms;
  i32 top_k;  // slots per token (sorted id -> token)
  // The tiles the grid's y x z provisions: route blocks (route_max_blocks; moe_gemm.cuh), or
  // groups for the warpgroup tile (route_max_groups); CTAs past them exit.
  i32 blocks;
  // L2 prefetch before the grid wait (FC1 under PDL; all 0 = none): CTA (b, m) with
  // b < prefetch_experts and m < prefetch_m_tiles asks L2 for the first prefetch_k_atoms K atoms
  // of every strip of expert b's M tile m, and their scales (moe_gemm.cuh's
  // prefetch_first_weights). prefetch_k_atoms <= k_atoms, prefetch_experts <= local experts.
  i32 prefetch_experts;
  i32 prefetch_m_tiles;
  i32 prefetch_k_atoms;
};

// How long a CTA may wait for another CTA's counter (MoeGemmChain, decode_moe's per-expert FC1
// counts) before the wait is taken for one that will never end: far beyond any layer (a whole
// layer takes milliseconds at T = 16384), so only a broken workspace contract (two calls in
// flight on one workspace, include/moejit/moe.hpp) or an earlier fault gets there.
inline constexpr u64 kCounterWaitLimitNs = 10ull * 1000 * 1000 * 1000;

// The order between a layer's two GEMMs, per tile instead of per grid: FC2's CTA of tile b (a
// route block, or a group for the warpgroup tile) needs only FC1's outputs of tile b, i.e. FC1's
// M tiles of that tile. FC1's CTAs count their stores in done[b] (a release add after a barrier
// behind every thread's stores); FC2's CTAs wait until done[b] == wait_count (FC1's M tiles)
// instead of waiting for FC1's whole grid, so FC2 works on the SMs FC1's last wave leaves idle.
// The route zeroes done[0, max_blocks) (route_params.cuh tile_done). No deadlock: FC1's CTAs
// trigger their dependents at their start, right after their wait for the route (moe_gemm.cuh),
// so FC2 launches only once every FC1 CTA is running or done. A second kernel argument, not
// MoeGemmParams fields: see the register note above.
struct MoeGemmChain {
  u32* signal = nullptr;      // FC1: done counters to add to (nullptr: none)
  const u32* wait = nullptr;  // FC2: done counters to wait on (nullptr: wait for FC1's grid)
  u32 wait_count = 0;         // FC2: FC1's M tiles (the count a tile is complete at)
  // FC2: how long a tile's count may stay short before the wait is taken for one that will never
  // end (ptx.cuh wait_at_least: it traps). The op passes kCounterWaitLimitNs.
  u64 wait_limit_ns = 0;
};

}  // namespace moejit::kern::moe
