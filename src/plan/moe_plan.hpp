// The MoE layer's plan: which kernels moe_forward launches for T tokens (the one function the
// planner and the op share, so a prewarm builds exactly what a call looks up), the sizes that
// follow from it (workspace, launch geometry, shared memory), and the arch facts supports()
// checks. No CUDA headers: testable on a CPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "descriptor/descriptor.hpp"
#include "moejit/kernel_spec.hpp"
#include "moejit/moe.hpp"
#include "moejit/shape.hpp"
#include "plan/decode_plan.hpp"

namespace moejit::detail {

// ---- facts shared by supports(), codegen and the ops ------------------------------------------

// moe_gemm.cuh's MoeGemmTraits: threads per CTA and dynamic shared memory (kSmemBytes).
int marlin_moe_threads(const MarlinMoeParams& p);
// The M tiles (the GEMM grid's x) of a matrix of `m_atoms` 16-row atoms under p.block_m.
int marlin_moe_m_tiles(const MarlinMoeParams& p, int m_atoms);
long long marlin_moe_smem_bytes(const MarlinMoeParams& p);
// route.cuh's RouteTraits::kRankSharedBytes (static shared memory of the rank phase): counters,
// counts, block and group starts, the scan (64-bit at most) and its alignment (the group starts
// counted whether or not the route has them).
constexpr long long route_rank_shared_bytes(int num_experts, int block_threads) {
  const long long e = num_experts;
  const long long warps = block_threads / 32;
  return (warps * e * 2 + 3) / 4 * 4 + e * 4 + 2 * (e + 1) * 4 + warps * 8 + 8;
}
inline constexpr long long kRouteStaticSharedLimit = 48 * 1024;
// The most dynamic shared memory one CTA may opt into on `arch` (the CUDA programming guide's
// per-arch table; the op still learns the device's own limit when it sets the attribute).
long long max_dynamic_smem_bytes(const Arch& arch);
// "<arch> allows at most <max_dynamic_smem_bytes>", saying when the figure is assumed (an arch
// the table does not know gets the 48 KB every CUDA GPU allows).
std::string smem_limit_text(const Arch& arch);

// Experts of the rank that uniform top-k routing of `tokens` tokens touches, expected.
double expected_experts_touched(int experts, int top_k, int tokens);
double expected_experts_touched(const ModelShape& shape, int tokens);
// The SMs of the GPU the tile rules were measured on (an H200). Rules that count CTAs or waves
// count them against it, not against the device at hand, so a plan is a function of the shape
// and T alone and a prewarm on any machine builds what a call will look up.
inline constexpr int kPlannedSms = 132;

// The most K splits of FC2 (MarlinMoeParams::k_splits; kern::moe::kMaxKSplits).
inline constexpr int kMaxKSplits = 8;

// marlin_moe's warpgroup main loop (MarlinMoeParams::wgmma_n) runs on `arch`: sm_90a only.
bool wgmma_runs_on(const Arch& arch);

// ---- the choice per T ---------------------------------------------------------------------------

// Everything moe_forward may launch for one token count T >= 1. An automatic call launches
// decode_moe's kernels (decode_first -> decode_second [-> decode_combine for the persistent tile])
// when decode_by_default(config) and decode_moe runs on the device's arch; otherwise, and
// whenever the marlin path is forced, [narrow_ids] -> route (single, or rank + scan + scatter) ->
// FC1 -> FC2 -> combine. The marlin fields are always filled.
struct MoeForwardConfig {
  int tokens = 0;
  bool decode = false;  // T <= 256 and decode_moe serves the shape at the planner's tile
  // The launches: the persistent tile (kReset -> kMain -> kCombine), or where decode_pair the
  // two-launch tile (kPairFc1 -> kPairFc2, no decode_combine). Valid when decode.
  bool decode_pair = false;
  MoeDecodeParams decode_first;
  MoeDecodeParams decode_second;
  MoeDecodeParams decode_combine;
  bool narrow_ids = false;       // int64 ids: one narrowing launch first
  NarrowIdsParams narrow;
  bool route_single = true;  // N = T * K <= route.chunk_rows: one route launch
  MoeRouteParams route;      // kernel = kSingle, or kRank (scan and scatter share the rest)
  MarlinMoeParams fc1;  // the mma.sync main loop (any arch)
  MarlinMoeParams fc2;
  // The tile has an sm_90a warpgroup variant (same route block, so the same route and
  // workspace; bf16 FC2 rows like the mma.sync tile's): on such devices FC1 runs fc1_wgmma
  // instead, and FC2 and combine run fc2_wgmma and combine_wgmma unless fc2_short_k.
  bool wgmma = false;
  // FC2 takes its short-K tile (I <= 768, moe_plan.cpp's kFc2ShortKTiles), and keeps it where FC1
  // runs the warpgroup tile: on the H200 (tools/PERF_LOG.md "FC2's short-K tile against the
  // warpgroup tile") deepseek-v4-flash-tp4 T = 512 (12 rows per expert, when the warpgroup tile
  // took it), FC2 109.7 against 115.9 us, layer 314.4 against 323.5.
  bool fc2_short_k = false;
  MarlinMoeParams fc1_wgmma;
  MarlinMoeParams fc2_wgmma;
  MoeCombineParams combine;
  MoeCombineParams combine_wgmma;  // combine reading fc2_wgmma's rows
};

// The config for `tokens` (1 <= tokens) of `shape`. Pure arithmetic on the shape's sizes, no
// allocation; the op calls it on every forward, the planner at the end of every run of T with
// one config.
MoeForwardConfig choose_moe_config(const ModelShape& shape, int tokens);

// Whether MoePath::kAuto takes the decode path for this config: where the planner chose the
// two-launch pair for T <= kDecodeAutoMaxTokens. Why not the persistent tile where the pair's
// rules refuse the shape: on the H200 (tools/PERF_LOG.md "the eight public shapes on both
// paths") it took 1.14-1.59x marlin_moe's time at T = 1 on every shape it served there
// (mixtral-8x7b 107.1 against 67.4 us, deepseek-v3 65.0 against 56.4, qwen3-235b-a22b 33.1
// against 29.0, llama-4-scout 60.4 against 47.9, phi-3.5-moe 44.9 against 34.2), while the pair
// took 0.85-0.93x on the seven shapes it served.
inline bool decode_by_default(const MoeForwardConfig& config) {
  return config.decode && config.decode_pair && config.tokens <= kDecodeAutoMaxTokens;
}

// The path moe_forward takes for `config` on `arch` under `options`:
// - kPair: decode_moe's two-launch tile (config.decode_first, then config.decode_second), for
//   kAuto where decode_by_default(config) and for kDecode where the planner chose the pair, both
//   without a forced block_n and where both kernels run on `arch`;
// - kPersistent: the persistent tile `decode` (reset -> main -> combine), for kDecode, and for
//   kAuto at the pair's T with a forced block_n, which asks for the persistent tile at that
//   block_n; only where a pipeline depth fits that tile (stages != 0) and it runs on `arch`;
// - kMarlin otherwise. For kDecode that is a refusal the op names: `decode` is then the tile
//   that can't run (its stages or `arch`), or unset where the planner chose none (config.decode
//   is false: T > 256).
// Pure arithmetic; the op asks it on every forward.
enum class ForwardPath { kPair, kPersistent, kMarlin };
struct ForwardChoice {
  ForwardPath path = ForwardPath::kMarlin;
  MoeDecodeParams decode;
};
ForwardChoice choose_forward_path(const ModelShape& shape, const MoeForwardConfig& config,
                                  const MoeForwardOptions& options, const Arch& arch);

// The kernels of one config for `arch`, by role. Filled without allocating (the op builds it on
// every forward).
struct MoeForwardSpecs {
  // config.decode and decode_moe runs on `arch` (decode_moe_runs_on): an automatic call launches
  // decode_first, decode_second and (the persistent tile) decode_combine, and nothing else. The
  // marlin chain below is always filled.
  bool decode = false;
  KernelSpec decode_first;
  KernelSpec decode_second;
  bool decode_has_combine = false;
  KernelSpec decode_combine;
  bool has_narrow = false;
  KernelSpec narrow;
  int route_count = 0;  // 1 (single) or 3 (rank, scan, scatter)
  KernelSpec route[3];
  MarlinMoeParams fc1_params;  // config.fc1, or config.fc1_wgmma where wgmma runs on `arch`
  MarlinMoeParams fc2_params;
  // FC2 waits for FC1 per tile (kernels/moe/params.cuh MoeGemmChain) instead of per grid: where
  // both GEMMs take the same tiles (both warpgroup GEMMs, or both mma.sync GEMMs of one block).
  bool gemm_chain = false;
  KernelSpec fc1;
  KernelSpec fc2;
  KernelSpec combine;
};
MoeForwardSpecs moe_forward_specs(const MoeForwardConfig& config, const Arch& arch);

// The kernels of each path, in launch order: decode_moe's (empty unless s.decode), and the marlin
// chain (narrow_ids where the ids are int64, the route, FC1, FC2, combine).
std::vector<KernelSpec> decode_chain(const MoeForwardSpecs& s);
std::vector<KernelSpec> marlin_chain(const MoeForwardSpecs& s);

// Every kernel a call with this config may launch on `arch` (the decode pair when
// MoeForwardSpecs::decode, then the marlin chain, which a call can force), each path in launch
// order. What the planner lists for the config.
std::vector<KernelSpec> moe_config_specs(const MoeForwardConfig& config, const Arch& arch);

// The largest T of each run of T in [1, max_tokens] over which choose_moe_config is constant,
// ascending; the last is max_tokens. Empty when max_tokens < 1.
std::vector<int> moe_config_segment_ends(const ModelShape& shape, int max_tokens);

// The two repack kernels (FC1 gate/up fused, FC2 plain), shared by every shape and layout.
MoeRepackParams moe_repack_params(bool gate_up);

// ---- sizes --------------------------------------------------------------------------------------

// Byte offsets inside the workspace for one config (every region 256-byte aligned).
struct MoeWorkspaceLayout {
  // route arrays (route_params.cuh's RouteWorkspaceLayout, offsets from 0)
  std::size_t expert_counts = 0;
  std::size_t expert_block_offset = 0;
  std::size_t sorted_rows = 0;
  std::size_t block_expert = 0;
  std::size_t slot_row = 0;
  std::size_t total_blocks = 0;
  std::size_t chunk_base = 0;
  std::size_t expert_group_offset = 0;  // with config.route.group_rows only (else empty)
  std::size_t group_tiles = 0;
  std::size_t tile_done = 0;     // [max_blocks] u32: the GEMMs' per-tile counters (route zeroes)
  std::size_t ids32 = 0;         // narrowed ids [T * K] int32 (only with narrow_ids)
  std::size_t inter = 0;         // FC1 output, bf16 [padded rows, I]
  std::size_t out2 = 0;          // FC2 output, [padded rows, H] in fc2.out_dtype
  std::size_t marlin_bytes = 0;  // end of the marlin chain's regions
  std::size_t decode_bytes = 0;  // config.decode: decode_moe's Geometry::workspace_bytes(), else 0
  std::size_t bytes = 0;         // max(marlin_bytes, decode_bytes): enough for either path
  long long max_blocks = 0;      // route blocks provisioned: the mma.sync GEMMs' grid.y x grid.z
  long long padded_rows = 0;     // max_blocks * block
  long long max_groups = 0;      // groups provisioned: the warpgroup GEMMs' grid.y x grid.z
};

// Rows of one of FC2's K-split row sets (MarlinMoeParams::k_splits; the kernels' p.blocks x their
// kBlockN): the route's padded rows for the mma.sync tile, its groups x wgmma_n for the warpgroup
// tile. Combine steps from set to set by this many rows.
long long fc2_set_rows(const MarlinMoeParams& fc2, const MoeWorkspaceLayout& layout);
// The workspace regions of one config (route arrays, FC1's rows, FC2's row sets).
MoeWorkspaceLayout moe_workspace_layout(const ModelShape& shape, const MoeForwardConfig& config);

// max over T in [1, max_tokens] of moe_workspace_layout(...).bytes, and of the decode workspace
// of both block_n values for every T in [1, min(256, max_tokens)] that decode_moe serves (so a
// forced block_n fits too); 0 when max_tokens is 0.
std::size_t moe_workspace_bytes_for(const ModelShape& shape, int max_tokens);

// Repacked weight sizes (layout.cuh), in bytes.
struct MoeWeightSizes {
  std::size_t w13 = 0, w13_scales = 0, w2 = 0, w2_scales = 0, b13 = 0, b2 = 0;
  int fc1_m_atoms = 0, fc1_k_atoms = 0, fc2_m_atoms = 0, fc2_k_atoms = 0;
};
MoeWeightSizes moe_weight_sizes(const ModelShape& shape);

// FC1's L2 prefetch before its grid wait (MoeGemmParams::prefetch_*; moe_gemm.cuh's
// prefetch_first_weights) for `fc1` (config.fc1, or config.fc1_wgmma where that runs) over the
// repacked `sizes` (moe_weight_sizes(shape), which the op already holds) at T = config.tokens,
// FC1's grid tiles (route blocks, or groups for the warpgroup tile) = max_blocks, on a device
// of `sms` SMs and arch `arch`; all 0 = none. On sm_90
// or newer where uniform routing is expected to leave at most kFc1PrefetchMaxUntouched of the
// local experts untouched: every M tile of the blocks the first wave serves (the grid runs M
// tiles fastest, so those are the first ceil(sms x min_blocks_per_sm / m_tiles) blocks), block b
// asking for expert b (experts at most E and max_blocks), and as many whole K atoms per strip as
// make kFc1PrefetchBytes in all. Measured on the H200 (tools/PERF_LOG.md, "FC1's
// first weights asked of L2 during the route"): -0.3 to -1.8% a layer at T = 24-1024; 8 or 32 MB
// did no better than 16, and 0.25 untouched left out rows that 0.7 gains on.
struct GemmPrefetch {
  int experts = 0;
  int m_tiles = 0;
  int k_atoms = 0;
};
inline constexpr double kFc1PrefetchMaxUntouched = 0.7;
inline constexpr long long kFc1PrefetchBytes = 16ll << 20;
GemmPrefetch fc1_prefetch(const ModelShape& shape, const MoeForwardConfig& config,
                          const MarlinMoeParams& fc1, const MoeWeightSizes& sizes,
                          long long max_blocks, int sms, const Arch& arch);

// Why an activation's kind or constants can't be a kernel's template arguments, or "".
std::string activation_problem(const Activation& activation);

// The first reason the op can't serve `shape` (sizes the kernels' arguments can't hold, more
// local experts than the route serves, activation constants the kernels can't take), or "".
// Kernel-level reasons come from supports() on the planned specs.
std::string moe_shape_problem(const ModelShape& shape);

}  // namespace moejit::detail
