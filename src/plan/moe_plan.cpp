// The MoE layer's plan: the config per token count (marlin_moe's tiles here, decode_moe's in
// decode_plan.cpp), the sizes that follow from it, and the arch facts supports() checks.
#include "plan/moe_plan.hpp"

#include <algorithm>
#include <climits>
#include <cmath>
#include <moejit/kern/moe/layout.cuh>
#include <moejit/kern/moe/params.cuh>
#include <moejit/kern/moe/route_params.cuh>
#include <utility>

#include "moejit/error.hpp"

namespace moejit::detail {

namespace {

// The T ranges marlin_moe plans a tile for: T <= 2, then route blocks of 8, 16, 32 and 64 rows.
// A tile's variants (short-K FC2, tall FC1, warpgroup) name the bucket they serve and share its
// route block, so they share its route and workspace.
enum class Bucket { kFirst, kRows8, kRows16, kRows32, kRows64 };

// One grouped-GEMM tile, used for T up to `max_tokens` (measured on the H200 with the standalone
// harness, tools/PERF_LOG.md "marlin_moe": best config at T = 1, 7..96, 256, 1000, 4096 on
// gpt-oss-120b and deepseek-v4-flash-tp4; the switch points sit between the measured T, near
// their geometric means). max_tokens 0: the bucket ends by rows per expert, not by T.
struct GemmTile {
  Bucket bucket;
  int max_tokens;
  int block_m, block_n, block_k, stages, warps_m, warps_n, warps_k, min_blocks_per_sm;
};

// The sm_90a warpgroup tile (moe_gemm_wg.cuh) that replaces a GemmTile on devices with wgmma.
// Its route block must be the GemmTile's block_n, so both share one route and one workspace.
struct WgmmaTile {
  Bucket bucket;  // the GemmTile bucket it replaces
  int wgmma_n, block_n, warpgroups, tiles_m, stages, min_blocks_per_sm;
  // Taken where min_rows_per_expert * R <= T * K < below_rows_per_expert * R, R the routed
  // experts of all ranks: uniform routing gives each expert T * K / R rows on average (0: no
  // bound).
  int min_rows_per_expert, below_rows_per_expert;
  // And only where both GEMMs run at least this many 64-wide K tiles (min(H, I) / 64; 0: no
  // bound). The first tile of the list that takes T wins.
  int min_k_tiles = 0;

  constexpr bool takes(long long rows, long long routed, int min_rows, int k_tiles) const {
    return rows >= min_rows * routed &&
           (below_rows_per_expert == 0 || rows < below_rows_per_expert * routed) &&
           k_tiles >= min_k_tiles;
  }
};

constexpr GemmTile kGemmTiles[] = {
    // T = 1: few experts touched; 32-row CTAs with K split over two warps put more CTAs on them.
    {Bucket::kFirst, 2, 32, 8, 256, 4, 2, 1, 2, 4},
    // T = 3..: one n8 token tile, 64 weight rows per CTA, four CTAs per SM. Taken by the rows
    // experts see, not by T (tile_for).
    {Bucket::kRows8, 0, 64, 8, 256, 4, 4, 1, 1, 4},
    // T <= 512 past that: 16-token blocks halve the dequant work per weight byte of two 8-row
    // blocks. 128 rows over four warps, two 16-row atoms a warp: a warp's B fragments (ldmatrix)
    // and the CTA's gathered input rows serve twice the weights of one atom a warp. Measured on
    // the H200 (tools/PERF_LOG.md "two atoms a warp for 16-row blocks") against 64 rows, one atom
    // a warp (64, 16, 256, 3, 4, 1, 1, 4): gpt-oss-120b T = 256 668, 670 -> 590, 583 us;
    // deepseek-v4-flash-tp4 T = 384 343, 342 -> 315, 318; qwen3-30b-a3b T = 128 131, 133 -> 123,
    // 123; kimi-k3.1-tp8 T = 384 760, 766 -> 711, 721. Two stages, not four: each step down was
    // faster (why is not measured; four CTAs with one stage ahead each still keep ~52 KB per SM
    // in flight); measured (tools/PERF_LOG.md "two stages for the 16-row tile", layer us, 4 -> 2
    // stages): qwen3-30b-a3b T = 96 108.3 -> 103.2, T = 128 113.9 -> 108.7; gpt-oss-120b T = 256
    // 514.8 -> 503.0; deepseek-v4-flash-tp4 T = 384 282.6 -> 278.5; never slower (3 stages lay
    // between; the 8-row tile's 4 -> 3 stages changed nothing).
    {Bucket::kRows16, 512, 128, 16, 128, 2, 4, 1, 1, 4},
    // T ~ 1000: 32-token blocks, shorter K stages.
    {Bucket::kRows32, 1024, 64, 32, 128, 4, 4, 1, 1, 3},
    // T >= 4096: 128 x 64 tiles, eight warps along M. Why from T = 1025 (not near the geometric
    // mean of 1000 and 4096): the sm_90a wgmma tile of this bucket is 1.7x faster at T = 2048
    // (gpt-oss-120b FC1 + FC2 1.34 ms against 2.47 ms for the 32-token tile), while at T = 1000
    // the 32-token tile still wins on deepseek-v4-flash-tp4 (0.52 against 0.57 ms).
    {Bucket::kRows64, INT_MAX, 128, 64, 128, 4, 8, 1, 1, 2},
};

// Whether every tile of `variants` (short-K FC2, warpgroup, tall FC1) serves a GemmTile bucket
// with that bucket's route block: the variants share its route and workspace.
template <class Tile, std::size_t N>
constexpr bool shares_route_blocks(const Tile (&variants)[N]) {
  for (const Tile& variant : variants) {
    bool found = false;
    for (const GemmTile& tile : kGemmTiles) {
      if (tile.bucket == variant.bucket) found = tile.block_n == variant.block_n;
    }
    if (!found) return false;
  }
  return true;
}

// FC2 over a short K: where the intermediate size (FC2's K) is at most kFc2ShortK, the 64-row CTA
// of the buckets below runs only 1-3 of its 256-wide K tiles (deepseek-v4-flash-tp4, I = 512: 2;
// kimi-k3.1-tp8, I = 384: 1.5, the half tile computed on zero-filled atoms), so its fixed costs
// (route rows, pipeline fill, epilogue) weigh on ~12 KB of weights. With 8-row route blocks FC2
// then takes a taller CTA: 256 rows over eight warps and 128-wide K tiles, three per SM. Measured
// on the H200 (tools/PERF_LOG.md "marlin_moe FC2 over a short K"), layer time with the 128-row tile
// against the bucket's tile for FC2: kimi-k3.1-tp8 T = 24 233 against 270 us, T = 96 537 against
// 616, T = 256 726 against 848; deepseek-v4-flash-tp4 T = 24 119 against 125, T = 256 319 against
// 338; qwen3-30b-a3b T = 24 87 against 91. gpt-oss-120b (I = 2880, 12 K tiles) lost with it (T = 6:
// 113 against 105 us).
constexpr int kFc2ShortK = 768;
constexpr GemmTile kFc2ShortKTiles[] = {
    // 256 rows, two atoms a warp: kimi-k3.1-tp8 T = 24 221 against 233 us with 128 rows,
    // deepseek-v4-flash-tp4 T = 96 242 against 250, qwen3-30b-a3b T = 24 84 against 87.
    {Bucket::kRows8, 0, 256, 8, 128, 3, 8, 1, 1, 3},
    // 16-row blocks: 256 rows over four warps of four atoms, three CTAs per SM, where the
    // bucket's first T gives FC2 kFc2ShortKMinWaves waves of them (fc2_tile_for), else
    // kFc2FewWavesTile (the bucket's tile at six CTAs per SM). Measured on the H200
    // (tools/PERF_LOG.md "one warpgroup of two m64 tiles", `--gap-ms 5`), layer us against the
    // bucket's tile: kimi-k3.1-tp8 T = 384 628.3 against 653.4, T = 512 676.2 against 702.2;
    // deepseek-v4-flash-tp4 T = 256 263.6 against 268.6, T = 384 283.1 against 288.9 (10 and
    // more waves); qwen3-30b-a3b (2.6 waves) T = 96 108.0 against 107.7, T = 128 114.4 against
    // 113.3. Eight warps of two atoms at two CTAs per SM, or four of four at two, were slower
    // than the bucket's tile (kimi T = 384 665, 693 us); eight warps of one atom at three
    // measured the same or slower (kimi-k3.1-tp8 T = 512 758 against 763-781 us, qwen3-30b-a3b
    // T = 128 120 against 123).
    {Bucket::kRows16, 0, 256, 16, 128, 3, 4, 1, 1, 3},
};
constexpr double kFc2ShortKMinWaves = 4.0;

// FC2 of 16-row blocks where K is short but the short-K tile above would fill fewer than
// kFc2ShortKMinWaves waves (qwen3-30b-a3b): the bucket's tile at six CTAs per SM, which ptxas fits
// in 80 registers without spills (92 at four, which gives five by registers; six take 157 KB of
// shared memory). Its warps wait at the K stage's barrier for a quarter of their samples (ncu,
// qwen3-30b-a3b T = 96); more stages did not help (3: +0.1 to +0.7%, 4: +1.7 to +2.6%), a sixth CTA
// did a little. Measured on the H200 (tools/PERF_LOG.md "FC2's 16-row tile at six CTAs per SM"),
// layer us over three id draws, five -> six CTAs: qwen3-30b-a3b T = 96 102.3, 101.6, 101.8 ->
// 101.4, 101.3, 101.6; T = 128 106.1, 106.8, 106.2 -> 105.8, 106.3, 105.7; T = 160 111.0, 110.8,
// 111.7 -> 110.5, 109.8, 111.1. gpt-oss-120b (K = 2880, 22.5 stages a CTA) did not gain (T = 192:
// +0.1 to +0.9%), so the long-K FC2 keeps the bucket's tile.
constexpr GemmTile with_ctas_per_sm(GemmTile tile, int ctas) {
  tile.min_blocks_per_sm = ctas;
  return tile;
}
static_assert(kGemmTiles[2].bucket == Bucket::kRows16, "kGemmTiles[2] is the 16-row bucket's tile");
constexpr GemmTile kFc2FewWavesTiles[] = {with_ctas_per_sm(kGemmTiles[2], 6)};
constexpr const GemmTile& kFc2FewWavesTile = kFc2FewWavesTiles[0];

static_assert(shares_route_blocks(kFc2ShortKTiles),
              "every short-K FC2 tile must serve a GemmTile bucket with the same block_n");
static_assert(shares_route_blocks(kFc2FewWavesTiles),
              "the few-waves FC2 tile serves a GemmTile bucket with its route block");

// FC1 of 16-row blocks over 256-wide K tiles where H is a multiple of 256 (no atoms past K): the
// bucket's tile with each stage twice as wide and the same two stages, four CTAs per SM (the most
// that fit: 2 x ~25 KB each). Measured on the H200 (tools/PERF_LOG.md "FC1's 16-row tile over
// 256-wide K stages", layer us, two runs each): deepseek-v4-flash-tp4 T = 256 256.3, 258.0 ->
// 252.6, 251.0; T = 384 276.9, 277.7 -> 272.2, 270.4; qwen3-30b-a3b T = 96 102.7, 103.1 -> 102.0,
// 101.5; kimi-k3.1-tp8 T = 384 619.9, 619.1 -> 604.8, 604.3. Why not for FC2 (K = I <= 768 on
// those shapes: two or three such stages) and not where H is not a multiple of 256: with both
// GEMMs on it FC2 was 0.2-1.7 us slower, and gpt-oss-120b (H = 2880: 11.25 stages, the last one
// mostly zero-filled atoms) 6 us slower per layer.
constexpr GemmTile kFc1WideKTiles[] = {{Bucket::kRows16, 512, 128, 16, 256, 2, 4, 1, 1, 4}};
constexpr const GemmTile& kFc1WideKTile = kFc1WideKTiles[0];
static_assert(shares_route_blocks(kFc1WideKTiles),
              "the wide-K FC1 tile serves a GemmTile bucket with its route block");

// Whether FC1 of the 16-row bucket takes kFc1WideKTile: H a multiple of its K stage.
bool fc1_wide_k(const ModelShape& shape) { return shape.hidden % kFc1WideKTile.block_k == 0; }

// Route: N = T * K ranks in one CTA (one launch) while N <= route_single_rows(threads); above it
// the three-launch path with chunks of kRouteChunkRows, and kRouteLargeChunkRows once
// N > kRouteLargeRows. Why (kernels/moe/route.cuh, measured on the H200): one CTA is best while
// each of its threads ranks at most kRouteSingleItems entries; past that its single SM is the
// limit and C = 1024 chunks win (kimi N = 4096: 16.4 us against 26.7 us). Layer us, one CTA up
// to N = 2048 (1024 threads) against three launches (tools/PERF_LOG.md "route in one CTA up to
// two entries a thread"): qwen3-30b-a3b T = 160 (N = 1280) 118.4 against 120.8;
// deepseek-v4-flash-tp4 T = 192 (1152) 236.1 against 239.3, T = 256 (1536) 262.4 against 264.0;
// qwen3 T = 256 (2048) 140.1 against 141.0; gpt-oss-120b T = 512 (2048) 602.7 against 605.6.
// Past two entries a thread one CTA loses: kimi-k3.1-tp8 (512 threads) T = 128 (N = 2048) 481.3
// against 479.5, and N = 4096 on 1024 threads (qwen3 T = 512: route 11.4 against 7.7 us). Again
// after warp::peers made the rank loop cheaper ("refuted after the ballots"): at three and four
// entries a thread one CTA took 7.7-11.4 us of route against about 7 for three launches, the
// layers tied or lost (gpt-oss-120b T = 768: 659.5, 664.5 against 660.6, 659.9). For very large
// N, C = 4096 keeps the scan's columns short.
constexpr int kRouteSingleRows = 1024;  // one CTA at least up to here, whatever its threads
constexpr int kRouteSingleItems = 2;
constexpr int kRouteChunkRows = 1024;
constexpr int kRouteLargeRows = 32768;
constexpr int kRouteLargeChunkRows = 4096;
constexpr int kRouteMaxItems = 32;   // RouteTraits: ChunkRows / BlockThreads <= 32
static_assert(kRouteSingleRows <= kRouteMaxItems * 32 && kRouteSingleItems <= kRouteMaxItems,
              "the one-CTA route's C must stay within RouteTraits' 32 entries a thread at 32 "
              "threads (route_threads' fewest)");
constexpr int kRouteRankBlockM = 8;  // the block size every rank kernel is built with

// Combine: T <= kCombineSmallTokens uses small CTAs so one token's H / 8 threads spread over
// several SMs (kimi T = 1: 448 threads = 7 CTAs of 64 instead of 2 of 256).
constexpr int kCombineSmallTokens = 16;
constexpr int kCombineSmallThreads = 64;
constexpr int kCombineThreads = 256;

constexpr int kNarrowIdsThreads = 256;
constexpr int kRepackThreads = 256;

// Measured on the H200 (tools/PERF_LOG.md "marlin_moe prefill on wgmma", "wgmma tile widths",
// "route blocks by rows per expert, and a narrower warpgroup tile", "one register set for the
// three-CTA warpgroup tile" and "one warpgroup of two m64 tiles"): 128 weight rows, 4 stages,
// over up to wgmma_n / block_n route blocks of one expert (a CTA runs at the narrowest quarter of
// wgmma_n that holds its real rows).
// - N = 128: two warpgroups of one m64 tile, two CTAs per SM. N = 64: one warpgroup of two m64
//   tiles, four CTAs per SM, one A register set at widths 48-64 and two at 16-32
//   (moe_gemm_wg.cuh a_buffers; 128 registers, no spills). Why one warpgroup of two tiles for N =
//   64: the tile is issue-bound (SASS: 127 instructions per warp and 544-byte atom with two
//   warpgroups of one tile, 0.233 per weight byte against the 0.249 the H200 can issue per byte at
//   the copy bandwidth), and a warp that owns two strips pays the K stage's barrier, wgmma wait and
//   loop once for both. Against two warpgroups of one tile at three CTAs per SM (`--gap-ms 5`, us):
//   qwen3-30b-a3b T = 256 152.3 -> 140.0, T = 512 183.7 -> 176.3; gpt-oss-120b T = 512 677 -> 605,
//   T = 1024 794 -> 734; deepseek-v4-flash-tp4 T = 1024 409 -> 375, T = 2048 517 -> 505;
//   kimi-k3.1-tp8 T = 1024 982 -> 887, T = 2048 1221 -> 1136.
// - T > 1024 (64-row blocks): N = 128: gpt-oss-120b T = 4096 FC1 + FC2 2.13 ms against 3.58 ms
//   for the mma.sync tile; N = 64 below 56 rows per expert (with the earlier two-warpgroup N = 64
//   tile: kimi-k3.1-tp8 T = 1536, 27 rows: 1185 against 1313 us; T = 2048: 1394 against 1536;
//   deepseek-v4-flash-tp4 T = 1536, 36 rows: 551 against 580).
// - T = 513..1024 (32-row blocks): faster than the mma.sync tile on every reference shape
//   measured (T = 1024: gpt-oss 967 against 1432 us, qwen3-30b-a3b 281 against 500,
//   deepseek-v4-flash-tp4 490 against 581, kimi-k3.1-tp8 1222 against 1292); N = 64 below 56
//   rows per expert, N = 128 from 56. The one-warpgroup N = 64 tile still loses at 64 rows
//   (qwen3-30b-a3b T = 1024 276 against 268 us for N = 128; gpt-oss-120b T = 2048 1213 against
//   1166) and 72 (qwen3 T = 1152 312 against 283; gpt-oss T = 2304 1396 against 1248); the
//   earlier one won at 48 rows (qwen3-30b-a3b T = 768: 227 against 242 us); 56 lies between.
// - 16-row blocks (T <= 512): N = 64 where experts average 12 rows or more (14 where FC1 takes
//   the wide-K tile: wgmma_min_rows). Against the four-stage mma.sync tile of two atoms a warp
//   (`--gap-ms 5`, us): ties at 12 rows (gpt-oss-120b T = 384 567.7 against 579.0;
//   deepseek-v4-flash-tp4 T = 512 323.0 against 328.2; qwen3-30b-a3b T = 192 131.4 against 129.4),
//   loses at 10 (qwen3 T = 160 129.0 against 119.8; gpt-oss T = 320 556.8 against 544.3; deepseek T
//   = 427 315.3 against 299.8) and 8 (gpt-oss T = 256 547 against 506; kimi-k3.1-tp8 T = 448 758
//   against 674). The earlier tile won from 14 (qwen3-30b-a3b T = 256, 16 rows: 164 against 183 us
//   for the N = 128 tile).
// - From 384 rows per expert (64-row blocks; few experts, or T past 4096) where both GEMMs run 40
//   K tiles or more (min(H, I) >= 2560): N = 256, two warpgroups of one m64 tile, one CTA per SM
//   (238 registers at most, no spills). Each weight dequantized feeds twice the tokens of N = 128,
//   which wins where the groups of 256 rows are mostly full and K is long, though one CTA per SM
//   leaves its barrier, copies, start and epilogue uncovered (tools/PERF_LOG.md "taller warpgroup
//   tiles at prefill" and "N = 256 from 384 rows an expert", `--gap-ms 5`, us, two seeds):
//   mixtral-8x7b T = 2048 (512 rows) 2476, 2405 -> 2332, 2245; T = 4096 (1024) 4812, 4587 ->
//   4193, 4203; phi-3.5-moe T = 4096 (512) 2096, 2081 -> 2019, 1967; gpt-oss-120b T = 16384 (512)
//   5935, 5760 -> 5608, 5665. It loses at 256 rows and fewer (qwen3-235b-a22b T = 4096 2207, 2258
//   -> 2309, 2365; gpt-oss-120b T = 4096, 128 rows, 1653 -> 1823) and on short K whatever the
//   rows: qwen3-30b-a3b T = 8192 (512 rows; FC2 K = 12 tiles) 1198, 1198 -> 1265, 1256 (FC2
//   +13%, FC1 at 32 tiles +3, -1%); deepseek-v4-flash-tp4 T = 16384 (384; FC2 8 tiles) 2552,
//   2559 -> 2676, 2701 (FC2 +18%). The bound of 40 lies between the 32 K tiles that tied and the
//   45 that won. 256 weight rows x 128 tokens at one CTA per SM, which halves the L2 bytes per
//   FLOP instead, lost 5-14% on every row: the N = 128 tile is not short of L2.
// - T <= 160: the mma.sync n8 tile wins (gpt-oss T = 96: 556 against 734 us), and so it does
//   wherever experts average at most 5 rows (tile_for).
constexpr WgmmaTile kWgmmaTiles[] = {
    {Bucket::kRows16, 64, 16, 1, 2, 4, 4, 12, 0},   // from 12 rows per expert (wgmma_min_rows)
    {Bucket::kRows32, 64, 32, 1, 2, 4, 4, 0, 56},   // below 56 rows
    {Bucket::kRows32, 128, 32, 2, 1, 4, 2, 56, 0},  // from 56
    {Bucket::kRows64, 64, 64, 1, 2, 4, 4, 0, 56},        // below 56
    {Bucket::kRows64, 256, 64, 2, 1, 4, 1, 384, 0, 40},  // from 384 where K >= 40 tiles
    {Bucket::kRows64, 128, 64, 2, 1, 4, 2, 56, 0},       // from 56 (else)
};

static_assert(shares_route_blocks(kWgmmaTiles),
              "every WgmmaTile must replace a GemmTile bucket with the same block_n (route block)");

// Routed experts across all ranks (an expert-parallel rank's experts see T * K / this rows each).
long long routed_experts(const ModelShape& shape) {
  return std::max(shape.global_experts, shape.num_experts);
}

constexpr const GemmTile& kFirstTile = kGemmTiles[0];       // T <= 2
constexpr const GemmTile& kSmallBlockTile = kGemmTiles[1];  // route blocks of 8 rows

// Route blocks of 8 rows (kSmallBlockTile's bucket) wherever uniform top-k routing gives each
// routed expert at most this many rows on average, whatever T. Measured on the H200
// (tools/PERF_LOG.md "marlin_moe: route blocks by rows per expert, ..."), layer time with 8-row
// against 16-row blocks: faster up to 6 rows (kimi-k3.1-tp8 T = 256, 4.6 rows: 691 against 765
// us; deepseek-v4-flash-tp4 T = 256, 6 rows: 318 against 335), slower from 8 (gpt-oss-120b
// T = 256: 783 against 701; qwen3-30b-a3b T = 128: 146 against 137; gpt-oss-20b T = 64: 198
// against 176), even at 6.9 (kimi T = 384: 826 both). With the two-atom 16-row tile the bound
// moved below 6 (tools/PERF_LOG.md "route blocks of 8 rows up to 5 rows per expert"): 16-row
// blocks win at 6 rows (gpt-oss-120b T = 192: 629, 637 against 580, 592 us; kimi-k3.1-tp8 T = 336
// 707, 711 against 692-704) or tie (deepseek-v4-flash-tp4 T = 256, qwen3-30b-a3b T = 96) and lose
// at 4.5 (deepseek T = 192: 273, 272 against 287, 288; kimi T = 256, 4.6 rows: 641, 646 against
// 657-675).
constexpr long long kSmallBlockMaxRowsPerExpert = 5;

// The last T whose experts average at most kSmallBlockMaxRowsPerExpert rows.
long long small_block_last_tokens(const ModelShape& shape) {
  return kSmallBlockMaxRowsPerExpert * routed_experts(shape) / std::max(shape.top_k, 1);
}

// The bucket's tile for T: T <= 2 and the rows rule first, then the T buckets.
const GemmTile& tile_for(const ModelShape& shape, int tokens) {
  if (tokens <= kFirstTile.max_tokens) return kFirstTile;
  if (tokens <= small_block_last_tokens(shape)) return kSmallBlockTile;
  for (const GemmTile& tile : kGemmTiles) {
    if (tokens <= tile.max_tokens) return tile;  // the 8-row bucket (0) ends by rows instead
  }
  return kGemmTiles[sizeof(kGemmTiles) / sizeof(kGemmTiles[0]) - 1];
}

// The short-K FC2 tile of `tile`'s bucket where the shape's K calls for it, else null.
const GemmTile* fc2_short_k_tile(const GemmTile& tile, const ModelShape& shape) {
  if (shape.intermediate > kFc2ShortK) return nullptr;
  for (const GemmTile& fc2 : kFc2ShortKTiles) {
    if (fc2.bucket == tile.bucket) return &fc2;
  }
  return nullptr;
}

// Why the most threads that fit: the rank phase keeps a 16-bit counter per (warp, expert) in
// 48 KB of static shared memory, so E = 896 takes 512 threads and E <= 384 takes 1024.
int route_threads(int num_experts) {
  for (int threads = 1024; threads > 32; threads /= 2) {
    if (route_rank_shared_bytes(num_experts, threads) <= kRouteStaticSharedLimit) return threads;
  }
  return 32;
}

// The route's threads for N = T * K entries: at most kRouteSmallThreads while
// N <= kRouteSingleRows, else the most that fit (route_threads). Why: the one-CTA route's scans
// and barriers span all its warps, so up to 1024 entries (one launch either way) 512 threads
// finish sooner; from 1025 entries one CTA of 1024 threads (two entries each) beats the three
// launches 512 would take. Layer us on the H200, two runs each, 1024 -> 512 threads
// (tools/PERF_LOG.md "Measured: the two branches' changes, the route's threads"):
// - qwen3-30b-a3b T = 1 14.8 -> 14.4, T = 48 92.9 -> 92.1, T = 96 102.3 -> 101.6;
// - deepseek-v4-flash-tp4 T = 1 15.5 -> 15.1; gpt-oss-120b T = 1 31.4 -> 31.0;
// - but qwen3 T = 256 (N = 2048, three launches at 512) 139.4 -> 140.5.
// 256 threads gained less.
constexpr int kRouteSmallThreads = 512;
int route_threads_for(int num_experts, long long rows) {
  const int most = route_threads(num_experts);
  return rows <= kRouteSingleRows ? std::min(most, kRouteSmallThreads) : most;
}

// The largest N = T * K the one-CTA route takes with `threads` threads: kRouteSingleItems entries
// a thread, and never below kRouteSingleRows.
int route_single_rows(int threads) {
  return std::max(kRouteSingleRows, kRouteSingleItems * threads);
}

MarlinMoeParams gemm_params(const GemmTile& tile, MoeGemmStage stage, const ModelShape& shape) {
  MarlinMoeParams p;
  p.stage = stage;
  p.block_m = tile.block_m;
  p.block_n = tile.block_n;
  p.block_k = tile.block_k;
  p.stages = tile.stages;
  p.warps_m = tile.warps_m;
  p.warps_n = tile.warps_n;
  p.warps_k = tile.warps_k;
  p.min_blocks_per_sm = tile.min_blocks_per_sm;
  p.has_bias = shape.has_bias;
  if (stage == MoeGemmStage::kFc1) {
    // Why not early: FC1 reads the route's block map, which the previous kernel writes, so it
    // must wait before anything else.
    p.early_weights = false;
    p.activation = shape.activation;
    p.out_dtype = DType::kBF16;
  } else {
    // Why early: FC2's dependency is FC1, which starts only after route finished, so FC2 may
    // stream its weights while FC1 drains (programmatic dependent launch).
    p.early_weights = true;
    p.activation = Activation{};
    // Why bf16 rows: they are T * k * H values that FC2 writes and combine reads back; bf16
    // halves that traffic for one more rounding (2^-9 relative) of each weighted row before the
    // fp32 top-k sum. Measured on the H200 against fp32 rows (tools/PERF_LOG.md "bf16 FC2
    // rows"): kimi-k3.1-tp8 T = 1 25.1 -> 23.5 us, T = 256 662 -> 651; gpt-oss-120b T = 256 683
    // -> 674.
    p.out_dtype = DType::kBF16;
  }
  return p;
}

// Where FC1 of the 16-row bucket runs kFc1WideKTile, the mma.sync tiles stay faster than the
// warpgroup tile up to 14 rows per expert, not 12. Measured on the H200 (tools/PERF_LOG.md "FC1's
// 16-row tile over 256-wide K stages", layer us, warpgroup from 12 against from 14):
// qwen3-30b-a3b T = 192 (12 rows) 129.0 against 120.6; deepseek-v4-flash-tp4 T = 512 (12 rows)
// 314.8 against 309.6; at 14 and 16 rows the warpgroup tile still wins (gpt-oss-120b T = 448
// 581 against 628; qwen3-30b-a3b T = 256 139.2 against 150.6). gpt-oss-120b (128-wide FC1
// stages) keeps 12: T = 384 567.6 against 575.5.
constexpr int kWideKWgmmaMinRows = 14;

// The least rows per routed expert at which `wg` replaces its bucket's tile on `shape`.
int wgmma_min_rows(const WgmmaTile& wg, const ModelShape& shape) {
  if (wg.bucket == kFc1WideKTile.bucket && fc1_wide_k(shape)) {
    return std::max(wg.min_rows_per_expert, kWideKWgmmaMinRows);
  }
  return wg.min_rows_per_expert;
}

// Why: the route kernels count rows and padded rows in int (route.cuh), which the shape rules'
// limits keep far under 2^31 (T x top_k <= 2^26); a raised limit must not wrap them silently.
// (256: wider than any route block the planner takes.)
static_assert(kern::moe::route_max_padded_rows(static_cast<long long>(kMaxTokensLimit) * kMaxTopK,
                                               kMaxRoutedLocalExperts, 256) <= INT_MAX,
              "the route's int row counts must hold every accepted T x top_k");

// Whether the warpgroup tile's input offsets fit: it keeps each input copy's source as a 32-bit
// element offset from the input (moe_gemm_wg.cuh setup_inputs), which holds FC1's T x H hidden
// rows and FC2's padded rows x I activations only below 2^32 elements (8 GB of bf16). Above, the
// mma.sync tile of the same bucket (64-bit offsets) runs instead; e.g. E = 8, k = 2, H = 4096,
// I = 14336 from T ~ 149000, where FC2's input passes 2^32 elements.
bool wgmma_offsets_fit(const GemmTile& tile, const ModelShape& shape, int tokens) {
  constexpr long long kElements = 1LL << 32;
  const long long rows = static_cast<long long>(tokens) * shape.top_k;
  const long long padded = kern::moe::route_max_padded_rows(rows, shape.num_experts, tile.block_n);
  return static_cast<long long>(tokens) * shape.hidden < kElements &&
         padded * shape.intermediate < kElements;
}

// The wgmma variant of `tile`'s bucket for T, or null where the bucket has none at T's rows per
// expert, or where its input offsets would not fit (wgmma_offsets_fit).
const WgmmaTile* wgmma_tile_for(const GemmTile& tile, const ModelShape& shape, int tokens) {
  if (!wgmma_offsets_fit(tile, shape, tokens)) return nullptr;
  const long long rows = static_cast<long long>(tokens) * shape.top_k;
  // The shorter GEMM's 64-wide K tiles (FC1 runs H, FC2 I).
  const int k_tiles =
      kern::moe::ceil_div(std::min(shape.hidden, shape.intermediate), kern::moe::layout::kAtomK);
  for (const WgmmaTile& wg : kWgmmaTiles) {
    if (wg.bucket == tile.bucket &&
        wg.takes(rows, routed_experts(shape), wgmma_min_rows(wg, shape), k_tiles)) {
      return &wg;
    }
  }
  return nullptr;
}

MarlinMoeParams wgmma_params(const WgmmaTile& wg, MoeGemmStage stage, const ModelShape& shape) {
  MarlinMoeParams p;
  p.stage = stage;
  p.block_m = 64 * wg.warpgroups * wg.tiles_m;
  p.block_n = wg.block_n;
  p.block_k = kern::moe::layout::kAtomK;
  p.stages = wg.stages;
  p.warps_m = 4 * wg.warpgroups;
  p.warps_n = 1;
  p.warps_k = 1;
  p.min_blocks_per_sm = wg.min_blocks_per_sm;
  p.wgmma_n = wg.wgmma_n;
  p.has_bias = shape.has_bias;
  // The same stage roles as the mma.sync tile (early weights, activation, bf16 FC2 rows).
  const MarlinMoeParams roles = gemm_params(GemmTile{}, stage, shape);
  p.early_weights = roles.early_weights;
  p.activation = roles.activation;
  p.out_dtype = roles.out_dtype;
  return p;
}

std::size_t to_size(unsigned long long v) { return static_cast<std::size_t>(v); }

std::size_t align_up(std::size_t bytes) {
  const std::size_t a = static_cast<std::size_t>(kern::moe::kRouteAlign);
  return (bytes + a - 1) / a * a;
}

}  // namespace

static_assert(kMaxKSplits == kern::moe::kMaxKSplits,
              "moe_plan.hpp's copy of kern::moe::kMaxKSplits");

double expected_experts_touched(int experts, int top_k, int tokens) {
  const double e = experts;
  const double miss = 1.0 - std::min(1.0, static_cast<double>(top_k) / e);
  return e * (1.0 - std::pow(miss, tokens));
}
double expected_experts_touched(const ModelShape& shape, int tokens) {
  return expected_experts_touched(shape.num_experts, shape.top_k, tokens);
}

int marlin_moe_threads(const MarlinMoeParams& p) { return 32 * p.warps_m * p.warps_n * p.warps_k; }

int marlin_moe_m_tiles(const MarlinMoeParams& p, int m_atoms) {
  const int atoms_per_tile = p.block_m / kern::moe::layout::kAtomRows;
  return (m_atoms + atoms_per_tile - 1) / atoms_per_tile;
}

long long marlin_moe_smem_bytes(const MarlinMoeParams& p) {
  if (p.warps_m <= 0 || p.warps_n <= 0 || p.block_n <= 0) return 0;
  if (p.wgmma_n != 0) {
    // MoeGemmWgTraits::kSmemBytes: stages of (wgmma_n input rows of 128 bytes + the CTA's weight
    // atoms and scales for 64 K), each rounded to 1024, or the staging tile if larger; token
    // ids, rows and top-k weights; 1024 for alignment.
    const long long atoms_m = p.block_m / kern::moe::layout::kAtomRows;
    const long long stage_raw =
        static_cast<long long>(p.wgmma_n) * 128 +
        atoms_m * (kern::moe::layout::kAtomBytes + kern::moe::layout::kAtomScaleBytes);
    const long long stage = (stage_raw + 1023) / 1024 * 1024;
    // The epilogue's staging tile: wgmma_n rows of the CTA's outputs (FC1: 8 bf16 per strip,
    // FC2: 16 of out_dtype), each padded by 16 bytes; it reuses the ring.
    const bool fc1 = p.stage == MoeGemmStage::kFc1;
    const long long out_bytes = fc1 || p.out_dtype == DType::kBF16 ? 2 : 4;
    const long long staging = static_cast<long long>(p.wgmma_n) *
                              (atoms_m * (fc1 ? kern::moe::layout::kGateUpRows
                                              : kern::moe::layout::kAtomRows) *
                                   out_bytes +
                               16);
    return std::max(p.stages * stage, staging) + 3LL * p.wgmma_n * 4 + 1024;
  }
  const long long atoms_m = p.block_m / kern::moe::layout::kAtomRows;
  const long long atoms_k = p.block_k / kern::moe::layout::kAtomK;
  const long long warp_atoms_m = atoms_m / p.warps_m;
  const long long warp_tiles_n = p.block_n / 8 / p.warps_n;
  const long long stage_weight = atoms_m * atoms_k * kern::moe::layout::kAtomBytes;
  const long long stage_scale = atoms_m * atoms_k * kern::moe::layout::kAtomScaleBytes;
  const long long input_row = static_cast<long long>(p.block_k) * 2 + 16;
  const long long stage_input = static_cast<long long>(p.block_n) * input_row;
  const long long stage = stage_weight + stage_scale + stage_input;
  const long long acc_regs = warp_atoms_m * warp_tiles_n * 4;
  const long long reduce =
      static_cast<long long>(p.warps_k - 1) * p.warps_m * p.warps_n * acc_regs * 32 * 4;
  const long long pipe = std::max(static_cast<long long>(p.stages) * stage, reduce);
  return pipe + 3LL * p.block_n * 4;  // + ids, input rows, FC2's top-k weights
}

static_assert(route_rank_shared_bytes(kMaxRoutedLocalExperts, 32) <= kRouteStaticSharedLimit &&
                  route_rank_shared_bytes(kMaxRoutedLocalExperts + 1, 32) > kRouteStaticSharedLimit,
              "kMaxRoutedLocalExperts is the most local experts the route's rank tables serve");

// What every CUDA GPU allows a CTA: the limit assumed for an arch the table below does not know.
constexpr long long kAssumedSmemBytes = 48 * 1024;

long long max_dynamic_smem_bytes(const Arch& arch) {
  switch (arch.sm) {
    case 70:
    case 72:
      return 96 * 1024;
    case 75:
      return 64 * 1024;
    case 80:
    case 87:
      return 163 * 1024;
    case 86:
    case 89:
    case 120:
    case 121:
      return 99 * 1024;
    case 90:
    case 100:
    case 101:
    case 103:
    case 110:
      return 227 * 1024;
    default:
      // Why: an arch this table does not know gets the limit every CUDA GPU allows.
      return kAssumedSmemBytes;
  }
}

std::string smem_limit_text(const Arch& arch) {
  const long long limit = max_dynamic_smem_bytes(arch);
  std::string text = arch.name() + " allows at most " + std::to_string(limit);
  if (limit == kAssumedSmemBytes) {
    text += " (assumed: the planner has no figure for " + arch.name() +
            ", and every CUDA GPU allows that much)";
  }
  return text;
}

bool wgmma_runs_on(const Arch& arch) { return arch.sm == 90 && arch.arch_specific; }

namespace {

// The 8-row bucket's tiles by how many CTAs a GEMM of it has (expected touched experts x its
// tiles of the GEMM's weight rows, against the CTA slots of the H200 the rules were measured on):
// - Tall: 128 rows, four warps of two atoms, four CTAs per SM, from kTallMinWaves waves. FC1
//   (tools/PERF_LOG.md "marlin_moe taller CTAs"), as eight warps of one atom at three CTAs per
//   SM: faster at T = 24 and 96 (gpt-oss-120b T = 96 515 against 527 us, qwen3-30b-a3b 120 against
//   125), slower at T = 6 where few CTAs remain (deepseek-v4-flash-tp4: 288 of them, 54.2 against
//   52.3 us); that rule took it from 2 x 3 x 132 = 792 CTAs. Four warps of two atoms over
//   128-wide K tiles were faster again ("two atoms a warp"): gpt-oss-120b T = 96 527, 526 -> 505,
//   506 us; kimi-k3.1-tp8 T = 24 221, 221 -> 215, 217; the threshold stays at 792 CTAs, 1.5 waves
//   of the four-CTA slots. FC2 where its K is long (the short-K tile otherwise) takes it by the
//   same rule ("the 8-row bucket's tiles by waves"): gpt-oss-120b T = 24 278.7, 278.7 -> 273.0,
//   270.9 us; T = 96 488.9, 494.0 -> 478.5, 481.0.
// - Wave: the bucket's 64 rows at three stages and five CTAs per SM, from one wave of its
//   four-CTA slots ("the 8-row bucket's tiles by waves"), layer time against the four-stage
//   tile: faster from a wave (kimi-k3.1-tp8 T = 3, 564 FC1 CTAs: FC1 28.3 -> 25.6 us;
//   deepseek-v4-flash-tp4 T = 6, 576: 31.1 -> 28.9; qwen3-30b-a3b T = 6: 26.2 -> 24.6; kimi T = 6:
//   45.6 -> 42.9), slower below one, where depth per CTA is what keeps bytes in flight (qwen3
//   T = 3, 480 FC1 CTAs: 14.8 -> 16.3; gpt-oss-120b T = 3, 495 FC2 CTAs: 17.2 -> 20.8).
// - Else the bucket's four-stage tile.
constexpr GemmTile kTallTiles[] = {{Bucket::kRows8, 0, 128, 8, 128, 4, 4, 1, 1, 4}};
constexpr const GemmTile& kTallTile = kTallTiles[0];
constexpr double kTallMinWaves = 1.5;
static_assert(shares_route_blocks(kTallTiles),
              "the tall tile serves a GemmTile bucket with its route block");
constexpr GemmTile kWaveTiles[] = {{Bucket::kRows8, 0, 64, 8, 256, 3, 4, 1, 1, 5}};
constexpr const GemmTile& kWaveTile = kWaveTiles[0];
static_assert(shares_route_blocks(kWaveTiles),
              "the wave tile serves a GemmTile bucket with its route block");

// Expected waves of a GEMM over `rows` weight rows on `tile`: its CTAs (expected touched experts
// x tiles of block_m rows) over the planned GPU's slots of min_blocks_per_sm CTAs per SM.
double expected_waves(const ModelShape& shape, int tokens, int rows, const GemmTile& tile) {
  const double ctas =
      expected_experts_touched(shape, tokens) * kern::moe::ceil_div(rows, tile.block_m);
  return ctas / (static_cast<double>(kPlannedSms) * tile.min_blocks_per_sm);
}

// `tile`, or for the 8-row bucket its tall or wave variant for a GEMM over `rows` weight rows.
const GemmTile& small_block_tile_for(const GemmTile& tile, const ModelShape& shape, int tokens,
                                     int rows) {
  if (tile.bucket != kSmallBlockTile.bucket) return tile;
  if (expected_waves(shape, tokens, rows, kTallTile) >= kTallMinWaves) return kTallTile;
  if (expected_waves(shape, tokens, rows, tile) >= 1.0) return kWaveTile;
  return tile;
}

const GemmTile& fc1_tile_for(const GemmTile& tile, const ModelShape& shape, int tokens) {
  if (tile.bucket == kFc1WideKTile.bucket && fc1_wide_k(shape)) return kFc1WideKTile;
  return small_block_tile_for(tile, shape, tokens, 2 * shape.intermediate);  // gate and up
}

// Whether the 16-row bucket's FC2 takes its short-K tile: where the bucket's first T already
// gives that tile kFc2ShortKMinWaves waves of CTAs (the count only grows with T, so one tile
// serves the whole bucket).
bool mid_fc2_short_k(const GemmTile& short_k, const ModelShape& shape) {
  const long long first = small_block_last_tokens(shape) + 1;
  if (first > INT_MAX) return false;
  return expected_waves(shape, static_cast<int>(first), shape.hidden, short_k) >=
         kFc2ShortKMinWaves;
}

// FC2's short-K tile in `tile`'s bucket where the shape's K calls for it (and for 16-row blocks
// its CTAs fill kFc2ShortKMinWaves waves), else null.
const GemmTile* fc2_short_k_for(const GemmTile& tile, const ModelShape& shape) {
  const GemmTile* short_k = fc2_short_k_tile(tile, shape);
  if (short_k == nullptr) return nullptr;
  if (short_k->bucket != Bucket::kRows16 || mid_fc2_short_k(*short_k, shape)) return short_k;
  return nullptr;
}

// FC2's tile in `tile`'s bucket: `short_k` (fc2_short_k_for) where the shape's K calls for it,
// kFc2FewWavesTile where K is short but short_k's waves were too few.
const GemmTile& fc2_tile_for(const GemmTile& tile, const GemmTile* short_k, const ModelShape& shape,
                             int tokens) {
  if (short_k != nullptr) return *short_k;
  if (tile.bucket == kFc2FewWavesTile.bucket && fc2_short_k_tile(tile, shape) != nullptr) {
    return kFc2FewWavesTile;
  }
  return small_block_tile_for(tile, shape, tokens, shape.hidden);
}
const GemmTile& fc2_tile_for(const GemmTile& tile, const ModelShape& shape, int tokens) {
  return fc2_tile_for(tile, fc2_short_k_for(tile, shape), shape, tokens);
}

// FC2's K splits (MarlinMoeParams::k_splits, moe_gemm.cuh): where FC2's expected CTAs fill under
// kFc2SplitMaxWaves of the planned GPU's slots, the fewest splits that fill a wave, each split at
// least a ring's worth of K tiles (`stages`), no split empty, at most kMaxKSplits.
// Why: few experts with a long K leave most SMs idle with few bytes in flight. On the H200
// (tools/PERF_LOG.md "the eight public shapes on both paths"), llama-4-scout at T = 1 (one
// expert, 160 CTAs of 32 K tiles for 528 slots) took ~30 us of FC2 for 22 MB, 5.3 us at the copy
// rate; mixtral-8x7b (256 CTAs of 56 K tiles) 26.4 us for 62 MB.
// Why the fewest that fill a wave, not the most within one ("the fewest splits that fill a
// wave"): layer us, most-within -> fewest-filling, llama-4-scout T = 1 / 2 / 3 / 4 30.4 -> 28.3,
// 50.1 -> 44.5, 67.0 -> 62.8, 88.0 -> 82.4; mixtral-8x7b 60.9 -> 59.1, 115.5 -> 108.1, 140.8 ->
// 124.7, 140.2 -> 125.0; phi-3.5-moe T = 3 / 4 71.1 -> 66.1, 79.7 -> 75.2 (T = 1 32.1 -> 32.9);
// gpt-oss-120b T = 1 27.2 -> 24.8. Why under 0.9 waves: near one wave a split only doubles the
// CTAs (gpt-oss-120b T = 3, 0.99 waves: 51.6 -> 53.3 us; phi-3.5-moe T = 2, 0.91: 52.5 -> 52.4),
// while 0.85 gained (mixtral-8x7b T = 2: -6%).
constexpr double kFc2SplitMaxWaves = 0.9;
// Only up to kFc2SplitMaxTokens: the case is a small-T one, and the bound keeps the workspace's
// scan of where the splits change (moe_config_segment_ends) short.
constexpr int kFc2SplitMaxTokens = 256;
// The splits of an FC2 whose CTAs fill `waves` of the slots, over `block_k`-wide K tiles run
// `stages` deep (the rule above). Never over a short K (I <= kFc2ShortK): there a CTA's fixed
// costs already outweigh its few K tiles (kFc2ShortKTiles), and a split would halve those again.
int k_splits_for(const ModelShape& shape, int tokens, double waves, int block_k, int stages) {
  if (tokens > kFc2SplitMaxTokens || shape.intermediate <= kFc2ShortK) return 1;
  if (!(waves > 0.0) || waves >= kFc2SplitMaxWaves) return 1;
  const int k_tiles = kern::moe::ceil_div(
      kern::moe::layout::fc2_dims(shape.intermediate, shape.hidden).k_atoms,
      block_k / kern::moe::layout::kAtomK);
  int splits = static_cast<int>(std::min<double>(kMaxKSplits, std::ceil(1.0 / waves)));
  splits = std::min(splits, k_tiles / stages);
  while (splits > 1 && (splits - 1) * kern::moe::ceil_div(k_tiles, splits) >= k_tiles) --splits;
  return std::max(splits, 1);
}
int fc2_k_splits(const GemmTile& fc2, const ModelShape& shape, int tokens) {
  return k_splits_for(shape, tokens, expected_waves(shape, tokens, shape.hidden, fc2), fc2.block_k,
                      fc2.stages);
}
// The warpgroup FC2's splits: its CTAs are each touched expert's groups of wgmma_n rows times its
// M tiles of 64 x warpgroups x tiles_m rows.
int fc2_wgmma_k_splits(const WgmmaTile& wg, const ModelShape& shape, int tokens) {
  const double touched = expected_experts_touched(shape, tokens);
  if (!(touched > 0.0)) return 1;
  const double rows = static_cast<double>(tokens) * shape.top_k / touched;  // a touched expert's
  const double groups = touched * std::max(1.0, std::ceil(rows / wg.wgmma_n));
  const int m_tiles = kern::moe::ceil_div(shape.hidden, 64 * wg.warpgroups * wg.tiles_m);
  const double waves =
      groups * m_tiles / (static_cast<double>(kPlannedSms) * wg.min_blocks_per_sm);
  return k_splits_for(shape, tokens, waves, kern::moe::layout::kAtomK, wg.stages);
}

}  // namespace

MoeForwardConfig choose_moe_config(const ModelShape& shape, int tokens) {
  MoeForwardConfig c;
  c.tokens = tokens;
  if (tokens >= 1 && tokens <= kDecodeMaxTokens && decode_shape_ok(shape)) {
    const MoeDecodeParams pair = choose_decode_pair(shape, tokens);
    if (pair.max_tokens != 0) {
      c.decode = true;
      c.decode_pair = true;
      c.decode_first = pair;
      c.decode_second = decode_pair_fc2_params(pair);
    } else {
      c.decode_second = choose_decode_config(shape, tokens, 0);
      c.decode = c.decode_second.stages != 0;
      c.decode_first = decode_reset_params(c.decode_second);
      c.decode_combine = decode_combine_params(c.decode_second);
    }
  }
  c.narrow_ids = shape.id_dtype == DType::kI64;
  c.narrow.block_threads = kNarrowIdsThreads;

  const GemmTile& tile = tile_for(shape, tokens);
  c.fc1 = gemm_params(fc1_tile_for(tile, shape, tokens), MoeGemmStage::kFc1, shape);
  const GemmTile* fc2_short_k = fc2_short_k_for(tile, shape);
  const GemmTile& fc2_tile = fc2_tile_for(tile, fc2_short_k, shape, tokens);
  c.fc2 = gemm_params(fc2_tile, MoeGemmStage::kFc2, shape);
  c.fc2.k_splits = fc2_k_splits(fc2_tile, shape, tokens);
  if (c.fc2.k_splits > 1) c.fc2.out_dtype = DType::kF32;  // the splits' partial sums
  c.fc2_short_k = fc2_short_k != nullptr;
  const WgmmaTile* wg = wgmma_tile_for(tile, shape, tokens);
  if (wg != nullptr) {
    c.wgmma = true;
    c.fc1_wgmma = wgmma_params(*wg, MoeGemmStage::kFc1, shape);
    c.fc2_wgmma = wgmma_params(*wg, MoeGemmStage::kFc2, shape);
    c.fc2_wgmma.k_splits = fc2_wgmma_k_splits(*wg, shape, tokens);
    if (c.fc2_wgmma.k_splits > 1) c.fc2_wgmma.out_dtype = DType::kF32;  // partial sums
  }

  const long long rows = static_cast<long long>(tokens) * shape.top_k;
  const int threads = route_threads_for(shape.num_experts, rows);
  c.route.num_experts = shape.num_experts;
  c.route.top_k = shape.top_k;
  c.route.block_m = tile.block_n;  // route block == the GEMM's token tile
  // The warpgroup tile's CTAs take groups of its wgmma_n rows: the route lists them, so its grid
  // holds groups, not blocks (moe_gemm_wg.cuh).
  c.route.group_rows = c.wgmma ? c.fc1_wgmma.wgmma_n : 0;
  c.route.block_threads = threads;
  c.route_single = rows <= route_single_rows(threads);
  c.route.kernel = c.route_single ? RouteKernel::kSingle : RouteKernel::kRank;
  // Why the one-CTA kernel's C is its bound at every T: the one-launch path needs N <= C, and
  // one kernel per thread count then serves all of its one-launch T (512 threads up to 1024
  // entries, 1024 threads above).
  if (c.route_single) {
    c.route.chunk_rows = route_single_rows(threads);
  } else if (rows <= kRouteLargeRows) {
    c.route.chunk_rows = std::min(kRouteChunkRows, kRouteMaxItems * threads);
  } else {
    c.route.chunk_rows = std::min(kRouteLargeChunkRows, kRouteMaxItems * threads);
  }

  c.combine.hidden = shape.hidden;
  c.combine.top_k = shape.top_k;
  c.combine.in_dtype = c.fc2.out_dtype;
  c.combine.block_threads = tokens <= kCombineSmallTokens ? kCombineSmallThreads : kCombineThreads;
  c.combine.k_splits = c.fc2.k_splits;
  c.combine_wgmma = c.combine;
  if (c.wgmma) {
    c.combine_wgmma.in_dtype = c.fc2_wgmma.out_dtype;
    c.combine_wgmma.k_splits = c.fc2_wgmma.k_splits;
  }
  return c;
}

// The tiles were sized for the H200's 227 KB a CTA. Where a device allows less (sm_86, sm_89,
// sm_120: 99 KB), the same tile runs with fewer stages, down to the fewest its main loop takes:
// rows, route block and workspace stay as planned, so one route and one workspace serve every
// arch. (The widest mma.sync tile, T > 1024, needs 105,216 bytes at four stages: sm_86, sm_89
// and sm_120 run it at three.) Not measured on such a device.
namespace {
void fit_stages_to(const Arch& arch, MarlinMoeParams* p) {
  const int fewest = p->wgmma_n != 0 ? 3 : 2;  // kernel_spec.cpp's marlin rules
  const long long limit = max_dynamic_smem_bytes(arch);
  while (p->stages > fewest && marlin_moe_smem_bytes(*p) > limit) --p->stages;
}
}  // namespace

ForwardChoice choose_forward_path(const ModelShape& shape, const MoeForwardConfig& config,
                                  const MoeForwardOptions& options, const Arch& arch) {
  const bool forced = options.path == MoePath::kDecode;
  const bool want = forced || (options.path == MoePath::kAuto && decode_by_default(config));
  ForwardChoice choice;
  if (!want || !config.decode) return choice;
  if (config.decode_pair && options.decode_block_n == 0 &&
      decode_moe_runs_on(config.decode_first, arch) &&
      decode_moe_runs_on(config.decode_second, arch)) {
    choice.path = ForwardPath::kPair;
    choice.decode = config.decode_first;
    return choice;
  }
  // Why not kAuto's persistent tile without a forced block_n: where the pair does not run on this
  // device (its shared memory) marlin_moe is the faster path (decode_by_default).
  if (!forced && options.decode_block_n == 0) return choice;
  choice.decode = options.decode_block_n != 0
                      ? choose_decode_config(shape, config.tokens, options.decode_block_n)
                  : config.decode_pair ? choose_decode_config(shape, config.tokens, 0)
                                       : config.decode_second;
  if (choice.decode.stages != 0 && decode_moe_runs_on(choice.decode, arch)) {
    choice.path = ForwardPath::kPersistent;
  }
  return choice;
}

MoeForwardSpecs moe_forward_specs(const MoeForwardConfig& config, const Arch& arch) {
  MoeForwardSpecs s;
  s.decode = config.decode && decode_moe_runs_on(config.decode_first, arch) &&
             decode_moe_runs_on(config.decode_second, arch);
  if (s.decode) {
    s.decode_first = decode_moe_spec(config.decode_first, arch);
    s.decode_second = decode_moe_spec(config.decode_second, arch);
    s.decode_has_combine = !config.decode_pair;
    if (s.decode_has_combine) s.decode_combine = decode_moe_spec(config.decode_combine, arch);
  }
  s.has_narrow = config.narrow_ids;
  if (s.has_narrow) s.narrow = KernelSpec{Family::kNarrowIds, arch, config.narrow};
  static constexpr RouteKernel kMulti[] = {RouteKernel::kRank, RouteKernel::kScan,
                                           RouteKernel::kScatter};
  s.route_count = config.route_single ? 1 : 3;
  for (int i = 0; i < s.route_count; ++i) {
    MoeRouteParams part = config.route;
    part.kernel = config.route_single ? RouteKernel::kSingle : kMulti[i];
    // Why: the rank kernel never reads the block size (it ranks entries within their chunk), so
    // every block size shares one rank kernel instead of one compile per block size.
    if (part.kernel == RouteKernel::kRank) part.block_m = kRouteRankBlockM;
    // Groups only for the warpgroup tile, which the rank kernel never serves either.
    if (part.kernel == RouteKernel::kRank || !(config.wgmma && wgmma_runs_on(arch))) {
      part.group_rows = 0;
    }
    s.route[i] = KernelSpec{Family::kRoute, arch, part};
  }
  const bool wgmma = config.wgmma && wgmma_runs_on(arch);
  const bool fc2_wgmma = wgmma && !config.fc2_short_k;
  s.fc1_params = wgmma ? config.fc1_wgmma : config.fc1;
  s.fc2_params = fc2_wgmma ? config.fc2_wgmma : config.fc2;
  fit_stages_to(arch, &s.fc1_params);
  fit_stages_to(arch, &s.fc2_params);
  // A warpgroup GEMM reads the route's group list of its own N: the route must list exactly those.
  const int groups = std::get<MoeRouteParams>(s.route[s.route_count - 1].params).group_rows;
  if (groups != s.fc1_params.wgmma_n ||
      (s.fc2_params.wgmma_n != 0 && s.fc2_params.wgmma_n != groups)) {
    throw Error(ErrorCode::kInternal,
                "moe plan: the route lists groups of " + std::to_string(groups) +
                    " rows but the warpgroup GEMMs take " + std::to_string(s.fc1_params.wgmma_n) +
                    " (FC1) and " + std::to_string(s.fc2_params.wgmma_n) + " (FC2)");
  }
  // Per-tile order where both GEMMs take the same tiles of the route: both warpgroup GEMMs (the
  // same groups, checked above), or both mma.sync GEMMs (the same blocks).
  s.gemm_chain = s.fc1_params.wgmma_n == s.fc2_params.wgmma_n &&
                 s.fc1_params.block_n == s.fc2_params.block_n && s.fc2_params.early_weights;
  s.fc1 = KernelSpec{Family::kMarlinMoe, arch, s.fc1_params};
  s.fc2 = KernelSpec{Family::kMarlinMoe, arch, s.fc2_params};
  s.combine = KernelSpec{Family::kCombine, arch, fc2_wgmma ? config.combine_wgmma : config.combine};
  return s;
}

std::vector<KernelSpec> decode_chain(const MoeForwardSpecs& s) {
  if (!s.decode) return {};
  std::vector<KernelSpec> specs = {s.decode_first, s.decode_second};
  if (s.decode_has_combine) specs.push_back(s.decode_combine);
  return specs;
}

std::vector<KernelSpec> marlin_chain(const MoeForwardSpecs& s) {
  std::vector<KernelSpec> specs;
  if (s.has_narrow) specs.push_back(s.narrow);
  specs.insert(specs.end(), s.route, s.route + s.route_count);
  specs.insert(specs.end(), {s.fc1, s.fc2, s.combine});
  return specs;
}

std::vector<KernelSpec> moe_config_specs(const MoeForwardConfig& config, const Arch& arch) {
  const MoeForwardSpecs s = moe_forward_specs(config, arch);
  std::vector<KernelSpec> specs = decode_chain(s);
  const std::vector<KernelSpec> marlin = marlin_chain(s);
  specs.insert(specs.end(), marlin.begin(), marlin.end());
  return specs;
}

std::vector<int> moe_config_segment_ends(const ModelShape& shape, int max_tokens) {
  std::vector<int> ends;
  if (max_tokens < 1) return ends;
  const int k = std::max(shape.top_k, 1);
  std::vector<long long> thresholds = {kCombineSmallTokens, kRouteSingleRows / k,
                                       route_single_rows(route_threads(shape.num_experts)) / k,
                                       kRouteLargeRows / k};
  // The T buckets' ends; the 8-row blocks end by rows per expert (small_last below).
  for (const GemmTile& tile : kGemmTiles) {
    if (tile.max_tokens > 0) thresholds.push_back(tile.max_tokens);
  }
  // The last T below each warpgroup tile's rows-per-expert bounds.
  for (const WgmmaTile& wg : kWgmmaTiles) {
    for (const int bound : {wgmma_min_rows(wg, shape), wg.below_rows_per_expert}) {
      const long long need = static_cast<long long>(bound) * routed_experts(shape);
      if (need > 0) thresholds.push_back((need + k - 1) / k - 1);
    }
  }
  // The last T whose warpgroup tiles' input offsets fit 32 bits (wgmma_offsets_fit), where a
  // larger T reaches max_tokens: above it the mma.sync tiles run. The fit only fails at T far
  // past the last bucket's start, where the tile no longer changes, so it holds up to one T.
  {
    const auto fits = [&](long long t) {
      return wgmma_offsets_fit(tile_for(shape, static_cast<int>(t)), shape, static_cast<int>(t));
    };
    if (!fits(max_tokens)) {
      long long fit = 0;  // fits(fit) (or fit = 0); !fits(miss)
      long long miss = max_tokens;
      while (miss - fit > 1) {
        const long long mid = fit + (miss - fit) / 2;
        (fits(mid) ? fit : miss) = mid;
      }
      thresholds.push_back(fit);
    }
  }
  // marlin_moe: the last T of 8-row route blocks, and where FC1 and FC2 change tiles inside
  // them (fc1_tile_for, fc2_tile_for: their CTA counts only grow with T).
  const long long small_last = small_block_last_tokens(shape);
  thresholds.push_back(small_last);
  const GemmTile* fc1_previous = nullptr;
  const GemmTile* fc2_previous = nullptr;
  for (long long t = kFirstTile.max_tokens + 1; t <= std::min<long long>(max_tokens, small_last);
       ++t) {
    const GemmTile* fc1 = &fc1_tile_for(kSmallBlockTile, shape, static_cast<int>(t));
    const GemmTile* fc2 = &fc2_tile_for(kSmallBlockTile, shape, static_cast<int>(t));
    if ((fc1_previous != nullptr && fc1 != fc1_previous) ||
        (fc2_previous != nullptr && fc2 != fc2_previous)) {
      thresholds.push_back(t - 1);
    }
    fc1_previous = fc1;
    fc2_previous = fc2;
  }
  // FC2's K splits: they change with T while FC2's CTAs fill under kFc2SplitMaxWaves, and the
  // bytes of its rows change with them (moe_workspace_layout).
  {
    const auto splits_at = [&](int t) {
      const MoeForwardConfig c = choose_moe_config(shape, t);
      return std::pair{c.fc2.k_splits, c.fc2_wgmma.k_splits};
    };
    std::pair<int, int> previous = splits_at(1);
    for (int t = 2; t <= std::min(max_tokens, kFc2SplitMaxTokens + 1); ++t) {
      const std::pair<int, int> current = splits_at(t);
      if (current != previous) thresholds.push_back(t - 1);
      previous = current;
    }
  }
  // decode_moe: its tile changes with T (block_n, strips per item) and it ends at T = 256.
  if (decode_shape_ok(shape)) {
    const int last = std::min(max_tokens, kDecodeMaxTokens);
    MoeDecodeParams previous = choose_moe_config(shape, 1).decode_second;
    for (int t = 2; t <= last; ++t) {
      const MoeDecodeParams current = choose_moe_config(shape, t).decode_second;
      if (!(current == previous)) thresholds.push_back(t - 1);
      previous = current;
    }
    thresholds.push_back(kDecodeMaxTokens);
  }
  for (long long t : thresholds) {
    if (t >= 1 && t < max_tokens) ends.push_back(static_cast<int>(t));
  }
  ends.push_back(max_tokens);
  std::sort(ends.begin(), ends.end());
  ends.erase(std::unique(ends.begin(), ends.end()), ends.end());
  return ends;
}

MoeRepackParams moe_repack_params(bool gate_up) {
  MoeRepackParams p;
  p.gate_up = gate_up;
  p.block_threads = kRepackThreads;
  return p;
}

GemmPrefetch fc1_prefetch(const ModelShape& shape, const MoeForwardConfig& config,
                          const MarlinMoeParams& fc1, const MoeWeightSizes& sizes,
                          long long max_blocks, int sms, const Arch& arch) {
  if (arch.sm < 90 || sms <= 0 || max_blocks <= 0 || config.tokens <= 0) return {};
  // A local expert is untouched when none of the T tokens picks it among the routed experts of
  // all ranks (uniform routing).
  const int routed = shape.global_experts > 0 ? shape.global_experts : shape.num_experts;
  const double miss = 1.0 - std::min(1.0, static_cast<double>(shape.top_k) / routed);
  if (std::pow(miss, config.tokens) > kFc1PrefetchMaxUntouched) return {};
  const int atoms_per_tile = fc1.block_m / kern::moe::layout::kAtomRows;
  const long long m_tiles = marlin_moe_m_tiles(fc1, sizes.fc1_m_atoms);
  const long long wave = static_cast<long long>(sms) * fc1.min_blocks_per_sm;
  GemmPrefetch out;
  out.experts = static_cast<int>(std::min<long long>(
      {static_cast<long long>(shape.num_experts), max_blocks, (wave + m_tiles - 1) / m_tiles}));
  out.m_tiles = static_cast<int>(m_tiles);
  const long long atom_bytes = kern::moe::layout::kAtomBytes + kern::moe::layout::kAtomScaleBytes;
  const long long strips = static_cast<long long>(out.experts) * out.m_tiles * atoms_per_tile;
  out.k_atoms = static_cast<int>(
      std::clamp<long long>(kFc1PrefetchBytes / (strips * atom_bytes), 1, sizes.fc1_k_atoms));
  return out;
}

long long fc2_set_rows(const MarlinMoeParams& fc2, const MoeWorkspaceLayout& layout) {
  return fc2.wgmma_n != 0 ? layout.max_groups * fc2.wgmma_n : layout.max_blocks * fc2.block_n;
}

MoeWorkspaceLayout moe_workspace_layout(const ModelShape& shape, const MoeForwardConfig& config) {
  const long long rows = static_cast<long long>(config.tokens) * shape.top_k;
  const kern::moe::RouteWorkspaceLayout route =
      kern::moe::route_workspace_layout(rows, shape.num_experts, config.route.block_m,
                                        config.route.chunk_rows, config.route.group_rows);
  MoeWorkspaceLayout w;
  w.expert_counts = to_size(route.expert_counts);
  w.expert_block_offset = to_size(route.expert_block_offset);
  w.sorted_rows = to_size(route.sorted_rows);
  w.block_expert = to_size(route.block_expert);
  w.slot_row = to_size(route.slot_row);
  w.total_blocks = to_size(route.total_blocks);
  w.chunk_base = to_size(route.chunk_base);
  w.expert_group_offset = to_size(route.expert_group_offset);
  w.group_tiles = to_size(route.group_tiles);
  w.tile_done = to_size(route.tile_done);
  w.max_groups = kern::moe::route_max_groups(rows, shape.num_experts, config.route.group_rows);
  w.max_blocks = kern::moe::route_max_blocks(rows, shape.num_experts, config.route.block_m);
  w.padded_rows = kern::moe::route_max_padded_rows(rows, shape.num_experts, config.route.block_m);
  std::size_t at = to_size(route.bytes);
  w.ids32 = at;
  if (config.narrow_ids) at = align_up(at + static_cast<std::size_t>(rows) * 4);
  w.inter = at;
  at = align_up(at + static_cast<std::size_t>(w.padded_rows) *
                         static_cast<std::size_t>(shape.intermediate) * 2);
  w.out2 = at;
  // FC2's rows, for whichever FC2 tile a device runs: the padded rows, or with K splits
  // k_splits sets of fc2_set_rows rows each (for the warpgroup tile its groups x their rows, at
  // least the padded rows), in the tile's element type.
  const auto out2_bytes = [&](const MarlinMoeParams& fc2) {
    const long long out_rows =
        fc2.k_splits == 1 ? w.padded_rows : fc2.k_splits * fc2_set_rows(fc2, w);
    return static_cast<std::size_t>(out_rows) * static_cast<std::size_t>(shape.hidden) *
           (fc2.out_dtype == DType::kF32 ? 4u : 2u);
  };
  std::size_t out2 = out2_bytes(config.fc2);
  if (config.wgmma) out2 = std::max(out2, out2_bytes(config.fc2_wgmma));
  at = align_up(at + out2);
  w.marlin_bytes = at;
  if (config.decode) {
    w.decode_bytes = static_cast<std::size_t>(decode_moe_workspace_bytes(config.decode_second));
  }
  w.bytes = std::max(w.marlin_bytes, w.decode_bytes);
  return w;
}

std::size_t moe_workspace_bytes_for(const ModelShape& shape, int max_tokens) {
  // Why only the segment ends: within a segment the config is fixed and every buffer grows
  // with T, so the largest T of each segment bounds the segment.
  std::size_t bytes = 0;
  for (int t : moe_config_segment_ends(shape, max_tokens)) {
    bytes = std::max(bytes, moe_workspace_layout(shape, choose_moe_config(shape, t)).bytes);
  }
  // Why every T and every block_n: a call may force block_n (MoeForwardOptions), and the decode
  // workspace depends on the tile (block_n, strips per item), not on T itself.
  if (decode_shape_ok(shape)) {
    for (int t = 1; t <= std::min(max_tokens, kDecodePairMaxTokens); ++t) {
      const MoeDecodeParams pair = choose_decode_pair(shape, t);
      if (pair.max_tokens == 0) continue;
      bytes = std::max(bytes, static_cast<std::size_t>(decode_moe_workspace_bytes(pair)));
    }
    for (int t = 1; t <= std::min(max_tokens, kDecodeMaxTokens); ++t) {
      for (int block_n : kDecodeBlockNs) {
        const MoeDecodeParams p = choose_decode_config(shape, t, block_n);
        if (p.stages == 0) continue;
        bytes = std::max(bytes, static_cast<std::size_t>(decode_moe_workspace_bytes(p)));
      }
    }
  }
  return bytes;
}

MoeWeightSizes moe_weight_sizes(const ModelShape& shape) {
  namespace layout = kern::moe::layout;
  const layout::Dims fc1 = layout::fc1_dims(shape.intermediate, shape.hidden);
  const layout::Dims fc2 = layout::fc2_dims(shape.intermediate, shape.hidden);
  MoeWeightSizes s;
  s.fc1_m_atoms = fc1.m_atoms;
  s.fc1_k_atoms = fc1.k_atoms;
  s.fc2_m_atoms = fc2.m_atoms;
  s.fc2_k_atoms = fc2.k_atoms;
  s.w13 = static_cast<std::size_t>(layout::weight_bytes(fc1, shape.num_experts));
  s.w13_scales = static_cast<std::size_t>(layout::scale_bytes(fc1, shape.num_experts));
  s.w2 = static_cast<std::size_t>(layout::weight_bytes(fc2, shape.num_experts));
  s.w2_scales = static_cast<std::size_t>(layout::scale_bytes(fc2, shape.num_experts));
  if (shape.has_bias) {
    s.b13 = static_cast<std::size_t>(shape.num_experts) *
            static_cast<std::size_t>(shape.intermediate) * 2 * 2;
    s.b2 = static_cast<std::size_t>(shape.num_experts) * static_cast<std::size_t>(shape.hidden) * 2;
  }
  return s;
}

std::string moe_shape_problem(const ModelShape& shape) {
  const auto field = [&](const char* name, long long value, const std::string& allowed) {
    return "shape \"" + shape.name + "\": " + name + " = " + std::to_string(value) +
           "; the MoE kernels need " + allowed;
  };
  if (shape.num_experts < 1 || shape.num_experts > kMaxRoutedLocalExperts) {
    return field("num_experts", shape.num_experts,
                 "1.." + std::to_string(kMaxRoutedLocalExperts) +
                     " (the route's per-expert tables fill 48 KB of shared memory)");
  }
  if (shape.top_k < 1 || shape.top_k > 64) return field("top_k", shape.top_k, "1..64");
  if (shape.hidden < 32 || shape.hidden % 32 != 0 || shape.hidden > 65536) {
    return field("hidden", shape.hidden,
                 "a multiple of 32 (one MXFP4 scale per 32 weights along K) in 32..65536");
  }
  if (shape.intermediate < 32 || shape.intermediate % 32 != 0 || shape.intermediate > 65536) {
    return field("intermediate", shape.intermediate,
                 "a multiple of 32 (one MXFP4 scale per 32 weights along K) in 32..65536");
  }
  if (shape.expert_offset < 0 ||
      static_cast<long long>(shape.expert_offset) + shape.num_experts > INT_MAX) {
    return field("expert_offset", shape.expert_offset,
                 ">= 0 with expert_offset + num_experts <= 2^31 - 1");
  }
  if (shape.max_tokens < 1 || shape.max_tokens > (1 << 20)) {
    return field("max_tokens", shape.max_tokens, "1..1048576");
  }
  if (shape.id_dtype != DType::kI32 && shape.id_dtype != DType::kI64) {
    return std::string("shape \"") + shape.name + "\": id_dtype = " + dtype_name(shape.id_dtype) +
           "; the MoE kernels need int32 or int64 ids";
  }
  if (shape.activation_dtype != DType::kBF16) {
    return std::string("shape \"") + shape.name +
           "\": activation_dtype = " + dtype_name(shape.activation_dtype) +
           "; the MoE kernels take bf16 activations";
  }
  if (shape.weight_format != WeightFormat::kMXFP4) {
    return "shape \"" + shape.name + "\": the MoE kernels take MXFP4 weights only";
  }
  const std::string activation = activation_problem(shape.activation);
  if (!activation.empty()) return "shape \"" + shape.name + "\": " + activation;
  // The shared experts as append_shared's template takes them: at most kMaxSharedExperts, a
  // known gate, float logits. (Their intermediate size and scale, which a shape file must give,
  // no kernel here reads: the engine runs their GEMMs and passes append_shared its scale.)
  const SharedExperts& shared = shape.shared;
  if (shared.count < 0 || shared.count > kMaxSharedExperts) {
    return field("shared.count", shared.count, "0.." + std::to_string(kMaxSharedExperts));
  }
  if (shared.count == 0) return "";
  if (shared.gate != SharedGate::kSigmoid && shared.gate != SharedGate::kConstant &&
      shared.gate != SharedGate::kGiven) {
    return field("shared.gate", static_cast<long long>(shared.gate),
                 "SharedGate::kSigmoid, kConstant or kGiven");
  }
  if (shared.logit_dtype != DType::kBF16 && shared.logit_dtype != DType::kF16 &&
      shared.logit_dtype != DType::kF32) {
    return std::string("shape \"") + shape.name +
           "\": shared.logit_dtype = " + dtype_name(shared.logit_dtype) +
           "; the MoE kernels need bf16, fp16 or fp32 logits";
  }
  return "";
}

}  // namespace moejit::detail
