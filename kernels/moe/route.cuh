// route: topk_ids int32 [T, K] to the expert-sorted, block-padded row lists the grouped GEMM
// consumes (the outputs and their sizes are described in route_params.cuh). Deterministic by
// construction: no atomics; every entry's row is its expert's first row plus the number of
// entries before it, in (token, slot) order, on the same expert.
//
// How an entry's rank is found without atomics. The N = T * K entries are cut into chunks of C
// entries; a chunk is ranked by one CTA. Warp w of the CTA owns a contiguous run of the chunk
// and walks it 32 entries at a time, in order: the lanes holding the same local expert find each
// other (warp::peers, one ballot per bit of the expert), each takes as rank the warp's running
// count of that expert plus the number of group lanes below it (popc), and the group's lowest lane
// adds the group size to the count (a plain store: one writer per (warp, expert) row). An exclusive
// scan over the warps of each expert's counts then turns a rank within the warp into a rank within
// the chunk, and an exclusive scan over chunks (multi-CTA path) into a rank within the expert.
//
// Launches (block = Traits::kThreads for all):
//   N <= C (decode; route_is_single_cta):  route_single_kernel, grid 1. Ranks, scans the
//       padded expert sizes and writes every output from shared memory in one launch.
//   N >  C (prefill), three launches, grid = route_num_chunks(N, C), 1, route_num_chunks(N, C):
//     1. route_rank_kernel: chunk c ranks its entries; writes its per-expert counts to
//        chunk_base[c, :] and, in slot_row, each entry's (expert << 16 | rank in chunk) or -1.
//     2. route_scan_kernel: one CTA turns chunk_base[:, e] into exclusive prefixes over chunks,
//        scans ceil(count / B) (and ceil(count / G)) over experts; writes expert_counts,
//        expert_block_offset, total_blocks (and expert_group_offset).
//     3. route_scatter_kernel, grid route_scatter_ctas(N, C, E, threads) (the chunks, or one
//        warp per expert if more): chunk c writes sorted_rows and the final slot_row of its
//        entries; all CTAs share out the padding rows, block_expert and its -1 tail (zeroing
//        tile_done beside it) (and the group tiles and theirs).
// With GroupRows G > 0 the route also lists each expert's groups of G / B blocks (the CTA tiles
// of the warpgroup GEMM, moe_gemm_wg.cuh), so that GEMM's grid holds only groups: one CTA per
// group and M tile, none for the blocks inside a group.
// Why three launches and not a look-back single pass: the chunk ranks need the counts of every
// earlier chunk on all E experts (E up to 896), which a decoupled look-back would have to pass
// chunk to chunk as E-wide vectors; the kernels stay simple and free of inter-CTA waiting.
// Every kernel waits on the previous grid (programmatic dependent launch) before reading.
//
// Choosing C (measured on the H200, graph replay, tools/PERF_LOG.md): one CTA is best while
// each of its threads ranks at most two entries (1024 threads: N <= 2048; qwen3-30b-a3b T = 160,
// N = 1280: 5.3 us against 7.2 for three launches); past that its single SM is the limit (the
// rank loop, scattered stores), and the three-launch path with C = 1024 wins (kimi T = 256, N =
// 4096: 16.4 us against 26.7 us for one CTA). Those figures predate warp::peers, which replaced
// MATCH.ANY in the rank loop and made both paths 0.2-1.1 us faster; re-measured with it, one CTA
// at three or four entries a thread still ties or loses (8-11.4 us against about 7). For very
// large N, C = 4096 keeps the scan's columns short (kimi T = 16384: 32 us). Up to N = 1024 the
// one-CTA kernel runs 512 threads (its scans and barriers span fewer warps: -0.4 to -0.8 us a
// layer). The planner picks C and the threads (src/plan/moe_plan.cpp, route_single_rows and
// route_threads_for).
#pragma once

#include <moejit/kern/common/ptx.cuh>
#include <moejit/kern/common/warp.cuh>
#include <moejit/kern/moe/route_params.cuh>

namespace moejit::kern::moe {

// Every compile-time setting of the route kernels.
template <int NumExperts,     // E: local experts; ids in [expert_offset, expert_offset + E) are
                              // local, all others (-1, other EP ranks) get no row
          int TopK,           // K: slots per token (entry t * K + s is token t, slot s)
          int BlockM,         // B: padded rows per GEMM block (8, 16, 32, 64 or 128), picked
                              // per T by the planner: the grouped GEMM's token tile
                              // (moe_gemm.cuh's kBlockN)
          int BlockThreads,   // threads per CTA of every route kernel: a multiple of 32 in
                              // [32, 1024]
          int ChunkRows,      // C: entries one CTA ranks; N <= C runs the one-launch path.
                              // A multiple of BlockThreads, at most 32768
          int GroupRows = 0>  // G: 0, or the warpgroup GEMM's token tile (a multiple of B):
                              // the route also lists the groups of G / B consecutive blocks
                              // of one expert its CTAs take (route_params.cuh group_tiles)
struct RouteTraits {
  static constexpr int kExperts = NumExperts;
  static constexpr int kTopK = TopK;
  static constexpr int kBlockM = BlockM;
  static constexpr int kThreads = BlockThreads;
  static constexpr int kChunkRows = ChunkRows;
  static constexpr int kGroupRows = GroupRows;

  // Derived.
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kItems = kChunkRows / kThreads;  // entries per thread in the rank phase
  static constexpr int kExpertsPerThread = (kExperts + kThreads - 1) / kThreads;
  // Scan kernel: threads per expert, each scanning a group of chunks (1 when E >= threads).
  static constexpr int kScanGroups =
      kThreads / kExperts < 1 ? 1 : (kThreads / kExperts > 32 ? 32 : kThreads / kExperts);
  // Static shared memory of the rank phase, at most: per-warp u16 counters, counts, block and
  // group starts, the scan (64-bit at most) and its alignment (the host's route_rank_shared_bytes).
  static constexpr int kRankSharedBytes =
      (kWarps * kExperts * 2 + 3) / 4 * 4 + kExperts * 4 + 2 * (kExperts + 1) * 4 + kWarps * 8 + 8;

  static_assert(kExperts >= 1 && kExperts <= 32767,
                "route: NumExperts must be in [1, 32767] (the multi-CTA path packs the local "
                "expert into 15 bits); split the experts over more EP ranks");
  static_assert(kTopK >= 1 && kTopK <= 64,
                "route: TopK must be in [1, 64]; extend the traits (and supports()) after "
                "checking T * K stays within int for the largest T");
  static_assert(kBlockM == 8 || kBlockM == 16 || kBlockM == 32 || kBlockM == 64 || kBlockM == 128,
                "route: BlockM must be 8, 16, 32, 64 or 128 (the grouped GEMM's token tile, "
                "kBlockN); plan a supported tile");
  static_assert(kThreads % 32 == 0 && kThreads >= 32 && kThreads <= 1024,
                "route: BlockThreads must be a multiple of 32 in [32, 1024]");
  static_assert(kChunkRows % kThreads == 0 && kChunkRows >= kThreads && kChunkRows <= 32768,
                "route: ChunkRows must be a multiple of BlockThreads, at most 32768 (counters "
                "and in-chunk ranks are 16-bit)");
  static_assert(kItems <= 32,
                "route: ChunkRows / BlockThreads must be at most 32 (entries a thread keeps in "
                "registers); raise BlockThreads or lower ChunkRows");
  static_assert(kGroupRows == 0 || (kGroupRows % kBlockM == 0 && kGroupRows <= 32767),
                "route: GroupRows must be 0 or a multiple of BlockM up to 32767 (a group's rows "
                "are packed into 15 bits)");
  static_assert(kRankSharedBytes <= 48 * 1024,
                "route: the rank phase needs BlockThreads / 32 * NumExperts 16-bit counters in "
                "static shared memory (48 KB at most); lower BlockThreads (e.g. 512 for 896 "
                "experts)");
};

namespace detail {

// The value route_scan_experts scans: 64 bits where groups ride in the high half, else 32 (a
// 64-bit scan cost the group-less route 0.2-0.3 us at kimi-k3.1-tp8 T = 24 on the H200).
template <bool kGroups>
struct RouteScanValue {
  using Type = long long;
};
template <>
struct RouteScanValue<false> {
  using Type = int;
};

// Shared memory of the per-expert totals (every kernel but the scatter).
template <class Traits>
struct RouteExpertShared {
  int expert_count[Traits::kExperts];     // entries on expert e (in this chunk, or in all)
  int block_start[Traits::kExperts + 1];  // exclusive scan of ceil(count / B); [E] = total
  // Exclusive scan of ceil(count / G); [E] = total (one unused int without groups).
  int group_start[Traits::kGroupRows > 0 ? Traits::kExperts + 1 : 1];
  typename RouteScanValue<(Traits::kGroupRows > 0)>::Type scan[Traits::kWarps];  // scan scratch
};

// Shared memory of the rank phase (single-CTA and rank kernels).
template <class Traits>
struct RouteRankShared {
  // [w][e]: entries of warp w on expert e; after route_scan_warps, their exclusive prefix over w.
  unsigned short warp_count[Traits::kWarps][Traits::kExperts];
  RouteExpertShared<Traits> x;
};

// Local index of a global expert id, or -1. Why unsigned: one compare covers both ends and no
// int32 id can overflow (the op checks offset >= 0 and offset + E <= INT_MAX).
template <int kExperts>
__device__ __forceinline__ int route_local_expert(int id, int expert_offset) {
  const unsigned rel = static_cast<unsigned>(id) - static_cast<unsigned>(expert_offset);
  return rel < static_cast<unsigned>(kExperts) ? static_cast<int>(rel) : -1;
}

// Entries per warp for a chunk of n entries: ceil(n / W) rounded up to a multiple of 32.
template <class Traits>
__device__ __forceinline__ int route_rows_per_warp(int n) {
  return ((n + Traits::kWarps - 1) / Traits::kWarps + 31) & ~31;
}

// Warps that hold entries of a chunk of n entries (the others skip the rank phase entirely).
template <class Traits>
__device__ __forceinline__ int route_active_warps(int n) {
  const int per_warp = route_rows_per_warp<Traits>(n);
  return per_warp == 0 ? 0 : (n + per_warp - 1) / per_warp;
}

// Exclusive scan of one value per thread over the CTA; `total` gets the sum. Every thread calls.
template <class Traits, class V>
__device__ __forceinline__ V route_block_exclusive_scan(V value, V* scratch, V& total) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  V inclusive = value;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const V up = __shfl_up_sync(0xffffffffu, inclusive, d);
    if (lane >= d) inclusive += up;
  }
  if (lane == 31) scratch[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    V w = lane < Traits::kWarps ? scratch[lane] : 0;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const V up = __shfl_up_sync(0xffffffffu, w, d);
      if (lane >= d) w += up;
    }
    if (lane < Traits::kWarps) scratch[lane] = w;
  }
  __syncthreads();
  total = scratch[Traits::kWarps - 1];
  const V before = warp == 0 ? 0 : scratch[warp - 1];
  __syncthreads();  // scratch may be reused by the caller
  return before + inclusive - value;
}

// Rank phase over entries [begin, begin + n) of topk_ids, n <= C (see the file comment). On
// return (after a __syncthreads), s.warp_count[w][e] holds warp w's entries on expert e, and
// expert[it] / rank[it] the local expert (-1: not local or no entry) and the rank within warp w
// on that expert of entry w * rows_per_warp + it * 32 + lane of the chunk.
template <class Traits>
__device__ __forceinline__ void route_rank_warps(const int* __restrict__ topk_ids, int begin, int n,
                                                 int expert_offset, RouteRankShared<Traits>& s,
                                                 int (&expert)[Traits::kItems],
                                                 int (&rank)[Traits::kItems]) {
  constexpr int E = Traits::kExperts;
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31;
  const int warp = tid >> 5;
  // Why only the active warps' rows: at decode one warp holds every entry, and zeroing (and
  // later scanning) W * E counters would cost more than the ranking itself.
  const int active = route_active_warps<Traits>(n);
  for (int i = tid; i < active * E; i += Traits::kThreads) (&s.warp_count[0][0])[i] = 0;
  const int per_warp = route_rows_per_warp<Traits>(n);
  const int first = warp * per_warp;
  // Why: all of a thread's loads issue before the first match, so the ranking loop below waits
  // on one memory round trip, not kItems of them.
#pragma unroll
  for (int it = 0; it < Traits::kItems; ++it) {
    const int r = first + it * 32 + lane;
    expert[it] = -1;
    rank[it] = 0;
    if (it * 32 < per_warp && r < n) {
      expert[it] = route_local_expert<E>(topk_ids[begin + r], expert_offset);
    }
  }
  __syncthreads();
  const unsigned lanes_below = (1u << lane) - 1u;
  unsigned short* const counts = s.warp_count[warp];
#pragma unroll
  for (int it = 0; it < Traits::kItems; ++it) {
    if (it * 32 >= per_warp || first + it * 32 >= n) break;  // uniform across the warp
    const int e = expert[it];
    // e + 1 in [0, E]: -1 (no local expert) stays apart from every expert.
    const unsigned peers =
        ::moejit::kern::warp::peers<::moejit::kern::warp::bit_width(Traits::kExperts)>(
            static_cast<unsigned>(e + 1));
    const int below = __popc(peers & lanes_below);
    int base = 0;
    if (e >= 0) base = counts[e];
    __syncwarp();
    if (e >= 0 && below == 0) counts[e] = static_cast<unsigned short>(base + __popc(peers));
    __syncwarp();
    rank[it] = base + below;
  }
  __syncthreads();
}

// s.warp_count[w][e] -> exclusive prefix over the active warps of a chunk of n entries;
// s.x.expert_count[e] = the sum. Ends synced.
template <class Traits>
__device__ __forceinline__ void route_scan_warps(RouteRankShared<Traits>& s, int n) {
  const int active = route_active_warps<Traits>(n);
  for (int e = static_cast<int>(threadIdx.x); e < Traits::kExperts; e += Traits::kThreads) {
    int sum = 0;
#pragma unroll
    for (int w = 0; w < Traits::kWarps; ++w) {
      if (w < active) {
        const int c = s.warp_count[w][e];
        s.warp_count[w][e] = static_cast<unsigned short>(sum);
        sum += c;
      }
    }
    s.x.expert_count[e] = sum;
  }
  __syncthreads();
}

// An expert's blocks (low 32 bits) and, with groups, its groups (high 32 bits) for `count`
// entries: one 64-bit scan gives both starts (neither sum passes N < 2^31, so no carry).
template <class Traits>
__device__ __forceinline__ typename RouteScanValue<(Traits::kGroupRows > 0)>::Type
route_blocks_and_groups(int count) {
  constexpr int B = Traits::kBlockM;
  constexpr int G = Traits::kGroupRows;
  typename RouteScanValue<(G > 0)>::Type v = (count + B - 1) / B;
  if constexpr (G > 0) v += static_cast<long long>((count + G - 1) / G) << 32;
  return v;
}

// s.block_start = exclusive scan over experts of ceil(s.expert_count[e] / B), and with groups
// s.group_start of ceil(count / G); [E] = the totals. Thread i owns experts [i * P, i * P + P)
// (P = kExpertsPerThread). Ends synced.
template <class Traits>
__device__ __forceinline__ void route_scan_experts(RouteExpertShared<Traits>& s) {
  constexpr int E = Traits::kExperts;
  constexpr int P = Traits::kExpertsPerThread;
  const int first = static_cast<int>(threadIdx.x) * P;
  using V = typename RouteScanValue<(Traits::kGroupRows > 0)>::Type;
  V mine = 0;
#pragma unroll
  for (int j = 0; j < P; ++j) {
    if (first + j < E) mine += route_blocks_and_groups<Traits>(s.expert_count[first + j]);
  }
  V total = 0;
  V at = route_block_exclusive_scan<Traits>(mine, s.scan, total);
#pragma unroll
  for (int j = 0; j < P; ++j) {
    if (first + j < E) {
      s.block_start[first + j] = static_cast<int>(at);
      if constexpr (Traits::kGroupRows > 0) s.group_start[first + j] = static_cast<int>(at >> 32);
      at += route_blocks_and_groups<Traits>(s.expert_count[first + j]);
    }
  }
  if (threadIdx.x == 0) {
    s.block_start[E] = static_cast<int>(total);
    if constexpr (Traits::kGroupRows > 0) s.group_start[E] = static_cast<int>(total >> 32);
  }
  __syncthreads();
}

// Group tiles j = first, first + stride, ... of expert e (`count` entries from block `start`,
// its groups from `group`): {its first block, (rows << 16) | e} (route_params.cuh).
template <class Traits>
__device__ __forceinline__ void route_write_groups(const RouteParams& p, int e, int count,
                                                   int start, int group, int first, int stride) {
  constexpr int G = Traits::kGroupRows;
  constexpr int kBlocksPerGroup = G / Traits::kBlockM;
  const int groups = (count + G - 1) / G;
  for (int j = first; j < groups; j += stride) {
    const int rows = count - j * G < G ? count - j * G : G;
    *reinterpret_cast<int2*>(p.group_tiles + 2 * (group + j)) =
        make_int2(start + j * kBlocksPerGroup, (rows << 16) | e);
  }
}

// group_tiles g = first, first + stride, ... from `total` (the groups used) below max_groups:
// both ints -1.
__device__ __forceinline__ void route_clear_groups(const RouteParams& p, int total, int first,
                                                   int stride, int max_groups) {
  for (int g = total + first; g < max_groups; g += stride) {
    *reinterpret_cast<int2*>(p.group_tiles + 2 * g) = make_int2(-1, -1);
  }
}

// Exclusive prefix, in place, of column[c * E] for c in [c_begin, c_end), starting from `sum`;
// returns the running sum after the last chunk. Why batches of 16: all loads of a batch issue
// before its stores, so the column costs one L2 round trip per 16 chunks, not one per chunk.
template <int kExperts>
__device__ __forceinline__ int route_prefix_column(int* column, int c_begin, int c_end, int sum) {
  constexpr int kBatch = 16;
  for (int c0 = c_begin; c0 < c_end; c0 += kBatch) {
    int v[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      v[j] = c0 + j < c_end ? column[static_cast<long long>(c0 + j) * kExperts] : 0;
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      if (c0 + j < c_end) column[static_cast<long long>(c0 + j) * kExperts] = sum;
      sum += v[j];
    }
  }
  return sum;
}

// Padding rows, block_expert entries and (with groups) group tiles of expert e (one warp): rows
// [B * start + count, B * end) get -1, blocks [start, end) get e, its groups from `group` their
// tiles.
template <class Traits>
__device__ __forceinline__ void route_fill_expert(const RouteParams& p, int e, int count, int start,
                                                  int end, int group, int lane) {
  constexpr int B = Traits::kBlockM;
  for (int r = start * B + count + lane; r < end * B; r += 32) p.sorted_rows[r] = -1;
  for (int b = start + lane; b < end; b += 32) {
    p.block_expert[b] = e;
    p.tile_done[b] = 0u;
  }
  if constexpr (Traits::kGroupRows > 0)
    route_write_groups<Traits>(p, e, count, start, group, lane, 32);
}

// Padding rows of one expert (one thread): rows [B * start + count, B * end) get -1. Fewer than
// B: only an expert's last block is partial.
template <int kBlockM>
__device__ __forceinline__ void route_pad_expert(const RouteParams& p, int count, int start,
                                                 int end) {
  for (int r = start * kBlockM + count; r < end * kBlockM; ++r) p.sorted_rows[r] = -1;
}

// block_expert[b] for b = first, first + stride, ... below max_blocks: the expert whose blocks
// [starts[e], starts[e + 1]) hold b, or -1 from starts[E] (the blocks used) on. starts is in
// shared memory: a binary search costs log2(E) dependent shared loads, with no serial walk over
// the experts.
template <int kExperts>
__device__ __forceinline__ void route_block_experts(const RouteParams& p, const int* starts,
                                                    int first, int stride, int max_blocks) {
  const int total = starts[kExperts];
  for (int b = first; b < max_blocks; b += stride) {
    int e = -1;
    if (b < total) {
      // Invariant: starts[lo] <= b < starts[hi]; it ends on the largest e with starts[e] <= b,
      // whose range is not empty.
      int lo = 0;
      int hi = kExperts;
      while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if (starts[mid] <= b) {
          lo = mid;
        } else {
          hi = mid;
        }
      }
      e = lo;
    }
    p.block_expert[b] = e;
    p.tile_done[b] = 0u;
  }
}

}  // namespace detail

// One launch for N = T * K <= C: grid 1, block Traits::kThreads.
template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads) route_single_kernel(const RouteParams p) {
  constexpr int E = Traits::kExperts;
  constexpr int B = Traits::kBlockM;
  __shared__ detail::RouteRankShared<Traits> s;
  ::moejit::kern::ptx::grid_dependency_wait();
  ::moejit::kern::ptx::launch_dependents();
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int n = p.num_tokens * Traits::kTopK;  // <= C: the op takes this path only then

  int expert[Traits::kItems];
  int rank[Traits::kItems];
  detail::route_rank_warps<Traits>(p.topk_ids, 0, n, p.expert_offset, s, expert, rank);
  detail::route_scan_warps<Traits>(s, n);
  detail::route_scan_experts<Traits>(s.x);

  // Why a thread per expert and per block for the padding rows and the block map (not a warp
  // per expert, as the scatter kernel does, nor one walking a group's nonempty experts): at
  // decode nearly every touched expert has one block, and the walk cost a dependent chain of ~60
  // instructions per touched expert (kimi-k3.1-tp8 T = 24: 315 experts, ~19 K of the kernel's
  // 25.5 K warp-instructions, 9.5 us). Here each thread writes fewer than B padding rows per
  // expert it owns and searches the block map for each block it owns.
  const int total = s.x.block_start[E];
  for (int e = tid; e < E; e += Traits::kThreads) {
    p.expert_counts[e] = s.x.expert_count[e];
    p.expert_block_offset[e] = s.x.block_start[e];
    detail::route_pad_expert<B>(p, s.x.expert_count[e], s.x.block_start[e], s.x.block_start[e + 1]);
    if constexpr (Traits::kGroupRows > 0) {
      p.expert_group_offset[e] = s.x.group_start[e];
      detail::route_write_groups<Traits>(p, e, s.x.expert_count[e], s.x.block_start[e],
                                         s.x.group_start[e], 0, 1);
    }
  }
  detail::route_block_experts<E>(p, s.x.block_start, tid, Traits::kThreads,
                                 static_cast<int>(route_max_blocks(n, E, B)));
  if constexpr (Traits::kGroupRows > 0) {
    detail::route_clear_groups(p, s.x.group_start[E], tid, Traits::kThreads,
                               static_cast<int>(route_max_groups(n, E, Traits::kGroupRows)));
    if (tid == 0) p.expert_group_offset[E] = s.x.group_start[E];
  }
  if (tid == 0) {
    p.expert_block_offset[E] = total;
    *p.total_blocks = total;
  }
  const int per_warp = detail::route_rows_per_warp<Traits>(n);
#pragma unroll
  for (int it = 0; it < Traits::kItems; ++it) {
    const int r = warp * per_warp + it * 32 + lane;
    if (it * 32 < per_warp && r < n) {
      const int e = expert[it];
      if (e >= 0) {
        const int row = s.x.block_start[e] * B + s.warp_count[warp][e] + rank[it];
        p.sorted_rows[row] = r;
        p.slot_row[r] = row;
      } else {
        p.slot_row[r] = -1;
      }
    }
  }
}

// Multi-CTA step 1 of 3: grid route_num_chunks(N, C). Chunk c writes its per-expert counts to
// chunk_base[c, :] and, for each entry, slot_row = (local expert << 16) | rank in the chunk on
// that expert, or -1.
template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads) route_rank_kernel(const RouteParams p) {
  constexpr int E = Traits::kExperts;
  __shared__ detail::RouteRankShared<Traits> s;
  ::moejit::kern::ptx::grid_dependency_wait();
  ::moejit::kern::ptx::launch_dependents();
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int rows = p.num_tokens * Traits::kTopK;
  const int chunk = static_cast<int>(blockIdx.x);
  const int begin = chunk * Traits::kChunkRows;
  const int n = rows - begin < Traits::kChunkRows ? rows - begin : Traits::kChunkRows;

  int expert[Traits::kItems];
  int rank[Traits::kItems];
  detail::route_rank_warps<Traits>(p.topk_ids, begin, n, p.expert_offset, s, expert, rank);
  detail::route_scan_warps<Traits>(s, n);

  int* const counts = p.chunk_base + static_cast<long long>(chunk) * E;
  for (int e = tid; e < E; e += Traits::kThreads) counts[e] = s.x.expert_count[e];
  const int per_warp = detail::route_rows_per_warp<Traits>(n);
#pragma unroll
  for (int it = 0; it < Traits::kItems; ++it) {
    const int r = warp * per_warp + it * 32 + lane;
    if (it * 32 < per_warp && r < n) {
      const int e = expert[it];
      p.slot_row[begin + r] = e >= 0 ? (e << 16) | (s.warp_count[warp][e] + rank[it]) : -1;
    }
  }
}

// Multi-CTA step 2 of 3: grid 1. chunk_base[c, e] -> entries on e in chunks before c; writes
// expert_counts, expert_block_offset and total_blocks.
template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads) route_scan_kernel(const RouteParams p) {
  constexpr int E = Traits::kExperts;
  constexpr int G = Traits::kScanGroups;
  __shared__ detail::RouteExpertShared<Traits> s;
  __shared__ int group_base[G][G > 1 ? E : 1];  // unused (one int) when G == 1
  ::moejit::kern::ptx::grid_dependency_wait();
  ::moejit::kern::ptx::launch_dependents();
  const int tid = static_cast<int>(threadIdx.x);
  const int rows = p.num_tokens * Traits::kTopK;
  const int chunks = static_cast<int>(route_num_chunks(rows, Traits::kChunkRows));

  if constexpr (G == 1) {
    for (int e = tid; e < E; e += Traits::kThreads) {
      s.expert_count[e] = detail::route_prefix_column<E>(p.chunk_base + e, 0, chunks, 0);
    }
  } else {
    // Why: with fewer experts than threads, G threads share an expert's column of chunks:
    // each sums its group, a short scan over groups gives each group's base, then each writes
    // its group's prefixes.
    const int per_group = (chunks + G - 1) / G;
    for (int i = tid; i < G * E; i += Traits::kThreads) {
      const int e = i % E;
      const int g = i / E;
      const int c_end = (g + 1) * per_group < chunks ? (g + 1) * per_group : chunks;
      int sum = 0;
      for (int c = g * per_group; c < c_end; ++c) {
        sum += p.chunk_base[static_cast<long long>(c) * E + e];
      }
      group_base[g][e] = sum;
    }
    __syncthreads();
    for (int e = tid; e < E; e += Traits::kThreads) {
      int sum = 0;
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const int v = group_base[g][e];
        group_base[g][e] = sum;
        sum += v;
      }
      s.expert_count[e] = sum;
    }
    __syncthreads();
    for (int i = tid; i < G * E; i += Traits::kThreads) {
      const int e = i % E;
      const int g = i / E;
      const int c_end = (g + 1) * per_group < chunks ? (g + 1) * per_group : chunks;
      detail::route_prefix_column<E>(p.chunk_base + e, g * per_group, c_end, group_base[g][e]);
    }
  }
  __syncthreads();
  detail::route_scan_experts<Traits>(s);
  for (int e = tid; e < E; e += Traits::kThreads) {
    p.expert_counts[e] = s.expert_count[e];
    p.expert_block_offset[e] = s.block_start[e];
    if constexpr (Traits::kGroupRows > 0) p.expert_group_offset[e] = s.group_start[e];
  }
  if (tid == 0) {
    p.expert_block_offset[E] = s.block_start[E];
    *p.total_blocks = s.block_start[E];
    if constexpr (Traits::kGroupRows > 0) p.expert_group_offset[E] = s.group_start[E];
  }
}

// Multi-CTA step 3 of 3: grid route_scatter_ctas(N, C, E, threads). Chunk c places its entries;
// the CTAs share out the padding rows and block_expert (a warp per expert) and the -1 tail of
// block_expert.
template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads) route_scatter_kernel(const RouteParams p) {
  constexpr int E = Traits::kExperts;
  constexpr int B = Traits::kBlockM;
  ::moejit::kern::ptx::grid_dependency_wait();
  ::moejit::kern::ptx::launch_dependents();
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31;
  const int rows = p.num_tokens * Traits::kTopK;
  const int chunk = static_cast<int>(blockIdx.x);
  const int begin = chunk * Traits::kChunkRows;
  const int n = rows - begin < Traits::kChunkRows ? rows - begin : Traits::kChunkRows;

  // Why three passes over registers: each row needs two loads that depend on the packed entry;
  // issued item by item (a store to slot_row between them may alias the next load) they would
  // cost kItems chains of round trips, batched they cost one.
  if (n > 0) {  // CTAs past the chunks only fill (route_scatter_ctas)
    // Why inside: for the CTAs past the chunks this pointer would lie past chunk_base.
    const int* const base = p.chunk_base + static_cast<long long>(chunk) * E;
    int packed[Traits::kItems];
#pragma unroll
    for (int it = 0; it < Traits::kItems; ++it) {
      const int r = it * Traits::kThreads + tid;
      packed[it] = r < n ? p.slot_row[begin + r] : -1;
    }
    int row[Traits::kItems];
#pragma unroll
    for (int it = 0; it < Traits::kItems; ++it) {
      const int e = packed[it] >= 0 ? packed[it] >> 16 : 0;
      row[it] = p.expert_block_offset[e] * B + base[e] + (packed[it] & 0xffff);
    }
#pragma unroll
    for (int it = 0; it < Traits::kItems; ++it) {
      const int r = it * Traits::kThreads + tid;
      if (packed[it] >= 0) {
        p.sorted_rows[row[it]] = begin + r;
        p.slot_row[begin + r] = row[it];
      }
    }
  }

  // A warp per expert: route_scatter_ctas gives the grid at least one warp per expert. Why not
  // a warp walking the nonempty experts of a group of 32: with fewer groups than warps most
  // warps idled while a few walked 32 experts each (measured on the H200: gpt-oss-120b, E = 128
  // over 32 warps, T = 96: 10.2 us with groups against 4.3 us with a warp per expert).
  const int grid_threads = static_cast<int>(gridDim.x) * Traits::kThreads;
  const int grid_warps = static_cast<int>(gridDim.x) * Traits::kWarps;
  for (int e = chunk * Traits::kWarps + (tid >> 5); e < E; e += grid_warps) {
    detail::route_fill_expert<Traits>(p, e, p.expert_counts[e], p.expert_block_offset[e],
                                      p.expert_block_offset[e + 1],
                                      Traits::kGroupRows > 0 ? p.expert_group_offset[e] : 0, lane);
  }
  const int total = p.expert_block_offset[E];
  const int max_blocks = static_cast<int>(route_max_blocks(rows, E, B));
  for (int b = total + chunk * Traits::kThreads + tid; b < max_blocks; b += grid_threads) {
    p.block_expert[b] = -1;
    p.tile_done[b] = 0u;
  }
  if constexpr (Traits::kGroupRows > 0) {
    detail::route_clear_groups(p, p.expert_group_offset[E], chunk * Traits::kThreads + tid,
                               grid_threads,
                               static_cast<int>(route_max_groups(rows, E, Traits::kGroupRows)));
  }
}

}  // namespace moejit::kern::moe
