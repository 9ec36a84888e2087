// route and combine: the arguments of their kernels (PODs, passed by value) and the sizes of
// every buffer route writes, as constexpr functions shared by the kernels, the ops that carve the
// workspace, and the CPU tests. Compiles as host C++17 (no CUDA headers), under nvcc and under
// NVRTC: builtin types only, no includes.
//
// What route produces, for N = T * K (token, slot) entries and B = BlockM:
//   expert_counts[E]            entries routed to each local expert
//   expert_block_offset[E + 1]  first GEMM block of each expert (exclusive scan of
//                               ceil(count / B)); [E] = total_blocks
//   sorted_rows[max_padded_rows] for each padded row r < total_blocks * B: the entry
//                               t * K + s it holds, or -1 for padding. Expert e owns rows
//                               [B * offset[e], B * offset[e + 1]): its entries first, in
//                               (token, slot) order, then -1 up to the block boundary.
//                               Rows >= total_blocks * B are NOT written: a consumer reads
//                               block_expert first and stops at -1.
//   block_expert[max_blocks]    local expert of each block b < total_blocks; -1 for every
//                               b in [total_blocks, max_blocks) (all written)
//   slot_row[N]                 for each entry t * K + s its row in sorted_rows, or -1 when
//                               the id is -1 or not local (it then contributes nothing)
//   total_blocks[1]             sum over experts of ceil(count / B)
//   tile_done[max_blocks]       all 0: the counters of the GEMMs' per-tile order (params.cuh
//                               MoeGemmChain), indexed by block, or by group for the warpgroup
//                               tile (max_groups <= max_blocks), reset for the FC1 that follows
// and, where the route is built with GroupRows = G > 0 (the warpgroup GEMM's token tile, a
// multiple of B: its CTAs take G / B consecutive blocks of one expert):
//   expert_group_offset[E + 1]  first group of each expert (exclusive scan of ceil(count / G));
//                               [E] = the groups used
//   group_tiles[2 * max_groups] for each group g < [E], two ints: the group's first block
//                               (offset[e] + j * G / B for group j of expert e) and
//                               (rows << 16) | e, rows = min(G, count - j * G) its real rows (a
//                               prefix of its G); both -1 for every g in [groups used,
//                               max_groups) (all written). max_groups = max_blocks(N, E, G).
// Local experts are ids in [expert_offset, expert_offset + E).
//
// The block bound. With n_e entries on expert e, sum n_e = M <= N and at most min(E, M)
// experts nonempty:  sum_e ceil(n_e / B) = sum_e floor((n_e + B - 1) / B)
//                    <= floor((M + min(E, M) * (B - 1)) / B)        (sum of floors <= floor of sum)
//                    <= floor((N + min(E, N) * (B - 1)) / B) = max_blocks(N, E, B).
// It is tight (one expert holds 1 + q * B + r entries, min(E, N) - 1 others hold one each), and
// never exceeds N (each nonempty expert needs at least one entry per block): with m = min(E, N)
// <= N, (N + m (B - 1)) / B <= (N + N (B - 1)) / B = N.
#pragma once

// Why no include: the ops and the CPU tests include this header with no kernel include path.
// The host/device marker is the one types.cuh defines, under the same guard.
#if !defined(MOEJIT_HD)
#if defined(__CUDACC__)
#define MOEJIT_HD __host__ __device__
#else
#define MOEJIT_HD
#endif
#endif

namespace moejit::kern::moe {

// Everything the route kernels read and write. The pointers are device pointers, normally
// carved from one workspace by route_workspace_layout(). Sizes in elements. The op checks
// before launching: T * K and route_max_padded_rows(T * K, E, B) fit int; expert_offset >= 0
// and expert_offset + E <= INT_MAX; route_single_kernel only when route_is_single_cta.
struct RouteParams {
  const int* topk_ids = nullptr;       // [T, K] int32 expert ids (global; -1 = none)
  int num_tokens = 0;                  // T (>= 0)
  int expert_offset = 0;               // global id of local expert 0 (>= 0; + E <= INT_MAX)
  int* expert_counts = nullptr;        // [E]
  int* expert_block_offset = nullptr;  // [E + 1], in blocks
  int* sorted_rows = nullptr;          // [route_max_padded_rows(N, E, B)]
  int* block_expert = nullptr;         // [route_max_blocks(N, E, B)]
  int* slot_row = nullptr;             // [N]
  int* total_blocks = nullptr;         // [1]
  int* chunk_base = nullptr;           // [route_num_chunks(N, C), E]: multi-CTA path only
  int* expert_group_offset = nullptr;  // [E + 1], in groups: GroupRows > 0 only
  int* group_tiles = nullptr;          // [2 * route_max_groups(N, E, G)]: GroupRows > 0 only
  unsigned* tile_done = nullptr;       // [route_max_blocks(N, E, B)], written 0
};

// combine: out[t, :] = sum over slots s = 0..K-1 in order of fc2_out[slot_row[t * K + s], :]
// (rows of -1 skipped), fp32 accumulation, rounded once to bf16. fc2_out is the FC2 output the
// grouped GEMM wrote per padded row with the top-k weight already applied (moe_gemm.cuh's
// Fc2Epilogue), fp32 or bf16. Vectorized: both leading dimensions and the base pointers must
// allow 16-byte access of 8 consecutive elements (ld_in a multiple of 4 for fp32 and of 8 for
// bf16, ld_out a multiple of 8, pointers 16-byte aligned), checked by the op.
struct CombineParams {
  const void* fc2_out = nullptr;  // [padded rows, ld_in] fp32, or bf16 bits
  const int* slot_row = nullptr;  // [T * K] from route, 16-byte aligned (the layout's is)
  unsigned short* out = nullptr;  // [T, ld_out] bf16 bits
  long long ld_in = 0;            // elements between rows of fc2_out (>= H)
  long long ld_out = 0;           // elements between rows of out (>= H)
  // Rows between FC2's row sets where it splits K (CombineTraits::kSplits > 1): the padded rows
  // of one set (route_max_padded_rows). Unused with one set.
  long long split_rows = 0;
  int num_tokens = 0;             // T
};

// max_blocks(N, E, B): the most GEMM blocks any routing of N entries over E experts can need
// (derivation above). 0 when N <= 0.
MOEJIT_HD constexpr long long route_max_blocks(long long rows, long long experts,
                                               long long block_m) {
  if (rows <= 0 || experts <= 0 || block_m <= 0) return 0;
  const long long nonempty = experts < rows ? experts : rows;
  return (rows + nonempty * (block_m - 1)) / block_m;
}

// Rows of sorted_rows the buffer must hold: max_blocks * B.
MOEJIT_HD constexpr long long route_max_padded_rows(long long rows, long long experts,
                                                    long long block_m) {
  return route_max_blocks(rows, experts, block_m) * block_m;
}

// Chunks of the multi-CTA path: ceil(N / C). 1 (the single-CTA path) when N <= C.
MOEJIT_HD constexpr long long route_num_chunks(long long rows, long long chunk_rows) {
  if (rows <= 0 || chunk_rows <= 0) return 1;
  return (rows + chunk_rows - 1) / chunk_rows;
}

// CTAs of route_scatter_kernel: one per chunk, and at least one warp per local expert for the
// padding fill. Why: the fill walks experts one warp each, three dependent global reads per
// expert, so two chunks' 32 warps over kimi-k3.1-tp8's 896 experts took 10 us (T = 96); the
// CTAs past the chunks only fill.
MOEJIT_HD constexpr long long route_scatter_ctas(long long rows, long long chunk_rows,
                                                 long long experts, long long block_threads) {
  const long long chunks = route_num_chunks(rows, chunk_rows);
  const long long warps = block_threads / 32 > 0 ? block_threads / 32 : 1;
  const long long fill = (experts + warps - 1) / warps;
  return chunks > fill ? chunks : fill;
}

// Groups of G rows the buffer must hold (GroupRows = G; 0 when G is 0: no groups): the block
// bound with G for B, as a group is ceil(count / G) per expert exactly like a block.
MOEJIT_HD constexpr long long route_max_groups(long long rows, long long experts,
                                               long long group_rows) {
  return group_rows > 0 ? route_max_blocks(rows, experts, group_rows) : 0;
}

// Whether N entries take the one-launch path (route_single_kernel): N <= C.
MOEJIT_HD constexpr bool route_is_single_cta(long long rows, long long chunk_rows) {
  return rows <= chunk_rows;
}

// Byte offsets of every route buffer inside one workspace, each aligned to kRouteAlign bytes,
// for one (N, E, B, C). The op sizes its workspace for its largest N and, because max_blocks
// falls and max_padded_rows grows with B, takes the largest `bytes` over the (T, B) pairs its
// plan can choose; any smaller call fits in the same allocation.
inline constexpr unsigned long long kRouteAlign = 256;

struct RouteWorkspaceLayout {
  unsigned long long expert_counts = 0;
  unsigned long long expert_block_offset = 0;
  unsigned long long sorted_rows = 0;
  unsigned long long block_expert = 0;
  unsigned long long slot_row = 0;
  unsigned long long total_blocks = 0;
  unsigned long long chunk_base = 0;  // [route_num_chunks(N, C), E] (one row for N <= C)
  unsigned long long expert_group_offset = 0;  // [E + 1] (empty when G is 0)
  unsigned long long group_tiles = 0;          // [2 * max_groups] (empty when G is 0)
  unsigned long long tile_done = 0;            // [max_blocks]
  unsigned long long bytes = 0;                // total size
};

MOEJIT_HD constexpr unsigned long long route_align_up(unsigned long long bytes) {
  return (bytes + kRouteAlign - 1) / kRouteAlign * kRouteAlign;
}

// group_rows: the route's GroupRows (0: no group arrays).
MOEJIT_HD constexpr RouteWorkspaceLayout route_workspace_layout(long long rows, long long experts,
                                                                long long block_m,
                                                                long long chunk_rows,
                                                                long long group_rows = 0) {
  const unsigned long long n = rows > 0 ? static_cast<unsigned long long>(rows) : 0ull;
  const unsigned long long e = experts > 0 ? static_cast<unsigned long long>(experts) : 0ull;
  const unsigned long long blocks =
      static_cast<unsigned long long>(route_max_blocks(rows, experts, block_m));
  const unsigned long long padded =
      static_cast<unsigned long long>(route_max_padded_rows(rows, experts, block_m));
  // Why always: E ints when the single-CTA path runs, and the op may then take either path.
  const unsigned long long chunks =
      static_cast<unsigned long long>(route_num_chunks(rows, chunk_rows));
  const unsigned long long kInt = 4;
  RouteWorkspaceLayout layout;
  unsigned long long at = 0;
  layout.expert_counts = at;
  at = route_align_up(at + e * kInt);
  layout.expert_block_offset = at;
  at = route_align_up(at + (e + 1) * kInt);
  layout.sorted_rows = at;
  at = route_align_up(at + padded * kInt);
  layout.block_expert = at;
  at = route_align_up(at + blocks * kInt);
  layout.slot_row = at;
  at = route_align_up(at + n * kInt);
  layout.total_blocks = at;
  at = route_align_up(at + kInt);
  layout.chunk_base = at;
  at = route_align_up(at + chunks * e * kInt);
  const unsigned long long groups =
      static_cast<unsigned long long>(route_max_groups(rows, experts, group_rows));
  layout.expert_group_offset = at;
  if (group_rows > 0) at = route_align_up(at + (e + 1) * kInt);
  layout.group_tiles = at;
  at = route_align_up(at + 2 * groups * kInt);
  layout.tile_done = at;
  at = route_align_up(at + blocks * kInt);
  layout.bytes = at;
  return layout;
}

}  // namespace moejit::kern::moe
